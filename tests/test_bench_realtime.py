"""bench realtime, as a tooling check on the fake engine: a results file the
report reads, with every turn timed and cancelled at its first audio (a short
answer may end first); the table's figures are computed from that file."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e


def test_realtime_writes_a_results_file_the_report_renders(tmp_path: Path) -> None:
    from bench import realtime, record

    assert realtime.main(["--engine", "fake", "--sessions", "3", "--speech-seconds", "0.5", "--runs", "2",
                          "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*-realtime-*.json*")
    rec = record.load(path)
    assert rec["run"]["command"].startswith("omni-serving bench realtime")
    assert rec["raw"]["stop_problems"] == []
    runs = rec["raw"]["runs"]
    assert len(runs) == 2 and all(len(r[p]["turns"]) == 3 for r in runs for p in ("spoken", "typed"))
    for r in runs:
        for phase in ("spoken", "typed"):
            for turn in r[phase]["turns"]:
                # the fake engine's short answers may end before the cancel arrives: "completed" then
                assert turn["first_audio_ms"] > 0 and turn["cancel_to_done_ms"] >= 0, turn
            assert r[phase]["freed_after_last_cancel_ms"] >= 0
    res = realtime.analyze(rec)
    spoken = [t["first_audio_ms"] for r in runs for t in r["spoken"]["turns"]]
    assert min(spoken) <= res["phases"]["spoken"]["first_audio_ms"]["p50"] <= max(spoken)
    table = realtime.render(rec)
    cancelled = sum(t["cancelled"] for r in runs for t in r["spoken"]["turns"])
    assert "| spoken (from the commit) |" in table and f"| {cancelled}/6 | 0 |" in table, table
    assert "Spoken over typed, time to first audio: p50 " in table
