"""`omni-serving bench checkpoint --quick`: one checkpoint served (the tiny one
here), its plan next to each process's resident memory, TTFP per level, the
step composition and the vocoder's real-time factor, in a results file that
`bench report` renders."""

from __future__ import annotations

import math

import pytest

from bench import cli, record, report

pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.timeout(600)]


def test_checkpoint_suite_measures_a_served_checkpoint(tmp_path, tiny_checkpoint):
    out = tmp_path / "run"
    assert cli.main(["checkpoint", "--quick", "--checkpoint", str(tiny_checkpoint), "--out", str(out)]) == 0
    (path,) = out.glob("*-checkpoint-quick.json*")
    rec = record.load(path)
    raw = rec["raw"]
    assert raw["checkpoint"] == str(tiny_checkpoint.resolve())
    assert [s["name"] for s in raw["plan"]["stages"]] == ["thinker", "talker", "code2wav"]
    assert raw["plan"]["lines"][0] == "memory plan (3 stages):"
    after = raw["memory"]["marks"]["after_warmup"]["rss_kib"]
    assert {"decoder", "gateway", "materializer", "stage-thinker", "stage-talker", "code2wav-0"} <= set(after)
    assert all(kib > 50 * 1024 for kib in after.values()), after
    assert raw["engine_settings"]["thinker"]["dtype"] == "float32"
    assert raw["shm_segments_left_after_stop"] == []

    from bench.checkpoint import analyze

    data = analyze(rec)
    assert set(data["levels"]) == {"1", "2"}
    for lv in data["levels"].values():
        assert lv["requests"] == 2 and math.isfinite(lv["ttfp_ms"]["p50"]) and lv["ttfp_ms"]["p50"] > 0
        assert lv["audio_s"] > 0 and 0 < lv["code2wav_rtf"] < 10
        talker = lv["steps"]["talker"]
        assert talker["steps"] > 0 and talker["code_predictor_share"] > 0
        assert lv["steps"]["thinker"]["steps"] > 0
    md = (out / "results.md").read_text()
    assert "## Memory plan" in md and "| stage-talker |" in md and "code2wav RTF" in md
    assert report.render_record(rec, str(path)) == md  # bench report shows the run's own tables
