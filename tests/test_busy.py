"""ForwardBusy: per-stage busy time and the time stages' steps overlap."""

from __future__ import annotations

import threading

import pytest

from decoder_svc.busy import ForwardBusy


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_busy_and_overlap_are_integrated_over_the_events():
    clock = FakeClock()
    busy = ForwardBusy(clock=clock, export=False)
    busy.enter("thinker")  # t=100
    clock.now = 101.0
    busy.enter("talker")  # thinker alone 1 s
    clock.now = 101.5
    busy.exit("thinker")  # both 0.5 s
    clock.now = 103.0
    busy.exit("talker")  # talker alone 1.5 s
    clock.now = 110.0
    busy.enter("talker")  # idle 7 s: charged to nobody
    clock.now = 110.25
    busy.exit("talker")
    assert busy.busy_s == pytest.approx({"thinker": 1.5, "talker": 2.25})
    assert busy.overlap_s == pytest.approx(0.5)


def test_serialised_steps_never_overlap():
    """Steps taken under one lock (engines sharing a process) show no overlap."""
    busy = ForwardBusy(export=False)
    lock = threading.Lock()

    def run(stage: str) -> None:
        for _ in range(200):
            with lock, busy.forward(stage):
                pass

    threads = [threading.Thread(target=run, args=(s,)) for s in ("thinker", "talker")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert busy.overlap_s == 0.0
    assert set(busy.busy_s) == {"thinker", "talker"}


def test_a_stage_with_two_steps_at_once_counts_once():
    clock = FakeClock()
    busy = ForwardBusy(clock=clock, export=False)
    busy.enter("talker")
    busy.enter("talker")
    clock.now += 2.0
    busy.exit("talker")
    busy.exit("talker")
    assert busy.busy_s == {"talker": 2.0} and busy.overlap_s == 0.0


def test_intervals_reported_by_stage_processes_give_busy_and_pairwise_overlap():
    """Stage processes report (start, end) intervals, in any order between
    stages: each overlap is counted once, whichever interval comes second."""
    busy = ForwardBusy(export=False)
    busy.add_interval("thinker", 10.0, 11.0)
    busy.add_interval("thinker", 12.0, 13.0)
    busy.add_interval("talker", 10.5, 12.5)  # overlaps both: 0.5 + 0.5
    busy.add_interval("talker", 13.5, 14.0)  # overlaps nothing yet
    busy.add_interval("thinker", 13.75, 15.0)  # overlaps the talker's last: 0.25
    assert busy.busy_s == pytest.approx({"thinker": 3.25, "talker": 2.5})
    assert busy.overlap_s == pytest.approx(1.25)


def test_a_stage_process_records_its_forward_passes_as_intervals():
    clock = FakeClock()
    busy = ForwardBusy(clock=clock, export=False)
    busy.enter("talker")  # not recorded yet
    clock.now = 101.0
    busy.exit("talker")
    assert busy.take_intervals() == []
    busy.record_intervals(True)
    busy.enter("talker")
    clock.now = 102.5
    busy.exit("talker")
    assert busy.take_intervals() == [(101.0, 102.5)]
    assert busy.take_intervals() == []
