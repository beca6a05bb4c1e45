"""The conformance kit: both shipped implementations pass it as real processes,
their payloads equal the decoder's synchronous in-process path, the golden
vectors regenerate identically, and the kit catches broken implementations."""

from __future__ import annotations

import filecmp
import importlib.util
import os
from pathlib import Path

import grpc
import pytest

from decoder_svc.backend import StepOutput
from decoder_svc.snapshot import meta_of, step_tensors, take_snapshot
from materializer_svc.conformance import check_names, main, run_conformance, summary, vectors
from materializer_svc.conformance.checks import payload_only
from materializer_svc.conformance.client import Stream, open_channel, release_key
from materializer_svc.conformance.harness import InProcessServer, MaterializerProcess
from materializer_svc.reference import ReferenceMaterializer
from materializer_svc.registry import MaterializerConfig
from omni_common.materialize import build_step, sources_of
from omni_common.shm_arena import ShmArena, list_segments
from omni_common.tensor_wire import decode_inline
from omni_serving.v1 import materializer_pb2

REPO = Path(__file__).resolve().parent.parent
GOLDEN = REPO / "materializer_svc" / "conformance" / "golden"


def failures(results) -> str:
    return "\n".join(r.line() for r in results if not r.passed)


@pytest.fixture(scope="module", params=["reference", "pool"])
def server(request, tmp_path_factory):
    impl = request.param
    with MaterializerProcess(
        impl,
        deployment=f"conf{os.getpid()}{impl}",
        socket_dir=tmp_path_factory.mktemp(impl),
        workers=2,
    ) as proc:
        yield proc
    assert proc.proc.returncode == 0, f"{impl} did not shut down cleanly:\n{proc.log()}"


def test_implementation_passes_the_kit(server):
    results = run_conformance(server.target, server.deployment, strict_messages=True, timeout_s=20)
    assert results and all(r.passed for r in results), f"{summary(results)}\n{failures(results)}"
    assert {r.name for r in results} == set(check_names()), "the kit skipped or invented checks"
    assert list_segments(f"omni-{server.deployment}") == [], "the kit left its arena behind"


def _step_output(snap) -> StepOutput:
    """The engine-side StepOutput a decoder would have had for this snapshot."""
    tensors = {}
    for st in snap.multimodal_outputs:
        tensors[st.name] = (decode_inline(st.tensor).clone(), st.layout)
    return StepOutput(
        request_ids=list(snap.request_ids),
        batch_indices=list(snap.batch_indices),
        num_scheduled_tokens=list(snap.num_scheduled_tokens),
        query_start_loc=decode_inline(snap.query_start_loc).clone(),
        sampled_token_ids=decode_inline(snap.sampled_token_ids).clone(),
        hidden_states=decode_inline(snap.hidden_states).clone()
        if snap.HasField("hidden_states")
        else None,
        mm_outputs=tensors,
        finished={rid: "stop" for rid in snap.finished_request_ids},
    )


def test_remote_payloads_equal_the_decoders_in_process_path(server):
    """Snapshots taken by the decoder's own code (arena slots, handles): the
    materializer's answer, the in-process build and the golden answer agree byte for byte."""
    scenarios = vectors.load_golden(GOLDEN)
    channel = open_channel(server.target)
    compared = 0
    try:
        with ShmArena(f"omni-{server.deployment}", 4, 256 * 1024) as arena:
            for sc in scenarios:
                open_req = materializer_pb2.MaterializeRequest()
                open_req.CopyFrom(sc.open)
                open_req.open.shm_prefix = arena.prefix
                stream = Stream(channel, open_req)
                for snap, golden in zip(sc.snapshots, sc.expected, strict=True):
                    plan = sc.plans[snap.stage_id]
                    out = _step_output(snap)
                    meta = meta_of(
                        out,
                        step_id=snap.step_id,
                        stage_id=snap.stage_id,
                        downstream_request_ids=list(snap.downstream_request_ids),
                        connector_signals=list(snap.connector_output.signals),
                    )
                    take_snapshot(
                        meta, step_tensors(out, sources_of(plan)), arena, acquire_timeout_s=5
                    )
                    meta.num_sampled_tokens = list(snap.num_sampled_tokens) or [1] * len(
                        snap.request_ids
                    )
                    assert meta.lease is not None, "the step should fit one slot"
                    sync = build_step(meta.local_view(arena), plan).SerializeToString(
                        deterministic=True
                    )
                    stream.send_snapshot(meta.to_proto())
                    resp = stream.recv(20)
                    arena.release(meta.lease.slot, meta.lease.generation)
                    assert resp.WhichOneof("kind") == "step", (
                        f"{sc.name} step {snap.step_id}: {resp.error}"
                    )
                    remote = payload_only(resp.step).SerializeToString(deterministic=True)
                    assert remote == sync, (
                        f"{sc.name} step {snap.step_id}: remote differs from in-process"
                    )
                    assert sync == golden.step.SerializeToString(deterministic=True), (
                        f"{sc.name} step {snap.step_id}"
                    )
                    assert [release_key(r) for r in resp.step.released_slots] == [
                        (arena.name, meta.lease.slot, meta.lease.generation)
                    ]
                    compared += 1
                stream.close_send()
                assert stream.wait_end(20).code == grpc.StatusCode.OK
    finally:
        channel.close()
    assert compared == sum(len(sc.snapshots) for sc in scenarios)


# -- golden vectors ---------------------------------------------------------------------


def test_regenerating_the_golden_vectors_gives_identical_files(tmp_path):
    fresh = vectors.write_golden(tmp_path)
    names = sorted(p.name for p in fresh)
    assert names == sorted(p.name for p in GOLDEN.iterdir()), (
        "the shipped golden vectors have missing or extra files"
    )
    differ = [p.name for p in fresh if not filecmp.cmp(p, GOLDEN / p.name, shallow=False)]
    assert not differ, f"regenerated files differ: {differ}; run scripts/gen_golden.py"
    spec = importlib.util.spec_from_file_location("gen_golden", REPO / "scripts" / "gen_golden.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert gen.main(["--check", "--out", str(GOLDEN)]) == 0


def test_golden_vectors_cover_the_contract():
    scenarios = vectors.load_golden(GOLDEN)
    snaps = [s for sc in scenarios for s in sc.snapshots]
    layouts = {st.layout for s in snaps for st in s.multimodal_outputs}
    dtypes = {st.tensor.dtype for s in snaps for st in s.multimodal_outputs} | {
        s.hidden_states.dtype for s in snaps
    }
    assert layouts == {1, 2}
    assert {1, 3, 9} <= dtypes | {s.sampled_token_ids.dtype for s in snaps}, (
        "float32, bfloat16, int64"
    )
    assert len({p.stage_id for sc in scenarios for p in sc.plans.values()}) >= 3
    assert any(not s.request_ids for s in snaps), "an empty step"
    assert any(s.finished_request_ids for s in snaps)
    assert any(0 < len(s.downstream_request_ids) < len(s.request_ids) for s in snaps), (
        "partial downstream"
    )
    assert any(sp.end - sp.start > 1 for s in snaps for sp in s.scheduled_spans), "prefill spans"
    assert any(n < s.sampled_token_ids.shape[1] for s in snaps for n in s.num_sampled_tokens), (
        "trimming"
    )
    for sc in scenarios:
        ids = [s.step_id for s in sc.snapshots]
        assert ids == sorted(set(ids))
    assert any(
        b - a > 1
        for sc in scenarios
        for a, b in zip(
            [s.step_id for s in sc.snapshots][:-1],
            [s.step_id for s in sc.snapshots][1:],
            strict=True,
        )
    ), "sparse step ids"


def test_corrupt_golden_file_is_reported(tmp_path):
    for p in GOLDEN.iterdir():
        (tmp_path / p.name).write_bytes(p.read_bytes())
    victim = tmp_path / "tts_talker.expected.binpb"
    data = bytearray(victim.read_bytes())
    data[-1] ^= 1
    victim.write_bytes(bytes(data))
    with pytest.raises(vectors.GoldenError, match="sha256"):
        vectors.load_golden(tmp_path)


# -- the kit against broken implementations (in-process servers) ---------------------------


class Reordering(ReferenceMaterializer):
    async def answers(self, session, it):
        held = None
        async for resp in super().answers(session, it):
            if held is None:
                held = resp
                continue
            yield resp
            yield held
            held = None
        if held is not None:
            yield held


class ForgetsReleases(ReferenceMaterializer):
    async def answers(self, session, it):
        async for resp in super().answers(session, it):
            resp.step.ClearField("released_slots") if resp.HasField(
                "step"
            ) else resp.error.ClearField("released_slots")
            yield resp


class InternalForEverything(ReferenceMaterializer):
    async def answers(self, session, it):
        async for resp in super().answers(session, it):
            if resp.HasField("error"):
                resp.error.code = grpc.StatusCode.INTERNAL.value[0]
            yield resp


class LateSignals(ReferenceMaterializer):
    """Drains each step's connector signals into the next answer."""

    async def answers(self, session, it):
        carry: list = []
        async for resp in super().answers(session, it):
            if resp.HasField("step"):
                now = list(resp.step.connector_signals)
                del resp.step.connector_signals[:]
                resp.step.connector_signals.extend(carry)
                carry = now
            yield resp


class TruncatesBf16(ReferenceMaterializer):
    """Flips the lowest bit of every payload tensor's last byte."""

    async def answers(self, session, it):
        async for resp in super().answers(session, it):
            for req in resp.step.requests:
                for nt in list(req.client.tensors):
                    if nt.tensor.inline_data:
                        data = bytearray(nt.tensor.inline_data)
                        data[-1] ^= 1
                        nt.tensor.inline_data = bytes(data)
            yield resp


@pytest.mark.parametrize(
    ("mutant", "only", "must_fail"),
    [
        (Reordering, ["golden/inline/omni_thinker_talker"], {"golden/inline/omni_thinker_talker"}),
        (
            ForgetsReleases,
            ["golden/shm/tts_talker", "golden/slot_releases", "handle/region_unknown"],
            {"golden/slot_releases", "handle/region_unknown"},
        ),
        (
            InternalForEverything,
            ["handle/stale_generation", "step/undeclared_stage"],
            {"handle/stale_generation", "step/undeclared_stage"},
        ),
        (
            LateSignals,
            ["golden/shm/omni_thinker_talker", "golden/connector_signals"],
            {"golden/shm/omni_thinker_talker", "golden/connector_signals"},
        ),
        (TruncatesBf16, ["golden/inline/edge_shapes"], {"golden/inline/edge_shapes"}),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else None,
)
def test_kit_catches_a_broken_implementation(tmp_path, mutant, only, must_fail):
    deployment = f"mut{os.getpid()}"
    with InProcessServer(
        mutant(MaterializerConfig(shm_prefix=f"omni-{deployment}")), f"unix://{tmp_path}/m.sock"
    ) as srv:
        results = run_conformance(srv.target, deployment, only=only, timeout_s=2)
    failed = {r.name for r in results if not r.passed}
    assert must_fail <= failed, f"kit missed a broken implementation: {failed=}, want {must_fail}"
    assert "info" not in failed


def test_cli_exit_codes(tmp_path, capsys):
    assert main(["--list"]) == 0
    assert "handle/stale_generation" in capsys.readouterr().out
    assert main([]) == 2
    assert (
        main(["--target", f"unix://{tmp_path}/nobody.sock", "--deployment", "x", "--wait", "0.3"])
        == 1
    )
    assert "FAIL  connect" in capsys.readouterr().out
    deployment = f"cli{os.getpid()}"
    with InProcessServer(
        ReferenceMaterializer(MaterializerConfig(shm_prefix=f"omni-{deployment}")),
        f"unix://{tmp_path}/m.sock",
    ) as srv:
        out_json = tmp_path / "r.json"
        assert (
            main(
                [
                    "--target",
                    srv.target,
                    "--deployment",
                    deployment,
                    "--only",
                    "info",
                    "--only",
                    "open/",
                    "--json",
                    str(out_json),
                ]
            )
            == 0
        )
        out = capsys.readouterr().out
        assert "PASS  info" in out and "conformance: 7 passed, 0 failed" in out, (
            out
        )  # info, info/counters, 5 open/ checks
        assert out_json.read_text().count('"passed": true') == 7
        # Pointing the kit at the wrong deployment fails loudly (prefix mismatch).
        assert main(["--target", srv.target, "--deployment", "elsewhere", "--only", "info"]) == 1
        assert "FAIL  info" in capsys.readouterr().out


def test_run_conformance_is_usable_from_code_with_a_filter(tmp_path):
    deployment = f"api{os.getpid()}"
    with InProcessServer(
        ReferenceMaterializer(MaterializerConfig(shm_prefix=f"omni-{deployment}")),
        f"unix://{tmp_path}/m.sock",
    ) as srv:
        seen = []
        results = run_conformance(
            srv.target, deployment, only=["golden/inline/tts"], on_result=seen.append
        )
    assert [r.name for r in results] == ["info", "golden/load", "golden/inline/tts_talker"]
    assert seen == results and all(r.passed for r in results), failures(results)
