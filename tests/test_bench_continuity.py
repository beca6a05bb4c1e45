"""Audio continuity as the e2e bench judges it (bench/continuity.py): hand-
worked streams, and the e2e summary and table built from chunk arrivals."""

from __future__ import annotations

import math

import pytest

from bench import e2e
from bench.continuity import continuity_summary, playback


def test_a_stream_ahead_of_real_time_never_stalls():
    r = playback([(0.1, 0.4), (0.2, 0.4), (0.3, 0.4)])
    assert r == {"start_s": 0.1, "stalls": 0, "stall_ms": 0.0}, r


def test_playback_starts_at_250_ms_buffered_and_a_late_chunk_stalls_it():
    # 0.2 s at 0.1 (not enough), 0.6 s buffered at 0.2: playback starts; it
    # runs dry at 0.8, the next chunk comes at 1.0 (200 ms stall); the one
    # after comes at 1.1 while 0.3 s is still buffered
    r = playback([(0.1, 0.2), (0.2, 0.4), (1.0, 0.4), (1.1, 0.4)])
    assert r["start_s"] == 0.2 and r["stalls"] == 1, r
    assert r["stall_ms"] == pytest.approx(200.0), r


def test_a_stream_shorter_than_the_buffer_plays_from_its_end_and_empty_chunks_do_not_count():
    r = playback([(0.5, 0.1), (0.7, 0.0), (0.9, 0.1)])
    assert r == {"start_s": 0.9, "stalls": 0, "stall_ms": 0.0}, r
    empty = playback([])
    assert math.isnan(empty["start_s"]) and empty["stalls"] == 0


def test_two_stalls_add_up_and_the_summary_counts_streams():
    stalls = [(0.0, 0.3), (0.5, 0.1), (0.9, 0.3)]  # dry at 0.3 (200 ms), at 0.6 (300 ms)
    assert playback(stalls)["stall_ms"] == pytest.approx(500.0)
    s = continuity_summary([stalls, [(0.0, 1.0)]])
    assert (s["streams"], s["stalled"], s["stalled_share"], s["buffer_ms"]) == (2, 1, 0.5, 250.0), s
    assert s["stall_ms"]["max"] == pytest.approx(500.0) and s["stall_ms"]["min"] == 0.0, s


def _request(i: int, chunks) -> dict:
    return {"index": i, "start": 0.0, "end": 2.0, "ttfp_s": 0.1, "wall_s": 2.0, "audio_s": 1.0, "rtf": 2.0,
            "sha256": "0" * 64, "bytes": 48000, "retries": 0, "server_ttfp_ms": None, "server_rtf": None,
            "first_chunk_frames": 5, "chunks": chunks}


def test_the_e2e_summary_and_table_carry_continuity_only_when_arrivals_were_recorded():
    reqs = [_request(0, [[0.1, 0.4], [1.5, 0.6]]), _request(1, [[0.1, 1.0]])]
    cont = e2e.level_summary(reqs)["continuity"]
    assert (cont["streams"], cont["stalled"]) == (2, 1), cont
    old = [{k: v for k, v in r.items() if k != "chunks"} for r in reqs]
    assert e2e.level_summary(old)["continuity"] is None
    levels = {"16": {m: e2e.level_summary(reqs) for m in e2e.MODES}}
    table = "\n".join(e2e.continuity_md(levels))
    assert "1/2" in table and "streams stalled" in table, table
    assert e2e.continuity_md({"16": {m: e2e.level_summary(old) for m in e2e.MODES}}) == []
