"""Request validation: protobuf or JSON requests in, domain requests out.

Every refusal is an `InvalidArgumentError` whose message starts with the
offending field's name as the client spelled it (``text`` in Speak,
``prompt`` in Generate, ``input`` over HTTP) and quotes at most a short
prefix of the value (`quote_value`). Checks that need the decoder (voices,
native sample rate) take its `DecoderInfo`.

Sampling parameters are checked against what the vLLM engine accepts
(vllm/sampling_params.py, ``SamplingParams._verify_args``), so a request
the gateway admits is not refused deep in the engine:

* ``temperature``: finite, in [0, 2] (0 = greedy);
* ``top_p``: finite, in [0, 1] (0 or 1 = off; the decoder sends 0 as 1);
* ``top_k``: >= 0 (0 = off; vLLM caps values above the vocabulary);
* ``max_tokens``: any uint32 (0 = the decoder's default); at most the
  deployment's ``max_text_tokens`` where it produces text; the decoder
  refuses prompt + max_tokens beyond the model's context (INVALID_ARGUMENT);
* ``max_audio_seconds``: finite, >= 0 (0 = the deployment's default), at
  most the deployment's ``max_audio_seconds``;
* ``seed``: below 2**63, the range every engine's int64 seed arithmetic holds;
* ``first_chunk_frames``: 0 (the deployment's choice) or at most the
  deployment's ``max_first_chunk_frames``, on requests with audio.

Checks against what the deployment can do (`check_against_decoder`, with the
decoder's `DecoderInfo`): the output modalities it produces, whether it takes
``instructions``, its length caps. A decoder that reports no modalities (an
older one) is not checked for them; instructions need a decoder that says it
supports them.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass

from gateway.decoder_client import DecoderInfo
from gateway.output_processor import OutputKind
from omni_common.conversation import (
    NO_AUDIO_INPUT,
    NO_IMAGE_INPUT,
    Turn,
    audio_parts,
    conversation_from_pb,
    image_parts,
    turn_text,
    turns_to_pb,
)
from omni_common.errors import InvalidArgumentError, ResourceExhaustedError, quote_value
from omni_common.modality import OutputModality
from omni_common.stop_strings import check_stops
from omni_common.voices import resolve_voice
from omni_serving.v1 import common_pb2, decoder_pb2, gateway_pb2

DEFAULT_MAX_TEXT_CHARS = 4096
DEFAULT_MAX_RESPONSE_BYTES = 3 * 2**20
"""Largest response message the gateway sends: below gRPC clients' default 4 MiB limit."""
MAX_REQUEST_ID_CHARS = 128
MAX_VOICE_CHARS = 128
MAX_MODALITIES_CHARS = 64
NATIVE_SAMPLE_RATE = 0
"""`sample_rate_hz` value meaning "the model's native rate"."""
MAX_TEMPERATURE = 2.0
"""vLLM refuses a temperature above 2."""
MAX_AUDIO_PARTS = MAX_IMAGE_PARTS = 64
"""Audio (image) parts a request may carry before any decoder is asked (each
decoder's own limit, DeploymentLimits.max_input_audio_parts / _image_parts, is lower)."""
MAX_SEED = 2**63 - 1
"""Largest seed accepted: the engines hold seeds in signed 64-bit integers."""

_SUPPORTED_ENCODINGS = {
    gateway_pb2.AUDIO_ENCODING_UNSPECIFIED: gateway_pb2.AUDIO_ENCODING_PCM16LE,
    gateway_pb2.AUDIO_ENCODING_PCM16LE: gateway_pb2.AUDIO_ENCODING_PCM16LE,
}
_DEFAULT_GENERATE_MODALITIES = "audio"


@dataclass(frozen=True)
class Limits:
    """Bounds the gateway enforces on requests."""

    max_text_chars: int = DEFAULT_MAX_TEXT_CHARS
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES
    """Largest response message; see `check_response_size`."""

    def __post_init__(self) -> None:
        if self.max_text_chars < 1:
            raise InvalidArgumentError("max_text_chars", f"must be >= 1, got {self.max_text_chars}")
        if self.max_response_bytes < 64 * 1024:
            raise InvalidArgumentError(
                "max_response_bytes", f"must be >= 65536, got {self.max_response_bytes}"
            )


@dataclass(frozen=True)
class SpeechRequest:
    """A validated text-to-speech request (voice and rate are checked against the decoder later)."""

    request_id: str
    text: str
    voice: str = ""
    sample_rate_hz: int = NATIVE_SAMPLE_RATE
    encoding: int = gateway_pb2.AUDIO_ENCODING_PCM16LE
    sampling_params: common_pb2.SamplingParams | None = None
    instructions: str = ""
    language: str = ""
    # a voice-clone model's reference clip (as sent) and its transcript
    reference_audio: common_pb2.AudioContent | None = None
    reference_text: str = ""


@dataclass(frozen=True)
class GenerationRequest:
    """A validated Generate request (voice still to be checked against the decoder)."""

    request_id: str
    prompt: str
    output_modality: OutputModality
    output_kind: OutputKind
    voice: str = ""
    sampling_params: common_pb2.SamplingParams | None = None
    instructions: str = ""
    messages: tuple[Turn, ...] = ()
    """A conversation instead of `prompt` ((role, content) turns, omni_common.conversation)."""


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


def json_type_name(value: object) -> str:
    """The JSON name of a decoded JSON value's type (for messages to HTTP clients)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)):
        return "array"
    if isinstance(value, dict):
        return "object"
    return "unsupported value"


def check_unicode(text: str, field: str) -> str:
    """Text that encodes as UTF-8 (JSON can carry unpaired surrogates; protobuf cannot)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgumentError(
            field, f"is not valid Unicode: unpaired surrogate at character {exc.start}"
        ) from None
    return text


def check_text(text: object, limits: Limits, field: str) -> str:
    """Non-blank text of at most `limits.max_text_chars` characters."""
    if not isinstance(text, str):
        raise InvalidArgumentError(field, f"must be a string, got {json_type_name(text)}")
    if len(text) > limits.max_text_chars:
        raise InvalidArgumentError(
            field, f"has {len(text)} characters; the limit is {limits.max_text_chars}"
        )
    if not text.strip():
        raise InvalidArgumentError(field, "must not be empty")
    return check_unicode(text, field)


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


def _check_float(value: float, field: str, low: float, high: float, note: str = "") -> None:
    if not math.isfinite(value):
        raise InvalidArgumentError(field, f"must be a finite number, got {value}")
    if not low <= value <= high:
        raise InvalidArgumentError(field, f"must be in [{low:g}, {high:g}]{note}, got {value:g}")


def check_sampling_params(
    params: common_pb2.SamplingParams | None, field: str = "sampling_params"
) -> common_pb2.SamplingParams | None:
    """Sampling parameters within what the engine accepts (see the module docstring)."""
    if params is None:
        return None
    _check_float(params.temperature, f"{field}.temperature", 0.0, MAX_TEMPERATURE, " (0 = greedy)")
    _check_float(params.top_p, f"{field}.top_p", 0.0, 1.0, " (0 or 1 = off)")
    if params.top_k < 0:
        raise InvalidArgumentError(f"{field}.top_k", f"must be >= 0 (0 = off), got {params.top_k}")
    if params.HasField("seed"):
        check_seed(params.seed, f"{field}.seed")
    if not math.isfinite(params.max_audio_seconds):
        raise InvalidArgumentError(
            f"{field}.max_audio_seconds", f"must be a finite number, got {params.max_audio_seconds}"
        )
    if params.max_audio_seconds < 0:
        raise InvalidArgumentError(
            f"{field}.max_audio_seconds",
            f"must be >= 0 (0 = the deployment's default), got {params.max_audio_seconds:g}",
        )
    check_stops(params.stop, f"{field}.stop")
    return params


def check_instructions(text: str, limits: Limits, field: str = "instructions") -> str:
    """Optional style instructions: at most `limits.max_text_chars`, valid Unicode; blank = none."""
    if len(text) > limits.max_text_chars:
        raise InvalidArgumentError(
            field, f"has {len(text)} characters; the limit is {limits.max_text_chars}"
        )
    return check_unicode(text, field).strip()


def check_against_decoder(
    info: DecoderInfo,
    *,
    modality: OutputModality,
    sampling_params: common_pb2.SamplingParams | None,
    instructions: str,
    modality_field: str = "output_modalities",
    field: str = "sampling_params",
    conversation: tuple[Turn, ...] = (),
    verbatim: bool = False,
    instructions_field: str = "instructions",
) -> None:
    """A request against what the deployment can do (see the module docstring;
    `conversation`: the request's messages, which need a text stage, and whose
    audio and image parts need a deployment that takes them, within its
    limits; `verbatim`: a text spoken as written, which takes no instructions
    nor stop sequences)."""
    if instructions and verbatim and not info.speech_instructions:
        raise InvalidArgumentError(
            instructions_field,
            "speech speaks the text as written: no text stage reads style instructions "
            "(give them to Generate on a deployment that takes them)",
        )
    if info.output_modalities:
        produced = OutputModality.from_string("+".join(info.output_modalities))
        missing = modality & ~produced
        if missing:
            raise InvalidArgumentError(
                modality_field,
                f"this deployment (profile {info.profile or 'unknown'}) produces "
                f"{produced.to_string()}; {missing.to_string()} cannot be produced",
            )
    if instructions and not info.supports_instructions:
        raise InvalidArgumentError(
            instructions_field,
            f"this deployment (profile {info.profile or 'unknown'}) does not take instructions",
        )
    for kind, parts, allowed, none_taken in (
            ("audio", audio_parts(conversation), info.limits.max_input_audio_parts, NO_AUDIO_INPUT),
            ("image", image_parts(conversation), info.limits.max_input_image_parts, NO_IMAGE_INPUT)):
        if len(parts) > allowed:
            raise InvalidArgumentError(
                parts[allowed].field,
                none_taken if not allowed else f"the request has {len(parts)} {kind} parts; this deployment takes "
                                               f"at most {allowed}")
    if conversation and not info.supports_instructions:
        raise InvalidArgumentError(
            "messages",
            f"this deployment (profile {info.profile or 'unknown'}) speaks its input as is: a conversation "
            "needs a text stage (a profile with a thinker, such as omni); send prompt",
        )
    if sampling_params is None:
        return
    limits = info.limits
    if sampling_params.stop and (verbatim or not info.supports_instructions):  # (a text stage)
        raise InvalidArgumentError(
            f"{field}.stop",
            "speech speaks the text as written: there is no text for a stop sequence to end" if verbatim else
            f"this deployment (profile {info.profile or 'unknown'}) has no text stage whose text a stop "
            "sequence could end",
        )
    if limits.max_audio_seconds and sampling_params.max_audio_seconds > limits.max_audio_seconds:
        raise InvalidArgumentError(
            f"{field}.max_audio_seconds",
            f"{sampling_params.max_audio_seconds:g} s is above this deployment's maximum of "
            f"{limits.max_audio_seconds:g} s",
        )
    first = sampling_params.first_chunk_frames
    if first and modality & OutputModality.AUDIO and limits.max_first_chunk_frames and first > limits.max_first_chunk_frames:
        raise InvalidArgumentError(
            f"{field}.first_chunk_frames",
            f"{first} is above this deployment's maximum of {limits.max_first_chunk_frames} codec frames "
            "(0 = the deployment's choice)",
        )
    # (speech: max_tokens caps the codec frames, which max_audio_seconds bounds)
    if limits.max_text_tokens and not verbatim and sampling_params.max_tokens > limits.max_text_tokens:
        raise InvalidArgumentError(
            f"{field}.max_tokens",
            f"{sampling_params.max_tokens} is above this deployment's maximum of "
            f"{limits.max_text_tokens} text tokens",
        )


def check_seed(seed: int, field: str = "seed") -> int:
    """A seed in [0, 2**63)."""
    if not 0 <= seed <= MAX_SEED:
        raise InvalidArgumentError(field, f"must be in [0, 2**63), got {quote_value(seed)}")
    return seed


def check_voice(voice: str, info: DecoderInfo, field: str = "voice") -> str:
    """The decoder's voice for `voice`: one it lists, or its voice for an
    alias it reports ("default", OpenAI's names); empty means its first
    voice (or none if it lists none) (``omni_common.voices``). Where the
    model has a voice registry, any other name goes on: the decoder looks
    it up among the registered voices (and refuses an unknown one)."""
    try:
        return resolve_voice(voice, info.voices, info.voice_aliases, field)
    except InvalidArgumentError:
        if info.voice_registry:
            return voice
        raise


def check_voice_shape(voice: str, field: str = "voice") -> str:
    """A request-only check: a voice name of plausible length (the decoder lists the rest)."""
    if len(voice) > MAX_VOICE_CHARS:
        raise InvalidArgumentError(
            field, f"has {len(voice)} characters; no voice name is longer than {MAX_VOICE_CHARS}"
        )
    return check_unicode(voice, field)


def check_modalities(text: str, field: str = "output_modalities") -> OutputModality:
    """A modality set such as ``text+audio``; empty means audio."""
    if len(text) > MAX_MODALITIES_CHARS:
        raise InvalidArgumentError(
            field, f"has {len(text)} characters; the limit is {MAX_MODALITIES_CHARS}"
        )
    return OutputModality.from_string(text or _DEFAULT_GENERATE_MODALITIES, field=field)


def check_response_size(size: int, kind: OutputKind, limits: Limits) -> int:
    """Refuse to send a response message over `limits.max_response_bytes`.

    Only a CUMULATIVE or FINAL_ONLY output can grow that large (it carries
    everything so far); a DELTA output carries one decoder step. The client
    is told to ask for DELTA.
    """
    if size > limits.max_response_bytes:
        raise ResourceExhaustedError(
            f"output_kind: the {kind.name} output has reached {size} bytes, over the gateway's "
            f"limit of {limits.max_response_bytes} bytes per message; request OUTPUT_KIND_DELTA "
            "and concatenate the deltas"
        )
    return size


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
        voice=check_voice_shape(request.voice),
        sample_rate_hz=check_sample_rate_shape(request.sample_rate_hz),
        encoding=check_encoding(request.encoding),
        sampling_params=check_sampling_params(
            request.sampling_params if request.HasField("sampling_params") else None
        ),
        instructions=check_instructions(request.instructions, limits),
        language=check_language(request.language),
        reference_audio=check_reference_audio(request.reference_audio if request.HasField("reference_audio")
                                              else None),
        reference_text=check_instructions(request.reference_text, limits, "reference_text"),
    )


MAX_LANGUAGE_CHARS = 64
MAX_REFERENCE_BYTES = 16 * 2**20


def check_language(language: str, field: str = "language") -> str:
    """A language name of plausible shape (the decoder lists the ones it speaks)."""
    if len(language) > MAX_LANGUAGE_CHARS:
        raise InvalidArgumentError(field, f"has {len(language)} characters; no language name is longer than "
                                          f"{MAX_LANGUAGE_CHARS}")
    return check_unicode(language, field).strip()


def check_language_against(language: str, info: DecoderInfo, field: str = "language") -> str:
    """A request's language against the model's (`info.languages`, case-insensitive); "" and
    "auto" let the model choose. A model that takes none refuses any other: nothing is ignored."""
    lang = language.strip().lower()
    if lang in ("", "auto"):
        return lang
    if not info.languages:
        raise InvalidArgumentError(field, f"this model takes no language (it speaks the text as it is written); "
                                          f"got {language!r}")
    if lang not in info.languages:
        raise InvalidArgumentError(field, f"unknown language {language!r}; this model speaks: auto, "
                                          f"{', '.join(info.languages)}")
    return lang


def check_reference_audio(audio: common_pb2.AudioContent | None,
                          field: str = "reference_audio") -> common_pb2.AudioContent | None:
    """A reference clip as sent: present data within the size limit (the decoder decodes it)."""
    if audio is None:
        return None
    if not audio.data:
        raise InvalidArgumentError(f"{field}.data", "is empty")
    if len(audio.data) > MAX_REFERENCE_BYTES:
        raise InvalidArgumentError(f"{field}.data", f"is {len(audio.data)} bytes; a reference clip is at most "
                                                    f"{MAX_REFERENCE_BYTES} bytes")
    return audio


def generation_request_from_pb(
    request: gateway_pb2.OmniGatewayServiceGenerateRequest, limits: Limits
) -> GenerationRequest:
    """Validate a Generate request (fields named as in the proto)."""
    messages: tuple[Turn, ...] = ()
    if request.messages:
        if request.prompt:
            raise InvalidArgumentError("messages", "give prompt or messages, not both")
        if request.instructions.strip():
            raise InvalidArgumentError("instructions", "with messages, style instructions are a system turn")
        messages = conversation_from_pb(request.messages, limits.max_text_chars, max_audio_parts=MAX_AUDIO_PARTS,
                                        max_image_parts=MAX_IMAGE_PARTS)
        for i, (_, content) in enumerate(messages):
            check_unicode(turn_text(content), f"messages[{i}].content")
    return GenerationRequest(
        request_id=check_request_id(request.request_id),
        prompt="" if messages else check_text(request.prompt, limits, "prompt"),
        output_modality=check_modalities(request.output_modalities),
        output_kind=OutputKind.from_proto(request.output_kind),
        voice=check_voice_shape(request.voice),
        sampling_params=check_sampling_params(
            request.sampling_params if request.HasField("sampling_params") else None
        ),
        instructions=check_instructions(request.instructions, limits),
        messages=messages,
    )


def decoder_request(
    request_id: str,
    prompt: str,
    modality: OutputModality,
    voice: str,
    sampling_params: common_pb2.SamplingParams | None,
    instructions: str = "",
    messages: tuple[Turn, ...] = (),
    *,
    verbatim: bool = False,
    language: str = "",
    reference_audio: common_pb2.AudioContent | None = None,
    reference_text: str = "",
) -> decoder_pb2.GenerateRequest:
    """The `DecoderService.Generate` request for a validated gateway request
    (`messages`: a conversation instead of `prompt`; `verbatim`: the prompt
    is spoken as written, as Speak does)."""
    out = decoder_pb2.GenerateRequest(
        request_id=request_id,
        prompt=prompt,
        output_modalities=modality.to_proto(),
        voice=voice,
        task=common_pb2.REQUEST_TASK_GENERATE,
        instructions=instructions,
        messages=turns_to_pb(messages),
        verbatim=verbatim,
    )
    out.language, out.reference_text = language, reference_text  # (a text-to-speech model's)
    if reference_audio is not None:
        out.reference_audio.CopyFrom(reference_audio)
    if sampling_params is not None:
        out.sampling_params.CopyFrom(sampling_params)
    return out


__all__ = [
    "DEFAULT_MAX_RESPONSE_BYTES",
    "DEFAULT_MAX_TEXT_CHARS",
    "MAX_SEED",
    "MAX_TEMPERATURE",
    "NATIVE_SAMPLE_RATE",
    "GenerationRequest",
    "Limits",
    "SpeechRequest",
    "check_against_decoder",
    "check_encoding",
    "check_instructions",
    "check_language",
    "check_language_against",
    "check_reference_audio",
    "check_modalities",
    "check_request_id",
    "check_response_size",
    "check_sample_rate",
    "check_sampling_params",
    "check_seed",
    "check_text",
    "check_unicode",
    "check_voice",
    "check_voice_shape",
    "json_type_name",
    "decoder_request",
    "generation_request_from_pb",
    "speech_request_from_pb",
]
