"""Where a talker step goes, as the e2e bench reads it from the decoders'
/metrics (bench/step_parts.py)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from bench import e2e, step_parts


def _metrics(step_s: float, gap_s: float, cp_s: float, steps: int) -> str:
    """A decoder's /metrics with the three families: the talker's and another stage's."""
    reg = CollectorRegistry()
    fams = {name: Histogram(name, "doc", ["stage"], registry=reg) for name in step_parts.FAMILIES}
    for name, total in (("omni_decoder_step_seconds", step_s), ("omni_decoder_step_gap_seconds", gap_s),
                        ("omni_decoder_code_predictor_seconds", cp_s)):
        for _ in range(steps):
            fams[name].labels("talker").observe(total / steps)
        fams[name].labels("thinker").observe(100.0)  # another stage: not counted
    return generate_latest(reg).decode()


def test_parse_reads_the_talkers_sums_and_counts():
    got = step_parts.parse(_metrics(2.0, 0.5, 1.5, 10))
    assert got["step_s"] == pytest.approx(2.0) and got["step_n"] == 10, got
    assert got["gap_s"] == pytest.approx(0.5) and got["code_predictor_s"] == pytest.approx(1.5), got


def test_shares_of_a_level_are_the_differences_between_two_reads():
    before = step_parts.parse(_metrics(1.0, 0.2, 0.6, 5))
    after = step_parts.parse(_metrics(3.0, 0.7, 2.1, 15))  # the level: 10 steps, 2.0 + 0.5 s, 1.5 s predicting
    s = step_parts.shares(before, after)
    assert s["steps"] == 10 and s["step_ms"] == pytest.approx(250.0), s
    assert s["code_predictor_share"] == pytest.approx(0.6), s
    assert s["forward_share"] == pytest.approx(0.2) and s["output_path_share"] == pytest.approx(0.2), s
    assert step_parts.shares(None, after) is None and step_parts.shares(after, after) is None


def test_snapshot_sums_the_decoders_and_skips_one_that_does_not_answer(tmp_path):
    one = tmp_path / "a.txt"
    one.write_text(_metrics(1.0, 0.5, 0.5, 4))
    got = step_parts.snapshot([one.as_uri(), one.as_uri(), (tmp_path / "missing").as_uri()])
    assert got["step_n"] == 8 and got["step_s"] == pytest.approx(2.0), got
    assert step_parts.snapshot([(tmp_path / "missing").as_uri()]) is None


def test_the_e2e_table_shows_the_parts_only_when_recorded():
    t = {"steps": 10, "step_ms": 250.0, "forward_share": 0.2, "code_predictor_share": 0.6,
         "output_path_share": 0.2}
    table = "\n".join(e2e.step_parts_md({"64": {m: {"talker_step": t} for m in e2e.MODES}}))
    assert "code predictor %" in table and "| 60 |" in table, table
    assert e2e.step_parts_md({"64": {m: {"talker_step": None} for m in e2e.MODES}}) == []
