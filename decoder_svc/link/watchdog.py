"""The stall watchdog of a link: cancel a stream whose materializer stopped answering or lags.

The connector (``.transport``) calls :meth:`Watchdog.watch` on the current
stream every 50 ms. It cancels the stream when the materializer stops
answering (``stall_timeout_s`` without an answer while steps wait: stall)
or cannot keep up (slow: the oldest waiting step is older than that, more
than ``max_pending`` steps wait, or decode steps spent more than half of the
last ``stall_timeout_s`` waiting for arena slots it holds). The cancel ends
the stream's receiver, which fails over (``.failover``) with the reason.
"""

from __future__ import annotations

import time

from decoder_svc.link.state import LinkState, Stream


class Watchdog:
    """Judges the current stream by its answers and by the decode steps' slot waits."""

    def __init__(self, state: LinkState) -> None:
        self.state = state
        self._slot_wait_s = 0.0  # decode time spent waiting for slots, this window
        self._window_start = time.monotonic()

    def note_slot_wait(self, seconds: float) -> None:
        """A decode step waited this long for an arena slot (all held by steps
        the materializer has not answered)."""
        self._slot_wait_s += seconds

    def reset_window(self) -> None:
        """A new stream: its slot waits count from now."""
        self._window_start = time.monotonic()
        self._slot_wait_s = 0.0

    def watch(self, stream: Stream) -> None:
        """Cancel a stream whose materializer stopped answering (stall) or
        falls behind (slow): no answer for stall_timeout_s while steps wait,
        the oldest waiting step older than that, or more than max_pending
        steps waiting."""
        st = self.state
        now = time.monotonic()
        window = now - self._window_start
        blocked = 0.0
        if window >= st.stall_timeout_s:
            blocked = self._slot_wait_s / window
            self._slot_wait_s = 0.0
            self._window_start = now
        with st.lock:
            if st.stream is not stream:
                return
            if not st.pending:
                if blocked <= 0.5:
                    return
                head, pending, since_answer = None, 0, 0.0
            else:
                since_answer = now - st.last_progress
                head = st.pending[0].meta
                pending = len(st.pending)
        head_age = time.perf_counter() - head.created_s if head is not None else 0.0
        if since_answer >= st.stall_timeout_s:  # nothing came back for the whole deadline
            reason = "stall"
        elif pending > st.max_pending:
            # stalled if nothing came back for a second (or ever), else slow
            reason = "stall" if since_answer >= 1.0 or not stream.answers else "slow"
        elif head_age > st.stall_timeout_s or blocked > 0.5:
            reason = "slow"
        else:
            return
        stream.cancel_detail = (
            f"decode waited for slots {blocked:.0%} of the last {st.stall_timeout_s:g}s, "
            if blocked > 0.5
            else ""
        )
        stream.cancel_detail += (
            f"oldest step waiting {head_age:.1f}s, no answer for "
            f"{since_answer:.1f}s, {pending} steps waiting"
        )
        stream.cancel_reason = reason
        stream.call.cancel()
