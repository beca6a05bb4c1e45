"""Per-stage forward time, and the time stages' forward passes run at once.

Each AR stage's engine reports the time it spends in ``engine.step()``
(forward, sample and the step's own bookkeeping). Two series come out:

- ``omni_decoder_stage_forward_seconds_total{stage}``: busy time per stage;
- ``omni_decoder_stage_forward_overlap_seconds_total``: wall time during which
  two or more stages were in a forward pass together.

overlap / min(busy of each stage) says how much of the stages' work runs side
by side: 0 while the engines share one process-wide forward lock (engines in
one process), up to 1 when they run in parallel.

Stages in their own processes (``decoder_svc.stage``) record their
forward passes as (start, end) intervals on the host's monotonic clock
(``time.perf_counter``: CLOCK_MONOTONIC, one clock for all processes) and
report them; the decoder's tracker adds each with :meth:`ForwardBusy.add_interval`,
which counts its overlap with the other stages' reported intervals (pairwise:
with three stages or more, time when three overlap counts more than once).
"""

from __future__ import annotations

import bisect
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
        self._recording = False
        self._started: dict[str, float] = {}
        self._intervals: list[tuple[float, float]] = []  # recorded, not yet taken (one stage per process)
        self._spans: dict[str, tuple[list[float], list[float]]] = {}  # reported: (starts, ends) per stage

    def record_intervals(self, on: bool = True) -> None:
        """Keep each forward pass as a (start, end) interval, for take_intervals()."""
        with self._lock:
            self._recording = on

    def take_intervals(self) -> list[tuple[float, float]]:
        """The intervals recorded since the last call."""
        with self._lock:
            out, self._intervals = self._intervals, []
        return out

    def add_interval(self, stage: str, start: float, end: float, keep_s: float = 30.0) -> None:
        """A forward pass of `stage` reported by its process: its busy time,
        and its overlap with the other stages' passes reported so far."""
        with self._lock:
            dt = max(0.0, end - start)
            self.busy_s[stage] = self.busy_s.get(stage, 0.0) + dt
            overlap = 0.0
            for other, (starts, ends) in self._spans.items():
                if other == stage:
                    continue
                i = bisect.bisect_right(ends, start)  # a stage's passes never overlap: ends sorted
                while i < len(starts) and starts[i] < end:
                    overlap += max(0.0, min(end, ends[i]) - max(start, starts[i]))
                    i += 1
            starts, ends = self._spans.setdefault(stage, ([], []))
            starts.append(start)
            ends.append(end)
            cut = bisect.bisect_left(ends, end - keep_s)  # older ones overlap nothing that is still to come
            if cut > 1024:
                del starts[:cut], ends[:cut]
            self.overlap_s += overlap
            if self._export:
                FORWARD_SECONDS.labels(stage).inc(dt)
                if overlap:
                    OVERLAP_SECONDS.inc(overlap)

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
            now = self._clock()
            self._advance(now)
            self._active[stage] = self._active.get(stage, 0) + 1
            if self._recording:
                self._started[stage] = now

    def exit(self, stage: str) -> None:
        with self._lock:
            now = self._clock()
            self._advance(now)
            self._active[stage] = max(0, self._active.get(stage, 0) - 1)
            start = self._started.pop(stage, None)
            if start is not None:
                self._intervals.append((start, now))

    @contextmanager
    def forward(self, stage: str) -> Iterator[None]:
        self.enter(stage)
        try:
            yield
        finally:
            self.exit(stage)


BUSY = ForwardBusy()
"""The decoder process's tracker (the engines' steps report to it)."""
