"""A liveness watchdog's verdicts as gRPC health (``omni_common.liveness``).

``HealthFromWatchdog`` is a ``Watchdog``'s ``on_change``: readiness goes on
the server's own health entries ("" and its services), liveness on
``LIVENESS_SERVICE``. A service whose readiness also depends on something
else (the gateway: a decoder to send work to) reports that with
``set_dependency``; it is ready only while both agree.

Invariants: the verdicts arrive on the watchdog's thread and are applied on
the server's event loop (``started`` binds it); before that, and after the
loop has ended, they are dropped. ``set_health`` ignores changes once the
server is shutting down, so a stopping server stays NOT_SERVING.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health_pb2

from omni_common.liveness import LIVENESS_SERVICE, Stuck, Watchdog, describe_unready
from omni_common.server import HealthServicer, set_health

logger = logging.getLogger(__name__)


class HealthFromWatchdog:
    """The watchdog's verdicts as gRPC health (see the module docstring).

    names: the readiness entries (``ServerConfig.health_names``); dependency:
    whether what the service depends on is there at start."""

    def __init__(self, names: tuple[str, ...], *, dependency: bool = True, log: logging.Logger = logger) -> None:
        self.names = names
        self.watchdog: Watchdog | None = None  # bound by `bind`: names what keeps it not ready
        self._log = log
        self._loop: asyncio.AbstractEventLoop | None = None
        self._health: HealthServicer | None = None
        self._ready = True  # the watchdog's verdict
        self._dependency = dependency  # what the service also needs (see set_dependency)

    def bind(self, watchdog: Watchdog) -> Watchdog:
        """Be `watchdog`'s on_change; returns it."""
        self.watchdog = watchdog
        watchdog.on_change = self
        return watchdog

    async def started(self, server: grpc.aio.Server, health: HealthServicer) -> None:
        """The server's on_started: from now on verdicts reach `health`."""
        self._loop, self._health = asyncio.get_running_loop(), health
        await health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)

    async def set_dependency(self, ok: bool) -> None:
        """(On the server's loop) whether what the service depends on is there."""
        self._dependency = ok
        if self._health is not None:
            await set_health(self._health, self.names, serving=self._ready and ok)

    def __call__(self, ready: bool, live: bool, stuck: list[Stuck]) -> None:
        loop, health = self._loop, self._health
        if loop is None or health is None:
            return
        if not ready:
            waiting = self.watchdog.waiting() if self.watchdog is not None else []
            self._log.error("not ready: %s", describe_unready(stuck, waiting))
        else:
            self._log.warning("ready again: no part is stuck or restarting")
        status = health_pb2.HealthCheckResponse.SERVING if live else health_pb2.HealthCheckResponse.NOT_SERVING

        async def update() -> None:
            self._ready = ready
            await set_health(health, self.names, serving=ready and self._dependency)
            await health.set(LIVENESS_SERVICE, status)

        try:
            asyncio.run_coroutine_threadsafe(update(), loop)
        except RuntimeError:  # the loop has ended: the server is gone
            pass
