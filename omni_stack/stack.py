"""`Stack`: materializer, decoder and gateway as processes, started, supervised and stopped.

- Sockets live in a private runtime directory (mode 0700) that the stack
  claims with a lock (omni_stack.runtime).
- Each service runs in its own session (process group), started without a
  fork() (omni_stack.processes), so a terminal's Ctrl-C reaches only the
  launcher, and everything a service started can be found and stopped with it.
- `start` sweeps what dead stacks left on this host, whatever their
  deployment name, then starts the services in order, each once the previous
  ones answer SERVING (generously: the vLLM engine creates its tiny models on
  first run), except the gateway: it starts beside its decoders (importing
  it takes seconds) and serves once one of them is healthy.
- `supervise` / `poll` restart services that exit on their own
  (omni_stack.supervision) and carry out rolling restarts of the
  materializers (omni_stack.rolling).
- `stop` stops the services in reverse order (gateway first) within one stop
  timeout, then whatever they left behind, sweeps the deployment's arenas
  (retrying for up to `SWEEP_WAIT_S` while a lock is still held: a process
  killed a moment before may not have released it yet) and returns the
  shared-memory segments still present. A killed launcher takes
  its services with it (parent-death signal, omni_common.lifeline).

Invariants: drive a Stack from one long-lived thread (the services' parent-death
signal follows the thread that started them); every process group a service
ever led is remembered until the stack stops (`ServiceProcess.dead_groups`),
so nothing it started outlives the stack.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from omni_common.net import MAX_UDS_PATH_BYTES, dial_host, free_port, uds_path_bytes, url_host
from omni_stack.commands import ServiceProcess, service_commands
from omni_stack.config import (
    StackConfig,
    replica_deployment,
    replica_port,
    replica_suffix,
)
from omni_stack.errors import ConfigError, StackError, StartAborted
from omni_stack.health import check_health
from omni_stack.processes import (
    alive,
    describe_exit,
    members,
    process_name,
    signal_group,
    spawn,
    wait_gone,
)
from omni_stack.rolling import ROLLING_STATUS_FILE, RollingRestarts
from omni_stack.runtime import (
    RuntimeDirLock,
    list_segments,
    new_runtime_dir,
    private_dir,
    sweep_orphaned_segments,
    sweep_runtime_dirs,
    sweep_stale,
)
from omni_stack.supervision import Supervisor

_STACKS = itertools.count(1)
# After the last service exited, how long `stop` waits for a segment's lock
# to be released: a process killed a moment ago (SIGKILL is not waited for
# when it is not our child) holds it until the kernel has torn it down.
SWEEP_WAIT_S = 3.0


def sweep_until_gone(prefixes: list[str], wait_s: float, poll_s: float = 0.05) -> list[str]:
    """Sweep the arenas under `prefixes` once every writer is meant to be gone
    (a half-made one too: a decoder killed while creating it left no header),
    retrying while a segment's lock is still held, for at most `wait_s`.
    Returns the segments still present (their lock outlived the wait)."""
    deadline = time.monotonic() + wait_s
    while True:
        for prefix in prefixes:
            sweep_stale(prefix, creating_grace_s=0)
        left = sorted(name for prefix in prefixes for name in list_segments(prefix))
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(poll_s)



def _log_stderr(message: str) -> None:
    print(f"omni-serving up: {message}", file=sys.stderr, flush=True)


class Stack:
    """A running stack; use as a context manager or call start()/stop().

    After start(), supervise() (or poll() in a loop of the caller's own)
    restarts services that exit on their own; see StackConfig for the policy.
    Drive a Stack from one long-lived thread (see omni_common.lifeline).
    """

    def __init__(
        self, cfg: StackConfig, *, subreaper: bool = False, log: Callable[[str], None] | None = None
    ) -> None:
        cfg = dataclasses.replace(cfg, extra_decoder_args=list(cfg.extra_decoder_args))
        cfg.validate()
        if not cfg.deployment:  # unique per stack: up<pid>, up<pid>-2, ...
            n = next(_STACKS)
            cfg.deployment = f"up{os.getpid()}" + (f"-{n}" if n > 1 else "")
        if cfg.port == 0:
            cfg.port = free_port(dial_host(cfg.host))
        if cfg.http_port == 0:
            cfg.http_port = free_port(dial_host(cfg.host))
        # (decoder, materializer) /metrics port of each replica; 0 picked free now
        metrics_ports = []
        for i in range(cfg.replicas):
            dec = replica_port(cfg.decoder_metrics_port, i)
            mat = replica_port(cfg.materializer_metrics_port, i)
            if dec == 0:
                dec = free_port(dial_host(cfg.metrics_host))
            if mat == 0 and not cfg.sync:
                mat = free_port(dial_host(cfg.metrics_host))
            metrics_ports.append((dec, mat))
        cfg.decoder_metrics_port, cfg.materializer_metrics_port = metrics_ports[0]
        self.cfg = cfg
        self.subreaper = subreaper
        self._log = log or _log_stderr
        self._lock: RuntimeDirLock | None = None
        self._own_runtime = not cfg.runtime_dir
        if cfg.runtime_dir:
            self.runtime = Path(cfg.runtime_dir).absolute()
            private_dir(self.runtime)
        else:
            self.runtime = new_runtime_dir()
        longest = max(
            uds_path_bytes(self.runtime / f"{role}{replica_suffix(cfg, i)}.sock")
            for role in ("decoder", "materializer")
            for i in range(cfg.replicas)
        )
        if longest > MAX_UDS_PATH_BYTES:
            self._remove_runtime()
            raise ConfigError(
                f"runtime_dir: {self.runtime} is too long for a Unix socket path "
                f"({longest} > {MAX_UDS_PATH_BYTES} bytes)"
            )
        try:
            self._lock = RuntimeDirLock(
                self.runtime, created=self._own_runtime, deployment=cfg.deployment
            )
        except BaseException:
            if self._own_runtime:
                self._remove_runtime()
            raise
        self.services = service_commands(cfg, self.runtime, metrics_ports=metrics_ports)
        self.killed: list[str] = []  # processes that had to be stopped after their service exited
        self.swept: list[str] = []  # stale segments and runtime directories removed at start
        self._stopped = False
        self._supervisor = Supervisor(
            cfg, log=self._log, spawn=self._spawn, reap_orphans=self.reap_orphans
        )
        self._rolling = RollingRestarts(
            cfg, self.runtime, log=self._log, popen=self._popen, services_of=self.services_of
        )

    # -- addresses
    @property
    def shm_prefix(self) -> str:
        """The arena prefix of the stack's one replica (replica 0 of several)."""
        return self.shm_prefixes[0]

    @property
    def shm_prefixes(self) -> list[str]:
        """The arena prefix of each replica: omni-<its deployment>."""
        return [f"omni-{replica_deployment(self.cfg, i)}" for i in range(self.cfg.replicas)]

    def segments(self) -> list[str]:
        """The arena segments of every replica present on this host."""
        return sorted(name for prefix in self.shm_prefixes for name in list_segments(prefix))

    def service(self, name: str) -> ServiceProcess | None:
        return next((s for s in self.services if s.name == name), None)

    def services_of(self, role: str) -> list[ServiceProcess]:
        """Every replica's service of `role` (materializer, decoder, gateway), in replica order."""
        return [s for s in self.services if s.role == role]

    @property
    def gateway_target(self) -> str:
        return self.services[-1].target

    @property
    def decoder_target(self) -> str:
        """The (first replica's) decoder."""
        return self.decoder_targets[0]

    @property
    def decoder_targets(self) -> list[str]:
        return [s.target for s in self.services_of("decoder")]

    @property
    def materializer_target(self) -> str | None:
        svc = self.service("materializer")
        return svc.target if svc else None

    @property
    def http_url(self) -> str:
        return f"http://{url_host(self.cfg.host)}:{self.cfg.http_port}"

    def endpoints(self) -> list[tuple[str, str]]:
        """(label, address) of everything a user reaches, for printing."""
        rows = [
            ("gateway gRPC", self.gateway_target),
            ("gateway HTTP", f"{self.http_url}/v1/audio/speech"),
        ]
        rows += [
            (f"{s.name} metrics", s.metrics_url) for s in reversed(self.services) if s.metrics_url
        ]
        rows += [(s.name, s.target) for s in self.services if s.role != "gateway"]
        rows.append(("runtime dir", str(self.runtime)))
        return rows

    # -- lifecycle
    def start(self, timeout_s: float | None = None, abort: threading.Event | None = None) -> None:
        """Sweep what dead stacks left, then start the services in order, each
        once the previous ones are healthy (the gateway beside its decoders:
        it waits for them itself).

        Raises StackError when one exits or stays unhealthy past timeout_s
        (default cfg.startup_timeout), StartAborted when `abort` is set;
        either way everything started so far is stopped first.
        """
        timeout = self.cfg.startup_timeout if timeout_s is None else timeout_s
        segments = sweep_orphaned_segments()
        dirs = sweep_runtime_dirs()
        self.swept = segments + dirs
        if segments:
            self._log(
                f"removed {len(segments)} shared-memory segment(s) of dead processes: "
                f"{', '.join(segments)}"
            )
        if dirs:
            self._log(f"removed {len(dirs)} runtime dir(s) of dead launchers: {', '.join(dirs)}")
        tmp = self.runtime / "tmp"  # the services' temp files go away with the stack
        tmp.mkdir(mode=0o700, exist_ok=True)
        try:
            started: list[ServiceProcess] = []
            for svc in self.services:
                # a service starts once those before it are healthy; the gateway
                # starts beside its decoders (it serves once one is healthy)
                if svc.role != "gateway":
                    self._await_healthy(started, timeout, abort)
                self._spawn(svc)
                started.append(svc)
            self._await_healthy(started, timeout, abort)
        except BaseException:
            self.stop()
            raise

    def _await_healthy(
        self, services: list[ServiceProcess], timeout_s: float, abort: threading.Event | None
    ) -> None:
        """Wait, in order, for each of `services` not yet running to answer SERVING."""
        for svc in services:
            if svc.state == "running":
                continue
            self._wait_healthy(svc, timeout_s, abort)
            svc.state = "running"
            svc.healthy_at = time.monotonic()

    def _popen(self, svc: ServiceProcess, argv: list[str]) -> subprocess.Popen:
        env = {**os.environ, **svc.env, "TMPDIR": str(self.runtime / "tmp")}
        return spawn(argv, env, pass_fds=(self._lock.fd,) if self._lock is not None else ())

    def _spawn(self, svc: ServiceProcess) -> None:
        svc.proc = self._popen(svc, svc.argv)
        svc.metrics_url = svc.base_metrics_url
        svc.started_at = time.monotonic()
        svc.start_deadline = svc.started_at + self.cfg.startup_timeout
        svc.state = "starting"

    def _wait_healthy(
        self, svc: ServiceProcess, timeout_s: float, abort: threading.Event | None
    ) -> None:
        assert svc.proc is not None
        deadline = time.monotonic() + timeout_s
        last = "no answer yet"
        while True:
            if abort is not None and abort.is_set():
                raise StartAborted(f"stop requested while {svc.name} was starting")
            code = svc.proc.poll()
            if code is not None:
                raise StackError(
                    f"{svc.name} {describe_exit(code)} while starting "
                    f"(command: {' '.join(svc.argv)})"
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StackError(
                    f"{svc.name} not healthy at {svc.target} after {timeout_s:g}s ({last})"
                )
            problem = check_health(self.cfg, svc, min(remaining, 1.0))
            if problem is None:
                return
            last = problem
            if svc.role == "gateway" and self.cfg.tls_cert:
                time.sleep(0.1)

    # -- supervision
    def supervise(self, stop: threading.Event, poll_s: float = 0.2) -> str | None:
        """Watch the services until `stop` is set, restarting those that exit on
        their own. Returns None once `stop` is set, or why it gave up (a service
        failed too often in a row, or restarts are off); the caller then stops
        the stack."""
        while not stop.wait(poll_s if self._rolling.handover is None else min(poll_s, 0.05)):
            problem = self.poll()
            if problem is not None:
                return problem
            self.reap_orphans()
        return None

    def poll(self) -> str | None:
        """One round of supervision: notice exits, restart after the backoff,
        mark restarted services running once healthy, advance a rolling
        restart. Returns why it gives up, or None."""
        self._rolling.advance()
        for svc in self.services:
            problem = self._supervisor.poll_service(svc)
            if problem is not None:
                return problem
        return None

    # -- rolling restart of the materializers (omni_stack.rolling)
    def request_rolling_restart(self) -> None:
        """Ask for a rolling restart of every materializer (safe from a signal
        handler and other threads); supervise()/poll() carry it out. Asked
        while one runs, one more follows it."""
        self._rolling.request()

    @property
    def rolling_restart_running(self) -> bool:
        return self._rolling.running

    @property
    def last_rolling_restart(self) -> dict[str, Any] | None:
        """The status record of the last finished rolling restart."""
        return self._rolling.last

    def rolling_restart(self, timeout_s: float = 300.0, poll_s: float = 0.05) -> dict[str, Any]:
        """Run a rolling restart now, supervising meanwhile; return its record
        (`state`: done or failed, `steps`: what was logged). Call it from the
        thread that drives the stack."""
        self.request_rolling_restart()
        deadline = time.monotonic() + timeout_s
        while self._rolling.pending:
            if time.monotonic() > deadline:
                raise StackError(f"rolling restart not done after {timeout_s:g}s")
            problem = self.poll()
            if problem is not None:
                raise StackError(problem)
            self.reap_orphans()
            time.sleep(poll_s)
        assert self.last_rolling_restart is not None
        return self.last_rolling_restart

    # -- processes
    def exited(self) -> list[ServiceProcess]:
        """Services whose process has ended."""
        return [s for s in self.services if s.proc is not None and s.proc.poll() is not None]

    def descendants(self) -> list[psutil.Process]:
        """Every live process the services started, children of children included."""
        found: dict[int, psutil.Process] = {}
        roots: list[psutil.Process] = []
        for proc in self._leaders():
            with contextlib.suppress(psutil.Error):
                roots.append(psutil.Process(proc.pid))
        if self.subreaper:  # orphans re-parented to us
            leaders = {p.pid for p in self._leaders()}
            with contextlib.suppress(psutil.Error):
                roots += [p for p in psutil.Process().children() if p.pid not in leaders]
        for root in roots:
            with contextlib.suppress(psutil.Error):
                for p in [root, *root.children(recursive=True)]:
                    found[p.pid] = p
        return [p for p in found.values() if alive(p)]

    def reap_orphans(self) -> None:
        """Collect exit statuses of re-parented orphans (only with subreaper)."""
        if not self.subreaper:
            return
        leaders = {p.pid for p in self._leaders()}
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process().children():
                if child.pid not in leaders:
                    with contextlib.suppress(ChildProcessError, OSError):
                        os.waitpid(child.pid, os.WNOHANG)

    def _leaders(self) -> list[subprocess.Popen]:
        """Every service process started (a rolling restart's extra one included)."""
        procs = [s.proc for s in self.services if s.proc is not None]
        return procs + [proc for _, proc in self._rolling.extra()]

    def _groups(self) -> dict[int, float | None]:
        """Process groups of every service incarnation (each leads its own):
        {pgid: None while its leader is not reaped, else when it was seen gone}."""
        groups: dict[int, float | None] = {}
        for svc in self.services:
            if svc.proc is not None and svc.proc.returncode is not None:
                svc.dead_groups.setdefault(svc.proc.pid, time.time())
            groups.update(svc.dead_groups)
            if svc.proc is not None and svc.proc.returncode is None:
                groups[svc.proc.pid] = None
        for svc, proc in self._rolling.extra():
            if proc.returncode is None:
                groups[proc.pid] = None
            else:
                groups.setdefault(proc.pid, svc.dead_groups.setdefault(proc.pid, time.time()))
        return groups

    def kill(self) -> None:
        """SIGKILL every service's process group now (a second Ctrl-C)."""
        groups = self._groups()
        for pgid, gone in groups.items():
            if gone is None:  # the leader is not reaped: the number is still its group's
                signal_group(pgid, signal.SIGKILL)
        for p in members({k: v for k, v in groups.items() if v is not None}):
            with contextlib.suppress(psutil.Error):
                p.kill()

    def stop(self, timeout_s: float | None = None) -> list[str]:
        """Stop gateway, decoder, materializer (in that order), then anything they
        left running, all within timeout_s (default cfg.stop_timeout) plus a
        moment to kill what is left. Returns the deployment's shared-memory
        segments still present."""
        if self._stopped:
            return self.segments()
        self._stopped = True
        self._rolling.stopped = True
        timeout = self.cfg.stop_timeout if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        # Each service may use what the ones before it left, less a share kept
        # for each one after it (a decoder whose gateway is gone stops in well
        # under a second): a slow gateway cannot leave the others no time at all.
        share = min(2.0, timeout / 6)
        tracked = {p.pid: p for p in self.descendants()}
        extra = dict((id(svc), proc) for svc, proc in self._rolling.extra())
        order: list[tuple[ServiceProcess, subprocess.Popen | None]] = []
        for svc in reversed(self.services):
            order.append((svc, svc.proc))
            if id(svc) in extra:  # a rolling restart's other process stops with it
                order.append((svc, extra[id(svc)]))
        for i, (svc, proc) in enumerate(order):
            svc.state = "stopped"
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            sent = time.monotonic()
            until = deadline - share * (len(order) - 1 - i)
            try:
                proc.wait(max(until - sent, 0.0))
            except subprocess.TimeoutExpired:
                self._log(
                    f"{svc.name} (pid {proc.pid}) did not stop within "
                    f"{time.monotonic() - sent:.1f}s of its SIGTERM; killing it"
                )
                signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
        self._rolling.abandon()
        # What the services started and did not stop: children of children,
        # orphans re-parented to us, anything still in their process groups.
        tracked.update({p.pid: p for p in self.descendants()})
        tracked.update({p.pid: p for p in members(self._groups())})
        # e.g. a forkserver noticing its parent left: a moment, within the deadline
        left = wait_gone(list(tracked.values()), min(2.0, max(deadline - time.monotonic(), 0.2)))
        if left:
            self.killed = [f"{p.pid} ({process_name(p)})" for p in left]
            for p in left:
                with contextlib.suppress(psutil.Error):
                    p.terminate()
            for p in wait_gone(left, min(3.0, max(deadline - time.monotonic(), 0.2))):
                with contextlib.suppress(psutil.Error):
                    p.kill()
        self.kill()  # last resort: nothing should be left
        self.reap_orphans()
        left = sweep_until_gone(self.shm_prefixes, SWEEP_WAIT_S)
        self._remove_runtime()
        return left

    def _remove_runtime(self) -> None:
        if self._own_runtime:
            shutil.rmtree(self.runtime, ignore_errors=True)
        else:
            shutil.rmtree(self.runtime / "tmp", ignore_errors=True)
            for name in (ROLLING_STATUS_FILE, ROLLING_STATUS_FILE + ".tmp"):
                with contextlib.suppress(OSError):
                    (self.runtime / name).unlink()
        if self._lock is not None:  # last: the directory is ours until it is gone
            self._lock.release(unlink=not self._own_runtime)

    def __enter__(self) -> Stack:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
