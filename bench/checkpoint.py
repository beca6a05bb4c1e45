"""checkpoint: one checkpoint served as a user serves it, measured.

    omni-serving bench checkpoint --checkpoint DIR [--concurrency 1,16] [--requests N]

One omni stack (``omni-serving up --profile omni --model DIR``: thinker ->
talker -> code2wav, the materializer in its own process) serves the
checkpoint with the deployment's own engine settings (none forced here: the
dtype, context and KV budget are what the decoder resolves for this host).
The run records

- the memory plan the decoder computes before any engine starts
  (``family.memory_plan``, the same numbers ``models plan`` prints), and the
  resident memory of every process it ends up with (the services and the
  decoder's children: one process per AR stage, the code2wav workers),
  sampled throughout, so plan and reality sit side by side;
- per concurrency level, after a warm-up: TTFP (request sent -> first audio
  chunk, ``Generate`` "text+audio"), request wall time and throughput;
- where a step goes, per AR stage, from the decoder's /metrics
  (``bench.step_parts``: forward, code predictor, output path);
- the vocoder's real-time factor: seconds of code2wav calls per second of
  audio they produced (all workers; below 1 keeps up with playback).

Made for a checkpoint at the released widths (``omni-serving models create
--preset released --layers 1``), which does not run in CI; ``--quick`` runs
the same code on the tiny checkpoint with a few short requests.
"""

from __future__ import annotations

import dataclasses
import os
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench import record, step_parts
from bench.common import (
    RssSampler,
    SuiteResult,
    finite,
    log,
    machine_md,
    md_table,
    plot_memory,
    progress,
    ratio,
    rss_peak,
    summary,
)

STAGES = ("thinker", "talker")
CODE2WAV_FAMILY = "omni_decoder_code2wav_chunk_seconds"
AUDIO_BYTES_PER_SECOND = 24_000 * 4  # float32 PCM at 24 kHz in Generate's audio tensors


@dataclasses.dataclass
class CheckpointConfig:
    checkpoint: str = ""  # empty: the model cache's tiny checkpoint
    quick: bool = False
    concurrency: tuple[int, ...] = (1, 16)
    prompts: dict[int, int] = dataclasses.field(default_factory=lambda: {1: 4, 16: 32})
    text_tokens: int = 32  # thinker tokens per request
    audio_frames: int = 32  # codec frames per request (its max_audio_seconds; 12.5 frames per second)
    temperature: float = 0.8
    top_p: float = 0.95
    startup_timeout_s: float = 900.0

    @classmethod
    def for_run(cls, quick: bool, checkpoint: str = "", concurrency: tuple[int, ...] = (),
                requests: int = 0) -> CheckpointConfig:
        cfg = cls(checkpoint=checkpoint, quick=quick)
        if quick:
            cfg.concurrency, cfg.prompts, cfg.text_tokens, cfg.audio_frames = (1, 2), {1: 2, 2: 2}, 8, 8
        if concurrency:
            cfg.concurrency = tuple(concurrency)
        if concurrency or requests:
            cfg.prompts = {c: requests or cfg.prompts.get(c, 2 * c) for c in cfg.concurrency}
        return cfg


def _checkpoint_dir(cfg: CheckpointConfig) -> str:
    if cfg.checkpoint:
        return str(Path(cfg.checkpoint).resolve())
    from decoder_svc.qwen3_omni.cache import default_model_dir

    return str(default_model_dir())


def plan_of(checkpoint: str) -> dict[str, Any]:
    """The memory plan the decoder computes for this checkpoint on this host
    (omni profile, one code2wav worker, the deployment's engine settings)."""
    from decoder_svc.profile import load_profile
    from decoder_svc.qwen3_omni.checkpoint import OmniCheckpoint
    from decoder_svc.qwen3_omni.family import memory_plan

    plan = memory_plan(OmniCheckpoint.open(checkpoint), load_profile("omni"), code2wav_workers=1)
    return {"lines": plan.lines(), "stages": [dataclasses.asdict(s) for s in plan.stages]}


def process_names(stack: Any) -> dict[str, int]:
    """Every process of the stack by name: its services, and the decoder's
    children (``stage-<name>`` per AR stage, ``code2wav-<k>`` per worker)."""
    import psutil

    out: dict[str, int] = {}
    workers = 0
    for svc in stack.services:
        assert svc.proc is not None
        out[svc.name] = svc.proc.pid
        if not svc.name.startswith("decoder"):
            continue
        for child in psutil.Process(svc.proc.pid).children(recursive=True):
            try:
                cmd = child.cmdline()
            except psutil.Error:
                continue
            title = " ".join(cmd)
            if title.startswith("omni-serving decoder stage "):
                out[f"stage-{title.split()[3]}"] = child.pid
            elif "spawn_main" in title:  # the code2wav workers (the pool's only spawned children)
                out[f"code2wav-{workers}"] = child.pid
                workers += 1
    return out


def code2wav_seconds(urls: list[str]) -> float:
    """Seconds spent in vocoder calls so far (``omni_decoder_code2wav_chunk_seconds``, all workers)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for url in urls:
        with urllib.request.urlopen(url, timeout=10) as resp:
            text = resp.read().decode()
        for family in text_string_to_metric_families(text):
            if family.name == CODE2WAV_FAMILY:
                total += sum(s.value for s in family.samples if s.name.endswith("_sum"))
    return total


def engine_settings(target: str) -> dict[str, dict[str, str]]:
    """Each stage's effective engine settings, as GetDecoderInfo reports them."""
    import grpc

    from omni_serving.v1 import decoder_pb2, decoder_pb2_grpc

    with grpc.insecure_channel(target) as ch:
        info = decoder_pb2_grpc.DecoderServiceStub(ch).GetDecoderInfo(decoder_pb2.GetDecoderInfoRequest(), timeout=30)
    return {st.name: dict(sorted(st.engine_settings.items())) for st in info.stages}


def _snapshot(urls: list[str]) -> dict[str, Any]:
    return {"stages": {s: step_parts.snapshot(urls, stage=s) for s in STAGES}, "code2wav_s": code2wav_seconds(urls)}


def _settled(urls: list[str], timeout_s: float = 10.0) -> dict[str, Any]:
    """A snapshot once the stage processes' series stopped moving (they
    reach the decoder's /metrics about once a second)."""
    last = _snapshot(urls)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(1.5)
        now = _snapshot(urls)
        if now == last:
            return now
        last = now
    return last


def run(cfg: CheckpointConfig, out_dir: Path) -> SuiteResult:
    from bench.e2e import Client, E2EConfig, decoder_metrics
    from omni_stack.config import StackConfig
    from omni_stack.stack import Stack

    out_dir.mkdir(parents=True, exist_ok=True)
    checkpoint = _checkpoint_dir(cfg)
    rec = record.begin("checkpoint", quick=cfg.quick, settings={**dataclasses.asdict(cfg), "checkpoint": checkpoint})
    plan = plan_of(checkpoint)
    for line in plan["lines"]:
        log(line)
    stack = Stack(StackConfig(profile="omni", engine="vllm", model=checkpoint, port=0, http_port=0,
                              deployment=f"benchckpt{os.getpid()}", log_level="WARNING",
                              startup_timeout=cfg.startup_timeout_s))
    sampler = RssSampler().start()
    client = None
    levels: dict[str, Any] = {}
    info: dict[str, Any] = {}
    try:
        t_start = time.perf_counter()
        with progress(None, "checkpoint: starting the stack", "stack"):
            stack.start(timeout_s=cfg.startup_timeout_s)
        startup_s = time.perf_counter() - t_start
        names = process_names(stack)
        for name, pid in names.items():
            sampler.add(name, pid)
        urls = decoder_metrics(stack)
        client = Client(stack.gateway_target, E2EConfig(temperature=cfg.temperature, top_p=cfg.top_p,
                                                        omni_audio_frames=cfg.audio_frames))
        top = max(cfg.concurrency)
        with progress(top, "checkpoint: warm-up", "req") as bar:
            client.run_level(list(range(top)), top, cfg.text_tokens, "warm", bar, call="generate")
        sampler.mark("after_warmup")
        for c in cfg.concurrency:
            n = cfg.prompts[c]
            before = _settled(urls)
            t0 = sampler.now()
            with progress(n, f"checkpoint: c={c}", "req") as bar:
                reqs = client.run_level(list(range(n)), c, cfg.text_tokens, f"c{c}", bar, call="generate")
            t1 = sampler.now()
            levels[str(c)] = {"requests": reqs, "window_s": [t0, t1], "metrics": {"before": before,
                                                                                  "after": _settled(urls)}}
        sampler.mark("end")
        info = engine_settings(stack.decoder_target)
    finally:
        if client is not None:
            client.close()
        sampler.stop()
        left = stack.stop()
    rec = record.complete(rec, {"checkpoint": checkpoint, "plan": plan, "startup_s": startup_s, "levels": levels,
                                "memory": sampler.raw(), "engine_settings": info, "shm_segments_left_after_stop": left})
    plot_memory(rec["raw"]["memory"], out_dir / "memory.png", "checkpoint: RSS per process")
    md = render(rec)
    (out_dir / "results.md").write_text(md)
    return SuiteResult("checkpoint", out_dir, analyze(rec), [], md, rec)


def analyze(rec: dict[str, Any]) -> dict[str, Any]:
    raw = rec["raw"]
    mem = raw["memory"]
    levels = {}
    for c, lv in raw["levels"].items():
        reqs = lv["requests"]
        wall = max(r["end"] for r in reqs) - min(r["start"] for r in reqs)
        audio_s = sum(r["audio_bytes"] for r in reqs) / AUDIO_BYTES_PER_SECOND
        a, b = lv["metrics"]["before"], lv["metrics"]["after"]
        levels[c] = {
            "requests": len(reqs), "wall_s": wall, "throughput_rps": len(reqs) / wall,
            # a request with no audio (a reply too short to speak) has no first audio
            "ttfp_ms": summary([r["first_audio_s"] for r in reqs if finite(r["first_audio_s"])], 1e3),
            "request_ms": summary([r["wall_s"] for r in reqs], 1e3),
            # a request's wall time per second of its audio (below 1: faster than playback)
            "rtf": summary([r["wall_s"] / (r["audio_bytes"] / AUDIO_BYTES_PER_SECOND) for r in reqs
                            if r["audio_bytes"]]),
            "audio_s": audio_s,
            "code2wav_rtf": ratio(b["code2wav_s"] - a["code2wav_s"], audio_s),
            "steps": {s: step_parts.shares(a["stages"][s], b["stages"][s]) for s in STAGES},
            "rss_peak_mib": {n: rss_peak(mem, n, *lv["window_s"]) / 2**20 for n in mem["timeline"]},
        }
    after = (mem["marks"].get("after_warmup") or {}).get("rss_kib", {})
    return {"levels": levels, "rss_after_warmup_mib": {n: kib / 1024 for n, kib in after.items()}}


def render(rec: dict[str, Any]) -> str:
    """The tables, from the record's raw numbers (also `bench report`'s)."""
    data = analyze(rec)
    raw = rec["raw"]
    lines = [f"# checkpoint: `{raw['checkpoint']}`", "", machine_md(rec["host"], rec["date"]), "",
             f"Stack up (every engine loaded) in {raw['startup_s']:.0f} s.", "",
             "## Memory plan (computed before any engine starts)", "", "```", *raw["plan"]["lines"], "```", ""]
    # per process: a code2wav worker holds its own copy; the KV is the stage's
    planned = {s["name"]: (s["weights"] + s["activations"] + s["runtime"] + s["kv"] / s["copies"]) / 2**20
               for s in raw["plan"]["stages"]}
    top = max(data["levels"], key=int) if data["levels"] else None
    rows = []
    for name, after in sorted(data["rss_after_warmup_mib"].items()):
        stage = name.removeprefix("stage-").split("-")[0]
        peak = data["levels"][top]["rss_peak_mib"].get(name) if top else None
        rows.append([name, planned.get(stage), after, peak])
    lines += ["## Resident memory per process (MiB)", "",
              md_table(["process", "planned", "after warm-up", f"peak at c={top}"], rows), ""]
    lines += ["## Latency and throughput (Generate, text+audio)", "",
              md_table(["concurrency", "requests", "TTFP p50 ms", "TTFP p99 ms", "request p50 ms", "RTF p50",
                        "req/s", "audio s", "code2wav RTF"],
                       [[c, lv["requests"], lv["ttfp_ms"]["p50"], lv["ttfp_ms"]["p99"], lv["request_ms"]["p50"],
                         lv["rtf"]["p50"], lv["throughput_rps"], lv["audio_s"], lv["code2wav_rtf"]]
                        for c, lv in data["levels"].items()]),
              "", "RTF: a request's wall time per second of its audio. code2wav RTF: seconds of vocoder calls "
              "per second of audio they produced (all workers). Below 1: faster than playback.", "",
              "## Where a step goes", ""]
    rows = []
    for c, lv in data["levels"].items():
        for stage, s in lv["steps"].items():
            if s:
                rows.append([c, stage, s["steps"], s["step_ms"], f"{s['forward_share']:.0%}",
                             f"{s['code_predictor_share']:.0%}", f"{s['output_path_share']:.0%}"])
    lines += [md_table(["concurrency", "stage", "steps", "ms per step", "forward", "code predictor", "output path"],
                       rows), ""]
    settings = raw.get("engine_settings") or {}
    keys = sorted({k for v in settings.values() for k in v})
    if keys:
        lines += ["## Effective engine settings (GetDecoderInfo)", "",
                  md_table(["setting", *settings], [[k, *(v.get(k, "") for v in settings.values())] for k in keys]),
                  ""]
    return "\n".join(lines)

