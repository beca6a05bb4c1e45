"""The per-step dispatch and per-stream rules, in-process (no server)."""

from __future__ import annotations

import logging
import os
import time

import grpc
import numpy as np
import pytest
import torch

from materializer_svc.conformance.cases import make_probe, probe_plan
from materializer_svc.conformance.client import place
from materializer_svc.session import (
    MaterializerCounters,
    StreamSession,
    _resolver,
    materialize_step,
    releases_of,
    session_from_first,
)
from omni_common.errors import FailedPreconditionError, InvalidArgumentError
from omni_common.materialize import (
    PER_REQUEST,
    PER_TOKEN,
    SAMPLED_TOKEN_IDS,
    build_local_step,
    build_step,
    inline_resolver,
    view_from_snapshot,
    view_from_tensors,
)
from omni_common.shm_arena import ArenaReader, ShmArena
from omni_common.tensor_wire import encode_inline
from omni_serving.v1 import materializer_pb2, snapshot_pb2, tensor_pb2

PREFIX = f"omni-sess{os.getpid()}"


def opening(**kw) -> materializer_pb2.MaterializeStreamOpen:
    return materializer_pb2.MaterializeStreamOpen(shm_prefix=PREFIX, stages=[probe_plan()], **kw)


@pytest.fixture
def arena():
    with ShmArena(PREFIX, 4, 64 * 1024) as a:
        yield a


@pytest.fixture
def reader():
    r = ArenaReader(PREFIX)
    yield r
    r.close()


def code_of(resp: materializer_pb2.MaterializeResponse) -> grpc.StatusCode:
    return next(c for c in grpc.StatusCode if c.value[0] == resp.error.code)


def test_releases_are_distinct_and_in_order():
    snap = snapshot_pb2.StepSnapshot()
    for region, slot, gen in [("a", 1, 1), ("a", 1, 1), ("b", 0, 3), ("a", 1, 2)]:
        snap.multimodal_outputs.add(
            name=f"t{len(snap.multimodal_outputs)}",
            tensor=tensor_pb2.TensorRef(
                shm=tensor_pb2.ShmHandle(region=region, slot=slot, generation=gen)
            ),
        )
    snap.hidden_states.inline_data = b""
    got = [(r.region, r.slot, r.generation) for r in releases_of(snap)]
    assert got == [("a", 1, 1), ("b", 0, 3), ("a", 1, 2)]


def test_shared_memory_is_read_without_copying(arena, reader):
    placed = place(arena, make_probe(1).snapshot)
    read = []
    view = view_from_snapshot(
        placed.snapshot, _resolver(reader, time.monotonic() + 1, True, read), None
    )
    mm = reader._regions[arena.name].mm
    lo = np.frombuffer(mm, dtype=np.uint8).ctypes.data
    for name, t in view.tensors.items():
        addr = t.array.ctypes.data
        assert lo <= addr < lo + len(mm), f"{name} was copied out of the arena"
    assert len(read) == 2
    del view


def test_materialize_step_answers_a_builder_bug_in_band(arena, reader, caplog):
    placed = place(arena, make_probe(1).snapshot)

    def broken(view, plan):
        raise RuntimeError("boom")

    with caplog.at_level(logging.ERROR):
        resp = materialize_step(
            placed.snapshot, probe_plan(), reader, time.monotonic() + 1, builder=broken
        )
    assert code_of(resp) == grpc.StatusCode.INTERNAL, resp
    # the exception's text stays in the log, under the error id the message names
    message = resp.error.message
    assert "boom" not in message and message.startswith("internal error (error id "), message
    error_id = message.split("error id ", 1)[1].split(")", 1)[0]
    assert [(r.region, r.slot, r.generation) for r in resp.error.released_slots] == [placed.release]
    logged = [r for r in caplog.records if error_id in r.getMessage()]
    assert logged and logged[0].exc_info and "boom" in str(logged[0].exc_info[1]), (
        "INTERNAL errors log their traceback under the error id"
    )


def test_client_errors_are_not_logged_as_tracebacks(arena, reader, caplog):
    snap = make_probe(1).snapshot
    snap.multimodal_outputs[0].tensor.dtype = 99
    with caplog.at_level(logging.ERROR):
        resp = materialize_step(snap, probe_plan(), reader, time.monotonic() + 1)
    assert code_of(resp) == grpc.StatusCode.INVALID_ARGUMENT
    assert not caplog.records


def test_session_refuses_another_prefix_and_duplicate_stages(reader):
    with pytest.raises(FailedPreconditionError, match="open.shm_prefix"):
        StreamSession(materializer_pb2.MaterializeStreamOpen(shm_prefix="omni-other"), reader)
    dup = opening()
    dup.stages.append(probe_plan())
    with pytest.raises(InvalidArgumentError, match="declared twice"):
        StreamSession(dup, reader)
    with pytest.raises(InvalidArgumentError, match="must be `open`"):
        session_from_first(
            materializer_pb2.MaterializeRequest(snapshot=make_probe(1).snapshot), reader
        )
    with pytest.raises(InvalidArgumentError, match="closed before the open"):
        session_from_first(None, reader)


def test_session_ordering_rules(reader):
    session = StreamSession(opening(readiness_timeout_ms=1234), reader)
    assert session.timeout_s == pytest.approx(1.234)
    ok = make_probe(5).snapshot
    assert session.admit(ok).stage_id == 0
    again = session.materialize(make_probe(5).snapshot)
    assert (
        code_of(again) == grpc.StatusCode.INVALID_ARGUMENT
        and "not after the previous step 5" in again.error.message
    )
    undeclared = make_probe(9).snapshot
    undeclared.stage_id = 3
    assert "not declared" in session.materialize(undeclared).error.message
    assert session.materialize(make_probe(6).snapshot).HasField("step"), (
        "sparse, increasing ids are fine"
    )


def test_default_readiness_timeout_applies_when_open_leaves_it_unset(reader):
    assert StreamSession(
        opening(), reader, default_readiness_timeout_ms=700
    ).timeout_s == pytest.approx(0.7)


def test_counters_record_answers():
    c = MaterializerCounters()
    c.record(materializer_pb2.MaterializeResponse(step=make_probe(1).expected))
    c.record(materializer_pb2.MaterializeResponse(error=materializer_pb2.StepError(code=10)))
    d = c.as_dict()
    assert (d["steps_materialized"], d["steps_failed"], d["failed_by_code"]) == (
        1,
        1,
        {"ABORTED": 1},
    )
    assert d["payload_bytes"] > 0


# -- builder validation (omni_common.materialize) ----------------------------------------


def _view(tensors, n=2, num_sampled=None, spans=None):
    rids = [f"r{i}" for i in range(n)]
    return view_from_tensors(
        step_id=1,
        stage_id=0,
        request_ids=rids,
        spans=spans or [(i, i + 1) for i in range(n)],
        num_sampled_tokens=num_sampled or [1] * n,
        finished_request_ids=[],
        downstream_request_ids=rids,
        tensors=tensors,
    )


def _plan(source, selection=1):
    return materializer_pb2.StagePlan(
        routes=[
            materializer_pb2.PayloadRoute(
                source=source, key="k", destination=1, selection=selection
            )
        ]
    )


@pytest.mark.parametrize(
    ("tensors", "source", "kw", "words"),
    [
        ({"codes": (torch.zeros(1, 3), PER_REQUEST)}, "codes", {}, "has 1 rows for 2 requests"),
        (
            {SAMPLED_TOKEN_IDS: (torch.zeros(2, dtype=torch.int64), PER_REQUEST)},
            SAMPLED_TOKEN_IDS,
            {},
            "must be [num_requests, max_tokens]",
        ),
        (
            {SAMPLED_TOKEN_IDS: (torch.zeros(2, 1, dtype=torch.int64), PER_REQUEST)},
            SAMPLED_TOKEN_IDS,
            {"num_sampled": [1, 2]},
            "sampled_token_ids has 1 columns",
        ),
        ({"x": (torch.tensor(1.0), PER_TOKEN)}, "x", {}, "needs a row dimension"),
        ({"x": (torch.zeros(2, 4), PER_TOKEN)}, "x", {"spans": [(0, 1), (1, 3)]}, "is past 2 rows"),
    ],
    ids=["per_request_short", "sampled_1d", "sampled_too_few_columns", "scalar", "span_past_rows"],
)
def test_builder_refuses_tensors_that_cannot_cover_the_batch(tensors, source, kw, words):
    with pytest.raises(InvalidArgumentError) as info:
        build_step(_view(tensors, **kw), _plan(source))
    assert words in str(info.value)


def test_per_request_rows_keep_a_leading_dim_of_one_and_sampled_ids_are_trimmed():
    sampled = torch.tensor([[7, 8, -1], [9, -1, -1]])
    codes = torch.arange(6, dtype=torch.int64).reshape(2, 3)
    view = _view(
        {SAMPLED_TOKEN_IDS: (sampled, PER_REQUEST), "codes": (codes, PER_REQUEST)},
        num_sampled=[2, 1],
    )
    plan = materializer_pb2.StagePlan(
        routes=[
            materializer_pb2.PayloadRoute(
                source=SAMPLED_TOKEN_IDS, key="all", destination=2, selection=1
            ),
            materializer_pb2.PayloadRoute(
                source=SAMPLED_TOKEN_IDS, key="last", destination=2, selection=2
            ),
            materializer_pb2.PayloadRoute(source="codes", key="codes", destination=2, selection=2),
        ]
    )
    step = build_step(view, plan)
    shapes = [[list(t.tensor.shape) for t in r.client.tensors] for r in step.requests]
    assert shapes == [[[2], [1], [1, 3]], [[1], [1], [1, 3]]], f"{shapes=}"


@pytest.mark.parametrize("downstream", [["r0", "r1", "r2"], ["r1"]], ids=["all", "partial"])
def test_the_tensor_builder_routes_what_the_message_builder_encodes(downstream):
    """The in-process paths (build_local_step) and the wire path (build_step)
    share their slicing: the tensor step, encoded, is the same message."""
    rids = ["r0", "r1", "r2"]
    hidden = torch.randn(7, 5).to(torch.bfloat16)
    view = view_from_tensors(
        step_id=3,
        stage_id=1,
        request_ids=rids,
        spans=[(0, 4), (4, 5), (5, 7)],
        num_sampled_tokens=[2, 1, 1],
        finished_request_ids=["r1"],
        downstream_request_ids=downstream,
        tensors={
            SAMPLED_TOKEN_IDS: (torch.tensor([[7, 8], [9, -1], [4, -1]]), PER_REQUEST),
            "hidden": (hidden, PER_TOKEN),
            "codes": (torch.arange(12, dtype=torch.int64).reshape(3, 4), PER_REQUEST),
        },
    )
    route = materializer_pb2.PayloadRoute
    plan = materializer_pb2.StagePlan(
        routes=[
            route(source="hidden", key="h_all", destination=1, selection=1),
            route(source=SAMPLED_TOKEN_IDS, key="ids", destination=2, selection=1),
            route(source="hidden", key="h_last", destination=2, selection=2),
            route(source="codes", key="codes", destination=1, selection=2),
        ]
    )
    wire = build_step(view, plan).SerializeToString(deterministic=True)
    local = build_local_step(view, plan)
    assert local.to_proto().SerializeToString(deterministic=True) == wire
    assert [r.request_id for r in local.requests] == rids
    assert [r.finished for r in local.requests] == [False, True, False]
    for r in local.requests:
        assert [name for name, _ in r.client] == ["ids", "h_last"]
        assert sorted(r.inter_stage) == (["codes", "h_all"] if r.request_id in downstream else [])
    assert torch.equal(local.requests[0].inter_stage.get("h_all", hidden[:4]), hidden[:4])
    # no client route (a thinker's or talker's plan): the client payload stays unset in both
    inter_only = materializer_pb2.StagePlan(routes=[plan.routes[0], plan.routes[3]])
    wire = build_step(view, inter_only).SerializeToString(deterministic=True)
    assert build_local_step(view, inter_only).to_proto().SerializeToString(deterministic=True) == wire


def test_duplicate_step_tensor_names_are_refused():
    snap = make_probe(1).snapshot
    snap.multimodal_outputs.add(
        name="probe", layout=PER_TOKEN, tensor=encode_inline(torch.zeros(4, 4))
    )
    with pytest.raises(InvalidArgumentError, match="a second step tensor named 'probe'"):
        view_from_snapshot(snap, inline_resolver)


def test_registry_loads_an_implementation_from_a_named_module(tmp_path, monkeypatch):
    from materializer_svc import registry

    (tmp_path / "my_materializer.py").write_text(
        "from materializer_svc.reference import ReferenceMaterializer\n"
        "from materializer_svc.registry import register\n"
        "class Mine(ReferenceMaterializer):\n"
        "    implementation = 'mine'\n"
        "@register('mine')\n"
        "def _factory(config):\n"
        "    return Mine(config)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    servicer = registry.create(
        "my_materializer:mine", registry.MaterializerConfig(shm_prefix=PREFIX)
    )
    try:
        assert servicer.implementation == "mine"
        assert "mine" in registry.names()
    finally:
        servicer.close()
    with pytest.raises(SystemExit, match="cannot import"):
        registry.create("no_such_module_here:mine", registry.MaterializerConfig(shm_prefix=PREFIX))


@pytest.mark.parametrize("impl", ["reference", "pool"])
def test_counter_observers_see_every_answer_with_its_latency(tmp_path, arena, impl):
    import threading

    from materializer_svc import registry
    from materializer_svc.conformance.client import Stream, open_channel
    from materializer_svc.conformance.harness import InProcessServer

    servicer = registry.create(impl, registry.MaterializerConfig(shm_prefix=PREFIX, workers=1))
    seen = []
    servicer.counters.observers.append(
        lambda resp, seconds: seen.append((resp.WhichOneof("kind"), seconds))
    )
    with InProcessServer(servicer, f"unix://{tmp_path}/m.sock") as srv:
        channel = open_channel(srv.target)
        stream = Stream(
            channel, materializer_pb2.MaterializeRequest(open=opening(readiness_timeout_ms=3000))
        )
        late = place(arena, make_probe(1).snapshot, mark_ready=False)
        timer = threading.Timer(0.15, late.lease.mark_ready)
        timer.start()
        stream.send_snapshot(late.snapshot)
        stream.send_snapshot(make_probe(1).snapshot)  # refused: step id does not increase
        answers = [stream.recv(10), stream.recv(10)]
        stream.close_send()
        stream.wait_end(10)
        channel.close()
    timer.cancel()
    assert [a.WhichOneof("kind") for a in answers] == ["step", "error"]
    assert [k for k, _ in seen] == ["step", "error"]
    assert seen[0][1] >= 0.1, f"latency of the late step: {seen[0][1]:.3f}s"
    assert servicer.counters.as_dict()["build_seconds_total"] >= 0.1
