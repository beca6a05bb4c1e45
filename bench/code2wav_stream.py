"""code2wav-stream: stateful streaming vs left-context re-decode of Qwen3-Omni Code2Wav.

    python -m bench.code2wav_stream [--frames 200] [--chunk 25] [--out DIR] [--slug NAME] [--released-size]

One seeded random-weight Code2Wav (``decoder_svc.qwen3_omni.code2wav``) decodes
the same random codes three ways, and each way's audio is compared with the
whole-sequence decode:

  stream        ``Code2WavStream.push`` per chunk: every layer carries its
                state (KV window, conv histories), a chunk costs its own frames
  left context  per chunk, decode the chunk again together with up to
                ``left_context`` earlier frames and keep the chunk's samples
                (``decode_with_left_context``, gapless); a context shorter than
                the model's receptive field changes the audio
  whole         one decode of all frames (the reference audio, and its time)

The default model is tiny (2 layers, hidden 128, decoder_dim 96: the test
suite's shape); ``--released-size`` uses the released widths (8 layers, hidden
1024, decoder_dim 1536), which is slow on a CPU. Times are wall-clock on
whatever else the machine is doing: read them as ratios.

The run writes a results file (bench/record.py: every timed pass and chunk,
the errors, the model's shape) into bench/results/ or ``--out``; the table
is computed from it by ``analyze`` (the same code ``bench report`` uses).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench import record
from bench.common import fmt, machine_md, md_table, ratio, summary
from decoder_svc.qwen3_omni.code2wav import (
    Code2Wav,
    decode_with_left_context,
    random_tensors,
)
from decoder_svc.qwen3_omni.code2wav_layers import Code2WavConfig

TINY_CONFIG: dict[str, Any] = dict(
    codebook_size=2048,
    num_quantizers=16,
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    intermediate_size=256,
    sliding_window=72,
    upsampling_ratios=[2, 2],
    upsample_rates=[8, 5, 4, 3],
    decoder_dim=96,
)
RELEASED_CONFIG: dict[str, Any] = {}  # the config class defaults are the released sizes
LEFT_CONTEXTS = (0, 25, 50, 75, 150, 300)


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        raise AssertionError(f"length {tuple(a.shape)} != whole decode {tuple(b.shape)}")
    return float((a - b).abs().max())


def _times_ms(fn, repeats: int) -> list[float]:
    """Wall time of each of `repeats` calls of fn(), in ms."""
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def run(
    frames: int = 200,
    chunk: int = 25,
    released_size: bool = False,
    seed: int = 0,
    repeats: int = 3,
    left_contexts: tuple[int, ...] = LEFT_CONTEXTS,
) -> dict[str, Any]:
    """Measures and returns the completed record (bench/record.py)."""
    settings = {"frames": frames, "chunk_frames": chunk, "model": "released-size" if released_size else "tiny",
                "seed": seed, "repeats": repeats, "left_contexts": list(left_contexts)}
    rec = record.begin("code2wav-stream", quick=False, settings=settings)
    config = dict(RELEASED_CONFIG if released_size else TINY_CONFIG)
    model = Code2Wav.from_config_and_tensors(config, random_tensors(config, seed=seed))
    codes = torch.randint(
        0,
        model.codebook_size,
        (frames, model.num_quantizers),
        generator=torch.Generator().manual_seed(seed),
    )

    # Every method runs once untimed first: the first call of each input shape
    # pays for kernel setup (a fresh re-decode window length costs up to ~10x).
    whole = model.decode(codes)
    whole_ms = _times_ms(lambda: model.decode(codes), repeats)

    def stream_pass(times: list[float] | None) -> torch.Tensor:
        stream = model.new_stream()
        pieces = []
        for start in range(0, frames, chunk):
            t0 = time.perf_counter()
            pieces.append(stream.push(codes[start : start + chunk]))
            if times is not None:
                times.append((time.perf_counter() - t0) * 1e3)
        return torch.cat(pieces)

    stream_pass(None)
    stream_ms: list[float] = []
    stream_err = [_max_err(stream_pass(stream_ms), whole) for _ in range(repeats)]

    redecode = []
    for left in left_contexts:
        err = _max_err(decode_with_left_context(model, codes, chunk, left), whole)
        redo = functools.partial(decode_with_left_context, model, codes, chunk, left)
        redecode.append({"left_context": left, "max_abs_err": err, "pass_ms": _times_ms(redo, repeats)})

    cfg = Code2WavConfig.from_dict(config)
    return record.complete(rec, {
        "model_config": {
            "num_hidden_layers": cfg.num_hidden_layers,
            "hidden_size": cfg.hidden_size,
            "decoder_dim": cfg.decoder_dim,
            "sliding_window": cfg.sliding_window,
            "samples_per_frame": model.samples_per_frame,
            "sample_rate": model.sample_rate,
            "tail_samples": model.tail_samples,
        },
        "threads": torch.get_num_threads(),
        "whole_decode_ms": whole_ms,
        "whole_rms": float(whole.pow(2).mean().sqrt()),
        "stream": {"chunk_ms": stream_ms, "max_abs_err": stream_err},
        "left_context": redecode,
    })


def analyze(rec: dict[str, Any]) -> dict[str, Any]:
    """The table's numbers from a results file's record: per method the
    frames decoded per chunk, the error against the whole decode, the mean
    time per chunk and its cost against the stateful stream."""
    raw, settings = rec["raw"], rec["settings"]
    c = raw["model_config"]
    frames, chunk = settings["frames"], settings["chunk_frames"]
    n_chunks = -(-frames // chunk)
    min_context = -(-c["tail_samples"] // c["samples_per_frame"])
    stream_mean = summary(raw["stream"]["chunk_ms"])["mean"]
    left = []
    for r in raw["left_context"]:
        mean_ms = summary(r["pass_ms"])["mean"] / n_chunks
        effective = max(r["left_context"], min_context)
        decoded = sum(min(s + chunk, frames) - s + min(effective, s) for s in range(0, frames, chunk))
        left.append({"left_context": r["left_context"], "effective_left_context": effective,
                     "max_abs_err": r["max_abs_err"], "mean_ms_per_chunk": mean_ms,
                     "frames_decoded_per_chunk": decoded / n_chunks, "cost_vs_stream": ratio(mean_ms, stream_mean)})
    return {
        "suite": "code2wav-stream", "model": settings["model"], "config": c, "frames": frames, "chunk_frames": chunk,
        "chunk_audio_ms": chunk * c["samples_per_frame"] / c["sample_rate"] * 1e3, "threads": raw["threads"],
        "load_average": rec["run"]["load_average_end"], "whole_decode_ms": summary(raw["whole_decode_ms"])["mean"],
        "whole_rms": raw["whole_rms"],
        "stream": {"max_abs_err": max(raw["stream"]["max_abs_err"]), "mean_ms_per_chunk": stream_mean,
                   "max_ms_per_chunk": summary(raw["stream"]["chunk_ms"])["max"],
                   "frames_decoded_per_chunk": frames / n_chunks},
        "left_context": left, "machine": rec["host"], "date": rec["date"],
    }


def render(rec: dict[str, Any]) -> str:
    """The table from a results file (what `bench report` shows)."""
    return markdown(analyze(rec))


def markdown(res: dict[str, Any]) -> str:
    c = res["config"]
    head = (
        f"Code2Wav ({res['model']}: {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, "
        f"decoder_dim {c['decoder_dim']}, sliding window {c['sliding_window']}), "
        f"{res['frames']} frames in chunks of {res['chunk_frames']} "
        f"({fmt(res['chunk_audio_ms'])} ms of audio each), {res['threads']} threads; "
        f"whole decode {fmt(res['whole_decode_ms'])} ms, audio rms {fmt(res['whole_rms'])}; "
        f"load average at the end {res['load_average']}."
    )
    s = res["stream"]
    rows = [
        [
            "stateful stream",
            "all (carried state)",
            s["frames_decoded_per_chunk"],
            s["max_abs_err"],
            s["mean_ms_per_chunk"],
            1.0,
        ]
    ]
    for r in res["left_context"]:
        ctx = str(r["left_context"])
        if r["effective_left_context"] != r["left_context"]:
            ctx += f" (used {r['effective_left_context']})"
        rows.append(
            [
                "left-context re-decode",
                ctx,
                r["frames_decoded_per_chunk"],
                r["max_abs_err"],
                r["mean_ms_per_chunk"],
                r["cost_vs_stream"],
            ]
        )
    table = md_table(
        [
            "method",
            "left context (frames)",
            "frames decoded / chunk",
            "max abs err vs whole",
            "mean ms / chunk",
            "cost vs stream",
        ],
        rows,
    )
    return f"{head}\n\n{table}\n\n{machine_md(res['machine'], res['date'])}\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.code2wav_stream", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--frames", type=int, default=200)
    parser.add_argument("--chunk", type=int, default=25)
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed passes per method, after one untimed"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: torch's; 1 is steadier on a busy machine)",
    )
    parser.add_argument(
        "--left-contexts",
        type=lambda s: tuple(int(v) for v in s.split(",")),
        default=LEFT_CONTEXTS,
        help="comma-separated left contexts in frames",
    )
    parser.add_argument("--released-size", action="store_true", help="8 layers, hidden 1024 (slow)")
    parser.add_argument(
        "--out",
        default=None,
        help="folder for the results file and results.md (default: the results file in bench/results/)",
    )
    parser.add_argument("--slug", default="", help="names the results file (default: full)")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    rec = run(
        args.frames, args.chunk, args.released_size, args.seed, args.repeats, args.left_contexts
    )
    md = render(rec)
    print(md)
    folder = Path(args.out) if args.out else record.RESULTS_DIR
    path = record.save(rec, folder, slug=args.slug, argv=argv, program="python -m bench.code2wav_stream",
                       wall_s=time.perf_counter() - t0)
    if args.out:
        (folder / "results.md").write_text(md)
    print(f"results file: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
