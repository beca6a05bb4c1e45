"""The decode loop of one AR stage (``StageRunner``): the critical path.

Per step: forward + sample + eager postprocess (the backend's ``step``),
then the step's routed tensors are copied into a free slot of the arena and
a ``SnapshotMeta`` handed to the materializer link (a queue put), or, on the
synchronous path, the payloads are sliced here and delivered; the next step
launches at once. Nothing else happens on this thread between two steps but
the commands a stage process queues for it (``put_input``).

No exception ends the loop: a failure ends the requests in flight with an
error (``on_failure``; the log has the traceback) and the stage goes on
serving. Each turn of the loop (a step taken, or one that found nothing to
run) advances ``progress`` (``omni_common.liveness``): a loop that wedges
stops its counter while work waits, and the decoder's watchdog sees it.
A decode step never waits for an arena slot longer than
``acquire_timeout_s``: without one the step is built in-process.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from decoder_svc import metrics
from decoder_svc.backend import ARBackend, StepOutput
from decoder_svc.cuda_staging import CudaStaging
from decoder_svc.guards import GuardDecision
from decoder_svc.link.materializer_link import MaterializerLink
from decoder_svc.profile import StageConfig
from decoder_svc.snapshot import SnapshotMeta, meta_of, step_tensors, take_snapshot
from omni_common.errors import ResourceExhaustedError
from omni_common.liveness import Progress
from omni_common.materialize import LocalStep, build_local_step, sources_of
from omni_common.shm_arena import ShmArena, SlotLease
from omni_serving.v1 import materializer_pb2

logger = logging.getLogger(__name__)


class _LeaseWatch:
    """The arena as `take_snapshot` uses it, remembering the slot it handed
    out (a snapshot that fails half-way must not keep its slot) and how long
    the step waited for it (the link judges the materializer by that)."""

    def __init__(self, arena: ShmArena) -> None:
        self.arena = arena
        self.slot_bytes = arena.slot_bytes
        self.lease: SlotLease | None = None
        self.waited_s = 0.0

    def acquire(self, timeout: float | None) -> SlotLease:
        t0 = time.perf_counter()
        try:
            self.lease = self.arena.acquire(timeout)
        finally:
            self.waited_s = time.perf_counter() - t0
        return self.lease

    def release(self, slot: int, generation: int) -> bool:
        return self.arena.release(slot, generation)


class StageRunner:
    """The decode loop of one AR stage.

    Per step (the critical path):
      1) forward + sample + eager postprocess (the backend's `step`);
      2) async path: copy the routed tensors into a free arena slot and hand
         a SnapshotMeta to the link (a queue put) -- sync path: slice the
         payloads here (tensors, `build_local_step`) and deliver them;
      3) loop: the next step launches at once.

    Step 2 waits at most `acquire_timeout_s` for a free slot (all held: the
    materializer lags); then, and for the following steps until a slot is
    free again, the step's tensors are copied out and the link builds it
    in-process, after the steps before it.
    """

    def __init__(
        self,
        config: StageConfig,
        backend: ARBackend,
        decision: GuardDecision,
        *,
        arena: ShmArena | None,
        link: MaterializerLink | None,
        deliver: Callable[[materializer_pb2.MaterializedStep | LocalStep, SnapshotMeta], None],
        downstream: Callable[[list[str]], list[str]],
        on_failure: Callable[[BaseException], None],
        inline_transport: bool = False,
        acquire_timeout_s: float = 0.5,
    ) -> None:
        self.config = config
        self.acquire_timeout_s = acquire_timeout_s
        self._starved = False  # the last step found no slot: do not wait for one
        self.on_failure = on_failure
        self.backend = backend
        self.decision = decision
        self.arena = arena
        self.link = link
        self.deliver = deliver
        self.downstream = downstream
        self.inline_transport = inline_transport
        self.plan = config.plan()
        self.sources = sources_of(self.plan)
        self.steps = 0
        # liveness: one advance per loop turn; work waits while the loop last
        # found requests unfinished (recorded by the loop itself: the watchdog
        # never calls into a backend that may be the part that wedged) or
        # commands are queued
        self._has_work = False
        self.commands_taken = 0  # commands applied (a stage process reports it)
        self.progress = Progress(f"stage:{config.name}", self.has_work)
        # (step time, gap) of each step, for a consumer that drains it (a stage process's status)
        self.observations: collections.deque[tuple[float, float]] | None = None
        # commands the loop applies between steps with `take_input` (a stage
        # process's adds, extends and aborts; `put_input` queues one)
        self.inbox: collections.deque = collections.deque()
        self.take_input: Callable[[Any], None] = lambda item: None
        self.gaps_s: collections.deque[float] = collections.deque(maxlen=100_000)
        self.step_times_s: collections.deque[float] = collections.deque(maxlen=100_000)
        self._wake = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name=f"stage-{config.name}", daemon=True)
        self._step_ids = itertools.count(1)
        self._staging: CudaStaging | None = None  # created at the first CUDA step
        self._leases = _LeaseWatch(arena) if arena is not None else None
        self._m_gap = metrics.STEP_GAP.labels(config.name)
        self._m_step = metrics.STEP_TIME.labels(config.name)
        self._m_steps = metrics.STEPS.labels(config.name, "async" if decision.use_async else "sync")

    def start(self) -> None:
        self._thread.start()

    def notify(self) -> None:
        with self._wake:
            self._wake.notify()

    def put_input(self, item: Any) -> None:
        """Queue a command for the loop to apply before its next step."""
        self.inbox.append(item)
        self.notify()

    def has_work(self) -> bool:
        """Whether something waits for the loop (cheap, any thread, never
        calls the backend)."""
        return self._has_work or bool(self.inbox)

    def _wake_up(self) -> bool:
        self._has_work = self.backend.has_unfinished()
        return self._stop or bool(self.inbox) or self._has_work

    def stop(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join(timeout=30)
        if self._staging is not None:
            self._staging.close()

    def _loop(self) -> None:
        inbox = self.inbox
        while True:
            try:
                with self._wake:
                    self._wake.wait_for(self._wake_up)
                    if self._stop:
                        return
                # requests' commands, between two steps, on this thread: none
                # of them waits for the engine while steps follow each other
                if inbox:
                    while inbox:
                        self.commands_taken += 1
                        self.take_input(inbox.popleft())
                    self._has_work = self.backend.has_unfinished()
                    if not self._has_work:
                        self.progress.advance(0.0)
                        continue
            except Exception as exc:  # noqa: BLE001 -- the stage keeps serving
                self._failed(exc)
                time.sleep(0.05)  # a backend that keeps failing must not spin
                continue
            t0 = time.perf_counter()
            try:
                # 1) forward + sample + eager postprocess
                out = self.backend.step()
                t_sampled = time.perf_counter()
                if out is None:
                    continue
                self.steps += 1
                # 2) hand the step's outputs off (or build them, on the sync path)
                self._emit(out)
            except Exception as exc:  # noqa: BLE001 -- nothing partial goes out: the requests in flight fail loudly, the stage keeps serving
                self._failed(exc)
                continue
            finally:
                # one turn (a step, none to take, or a failure): the loop moves
                self.progress.advance(time.perf_counter() - t0)
            t_launch = time.perf_counter()
            self.step_times_s.append(t_sampled - t0)
            self.gaps_s.append(t_launch - t_sampled)
            if self.observations is not None:
                self.observations.append((t_sampled - t0, t_launch - t_sampled))
            self._m_gap.observe(t_launch - t_sampled)
            self._m_step.observe(t_sampled - t0)
            self._m_steps.inc()

    def _failed(self, exc: BaseException) -> None:
        metrics.INTERNAL_ERRORS.labels("stage").inc()
        logger.error("stage %s: decode step failed; failing the requests in flight",
                     self.config.name, exc_info=exc)
        try:
            self.on_failure(exc)
        except Exception:  # noqa: BLE001 -- the stage keeps serving
            logger.exception("stage %s: failing the requests in flight failed", self.config.name)

    def _emit(self, out: StepOutput) -> None:
        meta = meta_of(
            out,
            step_id=next(self._step_ids),
            stage_id=self.config.stage_id,
            downstream_request_ids=self.downstream(out.request_ids),
            connector_signals=[],
        )
        tensors = step_tensors(out, self.sources)
        if self.decision.use_async and self.link is not None:
            arena = None if self.inline_transport else self.arena
            if arena is None or self._leases is None:
                self.link.submit(take_snapshot(meta, tensors, None))
                return
            if self._staging is None and any(t.is_cuda for t, _ in tensors.values()):
                device = next(t.device for t, _ in tensors.values() if t.is_cuda)
                self._staging = CudaStaging(arena, device)
            leases = self._leases
            leases.lease = None
            leases.waited_s = 0.0
            timeout = 0.0 if self._starved else self.acquire_timeout_s
            try:
                snap = take_snapshot(meta, tensors, leases, timeout, staging=self._staging)
            except ResourceExhaustedError:
                self.link.note_slot_wait(leases.waited_s)
                # No slot within the bound (or the step outgrew it): copy the
                # tensors out; the link builds the step in-process, in order.
                self._starved = self._starved or leases.lease is None
                meta.handles = {}
                self.link.submit(take_snapshot(meta, tensors, None), build_local=True)
                return
            except BaseException:
                if leases.lease is not None and meta.lease is None:
                    arena.release(leases.lease.slot, leases.lease.generation)
                raise
            if leases.lease is not None:
                self._starved = False
            if leases.waited_s > 1e-3:
                self.link.note_slot_wait(leases.waited_s)
            self.link.submit(snap)
            return
        # synchronous path: slice here, from the step's own tensors, and route
        # the slices as they are (no serialisation; the router copies what it
        # keeps). Device tensors (CUDA hosts) come to the host first: the
        # slicing reads values. A host tensor's .cpu() is itself.
        host = {name: (t.cpu(), layout) for name, (t, layout) in tensors.items()}
        self.deliver(build_local_step(meta.view_over(host), self.plan), meta)
