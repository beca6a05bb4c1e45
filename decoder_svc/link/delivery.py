"""In-order delivery of a link's steps: answered by the materializer, or built in-process.

Every submitted step waits in ``LinkState.pending`` until its turn: the head
of the queue is delivered once it has an answer, or once it is to be built
in-process (``Entry.local`` says why); the steps behind it wait. One delivery
at a time (``deliver_lock``), in step order on every path.

A step built in-process (``build_local_step``) is delivered as a
``LocalStep``: its payloads are tensors viewing the slot (or the detached
copies), never serialised; the slot is released once the delivery returns.
A step the materializer answered is delivered as its ``MaterializedStep``; a
``StepError`` answer has that step built in-process. An exception while
building or delivering a step fails that step's requests (``fail_step``) and
frees its slot; the threads keep serving.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable

from decoder_svc import metrics
from decoder_svc.link.state import Entry, LinkState
from decoder_svc.snapshot import SnapshotMeta
from omni_common.materialize import LocalStep, build_local_step
from omni_serving.v1 import materializer_pb2

logger = logging.getLogger(__name__)

Deliver = Callable[[materializer_pb2.MaterializedStep | LocalStep, SnapshotMeta], None]
"""Routes a step: as the materializer answered it, or built in-process (tensors)."""
FailStep = Callable[[SnapshotMeta, BaseException], None]


class Delivery:
    """The pending queue's head-of-line delivery, and building a step in-process."""

    def __init__(self, state: LinkState, deliver: Deliver, fail_step: FailStep | None) -> None:
        self.state = state
        self.deliver = deliver
        self.fail_step = fail_step
        self.fallback_steps = 0
        self.fallback_by_reason: collections.Counter[str] = collections.Counter()
        self.remote_steps = 0
        self.failed_steps = 0
        self.in_flight_peak = 0

    def append(self, entry: Entry) -> None:
        """Queue a step behind the pending ones (under the state's lock)."""
        st = self.state
        st.pending.append(entry)
        self.in_flight_peak = max(self.in_flight_peak, len(st.pending))

    def deliver_heads(self) -> None:
        """Deliver the steps at the head of the queue whose turn came: answered
        ones, and those to build in-process."""
        st = self.state
        with st.deliver_lock:
            while True:
                with st.lock:
                    if not st.pending:
                        return
                    head = st.pending[0]
                    if head.answer is None and head.local is None:
                        return
                    st.pending.popleft()
                self.deliver_entry(head)

    def deliver_entry(self, entry: Entry) -> None:
        """Deliver one step whose turn it is (under deliver_lock)."""
        resp = entry.answer
        if resp is None:
            self.build_local(entry.meta, entry.local or "no_slot")
        elif resp.WhichOneof("kind") == "step":
            self.remote_steps += 1
            self.finish(resp.step, entry.meta)
        else:
            logger.warning(
                "materializer failed step %d (code %d: %s); building it in-process",
                entry.meta.step_id,
                resp.error.code,
                resp.error.message,
            )
            self.build_local(entry.meta, "step_error")

    def build_local(self, meta: SnapshotMeta, reason: str) -> None:
        st = self.state
        with st.deliver_lock:
            if st.target:  # without a target, in-process building is the mode, not a fallback
                self.fallback_steps += 1
                self.fallback_by_reason[reason] += 1
                metrics.FALLBACK_STEPS.labels(reason).inc()
            try:
                # tensors viewing the slot, handed to the router as they are: the
                # router copies what it keeps, the slot is released after it
                built = build_local_step(meta.local_view(st.arena), st.plans[meta.stage_id])
            except Exception as exc:  # noqa: BLE001 -- fail this step's requests, keep serving
                self.fail(meta, exc, "link_build")
                return
            self.finish(built, meta)

    def finish(self, step: materializer_pb2.MaterializedStep | LocalStep, meta: SnapshotMeta) -> None:
        try:
            self.deliver(step, meta)
        except Exception as exc:  # noqa: BLE001 -- fail this step's requests, keep serving
            self.fail(meta, exc, "link_deliver")
        finally:
            self.release(meta)

    def release(self, meta: SnapshotMeta) -> None:
        lease = meta.lease
        arena = self.state.arena
        if lease is not None and arena is not None:
            meta.lease = None
            arena.release(lease.slot, lease.generation)

    def fail(self, meta: SnapshotMeta, exc: BaseException, where: str) -> None:
        """A step could not be built or delivered: fail its requests, free its slot."""
        self.failed_steps += 1
        metrics.INTERNAL_ERRORS.labels(where).inc()
        logger.error(
            "step %d of stage %d failed (%s); failing its %d request(s)",
            meta.step_id,
            meta.stage_id,
            where,
            len(meta.request_ids),
            exc_info=exc,
        )
        try:
            if self.fail_step is not None:
                self.fail_step(meta, exc)
        except Exception:  # noqa: BLE001 -- the slot is freed below whatever happens
            logger.exception("failing the requests of step %d failed", meta.step_id)
        finally:
            self.release(meta)
