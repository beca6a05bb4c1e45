"""The launcher's runtime directory and what dead stacks leave on this host.

- A runtime directory holds the services' Unix sockets (mode 0700), their
  temporary files under `tmp/`, and `owner`: the record of the launcher that
  uses it (`RuntimeDirLock`).
- `owner` is flock-ed for as long as the launcher *or any service it
  started* lives (the services inherit the locked descriptor), so the kernel
  tells a live directory from one left by a killed launcher.
- Sweeps, before a stack starts: runtime directories (`omni-serving-*` in
  `runtime_parents()`) whose launcher and services are gone
  (`sweep_runtime_dirs`), and shared-memory arenas of any deployment whose
  owner is gone (`sweep_orphaned_segments`, omni_common.shm_arena).

Invariants: a directory the user named (`--runtime-dir`) is never removed
by a sweep, only its `owner` record and our files in it at stop; a directory
is only removed when its lock is free.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from omni_stack.errors import ConfigError

RUNTIME_DIR_PREFIX = "omni-serving-"
OWNER_FILE = "owner"  # in a runtime directory: who uses it; locked while they live
_OWNER_GRACE_S = 60.0  # an owner file without a record this old is debris


def runtime_parents() -> list[Path]:
    """Where `up` creates its runtime directories, first choice first (and sweeps them)."""
    parents = []
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg) and os.access(xdg, os.W_OK):
        parents.append(Path(xdg))
    tmp = Path(tempfile.gettempdir())
    if tmp not in parents:
        parents.append(tmp)
    return parents


def private_dir(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid():
        raise ConfigError(
            f"runtime_dir: {path} belongs to uid {st.st_uid}, not to us ({os.getuid()})"
        )
    os.chmod(path, 0o700)


def new_runtime_dir() -> Path:
    # mkdtemp: mode 0700
    return Path(tempfile.mkdtemp(prefix=RUNTIME_DIR_PREFIX, dir=runtime_parents()[0]))


def read_record(fd: int) -> dict[str, Any] | None:
    try:
        record = json.loads(os.pread(fd, 4096, 0) or b"null")
    except ValueError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("pid"), int) else None


class RuntimeDirLock:
    """A launcher's claim on its runtime directory.

    `owner` in the directory records the launcher (pid, process start time,
    deployment, whether it created the directory) and is flock-ed for as long
    as the launcher *or any service it started* lives: the services inherit
    the locked descriptor. The kernel drops the lock when the last of them
    exits, however it exits, so a later `up` can tell a live directory from
    one left by a killed launcher (sweep_runtime_dirs).
    """

    def __init__(self, directory: Path, *, created: bool, deployment: str) -> None:
        self.path = directory / OWNER_FILE
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            deadline = time.monotonic() + 1.0  # a sweeper holds it for a moment at most
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        other = read_record(fd) or {}
                        raise ConfigError(
                            f"runtime_dir: {directory} is in use by another `omni-serving up` "
                            f"(pid {other.get('pid', '?')}, "
                            f"deployment {other.get('deployment', '?')})"
                        ) from None
                    time.sleep(0.05)
            me = psutil.Process()
            record = {
                "pid": me.pid,
                "start_time": me.create_time(),
                "deployment": deployment,
                "created": created,
            }
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd

    def release(self, *, unlink: bool) -> None:
        if self.fd < 0:
            return
        if unlink:
            self.path.unlink(missing_ok=True)
        os.close(self.fd)
        self.fd = -1


def _stale_runtime_dir(directory: Path) -> str | None:
    """Why `directory` (an `up` runtime directory) is debris, or None to leave it."""
    try:
        fd = os.open(directory / OWNER_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None  # no record: an older launcher's, or one being set up now
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return None  # its launcher or one of its services is alive
        record = read_record(fd)
        if record is None:
            age = time.time() - os.fstat(fd).st_mtime
            return "unreadable owner record" if age > _OWNER_GRACE_S else None
        if not record.get("created"):
            return None  # a directory the user named: never removed
        return f"launcher pid {record['pid']} and its services are gone"
    finally:
        os.close(fd)


def sweep_runtime_dirs() -> list[str]:
    """Remove runtime directories (ours, `omni-serving-*` in runtime_parents())
    whose launcher and services are gone; return their paths."""
    removed = []
    for parent in runtime_parents():
        for directory in sorted(parent.glob(RUNTIME_DIR_PREFIX + "*")):
            try:
                st = os.lstat(directory)
            except OSError:
                continue
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                continue
            if _stale_runtime_dir(directory) is not None:
                shutil.rmtree(directory, ignore_errors=True)
                if not directory.exists():
                    removed.append(str(directory))
    return removed


# -- shared-memory segments ---------------------------------------------------------------


def list_segments(prefix: str) -> list[str]:
    from omni_common import shm_arena  # imports torch: only when a stack runs

    return shm_arena.list_segments(prefix)


def sweep_stale(prefix: str, creating_grace_s: float | None = None) -> list[str]:
    from omni_common import shm_arena

    return shm_arena.sweep_stale(prefix, creating_grace_s)


def sweep_orphaned_segments() -> list[str]:
    """Arena segments of any deployment on this host whose owner is gone."""
    from omni_common import shm_arena

    return shm_arena.sweep_orphans()


def deployment_segments(deployment: str) -> list[str]:
    """Every /dev/shm entry of the deployment (arenas and anything else named for it)."""
    from omni_common.shm_arena import SHM_DIR

    return sorted(p.name for p in SHM_DIR.glob(f"omni-{deployment}-*"))
