"""Qwen3-TTS served by `omni-serving up --model DIR` (the stack's processes, the real engine).

The tiny checkpoints of tests/golden/qwen3_tts (scripts/gen_golden_qwen3_tts.py) are served with
`--profile auto` (the model's own: tts); greedy speech through gRPC and HTTP equals the reference's
audio (16-bit PCM within 4 steps), with speakers, style instructions, languages, a clip sent with
the request, and a voice registered once (HTTP) then named (gRPC), listed and deleted.
"""

from __future__ import annotations

import base64
import io
import json
import wave
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest

from omni_serving.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from omni_stack.config import StackConfig
from omni_stack.stack import Stack
from tests.fs_helpers import tree_snapshot
from tests.speech_helpers import check_chunks

pytest.importorskip("vllm")
pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.parity]

GOLDEN = Path(__file__).parent / "golden" / "qwen3_tts"
MANIFEST = json.loads((GOLDEN / "manifest.json").read_text())
FRAMES = MANIFEST["max_new_tokens"] - 1  # the reference drops its last step's frame


def _expected(case: str, item: int = 0) -> np.ndarray:
    wav = np.load(GOLDEN / MANIFEST["cases"][case]["file"])[f"wav_{item}"]
    return np.clip(np.round(wav * 32767.0), -32768, 32767).astype(np.int32)


def _pcm(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i2").astype(np.int32)


def _same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert np.abs(got - want).max() <= 4, f"{what}: audio differs from the reference"


def _clip_wav() -> bytes:
    clip = np.load(GOLDEN / "encode.npz")["clip"]
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(4)  # 32-bit PCM: the clip's float samples within 2**-31
        w.setframerate(24000)
        w.writeframes(np.round(clip.astype(np.float64) * 2**31).clip(-2**31, 2**31 - 1).astype("<i4").tobytes())
    return buf.getvalue()


def _stack(tmp_path_factory, model: Path) -> Stack:
    stack = Stack(StackConfig(engine="vllm", profile="auto", model=str(model), port=0, http_port=0,
                              runtime_dir=str(tmp_path_factory.mktemp("rt")), log_level="WARNING",
                              voice_dir=str(tmp_path_factory.mktemp("voices"))))
    stack.start(timeout_s=300)
    return stack


def _speak(stub, **fields) -> np.ndarray:
    req = gateway_pb2.SpeakRequest(sampling_params=common_pb2.SamplingParams(temperature=0, max_tokens=FRAMES),
                                   **fields)
    return _pcm(check_chunks(list(stub.Speak(req, timeout=300))))


def _http(stack: Stack) -> httpx.Client:
    return httpx.Client(base_url=stack.http_url, timeout=300)


def _speech_body(**fields) -> dict:
    return {"model": "custom_voice", "response_format": "pcm", "temperature": 0, "max_tokens": FRAMES, **fields}


def test_custom_voice_speakers_instructions_and_languages(tmp_path_factory, tts_checkpoints) -> None:
    stack = _stack(tmp_path_factory, tts_checkpoints["custom_voice"])
    try:
        with grpc.insecure_channel(stack.gateway_target) as ch:
            stub = gateway_pb2_grpc.OmniGatewayServiceStub(ch)
            card = stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=30).models[0]
            assert card.profile == "tts" and list(card.voices) == ["vivian", "ryan", "eric", "dylan"]
            assert card.speech_instructions and not card.voice_registry and "english" in card.languages
            single = MANIFEST["cases"]["custom_voice/single"]["args"]
            got = _speak(stub, text=single["text"], voice="vivian", language="English")
            _same(got, _expected("custom_voice/single"), "gRPC Speak")
            # text streamed in (one clause: one segment), with the call's voice and language
            batch = MANIFEST["cases"]["custom_voice/batch"]["args"]
            config = gateway_pb2.SpeakStreamConfig(
                voice=batch["speaker"][2], language=batch["language"][2],
                sampling_params=common_pb2.SamplingParams(temperature=0, max_tokens=FRAMES))
            calls = [gateway_pb2.SpeakStreamRequest(config=config),
                     gateway_pb2.SpeakStreamRequest(text=batch["text"][2]),
                     gateway_pb2.SpeakStreamRequest(end=gateway_pb2.SpeakStreamEnd())]
            streamed = b"".join(r.audio for r in stub.SpeakStream(iter(calls), timeout=300))
            _same(_pcm(streamed), _expected("custom_voice/batch", 2), "SpeakStream")
            with pytest.raises(grpc.RpcError) as err:
                stub.RegisterVoice(gateway_pb2.OmniGatewayServiceRegisterVoiceRequest(
                    name="x", audio=common_pb2.AudioContent(data=_clip_wav())), timeout=30)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        with _http(stack) as http:
            for i in (1, 2):  # a style instruction and auto language; Chinese in a speaker's dialect
                r = http.post("/v1/audio/speech", json=_speech_body(
                    input=batch["text"][i], voice=batch["speaker"][i], language=batch["language"][i],
                    instructions=batch["instruct"][i]))
                assert r.status_code == 200, r.text
                _same(_pcm(r.content), _expected("custom_voice/batch", i), f"HTTP speech, item {i}")
            for body, param in ((_speech_body(input="hi", voice="vivian", language="klingon"), "language"),
                                (_speech_body(input="hi", voice="nobody"), "voice"),
                                (_speech_body(input="hi", voice="vivian", reference_audio=base64.b64encode(
                                    _clip_wav()).decode()), "reference_audio")):
                r = http.post("/v1/audio/speech", json=body)
                assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    finally:
        assert stack.stop() == []


def test_voice_clone_with_a_clip_and_with_a_registered_voice(tmp_path_factory, tts_checkpoints) -> None:
    """... and the model's directory is only read: the registry lives in --voice-dir."""
    before = tree_snapshot(tts_checkpoints["base"])
    stack = _stack(tmp_path_factory, tts_checkpoints["base"])
    icl = MANIFEST["cases"]["base/icl"]["args"]
    xvec = MANIFEST["cases"]["base/xvector"]["args"]
    try:
        with _http(stack) as http, grpc.insecure_channel(stack.gateway_target) as ch:
            stub = gateway_pb2_grpc.OmniGatewayServiceStub(ch)
            # the clip with the request (the voice alone: no transcript)
            got = _speak(stub, text=xvec["text"], language="English",
                         reference_audio=common_pb2.AudioContent(data=_clip_wav()))
            _same(got, _expected("base/xvector"), "a clip sent with the request")
            # registered once over HTTP (multipart), with its transcript: in context
            r = http.post("/v1/audio/voices", data={"name": "ref-voice", "transcript": icl["ref_text"]},
                          files={"audio": ("clip.wav", _clip_wav(), "audio/wav")})
            assert r.status_code == 201, r.text
            assert r.json()["name"] == "ref-voice" and r.json()["duration_seconds"] == pytest.approx(1.2)
            r = http.post("/v1/audio/voices", data={"name": "ref-voice"},
                          files={"audio": ("clip.wav", _clip_wav(), "audio/wav")})
            assert r.status_code == 409, r.text
            listed = stub.ListVoices(gateway_pb2.OmniGatewayServiceListVoicesRequest(), timeout=30).voices
            assert [v.name for v in listed] == ["ref-voice"] and listed[0].transcript == icl["ref_text"]
            for _ in range(2):  # named twice: the features come from the registry both times
                got = _speak(stub, text=icl["text"], voice="ref-voice", language="English")
                _same(got, _expected("base/icl"), "a registered voice")
            r = http.post("/v1/audio/speech", json=_speech_body(model="base", input="hi"))
            assert r.status_code == 400 and r.json()["error"]["param"] == "reference_audio", r.text
            bad = http.post("/v1/audio/voices", json={"name": "noise", "audio": base64.b64encode(b"not audio").decode()})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "audio", bad.text
            assert http.delete("/v1/audio/voices/ref-voice").json()["deleted"] is True
            assert http.delete("/v1/audio/voices/ref-voice").status_code == 404
            r = http.post("/v1/audio/speech", json=_speech_body(model="base", input="hi", voice="ref-voice"))
            assert r.status_code == 400 and r.json()["error"]["param"] == "voice", r.text
            assert http.get("/v1/audio/voices").json()["data"] == []
    finally:
        assert stack.stop() == []
    assert tree_snapshot(tts_checkpoints["base"]) == before, "the model's directory changed"


def test_voice_design_described_voices(tmp_path_factory, tts_checkpoints) -> None:
    stack = _stack(tmp_path_factory, tts_checkpoints["voice_design"])
    single = MANIFEST["cases"]["voice_design/single"]["args"]
    batch = MANIFEST["cases"]["voice_design/batch"]["args"]
    try:
        with _http(stack) as http, grpc.insecure_channel(stack.gateway_target) as ch:
            stub = gateway_pb2_grpc.OmniGatewayServiceStub(ch)
            card = stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=30).models[0]
            assert list(card.voices) == ["default"] and card.speech_instructions and not card.voice_registry
            r = http.post("/v1/audio/speech", json=_speech_body(
                model="voice_design", input=single["text"], instructions=single["instruct"],
                language=single["language"]))
            assert r.status_code == 200, r.text
            _same(_pcm(r.content), _expected("voice_design/single"), "HTTP speech, a described voice")
            got = _speak(stub, text=batch["text"][1], instructions=batch["instruct"][1], language=batch["language"][1])
            _same(got, _expected("voice_design/batch", 1), "gRPC Speak, a described voice")
    finally:
        assert stack.stop() == []
