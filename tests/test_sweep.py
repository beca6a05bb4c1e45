"""What dead stacks leave is swept by the next start, whatever their deployment name.

Arena segments record their owner (and hold its lock); `up` runtime
directories hold an `owner` record locked by the launcher and its services.
The next `up` removes segments and runtime directories whose owners are gone,
of any deployment (the default name, up<pid>, differs every launch), and
never touches a live stack's.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from omni_common import shm_arena
from omni_common.shm_arena import SHM_DIR, ShmArena, list_segments, segment_owner, sweep_orphans
from omni_stack import runtime
from omni_stack.errors import ConfigError
from omni_stack.runtime import RuntimeDirLock, sweep_runtime_dirs
from tests.speech_helpers import check_chunks, speak_chunks
from tests.test_up import Up, check_running, check_stopped

REPO = Path(__file__).resolve().parent.parent


# -- segments ------------------------------------------------------------------------------


@pytest.fixture
def prefixes():
    made = [f"omni-sw{os.getpid()}{secrets.token_hex(3)}{tag}" for tag in "abc"]
    yield made
    for prefix in made:  # never leave anything behind, even on failure
        for name in list_segments(prefix):
            (SHM_DIR / name).unlink(missing_ok=True)


def _owner_process(code: str) -> tuple[subprocess.Popen, str]:
    """A Python child that runs `code`, prints one line and waits; (process, that line)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line, f"child printed nothing (exit {proc.poll()})"
    return proc, line


def _kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    if proc.stdout:
        proc.stdout.close()


def _holder(prefix: str, exit_after_s: float) -> subprocess.Popen:
    """A child that creates an arena under `prefix` (holding its lock), then is
    SIGKILLed after `exit_after_s` (by a timer of its own: it cannot unlink)."""
    proc, line = _owner_process(f"""
        import os, signal, threading
        from omni_common.shm_arena import ShmArena
        arena = ShmArena({prefix!r}, 1, 4096)
        print(arena.name, flush=True)
        threading.Timer({exit_after_s!r}, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
        threading.Event().wait()
    """)
    assert list_segments(prefix) == [line], (list_segments(prefix), line)
    return proc


def test_stop_sweep_waits_for_a_lock_released_a_moment_later(prefixes):
    """`Stack.stop` sweeps once its services are gone; a process killed a
    moment before (not our child: not waited for) may still hold a lock."""
    from omni_stack.stack import sweep_until_gone

    proc = _holder(prefixes[0], 0.6)
    try:
        assert shm_arena.sweep_stale(prefixes[0], creating_grace_s=0) == [], (
            "a held lock must keep its segment"
        )
        t0 = time.monotonic()
        left = sweep_until_gone([prefixes[0]], wait_s=10.0)
        took = time.monotonic() - t0
        assert left == [] and list_segments(prefixes[0]) == [], f"left: {left}"
        assert took < 5.0, f"the sweep waited {took:.1f}s for a lock released after 0.6s"
    finally:
        _kill(proc)


def test_stop_sweep_reports_a_segment_whose_lock_outlives_the_wait(prefixes):
    from omni_stack.stack import sweep_until_gone

    proc = _holder(prefixes[0], 60.0)
    try:
        t0 = time.monotonic()
        left = sweep_until_gone([prefixes[0]], wait_s=0.3)
        took = time.monotonic() - t0
        assert left == list_segments(prefixes[0]) and len(left) == 1, f"left: {left}"
        assert took < 2.0, f"the bounded wait took {took:.1f}s"
    finally:
        _kill(proc)


def test_arena_header_records_its_owner(prefixes):
    with ShmArena(prefixes[0], 1, 4096) as arena:
        owner = segment_owner(arena.name)
        assert owner is not None and owner.pid == os.getpid(), f"{owner=}"
        assert owner.start_ticks == shm_arena.process_start_ticks(os.getpid())
        assert owner.alive()
        mode = (SHM_DIR / arena.name).stat().st_mode & 0o777
        assert mode == 0o600, oct(mode)


def test_sweep_orphans_takes_dead_owners_segments_of_any_deployment(prefixes, monkeypatch):
    live_prefix, dead_prefix, junk_prefix = prefixes
    live = ShmArena(live_prefix, 1, 4096)
    child, orphan = _owner_process(f"""
        import time
        from omni_common.shm_arena import ShmArena
        print(ShmArena({dead_prefix!r}, 1, 4096).name, flush=True)
        time.sleep(120)
    """)
    try:
        assert sweep_orphans().count(orphan) == 0, "a live owner's segment must not be swept"
        owner = segment_owner(orphan)
        assert owner is not None and owner.pid == child.pid and owner.alive()
    finally:
        _kill(child)
    assert segment_owner(orphan) is not None and not segment_owner(orphan).alive()
    # A file without a header yet: what a decoder has between creating its
    # segment and writing the header. Young, it stays.
    junk = SHM_DIR / f"{junk_prefix}-arena-1-00000000"
    junk.write_bytes(b"")
    try:
        removed = sweep_orphans()
        assert orphan in removed, f"{orphan} not swept: {removed}"
        assert live.name not in removed and (SHM_DIR / live.name).exists()
        assert junk.name not in removed and junk.exists(), "a segment being created was swept"
        assert shm_arena.sweep_stale(junk_prefix) == []
        # A launcher whose decoder has exited knows nobody is creating it.
        assert shm_arena.sweep_stale(junk_prefix, creating_grace_s=0) == [junk.name]
        junk.write_bytes(b"")
        monkeypatch.setattr(shm_arena, "CREATING_GRACE_S", 0.0)
        assert junk.name in sweep_orphans(), "header-less debris past the grace should go"
    finally:
        junk.unlink(missing_ok=True)
        live.close()
    assert list_segments(live_prefix) == [] and list_segments(dead_prefix) == []


# -- runtime directories -------------------------------------------------------------------------


@pytest.fixture
def runtime_parent(tmp_path, monkeypatch):
    """Runtime directories are made (and swept) under tmp_path only."""
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert runtime.runtime_parents() == [tmp_path]
    return tmp_path


def _locking_child(directory: Path, created: bool) -> subprocess.Popen:
    proc, line = _owner_process(f"""
        import time
        from pathlib import Path
        from omni_stack.runtime import RuntimeDirLock
        RuntimeDirLock(Path({str(directory)!r}), created={created!r}, deployment="sweeptest")
        print("locked", flush=True)
        time.sleep(120)
    """)
    assert line == "locked"
    return proc


def test_runtime_dirs_of_dead_launchers_are_swept_live_and_user_ones_kept(runtime_parent):
    dead, live, named, unrecorded = (
        runtime_parent / f"omni-serving-{tag}" for tag in ("dead", "live", "named", "unrecorded")
    )
    for d in (dead, live, named, unrecorded):
        d.mkdir(mode=0o700)
        (d / "tmp").mkdir()
    holder = _locking_child(live, created=True)
    try:
        for d, created in ((dead, True), (named, False)):
            _kill(_locking_child(d, created))
        removed = sweep_runtime_dirs()
        assert removed == [str(dead)], f"{removed=}"
        assert not dead.exists()
        assert live.exists(), "a live launcher's directory was swept"
        assert named.exists(), "a directory the user named (--runtime-dir) is never removed"
        assert unrecorded.exists(), "a directory without an owner record is not ours to judge"
        # And a second `up` cannot take a directory in use.
        with pytest.raises(
            ConfigError, match=f"in use by another `omni-serving up` \\(pid {holder.pid},"
        ):
            RuntimeDirLock(live, created=False, deployment="second")
    finally:
        _kill(holder)
    assert sweep_runtime_dirs() == [str(live)]


# -- end to end: the next `up` --------------------------------------------------------------------


def _start(tmp_path: Path, name: str, *args: str) -> Up:
    home = tmp_path / name
    home.mkdir()
    return Up(home, "--engine", "fake", *args)


@pytest.mark.e2e
def test_next_up_sweeps_a_killed_stack_of_another_name_and_spares_a_live_one(tmp_path):
    stacks: list[Up] = []
    try:
        live = _start(tmp_path, "live")
        stacks.append(live)
        live.wait_ready(120)
        live_tree = check_running(live)
        live_runtime = Path(live.endpoints["runtime dir"])

        # A stack with the default deployment name (up<pid>): its decoder and
        # then its launcher SIGKILLed. The launcher's other services stop on
        # their own (parent-death signal); the arena and runtime dir stay.
        dead = _start(
            tmp_path,
            "dead",
            "--deployment",
            "",
            "--restart-backoff",
            "60",
            "--restart-backoff-max",
            "60",
        )
        stacks.append(dead)
        dead.wait_ready(120)
        dead.deployment = re.search(r"\(deployment (\S+)\)", dead.output()).group(1)
        assert dead.deployment == f"up{dead.proc.pid}"
        dead_arenas = dead.segments()
        assert len(dead_arenas) == 2, dead_arenas  # the step arena and the code2wav frames' arena
        dead_runtime = Path(dead.endpoints["runtime dir"])
        dead_services = dead.tree()
        decoder = next(p for p in dead_services if p.cmdline()[1:3] == ["-m", "decoder_svc"])
        decoder.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 30
        while "decoder was killed by SIGKILL" not in dead.errors() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(dead.proc.pid, signal.SIGKILL)
        dead.proc.wait(10)
        _, alive = psutil.wait_procs(dead_services, timeout=60)
        assert not alive, f"services of the killed launcher still run: {[p.pid for p in alive]}"
        # What they left. (On a shared machine another stack starting meanwhile
        # sweeps it first: the check below then only finds it gone.)
        left_arena = dead.segments() == dead_arenas
        left_runtime = dead_runtime.is_dir()
        print(f"\nleft by the killed stack: arena {left_arena}, runtime dir {left_runtime}")

        nxt = _start(tmp_path, "next")
        stacks.append(nxt)
        nxt.wait_ready(120)
        assert dead.segments() == [], f"the next `up` left {dead.segments()}"
        assert not dead_runtime.exists(), "the next `up` left the dead launcher's runtime dir"
        if left_arena and left_runtime:
            assert all(a in nxt.errors() for a in dead_arenas) and str(dead_runtime) in nxt.errors(), nxt.errors()[
                -2000:
            ]

        assert live.segments(), "the live stack's arena was swept"
        assert live_runtime.is_dir() and (live_runtime / "decoder.sock").exists()
        check_chunks(speak_chunks(live.endpoints["gateway gRPC"], "still alive", 4))

        for up in (nxt, live):
            tree = live_tree if up is live else check_running(up)
            check_stopped(up, tree, up.stop("SIGTERM"))
    finally:
        for up in stacks:
            up.cleanup()
