"""Transport choice: the arena probe, inline tensors to a materializer that
cannot map the arena, and the contract check before a stream is opened.

The end-to-end test runs the materializer in its own mount namespace with a
fresh /dev/shm (so the decoder's arena is invisible to it, as on another
host) and serves it on TCP; the decoder's probe comes back NOT_FOUND and it
sends inline tensors, with the same outputs and no step built in-process.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from decoder_svc.backend import RequestSpec
from decoder_svc.pipeline import Pipeline
from decoder_svc.profile import load_profile
from decoder_svc.testing.fake_engine import FakeBackend, fake_vocoder
from materializer_svc.reference import ReferenceMaterializer
from materializer_svc.registry import MaterializerConfig
from omni_common.modality import OutputModality
from omni_common.net import free_port
from omni_common.shm_arena import SHM_DIR, ShmArena, list_segments, probe_arena
from omni_serving.v1 import materializer_pb2, materializer_pb2_grpc
from tests.test_link_faults import Service, batch, check_outputs, decoder, prompt_for, wait_for
from tests.test_pipeline import Collector, ServerThread

PREFIX = f"omni-remote{os.getpid()}"


# -- the arena probe -------------------------------------------------------------------


@pytest.fixture
def arena():
    with ShmArena(PREFIX, 2, 4096) as a:
        yield a


def info_with_probe(servicer: ReferenceMaterializer, region: str):
    return asyncio.run(
        servicer.GetMaterializerInfo(
            materializer_pb2.GetMaterializerInfoRequest(arena_probe=region), None
        )
    )


def test_probe_answers(arena, tmp_path):
    servicer = ReferenceMaterializer(MaterializerConfig(shm_prefix=PREFIX))
    junk = SHM_DIR / f"{PREFIX}-arena-junk"
    other = ShmArena(f"omni-other{os.getpid()}", 1, 4096)
    try:
        junk.write_bytes(b"not an arena" * 100)
        before = {p: p.read_bytes() for p in (arena.path, junk)}
        cases = {
            arena.name: "mapped",
            f"{PREFIX}-arena-1-gone": "not_found",
            junk.name: "invalid",  # a segment, but not an arena
            other.name: "invalid",  # a valid arena outside the served prefix
            "../etc/passwd": "invalid",
        }
        for region, want in cases.items():
            assert probe_arena(region, PREFIX) == want, region
        want_enum = {
            "mapped": materializer_pb2.ARENA_PROBE_RESULT_MAPPED,
            "not_found": materializer_pb2.ARENA_PROBE_RESULT_NOT_FOUND,
            "invalid": materializer_pb2.ARENA_PROBE_RESULT_INVALID,
        }
        for region, want in cases.items():
            assert info_with_probe(servicer, region).arena_probe == want_enum[want], region
        plain = info_with_probe(servicer, "")
        assert plain.arena_probe == materializer_pb2.ARENA_PROBE_RESULT_UNSPECIFIED
        assert plain.contract == "omni_serving.v1" and plain.contract_version == 2
        assert plain.supports_drain and not plain.draining
        assert len(plain.instance_id) == 36 and plain.start_time_unix_ms > 0
        # read-only: nothing written, nothing unlinked, nothing kept mapped
        assert {p: p.read_bytes() for p in before} == before
        assert not servicer.reader._regions
        other_servicer = ReferenceMaterializer(MaterializerConfig(shm_prefix=PREFIX))
        assert other_servicer.instance_id != servicer.instance_id
    finally:
        junk.unlink(missing_ok=True)
        other.close()
        servicer.close()


# -- the contract check (in-process pipeline, test doubles of the materializer) ---------


class FakeOtherContract(ReferenceMaterializer):
    """Test double: claims another contract until `fixed` is set."""

    fixed = False

    async def GetMaterializerInfo(self, request, context):
        resp = await super().GetMaterializerInfo(request, context)
        if not self.fixed:
            resp.contract = "omni_serving.v9"
        return resp


class FakeNoInfo(ReferenceMaterializer):
    """Test double: a materializer of contract version 1 without GetMaterializerInfo."""

    async def GetMaterializerInfo(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")


def run_one(pipeline: Pipeline, rid: str) -> None:
    col = Collector()
    pipeline.submit(
        RequestSpec(
            request_id=rid, prompt=prompt_for(1, 60), seed=3, modality=OutputModality.AUDIO
        ),
        col.sink_for(rid),
    )
    col.wait(1, timeout=60)
    assert col.finish[rid] in ("stop", "length")


def test_a_materializer_of_another_contract_is_refused_then_retried(tmp_path, caplog):
    servicer = FakeOtherContract(MaterializerConfig(shm_prefix=PREFIX))
    with (
        ServerThread(f"unix://{tmp_path}/m.sock", servicer) as srv,
        ShmArena(PREFIX, 8, 1 << 20) as arena,
    ):
        pipeline = Pipeline(
            load_profile("tts"),
            {"talker": FakeBackend()},
            vocoder=fake_vocoder(load_profile("tts")),
            materializer_target=srv.target,
            shm_prefix=PREFIX,
            arena=arena,
        )
        with caplog.at_level("ERROR", logger="decoder_svc.link"):
            pipeline.start()
        try:
            link = pipeline.link
            assert not link.connected and link.attachment is None
            assert "implements contract 'omni_serving.v9'" in caplog.text
            run_one(pipeline, "x")
            assert link.remote_steps == 0 and link.fallback_by_reason["refused"] > 0
            assert servicer.counters.streams_opened == 0
            servicer.fixed = True  # retried with the backoff (0.5 s, 1 s, ...)
            wait_for(lambda: link.connected, 10, "attached once the contract matches")
            assert link.attachment.instance_id == servicer.instance_id
            run_one(pipeline, "y")
            assert link.remote_steps > 0
        finally:
            pipeline.stop()
        assert arena.in_use == 0


def test_without_get_materializer_info_it_is_contract_1_with_handles(tmp_path):
    servicer = FakeNoInfo(MaterializerConfig(shm_prefix=PREFIX))
    with (
        ServerThread(f"unix://{tmp_path}/m.sock", servicer) as srv,
        ShmArena(PREFIX, 8, 1 << 20) as arena,
    ):
        pipeline = Pipeline(
            load_profile("tts"),
            {"talker": FakeBackend()},
            vocoder=fake_vocoder(load_profile("tts")),
            materializer_target=srv.target,
            shm_prefix=PREFIX,
            arena=arena,
        )
        pipeline.start()
        try:
            att = pipeline.link.attachment
            assert att is not None and (att.contract_version, att.transport) == (1, "shm")
            assert att.instance_id == ""
            run_one(pipeline, "z")
            assert pipeline.link.remote_steps > 0 and pipeline.link.fallback_steps == 0
        finally:
            pipeline.stop()


def test_inline_transport_flag_forces_inline(tmp_path):
    servicer = ReferenceMaterializer(MaterializerConfig(shm_prefix=PREFIX))
    with (
        ServerThread(f"unix://{tmp_path}/m.sock", servicer) as srv,
        ShmArena(PREFIX, 8, 1 << 20) as arena,
    ):
        pipeline = Pipeline(
            load_profile("tts"),
            {"talker": FakeBackend()},
            vocoder=fake_vocoder(load_profile("tts")),
            materializer_target=srv.target,
            shm_prefix=PREFIX,
            arena=arena,
            inline_transport=True,
        )
        pipeline.start()
        try:
            assert pipeline.link.attachment.transport == "inline"
            run_one(pipeline, "i")
            assert pipeline.link.remote_steps > 0 and pipeline.link.fallback_steps == 0
            assert arena.peak_in_use == 0  # forced inline never uses the arena
        finally:
            pipeline.stop()


# -- a materializer that cannot see the arena (its own /dev/shm) --------------------------


def isolated_materializer(tmp: Path, deployment: str) -> Service:
    port = free_port()
    cmd = (
        "mount -t tmpfs none /dev/shm && exec "
        f"{sys.executable} -m materializer_svc --listen 127.0.0.1:{port} "
        f"--deployment {deployment} --log-level INFO"
    )
    return Service(["unshare", "-m", "sh", "-c", cmd], f"127.0.0.1:{port}", tmp / "m.log")


def unshare_works() -> str | None:
    if shutil.which("unshare") is None:
        return "unshare is not installed"
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs none /dev/shm && ls -A /dev/shm"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if probe.returncode != 0:
        return f"no private mount namespace here: {probe.stderr.strip()[:200]}"
    return None


@pytest.mark.e2e
def test_a_materializer_that_cannot_map_the_arena_gets_inline_tensors(tmp_path):
    why = unshare_works()
    if why is not None:
        pytest.skip(why)
    deployment = f"rm{os.getpid()}"
    mat = isolated_materializer(tmp_path, deployment).start()
    dec = decoder(tmp_path, deployment, mat.target)
    try:
        dec.start()
        assert list_segments(dec.shm_prefix), "the decoder's arena is on this host"
        got = dec.info()
        assert got.materializer_connected
        assert got.materializer.transport == "inline", dec.log_text()[-3000:]
        assert got.materializer.contract_version == 2 and got.materializer.instance_id
        check_outputs(batch(dec.target, "r", 6, 200))  # same audio as the in-process path
        got = dec.info()
        assert got.fallback_steps == 0, dec.log_text()[-3000:]
        assert got.materializer.transport == "inline"
        assert got.arena.peak_slots_in_use > 0  # the steps still went through the arena
        with grpc.insecure_channel(mat.target) as ch:
            remote = materializer_pb2_grpc.MaterializerServiceStub(ch).GetMaterializerInfo(
                materializer_pb2.GetMaterializerInfoRequest(arena_probe=got.arena.region), timeout=5
            )
        assert remote.arena_probe == materializer_pb2.ARENA_PROBE_RESULT_NOT_FOUND
        assert remote.steps_materialized > 0 and remote.steps_failed == 0
        assert "transport inline" in dec.log_text()
    finally:
        dec.kill()
        mat.kill()
