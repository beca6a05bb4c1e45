"""The real gateway over real Unix sockets, against FakeDecoder (a test double)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import threading
import wave
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from fakes import FakeDecoder, FakeDecoderConfig, GatewayThread, remove_dir, short_socket_dir
from fakes.fake_decoder import audio_payload, fake_audio

from gateway.audio import pcm16le
from gateway.decoder_client import DecoderClient
from gateway.engine import GatewayEngine
from gateway.output_processor import OutputProcessor
from gateway.validation import SpeechRequest
from omni_cli import speak_client
from omni_common.accumulation import PayloadAccumulator, TensorConsolidationError
from omni_common.accumulation import TensorAccumulationStrategy as S
from omni_common.errors import grpc_code_for
from omni_serving.v1 import common_pb2, decoder_pb2, gateway_pb2, gateway_pb2_grpc, payload_pb2


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    path = short_socket_dir()
    yield path
    remove_dir(path)


@pytest.fixture
def decoder(sock_dir: Path) -> Iterator[FakeDecoder]:
    with FakeDecoder(sock_dir / "decoder.sock") as fake:
        yield fake


@pytest.fixture
def gateway(decoder: FakeDecoder, sock_dir: Path) -> Iterator[GatewayThread]:
    with GatewayThread(decoder.target, sock_dir, max_text_chars=64, max_concurrent=8) as gw:
        yield gw


def speak(stub, **fields) -> list[gateway_pb2.SpeakResponse]:
    return list(stub.Speak(gateway_pb2.SpeakRequest(**fields), timeout=10))


def expected_pcm(text: str, voice: str, seed: int, config: FakeDecoderConfig) -> bytes:
    request = decoder_pb2.GenerateRequest(
        prompt=text, voice=voice, sampling_params=common_pb2.SamplingParams(seed=seed)
    )
    return b"".join(
        pcm16le(torch.from_numpy(fake_audio(request, i, config.chunk_samples)))
        for i in range(config.num_chunks)
    )


def check_stream(chunks: list[gateway_pb2.SpeakResponse], request_id: str) -> None:
    seqs = [c.sequence_number for c in chunks]
    assert seqs == list(range(len(chunks))), f"sequence numbers {seqs} are not 0..n-1"
    finals = [c.final for c in chunks]
    assert finals == [False] * (len(chunks) - 1) + [True], f"{finals=}"
    assert {c.request_id for c in chunks} == {request_id}
    assert {c.sample_rate_hz for c in chunks} == {24000}
    assert {c.encoding for c in chunks} == {gateway_pb2.AUDIO_ENCODING_PCM16LE}


# ---------------------------------------------------------------------------
# Streaming.


def test_concurrent_speak_streams(gateway: GatewayThread, decoder: FakeDecoder) -> None:
    results: dict[str, list[gateway_pb2.SpeakResponse]] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[f"req-{i}"] = speak(
                gateway.stub,
                request_id=f"req-{i}",
                text=f"hello number {i}",
                sampling_params=common_pb2.SamplingParams(seed=i),
            )
        except grpc.RpcError as exc:  # collected, asserted below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert not errors, f"{errors=}"

    for i in range(6):
        rid = f"req-{i}"
        chunks = results[rid]
        check_stream(chunks, rid)
        audio = b"".join(c.audio for c in chunks)
        want = expected_pcm(f"hello number {i}", "alice", i, decoder.config)
        assert audio == want, f"{rid}: {len(audio)} bytes, want {len(want)}"
        final = chunks[-1].metrics
        assert final.ttfp_ms > 0 and final.rtf > 0, f"{final=}"
        assert final.audio_seconds == pytest.approx(len(want) / 2 / 24000)
    assert decoder.state.aborts == [], "finished streams must not be aborted"
    # The default voice (empty) is the decoder's first voice; the seed is passed on.
    sent = {r.request_id: r for r in decoder.state.requests}
    assert sent["req-3"].voice == "alice" and sent["req-3"].sampling_params.seed == 3


def test_request_id_generated_and_echoed(gateway: GatewayThread) -> None:
    chunks = speak(gateway.stub, text="hi", voice="bob", sample_rate_hz=24000)
    rid = chunks[0].request_id
    assert rid, "an empty request_id must be replaced by a generated one"
    check_stream(chunks, rid)


def test_final_chunk_may_carry_samples(sock_dir: Path) -> None:
    """A decoder whose finished message also carries audio: that audio is in the final chunk."""

    def script(request):
        audio = np.full(100, 0.25, dtype=np.float32)
        return [
            decoder_pb2.GenerateResponse(
                request_id=request.request_id, multimodal_output=audio_payload(audio)
            ),
            decoder_pb2.GenerateResponse(
                request_id=request.request_id,
                multimodal_output=audio_payload(audio),
                finished=True,
            ),
        ]

    with (
        FakeDecoder(sock_dir / "d.sock", FakeDecoderConfig(script=script)) as fake,
        GatewayThread(fake.target, sock_dir) as gw,
    ):
        chunks = speak(gw.stub, request_id="x", text="hi")
    check_stream(chunks, "x")
    assert [len(c.audio) for c in chunks] == [200, 200]


def test_generate_text_and_audio(sock_dir: Path) -> None:
    def script(request):
        out = []
        for i in range(3):
            r = decoder_pb2.GenerateResponse(
                request_id=request.request_id,
                stage_id=i,
                new_token_ids=[i],
                text_delta=f"t{i}",
                multimodal_output=audio_payload(np.full(10, i / 10, dtype=np.float32)),
            )
            out.append(r)
        out.append(
            decoder_pb2.GenerateResponse(
                request_id=request.request_id, finished=True, finish_reason="stop"
            )
        )
        return out

    with (
        FakeDecoder(sock_dir / "d.sock", FakeDecoderConfig(script=script)) as fake,
        GatewayThread(fake.target, sock_dir) as gw,
    ):
        request = gateway_pb2.OmniGatewayServiceGenerateRequest(
            request_id="g1",
            prompt="hi",
            output_modalities="text+speech",
            output_kind=gateway_pb2.OUTPUT_KIND_CUMULATIVE,
        )
        outputs = [r.output for r in gw.stub.Generate(request, timeout=10)]
        sent = fake.state.requests[0]

    assert list(sent.output_modalities) == [
        payload_pb2.OUTPUT_MODALITY_TEXT,
        payload_pb2.OUTPUT_MODALITY_AUDIO,
    ]
    last = outputs[-1]
    assert last.finished and last.finish_reason == "stop" and last.request_id == "g1"
    assert last.text.text == "t0t1t2" and list(last.text.token_ids) == [0, 1, 2]
    (audio,) = last.multimodal.tensors
    assert audio.name == "audio" and list(audio.tensor.shape) == [30]
    assert [o.stage_id for o in outputs[:3]] == [0, 1, 2]


# ---------------------------------------------------------------------------
# Cancellation.


def test_cancel_mid_stream_aborts_decoder_request(sock_dir: Path) -> None:
    config = FakeDecoderConfig(num_chunks=200, delay_s=0.02)
    with (
        FakeDecoder(sock_dir / "d.sock", config) as fake,
        GatewayThread(fake.target, sock_dir) as gw,
    ):
        call = gw.stub.Speak(gateway_pb2.SpeakRequest(request_id="cancel-me", text="long"))
        it = iter(call)
        first, second = next(it), next(it)
        assert (first.sequence_number, second.sequence_number) == (0, 1)
        call.cancel()

        assert fake.wait_for(lambda: "cancel-me" in fake.state.aborts), (
            f"decoder saw no Abort: {fake.state.aborts=}"
        )
        assert fake.wait_for(lambda: "cancel-me" not in fake.state.active), "still active"
        assert gw.loop.run(_active_streams(gw)) == 0


async def _active_streams(gw: GatewayThread) -> int:
    return gw.gateway.engine.admission.active


# ---------------------------------------------------------------------------
# Errors.


SPEAK_ERRORS = [
    pytest.param({"text": ""}, "text", id="empty-text"),
    pytest.param({"text": "   "}, "text", id="blank-text"),
    pytest.param({"text": "x" * 65}, "text", id="long-text"),
    pytest.param({"text": "hi", "voice": "zed"}, "voice", id="unknown-voice"),
    pytest.param({"text": "hi", "encoding": 7}, "encoding", id="encoding"),
    pytest.param({"text": "hi", "sample_rate_hz": 16000}, "sample_rate_hz", id="sample-rate"),
    pytest.param(
        {"text": "hi", "sampling_params": common_pb2.SamplingParams(top_p=2.0)},
        "sampling_params.top_p",
        id="top-p",
    ),
]


@pytest.mark.parametrize(("fields", "field"), SPEAK_ERRORS)
def test_speak_validation_errors(gateway: GatewayThread, fields: dict, field: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        speak(gateway.stub, **fields)
    err = info.value
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, f"{err.code()=}, {err.details()=}"
    assert err.details().startswith(f"{field}:"), f"{err.details()=} does not name {field}"


def test_unknown_voice_lists_voices(gateway: GatewayThread) -> None:
    with pytest.raises(grpc.RpcError) as info:
        speak(gateway.stub, text="hi", voice="zed")
    assert "alice" in info.value.details() and "bob" in info.value.details()


GENERATE_ERRORS = [
    pytest.param({"prompt": ""}, "prompt", "must not be empty", id="empty-prompt"),
    pytest.param({"prompt": "y" * 65}, "prompt", "limit is 64", id="long-prompt"),
    pytest.param(
        {"prompt": "hi", "output_modalities": "smell"},
        "output_modalities",
        "supported: text, image, audio, latent",
        id="modality",
    ),
    pytest.param({"prompt": "hi", "output_kind": 9}, "output_kind", "DELTA", id="output-kind"),
    pytest.param({"prompt": "hi", "voice": "zed"}, "voice", "alice", id="voice"),
]


@pytest.mark.parametrize(("fields", "field", "mentions"), GENERATE_ERRORS)
def test_generate_validation_errors(
    gateway: GatewayThread, fields: dict, field: str, mentions: str
) -> None:
    request = gateway_pb2.OmniGatewayServiceGenerateRequest(**fields)
    with pytest.raises(grpc.RpcError) as info:
        list(gateway.stub.Generate(request, timeout=10))
    err = info.value
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, f"{err.code()=}, {err.details()=}"
    assert err.details().startswith(f"{field}:"), f"{err.details()=}"
    assert mentions in err.details(), f"{err.details()=} lacks {mentions!r}"


def test_decoder_absent_is_unavailable(sock_dir: Path) -> None:
    with GatewayThread(FakeDecoder.absent_target(sock_dir), sock_dir) as gw:
        with pytest.raises(grpc.RpcError) as info:
            speak(gw.stub, text="hi")
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, f"{info.value.details()=}"
        assert "decoder" in info.value.details()
        request = gateway_pb2.OmniGatewayServiceGenerateRequest(prompt="hi")
        with pytest.raises(grpc.RpcError) as info:
            list(gw.stub.Generate(request, timeout=10))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_overload_is_resource_exhausted(sock_dir: Path) -> None:
    config = FakeDecoderConfig(num_chunks=40, delay_s=0.02)
    with (
        FakeDecoder(sock_dir / "d.sock", config) as fake,
        GatewayThread(fake.target, sock_dir, max_concurrent=1) as gw,
    ):
        busy = gw.stub.Speak(gateway_pb2.SpeakRequest(request_id="busy", text="long"))
        next(iter(busy))  # the one allowed stream is running
        with pytest.raises(grpc.RpcError) as info:
            speak(gw.stub, request_id="extra", text="hi")
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, f"{info.value.details()=}"
        assert "extra" not in [r.request_id for r in fake.state.requests]
        busy.cancel()
        assert fake.wait_for(lambda: "busy" in fake.state.aborts)
        config.delay_s = 0.0
        check_stream(speak(gw.stub, request_id="after", text="hi"), "after")


def test_duplicate_running_request_id_is_already_exists(sock_dir: Path) -> None:
    config = FakeDecoderConfig(num_chunks=40, delay_s=0.02)
    with (
        FakeDecoder(sock_dir / "d.sock", config) as fake,
        GatewayThread(fake.target, sock_dir) as gw,
    ):
        first = gw.stub.Speak(gateway_pb2.SpeakRequest(request_id="same", text="a"))
        next(iter(first))
        with pytest.raises(grpc.RpcError) as info:
            speak(gw.stub, request_id="same", text="b")
        assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
        first.cancel()


def test_decoder_failure_mid_stream_reaches_client(sock_dir: Path) -> None:
    config = FakeDecoderConfig(num_chunks=10, fail_after=3, fail_code=grpc.StatusCode.UNAVAILABLE)
    with (
        FakeDecoder(sock_dir / "d.sock", config) as fake,
        GatewayThread(fake.target, sock_dir) as gw,
    ):
        received = []
        with pytest.raises(grpc.RpcError) as info:
            for chunk in gw.stub.Speak(gateway_pb2.SpeakRequest(request_id="f", text="hi")):
                received.append(chunk)
        assert [c.sequence_number for c in received] == [0, 1, 2]
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "decoder" in info.value.details() and "fake decoder failure" in info.value.details()


# ---------------------------------------------------------------------------
# Engine level: a consolidation error fails the request with a clear error
# and aborts it on the decoder.


class _Unmergeable(PayloadAccumulator):
    def take_delta(self):
        raise TensorConsolidationError("audio", "pieces cannot be merged (test)")


def test_consolidation_error_fails_request_and_aborts(decoder: FakeDecoder) -> None:
    async def run() -> BaseException:
        processor = OutputProcessor(
            payload_accumulator_factory=lambda m, s: _Unmergeable(S.CONCAT_LAST, s)
        )
        engine = GatewayEngine(DecoderClient(decoder.target), processor=processor)
        try:
            with pytest.raises(TensorConsolidationError) as info:
                async with contextlib.aclosing(
                    engine.speak(SpeechRequest(request_id="c", text="hi"))
                ) as chunks:
                    async for _ in chunks:
                        pass
            assert engine.admission.active == 0
            return info.value
        finally:
            await engine.close()

    error = asyncio.run(run())
    assert grpc_code_for(error) == grpc.StatusCode.INTERNAL
    assert "tensor 'audio'" in str(error)
    assert decoder.wait_for(lambda: "c" in decoder.state.aborts)


# ---------------------------------------------------------------------------
# The CLI client over gRPC.


def test_speak_client_writes_wav(
    gateway: GatewayThread, decoder: FakeDecoder, sock_dir: Path
) -> None:
    out = sock_dir / "out.wav"
    result = speak_client.speak(
        gateway.gateway.address, "hello there", out, voice="bob", seed=5, progress=False
    )
    want = expected_pcm("hello there", "bob", 5, decoder.config)
    with wave.open(str(out)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 24000)
        assert w.getnframes() == len(want) // 2
        assert w.readframes(w.getnframes()) == want
    assert result["samples"] == len(want) // 2 and result["rtf"] > 0 and result["ttfp_ms"] > 0
    assert result["server_ttfp_ms"] > 0 and result["request_id"]


def test_speak_client_error_removes_file(gateway: GatewayThread, sock_dir: Path) -> None:
    out = sock_dir / "bad.wav"
    with pytest.raises(speak_client.SpeakClientError, match="voice") as info:
        speak_client.speak(gateway.gateway.address, "hi", out, voice="zed", progress=False)
    assert info.value.code == "INVALID_ARGUMENT"
    assert not out.exists()


# ---------------------------------------------------------------------------
# The process entry point.


def test_python_m_gateway_serves_and_stops(decoder: FakeDecoder, sock_dir: Path) -> None:
    listen = f"unix://{sock_dir / 'gw-proc.sock'}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gateway",
            "--listen",
            listen,
            "--decoder",
            decoder.target,
            "--http-port",
            "0",
            "--max-concurrent",
            "2",
            "--log-level",
            "WARNING",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith(f"gateway listening on {listen}, HTTP on port "), (
            f"{line=}, stderr={proc.stderr.read() if proc.poll() is not None else ''}"
        )
        with grpc.insecure_channel(listen) as channel:
            stub = gateway_pb2_grpc.OmniGatewayServiceStub(channel)
            chunks = list(
                stub.Speak(gateway_pb2.SpeakRequest(request_id="p", text="hi"), timeout=10)
            )
        check_stream(chunks, "p")
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=15)
    assert rc == 0, proc.stderr.read()
    assert not (sock_dir / "gw-proc.sock").exists(), "socket file left behind"
