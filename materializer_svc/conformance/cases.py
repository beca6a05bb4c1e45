"""The bad-step matrix: snapshots an implementation must refuse, one code each.

Every case is a probe step (one request, a float32 PER_TOKEN tensor "probe"
and sampled_token_ids, both in one arena slot) with one thing broken. The
expected code is part of the contract; `hint` is a substring of the shipped
implementations' message, checked only with --strict-messages (messages are
free text, but must name what was wrong).

Handle cases follow the arena reader's table: a path-like or malformed
region name, a region outside the deployment prefix, an unknown region, a
slot or byte range outside the region or the slot, 64-bit overflow, a
byte_size that is not prod(shape) * itemsize, a stale generation, and a slot
that never became ready.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import numpy as np
import torch

from materializer_svc.conformance.client import Placed, place
from omni_common.materialize import (
    CLIENT,
    INTER_STAGE,
    PER_TOKEN,
    SAMPLED_TOKEN_IDS,
    SELECT_ALL,
    SELECT_LAST,
    build_step,
    view_from_tensors,
)
from omni_common.shm_arena import ShmArena
from omni_common.tensor_wire import encode_inline
from omni_serving.v1 import materializer_pb2, snapshot_pb2, tensor_pb2

U64 = 2**64
PROBE_STAGE = 0
PROBE_ROWS = 4


def probe_plan() -> materializer_pb2.StagePlan:
    return materializer_pb2.StagePlan(
        stage_id=PROBE_STAGE,
        name="probe",
        routes=[
            materializer_pb2.PayloadRoute(
                source="probe", key="probe", destination=CLIENT, selection=SELECT_ALL
            ),
            materializer_pb2.PayloadRoute(
                source=SAMPLED_TOKEN_IDS,
                key="token",
                destination=INTER_STAGE,
                selection=SELECT_LAST,
            ),
        ],
    )


@dataclass
class Probe:
    """A good probe step: its inline snapshot and the answer it must get."""

    snapshot: snapshot_pb2.StepSnapshot
    expected: materializer_pb2.MaterializedStep


def make_probe(step_id: int) -> Probe:
    probe = torch.from_numpy(
        (np.arange(PROBE_ROWS * 4, dtype=np.float32) + step_id).reshape(PROBE_ROWS, 4)
    )
    sampled = torch.tensor([[step_id % 151_935]], dtype=torch.int64)
    signal = snapshot_pb2.ConnectorSignal(request_id="p0", kind="probe", value=step_id)
    snap = snapshot_pb2.StepSnapshot(
        step_id=step_id,
        stage_id=PROBE_STAGE,
        request_ids=["p0"],
        batch_indices=[0],
        num_sampled_tokens=[1],
        num_scheduled_tokens=[PROBE_ROWS],
        downstream_request_ids=["p0"],
        sampled_token_ids=encode_inline(sampled),
    )
    snap.scheduled_spans.add(start=0, end=PROBE_ROWS)
    snap.multimodal_outputs.add(name="probe", layout=PER_TOKEN, tensor=encode_inline(probe))
    snap.connector_output.signals.append(signal)
    view = view_from_tensors(
        step_id=step_id,
        stage_id=PROBE_STAGE,
        request_ids=["p0"],
        spans=[(0, PROBE_ROWS)],
        num_sampled_tokens=[1],
        finished_request_ids=[],
        downstream_request_ids=["p0"],
        tensors={"probe": (probe, PER_TOKEN), SAMPLED_TOKEN_IDS: (sampled, 2)},
        connector_signals=[signal],
    )
    return Probe(snap, build_step(view, probe_plan()))


@dataclass
class Built:
    """A bad step ready to send, and what the kit must clean up afterwards."""

    snapshot: snapshot_pb2.StepSnapshot
    leases: list = field(
        default_factory=list
    )  # SlotLease objects the kit releases after the answer
    must_release: list[tuple[str, int, int]] = field(default_factory=list)


@dataclass
class CaseContext:
    arena: ShmArena
    step_id: int  # id for the bad step
    last_step_id: int  # id of the previous step on the stream (stage PROBE_STAGE)

    def placed_probe(self, *, mark_ready: bool = True) -> Placed:
        return place(self.arena, make_probe(self.step_id).snapshot, mark_ready=mark_ready)


@dataclass(frozen=True)
class Case:
    name: str
    code: grpc.StatusCode
    hint: str
    build: Callable[[CaseContext], Built]
    doc: str = ""


def _probe_ref(snap: snapshot_pb2.StepSnapshot) -> tensor_pb2.TensorRef:
    return snap.multimodal_outputs[0].tensor


def _mutating(
    mutate: Callable[[CaseContext, tensor_pb2.TensorRef, Placed], None],
) -> Callable[[CaseContext], Built]:
    def build(ctx: CaseContext) -> Built:
        placed = ctx.placed_probe()
        mutate(ctx, _probe_ref(placed.snapshot), placed)
        return Built(placed.snapshot, [placed.lease], [placed.release])

    return build


def _metadata(
    mutate: Callable[[CaseContext, snapshot_pb2.StepSnapshot], None],
) -> Callable[[CaseContext], Built]:
    def build(ctx: CaseContext) -> Built:
        placed = ctx.placed_probe()
        mutate(ctx, placed.snapshot)
        return Built(placed.snapshot, [placed.lease], [placed.release])

    return build


def _bytes(
    ref: tensor_pb2.TensorRef, offset: int, nbytes: int, shape: list[int] | None = None
) -> None:
    """Point the probe at [offset, offset + nbytes) as uint8 with a matching shape."""
    ref.dtype = tensor_pb2.D_TYPE_UINT8
    del ref.shape[:]
    ref.shape.extend(shape if shape is not None else [nbytes])
    ref.shm.offset = offset
    ref.shm.byte_size = nbytes


def _region(name: str):
    def mutate(ctx: CaseContext, ref: tensor_pb2.TensorRef, placed: Placed) -> None:
        ref.shm.region = name.format(prefix=ctx.arena.prefix)

    return mutate


def _stale(ctx: CaseContext) -> Built:
    placed = ctx.placed_probe()
    arena, old = ctx.arena, placed.lease
    arena.release(old.slot, old.generation)
    # The writer takes the slot again (a new generation) and rewrites it.
    held, lease = [], arena.acquire(30.0)
    while lease.slot != old.slot:
        held.append(lease)
        lease = arena.acquire(30.0)
    for other in held:
        arena.release(other.slot, other.generation)
    lease.write(torch.zeros(64, dtype=torch.uint8))
    lease.mark_ready()
    return Built(placed.snapshot, [lease], [placed.release])


def _never_ready(ctx: CaseContext) -> Built:
    placed = ctx.placed_probe(mark_ready=False)
    return Built(placed.snapshot, [placed.lease], [placed.release])


def _inline_short(ctx: CaseContext) -> Built:
    snap = make_probe(ctx.step_id).snapshot
    ref = _probe_ref(snap)
    ref.inline_data = ref.inline_data[:-1]
    return Built(snap)


def _rows_short(ctx: CaseContext, snap: snapshot_pb2.StepSnapshot) -> None:
    # A second request (no rows) while the PER_REQUEST sampled_token_ids has one row.
    snap.request_ids.append("p1")
    snap.batch_indices.append(1)
    snap.num_sampled_tokens.append(1)
    snap.num_scheduled_tokens.append(0)
    snap.scheduled_spans.add(start=PROBE_ROWS, end=PROBE_ROWS)


IA, OOR = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE

HANDLE_CASES: tuple[Case, ...] = (
    Case(
        "handle/region_path_traversal",
        IA,
        "malformed or path-like",
        _mutating(_region("../x")),
        'region "../x"',
    ),
    Case(
        "handle/region_absolute_path",
        IA,
        "malformed or path-like",
        _mutating(_region("/dev/shm/x")),
        "region /dev/shm/x",
    ),
    Case(
        "handle/region_empty", IA, "malformed or path-like", _mutating(_region("")), "empty region"
    ),
    Case(
        "handle/region_other_deployment",
        grpc.StatusCode.PERMISSION_DENIED,
        "outside deployment prefix",
        _mutating(_region("other-deployment-arena-1-aa")),
        "a well-formed name under another prefix",
    ),
    Case(
        "handle/region_unknown",
        grpc.StatusCode.NOT_FOUND,
        "unknown region",
        _mutating(_region("{prefix}-arena-1-00000000")),
        "a name under the prefix that no segment has",
    ),
    Case(
        "handle/slot_index_eq_num_slots",
        OOR,
        "out of range",
        _mutating(lambda ctx, ref, p: setattr(ref.shm, "slot", ctx.arena.num_slots)),
        "slot = num_slots, bytes inside the region",
    ),
    Case(
        "handle/slot_size_plus_one",
        OOR,
        "not inside slot",
        _mutating(
            lambda ctx, ref, p: _bytes(
                ref, ctx.arena.slot_offset(p.lease.slot), ctx.arena.slot_bytes + 1
            )
        ),
        "byte_size = slot size + 1 at offset 0 of the slot",
    ),
    Case(
        "handle/full_slot_at_offset_1",
        OOR,
        "not inside slot",
        _mutating(
            lambda ctx, ref, p: _bytes(
                ref, ctx.arena.slot_offset(p.lease.slot) + 1, ctx.arena.slot_bytes
            )
        ),
        "the full slot size at offset 1 of the slot",
    ),
    Case(
        "handle/one_byte_at_region_end",
        OOR,
        "past the end of region",
        _mutating(lambda ctx, ref, p: _bytes(ref, ctx.arena.size, 1)),
        "one byte at offset = region size",
    ),
    Case(
        "handle/offset_past_region",
        OOR,
        "past the end of region",
        _mutating(lambda ctx, ref, p: _bytes(ref, ctx.arena.size + 4096, 1)),
        "offset beyond the region",
    ),
    Case(
        "handle/byte_size_u64_max",
        IA,
        "overflows 64 bits",
        # 2**64 - 1 = 65535 * 281479271743489: a shape that matches the byte size.
        _mutating(
            lambda ctx, ref, p: _bytes(ref, ref.shm.offset, U64 - 1, [65535, 281479271743489])
        ),
        "byte_size = 2**64 - 1 at the slot's offset",
    ),
    Case(
        "handle/byte_size_wraps_to_2_64",
        IA,
        "overflows 64 bits",
        # offset is a multiple of 64, so 2**64 - offset = 64 * (2**58 - offset / 64).
        _mutating(
            lambda ctx, ref, p: _bytes(
                ref, ref.shm.offset, U64 - ref.shm.offset, [64, 2**58 - ref.shm.offset // 64]
            )
        ),
        "byte_size = 2**64 - offset (offset + byte_size wraps to 0)",
    ),
    Case(
        "handle/offset_u64_max",
        IA,
        "overflows 64 bits",
        _mutating(lambda ctx, ref, p: _bytes(ref, U64 - 1, 4)),
        "offset = 2**64 - 1 with 4 bytes",
    ),
    Case(
        "handle/byte_size_mismatch",
        IA,
        "needs",
        _mutating(lambda ctx, ref, p: setattr(ref.shm, "byte_size", ref.shm.byte_size + 1)),
        "byte_size = prod(shape) * itemsize + 1",
    ),
    Case(
        "handle/stale_generation",
        grpc.StatusCode.ABORTED,
        "stale",
        _stale,
        "the writer reused the slot (new generation) before the read",
    ),
    Case(
        "handle/readiness_never_marked",
        grpc.StatusCode.DEADLINE_EXCEEDED,
        "not ready in time",
        _never_ready,
        "the slot is never marked ready (stream readiness_timeout_ms is short)",
    ),
)

TENSOR_CASES: tuple[Case, ...] = (
    Case(
        "tensor/shape_overflow",
        IA,
        "overflows 64-bit",
        _mutating(lambda ctx, ref, p: (ref.ClearField("shape"), ref.shape.extend([2**62, 16]))),
        "prod(shape) * itemsize past 2**64",
    ),
    Case(
        "tensor/negative_dim",
        IA,
        ">= 0",
        _mutating(lambda ctx, ref, p: (ref.ClearField("shape"), ref.shape.extend([-1, 4]))),
        "a negative dimension",
    ),
    Case(
        "tensor/unknown_dtype",
        IA,
        "unknown dtype",
        _mutating(lambda ctx, ref, p: setattr(ref, "dtype", 99)),
        "dtype value 99",
    ),
    Case(
        "tensor/dtype_unspecified",
        IA,
        "unknown dtype",
        _mutating(lambda ctx, ref, p: setattr(ref, "dtype", 0)),
        "dtype D_TYPE_UNSPECIFIED",
    ),
    Case(
        "tensor/data_unset",
        IA,
        "neither",
        _mutating(lambda ctx, ref, p: ref.ClearField("shm")),
        "neither inline_data nor shm",
    ),
    Case("tensor/inline_size_mismatch", IA, "needs", _inline_short, "inline_data one byte short"),
)

STEP_CASES: tuple[Case, ...] = (
    Case(
        "step/undeclared_stage",
        IA,
        "not declared",
        _metadata(lambda ctx, s: setattr(s, "stage_id", 99)),
        "stage_id not in the open message",
    ),
    Case(
        "step/step_id_not_increasing",
        IA,
        "is not after",
        _metadata(lambda ctx, s: setattr(s, "step_id", ctx.last_step_id)),
        "the previous step id again",
    ),
    Case(
        "step/missing_source",
        IA,
        "has no tensor",
        _metadata(lambda ctx, s: s.ClearField("multimodal_outputs")),
        "a route reads a tensor the snapshot lacks",
    ),
    Case(
        "step/span_past_rows",
        IA,
        "past",
        _metadata(lambda ctx, s: setattr(s.scheduled_spans[0], "end", PROBE_ROWS + 5)),
        "a PER_TOKEN span past the tensor's rows",
    ),
    Case(
        "step/downstream_not_in_batch",
        IA,
        "not in request_ids",
        _metadata(lambda ctx, s: s.downstream_request_ids.append("ghost")),
        "a downstream id that is not a request of the step",
    ),
    Case(
        "step/per_request_rows_short",
        IA,
        "rows for",
        _metadata(_rows_short),
        "a PER_REQUEST tensor with fewer rows than requests",
    ),
    Case(
        "step/layout_unspecified",
        IA,
        "PER_TOKEN or PER_REQUEST",
        _metadata(lambda ctx, s: setattr(s.multimodal_outputs[0], "layout", 0)),
        "a multimodal output without a layout",
    ),
    Case(
        "step/spans_count_mismatch",
        IA,
        "entries for",
        _metadata(lambda ctx, s: s.scheduled_spans.add(start=PROBE_ROWS, end=PROBE_ROWS)),
        "scheduled_spans not parallel to request_ids",
    ),
)

ALL_CASES: tuple[Case, ...] = HANDLE_CASES + TENSOR_CASES + STEP_CASES
