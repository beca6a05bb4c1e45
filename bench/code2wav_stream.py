"""code2wav-stream: stateful streaming vs left-context re-decode of Qwen3-Omni Code2Wav.

    python -m bench.code2wav_stream [--frames 200] [--chunk 25] [--out DIR] [--released-size]

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
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import fmt, machine_info, machine_md, md_table, write_json
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


def _time_ms(fn, repeats: int) -> float:
    """Mean wall time of fn() over repeats, in ms."""
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) * 1e3 / repeats


def run(
    frames: int = 200,
    chunk: int = 25,
    released_size: bool = False,
    seed: int = 0,
    repeats: int = 3,
    left_contexts: tuple[int, ...] = LEFT_CONTEXTS,
) -> dict[str, Any]:
    config = dict(RELEASED_CONFIG if released_size else TINY_CONFIG)
    model = Code2Wav.from_config_and_tensors(config, random_tensors(config, seed=seed))
    codes = torch.randint(
        0,
        model.codebook_size,
        (frames, model.num_quantizers),
        generator=torch.Generator().manual_seed(seed),
    )
    spf, chunk_audio_ms = (
        model.samples_per_frame,
        chunk * model.samples_per_frame / model.sample_rate * 1e3,
    )
    n_chunks = -(-frames // chunk)

    # Every method runs once untimed first: the first call of each input shape
    # pays for kernel setup (a fresh re-decode window length costs up to ~10x).
    whole = model.decode(codes)
    whole_ms = _time_ms(lambda: model.decode(codes), repeats)

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
    stream_err = max(_max_err(stream_pass(stream_ms), whole) for _ in range(repeats))
    stream_mean = sum(stream_ms) / len(stream_ms)

    min_context = -(-model.tail_samples // spf)
    redecode = []
    for left in left_contexts:
        err = _max_err(decode_with_left_context(model, codes, chunk, left), whole)
        redo = functools.partial(decode_with_left_context, model, codes, chunk, left)
        mean_ms = _time_ms(redo, repeats) / n_chunks
        effective = max(left, min_context)
        decoded = sum(
            min(s + chunk, frames) - s + min(effective, s) for s in range(0, frames, chunk)
        )
        redecode.append(
            {
                "left_context": left,
                "effective_left_context": effective,
                "max_abs_err": err,
                "mean_ms_per_chunk": mean_ms,
                "frames_decoded_per_chunk": decoded / n_chunks,
                "cost_vs_stream": mean_ms / stream_mean,
            }
        )

    cfg = Code2WavConfig.from_dict(config)
    load = [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None
    return {
        "suite": "code2wav-stream",
        "model": "released-size" if released_size else "tiny",
        "config": {
            "num_hidden_layers": cfg.num_hidden_layers,
            "hidden_size": cfg.hidden_size,
            "decoder_dim": cfg.decoder_dim,
            "sliding_window": cfg.sliding_window,
            "samples_per_frame": spf,
            "tail_samples": model.tail_samples,
        },
        "frames": frames,
        "chunk_frames": chunk,
        "chunk_audio_ms": chunk_audio_ms,
        "repeats": repeats,
        "seed": seed,
        "threads": torch.get_num_threads(),
        "load_average": load,
        "whole_decode_ms": whole_ms,
        "whole_rms": float(whole.pow(2).mean().sqrt()),
        "stream": {
            "max_abs_err": stream_err,
            "mean_ms_per_chunk": stream_mean,
            "max_ms_per_chunk": max(stream_ms),
            "frames_decoded_per_chunk": frames / n_chunks,
        },
        "left_context": redecode,
        "machine": machine_info(),
    }


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
    return f"{head}\n\n{table}\n\n{machine_md(res['machine'])}\n"


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
    parser.add_argument("--out", default=None, help="folder for results.json and results.md")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    res = run(
        args.frames, args.chunk, args.released_size, args.seed, args.repeats, args.left_contexts
    )
    md = markdown(res)
    print(md)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "results.json", res)
        (out / "results.md").write_text(md)
        print(f"wrote {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
