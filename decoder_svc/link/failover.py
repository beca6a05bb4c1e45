"""A link's failover to in-process building, and its handover to a draining materializer's successor.

Failover. The stream breaks, stalls or lags (``.watchdog``), the receiver
fails, or a handover finds no replacement in time: the link switches to
in-process building (one log line, one metric), every pending step is
delivered in order (answered ones as answered, the others built
in-process), and so is every later step until the connector has a new
stream. Steps built in-process are never sent again; the switch back happens
between two steps. A stream that failed without answering, stalled or lagged
counts a strike: the connector waits ``reconnect_interval_s * 2**strikes``
(at most 30 s) before it tries again.

Handover. A materializer that stops sends StreamDraining (contract 2). The
link stops sending on that stream at once and half-closes it; its receiver
keeps reading it until it ends. Later steps wait, unsent and in order,
while the connector opens a new stream (to the message's successor, else
the same target). An old stream that ends with steps unanswered (its grace
period passed, it died) has just those steps built in-process.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time

from decoder_svc import metrics
from decoder_svc.link.delivery import Delivery
from decoder_svc.link.state import STOP, Attachment, Entry, Handover, LinkState, Stream
from omni_serving.v1 import materializer_pb2

logger = logging.getLogger(__name__)

# A stream that failed without answering, stalled or lagged is retried after
# reconnect_interval_s * 2**strikes, at most this long.
MAX_BACKOFF_S = 30.0
# A stream that ran this long before failing counts as healthy again.
_HEALTHY_STREAM_S = 30.0


def publish(previous: Attachment | None, current: Attachment | None) -> None:
    """The info gauge: one series, for the attached instance."""
    if previous is not None and previous != current:
        with contextlib.suppress(KeyError):
            metrics.MATERIALIZER_INFO.remove(*metrics.attachment_labels(previous))
    if current is not None:
        metrics.MATERIALIZER_INFO.labels(*metrics.attachment_labels(current)).set(1)


class Failover:
    """Switches between the materializer and in-process building, and hands over."""

    def __init__(self, state: LinkState, delivery: Delivery) -> None:
        self.state = state
        self.delivery = delivery
        self.handovers = 0
        self.switches: collections.Counter[tuple[str, str]] = collections.Counter()

    # -- attaching (the transport opened a stream; under deliver_lock) --------------------
    def attached(self, attachment: Attachment, handover: Handover | None, waiting: int,
                 was_local_s: float) -> None:
        """Count and log a new stream: a handover's, or a switch back from in-process."""
        if handover is not None:
            self.handovers += 1
            metrics.MATERIALIZER_ATTACHMENTS.labels("handover").inc()
            logger.info(
                "materializer %s: handover from instance %s (%s) to %s; %d waiting steps "
                "go there",
                attachment.target,
                handover.old_instance or "?",
                handover.reason or "draining",
                attachment.describe(),
                waiting,
            )
        else:
            metrics.MATERIALIZER_ATTACHMENTS.labels("connect").inc()
            logger.info(
                "materializer %s: attached to %s", attachment.target, attachment.describe()
            )
            self.switch("to_remote", "connected", in_process_s=was_local_s)

    # -- draining ----------------------------------------------------------------------------
    def on_draining(self, stream: Stream, msg: materializer_pb2.StreamDraining) -> None:
        """The materializer stops: send nothing more on this stream, keep
        reading it, and have the connector attach a replacement."""
        st = self.state
        with st.lock:
            if stream.abandoned or stream.draining:
                return
            stream.draining = True
            current = st.stream is stream
            if current:
                old = stream.attachment.instance_id if stream.attachment else ""
                # empty successor: the same target as this stream's (a successor's, after one)
                target = msg.successor or st.dial_target or st.target or ""
                st.stream = None
                st.old.append(stream)
                st.handover = Handover(time.monotonic(), old, target, msg.reason)
                st.dial_target = target
            in_flight = len(stream.sent)
        stream.outbox.put(STOP)  # half-close: what was sent is still answered
        who = stream.attachment.describe() if stream.attachment else "materializer"
        logger.info(
            "materializer %s: %s is draining (%s, grace %d ms, %d steps in flight); "
            "attaching to %s",
            st.dial_target,
            who,
            msg.reason or "no reason given",
            msg.grace_ms,
            in_flight,
            msg.successor or "its replacement",
        )
        if current:
            st.next_try = 0.0
            st.wake.set()

    def stream_ended(self, stream: Stream, reason: str) -> None:
        """A stream's call is over. The current one: fail over. A drained one:
        done; steps it left unanswered are built in-process."""
        st = self.state
        with st.deliver_lock:
            with st.lock:
                if stream.abandoned:
                    return
                current = st.stream is stream
                drained = stream in st.old
                left: list[Entry] = []
                if drained:
                    st.old.remove(stream)
                    stream.abandoned = True
                    left = list(stream.sent)
                    stream.sent.clear()
                    for entry in left:
                        entry.local = reason
            if current:
                self.fail_over_all(reason, stream.cancel_detail, ended=stream)
                return
            if not drained:
                return
            who = stream.attachment.describe() if stream.attachment else "materializer"
            if left:
                logger.warning(
                    "materializer %s: the drained stream of %s ended (%s) with %d "
                    "steps unanswered; building them in-process",
                    st.target,
                    who,
                    reason,
                    len(left),
                )
            else:
                logger.info("materializer %s: the drained stream of %s ended", st.target, who)
            self.delivery.deliver_heads()

    # -- failing over --------------------------------------------------------------------------
    def fail_over_all(self, reason: str, detail: str = "", ended: Stream | None = None) -> None:
        """Switch to in-process building: every pending step is delivered in
        order (answered ones as answered, the others built in-process), every
        stream is dropped."""
        st = self.state
        with st.deliver_lock:
            with st.lock:
                current = st.stream
                streams = [s for s in (current, *st.old) if s is not None]
                handover = st.handover
                if not streams and handover is None and not st.pending:
                    return
                st.stream = None
                st.old = []
                st.handover = None
                entries = list(st.pending)
                st.pending.clear()
                st.unsent.clear()
                for s in streams:
                    s.abandoned = True
                    s.sent.clear()
                rebuilt = 0
                for entry in entries:
                    if entry.answer is None:
                        entry.local = entry.local or reason
                        rebuilt += 1
                st.local_reason = reason
                st.local_since = time.monotonic()
                st.dial_target = st.target
                previous, st.attachment = st.attachment, None
            for s in streams:
                s.outbox.put(STOP)
            publish(previous, None)
            if reason == "shutdown" and not rebuilt:
                metrics.set_mode(False)
            else:
                self.switch("to_in_process", reason, rebuilt=rebuilt, detail=detail)
            for entry in entries:
                self.delivery.deliver_entry(entry)
        judged = ended or current or (streams[0] if streams else None)
        if judged is not None:
            lived = time.monotonic() - judged.opened_s
            bad = (
                reason in ("stall", "slow", "protocol_error", "no_replacement")
                or judged.answers == 0
            )
        else:
            lived, bad = 0.0, True
        st.strikes = st.strikes + 1 if bad and lived < _HEALTHY_STREAM_S else 0
        delay = st.reconnect_interval_s * 2**st.strikes if st.strikes else 0.0
        st.next_try = time.monotonic() + min(MAX_BACKOFF_S, delay)
        for s in streams:
            if not (s is ended and reason == "stream_closed"):
                s.call.cancel()
        st.wake.set()

    def switch(
        self,
        direction: str,
        reason: str,
        rebuilt: int = 0,
        in_process_s: float = 0.0,
        detail: str = "",
    ) -> None:
        """Count and log a switch (to_remote / to_in_process) and set the mode gauge."""
        target = self.state.target
        first = not self.switches
        self.switches[(direction, reason)] += 1
        metrics.MATERIALIZER_SWITCHES.labels(direction, reason).inc()
        metrics.set_mode(direction == "to_remote")
        if direction == "to_remote" and first:
            logger.info("materializer %s: stream open", target)
        elif direction == "to_remote":
            logger.warning(
                "materializer %s: stream open; building on the materializer again "
                "(after %.1fs in-process)",
                target,
                in_process_s,
            )
        else:
            logger.warning(
                "materializer %s: %s%s; building in-process (%d pending steps rebuilt), "
                "reconnecting in the background",
                target,
                reason,
                f" ({detail})" if detail else "",
                rebuilt,
            )
