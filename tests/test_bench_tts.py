"""bench tts as a tooling check: the quick run serves the tiny Qwen3-TTS checkpoints (vLLM), writes a
results file the report reads, and its table's figures come from that file; bad options are refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import tts

pytest.importorskip("vllm")
pytestmark = [pytest.mark.e2e, pytest.mark.vllm]


def test_bad_options_are_refused(capsys) -> None:
    for argv, says in ((["--concurrency", "1,x"], "--concurrency"), (["--concurrency", "1,2", "--requests", "3"],
                                                                     "--requests"), (["--frames", "0"], "--frames")):
        with pytest.raises(SystemExit):
            tts.main(argv)
        assert says in capsys.readouterr().err


def test_tts_writes_a_results_file_the_report_renders(tmp_path: Path) -> None:
    from bench import record

    assert tts.main(["--quick", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*-tts-*.json*")
    rec = record.load(path)
    assert rec["run"]["command"].startswith("omni-serving bench tts")
    assert [lv["concurrency"] for lv in rec["raw"]["levels"]] == [1, 2]
    assert [len(lv["requests"]) for lv in rec["raw"]["levels"]] == [2, 4]
    for lv in rec["raw"]["levels"]:
        for r in lv["requests"]:
            assert r["ttfp_s"] > 0 and abs(r["audio_s"] - 8 * 1920 / 24000) < 1e-9  # 8 frames each
    assert {k: len(v) for k, v in rec["raw"]["voices"].items()} == {"registered": 2, "resend": 2, "builtin": 2}
    res = tts.analyze(rec)
    table = tts.render(rec)
    assert f"| 1 | 2 | {res['levels'][0]['ttfp_p50_ms']:.3g}" in table
    assert "TTFP p50 c2 / c1" in table and "registered voice / resent clip" in table
