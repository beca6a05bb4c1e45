"""The stall watchdog of a link: cancel a stream whose materializer stopped answering or lags.

The connector (``.transport``) calls :meth:`Watchdog.watch` on the current
stream and :meth:`Watchdog.watch_draining` on the drained ones every 50 ms.

Each stream is judged by its own sent steps (``Stream.sent``) and its own
clock (``Stream.progress_s``: its last answer, or when it was last given
work while idle), never by the link-wide pending queue: during a handover
that queue starts with the old, draining stream's steps and holds the
backlog that waited for the replacement, neither of which the new stream
can be blamed for.

- The current stream is cancelled when its materializer stops answering
  (``stall_timeout_s`` without an answer while steps it was sent wait:
  stall) or cannot keep up (slow: its oldest unanswered step was sent more
  than that ago, more than ``max_pending`` steps are held up behind that
  step (sent on it, or waiting to be built in-process in their turn), or decode
  steps spent more than half of the last ``stall_timeout_s`` waiting for
  arena slots while no drained stream held any). The steps that waited for
  it during a handover and were sent on attach (``Stream.backlog``) count
  against its clock, not against ``max_pending``: a stream that has just
  been handed a backlog has had no chance to answer yet. Nor do steps
  ahead of its oldest one (a drained stream's). Until the backlog is
  answered, the age rule does not apply either (the stall rule does): a
  cold replacement answering a backlog sent at once is not slow, and a
  step's age counts from when the backlog was done.
- A drained stream (StreamDraining; it only answers what it was sent) that
  answers nothing for ``stall_timeout_s`` while steps it was sent wait is
  abandoned: it is cancelled with the reason ``drain_stall`` and just its
  unanswered steps are built in-process; the current stream is untouched.

The cancel ends the stream's receiver, which fails over (``.failover``)
with the reason (a drained stream: builds only its own steps).
"""

from __future__ import annotations

import time

from decoder_svc.link.state import LinkState, Stream


class Watchdog:
    """Judges each stream by its own answers, and the current one by the decode steps' slot waits."""

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
        """Cancel the current stream if its materializer stopped answering
        (stall) or falls behind (slow), judged by the steps sent on it."""
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
            if st.old:
                blocked = 0.0  # a drained stream's steps hold slots too: not this one's doing
            waiting = len(stream.sent)
            if not waiting and blocked <= 0.5:
                return
            since_answer = now - stream.progress_s if waiting else 0.0
            # While it answers the handover's backlog (sent at once on attach,
            # to a replacement that may be cold) only the stall rule and the
            # count apply; a step's age counts from when the backlog was done.
            in_backlog = stream.backlog > stream.answers
            head_age = (
                now - max(stream.sent[0].sent_s, stream.backlog_done_s)
                if waiting and not in_backlog
                else 0.0
            )
            held_up = self._held_up(stream)
            answers = stream.answers
        if since_answer >= st.stall_timeout_s:  # nothing came back for the whole deadline
            reason = "stall"
        elif held_up > st.max_pending:
            # stalled if nothing came back for a second (or ever), else slow
            reason = "stall" if since_answer >= 1.0 or not answers else "slow"
        elif head_age > st.stall_timeout_s or blocked > 0.5:
            reason = "slow"
        else:
            return
        detail = (
            f"decode waited for slots {blocked:.0%} of the last {st.stall_timeout_s:g}s, "
            if blocked > 0.5
            else ""
        )
        detail += (
            f"oldest step sent {head_age:.1f}s ago, no answer for "
            f"{since_answer:.1f}s, {held_up} steps held up behind it"
        )
        self._cancel(stream, reason, detail)

    def _held_up(self, stream: Stream) -> int:
        """Steps that wait on this stream (under the lock): its oldest unanswered
        step and every step queued behind it (sent on it, or to be built
        in-process once their turn comes), less the handover backlog it has
        not answered yet. Steps ahead of it (a drained stream's) are not its."""
        if not stream.sent:
            return 0
        head = stream.sent[0]
        count = 0
        for entry in reversed(self.state.pending):
            count += 1
            if entry is head:
                break
        return count - max(0, stream.backlog - stream.answers)

    def watch_draining(self) -> None:
        """Abandon a drained stream that answers nothing for stall_timeout_s
        while steps it was sent wait: only its own steps are built in-process."""
        st = self.state
        now = time.monotonic()
        with st.lock:
            stuck = [
                (s, len(s.sent), now - s.progress_s)
                for s in st.old
                if s.sent and not s.abandoned and s.cancel_reason is None
                and now - s.progress_s >= st.stall_timeout_s
            ]
        for stream, waiting, since_answer in stuck:
            self._cancel(
                stream,
                "drain_stall",
                f"draining, no answer for {since_answer:.1f}s, {waiting} steps waiting",
            )

    @staticmethod
    def _cancel(stream: Stream, reason: str, detail: str) -> None:
        stream.cancel_detail = detail
        stream.cancel_reason = reason
        stream.call.cancel()
