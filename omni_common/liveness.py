"""Progress-based liveness: a part that stops making progress is treated like a part that died.

Every long-lived loop of a service (a stage's decode loop, a code2wav worker,
the materializer link, a front end's event loop) has a `Progress`: a counter
that **the loop itself** advances each time it comes round (a step taken, a
chunk decoded, a step delivered, a tick of the event loop), and a question,
`has_work()`, whether anything waits for it. No timer thread advances a
counter on a loop's behalf: a loop that wedges (a deadlock, a device call that
never returns, a process stopped by a signal) stops its counter while the rest
of its process (a status reporter, the health server) still answers.

A `Watchdog` thread looks at every part every `interval_s`:

1. a part with nothing waiting is idle, never stuck (its clock restarts);
2. a part with work waiting whose counter has not moved for longer than its
   limit is **stuck**. The limit follows the part's own recent pace:
   ``max(floor_s, factor * pace)``, ``pace`` being the part's recent time per
   turn (an exponential average of what the loop reports), so a decode loop
   whose steps take 0.4 s under load is not judged by the 30 ms of an idle one;
3. readiness first: while a part is stuck the service is not ready (gRPC
   health NOT_SERVING: balancers and readiness probes stop sending it work;
   the part is named in `stuck()`), and the part's `on_stuck` runs once per
   episode: a part that runs in a child process is killed there and started
   again by its owner, and its requests end with UNAVAILABLE naming the cause;
4. liveness later: a part stuck for longer than `grace_s` makes `live` False
   (the health entry `LIVENESS_SERVICE` goes NOT_SERVING): the supervisor
   (`omni-serving up`, Kubernetes' livenessProbe) restarts the service;
5. a part that moves again is not stuck any more: readiness comes back;
6. a part may also be not ready without being stuck: its `not_ready()`
   names why (a stage process being restarted after a crash or a kill);
   the service is not ready while any part says so (``waiting()`` names
   them), ready again once none does. That never makes it not live: the
   part's owner is already restarting it.

Counters are plain integers written by one loop and read by the watchdog (a
read that sees the old value only delays a verdict by one look).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

LIVENESS_SERVICE = "omni_serving.liveness"
"""The gRPC health entry that reports liveness (NOT_SERVING: restart me).

The overall entry ("") and the service's own name report readiness."""

DEFAULT_FLOOR_S = 30.0
"""Default: the shortest time without progress, work waiting, that makes a part stuck."""
DEFAULT_FACTOR = 20.0
"""Default: how many of a part's recent turns may pass without progress before it is stuck."""
DEFAULT_GRACE_S = 120.0
"""Default: how long a part may stay stuck before the service reports itself not live."""


@dataclass(frozen=True)
class StallLimits:
    """When a part counts as stuck, and when its service stops being live."""

    floor_s: float = DEFAULT_FLOOR_S
    factor: float = DEFAULT_FACTOR
    grace_s: float = DEFAULT_GRACE_S

    def __post_init__(self) -> None:
        from omni_common.errors import InvalidArgumentError

        if not self.floor_s > 0:
            raise InvalidArgumentError("stall_after_s", f"must be > 0, got {self.floor_s}")
        if not self.factor >= 1:
            raise InvalidArgumentError("stall_factor", f"must be >= 1, got {self.factor}")
        if not self.grace_s >= self.floor_s:
            raise InvalidArgumentError(
                "liveness_grace_s",
                f"must be >= stall_after_s ({self.floor_s:g}), got {self.grace_s}",
            )


class Progress:
    """One loop's progress counter (see the module docstring).

    has_work: whether something waits for the loop now (thread-safe, cheap).
    on_stuck: called (on the watchdog's thread) once each time the part
    becomes stuck, with the part and how long it has not moved; a part that
    can be restarted on its own (a child process) restarts itself there.
    not_ready: why the part cannot take work now though it is not stuck
    ("" when it can; e.g. "restarting"); asked at every look (cheap, thread-safe).
    """

    def __init__(
        self,
        name: str,
        has_work: Callable[[], bool],
        *,
        on_stuck: Callable[[Progress, float], None] | None = None,
        not_ready: Callable[[], str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.count = 0
        self.has_work = has_work
        self.on_stuck = on_stuck
        self.not_ready = not_ready
        self.pace_s: float | None = None
        self._clock = clock
        self._last_turn = clock()

    def advance(self, seconds: float | None = None, n: int = 1) -> None:
        """The loop came round `n` times; `seconds`: how long its last turn
        took (default: the time since the last advance)."""
        now = self._clock()
        took = now - self._last_turn if seconds is None else seconds
        self._last_turn = now
        self.count += n
        self.note_pace(took)

    def note_pace(self, seconds: float) -> None:
        """Fold one turn's duration into the recent pace (an exponential average)."""
        if seconds < 0:
            return
        self.pace_s = seconds if self.pace_s is None else 0.8 * self.pace_s + 0.2 * seconds

    def set_count(self, count: int) -> None:
        """For a part whose loop runs elsewhere (a child process): the count it reported."""
        self.count = count


@dataclass
class _Watch:
    progress: Progress
    count: int
    since: float  # last change of the count, or the last look that found the part idle
    stuck: bool = False


def no_progress(seconds: float, limit_s: float) -> str:
    """How a stuck part's requests are told why they ended (the words every
    part uses: "made no progress for 2.3 s with work waiting (limit 2.0 s)")."""
    return f"made no progress for {seconds:.1f} s with work waiting (limit {limit_s:.1f} s)"


@dataclass(frozen=True)
class Stuck:
    """A part that has not moved while work waited."""

    name: str
    seconds: float
    limit_s: float

    def describe(self) -> str:
        return f"{self.name} made no progress for {self.seconds:.1f}s (limit {self.limit_s:.1f}s) with work waiting"


@dataclass(frozen=True)
class Waiting:
    """A part that is not stuck but cannot take work now (its `not_ready()`)."""

    name: str
    why: str

    def describe(self) -> str:
        return f"{self.name} is {self.why}"


def describe_unready(stuck: list[Stuck], waiting: list[Waiting]) -> str:
    """Why a service is not ready, in one line."""
    return "; ".join([s.describe() for s in stuck] + [w.describe() for w in waiting])


class Watchdog:
    """Judges every registered part (see the module docstring).

    on_change(ready, live, stuck): called on the watchdog's thread whenever
    readiness or liveness changes (e.g. to set gRPC health); `waiting()`
    names the parts not ready for another reason at that look."""

    def __init__(
        self,
        limits: StallLimits | None = None,
        *,
        interval_s: float = 0.25,
        on_change: Callable[[bool, bool, list[Stuck]], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        name: str = "watchdog",
    ) -> None:
        self.limits = limits or StallLimits()
        self.interval_s = interval_s
        self.on_change = on_change
        self._clock = clock
        self._lock = threading.Lock()
        self._watches: dict[str, _Watch] = {}
        self._stuck: list[Stuck] = []
        self._waiting: list[Waiting] = []
        self.ready = True
        self.live = True
        self.episodes = 0  # parts that became stuck, since start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    # -- parts ---------------------------------------------------------------------
    def watch(self, progress: Progress) -> Progress:
        """Judge `progress` from now on (a part of that name is replaced)."""
        with self._lock:
            self._watches[progress.name] = _Watch(progress, progress.count, self._clock())
        return progress

    def forget(self, name: str) -> None:
        with self._lock:
            self._watches.pop(name, None)

    def limit_s(self, progress: Progress) -> float:
        pace = progress.pace_s or 0.0
        return max(self.limits.floor_s, self.limits.factor * pace)

    def stuck(self) -> list[Stuck]:
        """The parts stuck at the last look."""
        with self._lock:
            return list(self._stuck)

    def waiting(self) -> list[Waiting]:
        """The parts not ready at the last look though not stuck (restarting, ...)."""
        with self._lock:
            return list(self._waiting)

    # -- the thread ----------------------------------------------------------------
    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.look()
            except Exception:  # noqa: BLE001 -- the watchdog must outlive a bad part
                logger.exception("liveness watchdog: a look failed")

    def look(self) -> list[Stuck]:
        """One look at every part (the thread's loop; tests call it directly)."""
        now = self._clock()
        newly: list[tuple[Progress, float]] = []
        stuck: list[Stuck] = []
        waiting: list[Waiting] = []
        longest = 0.0
        with self._lock:
            watches = list(self._watches.values())
        for w in watches:
            p = w.progress
            count = p.count
            why = _not_ready(p)
            if why:
                waiting.append(Waiting(p.name, why))
            try:
                busy = bool(p.has_work())
            except Exception:  # noqa: BLE001 -- a part whose question fails is judged busy
                logger.exception("liveness: %s: has_work failed", p.name)
                busy = True
            if count != w.count or not busy:
                w.count, w.since = count, now
                if w.stuck:
                    logger.warning("liveness: %s moves again", p.name)
                w.stuck = False
                continue
            idle_for = now - w.since
            limit = self.limit_s(p)
            if idle_for <= limit:
                continue
            stuck.append(Stuck(p.name, idle_for, limit))
            longest = max(longest, idle_for)
            if not w.stuck:
                w.stuck = True
                newly.append((p, idle_for))
        ready = not stuck and not waiting
        live = longest <= self.limits.grace_s
        with self._lock:
            self._stuck, self._waiting = stuck, waiting
            changed = ready != self.ready or live != self.live
            self.ready, self.live = ready, live
            self.episodes += len(newly)
        for p, idle_for in newly:
            logger.error("liveness: %s made no progress for %.1fs with work waiting (limit %.1fs)",
                         p.name, idle_for, self.limit_s(p))
            if p.on_stuck is not None:
                try:
                    p.on_stuck(p, idle_for)
                except Exception:  # noqa: BLE001 -- the verdict stands; the next episode tries again
                    logger.exception("liveness: recovering %s failed", p.name)
        if changed:
            if not live:
                logger.error("liveness: stuck past the %.0fs grace: reporting not live (%s)",
                             self.limits.grace_s, "; ".join(s.describe() for s in stuck))
            if self.on_change is not None:
                self.on_change(ready, live, stuck)
        return stuck


def _not_ready(p: Progress) -> str:
    if p.not_ready is None:
        return ""
    try:
        return p.not_ready()
    except Exception:  # noqa: BLE001 -- a part whose question fails is judged ready (it may be stuck)
        logger.exception("liveness: %s: not_ready failed", p.name)
        return ""
