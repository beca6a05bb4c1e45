"""Linux process plumbing of the launcher: spawning services, process groups, psutil helpers.

- `spawn` starts a service in its own session (process group), so a
  terminal's Ctrl-C reaches only the launcher and everything the service
  starts (vLLM workers, pool workers, their children) can be found and
  stopped with it (`members`, `signal_group`).
- It spawns without anything that makes CPython `fork()`: no `preexec_fn`,
  no user or group change. CPython 3.11's `_posixsubprocess` then uses
  vfork(), which runs no fork handler; a real fork() in the launcher, which
  holds live gRPC channels, runs gRPC's fork handlers and can hang it for
  good. The parent-death signal a `preexec_fn` used to set, the service
  sets itself at its start (omni_common.lifeline), told the launcher's pid
  in its environment.
- `become_subreaper`: orphaned descendants of the services are re-parented
  to the launcher instead of init, so nothing a service started slips away
  unseen.

Invariants: `spawn` never passes `preexec_fn` (tests/test_spawn.py counts
the fork handlers run while services are started); a process counts as
gone once it is a zombie (`alive`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Sequence

import psutil

from omni_common.lifeline import PR_SET_CHILD_SUBREAPER, launcher_environment, prctl


def become_subreaper() -> bool:
    """Linux: orphaned descendants are re-parented to us instead of init, so
    nothing a service started can slip away unseen. Best effort."""
    return prctl(PR_SET_CHILD_SUBREAPER, 1)


def spawn(
    argv: Sequence[str], env: dict[str, str], pass_fds: Sequence[int] = ()
) -> subprocess.Popen:
    """Start a service: `env` is its whole environment (the launcher's pid is
    added for its parent-death signal), in a session of its own, with
    `pass_fds` inherited. No fork(): see the module docstring."""
    return subprocess.Popen(
        list(argv),
        env={**env, **launcher_environment()},
        start_new_session=True,
        pass_fds=tuple(pass_fds),
    )


def describe_exit(code: int) -> str:
    """`exited with code 3`, `was killed by SIGKILL`."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def wait_gone(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Wait until the processes have exited (zombies count as gone); return the rest."""
    deadline = time.monotonic() + timeout_s
    left = [p for p in procs if alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if alive(p)]
    return left


def signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def members(groups: dict[int, float | None]) -> list[psutil.Process]:
    """Live processes in the given process groups. A group given with a time
    (its leader gone then) counts only processes that started before it."""
    found = []
    for p in psutil.process_iter():
        with contextlib.suppress(OSError, psutil.Error):
            pgid = os.getpgid(p.pid)
            if pgid not in groups or not alive(p):
                continue
            gone = groups[pgid]
            if gone is None or p.create_time() <= gone:
                found.append(p)
    return found


def terminate_members(groups: dict[int, float | None]) -> None:
    """SIGTERM every live member of `groups` (see `members`)."""
    for p in members(groups):
        with contextlib.suppress(psutil.Error):
            p.terminate()


def process_name(proc: psutil.Process) -> str:
    try:
        return proc.name()
    except psutil.Error:
        return "?"
