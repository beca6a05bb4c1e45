"""A link's dispatcher: each submitted snapshot is sent, queued behind earlier steps, or built now.

One thread. It turns snapshots into StepSnapshot messages and puts them on
the current stream, or, while there is no stream, builds them in-process at
once. It never waits on the materializer and never connects. While a
handover is under way, steps wait unsent (``LinkState.unsent``) and go out,
in order, once a stream is attached (``FLUSH``). A step that no slot was
free for (``submit(meta, build_local=True)``) is built in-process, but only
once the steps before it were delivered; so is a step that cannot be encoded.
The exception is a handover: steps waiting for the replacement hold slots,
so a step that found none then is not the materializer's fault; it waits
and goes to the replacement with its (detached) tensors inline, as do the
steps that find no slot while the drained materializer still answers what
it was sent, or while the replacement answers that backlog and then the
steps sent to it meanwhile (``Stream.catch_up``): the old materializer's
last steps and a cold replacement catching up hold the slots, not one that
cannot keep up.

On a stream of inline transport the tensors are copied out of the slot into
the message (``SnapshotMeta.to_proto``); the slot stays held until the step
is answered, as with handles.

Liveness (``omni_common.liveness``): the loop advances ``progress`` itself
once per item it has handled; work waits while an item is being handled or
the inbox holds any (steps waiting to go out). A dispatcher wedged in a step
stops its counter while steps pile up: the decoder's watchdog judges it.
"""

from __future__ import annotations

import logging
import time

from decoder_svc import metrics
from decoder_svc.link.delivery import Delivery
from decoder_svc.link.failover import Failover
from decoder_svc.link.state import FLUSH, STOP, Entry, LinkState, Stream
from decoder_svc.snapshot import SnapshotMeta
from omni_common.liveness import Progress
from omni_serving.v1 import materializer_pb2

logger = logging.getLogger(__name__)


class Dispatcher:
    """The loop behind ``MaterializerLink.submit`` (module docstring)."""

    def __init__(self, state: LinkState, delivery: Delivery, failover: Failover) -> None:
        self.state = state
        self.delivery = delivery
        self.failover = failover
        self.handling = False  # an item taken from the inbox is being handled
        self.progress = Progress(f"link:{state.name}", self.has_work)
        self._no_slot_logged_s = float("-inf")

    def has_work(self) -> bool:
        """Steps wait for the loop: one is being handled, or the inbox holds some."""
        return self.handling or not self.state.inbox.empty()

    def loop(self) -> None:
        """Serve the inbox until STOP (the dispatcher thread)."""
        while True:
            item = self.state.inbox.get()
            self.handling = True
            t0 = time.monotonic()
            try:
                if self._handle(item):
                    return
            finally:
                self.handling = False
                self.progress.advance(time.monotonic() - t0)

    def _handle(self, item) -> bool:
        """One item of the inbox; True at STOP (the loop ends)."""
        if item is STOP:
            try:
                self._drain_on_close()
            except Exception:  # noqa: BLE001 -- close() takes the rest over
                logger.exception("materializer link: draining at shutdown failed")
            return True
        if item is FLUSH:
            self.flush_unsent()
            return False
        meta, local = item
        try:
            self._dispatch(meta, local)
        except Exception as exc:  # noqa: BLE001 -- fail this step, keep serving
            self.delivery.fail(meta, exc, "link_dispatcher")
        return False

    def _encode(self, meta: SnapshotMeta, stream: Stream) -> materializer_pb2.MaterializeRequest:
        inline = stream.attachment is not None and stream.attachment.transport == "inline"
        snap = meta.to_proto(inline_from=self.state.arena) if inline and meta.handles else meta.to_proto()
        return materializer_pb2.MaterializeRequest(snapshot=snap)

    def _encode_failed(self, meta: SnapshotMeta) -> None:
        metrics.INTERNAL_ERRORS.labels("link_encode").inc()
        logger.exception("step %d could not be encoded; building it in-process", meta.step_id)

    def _send(self, entry: Entry) -> bool:
        """Send a step on the current stream, after the steps that waited for
        it; False when there is no stream (or the step cannot be encoded:
        then entry.local says so)."""
        st = self.state
        self.flush_unsent()
        while True:
            with st.lock:
                stream = st.stream
            if stream is None:
                return False
            try:
                request = self._encode(entry.meta, stream)
            except Exception:  # noqa: BLE001 -- a step that cannot be encoded is built here
                self._encode_failed(entry.meta)
                entry.local = "encode_error"
                return False
            with st.lock:
                if st.stream is stream and not st.unsent:
                    self.delivery.append(entry)
                    stream.put(entry, request)
                    if entry.handover:
                        stream.backlog += 1
                    return True
            self.flush_unsent()  # the stream changed meanwhile: try again

    def flush_unsent(self) -> None:
        """Send the steps that waited for a stream, in order (dispatcher only)."""
        st = self.state
        failed = False
        while True:
            with st.lock:
                stream = st.stream
                if stream is None or not st.unsent:
                    break
                entry = st.unsent[0]
            try:
                request: materializer_pb2.MaterializeRequest | None = self._encode(
                    entry.meta, stream
                )
            except Exception:  # noqa: BLE001 -- built in-process when its turn comes
                self._encode_failed(entry.meta)
                request = None
            with st.lock:
                if not st.unsent or st.unsent[0] is not entry:
                    continue  # taken over meanwhile (failover)
                if request is None:
                    st.unsent.popleft()
                    entry.local = "encode_error"
                    failed = True
                    continue
                if st.stream is not stream:
                    continue
                st.unsent.popleft()
                stream.put(entry, request)
                stream.backlog += 1
        if failed:
            self.delivery.deliver_heads()

    def _dispatch(self, meta: SnapshotMeta, local: str | None) -> None:
        """Send a step, queue it behind the pending ones, or build it now.

        local: why this step must be built in-process (None: send it when
        there is a stream)."""
        st = self.state
        entry = Entry(meta, local)
        if local == "no_slot":
            held = self._handover_holds_slots()
            if held == "inline":
                # The slots are held by steps that wait for (or were just
                # handed to) a replacement, not by a materializer that cannot
                # keep up: the step goes to the replacement too, its detached
                # tensors inline, instead of being built in-process.
                entry.local, entry.handover = None, True
            else:
                # "full": a handover holds the slots but its backlog reached
                # max_pending; counted apart from a materializer that lags
                entry.local = local = "handover_full" if held == "full" else local
                self._log_no_slot(meta, local)
        while True:
            if entry.local is None and self._send(entry):  # the usual case
                return
            with st.deliver_lock:
                with st.lock:
                    if entry.local is None and st.stream is not None:
                        retry = True  # a stream was attached meanwhile
                    elif entry.local is None and st.handover is not None:
                        # waiting for a replacement: the step waits, unsent
                        self.delivery.append(entry)
                        st.unsent.append(entry)
                        return
                    elif entry.local is not None and st.pending:
                        self.delivery.append(entry)  # built when its turn comes
                        return
                    else:
                        retry = False
                        reason = entry.local or st.local_reason
                if not retry:
                    # No stream (or a local step with nothing before it): build
                    # now. The deliver lock is held from the check on, so a
                    # receiver cannot deliver an earlier step after this one.
                    self.delivery.build_local(meta, reason)
                    return

    def _handover_holds_slots(self) -> str | None:
        """Whether a handover holds the slots: one is under way, a drained
        stream still answers the steps it was sent (its slots are held until
        it does), or the current stream has not yet answered the steps that
        waited for it and those sent to it while it answered them. "inline":
        yes, and that backlog is under max_pending; "full": yes, but the
        backlog reached max_pending (the step is built in-process); None: no
        handover holds them (a materializer that lags: ``no_slot``)."""
        st = self.state
        with st.lock:
            stream = st.stream
            if stream is None:
                if st.handover is None:
                    return None
                return "inline" if len(st.unsent) < st.max_pending else "full"
            draining = any(s.sent and not s.abandoned for s in st.old)
            if not (draining or stream.answers < max(stream.backlog, stream.catch_up)):
                return None
            return "inline" if stream.backlog < st.max_pending else "full"

    def _log_no_slot(self, meta: SnapshotMeta, reason: str) -> None:
        """Say why a step is built in-process for want of a slot (at most
        once every 10 s: under overload it is every step; the counter has them).
        Without a materializer, building in-process is the mode: nothing to say."""
        now = time.monotonic()
        if not self.state.target or now - self._no_slot_logged_s < 10.0:
            return
        self._no_slot_logged_s = now
        st = self.state
        with st.lock:
            stream = st.stream
            where = (
                "no stream"
                if stream is None
                else f"stream open {now - stream.opened_s:.1f}s, answered {stream.answers}, "
                f"{len(stream.sent)} unanswered, backlog {stream.backlog}, catch-up to {stream.catch_up}"
            )
            if st.handover is not None:
                where += ", handover under way"
            draining = sum(1 for s in st.old if s.sent and not s.abandoned)
            if draining:
                where += f", {draining} draining"
        logger.warning(
            "materializer %s: step %d found no free slot in time; built in-process (%s; %s)",
            st.target or "-",
            meta.step_id,
            reason,
            where,
        )

    def _drain_on_close(self) -> None:
        st = self.state
        deadline = time.monotonic() + st.drain_timeout_s
        while time.monotonic() < deadline:
            with st.lock:
                if not st.pending:
                    return
                head = st.pending[0]
                if head.stream is None and head.answer is None and head.local is None:
                    break  # it waits for a replacement that will not come now
            time.sleep(0.005)
        with st.lock:
            left = len(st.pending)
        if left:
            logger.warning(
                "materializer %s: %d steps unanswered at shutdown; building them in-process",
                st.target,
                left,
            )
            self.failover.fail_over_all("shutdown")
