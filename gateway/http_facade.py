"""OpenAI-compatible HTTP facade (aiohttp), in the gateway's process and event loop.

Routes:

* ``POST /v1/audio/speech`` - OpenAI's speech request (`gateway.http_speech`):
  raw audio chunks or SSE events as the audio is made, or one exact
  WAV/PCM/FLAC body.
* ``POST``, ``GET /v1/audio/voices`` and ``DELETE /v1/audio/voices/{name}``
  - a voice-clone model's voice registry (`gateway.http_voices`).
* ``POST /v1/chat/completions`` - OpenAI's chat completions with text and
  audio output, streamed (SSE) or whole (`gateway.http_chat`).
* ``GET /v1/models`` and ``GET /v1/models/{id}`` - the served model, with
  its modalities, voices and limits (`gateway.http_models`).
* ``GET /health`` - 200 when a decoder is healthy (the same state as the
  gateway's gRPC health), 503 otherwise; ``decoders`` counts the healthy
  and the configured replicas. Never needs a token.
* ``GET /metrics`` - Prometheus text format. Every HTTP request is counted
  in ``omni_gateway_http_requests_total{api, status}`` (``api`` is the
  route template) and timed in ``omni_gateway_http_request_seconds``; the
  ``/v1/`` routes also count in ``omni_gateway_requests_total`` with the
  gRPC code of their status.
* ``GET /v1/audio/speech/stream`` - a WebSocket: text in as it is written,
  audio out as each segment is spoken, cancel (barge-in) on the same call
  (`gateway.http_ws`, `gateway.speak_stream`).
* ``GET /v1/realtime`` - a WebSocket: a realtime voice session in OpenAI's
  Realtime API (audio in, audio and transcript out, turn detection,
  barge-in; `gateway.http_realtime`, `gateway.realtime`).
* ``POST /v1/realtime/client_secrets`` - a short-lived key for the
  WebSocket routes, in OpenAI's client-secret shape (`gateway.http_auth`).
* ``GET /`` and ``GET /playground/{name}`` - the playground page and its
  files (`gateway.http_playground`).

Access (`gateway.http_auth`, one middleware): with a token configured,
every route but ``/health`` and the playground page (GET/HEAD of ``/`` and
its files, static and holding no data: the page sends the token the user
types to the API routes) needs ``Authorization: Bearer <token>``; without it
the answer is 401 in OpenAI's shape (code ``invalid_api_key``). The
WebSocket routes also take a key in a ``Sec-WebSocket-Protocol`` entry (a
browser can set no header), and refuse an ``Origin`` other than the
gateway's own or a listed one (403), token or not.

Errors use OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``,
with the HTTP status derived from the gRPC code `grpc_code_for` gives, and
the message from `public_message` (bounded, sanitized): the helpers are in
`gateway.http_common`, which every endpoint module imports. This module
imports the endpoints and routes to them; no endpoint imports it.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Sequence

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway import metrics
from gateway.engine import GatewayEngine
from gateway.health import HealthState
from gateway.http_auth import (
    CLIENT_SECRETS_ROUTE,
    Access,
    AllowedOrigins,
    ClientKeys,
    ClientSecretsEndpoint,
)
from gateway.http_chat import ChatEndpoint
from gateway.http_common import error_response, route_label
from gateway.http_models import ModelsEndpoint
from gateway.http_playground import add_playground_routes
from gateway.http_realtime import RealtimeEndpoint
from gateway.http_speech import SpeechEndpoint
from gateway.http_voices import VoicesEndpoint
from gateway.http_ws import SpeechStreamEndpoint
from gateway.servicer import CLIENT_ERRORS
from omni_common.errors import (
    FailedPreconditionError,
    log_internal,
    public_message,
    quote_value,
)

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 24 * 2**20
"""Largest HTTP request body (413 above it): a chat request's audio parts are
base64 in its JSON, a third larger than the 16 MiB gRPC requests may carry."""


class HttpFacade:
    """The aiohttp application and its runner."""

    def __init__(
        self,
        engine: GatewayEngine,
        *,
        monitor: HealthState | None = None,
        auth_token: str | None = None,
        allowed_origins: Sequence[str] = (),
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self._engine = engine
        self._monitor = monitor
        self._ssl_context = ssl_context
        keys = ClientKeys(auth_token)
        access = Access(
            token=auth_token,
            keys=keys,
            origins=AllowedOrigins(allowed_origins),
            websocket_routes=[SpeechStreamEndpoint.route, RealtimeEndpoint.route],
        )
        # Outermost first: the metrics see the final status of every request.
        self.app = web.Application(middlewares=[_http_metrics, _openai_errors, access.middleware],
                                   client_max_size=MAX_BODY_BYTES)
        models = ModelsEndpoint(engine)
        self.app.router.add_post("/v1/audio/speech", SpeechEndpoint(engine).handle)
        self.app.router.add_get(
            SpeechStreamEndpoint.route.path, SpeechStreamEndpoint(engine).handle
        )
        VoicesEndpoint(engine).add_routes(self.app.router)
        self.app.router.add_post("/v1/chat/completions", ChatEndpoint(engine).handle)
        self.app.router.add_get(RealtimeEndpoint.route.path, RealtimeEndpoint(engine).handle)
        self.app.router.add_post(CLIENT_SECRETS_ROUTE, ClientSecretsEndpoint(keys).handle)
        self.app.router.add_get("/v1/models", models.list)
        self.app.router.add_get("/v1/models/{model_id:.+}", models.get)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/metrics", self.metrics)
        add_playground_routes(self.app.router)
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


# HTTP status -> the gRPC code counted in omni_gateway_requests_total.
_GRPC_CODE_OF_STATUS: dict[int, str] = {
    200: "OK",
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    405: "UNIMPLEMENTED",
    409: "ABORTED",
    413: "RESOURCE_EXHAUSTED",
    429: "RESOURCE_EXHAUSTED",
    499: "CANCELLED",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}
CLIENT_CLOSED_STATUS = 499
"""Status counted for a request whose client went away before it was answered."""


@web.middleware
async def _http_metrics(request: web.Request, handler) -> web.StreamResponse:  # noqa: ANN001
    """Count and time every request by route template and status."""
    start = time.monotonic()
    status = CLIENT_CLOSED_STATUS
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as exc:  # not reached through _openai_errors; counted anyway
        status = exc.status
        raise
    except asyncio.CancelledError:
        raise
    except Exception:
        status = 500
        raise
    finally:
        api = route_label(request)
        metrics.HTTP_REQUESTS.labels(api=api, status=str(status)).inc()
        metrics.HTTP_REQUEST_SECONDS.labels(api=api).observe(time.monotonic() - start)
        if api.startswith("/v1/"):
            # 101: a WebSocket call that ran to its end (its errors travel in-band)
            ok = status < 400
            code = (
                "OK"
                if ok
                else _GRPC_CODE_OF_STATUS.get(status, "INTERNAL" if status >= 500 else "UNKNOWN")
            )
            metrics.REQUESTS.labels(api=api, code=code).inc()


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
    except Exception as exc:  # noqa: BLE001  a bug: traceback logged under an error id, generic 500
        message = log_internal(logger, f"{request.method} {request.path}", exc)
        return error_response(500, message, type_="server_error", param=None, code="internal")


__all__ = ["CLIENT_CLOSED_STATUS", "HttpFacade"]
