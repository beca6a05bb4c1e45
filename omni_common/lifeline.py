"""A service started by `omni-serving up` dies with its launcher: both sides of that contract.

The launcher (omni_stack) holds live gRPC channels while it starts and
restarts services. A real `fork()` in such a process runs gRPC's fork
handlers, which can block the launcher for good; so it starts services with
nothing that forces CPython to fork (no `preexec_fn`, no user or group
change): CPython then spawns with vfork(), which runs no fork handler. What
a `preexec_fn` used to do in the child, the child now does itself:

- the launcher puts its pid in the child's environment (`launcher_environment`);
- the service calls `die_with_launcher()` first thing (`setup_logging`, the
  first call of every service's `main()`, calls it), which
  1. removes the variable from its environment, so what the service starts
     (stage processes, code2wav and vLLM workers) does not inherit it;
  2. asks the kernel for `PARENT_DEATH_SIGNAL` when its parent dies
     (`PR_SET_PDEATHSIG`), SIGKILL of the launcher included; its handler
     turns the first one into one SIGTERM to the service (`DEATH_SIGNAL`),
     the service's orderly shutdown, and ignores the signal from then on;
  3. if its parent is already not the launcher (it died between the spawn and
     step 2, e.g. while the service imported its modules), sends itself
     SIGTERM at once, as the kernel would have.

Why not SIGTERM from the kernel directly: a kernel may deliver the
parent-death signal more than once (gVisor does, a copy arriving up to a
tenth of a second after the first), and a second SIGTERM ends a service
whose shutdown has begun at once, leaving its shared memory behind (the
services restore SIGTERM's default action once they are stopping; the
materializer takes a second signal as "stop now").

Invariants: the service gets exactly one SIGTERM when its launcher dies; it
arrives once the main thread runs Python again (a service's main thread
waits in its event loop). Without the variable (compose, Kubernetes, a
service run by hand, a test calling a `main()` in-process) nothing happens.
The kernel sends the signal when the launcher *thread* that started the
service ends: a launcher drives its stack from one long-lived thread. Linux
only; on other systems the calls do nothing.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Any

LAUNCHER_PID_ENV = "OMNI_LAUNCHER_PID"
"""The launcher's pid, in the environment of a service it starts."""

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
DEATH_SIGNAL = signal.SIGTERM
"""What a service gets, once, when its launcher dies: its orderly shutdown."""
PARENT_DEATH_SIGNAL = signal.SIGRTMIN + 1
"""What the kernel sends (a real-time signal nobody else uses here); see the module docstring."""

_dying = False


def _load_libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_LIBC = _load_libc()


def prctl(option: int, value: int) -> bool:
    """Linux prctl(option, value); False where it is unavailable or fails."""
    call = getattr(_LIBC, "prctl", None)
    return call is not None and call(option, value, 0, 0, 0) == 0


def launcher_environment(launcher_pid: int | None = None) -> dict[str, str]:
    """Variables the launcher adds to a service's environment (launcher_pid: default, us)."""
    return {LAUNCHER_PID_ENV: str(os.getpid() if launcher_pid is None else launcher_pid)}


def die_with_launcher() -> bool:
    """Arm the parent-death signal if a launcher started us (see the module
    docstring); True when armed. Call it first thing, from the main thread."""
    value = os.environ.pop(LAUNCHER_PID_ENV, None)
    if value is None:
        return False
    try:
        launcher_pid = int(value)
    except ValueError:
        print(
            f"warning: {LAUNCHER_PID_ENV}={value!r} is not a pid; not following a launcher",
            file=sys.stderr,
        )
        return False
    signal.signal(PARENT_DEATH_SIGNAL, _on_parent_death)
    armed = prctl(PR_SET_PDEATHSIG, int(PARENT_DEATH_SIGNAL))
    if os.getppid() != launcher_pid:  # the launcher died before the prctl
        os.kill(os.getpid(), DEATH_SIGNAL)
        os._exit(128 + int(DEATH_SIGNAL))  # only if a handler caught the signal
    return armed


def _on_parent_death(signum: int, frame: object) -> None:
    """The launcher died: one SIGTERM to ourselves, whatever the kernel sends more.

    Later copies are ignored by the kernel from here on, even once the
    interpreter is finalizing (it resets the signals it handles to their
    default action, which for this one is to end the process, but leaves
    ignored ones as they are).
    """
    global _dying
    signal.signal(PARENT_DEATH_SIGNAL, signal.SIG_IGN)
    if not _dying:
        _dying = True
        os.kill(os.getpid(), DEATH_SIGNAL)


__all__ = [
    "DEATH_SIGNAL",
    "LAUNCHER_PID_ENV",
    "PARENT_DEATH_SIGNAL",
    "PR_SET_CHILD_SUBREAPER",
    "PR_SET_PDEATHSIG",
    "die_with_launcher",
    "launcher_environment",
    "prctl",
]
