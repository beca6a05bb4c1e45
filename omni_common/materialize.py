"""Build a step's payloads from its snapshot: the one builder every path uses.

The shipped materializer implementations and the conformance kit's golden
vectors call `build_step` (payloads as protobuf messages); the decoder's
in-process paths (the synchronous one and the background builder) call
`build_local_step` (payloads as tensors viewing the step's own memory, no
serialisation). Both walk the same routing (`_routed_rows`), so what one
encodes is exactly what the other hands over.

Input is a `StepView`: the snapshot's metadata plus its tensors as numpy
arrays (viewing shared memory, inline bytes, or the engine's own tensors).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from omni_common.errors import InvalidArgumentError
from omni_common.tensor_wire import (
    DTypeInfo,
    encode_array,
    encode_inline,
    tensor_from_buffer,
    validate_ref,
)
from omni_serving.v1 import materializer_pb2, payload_pb2, snapshot_pb2, tensor_pb2

PER_TOKEN = snapshot_pb2.TENSOR_LAYOUT_PER_TOKEN
PER_REQUEST = snapshot_pb2.TENSOR_LAYOUT_PER_REQUEST
INTER_STAGE = materializer_pb2.PAYLOAD_DESTINATION_INTER_STAGE
CLIENT = materializer_pb2.PAYLOAD_DESTINATION_CLIENT
SELECT_ALL = materializer_pb2.ROW_SELECTION_ALL
SELECT_LAST = materializer_pb2.ROW_SELECTION_LAST

HIDDEN_STATES = "hidden_states"
SAMPLED_TOKEN_IDS = "sampled_token_ids"


@dataclass
class StepTensorView:
    """A step tensor as a numpy array, with its row layout and wire dtype."""

    array: np.ndarray
    layout: int
    dtype: torch.dtype


@dataclass
class StepView:
    """What the builder reads from one step (metadata + tensors)."""

    step_id: int
    stage_id: int
    request_ids: Sequence[str]
    spans: Sequence[tuple[int, int]]
    num_sampled_tokens: Sequence[int]
    finished_request_ids: frozenset[str]
    downstream_request_ids: frozenset[str]
    tensors: Mapping[str, StepTensorView]
    connector_signals: Sequence[snapshot_pb2.ConnectorSignal] = field(default_factory=tuple)


def _array_of(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy()
    return t.numpy()


def view_from_tensors(
    *,
    step_id: int,
    stage_id: int,
    request_ids: Sequence[str],
    spans: Sequence[tuple[int, int]],
    num_sampled_tokens: Sequence[int],
    finished_request_ids: Sequence[str],
    downstream_request_ids: Sequence[str],
    tensors: Mapping[str, tuple[torch.Tensor, int]],
    connector_signals: Sequence[snapshot_pb2.ConnectorSignal] = (),
) -> StepView:
    """A StepView over in-process tensors (the synchronous path)."""
    return StepView(
        step_id=step_id,
        stage_id=stage_id,
        request_ids=request_ids,
        spans=spans,
        num_sampled_tokens=num_sampled_tokens,
        finished_request_ids=frozenset(finished_request_ids),
        downstream_request_ids=frozenset(downstream_request_ids),
        tensors={name: StepTensorView(_array_of(t), layout, t.dtype) for name, (t, layout) in tensors.items()},
        connector_signals=tuple(connector_signals),
    )


TensorResolver = Callable[[tensor_pb2.TensorRef, str], tuple[DTypeInfo, memoryview | bytes]]
"""Maps a TensorRef to (dtype, bytes) — shared memory or inline — after validation."""


def inline_resolver(ref: tensor_pb2.TensorRef, field: str) -> tuple[DTypeInfo, memoryview | bytes]:
    info, _, _ = validate_ref(ref, field)
    if ref.WhichOneof("data") != "inline_data":
        raise InvalidArgumentError(f"{field}.shm", "this reader accepts inline tensors only")
    return info, ref.inline_data


def _np_view(info: DTypeInfo, buf: memoryview | bytes, shape: Sequence[int]) -> np.ndarray:
    return _array_of(tensor_from_buffer(buf, info, shape))


def view_from_snapshot(
    snap: snapshot_pb2.StepSnapshot,
    resolve: TensorResolver,
    needed: set[str] | None = None,
) -> StepView:
    """A StepView over a StepSnapshot; tensors come from `resolve` (no copy).

    Validates the metadata's internal consistency (parallel list lengths,
    spans) so the builder can trust it. Only tensors in `needed` are resolved
    (None = all).
    """
    n = len(snap.request_ids)
    if len(snap.scheduled_spans) != n:
        raise InvalidArgumentError(
            "snapshot.scheduled_spans", f"has {len(snap.scheduled_spans)} entries for {n} request_ids"
        )
    if snap.num_sampled_tokens and len(snap.num_sampled_tokens) != n:
        raise InvalidArgumentError(
            "snapshot.num_sampled_tokens", f"has {len(snap.num_sampled_tokens)} entries for {n} request_ids"
        )
    spans = []
    prev_end = 0
    for i, s in enumerate(snap.scheduled_spans):
        if s.end < s.start or s.start < prev_end:
            raise InvalidArgumentError(f"snapshot.scheduled_spans[{i}]", f"span [{s.start}, {s.end}) is not ordered")
        spans.append((int(s.start), int(s.end)))
        prev_end = s.end
    ids = set(snap.request_ids)
    for rid in snap.downstream_request_ids:
        if rid not in ids:
            raise InvalidArgumentError("snapshot.downstream_request_ids", f"{rid!r} is not in request_ids")

    tensors: dict[str, StepTensorView] = {}

    seen: set[str] = set()

    def add(name: str, ref: tensor_pb2.TensorRef, layout: int, field_name: str) -> None:
        if name in seen:
            raise InvalidArgumentError(field_name, f"a second step tensor named {name!r}")
        seen.add(name)
        if needed is not None and name not in needed:
            return
        info, buf = resolve(ref, field_name)
        tensors[name] = StepTensorView(_np_view(info, buf, list(ref.shape)), layout, info.torch_dtype)

    if snap.HasField("sampled_token_ids"):
        add(SAMPLED_TOKEN_IDS, snap.sampled_token_ids, PER_REQUEST, "snapshot.sampled_token_ids")
    if snap.HasField("hidden_states"):
        add(HIDDEN_STATES, snap.hidden_states, PER_TOKEN, "snapshot.hidden_states")
    for i, st in enumerate(snap.multimodal_outputs):
        if st.layout not in (PER_TOKEN, PER_REQUEST):
            raise InvalidArgumentError(f"snapshot.multimodal_outputs[{i}].layout", "must be PER_TOKEN or PER_REQUEST")
        add(st.name, st.tensor, st.layout, f"snapshot.multimodal_outputs[{i}].tensor")

    return StepView(
        step_id=snap.step_id,
        stage_id=snap.stage_id,
        request_ids=list(snap.request_ids),
        spans=spans,
        num_sampled_tokens=list(snap.num_sampled_tokens) or [1] * n,
        finished_request_ids=frozenset(snap.finished_request_ids),
        downstream_request_ids=frozenset(snap.downstream_request_ids),
        tensors=tensors,
        connector_signals=tuple(snap.connector_output.signals),
    )


def set_step_tensor(snap: snapshot_pb2.StepSnapshot, name: str, ref: tensor_pb2.TensorRef, layout: int) -> None:
    """Put a step tensor in its StepSnapshot field: the two well-known sources
    have their own fields, everything else is a multimodal output."""
    if name == SAMPLED_TOKEN_IDS:
        snap.sampled_token_ids.CopyFrom(ref)
    elif name == HIDDEN_STATES:
        snap.hidden_states.CopyFrom(ref)
    else:
        snap.multimodal_outputs.add(name=name, layout=layout, tensor=ref)


def sources_of(plan: materializer_pb2.StagePlan) -> set[str]:
    """Step tensors a stage's routes read (the only ones worth snapshotting)."""
    return {r.source for r in plan.routes}


def validate_plan(plan: materializer_pb2.StagePlan, field: str = "plan") -> None:
    for i, r in enumerate(plan.routes):
        if not r.source:
            raise InvalidArgumentError(f"{field}.routes[{i}].source", "is empty")
        if not r.key:
            raise InvalidArgumentError(f"{field}.routes[{i}].key", "is empty")
        if r.destination not in (INTER_STAGE, CLIENT):
            raise InvalidArgumentError(f"{field}.routes[{i}].destination", "must be INTER_STAGE or CLIENT")
        if r.selection not in (SELECT_ALL, SELECT_LAST):
            raise InvalidArgumentError(f"{field}.routes[{i}].selection", "must be ALL or LAST")


def _rows(view: StepView, name: str, t: StepTensorView, i: int, selection: int) -> np.ndarray:
    """Request i's rows of a step tensor under a row selection."""
    a = t.array
    if name == SAMPLED_TOKEN_IDS:
        row = a[i, : view.num_sampled_tokens[i]]
        return row[-1:] if selection == SELECT_LAST else row
    if t.layout == PER_REQUEST:
        return a[i : i + 1]
    start, end = view.spans[i]
    if end > a.shape[0]:
        raise InvalidArgumentError(name, f"span [{start}, {end}) of request {i} is past {a.shape[0]} rows")
    return a[end - 1 : end] if selection == SELECT_LAST and end > start else a[start:end]


def _check_source(view: StepView, name: str, t: StepTensorView) -> None:
    """Refuse a routed tensor whose rows cannot cover the step's requests
    (slicing would otherwise return short or empty rows without a word)."""
    a, n = t.array, len(view.request_ids)
    if a.ndim < 1:
        raise InvalidArgumentError(name, "a step tensor needs a row dimension, got a scalar")
    if name == SAMPLED_TOKEN_IDS:
        if a.ndim != 2:
            raise InvalidArgumentError(name, f"must be [num_requests, max_tokens], got shape {list(a.shape)}")
        for i, k in enumerate(view.num_sampled_tokens):
            if k > a.shape[1]:
                raise InvalidArgumentError(
                    "snapshot.num_sampled_tokens", f"[{i}] is {k}, sampled_token_ids has {a.shape[1]} columns"
                )
    if (name == SAMPLED_TOKEN_IDS or t.layout == PER_REQUEST) and a.shape[0] < n:
        raise InvalidArgumentError(name, f"has {a.shape[0]} rows for {n} requests")


@dataclass
class LocalRequest:
    """One request's payloads of a step, as tensors (in-process paths).

    The tensors view the step's memory (an arena slot, the engine's output):
    a consumer that keeps one past the delivery of the step copies it."""

    request_id: str
    finished: bool
    # client payload tensors in route order (the order build_step encodes them in)
    client: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    # inter-stage payload tensors by key (as `payload_tensors` decodes them)
    inter_stage: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class LocalStep:
    """A step's payloads built in-process: what `build_step` would encode,
    before encoding."""

    step_id: int
    stage_id: int
    requests: list[LocalRequest]
    connector_signals: Sequence[snapshot_pb2.ConnectorSignal] = ()

    def to_proto(self) -> materializer_pb2.MaterializedStep:
        """The MaterializedStep `build_step` builds from the same view."""
        out = materializer_pb2.MaterializedStep(step_id=self.step_id, stage_id=self.stage_id)
        for r in self.requests:
            req = out.requests.add(request_id=r.request_id, finished=r.finished)
            for key, t in r.inter_stage.items():
                req.inter_stage.tensors.add(name=key, tensor=encode_inline(t))
            if r.client:  # unset when the request has no client payload, as build_step leaves it
                client_payload(r.client, into=req.client)
        out.connector_signals.extend(self.connector_signals)
        return out


_Routed = tuple[int, str, list[tuple[int, str, np.ndarray, torch.dtype]]]


def _routed_rows(view: StepView, plan: materializer_pb2.StagePlan) -> Iterator[_Routed]:
    """Slice per request and route by key: the routing both builders share.

    Yields, per request in step order, (index, request_id, [(destination,
    key, rows, wire dtype)] in route order); rows are numpy views of the
    step's tensors (no copy)."""
    routes = list(plan.routes)
    for r in routes:
        if r.source not in view.tensors:
            raise InvalidArgumentError("plan.routes.source", f"step {view.step_id} has no tensor {r.source!r}")
        _check_source(view, r.source, view.tensors[r.source])
    if len(view.num_sampled_tokens) != len(view.request_ids):
        raise InvalidArgumentError(
            "num_sampled_tokens", f"has {len(view.num_sampled_tokens)} entries for {len(view.request_ids)} requests"
        )
    # 1) downstream set
    downstream = view.downstream_request_ids
    # 2) per-request slices
    for i, rid in enumerate(view.request_ids):
        wants_inter = rid in downstream
        rows = []
        for r in routes:
            if r.destination == INTER_STAGE and not wants_inter:
                continue
            t = view.tensors[r.source]
            rows.append((r.destination, r.key, _rows(view, r.source, t, i, r.selection), t.dtype))
        yield i, rid, rows


def build_step(view: StepView, plan: materializer_pb2.StagePlan) -> materializer_pb2.MaterializedStep:
    """Slice per request, route by key, build payload messages.

    Steps (the only loop over requests in output materialization):
      1) resolve which requests want an inter-stage payload this step;
      2) for each request, slice every routed tensor by its span and encode
         it into the inter-stage or client payload, in route order;
      3) after all payloads of the step are built, drain the step's
         connector signals into the result (never into another step's).
    Slot release is added by the caller, which knows the handles.
    """
    out = materializer_pb2.MaterializedStep(step_id=view.step_id, stage_id=view.stage_id)
    finished = view.finished_request_ids
    for _, rid, rows in _routed_rows(view, plan):
        req = out.requests.add(request_id=rid, finished=rid in finished)
        for destination, key, a, dtype in rows:
            target = req.inter_stage if destination == INTER_STAGE else req.client
            target.tensors.add(name=key, tensor=encode_array(a, dtype))
    # 3) connector signals, after this step's payloads
    out.connector_signals.extend(view.connector_signals)
    return out


def _as_tensor(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A numpy view as a tensor of its wire dtype (no copy)."""
    t = torch.from_numpy(a)
    return t.view(dtype) if t.dtype != dtype else t


def build_local_step(view: StepView, plan: materializer_pb2.StagePlan) -> LocalStep:
    """`build_step` without the encoding: the same slices, routed the same way,
    kept as tensors viewing the step's memory. The decoder's in-process
    paths hand these to the router directly; only a client payload becomes
    a message (`client_payload`), once, where the Generate stream needs it."""
    finished = view.finished_request_ids
    requests = []
    for _, rid, rows in _routed_rows(view, plan):
        req = LocalRequest(request_id=rid, finished=rid in finished)
        for destination, key, a, dtype in rows:
            if destination == INTER_STAGE:
                req.inter_stage[key] = _as_tensor(a, dtype)
            else:
                req.client.append((key, _as_tensor(a, dtype)))
        requests.append(req)
    # connector signals, after this step's payloads
    return LocalStep(view.step_id, view.stage_id, requests, tuple(view.connector_signals))


def client_payload(
    tensors: Sequence[tuple[str, torch.Tensor]], into: payload_pb2.MultimodalPayload | None = None
) -> payload_pb2.MultimodalPayload:
    """A client payload message from (key, tensor) pairs, in order (built in
    `into` when given: the message that carries it, no second copy)."""
    payload = payload_pb2.MultimodalPayload() if into is None else into
    for key, t in tensors:
        payload.tensors.add(name=key, tensor=encode_inline(t))
    return payload


def payload_tensors(payload: payload_pb2.MultimodalPayload, field: str = "payload") -> dict[str, torch.Tensor]:
    """Decode a payload's inline tensors into a name -> tensor dict."""
    result = {}
    for i, nt in enumerate(payload.tensors):
        info, shape, _ = validate_ref(nt.tensor, f"{field}.tensors[{i}]")
        result[nt.name] = tensor_from_buffer(nt.tensor.inline_data, info, shape)
    return result
