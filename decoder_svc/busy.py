"""Per-stage forward time, and the time stages' forward passes run at once.

Each AR stage's engine reports the time it spends in ``engine.step()``
(forward, sample and the step's own bookkeeping). Two series come out:

- ``omni_decoder_stage_forward_seconds_total{stage}``: busy time per stage;
- ``omni_decoder_stage_forward_overlap_seconds_total``: wall time during which
  two or more stages were in a forward pass together.

overlap / min(busy of each stage) says how much of the stages' work runs side
by side: 0 while the engines share one process-wide forward lock (engines in
one process), up to 1 when they run in parallel.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from prometheus_client import Counter

FORWARD_SECONDS = Counter(
    "omni_decoder_stage_forward_seconds",
    "Time each AR stage's engine spent in decode steps (forward + sample)",
    ["stage"],
)
OVERLAP_SECONDS = Counter(
    "omni_decoder_stage_forward_overlap_seconds",
    "Wall time during which two or more AR stages were in a decode step at once",
)


class ForwardBusy:
    """Integrates busy and overlap time over enter/exit events (thread-safe)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter, export: bool = True) -> None:
        self._clock = clock
        self._export = export
        self._lock = threading.Lock()
        self._active: dict[str, int] = {}
        self._since = 0.0  # time of the last event
        self.busy_s: dict[str, float] = {}
        self.overlap_s = 0.0

    def _advance(self, now: float) -> None:
        """Charge the time since the last event to the stages active in it."""
        dt = now - self._since
        self._since = now
        if dt <= 0:
            return
        running = [s for s, n in self._active.items() if n > 0]
        for stage in running:
            self.busy_s[stage] = self.busy_s.get(stage, 0.0) + dt
            if self._export:
                FORWARD_SECONDS.labels(stage).inc(dt)
        if len(running) >= 2:
            self.overlap_s += dt
            if self._export:
                OVERLAP_SECONDS.inc(dt)

    def enter(self, stage: str) -> None:
        with self._lock:
            self._advance(self._clock())
            self._active[stage] = self._active.get(stage, 0) + 1

    def exit(self, stage: str) -> None:
        with self._lock:
            self._advance(self._clock())
            self._active[stage] = max(0, self._active.get(stage, 0) - 1)

    @contextmanager
    def forward(self, stage: str) -> Iterator[None]:
        self.enter(stage)
        try:
            yield
        finally:
            self.exit(stage)


BUSY = ForwardBusy()
"""The decoder process's tracker (the engines' steps report to it)."""
