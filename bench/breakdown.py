"""breakdown: where the time of the decode critical path goes (diagnostic).

`omni-serving bench breakdown [--quick] [--engine ...] [--batch N]`

Runs the step-gap measurement for the heavy payload at one batch size in
every mode, with perf counters around the functions the stage runner calls
between sampling and the next launch (the names `decoder_svc.stage.runner` and
`decoder_svc.snapshot` look up at call time, and the arena's slot methods),
counted on the stage thread only. The counters are installed for this
diagnostic run and removed afterwards; the step-gap suite never runs with
them. Also reported: CPU time per step of each thread group of the decoder
process and of the materializer process (/proc via psutil), which shows who
competes with the forward pass for the cores.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import threading
import time
from pathlib import Path
from typing import Any

from bench import engines, record, step_gap
from bench.common import SuiteResult, log, machine_md, md_table, progress, summary

STAGE_THREAD = "stage-talker"


class Counters:
    def __init__(self) -> None:
        self.total: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()

    def wrap(self, name: str, fn):  # noqa: ANN001, ANN201
        total, calls = self.total, self.calls

        def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            if threading.current_thread().name != STAGE_THREAD:
                return fn(*args, **kwargs)
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                total[name] += time.perf_counter() - t
                calls[name] += 1

        return timed


@contextlib.contextmanager
def instrumented(counters: Counters):
    import decoder_svc.stage.runner as runner_mod
    from decoder_svc.link.materializer_link import MaterializerLink
    from decoder_svc.requests import RequestTable
    from decoder_svc.routing import Router
    from decoder_svc.snapshot import SnapshotMeta
    from omni_common.shm_arena import ShmArena, SlotLease

    patches = [
        (runner_mod, "meta_of"), (runner_mod, "step_tensors"), (runner_mod, "take_snapshot"),
        (runner_mod, "view_from_tensors"), (SnapshotMeta, "view_over"), (runner_mod, "build_local_step"),
        (RequestTable, "downstream"), (Router, "deliver"), (MaterializerLink, "submit"),
        (ShmArena, "acquire"), (SlotLease, "write"), (SlotLease, "mark_ready"),
    ]
    saved = []
    try:
        for owner, name in patches:
            if not (name in owner.__dict__ if isinstance(owner, type) else hasattr(owner, name)):
                continue  # not on this version of the code path
            orig = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
            saved.append((owner, name, orig))
            label = f"{getattr(owner, '__name__', owner)}.{name}".replace("decoder_svc.", "")
            setattr(owner, name, counters.wrap(label, orig))
        yield
    finally:
        for owner, name, orig in reversed(saved):
            setattr(owner, name, orig)


def thread_cpu() -> dict[str, float]:
    """CPU seconds per thread group of this process."""
    import psutil

    names = {t.native_id: t.name for t in threading.enumerate()}
    out: collections.Counter[str] = collections.Counter()
    for th in psutil.Process().threads():
        name = names.get(th.id, "")
        if name == STAGE_THREAD:
            group = "decoder: stage thread (decode loop)"
        elif name.startswith("decoder-"):
            group = "decoder: link threads (sender/receiver or in-process builder)"
        elif name:
            group = "decoder: other Python threads"
        else:
            group = "decoder: native threads (OpenMP, gRPC)"
        out[group] += th.user_time + th.system_time
    return dict(out)


def proc_cpu(pid: int) -> float:
    """CPU seconds of a service: its process, its ended children and its
    running ones (the stage processes, the code2wav workers)."""
    import psutil

    proc = psutil.Process(pid)
    t = proc.cpu_times()
    total = t.user + t.system + t.children_user + t.children_system
    for child in proc.children(recursive=True):
        try:
            c = child.cpu_times()
        except psutil.Error:  # ended meanwhile: counted in children_* once reaped
            continue
        total += c.user + c.system
    return total


def run(quick: bool, engine: str, batch: int, out_dir: Path) -> SuiteResult:
    from omni_common.shm_arena import sweep_stale

    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = step_gap.StepGapConfig.for_run(quick, engine)
    steps = 12 if quick else 40
    rec = record.begin("breakdown", quick=quick,
                       settings={"engine": engine, "batch": batch, "steps": steps, "step_gap": dataclasses.asdict(cfg)})
    deployment = f"brk{os.getpid()}"
    prefix = f"omni-{deployment}"
    sweep_stale(prefix)
    inner, engine_name, why = step_gap._build_engine(cfg)
    backend = engines.MeasuredBackend(inner)
    materializer = step_gap.MaterializerProcess(deployment).start()
    modes: list[dict[str, Any]] = []
    try:
        step_gap._warm_engine(backend, engine_name, batch, cfg.warmup + 4)
        with progress(len(step_gap.MODES), "breakdown", "mode") as bar:
            for mode in step_gap.MODES:
                counters = Counters()
                cpu: dict[str, Any] = {}

                def probe(when: str, _cpu=cpu) -> None:  # noqa: ANN001
                    key = "before" if when == "running" else "after"
                    _cpu[key] = {"threads_s": thread_cpu(), "materializer_s": proc_cpu(materializer.pid)}

                with instrumented(counters):
                    r = step_gap.run_one(backend, engine_name, "heavy", mode, batch, warmup=cfg.warmup, steps=steps,
                                         materializer=materializer, prefix=prefix, round_no=0, probe=probe)
                modes.append({
                    "mode": mode, "steps_total": len(backend.records), "gaps_s": r["gaps_s"], "step_s": r["step_s"],
                    "time_s": dict(counters.total), "calls": dict(counters.calls), "cpu": cpu,
                })
                bar.update(1)
    finally:
        materializer.stop()
        backend.really_close()
        sweep_stale(prefix)
    rec = record.complete(rec, {"engine": engine_name, "engine_note": why, "modes": modes})
    data = analyze(rec)
    md = markdown(data)
    (out_dir / "results.md").write_text(md)
    log(f"breakdown written to {out_dir}")
    return SuiteResult("breakdown", out_dir, data, [], md, rec)


def analyze(rec: dict[str, Any]) -> dict[str, Any]:
    """Per mode: time and calls per step in each function, gap and step p50,
    CPU per step by thread group, from a results file's record."""
    raw = rec["raw"]
    rows = []
    for m in raw["modes"]:
        n_steps = max(1, m["steps_total"])
        before, after = m["cpu"]["before"], m["cpu"]["after"]
        groups = sorted(set(before["threads_s"]) | set(after["threads_s"]))
        cpu_ms = {g: (after["threads_s"].get(g, 0) - before["threads_s"].get(g, 0)) / n_steps * 1e3 for g in groups}
        cpu_ms["materializer process"] = ((after["materializer_s"] - before["materializer_s"]) / n_steps * 1e3
                                          if m["mode"].startswith("remote") else 0.0)
        rows.append({
            "mode": m["mode"], "steps_total": n_steps,
            "gap_p50_us": summary(m["gaps_s"], 1e6)["p50"], "step_p50_ms": summary(m["step_s"], 1e3)["p50"],
            "per_step_us": {k: v / n_steps * 1e6 for k, v in m["time_s"].items()},
            "calls_per_step": {k: v / n_steps for k, v in m["calls"].items()},
            "cpu_ms_per_step": cpu_ms,
        })
    return {"suite": "breakdown", "quick": rec["quick"], "engine": raw["engine"], "engine_note": raw["engine_note"],
            "batch": rec["settings"]["batch"], "machine": rec["host"], "date": rec["date"], "results": rows}


def render(rec: dict[str, Any]) -> str:
    """The suite's tables from a results file (what `bench report` shows)."""
    return markdown(analyze(rec))


def markdown(data: dict[str, Any]) -> str:
    rows = data["results"]
    lines = [f"# breakdown (heavy payload, batch {data['batch']})", "", machine_md(data["machine"], data["date"]), "",
             f"Engine: {data['engine_note']}.", "",
             "Time per decode step spent in each function on the stage thread (us, mean over all steps of the run, "
             "prefill included; nested calls are counted in their callers too).", ""]
    names = sorted({k for r in rows for k in r["per_step_us"]})
    lines.append(md_table(["function", *[r["mode"] for r in rows]],
                          [[n, *[r["per_step_us"].get(n, 0.0) for r in rows]] for n in names]))
    lines += ["", md_table(["", *[r["mode"] for r in rows]],
                           [["gap p50 us (measured steps)", *[r["gap_p50_us"] for r in rows]],
                            ["step p50 ms (measured steps)", *[r["step_p50_ms"] for r in rows]]])]
    lines += ["", "CPU time per step (ms) by thread group / process:", ""]
    groups = sorted({k for r in rows for k in r["cpu_ms_per_step"]})
    lines.append(md_table(["where", *[r["mode"] for r in rows]],
                          [[g, *[r["cpu_ms_per_step"].get(g, 0.0) for r in rows]] for g in groups]))
    lines.append("")
    return "\n".join(lines)


__all__ = ["run", "analyze", "render"]
