"""`omni-serving bench code-predictor`: the talker's code predictor per frame,
three implementations side by side on the same weights, inputs, threads and
dtype (float32):

  ours          decoder_svc/qwen3_omni/code_predictor.py (the serving one)
  previous      bench/baselines/code_predictor_v0.py (the implementation it
                replaced, kept verbatim)
  transformers  transformers' Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration
                driven exactly as its talker drives it in
                ``Qwen3OmniMoeTalkerForConditionalGeneration.prepare_inputs_for_generation``:
                ``generate(inputs_embeds=[past_hidden, code0 embedding],
                max_new_tokens=G-1, output_hidden_states=True,
                return_dict_in_generate=True, do_sample, top_k=50, top_p=0.8)``
                and the sum of the residual codes' embeddings from its
                hidden states -- what a user would otherwise run.

Widths: ``tiny`` (the tiny checkpoint's code predictor) and ``released``
(Qwen3-Omni-30B-A3B's: hidden 1024, 5 layers, 16 heads / 8 KV heads x 128,
intermediate 3072, vocabulary 2048, 16 code groups; random weights). Batches
1, 16, 64; modes greedy and sampled (temperature 1, top-k 50, top-p 0.8,
the checkpoint defaults). One frame = codebooks 1..15 for every row.

Runs are interleaved: each repetition times every implementation once (a
run: ``frames`` frames after one warm-up frame; its value is the median
frame), starting the order at a different implementation each repetition;
each ratio is the median over repetitions with its min and max. Timing is
only meaningful on a quiet machine.

The run writes a results file (bench/record.py: the command line, git
state, host, settings, and in ``raw`` every run's per-frame times, torch's
thread count and CPU capability, and the greedy-code comparison) into
bench/results/ (with ``--out DIR``, into DIR instead), and keeps a partial
copy in its run folder after every configuration (a stopped long run keeps
what it measured). The tables and targets are computed from ``raw``
(:func:`render`, what ``bench report`` shows) and printed. Greedy codes of
the three are compared on one frame per configuration (reported, not
asserted: a near-tie may differ in the last bits of float32 rounding).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

IMPLS = ("ours", "previous", "transformers")
MODES = ("greedy", "sampled")
TOP_K, TOP_P, TEMPERATURE = 50, 0.8, 1.0
# Qwen/Qwen3-Omni-30B-A3B(-Instruct) talker_config.code_predictor_config: transformers'
# Qwen3OmniMoeTalkerCodePredictorConfig defaults (documented against that checkpoint), with
# num_code_groups 16 as in the released checkpoint (the class default is 32) and its rope_theta.
RELEASED = {
    "vocab_size": 2048, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 5,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "num_code_groups": 16,
    "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
}
TARGETS = {"tiny": 8.0, "released": 3.0}  # ours / transformers per frame at batch 64, at least


KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "num_code_groups", "rms_norm_eps", "rope_parameters")


def tiny_config() -> dict[str, Any]:
    """The tiny checkpoint's code predictor widths (from the config it writes)."""
    import omni_common  # noqa: F401 -- torchvision shim before transformers
    from decoder_svc.qwen3_omni import tiny

    full = tiny._config().talker_config.code_predictor_config.to_dict()
    return {k: full[k] for k in KEYS}


def widths() -> dict[str, dict[str, Any]]:
    return {"tiny": tiny_config(), "released": dict(RELEASED)}


WIDTHS = ("tiny", "released")


def frame_gflop(cfg: dict[str, Any], batch: int) -> float:
    """Matrix-product GFLOP of one frame (G positions through the layers,
    G-1 heads), the floor every implementation pays."""
    hid, d = cfg["hidden_size"], cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    h, kv, inter = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"], \
        cfg["intermediate_size"]
    per_pos = cfg["num_hidden_layers"] * (hid * (h + 2 * kv) * d + h * d * hid + 3 * hid * inter)
    g = cfg["num_code_groups"]
    return 2.0 * batch * (g * per_pos + (g - 1) * hid * cfg["vocab_size"]) / 1e9


# -- the three implementations ------------------------------------------------------------


def _hf_model(cfg: dict[str, Any], seed: int):
    import omni_common  # noqa: F401, I001 -- torchvision shim before transformers
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
        Qwen3OmniMoeTalkerCodePredictorConfig,
    )
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration as HFCodePredictor,
    )

    torch.manual_seed(seed)
    model = HFCodePredictor._from_config(Qwen3OmniMoeTalkerCodePredictorConfig(**cfg)).float().eval()
    with torch.no_grad():  # weights that give peaked distributions (the default init is near-uniform)
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape))
            else:
                p.normal_(0.0, 0.5 if "embedding" in name else 1.5 * p.shape[-1] ** -0.5)
    model.generation_config.temperature = TEMPERATURE
    return model


def transformers_frame(model, past_hidden: torch.Tensor, last_id_hidden: torch.Tensor, do_sample: bool):
    """The talker's call (prepare_inputs_for_generation): [n, 1, H] each ->
    (codes [n, G-1], the summed codec embeddings of the frame [n, 1, H])."""
    kwargs: dict[str, Any] = {"do_sample": do_sample}
    if do_sample:
        kwargs.update(top_k=TOP_K, top_p=TOP_P)
    result = model.generate(
        inputs_embeds=torch.cat((past_hidden, last_id_hidden), dim=1),
        max_new_tokens=model.config.num_code_groups - 1,
        output_hidden_states=True,
        return_dict_in_generate=True,
        **kwargs,
    )
    mid = [hid[0] for hid in result.hidden_states[1:]]
    last = model.get_input_embeddings()[-1](result.sequences[..., -1:])
    return result.sequences, torch.cat([last_id_hidden] + mid + [last], dim=1).sum(1, keepdim=True)


class Bench:
    """One width: the three implementations on the same weights."""

    def __init__(self, cfg: dict[str, Any], seed: int = 0, compile: bool = False) -> None:
        from bench.baselines.code_predictor_v0 import CodePredictor as Previous
        from decoder_svc.qwen3_omni.code_predictor import CodePredictor

        self.cfg = cfg
        self.hf = _hf_model(cfg, seed)
        weights = {k: v.detach() for k, v in self.hf.state_dict().items()}
        self.ours = CodePredictor(cfg, compile=compile)
        self.ours.load(weights, prefix="")
        self.previous = Previous(cfg)
        self.previous.load(weights, prefix="")
        self.compiled = None
        if compile:
            self.compiled = CodePredictor(cfg, compile=True)
            self.compiled.load(weights, prefix="")
        self.frame_index = 0

    def inputs(self, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        hid = self.cfg["hidden_size"]
        return torch.randn(batch, hid, generator=gen), torch.randn(batch, hid, generator=gen) * 0.5

    def runner(self, impl: str, mode: str, hidden: torch.Tensor, emb0: torch.Tensor) -> Callable[[], torch.Tensor]:
        """A callable running one frame; returns its codes [n, G-1]."""
        from decoder_svc.qwen3_omni.code_sampling import SamplingBatch

        n = hidden.shape[0]
        sampled = mode == "sampled"
        temp = [TEMPERATURE if sampled else 0.0] * n
        if impl in ("ours", "ours-compiled"):
            model = self.ours if impl == "ours" else self.compiled
            assert model is not None, "ours-compiled: build the bench with compile=True"

            def ours() -> torch.Tensor:
                self.frame_index += 1
                s = SamplingBatch.build(temperature=temp, top_k=[TOP_K] * n, top_p=[TOP_P] * n,
                                        seed=list(range(n)), frame=[self.frame_index] * n,
                                        vocab_size=self.cfg["vocab_size"])
                return model.predict(hidden, emb0, s)[0]
            return ours
        if impl == "previous":
            gens = [torch.Generator().manual_seed(i) for i in range(n)] if sampled else [None] * n

            def previous() -> torch.Tensor:
                return self.previous.predict(hidden, emb0, temperature=temp, top_k=[TOP_K] * n, top_p=[TOP_P] * n,
                                             generators=gens)[0]
            return previous
        if impl == "transformers":
            past, last = hidden[:, None, :], emb0[:, None, :]

            def hf() -> torch.Tensor:
                return transformers_frame(self.hf, past, last, sampled)[0]
            return hf
        raise ValueError(f"impl: unknown {impl!r}")


def time_run(fn: Callable[[], Any], frames: int) -> list[float]:
    """One warm-up frame, then ``frames`` timed frames (seconds each)."""
    with torch.inference_mode():
        fn()
        out = []
        for _ in range(frames):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return out


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


# -- the suite -------------------------------------------------------------------------------


def run(args: argparse.Namespace, save: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """The suite (``args`` from :func:`build_parser`): a completed results
    file record. ``save`` gets the record so far after every configuration.
    torch's thread count is restored after."""
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _run(args, save or (lambda _: None))
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace, save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    from importlib import metadata

    from bench import record
    from bench.common import log

    chosen = [w.strip() for w in args.widths.split(",") if w.strip()]
    all_widths = widths()
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    impls = list(IMPLS) + (["ours-compiled"] if args.compile else [])
    settings: dict[str, Any] = {
        "widths": {w: all_widths[w] for w in chosen}, "batches": batches, "modes": modes,
        "impls": impls, "reps": args.reps, "dtype": "float32", "warmup_frames": 1,
        "frames": {w: args.frames or (5 if w == "tiny" else 2) for w in chosen},
        "sampling": {"temperature": TEMPERATURE, "top_k": TOP_K, "top_p": TOP_P},
        "released_widths_source": "transformers Qwen3OmniMoeTalkerCodePredictorConfig defaults (documented for "
                                  "Qwen/Qwen3-Omni-30B-A3B-Instruct) with the checkpoint's 16 code groups",
    }
    begun = record.begin("code-predictor", quick=args.quick, settings=settings)
    try:
        transformers_version = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        transformers_version = "not installed"
    raw: dict[str, Any] = {
        "torch_threads": torch.get_num_threads(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "transformers": transformers_version,
        "runs": [],
        "greedy_codes_equal": [],
    }
    for width in chosen:
        cfg = all_widths[width]
        frames = settings["frames"][width]
        log(f"code-predictor: {width} widths, building the three implementations")
        bench = Bench(cfg, compile=args.compile)
        for batch in batches:
            hidden, emb0 = bench.inputs(batch, seed=batch)
            # greedy codes of the three on one frame (reported, not asserted)
            with torch.inference_mode():
                ref = bench.runner("ours", "greedy", hidden, emb0)()
                raw["greedy_codes_equal"].append({
                    "width": width, "batch": batch,
                    **{impl: bool(torch.equal(bench.runner(impl, "greedy", hidden, emb0)(), ref))
                       for impl in ("previous", "transformers")},
                })
            for mode in modes:
                times: dict[str, list[float]] = {impl: [] for impl in impls}
                for rep in range(args.reps):
                    order = impls[rep % len(impls):] + impls[: rep % len(impls)]
                    for pos, impl in enumerate(order):
                        per_frame = time_run(bench.runner(impl, mode, hidden, emb0), frames)
                        med = statistics.median(per_frame)
                        times[impl].append(med)
                        raw["runs"].append({"width": width, "batch": batch, "mode": mode, "rep": rep,
                                               "order": pos, "impl": impl, "frame_s": per_frame, "median_s": med})
                    log(f"  {width} batch {batch} {mode} rep {rep}: "
                        + ", ".join(f"{i} {times[i][-1] * 1e3:.1f} ms" for i in impls))
                save(record.complete(begun, raw))
    return record.complete(begun, raw)


def summarize(rec: dict[str, Any]) -> list[dict[str, Any]]:
    """Per (width, batch, mode): each implementation's median frame time and
    GFLOP/s, and every ratio to ours as median / min / max over the
    repetitions, computed from the record's raw runs."""
    settings, runs = rec["settings"], rec["raw"]["runs"]
    impls = settings["impls"]
    summary = []
    for width in settings["widths"]:
        cfg = settings["widths"][width]
        for batch in settings["batches"]:
            for mode in settings["modes"]:
                times: dict[str, list[float]] = {impl: [] for impl in impls}
                for r in sorted((r for r in runs if (r["width"], r["batch"], r["mode"]) == (width, batch, mode)),
                                key=lambda r: r["rep"]):
                    times[r["impl"]].append(r["median_s"])
                if not times["ours"]:
                    continue  # a partial file: this configuration did not run
                gflop = frame_gflop(cfg, batch)
                row: dict[str, Any] = {"width": width, "batch": batch, "mode": mode, "gflop_per_frame": gflop}
                for impl in impls:
                    row[f"{impl}_ms"] = statistics.median(times[impl]) * 1e3
                    row[f"{impl}_gflops"] = gflop / statistics.median(times[impl])
                for impl in impls:
                    if impl != "ours":
                        row[f"speedup_vs_{impl}"] = spread([a / b for a, b in zip(times[impl], times["ours"],
                                                                                  strict=True)])
                summary.append(row)
    return summary


def targets(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for width, goal in TARGETS.items():
        for mode in MODES:
            rows = [r for r in summary if r["width"] == width and r["mode"] == mode]
            b64 = next((r for r in rows if r["batch"] == 64), None)
            if b64 is not None:
                m = b64["speedup_vs_transformers"]["median"]
                out.append({"name": f"ours / transformers per frame, {width}, batch 64, {mode}", "measured": m,
                            "goal": f">= {goal}x", "met": m >= goal})
            b1 = next((r for r in rows if r["batch"] == 1), None)
            if b1 is not None:
                m = b1["speedup_vs_transformers"]["median"]
                out.append({"name": f"ours / transformers per frame, {width}, batch 1, {mode}", "measured": m,
                            "goal": ">= 1x (not slower)", "met": m >= 1.0})
    return out


def render(rec: dict[str, Any]) -> str:
    """The tables and targets from a results file (what ``bench report`` shows)."""
    from bench.common import md_table

    impls = rec["settings"]["impls"]
    summary = summarize(rec)
    rows = []
    for r in summary:
        cells = [r["width"], r["batch"], r["mode"]] + [r[f"{i}_ms"] for i in impls]
        for i in impls:
            if i != "ours":
                s = r[f"speedup_vs_{i}"]
                cells.append(f"{s['median']:.2f}x ({s['min']:.2f}-{s['max']:.2f})")
        cells.append(r["ours_gflops"])
        rows.append(cells)
    headers = (["width", "batch", "mode"] + [f"{i} ms/frame" for i in impls]
               + [f"ours vs {i}" for i in impls if i != "ours"] + ["ours GFLOP/s"])
    h, raw = rec["host"], rec["raw"]
    lines = [f"code predictor per frame ({h['cpu_model']}, {h['cores_available']} cores, {raw['torch_threads']} "
             f"threads, {raw['torch_cpu_capability']}; median of {rec['settings']['reps']} interleaved runs, "
             "spread min-max)",
             "", md_table(headers, rows), "", "| target | measured | goal | met |", "|---|---|---|---|"]
    for t in targets(summary):
        lines.append(f"| {t['name']} | {t['measured']:.2f}x | {t['goal']} | {'yes' if t['met'] else 'no'} |")
    eq = raw["greedy_codes_equal"]
    lines += ["", "greedy codes equal to ours: " + ", ".join(
        f"{e['width']}/{e['batch']}: previous {'yes' if e['previous'] else 'NO'}, transformers "
        f"{'yes' if e['transformers'] else 'NO'}" for e in eq)]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="omni-serving bench code-predictor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="", metavar="DIR",
                   help="run folder (default bench/results/code-predictor-<timestamp>/); the results file goes "
                        "there too instead of bench/results/")
    p.add_argument("--slug", default="", help="names the results file (default: quick or full)")
    p.add_argument("--quick", action="store_true",
                   help="a check that the suite works, in seconds: tiny widths, batches 1 and 4, 2 frames a run")
    p.add_argument("--widths", default=None, help="comma-separated: tiny, released (default both; --quick: tiny)")
    p.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,16,64; --quick: 1,4)")
    p.add_argument("--modes", default="greedy,sampled", help="comma-separated: greedy, sampled")
    p.add_argument("--reps", type=int, default=3, help="interleaved repetitions (each ratio: their median)")
    p.add_argument("--frames", type=int, default=0,
                   help="timed frames per run (default 5 at tiny widths, 2 at released widths)")
    p.add_argument("--threads", type=int, default=0, help="torch threads for all (default: torch's default)")
    p.add_argument("--compile", action="store_true",
                   help="also time ours with torch.compile (compile time is not in the timed frames)")
    return p


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick:
        args.widths, args.batches, args.frames = args.widths or "tiny", args.batches or "1,4", args.frames or 2
    args.widths, args.batches = args.widths or "tiny,released", args.batches or "1,16,64"
    for w in args.widths.split(","):
        if w.strip() and w.strip() not in WIDTHS:
            parser.error(f"--widths: unknown {w.strip()!r} (choices: {', '.join(WIDTHS)})")
    for m in args.modes.split(","):
        if m.strip() and m.strip() not in MODES:
            parser.error(f"--modes: unknown {m.strip()!r} (choices: {', '.join(MODES)})")
    try:
        if not all(int(b) > 0 for b in args.batches.split(",") if b.strip()):
            raise ValueError
    except ValueError:
        parser.error(f"--batches: expected positive integers separated by commas, got {args.batches!r}")
    if args.reps < 1 or args.frames < 0:
        parser.error("--reps: must be >= 1; --frames: must be >= 0")
    from bench import record
    from bench.common import log, results_dir

    folder = results_dir("code-predictor", args.out or None)
    t0 = time.perf_counter()

    def save_partial(rec: dict[str, Any]) -> None:
        (folder / "partial.json").write_text(record.dumps(rec) + "\n")

    rec = run(args, save_partial)
    md = render(rec)
    path = record.save(rec, folder if args.out else record.RESULTS_DIR, slug=args.slug,
                       argv=["code-predictor", *argv], wall_s=time.perf_counter() - t0)
    (folder / "results.md").write_text(md)
    (folder / "partial.json").unlink(missing_ok=True)
    print(md)
    log(f"code-predictor: done in {time.perf_counter() - t0:.0f}s; results file {path}")
    print(f"\nresults file: {path}")
    return 0
