"""Request validation: protobuf or JSON requests in, domain requests out.

Every refusal is an `InvalidArgumentError` whose message starts with the
offending field's name as the client spelled it (``text`` in Speak,
``prompt`` in Generate, ``input`` over HTTP). Checks that need the decoder
(voices, native sample rate) take its `DecoderInfo`.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from gateway.decoder_client import DecoderInfo
from gateway.output_processor import OutputKind
from omni_common.errors import InvalidArgumentError
from omni_common.modality import OutputModality
from omni_serving.v1 import common_pb2, decoder_pb2, gateway_pb2

DEFAULT_MAX_TEXT_CHARS = 4096
MAX_REQUEST_ID_CHARS = 128
NATIVE_SAMPLE_RATE = 0
"""`sample_rate_hz` value meaning "the model's native rate"."""

_SUPPORTED_ENCODINGS = {
    gateway_pb2.AUDIO_ENCODING_UNSPECIFIED: gateway_pb2.AUDIO_ENCODING_PCM16LE,
    gateway_pb2.AUDIO_ENCODING_PCM16LE: gateway_pb2.AUDIO_ENCODING_PCM16LE,
}
_DEFAULT_GENERATE_MODALITIES = "audio"


@dataclass(frozen=True)
class Limits:
    """Bounds the gateway enforces on requests."""

    max_text_chars: int = DEFAULT_MAX_TEXT_CHARS


@dataclass(frozen=True)
class SpeechRequest:
    """A validated text-to-speech request (voice and rate still to be checked against the decoder)."""

    request_id: str
    text: str
    voice: str = ""
    sample_rate_hz: int = NATIVE_SAMPLE_RATE
    encoding: int = gateway_pb2.AUDIO_ENCODING_PCM16LE
    sampling_params: common_pb2.SamplingParams | None = None


@dataclass(frozen=True)
class GenerationRequest:
    """A validated Generate request (voice still to be checked against the decoder)."""

    request_id: str
    prompt: str
    output_modality: OutputModality
    output_kind: OutputKind
    voice: str = ""
    sampling_params: common_pb2.SamplingParams | None = None


# ---------------------------------------------------------------------------
# Field checks.


def check_request_id(request_id: str, field: str = "request_id") -> str:
    """The client's id, or a fresh one when empty."""
    if not request_id:
        return uuid.uuid4().hex
    if len(request_id) > MAX_REQUEST_ID_CHARS or not request_id.isprintable():
        raise InvalidArgumentError(
            field, f"must be printable and at most {MAX_REQUEST_ID_CHARS} characters"
        )
    return request_id


def check_text(text: object, limits: Limits, field: str) -> str:
    """Non-blank text of at most `limits.max_text_chars` characters."""
    if not isinstance(text, str):
        raise InvalidArgumentError(field, f"must be a string, got {type(text).__name__}")
    if not text.strip():
        raise InvalidArgumentError(field, "must not be empty")
    if len(text) > limits.max_text_chars:
        raise InvalidArgumentError(
            field, f"has {len(text)} characters; the limit is {limits.max_text_chars}"
        )
    return text


def check_encoding(encoding: int, field: str = "encoding") -> int:
    """The encoding to produce (UNSPECIFIED means PCM16LE)."""
    resolved = _SUPPORTED_ENCODINGS.get(encoding)
    if resolved is None:
        name = (
            gateway_pb2.AudioEncoding.Name(encoding)
            if encoding in gateway_pb2.AudioEncoding.values()
            else str(encoding)
        )
        raise InvalidArgumentError(
            field, f"unsupported encoding {name}; supported: AUDIO_ENCODING_PCM16LE"
        )
    return resolved


def check_sample_rate_shape(rate: int, field: str = "sample_rate_hz") -> int:
    """A request-only check: a non-negative, plausible rate (the decoder decides the rest)."""
    if rate < 0 or rate > 384_000:
        raise InvalidArgumentError(field, f"{rate} is out of range")
    return rate


def check_sampling_params(
    params: common_pb2.SamplingParams | None, field: str = "sampling_params"
) -> common_pb2.SamplingParams | None:
    if params is None:
        return None
    if params.temperature < 0:
        raise InvalidArgumentError(
            f"{field}.temperature", f"must be >= 0, got {params.temperature}"
        )
    if not 0 <= params.top_p <= 1:
        raise InvalidArgumentError(f"{field}.top_p", f"must be in [0, 1], got {params.top_p}")
    if params.top_k < -1:
        raise InvalidArgumentError(f"{field}.top_k", f"must be >= -1, got {params.top_k}")
    return params


def check_voice(voice: str, info: DecoderInfo, field: str = "voice") -> str:
    """A voice the decoder lists; empty means its first voice (or none if it lists none)."""
    if not voice:
        return info.voices[0] if info.voices else ""
    if voice not in info.voices:
        listed = ", ".join(info.voices) if info.voices else "none"
        raise InvalidArgumentError(field, f"unknown voice {voice!r}; voices: {listed}")
    return voice


def check_sample_rate(rate: int, info: DecoderInfo, field: str = "sample_rate_hz") -> int:
    """The rate to send: 0 (native) or the native rate; no resampling is done."""
    if rate in (NATIVE_SAMPLE_RATE, info.sample_rate_hz):
        return info.sample_rate_hz
    raise InvalidArgumentError(
        field,
        f"{rate} Hz is not supported; supported: 0 (native) or {info.sample_rate_hz} "
        "(the gateway does not resample)",
    )


# ---------------------------------------------------------------------------
# Whole requests.


def speech_request_from_pb(request: gateway_pb2.SpeakRequest, limits: Limits) -> SpeechRequest:
    """Validate a `SpeakRequest` (fields named as in the proto)."""
    return SpeechRequest(
        request_id=check_request_id(request.request_id),
        text=check_text(request.text, limits, "text"),
        voice=request.voice,
        sample_rate_hz=check_sample_rate_shape(request.sample_rate_hz),
        encoding=check_encoding(request.encoding),
        sampling_params=check_sampling_params(
            request.sampling_params if request.HasField("sampling_params") else None
        ),
    )


def generation_request_from_pb(
    request: gateway_pb2.OmniGatewayServiceGenerateRequest, limits: Limits
) -> GenerationRequest:
    """Validate a Generate request (fields named as in the proto)."""
    return GenerationRequest(
        request_id=check_request_id(request.request_id),
        prompt=check_text(request.prompt, limits, "prompt"),
        output_modality=OutputModality.from_string(
            request.output_modalities or _DEFAULT_GENERATE_MODALITIES, field="output_modalities"
        ),
        output_kind=OutputKind.from_proto(request.output_kind),
        voice=request.voice,
        sampling_params=check_sampling_params(
            request.sampling_params if request.HasField("sampling_params") else None
        ),
    )


def decoder_request(
    request_id: str,
    prompt: str,
    modality: OutputModality,
    voice: str,
    sampling_params: common_pb2.SamplingParams | None,
) -> decoder_pb2.GenerateRequest:
    """The `DecoderService.Generate` request for a validated gateway request."""
    out = decoder_pb2.GenerateRequest(
        request_id=request_id,
        prompt=prompt,
        output_modalities=modality.to_proto(),
        voice=voice,
        task=common_pb2.REQUEST_TASK_GENERATE,
    )
    if sampling_params is not None:
        out.sampling_params.CopyFrom(sampling_params)
    return out


__all__ = [
    "DEFAULT_MAX_TEXT_CHARS",
    "NATIVE_SAMPLE_RATE",
    "GenerationRequest",
    "Limits",
    "SpeechRequest",
    "check_encoding",
    "check_request_id",
    "check_sample_rate",
    "check_sampling_params",
    "check_text",
    "check_voice",
    "decoder_request",
    "generation_request_from_pb",
    "speech_request_from_pb",
]
