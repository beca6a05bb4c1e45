"""The gateway's text-to-speech fields (language, a reference clip and its transcript) as each API parses them."""

from __future__ import annotations

import base64

import pytest

from gateway.decoder_client import DecoderInfo
from gateway.http_speech import speech_call_from_json
from gateway.http_voices import audio_from_json
from gateway.http_ws import config_from_json
from gateway.validation import (
    MAX_REFERENCE_BYTES,
    Limits,
    check_language_against,
    check_voice,
    speech_request_from_pb,
)
from omni_common.errors import InvalidArgumentError
from omni_serving.v1 import common_pb2, gateway_pb2

WAV = b"RIFF....WAVEfmt "  # bytes as sent: the decoder decodes them


def test_speech_body_carries_language_and_a_reference_clip() -> None:
    uri = "data:audio/wav;base64," + base64.b64encode(WAV).decode()
    call = speech_call_from_json({"model": "m", "input": "hi", "language": "English", "reference_audio": uri,
                                  "reference_text": " Hello. "}, Limits(), None)
    r = call.request
    assert (r.language, r.reference_text) == ("English", "Hello.")
    assert r.reference_audio is not None and r.reference_audio.data == WAV and r.reference_audio.format == "wav"
    with pytest.raises(InvalidArgumentError, match="reference_audio: is not valid base64"):
        speech_call_from_json({"model": "m", "input": "hi", "reference_audio": "%%%"}, Limits(), None)
    with pytest.raises(InvalidArgumentError, match="reference_audio_format: unknown format"):
        speech_call_from_json({"model": "m", "input": "hi", "reference_audio": "AAAA",
                               "reference_audio_format": "aiff"}, Limits(), None)


def test_audio_from_json_formats_and_limits() -> None:
    assert audio_from_json(base64.b64encode(WAV).decode(), "audio").format == ""  # recognised from the header
    assert audio_from_json("data:audio/mpeg;base64," + base64.b64encode(b"ID3x").decode(), "audio").format == "mp3"
    pcm = audio_from_json(base64.b64encode(b"\0\0").decode(), "audio", "pcm16", 16000)
    assert (pcm.format, pcm.sample_rate) == ("pcm16", 16000)
    for bad, says in (("", "audio: must be a non-empty string"), (3, "audio: must be a non-empty string"),
                      (base64.b64encode(b"x" * (MAX_REFERENCE_BYTES + 3)).decode(), r"audio\.data: is 16777219 bytes"),
                      (base64.b64encode(b"x" * (MAX_REFERENCE_BYTES + 300)).decode(), "audio: is over 16777216 bytes")):
        with pytest.raises(InvalidArgumentError, match=says):
            audio_from_json(bad, "audio")


def test_grpc_speak_and_the_websocket_config_carry_the_same_fields() -> None:
    req = gateway_pb2.SpeakRequest(text="hi", language="english", reference_text="Hello.",
                                   reference_audio=common_pb2.AudioContent(data=WAV))
    parsed = speech_request_from_pb(req, Limits())
    assert parsed.language == "english" and parsed.reference_audio.data == WAV  # type: ignore[union-attr]
    with pytest.raises(InvalidArgumentError, match="reference_audio.data: is empty"):
        speech_request_from_pb(gateway_pb2.SpeakRequest(text="hi", reference_audio=common_pb2.AudioContent()),
                               Limits())
    cfg = config_from_json({"type": "config", "language": "chinese", "reference_text": "Hi.",
                            "reference_audio": base64.b64encode(WAV).decode()}, Limits())
    assert (cfg.language, cfg.reference_text, cfg.reference_audio.data) == ("chinese", "Hi.", WAV)  # type: ignore[union-attr]


def test_language_and_voice_against_the_model() -> None:
    tts = DecoderInfo(voices=("default",), sample_rate_hz=24000, languages=("chinese", "english"),
                      voice_registry=True)
    omni = DecoderInfo(voices=("chelsie",), sample_rate_hz=24000)
    assert check_language_against("English", tts) == "english" and check_language_against("", omni) == ""
    assert check_language_against("auto", omni) == "auto"
    with pytest.raises(InvalidArgumentError, match="language: unknown language 'klingon'; this model speaks: auto"):
        check_language_against("klingon", tts)
    with pytest.raises(InvalidArgumentError, match="language: this model takes no language"):
        check_language_against("english", omni)
    assert check_voice("my-clone", tts) == "my-clone"  # the decoder looks registered names up
    with pytest.raises(InvalidArgumentError, match="voice: unknown voice"):
        check_voice("my-clone", omni)
