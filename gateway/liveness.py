"""The gateway's event loop under a liveness watchdog (``omni_common.liveness``).

Everything the gateway does runs on one asyncio event loop; a coroutine
that blocks it (a synchronous call that never returns, a CPU-bound bug)
stops every stream while the process stays up. ``LoopLiveness``:

- a tick task on the loop advances ``progress`` itself every ``tick_s``
  (no timer thread does it on the loop's behalf); work waits while client
  streams are in flight (``Admission.active``);
- a ``Watchdog`` thread judges it: stuck (streams in flight, no tick for
  longer than ``--stall-after-s``) makes the gateway not ready, and it logs
  the loop thread's stack once per episode (what blocked it); stuck past
  ``--liveness-grace-s`` makes the health entry ``omni_serving.liveness``
  NOT_SERVING;
- its health (``omni_common.liveness_health.HealthFromWatchdog``): the
  gateway is ready while its decoders are (``set_dependency``) and its loop
  is not stuck.

A loop that is blocked cannot answer health checks at all (grpc.aio serves
them on that loop): the verdicts reach gRPC health once it runs again, and
until then the missing answers are the signal (``omni-serving up`` restarts
a gateway whose liveness check goes unanswered for
``--liveness-unanswered-s``; a Kubernetes probe that times out fails). The
watchdog's log lines come from its own thread at once.

``debug_stall`` is a test hook: with ``OMNI_DEBUG_GATEWAY_STALL`` set to
``MARKER:SECONDS``, a request whose text contains MARKER blocks the event
loop for SECONDS (a wedged loop, on purpose). Unset, it does nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable

from omni_common.liveness import Progress, StallLimits, Watchdog
from omni_common.liveness_health import HealthFromWatchdog

logger = logging.getLogger(__name__)

STALL_ENV = "OMNI_DEBUG_GATEWAY_STALL"
"""Test hook: ``MARKER:SECONDS`` (see the module docstring)."""

TICK_S = 0.1
"""How often the tick task advances the loop's counter."""


class LoopLiveness:
    """The gateway's event loop, watched (see the module docstring).

    in_flight: how many client streams are open (work waiting for the loop).
    names: the readiness health entries (``ServerConfig.health_names``)."""

    def __init__(self, in_flight: Callable[[], int], limits: StallLimits, names: tuple[str, ...], *,
                 tick_s: float = TICK_S, interval_s: float = 0.25) -> None:
        self.tick_s = tick_s
        self.progress = Progress("gateway:event_loop", lambda: in_flight() > 0, on_stuck=self._log_stack)
        self.health = HealthFromWatchdog(names, dependency=False, log=logger)  # no decoder yet
        self.watchdog = self.health.bind(Watchdog(limits, interval_s=interval_s, name="gateway-watchdog"))
        self.watchdog.watch(self.progress)
        self._task: asyncio.Task | None = None
        self._loop_thread: int | None = None

    async def start(self) -> None:
        """On the gateway's loop: start ticking and judging."""
        self._loop_thread = threading.get_ident()
        self._task = asyncio.create_task(self._tick(), name="gateway-liveness-tick")
        self.watchdog.start()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await asyncio.to_thread(self.watchdog.stop)

    async def _tick(self) -> None:
        while True:
            self.progress.advance()
            await asyncio.sleep(self.tick_s)

    def _log_stack(self, progress: Progress, seconds: float) -> None:
        """on_stuck (the watchdog's thread): where the loop's thread is now."""
        frame = sys._current_frames().get(self._loop_thread) if self._loop_thread is not None else None
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "(no stack)\n"
        logger.error("the event loop has not run for %.1f s with %s; its thread is at:\n%s",
                     seconds, "client streams in flight", stack)


def _stall_setting() -> tuple[str, float] | None:
    raw = os.environ.get(STALL_ENV, "")
    marker, _, seconds = raw.rpartition(":")
    if not marker:
        return None
    try:
        return marker, float(seconds)
    except ValueError:
        logger.error("%s=%r: expected MARKER:SECONDS; ignored", STALL_ENV, raw)
        return None


_STALL = _stall_setting()


def debug_stall(text: str) -> None:
    """Test hook (``OMNI_DEBUG_GATEWAY_STALL``): block the event loop when `text` holds the marker."""
    if _STALL is None or _STALL[0] not in text:
        return
    logger.warning("%s: blocking the event loop for %.1f s (test hook)", STALL_ENV, _STALL[1])
    time.sleep(_STALL[1])
