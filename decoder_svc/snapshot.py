"""Per-step snapshots: detached metadata plus tensors copied into an arena slot.

`take_snapshot` runs on the decode critical path. It copies only the tensors
the stage's routes read (one memcpy each, into a free slot), marks the slot
ready, and returns a `SnapshotMeta`: plain Python values and handles. The
`StepSnapshot` protobuf is built later, by the sender thread; so are the
per-request lists a backend hands over lazily (`decoder_svc.backend.LazyList`:
batch indices, per-row counts, spans), which `meta_of` passes on unread.
The step's tensors are the backend's own for that step (no later step
rewrites them, see `StepOutput`), so the slot copy is the step's only copy.

When a step's tensors do not fit a slot, or inline transport is forced
(`--inline-transport`), the snapshot keeps detached (cloned) tensors instead
and they travel as bytes. A stream to a materializer that cannot map the
arena (another host or shared-memory namespace) also carries bytes: the step
still goes through a slot, and `to_proto(inline_from=arena)` copies the
slot's bytes into the message, off the critical path.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from decoder_svc.backend import StepOutput
from decoder_svc.cuda_staging import CudaStaging
from omni_common.errors import ResourceExhaustedError
from omni_common.materialize import (
    HIDDEN_STATES,
    SAMPLED_TOKEN_IDS,
    StepView,
    set_step_tensor,
    view_from_tensors,
)
from omni_common.shm_arena import ShmArena, SlotLease
from omni_common.tensor_wire import dtype_info, encode_inline
from omni_serving.v1 import snapshot_pb2, tensor_pb2

PER_TOKEN = snapshot_pb2.TENSOR_LAYOUT_PER_TOKEN
PER_REQUEST = snapshot_pb2.TENSOR_LAYOUT_PER_REQUEST


@dataclass
class SnapshotMeta:
    """A step, detached from the runner's live state."""

    step_id: int
    stage_id: int
    request_ids: list[str]
    batch_indices: Sequence[int]  # may be lazy (computed on the sender thread)
    num_scheduled_tokens: Sequence[int]
    spans: Sequence[tuple[int, int]]
    num_sampled_tokens: Sequence[int]
    finished: dict[str, str]
    downstream_request_ids: list[str]
    connector_signals: list[snapshot_pb2.ConnectorSignal]
    handles: dict[str, tuple[tensor_pb2.TensorRef, int]] = field(default_factory=dict)
    tensors: dict[str, tuple[torch.Tensor, int]] = field(default_factory=dict)  # detached, slot-less
    lease: SlotLease | None = None
    text_deltas: Mapping[str, str] = field(default_factory=dict)
    new_token_ids: Mapping[str, list[int]] = field(default_factory=dict)
    created_s: float = field(default_factory=time.perf_counter)

    # -- off the critical path -------------------------------------------------
    def to_proto(self, inline_from: ShmArena | None = None) -> snapshot_pb2.StepSnapshot:
        """The StepSnapshot message. With `inline_from` (the arena the handles
        point into), slot tensors are sent as inline bytes read from the slot
        instead of handles; the slot itself stays held (the caller releases it
        once the step is answered)."""
        snap = snapshot_pb2.StepSnapshot(
            step_id=self.step_id,
            stage_id=self.stage_id,
            request_ids=self.request_ids,
            batch_indices=list(self.batch_indices),
            num_sampled_tokens=list(self.num_sampled_tokens),
            num_scheduled_tokens=list(self.num_scheduled_tokens),
            finished_request_ids=list(self.finished),
            downstream_request_ids=self.downstream_request_ids,
        )
        for start, end in self.spans:
            snap.scheduled_spans.add(start=start, end=end)
        snap.connector_output.signals.extend(self.connector_signals)
        refs = dict(self.handles) if inline_from is None else self._inline_handles(inline_from)
        for name, (t, layout) in self.tensors.items():
            refs[name] = (encode_inline(t), layout)
        for name, (ref, layout) in refs.items():
            set_step_tensor(snap, name, ref, layout)
        return snap

    def _inline_handles(self, arena: ShmArena) -> dict[str, tuple[tensor_pb2.TensorRef, int]]:
        """The slot tensors as inline TensorRefs (one copy each, out of the slot)."""
        if not self.handles:
            return {}
        if self.lease is not None:
            arena.wait_ready(self.lease.slot, self.lease.generation, timeout_s=30.0)
        refs: dict[str, tuple[tensor_pb2.TensorRef, int]] = {}
        for name, (ref, layout) in self.handles.items():
            assert ref.shm.region == arena.name
            data = arena.data_view(ref.shm.offset, ref.shm.byte_size).numpy().tobytes()
            refs[name] = (
                tensor_pb2.TensorRef(dtype=ref.dtype, shape=ref.shape, inline_data=data),
                layout,
            )
        return refs

    def local_view(self, arena: ShmArena | None) -> StepView:
        """A StepView over this snapshot's own tensors (in-process fallback)."""
        tensors = dict(self.tensors)
        if self.lease is not None and arena is not None:
            arena.wait_ready(self.lease.slot, self.lease.generation, timeout_s=30.0)
        for name, (ref, layout) in self.handles.items():
            assert arena is not None and ref.shm.region == arena.name
            nbytes = ref.shm.byte_size
            raw = arena.data_view(ref.shm.offset, nbytes)
            dtype = dtype_info(ref.dtype).torch_dtype
            tensors[name] = (raw.view(dtype).view(tuple(ref.shape)), layout)
        return self.view_over(tensors)

    def view_over(self, tensors: dict[str, tuple[torch.Tensor, int]]) -> StepView:
        """A StepView of this step's metadata over the given tensors."""
        return view_from_tensors(
            step_id=self.step_id,
            stage_id=self.stage_id,
            request_ids=self.request_ids,
            spans=self.spans,
            num_sampled_tokens=self.num_sampled_tokens,
            finished_request_ids=list(self.finished),
            downstream_request_ids=self.downstream_request_ids,
            tensors=tensors,
            connector_signals=self.connector_signals,
        )


def step_tensors(out: StepOutput, sources: set[str]) -> dict[str, tuple[torch.Tensor, int]]:
    """The step tensors the stage's routes read, by source name."""
    tensors: dict[str, tuple[torch.Tensor, int]] = {}
    if SAMPLED_TOKEN_IDS in sources:
        tensors[SAMPLED_TOKEN_IDS] = (out.sampled_token_ids, PER_REQUEST)
    if HIDDEN_STATES in sources and out.hidden_states is not None:
        tensors[HIDDEN_STATES] = (out.hidden_states, PER_TOKEN)
    for name, value in out.mm_outputs.items():
        if name in sources:
            tensors[name] = value
    return tensors


def meta_of(
    out: StepOutput,
    *,
    step_id: int,
    stage_id: int,
    downstream_request_ids: list[str],
    connector_signals: list[snapshot_pb2.ConnectorSignal],
) -> SnapshotMeta:
    """The step's metadata, detached from the runner's live state (no tensors).

    Critical path: lazy lists of `out` are passed on, not computed."""
    return SnapshotMeta(
        step_id=step_id,
        stage_id=stage_id,
        request_ids=out.request_ids,
        batch_indices=out.batch_indices,
        num_scheduled_tokens=out.num_scheduled_tokens,
        spans=out.spans,
        num_sampled_tokens=[int(out.sampled_token_ids.shape[1])] * len(out.request_ids),
        finished=out.finished,
        downstream_request_ids=downstream_request_ids,
        connector_signals=connector_signals,
        text_deltas=out.text_deltas,
        new_token_ids=out.new_token_ids,
    )


def take_snapshot(
    meta: SnapshotMeta,
    tensors: dict[str, tuple[torch.Tensor, int]],
    arena: ShmArena | None,
    acquire_timeout_s: float | None = None,
    staging: CudaStaging | None = None,
) -> SnapshotMeta:
    """Attach the step's tensors to `meta` (critical path): copy them into a
    free arena slot, one memcpy each, and mark the slot ready.

    Blocks while every slot is held (backpressure). Without an arena, or if
    the step does not fit one slot, the tensors are copied to host memory
    instead (they then travel inline). With `staging` (CUDA hosts) the copies
    are only enqueued and the slot is marked ready when they complete.
    """
    if arena is not None:
        need = sum(t.numel() * t.element_size() + 64 for t, _ in tensors.values())
        if need <= arena.slot_bytes:
            lease = arena.acquire(acquire_timeout_s)
            try:
                if staging is not None:
                    meta.handles = staging.write(lease, tensors)
                else:
                    for name, (t, layout) in tensors.items():
                        meta.handles[name] = (lease.write(t), layout)
                    lease.mark_ready()
            except ResourceExhaustedError:
                arena.release(lease.slot, lease.generation)
                raise
            meta.lease = lease
            return meta
    # One copy each, to host memory (from a device tensor this waits for it).
    meta.tensors = {
        name: (t.detach().to("cpu", copy=True), layout) for name, (t, layout) in tensors.items()
    }
    return meta
