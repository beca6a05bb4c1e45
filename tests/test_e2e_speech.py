"""The walking skeleton end to end: three real services on temp-dir sockets."""

from __future__ import annotations

import concurrent.futures
import time

import grpc
import pytest

from decoder_svc.testing.fake_engine import FAKE_SLOW_MARKER
from omni_common.shm_arena import list_segments
from omni_serving.v1 import decoder_pb2, decoder_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from omni_stack.config import StackConfig
from omni_stack.stack import Stack
from tests.speech_helpers import check_chunks, digest, reference_audio_sync, speak_chunks

pytestmark = pytest.mark.e2e

TEXTS = [("Hello there", 7), ("The quick brown fox jumps over the lazy dog", 11)]


@pytest.fixture(scope="module", params=["reference", "pool"])
def stack(request, tmp_path_factory):
    """The stack, once per shipped materializer, chosen by configuration only."""
    runtime = tmp_path_factory.mktemp("rt")
    s = Stack(StackConfig(engine="fake", materializer_impl=request.param, runtime_dir=str(runtime), port=0,
                          http_port=0, log_level="WARNING"))
    s.start()
    yield s
    left = s.stop()
    assert left == [], f"shared-memory segments left after shutdown: {left}"


def test_two_concurrent_speaks_match_sync_in_process(stack):
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda ts: speak_chunks(stack.gateway_target, ts[0], ts[1]), TEXTS))
    for (text, seed), chunks in zip(TEXTS, results, strict=True):
        pcm = check_chunks(chunks)
        assert chunks[0].sample_rate_hz == 24000
        assert len(pcm) > 0
        want = reference_audio_sync(text, seed)
        assert digest(pcm) == digest(want), f"{text!r}: async audio differs from sync in-process ({len(pcm)=}, {len(want)=})"
    with grpc.insecure_channel(stack.decoder_target) as ch:
        info = decoder_pb2_grpc.DecoderServiceStub(ch).GetDecoderInfo(decoder_pb2.GetDecoderInfoRequest())
    talker = info.stages[0]
    assert talker.output_path == decoder_pb2.OUTPUT_PATH_ASYNC, f"talker ran {talker.output_path=} ({talker.reason})"
    assert info.materializer_connected and info.fallback_steps == 0, f"{info.fallback_steps=}"
    assert info.arena.peak_slots_in_use >= 1
    assert list_segments(stack.shm_prefix), "decoder arena segment should exist while running"


@pytest.mark.parametrize(
    ("text", "modalities", "field"),
    [("", "", "prompt"), ("hi", "smell", "output_modalities")],
)
def test_bad_generate_input_is_invalid_argument(stack, text, modalities, field):
    with grpc.insecure_channel(stack.gateway_target) as ch:
        stub = gateway_pb2_grpc.OmniGatewayServiceStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(gateway_pb2.OmniGatewayServiceGenerateRequest(prompt=text, output_modalities=modalities)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
    assert field in err.value.details(), f"{field=} not named in {err.value.details()!r}"


def test_empty_speak_text_is_invalid_argument(stack):
    with pytest.raises(grpc.RpcError) as err:
        speak_chunks(stack.gateway_target, "", 1)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "text" in err.value.details()


def _decoder_info(stack) -> decoder_pb2.GetDecoderInfoResponse:
    with grpc.insecure_channel(stack.decoder_target) as ch:
        return decoder_pb2_grpc.DecoderServiceStub(ch).GetDecoderInfo(decoder_pb2.GetDecoderInfoRequest())


def test_cancel_mid_stream_frees_the_request_in_the_decoder(stack):
    before = _decoder_info(stack).aborted_requests
    with grpc.insecure_channel(stack.gateway_target) as ch:
        stub = gateway_pb2_grpc.OmniGatewayServiceStub(ch)
        long_text = FAKE_SLOW_MARKER + "a long text to speak " * 40  # about 4 s: still running
        call = stub.Speak(gateway_pb2.SpeakRequest(text=long_text, request_id="cancel-me"))
        first = next(call)
        assert first.request_id == "cancel-me" and first.sequence_number == 0
        call.cancel()
    deadline = time.monotonic() + 10
    info = _decoder_info(stack)
    while time.monotonic() < deadline and (info.active_requests or info.aborted_requests == before):
        time.sleep(0.05)
        info = _decoder_info(stack)
    assert info.active_requests == 0, f"{info.active_requests=} after cancel"
    assert info.aborted_requests == before + 1, f"{info.aborted_requests=}, {before=}"


def test_openai_client_bytes_equal_grpc(stack):
    openai = pytest.importorskip("openai")
    text, seed = "Hello from the HTTP facade", 5
    grpc_pcm = check_chunks(speak_chunks(stack.gateway_target, text, seed, voice="alloy"))
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{stack.cfg.http_port}/v1", api_key="unused")
    with client.audio.speech.with_streaming_response.create(
        model="omni-serving", voice="alloy", input=text, response_format="pcm", extra_body={"seed": seed}
    ) as response:
        http_pcm = b"".join(response.iter_bytes())
    assert http_pcm and digest(http_pcm) == digest(grpc_pcm), f"{len(http_pcm)=} {len(grpc_pcm)=}"

