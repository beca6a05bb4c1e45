"""The handle error matrix against real materializer servers over a UDS.

Each bad handle gets its own code and message; the failing step is a
StepError in the stream, which then materializes a good step, and the
service keeps answering GetMaterializerInfo.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import pytest
import torch

from materializer_svc.conformance.cases import make_probe, probe_plan
from materializer_svc.conformance.client import (
    Placed,
    Stream,
    info,
    open_channel,
    place,
    release_key,
)
from materializer_svc.conformance.harness import InProcessServer
from materializer_svc.registry import MaterializerConfig, create
from omni_common.shm_arena import ShmArena
from omni_serving.v1 import materializer_pb2, tensor_pb2

U64 = 2**64
SLOT_BYTES = 64 * 1024


@dataclass
class Served:
    target: str
    deployment: str


@pytest.fixture(scope="module", params=["reference", "pool"])
def server(request, tmp_path_factory):
    """A real grpc.aio server on a UDS serving the implementation from the
    registry, in this process (tests/test_conformance.py runs them as
    separate processes)."""
    impl = request.param
    deployment = f"err{os.getpid()}{impl}"
    servicer = create(impl, MaterializerConfig(shm_prefix=f"omni-{deployment}", workers=2))
    sock = tmp_path_factory.mktemp(impl) / "m.sock"
    with InProcessServer(servicer, f"unix://{sock}") as srv:
        yield Served(srv.target, deployment)


@pytest.fixture(scope="module")
def arena(server):
    with ShmArena(f"omni-{server.deployment}", 8, SLOT_BYTES) as a:
        yield a


@pytest.fixture(scope="module")
def channel(server):
    ch = open_channel(server.target)
    yield ch
    ch.close()


def open_req(arena: ShmArena, readiness_ms: int = 250) -> materializer_pb2.MaterializeRequest:
    return materializer_pb2.MaterializeRequest(
        open=materializer_pb2.MaterializeStreamOpen(
            shm_prefix=arena.prefix,
            stages=[probe_plan()],
            readiness_timeout_ms=readiness_ms,
            client_name="errors-test",
        )
    )


def good_step(stream: Stream, arena: ShmArena, step_id: int) -> None:
    probe = make_probe(step_id)
    placed = place(arena, probe.snapshot)
    stream.send_snapshot(placed.snapshot)
    resp = stream.recv(15)
    arena.release(placed.lease.slot, placed.lease.generation)
    assert resp.WhichOneof("kind") == "step", f"good step {step_id} failed: {resp.error}"
    got = materializer_pb2.MaterializedStep()
    got.CopyFrom(resp.step)
    del got.released_slots[:]
    assert got.SerializeToString(deterministic=True) == probe.expected.SerializeToString(
        deterministic=True
    )
    assert [release_key(r) for r in resp.step.released_slots] == [placed.release]


# -- the matrix -----------------------------------------------------------------------


@dataclass
class Bad:
    """How to break the probe step and what the answer must say."""

    break_it: Callable[[ShmArena, tensor_pb2.TensorRef, Placed], None]
    code: grpc.StatusCode
    words: Callable[[ShmArena, tensor_pb2.TensorRef, Placed], str]
    mark_ready: bool = True


def as_bytes(
    ref: tensor_pb2.TensorRef, offset: int, nbytes: int, shape: list[int] | None = None
) -> None:
    ref.dtype = tensor_pb2.D_TYPE_UINT8
    del ref.shape[:]
    ref.shape.extend(shape or [nbytes])
    ref.shm.offset, ref.shm.byte_size = offset, nbytes


def slot_start(a: ShmArena, p: Placed) -> int:
    return a.slot_offset(p.lease.slot)


def reuse_slot(a: ShmArena, ref: tensor_pb2.TensorRef, p: Placed) -> None:
    """The writer releases the slot and takes it again before the read."""
    a.release(p.lease.slot, p.lease.generation)
    again = a.acquire(5)
    assert again.slot == p.lease.slot
    again.write(torch.zeros(16))
    again.mark_ready()
    p.lease = again  # the test releases the new generation afterwards


IA, OOR = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE
REGION = "multimodal_outputs[0].tensor.shm.region"

CASES: dict[str, Bad] = {
    "region_dotdot": Bad(
        lambda a, r, p: setattr(r.shm, "region", "../x"),
        IA,
        lambda a, r, p: f"{REGION}: region name '../x' is malformed or path-like",
    ),
    "region_dev_shm_path": Bad(
        lambda a, r, p: setattr(r.shm, "region", "/dev/shm/x"),
        IA,
        lambda a, r, p: "region name '/dev/shm/x' is malformed",
    ),
    "region_empty": Bad(
        lambda a, r, p: setattr(r.shm, "region", ""),
        IA,
        lambda a, r, p: "region name '' is malformed",
    ),
    "region_other_deployment": Bad(
        lambda a, r, p: setattr(r.shm, "region", "other-deployment-arena-1-aa"),
        grpc.StatusCode.PERMISSION_DENIED,
        lambda a, r, p: (
            f"region 'other-deployment-arena-1-aa' is outside deployment prefix '{a.prefix}'"
        ),
    ),
    "region_unknown": Bad(
        lambda a, r, p: setattr(r.shm, "region", f"{a.prefix}-arena-1-00000000"),
        grpc.StatusCode.NOT_FOUND,
        lambda a, r, p: f"unknown region '{a.prefix}-arena-1-00000000'",
    ),
    "slot_eq_num_slots": Bad(
        lambda a, r, p: setattr(r.shm, "slot", a.num_slots),
        OOR,
        lambda a, r, p: f"shm.slot: {a.num_slots} is out of range (region has {a.num_slots} slots)",
    ),
    "size_plus_one_at_slot_offset_0": Bad(
        lambda a, r, p: as_bytes(r, slot_start(a, p), a.slot_bytes + 1),
        OOR,
        lambda a, r, p: (
            f"[{slot_start(a, p)}, {slot_start(a, p) + a.slot_bytes + 1}) are not inside slot {p.lease.slot}"
        ),
    ),
    "full_slot_at_offset_1": Bad(
        lambda a, r, p: as_bytes(r, slot_start(a, p) + 1, a.slot_bytes),
        OOR,
        lambda a, r, p: (
            f"[{slot_start(a, p) + 1}, {slot_start(a, p) + 1 + a.slot_bytes}) are not inside slot"
        ),
    ),
    "one_byte_at_region_size": Bad(
        lambda a, r, p: as_bytes(r, a.size, 1),
        OOR,
        lambda a, r, p: (
            f"offset {a.size} + byte_size 1 is past the end of region '{a.name}' ({a.size} bytes)"
        ),
    ),
    "byte_size_u64_max": Bad(
        lambda a, r, p: as_bytes(r, slot_start(a, p), U64 - 1, [65535, 281479271743489]),
        IA,
        lambda a, r, p: f"offset {slot_start(a, p)} + byte_size {U64 - 1} overflows 64 bits",
    ),
    "byte_size_2_64_minus_offset": Bad(
        lambda a, r, p: as_bytes(
            r, slot_start(a, p), U64 - slot_start(a, p), [64, 2**58 - slot_start(a, p) // 64]
        ),
        IA,
        lambda a, r, p: (
            f"offset {slot_start(a, p)} + byte_size {U64 - slot_start(a, p)} overflows 64 bits"
        ),
    ),
    "offset_u64_max": Bad(
        lambda a, r, p: as_bytes(r, U64 - 1, 4),
        IA,
        lambda a, r, p: f"offset {U64 - 1} + byte_size 4 overflows 64 bits",
    ),
    "byte_size_not_prod_shape": Bad(
        lambda a, r, p: setattr(r.shm, "byte_size", 65),
        IA,
        lambda a, r, p: "shm.byte_size: is 65, shape [4, 4] of float32 needs 64",
    ),
    "stale_generation_after_reuse": Bad(
        reuse_slot,
        grpc.StatusCode.ABORTED,
        lambda a, r, p: (
            f"stale handle, slot {p.lease.slot} is at generation {p.lease.generation}, "
            f"handle has {p.lease.generation - 1}"
        ),
    ),
    "readiness_never_marked": Bad(
        lambda a, r, p: None,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        lambda a, r, p: (
            f"slot {p.lease.slot} generation {p.lease.generation} of '{a.name}' was not ready in time"
        ),
        mark_ready=False,
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_handle_gets_its_code_and_the_stream_lives_on(server, arena, channel, name):
    bad = CASES[name]
    failed_before = info(channel).steps_failed
    stream = Stream(channel, open_req(arena))
    good_step(stream, arena, 1)

    placed = place(arena, make_probe(2).snapshot, mark_ready=bad.mark_ready)
    real = placed.release
    ref = placed.snapshot.multimodal_outputs[0].tensor
    bad.break_it(arena, ref, placed)
    words = bad.words(arena, ref, placed)
    stream.send_snapshot(placed.snapshot)
    resp = stream.recv(15)
    arena.release(placed.lease.slot, placed.lease.generation)

    assert resp.WhichOneof("kind") == "error", f"{name}: answered a step, want {bad.code.name}"
    err = resp.error
    got_code = grpc.StatusCode(next(c for c in grpc.StatusCode if c.value[0] == err.code))
    assert got_code == bad.code, f"{name}: {got_code=}, want {bad.code}; message {err.message!r}"
    assert words in err.message, f"{name}: {err.message!r} lacks {words!r}"
    assert (err.step_id, err.stage_id) == (2, 0)
    assert real in [release_key(r) for r in err.released_slots], (
        f"{name}: slot {real} not released: {err.released_slots}"
    )

    good_step(stream, arena, 3)  # the same stream still works
    now = info(channel)  # and so does the service
    assert now.steps_failed >= failed_before + 1
    stream.close_send()
    assert stream.wait_end(15).code == grpc.StatusCode.OK


def test_every_case_has_its_own_message(server, arena):
    """No two cases share a message: each names what was wrong."""
    seen = {}
    for name, bad in CASES.items():
        placed = place(arena, make_probe(2).snapshot, mark_ready=False)
        try:
            ref = placed.snapshot.multimodal_outputs[0].tensor
            if bad.break_it is not reuse_slot:
                bad.break_it(arena, ref, placed)
            seen.setdefault(bad.words(arena, ref, placed), []).append(name)
        finally:
            arena.release(placed.lease.slot, placed.lease.generation)
    dupes = {w: n for w, n in seen.items() if len(n) > 1}
    assert not dupes, f"cases share a message: {dupes}"


def test_open_with_another_deployments_prefix_is_refused(server, channel, arena):
    req = open_req(arena)
    req.open.shm_prefix = "omni-someone-else"
    end = Stream(channel, req).wait_end(15)
    assert end.code == grpc.StatusCode.FAILED_PRECONDITION, end
    assert "open.shm_prefix" in end.details and "omni-someone-else" in end.details


def test_first_message_must_be_open(server, channel):
    first = materializer_pb2.MaterializeRequest(snapshot=make_probe(1).snapshot)
    end = Stream(channel, first).wait_end(15)
    assert end.code == grpc.StatusCode.INVALID_ARGUMENT, end
    assert "must be `open`" in end.details


def test_a_stuck_stream_does_not_hold_up_another(server, channel, arena):
    """Stream A waits on a slot that never becomes ready; stream B is served meanwhile."""
    a = Stream(channel, open_req(arena, readiness_ms=800))
    stuck = place(arena, make_probe(1).snapshot, mark_ready=False)
    a.send_snapshot(stuck.snapshot)
    time.sleep(0.05)
    b = Stream(channel, open_req(arena))
    done_b = threading.Event()
    t0 = time.monotonic()
    for step_id in range(1, 6):
        good_step(b, arena, step_id)
    done_b.set()
    b_took = time.monotonic() - t0
    resp = a.recv(15)
    a_took = time.monotonic() - t0
    arena.release(stuck.lease.slot, stuck.lease.generation)
    assert resp.error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0], resp
    assert b_took < a_took, f"stream B ({b_took:.2f}s) waited for stream A ({a_took:.2f}s)"
    good_step(a, arena, 2)
    for s in (a, b):
        s.close_send()
        assert s.wait_end(15).code == grpc.StatusCode.OK
