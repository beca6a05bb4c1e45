"""tts: Qwen3-TTS served by the stack: first audio under load, and what a registered voice saves.

    python -m bench.tts [--concurrency 1,64] [--requests 16,128] [--frames 32] [--voice-requests 12]
                        [--quick] [--out DIR] [--slug NAME]
    (or omni-serving bench tts ...)

The tiny Qwen3-TTS checkpoints (``models create --family qwen3-tts``), served
by `omni-serving up --model DIR` as a user would (vLLM, stage processes,
code2wav workers, the default `--profile auto`: tts):

* **load** (CustomVoice, speaker ``vivian``): per concurrency level,
  ``requests`` Speak requests from that many closed-loop clients, each
  ``frames`` codec frames (sampled, seeded): time to first audio (p50, p90),
  and audio continuity (a player starting at 250 ms buffered: the streams
  that stalled and their stall time, bench/continuity.py). Target: TTFP p50
  at the top level over the lowest <= 3.
* **voices**: one request at a time, ``voice-requests`` of each, the kinds
  interleaved: a clone (Base) named by its registered voice; the same
  request sending its reference clip (a 3 s WAV) and transcript with it; a
  CustomVoice built-in speaker (its own stack, the same text). Time to first
  audio p50 of each and the ratios: registered / resend (the cached features
  at work: no upload, decode or encoding of the clip) and registered / built-in.

The model's weights are random: its speech is noise. The measures are the
serving path's.
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
import time
import wave
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from bench import record
from bench.common import check, fmt, log, machine_md, md_table, pct, targets_json, targets_md
from bench.continuity import continuity_summary

__all__ = ["analyze", "main", "render", "run"]

SAMPLE_RATE = 24_000
TEXTS = ("Hello world! This is a tiny model.", "Good morning, how are you today?",
         "The quick brown fox jumps over the lazy dog.", "Please read the following sentence aloud.")
VOICE_TEXT = "She sells sea shells by the sea shore."
TRANSCRIPT = "Hello world, this is my voice."


def reference_wav(seconds: float = 3.0) -> bytes:
    """A synthetic reference clip (a chirp under an envelope, seeded noise) as a 16-bit WAV file."""
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    clip = 0.4 * np.sin(2 * np.pi * (150 * t + 60 * t * t)) * np.sin(np.pi * t / seconds)
    clip += np.random.default_rng(7).standard_normal(t.shape) * 0.02
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SAMPLE_RATE)
        w.writeframes(np.round(np.clip(clip, -1, 1) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


class _Stack:
    """A stack serving one checkpoint (started on enter, stopped on exit)."""

    def __init__(self, model: Path, runtime: Path) -> None:
        from omni_stack.config import StackConfig
        from omni_stack.stack import Stack

        self.stack = Stack(StackConfig(engine="vllm", profile="auto", model=str(model), port=0, http_port=0,
                                       runtime_dir=str(runtime), log_level="WARNING",
                                       voice_dir=str(runtime / "voices")))

    def __enter__(self) -> Any:
        import grpc

        from omni_serving.v1 import gateway_pb2_grpc

        self.stack.start(timeout_s=600)
        self.channel = grpc.insecure_channel(self.stack.gateway_target)
        return gateway_pb2_grpc.OmniGatewayServiceStub(self.channel)

    def __exit__(self, *exc: object) -> None:
        self.channel.close()
        left = self.stack.stop()
        if left:
            log(f"tts bench: processes left after stop: {left}")


def speak(stub: Any, text: str, frames: int, seed: int, **fields: Any) -> dict[str, Any]:
    """One Speak request: time to first audio, the chunks' arrivals (for continuity), the audio's length."""
    import grpc

    from omni_serving.v1 import common_pb2, gateway_pb2

    req = gateway_pb2.SpeakRequest(text=text, language="english", sampling_params=common_pb2.SamplingParams(
        seed=seed, max_tokens=frames, temperature=0.9), **fields)
    for _ in range(1000):
        t0 = time.perf_counter()
        first = None
        chunks: list[list[float]] = []
        try:
            for chunk in stub.Speak(req, timeout=600):
                if chunk.audio:
                    now = time.perf_counter()
                    first = now if first is None else first
                    chunks.append([now - t0, len(chunk.audio) / 2 / SAMPLE_RATE])
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:  # the gateway's stream limit: retry
                time.sleep(0.01)
                continue
            raise
        return {"ttfp_s": (first - t0) if first else float("nan"), "wall_s": time.perf_counter() - t0,
                "audio_s": sum(c[1] for c in chunks), "chunks": chunks}
    raise RuntimeError("the gateway kept refusing the stream")


def _load(stub: Any, concurrency: int, requests: int, frames: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        got = list(pool.map(lambda i: speak(stub, TEXTS[i % len(TEXTS)] + f" Take {i}.", frames, 9000 + i,
                                            voice="vivian"), range(requests)))
    return {"concurrency": concurrency, "wall_s": time.perf_counter() - t0, "requests": got}


def run(concurrency: tuple[int, ...], requests: tuple[int, ...], frames: int, voice_requests: int,
        quick: bool) -> dict[str, Any]:
    from decoder_svc.qwen3_tts.tiny import create_tiny_checkpoint
    from omni_serving.v1 import common_pb2, gateway_pb2

    rec = record.begin("tts", quick=quick, settings={"concurrency": list(concurrency), "requests": list(requests),
                                                     "frames": frames, "voice_requests": voice_requests})
    raw: dict[str, Any] = {"levels": [], "voices": {"registered": [], "resend": [], "builtin": []}}
    clip = reference_wav()
    with tempfile.TemporaryDirectory(prefix="bench-tts-") as tmp:
        root = Path(tmp)
        models = {k: create_tiny_checkpoint(root / k, kind=k) for k in ("custom_voice", "base")}
        (root / "rt-cv").mkdir()
        with _Stack(models["custom_voice"], root / "rt-cv") as stub:
            for i in range(2):  # warm-up
                speak(stub, TEXTS[i], frames, i, voice="vivian")
            for c, n in zip(concurrency, requests, strict=True):
                log(f"tts bench: load at concurrency {c}, {n} requests")
                raw["levels"].append(_load(stub, c, n, frames))
            for i in range(voice_requests):
                raw["voices"]["builtin"].append(speak(stub, VOICE_TEXT, frames, 100 + i, voice="vivian"))
        (root / "rt-base").mkdir()
        with _Stack(models["base"], root / "rt-base") as stub:
            reg = gateway_pb2.OmniGatewayServiceRegisterVoiceRequest(
                name="bench-voice", audio=common_pb2.AudioContent(data=clip), transcript=TRANSCRIPT)
            t0 = time.perf_counter()
            stub.RegisterVoice(reg, timeout=300)
            raw["register_s"] = time.perf_counter() - t0
            inline = common_pb2.AudioContent(data=clip)
            speak(stub, TEXTS[0], frames, 0, voice="bench-voice")  # warm-up
            for i in range(voice_requests):  # interleaved: a slow moment falls on both
                raw["voices"]["registered"].append(speak(stub, VOICE_TEXT, frames, 100 + i, voice="bench-voice"))
                raw["voices"]["resend"].append(speak(stub, VOICE_TEXT, frames, 100 + i, reference_audio=inline,
                                                     reference_text=TRANSCRIPT))
    return record.complete(rec, raw)


def analyze(rec: dict[str, Any]) -> dict[str, Any]:
    raw = rec["raw"]
    levels = []
    for lv in raw["levels"]:
        ttfp = [r["ttfp_s"] * 1e3 for r in lv["requests"]]
        levels.append({"concurrency": lv["concurrency"], "requests": len(lv["requests"]),
                       "ttfp_p50_ms": pct(ttfp, 50), "ttfp_p90_ms": pct(ttfp, 90),
                       "throughput_rps": len(lv["requests"]) / lv["wall_s"],
                       "continuity": continuity_summary(r["chunks"] for r in lv["requests"])})
    voices = {k: pct([r["ttfp_s"] * 1e3 for r in v], 50) for k, v in raw["voices"].items()}
    ratio = levels[-1]["ttfp_p50_ms"] / levels[0]["ttfp_p50_ms"] if len(levels) > 1 else float("nan")
    targets = [
        check(f"TTFP p50 c{levels[-1]['concurrency']} / c{levels[0]['concurrency']}", ratio, "<= 3",
              lambda x: x <= 3, "x"),
        check("registered voice / resent clip, TTFP p50", voices["registered"] / voices["resend"],
              "reported (< 1: the cached features save time)", lambda x: x < 1, "x"),
        check("registered voice / built-in speaker, TTFP p50", voices["registered"] / voices["builtin"],
              "reported", lambda x: True, "x"),
    ]
    return {"levels": levels, "voices": voices, "register_s": raw.get("register_s"), "targets": targets,
            "settings": rec["settings"], "machine": rec["host"], "date": rec["date"]}


def render(rec: dict[str, Any]) -> str:
    res = analyze(rec)
    s = res["settings"]
    head = (f"The tiny Qwen3-TTS checkpoints served by the stack (vLLM, `--profile auto`: tts), Speak requests of "
            f"{s['frames']} frames, sampled and seeded. Load: CustomVoice speaker `vivian`, closed-loop clients per "
            f"level. Voices: {s['voice_requests']} requests of each kind one at a time, interleaved.")
    load = md_table(["concurrency", "requests", "TTFP p50 (ms)", "TTFP p90 (ms)", "throughput (req/s)",
                     "streams stalled (250 ms buffer)", "stall ms p50", "stall ms max"],
                    [[lv["concurrency"], lv["requests"], lv["ttfp_p50_ms"], lv["ttfp_p90_ms"], lv["throughput_rps"],
                      f"{lv['continuity']['stalled']}/{lv['continuity']['streams']}",
                      lv["continuity"]["stall_ms"]["p50"], lv["continuity"]["stall_ms"]["max"]]
                     for lv in res["levels"]])
    voices = md_table(["voice", "TTFP p50 (ms)"],
                      [["registered (Base, by name)", res["voices"]["registered"]],
                       ["clip resent with each request (Base)", res["voices"]["resend"]],
                       ["built-in speaker (CustomVoice)", res["voices"]["builtin"]]])
    reg = f"Registering the voice (upload, decode, x-vector and codes, files) took {fmt(res['register_s'])} s."
    return (f"{head}\n\n{load}\n\n{voices}\n\n{reg}\n\n{targets_md(res['targets'])}\n\n"
            f"{machine_md(res['machine'], res['date'])}\n")


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise ValueError(f"{what}: integers separated by commas, got {text!r}") from exc
    if not out or min(out) < 1:
        raise ValueError(f"{what}: at least one, each >= 1, got {text!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="omni-serving bench tts", description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", default="1,64", help="load levels, comma-separated (first: the baseline)")
    parser.add_argument("--requests", default="16,128", help="requests per level, comma-separated")
    parser.add_argument("--frames", type=int, default=32, help="codec frames per request (12.5 a second)")
    parser.add_argument("--voice-requests", type=int, default=12, help="requests of each voice kind")
    parser.add_argument("--quick", action="store_true", help="levels 1,2, a few short requests: a tooling check")
    parser.add_argument("--out", default=None, help="folder for the results file (default: bench/results/)")
    parser.add_argument("--slug", default="", help="names the results file (default: full, or quick)")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    try:
        concurrency, requests = _ints(args.concurrency, "--concurrency"), _ints(args.requests, "--requests")
    except ValueError as exc:
        parser.error(str(exc))
    if len(requests) != len(concurrency):
        parser.error(f"--requests: {len(requests)} counts for {len(concurrency)} levels")
    if args.frames < 1 or args.voice_requests < 1:
        parser.error("--frames and --voice-requests must be >= 1")
    if args.quick:
        concurrency, requests, args.frames, args.voice_requests = (1, 2), (2, 4), 8, 2
    t0 = time.perf_counter()
    rec = run(concurrency, requests, args.frames, args.voice_requests, args.quick)
    res = analyze(rec)
    rec["targets"] = targets_json(res["targets"])
    record.publish(rec, render(rec), out=args.out, slug=args.slug, argv=argv, suite="tts", started=t0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
