"""``POST /v1/audio/speech``: OpenAI's speech request on `GatewayEngine.speak`.

Fields, as OpenAI names them (a field of the wrong type is a 400 naming
it, and so is a field this route does not know, as OpenAI's own API
answers one: nothing is silently ignored):

* ``input`` (required), ``model`` (required; any name: a deployment serves
  one model), ``voice`` (one the decoder lists, or an alias it reports:
  ``default``, OpenAI's voice names; empty = its default voice);
* ``response_format``: ``wav`` (default), ``pcm`` (raw PCM16LE mono) or
  ``flac``;
* ``stream`` (extension; default true, false for ``flac``): true sends the
  audio as it is produced, false buffers it and sends one exact body;
* ``stream_format``: ``audio`` (default: the audio bytes, chunked) or
  ``sse`` (OpenAI's ``speech.audio.delta`` events with base64 audio, then
  one ``speech.audio.done`` event with ``usage`` and, as an extension,
  ``finish_reason``);
* ``speed``: in [0.25, 4.0] as OpenAI checks it, and only 1.0 is served
  (the gateway does not time-stretch);
* ``instructions``: passed to the decoder, which refuses it where the
  deployment does not support it (400 naming ``instructions``);
* ``max_tokens``, ``max_audio_seconds``, ``temperature``, ``seed``,
  ``first_chunk_frames`` (extensions): the request's `SamplingParams`. Without ``temperature``
  the model's own sampling defaults apply (``model_defaults``), so ``seed``
  picks one of its random outputs; ``temperature: 0`` is greedy.

FLAC states its length in its header, so it is only sent whole
(``"stream": true`` with ``flac`` is a 400 naming ``stream``). A buffered
answer carries ``X-Finish-Reason``; a raw audio stream cannot (its headers
leave before the audio is made): ``stream_format: "sse"`` reports it in the
done event.
"""

from __future__ import annotations

import base64
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

from aiohttp import web

from gateway.audio import AudioChunk, flac_bytes, wav_header
from gateway.engine import GatewayEngine
from gateway.http_common import (
    FINISH_REASON_HEADER,
    MAX_UINT32,
    REQUEST_ID_HEADER,
    SAMPLE_RATE_HEADER,
    check_fields,
    error_response_for,
    int_field,
    json_field,
    number_field,
    read_json,
    sse_event,
    start_sse,
    write_sse_error,
)
from gateway.http_voices import audio_from_json
from gateway.servicer import CLIENT_ERRORS
from gateway.validation import (
    MAX_TEMPERATURE,
    Limits,
    SpeechRequest,
    check_instructions,
    check_language,
    check_request_id,
    check_seed,
    check_text,
    check_voice_shape,
)
from omni_common.errors import InvalidArgumentError, quote_value
from omni_serving.v1 import common_pb2

logger = logging.getLogger(__name__)

RESPONSE_FORMATS = ("wav", "pcm", "flac")
DEFAULT_RESPONSE_FORMAT = "wav"
STREAM_FORMATS = ("audio", "sse")
SPEED_RANGE = (0.25, 4.0)
# OpenAI's speech fields and this route's extensions (the module docstring)
SPEECH_FIELDS = frozenset({
    "model", "input", "voice", "instructions", "response_format", "speed", "stream_format", "stream",
    "max_tokens", "max_audio_seconds", "temperature", "seed", "first_chunk_frames",
    "language", "reference_audio", "reference_audio_format", "reference_text",
})
_CONTENT_TYPES = {"pcm": "audio/pcm", "wav": "audio/wav", "flac": "audio/flac"}

# Decoder and engine field names -> the HTTP field a client sent.
SPEECH_PARAMS: Mapping[str, str] = {"text": "input", "prompt": "input"}


@dataclass(frozen=True)
class SpeechCall:
    """A validated ``/v1/audio/speech`` body."""

    request: SpeechRequest
    response_format: str
    stream: bool
    stream_format: str


def speech_call_from_json(body: object, limits: Limits, request_id: str | None) -> SpeechCall:
    """Validate an OpenAI speech body; fields are named as in OpenAI's API."""
    if not isinstance(body, dict):
        raise InvalidArgumentError("body", "must be a JSON object")
    check_fields(body, SPEECH_FIELDS, {})
    text = check_text(body.get("input"), limits, "input")
    model = json_field(body, "model", (str,), "")
    if not model:
        raise InvalidArgumentError("model", "is required")
    voice = check_voice_shape(str(json_field(body, "voice", (str,), "")))
    response_format = json_field(body, "response_format", (str,), DEFAULT_RESPONSE_FORMAT)
    if response_format not in RESPONSE_FORMATS:
        raise InvalidArgumentError(
            "response_format",
            f"unsupported format {quote_value(response_format)}; "
            f"supported: {', '.join(RESPONSE_FORMATS)}",
        )
    speed = number_field(body, "speed", *SPEED_RANGE)
    if speed is not None and speed != 1.0:
        raise InvalidArgumentError(
            "speed", f"only 1.0 is supported (the gateway does not time-stretch), got {speed:g}"
        )
    stream_format = json_field(body, "stream_format", (str,), "audio")
    if stream_format not in STREAM_FORMATS:
        raise InvalidArgumentError(
            "stream_format",
            f"unsupported {quote_value(stream_format)}; supported: {', '.join(STREAM_FORMATS)}",
        )
    stream = json_field(body, "stream", (bool,), response_format != "flac")
    if response_format == "flac":
        if stream:
            raise InvalidArgumentError(
                "stream",
                'flac is sent whole (its header states the length): send "stream": false, '
                "or stream wav or pcm",
            )
        if stream_format == "sse":
            raise InvalidArgumentError(
                "stream_format", "sse streams audio as it is made; flac cannot be streamed"
            )
    elif stream_format == "sse" and not stream:
        raise InvalidArgumentError(
            "stream_format", 'sse is a stream: it cannot be combined with "stream": false'
        )
    instructions = check_instructions(str(json_field(body, "instructions", (str,), "")), limits)
    sampling = common_pb2.SamplingParams()
    max_tokens = int_field(body, "max_tokens", 1, MAX_UINT32)
    if max_tokens is not None:
        sampling.max_tokens = max_tokens
    max_audio_seconds = number_field(body, "max_audio_seconds", 0.0, 1e9)
    if max_audio_seconds is not None:
        if max_audio_seconds <= 0:
            raise InvalidArgumentError("max_audio_seconds", "must be > 0")
        sampling.max_audio_seconds = max_audio_seconds
    first_chunk_frames = int_field(body, "first_chunk_frames", 0, MAX_UINT32)
    if first_chunk_frames is not None:
        sampling.first_chunk_frames = first_chunk_frames
    temperature = number_field(body, "temperature", 0.0, MAX_TEMPERATURE, " (0 = greedy)")
    if temperature is None:
        sampling.model_defaults = True
    else:
        sampling.temperature = temperature
    seed = json_field(body, "seed", (int,), None)
    if seed is not None:
        assert isinstance(seed, int)
        sampling.seed = check_seed(seed)
    reference = body.get("reference_audio")
    request = SpeechRequest(
        request_id=check_request_id(request_id or "", REQUEST_ID_HEADER),
        text=text,
        voice=voice,
        sampling_params=sampling,
        instructions=instructions,
        language=check_language(str(json_field(body, "language", (str,), ""))),
        reference_audio=None if reference is None else audio_from_json(
            reference, "reference_audio", body.get("reference_audio_format", "")),
        reference_text=check_instructions(str(json_field(body, "reference_text", (str,), "")), limits,
                                          "reference_text"),
    )
    return SpeechCall(
        request=request,
        response_format=str(response_format),
        stream=bool(stream),
        stream_format=str(stream_format),
    )


class SpeechEndpoint:
    """The handler of ``POST /v1/audio/speech``."""

    def __init__(self, engine: GatewayEngine) -> None:
        self._engine = engine

    async def handle(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await read_json(request)
            call = speech_call_from_json(
                body, self._engine.limits, request.headers.get(REQUEST_ID_HEADER)
            )
        except CLIENT_ERRORS as exc:
            return error_response_for(exc, SPEECH_PARAMS)
        async with contextlib.aclosing(self._engine.speak(call.request)) as chunks:
            # Errors before the first chunk (validation against the decoder,
            # overload, decoder down) still get a proper status and JSON body.
            try:
                first = await anext(chunks)
            except CLIENT_ERRORS as exc:
                return error_response_for(exc, SPEECH_PARAMS)
            if not call.stream:
                return await self._buffered(call, first, chunks)
            if call.stream_format == "sse":
                return await self._sse(request, call, first, chunks)
            return await self._stream(request, call, first, chunks)

    async def _buffered(
        self, call: SpeechCall, first: AudioChunk, rest: AsyncIterator[AudioChunk]
    ) -> web.Response:
        parts = [first.audio]
        last = first
        try:
            async for chunk in rest:
                parts.append(chunk.audio)
                last = chunk
        except CLIENT_ERRORS as exc:
            return error_response_for(exc, SPEECH_PARAMS)
        pcm = b"".join(parts)
        rate = first.sample_rate_hz
        if call.response_format == "pcm":
            body = pcm
        elif call.response_format == "flac":
            body = flac_bytes(pcm, rate)
        else:
            body = wav_header(rate, len(pcm)) + pcm
        headers = self._headers(call, first)
        if last.finish_reason:
            headers[FINISH_REASON_HEADER] = last.finish_reason
        return web.Response(body=body, headers=headers)

    async def _stream(
        self,
        request: web.Request,
        call: SpeechCall,
        first: AudioChunk,
        rest: AsyncIterator[AudioChunk],
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers=self._headers(call, first))
        response.enable_chunked_encoding()
        await response.prepare(request)
        if call.response_format == "wav":
            await response.write(wav_header(first.sample_rate_hz))
        if first.audio:
            await response.write(first.audio)
        try:
            async for chunk in rest:
                if chunk.audio:
                    await response.write(chunk.audio)
        except Exception as exc:  # noqa: BLE001  client errors and bugs alike, once headers are out
            # Headers are sent: the only honest signal left is to cut the
            # connection before the terminating chunk.
            _log_mid_stream(call, exc)
            if request.transport is not None:
                request.transport.close()
            return response
        await response.write_eof()
        return response

    async def _sse(
        self,
        request: web.Request,
        call: SpeechCall,
        first: AudioChunk,
        rest: AsyncIterator[AudioChunk],
    ) -> web.StreamResponse:
        response = await start_sse(request, self._headers(call, first))
        prefix = wav_header(first.sample_rate_hz) if call.response_format == "wav" else b""
        chunk = first
        try:
            while True:
                audio = prefix + chunk.audio
                prefix = b""
                if audio:
                    await response.write(
                        sse_event(
                            {
                                "type": "speech.audio.delta",
                                "audio": base64.b64encode(audio).decode("ascii"),
                            }
                        )
                    )
                if chunk.final:
                    break
                chunk = await anext(rest)
        except Exception as exc:  # noqa: BLE001  reported as an error event, then the end
            _log_mid_stream(call, exc)
            await write_sse_error(response, exc, SPEECH_PARAMS)
            return response
        output_tokens = int(chunk.metrics.num_steps)
        input_tokens = int(chunk.metrics.prompt_tokens)
        await response.write(
            sse_event(
                {
                    "type": "speech.audio.done",
                    "usage": {
                        "input_tokens": input_tokens,
                        "output_tokens": output_tokens,
                        "total_tokens": input_tokens + output_tokens,
                    },
                    "finish_reason": chunk.finish_reason,
                }
            )
        )
        await response.write_eof()
        return response

    @staticmethod
    def _headers(call: SpeechCall, first: AudioChunk) -> dict[str, str]:
        return {
            "Content-Type": _CONTENT_TYPES[call.response_format],
            REQUEST_ID_HEADER: call.request.request_id,
            SAMPLE_RATE_HEADER: str(first.sample_rate_hz),
        }


def _log_mid_stream(call: SpeechCall, exc: BaseException) -> None:
    if isinstance(exc, CLIENT_ERRORS):
        logger.warning("speech stream %s failed mid-stream: %s", call.request.request_id, exc)
    else:
        logger.error("speech stream %s failed", call.request.request_id, exc_info=exc)


__all__ = [
    "DEFAULT_RESPONSE_FORMAT",
    "RESPONSE_FORMATS",
    "STREAM_FORMATS",
    "SpeechCall",
    "SpeechEndpoint",
    "speech_call_from_json",
]
