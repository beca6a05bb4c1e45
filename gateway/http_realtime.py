"""``GET /v1/realtime``: a realtime voice session over a WebSocket (`gateway.realtime`).

OpenAI's Realtime API over WebSocket: one JSON event per text frame both
ways, audio base64 PCM16 mono at 24 kHz (docs/realtime.md). The model query
parameter (``?model=...``) is accepted and not needed: a deployment serves
one model.

The session holds one ``--max-concurrent`` slot from the upgrade to the
close (its responses run in it); a gateway at its limit answers the upgrade
itself with HTTP 429. Access is checked on the upgrade request
(`gateway.http_auth`): ``Authorization: Bearer``, or from a browser a key
(the token, or a short-lived one from ``POST /v1/realtime/client_secrets``)
in a ``Sec-WebSocket-Protocol`` entry ``openai-insecure-api-key.<key>``
offered beside ``realtime``, as OpenAI's browser clients do; ``Origin`` is
checked. A client that closes the socket, or whose connection drops, gets
its running response cancelled at the decoder.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging

from aiohttp import WSMsgType, web

from gateway.engine import GatewayEngine
from gateway.http_common import WebSocketRoute, error_response, error_response_for, model_id
from gateway.realtime import RealtimeSession
from omni_common.errors import CLIENT_ERRORS, InvalidArgumentError

logger = logging.getLogger(__name__)

ROUTE = "/v1/realtime"
PROTOCOL = "realtime"
"""The subprotocol OpenAI's browser clients offer (with their key beside it)."""
MAX_MESSAGE_BYTES = 16 * 2**20
"""Largest client event (an append of 15 MiB of base64, as OpenAI allows, fits); a bigger one closes the socket (1009)."""
HEARTBEAT_S = 20.0


def encode(event: dict) -> str:
    """A server event as its JSON text frame (an audio delta's bytes as base64)."""
    delta = event.get("delta")
    if isinstance(delta, bytes):
        event = {**event, "delta": base64.b64encode(delta).decode("ascii")}
    return json.dumps(event)


class RealtimeEndpoint:
    """The WebSocket handler over one `GatewayEngine`."""

    route = WebSocketRoute(ROUTE, (PROTOCOL,))

    def __init__(self, engine: GatewayEngine) -> None:
        self._engine = engine

    async def handle(self, request: web.Request) -> web.StreamResponse:
        ws = web.WebSocketResponse(protocols=self.route.protocols, heartbeat=HEARTBEAT_S,
                                   max_msg_size=MAX_MESSAGE_BYTES)
        if not ws.can_prepare(request).ok:
            return error_response(426, f"{ROUTE} is a WebSocket: connect with 'Upgrade: websocket'",
                                  type_="invalid_request_error", param=None, code="upgrade_required")
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(self._engine.admission.slot())
                info = await self._engine.decoder_info()
            except CLIENT_ERRORS as exc:  # at the limit, or no decoder: answered before the upgrade
                return error_response_for(exc)
            await ws.prepare(request)

            async def send(event: dict) -> None:
                await ws.send_str(encode(event))

            session = RealtimeSession(self._engine, info, send, model=model_id(info))
            try:
                await session.start()
                async for message in ws:  # ends at the client's close
                    if message.type is WSMsgType.TEXT:
                        await session.handle_json(message.data)
                    elif message.type is WSMsgType.BINARY:
                        await session.error(InvalidArgumentError(
                            "event", "binary frames are not taken: send JSON events (audio as base64)"))
                    elif message.type is WSMsgType.ERROR:  # a broken connection, a frame too large
                        break
            except ConnectionError:
                logger.info("realtime session %s: the client went away", session.id)
            finally:
                await session.close()
        return ws


__all__ = ["PROTOCOL", "ROUTE", "RealtimeEndpoint", "encode"]
