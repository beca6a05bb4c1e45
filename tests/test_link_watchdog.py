"""The link's stall watchdog and dispatcher during a materializer handover (unit, no process).

A real ``LinkState``, ``Watchdog`` and ``Dispatcher`` around hand-built
streams whose gRPC call is a fake (``FakeCall`` records ``cancel``). The
cases are the handover's: an old stream draining its steps while a new one
has just been handed the steps that waited for it. Each stream must be
judged by its own sent steps and its own last answer; a drained stream
that stops answering is abandoned on its own; a step that finds no arena
slot because the handover's steps hold them goes to the replacement
(inline) instead of being built in-process.

The dispatcher's own liveness (``omni_common.liveness``): a real dispatch
loop on a thread whose step handling blocks (``WedgedDispatcher``, a test
double) is judged stuck (``link:test``) by a liveness watchdog on a fake
clock while steps wait, and not stuck once it moves or has nothing waiting.
"""

from __future__ import annotations

import queue
import threading
import time

import torch

from decoder_svc.link.delivery import Delivery
from decoder_svc.link.dispatch import Dispatcher
from decoder_svc.link.failover import Failover
from decoder_svc.link.state import STOP, Attachment, Entry, Handover, LinkState, Stream
from decoder_svc.link.watchdog import Watchdog
from decoder_svc.snapshot import PER_TOKEN, SnapshotMeta
from omni_common import liveness
from omni_common.materialize import HIDDEN_STATES
from tests.test_liveness import FakeClock

STALL_S = 3.0
MAX_PENDING = 4


class FakeCall:
    """Stands in for a Materialize call: records whether it was cancelled."""

    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


def state() -> LinkState:
    return LinkState(
        target="unix:///nonexistent/m.sock", shm_prefix="omni-test", plans={}, arena=None,
        readiness_timeout_ms=1000, reconnect_interval_s=0.25, probe_timeout_s=0.5,
        stall_timeout_s=STALL_S, max_pending=MAX_PENDING, drain_timeout_s=1.0,
        inline_transport=False, name="test",
    )


def stream() -> Stream:
    return Stream(
        call=FakeCall(), outbox=queue.SimpleQueue(), opened_s=time.monotonic(),
        attachment=Attachment("unix:///m", "id", "reference", "0", 2, 0, "shm"),
    )


def meta(step_id: int, created_ago_s: float = 0.0, tensors: bool = False) -> SnapshotMeta:
    m = SnapshotMeta(
        step_id=step_id, stage_id=0, request_ids=["r"], batch_indices=[0],
        num_scheduled_tokens=[1], spans=[(0, 1)], num_sampled_tokens=[1], finished={},
        downstream_request_ids=[], connector_signals=[],
    )
    m.created_s -= created_ago_s
    if tensors:
        m.tensors = {HIDDEN_STATES: (torch.arange(8, dtype=torch.float32).reshape(1, 8), PER_TOKEN)}
    return m


def sent_on(st: LinkState, s: Stream, step_id: int, created_ago_s: float = 0.0,
            sent_ago_s: float = 0.0) -> Entry:
    """A step sent on `s` (fields set as the dispatcher sets them), queued in the link."""
    e = Entry(meta(step_id, created_ago_s))
    e.stream = s
    e.sent_s = time.monotonic() - sent_ago_s
    s.sent.append(e)
    st.pending.append(e)
    return e


def handover_in_progress(st: LinkState) -> tuple[Stream, Stream]:
    """An old stream draining one step that answers steadily, and a new stream
    just handed a backlog of MAX_PENDING + 6 steps that waited 4 s for it (no
    answer from it yet)."""
    old, new = stream(), stream()
    old.draining = True
    old.answers = 50
    old.progress_s = time.monotonic() - 0.2  # answered 0.2 s ago
    st.old.append(old)
    sent_on(st, old, 1, created_ago_s=5.0, sent_ago_s=5.0)
    for i in range(MAX_PENDING + 6):
        sent_on(st, new, 2 + i, created_ago_s=4.0)  # waited unsent during the handover
    new.backlog = MAX_PENDING + 6
    new.progress_s = time.monotonic()
    st.stream = new
    return old, new


def check_dropped(st: LinkState, s: Stream, reason: str, why: str) -> None:
    """The watchdog cancels the current stream `s` with `reason`."""
    Watchdog(st).watch(s)
    assert s.call.cancelled and s.cancel_reason == reason, (
        f"cancelled={s.call.cancelled}, reason={s.cancel_reason} ({s.cancel_detail}): {why}"
    )


def test_new_stream_is_not_judged_by_the_handover_backlog_or_the_old_streams_steps():
    st = state()
    old, new = handover_in_progress(st)
    Watchdog(st).watch(new)
    assert not new.call.cancelled, (
        f"the new stream was cancelled ({new.cancel_reason}: {new.cancel_detail}) right after "
        "it was handed the handover's backlog"
    )
    assert not old.call.cancelled, f"the old stream was cancelled ({old.cancel_reason})"


def test_cold_replacement_answering_its_backlog_slowly_is_not_slow():
    """The backlog went out at once on attach; a replacement that keeps
    answering it (each answer within stall_timeout_s) is not judged by the
    age of its oldest backlog step, and after the backlog a step's age counts
    from when the backlog was done."""
    st = state()
    _, new = handover_in_progress(st)
    for e in new.sent:
        e.sent_s = time.monotonic() - STALL_S - 0.5  # sent on attach, 3.5 s ago
    new.answers = 3
    new.progress_s = time.monotonic() - 1.0
    Watchdog(st).watch(new)
    assert not new.call.cancelled, f"cancelled ({new.cancel_reason}: {new.cancel_detail})"
    new.answers = new.backlog  # done with the backlog 0.5 s ago; one more step waits
    new.backlog_done_s = time.monotonic() - 0.5
    for e in new.sent:
        st.pending.remove(e)
    new.sent.clear()
    sent_on(st, new, 100, sent_ago_s=STALL_S + 1.0)  # sent while the backlog was answered
    Watchdog(st).watch(new)
    assert not new.call.cancelled, f"cancelled ({new.cancel_reason}: {new.cancel_detail})"
    new.backlog_done_s = time.monotonic() - STALL_S - 0.1
    check_dropped(st, new, "slow", f"a step waiting {STALL_S + 0.1}s after the backlog was done")


def test_new_stream_that_does_not_answer_its_backlog_in_time_is_dropped():
    st = state()
    _, new = handover_in_progress(st)
    new.progress_s = time.monotonic() - STALL_S - 0.1
    check_dropped(st, new, "stall", f"silent for {STALL_S + 0.1}s with steps waiting")


def test_new_stream_with_more_than_max_pending_of_its_own_steps_is_dropped():
    st = state()
    _, new = handover_in_progress(st)
    new.answers = new.backlog  # the backlog is answered; then too many steps of its own
    new.sent.clear()
    for i in range(MAX_PENDING + 1):
        sent_on(st, new, 100 + i)
    check_dropped(st, new, "slow", f"{MAX_PENDING + 1} steps wait on it, max_pending {MAX_PENDING}")


def test_stream_that_never_answered_with_steps_held_up_behind_it_is_dropped():
    """Steps to be built in-process (no slot: the stream holds them all) wait
    behind its unanswered head: they count against it, not only its own."""
    st = state()
    silent = stream()
    st.stream = silent
    sent_on(st, silent, 1)
    for i in range(MAX_PENDING):
        st.pending.append(Entry(meta(2 + i), local="no_slot"))
    check_dropped(st, silent, "stall", f"{MAX_PENDING + 1} steps held up, never an answer")


def test_draining_stream_that_stops_answering_is_abandoned_on_its_own():
    st = state()
    old, new = handover_in_progress(st)
    old.progress_s = time.monotonic() - STALL_S - 0.1
    dog = Watchdog(st)
    dog.watch_draining()
    dog.watch(new)
    assert old.call.cancelled and old.cancel_reason == "drain_stall", (
        f"cancelled={old.call.cancelled}, reason={old.cancel_reason}: the drained stream was "
        f"silent for {STALL_S + 0.1}s with a step waiting"
    )
    assert not new.call.cancelled, f"the new stream was cancelled too ({new.cancel_reason})"


def test_draining_stream_that_answers_is_left_alone():
    st = state()
    old, _ = handover_in_progress(st)
    Watchdog(st).watch_draining()
    assert not old.call.cancelled, f"cancelled ({old.cancel_reason}: {old.cancel_detail})"


def dispatcher(st: LinkState) -> tuple[Dispatcher, Delivery]:
    delivered: list[int] = []
    delivery = Delivery(st, lambda step, m: delivered.append(m.step_id), None)
    return Dispatcher(st, delivery, Failover(st, delivery)), delivery


def test_step_without_a_slot_during_a_handover_goes_to_the_replacement_inline():
    st = state()
    disp, delivery = dispatcher(st)
    st.handover = Handover(time.monotonic(), "old-id", "unix:///m", "SIGTERM")
    disp._dispatch(meta(1, tensors=True), "no_slot")
    assert [e.meta.step_id for e in st.unsent] == [1] and delivery.fallback_steps == 0, (
        f"unsent {[e.meta.step_id for e in st.unsent]}, built in-process "
        f"{dict(delivery.fallback_by_reason)}"
    )
    new = stream()
    st.stream, st.handover = new, None  # attached
    disp.flush_unsent()
    # the replacement has not answered its backlog: its slots are still held
    disp._dispatch(meta(2, tensors=True), "no_slot")
    sent = [new.outbox.get_nowait() for _ in range(new.outbox.qsize())]
    assert [r.snapshot.step_id for r in sent] == [1, 2], sent
    for r in sent:  # no slot behind them: the tensors travel in the message
        assert "inline_data" in str(r) and "shm {" not in str(r), f"not inline: {r}"
    assert new.backlog == 2 and delivery.fallback_steps == 0, (
        new.backlog, dict(delivery.fallback_by_reason)
    )


def test_step_without_a_slot_while_the_replacement_catches_up_goes_to_it_inline():
    """The replacement answered the handover's backlog, but not yet the steps
    sent to it meanwhile: they hold the slots, so a step without one still
    goes to it inline. Once those are answered, a step without a slot is the
    materializer's fault again and is built in-process."""
    st = state()
    disp, delivery = dispatcher(st)
    new = stream()
    st.stream = new
    new.backlog = 2
    for step_id in (1, 2, 3, 4):  # 1 and 2 waited for it; 3 and 4 came meanwhile
        sent_on(st, new, step_id)
    for _ in range(2):
        new.answered()
        st.pending.popleft()
    assert new.catch_up == 4 and new.backlog_done_s > 0, (new.catch_up, new.backlog_done_s)
    disp._dispatch(meta(5, tensors=True), "no_slot")
    sent = [new.outbox.get_nowait() for _ in range(new.outbox.qsize())]
    assert [r.snapshot.step_id for r in sent] == [5], sent
    assert "inline_data" in str(sent[0]), f"not inline: {sent[0]}"
    assert new.backlog == 3 and delivery.fallback_steps == 0, (
        new.backlog, dict(delivery.fallback_by_reason)
    )
    for _ in range(3):  # 3, 4 and 5 answered: caught up
        new.answered()
        st.pending.popleft()
    sent_on(st, new, 6)  # a step of its own holds the slots now
    disp._dispatch(meta(7, tensors=True), "no_slot")
    assert new.outbox.qsize() == 0, "a no-slot step was sent to a caught-up materializer"
    assert [(e.meta.step_id, e.local) for e in st.pending] == [(6, None), (7, "no_slot")], [
        (e.meta.step_id, e.local) for e in st.pending
    ]


def test_step_without_a_slot_while_the_drained_stream_answers_goes_to_the_replacement():
    """The replacement attached with no backlog, but the drained materializer
    still holds slots for the steps it was sent: a step without a slot goes
    to the replacement inline; once the drained stream is done, it is built
    in-process as usual."""
    st = state()
    disp, delivery = dispatcher(st)
    old, new = stream(), stream()
    old.draining = True
    st.old.append(old)
    st.stream = new
    sent_on(st, old, 1)
    disp._dispatch(meta(2, tensors=True), "no_slot")
    sent = [new.outbox.get_nowait() for _ in range(new.outbox.qsize())]
    assert [r.snapshot.step_id for r in sent] == [2] and delivery.fallback_steps == 0, (
        sent, dict(delivery.fallback_by_reason)
    )
    assert new.backlog == 1, new.backlog
    old.answered()  # the drained stream is done; the replacement answers step 2
    new.answered()
    st.old.clear()
    st.pending.clear()
    sent_on(st, new, 3)
    disp._dispatch(meta(4, tensors=True), "no_slot")
    assert new.outbox.qsize() == 0, "a no-slot step was sent to a materializer that lags"
    assert [(e.meta.step_id, e.local) for e in st.pending] == [(3, None), (4, "no_slot")]


def test_step_without_a_slot_when_the_handover_backlog_is_full_is_built_in_process_as_handover_full():
    st = state()
    disp, _ = dispatcher(st)
    new = stream()
    st.stream = new
    new.backlog = MAX_PENDING  # the replacement owes a whole max_pending of handover steps
    for step_id in range(1, MAX_PENDING + 1):
        sent_on(st, new, step_id)
    disp._dispatch(meta(MAX_PENDING + 1, tensors=True), "no_slot")
    assert new.outbox.qsize() == 0, "sent past max_pending"
    assert st.pending[-1].local == "handover_full", [(e.meta.step_id, e.local) for e in st.pending]


def test_step_without_a_slot_outside_a_handover_is_built_in_process():
    st = state()
    disp, _ = dispatcher(st)
    new = stream()
    st.stream = new
    sent_on(st, new, 1)  # the materializer holds the slots
    disp._dispatch(meta(2, tensors=True), "no_slot")
    assert new.outbox.qsize() == 0, "a no-slot step was sent to a materializer that lags"
    assert [(e.meta.step_id, e.local) for e in st.pending] == [(1, None), (2, "no_slot")], [
        (e.meta.step_id, e.local) for e in st.pending
    ]


class WedgedDispatcher(Dispatcher):
    """A test double: the real dispatch loop, whose handling of a step blocks
    until `release` is set (a send or a build that never returns)."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.release = threading.Event()
        self.wedged = threading.Event()
        self.dispatched: list[int] = []

    def _dispatch(self, meta, local) -> None:
        self.wedged.set()
        self.release.wait(30)
        self.dispatched.append(meta.step_id)


def test_a_wedged_dispatch_loop_is_stuck_while_steps_wait_and_moves_again():
    st = state()
    delivery = Delivery(st, lambda step, m: None, None)
    disp = WedgedDispatcher(st, delivery, Failover(st, delivery))
    clock = FakeClock()
    dog = liveness.Watchdog(liveness.StallLimits(floor_s=5.0, factor=20.0, grace_s=10.0), clock=clock)
    dog.watch(disp.progress)
    loop = threading.Thread(target=disp.loop, daemon=True)
    loop.start()
    try:
        clock.t += 100
        assert dog.look() == [] and dog.ready, "an idle dispatch loop was judged stuck"
        st.inbox.put((meta(1), None))
        assert disp.wedged.wait(10), "the dispatch loop never took the step"
        st.inbox.put((meta(2), None))  # a step waiting to go out behind the wedged one
        dog.look()
        clock.t += 6
        stuck = dog.look()
        assert [s.name for s in stuck] == ["link:test"] and not dog.ready, f"stuck: {stuck}"
        clock.t += 6
        dog.look()
        assert not dog.live, "stuck past the grace, still live"
        disp.release.set()
        deadline = time.monotonic() + 10
        while disp.dispatched != [1, 2] or disp.progress.has_work():
            assert time.monotonic() < deadline, f"the loop did not move: {disp.dispatched}"
            time.sleep(0.01)
        assert disp.progress.count == 2, f"turns: {disp.progress.count}"
        assert dog.look() == [] and dog.ready and dog.live, f"still stuck after it moved: {dog.stuck()}"
    finally:
        disp.release.set()
        st.inbox.put(STOP)
        loop.join(10)
