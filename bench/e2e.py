"""e2e: the tts profile through the gateway: async (materializer) vs sync vs
thread (the in-process background builder).

Three stacks of the real services (`omni_stack.stack.Stack`) run side by
side: `async` with the materializer (snapshots to shared memory, payloads
built in its own process), `sync` with `StackConfig(sync=True)` (payloads
built in the decode step), and `thread`, the seed's design: no materializer,
the decoder started with `--in-process-builder` (snapshots into the arena,
payloads built as tensors on a background thread of the decoder process).
All are warmed up, then for every concurrency level the same N prompts
(each with its own fixed seed) go through each stack's gateway (`Speak`,
gRPC) with a closed-loop client pool of that concurrency; the order of the
stacks rotates between levels.

Per level and stack: request throughput, TTFP (client side: request sent ->
first non-empty audio chunk) p50/p99, RTF (request wall time / audio
duration) p50/p99, audio seconds per wall second, CPU per request per
service, and the sha256 of every request's PCM, compared across the three
stacks. At the top level a probe calls the decoder's `GetDecoderInfo` every
`probe_interval_s` meanwhile: its latency is how responsive the decoder's
gRPC front stays under full load.

The `omni` variant then runs the omni profile (thinker -> talker ->
code2wav; the thinker routes its hidden states to the talker, a heavy
payload) in the same three modes through `Generate` ("text+audio") and
records per request when the thinker finished (its last text delta arrived)
and when the first audio chunk arrived: whether first audio comes before
the thinker is done. Text and audio hashes are compared across the modes.

`replicas` (`--replicas N`) runs both stacks with N decoder + materializer
pairs behind their gateway; `failover` (`--failover`, needs N >= 2) then
SIGKILLs one decoder of the async stack under load and measures how long
until requests succeed again (see `failover`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import record, step_parts
from bench.common import (
    RssSampler,
    SuiteResult,
    check,
    finite,
    fmt,
    growth_report,
    log,
    machine_md,
    md_table,
    pct,
    plot_memory,
    progress,
    pyplot,
    ratio,
    rss_peak,
    summary,
    targets_json,
    targets_md,
)
from bench.continuity import continuity_summary

MODES = ("async", "sync", "thread")
# the decoder flag of the thread mode (a stack without a materializer)
THREAD_ARGS = ("--in-process-builder",)
# the levels the throughput and CPU targets are judged at (not run: not measured)
TARGET_LEVELS = (16, 64)
SAMPLE_RATE = 24_000
TEXTS = (
    "Hello there, this is a short test of the speech service.",
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Please read the following sentence aloud in a calm and friendly voice.",
    "Streams of tokens are decoded step by step, one frame per request.",
    "Good morning, good afternoon, good evening and good night to everyone.",
    "She sells sea shells by the sea shore, and the shells are sea shells.",
    "Numbers like one two three four five are spoken one after another.",
    "Once upon a time there was a small model that could only say a few words.",
)


@dataclasses.dataclass
class E2EConfig:
    quick: bool = False
    engine: str = "vllm"
    concurrency: tuple[int, ...] = (1, 16, 64)
    prompts: dict[int, int] = dataclasses.field(default_factory=lambda: {1: 16, 16: 96, 64: 384})
    max_tokens: int = 64  # codec frames per request (12.5 frames per audio second)
    temperature: float = 0.8
    top_p: float = 0.95
    warmup_max_tokens: int = 64  # warm-up: one request per client slot at the top concurrency, full length
    model_dir: str = ""
    replicas: int = 1  # decoder + materializer pairs per stack
    failover: bool = False  # SIGKILL one decoder of the async stack under load (replicas >= 2)
    failover_concurrency: int = 4
    probe_interval_s: float = 0.02  # GetDecoderInfo probe under load (top level)
    omni: bool = True  # the omni variant (thinker -> talker -> code2wav)
    omni_text_tokens: int = 32  # thinker tokens per omni request
    omni_audio_frames: int = 32  # codec frames per omni request (its max_audio_seconds)
    first_chunk_frames: int = 0  # every request's sampling_params.first_chunk_frames; 0: the deployment's choice
    rounds: int = 1  # each level this many times (the stack order rotating): ratios are medians over rounds

    @classmethod
    def for_run(cls, quick: bool, engine: str = "auto", model_dir: str = "", replicas: int = 1,
                failover: bool = False, concurrency: tuple[int, ...] = (), requests: int | tuple[int, ...] = 0,
                first_chunk_frames: int = 0, rounds: int = 1, omni: bool = True) -> E2EConfig:
        if quick:
            cfg = cls(quick=True, engine="fake" if engine == "auto" else engine, concurrency=(1, 4),
                      prompts={1: 3, 4: 8}, max_tokens=16, warmup_max_tokens=16, model_dir=model_dir,
                      omni_text_tokens=16, omni_audio_frames=16)
        else:
            cfg = cls(engine="vllm" if engine == "auto" else engine, model_dir=model_dir)
        cfg.replicas, cfg.failover = replicas, failover
        cfg.first_chunk_frames, cfg.rounds, cfg.omni = first_chunk_frames, rounds, omni
        if concurrency:
            cfg.concurrency = tuple(concurrency)
        counts = tuple(requests) if isinstance(requests, tuple) else ((requests,) if requests else ())
        if len(counts) > 1 and len(counts) != len(cfg.concurrency):
            raise ValueError(f"{len(counts)} request counts for {len(cfg.concurrency)} concurrency levels")
        if concurrency or counts:
            cfg.prompts = {c: (counts[k] if len(counts) > 1 else counts[0]) if counts else cfg.prompts.get(c, 4 * c)
                           for k, c in enumerate(cfg.concurrency)}
        return cfg


def prompt(i: int) -> tuple[str, int]:
    return f"{TEXTS[i % len(TEXTS)]} Take {i}.", 7000 + i


class Client:
    """Closed-loop Speak clients against one gateway."""

    def __init__(self, target: str, cfg: E2EConfig) -> None:
        import grpc

        from omni_serving.v1 import gateway_pb2_grpc

        self.cfg = cfg
        self.channel = grpc.insecure_channel(target, options=[("grpc.max_receive_message_length", 64 * 2**20)])
        self.stub = gateway_pb2_grpc.OmniGatewayServiceStub(self.channel)

    def speak(self, i: int, max_tokens: int, tag: str) -> dict[str, Any]:
        import grpc

        from omni_serving.v1 import common_pb2, gateway_pb2

        text, seed = prompt(i)
        req = gateway_pb2.SpeakRequest(
            request_id=f"{tag}-{i}", text=text,
            sampling_params=common_pb2.SamplingParams(seed=seed, max_tokens=max_tokens, temperature=self.cfg.temperature,
                                                      top_p=self.cfg.top_p,
                                                      first_chunk_frames=self.cfg.first_chunk_frames))
        retries = 0
        while True:
            t0 = time.perf_counter()
            first = None
            pcm = hashlib.sha256()
            nbytes = 0
            last = None
            arrivals: list[list[float]] = []  # [seconds since sent, seconds of audio] per chunk
            try:
                for chunk in self.stub.Speak(req, timeout=600):
                    if chunk.audio:
                        now = time.perf_counter()
                        if first is None:
                            first = now
                        pcm.update(chunk.audio)
                        nbytes += len(chunk.audio)
                        arrivals.append([now - t0, len(chunk.audio) / 2 / SAMPLE_RATE])
                    last = chunk
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and retries < 1000:
                    retries += 1  # the gateway's stream limit: the slot of a finished stream is not free yet
                    time.sleep(0.01)
                    continue
                raise
            t1 = time.perf_counter()
            break
        audio_s = nbytes / 2 / SAMPLE_RATE
        m = last.metrics if last is not None else None
        return {
            "index": i, "start": t0, "end": t1, "ttfp_s": (first - t0) if first else float("nan"),
            "wall_s": t1 - t0, "audio_s": audio_s, "rtf": (t1 - t0) / audio_s if audio_s else float("nan"),
            "sha256": pcm.hexdigest(), "bytes": nbytes, "retries": retries,
            "server_ttfp_ms": m.ttfp_ms if m else None, "server_rtf": m.rtf if m else None,
            "first_chunk_frames": m.first_chunk_frames if m else 0, "chunks": arrivals,
        }

    def generate(self, i: int, max_tokens: int, tag: str) -> dict[str, Any]:
        """One omni request (Generate, "text+audio", delta outputs): when its
        thinker finished (the last text delta arrived) and when its first
        audio chunk arrived, and the hashes of its text and audio."""
        from omni_serving.v1 import common_pb2, gateway_pb2

        text, seed = prompt(i)
        req = gateway_pb2.OmniGatewayServiceGenerateRequest(
            request_id=f"{tag}-{i}", prompt=text, output_modalities="text+audio",
            output_kind=gateway_pb2.OUTPUT_KIND_DELTA,
            sampling_params=common_pb2.SamplingParams(
                seed=seed, max_tokens=max_tokens, temperature=self.cfg.temperature, top_p=self.cfg.top_p,
                max_audio_seconds=self.cfg.omni_audio_frames / 12.5, first_chunk_frames=self.cfg.first_chunk_frames))
        t0 = time.perf_counter()
        first_audio = last_text = None
        text_hash, pcm = hashlib.sha256(), hashlib.sha256()
        nbytes = 0
        first_chunk = 0
        for resp in self.stub.Generate(req, timeout=600):
            out = resp.output
            first_chunk = out.metrics.first_chunk_frames or first_chunk
            now = time.perf_counter()
            if out.text.text or out.text.token_ids:
                last_text = now
                text_hash.update(out.text.text.encode())
            for nt in out.multimodal.tensors:
                if nt.name == "audio" and nt.tensor.inline_data:
                    if first_audio is None:
                        first_audio = now
                    pcm.update(nt.tensor.inline_data)
                    nbytes += len(nt.tensor.inline_data)
        t1 = time.perf_counter()
        nan = float("nan")
        return {
            "index": i, "start": t0, "end": t1, "wall_s": t1 - t0,
            "thinker_done_s": (last_text - t0) if last_text else nan,
            "first_audio_s": (first_audio - t0) if first_audio else nan,
            # > 0: the first audio came this long before the thinker finished
            "audio_lead_s": (last_text - first_audio) if last_text and first_audio else nan,
            "sha256": hashlib.sha256(text_hash.digest() + pcm.digest()).hexdigest(),
            "text_sha256": text_hash.hexdigest(), "audio_sha256": pcm.hexdigest(), "audio_bytes": nbytes,
            "first_chunk_frames": first_chunk,
        }

    def run_level(self, indices: list[int], concurrency: int, max_tokens: int, tag: str, bar=None,  # noqa: ANN001
                  call: str = "speak") -> list[dict[str, Any]]:
        """Closed loop: `concurrency` clients send the prompts `indices` (Speak,
        or Generate for call="generate") until none is left."""
        send = self.speak if call == "speak" else self.generate
        lock = threading.Lock()
        todo = list(indices)
        out: list[dict[str, Any]] = []

        def worker() -> None:
            while True:
                with lock:
                    if not todo:
                        return
                    i = todo.pop(0)
                r = send(i, max_tokens, tag)
                with lock:
                    out.append(r)
                if bar is not None:
                    bar.update(1)

        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            futs = [pool.submit(worker) for _ in range(concurrency)]
            for f in futs:
                f.result()
        return sorted(out, key=lambda r: r["index"])

    def close(self) -> None:
        self.channel.close()


class InfoProbe:
    """Calls the decoder's GetDecoderInfo every `interval_s` on a thread
    (one channel, kept open) and records each call's latency: how quickly
    the decoder's gRPC front answers while its stages are busy."""

    def __init__(self, target: str, interval_s: float) -> None:
        import grpc

        from omni_serving.v1 import decoder_pb2_grpc

        self.interval_s = interval_s
        self.channel = grpc.insecure_channel(target)
        self.stub = decoder_pb2_grpc.DecoderServiceStub(self.channel)
        self.latencies_s: list[float] = []
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="info-probe", daemon=True)

    def _run(self) -> None:
        import grpc

        from omni_serving.v1 import decoder_pb2

        while not self._stop.is_set():
            t0 = time.perf_counter()
            try:
                self.stub.GetDecoderInfo(decoder_pb2.GetDecoderInfoRequest(), timeout=10)
                self.latencies_s.append(time.perf_counter() - t0)
            except grpc.RpcError:
                self.errors += 1
            self._stop.wait(self.interval_s)

    def __enter__(self) -> InfoProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=15)
        self.channel.close()

    def raw(self) -> dict[str, Any]:
        return {"latencies_s": list(self.latencies_s), "errors": self.errors, "interval_s": self.interval_s}


def probe_summary(raw: dict[str, Any]) -> dict[str, Any]:
    """A probe's table row, from its raw latencies (`InfoProbe.raw`)."""
    return {"latency_ms": summary(raw["latencies_s"], 1e3), "errors": raw["errors"],
            "interval_ms": raw["interval_s"] * 1e3}


def stack_config(mode: str, cfg: E2EConfig, model_dir: str, profile: str = "tts") -> Any:
    """The StackConfig of a mode: async = with the materializer; sync = none,
    payloads built in the decode step; thread = none, payloads built on the
    decoder's background builder thread."""
    from omni_stack.config import StackConfig

    return StackConfig(profile=profile, engine=cfg.engine, model=model_dir, sync=mode != "async",
                       extra_decoder_args=list(THREAD_ARGS) if mode == "thread" else [],
                       port=0, http_port=0, deployment=f"bench{profile}{mode}{os.getpid()}", log_level="WARNING",
                       replicas=cfg.replicas if profile == "tts" else 1, restart_backoff=0.2)


def decoder_info(target: str) -> dict[str, Any]:
    import grpc

    from omni_serving.v1 import decoder_pb2, decoder_pb2_grpc

    with grpc.insecure_channel(target) as ch:
        info = decoder_pb2_grpc.DecoderServiceStub(ch).GetDecoderInfo(decoder_pb2.GetDecoderInfoRequest(), timeout=30)
    stages = [{"name": st.name, "output_path": decoder_pb2.OutputPath.Name(st.output_path), "reason": st.reason,
               "steps": st.steps, "engine_settings": dict(st.engine_settings)} for st in info.stages]
    talker = next((st for st in info.stages if st.name == "talker"), info.stages[0])
    return {
        "engine": info.engine, "profile": info.profile, "stages": stages,
        "talker_output_path": decoder_pb2.OutputPath.Name(talker.output_path), "talker_reason": talker.reason,
        "talker_steps": talker.steps, "materializer_connected": info.materializer_connected,
        "fallback_steps": info.fallback_steps, "finished_requests": info.finished_requests,
        "arena": {"region": info.arena.region, "num_slots": info.arena.num_slots, "slot_bytes": info.arena.slot_bytes,
                  "peak_slots_in_use": info.arena.peak_slots_in_use, "slots_in_use": info.arena.slots_in_use},
    }


def decoder_metrics(stack: Any) -> list[str]:
    """The /metrics URLs of a stack's decoders."""
    return [svc.metrics_url for svc in stack.services if svc.name.startswith("decoder") and svc.metrics_url]


def cpu_snapshot(stack: Any) -> dict[str, float]:
    """CPU seconds so far of each service of a stack (its child processes
    included), of this process (the clients), and of the whole host (busy =
    not idle / iowait)."""
    import psutil

    from bench.breakdown import proc_cpu

    out: dict[str, float] = {}
    for svc in stack.services:
        try:  # with its child processes (stage processes, code2wav workers)
            out[svc.name] = proc_cpu(svc.proc.pid)
        except psutil.Error:  # restarted meanwhile (failover)
            continue
    t = psutil.Process().cpu_times()
    out["bench clients"] = t.user + t.system
    h = psutil.cpu_times()
    out["host busy"] = sum(h) - h.idle - getattr(h, "iowait", 0.0)
    return out


def cpu_report(cpu: dict[str, Any], requests: int, cores: int) -> dict[str, Any]:
    """CPU per request and per process, from two `cpu_snapshot`s (`before`,
    `after`) taken `wall_s` apart around `requests` requests, on a host with
    `cores` cores (the results file's host, not this machine)."""
    a, b, wall_s = cpu["before"], cpu["after"], cpu["wall_s"]
    per_request_ms = {k: (b[k] - a[k]) / requests * 1e3 for k in a if k != "host busy" and k in b}
    by_role: dict[str, float] = {}  # decoder-r0 + decoder-r1 -> decoder
    for k, v in per_request_ms.items():
        role = k.split("-r")[0] if k.startswith(("decoder-r", "materializer-r")) else k
        by_role[role] = by_role.get(role, 0.0) + v
    return {
        "cpu_ms_per_request": per_request_ms,
        "cpu_ms_per_request_by_role": by_role,
        "cpu_pct_of_one_core": {k: 100.0 * (b[k] - a[k]) / wall_s for k in a if k != "host busy" and k in b}
        if wall_s > 0 else {},
        "host_busy_pct": 100.0 * (b["host busy"] - a["host busy"]) / (wall_s * cores) if wall_s > 0 else float("nan"),
        "stack_cpu_pct_of_host": 100.0 * sum(b[k] - a[k] for k in a if k not in ("host busy", "bench clients"))
        / (wall_s * cores) if wall_s > 0 else float("nan"),
    }


def level_summary(reqs: list[dict[str, Any]]) -> dict[str, Any]:
    wall = max(r["end"] for r in reqs) - min(r["start"] for r in reqs)
    audio = sum(r["audio_s"] for r in reqs)
    return {
        "requests": len(reqs), "wall_s": wall, "throughput_rps": len(reqs) / wall,
        "ttfp_ms": {**summary([r["ttfp_s"] for r in reqs], 1e3), "p90": pct([r["ttfp_s"] * 1e3 for r in reqs], 90)}, "rtf": summary([r["rtf"] for r in reqs]),
        "server_ttfp_ms": summary([r["server_ttfp_ms"] for r in reqs if r["server_ttfp_ms"]]),
        "audio_s_total": audio, "audio_s_per_wall_s": audio / wall, "retries": sum(r["retries"] for r in reqs),
        "first_chunk_frames": first_chunks(reqs),
        # playback from 250 ms buffered (bench/continuity.py); runs recorded
        # before chunk arrivals were kept have none
        "continuity": continuity_summary(r["chunks"] for r in reqs) if all("chunks" in r for r in reqs) else None,
    }


def continuity_md(levels: dict[str, dict[str, Any]]) -> list[str]:
    """The continuity table (no lines for a run recorded without chunk arrivals)."""
    rows = []
    for c, lv in levels.items():
        for m in MODES:
            cont = lv[m].get("continuity")
            if cont:
                st = cont["stall_ms"]
                rows.append([c, m, f"{cont['stalled']}/{cont['streams']}", cont["stalled_share"] * 100, st["p50"],
                             st["p99"], st["max"]])
    return _section("Audio continuity: each stream played from the moment 250 ms of it was buffered, in real time; "
                    "a stall is its buffer running empty before its last chunk arrived (bench/continuity.py). Stall "
                    "time per stream, streams that never stalled counting 0:",
                    ["concurrency", "path", "streams stalled", "stalled %", "stall ms p50", "stall ms p99",
                     "stall ms max"], rows)


def _section(caption: str, headers: list[str], rows: list[list[Any]]) -> list[str]:
    """A captioned table after a blank line; no lines without rows (a run recorded before it was measured)."""
    return ["", caption, "", md_table(headers, rows)] if rows else []


def step_parts_md(levels: dict[str, dict[str, Any]]) -> list[str]:
    """Where the talker's steps went (no lines for a run recorded without it)."""
    rows = [[c, m, t["steps"], t["step_ms"], t["forward_share"] * 100, t["code_predictor_share"] * 100,
             t["output_path_share"] * 100]
            for c, lv in levels.items() for m in MODES if (t := lv[m].get("talker_step"))]
    return _section("The talker's steps (the decoders' /metrics, bench/step_parts.py): a step is its forward and "
                    "sample plus the critical-path gap before the next one (the output path); the code predictor runs "
                    "inside the step (host time):",
                    ["concurrency", "path", "talker steps", "ms per step", "forward %", "code predictor %",
                     "output path %"], rows)


def first_chunks(reqs: list[dict[str, Any]]) -> dict[str, int]:
    """How many requests had each first chunk (frames), as the servers reported."""
    counts = collections.Counter(int(r.get("first_chunk_frames") or 0) for r in reqs)
    return {str(k): counts[k] for k in sorted(counts)}


def _ensure_models(cfg: E2EConfig) -> str:
    """The Qwen3-Omni checkpoint to serve (default: the tiny one in the model cache)."""
    if cfg.engine != "vllm":
        return ""
    if cfg.model_dir:
        return cfg.model_dir
    from decoder_svc.qwen3_omni.cache import default_model_dir

    return str(default_model_dir())


def run(cfg: E2EConfig, out_dir: Path) -> SuiteResult:
    out_dir.mkdir(parents=True, exist_ok=True)
    from omni_stack.stack import Stack

    rec = record.begin("e2e", quick=cfg.quick, settings=dataclasses.asdict(cfg))
    note = ""
    if cfg.engine == "vllm":
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            note = "vLLM is not installed here; the fake engine ran instead"
            log(f"e2e: {note}")
            cfg = dataclasses.replace(cfg, engine="fake")
    model_dir = _ensure_models(cfg)
    sampler = RssSampler().start()
    stacks: dict[str, Any] = {}
    clients: dict[str, Client] = {}
    levels: dict[str, dict[str, Any]] = {}
    extra_rounds: list[dict[str, dict[str, Any]]] = [{} for _ in range(cfg.rounds - 1)]  # rounds 2..N, as levels
    infos: dict[str, Any] = {}
    failover_raw: dict[str, Any] | None = None
    leftovers: dict[str, list[str]] = {}
    top = max(cfg.concurrency)
    try:
        with progress(len(MODES), "e2e: starting stacks", "stack") as bar:
            for mode in MODES:
                s = Stack(stack_config(mode, cfg, model_dir))
                stacks[mode] = s
                s.start(timeout_s=300)
                for svc in s.services:
                    assert svc.proc is not None
                    sampler.add(f"{mode}/{svc.name}", svc.proc.pid)
                clients[mode] = Client(s.gateway_target, cfg)
                bar.update(1)
        with progress(len(MODES) * top, "e2e: warm-up", "req") as bar:
            for mode in MODES:
                clients[mode].run_level(list(range(top)), top, cfg.warmup_max_tokens, f"warm-{mode}", bar)
        time.sleep(0.5)
        sampler.mark("after_warmup")
        for rnd, k, c in ((r, k, c) for r in range(cfg.rounds) for k, c in enumerate(cfg.concurrency)):
            n = cfg.prompts[c]
            turn = k + rnd
            order = MODES[turn % len(MODES):] + MODES[: turn % len(MODES)]  # each level starts elsewhere
            into = levels if rnd == 0 else extra_rounds[rnd - 1]
            into[str(c)] = {}
            for mode in order:
                label = f"e2e: {mode} c={c}" + (f" round {rnd + 1}/{cfg.rounds}" if cfg.rounds > 1 else "")
                with progress(n, label, "req") as bar:
                    probe = (InfoProbe(stacks[mode].decoder_target, cfg.probe_interval_s)
                             if c == top and rnd == 0 else None)
                    cpu0 = cpu_snapshot(stacks[mode])
                    parts0 = step_parts.snapshot(decoder_metrics(stacks[mode]))
                    t0 = sampler.now()
                    with probe or contextlib.nullcontext():
                        reqs = clients[mode].run_level(list(range(n)), c, cfg.max_tokens, f"c{c}-{mode}-r{rnd}", bar)
                    t1 = sampler.now()
                    cpu1 = cpu_snapshot(stacks[mode])
                    parts1 = step_parts.snapshot(decoder_metrics(stacks[mode]))
                into[str(c)][mode] = {"requests": reqs, "cpu": {"before": cpu0, "after": cpu1, "wall_s": t1 - t0},
                                        "window_s": [t0, t1], "probe": probe.raw() if probe is not None else None,
                                        "step_parts": {"before": parts0, "after": parts1}}
        time.sleep(0.5)
        sampler.mark("end")
        for mode in MODES:
            infos[mode] = decoder_info(stacks[mode].decoder_target)
            if cfg.replicas > 1:
                infos[mode]["finished_requests_per_replica"] = [
                    decoder_info(t)["finished_requests"] for t in stacks[mode].decoder_targets]
        if cfg.failover:
            for svc in stacks["async"].services:
                sampler.remove(f"async/{svc.name}")
            failover_raw = failover(stacks["async"], cfg)
    finally:
        for c in clients.values():
            c.close()
        for mode, s in stacks.items():
            for svc in s.services:
                sampler.remove(f"{mode}/{svc.name}")  # (a no-op for a name removed before)
            leftovers[mode] = s.stop()
        sampler.stop()
    omni = run_omni(cfg, model_dir) if cfg.omni else None
    rec = record.complete(rec, {
        "engine": cfg.engine, "engine_note": note, "model_dir": model_dir, "levels": levels,
        "extra_rounds": extra_rounds,
        "decoder_info": infos, "memory": sampler.raw(), "shm_segments_left_after_stop": leftovers,
        "omni": omni, "failover": failover_raw,
    })
    data, targets = analyze(rec)
    all_hashes = data["hashes"] + (data["omni"]["hashes"] if data["omni"] else [])
    (out_dir / "hashes.txt").write_text("".join(hash_line(h, 64) + "\n" for h in all_hashes))
    for h in all_hashes:
        print("sha256 " + hash_line(h, 16), flush=True)
    plot(data, out_dir)
    plot_memory(rec["raw"]["memory"], out_dir / "memory.png", "e2e: RSS per service")
    md = markdown(data, targets)
    (out_dir / "results.md").write_text(md)
    return SuiteResult("e2e", out_dir, data, targets, md, rec)


def analyze(rec: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    """The tables' numbers and the targets, from a results file's record:
    per level and stack the request summaries, CPU, probe; the hashes
    compared across the stacks; memory; the omni variant; failover."""
    raw, settings, cores = rec["raw"], rec["settings"], rec["host"]["cores_available"]
    levels = summarize_levels(raw["levels"], cores)
    rounds = [levels] + [summarize_levels(r, cores) for r in raw.get("extra_rounds") or []]
    top = str(max(int(c) for c in raw["levels"])) if raw["levels"] else ""
    probes = {m: probe_summary(lv["probe"]) for m, lv in raw["levels"].get(top, {}).items() if lv["probe"]}
    hashes = compare_hashes({c: {m: lv[m]["requests"] for m in MODES} for c, lv in raw["levels"].items()})
    mem = raw["memory"]
    idle = (mem["marks"].get("after_warmup") or {}).get("rss_kib", {}).get("async/materializer")
    peaks = {f"c{c}/{m}": {n: rss_peak(mem, n, *lv[m]["window_s"]) for n in mem["timeline"] if n.startswith(m + "/")}
             for c, lv in raw["levels"].items() for m in MODES}
    mat_peak_top = peaks.get(f"c{top}/async", {}).get("async/materializer")
    memory = {
        "processes": growth_report(mem),
        "materializer_idle_mib": idle / 1024 if idle else None,
        "materializer_peak_at_top_mib": mat_peak_top / 2**20 if mat_peak_top else None,
        "peaks_per_level_mib": {k: {n: v / 2**20 for n, v in w.items()} for k, w in peaks.items()},
        "arena": {m: i["arena"] for m, i in raw["decoder_info"].items()},
        "shm_segments_left_after_stop": raw["shm_segments_left_after_stop"],
    }
    omni = omni_analysis(raw["omni"], cores) if raw["omni"] else None
    targets = e2e_targets(levels, hashes, memory, int(top) if top else 0, probes, omni, rounds,
                          settings.get("first_chunk_frames", 0))
    data = {
        "suite": "e2e", "quick": rec["quick"], "engine": raw["engine"], "engine_note": raw["engine_note"],
        "model_dir": raw["model_dir"], "config": settings, "machine": rec["host"], "date": rec["date"],
        "levels": levels, "requests": {c: {m: lv[m]["requests"] for m in MODES} for c, lv in raw["levels"].items()},
        "rounds": rounds,
        "hashes": hashes, "decoder_info": raw["decoder_info"], "info_probe": {"concurrency": int(top) if top else None,
                                                                              **probes},
        "omni": omni, "memory": memory, "targets": targets_json(targets),
        "replicas": settings["replicas"], "failover": failover_summary(raw["failover"]) if raw["failover"] else None,
    }
    return data, targets


def summarize_levels(raw_levels: dict[str, dict[str, Any]], cores: int) -> dict[str, dict[str, Any]]:
    """Per level and stack: the request summaries, CPU and the talker step's parts."""
    return {c: {m: {**level_summary(lv[m]["requests"]), "cpu": cpu_report(lv[m]["cpu"], len(lv[m]["requests"]), cores),
                    "talker_step": step_parts.shares(**(lv[m].get("step_parts") or {"before": None, "after": None}))}
                for m in MODES} for c, lv in raw_levels.items()}


def render(rec: dict[str, Any]) -> str:
    """The suite's tables from a results file (what `bench report` shows)."""
    return markdown(*analyze(rec))


def compare_hashes(by_level: dict[Any, dict[str, list[dict[str, Any]]]], profile: str = "tts") -> list[dict[str, Any]]:
    """Per level and prompt, each mode's sha256; equal when all modes agree
    (a mode that has no result for the prompt makes it unequal).
    comparable: every mode's request had the same first audio chunk (the
    deployment chooses it by the load at the request's start, and only the
    same chunks give the same bytes: docs/decoder.md)."""
    out = []
    for c, per_mode in by_level.items():
        got = {m: {r["index"]: r["sha256"] for r in reqs} for m, reqs in per_mode.items()}
        chunk = {m: {r["index"]: int(r.get("first_chunk_frames") or 0) for r in reqs} for m, reqs in per_mode.items()}
        indices = sorted(set().union(*(g.keys() for g in got.values())))
        for i in indices:
            row: dict[str, Any] = {"profile": profile, "concurrency": c, "index": i}
            row.update({m: got[m].get(i) for m in MODES})
            values = [row[m] for m in MODES]
            row["equal"] = None not in values and len(set(values)) == 1
            row["first_chunks"] = {m: chunk[m].get(i) for m in MODES}
            row["comparable"] = len(set(row["first_chunks"].values())) == 1
            out.append(row)
    return out


def hashes_held(hashes: list[dict[str, Any]]) -> tuple[int, int, int]:
    """(equal, comparable, all): of the comparable rows (same first chunk in
    every mode), how many are equal; an unequal row that is not comparable
    is not a failure of the byte-identity invariant."""
    comparable = [h for h in hashes if h.get("comparable", True)]
    return sum(h["equal"] for h in comparable), len(comparable), len(hashes)


def first_chunk_cell(per_mode: dict[str, dict[str, Any]]) -> str:
    """Per mode, how many requests had each first chunk ("async 1: 380, 5: 4; ...")."""
    return "; ".join(f"{m} " + ", ".join(f"{k}: {n}" for k, n in (per_mode[m].get("first_chunk_frames") or {}).items())
                     for m in MODES if m in per_mode)


def first_chunk_note(comparable: int, total: int) -> str:
    if comparable == total:
        return ""
    return (f"; {total - comparable} of {total} requests started under another load in some mode (another first "
            "chunk) and are not compared")


def hash_line(h: dict[str, Any], digits: int) -> str:
    modes = " ".join(f"{m}={(h.get(m) or '-')[:digits]}" for m in MODES)
    verdict = "equal" if h["equal"] else "DIFFERENT" if h.get("comparable", True) else "other first chunk"
    chunks = "" if h.get("comparable", True) else " first chunks " + ",".join(
        f"{m}={v}" for m, v in h["first_chunks"].items())
    return f"{h['profile']} c={h['concurrency']} #{h['index']} {modes} {verdict}{chunks}"


def run_omni(cfg: E2EConfig, model_dir: str) -> dict[str, Any]:
    """The omni profile in every mode, one stack at a time: warm-up, then the
    top concurrency level through Generate ("text+audio")."""
    from omni_stack.stack import Stack

    c = max(cfg.concurrency)
    n = cfg.prompts[c]
    # raw, per mode: the requests, CPU snapshots, decoder info, shared memory left (omni_analysis reads it)
    result: dict[str, Any] = {"concurrency": c, "requests": n, "text_tokens": cfg.omni_text_tokens,
                              "audio_frames": cfg.omni_audio_frames, "modes": {}}
    for mode in MODES:
        stack = Stack(stack_config(mode, cfg, model_dir, profile="omni"))
        client = None
        got: dict[str, Any] = result["modes"].setdefault(mode, {})
        try:
            with progress(None, f"e2e omni: starting {mode}", "stack"):
                stack.start(timeout_s=300)
            client = Client(stack.gateway_target, cfg)
            with progress(c + n, f"e2e omni: {mode} c={c}", "req") as bar:
                client.run_level(list(range(c)), c, cfg.omni_text_tokens, f"omni-warm-{mode}", bar, call="generate")
                cpu0 = cpu_snapshot(stack)
                t0 = time.perf_counter()
                reqs = client.run_level(list(range(n)), c, cfg.omni_text_tokens, f"omni-{mode}", bar,
                                        call="generate")
                wall = time.perf_counter() - t0
                cpu1 = cpu_snapshot(stack)
            got["requests"] = reqs
            got["cpu"] = {"before": cpu0, "after": cpu1, "wall_s": wall}
            got["decoder_info"] = decoder_info(stack.decoder_target)
        finally:
            if client is not None:
                client.close()
            got["shm_segments_left_after_stop"] = stack.stop()
    return result


def omni_analysis(raw: dict[str, Any], cores: int) -> dict[str, Any]:
    """The omni variant's tables, from its raw form (`run_omni`)."""
    modes = raw["modes"]
    per_mode = {m: o["requests"] for m, o in modes.items()}
    return {
        "concurrency": raw["concurrency"], "requests": raw["requests"], "text_tokens": raw["text_tokens"],
        "audio_frames": raw["audio_frames"],
        "modes": {m: {**omni_summary(o["requests"]), "cpu": cpu_report(o["cpu"], len(o["requests"]), cores)}
                  for m, o in modes.items()},
        "decoder_info": {m: o["decoder_info"] for m, o in modes.items()},
        "shm_segments_left_after_stop": {m: o["shm_segments_left_after_stop"] for m, o in modes.items()},
        "per_request": per_mode,
        "hashes": compare_hashes({raw["concurrency"]: per_mode}, profile="omni"),
    }


def omni_summary(reqs: list[dict[str, Any]]) -> dict[str, Any]:
    leads = [r["audio_lead_s"] for r in reqs if finite(r["audio_lead_s"])]
    wall = max(r["end"] for r in reqs) - min(r["start"] for r in reqs)
    return {
        "requests": len(reqs), "wall_s": wall, "throughput_rps": len(reqs) / wall,
        "thinker_done_ms": summary([r["thinker_done_s"] for r in reqs], 1e3),
        # a request with no audio (a reply too short to speak) has no first audio
        "first_audio_ms": summary([r["first_audio_s"] for r in reqs if finite(r["first_audio_s"])], 1e3),
        "audio_lead_ms": summary(leads, 1e3),
        "first_audio_before_thinker_done": sum(1 for v in leads if v > 0),
        "with_text_and_audio": len(leads),
        "first_chunk_frames": first_chunks(reqs),
    }


def failover(stack: Any, cfg: E2EConfig, settle_s: float = 3.0) -> dict[str, Any]:
    """SIGKILL the last replica's decoder of `stack` while closed-loop clients
    send short requests; supervise the stack (restart it) meanwhile.

    gap_ms: from the kill to the send of the first request that then
    succeeded (how long new requests fail); first_success_done_ms: to the
    end of that request; restarted_s: until the killed decoder was healthy
    again; failed: requests that failed (in flight on the killed decoder,
    or sent in the gap).
    """
    import grpc

    victims = stack.services_of("decoder")
    if len(victims) < 2:
        raise ValueError("failover needs --replicas 2 or more")
    victim = victims[-1]
    client = Client(stack.gateway_target, cfg)
    lock = threading.Lock()
    results: list[tuple[float, float, str]] = []
    stop = threading.Event()

    def worker(k: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            t0 = time.perf_counter()
            try:
                client.speak(10_000 + k * 1000 + n, cfg.max_tokens, f"failover-{k}")
                outcome = "ok"
            except grpc.RpcError as exc:
                outcome = exc.code().name
                time.sleep(0.01)
            with lock:
                results.append((t0, time.perf_counter(), outcome))

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(cfg.failover_concurrency)]
    for t in threads:
        t.start()
    try:
        time.sleep(settle_s)
        old_pid = victim.proc.pid
        killed = time.perf_counter()
        os.kill(old_pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while victim.state != "running" or victim.proc.pid == old_pid:  # supervise from this thread
            problem = stack.poll()
            if problem is not None or time.monotonic() > deadline:
                raise RuntimeError(f"failover: the decoder did not come back: {problem}")
            time.sleep(0.02)
        restarted = time.perf_counter()
        end = time.monotonic() + settle_s
        while time.monotonic() < end:
            stack.poll()
            time.sleep(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join(120)
        client.close()
    out = {"killed": victim.name, "concurrency": cfg.failover_concurrency, "restarted_s": restarted - killed,
           "requests": [[t0 - killed, t1 - killed, outcome] for t0, t1, outcome in results]}
    log(f"e2e failover: {failover_summary(out)}")
    return out


def failover_summary(raw: dict[str, Any]) -> dict[str, Any]:
    """The failover figures, from its raw form (`failover`: every request's
    send and end time in seconds from the kill, and its outcome)."""
    results = raw["requests"]
    restarted = raw["restarted_s"]
    after = sorted((r for r in results if r[0] >= 0 and r[2] == "ok"), key=lambda r: r[0])
    failed = [r for r in results if r[2] != "ok"]
    first = after[0] if after else None
    return {
        "killed": raw["killed"], "concurrency": raw["concurrency"], "requests": len(results),
        "failed": len(failed), "failed_codes": sorted({r[2] for r in failed}),
        "failed_sent_after_kill_ms": sorted(r[0] * 1e3 for r in failed if r[0] >= 0),
        "gap_ms": first[0] * 1e3 if first else None,
        "first_success_done_ms": first[1] * 1e3 if first else None,
        "restarted_s": restarted,
        "ok_after_restart": sum(1 for r in results if r[0] >= restarted and r[2] == "ok"),
        "failed_after_restart": sum(1 for r in results if r[0] >= restarted and r[2] != "ok"),
    }


def e2e_targets(levels: dict[str, dict[str, Any]], hashes, memory, top: int,  # noqa: ANN001
                probes: dict[str, Any] | None = None, omni: dict[str, Any] | None = None,
                rounds: list[dict[str, dict[str, Any]]] | None = None, first_chunk: int = 0):
    """The targets, from the per-level summaries (keyed by str(concurrency)).
    Levels a target names but the run did not include are "not measured".
    `rounds`: the summaries of every round (the first is `levels`); a ratio
    is then the median of the rounds' ratios, its spread in the note."""
    rounds = rounds or [levels]

    def level(c: int, mode: str, lv: dict[str, dict[str, Any]] | None = None) -> dict[str, Any] | None:
        return (levels if lv is None else lv).get(str(c), {}).get(mode)

    def decoder_cpu(c: int, mode: str, lv: dict[str, dict[str, Any]]) -> float | None:
        return (((level(c, mode, lv) or {}).get("cpu") or {}).get("cpu_ms_per_request_by_role", {}).get("decoder"))

    def over_rounds(fn) -> tuple[float | None, str]:  # noqa: ANN001
        vals = [v for v in (fn(lv) for lv in rounds) if v is not None and finite(v)]
        if len(vals) <= 1:
            return (vals[0] if vals else None), ""
        return float(np.median(vals)), f"; median of {len(vals)} rounds ({min(vals):.3g}-{max(vals):.3g})"

    def mode_ratio(c: int, key, a: str, b: str):  # noqa: ANN001
        def fn(lv: dict[str, dict[str, Any]]) -> float | None:
            x, y = level(c, a, lv), level(c, b, lv)
            return ratio(key(x), key(y)) if x and y else None
        return over_rounds(fn)

    def thr(x: dict[str, Any]) -> float:
        return x["throughput_rps"]

    targets = []
    for c in TARGET_LEVELS:
        at = f"concurrency {c}" + ("" if level(c, "async") else " (not run)")
        sync_thr, n1 = mode_ratio(c, thr, "async", "sync")
        thread_thr, n2 = mode_ratio(c, thr, "async", "thread")
        cpu, n3 = over_rounds(lambda lv, c=c: ratio(decoder_cpu(c, "async", lv), decoder_cpu(c, "sync", lv)))
        targets += [
            check("e2e throughput: async / sync", sync_thr, ">= 1.05x", lambda v: v >= 1.05, "x", at + n1),
            check("e2e throughput: async / thread", thread_thr, ">= 1.0x", lambda v: v >= 1.0, "x", at + n2),
            check("decoder CPU per request: async / sync", cpu, "<= 1.0x", lambda v: v <= 1.0, "x", at + n3),
        ]
    ttfp, n_ttfp = mode_ratio(top, lambda x: x["ttfp_ms"]["p50"], "async", "sync")
    rtf, n_rtf = mode_ratio(top, lambda x: x["rtf"]["p50"], "async", "sync")
    thr_top, n_thr = mode_ratio(top, thr, "async", "sync")
    both = level(1, "async") and level(64, "async")
    scaling, n_scaling = over_rounds(lambda lv: ratio(level(64, "async", lv)["ttfp_ms"]["p50"],
                                                      level(1, "async", lv)["ttfp_ms"]["p50"]) if both else None)
    probe = (probes or {}).get("async")
    info_p99 = probe["latency_ms"]["p99"] if probe and probe["latency_ms"]["n"] else None
    equal, comparable, total = hashes_held(hashes)
    idle, peak = memory.get("materializer_idle_mib"), memory.get("materializer_peak_at_top_mib")
    mat = ratio(peak, idle) if idle and peak else None
    grew = [n for n, m in memory["processes"].items() if m["grew_over_limit"]]
    worst = max((m["growth"] for m in memory["processes"].values()), default=None)
    at = f"concurrency {top}"
    chunk = f"first chunk fixed at {first_chunk} frames" if first_chunk else "first chunk by load"
    targets += [
        check("e2e throughput: async / sync (the seed's gain)", thr_top, ">= 1.3x", lambda v: v >= 1.3, "x",
              at + n_thr),
        check("e2e TTFP p50: async / sync", ttfp, "<= 1.0x", lambda v: v <= 1.0, "x", at + n_ttfp),
        check("e2e RTF p50: async / sync", rtf, "<= 0.75x", lambda v: v <= 0.75, "x", at + n_rtf),
        check("e2e TTFP p50 (async): concurrency 64 / 1", scaling, "<= 3x", lambda v: v <= 3, "x",
              f"async stack, {chunk}" + ("" if both else " (concurrency 1 and 64 not both run)") + n_scaling),
    ]
    if first_chunk:
        steady, n_steady = over_rounds(lambda lv: ratio(level(64, "async", lv)["ttfp_ms"]["p90"],
                                                        level(1, "async", lv)["ttfp_ms"]["p50"]) if both else None)
        targets.append(check("e2e TTFP (async): p90 at concurrency 64 / p50 at 1", steady, "<= 3x",
                             lambda v: v <= 3, "x", f"{chunk}, closed-loop clients" + n_steady))
    targets += [
        check("GetDecoderInfo p99 under full load (async)", info_p99, "<= 50 ms", lambda v: v <= 50, " ms",
              f"{probe['latency_ms']['n']} calls during {at}" if probe else f"{at} (no probe)"),
        check("e2e audio hashes equal (async, sync, thread)", float(equal), f"{comparable}/{comparable}",
              lambda v: comparable and v == comparable, f"/{comparable}",
              "sha256 of every request's PCM" + first_chunk_note(comparable, total)),
    ]
    step64 = (level(64, "async") or {}).get("talker_step")
    if step64:
        def cp_pct(lv: dict[str, dict[str, Any]]) -> float | None:
            part = (level(64, "async", lv) or {}).get("talker_step")
            return part["code_predictor_share"] * 100 if part else None

        share, n_share = over_rounds(cp_pct)
        targets.append(check("talker step at concurrency 64 (async): code predictor share", share, "<= 35%",
                             lambda v: v <= 35, "%",
                             f"{step64['steps']} steps, {step64['step_ms']:.1f} ms each (first round)" + n_share))
    cont16, cont64 = (stalls_over_rounds([level(c, "async", lv) for lv in rounds]) for c in (16, 64))
    if cont16 or cont64:
        stalled = cont16["stalled_share"] * 100 if cont16 else None
        targets.append(check(
            "continuity: streams that stalled at a 250 ms buffer (async)", stalled, "0%", lambda v: v == 0, "%",
            "concurrency 16" + (f" ({cont16['stalled']}/{cont16['streams']})" if cont16 else " (not run)")
            + (f"; at 64: {cont64['stalled']}/{cont64['streams']} stalled, worst round's p99 "
               f"{cont64['stall_p99_ms']:.0f} ms" if cont64 else "")
            + (f"; {len(rounds)} rounds" if len(rounds) > 1 else "")))
    if omni:
        ohashes = omni["hashes"]
        oequal, ocomparable, ototal = hashes_held(ohashes)
        oa = omni["modes"].get("async", {})
        lead = oa.get("audio_lead_ms", {}).get("p50")
        targets += [
            check("omni text+audio hashes equal (async, sync, thread)", float(oequal),
                  f"{ocomparable}/{ocomparable}", lambda v: ocomparable and v == ocomparable, f"/{ocomparable}",
                  "sha256 of every request's text and PCM" + first_chunk_note(ocomparable, ototal)),
            check("omni: first audio before the thinker finished (async, p50 lead)", lead, "> 0 ms",
                  lambda v: v > 0, " ms",
                  f"{oa.get('first_audio_before_thinker_done', 0)}/{oa.get('with_text_and_audio', 0)} requests; "
                  f"concurrency {omni['concurrency']}"),
        ]
    targets += [
        check("materializer RSS during e2e / idle", mat, "<= 1.1x", lambda v: v <= 1.1, "x", f"peak at {at} vs after warm-up"),
        check("service RSS growth after warm-up (worst)", worst * 100 if worst is not None else None, "<= 10% each",
              lambda v: v <= 10, "%", ("grew: " + ", ".join(grew)) if grew else "all services"),
    ]
    return targets


def stalls_over_rounds(per_round: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """A level's continuity summed over the rounds (None: no round kept chunk arrivals)."""
    got = [lv["continuity"] for lv in per_round if lv and lv.get("continuity")]
    if not got:
        return None
    streams, stalled = sum(c["streams"] for c in got), sum(c["stalled"] for c in got)
    return {"streams": streams, "stalled": stalled, "stalled_share": stalled / streams if streams else float("nan"),
            "stall_p99_ms": max(c["stall_ms"]["p99"] for c in got)}


def markdown(data: dict[str, Any], targets) -> str:  # noqa: ANN001
    cfg = data["config"]
    engine = data["engine"] + (f" (checkpoints {data['model_dir']})" if data["model_dir"] else "")
    if data.get("engine_note"):
        engine += f" ({data['engine_note']})"
    reps = data.get("replicas", 1)
    title = f"# e2e{' (quick)' if data['quick'] else ''}{f', {reps} replicas' if reps > 1 else ''}"
    lines = [title,
             "", machine_md(data["machine"], data["date"]), "",
             f"Profile tts, engine {engine}; {cfg['max_tokens']} codec frames per request "
             f"({cfg['max_tokens'] / 12.5:.2f} s of audio), temperature {cfg['temperature']}, top_p {cfg['top_p']}, "
             "a fixed seed per prompt"
             + (f", the first chunk fixed at {cfg['first_chunk_frames']} frames" if cfg.get("first_chunk_frames")
                else "") +
             ". Client: closed loop over gRPC Speak; TTFP = request sent -> first audio chunk. "
             "Modes: async = the materializer process (shm handles); sync = payloads built in the decode step; "
             "thread = no materializer, the decoder's in-process background builder (`--in-process-builder`).", ""]
    rows = []
    for c, lv in data["levels"].items():
        for m in MODES:
            s = lv[m]
            rows.append([c, m, s["requests"], s["wall_s"], s["throughput_rps"], s["ttfp_ms"]["p50"], s["ttfp_ms"]["p99"],
                         s["rtf"]["p50"], s["rtf"]["p99"], s["audio_s_per_wall_s"], s["retries"]])
    lines.append(md_table(["concurrency", "path", "requests", "wall s", "req/s", "TTFP p50 ms", "TTFP p99 ms", "RTF p50",
                           "RTF p99", "audio s / wall s", "gateway retries"], rows))
    lines += continuity_md(data["levels"]) + step_parts_md(data["levels"])
    lines += ["", "Async / sync and async / thread at each level (hashes: all three modes equal):", ""]
    rows = []
    for c, lv in data["levels"].items():
        a, s, t = lv["async"], lv["sync"], lv["thread"]
        eq = [h for h in data["hashes"] if str(h["concurrency"]) == c]
        rows.append([c, ratio(a["throughput_rps"], s["throughput_rps"]), ratio(a["throughput_rps"], t["throughput_rps"]),
                     ratio(a["ttfp_ms"]["p50"], s["ttfp_ms"]["p50"]), ratio(a["ttfp_ms"]["p50"], t["ttfp_ms"]["p50"]),
                     ratio(a["rtf"]["p50"], s["rtf"]["p50"]), ratio(a["rtf"]["p50"], t["rtf"]["p50"]),
                     "{}/{}".format(*hashes_held(eq)[:2]), first_chunk_cell(lv)])
    lines.append(md_table(["concurrency", "throughput async/sync", "throughput async/thread", "TTFP p50 async/sync",
                           "TTFP p50 async/thread", "RTF p50 async/sync", "RTF p50 async/thread",
                           "hashes equal (same first chunk)", "first chunk frames: requests"], rows))
    if len(data.get("rounds") or []) > 1:
        lines += ["", f"Every round ({len(data['rounds'])}; the tables above are the first round's; the targets' "
                  "ratios are the medians over the rounds):", ""]
        rows = []
        for k, rnd in enumerate(data["rounds"]):
            for c, lv in rnd.items():
                a, s, t = lv["async"], lv["sync"], lv["thread"]
                rows.append([k + 1, c, a["throughput_rps"], s["throughput_rps"], t["throughput_rps"],
                             ratio(a["throughput_rps"], s["throughput_rps"]),
                             a["ttfp_ms"]["p50"], a["ttfp_ms"].get("p90"), s["ttfp_ms"]["p50"], t["ttfp_ms"]["p50"]])
        lines.append(md_table(["round", "concurrency", "req/s async", "req/s sync", "req/s thread",
                               "throughput async/sync", "TTFP p50 async ms", "TTFP p90 async ms",
                               "TTFP p50 sync ms", "TTFP p50 thread ms"], rows))
    lines += ["", "CPU per request (ms, all processes of the stack and the client) and host CPU use during each level:", ""]
    rows = []
    for c, lv in data["levels"].items():
        for m in MODES:
            cpu = lv[m].get("cpu")
            if not cpu:
                continue
            per = cpu.get("cpu_ms_per_request_by_role") or cpu["cpu_ms_per_request"]
            rows.append([c, m, per.get("decoder"), per.get("materializer", 0.0), per.get("gateway"),
                         per.get("bench clients"), sum(v for k, v in per.items() if k != "bench clients"),
                         f"{cpu['host_busy_pct']:.0f}%"])
    lines.append(md_table(["concurrency", "path", "decoder", "materializer", "gateway", "clients (bench)",
                           "stack total", "host CPU busy"], rows))
    if data.get("replicas", 1) > 1:
        lines += ["", "CPU use per process during each level (% of one core):", ""]
        rows = []
        for c, lv in data["levels"].items():
            for m in MODES:
                pct_core = (lv[m].get("cpu") or {}).get("cpu_pct_of_one_core") or {}
                rows.append([c, m, ", ".join(f"{k} {v:.0f}%" for k, v in pct_core.items())])
        lines.append(md_table(["concurrency", "path", "per process"], rows))
    probe = data.get("info_probe") or {}
    if any(m in probe for m in MODES):
        lines += ["", f"GetDecoderInfo latency while concurrency {probe.get('concurrency')} ran (a call every "
                  f"{cfg['probe_interval_s'] * 1e3:.0f} ms on one open channel):", ""]
        lines.append(md_table(["path", "calls", "p50 ms", "p99 ms", "max ms", "errors"],
                              [[m, p["latency_ms"]["n"], p["latency_ms"]["p50"], p["latency_ms"]["p99"],
                                p["latency_ms"]["max"], p["errors"]] for m, p in probe.items() if m in MODES]))
    omni = data.get("omni")
    if omni:
        lines += ["", "## omni: thinker -> talker -> code2wav", "",
                  f"Profile omni (the thinker routes its hidden states to the talker), Generate \"text+audio\", "
                  f"{omni['text_tokens']} text tokens and {omni['audio_frames']} codec frames per request at most, "
                  f"{omni['requests']} requests at concurrency {omni['concurrency']} per mode, one stack at a time. "
                  "Thinker done = the request's last text delta arrived; lead = thinker done - first audio "
                  "(> 0: audio started before the thinker finished).", ""]
        rows = []
        for m, o in omni["modes"].items():
            rows.append([m, o["requests"], o["throughput_rps"], o["thinker_done_ms"]["p50"], o["first_audio_ms"]["p50"],
                         o["first_audio_ms"]["p99"], o["audio_lead_ms"]["p50"],
                         f"{o['first_audio_before_thinker_done']}/{o['with_text_and_audio']}",
                         (o["cpu"].get("cpu_ms_per_request_by_role") or {}).get("decoder")])
        lines.append(md_table(["path", "requests", "req/s", "thinker done p50 ms", "first audio p50 ms",
                               "first audio p99 ms", "lead p50 ms", "audio before thinker done",
                               "decoder CPU ms / request"], rows))
        oeq = omni["hashes"]
        oequal, ocomparable, ototal = hashes_held(oeq)
        lines += ["", f"Text + audio hashes equal across the modes: {oequal}/{ocomparable}"
                  f"{first_chunk_note(ocomparable, ototal)}. First chunks: {first_chunk_cell(omni['modes'])}. "
                  "Stage paths: " + "; ".join(
                      f"{m}: " + ", ".join(f"{st['name']} {st['output_path'].removeprefix('OUTPUT_PATH_').lower()}"
                                           for st in i["stages"])
                      for m, i in omni["decoder_info"].items()) + ".", ""]
    lines += ["", "## Decoder info at the end", ""]
    lines.append(md_table(["stack", "talker path", "reason", "fallback steps", "arena", "peak slots in use"],
                          [[m, i["talker_output_path"], i["talker_reason"], i["fallback_steps"],
                            f"{i['arena']['num_slots']} x {i['arena']['slot_bytes'] // 2**20} MiB",
                            i["arena"]["peak_slots_in_use"]] for m, i in data["decoder_info"].items()]))
    mem = data["memory"]
    lines += ["", "## Memory", ""]
    lines.append(md_table(["process", "peak RSS MiB", "RSS after warm-up MiB", "RSS at end MiB", "growth", "flag"],
                          [[n, m["peak_mib"], m["rss_after_warmup_mib"], m["rss_end_mib"], f"{m['growth'] * 100:+.1f}%",
                            "GREW > 10%" if m["grew_over_limit"] else "ok"] for n, m in mem["processes"].items()]))
    lines += ["", f"Materializer RSS idle (after warm-up) {mem['materializer_idle_mib'] or float('nan'):.0f} MiB, "
              f"peak at the top concurrency {mem['materializer_peak_at_top_mib'] or float('nan'):.0f} MiB. "
              f"Shared-memory segments left after stop: {mem['shm_segments_left_after_stop']}.", ""]
    odd = [h for h in data["hashes"] if not h["equal"]]
    equal, comparable, total = hashes_held(data["hashes"])
    lines += ["## Audio hashes", "",
              f"sha256 of every request's PCM, compared across {', '.join(MODES)}: {equal} of {comparable} comparable "
              f"requests equal{first_chunk_note(comparable, total)}. Every hash is in the results file and in the "
              "run folder's hashes.txt." + (" The requests whose hashes differ (first 16 hex digits):" if odd else ""),
              ""]
    if odd:
        lines.append(md_table(["concurrency", "#", *MODES, "verdict"],
                              [[h["concurrency"], h["index"], *((h.get(m) or "")[:16] for m in MODES),
                                "DIFFERENT" if h.get("comparable", True) else "other first chunk"] for h in odd]))
        lines.append("")
    if data.get("replicas", 1) > 1:
        lines += ["", "## Replicas", "",
                  f"{data['replicas']} decoder + materializer pairs per stack. Requests finished per decoder: "
                  + ", ".join(f"{m}: {i.get('finished_requests_per_replica')}" for m, i in data["decoder_info"].items())
                  + ".", ""]
    fo = data.get("failover")
    if fo:
        lines += ["## Failover", "",
                  f"SIGKILL {fo['killed']} of the async stack under {fo['concurrency']} closed-loop clients: "
                  f"the first request served again was sent {fmt(fo['gap_ms'])} ms after the kill "
                  f"(done {fmt(fo['first_success_done_ms'])} ms after it); {fo['failed']} of {fo['requests']} "
                  f"requests failed ({', '.join(fo['failed_codes']) or 'none'}); the decoder was serving again "
                  f"{fo['restarted_s']:.1f} s after the kill; after that {fo['ok_after_restart']} requests, "
                  f"{fo['failed_after_restart']} failed.", ""]
    lines += ["", "## Targets", "", targets_md(targets), "", "Plots: e2e.png, memory.png.", ""]
    return "\n".join(lines)


def plot(data: dict[str, Any], out_dir: Path) -> None:
    plt = pyplot()
    cs = list(data["levels"])
    fig, axes = plt.subplots(1, 4, figsize=(16, 4))
    panels = (("throughput_rps", None, "requests / s"), ("ttfp_ms", "p50", "TTFP p50 (ms)"),
              ("rtf", "p50", "RTF p50"), ("audio_s_per_wall_s", None, "audio s / wall s"))
    for ax, (key, sub, label) in zip(axes, panels, strict=True):
        for j, m in enumerate(MODES):
            vals = [data["levels"][c][m][key][sub] if sub else data["levels"][c][m][key] for c in cs]
            width = 0.8 / len(MODES)
            ax.bar([i + (j - (len(MODES) - 1) / 2) * width for i in range(len(cs))], vals, width, label=m)
        ax.set_xticks(range(len(cs)), [f"c={c}" for c in cs])
        ax.set_title(label)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(out_dir / "e2e.png", dpi=110)
    plt.close(fig)


__all__ = ["E2EConfig", "run", "log"]
