"""omni_common.liveness: progress counters and the watchdog's verdicts (a fake clock, no threads)."""

from __future__ import annotations

import pytest

from omni_common.errors import InvalidArgumentError
from omni_common.liveness import Progress, StallLimits, Watchdog


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(floor=2.0, factor=10.0, grace=6.0):
    clock = FakeClock()
    changes = []
    dog = Watchdog(StallLimits(floor, factor, grace), clock=clock,
                   on_change=lambda ready, live, stuck: changes.append((ready, live, [s.name for s in stuck])))
    return clock, dog, changes


def test_idle_part_is_never_stuck():
    clock, dog, changes = make()
    p = dog.watch(Progress("loop", lambda: False, clock=clock))
    clock.t += 1000
    assert dog.look() == [] and dog.ready and dog.live
    assert p.count == 0 and changes == []


def test_part_with_work_that_does_not_move_is_stuck_then_not_live_then_recovers():
    clock, dog, changes = make()
    work = [True]
    hits = []
    p = dog.watch(Progress("decode", lambda: work[0], on_stuck=lambda part, s: hits.append((part.name, s)),
                           clock=clock))
    clock.t += 1.9
    assert dog.look() == [] and dog.ready
    clock.t += 0.2  # 2.1 s without a turn, work waiting: past the 2 s floor
    stuck = dog.look()
    assert [s.name for s in stuck] == ["decode"] and not dog.ready and dog.live
    assert hits == [("decode", pytest.approx(2.1))], hits
    assert "decode made no progress for 2.1s" in stuck[0].describe()
    clock.t += 1.0
    dog.look()
    assert len(hits) == 1, "on_stuck runs once per episode"
    clock.t += 3.0  # 6.1 s stuck: past the 6 s grace
    dog.look()
    assert not dog.ready and not dog.live
    p.advance()
    dog.look()
    assert dog.ready and dog.live and dog.stuck() == []
    assert changes == [(False, True, ["decode"]), (False, False, ["decode"]), (True, True, [])], changes
    assert dog.episodes == 1


def test_limit_follows_the_parts_recent_pace():
    clock, dog, _ = make(floor=2.0, factor=10.0, grace=100.0)
    p = dog.watch(Progress("talker", lambda: True, clock=clock))
    for _ in range(20):  # steps of 0.4 s under load
        clock.t += 0.4
        p.advance(0.4)
        dog.look()
    assert dog.limit_s(p) == pytest.approx(4.0, rel=0.01)
    clock.t += 3.9
    assert dog.look() == [], "3.9 s is less than ten recent steps"
    clock.t += 0.2
    assert [s.name for s in dog.look()] == ["talker"]


def test_counter_from_elsewhere_and_work_coming_and_going():
    clock, dog, _ = make()
    work = [False]
    p = dog.watch(Progress("stage talker", lambda: work[0], clock=clock))
    clock.t += 10
    dog.look()
    work[0] = True  # work arrives: the clock starts now, not at the last turn
    clock.t += 1.5
    assert dog.look() == []
    p.set_count(7)  # the child process reported turns
    clock.t += 1.5
    assert dog.look() == []
    clock.t += 2.5
    assert [s.name for s in dog.look()] == ["stage talker"]
    dog.forget("stage talker")
    assert dog.look() == [] and dog.ready


def test_a_failing_question_counts_as_busy_and_a_failing_recovery_keeps_the_verdict():
    clock, dog, _ = make()

    def boom():
        raise RuntimeError("no")

    def bad_recovery(part, seconds):
        raise RuntimeError("cannot kill")

    dog.watch(Progress("worker", boom, on_stuck=bad_recovery, clock=clock))
    clock.t += 3
    assert [s.name for s in dog.look()] == ["worker"] and not dog.ready


@pytest.mark.parametrize(
    ("floor", "factor", "grace", "field"),
    [(0, 10, 10, "stall_after_s"), (1, 0.5, 10, "stall_factor"), (5, 10, 4, "liveness_grace_s")],
)
def test_limits_refuse_bad_values_naming_the_setting(floor, factor, grace, field):
    with pytest.raises(InvalidArgumentError, match=field):
        StallLimits(floor, factor, grace)


def test_part_not_ready_for_another_reason_makes_the_service_not_ready_but_never_not_live():
    clock, dog, changes = make()
    why = ["restarting"]
    dog.watch(Progress("stage:talker", lambda: False, not_ready=lambda: why[0], clock=clock))
    assert dog.look() == [], "a restarting part is not stuck"
    assert not dog.ready and dog.live, f"ready={dog.ready} live={dog.live} while a part restarts"
    assert [(w.name, w.why) for w in dog.waiting()] == [("stage:talker", "restarting")], dog.waiting()
    assert changes == [(False, True, [])], f"changes: {changes}"
    clock.t += 1000  # far past the grace: restarting never makes it not live
    dog.look()
    assert dog.live and changes == [(False, True, [])], f"changes: {changes}"
    why[0] = ""
    dog.look()
    assert dog.ready and dog.waiting() == [] and changes[-1] == (True, True, []), f"changes: {changes}"


def test_a_failing_not_ready_question_leaves_the_part_ready():
    clock, dog, _ = make()

    def broken() -> str:
        raise RuntimeError("boom")

    dog.watch(Progress("p", lambda: False, not_ready=broken, clock=clock))
    dog.look()
    assert dog.ready and dog.waiting() == [], "a failing not_ready question made the service not ready"
