"""Supervision: a service that exits or stays stuck is restarted, one that keeps failing stops the stack.

Each service moves through `ServiceProcess.state`:
starting -> running -> (exits) -> backoff -> starting -> ... or failed.

- A service that exits without being asked to (`_crashed`) is restarted
  after a delay that doubles from `restart_backoff` up to
  `restart_backoff_max`; what it started goes with it (SIGTERM now, SIGKILL at
  the restart).
- One that fails more than `max_restarts` times in a row (without staying up
  for `restart_reset` seconds in between) stops the stack; `max_restarts` 0
  means a crash stops it.
- A restarted service counts as running once it answers SERVING; one that
  does not within `startup_timeout` is killed and counts as a failure.
- A service the launcher stopped itself (`stop_expected`, a failed rolling
  restart) is started again at once, without counting a failure.
- A running decoder or gateway whose `omni_serving.liveness` health entry
  (`omni_common.liveness`) answers NOT_SERVING in `NOT_LIVE_CHECKS` checks in
  a row, one every `liveness_poll` seconds (0 = off), is killed and restarted
  as after a crash, the log naming the reason.
- One whose liveness check gets no answer at all (a stopped process, a
  wedged event loop: nothing in it can say NOT_SERVING) for longer than
  `liveness_unanswered_s` (0 = off) is killed and restarted the same way.
  The time counts from its last answer of any kind (SERVING, NOT_SERVING, an
  unknown entry), or from when it became healthy; it is long (60 s by
  default) so that a check that times out under load does not restart a
  healthy service. A service without the entry answers (NOT_FOUND): it is
  never restarted by either rule.

Invariant: `Supervisor.poll_service` only notices and acts, it never waits
longer than one short health check; the stack calls it for each service in
every round (`Stack.poll`), from the thread that drives the stack.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Callable

import grpc
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc

from omni_common.liveness import LIVENESS_SERVICE
from omni_common.server import client_target
from omni_stack.commands import ServiceProcess
from omni_stack.config import StackConfig
from omni_stack.health import check_health
from omni_stack.processes import describe_exit, members, signal_group, terminate_members
from omni_stack.runtime import sweep_stale

NOT_LIVE_CHECKS = 2
"""NOT_SERVING answers of a decoder's liveness entry in a row that restart it."""

LIVENESS_CHECK_TIMEOUT_S = 0.2
"""The longest one liveness check waits (the supervisor's round never waits longer)."""

LIVENESS_ROLES = ("decoder", "gateway")
"""The services whose liveness entry the launcher checks (a gateway serving
TLS is not: the launcher's check speaks plain gRPC)."""


def liveness_status(svc: ServiceProcess, timeout_s: float) -> str:
    """`svc`'s `omni_serving.liveness` health answer ("SERVING", "NOT_SERVING",
    ...), or "" when none came within `timeout_s` (or the entry is unknown)."""
    try:
        with grpc.insecure_channel(client_target(svc.target)) as channel:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=LIVENESS_SERVICE), timeout=timeout_s
            )
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.NOT_FOUND:  # it answered: no such entry
            return "SERVICE_UNKNOWN"
        return ""
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def count_not_live(status: str, not_live: int) -> int:
    """The NOT_SERVING answers in a row after `status` (`NOT_LIVE_CHECKS`: restart);
    an answer that did not come ("") neither counts nor resets the count."""
    if status == "NOT_SERVING":
        return not_live + 1
    if status == "":
        return not_live
    return 0


def unanswered_for(answered_at: float, now: float, limit_s: float) -> float | None:
    """How long a service has left its liveness check unanswered, when that is
    longer than `limit_s` (restart it); None otherwise or when `limit_s` is 0 (off)."""
    silent = now - answered_at
    return silent if limit_s > 0 and silent > limit_s else None


class Supervisor:
    """Restarts a stack's services (see the module docstring).

    `spawn(svc)` starts `svc`'s process the way the stack does; `reap_orphans()`
    collects re-parented orphans before a restart.
    """

    def __init__(
        self,
        cfg: StackConfig,
        *,
        log: Callable[[str], None],
        spawn: Callable[[ServiceProcess], None],
        reap_orphans: Callable[[], None],
        check_liveness: Callable[[ServiceProcess, float], str] = liveness_status,
    ) -> None:
        self.cfg = cfg
        self._check_liveness = check_liveness
        self._log = log
        self._spawn = spawn
        self._reap_orphans = reap_orphans

    def poll_service(self, svc: ServiceProcess) -> str | None:
        """One round for `svc`: notice an exit, restart after the backoff, mark a
        restarted one running once healthy. Returns why the stack gives up, or None."""
        now = time.monotonic()
        if svc.state == "backoff":
            if now >= svc.next_start:
                self._restart(svc)
            return None
        if svc.state not in ("running", "starting") or svc.proc is None:
            return None
        code = svc.proc.poll()
        if svc.state == "running":
            if code is None:
                if svc.failures and now - svc.healthy_at >= self.cfg.restart_reset:
                    svc.failures = 0  # it has stayed up: its next crash starts a new count
                return self._check_live(svc, now)
            if svc.stop_expected:  # stopped by the launcher itself: start a fresh one now
                svc.stop_expected = False
                svc.dead_groups[svc.proc.pid] = time.time()
                svc.state, svc.next_start = "backoff", now
                self._log(f"{svc.name} (pid {svc.proc.pid}) stopped as asked; starting a fresh one")
                return None
            return self._crashed(svc, describe_exit(code), now)
        # starting (a restart): healthy yet?
        if code is not None:
            return self._crashed(svc, f"{describe_exit(code)} while starting", now)
        if check_health(self.cfg, svc, 0.2) is None:
            svc.state = "running"
            svc.healthy_at = time.monotonic()
            svc.not_live, svc.next_liveness = 0, svc.healthy_at + self.cfg.liveness_poll
            self._log(
                f"{svc.name} is serving again (pid {svc.proc.pid}, healthy "
                f"{svc.healthy_at - svc.started_at:.1f}s after its start)"
            )
            return None
        if now > svc.start_deadline:
            signal_group(svc.proc.pid, signal.SIGKILL)  # not reaped yet: the group is its own
            svc.proc.wait()
            return self._crashed(svc, f"was not healthy within {self.cfg.startup_timeout:g}s", now)
        return None

    def _check_live(self, svc: ServiceProcess, now: float) -> str | None:
        """A running decoder or gateway: check its liveness entry when due; stuck in
        `NOT_LIVE_CHECKS` checks in a row, or no answer for longer than
        `liveness_unanswered_s`, kill it and restart it as after a crash."""
        poll = self.cfg.liveness_poll
        if svc.role not in LIVENESS_ROLES or poll <= 0 or now < svc.next_liveness:
            return None
        if svc.role == "gateway" and self.cfg.tls_cert:
            return None
        assert svc.proc is not None
        svc.next_liveness = now + poll
        status = self._check_liveness(svc, LIVENESS_CHECK_TIMEOUT_S)
        if status:
            svc.answered_at = time.monotonic()
        svc.not_live = count_not_live(status, svc.not_live)
        if svc.not_live >= NOT_LIVE_CHECKS:
            svc.not_live = 0
            why = (f"reports not live ({LIVENESS_SERVICE} NOT_SERVING in {NOT_LIVE_CHECKS} checks "
                   f"in a row, {poll:g}s apart)")
            return self._kill_stuck(svc, why, f"was stuck ({LIVENESS_SERVICE} NOT_SERVING)", now)
        silent = unanswered_for(max(svc.answered_at, svc.healthy_at), now, self.cfg.liveness_unanswered_s)
        if silent is not None:
            why = (f"did not answer its {LIVENESS_SERVICE} check for {silent:.1f}s "
                   f"(liveness-unanswered-s {self.cfg.liveness_unanswered_s:g})")
            return self._kill_stuck(svc, why, f"did not answer for {silent:.1f}s (stopped or wedged)", now)
        return None

    def _kill_stuck(self, svc: ServiceProcess, why: str, what: str, now: float) -> str | None:
        assert svc.proc is not None
        self._log(f"{svc.name} (pid {svc.proc.pid}) {why}: killing it")
        signal_group(svc.proc.pid, signal.SIGKILL)
        svc.proc.wait()
        return self._crashed(svc, what, now)

    def _crashed(self, svc: ServiceProcess, what: str, now: float) -> str | None:
        """`svc` exited without being asked to: schedule its restart or give up."""
        assert svc.proc is not None
        cfg = self.cfg
        uptime = now - svc.started_at
        # What it started (pool workers, ...) goes too: asked now, killed at the restart.
        svc.dead_groups[svc.proc.pid] = time.time()
        terminate_members({svc.proc.pid: svc.dead_groups[svc.proc.pid]})
        if svc.state == "running" and now - svc.healthy_at >= cfg.restart_reset:
            svc.failures = 0
        svc.failures += 1
        if cfg.max_restarts == 0:
            svc.state = "failed"
            return f"{svc.name} {what} after {uptime:.1f}s (restarts are off: max-restarts 0)"
        if svc.failures > cfg.max_restarts:
            svc.state = "failed"
            return (
                f"{svc.name} {what} after {uptime:.1f}s; it failed {svc.failures} times in a row "
                f"(max-restarts {cfg.max_restarts}); giving up"
            )
        delay = min(cfg.restart_backoff * 2 ** (svc.failures - 1), cfg.restart_backoff_max)
        svc.state = "backoff"
        svc.next_start = now + delay
        self._log(
            f"{svc.name} {what} after {uptime:.1f}s; restarting it in {delay:g}s "
            f"(failure {svc.failures} in a row, at most {cfg.max_restarts})"
        )
        return None

    def _restart(self, svc: ServiceProcess) -> None:
        for p in members(dict(svc.dead_groups)):  # leftovers of the dead one: no more waiting
            with contextlib.suppress(psutil.Error):
                p.kill()
        self._reap_orphans()
        if svc.role == "decoder":  # the dead decoder's arena, even a half-made one
            sweep_stale(f"omni-{svc.deployment}", creating_grace_s=0)
        svc.restarts += 1
        self._spawn(svc)
        self._log(
            f"restarting {svc.name} (pid {svc.proc.pid if svc.proc else '?'}, "
            f"restart {svc.restarts})"
        )
