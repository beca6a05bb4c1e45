"""A running `omni-serving up`, found from another process; `omni-serving restart materializer`.

- Discovery: a live launcher is recorded in its runtime directory's `owner`
  file (omni_stack.runtime); `find_running_stacks` looks in the directories
  `up` creates (`omni-serving-*` in `runtime_parents()`), and a stack started
  with `--runtime-dir` is found by that directory.
- `run_restart_materializer` sends the launcher SIGHUP and follows the
  rolling restart in the directory's status record until it is done.

Invariant: a record counts only while its process is the same one that
wrote it (pid and start time), not a later process that got its pid.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from omni_stack.errors import StackError
from omni_stack.processes import alive
from omni_stack.rolling import ROLLING_STATUS_FILE
from omni_stack.runtime import OWNER_FILE, RUNTIME_DIR_PREFIX, read_record, runtime_parents


@dataclass
class RunningStack:
    """A live `omni-serving up`, as its runtime directory's owner record tells."""

    runtime: Path
    pid: int
    deployment: str


def _owner_of(directory: Path) -> RunningStack | None:
    """The live launcher recorded in `directory`/owner, or None."""
    try:
        fd = os.open(directory / OWNER_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        record = read_record(fd)
    finally:
        os.close(fd)
    if record is None:
        return None
    try:
        proc = psutil.Process(record["pid"])
        # The same process, not a later one that got its pid.
        if abs(proc.create_time() - float(record.get("start_time", 0))) > 0.5 or not alive(proc):
            return None
    except (psutil.Error, TypeError, ValueError):
        return None
    return RunningStack(directory.absolute(), record["pid"], str(record.get("deployment", "")))


def find_running_stacks() -> list[RunningStack]:
    """The live `up` launchers whose runtime directory `up` created (omni-serving-* in
    runtime_parents()); a stack started with --runtime-dir is found by that directory."""
    found = []
    for parent in runtime_parents():
        for directory in sorted(parent.glob(RUNTIME_DIR_PREFIX + "*")):
            with contextlib.suppress(OSError):
                if directory.is_dir() and directory.stat().st_uid == os.getuid():
                    owner = _owner_of(directory)
                    if owner is not None:
                        found.append(owner)
    return found


def find_running_stack(deployment: str = "", runtime_dir: str = "") -> RunningStack:
    """The one live `up` named by deployment or runtime directory (or the only one)."""
    if runtime_dir:
        owner = _owner_of(Path(runtime_dir))
        if owner is None:
            raise StackError(
                f"--runtime-dir: no running `omni-serving up` owns {runtime_dir} "
                f"(no {OWNER_FILE} record of a live launcher there)"
            )
        if deployment and owner.deployment != deployment:
            raise StackError(
                f"--deployment: the stack in {runtime_dir} is deployment {owner.deployment!r}, "
                f"not {deployment!r}"
            )
        return owner
    stacks = find_running_stacks()
    if deployment:
        stacks = [s for s in stacks if s.deployment == deployment]
        if not stacks:
            raise StackError(
                f"--deployment: no running `omni-serving up` of deployment {deployment!r} "
                f"found in {', '.join(map(str, runtime_parents()))} (a stack started with "
                f"--runtime-dir is found with --runtime-dir)"
            )
    if not stacks:
        raise StackError("no running `omni-serving up` found; name one with --runtime-dir")
    if len(stacks) > 1:
        listed = ", ".join(f"{s.deployment} (pid {s.pid}, {s.runtime})" for s in stacks)
        raise StackError(f"several stacks run ({listed}); choose one with --deployment")
    return stacks[0]


def read_rolling_status(runtime: Path) -> dict[str, Any] | None:
    try:
        record = json.loads((runtime / ROLLING_STATUS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def run_restart_materializer(
    deployment: str = "", runtime_dir: str = "", timeout_s: float = 300.0, out=None
) -> int:
    """Ask a running `up` for a rolling restart of its materializers (SIGHUP),
    then follow it in the runtime directory's status record until it is done.

    Exit status: 0 done, 1 failed or not done within timeout_s, 2 no such stack.
    """
    out = out or sys.stdout
    try:
        stack = find_running_stack(deployment, runtime_dir)
    except StackError as exc:
        print(f"omni-serving restart: error: {exc}", file=sys.stderr)
        return 2
    before = read_rolling_status(stack.runtime)
    last_id = before["id"] if before and isinstance(before.get("id"), int) else 0
    os.kill(stack.pid, signal.SIGHUP)
    print(
        f"asked `omni-serving up` (pid {stack.pid}, deployment {stack.deployment}, "
        f"runtime dir {stack.runtime}) for a rolling restart of its materializers",
        file=out,
        flush=True,
    )
    if timeout_s <= 0:
        return 0
    deadline = time.monotonic() + timeout_s
    shown = 0
    while time.monotonic() < deadline:
        record = read_rolling_status(stack.runtime)
        if record is not None and isinstance(record.get("id"), int) and record["id"] > last_id:
            steps = record.get("steps") or []
            for step in steps[shown:]:
                print(f"  {step}", file=out, flush=True)
            shown = len(steps)
            if record.get("state") == "done":
                return 0
            if record.get("state") == "failed":
                print("omni-serving restart: the rolling restart failed", file=sys.stderr)
                return 1
        if _owner_of(stack.runtime) is None:
            print("omni-serving restart: error: the stack stopped meanwhile", file=sys.stderr)
            return 1
        time.sleep(0.1)
    print(
        f"omni-serving restart: not done after {timeout_s:g}s; `up`'s log has the rest",
        file=sys.stderr,
    )
    return 1
