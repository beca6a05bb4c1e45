"""Golden vectors: deterministic snapshot streams and the answers they must get.

A *scenario* is one Materialize stream: an `open` message (stage plans) and a
list of StepSnapshots whose tensors are inline, plus one expected
MaterializeResponse per snapshot. The expected answers are built by
`omni_common.materialize.build_step` over views of the generator's own
tensors (`view_from_tensors`, the decoder's synchronous path), and checked
against the inline path (`view_from_snapshot`) while generating.

On disk (materializer_svc/conformance/golden/):
  manifest.json                  format, contract, scenarios, file hashes
  <scenario>.requests.binpb      MaterializeRequest messages: open, snapshots
  <scenario>.expected.binpb      MaterializeResponse messages, one per snapshot
Both .binpb files are sequences of length-delimited messages: a base-128
varint byte count, then the message (the framing of Java's writeDelimitedTo
and C++'s SerializeDelimitedToOstream). Expected answers carry no
released_slots: those depend on the arena the kit writes at run time and are
checked separately.

Everything here is deterministic: numpy's PCG64 with fixed seeds, torch's
round-to-nearest-even for bfloat16/float16, deterministic serialization.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from omni_common.materialize import (
    CLIENT,
    HIDDEN_STATES,
    INTER_STAGE,
    PER_REQUEST,
    PER_TOKEN,
    SAMPLED_TOKEN_IDS,
    SELECT_ALL,
    SELECT_LAST,
    build_step,
    inline_resolver,
    set_step_tensor,
    view_from_snapshot,
    view_from_tensors,
)
from omni_common.tensor_wire import decode_inline, encode_inline
from omni_serving.v1 import materializer_pb2, snapshot_pb2, tensor_pb2

FORMAT = 1
CONTRACT = "omni_serving.v1"
MANIFEST = "manifest.json"

# --------------------------------------------------------------------------
# Length-delimited framing
# --------------------------------------------------------------------------


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def encode_delimited(messages: Iterable[bytes]) -> bytes:
    return b"".join(_varint(len(m)) + m for m in messages)


def decode_delimited(data: bytes) -> Iterator[bytes]:
    pos = 0
    while pos < len(data):
        n = shift = 0
        while True:
            if pos >= len(data):
                raise ValueError("truncated varint in delimited stream")
            byte = data[pos]
            pos += 1
            n |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
        if pos + n > len(data):
            raise ValueError("truncated message in delimited stream")
        yield data[pos : pos + n]
        pos += n


def canonical(msg) -> bytes:
    """Deterministic serialization: how the kit compares messages byte for byte."""
    return msg.SerializeToString(deterministic=True)


# --------------------------------------------------------------------------
# Scenario specs
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    """A step tensor of a stage: rows follow the layout, `tail` the rest."""

    name: str
    layout: int
    dtype: torch.dtype
    tail: tuple[int, ...] = ()
    values: str = "normal"  # normal | codes | special


@dataclass(frozen=True)
class StageSpec:
    stage_id: int
    name: str
    tensors: tuple[TensorSpec, ...]
    routes: tuple[tuple[str, str, int, int], ...]  # (source, key, destination, selection)

    def plan(self) -> materializer_pb2.StagePlan:
        return materializer_pb2.StagePlan(
            stage_id=self.stage_id,
            name=self.name,
            routes=[
                materializer_pb2.PayloadRoute(source=s, key=k, destination=d, selection=sel)
                for s, k, d, sel in self.routes
            ],
        )


@dataclass(frozen=True)
class StepSpec:
    step_id: int
    stage_id: int
    requests: tuple[tuple[str, int], ...] = ()  # (request id, scheduled tokens)
    k: int = 1  # columns of sampled_token_ids
    num_sampled: tuple[int, ...] | None = None  # None: left empty on the wire (1 each)
    finished: tuple[str, ...] = ()
    downstream: tuple[str, ...] = ()
    signals: tuple[tuple[str, str, int], ...] = ()
    finished_sending: tuple[str, ...] = ()
    finished_recving: tuple[str, ...] = ()
    extras: tuple[str, ...] = ()  # unrouted tensors to carry: logprobs, prompt_logprobs


@dataclass
class Scenario:
    """One stream of the kit, with its expected answers."""

    name: str
    description: str
    seed: int
    open: materializer_pb2.MaterializeRequest
    snapshots: list[snapshot_pb2.StepSnapshot]
    expected: list[materializer_pb2.MaterializeResponse]
    plans: dict[int, materializer_pb2.StagePlan] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.plans:
            self.plans = {p.stage_id: p for p in self.open.open.stages}

    def requests_bytes(self) -> bytes:
        msgs = [self.open] + [
            materializer_pb2.MaterializeRequest(snapshot=s) for s in self.snapshots
        ]
        return encode_delimited(canonical(m) for m in msgs)

    def expected_bytes(self) -> bytes:
        return encode_delimited(canonical(m) for m in self.expected)


# --------------------------------------------------------------------------
# Generation
# --------------------------------------------------------------------------


def _values(rng: np.random.Generator, spec: TensorSpec, shape: tuple[int, ...]) -> torch.Tensor:
    if spec.dtype == torch.bool:
        return torch.from_numpy(rng.random(shape) < 0.5)
    if not spec.dtype.is_floating_point:
        info = torch.iinfo(spec.dtype)
        hi = 4096 if spec.values == "codes" else info.max
        lo = 0 if spec.values == "codes" else info.min
        return torch.from_numpy(rng.integers(lo, hi, size=shape, dtype=np.int64, endpoint=True)).to(
            spec.dtype
        )
    a = rng.standard_normal(shape).astype(np.float32) * 3
    if spec.values == "special" and a.size:
        flat = a.reshape(-1)
        specials = np.array(
            [np.nan, np.inf, -np.inf, -0.0, 1e-40, 65504.0, 3.4e38], dtype=np.float32
        )
        idx = rng.choice(flat.size, size=min(flat.size, len(specials)), replace=False)
        flat[idx] = specials[: len(idx)]
    return torch.from_numpy(a).to(spec.dtype)


def _sampled(rng: np.random.Generator, n: int, k: int, num_sampled: Sequence[int]) -> torch.Tensor:
    ids = rng.integers(0, 151_935, size=(n, k), dtype=np.int64)
    for i, valid in enumerate(num_sampled):
        ids[i, valid:] = -1  # rejected draft positions are padding
    return torch.from_numpy(ids)


def _step(
    rng: np.random.Generator, stage: StageSpec, spec: StepSpec
) -> tuple[snapshot_pb2.StepSnapshot, materializer_pb2.MaterializeResponse]:
    rids = [r for r, _ in spec.requests]
    tokens = [t for _, t in spec.requests]
    n, total = len(rids), sum(tokens)
    q = (
        np.concatenate([[0], np.cumsum(tokens, dtype=np.int64)]).astype(np.int32)
        if n
        else np.zeros(1, np.int32)
    )
    spans = [(int(q[i]), int(q[i + 1])) for i in range(n)]
    num_sampled = list(spec.num_sampled) if spec.num_sampled is not None else [1] * n

    tensors: dict[str, tuple[torch.Tensor, int]] = {}
    for t in stage.tensors:
        if t.name == SAMPLED_TOKEN_IDS:
            tensors[t.name] = (_sampled(rng, n, spec.k, num_sampled), PER_REQUEST)
            continue
        rows = total if t.layout == PER_TOKEN else n
        tensors[t.name] = (_values(rng, t, (rows, *t.tail)), t.layout)

    snap = snapshot_pb2.StepSnapshot(
        step_id=spec.step_id,
        stage_id=spec.stage_id,
        request_ids=rids,
        batch_indices=[int(x) for x in rng.permutation(max(n, 1))[:n]],
        num_sampled_tokens=list(spec.num_sampled) if spec.num_sampled is not None else [],
        num_scheduled_tokens=tokens,
        finished_request_ids=list(spec.finished),
        downstream_request_ids=list(spec.downstream),
        query_start_loc=encode_inline(torch.from_numpy(q)),
    )
    for start, end in spans:
        snap.scheduled_spans.add(start=start, end=end)
    if spec.k > 1:
        snap.spec_decode.num_draft_tokens.extend([spec.k - 1] * n)
        snap.spec_decode.num_accepted_tokens.extend([max(v - 1, 0) for v in num_sampled])
    for rid, kind, value in spec.signals:
        snap.connector_output.signals.add(request_id=rid, kind=kind, value=value)
    snap.connector_output.finished_sending.extend(spec.finished_sending)
    snap.connector_output.finished_recving.extend(spec.finished_recving)
    for name, (tensor, layout) in tensors.items():
        set_step_tensor(snap, name, encode_inline(tensor), layout)
    if "logprobs" in spec.extras:
        snap.logprobs.CopyFrom(
            encode_inline(torch.from_numpy(rng.standard_normal((n, 2)).astype(np.float32)))
        )
    if "prompt_logprobs" in spec.extras:
        snap.prompt_logprobs.CopyFrom(
            encode_inline(torch.from_numpy(rng.standard_normal((total, 2)).astype(np.float32)))
        )

    plan = stage.plan()
    # The expected answer: the decoder's synchronous path over the same tensors.
    view = view_from_tensors(
        step_id=spec.step_id,
        stage_id=spec.stage_id,
        request_ids=rids,
        spans=spans,
        num_sampled_tokens=num_sampled,
        finished_request_ids=list(spec.finished),
        downstream_request_ids=list(spec.downstream),
        tensors=tensors,
        connector_signals=list(snap.connector_output.signals),
    )
    built = build_step(view, plan)
    # The inline wire path must agree before anything is written.
    via_wire = build_step(view_from_snapshot(snap, inline_resolver), plan)
    if canonical(via_wire) != canonical(built):
        raise AssertionError(
            f"step {spec.step_id}: inline wire path differs from the in-process path"
        )
    return snap, materializer_pb2.MaterializeResponse(step=built)


def _scenario(
    name: str,
    description: str,
    seed: int,
    stages: Sequence[StageSpec],
    steps: Sequence[StepSpec],
    readiness_ms: int = 5000,
) -> Scenario:
    rng = np.random.Generator(np.random.PCG64(seed))
    by_id = {s.stage_id: s for s in stages}
    open_msg = materializer_pb2.MaterializeRequest(
        open=materializer_pb2.MaterializeStreamOpen(
            shm_prefix="",  # filled in by the kit with the target's prefix
            stages=[s.plan() for s in stages],
            readiness_timeout_ms=readiness_ms,
            client_name=f"conformance/{name}",
        )
    )
    snaps, expected = [], []
    for spec in steps:
        snap, resp = _step(rng, by_id[spec.stage_id], spec)
        snaps.append(snap)
        expected.append(resp)
    return Scenario(name, description, seed, open_msg, snaps, expected)


# -- the scenarios -----------------------------------------------------------------

_BF16, _F32, _I64 = torch.bfloat16, torch.float32, torch.int64


def _omni_thinker_talker() -> Scenario:
    thinker = StageSpec(
        0,
        "thinker",
        (
            TensorSpec(HIDDEN_STATES, PER_TOKEN, _BF16, (8,)),
            TensorSpec("thinker_reply_embed", PER_TOKEN, _F32, (4,)),
            TensorSpec(SAMPLED_TOKEN_IDS, PER_REQUEST, _I64),
        ),
        (
            (HIDDEN_STATES, "thinker_hidden", INTER_STAGE, SELECT_ALL),
            ("thinker_reply_embed", "reply_embed", INTER_STAGE, SELECT_LAST),
            (SAMPLED_TOKEN_IDS, "token_ids", CLIENT, SELECT_ALL),
            (HIDDEN_STATES, "hidden_last", CLIENT, SELECT_LAST),
        ),
    )
    talker = StageSpec(
        1,
        "talker",
        (
            TensorSpec("codec_codes", PER_REQUEST, _I64, (16,), "codes"),
            TensorSpec("audio_latent", PER_TOKEN, _F32, (6,)),
            TensorSpec(SAMPLED_TOKEN_IDS, PER_REQUEST, _I64),
        ),
        (
            ("codec_codes", "codec_codes", INTER_STAGE, SELECT_ALL),
            (SAMPLED_TOKEN_IDS, "talker_token", INTER_STAGE, SELECT_LAST),
            ("audio_latent", "latent", CLIENT, SELECT_ALL),
            ("codec_codes", "codec_last", CLIENT, SELECT_LAST),
        ),
    )
    steps = (
        StepSpec(
            1,
            0,
            (("a", 5), ("b", 3)),
            downstream=("a",),
            signals=(("a", "chunk_ready", 1),),
            extras=("logprobs",),
        ),
        StepSpec(
            2,
            0,
            (("a", 1), ("b", 1), ("c", 4)),
            downstream=("a", "c"),
            signals=(("c", "chunk_ready", 2),),
        ),
        StepSpec(3, 1, (("a", 2),), downstream=("a",), signals=(("a", "chunk_ready", 3),)),
        StepSpec(
            5,
            0,
            (("a", 3), ("b", 2), ("c", 1)),
            k=3,
            num_sampled=(2, 2, 1),
            finished=("b",),
            downstream=("b", "c"),
            signals=(("b", "kv_sent", 5), ("a", "chunk_ready", 5)),
        ),
        StepSpec(
            6,
            1,
            (("a", 1), ("c", 3)),
            downstream=("a", "c"),
            finished_recving=("c",),
            extras=("prompt_logprobs",),
        ),
        StepSpec(8, 0, (), signals=(("a", "chunk_ready", 8),), finished_sending=("b",)),
        StepSpec(9, 0, (("a", 1), ("c", 1)), finished=("a",)),
        StepSpec(
            12, 1, (("a", 1), ("c", 1)), num_sampled=(1, 1), downstream=("c",), finished=("a",)
        ),
        StepSpec(13, 1, ()),
        StepSpec(20, 0, (("c", 1),), finished=("c",), downstream=("c",)),
        StepSpec(
            21,
            1,
            (("c", 1),),
            finished=("c",),
            downstream=("c",),
            signals=(("c", "chunk_ready", 21),),
        ),
    )
    return _scenario(
        "omni_thinker_talker",
        "two AR stages on one stream: prefill spans, spec-decode trimming, sparse step ids, empty steps, "
        "partial downstream sets, finished requests, unrouted tensors",
        1001,
        (thinker, talker),
        steps,
    )


def _tts_talker() -> Scenario:
    talker = StageSpec(
        0,
        "talker",
        (
            TensorSpec("codec_codes", PER_REQUEST, _I64, (8,), "codes"),
            TensorSpec("audio_chunk", PER_REQUEST, _F32, (240,)),
            TensorSpec(HIDDEN_STATES, PER_TOKEN, _BF16, (8,)),
            TensorSpec(SAMPLED_TOKEN_IDS, PER_REQUEST, _I64),
        ),
        (
            ("codec_codes", "codec_codes", INTER_STAGE, SELECT_ALL),
            ("audio_chunk", "audio", CLIENT, SELECT_ALL),
            (SAMPLED_TOKEN_IDS, "token_ids", CLIENT, SELECT_LAST),
            (HIDDEN_STATES, "hidden_last", INTER_STAGE, SELECT_LAST),
        ),
    )

    def sig(step: int, *rids: str) -> tuple[tuple[str, str, int], ...]:
        return tuple((r, "chunk_ready", step * 10 + i) for i, r in enumerate(rids))

    r012 = ("r0", "r1", "r2")
    steps = (
        StepSpec(
            100, 0, (("r0", 6), ("r1", 4), ("r2", 2)), downstream=r012, signals=sig(100, *r012)
        ),
        StepSpec(101, 0, (("r0", 1), ("r1", 1), ("r2", 1)), downstream=("r0", "r2")),
        StepSpec(
            102,
            0,
            (("r0", 1), ("r1", 1), ("r2", 1), ("r3", 5)),
            downstream=(*r012, "r3"),
            signals=sig(102, "r3"),
        ),
        StepSpec(
            104,
            0,
            (("r0", 1), ("r1", 1), ("r2", 1), ("r3", 1)),
            finished=("r1",),
            downstream=("r0", "r1", "r3"),
            signals=sig(104, "r1"),
        ),
        StepSpec(108, 0, (("r0", 1), ("r2", 1), ("r3", 1))),
        StepSpec(
            109,
            0,
            (("r0", 1), ("r2", 1), ("r3", 1)),
            finished=("r0", "r2", "r3"),
            downstream=("r0", "r2", "r3"),
            signals=sig(109, "r0", "r2", "r3"),
            finished_sending=("r1",),
        ),
        StepSpec(110, 0, ()),
        StepSpec(
            111, 0, (("r4", 3),), finished=("r4",), downstream=("r4",), signals=sig(111, "r4")
        ),
    )
    return _scenario(
        "tts_talker",
        "one talker stage: PER_REQUEST codec codes and audio chunks, requests joining and finishing, "
        "a step with nothing downstream",
        2002,
        (talker,),
        steps,
    )


def _edge_shapes() -> Scenario:
    edges = StageSpec(
        5,
        "edges",
        (
            TensorSpec(HIDDEN_STATES, PER_TOKEN, _F32, (0,)),
            TensorSpec("mask", PER_TOKEN, torch.bool),
            TensorSpec("ids32", PER_REQUEST, torch.int32),
            TensorSpec("special", PER_TOKEN, _BF16, (3,), "special"),
            TensorSpec("f16", PER_REQUEST, torch.float16, (2, 2), "special"),
            TensorSpec("u8", PER_TOKEN, torch.uint8, (5,)),
            TensorSpec("f64", PER_REQUEST, torch.float64, (1,)),
            TensorSpec("i8", PER_TOKEN, torch.int8, (2,)),
            TensorSpec("i16", PER_REQUEST, torch.int16, (3,)),
            TensorSpec(SAMPLED_TOKEN_IDS, PER_REQUEST, _I64),
        ),
        (
            (HIDDEN_STATES, "zero_width", INTER_STAGE, SELECT_ALL),
            ("mask", "mask", CLIENT, SELECT_ALL),
            ("ids32", "ids", INTER_STAGE, SELECT_LAST),
            ("special", "special", CLIENT, SELECT_ALL),
            ("special", "special_last", INTER_STAGE, SELECT_LAST),
            ("f16", "f16", CLIENT, SELECT_ALL),
            ("u8", "u8_last", CLIENT, SELECT_LAST),
            ("f64", "f64", INTER_STAGE, SELECT_ALL),
            ("i8", "i8", CLIENT, SELECT_ALL),
            ("i16", "i16_last", CLIENT, SELECT_LAST),
            (SAMPLED_TOKEN_IDS, "tokens", CLIENT, SELECT_ALL),
            (SAMPLED_TOKEN_IDS, "token_last", INTER_STAGE, SELECT_LAST),
        ),
    )
    e012 = ("e0", "e1", "e2")
    steps = (
        StepSpec(
            0, 5, (("e0", 3), ("e1", 0), ("e2", 2)), k=4, num_sampled=(4, 0, 2), downstream=e012
        ),
        StepSpec(7, 5, (("e0", 0), ("e1", 1)), k=4, num_sampled=(0, 1), downstream=("e1",)),
        StepSpec(
            1000,
            5,
            (("e2", 7),),
            k=4,
            num_sampled=(4,),
            downstream=("e2",),
            signals=(("e2", "chunk_ready", 0),),
        ),
        StepSpec(2**40, 5, (), k=4, num_sampled=(), signals=(("e0", "kv_sent", 2**63),)),
        StepSpec(
            2**40 + 1,
            5,
            (("e0", 1), ("e1", 1), ("e2", 1)),
            k=4,
            num_sampled=(1, 1, 1),
            finished=e012,
            downstream=e012,
        ),
    )
    return _scenario(
        "edge_shapes",
        "every dtype, zero-width and 1-D tensors, requests with no scheduled rows, zero sampled tokens, "
        "NaN/Inf/-0/subnormal bit patterns, step ids past 2**32",
        3003,
        (edges,),
        steps,
    )


def _batch_pipeline() -> Scenario:
    bulk = StageSpec(
        2,
        "bulk",
        (
            TensorSpec(HIDDEN_STATES, PER_TOKEN, _F32, (16,)),
            TensorSpec("frames", PER_REQUEST, _BF16, (32,)),
            TensorSpec(SAMPLED_TOKEN_IDS, PER_REQUEST, _I64),
        ),
        (
            (HIDDEN_STATES, "hidden", INTER_STAGE, SELECT_ALL),
            ("frames", "frames", CLIENT, SELECT_ALL),
            (SAMPLED_TOKEN_IDS, "tokens", CLIENT, SELECT_ALL),
        ),
    )
    rng = np.random.Generator(np.random.PCG64(4040))
    rids = [f"q{i:02d}" for i in range(12)]
    steps, step_id = [], 0
    for i in range(24):
        step_id += int(rng.integers(1, 4))
        big = i % 5 == 0
        reqs = tuple((r, int(rng.integers(8, 25) if big else rng.integers(1, 4))) for r in rids)
        down = tuple(r for r in rids if rng.random() < 0.6)
        fin = tuple(r for r in rids if rng.random() < 0.1)
        num = tuple(int(x) for x in rng.integers(1, 3, size=len(rids)))
        steps.append(
            StepSpec(
                step_id,
                2,
                reqs,
                k=2,
                num_sampled=num,
                downstream=down,
                finished=fin,
                signals=(("q00", "chunk_ready", step_id),),
            )
        )
    return _scenario(
        "batch_pipeline",
        "24 steps of 12 requests with large and small steps mixed, for pipelined implementations: "
        "answers must stay in step order",
        4004,
        (bulk,),
        steps,
    )


SCENARIOS = (_omni_thinker_talker, _tts_talker, _edge_shapes, _batch_pipeline)


def generate() -> list[Scenario]:
    """Every scenario of the kit, generated in memory."""
    return [make() for make in SCENARIOS]


# --------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------


def write_golden(out_dir: str | Path) -> list[Path]:
    """Write every scenario and the manifest into `out_dir`; return the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written, entries = [], []
    for sc in generate():
        files = {}
        for kind, data in (("requests", sc.requests_bytes()), ("expected", sc.expected_bytes())):
            path = out / f"{sc.name}.{kind}.binpb"
            path.write_bytes(data)
            written.append(path)
            files[kind] = {
                "file": path.name,
                "sha256": hashlib.sha256(data).hexdigest(),
                "bytes": len(data),
            }
        entries.append(
            {
                "name": sc.name,
                "description": sc.description,
                "seed": sc.seed,
                "stages": [{"stage_id": p.stage_id, "name": p.name} for p in sc.plans.values()],
                "steps": [s.step_id for s in sc.snapshots],
                **files,
            }
        )
    manifest = {
        "format": FORMAT,
        "contract": CONTRACT,
        "framing": "varint length-delimited protobuf messages",
        "requests_message": "omni_serving.v1.MaterializeRequest (open first, then snapshots)",
        "expected_message": "omni_serving.v1.MaterializeResponse (one per snapshot, released_slots empty)",
        "generator": "scripts/gen_golden.py",
        "scenarios": entries,
    }
    path = out / MANIFEST
    path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    written.append(path)
    return written


class GoldenError(Exception):
    """The golden files are missing, corrupt or of another format."""


def load_golden(golden_dir: str | Path) -> list[Scenario]:
    """Read the scenarios written by `write_golden`, checking the manifest's hashes."""
    root = Path(golden_dir)
    try:
        manifest = json.loads((root / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise GoldenError(f"{root / MANIFEST}: {exc}") from exc
    if manifest.get("format") != FORMAT or manifest.get("contract") != CONTRACT:
        raise GoldenError(
            f"{root / MANIFEST}: format {manifest.get('format')} / {manifest.get('contract')} not supported"
        )
    scenarios = []
    for entry in manifest["scenarios"]:
        blobs = {}
        for kind in ("requests", "expected"):
            path = root / entry[kind]["file"]
            data = path.read_bytes()
            if hashlib.sha256(data).hexdigest() != entry[kind]["sha256"]:
                raise GoldenError(f"{path}: sha256 differs from the manifest")
            blobs[kind] = data
        reqs = [
            materializer_pb2.MaterializeRequest.FromString(b)
            for b in decode_delimited(blobs["requests"])
        ]
        expected = [
            materializer_pb2.MaterializeResponse.FromString(b)
            for b in decode_delimited(blobs["expected"])
        ]
        if not reqs or reqs[0].WhichOneof("kind") != "open" or len(reqs) - 1 != len(expected):
            raise GoldenError(f"{entry['name']}: requests and expected answers do not pair up")
        scenarios.append(
            Scenario(
                entry["name"],
                entry["description"],
                entry["seed"],
                reqs[0],
                [r.snapshot for r in reqs[1:]],
                expected,
            )
        )
    return scenarios


def snapshot_tensors(snap: snapshot_pb2.StepSnapshot) -> list[tuple[str, tensor_pb2.TensorRef]]:
    """(field path, TensorRef) of every tensor a snapshot carries, set or not skipped."""
    out = []
    for name in (
        "sampled_token_ids",
        "logprobs",
        "prompt_logprobs",
        "query_start_loc",
        "hidden_states",
    ):
        if snap.HasField(name):
            out.append((name, getattr(snap, name)))
    for i, st in enumerate(snap.multimodal_outputs):
        out.append((f"multimodal_outputs[{i}]", st.tensor))
    return out


def inline_tensor(ref: tensor_pb2.TensorRef) -> torch.Tensor:
    """The torch tensor of an inline TensorRef (a read-only view)."""
    return decode_inline(ref)
