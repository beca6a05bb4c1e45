"""``GET /v1/audio/speech/stream``: SpeakStream over a WebSocket (text in, audio out).

The same call as gRPC `SpeakStream` (`gateway.speak_stream`), with JSON text
frames for messages and binary frames for audio. The protocol is in
docs/gateway.md ("Streaming text in"); in short:

Client → gateway, one JSON object per text frame:

* ``{"type": "config", "voice", "response_format": "pcm", "sample_rate",
  "seed", "instructions", "language", "reference_audio", "reference_text",
  "request_id", "model"}``: first and once; every
  field optional (``model`` is accepted and ignored, as one deployment
  serves one model); unknown fields are refused;
* ``{"type": "text", "text": "..."}``, ``{"type": "flush"}``,
  ``{"type": "cancel"}``, ``{"type": "end"}``.

Gateway → client:

* ``{"type": "ready", "request_id", "voice", "sample_rate", "response_format"}``
  once the config is accepted;
* ``{"type": "segment.start", "segment", "text"}``, then binary frames of
  PCM16LE mono audio of that segment, then ``{"type": "segment.end",
  "segment", "text", "finish_reason", "audio_seconds"}``;
* ``{"type": "cancelled"}`` after a cancel took effect (after a
  ``segment.end`` with ``finish_reason: "abort"`` for a segment cut short);
* ``{"type": "end", ...}`` after ``end``, then the gateway closes (1000);
* ``{"type": "error", "error": {"message", "type", "param", "code"}}``
  (OpenAI's error object), then the gateway closes (1008 for a client
  error, 1013 when overloaded or no decoder is available, 1011 otherwise).

The call holds one `--max-concurrent` slot from the upgrade to the close; a
gateway at its limit answers the upgrade request itself with HTTP 429. A
client that closes the socket (or whose connection drops) gets everything
aborted. Access is checked on the upgrade request, before this handler
runs (`gateway.http_auth`): the ``Authorization`` header, or a key in a
``Sec-WebSocket-Protocol`` entry offered beside ``omni-speech-stream``
(`PROTOCOL`, the name the handshake echoes), and ``Origin``.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncGenerator, Mapping

from aiohttp import WSCloseCode, WSMsgType, web

from gateway.engine import GatewayEngine
from gateway.http_common import (
    WebSocketRoute,
    error_body,
    error_response,
    error_response_for,
    json_field,
)
from gateway.http_voices import audio_from_json
from gateway.servicer import CLIENT_ERRORS
from gateway.speak_stream import (
    ClientGone,
    ClientMessage,
    Control,
    EventKind,
    SpeakStreamCall,
    StreamConfig,
    StreamEvent,
    TextPiece,
)
from gateway.validation import (
    Limits,
    check_instructions,
    check_language,
    check_request_id,
    check_sample_rate_shape,
    check_seed,
    check_unicode,
    check_voice_shape,
    json_type_name,
)
from omni_common.errors import InvalidArgumentError, quote_value
from omni_serving.v1 import common_pb2

logger = logging.getLogger(__name__)

ROUTE = "/v1/audio/speech/stream"
PROTOCOL = "omni-speech-stream"
"""The subprotocol name of this route, echoed when a client offers it (with a key beside it)."""
RESPONSE_FORMATS = ("pcm",)
CONFIG_FIELDS = (
    "type",
    "request_id",
    "model",
    "voice",
    "response_format",
    "sample_rate",
    "seed",
    "instructions",
    "language",
    "reference_audio",
    "reference_text",
)
MESSAGE_TYPES = ("config", "text", "flush", "cancel", "end")
MAX_MESSAGE_BYTES = 2**20
"""Largest client frame (as gRPC's request limit); a bigger one closes the socket (1009)."""
HEARTBEAT_S = 20.0
"""Ping interval: a peer that stops answering is noticed and its call aborted."""

CLOSE_TRY_AGAIN_LATER = 1013


def config_from_json(body: Mapping[str, object], limits: Limits) -> StreamConfig:
    """Validate a config message; fields are named as the client spells them."""
    for key in body:
        if key not in CONFIG_FIELDS:
            raise InvalidArgumentError(
                str(key)[:64], f"unknown config field; known: {', '.join(CONFIG_FIELDS[1:])}"
            )
    json_field(body, "model", (str,), "")
    response_format = json_field(body, "response_format", (str,), "pcm")
    if response_format not in RESPONSE_FORMATS:
        raise InvalidArgumentError(
            "response_format",
            f"unsupported format {quote_value(response_format)}; supported: "
            f"{', '.join(RESPONSE_FORMATS)}",
        )
    seed = json_field(body, "seed", (int,), None)
    sampling = None
    if seed is not None:
        assert isinstance(seed, int)
        sampling = common_pb2.SamplingParams(seed=check_seed(seed))
    rate = json_field(body, "sample_rate", (int,), 0)
    assert isinstance(rate, int)
    return StreamConfig(
        request_id=check_request_id(str(json_field(body, "request_id", (str,), "")), "request_id"),
        voice=check_voice_shape(str(json_field(body, "voice", (str,), ""))),
        sample_rate_hz=check_sample_rate_shape(rate, "sample_rate"),
        sampling_params=sampling,
        instructions=check_instructions(
            str(json_field(body, "instructions", (str,), "")), limits, "instructions"
        ),
        voice_field="voice",
        sample_rate_field="sample_rate",
        instructions_field="instructions",
        sampling_params_field="sampling_params",
        language=check_language(str(json_field(body, "language", (str,), "")), "language"),
        reference_audio=None if body.get("reference_audio") is None else audio_from_json(
            body.get("reference_audio"), "reference_audio"),
        reference_text=check_instructions(str(json_field(body, "reference_text", (str,), "")), limits,
                                          "reference_text"),
    )


def client_message_from_json(data: str, limits: Limits) -> ClientMessage:
    """One client text frame as a call message (INVALID_ARGUMENT naming what is wrong)."""
    try:
        body = json.loads(data)
    except (ValueError, RecursionError) as exc:
        reason = exc.msg if isinstance(exc, json.JSONDecodeError) else "cannot be decoded"
        raise InvalidArgumentError("message", f"not valid JSON: {reason}") from None
    if not isinstance(body, dict):
        raise InvalidArgumentError("message", f"must be a JSON object, got {json_type_name(body)}")
    kind = body.get("type")
    if kind == "config":
        return config_from_json(body, limits)
    if kind == "text":
        text = body.get("text")
        if not isinstance(text, str):
            raise InvalidArgumentError("text", f"must be a string, got {json_type_name(text)}")
        return TextPiece(check_unicode(text, "text"))
    if kind in ("flush", "cancel", "end"):
        return Control(kind)
    raise InvalidArgumentError(
        "type",
        f"unknown message type {quote_value(kind)}; one of {', '.join(MESSAGE_TYPES)}",
    )


async def _messages(
    ws: web.WebSocketResponse, limits: Limits
) -> AsyncGenerator[ClientMessage, None]:
    async for message in ws:  # ends at the client's close
        if message.type is WSMsgType.TEXT:
            yield client_message_from_json(message.data, limits)
        elif message.type is WSMsgType.BINARY:
            raise InvalidArgumentError(
                "message", "binary frames are not accepted; send JSON text frames"
            )
        elif message.type is WSMsgType.ERROR:  # a broken connection, a frame too large
            break
    raise ClientGone()


def _close_code(status: int) -> int:
    if status in (429, 503):
        return CLOSE_TRY_AGAIN_LATER
    return WSCloseCode.POLICY_VIOLATION if status < 500 else WSCloseCode.INTERNAL_ERROR


class SpeechStreamEndpoint:
    """The WebSocket handler over one `GatewayEngine`."""

    route = WebSocketRoute(ROUTE, (PROTOCOL,))

    def __init__(self, engine: GatewayEngine) -> None:
        self._engine = engine

    async def handle(self, request: web.Request) -> web.StreamResponse:
        ws = web.WebSocketResponse(
            protocols=self.route.protocols, heartbeat=HEARTBEAT_S, max_msg_size=MAX_MESSAGE_BYTES
        )
        if not ws.can_prepare(request).ok:
            return error_response(
                426,
                f"{ROUTE} is a WebSocket: connect with 'Upgrade: websocket'",
                type_="invalid_request_error",
                param=None,
                code="upgrade_required",
            )
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(self._engine.admission.slot())
            except CLIENT_ERRORS as exc:  # at the limit: answered before the upgrade
                return error_response_for(exc)
            await ws.prepare(request)
            await self._serve(ws)
        return ws

    async def _serve(self, ws: web.WebSocketResponse) -> None:
        call = SpeakStreamCall(self._engine, _messages(ws, self._engine.limits))

        async def emit(event: StreamEvent) -> None:
            try:
                await _send(ws, call, event)
            except ConnectionError as exc:  # the client is gone
                raise ClientGone() from exc

        try:
            await call.run(emit)
        except ClientGone:
            logger.info("speech stream %s: the client went away", call.call_id or "(no config)")
        except Exception as exc:  # noqa: BLE001  client errors and bugs: an error frame, then close
            status, error = error_body(exc)
            with contextlib.suppress(ConnectionError, RuntimeError):  # the client may be gone
                await ws.send_json({"type": "error", "error": error})
                await ws.close(code=_close_code(status))
            return
        await ws.close()


async def _send(ws: web.WebSocketResponse, call: SpeakStreamCall, event: StreamEvent) -> None:
    kind = event.kind
    if kind is EventKind.READY:
        await ws.send_json(
            {
                "type": "ready",
                "request_id": call.call_id,
                "voice": event.voice,
                "sample_rate": event.sample_rate_hz,
                "response_format": "pcm",
            }
        )
    elif kind is EventKind.AUDIO:
        if event.first:
            await ws.send_json(
                {"type": "segment.start", "segment": event.segment, "text": event.text}
            )
        if event.audio:
            await ws.send_bytes(event.audio)
    elif kind is EventKind.SEGMENT_END:
        if event.first:  # a segment that produced no audio
            await ws.send_json(
                {"type": "segment.start", "segment": event.segment, "text": event.text}
            )
        await ws.send_json(
            {
                "type": "segment.end",
                "segment": event.segment,
                "text": event.text,
                "finish_reason": event.finish_reason,
                "audio_seconds": event.metrics.audio_seconds if event.metrics else 0.0,
            }
        )
    elif kind is EventKind.CANCELLED:
        await ws.send_json({"type": "cancelled"})
    elif kind is EventKind.END:
        metrics = event.metrics
        await ws.send_json(
            {
                "type": "end",
                "request_id": call.call_id,
                "segments": event.segments,
                "audio_seconds": metrics.audio_seconds if metrics else 0.0,
                "ttfp_ms": metrics.ttfp_ms if metrics else 0.0,
                "elapsed_ms": metrics.elapsed_ms if metrics else 0.0,
            }
        )


__all__ = [
    "PROTOCOL",
    "ROUTE",
    "SpeechStreamEndpoint",
    "client_message_from_json",
    "config_from_json",
]
