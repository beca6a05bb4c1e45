"""omni_common.lifeline: a service dies with the launcher that started it.

Real processes: a small Python "launcher" starts a "service" through
omni_stack.processes.spawn (no fork: the service arms its own parent-death
signal), then the launcher dies. Both orders are checked: the launcher dies
after the service armed it (the kernel's signal becomes one SIGTERM, however
often it comes), and before (the service notices at its start and ends
itself). tests/test_supervision.py checks the same with the real services
under `omni-serving up`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil

from omni_common.lifeline import LAUNCHER_PID_ENV, PARENT_DEATH_SIGNAL, die_with_launcher
from omni_stack.processes import spawn

REPO = Path(__file__).resolve().parent.parent

# The service: reports, arms the lifeline, reports what it and a child of its
# own see, then waits to be ended.
SERVICE = textwrap.dedent(
    """
    import json, os, subprocess, sys, time
    from pathlib import Path
    out = Path(sys.argv[1])
    if sys.argv[2] == "late":  # start once the launcher is gone
        while os.getppid() == int(os.environ["OMNI_LAUNCHER_PID"]):
            time.sleep(0.01)
    out.with_suffix(".before").write_text(str(os.getpid()))
    from omni_common.lifeline import die_with_launcher
    armed = die_with_launcher()
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.environ.get('OMNI_LAUNCHER_PID', ''))"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    out.write_text(json.dumps({
        "armed": armed, "own": os.environ.get("OMNI_LAUNCHER_PID"), "child": child,
    }))
    time.sleep(120)
    """
)

# The launcher: starts the service the way `up` does, prints its pid, then
# waits to be killed ("early") or exits at once ("late").
LAUNCHER = textwrap.dedent(
    """
    import os, sys
    from omni_stack.processes import spawn
    out, when, code = sys.argv[1], sys.argv[2], sys.argv[3]
    proc = spawn([sys.executable, "-c", code, out, when], dict(os.environ))
    print(proc.pid, flush=True)
    if when == "late":
        os._exit(0)
    import time
    time.sleep(120)
    """
)


def _start(tmp_path: Path, when: str, service: str = SERVICE) -> tuple[subprocess.Popen, int, Path]:
    out = tmp_path / "service.json"
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(out), when, service],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    assert launcher.stdout is not None
    line = launcher.stdout.readline().strip()
    assert line.isdigit(), f"the launcher printed {line!r} (exit {launcher.poll()})"
    return launcher, int(line), out


def _gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.02)
    return False


def _wait_for(path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline, f"{path.name} not written within {timeout_s}s"
        time.sleep(0.02)


def _end(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_service_gets_sigterm_when_its_launcher_is_killed(tmp_path):
    launcher, service, out = _start(tmp_path, "early")
    try:
        _wait_for(out, 60)
        seen = json.loads(out.read_text())
        assert seen == {"armed": True, "own": None, "child": ""}, (
            f"the service should be armed and the variable gone from it and its child: {seen}"
        )
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(10)
        assert _gone(service, 20), "the service outlived its launcher's SIGKILL"
    finally:
        _end(service)
        launcher.kill()
        launcher.wait(10)
        launcher.stdout.close()


def test_service_whose_launcher_died_before_it_armed_ends_itself(tmp_path):
    launcher, service, out = _start(tmp_path, "late")
    try:
        launcher.wait(10)
        _wait_for(out.with_suffix(".before"), 60)
        assert _gone(service, 20), "the service went on though its launcher was already gone"
        assert not out.exists(), f"the service ran past die_with_launcher(): {out.read_text()}"
    finally:
        _end(service)
        launcher.stdout.close()


# A service whose SIGTERM handler counts: what the launcher's death delivers.
COUNTING_SERVICE = textwrap.dedent(
    """
    import os, signal, sys, time
    from pathlib import Path
    from omni_common.lifeline import PARENT_DEATH_SIGNAL, die_with_launcher
    out = Path(sys.argv[1])
    assert die_with_launcher()
    terms = []
    signal.signal(signal.SIGTERM, lambda s, f: terms.append(s))
    out.with_suffix(".ready").write_text(str(os.getpid()))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not (terms and out.with_suffix(".done").exists()):
        time.sleep(0.05)
    ignored = signal.getsignal(PARENT_DEATH_SIGNAL) == signal.SIG_IGN
    out.write_text(f"{len(terms)} {'ignored' if ignored else 'handled'}")
    """
)


def test_repeated_parent_death_signals_give_one_sigterm(tmp_path):
    # A kernel may deliver the parent-death signal more than once (gVisor
    # does); the service must still see one SIGTERM, not a second that would
    # end its shutdown half-way.
    launcher, service, out = _start(tmp_path, "early", COUNTING_SERVICE)
    try:
        _wait_for(out.with_suffix(".ready"), 60)
        for _ in range(3):
            os.kill(service, PARENT_DEATH_SIGNAL)
            time.sleep(0.1)
        launcher.send_signal(signal.SIGKILL)  # and the real one
        launcher.wait(10)
        time.sleep(0.5)
        out.with_suffix(".done").write_text("1")
        _wait_for(out, 30)
        got = out.read_text()
        assert got == "1 ignored", (
            f"got {got!r}: want one SIGTERM, and the parent-death signal ignored after the "
            "first (the interpreter's finalization would restore its default action: death)"
        )
    finally:
        _end(service)
        launcher.stdout.close()


def test_without_a_launcher_nothing_happens(monkeypatch, capsys):
    monkeypatch.delenv(LAUNCHER_PID_ENV, raising=False)
    assert die_with_launcher() is False, "armed without a launcher"
    monkeypatch.setenv(LAUNCHER_PID_ENV, "up-1")
    assert die_with_launcher() is False, "armed with a malformed pid"
    assert LAUNCHER_PID_ENV not in os.environ, "the variable should be consumed"
    err = capsys.readouterr().err
    assert LAUNCHER_PID_ENV in err and "'up-1'" in err, f"the warning should name it: {err!r}"


def test_spawn_tells_the_service_our_pid_and_keeps_it_from_us(tmp_path):
    seen = tmp_path / "seen"
    code = f"import os; open({str(seen)!r}, 'w').write(os.environ.get({LAUNCHER_PID_ENV!r}, '-'))"
    env = {**os.environ, LAUNCHER_PID_ENV: "1"}  # a stale value is overwritten
    proc = spawn([sys.executable, "-c", code], env)
    assert proc.wait(60) == 0, f"the child exited with {proc.returncode}"
    assert seen.read_text() == str(os.getpid()), f"the service was told {seen.read_text()!r}"
    assert env[LAUNCHER_PID_ENV] == "1", "spawn changed the caller's environment mapping"
    assert LAUNCHER_PID_ENV not in os.environ, "the launcher's own environment got the variable"
