"""What the HTTP endpoint modules share: OpenAI's error shape, JSON field readers, SSE, headers.

The endpoint modules (`gateway.http_speech`, `gateway.http_chat`,
`gateway.http_ws`, `gateway.http_models`) and the facade that routes to
them (`gateway.http_facade`) import this module; it imports none of them.
The endpoints never import each other: what two of them share lives here.

Invariants:

* Every error a client sees is OpenAI's object,
  ``{"error": {"message", "type", "param", "code"}}``. For an exception the
  HTTP status comes from the gRPC code `grpc_code_for` gives (one mapping,
  `_HTTP_STATUS`), and the message from `public_message` (bounded,
  sanitized); a 500 carries the generic internal message with an error id
  (`log_internal`: the traceback is logged under the same id) unless the
  error is one of ours. A plain ValueError / TypeError / KeyError is a bug,
  a 500, never a 400.
* ``param`` is the field as the client spelled it (`http_param` renames the
  engine's and decoder's field names).
* A WebSocket route declares itself as a `WebSocketRoute` (its path and
  subprotocol names), so the access rules and the handler agree on them.
* A JSON field of the wrong type, or a number out of its range, is a 400
  that names the field (`json_field`, `number_field`, `int_field`); a JSON
  ``true`` is never taken for a number.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import grpc
from aiohttp import web

from gateway.decoder_client import DecoderInfo
from gateway.validation import json_type_name
from omni_common.errors import (
    InvalidArgumentError,
    OmniError,
    grpc_code_for,
    log_internal,
    public_message,
    quote_value,
)

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-Id"
SAMPLE_RATE_HEADER = "X-Sample-Rate"
FINISH_REASON_HEADER = "X-Finish-Reason"

MAX_UINT32 = 2**32 - 1
"""Largest value of a ``uint32`` proto field (token caps, first chunk frames)."""

DEFAULT_MODEL_ID = "omni-serving"
"""The model's id when the decoder does not name it."""

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


def model_id(info: DecoderInfo) -> str:
    """The id clients see: the decoder's model name, or `DEFAULT_MODEL_ID`."""
    return info.model or DEFAULT_MODEL_ID


def route_label(request: web.Request) -> str:
    """The route template of a request (``/v1/models/{model_id}``); "unmatched" for none."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


@dataclass(frozen=True)
class WebSocketRoute:
    """A WebSocket route, as the access rules see it (`gateway.http_auth`).

    `protocols` are the ``Sec-WebSocket-Protocol`` names the route speaks:
    the gateway echoes the first one the client offers, and a client that
    sends its key in a protocol entry offers one of these beside it.
    """

    path: str
    protocols: tuple[str, ...]


# ------------------------------------------------------------------ errors


def error_response(
    status: int, message: str, *, type_: str, param: str | None, code: str | None
) -> web.Response:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return web.json_response(body, status=status)


def http_param(field: str | None, params: Mapping[str, str] | None = None) -> str | None:
    """The HTTP field a client sent for an engine or decoder field name.

    ``sampling_params.x`` is the body's ``x``; `params` renames the rest
    (``text`` -> ``input`` for speech, ``prompt`` -> ``messages`` for chat);
    a key that starts with a dot renames that segment of a path wherever it
    is (``.audio`` -> ``.input_audio``: ``messages[0].content[1].audio.data``
    is the body's ``messages[0].content[1].input_audio.data``).
    """
    if field is None:
        return None
    field = field.removeprefix("sampling_params.")
    params = params or {}
    if field in params:
        return params[field]
    for segment, name in params.items():
        if segment.startswith("."):
            field = re.sub(re.escape(segment) + r"(?=\.|$)", name, field)
    return field


def error_body(
    exc: BaseException, params: Mapping[str, str] | None = None
) -> tuple[int, dict[str, object]]:
    """The HTTP status and OpenAI error object for an exception (gRPC code mapping)."""
    code = grpc_code_for(exc)
    status, type_ = _HTTP_STATUS.get(code, (500, "server_error"))
    if status == 500:
        code = grpc.StatusCode.INTERNAL
        if isinstance(exc, OmniError):
            logger.error("HTTP request failed", exc_info=exc)
            message = public_message(exc)
        else:
            message = log_internal(logger, "HTTP request", exc)
    else:
        logger.info("HTTP request refused: %s: %s", code.name, exc)
        message = public_message(exc)
    field = getattr(exc, "field", None)
    param = http_param(field if isinstance(field, str) else None, params)
    if isinstance(field, str) and param and param != field:
        message = message.replace(f"{field}: ", f"{param}: ", 1)  # the field as the client named it
    return status, {"message": message, "type": type_, "param": param, "code": code.name.lower()}


def error_response_for(exc: BaseException, params: Mapping[str, str] | None = None) -> web.Response:
    """OpenAI-shaped error for an exception, through the shared gRPC code mapping.

    `params` maps engine and decoder field names to the request's (`http_param`).
    """
    status, error = error_body(exc, params)
    return web.json_response({"error": error}, status=status)


# ------------------------------------------------------------- JSON bodies


class InvalidBodyError(OmniError):
    """The request body is not a JSON document (400, no ``param``)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


async def read_json(request: web.Request) -> object:
    """The request's JSON body (`InvalidBodyError` if it does not parse)."""
    try:
        return json.loads(await request.read())
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad UTF-8, deep nesting
        reason = exc.msg if isinstance(exc, json.JSONDecodeError) else "cannot be decoded"
        raise InvalidBodyError(f"body: not valid JSON: {reason}") from None


def json_field(
    body: Mapping[str, object], name: str, types: tuple[type, ...], default: object
) -> object:
    """`body[name]` if it has one of `types` (absent or null: `default`); else a 400 naming it.

    `name` is the field as the client spells it (``audio.format``); the key
    looked up is its last part.
    """
    value = body.get(name.rpartition(".")[2], default)
    if value is None:
        return default
    # bool is an int: refuse it where a number is expected.
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        wanted = " or ".join(dict.fromkeys(json_type_name(t()) for t in types))
        raise InvalidArgumentError(name, f"must be a {wanted}, got {json_type_name(value)}")
    return value


def number_field(
    body: Mapping[str, object], name: str, low: float, high: float, note: str = ""
) -> float | None:
    """An optional finite number in [low, high]."""
    value = json_field(body, name, (int, float), None)
    if value is None:
        return None
    assert isinstance(value, (int, float))
    # An integer too large for a float is out of range too (math.isfinite would overflow).
    if not (abs(value) < 1e300 and math.isfinite(value) and low <= value <= high):
        raise InvalidArgumentError(
            name, f"must be a number in [{low:g}, {high:g}]{note}, got {quote_value(value)}"
        )
    return float(value)


def int_field(body: Mapping[str, object], name: str, low: int, high: int) -> int | None:
    """An optional integer in [low, high]."""
    value = json_field(body, name, (int,), None)
    if value is None:
        return None
    assert isinstance(value, int)
    if not low <= value <= high:
        raise InvalidArgumentError(
            name, f"must be an integer in [{low}, {high}], got {quote_value(value)}"
        )
    return value


@dataclass(frozen=True)
class Unserved:
    """A field of the API that this server does not implement: accepted only
    at a value that asks for nothing (`accepts`), else a 400 naming it with
    `why` (what the field would need)."""

    accepts: Callable[[object], bool]
    why: str


def check_fields(body: Mapping[str, object], served: frozenset[str], unserved: Mapping[str, Unserved]) -> None:
    """Every field of `body` is one the route serves, or one it does not
    serve at a value that asks for nothing; any other is a 400 naming it
    (fields are never silently ignored). Null counts as absent."""
    for name, value in body.items():
        if value is None or name in served:
            continue
        field = unserved.get(name)
        if field is None:
            raise InvalidArgumentError(name, f"unknown field; this route serves: {', '.join(sorted(served))}")
        if not field.accepts(value):
            raise InvalidArgumentError(name, f"is not supported by this server: {field.why}")


# --------------------------------------------------------- server-sent events


async def start_sse(request: web.Request, headers: dict[str, str]) -> web.StreamResponse:
    """A prepared ``text/event-stream`` response with `headers` (uncached)."""
    headers["Content-Type"] = "text/event-stream"
    headers["Cache-Control"] = "no-cache"
    response = web.StreamResponse(headers=headers)
    await response.prepare(request)
    return response


def sse_event(data: object) -> bytes:
    """One server-sent event carrying `data` as JSON."""
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


async def write_sse_error(
    response: web.StreamResponse, exc: BaseException, params: Mapping[str, str] | None = None
) -> None:
    """End an SSE stream that failed after its headers left: an error event, no more."""
    _, error = error_body(exc, params)
    with contextlib.suppress(ConnectionError, RuntimeError):  # the client may be gone
        await response.write(sse_event({"type": "error", "error": error}))
        await response.write_eof()


__all__ = [
    "DEFAULT_MODEL_ID",
    "FINISH_REASON_HEADER",
    "MAX_UINT32",
    "REQUEST_ID_HEADER",
    "SAMPLE_RATE_HEADER",
    "InvalidBodyError",
    "Unserved",
    "WebSocketRoute",
    "error_body",
    "error_response",
    "error_response_for",
    "check_fields",
    "http_param",
    "int_field",
    "json_field",
    "model_id",
    "number_field",
    "read_json",
    "route_label",
    "sse_event",
    "start_sse",
    "write_sse_error",
]
