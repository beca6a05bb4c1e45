"""The pool implementation: workers are processes, steps are pipelined,
answers stay in order, a dead worker costs one in-band error, close() ends it all."""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import psutil
import pytest
import torch

from materializer_svc.conformance.cases import make_probe, probe_plan
from materializer_svc.conformance.checks import payload_only
from materializer_svc.conformance.client import Stream, open_channel, place
from materializer_svc.conformance.harness import InProcessServer
from materializer_svc.pool import PoolMaterializer
from materializer_svc.registry import MaterializerConfig, create, names
from omni_common.errors import InvalidArgumentError
from omni_common.shm_arena import ShmArena
from omni_common.tensor_wire import encode_inline
from omni_serving.v1 import materializer_pb2


def _running(pid: int) -> bool:
    """Alive and not a zombie (a process that ends while it is looked at is gone)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def gone(pids: list[int], within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        alive = [p for p in pids if _running(p)]
        if not alive:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def pool_server(tmp_path_factory):
    deployment = f"pool{os.getpid()}"
    pool = PoolMaterializer(
        MaterializerConfig(shm_prefix=f"omni-{deployment}", workers=2, pipeline_depth=4)
    )
    sock = tmp_path_factory.mktemp("pool") / "m.sock"
    with InProcessServer(pool, f"unix://{sock}") as srv:
        with ShmArena(f"omni-{deployment}", 16, 256 * 1024) as arena:
            channel = open_channel(srv.target)
            yield pool, arena, channel
            channel.close()


def open_req(arena: ShmArena, readiness_ms: int = 3000) -> materializer_pb2.MaterializeRequest:
    return materializer_pb2.MaterializeRequest(
        open=materializer_pb2.MaterializeStreamOpen(
            shm_prefix=arena.prefix,
            stages=[probe_plan()],
            readiness_timeout_ms=readiness_ms,
            client_name="pool-test",
        )
    )


def test_registered_and_selectable():
    assert {"reference", "pool"} <= set(names())
    with pytest.raises(InvalidArgumentError, match="workers"):
        create("pool", MaterializerConfig(shm_prefix="omni-x", workers=0))


def test_workers_are_separate_processes(pool_server):
    pool, _, _ = pool_server
    pids = pool.worker_pids()
    assert len(pids) == 2 and os.getpid() not in pids, f"{pids=}"


def test_steps_are_pipelined_and_answered_in_order(pool_server):
    """Step 1 waits on readiness while later steps are dispatched; answers keep step order."""
    pool, arena, channel = pool_server
    stream = Stream(channel, open_req(arena))
    placed = [place(arena, make_probe(i).snapshot, mark_ready=i != 1) for i in range(1, 9)]
    timer = threading.Timer(0.3, placed[0].lease.mark_ready)
    peak_before = pool.counters.peak_in_flight
    for p in placed:
        stream.send_snapshot(p.snapshot)
    timer.start()
    try:
        answers = [stream.recv(15) for _ in placed]
    finally:
        timer.cancel()
        for p in placed:
            arena.release(p.lease.slot, p.lease.generation)
    got = [a.step.step_id if a.HasField("step") else ("error", a.error.step_id) for a in answers]
    assert got == list(range(1, 9)), f"answers out of order or failed: {got}"
    for i, a in enumerate(answers, start=1):
        want = make_probe(i).expected.SerializeToString(deterministic=True)
        assert payload_only(a.step).SerializeToString(deterministic=True) == want, (
            f"step {i} payload differs"
        )
    assert pool.counters.peak_in_flight >= 4, (
        f"{pool.counters.peak_in_flight=} (was {peak_before}): no pipelining"
    )
    stream.close_send()
    assert stream.wait_end(10).code == grpc.StatusCode.OK


def test_only_metadata_crosses_to_the_workers(pool_server):
    """A step with 128 KiB of tensor data sends well under 1 KiB to its worker."""
    pool, arena, channel = pool_server
    sizes = []
    executor = pool._executor
    original = executor.submit

    def recording_submit(fn, *args, **kwargs):
        sizes.append(sum(len(a) for a in args if isinstance(a, bytes)))
        return original(fn, *args, **kwargs)

    executor.submit = recording_submit
    try:
        snap = make_probe(1).snapshot
        big = torch.arange(32 * 1024, dtype=torch.float32).reshape(
            4, -1
        )  # 128 KiB, 4 rows like the probe
        snap.multimodal_outputs[0].tensor.CopyFrom(encode_inline(big))
        placed = place(arena, snap)
        stream = Stream(channel, open_req(arena))
        stream.send_snapshot(placed.snapshot)
        resp = stream.recv(15)
        arena.release(placed.lease.slot, placed.lease.generation)
        stream.close_send()
    finally:
        del executor.submit
    assert resp.HasField("step"), resp
    assert list(resp.step.requests[0].client.tensors[0].tensor.shape) == [4, 8192]
    assert sizes and max(sizes) < 1024, f"bytes sent to a worker: {sizes}"


def test_a_killed_worker_costs_an_in_band_error_and_the_pool_recovers(pool_server):
    pool, arena, channel = pool_server
    victim = pool.worker_pids()[0]
    os.kill(victim, signal.SIGKILL)
    assert gone([victim])
    stream = Stream(channel, open_req(arena))
    codes, step_id, deadline = [], 0, time.monotonic() + 30
    while time.monotonic() < deadline:
        step_id += 1
        p = place(arena, make_probe(step_id).snapshot)
        stream.send_snapshot(p.snapshot)
        resp = stream.recv(30)
        arena.release(p.lease.slot, p.lease.generation)
        if resp.HasField("step"):
            # a step may still reach the surviving worker before the pool
            # notices the death; recovery is a success after the restart
            if pool.worker_restarts:
                break
            time.sleep(0.05)
            continue
        codes.append(resp.error.code)
    else:
        pytest.fail(f"pool did not recover: {codes=}")
    assert set(codes) <= {grpc.StatusCode.UNAVAILABLE.value[0]}, f"{codes=}"
    assert pool.worker_restarts == 1
    # the restart is counted when it begins; its process may still be starting
    deadline = time.monotonic() + 30
    while len(pool.worker_pids()) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert victim not in pool.worker_pids() and len(pool.worker_pids()) == 2
    stream.close_send()
    assert stream.wait_end(10).code == grpc.StatusCode.OK


def test_close_terminates_the_workers():
    pool = PoolMaterializer(MaterializerConfig(shm_prefix="omni-poolclose", workers=2))
    pids = pool.worker_pids()
    assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
    pool.close()
    pool.close()  # idempotent
    assert gone(pids), f"workers still alive after close(): {pids}"


def test_spawn_start_method_works():
    pool = PoolMaterializer(
        MaterializerConfig(shm_prefix="omni-poolspawn", workers=1, start_method="spawn")
    )
    try:
        assert len(pool.worker_pids()) == 1
    finally:
        pool.close()
