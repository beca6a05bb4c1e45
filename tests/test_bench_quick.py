"""`omni-serving bench all --quick`: every suite runs and writes its results.

Correctness only (every mode ran and produced numbers, audio hashes agree,
the results file / Markdown / PNG files exist, the results file holds the
raw numbers and gives the run's own tables, `bench report` renders the
files); never time: the figures are for people to read, on a machine whose
load nobody controls.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest

from bench import cli, e2e, handoff, record, report, step_gap

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bench")
    assert cli.main(["all", "--quick", "--out", str(out)]) == 0
    return out


MODULES = {"step-gap": step_gap, "handoff": handoff, "e2e": e2e}


def record_of(results: Path, suite: str) -> tuple[Path, dict]:
    """The suite's results file in its run folder (`--out` keeps it there), read back."""
    files = sorted((results / suite).glob(f"*-{suite}-quick.json*"))
    assert len(files) == 1, f"{suite}: expected one results file in {results / suite}, found {files}"
    return files[0], record.load(files[0])


def load(results: Path, suite: str) -> dict:
    """The suite's tables' numbers, computed from its results file."""
    folder = results / suite
    for name in ("results.md", "memory.png"):
        assert (folder / name).is_file() and (folder / name).stat().st_size > 0, f"{suite}: {name} missing"
    data, _ = MODULES[suite].analyze(record_of(results, suite)[1])
    return data


def finite(*xs) -> bool:
    return all(isinstance(x, (int, float)) and math.isfinite(x) for x in xs)


def check_memory(mem: dict) -> None:
    assert mem["processes"], "no process was sampled"
    for name, m in mem["processes"].items():
        assert m["peak_mib"] > 0 and finite(m["rss_after_warmup_mib"], m["rss_end_mib"], m["growth"]), name


def test_step_gap_every_mode_ran(results):
    data = load(results, "step-gap")
    cfg = step_gap.StepGapConfig.for_run(quick=True)
    assert data["engine"] in ("fake", "vllm") and data["engine_note"]
    got = {(r["payload"], r["mode"], r["batch"]): r for r in data["results"]}
    for payload in step_gap.PAYLOADS:
        for mode in step_gap.MODES:
            for batch in cfg.batches:
                r = got[(payload, mode, batch)]
                assert r["gap_us"]["n"] == cfg.steps[batch], (payload, mode, batch, r["gap_us"]["n"])
                assert finite(r["gap_us"]["p50"], r["gap_us"]["p99"], r["step_ms"]["p50"], r["step_ms"]["p99"])
                want = "async" if mode in ("thread", "remote-shm", "remote-inline") else "sync"
                assert r["output_path"] == want, (payload, mode, batch)
                if mode.startswith("remote"):
                    assert r["remote_steps"] > 0 and r["fallback_steps"] == 0, r
                if mode in ("thread", "remote-shm"):
                    assert r["peak_slots_in_use"] >= 1, r
                # the gap a mode adds over the floor is its gap less mode none's, at the same batch
                none = got[(payload, "none", batch)]
                added = r["gap_added_us"]["p50"]
                assert math.isclose(added, r["gap_us"]["p50"] - none["gap_us"]["p50"], abs_tol=1e-6), r
    check_memory(data["memory"])
    assert data["memory"]["arena"]["num_slots"] * data["memory"]["arena"]["slot_bytes"] > 0
    names = [t["name"] for t in data["targets"]]
    assert "step gap added over the floor: inline / remote-shm" in names
    # the decode step targets: one pair per named batch; batches the quick run skips are not measured
    step = [t for t in data["targets"] if t["name"] == "decode step: remote-shm / none"]
    assert [t["note"].split(",")[0] for t in step] == [f"batch {b}" for b in step_gap.STEP_TARGET_BATCHES]
    for t in step:
        ran = int(t["note"].split(",")[0].split()[1]) in cfg.batches
        assert (t["measured"] is not None) == ran, t
    for png in ("gap.png", "step.png"):
        assert (results / "step-gap" / png).stat().st_size > 0


def test_handoff_every_size_measured(results):
    data = load(results, "handoff")
    cfg = handoff.HandoffConfig.for_run(quick=True)
    assert [r["size"] for r in data["results"]] == list(cfg.sizes)
    for r in data["results"]:
        for key in ("memcpy_torch_us", "memcpy_numpy_us", "arena_write_us", "shm_roundtrip_us", "inline_roundtrip_us"):
            assert r[key]["n"] == r["iters"] >= cfg.iters(r["size"]) and finite(r[key]["p50"]), (r["size"], key)
        assert finite(r["inline_over_shm"], r["arena_copy_pct_of_memcpy"])
        # handles, not bytes: the shm snapshot stays small; the inline one carries the payload
        assert r["snapshot_bytes"]["shm"] < 256
        assert r["snapshot_bytes"]["inline"] >= r["size"]
    check_memory(data["memory"])
    for png in ("handoff.png", "bandwidth.png", "snapshot_size.png"):
        assert (results / "handoff" / png).stat().st_size > 0


def test_e2e_async_sync_and_thread_give_the_same_audio(results):
    data = load(results, "e2e")
    cfg = e2e.E2EConfig.for_run(quick=True)
    assert sorted(int(c) for c in data["levels"]) == sorted(cfg.concurrency)
    for c, level in data["levels"].items():
        for mode in e2e.MODES:
            s = level[mode]
            assert s["requests"] == cfg.prompts[int(c)], (c, mode)
            assert finite(s["throughput_rps"], s["ttfp_ms"]["p50"], s["ttfp_ms"]["p99"], s["rtf"]["p50"])
            assert s["audio_s_total"] > 0
    for c, level in data["levels"].items():
        for mode in e2e.MODES:
            # where the talker's steps went, from the decoders' /metrics
            t = level[mode]["talker_step"]
            assert t and t["steps"] > 0 and finite(t["step_ms"]), (c, mode, t)
            assert abs(t["forward_share"] + t["code_predictor_share"] + t["output_path_share"] - 1) < 1e-6, t
            if data["engine"] == "vllm":  # the fake talker has no code predictor
                assert 0 < t["code_predictor_share"] < 1, (c, mode, t)
            cont = level[mode]["continuity"]
            assert cont["streams"] == cfg.prompts[int(c)] and 0 <= cont["stalled"] <= cont["streams"], cont
    hashes = data["hashes"]
    assert len(hashes) == sum(cfg.prompts[c] for c in cfg.concurrency)
    assert all(h[m] for h in hashes for m in e2e.MODES), "a mode has no result for a prompt"
    different = [h for h in hashes if not h["equal"]]
    assert not different, f"async, sync and thread audio differ: {different}"
    info = data["decoder_info"]
    assert info["async"]["talker_output_path"] == "OUTPUT_PATH_ASYNC" and info["async"]["fallback_steps"] == 0
    assert info["sync"]["talker_output_path"] == "OUTPUT_PATH_SYNC"
    # thread: the async path without a materializer (the decoder's own background builder)
    assert info["thread"]["talker_output_path"] == "OUTPUT_PATH_ASYNC"
    assert not info["thread"]["materializer_connected"] and info["async"]["materializer_connected"]
    for mode in ("async", "thread"):
        assert info[mode]["arena"]["peak_slots_in_use"] >= 1, mode
    assert data["memory"]["shm_segments_left_after_stop"] == {m: [] for m in e2e.MODES}
    probe = data["info_probe"]
    assert probe["concurrency"] == max(cfg.concurrency)
    for mode in e2e.MODES:
        assert probe[mode]["latency_ms"]["n"] > 0 and finite(probe[mode]["latency_ms"]["p99"]), mode
    names = {t["name"] for t in data["targets"]}
    for name in ("e2e throughput: async / thread", "GetDecoderInfo p99 under full load (async)",
                 "e2e TTFP p50 (async): concurrency 64 / 1", "decoder CPU per request: async / sync"):
        assert name in names, name
    check_memory(data["memory"])
    assert (results / "e2e" / "e2e.png").stat().st_size > 0
    lines = (results / "e2e" / "hashes.txt").read_text().splitlines()
    assert len(lines) == len(hashes) + len(data["omni"]["hashes"])
    assert all(line.endswith(" equal") for line in lines), lines


def test_e2e_omni_variant_times_thinker_and_first_audio(results):
    data = load(results, "e2e")
    cfg = e2e.E2EConfig.for_run(quick=True)
    omni = data["omni"]
    n = cfg.prompts[max(cfg.concurrency)]
    assert set(omni["modes"]) == set(e2e.MODES)
    for mode, reqs in omni["per_request"].items():
        assert len(reqs) == n, mode
        for r in reqs:
            # text and audio both came, and the lead is the difference of the two times
            assert finite(r["thinker_done_s"], r["first_audio_s"]) and r["audio_bytes"] > 0, (mode, r)
            assert math.isclose(r["audio_lead_s"], r["thinker_done_s"] - r["first_audio_s"], abs_tol=1e-9)
    different = [h for h in omni["hashes"] if not h["equal"]]
    assert len(omni["hashes"]) == n and not different, different
    for mode, info in omni["decoder_info"].items():
        assert [s["name"] for s in info["stages"]][:2] == ["thinker", "talker"], info["stages"]
        want = "OUTPUT_PATH_SYNC" if mode == "sync" else "OUTPUT_PATH_ASYNC"
        assert all(s["output_path"] == want for s in info["stages"][:2]), (mode, info["stages"])
    assert omni["shm_segments_left_after_stop"] == {m: [] for m in e2e.MODES}


def test_summary_has_the_targets_table(results):
    text = (results / "summary.md").read_text()
    assert "## Targets" in text and "| target | measured | goal | status |" in text
    for suite in ("# step-gap", "# handoff", "# e2e"):
        assert suite in text


def test_results_files_hold_the_raw_numbers_and_give_the_run_tables(results):
    for suite, module in MODULES.items():
        path, rec = record_of(results, suite)
        assert rec["suite"] == suite and rec["quick"] is True, (suite, rec["suite"], rec["quick"])
        assert rec["run"]["command"] == f"python -m bench all --quick --out {results}", rec["run"]["command"]
        assert re.fullmatch(r"[0-9a-f]{40}", rec["run"]["git"]["commit"]), rec["run"]["git"]
        assert rec["host"]["cores_available"] >= 1 and rec["host"]["cpu_model"], rec["host"]
        assert path.stat().st_size < record.COMMIT_LIMIT, f"{path.name}: {path.stat().st_size} bytes"
        # the run folder's tables are what the report computes from the file
        assert module.render(rec) == (results / suite / "results.md").read_text(), f"{suite}: tables differ"
    # raw: per step, per iteration and per request, not summaries
    sg = record_of(results, "step-gap")[1]
    cfg = step_gap.StepGapConfig.for_run(quick=True)
    runs = sg["raw"]["runs"]
    assert len(runs) == cfg.rounds * len(step_gap.PAYLOADS) * len(cfg.batches) * len(step_gap.MODES)
    for r in runs:
        assert len(r["gaps_s"]) == len(r["step_s"]) == cfg.steps[r["batch"]], r
    assert sg["raw"]["memory"]["timeline"] and set(sg["raw"]["memory"]["marks"]) == {"after_warmup", "end"}
    ho = record_of(results, "handoff")[1]
    for size in ho["raw"]["sizes"]:
        assert len(size["samples_s"]["shm_roundtrip"]) == size["iters"], size["size"]
    ee = record_of(results, "e2e")[1]
    ecfg = e2e.E2EConfig.for_run(quick=True)
    for c, level in ee["raw"]["levels"].items():
        for mode in e2e.MODES:
            reqs = level[mode]["requests"]
            assert len(reqs) == ecfg.prompts[int(c)] and all(len(r["sha256"]) == 64 for r in reqs), (c, mode)
    top = ee["raw"]["levels"][str(max(ecfg.concurrency))]
    assert all(top[m]["probe"]["latencies_s"] for m in e2e.MODES), "the probe's calls are not in the file"


def test_report_renders_the_results_files(results, tmp_path):
    folder = tmp_path / "results"
    folder.mkdir()
    sections = []
    for suite in MODULES:
        path, _ = record_of(results, suite)
        shutil.copy(path, folder / path.name)
        sections.append({"file": path.name, "note": f"The {suite} suite.", "quick": True})
    index = folder / "INDEX.yaml"
    index.write_text(json.dumps({"sections": sections}))
    output = tmp_path / "RESULTS.md"
    text = report.generate(index, output)
    assert text == report.generate(index, output), "two reports of the same files differ"
    for suite in MODULES:
        tables = report.shift_headings((results / suite / "results.md").read_text().strip(), 2)
        assert tables in text, f"the report does not show {suite}'s tables as its run did"
    output.write_text(text)
    assert report.main(["--check", "--index", str(index), "--output", str(output)]) == 0


def test_e2e_rounds_and_a_fixed_first_chunk(tmp_path):
    """`e2e --rounds 2 --first-chunk 2 --no-omni`: every level runs twice on the same
    stacks, every request's first chunk is the one asked for (so every
    request's audio is compared across the stacks), and the targets' ratios
    are the medians over the rounds, with the steady-state target added."""
    assert cli.main(["e2e", "--quick", "--rounds", "2", "--first-chunk", "2", "--requests", "2,4", "--no-omni",
                     "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*-e2e-quick.json*")
    rec = record.load(path)
    assert rec["settings"]["rounds"] == 2 and rec["settings"]["first_chunk_frames"] == 2
    assert rec["raw"]["omni"] is None  # --no-omni
    (second,) = rec["raw"]["extra_rounds"]
    for rnd in (rec["raw"]["levels"], second):
        assert {c: len(lv["async"]["requests"]) for c, lv in rnd.items()} == {"1": 2, "4": 4}
        assert {r["first_chunk_frames"] for lv in rnd.values() for m in e2e.MODES for r in lv[m]["requests"]} == {2}
    data, targets = e2e.analyze(rec)
    assert len(data["rounds"]) == 2
    equal, comparable, total = e2e.hashes_held(data["hashes"])
    assert equal == comparable == total == 6, (equal, comparable, total)
    by_name = {t.name: t for t in targets}
    # the quick run has no level 64: the scaling targets are not measured, and say so
    steady = by_name["e2e TTFP (async): p90 at concurrency 64 / p50 at 1"]
    assert steady.measured is None and "first chunk fixed at 2 frames" in steady.note, steady
    thr = [t for t in targets if t.name == "e2e throughput: async / sync (the seed's gain)"][0]
    per_round = [rnd["4"]["async"]["throughput_rps"] / rnd["4"]["sync"]["throughput_rps"] for rnd in data["rounds"]]
    assert thr.measured == pytest.approx(sum(per_round) / 2) and "median of 2 rounds" in thr.note, thr
    md = (tmp_path / "results.md").read_text() if (tmp_path / "results.md").exists() else e2e.render(rec)
    assert "Every round (2;" in md and "the first chunk fixed at 2 frames" in md
