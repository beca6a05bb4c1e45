"""The gateway's health follows its decoder's.

`DecoderMonitor` checks the decoder every `interval_s` (a grpc.health.v1
`Check` with a short deadline, on the same channel requests use) and calls
`on_change(healthy)` whenever the answer flips; `wake()` asks for a check
now (a request that saw the decoder UNAVAILABLE calls it). With several
decoders (gateway.replicas) each replica has its own monitor, and the
gateway is healthy while any replica is. The gateway wires that to
its own grpc.health.v1 status (`omni_common.server.set_health`), so load
balancers and `omni-serving up` see NOT_SERVING while the decoder is
unreachable, and SERVING again one check after it is back. HTTP ``/health``
reads the same state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from gateway.decoder_client import DecoderClient

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 0.25
"""Time between two checks: a flip is seen within this plus one check's deadline."""
DEFAULT_TIMEOUT_S = 0.5
"""Deadline of one check. A local decoder answers in about a millisecond."""
DEFAULT_SLOW_CHECKS = 4
"""Checks in a row that must run past their deadline before a healthy decoder
counts as down. A decoder that refuses the connection or answers NOT_SERVING
is down at once, and so is one that is late while its channel is not
connected; one that is merely slow to answer on a live connection (a host
saturated by its own load) keeps its requests for about this many intervals
plus deadlines."""


class HealthState(Protocol):
    """What reports the gateway's health: a `DecoderMonitor` or a `gateway.replicas.ReplicaPool`."""

    @property
    def healthy(self) -> bool | None:
        """The latest answer; None before the first check."""
        ...


class DecoderMonitor:
    """Periodic decoder health checks on a background task; create it inside its event loop."""

    def __init__(
        self,
        decoder: DecoderClient,
        on_change: Callable[[bool], Awaitable[None]] | None = None,
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        slow_checks: int = DEFAULT_SLOW_CHECKS,
    ) -> None:
        self._decoder = decoder
        self.slow_checks = max(1, slow_checks)
        self._slow = 0
        self._wake = asyncio.Event()
        self._on_change = on_change
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.healthy: bool | None = None
        """None until the first check has answered."""
        self.reason = "not checked yet"
        """Why the decoder is not healthy (for logs; never sent to clients verbatim)."""
        self.checked = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Check once now (so health is right from the start), then keep checking."""
        if self._task is None:
            await self._check_logged()
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name=f"decoder-health-monitor {self._decoder.target}"
            )

    def wake(self) -> None:
        """Check now instead of at the next interval (no-op when not started)."""
        self._wake.set()

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def check_once(self) -> bool:
        """Run one check now, apply its result, and return it."""
        problem = await self._decoder.probe(self.timeout_s)
        healthy = problem is None
        # late on a live connection: busy; late while (re)connecting: gone
        slow = (
            problem is not None
            and problem.startswith("DEADLINE_EXCEEDED")
            and self._decoder.connected()
        )
        self._slow = self._slow + 1 if slow else 0
        if slow and self.healthy and self._slow < self.slow_checks:
            healthy = True  # slow, not gone: keep it until slow_checks in a row
        if healthy != self.healthy:
            if healthy:
                logger.info("decoder at %s is healthy", self._decoder.target)
            elif self.healthy is None:  # never seen healthy: still starting, as a rule
                logger.info("decoder at %s is not serving yet: %s", self._decoder.target, problem)
            else:
                logger.warning("decoder at %s is not healthy: %s", self._decoder.target, problem)
            self.healthy = healthy
            if self._on_change is not None:
                await self._on_change(healthy)
        self.reason = problem or ""
        self.checked.set()
        return healthy

    async def _check_logged(self) -> None:
        try:
            await self.check_once()
        except Exception:  # noqa: BLE001  a bug in a check must not end the monitor
            logger.exception("decoder health check failed")

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval_s)
            self._wake.clear()
            await self._check_logged()


__all__ = ["DEFAULT_INTERVAL_S", "DEFAULT_TIMEOUT_S", "DecoderMonitor", "HealthState"]
