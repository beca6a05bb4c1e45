"""step-gap: the decode critical path between sampling step N and launching
step N + 1 (`StageRunner.gaps_s`), and the decode step time, per output mode.

One engine, one talker stage, five modes on the same engine and payload:

  none           the stage has no routes: nothing is built (the floor)
  inline         synchronous path: payloads built inside the step
  thread         the in-process baseline: snapshot into the arena and a
                 background builder thread in the decoder process
  remote-shm     a real materializer process, tensors as shm handles
  remote-inline  the same materializer, tensors as bytes in the message

Payloads: heavy = per-token hidden states (width 2048, float32) + 16-codebook
codes routed; light = codes only. Batches are admitted at once; after the
prefill steps and `warmup` decode steps, the following full-batch decode
steps (one scheduled token per request) are measured, up to `steps` per
(payload, mode, batch) in all. The measurement is split into `rounds`; every
round runs every configuration once, each round starting the mode order at
a different mode, so slow drifts of a shared machine spread over all modes.
The vLLM talker ignores EOS here so a batch keeps its size.

Each mode's gap is reported raw and as the gap it adds over the floor (its
p50 minus mode `none`'s p50 at the same payload and batch): the floor is
what the runner loop itself costs without outputs, the same for every mode,
so only the added part is the output path's cost.

The generation stage (code2wav) is replaced by a frame counter in every mode:
the suite measures the AR stage's critical path, and the vocoder thread's CPU
use would otherwise load every mode but `none`. The e2e suite runs the real one.
"""

from __future__ import annotations

import dataclasses
import math
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench import engines, record
from bench.common import (
    RssSampler,
    SuiteResult,
    check,
    fmt,
    growth_report,
    log,
    machine_md,
    md_table,
    memory_md,
    plot_memory,
    progress,
    pyplot,
    ratio,
    summary,
    targets_json,
    targets_md,
)

MODES = ("none", "inline", "thread", "remote-shm", "remote-inline")
PAYLOADS = ("heavy", "light")
CODES_ROUTE = {"source": "codec_codes", "key": "codec_codes", "destination": "inter_stage", "selection": "all"}
HIDDEN_ROUTE = {"source": "hidden_states", "key": "talker_hidden", "destination": "inter_stage", "selection": "all"}
ARENA_SLOTS = 16
ARENA_SLOT_BYTES = 4 * 2**20


@dataclasses.dataclass
class StepGapConfig:
    quick: bool = False
    engine: str = "auto"  # auto | vllm | fake
    batches: tuple[int, ...] = (1, 16, 64)
    warmup: int = 4
    steps: dict[int, int] = dataclasses.field(default_factory=lambda: {1: 160, 16: 80, 64: 60})
    rounds: int = 3
    model_dir: str = ""
    hidden_size: int = engines.BENCH_HIDDEN
    num_layers: int = engines.BENCH_LAYERS
    reference_step_s: float = 0.03  # reference engine: synthetic model cost per step

    @classmethod
    def for_run(cls, quick: bool, engine: str = "auto", model_dir: str = "") -> StepGapConfig:
        if quick:
            return cls(quick=True, engine="fake" if engine == "auto" else engine, batches=(1, 4), warmup=3,
                       steps={1: 12, 4: 12}, rounds=1, model_dir=model_dir, reference_step_s=0.002)
        return cls(engine="vllm" if engine == "auto" else engine, model_dir=model_dir)


# -- pipeline pieces ------------------------------------------------------------


def stage_profile(payload: str):
    """The tts profile with the talker's routes for `payload` (none | light | heavy)."""
    from decoder_svc.profile import load_profile

    base = load_profile("tts")
    routes = {"none": (), "light": (CODES_ROUTE,), "heavy": (HIDDEN_ROUTE, CODES_ROUTE)}[payload]
    stages = tuple(dataclasses.replace(s, routes=routes) if s.name == "talker" else s for s in base.stages)
    return dataclasses.replace(base, stages=stages)


class FrameCounter:
    """Stands in for code2wav in this suite: counts frames, completes requests."""

    def __init__(
        self, emit: Callable[[str, np.ndarray, bool, str], None], num_codebooks: int, codebook_size: int
    ) -> None:
        self.emit = emit
        self.num_codebooks, self.codebook_size = num_codebooks, codebook_size  # read by the runaway guard
        self.chunks = 0
        self.frames_seen = 0
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="frame-counter", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=30)

    def frames(self, request_id: str, voice: str, codes: np.ndarray, first: int = 0) -> None:
        self.frames_seen += int(codes.shape[0])

    def finish(self, request_id: str, voice: str, reason: str) -> None:
        self._q.put((request_id, reason))

    def abort(self, request_id: str) -> None:
        pass

    def _loop(self) -> None:
        while (item := self._q.get()) is not None:
            rid, reason = item
            self.emit(rid, np.zeros(0, dtype=np.float32), True, reason)


class Done:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.finished: set[str] = set()

    def sink_for(self, rid: str):
        def sink(resp) -> None:  # noqa: ANN001
            if isinstance(resp, Exception):
                raise resp  # the pipeline logs it; the batch then never finishes, which run_one reports
            if resp.finished:
                with self.cond:
                    self.finished.add(rid)
                    self.cond.notify_all()

        return sink

    def wait(self, n: int, timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: len(self.finished) >= n, timeout)


class MaterializerProcess:
    """`python -m materializer_svc` on a private unix socket."""

    def __init__(self, deployment: str, impl: str = "reference") -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="omni-bench-")
        self.target = f"unix://{self._dir.name}/materializer.sock"
        self.deployment = deployment
        self.argv = [sys.executable, "-m", "materializer_svc", "--listen", self.target, "--deployment", deployment,
                     "--impl", impl, "--log-level", "WARNING"]
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 60.0) -> MaterializerProcess:
        from omni_common.server import wait_for_health_sync

        self.proc = subprocess.Popen(self.argv, start_new_session=True)
        wait_for_health_sync(self.target, timeout_s)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._dir.cleanup()


# -- one measurement -------------------------------------------------------------


def prompt_for(i: int, engine: str, max_tokens: int) -> str:
    base = f"Request {i} reads this sentence aloud in a calm voice."
    if engine == "fake":
        # the reference talker emits 4 + 2 x len(prompt) frames at most
        base = (base + " ") * (max_tokens // (2 * len(base)) + 1)
    return base


def run_one(
    backend: engines.MeasuredBackend,
    engine: str,
    payload: str,
    mode: str,
    batch: int,
    *,
    warmup: int,
    steps: int,
    materializer: MaterializerProcess | None,
    prefix: str,
    round_no: int,
    probe: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    from decoder_svc.backend import RequestSpec
    from decoder_svc.pipeline import Pipeline
    from decoder_svc.testing.fake_engine import fake_vocoder
    from omni_common.modality import OutputModality
    from omni_common.shm_arena import ShmArena

    profile = stage_profile("none" if mode == "none" else payload)
    remote = mode.startswith("remote")
    arena = ShmArena(prefix, ARENA_SLOTS, ARENA_SLOT_BYTES) if mode in ("thread", "remote-shm", "remote-inline") else None
    if hasattr(backend.inner, "capture_hidden"):
        backend.inner.capture_hidden = payload == "heavy"  # the engine copies out what the payload routes
    pipeline = Pipeline(
        profile,
        {"talker": backend},
        vocoder=fake_vocoder(profile, backend),
        materializer_target=materializer.target if (remote and materializer) else None,
        shm_prefix=prefix,
        arena=arena,
        inline_transport=mode == "remote-inline",
        in_process_builder=mode == "thread",
    )
    want_async = mode in ("thread", "remote-shm", "remote-inline")
    if pipeline.decision.use_async != want_async:
        raise RuntimeError(f"{mode}: guards chose {'async' if pipeline.decision.use_async else 'sync'} ({pipeline.decision.reason})")
    real = pipeline.code2wav
    pipeline.code2wav = FrameCounter(real.emit, real.num_codebooks, real.codebook_size)
    backend.reset()
    # chunked prefill staggers the batch by a few steps at both ends: margin
    max_tokens = warmup + steps + 16
    done = Done()
    pipeline.start()
    try:
        if remote and not (pipeline.link and pipeline.link.connected):
            raise RuntimeError(f"{mode}: materializer stream did not open")
        ids = [f"g{round_no}-{payload}-{mode}-{batch}-{i}" for i in range(batch)]
        for i, rid in enumerate(ids):
            pipeline.submit(
                RequestSpec(request_id=rid, prompt=prompt_for(i, engine, max_tokens), max_tokens=max_tokens, seed=1000 + i,
                            modality=OutputModality.AUDIO),
                done.sink_for(rid),
            )
        if probe is not None:
            probe("running")
        # The batch runs to max_tokens (aborting mid-flight would leave the
        # engine's queued step to the next configuration).
        deadline = time.monotonic() + 600
        finished = False
        while time.monotonic() < deadline:
            if done.wait(batch, timeout=0.5):
                finished = True
                break
            if not pipeline.runner._thread.is_alive():
                raise RuntimeError(f"{mode} batch {batch}: the stage thread died (see the log above)")
        if probe is not None:
            probe("finished")  # before stop: the pipeline's threads still exist
        if not finished:
            raise RuntimeError(f"{mode} batch {batch}: only {len(done.finished)}/{batch} requests finished")
    finally:
        pipeline.stop()
        if arena is not None:
            peak_slots = arena.peak_in_use
            arena.close()
        else:
            peak_slots = 0
    runner = pipeline.runner
    gaps, times, recs = list(runner.gaps_s), list(runner.step_times_s), list(backend.records)
    if not (len(gaps) == len(times) == len(recs)):
        raise RuntimeError(f"step records misaligned: {len(gaps)=} {len(times)=} {len(recs)=}")
    idx = [i for i, r in enumerate(recs) if r.decode_only and r.rows == batch]
    idx = idx[warmup : warmup + steps]
    link = pipeline.link
    return {
        "gaps_s": [gaps[i] for i in idx],
        "step_s": [times[i] for i in idx],
        "prefill_or_partial_steps": len(recs) - len([r for r in recs if r.decode_only and r.rows == batch]),
        "total_steps": len(recs),
        "peak_slots_in_use": peak_slots,
        "fallback_steps": link.fallback_steps if link else 0,
        "remote_steps": link.remote_steps if link else 0,
        "in_flight_peak": link.in_flight_peak if link else 0,
        "output_path": "async" if pipeline.decision.use_async else "sync",
    }


def payload_bytes(payload: str, mode: str, batch: int, hidden: int) -> int:
    if mode == "none":
        return 0
    codes = batch * 16 * 8
    return codes + (batch * hidden * 4 if payload == "heavy" else 0)


# -- the suite --------------------------------------------------------------------


def _build_engine(cfg: StepGapConfig) -> tuple[Any, str, str]:
    """(backend, engine name, why)."""
    if cfg.engine == "vllm":
        try:
            t = time.perf_counter()
            folder = engines.ensure_talker_model(Path(cfg.model_dir) if cfg.model_dir else None, cfg.hidden_size, cfg.num_layers)
            backend = engines.build_vllm_talker(folder, max_num_seqs=max(64, max(cfg.batches)))
            why = (f"vLLM {backend.engine_facts().get('vllm_version')} talker, hidden {cfg.hidden_size}, "
                   f"{cfg.num_layers} layer(s), random weights from {folder / 'talker'}; engine built in "
                   f"{time.perf_counter() - t:.0f}s")
            return backend, "vllm", why
        except Exception as exc:  # noqa: BLE001  reported; the suite falls back to the fake engine
            log(f"vLLM engine unavailable ({exc!r}); falling back to the fake engine")
            fallback = f"vLLM engine failed to build here ({type(exc).__name__}: {exc}); "
    else:
        fallback = "fake engine requested (quick run: fast and deterministic); "
    work = engines.calibrate_work(cfg.reference_step_s)
    backend = engines.build_reference_talker(hidden_size=cfg.hidden_size, work_per_step=work, max_num_seqs=max(64, max(cfg.batches)))
    why = fallback + f"reference backend, hidden {cfg.hidden_size}, work_per_step {work} (~{cfg.reference_step_s * 1e3:.0f} ms matmul per step)"
    return backend, "fake", why


def _warm_engine(backend: engines.MeasuredBackend, engine: str, batch: int, steps: int) -> None:
    from decoder_svc.backend import RequestSpec

    if hasattr(backend.inner, "capture_hidden"):
        backend.inner.capture_hidden = True
    for i in range(batch):
        backend.add_request(RequestSpec(request_id=f"warm-{i}", prompt=prompt_for(i, engine, steps), max_tokens=steps, seed=i))
    while backend.has_unfinished():
        backend.step()


def run(cfg: StepGapConfig, out_dir: Path) -> SuiteResult:
    out_dir.mkdir(parents=True, exist_ok=True)
    from omni_common.shm_arena import sweep_stale

    rec = record.begin("step-gap", quick=cfg.quick, settings=dataclasses.asdict(cfg))
    deployment = f"bench{os.getpid()}"
    prefix = f"omni-{deployment}"
    sweep_stale(prefix)
    sampler = RssSampler({"decoder (bench process)": os.getpid()}).start()
    log("step-gap: building the engine")
    inner, engine, why = _build_engine(cfg)
    backend = engines.MeasuredBackend(inner)
    materializer = MaterializerProcess(deployment).start()
    sampler.add("materializer", materializer.pid)
    runs: list[dict[str, Any]] = []
    try:
        log(f"step-gap: engine = {why}")
        _warm_engine(backend, engine, max(cfg.batches), cfg.warmup + 8)
        # warm-up pass: every mode once at the largest batch (threads, channels,
        # arena pages, allocator pools reach their steady size), not recorded
        with progress(len(MODES), "step-gap: warm-up", "mode") as bar:
            for mode in MODES:
                run_one(backend, engine, "heavy", mode, max(cfg.batches), warmup=2, steps=4,
                        materializer=materializer, prefix=prefix, round_no=-1)
                bar.update(1)
        sampler.mark("after_warmup")
        plan = [(r, p, b, m) for r in range(cfg.rounds) for p in PAYLOADS for b in cfg.batches
                for m in MODES[r % len(MODES):] + MODES[: r % len(MODES)]]  # each round starts elsewhere
        per_round_steps = {b: max(1, -(-cfg.steps[b] // cfg.rounds)) for b in cfg.batches}
        with progress(len(plan), "step-gap", "config") as bar:
            for round_no, payload, batch, mode in plan:
                bar.set_postfix_str(f"{payload} b={batch} {mode}")
                r = run_one(backend, engine, payload, mode, batch, warmup=cfg.warmup, steps=per_round_steps[batch],
                            materializer=materializer, prefix=prefix, round_no=round_no)
                runs.append({"round": round_no, "payload": payload, "mode": mode, "batch": batch, **r})
                bar.update(1)
        sampler.mark("end")
    finally:
        materializer.stop()
        sampler.stop()
        backend.really_close()
        sweep_stale(prefix)
    rec = record.complete(rec, {
        "engine": engine, "engine_note": why, "arena": {"num_slots": ARENA_SLOTS, "slot_bytes": ARENA_SLOT_BYTES},
        "runs": runs, "memory": sampler.raw(),
    })
    data, targets = analyze(rec)
    plot(data["results"], cfg.batches, out_dir)
    plot_memory(rec["raw"]["memory"], out_dir / "memory.png", "step-gap: RSS per process")
    md = markdown(data, targets)
    (out_dir / "results.md").write_text(md)
    return SuiteResult("step-gap", out_dir, data, targets, md, rec)


def analyze(rec: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    """The tables' numbers and the targets, from a results file's record:
    every run's steps pooled per (payload, mode, batch) over the rounds."""
    raw, settings = rec["raw"], rec["settings"]
    acc: dict[tuple[str, str, int], dict[str, Any]] = {}
    for r in raw["runs"]:
        a = acc.setdefault((r["payload"], r["mode"], r["batch"]), {
            "gaps_s": [], "step_s": [], "peak_slots_in_use": 0, "fallback_steps": 0, "remote_steps": 0,
            "in_flight_peak": 0})
        a["gaps_s"] += r["gaps_s"]
        a["step_s"] += r["step_s"]
        for k in ("peak_slots_in_use", "in_flight_peak"):
            a[k] = max(a[k], r[k])
        for k in ("fallback_steps", "remote_steps"):
            a[k] += r[k]
        a["output_path"] = r["output_path"]
    results = [{
        "payload": payload, "mode": mode, "batch": batch, "output_path": a["output_path"],
        "payload_bytes_per_step": payload_bytes(payload, mode, batch, settings["hidden_size"]),
        "gap_us": summary(a["gaps_s"], 1e6), "step_ms": summary(a["step_s"], 1e3),
        "peak_slots_in_use": a["peak_slots_in_use"], "fallback_steps": a["fallback_steps"],
        "remote_steps": a["remote_steps"], "in_flight_peak": a["in_flight_peak"],
    } for (payload, mode, batch), a in acc.items()]
    results.sort(key=lambda r: (PAYLOADS.index(r["payload"]), r["batch"], MODES.index(r["mode"])))
    add_floor_gaps(results)
    memory = {
        "processes": growth_report(raw["memory"]),
        "arena": {**raw["arena"], "peak_slots_in_use": max((r["peak_slots_in_use"] for r in results), default=0)},
    }
    targets = step_gap_targets(results, max(settings["batches"]))
    data = {
        "suite": "step-gap", "quick": rec["quick"], "engine": raw["engine"], "engine_note": raw["engine_note"],
        "config": settings, "machine": rec["host"], "date": rec["date"], "results": results,
        "memory": memory, "targets": targets_json(targets),
    }
    return data, targets


def render(rec: dict[str, Any]) -> str:
    """The suite's tables from a results file (what `bench report` shows)."""
    return markdown(*analyze(rec))


def _get(results: list[dict[str, Any]], payload: str, mode: str, batch: int) -> dict[str, Any] | None:
    return next((r for r in results if r["payload"] == payload and r["mode"] == mode and r["batch"] == batch), None)


def add_floor_gaps(results: list[dict[str, Any]]) -> None:
    """Each result's gap added over the floor: its gap p50 / p99 minus mode
    `none`'s at the same payload and batch (NaN without a `none` result)."""
    for r in results:
        none = _get(results, r["payload"], "none", r["batch"])
        r["gap_added_us"] = {
            q: (r["gap_us"][q] - none["gap_us"][q]) if none else float("nan") for q in ("p50", "p99")
        }


TARGET_BATCH = 64  # the batch the gap target is judged at
STEP_TARGET_BATCHES = (1, 16, 64)  # the batches the decode step targets are judged at


def step_gap_targets(results: list[dict[str, Any]], batch: int):
    """The targets (heavy payload, p50). The gap targets are judged at batch
    64, or at the run's largest batch when 64 was not run (the note says
    so); the decode step targets at each of 1, 16 and 64 (not run: not
    measured)."""
    def p50(mode: str, key: str, b: int) -> float | None:
        r = _get(results, "heavy", mode, b)
        return r[key]["p50"] if r else None

    gb = TARGET_BATCH if _get(results, "heavy", "none", TARGET_BATCH) else batch
    at = f"batch {gb}, heavy, p50" + ("" if gb == TARGET_BATCH else f" (batch {TARGET_BATCH} not run)")
    targets = [
        check("step gap added over the floor: inline / remote-shm",
              ratio(p50("inline", "gap_added_us", gb), p50("remote-shm", "gap_added_us", gb)),
              ">= 40x", lambda v: v >= 40, "x", at),
        check("step gap: inline / remote-shm", ratio(p50("inline", "gap_us", gb), p50("remote-shm", "gap_us", gb)),
              ">= 50x", lambda v: v >= 50, "x", at),
        check("decode step: thread / remote-shm", ratio(p50("thread", "step_ms", gb), p50("remote-shm", "step_ms", gb)),
              ">= 1.3x", lambda v: v >= 1.3, "x", at),
    ]
    for b in STEP_TARGET_BATCHES:
        remote = ratio(p50("remote-shm", "step_ms", b), p50("none", "step_ms", b))
        inline = ratio(p50("inline", "step_ms", b), p50("none", "step_ms", b))
        ran = _get(results, "heavy", "none", b) is not None
        at_b = f"batch {b}, heavy, p50" + ("" if ran else " (not run)")
        targets += [
            check("decode step: remote-shm / none", remote if ran else None, "<= 1.03x", lambda v: v <= 1.03, "x", at_b),
            # remote-shm / none never above inline / none: (remote-shm / none) - (inline / none) <= 0
            check("decode step: remote-shm / none minus inline / none",
                  remote - inline if ran and math.isfinite(remote) and math.isfinite(inline) else None,
                  "<= 0", lambda v: v <= 0, "",
                  f"{at_b}; inline / none {fmt(inline)}x" if ran else at_b),
        ]
    return targets


def markdown(data: dict[str, Any], targets) -> str:
    results = data["results"]
    lines = [
        f"# step-gap{' (quick)' if data['quick'] else ''}",
        "",
        machine_md(data["machine"], data["date"]),
        "",
        f"Engine: {data['engine_note']}.",
        "",
        "Gap = time from the end of sampling step N to the launch of step N+1 (StageRunner.gaps_s); "
        "gap added = a mode's gap p50 minus mode none's (the floor: the runner loop without outputs); "
        "step = the engine's decode step (forward + sample + eager postprocess). Decode steps only "
        "(full batch, one token per request), after warm-up. Heavy = hidden states "
        f"[{data['config']['hidden_size']} x float32 per token] + 16 codebook codes; light = codes only.",
        "",
    ]
    for payload in PAYLOADS:
        lines.append(f"## {payload} payload")
        lines.append("")
        rows = []
        for r in results:
            if r["payload"] != payload:
                continue
            none = _get(results, payload, "none", r["batch"])
            rows.append([
                r["batch"], r["mode"], r["output_path"], r["payload_bytes_per_step"],
                r["gap_us"]["p50"], r["gap_us"]["p99"], r["gap_added_us"]["p50"], r["step_ms"]["p50"], r["step_ms"]["p99"],
                ratio(r["step_ms"]["p50"], none["step_ms"]["p50"]) if none else None,
                r["gap_us"]["n"], r["peak_slots_in_use"], r["fallback_steps"],
            ])
        lines.append(md_table(
            ["batch", "mode", "path", "routed bytes/step", "gap p50 us", "gap p99 us", "gap added over none p50 us",
             "step p50 ms", "step p99 ms",
             "step / none", "steps", "peak slots", "fallback steps"], rows))
        lines.append("")
    lines += ["## Ratios at each batch (heavy)", ""]
    rows = []
    for b in data["config"]["batches"]:
        def g(mode: str, key: str, b: int = b) -> float | None:
            r = _get(results, "heavy", mode, b)
            return r[key]["p50"] if r else None
        rows.append([b, ratio(g("inline", "gap_added_us"), g("remote-shm", "gap_added_us")),
                     ratio(g("thread", "gap_added_us"), g("remote-shm", "gap_added_us")),
                     ratio(g("inline", "gap_us"), g("remote-shm", "gap_us")),
                     ratio(g("thread", "gap_us"), g("remote-shm", "gap_us")),
                     ratio(g("remote-inline", "gap_us"), g("remote-shm", "gap_us")),
                     ratio(g("remote-shm", "step_ms"), g("none", "step_ms")),
                     ratio(g("thread", "step_ms"), g("remote-shm", "step_ms")),
                     ratio(g("inline", "step_ms"), g("none", "step_ms"))])
    lines.append(md_table(["batch", "added gap inline/remote-shm", "added gap thread/remote-shm",
                           "gap inline/remote-shm", "gap thread/remote-shm", "gap remote-inline/remote-shm",
                           "step remote-shm/none", "step thread/remote-shm", "step inline/none"], rows))
    lines += ["", "## Memory", "", memory_md(data["memory"]), "", "## Targets", "", targets_md(targets), ""]
    lines += ["Plots: gap.png, step.png, memory.png.", ""]
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], batches: tuple[int, ...], out_dir: Path) -> None:
    plt = pyplot()
    for key, fname, ylabel, log_y in (("gap_us", "gap.png", "gap p50 (us), bar; p99 tick", True),
                                       ("step_ms", "step.png", "decode step p50 (ms), bar; p99 tick", False)):
        fig, axes = plt.subplots(1, len(PAYLOADS), figsize=(12, 4.5), sharey=log_y)
        for ax, payload in zip(axes, PAYLOADS, strict=True):
            width = 0.8 / len(MODES)
            for j, mode in enumerate(MODES):
                xs, p50s, p99s = [], [], []
                for i, b in enumerate(batches):
                    r = _get(results, payload, mode, b)
                    if r is None:
                        continue
                    xs.append(i + (j - (len(MODES) - 1) / 2) * width)
                    p50s.append(max(r[key]["p50"], 1e-3))
                    p99s.append(max(r[key]["p99"], 1e-3))
                ax.bar(xs, p50s, width, label=mode)
                ax.scatter(xs, p99s, marker="_", color="black", s=60, zorder=3)
            ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
            if log_y:
                ax.set_yscale("log")
            ax.set_title(f"{payload} payload")
            ax.set_ylabel(ylabel)
            ax.grid(axis="y", alpha=0.3)
        axes[0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / fname, dpi=110)
        plt.close(fig)


__all__ = ["StepGapConfig", "run", "analyze", "render", "MODES", "PAYLOADS", "fmt"]
