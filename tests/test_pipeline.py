"""The decoder's pipeline in-process: paths agree, backpressure bounds memory,
failures of the materializer cost no request."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
import torch

from decoder_svc.backend import RequestSpec
from decoder_svc.pipeline import Pipeline
from decoder_svc.profile import load_profile
from decoder_svc.testing.fake_engine import FakeBackend, fake_vocoder
from gateway.audio import pcm16le
from materializer_svc.reference import ReferenceMaterializer
from materializer_svc.registry import MaterializerConfig
from omni_common.materialize import payload_tensors
from omni_common.modality import OutputModality
from omni_common.server import ServerConfig, build_server
from omni_common.shm_arena import ShmArena, list_segments
from omni_serving.v1 import materializer_pb2_grpc
from tests.speech_helpers import digest

PREFIX = f"omni-pipetest{os.getpid()}"  # per process: xdist workers must not share arenas


class Collector:
    def __init__(self) -> None:
        self.audio: dict[str, list[torch.Tensor]] = {}
        self.text: dict[str, str] = {}
        self.finish: dict[str, str] = {}
        self.done = threading.Condition()

    def sink_for(self, rid: str):
        def sink(resp) -> None:
            if resp.multimodal_output.tensors:
                self.audio.setdefault(rid, []).append(payload_tensors(resp.multimodal_output)["audio"].clone())
            if resp.text_delta:
                self.text[rid] = self.text.get(rid, "") + resp.text_delta
            if resp.finished:
                with self.done:
                    self.finish[rid] = resp.finish_reason
                    self.done.notify_all()

        return sink

    def wait(self, n: int, timeout: float = 60) -> None:
        with self.done:
            assert self.done.wait_for(lambda: len(self.finish) >= n, timeout), f"only {len(self.finish)}/{n} finished"

    def digests(self) -> dict[str, tuple[str, str]]:
        return {rid: (digest(pcm16le(self.audio.get(rid, []))), self.text.get(rid, "")) for rid in self.finish}


def backends(profile):
    return {s.name: FakeBackend(role=s.engine_role) for s in profile.ar_stages}


def run_batch(profile_name: str, *, n: int = 8, modality: str = "audio", **kw) -> tuple[dict, Pipeline]:
    profile = load_profile(profile_name)
    pipeline = Pipeline(profile, backends(profile), vocoder=fake_vocoder(profile), shm_prefix=PREFIX, **kw)
    pipeline.start()
    col = Collector()
    try:
        for i in range(n):
            rid = f"r{i}"
            pipeline.submit(
                RequestSpec(request_id=rid, prompt=f"request number {i} says hello", seed=100 + i,
                            modality=OutputModality.from_string(modality)),
                col.sink_for(rid),
            )
        col.wait(n)
    finally:
        pipeline.stop()
    return col.digests(), pipeline


@pytest.mark.parametrize(("profile", "modality"), [("tts", "audio"), ("omni", "text+audio"), ("omni", "text")])
def test_async_in_process_builder_equals_sync(profile, modality):
    sync, p_sync = run_batch(profile, modality=modality, materializer_target=None, arena=None)
    assert not any(d.use_async for d in p_sync.decisions.values())
    with ShmArena(PREFIX, 8, 1 << 20) as arena:
        asyn, p_async = run_batch(profile, modality=modality, materializer_target=None, arena=arena,
                                  in_process_builder=True)
    assert all(d.use_async for d in p_async.decisions.values())
    assert sync == asyn, f"sync and async outputs differ: {sync=}, {asyn=}"
    assert all(v[0] != digest(b"") for v in sync.values()) == OutputModality.from_string(modality).has_multimodal
    if "text" in modality:
        assert all(v[1] for v in sync.values()), "text modality produced no text"


class SlowFakeMaterializer(ReferenceMaterializer):
    """Test double: the reference materializer sleeping 50 ms per step."""

    async def Materialize(self, request_iterator, context):
        async for resp in super().Materialize(request_iterator, context):
            await asyncio.sleep(0.05)
            yield resp


class ServerThread:
    """A real grpc.aio server on a UDS, on its own event loop thread."""

    def __init__(self, address: str, servicer) -> None:
        self.loop = asyncio.new_event_loop()
        self.started = threading.Event()
        self.address = address
        self.servicer = servicer
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def main() -> None:
            def register(server) -> None:
                materializer_pb2_grpc.add_MaterializerServiceServicer_to_server(self.servicer, server)

            self.stopping = asyncio.Event()
            server, self.target, _ = await build_server(ServerConfig(address=self.address, service_name="m"), register)
            self.started.set()
            await self.stopping.wait()
            await server.stop(0)

        self.loop.run_until_complete(main())

    def __enter__(self) -> ServerThread:
        self.thread.start()
        assert self.started.wait(10)
        return self

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.stopping.set)
        self.thread.join(15)
        assert not self.thread.is_alive(), "materializer test server did not stop"

    def __exit__(self, *exc) -> None:
        self.stop()


def test_slow_materializer_backpressure_not_unbounded(tmp_path):
    """Steps keep launching while the materializer lags, until every slot is
    held; then the step waits (bounded memory); nothing is lost. (A long
    stall_timeout_s: by default a materializer that keeps decode steps
    waiting for slots most of the time is dropped, see test_link_faults.py.)"""
    sync, _ = run_batch("tts", materializer_target=None, arena=None)
    slots = 4
    with ServerThread(f"unix://{tmp_path}/m.sock", SlowFakeMaterializer(MaterializerConfig(shm_prefix=PREFIX))) as srv, \
            ShmArena(PREFIX, slots, 1 << 20) as arena:
        profile = load_profile("tts")
        pipeline = Pipeline(profile, backends(profile), vocoder=fake_vocoder(profile), materializer_target=srv.target,
                            shm_prefix=PREFIX, arena=arena, stall_timeout_s=30.0)
        pipeline.start()
        col = Collector()
        for i in range(8):
            pipeline.submit(RequestSpec(request_id=f"r{i}", prompt=f"request number {i} says hello", seed=100 + i,
                                        modality=OutputModality.AUDIO), col.sink_for(f"r{i}"))
        # the decode loop runs ahead of the materializer (lagged consumption) ...
        max_ahead = 0
        deadline = time.monotonic() + 60
        while len(col.finish) < 8 and time.monotonic() < deadline:
            max_ahead = max(max_ahead, pipeline.runner.steps - pipeline.link.remote_steps)
            time.sleep(0.005)
        assert max_ahead >= slots - 1, f"decode never ran ahead of a slow materializer: {max_ahead=}"
        # ... but never by more than the arena holds
        col.wait(8)
        pipeline.stop()
        assert arena.peak_in_use == slots, f"{arena.peak_in_use=}, want the arena full ({slots})"
        assert pipeline.link.in_flight_peak <= slots, f"{pipeline.link.in_flight_peak=} > {slots} slots"
        assert pipeline.link.fallback_steps == 0
    assert col.digests() == sync


class FailingFakeMaterializer(ReferenceMaterializer):
    """Test double: answers every third step with a StepError, then dies after step 12."""

    async def Materialize(self, request_iterator, context):
        n = 0
        async for resp in super().Materialize(request_iterator, context):
            n += 1
            if n == 12:
                await context.abort(__import__("grpc").StatusCode.INTERNAL, "fake crash")
            if n % 3 == 0:
                step = resp.step
                resp.Clear()
                resp.error.step_id = step.step_id
                resp.error.stage_id = step.stage_id
                resp.error.code = 13
                resp.error.message = "fake failure"
            yield resp


def test_materializer_errors_and_death_cost_no_request(tmp_path):
    sync, _ = run_batch("tts", materializer_target=None, arena=None)
    with ServerThread(f"unix://{tmp_path}/m.sock", FailingFakeMaterializer(MaterializerConfig(shm_prefix=PREFIX))) as srv, \
            ShmArena(PREFIX, 8, 1 << 20) as arena:
        got, pipeline = run_batch("tts", materializer_target=srv.target, arena=arena)
        assert pipeline.link.fallback_steps > 0
        assert arena.in_use == 0, "slots leaked after failover"
    assert got == sync
    assert list_segments(PREFIX) == []


class StallingFakeMaterializer(ReferenceMaterializer):
    """Test double: reads every snapshot and never answers."""

    async def Materialize(self, request_iterator, context):
        async for _ in request_iterator:
            pass
        if False:  # an async generator that yields nothing
            yield


def test_stalled_materializer_costs_no_request(tmp_path):
    sync, _ = run_batch("tts", materializer_target=None, arena=None)
    with ServerThread(f"unix://{tmp_path}/m.sock", StallingFakeMaterializer(MaterializerConfig(shm_prefix=PREFIX))) as srv, \
            ShmArena(PREFIX, 8, 1 << 20) as arena:
        got, pipeline = run_batch("tts", materializer_target=srv.target, arena=arena, stall_timeout_s=1.0)
        assert pipeline.link.fallback_by_reason["stall"] > 0, pipeline.link.fallback_by_reason
        assert arena.in_use == 0, "slots leaked after a stall"
    assert got == sync


class FlakyFakeBackend(FakeBackend):
    """Test double: the reference talker whose third step raises."""

    calls = 0

    def step(self):
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("fake engine failure")
        return super().step()


def test_a_failing_step_fails_its_requests_and_the_stage_keeps_serving():
    profile = load_profile("tts")
    pipeline = Pipeline(profile, {"talker": FlakyFakeBackend()}, vocoder=fake_vocoder(profile), materializer_target=None, shm_prefix=PREFIX, arena=None)
    pipeline.start()
    errors: list[object] = []
    done = threading.Event()

    def failing_sink(resp) -> None:
        if not hasattr(resp, "finished"):
            errors.append(resp)
            done.set()

    try:
        pipeline.submit(RequestSpec(request_id="a", prompt="will fail", seed=1, modality=OutputModality.AUDIO), failing_sink)
        assert done.wait(10), "the request in flight was not failed"
        assert "decode step failed" in str(errors[0]), errors
        assert pipeline.active_requests == 0
        col = Collector()
        pipeline.submit(RequestSpec(request_id="b", prompt="after the failure", seed=2, modality=OutputModality.AUDIO),
                        col.sink_for("b"))
        col.wait(1)
        assert col.finish["b"] in ("stop", "length"), col.finish
    finally:
        pipeline.stop()
