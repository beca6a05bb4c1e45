"""`omni-serving bench code-predictor` runs and writes its results file (tiny
widths, one small batch, two repetitions). Correctness only: every
implementation ran every mode and gave finite times, the file describes its
run in the common results-file format, its tables come from the file's raw
numbers, greedy codes agree; never time."""

from __future__ import annotations

import math

import pytest

from bench import cli, code_predictor, record, report

pytestmark = pytest.mark.timeout(600)


def test_the_code_predictor_bench_runs_and_writes_its_results(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(["code-predictor", "--quick", "--batches", "2", "--reps", "2", "--frames", "1", "--threads", "1",
                     "--out", str(out), "--slug", "check"]) == 0
    [path] = out.glob("*-code-predictor-check.json*")
    rec = record.load(path)  # validates the common fields
    assert rec["suite"] == "code-predictor" and rec["quick"] is True
    assert rec["run"]["argv"][0] == "code-predictor" and "code-predictor" in rec["run"]["command"]
    assert rec["run"]["git"]["commit"] and rec["host"]["cpu_model"] and rec["raw"]["torch_threads"] == 1
    assert rec["settings"]["widths"]["tiny"]["hidden_size"] == 128
    assert not (out / "partial.json").exists(), "the partial copy is removed once the results file is written"
    runs = rec["raw"]["runs"]
    impls, modes = ["ours", "previous", "transformers"], ["greedy", "sampled"]
    for mode in modes:
        for impl in impls:
            mine = [r for r in runs if r["impl"] == impl and r["mode"] == mode]
            assert [r["rep"] for r in mine] == [0, 1], f"{impl} {mode}: {mine}"
            assert all(len(r["frame_s"]) == 1 and r["frame_s"][0] > 0 for r in mine), mine
        # interleaved: each repetition starts at another implementation
        firsts = {r["rep"]: r["impl"] for r in runs if r["mode"] == mode and r["order"] == 0}
        assert firsts == {0: "ours", 1: "previous"}, firsts
    summary = code_predictor.summarize(rec)
    assert [(r["width"], r["batch"], r["mode"]) for r in summary] == [("tiny", 2, m) for m in modes]
    for r in summary:
        for key in ("ours_ms", "previous_ms", "transformers_ms", "gflop_per_frame"):
            assert math.isfinite(r[key]) and r[key] > 0, (key, r)
        s = r["speedup_vs_transformers"]
        assert s["n"] == 2 and s["min"] <= s["median"] <= s["max"], s
    assert rec["raw"]["greedy_codes_equal"] == [{"width": "tiny", "batch": 2, "previous": True, "transformers": True}]
    assert code_predictor.targets(summary) == [], "no target at batches other than 1 and 64"
    printed = capsys.readouterr().out
    assert "| tiny | 2 | sampled |" in printed and str(path) in printed
    # bench report renders the same tables from the file
    rendered = report.render_record(rec, str(path))
    assert "| tiny | 2 | sampled |" in rendered
    assert (out / "results.md").read_text() == code_predictor.render(rec)
