"""OpenAI-compatible HTTP facade (aiohttp), in the gateway's process and event loop.

Routes:

* ``POST /v1/audio/speech`` - OpenAI's speech request (``input``, ``model``,
  ``voice``, ``response_format`` pcm|wav, ``speed`` validated and ignored,
  ``stream``; extension: ``seed``). Streams raw PCM16LE (``pcm``) or a WAV
  whose header carries the streaming maximum length (``wav``) with chunked
  transfer; ``"stream": false`` buffers and sends an exact WAV/PCM body.
* ``GET /health`` - 200 when a decoder is healthy (the same state as the
  gateway's gRPC health), 503 otherwise; ``decoders`` counts the healthy
  and the configured replicas. Never needs a token.
* ``GET /metrics`` - Prometheus text format.

With a token configured, every route but ``/health`` needs
``Authorization: Bearer <token>``; without it the answer is 401 in OpenAI's
shape (code ``invalid_api_key``).

Errors use OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``,
with the HTTP status derived from the gRPC code `grpc_code_for` gives, and
the message from `public_message` (bounded, sanitized).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass

import grpc
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.audio import AudioChunk, wav_header
from gateway.engine import GatewayEngine
from gateway.health import HealthState
from gateway.servicer import CLIENT_ERRORS
from gateway.validation import (
    Limits,
    SpeechRequest,
    check_request_id,
    check_seed,
    check_text,
    check_voice_shape,
    json_type_name,
)
from omni_common.errors import (
    INTERNAL_MESSAGE,
    FailedPreconditionError,
    InvalidArgumentError,
    OmniError,
    grpc_code_for,
    public_message,
    quote_value,
)
from omni_common.server import bearer_token_matches
from omni_serving.v1 import common_pb2

logger = logging.getLogger(__name__)

RESPONSE_FORMATS = ("pcm", "wav")
DEFAULT_RESPONSE_FORMAT = "wav"
SPEED_RANGE = (0.25, 4.0)
REQUEST_ID_HEADER = "X-Request-Id"
SAMPLE_RATE_HEADER = "X-Sample-Rate"
_CONTENT_TYPES = {"pcm": "audio/pcm", "wav": "audio/wav"}

# gRPC code -> (HTTP status, OpenAI error type).
_HTTP_STATUS: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    grpc.StatusCode.ABORTED: (409, "invalid_request_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error"),
}


def error_response(
    status: int, message: str, *, type_: str, param: str | None, code: str | None
) -> web.Response:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return web.json_response(body, status=status)


def error_response_for(exc: BaseException) -> web.Response:
    """OpenAI-shaped error for an exception, through the shared gRPC code mapping."""
    code = grpc_code_for(exc)
    status, type_ = _HTTP_STATUS.get(code, (500, "server_error"))
    if status == 500:
        logger.error("speech request failed", exc_info=exc)
        code = grpc.StatusCode.INTERNAL
        message = public_message(exc) if isinstance(exc, OmniError) else INTERNAL_MESSAGE
    else:
        logger.info("speech request refused: %s: %s", code.name, exc)
        message = public_message(exc)
    field = getattr(exc, "field", None)
    param = field if isinstance(field, str) else None
    return error_response(status, message, type_=type_, param=param, code=code.name.lower())


UNAUTHORIZED_MESSAGE = (
    "authorization: missing or invalid bearer token (header 'Authorization: Bearer …')"
)


def unauthorized_response() -> web.Response:
    response = error_response(
        401, UNAUTHORIZED_MESSAGE, type_="invalid_request_error", param=None, code="invalid_api_key"
    )
    response.headers["WWW-Authenticate"] = "Bearer"
    return response


@dataclass(frozen=True)
class SpeechCall:
    """A validated ``/v1/audio/speech`` body."""

    request: SpeechRequest
    response_format: str
    stream: bool


def _field(
    body: Mapping[str, object], name: str, types: tuple[type, ...], default: object
) -> object:
    value = body.get(name, default)
    if value is None:
        return default
    # bool is an int: refuse it where a number is expected.
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        wanted = " or ".join(dict.fromkeys(json_type_name(t()) for t in types))
        raise InvalidArgumentError(name, f"must be a {wanted}, got {json_type_name(value)}")
    return value


def speech_call_from_json(body: object, limits: Limits, request_id: str | None) -> SpeechCall:
    """Validate an OpenAI speech body; fields are named as in OpenAI's API."""
    if not isinstance(body, dict):
        raise InvalidArgumentError("body", "must be a JSON object")
    text = check_text(body.get("input"), limits, "input")
    model = _field(body, "model", (str,), "")
    if not model:
        raise InvalidArgumentError("model", "is required")
    voice = check_voice_shape(str(_field(body, "voice", (str,), "")))
    response_format = _field(body, "response_format", (str,), DEFAULT_RESPONSE_FORMAT)
    if response_format not in RESPONSE_FORMATS:
        raise InvalidArgumentError(
            "response_format",
            f"unsupported format {quote_value(response_format)}; "
            f"supported: {', '.join(RESPONSE_FORMATS)}",
        )
    speed = _field(body, "speed", (int, float), 1.0)
    assert isinstance(speed, (int, float))
    # An integer too large for a float is out of range too (math.isfinite would overflow).
    if not (
        abs(speed) < 1e300 and math.isfinite(speed) and SPEED_RANGE[0] <= speed <= SPEED_RANGE[1]
    ):
        raise InvalidArgumentError(
            "speed",
            f"must be between {SPEED_RANGE[0]} and {SPEED_RANGE[1]}, got {quote_value(speed)}",
        )
    stream = _field(body, "stream", (bool,), True)
    seed = _field(body, "seed", (int,), None)
    sampling = None
    if seed is not None:
        assert isinstance(seed, int)
        sampling = common_pb2.SamplingParams(seed=check_seed(seed))
    return SpeechCall(
        request=SpeechRequest(
            request_id=check_request_id(request_id or "", REQUEST_ID_HEADER),
            text=text,
            voice=voice,
            sampling_params=sampling,
        ),
        response_format=response_format,
        stream=stream,
    )


class HttpFacade:
    """The aiohttp application and its runner."""

    def __init__(
        self,
        engine: GatewayEngine,
        *,
        monitor: HealthState | None = None,
        auth_token: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self._engine = engine
        self._monitor = monitor
        self._ssl_context = ssl_context
        middlewares = [_openai_errors]
        if auth_token is not None:
            middlewares.append(_bearer_auth(auth_token))
        self.app = web.Application(middlewares=middlewares)
        self.app.router.add_post("/v1/audio/speech", self.speech)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/metrics", self.metrics)
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen on host:port (0 = any free port); return the bound port."""
        # handler_cancellation: a client that disconnects cancels its handler,
        # which closes the engine stream and aborts the decoder request.
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, ssl_context=self._ssl_context)
        try:
            await site.start()
        except OSError as exc:  # address in use, host not local, ...
            await self.stop()
            raise FailedPreconditionError(
                f"cannot listen for HTTP on {host}:{port}: {exc}"
            ) from exc
        self.port = int(self._runner.addresses[0][1])
        logger.info("HTTP facade listening on %s:%s", host, self.port)
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def health(self, request: web.Request) -> web.Response:
        """200 with the decoders' voices while one is healthy; 503 otherwise.

        With a monitor (the gateway's), the answer is its latest checks, the
        same state gRPC health reports.
        """
        replicas = self._engine.pool.replicas
        decoders = {"healthy": sum(1 for r in replicas if r.healthy), "configured": len(replicas)}
        if self._monitor is not None and not self._monitor.healthy:
            return web.json_response(
                {"status": "unavailable", "decoder": "unhealthy", "decoders": decoders}, status=503
            )
        try:
            info = await self._engine.decoder_info()
        except CLIENT_ERRORS as exc:
            return web.json_response(
                {"status": "unavailable", "decoder": public_message(exc)}, status=503
            )
        return web.json_response(
            {
                "status": "ok",
                "decoder": "ok",
                "voices": list(info.voices),
                "sample_rate_hz": info.sample_rate_hz,
                "active_streams": self._engine.admission.active,
                "decoders": decoders,
            }
        )

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def speech(self, request: web.Request) -> web.StreamResponse:
        try:
            body = json.loads(await request.read())
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad UTF-8, deep nesting
            reason = exc.msg if isinstance(exc, json.JSONDecodeError) else "cannot be decoded"
            return error_response(
                400,
                f"body: not valid JSON: {reason}",
                type_="invalid_request_error",
                param=None,
                code="invalid_argument",
            )
        try:
            call = speech_call_from_json(
                body, self._engine.limits, request.headers.get(REQUEST_ID_HEADER)
            )
        except CLIENT_ERRORS as exc:
            return error_response_for(exc)
        async with contextlib.aclosing(self._engine.speak(call.request)) as chunks:
            # Errors before the first chunk (validation against the decoder,
            # overload, decoder down) still get a proper status and JSON body.
            try:
                first = await anext(chunks)
            except CLIENT_ERRORS as exc:
                return error_response_for(exc)
            if call.stream:
                return await self._stream(request, call, first, chunks)
            return await self._buffered(call, first, chunks)

    async def _buffered(
        self, call: SpeechCall, first: AudioChunk, rest: AsyncIterator[AudioChunk]
    ) -> web.Response:
        parts = [first.audio]
        try:
            async for chunk in rest:
                parts.append(chunk.audio)
        except CLIENT_ERRORS as exc:
            return error_response_for(exc)
        pcm = b"".join(parts)
        body = (
            pcm
            if call.response_format == "pcm"
            else wav_header(first.sample_rate_hz, len(pcm)) + pcm
        )
        return web.Response(
            body=body,
            headers=self._headers(call, first),
        )

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
            if isinstance(exc, CLIENT_ERRORS):
                logger.warning(
                    "speech stream %s failed mid-stream: %s", call.request.request_id, exc
                )
            else:
                logger.error("speech stream %s failed", call.request.request_id, exc_info=exc)
            if request.transport is not None:
                request.transport.close()
            return response
        await response.write_eof()
        return response

    @staticmethod
    def _headers(call: SpeechCall, first: AudioChunk) -> dict[str, str]:
        return {
            "Content-Type": _CONTENT_TYPES[call.response_format],
            REQUEST_ID_HEADER: call.request.request_id,
            SAMPLE_RATE_HEADER: str(first.sample_rate_hz),
        }


def _bearer_auth(
    token: str,
) -> Callable[[web.Request, Callable[[web.Request], Awaitable[web.StreamResponse]]], Awaitable]:
    @web.middleware
    async def bearer_auth(request: web.Request, handler) -> web.StreamResponse:  # noqa: ANN001
        """Every route but /health needs ``Authorization: Bearer <token>``."""
        if request.path == "/health" or bearer_token_matches(
            request.headers.get("Authorization"), token
        ):
            return await handler(request)
        logger.info("refused %s %s: no valid bearer token", request.method, request.path)
        return unauthorized_response()

    return bearer_auth


@web.middleware
async def _openai_errors(request: web.Request, handler) -> web.StreamResponse:  # noqa: ANN001
    """aiohttp's errors (unknown path, wrong method, body too large) and bugs, OpenAI-shaped."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(
            exc.status,
            f"{request.method} {quote_value(request.path)}: {exc.reason}",
            type_="invalid_request_error" if exc.status < 500 else "server_error",
            param=None,
            code=exc.reason.lower().replace(" ", "_"),
        )
    except Exception as exc:  # noqa: BLE001  a bug: traceback logged, generic 500
        logger.error("%s %s failed", request.method, request.path, exc_info=exc)
        return error_response(
            500, INTERNAL_MESSAGE, type_="server_error", param=None, code="internal"
        )


__all__ = [
    "DEFAULT_RESPONSE_FORMAT",
    "RESPONSE_FORMATS",
    "HttpFacade",
    "SpeechCall",
    "error_response_for",
    "speech_call_from_json",
]
