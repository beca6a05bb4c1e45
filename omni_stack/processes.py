"""Linux process plumbing of the launcher: spawning services, process groups, psutil helpers.

- `spawn` starts a service in its own session (process group), so a
  terminal's Ctrl-C reaches only the launcher and everything the service
  starts (vLLM workers, pool workers, their children) can be found and
  stopped with it (`members`, `signal_group`).
- A service gets SIGTERM when the launcher dies, SIGKILL included
  (`_die_with_launcher`, the parent-death signal), so a killed launcher
  leaves no stack running on its own.
- `become_subreaper`: orphaned descendants of the services are re-parented
  to the launcher instead of init, so nothing a service started slips away
  unseen.

Invariant: a process counts as gone once it is a zombie (`alive`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import psutil

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _load_libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_LIBC = _load_libc()


def become_subreaper() -> bool:
    """Linux: orphaned descendants are re-parented to us instead of init, so
    nothing a service started can slip away unseen. Best effort."""
    try:
        return _LIBC is not None and _LIBC.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except AttributeError:
        return False


def _die_with_launcher(launcher_pid: int) -> Callable[[], None] | None:
    """A `preexec_fn` (Linux): the service gets SIGTERM when the launcher dies,
    SIGKILL included, so a killed launcher leaves no stack running on its own.

    The kernel sends it when the *thread* that started the service ends: a
    Stack is driven from one long-lived thread (run_up: the main thread).
    """
    prctl = getattr(_LIBC, "prctl", None)
    if prctl is None:
        return None
    sigterm = int(signal.SIGTERM)

    def preexec() -> None:  # runs in the child between fork and exec: keep it minimal
        prctl(_PR_SET_PDEATHSIG, sigterm, 0, 0, 0)
        if os.getppid() != launcher_pid:  # the launcher died before prctl
            os.kill(os.getpid(), sigterm)

    return preexec


def spawn(
    argv: Sequence[str], env: dict[str, str], pass_fds: Sequence[int] = ()
) -> subprocess.Popen:
    """Start a service: `env` is its whole environment, in a session of its
    own, with `pass_fds` inherited, dying with the launcher."""
    return subprocess.Popen(
        list(argv),
        env=env,
        start_new_session=True,
        pass_fds=tuple(pass_fds),
        preexec_fn=_die_with_launcher(os.getpid()),
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
