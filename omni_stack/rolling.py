"""Rolling restart of the materializers: each replaced in turn, no request failed.

A rolling restart (SIGHUP to `up`, `omni-serving restart materializer`,
`Stack.rolling_restart`) hands each materializer over to a replacement, one
at a time (`_Handover`):

1. "starting": the replacement starts with `--take-over` on the same socket
   path; it binds a fresh socket and renames it over the path, so new
   connections reach it while the old process keeps those it accepted;
2. once the path names the replacement and it answers SERVING, the old one
   gets SIGTERM ("draining"): it finishes its steps and exits, within
   `drain_timeout` or it is killed;
3. the next materializer follows.

Each step is logged and written to the runtime directory's
`ROLLING_STATUS_FILE`, which `omni-serving restart` follows.

Invariants: at most one rolling restart runs and one more may wait; a
replacement that fails leaves the old process serving (or, when the path no
longer names it, stops it so supervision starts a fresh one on the path); the
stack's supervision advances a rolling restart (`RollingRestarts.advance`,
from `Stack.poll`), so it runs on the thread that drives the stack.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omni_common.net import dial_host, free_port, port_free
from omni_stack.commands import ServiceProcess, metrics_url
from omni_stack.config import StackConfig
from omni_stack.health import check_health
from omni_stack.processes import describe_exit, signal_group, terminate_members

ROLLING_STATUS_FILE = "rolling-restart.json"  # in the runtime dir: the last rolling restart


@dataclass
class _Handover:
    """One materializer of a rolling restart: its replacement starting on the
    same socket path (phase "starting"), then the old one stopping ("draining").

    The replacement runs with --take-over: it binds a fresh socket and renames
    it over the path, so new connections reach it while the old process keeps
    the connections it accepted; at exit the old one removes the path only if
    it is still its own socket (materializer_svc/server.py).
    """

    svc: ServiceProcess
    old: subprocess.Popen
    new: subprocess.Popen
    started: float  # time.monotonic() of the replacement's start
    deadline: float  # of the current phase
    old_socket: tuple[int, int] | None  # (st_dev, st_ino) of the path before the replacement
    metrics_url: str
    argv: list[str]  # the replacement's command line without --take-over (its metrics port)
    phase: str = "starting"
    sigterm_at: float = 0.0
    killed: bool = False


def _socket_identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def _with_metrics_port(argv: list[str], port: int) -> list[str]:
    out = list(argv)
    i = out.index("--metrics-port")
    out[i + 1] = str(port)
    return out


def _group_gone(svc: ServiceProcess, proc: subprocess.Popen) -> None:
    """`proc` (a leader of `svc`'s) has exited: what it started goes too."""
    svc.dead_groups[proc.pid] = time.time()
    terminate_members({proc.pid: svc.dead_groups[proc.pid]})


class RollingRestarts:
    """The rolling restarts of one stack's materializers (see the module docstring).

    `popen(svc, argv)` starts a process of `svc` the way the stack starts its
    services; `services_of(role)` lists the stack's services of a role.
    """

    def __init__(
        self,
        cfg: StackConfig,
        runtime: Path,
        *,
        log: Callable[[str], None],
        popen: Callable[[ServiceProcess, list[str]], subprocess.Popen],
        services_of: Callable[[str], list[ServiceProcess]],
    ) -> None:
        self.cfg = cfg
        self.runtime = runtime
        self._log = log
        self._popen = popen
        self._services_of = services_of
        self.stopped = False  # the stack is stopping: no more status records
        self._requested = False
        self._roll: dict[str, Any] | None = None  # the run in progress (its status record)
        self._queue: list[ServiceProcess] = []
        self.handover: _Handover | None = None
        self._count = 0
        self.last: dict[str, Any] | None = None  # the last finished run

    def request(self) -> None:
        """Ask for a rolling restart of every materializer (safe from a signal
        handler and other threads); `advance` carries it out. Asked while one
        runs, one more follows it."""
        self._requested = True  # a plain store: no lock in a signal handler

    @property
    def running(self) -> bool:
        return self._roll is not None

    @property
    def pending(self) -> bool:
        """One runs or one was asked for."""
        return self._requested or self._roll is not None

    def extra(self) -> list[tuple[ServiceProcess, subprocess.Popen]]:
        """The process of a rolling restart that is not its service's `proc`:
        the replacement while it starts, the old one while it drains."""
        h = self.handover
        if h is None:
            return []
        return [(h.svc, h.new if h.phase == "starting" else h.old)]

    def abandon(self) -> None:
        """The stack has stopped (both processes of a handover with it): the
        handover's groups count as gone, a run in progress as failed."""
        h, self.handover = self.handover, None
        if h is not None:
            for proc in (h.old, h.new):
                h.svc.dead_groups.setdefault(proc.pid, time.time())
        if self._roll is not None:
            self._roll["steps"].append("the stack stopped before it was done")
            self._roll.update(state="failed", finished=time.time())
            self.last, self._roll = self._roll, None

    def _roll_log(self, message: str) -> None:
        self._log(f"rolling restart: {message}")
        if self._roll is not None:
            self._roll["steps"].append(message)
            self._write_status()

    def _write_status(self) -> None:
        record = self._roll or self.last
        if record is None or self.stopped:
            return
        path = self.runtime / ROLLING_STATUS_FILE
        tmp = path.with_name(path.name + ".tmp")
        with contextlib.suppress(OSError):
            tmp.write_text(json.dumps(record) + "\n")
            os.replace(tmp, path)

    def advance(self) -> None:
        """One round: begin a requested run, step the handover in progress,
        begin the next one, finish the run when none is left."""
        if self._roll is None and self._requested:
            self._requested = False
            self._count += 1
            self._roll = {
                "id": self._count,
                "state": "running",
                "started": time.time(),
                "finished": None,
                "steps": [],
            }
            self._queue = list(self._services_of("materializer"))
            if self._queue:
                names = ", ".join(s.name for s in self._queue)
                self._roll_log(f"restarting {names} one at a time")
            else:
                self._roll_log("nothing to restart: this stack runs no materializer (--sync)")
        if self._roll is None:
            return
        if self.handover is not None:
            self._step_handover(self.handover)
        while self.handover is None and self._queue and self._roll is not None:
            self._begin_handover(self._queue.pop(0))
        if self.handover is None and not self._queue and self._roll is not None:
            self._finish_roll("done")

    def _finish_roll(self, state: str) -> None:
        assert self._roll is not None
        took = time.time() - self._roll["started"]
        self._roll_log(f"{state} in {took * 1e3:.0f} ms")
        self._roll.update(state=state, finished=time.time())
        self.last, self._roll = self._roll, None
        self._queue = []
        self._write_status()

    def _begin_handover(self, svc: ServiceProcess) -> None:
        old = svc.proc
        if svc.state != "running" or old is None or old.poll() is not None:
            self._roll_log(f"{svc.name}: skipped, it is not running (state {svc.state})")
            return
        path = svc.uds_path
        assert path is not None, "materializers listen on Unix sockets"
        old_socket = _socket_identity(path)
        argv, url = svc.argv, svc.base_metrics_url
        port = int(svc.argv[svc.argv.index("--metrics-port") + 1])
        host = dial_host(self.cfg.metrics_host)
        if port > 0 and not port_free(self.cfg.metrics_host, port):
            # The old one holds the configured port until it exits.
            port = free_port(host)
            argv = _with_metrics_port(svc.argv, port)
            url = metrics_url(self.cfg.metrics_host, port)
        now = time.monotonic()
        try:
            new = self._popen(svc, [*argv, "--take-over"])
        except OSError as exc:
            self._roll_log(f"{svc.name}: could not start a replacement: {exc}")
            self._finish_roll("failed")
            return
        self.handover = _Handover(
            svc, old, new, now, now + self.cfg.startup_timeout, old_socket, url, argv
        )
        moved = "" if url == svc.metrics_url else f", metrics at {url}"
        self._roll_log(
            f"{svc.name}: started replacement pid {new.pid} on {svc.target}{moved}; "
            f"old pid {old.pid} keeps serving its streams"
        )

    def _step_handover(self, h: _Handover) -> None:
        svc, now = h.svc, time.monotonic()
        if h.phase == "starting":
            code = h.new.poll()
            if code is not None:
                h.svc.dead_groups[h.new.pid] = time.time()
                self._abort_handover(h, f"replacement pid {h.new.pid} {describe_exit(code)}")
                return
            if h.old.poll() is not None:  # the old one died meanwhile: adopt the replacement
                _group_gone(svc, h.old)
                svc.proc, svc.state = h.new, "starting"
                svc.started_at, svc.start_deadline = h.started, h.deadline
                svc.metrics_url, svc.argv = h.metrics_url, h.argv
                self.handover = None
                self._roll_log(
                    f"{svc.name}: old pid {h.old.pid} {describe_exit(h.old.returncode)} "
                    f"before its replacement was healthy; pid {h.new.pid} takes over"
                )
                return
            # The path names the replacement once it has renamed its socket over it.
            taken = _socket_identity(svc.uds_path or "") not in (None, h.old_socket)
            if taken and check_health(self.cfg, svc, 0.2) is None:
                healthy = time.monotonic()
                svc.proc, svc.state = h.new, "running"
                svc.started_at, svc.healthy_at = h.started, healthy
                svc.metrics_url, svc.argv = h.metrics_url, h.argv
                h.old.send_signal(signal.SIGTERM)
                h.phase, h.sigterm_at = "draining", time.monotonic()
                h.deadline = h.sigterm_at + self.cfg.drain_timeout
                self._roll_log(
                    f"{svc.name}: replacement pid {h.new.pid} healthy "
                    f"{(healthy - h.started) * 1e3:.0f} ms after its start; "
                    f"SIGTERM to old pid {h.old.pid}"
                )
                return
            if now > h.deadline:
                signal_group(h.new.pid, signal.SIGKILL)
                h.new.wait()
                h.svc.dead_groups[h.new.pid] = time.time()
                self._abort_handover(
                    h,
                    f"replacement pid {h.new.pid} not healthy within "
                    f"{self.cfg.startup_timeout:g}s; killed",
                )
            return
        # draining: the old one finishes its steps and exits
        code = h.old.poll()
        if code is None:
            if now > h.deadline and not h.killed:
                h.killed = True
                self._roll_log(
                    f"{svc.name}: old pid {h.old.pid} did not exit within "
                    f"{self.cfg.drain_timeout:g}s of its SIGTERM; killing it"
                )
                signal_group(h.old.pid, signal.SIGKILL)
            return
        took = (time.monotonic() - h.sigterm_at) * 1e3
        # The old one has exited: its leftovers go, the socket path stays the replacement's.
        self.handover = None
        _group_gone(h.svc, h.old)
        how = "was killed" if h.killed else f"drained and {describe_exit(code)}"
        self._roll_log(f"{svc.name}: old pid {h.old.pid} {how} in {took:.0f} ms")

    def _abort_handover(self, h: _Handover, why: str) -> None:
        """The replacement failed: the old one keeps serving."""
        self.handover = None
        if _socket_identity(h.svc.uds_path or "") != h.old_socket:
            # The path names the dead replacement: nothing new can reach the old
            # one. Stop it (it drains); supervision then starts a fresh one on the path.
            h.old.send_signal(signal.SIGTERM)
            h.svc.stop_expected = True
            self._roll_log(
                f"{h.svc.name}: {why}; {h.svc.target} no longer names old pid {h.old.pid}: "
                "SIGTERM to it, supervision starts a fresh one (the decoder builds in-process "
                "meanwhile)"
            )
            self._finish_roll("failed")
            return
        self._roll_log(f"{h.svc.name}: {why}; old pid {h.old.pid} keeps serving")
        self._finish_roll("failed")
