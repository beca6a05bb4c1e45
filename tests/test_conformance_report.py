"""The conformance kit's reports: field-path diffs, equivalence after
normalisation, `--explain`, contract-version-2 checks and their skips, and
the documentation of strict-mode phrases kept in step with the kit."""

from __future__ import annotations

import os
import re
import time
import uuid
from pathlib import Path

import grpc
import pytest

from materializer_svc.conformance import main, run_conformance, summary, vectors
from materializer_svc.conformance.cases import ALL_CASES
from materializer_svc.conformance.checks import SKIPPED_V1, V2_CHECKS
from materializer_svc.conformance.compare import first_difference, normalise
from materializer_svc.conformance.harness import InProcessServer
from materializer_svc.reference import ReferenceMaterializer
from materializer_svc.registry import MaterializerConfig
from omni_common.shm_arena import ENTRY_BYTES, HEADER, HEADER_BYTES, MAGIC, SHM_DIR, VERSION
from omni_serving.v1 import materializer_pb2, tensor_pb2

REPO = Path(__file__).resolve().parent.parent
GOLDEN = REPO / "materializer_svc" / "conformance" / "golden"
DOC = REPO / "docs" / "writing-a-materializer.md"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")


def _run(servicer_cls, tmp_path, only, **kw):
    deployment = f"rep{os.getpid()}"
    with InProcessServer(
        servicer_cls(MaterializerConfig(shm_prefix=f"omni-{deployment}")),
        f"unix://{tmp_path}/m.sock",
    ) as srv:
        return run_conformance(srv.target, deployment, only=only, timeout_s=5, **kw)


def _by_name(results):
    return {r.name: r for r in results}


# -- fakes: implementations that are wrong (or right) in one known way ----------------------


class FakeSwapsShapes(ReferenceMaterializer):
    """Fake: reverses the shape of every 2-D client tensor (bytes untouched)."""

    async def answers(self, session, it):
        async for resp in super().answers(session, it):
            for req in resp.step.requests:
                for nt in req.client.tensors:
                    if len(nt.tensor.shape) == 2:
                        nt.tensor.shape.reverse()
            yield resp


class FakeFlipsOneBit(ReferenceMaterializer):
    """Fake: flips the lowest bit of byte 0 of every inter-stage tensor."""

    async def answers(self, session, it):
        async for resp in super().answers(session, it):
            for req in resp.step.requests:
                for nt in req.inter_stage.tensors:
                    if nt.tensor.inline_data:
                        data = bytearray(nt.tensor.inline_data)
                        data[0] ^= 1
                        nt.tensor.inline_data = bytes(data)
            yield resp


class FakeSetButEmptyPayloads(ReferenceMaterializer):
    """Fake: sets every payload, even an empty one, and adds a field the
    protos do not know (number 99). Equivalent to the reference's answers."""

    async def answers(self, session, it):
        async for resp in super().answers(session, it):
            for req in resp.step.requests:
                req.inter_stage.SetInParent()
                req.client.SetInParent()
                req.MergeFromString(b"\x98\x06\x01")  # field 99, varint 1
            yield resp


class FakeDrainsV1Senders(ReferenceMaterializer):
    """Fake: sends StreamDraining to a sender that did not ask for contract 2."""

    async def answers(self, session, it):
        yield materializer_pb2.MaterializeResponse(
            draining=materializer_pb2.StreamDraining(reason="fake")
        )
        async for resp in super().answers(session, it):
            yield resp


def _v1_info(resp: materializer_pb2.GetMaterializerInfoResponse) -> None:
    for name in (
        "instance_id",
        "start_time_unix_ms",
        "contract_version",
        "supports_drain",
        "draining",
        "arena_probe",
    ):
        resp.ClearField(name)


class FakeV1(ReferenceMaterializer):
    """Fake: a contract-version-1 implementation (no identity, no probe)."""

    async def GetMaterializerInfo(self, request, context):
        resp = await super().GetMaterializerInfo(
            materializer_pb2.GetMaterializerInfoRequest(), context
        )
        _v1_info(resp)
        return resp


def fake_probe(name: str, prefix: str) -> int:
    """The documented arena-probe rules, written out independently of the reference."""
    R = materializer_pb2
    if not name:
        return R.ARENA_PROBE_RESULT_UNSPECIFIED
    if ".." in name or not _NAME.match(name) or not name.startswith(f"{prefix}-arena-"):
        return R.ARENA_PROBE_RESULT_INVALID
    try:
        with open(SHM_DIR / name, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return R.ARENA_PROBE_RESULT_NOT_FOUND
    except OSError:
        return R.ARENA_PROBE_RESULT_INVALID
    if len(data) < HEADER_BYTES:
        return R.ARENA_PROBE_RESULT_INVALID
    magic, version, num_slots, slot_bytes, data_offset = HEADER.unpack_from(data, 0)
    if magic != MAGIC or version != VERSION:
        return R.ARENA_PROBE_RESULT_INVALID
    if data_offset < HEADER_BYTES + ENTRY_BYTES * num_slots:
        return R.ARENA_PROBE_RESULT_INVALID
    if data_offset + num_slots * slot_bytes > len(data):
        return R.ARENA_PROBE_RESULT_INVALID
    return R.ARENA_PROBE_RESULT_MAPPED


class FakeV2(ReferenceMaterializer):
    """Fake: a contract-version-2 implementation following the docs."""

    instance = str(uuid.uuid4())
    started_ms = int(time.time() * 1000)

    async def GetMaterializerInfo(self, request, context):
        resp = await super().GetMaterializerInfo(
            materializer_pb2.GetMaterializerInfoRequest(), context
        )
        _v1_info(resp)
        resp.instance_id = self.instance
        resp.start_time_unix_ms = self.started_ms
        resp.contract_version = 2
        resp.arena_probe = fake_probe(request.arena_probe, self.reader.prefix)
        return resp


class FakeV2NoInstanceId(FakeV2):
    instance = ""


class FakeV2FromTheFuture(FakeV2):
    started_ms = int(time.time() * 1000) + 3_600_000


class FakeV2ProbeSaysMapped(FakeV2):
    """Fake: answers MAPPED to any probe without looking."""

    async def GetMaterializerInfo(self, request, context):
        resp = await super().GetMaterializerInfo(request, context)
        if request.arena_probe:
            resp.arena_probe = materializer_pb2.ARENA_PROBE_RESULT_MAPPED
        return resp


# -- field-path diffs ------------------------------------------------------------------------


def _first_2d_client_tensor(sc: vectors.Scenario) -> tuple[str, list[int]]:
    for i, want in enumerate(sc.expected):
        for r, req in enumerate(want.step.requests):
            for t, nt in enumerate(req.client.tensors):
                if len(nt.tensor.shape) == 2:
                    path = f"answers[{i}].step.requests[{r}].client.tensors[{t}].tensor.shape"
                    return path, list(nt.tensor.shape)
    raise AssertionError("no 2-D client tensor in the scenario")


def test_a_wrong_shape_is_reported_at_its_field_path_with_both_values(tmp_path):
    sc = next(s for s in vectors.load_golden(GOLDEN) if s.name == "omni_thinker_talker")
    path, shape = _first_2d_client_tensor(sc)
    assert shape[0] != shape[1]
    results = _by_name(_run(FakeSwapsShapes, tmp_path, ["golden/inline/omni_thinker_talker"]))
    r = results["golden/inline/omni_thinker_talker"]
    assert not r.passed
    assert r.detail.startswith(
        f"{path}: expected [{shape[0]}, {shape[1]}], got [{shape[1]}, {shape[0]}]"
    ), r.detail
    assert "serialized bytes differ" not in r.detail


def test_a_wrong_element_is_reported_with_its_index_and_decoded_values(tmp_path):
    results = _by_name(_run(FakeFlipsOneBit, tmp_path, ["golden/inline/tts_talker"]))
    r = results["golden/inline/tts_talker"]
    assert not r.passed
    # tts_talker: step 100, request r0's first inter-stage tensor is int64 codec codes.
    m = re.match(
        r"answers\[0\]\.step\.requests\[0\]\.inter_stage\.tensors\[0\]\.tensor\.inline_data: "
        r"element \[0, 0\]: expected (-?\d+), got (-?\d+) \(1 of \d+ elements differ\)",
        r.detail,
    )
    assert m, r.detail
    assert int(m.group(1)) ^ int(m.group(2)) == 1


def test_first_difference_names_oneofs_lengths_enums_and_float_bits():
    sc = next(s for s in vectors.load_golden(GOLDEN) if s.name == "edge_shapes")
    want = sc.expected[0]
    got = materializer_pb2.MaterializeResponse()
    got.CopyFrom(want)
    assert first_difference(want, got, "answers[0]") is None
    got.step.requests[0].client.tensors[0].tensor.dtype = tensor_pb2.D_TYPE_FLOAT16
    assert first_difference(want, got, "a") == (
        "a.step.requests[0].client.tensors[0].tensor.dtype: expected D_TYPE_BOOL, got D_TYPE_FLOAT16"
    )
    got.CopyFrom(want)
    del got.step.requests[-1]
    d = first_difference(want, got, "a")
    assert d.startswith("a.step.requests: expected 3 entries, got 2 (missing a.step.requests[2] ")
    got = materializer_pb2.MaterializeResponse(
        error=materializer_pb2.StepError(step_id=0, stage_id=5, code=3, message="boom")
    )
    assert first_difference(want, got, "a").startswith("a: expected step MaterializedStep {")
    assert "got error StepError {step_id: 0, stage_id: 5, code: INVALID_ARGUMENT" in (
        first_difference(want, got, "a")
    )
    # float32 elements: bit patterns are compared and shown (-0.0 is not 0.0).
    w = materializer_pb2.MaterializedStep()
    t = w.requests.add(request_id="x").client.tensors.add(name="f").tensor
    t.dtype, t.inline_data = 1, b"\x00\x00\x00\x00"
    t.shape.append(1)
    g = materializer_pb2.MaterializedStep()
    g.CopyFrom(w)
    g.requests[0].client.tensors[0].tensor.inline_data = b"\x00\x00\x00\x80"
    assert first_difference(w, g) == (
        "requests[0].client.tensors[0].tensor.inline_data: element [0]: "
        "expected 0.0 (bits 0x00000000), got -0.0 (bits 0x80000000) (1 of 1 elements differ)"
    )


def test_wrong_code_and_message_reports_name_the_field(tmp_path):
    class FakeInternalForEverything(ReferenceMaterializer):
        async def answers(self, session, it):
            async for resp in super().answers(session, it):
                if resp.HasField("error"):
                    resp.error.code = grpc.StatusCode.INTERNAL.value[0]
                    resp.error.message = "oops"
                yield resp

    r = _by_name(_run(FakeInternalForEverything, tmp_path, ["handle/stale_generation"]))
    detail = r["handle/stale_generation"].detail
    assert detail == "error.code: expected ABORTED, got INTERNAL (message 'oops')", detail

    class FakeTerseMessages(ReferenceMaterializer):
        async def answers(self, session, it):
            async for resp in super().answers(session, it):
                if resp.HasField("error"):
                    resp.error.message = "bad step"
                yield resp

    r = _by_name(
        _run(FakeTerseMessages, tmp_path, ["step/step_id_not_increasing"], strict_messages=True)
    )
    assert r["step/step_id_not_increasing"].detail == (
        "error.message: expected it to contain 'is not after' (--strict-messages), got 'bad step'"
    )


# -- equivalence -----------------------------------------------------------------------------


def test_set_but_empty_payloads_and_unknown_fields_are_equivalent(tmp_path):
    scenarios = vectors.load_golden(GOLDEN)
    unset = [
        (sc.name, i)
        for sc in scenarios
        for i, w in enumerate(sc.expected)
        for req in w.step.requests
        if not req.HasField("inter_stage") or not req.HasField("client")
    ]
    assert unset, "the golden answers should have unset payloads (the canonical empty payload)"
    # The fake's answers really are different bytes...
    want = next(w for sc in scenarios for w in sc.expected if w.step.requests)
    got = materializer_pb2.MaterializeResponse()
    got.CopyFrom(want)
    for req in got.step.requests:
        req.inter_stage.SetInParent()
        req.client.SetInParent()
    assert got.SerializeToString(deterministic=True) != want.SerializeToString(deterministic=True)
    # ...and equal after normalisation.
    assert first_difference(want, got) is None
    assert normalise(got).SerializeToString(deterministic=True) == want.SerializeToString(
        deterministic=True
    )
    only = [f"golden/{m}/{sc.name}" for m in ("inline", "shm") for sc in scenarios]
    results = _run(FakeSetButEmptyPayloads, tmp_path, only + ["golden/slot_releases"])
    assert all(r.passed for r in results), (
        summary(results) + "\n" + "\n".join(r.line() for r in results if not r.passed)
    )
    assert len(results) == len(only) + 3  # + info, golden/load, golden/slot_releases


def test_metadata_is_not_equivalent_to_nothing():
    w = materializer_pb2.RequestPayloads(request_id="a")
    g = materializer_pb2.RequestPayloads(request_id="a")
    g.client.metadata["sample_rate"].int_value = 24000
    assert first_difference(w, g) == (
        'client: expected unset, got MultimodalPayload {metadata: {"sample_rate"}}'
    )


def test_stream_draining_to_a_contract_1_sender_fails(tmp_path):
    r = _by_name(_run(FakeDrainsV1Senders, tmp_path, ["golden/inline/tts_talker"]))
    assert not r["golden/inline/tts_talker"].passed
    assert "StreamDraining" in r["golden/inline/tts_talker"].detail


# -- contract version 2 ----------------------------------------------------------------------


def test_v2_checks_are_skipped_for_a_contract_1_implementation(tmp_path, capsys):
    results = _run(FakeV1, tmp_path, ["v2/"])
    v2 = [r for r in results if r.name.startswith("v2/")]
    assert [r.name for r in v2] == V2_CHECKS
    assert all(r.skipped and r.passed and r.detail == SKIPPED_V1 for r in v2)
    assert summary(results) == f"conformance: 1 passed, 0 failed, {len(V2_CHECKS)} skipped"
    assert all(r.line().startswith("SKIP  v2/") for r in v2)
    deployment = f"cli1{os.getpid()}"
    with InProcessServer(
        FakeV1(MaterializerConfig(shm_prefix=f"omni-{deployment}")), f"unix://{tmp_path}/c.sock"
    ) as srv:
        assert main(["--target", srv.target, "--deployment", deployment, "--only", "v2/"]) == 0
    out = capsys.readouterr().out
    assert "SKIP  v2/arena_probe/mapped" in out
    assert "skipped: implementation reports contract_version 1" in out


def test_v2_checks_pass_for_an_implementation_that_follows_the_docs(tmp_path):
    results = _run(FakeV2, tmp_path, ["v2/"])
    assert [r.name for r in results] == ["info", *V2_CHECKS]
    assert all(r.passed and not r.skipped for r in results), "\n".join(r.line() for r in results)


@pytest.mark.parametrize(
    ("fake", "failing", "words"),
    [
        (FakeV2NoInstanceId, {"v2/identity"}, "instance_id: expected a non-empty id"),
        (FakeV2FromTheFuture, {"v2/identity"}, "start_time_unix_ms: expected Unix epoch"),
        (
            FakeV2ProbeSaysMapped,
            {
                f"v2/arena_probe/{k}"
                for k in (
                    "not_found",
                    "not_an_arena",
                    "short_segment",
                    "wrong_version",
                    "inconsistent_header",
                    "outside_prefix",
                    "malformed_name",
                )
            },
            "expected ARENA_PROBE_RESULT_",
        ),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else None,
)
def test_v2_checks_catch_a_wrong_implementation(tmp_path, fake, failing, words):
    results = _run(fake, tmp_path, ["v2/"])
    failed = {r.name: r.detail for r in results if not r.passed}
    assert set(failed) == failing, failed
    assert all(words in d for d in failed.values()), failed


# -- --explain and --list --------------------------------------------------------------------


def test_explain_prints_what_a_check_sends_and_expects(capsys):
    assert main(["--explain", "handle/stale_generation", "--deployment", f"ex{os.getpid()}"]) == 0
    out = capsys.readouterr().out
    assert "handle/stale_generation: the writer reused the slot" in out
    assert "snapshot:" in out and "shm {region: " in out and "float32 [4, 4]" in out
    assert "code: ABORTED (10)" in out
    assert "must contain 'stale'" in out
    assert main(["--explain", "golden/inline/edge_shapes"]) == 0
    out = capsys.readouterr().out
    assert "expected answers[0]" in out and "inline [" in out and "open:" in out
    assert "equivalent to the golden answer after normalisation" in out
    assert main(["--explain", "v2/arena_probe/wrong_version"]) == 0
    out = capsys.readouterr().out
    assert "ARENA_PROBE_RESULT_INVALID" in out and SKIPPED_V1 in out
    assert main(["--explain", "open/"]) == 0
    out = capsys.readouterr().out
    assert all(f"open/{k}:" in out for k in ("wrong_prefix", "not_first", "missing", "twice"))
    assert main(["--explain", "no/such/check"]) == 2
    assert "no check is named" in capsys.readouterr().err


def test_every_check_can_be_explained(capsys):
    assert main(["--list"]) == 0
    names = capsys.readouterr().out.split()
    assert set(V2_CHECKS) <= set(names)
    for name in names:
        assert main(["--explain", name, "--deployment", f"ex{os.getpid()}"]) == 0, name
        out = capsys.readouterr().out
        assert out.startswith(f"{name}:") and "Expects" in out, name


# -- the docs keep up with the kit -------------------------------------------------------------


def test_the_strict_message_table_lists_every_case_with_its_code_and_phrase():
    text = DOC.read_text()
    rows = {}
    for line in text.splitlines():
        m = re.match(
            r"\|\s*`((?:handle|tensor|step)/[a-z0-9_]+)`\s*\|([^|]*)\|\s*`([A-Z_]+)`\s*\|\s*`([^`]+)`\s*\|",
            line,
        )
        if m:
            rows[m.group(1)] = (m.group(3), m.group(4))
    want = {c.name: (c.code.name, c.hint) for c in ALL_CASES}
    assert rows == want


def test_the_docs_name_every_check_family():
    text = DOC.read_text()
    for name in (
        "info",
        "v2/identity",
        "v2/arena_probe/",
        "open/",
        "golden/inline/",
        "golden/shm/",
        "golden/connector_signals",
        "golden/slot_releases",
        "readiness/late_mark",
        "stream/cancel_then_reconnect",
        "stream/concurrent_isolation",
        "info/counters",
    ):
        assert f"`{name}" in text, name
