"""No hang on internal errors: an exception on any decoder thread fails the
affected requests promptly with a short status, frees their arena slots, and
the thread goes on serving.

Each test makes one method raise once on a running decoder (an in-process
Pipeline with the fake engine and a real arena; the receiver and the gRPC
case with a real materializer on a Unix socket), then checks: the affected
request ends with an error within seconds, no arena slot stays held, a new
request afterwards succeeds with the same audio as a fault-free run.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass

import grpc
import pytest

import decoder_svc.code2wav.chunking as chunking_mod
import decoder_svc.link.delivery as delivery_mod
import decoder_svc.stage.runner as runner_mod
from decoder_svc.backend import RequestSpec
from decoder_svc.pipeline import Pipeline
from decoder_svc.profile import load_profile
from decoder_svc.server import SERVICE_NAME
from decoder_svc.servicer import DecoderServicer
from decoder_svc.snapshot import SnapshotMeta
from decoder_svc.testing.fake_engine import FakeBackend, fake_vocoder
from gateway.audio import pcm16le
from materializer_svc.reference import ReferenceMaterializer
from materializer_svc.registry import MaterializerConfig
from omni_common.errors import OmniError
from omni_common.materialize import payload_tensors
from omni_common.modality import OutputModality
from omni_common.server import ServerConfig, build_server
from omni_common.shm_arena import ShmArena, list_segments
from omni_serving.v1 import common_pb2, decoder_pb2, decoder_pb2_grpc
from tests.fakes.fake_decoder import BackgroundLoop
from tests.speech_helpers import digest
from tests.test_link_faults import materializer, prompt_for, reference_digests, wait_for
from tests.test_pipeline import ServerThread

PREFIX = f"omni-watchdog{os.getpid()}"  # per process: two runs at once must not share arenas
FAIL_WITHIN_S = 5.0


def raise_once(fn, exc: BaseException):
    """`fn`, except that its first call raises `exc` (a one-shot fault)."""
    lock = threading.Lock()
    fired = []

    def wrapper(*args, **kwargs):
        with lock:
            first = not fired
            fired.append(True)
        if first:
            raise exc
        return fn(*args, **kwargs)

    wrapper.fired = fired
    return wrapper


@dataclass
class Req:
    rid: str
    prompt: str
    seed: int


class Outcome:
    """One request's sink: its audio, its finish, or its error."""

    def __init__(self) -> None:
        self.pieces: list = []
        self.error: OmniError | None = None
        self.finish = ""
        self.done = threading.Event()

    def __call__(self, resp) -> None:
        if isinstance(resp, OmniError):
            self.error = resp
            self.done.set()
            return
        if resp.multimodal_output.tensors:
            self.pieces.append(payload_tensors(resp.multimodal_output)["audio"].clone())
        if resp.finished:
            self.finish = resp.finish_reason
            self.done.set()


def submit(pipeline: Pipeline, req: Req) -> Outcome:
    out = Outcome()
    pipeline.submit(
        RequestSpec(
            request_id=req.rid, prompt=req.prompt, seed=req.seed, modality=OutputModality.AUDIO
        ),
        out,
    )
    return out


def check_fault_then_recovery(
    pipeline: Pipeline, arena: ShmArena | None, message: str, n_faulty: int = 1
) -> None:
    """The faulty requests end with `message` promptly; slots return; a new request succeeds."""
    faulty = [Req(f"bad{i}", prompt_for(i, 80), 11 + i) for i in range(n_faulty)]
    t0 = time.monotonic()
    outs = [submit(pipeline, r) for r in faulty]
    for r, out in zip(faulty, outs, strict=True):
        assert out.done.wait(FAIL_WITHIN_S), f"{r.rid}: no end within {FAIL_WITHIN_S}s"
    took = time.monotonic() - t0
    errors = [o.error for o in outs if o.error is not None]
    assert errors, "the fault failed no request"
    for err in errors:
        text = str(err)
        assert message in text, text
        assert "Error" not in text and "/" not in text, f"internals in the client message: {text!r}"
    assert took < FAIL_WITHIN_S
    if arena is not None:
        wait_for(lambda: arena.in_use == 0, 5, "slots returned")
    wait_for(lambda: pipeline.active_requests == 0, 5, "requests freed")
    good = Req("good", prompt_for(7, 120), 99)
    out = submit(pipeline, good)
    assert out.done.wait(30), "the request after the fault did not finish"
    assert out.error is None and out.finish in ("stop", "length"), (out.error, out.finish)
    assert digest(pcm16le(out.pieces)) == reference_digests([good])["good"]
    if arena is not None:
        wait_for(lambda: arena.in_use == 0, 5, "slots returned after the good request")


@contextlib.contextmanager
def running(target: str | None = None, *, slots: int = 8, in_process_builder: bool = False, **kw):
    profile = load_profile("tts")
    with ShmArena(PREFIX, slots, 1 << 20) as arena:
        pipeline = Pipeline(
            profile,
            {"talker": FakeBackend()},
            vocoder=fake_vocoder(profile),
            materializer_target=target,
            shm_prefix=PREFIX,
            arena=arena,
            in_process_builder=in_process_builder,
            **kw,
        )
        pipeline.start()
        try:
            yield pipeline, arena
        finally:
            pipeline.stop()
    assert list_segments(PREFIX) == []


@pytest.fixture
def remote(tmp_path):
    """A real gRPC server on a Unix socket serving the reference materializer."""
    with ServerThread(
        f"unix://{tmp_path}/m.sock", ReferenceMaterializer(MaterializerConfig(shm_prefix=PREFIX))
    ) as srv:
        yield srv.target


# -- link dispatcher (in-process builder) ------------------------------------------


def test_dispatcher_build_error_fails_the_step_and_keeps_serving(monkeypatch):
    with running(in_process_builder=True) as (pipeline, arena):
        fault = raise_once(delivery_mod.build_local_step, OmniError("injected"))
        monkeypatch.setattr(delivery_mod, "build_local_step", fault)
        check_fault_then_recovery(pipeline, arena, "building the outputs of a decode step failed")
        assert fault.fired and pipeline.link.failed_steps == 1


def test_dispatcher_encode_error_builds_that_step_in_process(monkeypatch, remote):
    """A step that cannot be turned into a message is built here instead: nothing fails."""
    with running(remote) as (pipeline, arena):
        fault = raise_once(SnapshotMeta.to_proto, OmniError("injected"))
        monkeypatch.setattr(SnapshotMeta, "to_proto", fault)
        req = Req("enc", prompt_for(3, 120), 5)
        out = submit(pipeline, req)
        assert out.done.wait(30) and out.error is None, out.error
        assert digest(pcm16le(out.pieces)) == reference_digests([req])["enc"]
        assert fault.fired and pipeline.link.fallback_by_reason["encode_error"] == 1
        assert pipeline.link.connected
        wait_for(lambda: arena.in_use == 0, 5, "slots returned")


# -- link receiver (real materializer) ------------------------------------------------


def test_receiver_delivery_error_fails_the_step_and_keeps_the_stream(monkeypatch, remote):
    with running(remote) as (pipeline, arena):
        link = pipeline.link
        assert link.connected
        fault = raise_once(link.delivery.deliver, OmniError("injected"))
        monkeypatch.setattr(link.delivery, "deliver", fault)
        remote_before = link.remote_steps
        check_fault_then_recovery(pipeline, arena, "building the outputs of a decode step failed")
        assert fault.fired and link.connected and link.remote_steps > remote_before
        assert link.fallback_steps == 0


def test_receiver_loop_error_fails_over_without_losing_steps(monkeypatch, remote):
    """An exception before a response is matched ends the receiver: its steps
    are built in-process (no request fails) and the link reconnects."""
    with running(remote) as (pipeline, arena):
        link = pipeline.link
        fault = raise_once(link.transport.on_response, RuntimeError("injected"))
        monkeypatch.setattr(link.transport, "on_response", fault)
        req = Req("rx", prompt_for(4, 200), 8)
        out = submit(pipeline, req)
        assert out.done.wait(30) and out.error is None, out.error
        assert digest(pcm16le(out.pieces)) == reference_digests([req])["rx"]
        assert fault.fired and link.switches[("to_in_process", "internal_error")] == 1
        wait_for(lambda: link.connected, 5, "reconnected after the receiver failed")
        wait_for(lambda: arena.in_use == 0, 5, "slots returned")


# -- code2wav worker -------------------------------------------------------------------


def test_code2wav_error_fails_the_request_and_the_worker_keeps_serving(monkeypatch):
    with running(in_process_builder=True) as (pipeline, arena):
        # the worker's turn takes each chunk's frames, then calls the vocoder
        fault = raise_once(chunking_mod.ChunkState.take, OmniError("injected"))
        monkeypatch.setattr(chunking_mod.ChunkState, "take", fault)
        check_fault_then_recovery(pipeline, arena, "audio generation failed")
        assert fault.fired and pipeline.code2wav._thread.is_alive()


# -- stage thread ---------------------------------------------------------------------


def test_stage_error_after_taking_a_slot_frees_it(monkeypatch, remote):
    """A step that fails half-way through its snapshot (slot taken, copy
    failed) fails the requests in flight and gives the slot back."""
    real = runner_mod.take_snapshot
    calls = []

    def failing_copy(meta, tensors, arena, *args, **kwargs):
        if arena is not None and not calls:
            calls.append(True)
            arena.acquire(0.5)  # the slot is taken, then the copy fails
            raise OmniError("injected")
        return real(meta, tensors, arena, *args, **kwargs)

    with running(remote) as (pipeline, arena):
        monkeypatch.setattr(runner_mod, "take_snapshot", failing_copy)
        check_fault_then_recovery(pipeline, arena, "decode step failed")
        assert calls and pipeline.runner._thread.is_alive()


def test_stage_error_while_waiting_for_work_keeps_the_stage(monkeypatch):
    with running(in_process_builder=True) as (pipeline, arena):
        backend = pipeline.backends["talker"]
        fault = raise_once(backend.has_unfinished, OmniError("injected"))
        monkeypatch.setattr(backend, "has_unfinished", fault)
        good = Req("after", prompt_for(2, 100), 4)
        out = submit(pipeline, good)  # wakes the stage: the first check raises
        assert out.done.wait(30), "the stage stopped serving"
        assert fault.fired
        if out.error is not None:  # it was in flight when the check failed
            assert "decode step failed" in str(out.error)
            out = submit(pipeline, Req("after2", good.prompt, good.seed))
            assert out.done.wait(30) and out.error is None, out.error
        assert digest(pcm16le(out.pieces)) == reference_digests([good])["after"]


# -- slot acquisition is bounded ----------------------------------------------------------


class FakeSilentMaterializer(ReferenceMaterializer):
    """Test double: its first stream reads every snapshot and never answers;
    later streams are refused (UNAVAILABLE). Without the refusal, a stream
    reopened after the stall would hold the request's last steps, fewer than
    max_pending, until the 30 s stall timeout: how many are left by then is
    timing."""

    opened = 0

    async def Materialize(self, request_iterator, context):
        self.opened += 1
        if self.opened > 1:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "test double: silent once")
        async for _ in request_iterator:
            pass
        if False:  # an async generator that yields nothing
            yield


def test_slot_wait_is_bounded_when_every_slot_is_held(tmp_path):
    """Every slot held by a materializer that never answers: a step waits at
    most the bound, then it (and the next ones) are built in-process, in
    order behind the held ones; the stalled stream is dropped; nothing is lost."""
    req = Req("held", prompt_for(1, 200), 3)
    servicer = FakeSilentMaterializer(MaterializerConfig(shm_prefix=PREFIX))
    with (
        ServerThread(f"unix://{tmp_path}/m.sock", servicer) as srv,
        running(srv.target, slots=2, acquire_timeout_s=0.3, stall_timeout_s=30.0) as (
            pipeline,
            arena,
        ),
    ):
        t0 = time.monotonic()
        out = submit(pipeline, req)
        assert out.done.wait(30), "the request hung on held slots"
        took = time.monotonic() - t0
        assert out.error is None, out.error
        assert digest(pcm16le(out.pieces)) == reference_digests([req])["held"]
        link = pipeline.link
        assert link.fallback_by_reason["no_slot"] > 0, link.fallback_by_reason
        assert link.switches[("to_in_process", "stall")] == 1, link.switches
        assert max(pipeline.runner.gaps_s) < 0.3 + 0.5
        assert took < 10, f"{took=:.1f}s"
        wait_for(lambda: arena.in_use == 0, 5, "slots returned")


# -- through real services ---------------------------------------------------------------


@pytest.mark.e2e
def test_internal_error_reaches_the_client_as_internal_with_a_short_message(monkeypatch, tmp_path):
    """A real materializer process and the decoder's gRPC service on a Unix
    socket: a delivery fault ends the client's Generate stream with INTERNAL
    and a short message; the arena drains; the next request is served."""
    deployment = f"wdg{os.getpid()}"
    prefix = f"omni-{deployment}"
    mat = materializer(tmp_path, deployment).start()
    loop = BackgroundLoop("decoder-test")
    arena = ShmArena(prefix, 8, 1 << 20)
    pipeline = Pipeline(
        load_profile("tts"),
        {"talker": FakeBackend()},
        vocoder=fake_vocoder(load_profile("tts")),
        materializer_target=mat.target,
        shm_prefix=prefix,
        arena=arena,
    )
    pipeline.start()
    servicer = DecoderServicer(pipeline, engine="fake", materializer_target=mat.target)
    server = None
    try:

        def register(s: grpc.aio.Server) -> None:
            decoder_pb2_grpc.add_DecoderServiceServicer_to_server(servicer, s)

        server, target, _ = loop.run(
            build_server(
                ServerConfig(address=f"unix://{tmp_path}/d.sock", service_name=SERVICE_NAME),
                register,
            )
        )
        assert pipeline.link.connected
        fault = raise_once(pipeline.link.delivery.deliver, OmniError("injected"))
        monkeypatch.setattr(pipeline.link.delivery, "deliver", fault)

        def generate(rid: str, req: Req) -> list:
            pieces = []
            with grpc.insecure_channel(target) as ch:
                request = decoder_pb2.GenerateRequest(
                    request_id=rid,
                    prompt=req.prompt,
                    sampling_params=common_pb2.SamplingParams(seed=req.seed),
                )
                for resp in decoder_pb2_grpc.DecoderServiceStub(ch).Generate(request, timeout=30):
                    if resp.multimodal_output.tensors:
                        pieces.append(payload_tensors(resp.multimodal_output)["audio"].clone())
            return pieces

        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            generate("bad", Req("bad", prompt_for(0, 80), 1))
        assert time.monotonic() - t0 < FAIL_WITHIN_S
        assert err.value.code() == grpc.StatusCode.INTERNAL, err.value
        details = err.value.details()
        assert "failed" in details and len(details) < 100, details
        assert "Error" not in details and "/" not in details and "unix" not in details, details

        def info() -> decoder_pb2.GetDecoderInfoResponse:
            with grpc.insecure_channel(target) as ch:
                return decoder_pb2_grpc.DecoderServiceStub(ch).GetDecoderInfo(
                    decoder_pb2.GetDecoderInfoRequest(), timeout=5
                )

        wait_for(
            lambda: info().arena.slots_in_use == 0 and info().active_requests == 0,
            5,
            "slots returned",
        )
        good = Req("good", prompt_for(5, 120), 42)
        assert digest(pcm16le(generate("good", good))) == reference_digests([good])["good"]
        after = info()
        assert after.materializer_connected and after.fallback_steps == 0
        assert after.arena.slots_in_use == 0
    finally:
        if server is not None:
            loop.run(server.stop(0))
        loop.close()
        pipeline.stop()
        arena.close()
        mat.kill()
    assert list_segments(prefix) == []
