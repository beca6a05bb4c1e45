"""``POST /v1/chat/completions``: OpenAI's chat completions, text and audio out, on Generate.

The request runs as one `GatewayEngine.generate` call (the gRPC Generate
path with ``messages``, delta outputs): every turn goes through the model's
chat template, in order (``system``, ``developer`` as a system turn,
``user``, ``assistant``), the last one the user's. An ``assistant`` turn
needs its text: audio is not kept between requests, so a turn that only
refers to an earlier reply's audio is a 400 naming its content (send the
transcript). A deployment without a text stage (``tts``) refuses a
conversation (400 naming ``messages``); a lone user message is sent as
the prompt, which it speaks.

Fields, as OpenAI names them (a field of the wrong type is a 400 naming
it; so is a field this route does not know, as OpenAI's own API answers
one, and one of OpenAI's fields that it does not implement --
``tools``, ``logprobs``, ``response_format``, penalties and the rest of
``CHAT_UNSERVED`` -- unless its value asks for nothing, e.g. ``"logprobs":
false``; nothing is silently ignored): ``messages``,
``model`` (any name: a deployment serves one model; answers carry its id),
``modalities`` (``["text"]`` default, ``["text", "audio"]``, ``["audio"]``;
one the deployment cannot produce is a 400 naming ``modalities``),
``audio`` (``{"voice", "format"}``, required with audio; ``format`` is
``wav`` or ``pcm16``, and ``pcm16`` when streaming, as OpenAI requires),
``stream``, ``stream_options.include_usage``, ``max_completion_tokens`` /
``max_tokens`` (the former wins), ``temperature``, ``top_p``, ``seed``,
``n`` (1 only), ``stop`` (a string or up to 4: the text and its speech end
where one begins; ``SamplingParams.stop``); ``user``, ``safety_identifier``, ``metadata``,
``prompt_cache_key`` and ``parallel_tool_calls`` are accepted and change
nothing. Without ``temperature`` the model's own sampling defaults
apply (``model_defaults``), so ``seed`` picks one of its random outputs.

Output follows OpenAI: with audio, the text is the audio's ``transcript``
(``message.audio.transcript``, streamed as ``delta.audio.transcript``) and
``message.content`` is null; text only, it is ``message.content`` /
``delta.content``. Streamed audio is base64 PCM16LE mono at the
deployment's rate (24 kHz, ``X-Sample-Rate``); whole audio is a WAV or raw
PCM16 in ``message.audio.data``. Audio is not kept for later turns:
``expires_at`` is the response's ``created`` time. ``finish_reason`` is the
decoder's (``stop``, ``length``, ``repetition``). ``usage`` counts the
prompt's tokens as the model reads them (the chat template's included:
``RequestMetrics.prompt_tokens``) and the generated text tokens.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

from aiohttp import web

from gateway.audio import AUDIO_KEY, SAMPLE_RATE_KEY, pcm16le, wav_header
from gateway.decoder_client import DecoderInfo
from gateway.engine import GatewayEngine
from gateway.http_common import (
    MAX_UINT32,
    REQUEST_ID_HEADER,
    SAMPLE_RATE_HEADER,
    Unserved,
    check_fields,
    error_response_for,
    int_field,
    json_field,
    model_id,
    number_field,
    read_json,
    sse_event,
    start_sse,
    write_sse_error,
)
from gateway.output_processor import OutputKind
from gateway.outputs import OmniRequestOutput
from gateway.servicer import CLIENT_ERRORS
from gateway.validation import (
    MAX_AUDIO_PARTS,
    MAX_IMAGE_PARTS,
    MAX_TEMPERATURE,
    GenerationRequest,
    Limits,
    check_request_id,
    check_seed,
    check_unicode,
    check_voice_shape,
    json_type_name,
)
from omni_common.conversation import Turn, conversation_from_pb, turn_text
from omni_common.errors import InvalidArgumentError, quote_value
from omni_common.modality import OutputModality
from omni_common.stop_strings import check_stops
from omni_serving.v1 import common_pb2

logger = logging.getLogger(__name__)

ROLES = ("system", "developer", "user", "assistant")
CHAT_AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg", "pcm16")
"""``input_audio.format`` values (OpenAI's wav and mp3, and the other files the decoder reads)."""
OPENAI_PCM16_RATE = 24000
"""Sample rate of raw ``pcm16`` input audio (OpenAI's PCM16 is 24 kHz mono)."""
MODALITIES = ("text", "audio")
AUDIO_FORMATS = ("wav", "pcm16")
STREAM_AUDIO_FORMAT = "pcm16"
DEFAULT_FINISH_REASON = "stop"

# OpenAI's request fields this route serves; user, safety_identifier,
# metadata, prompt_cache_key and parallel_tool_calls are accepted and change
# nothing (no store, no cache key, no tools)
CHAT_FIELDS = frozenset({
    "messages", "model", "audio", "modalities", "max_completion_tokens", "max_tokens", "n", "seed", "stream",
    "stream_options", "temperature", "top_p", "user", "safety_identifier", "metadata", "prompt_cache_key",
    "parallel_tool_calls", "stop",
})


def _zero(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0


def _never(value: object) -> bool:
    return False


# OpenAI's fields this route does not implement: a 400 naming the field unless
# its value asks for nothing
CHAT_UNSERVED = {
    "tools": Unserved(lambda v: v == [], "tool calls are not implemented"),
    "tool_choice": Unserved(lambda v: v == "none", 'tool calls are not implemented (only "none")'),
    "functions": Unserved(lambda v: v == [], "function calls are not implemented"),
    "function_call": Unserved(lambda v: v == "none", 'function calls are not implemented (only "none")'),
    "logprobs": Unserved(lambda v: v is False, "log probabilities are not returned (only false)"),
    "top_logprobs": Unserved(_zero, "log probabilities are not returned (only 0)"),
    "logit_bias": Unserved(lambda v: v == {}, "logit biases are not applied (only {})"),
    "frequency_penalty": Unserved(_zero, "penalties are not applied (only 0)"),
    "presence_penalty": Unserved(_zero, "penalties are not applied (only 0)"),
    "response_format": Unserved(lambda v: v == {"type": "text"},
                                'structured output is not implemented (only {"type": "text"})'),
    "store": Unserved(lambda v: v is False, "completions are not stored (only false)"),
    "service_tier": Unserved(lambda v: v in ("auto", "default"), 'one tier (only "auto" or "default")'),
    "prediction": Unserved(_never, "predicted outputs are not implemented"),
    "reasoning_effort": Unserved(_never, "the model has no reasoning effort setting"),
    "verbosity": Unserved(_never, "the model has no verbosity setting"),
    "web_search_options": Unserved(_never, "web search is not implemented"),
}


@dataclass(frozen=True)
class ChatCall:
    """A validated chat completions body."""

    request: GenerationRequest
    model: str
    modalities: tuple[str, ...]
    stream: bool
    include_usage: bool
    audio_format: str | None
    """None when no audio is asked for."""
    params: Mapping[str, str] = field(default_factory=dict)
    """Engine and decoder field names -> this request's field names."""

    @property
    def audio(self) -> bool:
        return self.audio_format is not None


def _object(value: object, where: str) -> dict:
    if not isinstance(value, dict):
        raise InvalidArgumentError(where, f"must be an object, got {json_type_name(value)}")
    return value


def _message(message: object, where: str) -> tuple[str, list[common_pb2.ContentPart]]:
    """(role, content parts) of one message: a string is one text part; an
    array holds ``text`` and ``input_audio`` parts."""
    message = _object(message, where)
    role = message.get("role")
    if not isinstance(role, str):
        raise InvalidArgumentError(f"{where}.role", f"must be a string, got {json_type_name(role)}")
    if role not in ROLES:
        raise InvalidArgumentError(
            f"{where}.role", f"unsupported role {quote_value(role)}; supported: {', '.join(ROLES)}"
        )
    content = message.get("content")
    if content is None:
        if role == "assistant":  # an earlier audio reply, or tool calls
            return role, []
        raise InvalidArgumentError(f"{where}.content", "is required")
    if isinstance(content, str):
        return role, [common_pb2.ContentPart(text=content)]
    if not isinstance(content, list):
        raise InvalidArgumentError(
            f"{where}.content",
            f"must be a string or an array of content parts, got {json_type_name(content)}",
        )
    return role, [_part(part, f"{where}.content[{j}]") for j, part in enumerate(content)]


def _part(part: object, where: str) -> common_pb2.ContentPart:
    part = _object(part, where)
    kind = part.get("type")
    if kind == "text":
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidArgumentError(f"{where}.text", f"must be a string, got {json_type_name(text)}")
        return common_pb2.ContentPart(text=text)
    if kind == "input_audio":
        return common_pb2.ContentPart(audio=_input_audio(part.get("input_audio"), f"{where}.input_audio"))
    if kind == "image_url":
        return common_pb2.ContentPart(image=_image_url(part.get("image_url"), f"{where}.image_url"))
    raise InvalidArgumentError(
        f"{where}.type", f"unsupported content part {quote_value(kind)}; supported: text, input_audio, image_url"
    )


def _image_url(value: object, where: str) -> common_pb2.ImageContent:
    """OpenAI's ``{"url": ..., "detail": ...}``: a ``data:`` URL of a PNG or
    JPEG (base64); this server fetches nothing, so any other URL is refused.
    ``detail`` is accepted and changes nothing (the model's processor sizes
    the image within its own pixel bounds)."""
    value = _object(value, where)
    url = value.get("url")
    if not isinstance(url, str):
        raise InvalidArgumentError(f"{where}.url", f"must be a string, got {json_type_name(url)}")
    head, sep, data = url.partition(",")
    if not (url.startswith("data:") and sep and head.endswith(";base64")):
        raise InvalidArgumentError(
            f"{where}.url", "only base64 data URLs (data:image/png;base64,...) are taken: this server fetches nothing"
        )
    detail = value.get("detail", "auto")
    if detail not in ("auto", "low", "high"):
        raise InvalidArgumentError(f"{where}.detail", f"must be auto, low or high, got {quote_value(detail)}")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidArgumentError(f"{where}.url", "is not valid base64 after the comma") from None
    return common_pb2.ImageContent(data=raw)


def _input_audio(value: object, where: str) -> common_pb2.AudioContent:
    """OpenAI's ``{"data": base64, "format": ...}``: a WAV, MP3, FLAC or Ogg
    file, or raw ``pcm16`` (mono, 24 kHz as OpenAI's PCM16 is)."""
    value = _object(value, where)
    fmt = value.get("format")
    if not isinstance(fmt, str) or fmt not in CHAT_AUDIO_FORMATS:
        raise InvalidArgumentError(
            f"{where}.format", f"must be one of {', '.join(CHAT_AUDIO_FORMATS)}, got {quote_value(fmt)}"
        )
    data = value.get("data")
    if not isinstance(data, str):
        raise InvalidArgumentError(f"{where}.data", f"must be a base64 string, got {json_type_name(data)}")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidArgumentError(f"{where}.data", "is not valid base64") from None
    return common_pb2.AudioContent(data=raw, format=fmt,
                                   sample_rate=OPENAI_PCM16_RATE if fmt == "pcm16" else 0)


def _conversation(body: Mapping[str, object], limits: Limits) -> tuple[Turn, ...]:
    """The (role, content) turns of ``messages``, every one given to the model
    (``developer`` is a ``system`` turn; see the module docstring), checked
    as gRPC Generate checks its ``messages`` (``omni_common.conversation``)."""
    messages = body.get("messages")
    if messages is None:
        raise InvalidArgumentError("messages", "is required")
    if not isinstance(messages, list):
        raise InvalidArgumentError("messages", f"must be an array, got {json_type_name(messages)}")
    turns = []
    for i, message in enumerate(messages):
        role, parts = _message(message, f"messages[{i}]")
        if role == "assistant" and not any(p.text for p in parts):
            raise InvalidArgumentError(
                f"messages[{i}].content",
                "an assistant turn needs its text: audio is not kept between requests, so send the "
                "reply's transcript as the content",
            )
        turns.append(common_pb2.ChatMessage(role="system" if role == "developer" else role, content=parts))
    conversation = conversation_from_pb(turns, limits.max_text_chars, max_audio_parts=MAX_AUDIO_PARTS,
                                        max_image_parts=MAX_IMAGE_PARTS)
    for i, (_, content) in enumerate(conversation):
        check_unicode(turn_text(content), f"messages[{i}].content")
    return conversation


def _modalities(body: Mapping[str, object]) -> tuple[str, ...]:
    raw = json_field(body, "modalities", (list,), ["text"])
    assert isinstance(raw, list)
    if not raw:
        raise InvalidArgumentError("modalities", "must not be empty")
    out: list[str] = []
    for item in raw:
        if not isinstance(item, str):
            raise InvalidArgumentError(
                "modalities", f"must be an array of strings, got a {json_type_name(item)} in it"
            )
        if item not in MODALITIES:
            raise InvalidArgumentError(
                "modalities",
                f"unsupported modality {quote_value(item)}; supported: {', '.join(MODALITIES)}",
            )
        if item not in out:
            out.append(item)
    return tuple(out)


def _audio(body: Mapping[str, object], stream: bool) -> tuple[str, str]:
    """(voice, format) of the ``audio`` object."""
    audio = body.get("audio")
    if audio is None:
        raise InvalidArgumentError("audio", 'is required when "modalities" includes "audio"')
    audio = _object(audio, "audio")
    voice = audio.get("voice")
    if isinstance(voice, dict):  # OpenAI's {"id": "..."} form
        voice = json_field(voice, "audio.voice.id", (str,), "")
    if voice is None or voice == "":
        raise InvalidArgumentError("audio.voice", "is required")
    if not isinstance(voice, str):
        raise InvalidArgumentError("audio.voice", f"must be a string, got {json_type_name(voice)}")
    fmt = json_field(audio, "audio.format", (str,), None)
    if fmt is None:
        raise InvalidArgumentError(
            "audio.format", f"is required; supported: {', '.join(AUDIO_FORMATS)}"
        )
    if fmt not in AUDIO_FORMATS:
        raise InvalidArgumentError(
            "audio.format",
            f"unsupported format {quote_value(fmt)}; supported: {', '.join(AUDIO_FORMATS)}",
        )
    if stream and fmt != STREAM_AUDIO_FORMAT:
        raise InvalidArgumentError(
            "audio.format", f"streamed audio is {STREAM_AUDIO_FORMAT}; got {quote_value(fmt)}"
        )
    return check_voice_shape(voice, "audio.voice"), str(fmt)


def _sampling(body: Mapping[str, object]) -> tuple[common_pb2.SamplingParams, str]:
    """Sampling parameters and the name the client gave its token cap."""
    sampling = common_pb2.SamplingParams()
    tokens_field = "max_completion_tokens"
    max_tokens = int_field(body, "max_completion_tokens", 1, MAX_UINT32)
    if max_tokens is None:
        max_tokens = int_field(body, "max_tokens", 1, MAX_UINT32)
        if max_tokens is not None:
            tokens_field = "max_tokens"
    if max_tokens is not None:
        sampling.max_tokens = max_tokens
    temperature = number_field(body, "temperature", 0.0, MAX_TEMPERATURE, " (0 = greedy)")
    if temperature is None:
        sampling.model_defaults = True
    else:
        sampling.temperature = temperature
    top_p = number_field(body, "top_p", 0.0, 1.0)
    if top_p is not None:
        sampling.top_p = top_p
    seed = json_field(body, "seed", (int,), None)
    if seed is not None:
        assert isinstance(seed, int)
        sampling.seed = check_seed(seed)
    stop = json_field(body, "stop", (str, list), None)
    if stop is not None:  # a string or an array of strings, as OpenAI takes it
        stops = [stop] if isinstance(stop, str) else stop
        assert isinstance(stops, list)
        for i, s in enumerate(stops):
            if not isinstance(s, str):
                raise InvalidArgumentError(f"stop[{i}]", f"must be a string, got {json_type_name(s)}")
        sampling.stop.extend(check_stops(stops, "stop"))
    return sampling, tokens_field


def chat_call_from_json(body: object, limits: Limits, request_id: str | None) -> ChatCall:
    """Validate an OpenAI chat completions body; fields are named as in OpenAI's API."""
    if not isinstance(body, dict):
        raise InvalidArgumentError("body", "must be a JSON object")
    check_fields(body, CHAT_FIELDS, CHAT_UNSERVED)
    model = json_field(body, "model", (str,), "")
    if not model:
        raise InvalidArgumentError("model", "is required")
    messages = _conversation(body, limits)
    lone_text = len(messages) == 1 and isinstance(messages[0][1], str)
    stream = bool(json_field(body, "stream", (bool,), False))
    options = json_field(body, "stream_options", (dict,), None)
    include_usage = False
    if options is not None:
        if not stream:
            raise InvalidArgumentError("stream_options", 'is only allowed with "stream": true')
        assert isinstance(options, dict)
        include_usage = bool(json_field(options, "stream_options.include_usage", (bool,), False))
    n = int_field(body, "n", 1, 2**31 - 1)
    if n is not None and n != 1:
        raise InvalidArgumentError("n", f"only 1 choice is supported, got {n}")
    modalities = _modalities(body)
    voice, audio_format = "", None
    if "audio" in modalities:
        voice, audio_format = _audio(body, stream)
    sampling, tokens_field = _sampling(body)
    modality = OutputModality(0)
    for name in modalities:
        modality |= OutputModality.from_string(name, field="modalities")
    request = GenerationRequest(
        request_id=check_request_id(request_id or "", REQUEST_ID_HEADER),
        # one user turn is the prompt (the same ids through the chat template, and a
        # deployment without a text stage speaks it); a longer conversation, or
        # one with audio, goes whole
        prompt=messages[0][1] if lone_text else "",
        messages=() if lone_text else messages,
        output_modality=modality,
        output_kind=OutputKind.DELTA,
        voice=voice,
        sampling_params=sampling,
    )
    return ChatCall(
        request=request,
        model=str(model),
        modalities=modalities,
        stream=stream,
        include_usage=include_usage,
        audio_format=audio_format,
        params={
            "prompt": "messages",
            "text": "messages",
            "output_modalities": "modalities",
            "voice": "audio.voice",
            "max_tokens": tokens_field,
            ".audio": ".input_audio",
            ".image.data": ".image_url.url",
            ".image": ".image_url",
        },
    )


@dataclass
class _Reply:
    """What a chat request has produced so far."""

    sample_rate_hz: int
    text: list[str] = field(default_factory=list)
    audio: list[bytes] = field(default_factory=list)
    completion_tokens: int = 0
    prompt_tokens: int = 0
    finish_reason: str = ""

    def add(self, output: OmniRequestOutput) -> tuple[str, bytes]:
        """Take one delta output; return its (text, PCM16) parts."""
        pcm = b""
        payload = output.multimodal
        if payload is not None:
            rate = payload.metadata.get(SAMPLE_RATE_KEY)
            if isinstance(rate, int) and rate > 0:
                self.sample_rate_hz = rate
            samples = payload.tensors.get(AUDIO_KEY)
            if samples is not None:
                pcm = pcm16le(samples)
        self.text.append(output.text)
        self.audio.append(pcm)
        self.completion_tokens += len(output.token_ids)
        self.prompt_tokens = max(self.prompt_tokens, output.metrics.prompt_tokens)
        if output.finished:
            self.finish_reason = output.finish_reason or DEFAULT_FINISH_REASON
        return output.text, pcm

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


class ChatEndpoint:
    """The handler of ``POST /v1/chat/completions``."""

    def __init__(self, engine: GatewayEngine) -> None:
        self._engine = engine

    async def handle(self, request: web.Request) -> web.StreamResponse:
        params: Mapping[str, str] = {}
        try:
            body = await read_json(request)
            call = chat_call_from_json(
                body, self._engine.limits, request.headers.get(REQUEST_ID_HEADER)
            )
            params = call.params
            info = await self._engine.decoder_info()
        except CLIENT_ERRORS as exc:
            return error_response_for(exc, params)
        reply = _Reply(info.sample_rate_hz)
        created = int(time.time())
        async with contextlib.aclosing(self._engine.generate(call.request)) as outputs:
            try:
                first = await anext(outputs)
            except CLIENT_ERRORS as exc:
                return error_response_for(exc, params)
            if call.stream:
                return await self._stream(request, call, info, created, reply, first, outputs)
            return await self._whole(call, info, created, reply, first, outputs)

    @staticmethod
    def _headers(call: ChatCall, reply: _Reply) -> dict[str, str]:
        headers = {REQUEST_ID_HEADER: call.request.request_id}
        if call.audio:
            headers[SAMPLE_RATE_HEADER] = str(reply.sample_rate_hz)
        return headers

    async def _whole(
        self,
        call: ChatCall,
        info: DecoderInfo,
        created: int,
        reply: _Reply,
        first: OmniRequestOutput,
        rest: AsyncIterator[OmniRequestOutput],
    ) -> web.Response:
        reply.add(first)
        try:
            async for output in rest:
                reply.add(output)
        except CLIENT_ERRORS as exc:
            return error_response_for(exc, call.params)
        text = "".join(reply.text)
        message: dict[str, object] = {
            "role": "assistant",
            "content": None if call.audio else text,
            "refusal": None,
            "annotations": [],
        }
        if call.audio:
            pcm = b"".join(reply.audio)
            data = (
                pcm
                if call.audio_format == "pcm16"
                else wav_header(reply.sample_rate_hz, len(pcm)) + pcm
            )
            message["audio"] = {
                "id": _audio_id(call),
                "data": base64.b64encode(data).decode("ascii"),
                "expires_at": created,
                "transcript": text,
            }
        body = {
            "id": _completion_id(call),
            "object": "chat.completion",
            "created": created,
            "model": model_id(info),
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": reply.finish_reason or DEFAULT_FINISH_REASON,
                }
            ],
            "usage": reply.usage(),
        }
        return web.json_response(body, headers=self._headers(call, reply))

    async def _stream(
        self,
        request: web.Request,
        call: ChatCall,
        info: DecoderInfo,
        created: int,
        reply: _Reply,
        first: OmniRequestOutput,
        rest: AsyncIterator[OmniRequestOutput],
    ) -> web.StreamResponse:
        response = await start_sse(request, self._headers(call, reply))
        model = model_id(info)

        def chunk(delta: dict[str, object], finish_reason: str | None = None) -> bytes:
            out: dict[str, object] = {
                "id": _completion_id(call),
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [
                    {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
                ],
            }
            if call.include_usage:
                out["usage"] = None
            return sse_event(out)

        opening: dict[str, object] = {"role": "assistant"}
        if not call.audio:
            opening["content"] = ""
        await response.write(chunk(opening))
        output = first
        try:
            while True:
                text, pcm = reply.add(output)
                delta: dict[str, object] = {}
                if call.audio:
                    audio: dict[str, object] = {}
                    if pcm:
                        audio["data"] = base64.b64encode(pcm).decode("ascii")
                    if text:
                        audio["transcript"] = text
                    if audio:
                        delta["audio"] = {"id": _audio_id(call), **audio}
                elif text:
                    delta["content"] = text
                if delta:
                    await response.write(chunk(delta))
                if output.finished:
                    break
                output = await anext(rest)
        except Exception as exc:  # noqa: BLE001  reported as an error event, then the end
            if isinstance(exc, CLIENT_ERRORS):
                logger.warning("chat stream %s failed: %s", call.request.request_id, exc)
            else:
                logger.error("chat stream %s failed", call.request.request_id, exc_info=exc)
            await write_sse_error(response, exc, call.params)
            return response
        if call.audio:
            await response.write(chunk({"audio": {"id": _audio_id(call), "expires_at": created}}))
        await response.write(chunk({}, reply.finish_reason or DEFAULT_FINISH_REASON))
        if call.include_usage:
            await response.write(
                sse_event(
                    {
                        "id": _completion_id(call),
                        "object": "chat.completion.chunk",
                        "created": created,
                        "model": model,
                        "choices": [],
                        "usage": reply.usage(),
                    }
                )
            )
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def _completion_id(call: ChatCall) -> str:
    return f"chatcmpl-{call.request.request_id}"


def _audio_id(call: ChatCall) -> str:
    return f"audio_{call.request.request_id}"


__all__ = [
    "AUDIO_FORMATS",
    "MODALITIES",
    "ChatCall",
    "ChatEndpoint",
    "chat_call_from_json",
]
