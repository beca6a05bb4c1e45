"""handoff: the cost of getting one step's tensors to the materializer, by
payload size, shared memory vs inline bytes, against this machine's memcpy.

Per size S (one step whose routed tensor is hidden states [S / 8 KiB, 2048]
float32), in one run; shm and inline alternate in blocks, each path with its
own receiver process, so freeing one path's large buffers is never charged to
the other:

  memcpy      torch `dst.copy_(src)` and numpy `np.copyto` of S bytes into a
              preallocated buffer (the machine's copy bandwidth)
  shm         the decoder's real code: `take_snapshot` copies the tensor into
              an arena slot and marks it ready (the critical-path part), the
              sender builds the StepSnapshot with handles; the message goes
              over a real gRPC stream (unix socket) to a receiver process
              that validates the handle, waits for readiness, reads every
              byte from shared memory and answers
  inline      the same, with `take_snapshot(arena=None)` (tensors detached)
              and the bytes inside the message (the remote-inline transport)

The receiver (bench/handoff_sink.py) speaks MaterializerService but builds
nothing, so the round trip is the handoff alone. Also reported: the
serialized StepSnapshot size of both, and the arena copy's bandwidth as a
share of memcpy.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import queue
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench import record
from bench.common import (
    RssSampler,
    SuiteResult,
    check,
    growth_report,
    human_bytes,
    machine_md,
    md_table,
    memory_md,
    pct,
    plot_memory,
    progress,
    pyplot,
    ratio,
    summary,
    targets_json,
    targets_md,
)
from bench.handoff_sink import RECEIVE_NS

KiB, MiB = 2**10, 2**20
WIDTH = 2048  # hidden size: one row is 8 KiB of float32


@dataclasses.dataclass
class HandoffConfig:
    quick: bool = False
    sizes: tuple[int, ...] = (64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB)
    bytes_per_size: int = 768 * MiB  # iterations per size: this many bytes, within the bounds below
    min_iters: int = 10
    max_iters: int = 300
    target_size: int = 16 * MiB  # where the 10x and 50% targets are read

    @classmethod
    def for_run(cls, quick: bool) -> HandoffConfig:
        if quick:
            return cls(quick=True, sizes=(64 * KiB, 256 * KiB, 1 * MiB), bytes_per_size=32 * MiB, min_iters=5,
                       max_iters=40, target_size=1 * MiB)
        return cls()

    def iters(self, size: int) -> int:
        return max(self.min_iters, min(self.max_iters, self.bytes_per_size // size))


class SinkProcess:
    def __init__(self, deployment: str) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="omni-bench-")
        self.target = f"unix://{self._dir.name}/sink.sock"
        self.proc: subprocess.Popen | None = None
        self.argv = [sys.executable, "-m", "bench.handoff_sink", "--listen", self.target, "--deployment", deployment]

    def start(self) -> SinkProcess:
        from omni_common.server import wait_for_health_sync

        self.proc = subprocess.Popen(self.argv, start_new_session=True, cwd=str(Path(__file__).resolve().parent.parent))
        wait_for_health_sync(self.target, 60)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._dir.cleanup()


class Stream:
    """One Materialize stream to the sink, driven one step at a time."""

    def __init__(self, target: str, prefix: str) -> None:
        import grpc

        from omni_serving.v1 import materializer_pb2, materializer_pb2_grpc

        self._pb = materializer_pb2
        opts = [("grpc.max_receive_message_length", 256 * MiB), ("grpc.max_send_message_length", 256 * MiB)]
        self.channel = grpc.insecure_channel(target, options=opts)
        grpc.channel_ready_future(self.channel).result(timeout=10)
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        stub = materializer_pb2_grpc.MaterializerServiceStub(self.channel)
        self._q.put(materializer_pb2.MaterializeRequest(
            open=materializer_pb2.MaterializeStreamOpen(shm_prefix=prefix, readiness_timeout_ms=5000, client_name="bench")))
        self._responses = stub.Materialize(iter(self._q.get, None))

    def roundtrip(self, snapshot) -> float:  # noqa: ANN001
        """Send one snapshot, wait for its answer; returns the receiver's own time (s)."""
        self._q.put(self._pb.MaterializeRequest(snapshot=snapshot))
        resp = next(self._responses)
        if resp.WhichOneof("kind") != "step":
            raise RuntimeError(f"receiver refused step {snapshot.step_id}: {resp.error.message}")
        return sum(s.value for s in resp.step.connector_signals if s.kind == RECEIVE_NS) / 1e9

    def close(self) -> None:
        self._q.put(None)
        for _ in self._responses:
            pass
        self.channel.close()


def _meta(step_id: int, rows: int):
    from decoder_svc.snapshot import SnapshotMeta

    return SnapshotMeta(step_id=step_id, stage_id=0, request_ids=["r0"], batch_indices=[0], num_scheduled_tokens=[rows],
                        spans=[(0, rows)], num_sampled_tokens=[1], finished={}, downstream_request_ids=["r0"],
                        connector_signals=[])


BLOCKS = 4  # per size: shm and inline alternate in blocks, so one path's clean-up never lands in the other's samples


def measure_size(size: int, iters: int, arena, streams: dict[str, Stream], step_ids) -> dict[str, Any]:  # noqa: ANN001
    """All measurements for one payload size.

    The paths alternate in blocks (the first iteration of every block is
    dropped): freeing a large inline message (sender and receiver side) takes
    milliseconds and must not be charged to the shm step that follows it.
    Each path has its own receiver process and stream for the same reason.
    """
    from decoder_svc.snapshot import take_snapshot
    from omni_common.materialize import PER_TOKEN

    rows = max(1, size // (WIDTH * 4))
    hidden = torch.randn(rows, WIDTH)
    tensors = {"hidden_states": (hidden, PER_TOKEN)}
    t_dst = torch.empty_like(hidden)
    n_src = hidden.numpy().copy()
    n_dst = np.empty_like(n_src)
    acc: dict[str, list[float]] = collections.defaultdict(list)
    sizes: dict[str, int] = {}
    per_block = max(1, -(-iters // BLOCKS))

    def copies(suffix: str = "") -> None:
        t = time.perf_counter()
        t_dst.copy_(hidden)
        acc["memcpy_torch" + suffix].append(time.perf_counter() - t)
        if not suffix:
            t = time.perf_counter()
            np.copyto(n_dst, n_src)
            acc["memcpy_numpy"].append(time.perf_counter() - t)
        lease = arena.acquire(5.0)  # the arena write alone, in a slot taken and given back around it
        t = time.perf_counter()
        lease.write(hidden)
        acc["arena_write" + suffix].append(time.perf_counter() - t)
        arena.release(lease.slot, lease.generation)

    def one(path: str, suffix: str = "", keep: bool = True) -> None:
        t0 = time.perf_counter()
        meta = take_snapshot(_meta(next(step_ids), rows), tensors, arena if path == "shm" else None, acquire_timeout_s=5.0)
        t1 = time.perf_counter()
        snap = meta.to_proto()
        t2 = time.perf_counter()
        rx = streams[path].roundtrip(snap)
        t3 = time.perf_counter()
        if meta.lease is not None:
            arena.release(meta.lease.slot, meta.lease.generation)
        sizes[path] = snap.ByteSize()
        if not keep:
            return
        acc[f"{path}_roundtrip{suffix}"].append(t3 - t0)
        if not suffix:
            acc[f"{path}_critical"].append(t1 - t0)
            acc[f"{path}_message"].append(t2 - t1)
            acc[f"{path}_receiver"].append(rx)

    def run_blocks(suffix: str, n: int) -> None:
        for b in range(BLOCKS):
            for path in (("shm", "inline") if b % 2 == 0 else ("inline", "shm")):
                one(path, suffix, keep=False)  # the block's first step absorbs the other path's clean-up
                for _ in range(n):
                    one(path, suffix)
            for _ in range(n):
                copies(suffix)

    copies()  # warm the destination buffers
    acc.clear()
    run_blocks("", per_block)
    # diagnostic: the same with one torch intra-op thread (torch splits copies
    # above 32K elements over its OpenMP threads)
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_blocks("_1t", max(1, per_block // 2))
    finally:
        torch.set_num_threads(prev)
    return {"size": rows * WIDTH * 4, "iters": per_block * BLOCKS, "snapshot_bytes": sizes, "torch_threads": prev,
            "samples_s": dict(acc)}


def size_summary(m: dict[str, Any]) -> dict[str, Any]:
    """One size's table row, from its raw samples (`measure_size`)."""
    acc, nbytes = m["samples_s"], m["size"]
    out: dict[str, Any] = {"size": nbytes, "iters": m["iters"], "snapshot_bytes": m["snapshot_bytes"],
                           "torch_threads": m["torch_threads"]}
    for k, v in acc.items():
        out[k + "_us"] = summary(v, 1e6)
    for path in ("shm", "inline"):  # what the parts above do not cover: serialize, socket, parse, wake-ups
        out[f"{path}_transport_us"] = summary(
            [r - c - x - y for r, c, x, y in zip(acc[f"{path}_roundtrip"], acc[f"{path}_critical"],
                                                 acc[f"{path}_message"], acc[f"{path}_receiver"], strict=True)], 1e6)
    med = {k: pct(v, 50) for k, v in acc.items()}
    out["bandwidth_gbps"] = {k: nbytes / med[k] / 1e9 for k in ("memcpy_torch", "memcpy_numpy", "arena_write",
                                                                 "shm_roundtrip", "inline_roundtrip",
                                                                 "memcpy_torch_1t", "arena_write_1t")}
    memcpy = max(out["bandwidth_gbps"]["memcpy_torch"], out["bandwidth_gbps"]["memcpy_numpy"])
    out["arena_copy_pct_of_memcpy"] = 100.0 * out["bandwidth_gbps"]["arena_write"] / memcpy
    out["inline_over_shm"] = ratio(med["inline_roundtrip"], med["shm_roundtrip"])
    out["inline_over_shm_1t"] = ratio(med["inline_roundtrip_1t"], med["shm_roundtrip_1t"])
    return out


def run(cfg: HandoffConfig, out_dir: Path) -> SuiteResult:
    out_dir.mkdir(parents=True, exist_ok=True)
    import itertools

    from omni_common.shm_arena import ShmArena, sweep_stale

    rec = record.begin("handoff", quick=cfg.quick, settings=dataclasses.asdict(cfg))
    deployment = f"handoff{os.getpid()}"
    prefix = f"omni-{deployment}"
    sweep_stale(prefix)
    sampler = RssSampler({"decoder side (bench process)": os.getpid()}).start()
    slot_bytes = max(cfg.sizes) + 64 * KiB
    arena = ShmArena(prefix, 2, slot_bytes)
    sinks: dict[str, SinkProcess] = {}
    streams: dict[str, Stream] = {}
    for path in ("shm", "inline"):
        sinks[path] = SinkProcess(deployment).start()
        assert sinks[path].proc is not None
        sampler.add(f"receiver of {path} (materializer side)", sinks[path].proc.pid)
        streams[path] = Stream(sinks[path].target, prefix)
    stream = streams["shm"]
    step_ids = itertools.count(1)
    sizes: list[dict[str, Any]] = []
    try:
        # baseline: a snapshot with no tensor (the stream's own round trip)
        from decoder_svc.snapshot import take_snapshot

        base = []
        for i in range(50):
            meta = take_snapshot(_meta(next(step_ids), 1), {}, None)
            t = time.perf_counter()
            stream.roundtrip(meta.to_proto())
            if i >= 5:
                base.append(time.perf_counter() - t)
        for size in cfg.sizes:  # warm-up at every size: buffers and pages reach their steady size
            measure_size(size, 1, arena, streams, step_ids)
        sampler.mark("after_warmup")
        with progress(len(cfg.sizes), "handoff", "size") as bar:
            for size in cfg.sizes:
                bar.set_postfix_str(human_bytes(size))
                sizes.append(measure_size(size, cfg.iters(size), arena, streams, step_ids))
                bar.update(1)
        sampler.mark("end")
    finally:
        for st in streams.values():
            st.close()
        for sk in sinks.values():
            sk.stop()
        sampler.stop()
        peak = arena.peak_in_use
        arena.close()
        sweep_stale(prefix)
    rec = record.complete(rec, {
        "empty_roundtrip_s": base, "sizes": sizes, "memory": sampler.raw(),
        "arena": {"num_slots": 2, "slot_bytes": arena.slot_bytes, "peak_slots_in_use": peak},
    })
    data, targets = analyze(rec)
    plot(data["results"], out_dir)
    plot_memory(rec["raw"]["memory"], out_dir / "memory.png", "handoff: RSS per process")
    md = markdown(data, targets)
    (out_dir / "results.md").write_text(md)
    return SuiteResult("handoff", out_dir, data, targets, md, rec)


def analyze(rec: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    """The tables' numbers and the targets, from a results file's record."""
    raw = rec["raw"]
    rows = [size_summary(m) for m in raw["sizes"]]
    memory = {"processes": growth_report(raw["memory"]), "arena": raw["arena"]}
    targets = handoff_targets(rows, rec["settings"]["target_size"])
    data = {"suite": "handoff", "quick": rec["quick"], "config": rec["settings"], "machine": rec["host"],
            "date": rec["date"], "empty_roundtrip_us": summary(raw["empty_roundtrip_s"], 1e6), "results": rows,
            "memory": memory, "targets": targets_json(targets)}
    return data, targets


def render(rec: dict[str, Any]) -> str:
    """The suite's tables from a results file (what `bench report` shows)."""
    return markdown(*analyze(rec))


def _at(rows: list[dict[str, Any]], size: int) -> dict[str, Any] | None:
    return next((r for r in rows if r["size"] == size), None)


def handoff_targets(rows: list[dict[str, Any]], target_size: int):
    at = _at(rows, target_size)
    shm_sizes = [r["snapshot_bytes"]["shm"] for r in rows]
    spread = (max(shm_sizes) - min(shm_sizes)) if shm_sizes else None
    where = f"at {human_bytes(target_size)}"
    return [
        check("StepSnapshot size (shm) across payload sizes", spread, "constant (spread <= 16 B: varint widths)",
              lambda v: v <= 16, " B spread",
              f"{min(shm_sizes)}-{max(shm_sizes)} B for {human_bytes(rows[0]['size'])}..{human_bytes(rows[-1]['size'])}"
              if shm_sizes else ""),
        check("handoff: inline / shm round trip", at["inline_over_shm"] if at else None, ">= 10x", lambda v: v >= 10, "x",
              where + ", p50"),
        check("arena copy bandwidth / memcpy", at["arena_copy_pct_of_memcpy"] if at else None, ">= 50%",
              lambda v: v >= 50, "%", where + ", p50, memcpy = the faster of torch/numpy"),
    ]


def markdown(data: dict[str, Any], targets) -> str:
    rows = data["results"]
    lines = [f"# handoff{' (quick)' if data['quick'] else ''}", "", machine_md(data["machine"], data["date"]), "",
             "One step's tensor (hidden states, 2048 x float32 per row) to a receiver process over a real gRPC "
             "stream on a unix socket; the receiver validates, waits for readiness, reads every byte and answers. "
             "Critical path = what the decode step pays (shm: copy into the arena slot + ready mark; inline: "
             "detached copy). Message = building the StepSnapshot (sender thread). Receiver = the receiving process's "
             "own time (validate, readiness, read every byte; for inline the message is already parsed). Round trip "
             "= from the step's tensors to the receiver's answer (includes serialization, the socket and parsing). "
             "Times are p50 in microseconds.", "",
             f"Empty-snapshot round trip (the stream's floor): p50 {data['empty_roundtrip_us']['p50']:.0f} us.", ""]
    lines.append(md_table(
        ["size", "iters", "memcpy torch us", "memcpy numpy us", "arena write us", "shm critical us", "shm message us",
         "shm receiver us", "shm round trip us", "inline critical us", "inline message us", "inline receiver us",
         "inline round trip us", "inline / shm"],
        [[human_bytes(r["size"]), r["iters"], r["memcpy_torch_us"]["p50"], r["memcpy_numpy_us"]["p50"],
          r["arena_write_us"]["p50"], r["shm_critical_us"]["p50"], r["shm_message_us"]["p50"],
          r["shm_receiver_us"]["p50"], r["shm_roundtrip_us"]["p50"], r["inline_critical_us"]["p50"],
          r["inline_message_us"]["p50"], r["inline_receiver_us"]["p50"], r["inline_roundtrip_us"]["p50"],
          r["inline_over_shm"]] for r in rows]))
    lines += ["", "Round trip minus the parts above (serialization, the socket, parsing, thread wake-ups), p50 us:", ""]
    lines.append(md_table(["size", "shm", "inline"],
                          [[human_bytes(r["size"]), r["shm_transport_us"]["p50"], r["inline_transport_us"]["p50"]]
                           for r in rows]))
    lines += ["", "Bandwidth (GB/s, from p50 times) and serialized StepSnapshot size:", ""]
    lines.append(md_table(
        ["size", "memcpy torch", "memcpy numpy", "arena write", "arena / memcpy", "shm round trip", "inline round trip",
         "StepSnapshot shm B", "StepSnapshot inline B"],
        [[human_bytes(r["size"]), r["bandwidth_gbps"]["memcpy_torch"], r["bandwidth_gbps"]["memcpy_numpy"],
          r["bandwidth_gbps"]["arena_write"], f"{r['arena_copy_pct_of_memcpy']:.0f}%",
          r["bandwidth_gbps"]["shm_roundtrip"], r["bandwidth_gbps"]["inline_roundtrip"],
          r["snapshot_bytes"]["shm"], r["snapshot_bytes"]["inline"]] for r in rows]))
    lines += ["", f"Diagnostic (not a target): the same with torch limited to one intra-op thread instead of "
              f"{rows[0].get('torch_threads', '?')} (copies in GB/s, round trips p50 us):", ""]
    lines.append(md_table(
        ["size", "torch copy", "torch copy, 1 thread", "arena write", "arena write, 1 thread", "memcpy numpy",
         "shm round trip, 1 thread", "inline round trip, 1 thread", "inline / shm, 1 thread"],
        [[human_bytes(r["size"]), r["bandwidth_gbps"]["memcpy_torch"], r["bandwidth_gbps"]["memcpy_torch_1t"],
          r["bandwidth_gbps"]["arena_write"], r["bandwidth_gbps"]["arena_write_1t"], r["bandwidth_gbps"]["memcpy_numpy"],
          r["shm_roundtrip_1t_us"]["p50"], r["inline_roundtrip_1t_us"]["p50"], r["inline_over_shm_1t"]]
         for r in rows]))
    lines += ["", "## Memory", "", memory_md(data["memory"]), "", "## Targets", "", targets_md(targets), "",
              "Plots: handoff.png (time vs size), bandwidth.png, snapshot_size.png, memory.png.", ""]
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], out_dir: Path) -> None:
    plt = pyplot()
    xs = [r["size"] for r in rows]
    labels = [human_bytes(x) for x in xs]
    fig, ax = plt.subplots(figsize=(8, 5))
    for key, label in (("shm_roundtrip_us", "shm round trip"), ("inline_roundtrip_us", "inline round trip"),
                       ("shm_critical_us", "shm critical path (arena copy)"),
                       ("inline_critical_us", "inline critical path (detached copy)"),
                       ("memcpy_torch_us", "memcpy (torch)")):
        ax.plot(xs, [r[key]["p50"] for r in rows], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(xs, labels)
    ax.set_xlabel("payload per step")
    ax.set_ylabel("p50 time (us)")
    ax.set_title("handoff: one step's tensors to the materializer")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "handoff.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 5))
    for key, label in (("memcpy_torch", "memcpy (torch)"), ("memcpy_numpy", "memcpy (numpy)"),
                       ("arena_write", "copy into arena slot"), ("shm_roundtrip", "shm round trip"),
                       ("inline_roundtrip", "inline round trip")):
        ax.plot(xs, [r["bandwidth_gbps"][key] for r in rows], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, labels)
    ax.set_ylabel("GB/s (p50)")
    ax.set_title("bandwidth")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "bandwidth.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(xs, [r["snapshot_bytes"]["shm"] for r in rows], marker="o", label="shm handles")
    ax.plot(xs, [r["snapshot_bytes"]["inline"] for r in rows], marker="o", label="inline bytes")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(xs, labels)
    ax.set_ylabel("serialized StepSnapshot (bytes)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "snapshot_size.png", dpi=110)
    plt.close(fig)
