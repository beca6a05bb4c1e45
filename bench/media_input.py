"""media-input: the audio and vision towers' share of the thinker's first step.

    python -m bench.media_input [--audio-seconds 2,10,30] [--images 448x448,896x896] [--repeats 3]
    (or omni-serving bench media-input ...)

The thinker of the tiny checkpoint (the model cache's, or ``--checkpoint``)
runs in this process on vLLM, as a stage process runs it. For each input, a
request with that audio clip (or image) and a short question is prefilled
``repeats`` times (each time a new request, after one untimed): the step's
wall time, and the encoder's own forward time inside it (a forward hook on
vLLM's ``audio_tower`` / ``visual`` module), with the prompt's token count
and the media's tokens. The table's share is encoder time / step time: how
much of a media prompt's first step the encoder is. Times are wall-clock on
whatever else the machine is doing: read the shares, not the milliseconds.

The results file (bench/record.py) holds every timed step; the table is
computed from it by ``analyze`` (what ``bench report`` shows).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np

from bench import record
from bench.common import fmt, machine_md, md_table, summary

__all__ = ["analyze", "main", "render", "run"]

QUESTION = "What is in it?"


def _inputs(audio_seconds: tuple[float, ...], images: tuple[tuple[int, int], ...]) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    out: list[dict[str, Any]] = []
    for s in audio_seconds:
        t = np.arange(int(s * 16000)) / 16000
        clip = (0.2 * np.sin(2 * np.pi * 220 * t) + 0.01 * rng.standard_normal(t.size)).astype(np.float32)
        out.append({"kind": "audio", "label": f"audio {s:g} s", "audio": clip})
    for h, w in images:
        out.append({"kind": "image", "label": f"image {w}x{h}",
                    "image": (rng.random((h, w, 3)) * 255).astype(np.uint8)})
    return out


def run(checkpoint: str = "", audio_seconds: tuple[float, ...] = (2.0, 10.0, 30.0),
        images: tuple[tuple[int, int], ...] = ((448, 448), (896, 896)), repeats: int = 3) -> dict[str, Any]:
    """Measures and returns the completed record (bench/record.py)."""
    import torch

    from decoder_svc.backend import RequestSpec
    from decoder_svc.profile import load_profile
    from decoder_svc.qwen3_omni.engine import build_engine
    from decoder_svc.vllm_engine.engine_factory import get_model_runner
    from omni_common.media import AudioInput, ImageInput

    settings = {"checkpoint": checkpoint or "tiny (the model cache's)", "audio_seconds": list(audio_seconds),
                "images": [f"{w}x{h}" for h, w in images], "repeats": repeats}
    rec = record.begin("media-input", quick=False, settings=settings)
    engine = build_engine(load_profile("omni"), checkpoint or None, max_num_seqs=4)
    rows: list[dict[str, Any]] = []
    try:
        thinker = engine.backends["thinker"]
        model = get_model_runner(thinker.engine).model
        tower_s: list[float] = []
        for module in (model.audio_tower, model.visual):
            module.register_forward_pre_hook(lambda *_: tower_s.append(-time.perf_counter()))
            module.register_forward_hook(lambda *_: tower_s.append(time.perf_counter()))
        n = 0
        for item in _inputs(audio_seconds, images):
            part = AudioInput(b"") if item["kind"] == "audio" else ImageInput(b"")
            media = {"audio": (item["audio"],)} if item["kind"] == "audio" else {"images": (item["image"],)}
            step_ms, tower_ms, prompt = [], [], 0
            for i in range(repeats + 1):
                n += 1
                spec = engine.prepare(RequestSpec(request_id=f"m{n}", prompt="", max_tokens=1,
                                                  messages=(("user", (part, QUESTION)),), **media))
                thinker.add_request(spec)
                tower_s.clear()
                t0 = time.perf_counter()
                thinker.step()  # the prefill: the encoder and the thinker's forward over the prompt
                took = (time.perf_counter() - t0) * 1e3
                while thinker.has_unfinished():
                    thinker.step()
                if i:  # the first of each input is untimed (kernel set-up for its shapes)
                    step_ms.append(took)
                    tower_ms.append(sum(tower_s) * 1e3)
                prompt = len(spec.prompt_token_ids)
            token = thinker.audio_token if item["kind"] == "audio" else thinker.image_token
            rows.append({"input": item["label"], "kind": item["kind"], "prompt_tokens": prompt,
                         "media_tokens": sum(1 for t in spec.prompt_token_ids if t == token),
                         "step_ms": step_ms, "tower_ms": tower_ms})
        threads = torch.get_num_threads()
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    finally:
        engine.close()
    return record.complete(rec, {"inputs": rows, "threads": threads, "dtype": dtype})


def analyze(rec: dict[str, Any]) -> dict[str, Any]:
    """Per input: median step and encoder times, the encoder's share of the step."""
    out = []
    for r in rec["raw"]["inputs"]:
        step, tower = summary(r["step_ms"])["p50"], summary(r["tower_ms"])["p50"]
        shares = [t / s for t, s in zip(r["tower_ms"], r["step_ms"], strict=True) if s > 0]
        out.append({**{k: r[k] for k in ("input", "prompt_tokens", "media_tokens")}, "step_ms": step,
                    "tower_ms": tower, "share": summary(shares)["p50"] if shares else 0.0,
                    "share_min": min(shares, default=0.0), "share_max": max(shares, default=0.0)})
    return {"rows": out, "threads": rec["raw"]["threads"], "dtype": rec["raw"]["dtype"],
            "repeats": rec["settings"]["repeats"],
            "checkpoint": rec["settings"]["checkpoint"], "load_average": rec["run"]["load_average_end"],
            "machine": rec["host"], "date": rec["date"]}


def render(rec: dict[str, Any]) -> str:
    """The table from a results file (what `bench report` shows)."""
    res = analyze(rec)
    head = (f"The thinker of the {res['checkpoint']} checkpoint on vLLM in one process ({res['dtype']}, the "
            f"deployment's default engine settings), {res['threads']} threads; "
            f"each input prefilled {res['repeats']} times after one untimed; medians, the share's range in "
            f"brackets; load average at the end {res['load_average']}.")
    rows = [[r["input"], r["media_tokens"], r["prompt_tokens"], fmt(r["step_ms"]), fmt(r["tower_ms"]),
             f"{r['share']:.0%} ({r['share_min']:.0%}-{r['share_max']:.0%})"] for r in res["rows"]]
    table = md_table(["input", "media tokens", "prompt tokens", "first step (ms)", "encoder (ms)",
                      "encoder share of the step"], rows)
    return f"{head}\n\n{table}\n\n{machine_md(res['machine'], res['date'])}\n"


def _pairs(text: str) -> tuple[tuple[int, int], ...]:
    out = []
    for item in filter(None, text.split(",")):
        w, _, h = item.partition("x")
        out.append((int(h), int(w)))
    return tuple(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="omni-serving bench media-input", description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", default="", help="a Qwen3-Omni checkpoint (default: the tiny one)")
    parser.add_argument("--audio-seconds", default="2,10,30", help="clip lengths, comma-separated")
    parser.add_argument("--images", default="448x448,896x896", help="image sizes WxH, comma-separated")
    parser.add_argument("--repeats", type=int, default=3, help="timed prefills per input, after one untimed")
    parser.add_argument("--out", default=None, help="folder for the results file (default: bench/results/)")
    parser.add_argument("--slug", default="", help="names the results file (default: full)")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    rec = run(args.checkpoint, tuple(float(s) for s in args.audio_seconds.split(",") if s),
              _pairs(args.images), args.repeats)
    record.publish(rec, render(rec), out=args.out, slug=args.slug, argv=argv, suite="media-input", started=t0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
