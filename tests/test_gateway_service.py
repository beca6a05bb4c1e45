"""The real gateway over real Unix sockets, against FakeDecoder (a test double)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import signal
import subprocess
import sys
import threading
import time
import wave
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from fakes import FakeDecoder, FakeDecoderConfig, GatewayThread
from fakes.fake_decoder import audio_payload, fake_audio
from prometheus_client import REGISTRY

from gateway.audio import pcm16le
from gateway.decoder_client import DecoderClient, decoder_error
from gateway.engine import GatewayEngine
from gateway.output_processor import OutputProcessor
from gateway.validation import SpeechRequest
from omni_cli import speak_client
from omni_common.accumulation import PayloadAccumulator, TensorConsolidationError
from omni_common.accumulation import TensorAccumulationStrategy as S
from omni_common.errors import grpc_code_for
from omni_serving.v1 import common_pb2, decoder_pb2, gateway_pb2, gateway_pb2_grpc, payload_pb2


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


def test_a_client_that_cancels_while_the_gateway_waits_to_write_is_cancelled_not_an_error(
    sock_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The client stops reading; the transports' windows fill and the gateway's
    write waits; then the client cancels. grpc's core fails that write before the
    call's cancellation reaches the handler: counted CANCELLED, nothing logged
    as an error, the decoder request aborted."""
    caplog.set_level(logging.WARNING)
    config = FakeDecoderConfig(num_chunks=400, chunk_samples=96_000)  # 192 kB a chunk, 77 MB
    counted = ("omni_gateway_requests_total", {"api": "Speak", "code": "CANCELLED"})
    before = REGISTRY.get_sample_value(*counted) or 0.0
    with (
        FakeDecoder(sock_dir / "d.sock", config) as fake,
        GatewayThread(fake.target, sock_dir) as gw,
    ):
        call = gw.stub.Speak(gateway_pb2.SpeakRequest(request_id="unread", text="long"))
        next(iter(call))
        # not read further: the decoder's whole answer would take 77 MB of buffers
        assert fake.wait_for(lambda: len(fake.state.requests) == 1)
        time.sleep(1.0)
        assert "unread" in fake.state.active, "the answer was buffered whole: nothing waits"
        call.cancel()
        assert fake.wait_for(lambda: "unread" not in fake.state.active), "still active"
        assert fake.wait_for(lambda: (REGISTRY.get_sample_value(*counted) or 0.0) == before + 1)
        # The gateway's servicer, and grpc's server of that call (other calls in
        # this process, the fake decoder's and health checks, are not judged here).
        errors = [
            r
            for r in caplog.records
            if r.levelno >= logging.WARNING
            and (
                r.name.startswith(("gateway.servicer", "omni_common.server"))
                or (r.name.startswith("grpc") and "OmniGatewayService/Speak" in r.getMessage())
            )
        ]
        assert not errors, [f"{r.name}: {r.getMessage()}" for r in errors]


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
    *[
        pytest.param(
            {"text": "hi", "sampling_params": common_pb2.SamplingParams(**{name: value})},
            f"sampling_params.{name}",
            id=f"{name}={value}",
        )
        for name, value in [
            ("temperature", 2.01),  # vLLM's bound is [0, 2]
            ("temperature", -0.5),
            ("temperature", float("nan")),
            ("temperature", float("inf")),
            ("top_p", float("nan")),
            ("top_p", float("-inf")),
            ("top_p", -0.1),
            ("top_k", -1),
            ("seed", 2**63),
        ]
    ],
    pytest.param({"text": "hi", "voice": "v" * 129}, "voice", id="long-voice"),
]


@pytest.mark.parametrize(("fields", "field"), SPEAK_ERRORS)
def test_speak_validation_errors(gateway: GatewayThread, fields: dict, field: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        speak(gateway.stub, **fields)
    err = info.value
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, f"{err.code()=}, {err.details()=}"
    assert err.details().startswith(f"{field}:"), f"{err.details()=} does not name {field}"


def test_sampling_params_at_their_bounds_are_accepted(gateway: GatewayThread) -> None:
    for params in (
        common_pb2.SamplingParams(temperature=2.0, top_p=1.0, top_k=2**31 - 1, seed=2**63 - 1),
        common_pb2.SamplingParams(
            temperature=0.0, top_p=0.0, top_k=0, seed=0, max_tokens=2**32 - 1
        ),
    ):
        check_stream(speak(gateway.stub, request_id="b", text="hi", sampling_params=params), "b")


def test_messages_are_short_and_quote_a_prefix(gateway: GatewayThread) -> None:
    """A 10,000-character value is not echoed: the message names the field, quotes 40 chars."""
    huge = "\u202e\x00" + "z" * 10_000
    cases = [
        {"text": "hi", "voice": "q" * 100 + "\n"},  # under the voice length limit: quoted
        {"text": "hi", "voice": huge},
        {"text": huge},
        {"text": "hi", "request_id": huge},
    ]
    for fields in cases:
        with pytest.raises(grpc.RpcError) as info:
            speak(gateway.stub, **fields)
        details = info.value.details()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, details
        assert len(details) <= 512 and "z" * 41 not in details and "q" * 41 not in details
        assert details.isprintable(), repr(details)
    request = gateway_pb2.OmniGatewayServiceGenerateRequest(prompt="hi", output_modalities=huge)
    with pytest.raises(grpc.RpcError) as info:
        list(gateway.stub.Generate(request, timeout=10))
    assert info.value.details().startswith("output_modalities:"), info.value.details()
    assert len(info.value.details()) <= 512


@pytest.mark.parametrize(
    "raw",
    [b"\xff\xff\xff", b"\x0a\x02\xff\xfe", b"\x12" + b"\xff" * 9, b"\x08"],
    ids=["corrupt", "bad-utf8", "bad-varint", "truncated"],
)
def test_malformed_protobuf_is_invalid_argument(gateway: GatewayThread, raw: bytes) -> None:
    for method in ("Speak", "Generate"):
        call = gateway.channel.unary_stream(f"/omni_serving.v1.OmniGatewayService/{method}")
        with pytest.raises(grpc.RpcError) as info:
            list(call(raw, timeout=10))
        err = info.value
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, f"{err.code()=} {err.details()=}"
        assert err.details().startswith(f"request: not a valid {method} request message")
        assert "<class" not in err.details() and "omni_serving.v1" not in err.details()
    check_stream(speak(gateway.stub, request_id="after", text="hi"), "after")


def test_unknown_voice_lists_voices(gateway: GatewayThread) -> None:
    with pytest.raises(grpc.RpcError) as info:
        speak(gateway.stub, text="hi", voice="zed")
    assert "alice" in info.value.details() and "bob" in info.value.details()


def test_voice_aliases_reach_the_decoder_as_its_voices(sock_dir: Path) -> None:
    """The decoder's aliases ("default", OpenAI's names) are accepted and sent
    as the voice they stand for; ListModels reports them; an unknown name
    lists voices and aliases."""
    aliases = {"default": "alice", "nova": "alice", "onyx": "bob"}
    with (
        FakeDecoder(sock_dir / "decoder.sock", FakeDecoderConfig(voice_aliases=aliases)) as fake,
        GatewayThread(fake.target, sock_dir) as gw,
    ):
        for given, sent in (("onyx", "bob"), ("default", "alice"), ("", "alice"), ("bob", "bob")):
            check_stream(speak(gw.stub, request_id=f"v-{given}", text="hi", voice=given), f"v-{given}")
            assert fake.state.requests[-1].voice == sent, (given, fake.state.requests[-1].voice)
        (card,) = gw.stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=10).models
        assert dict(card.voice_aliases) == aliases
        with pytest.raises(grpc.RpcError) as info:
            speak(gw.stub, text="hi", voice="zed")
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "voices: alice, bob; aliases: default, nova, onyx" in info.value.details(), info.value.details()


def _turn(role: str, text: str) -> common_pb2.ChatMessage:
    return common_pb2.ChatMessage(role=role, content=[common_pb2.ContentPart(text=text)])


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
    pytest.param({"prompt": "hi", "messages": [_turn("user", "hi")]}, "messages", "not both", id="prompt-and-messages"),
    pytest.param({"instructions": "calm", "messages": [_turn("user", "hi")]}, "instructions", "system turn",
                 id="instructions-and-messages"),
    pytest.param({"messages": [_turn("robot", "hi")]}, "messages[0].role", "roles: system, user, assistant",
                 id="message-role"),
    pytest.param({"messages": [_turn("user", "hi"), _turn("assistant", "ok")]}, "messages[1].role",
                 "the last turn must be the user's", id="last-turn"),
    pytest.param({"messages": [common_pb2.ChatMessage(role="user", content=[common_pb2.ContentPart()])]},
                 "messages[0].content[0]", "is empty", id="empty-part"),
    pytest.param({"messages": [_turn("user", "  ")]}, "messages[0].content", "has no text", id="blank-turn"),
    pytest.param({"messages": [_turn("system", "s" * 40), _turn("user", "u" * 30)]}, "messages[1].content",
                 "the limit is 64 in all", id="long-conversation"),
    # a well-formed conversation on a deployment without a text stage (the fake decoder's)
    pytest.param({"messages": [_turn("user", "hi")]}, "messages", "needs a text stage", id="no-text-stage"),
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


@pytest.mark.parametrize(
    ("decoder_code", "client_code"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INVALID_ARGUMENT),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL),
        (grpc.StatusCode.INTERNAL, grpc.StatusCode.INTERNAL),
        (grpc.StatusCode.DATA_LOSS, grpc.StatusCode.INTERNAL),
    ],
    ids=lambda c: c.name,
)
def test_decoder_status_reaches_client_sanitized(
    sock_dir: Path, decoder_code: grpc.StatusCode, client_code: grpc.StatusCode
) -> None:
    config = FakeDecoderConfig(fail_after=0, fail_code=decoder_code)
    with (
        FakeDecoder(sock_dir / "d.sock", config) as fake,
        GatewayThread(fake.target, sock_dir) as gw,
    ):
        with pytest.raises(grpc.RpcError) as info:
            speak(gw.stub, request_id="e", text="hi")
    err = info.value
    assert err.code() == client_code, f"{err.code()=} {err.details()=}"
    assert err.details().startswith("decoder: "), err.details()
    assert str(sock_dir) not in err.details() and "unix:" not in err.details()
    if client_code is grpc.StatusCode.INTERNAL:  # details only in the gateway's log
        assert "fake decoder failure" not in err.details(), err.details()
    else:
        assert err.details() == f"decoder: {decoder_code.name}: fake decoder failure (test)"


@pytest.mark.parametrize(
    ("code", "details", "want_code", "want"),
    [
        (
            grpc.StatusCode.INVALID_ARGUMENT,
            "text: is 5000 tokens with the chat template; with max_tokens the limit is 2048",
            grpc.StatusCode.INVALID_ARGUMENT,
            "decoder: INVALID_ARGUMENT: text: is 5000 tokens with the chat template; "
            "with max_tokens the limit is 2048",
        ),
        (
            grpc.StatusCode.UNAVAILABLE,
            "failed to connect to all addresses; last error: UNKNOWN: "
            "unix:/tmp/omni-x/decoder.sock: No such file or directory",
            grpc.StatusCode.UNAVAILABLE,
            "decoder: UNAVAILABLE: failed to connect to all addresses; last error: UNKNOWN: "
            "[address]: No such file or directory",
        ),
        (
            grpc.StatusCode.FAILED_PRECONDITION,
            "cannot open /srv/models/qwen/config.json (vllm.engine.EngineDeadError)",
            grpc.StatusCode.FAILED_PRECONDITION,
            "decoder: FAILED_PRECONDITION: cannot open [path] ([type])",
        ),
        (
            grpc.StatusCode.UNKNOWN,
            "Unexpected <class 'vllm.v1.engine.exceptions.EngineDeadError'>: boom at /x/y.py",
            grpc.StatusCode.INTERNAL,
            "decoder: failed the request (UNKNOWN); the gateway log has the details",
        ),
    ],
    ids=["context", "unreachable", "paths-and-types", "unknown"],
)
def test_decoder_error_messages(
    code: grpc.StatusCode, details: str, want_code: grpc.StatusCode, want: str
) -> None:
    exc = grpc.aio.AioRpcError(code, details=details)
    error = decoder_error(exc, "unix:///tmp/omni-x/decoder.sock")
    assert grpc_code_for(error) == want_code
    assert str(error) == want
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        assert error.field == "text"


def test_long_decoder_message_is_bounded() -> None:
    error = decoder_error(
        grpc.aio.AioRpcError(grpc.StatusCode.INVALID_ARGUMENT, details="prompt: " + "x" * 10_000),
        "unix:///d.sock",
    )
    assert len(str(error)) <= 512 and str(error).endswith("…")


@pytest.mark.parametrize("bug", [ValueError, KeyError, TypeError])
def test_a_gateway_bug_is_internal_with_a_generic_message(
    gateway: GatewayThread, decoder: FakeDecoder, caplog: pytest.LogCaptureFixture, bug: type
) -> None:
    """Any exception outside the client errors (a ValueError of ours too): INTERNAL, never
    INVALID_ARGUMENT or UNKNOWN, no text of its own; an error id the log also has."""

    async def broken(request):
        raise bug("at /srv/secret/path.py: <class 'x.Y'>")
        yield  # an async generator, like the real one

    gateway.gateway.engine.speak = broken
    with caplog.at_level(logging.ERROR, logger="gateway.servicer"):
        with pytest.raises(grpc.RpcError) as info:
            speak(gateway.stub, text="hi")
    assert info.value.code() == grpc.StatusCode.INTERNAL, info.value
    details = info.value.details()
    match = re.fullmatch(
        r"internal error \(error id ([0-9a-f]{12})\); the server log has the details", details
    )
    assert match, f"not the internal message with an error id: {details!r}"
    logged = [r for r in caplog.records if match.group(1) in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is not None, [r.getMessage() for r in caplog.records]
    assert isinstance(logged[0].exc_info[1], bug), logged[0].exc_info


def _big_audio_script(num_steps: int, samples: int):
    def script(request):
        out = [
            decoder_pb2.GenerateResponse(
                request_id=request.request_id,
                multimodal_output=audio_payload(np.full(samples, (i + 1) / 100, dtype=np.float32)),
            )
            for i in range(num_steps)
        ]
        out.append(decoder_pb2.GenerateResponse(request_id=request.request_id, finished=True))
        return out

    return script


def test_cumulative_output_over_the_message_cap_is_resource_exhausted(sock_dir: Path) -> None:
    """8 steps of 10,000 float32 samples: the CUMULATIVE output outgrows a 64 KiB cap."""
    config = FakeDecoderConfig(script=_big_audio_script(8, 10_000))
    with (
        FakeDecoder(sock_dir / "d.sock", config) as fake,
        GatewayThread(fake.target, sock_dir, max_response_bytes=65536) as gw,
    ):
        request = gateway_pb2.OmniGatewayServiceGenerateRequest(
            request_id="cum", prompt="hi", output_kind=gateway_pb2.OUTPUT_KIND_CUMULATIVE
        )
        received = []
        with pytest.raises(grpc.RpcError) as info:
            for response in gw.stub.Generate(request, timeout=10):
                received.append(response)
        err = info.value
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
        assert err.details().startswith("output_kind: the CUMULATIVE output has reached ")
        assert "OUTPUT_KIND_DELTA" in err.details()
        assert [r.ByteSize() <= 65536 for r in received] == [True] * len(received)
        assert 0 < len(received) < 8
        assert fake.wait_for(lambda: "cum" in fake.state.aborts), "decoder request not aborted"
        # DELTA carries one step per message and is served in full.
        delta = gateway_pb2.OmniGatewayServiceGenerateRequest(prompt="hi")
        outputs = list(gw.stub.Generate(delta, timeout=10))
        assert sum(o.output.multimodal.tensors[0].tensor.shape[0] for o in outputs[:-1]) == 80_000


def test_speak_splits_a_step_larger_than_the_message_cap(sock_dir: Path) -> None:
    config = FakeDecoderConfig(script=_big_audio_script(2, 50_000))  # 100 kB of PCM per step
    with (
        FakeDecoder(sock_dir / "d.sock", config) as fake,
        GatewayThread(fake.target, sock_dir, max_response_bytes=65536) as gw,
    ):
        chunks = speak(gw.stub, request_id="split", text="hi")
    check_stream(chunks, "split")
    assert all(c.ByteSize() <= 65536 for c in chunks), [c.ByteSize() for c in chunks]
    want = pcm16le(torch.full((50_000,), 0.01)) + pcm16le(torch.full((50_000,), 0.02))
    assert b"".join(c.audio for c in chunks) == want
    assert len(chunks) == 5  # 2 pieces per step, then the empty final chunk
    assert chunks[-1].metrics.audio_seconds == pytest.approx(100_000 / 24000)


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
