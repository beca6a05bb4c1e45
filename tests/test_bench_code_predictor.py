"""`omni-serving bench code-predictor` runs and writes its JSON file (tiny
widths, one small batch, one repetition). Correctness only: every
implementation ran every mode and gave finite times, the file describes its
run, greedy codes agree; never time."""

from __future__ import annotations

import json
import math

import pytest

from bench import cli

pytestmark = pytest.mark.timeout(600)


def test_the_code_predictor_bench_runs_and_writes_its_results(tmp_path, capsys):
    out = tmp_path / "cp.json"
    assert cli.main(["code-predictor", "--quick", "--batches", "2", "--reps", "2", "--frames", "1", "--threads", "1",
                     "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["suite"] == "code-predictor" and "code-predictor" in data["command"]
    assert data["git_commit"] and data["host"]["cpu_model"] and data["host"]["torch_threads"] == 1
    assert data["config"]["widths"]["tiny"]["hidden_size"] == 128
    impls, modes = ["ours", "previous", "transformers"], ["greedy", "sampled"]
    for mode in modes:
        for impl in impls:
            runs = [r for r in data["runs"] if r["impl"] == impl and r["mode"] == mode]
            assert [r["rep"] for r in runs] == [0, 1], f"{impl} {mode}: {runs}"
            assert all(len(r["frame_s"]) == 1 and r["frame_s"][0] > 0 for r in runs), runs
        # interleaved: each repetition starts at another implementation
        firsts = {r["rep"]: r["impl"] for r in data["runs"] if r["mode"] == mode and r["order"] == 0}
        assert firsts == {0: "ours", 1: "previous"}, firsts
    assert [(r["width"], r["batch"], r["mode"]) for r in data["summary"]] == [("tiny", 2, m) for m in modes]
    for r in data["summary"]:
        for key in ("ours_ms", "previous_ms", "transformers_ms", "gflop_per_frame"):
            assert math.isfinite(r[key]) and r[key] > 0, (key, r)
        s = r["speedup_vs_transformers"]
        assert s["n"] == 2 and s["min"] <= s["median"] <= s["max"], s
    assert data["greedy_codes_equal"] == [{"width": "tiny", "batch": 2, "previous": True, "transformers": True}]
    assert data["targets"] == [], "no target at batches other than 1 and 64"
    printed = capsys.readouterr().out
    assert "| tiny | 2 | sampled |" in printed and str(out) in printed
