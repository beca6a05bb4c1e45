"""`omni-serving up` supervises: a crashed service comes back, the others keep serving.

Real processes with the fake engine. Each service in turn is SIGKILLed (its
main process only, the way the OOM killer or a segfault ends it); `up` must
keep running, restart it after the backoff, and a Speak must succeed again.
A decoder stopped with SIGSTOP (alive, answering nothing) is killed and
restarted once its liveness check has gone unanswered for
--liveness-unanswered-s (the log says how long), and a Speak succeeds
afterwards.
The shutdown tests stop `up` with SIGTERM in the awkward states (a service
waiting for its restart, one starting again, a Speak in flight) and check
that it exits 0 within --stop-timeout and leaves nothing behind.

The measured times are printed (`pytest -s`); the bounds asserted are
generous because this machine is shared.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import grpc
import psutil
import pytest

from decoder_svc.testing.fake_engine import FAKE_SLOW_MARKER
from omni_stack.config import StackConfig
from omni_stack.stack import Stack
from tests.speech_helpers import check_chunks, speak_chunks
from tests.test_up import Up, _alive, check_running, check_stopped, speak_and_check

pytestmark = pytest.mark.e2e

MODULES = {"materializer": "materializer_svc", "decoder": "decoder_svc", "gateway": "gateway"}
# The gateway's reconnect to a restarted decoder is the gateway's own; this
# is the bound the stack promises end to end, from the kill to a served Speak.
SERVE_AGAIN_S = {"materializer": 30.0, "decoder": 40.0, "gateway": 40.0}


@pytest.fixture
def up_factory(tmp_path):
    """`omni-serving up` subprocesses (tests/test_up.py's Up), cleaned up after the test."""
    started: list[Up] = []

    def start(*args: str) -> Up:
        home = tmp_path / f"up{len(started)}"
        home.mkdir()
        up = Up(home, *args)
        started.append(up)
        return up

    yield start
    for up in started:
        up.cleanup()


def service_process(up, name: str) -> psutil.Process | None:
    """The live main process of service `name` under `up`."""
    for p in psutil.Process(up.proc.pid).children():
        try:
            if p.cmdline()[1:3] == ["-m", MODULES[name]] and _alive(p):
                return p
        except psutil.Error:
            continue
    return None


def wait_for_log(up, needle: str, count: int = 1, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while up.errors().count(needle) < count:
        if up.proc.poll() is not None:
            pytest.fail(
                f"`up` exited with {up.proc.returncode} waiting for {needle!r}:\n"
                f"{up.errors()[-4000:]}"
            )
        if time.monotonic() > deadline:
            pytest.fail(
                f"no {needle!r} (x{count}) from `up` within {timeout_s}s:\n{up.errors()[-4000:]}"
            )
        time.sleep(0.05)


def speak_until_served(up, timeout_s: float, text: str = "back again") -> float:
    """Speak until one succeeds; return when it did (time.monotonic())."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            check_chunks(speak_chunks(up.endpoints["gateway gRPC"], text, 3))
            return time.monotonic()
        except grpc.RpcError as exc:
            last = exc
            time.sleep(0.1)
    pytest.fail(f"no Speak served within {timeout_s}s (last: {last}):\n{up.errors()[-3000:]}")


def in_flight_speak(
    up, repeat: int = 150, max_audio_seconds: float = 0.0
) -> tuple[threading.Thread, list[object]]:
    """A Speak of a few seconds, running once this returns: (its thread, [its outcome])
    where the outcome is the number of chunks (PCM checked) or the gRPC status code.
    Its text slows the fake talker's steps (FAKE_SLOW_MARKER): 750 frames, the
    default cap, take about 4 s (at full speed the fake spoke them in 0.3 s)."""
    outcome: list[object] = []

    def run() -> None:
        try:
            text = FAKE_SLOW_MARKER + "many words " * repeat
            chunks = speak_chunks(up.endpoints["gateway gRPC"], text, 9, max_audio_seconds=max_audio_seconds)
            outcome.append(len(chunks) if check_chunks(chunks) else 0)
        except grpc.RpcError as exc:
            outcome.append(exc.code())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not _active_streams(up):
        assert time.monotonic() < deadline and thread.is_alive(), (
            f"the Speak never started: {outcome}"
        )
        time.sleep(0.02)
    return thread, outcome


def test_up_restarts_each_crashed_service_and_keeps_serving(up_factory):
    up = up_factory("--engine", "fake", "--stop-timeout", "20")
    up.wait_ready(120)
    tree = check_running(up)
    speak_and_check(up)
    first_arenas = up.segments()
    assert len(first_arenas) == 2, first_arenas  # the step arena and the code2wav frames' arena

    timings = {}
    outcomes = {}
    for name in ("materializer", "decoder", "gateway"):
        victim = service_process(up, name)
        assert victim is not None, f"no {name} process under `up`"
        stream, outcome = in_flight_speak(up)  # a request open while the service dies
        killed_at = time.monotonic()
        victim.send_signal(signal.SIGKILL)
        wait_for_log(up, f"{name} was killed by SIGKILL")
        wait_for_log(up, f"{name} is serving again")
        healthy_at = time.monotonic()
        served_at = speak_until_served(up, SERVE_AGAIN_S[name] - (healthy_at - killed_at))
        assert up.proc.poll() is None, f"`up` exited after the {name} crash:\n{up.errors()[-3000:]}"
        again = service_process(up, name)
        assert again is not None and again.pid != victim.pid, f"{name} was not restarted"
        timings[name] = (healthy_at - killed_at, served_at - killed_at)
        stream.join(60)
        assert outcome, f"the request in flight when the {name} died never ended"
        outcomes[name] = outcome[0]
        if name == "materializer":  # the decoder built its payloads itself meanwhile
            assert isinstance(outcome[0], int) and outcome[0] > 0, f"in-flight Speak: {outcome[0]}"
        if name == "decoder":
            arenas = up.segments()
            assert set(first_arenas).isdisjoint(arenas), "the killed decoder's arenas were not swept"
            assert len(arenas) == 2, f"two arenas expected, got {arenas}"
    for name, (healthy, served) in timings.items():
        print(
            f"\n{name}: SIGKILL -> healthy again {healthy:.1f}s, -> Speak served {served:.1f}s; "
            f"the Speak in flight: {outcomes[name]}"
        )

    stopping = time.monotonic()
    rc = up.stop("SIGTERM")
    print(f"stop after three restarts: {time.monotonic() - stopping:.1f}s")
    check_stopped(up, tree, rc)


def test_up_restarts_a_decoder_that_answers_nothing(up_factory):
    limit_s = 8.0
    up = up_factory("--engine", "fake", "--stop-timeout", "20", "--liveness-poll", "0.5",
                    "--liveness-unanswered-s", f"{limit_s:g}")
    up.wait_ready(120)
    speak_and_check(up)
    victim = service_process(up, "decoder")
    assert victim is not None, "no decoder process under `up`"
    assert "did not answer its" not in up.errors(), f"a healthy decoder was restarted:\n{up.errors()[-3000:]}"
    victim.send_signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    needle = f"decoder (pid {victim.pid}) did not answer its omni_serving.liveness check for "
    wait_for_log(up, needle)
    wait_for_log(up, "decoder did not answer for")
    detected_at = time.monotonic()
    silent = float(up.errors().split(needle, 1)[1].split("s", 1)[0])
    assert silent >= limit_s, f"killed after {silent}s without an answer, limit {limit_s}s"
    wait_for_log(up, "decoder is serving again")
    assert not _alive(victim), "the stopped decoder is still there after its restart"
    served_at = speak_until_served(up, SERVE_AGAIN_S["decoder"])
    again = service_process(up, "decoder")
    assert again is not None and again.pid != victim.pid, "the decoder was not restarted"
    print(f"\nSIGSTOP -> restarted {detected_at - stopped_at:.1f}s (silent {silent:.1f}s), "
          f"-> Speak served {served_at - stopped_at:.1f}s")
    rc = up.stop("SIGTERM")
    assert rc == 0, f"`up` stopped with {rc}:\n{up.errors()[-3000:]}"


def test_up_gives_up_when_restarts_are_off(up_factory):
    up = up_factory("--engine", "fake", "--max-restarts", "0")
    up.wait_ready(120)
    service_process(up, "materializer").send_signal(signal.SIGKILL)
    rc = up.proc.wait(60)
    assert rc == 1, up.errors()[-2000:]
    assert "materializer was killed by SIGKILL" in up.errors() and "restarts are off" in up.errors()
    assert not up.deployment_processes()
    assert up.segments() == []


def test_stack_backs_off_and_gives_up_on_a_service_that_keeps_failing(tmp_path):
    # In-process Stack: the materializer's command is swapped for one that
    # fails at once, so every restart fails; the delays double, then it gives up.
    log: list[str] = []
    cfg = StackConfig(
        engine="fake",
        port=0,
        http_port=0,
        log_level="WARNING",
        runtime_dir=str(tmp_path / "rt"),
        max_restarts=3,
        restart_backoff=0.2,
        restart_backoff_max=0.5,
    )
    stack = Stack(cfg, log=log.append)
    stack.start()
    try:
        mat = stack.service("materializer")
        assert mat is not None and mat.proc is not None
        mat.argv = [sys.executable, "-c", "raise SystemExit(3)"]
        mat.proc.send_signal(signal.SIGKILL)
        stop = threading.Event()
        timer = threading.Timer(60, stop.set)  # a safety net, not the expected path
        timer.start()
        started = time.monotonic()
        problem = stack.supervise(stop)
        timer.cancel()
        assert problem is not None, "supervise() should give up"
        assert (
            "materializer exited with code 3 while starting" in problem and "giving up" in problem
        ), problem
        assert time.monotonic() - started < 30
        delays = [
            line.split("restarting it in ")[1].split("s ")[0]
            for line in log
            if "restarting it in" in line
        ]
        assert delays == ["0.2", "0.4", "0.5"], f"{delays=} {log=}"
        # The decoder and the gateway kept serving meanwhile.
        check_chunks(speak_chunks(stack.gateway_target, "still here", 5))
    finally:
        assert stack.stop() == []
    assert not (tmp_path / "rt" / "tmp").exists()


# -- shutdown in awkward states ------------------------------------------------------------

STOP_TIMEOUT_S = 5.0
# SIGTERM to exit: the services within --stop-timeout, plus killing what is
# left, sweeping, and the launcher's own exit (slow on a loaded machine).
EXIT_MARGIN_S = 10.0


@pytest.mark.parametrize("state", ["waiting to restart", "restarting", "streaming"])
def test_sigterm_stops_everything_in_time(up_factory, state):
    args = ["--engine", "fake", "--stop-timeout", str(STOP_TIMEOUT_S)]
    if state == "waiting to restart":
        args += ["--restart-backoff", "60", "--restart-backoff-max", "60"]
    up = up_factory(*args)
    up.wait_ready(120)
    tree = check_running(up)
    stream_result: list[object] = []
    stream: threading.Thread | None = None

    if state in ("waiting to restart", "restarting"):
        service_process(up, "decoder").send_signal(signal.SIGKILL)
        if state == "waiting to restart":
            wait_for_log(up, "decoder was killed by SIGKILL after")
        else:  # SIGTERM while the new decoder is importing, before it is healthy
            wait_for_log(up, "restarting decoder (pid")
            assert "decoder is serving again" not in up.errors()
    else:  # ~4000 bytes of text, 300 s of audio slowed: a stream much longer than the stop timeout
        stream, stream_result = in_flight_speak(up, repeat=360, max_audio_seconds=300)

    stopping = time.monotonic()
    rc = up.stop("SIGTERM", timeout_s=STOP_TIMEOUT_S + EXIT_MARGIN_S + 30)
    took = time.monotonic() - stopping
    print(f"\n{state}: SIGTERM -> `up` exited in {took:.1f}s ({up.errors().splitlines()[-1]})")
    assert took < STOP_TIMEOUT_S + EXIT_MARGIN_S, (
        f"`up` took {took:.1f}s to stop:\n{up.errors()[-3000:]}"
    )
    check_stopped(up, tree, rc)
    if stream is not None:
        stream.join(30)
        assert stream_result, "the in-flight Speak never ended"
        print(f"in-flight Speak ended with: {stream_result[0]}")


def _active_streams(up) -> bool:
    from tests.test_up import _samples

    try:
        return _samples(up.endpoints["gateway metrics"]).get("omni_gateway_active_streams", 0) > 0
    except OSError:
        return False


def test_services_stop_when_the_launcher_is_killed(up_factory):
    # SIGKILL reaches only the launcher; its services get one SIGTERM (the
    # parent-death signal, omni_common.lifeline) and stop cleanly: no stack
    # left on its own, no arena (a second SIGTERM would cut a shutdown short).
    up = up_factory("--engine", "fake")
    up.wait_ready(120)
    tree = check_running(up)
    os.kill(up.proc.pid, signal.SIGKILL)
    up.proc.wait(10)
    gone, alive = psutil.wait_procs(tree, timeout=60)
    assert not [p for p in alive if _alive(p)], (
        f"left running: {[(p.pid, p.cmdline()) for p in alive]}"
    )
    deadline = time.monotonic() + 30
    while up.deployment_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not up.deployment_processes()
    assert up.segments() == [], "the decoder stopped cleanly: its arena should be gone"
