"""realtime: a spoken turn's time to first audio, and barge-in, on the realtime session.

    python -m bench.realtime [--sessions 16] [--speech-seconds 3] [--runs 3] [--engine vllm|fake]
    (or omni-serving bench realtime ...)

A stack (the ``omni`` profile; vLLM serving the tiny Qwen3-Omni checkpoint
of the model cache, or ``--checkpoint``; ``--engine fake`` for a tooling
check) is started once. Each run has two phases of ``sessions`` concurrent
WebSocket sessions (``GET /v1/realtime``, turns committed by hand):

* **spoken**: each session appends ``speech-seconds`` of speech (espeak-ng,
  cut or padded to that length; a tone where espeak-ng is missing, which
  the results file says) in 100 ms pieces as fast as it can, then commits
  and asks for the answer: the time from the commit to the first
  ``response.output_audio.delta``;
* **typed**: the same with a text question instead (the deployment's text-in
  time to first audio at the same concurrency): from ``response.create``.

In both, each session cancels its response at its first audio delta (an
answer that ends before any audio, as a random-weight model's may, is
counted apart)
(barge-in): the audio deltas it still receives after ``response.cancel``
(and when the last came), the time to ``response.done``, and, once every
session has cancelled, the time until
the decoder holds no request (``GetDecoderInfo.active_requests``: the
requests aborted, their KV cache freed). The table gives each run's p50 and
p99 and their medians over the runs; the ratio is spoken over typed.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import shutil
import subprocess
import sys
import tempfile
import time
import wave
from pathlib import Path
from typing import Any

import numpy as np

from bench import record
from bench.common import fmt, log, machine_md, md_table, summary

__all__ = ["analyze", "main", "render", "run"]

RATE = 24_000
QUESTION = "What is the weather like on the coast today?"
PIECE_BYTES = 4800  # 100 ms of PCM16


def speech(seconds: float) -> tuple[bytes, str]:
    """PCM16 24 kHz of `seconds`: espeak-ng speaking the question (repeated or
    cut to length), or a tone; and which."""
    n = int(seconds * RATE)
    if shutil.which("espeak-ng") and shutil.which("sox"):
        with tempfile.TemporaryDirectory() as d:
            raw, out = Path(d) / "raw.wav", Path(d) / "q.wav"
            subprocess.run(["espeak-ng", "-w", str(raw), QUESTION], check=True, capture_output=True)
            subprocess.run(["sox", str(raw), "-r", str(RATE), "-c", "1", "-b", "16", str(out), "norm", "-6"],
                           check=True, capture_output=True)
            with wave.open(str(out)) as w:
                voice = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
        return np.resize(voice, n).astype("<i2").tobytes(), "espeak-ng"
    t = np.arange(n) / RATE
    return (np.sin(2 * np.pi * 220 * t) * 0.3 * 32767).astype("<i2").tobytes(), "tone"


async def _session(url: str, pcm: bytes | None, go: asyncio.Event) -> dict[str, float]:
    """One turn; times in ms."""
    import aiohttp

    async with aiohttp.ClientSession() as http, http.ws_connect(url, max_msg_size=0) as ws:

        async def until(kind: str) -> dict:
            while True:
                event = json.loads((await ws.receive()).data)
                if event["type"] == "error":
                    raise RuntimeError(f"realtime error: {event['error']}")
                if event["type"] == kind:
                    return event

        await until("session.created")
        await ws.send_json({"type": "session.update",
                            "session": {"type": "realtime", "audio": {"input": {"turn_detection": None}}}})
        await until("session.updated")
        if pcm is None:
            await ws.send_json({"type": "conversation.item.create", "item": {
                "type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}})
            await until("conversation.item.done")
        await go.wait()
        t_append = time.perf_counter()
        if pcm is not None:
            for i in range(0, len(pcm), PIECE_BYTES):
                await ws.send_json({"type": "input_audio_buffer.append",
                                    "audio": base64.b64encode(pcm[i:i + PIECE_BYTES]).decode()})
            await ws.send_json({"type": "input_audio_buffer.commit"})
        t0 = time.perf_counter()
        await ws.send_json({"type": "response.create"})
        while True:  # the first audio; or, rarely, an answer that ends before any (a random model's end token)
            event = json.loads((await ws.receive()).data)
            if event["type"] == "error":
                raise RuntimeError(f"realtime error: {event['error']}")
            if event["type"] in ("response.output_audio.delta", "response.done"):
                break
        t_first = time.perf_counter()
        if event["type"] == "response.done":
            return {"append_ms": (t0 - t_append) * 1e3, "first_audio_ms": None, "deltas_after_cancel": 0,
                    "cancel_to_last_delta_ms": 0.0, "cancel_to_done_ms": None, "cancelled": False,
                    "t_cancel": t_first}
        await ws.send_json({"type": "response.cancel"})
        t_cancel = last_delta = time.perf_counter()
        late = 0  # audio deltas after the cancel was sent (already on their way, or not stopped)
        while True:
            event = json.loads((await ws.receive()).data)
            if event["type"] == "response.output_audio.delta":
                last_delta, late = time.perf_counter(), late + 1
            elif event["type"] == "response.done":
                t_done = time.perf_counter()
                status = event["response"]["status"]
                break
        return {"append_ms": (t0 - t_append) * 1e3, "first_audio_ms": (t_first - t0) * 1e3,
                "deltas_after_cancel": late, "cancel_to_last_delta_ms": (last_delta - t_cancel) * 1e3 if late else 0.0,
                "cancel_to_done_ms": (t_done - t_cancel) * 1e3, "cancelled": status == "cancelled",
                "t_cancel": t_cancel}


def _active(target: str) -> int:
    import grpc

    from omni_serving.v1 import decoder_pb2, decoder_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        return decoder_pb2_grpc.DecoderServiceStub(channel).GetDecoderInfo(
            decoder_pb2.GetDecoderInfoRequest(), timeout=30).active_requests


async def _phase(url: str, decoder: str, sessions: int, pcm: bytes | None) -> dict[str, Any]:
    go = asyncio.Event()
    tasks = [asyncio.create_task(_session(url, pcm, go)) for _ in range(sessions)]
    await asyncio.sleep(0.5)  # every session connected and set up before the turns start
    go.set()
    turns = await asyncio.gather(*tasks)
    last_cancel = max(t.pop("t_cancel") for t in turns)
    while await asyncio.to_thread(_active, decoder):
        await asyncio.sleep(0.01)
    return {"turns": turns, "freed_after_last_cancel_ms": (time.perf_counter() - last_cancel) * 1e3}


def run(engine: str = "vllm", checkpoint: str = "", sessions: int = 16, speech_seconds: float = 3.0,
        runs: int = 3, quick: bool = False) -> dict[str, Any]:
    """Measures and returns the completed record (bench/record.py)."""
    from omni_stack.config import StackConfig
    from omni_stack.stack import Stack

    pcm, source = speech(speech_seconds)
    settings = {"engine": engine, "checkpoint": checkpoint or ("tiny (the model cache's)" if engine == "vllm" else ""),
                "sessions": sessions, "speech_seconds": speech_seconds, "runs": runs, "speech": source}
    rec = record.begin("realtime", quick=quick, settings=settings)
    with tempfile.TemporaryDirectory(prefix="bench-realtime-") as runtime:
        stack = Stack(StackConfig(profile="omni", engine=engine, model=checkpoint, port=0, http_port=0,
                                  runtime_dir=runtime, log_level="WARNING"))
        stack.start(timeout_s=600)
        url = stack.http_url.replace("http://", "ws://") + "/v1/realtime"
        out: list[dict[str, Any]] = []
        try:
            asyncio.run(_phase(url, stack.decoder_target, min(2, sessions), pcm))  # warm-up, untimed
            for i in range(runs):
                one = {}
                for name, question in (("spoken", pcm), ("typed", None)):
                    log(f"realtime: run {i + 1}/{runs}, {name}, {sessions} sessions")
                    one[name] = asyncio.run(_phase(url, stack.decoder_target, sessions, question))
                out.append(one)
        finally:
            problems = stack.stop()
    return record.complete(rec, {"runs": out, "stop_problems": problems})


MEASURES = ("first_audio_ms", "cancel_to_done_ms")


def analyze(rec: dict[str, Any]) -> dict[str, Any]:
    """Per phase and measure: each run's p50 and p99, their medians over the runs."""
    phases: dict[str, Any] = {}
    for name in ("spoken", "typed"):
        rows = {}
        for m in MEASURES:  # turns answered without audio have none of these
            per_run = [summary([t[m] for t in r[name]["turns"] if t[m] is not None]) for r in rec["raw"]["runs"]]
            rows[m] = {"p50": float(np.median([s["p50"] for s in per_run])),
                       "p99": float(np.median([s["p99"] for s in per_run])),
                       "runs_p50": [s["p50"] for s in per_run]}
        rows["freed_ms"] = float(np.median([r[name]["freed_after_last_cancel_ms"] for r in rec["raw"]["runs"]]))
        rows["cancelled"] = sum(t["cancelled"] for r in rec["raw"]["runs"] for t in r[name]["turns"])
        rows["late_deltas"] = sum(t["deltas_after_cancel"] for r in rec["raw"]["runs"] for t in r[name]["turns"])
        rows["late_max_ms"] = max(t["cancel_to_last_delta_ms"] for r in rec["raw"]["runs"] for t in r[name]["turns"])
        rows["turns"] = sum(len(r[name]["turns"]) for r in rec["raw"]["runs"])
        rows["silent"] = sum(t["first_audio_ms"] is None for r in rec["raw"]["runs"] for t in r[name]["turns"])
        phases[name] = rows
    spoken, typed = phases["spoken"]["first_audio_ms"], phases["typed"]["first_audio_ms"]
    return {"phases": phases, "ratio_p50": spoken["p50"] / typed["p50"] if typed["p50"] else float("nan"),
            "ratio_p99": spoken["p99"] / typed["p99"] if typed["p99"] else float("nan"),
            "settings": rec["settings"], "load_average": rec["run"]["load_average_end"], "machine": rec["host"],
            "date": rec["date"]}


def render(rec: dict[str, Any]) -> str:
    """The table from a results file (what `bench report` shows)."""
    res = analyze(rec)
    s = res["settings"]
    engine = f"vLLM, the {s['checkpoint']} Qwen3-Omni checkpoint" if s["engine"] == "vllm" else "the fake engine"
    head = (f"{s['sessions']} concurrent realtime sessions on one stack ({engine}, omni profile), "
            f"{s['runs']} runs; spoken turns are {s['speech_seconds']:g} s of {s['speech']} speech appended in "
            f"100 ms pieces then committed; typed turns a text question. Each session cancels its answer at "
            f"its first audio. Medians over the runs of each run's p50 and p99; load average at the end "
            f"{res['load_average']}.")
    rows = []
    for name, label in (("spoken", "spoken (from the commit)"), ("typed", "typed (from response.create)")):
        p = res["phases"][name]
        late = f"{p['late_deltas']} (last {fmt(p['late_max_ms'])} ms after)" if p["late_deltas"] else "0"
        rows.append([label, fmt(p["first_audio_ms"]["p50"]), fmt(p["first_audio_ms"]["p99"]), late,
                     fmt(p["cancel_to_done_ms"]["p50"]), fmt(p["cancel_to_done_ms"]["p99"]), fmt(p["freed_ms"]),
                     f"{p['cancelled']}/{p['turns']}", str(p["silent"])])
    table = md_table(["turn", "first audio p50 (ms)", "p99 (ms)", "audio deltas after the cancel",
                      "cancel → response.done p50 (ms)", "p99 (ms)", "last cancel → decoder idle (ms)",
                      "ended cancelled", "answered without audio"], rows)
    ratio = (f"Spoken over typed, time to first audio: p50 {res['ratio_p50']:.2f}x, "
             f"p99 {res['ratio_p99']:.2f}x.")
    return f"{head}\n\n{table}\n\n{ratio}\n\n{machine_md(res['machine'], res['date'])}\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="omni-serving bench realtime", description=__doc__.split("\n")[0])
    parser.add_argument("--engine", default="vllm", choices=("vllm", "fake"))
    parser.add_argument("--checkpoint", default="", help="a Qwen3-Omni checkpoint (default: the tiny one)")
    parser.add_argument("--sessions", type=int, default=16, help="concurrent sessions")
    parser.add_argument("--speech-seconds", type=float, default=3.0, help="speech per spoken turn")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="2 sessions, 1 s, 1 run: a tooling check")
    parser.add_argument("--out", default=None, help="folder for the results file (default: bench/results/)")
    parser.add_argument("--slug", default="", help="names the results file (default: full, or quick)")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if args.sessions < 1 or args.runs < 1 or args.speech_seconds <= 0:
        parser.error("--sessions and --runs must be >= 1, --speech-seconds > 0")
    if args.quick:
        args.sessions, args.speech_seconds, args.runs = 2, 1.0, 1
    t0 = time.perf_counter()
    rec = run(args.engine, args.checkpoint, args.sessions, args.speech_seconds, args.runs, args.quick)
    record.publish(rec, render(rec), out=args.out, slug=args.slug, argv=argv, suite="realtime", started=t0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
