"""Who may call the HTTP facade: the bearer token, WebSocket credentials a browser can send, Origin.

One middleware (`Access.middleware`) applies three rules before any handler runs:

* **HTTP routes.** With a token configured, every route but ``/health`` and
  the playground page needs ``Authorization: Bearer <token>``; otherwise 401
  in OpenAI's shape (code ``invalid_api_key``, ``WWW-Authenticate: Bearer``).
* **WebSocket routes** (each a `WebSocketRoute`: ``/v1/audio/speech/stream``
  now, the realtime route later). A browser cannot set a header on a
  WebSocket, so these also take the credential where OpenAI's browser
  clients put it: a ``Sec-WebSocket-Protocol`` entry
  ``openai-insecure-api-key.<key>``, offered beside one of the route's own
  protocol names. The handshake echoes the route's name, never the entry
  that carries the key. The key is the token itself, or a client key minted
  by ``POST /v1/realtime/client_secrets`` (`ClientSecretsEndpoint`), so that
  a page never needs the long-lived token in a WebSocket. An
  ``Authorization`` header works too, with either.
* **Origin.** A WebSocket request that carries ``Origin`` (a browser's
  always does) is refused with 403 naming ``Origin`` unless that origin is
  the gateway's own (the scheme's host and port are the ``Host`` the
  request was sent to) or one the deployment lists (``--allowed-origins``,
  `AllowedOrigins`). A request without ``Origin`` is not a browser's and is
  judged by its credentials alone. This holds with and without a token: an
  open gateway on loopback is not a service for every page its user opens.

Client keys (`ClientKeys`) are ``ek_`` followed by their expiry, a random
nonce and an HMAC-SHA256 over both, under a secret derived from the token.
The gateway keeps no table of them: every gateway with the same token
accepts a key any of them minted (gateways stay stateless and
interchangeable behind a load balancer), nothing can fill up, and a new
token retires every key. A key lives 10 s to 2 h (default 10 min, OpenAI's
client-secret bounds) and opens any number of WebSocket calls until it
expires (a call already open runs on); the HTTP routes compare against the
token alone, so a key opens nothing else.

Invariants: no credential (token, key, the protocol header carrying one,
the ``Authorization`` header) is logged or put in a message; comparisons
are constant time; every refusal is an OpenAI-shaped JSON error sent before
the upgrade.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
import secrets
import struct
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from urllib.parse import urlsplit

from aiohttp import web

from gateway.http_common import (
    WebSocketRoute,
    error_response,
    error_response_for,
    json_field,
    read_json,
    route_label,
)
from gateway.http_playground import is_page_path
from gateway.servicer import CLIENT_ERRORS
from omni_common.errors import InvalidArgumentError, quote_value
from omni_common.server import bearer_token_matches

logger = logging.getLogger(__name__)

CLIENT_SECRETS_ROUTE = "/v1/realtime/client_secrets"
KEY_PROTOCOL_PREFIX = "openai-insecure-api-key."
"""A ``Sec-WebSocket-Protocol`` entry that carries a key, as OpenAI's browser clients send it."""
PROTOCOL_HEADER = "Sec-WebSocket-Protocol"
KEY_PREFIX = "ek_"
MIN_KEY_SECONDS = 10
MAX_KEY_SECONDS = 7200
DEFAULT_KEY_SECONDS = 600
EXPIRY_ANCHOR = "created_at"
ANY_ORIGIN = "*"

_KEY_VERSION = 1
_NONCE_BYTES = 16
_HEAD = struct.Struct(">BQ")  # version, expires_at (Unix seconds)
_MAC_BYTES = hashlib.sha256().digest_size
_KEY_BYTES = _HEAD.size + _NONCE_BYTES + _MAC_BYTES
_KEY_LABEL = b"omni-serving websocket client key v1"
_DEFAULT_PORTS = {"http": 80, "https": 443}

UNAUTHORIZED_MESSAGE = (
    "authorization: missing or invalid bearer token (header 'Authorization: Bearer …')"
)
WEBSOCKET_UNAUTHORIZED_MESSAGE = (
    "authorization: missing, invalid or expired credentials: send 'Authorization: Bearer …', "
    f"or from a browser the {PROTOCOL_HEADER} entry '{KEY_PROTOCOL_PREFIX}…' with a key from "
    f"POST {CLIENT_SECRETS_ROUTE}"
)


def unauthorized_response(message: str = UNAUTHORIZED_MESSAGE) -> web.Response:
    response = error_response(
        401, message, type_="invalid_request_error", param=None, code="invalid_api_key"
    )
    response.headers["WWW-Authenticate"] = "Bearer"
    return response


# ------------------------------------------------------------- client keys


class ClientKeys:
    """Mints and checks the short-lived keys of the WebSocket routes (see the module docstring).

    `token` is the gateway's token; without one (an open gateway) the
    secret is random, and the keys are minted for clients written for a
    protected gateway, as nothing checks them. `clock` gives Unix seconds.
    """

    def __init__(self, token: str | None, *, clock: Callable[[], float] = time.time) -> None:
        secret = token.encode("utf-8", "surrogatepass") if token else secrets.token_bytes(32)
        # A key of its own, derived from the token: a minted key reveals nothing about the token.
        self._mac_key = hmac.new(secret, _KEY_LABEL, hashlib.sha256).digest()
        self._clock = clock

    def mint(self, seconds: int, *, now: float | None = None) -> tuple[str, int]:
        """A new key valid for `seconds` from `now` (default: the clock): (key, expires_at)."""
        if not MIN_KEY_SECONDS <= seconds <= MAX_KEY_SECONDS:
            raise InvalidArgumentError(
                "expires_after.seconds",
                f"must be an integer in [{MIN_KEY_SECONDS}, {MAX_KEY_SECONDS}], "
                f"got {quote_value(seconds)}",
            )
        expires_at = int(self._clock() if now is None else now) + seconds
        body = _HEAD.pack(_KEY_VERSION, expires_at) + secrets.token_bytes(_NONCE_BYTES)
        raw = body + self._mac(body)
        return KEY_PREFIX + base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii"), expires_at

    def valid(self, key: str) -> bool:
        """Whether `key` was minted under this token and has not expired."""
        if not key.startswith(KEY_PREFIX):
            return False
        text = key[len(KEY_PREFIX) :]
        try:
            raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
        except (ValueError, binascii.Error):  # not base64, or not ASCII
            return False
        if len(raw) != _KEY_BYTES:
            return False
        body, mac = raw[:-_MAC_BYTES], raw[-_MAC_BYTES:]
        if not hmac.compare_digest(self._mac(body), mac):
            return False
        version, expires_at = _HEAD.unpack_from(body)
        return version == _KEY_VERSION and self._clock() < expires_at

    def _mac(self, body: bytes) -> bytes:
        return hmac.new(self._mac_key, body, hashlib.sha256).digest()


class ClientSecretsEndpoint:
    """``POST /v1/realtime/client_secrets``: a client key, in OpenAI's client-secret shape.

    Body (optional, every field optional): ``{"expires_after": {"anchor":
    "created_at", "seconds": N}, "session": {...}}``. Answer: ``{"value":
    "ek_…", "expires_at": <Unix seconds>, "session": {...}}`` with
    ``Cache-Control: no-store``. ``session`` is returned as given (default
    ``{"type": "realtime"}``); a key carries no session settings.
    """

    def __init__(self, keys: ClientKeys) -> None:
        self._keys = keys

    async def handle(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request) if await request.read() else {}
            seconds, session = _client_secret_request(body)
            key, expires_at = self._keys.mint(seconds)
        except CLIENT_ERRORS as exc:
            return error_response_for(exc)
        logger.info("minted a WebSocket client key for %d s", seconds)
        return web.json_response(
            {"value": key, "expires_at": expires_at, "session": session},
            headers={"Cache-Control": "no-store"},
        )


def _client_secret_request(body: object) -> tuple[int, dict]:
    """(seconds, session) of a client-secret body; a 400 names the field."""
    if not isinstance(body, dict):
        raise InvalidArgumentError("body", "must be a JSON object")
    expires_after = json_field(body, "expires_after", (dict,), {})
    assert isinstance(expires_after, dict)
    anchor = json_field(expires_after, "expires_after.anchor", (str,), EXPIRY_ANCHOR)
    if anchor != EXPIRY_ANCHOR:
        raise InvalidArgumentError(
            "expires_after.anchor",
            f"only {EXPIRY_ANCHOR!r} is supported, got {quote_value(anchor)}",
        )
    seconds = json_field(expires_after, "expires_after.seconds", (int,), DEFAULT_KEY_SECONDS)
    assert isinstance(seconds, int)
    session = json_field(body, "session", (dict,), {"type": "realtime"})
    assert isinstance(session, dict)
    return seconds, session


# ----------------------------------------------------------------- origins


def _origin_parts(text: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) of an ``http(s)://host[:port]`` origin; None for anything else."""
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError:  # a bad port, unbalanced brackets
        return None
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS or not parts.hostname:
        return None
    if parts.path or parts.query or parts.fragment or parts.username or parts.password:
        return None
    return scheme, parts.hostname, port if port is not None else _DEFAULT_PORTS[scheme]


def parse_allowed_origins(
    values: str | Iterable[str], field: str = "--allowed-origins"
) -> tuple[str, ...]:
    """Origins from options or a config key: each ``scheme://host[:port]`` or ``*``.

    `values` may hold comma-separated lists. The result is normalised
    (lower case, no default port); a bad entry is refused naming `field`.
    """
    entries = [values] if isinstance(values, str) else list(values)
    out: list[str] = []
    for entry in ",".join(entries).split(","):
        entry = entry.strip()
        if not entry:
            continue
        if entry == ANY_ORIGIN:
            out.append(ANY_ORIGIN)
            continue
        parts = _origin_parts(entry)
        if parts is None:
            raise InvalidArgumentError(
                field,
                f"{quote_value(entry)} is not an origin: write scheme://host[:port] "
                "(http or https, no path, no trailing slash), or * for any",
            )
        scheme, host, port = parts
        host = f"[{host}]" if ":" in host else host
        default = port == _DEFAULT_PORTS[scheme]
        out.append(f"{scheme}://{host}" if default else f"{scheme}://{host}:{port}")
    return tuple(dict.fromkeys(out))


class AllowedOrigins:
    """Which ``Origin`` may open a WebSocket: the gateway's own, and the listed ones."""

    def __init__(self, origins: Iterable[str] = ()) -> None:
        listed = parse_allowed_origins(list(origins))
        self.any = ANY_ORIGIN in listed
        self._listed = {_origin_parts(o) for o in listed if o != ANY_ORIGIN}

    def allows(self, origin: str, host: str | None) -> bool:
        """Whether a request with this ``Origin`` sent to this ``Host`` may go on."""
        if self.any:
            return True
        parts = _origin_parts(origin)
        if parts is None:  # "null" (a sandboxed page, a file), or garbage
            return False
        return parts in self._listed or _same_origin(parts, host)


def _same_origin(origin: tuple[str, str, int], host: str | None) -> bool:
    """Whether `host` (the ``Host`` header) names the origin's host and port.

    The scheme is not compared: behind a proxy that ends TLS the gateway
    sees plain HTTP from a page served over https (the ``Host`` header's
    missing port is then the origin scheme's default).
    """
    if not host:
        return False
    try:
        parts = urlsplit(f"//{host}")
        port = parts.port
    except ValueError:
        return False
    scheme, origin_host, origin_port = origin
    return parts.hostname == origin_host and (port or _DEFAULT_PORTS[scheme]) == origin_port


# -------------------------------------------------------------- middleware


class Access:
    """The facade's access rules (module docstring), as one aiohttp middleware."""

    def __init__(
        self,
        *,
        token: str | None,
        keys: ClientKeys,
        origins: AllowedOrigins,
        websocket_routes: Sequence[WebSocketRoute],
    ) -> None:
        self._token = token
        self._keys = keys
        self._origins = origins
        self._websocket: Mapping[str, WebSocketRoute] = {r.path: r for r in websocket_routes}

    @web.middleware
    async def middleware(self, request: web.Request, handler) -> web.StreamResponse:  # noqa: ANN001
        route = self._websocket.get(route_label(request))
        if route is not None:
            return self._refuse_websocket(request, route) or await handler(request)
        if (
            self._token is None
            or request.path == "/health"
            or is_page_path(request.method, request.path)
            or bearer_token_matches(request.headers.get("Authorization"), self._token)
        ):
            return await handler(request)
        logger.info("refused %s %s: no valid bearer token", request.method, request.path)
        return unauthorized_response()

    def _refuse_websocket(self, request: web.Request, route: WebSocketRoute) -> web.Response | None:
        """The answer refusing a WebSocket request, or None to let it through."""
        origin = request.headers.get("Origin")
        if origin is not None and not self._origins.allows(origin, request.headers.get("Host")):
            logger.info("refused %s: Origin %s is not allowed", request.path, quote_value(origin))
            return error_response(
                403,
                f"Origin: {quote_value(origin)} may not open WebSockets here; the gateway's "
                "own origin may, and those listed with --allowed-origins",
                type_="invalid_request_error",
                param="Origin",
                code="origin_not_allowed",
            )
        try:
            key = _protocol_key(request, route)
        except InvalidArgumentError as exc:
            return error_response_for(exc)
        if self._token is None:
            return None
        bearer = _bearer_value(request.headers.get("Authorization", ""))
        presented = [c for c in (bearer, key) if c is not None]
        if presented and all(self._valid(credential) for credential in presented):
            return None
        logger.info("refused %s: no valid WebSocket credentials", request.path)
        return unauthorized_response(WEBSOCKET_UNAUTHORIZED_MESSAGE)

    def _valid(self, credential: str) -> bool:
        assert self._token is not None
        token_ok = bearer_token_matches(f"Bearer {credential}", self._token)
        return self._keys.valid(credential) or token_ok


def _bearer_value(header: str) -> str | None:
    """The credential of an ``Authorization: Bearer …`` value; None for none or another scheme.

    A browser may send the ``Basic`` credentials it holds for the site on a
    WebSocket handshake by itself; they are not the gateway's, so they are
    not judged.
    """
    scheme, _, value = header.strip().partition(" ")
    return value.strip() if scheme.lower() == "bearer" else None


def _protocol_key(request: web.Request, route: WebSocketRoute) -> str | None:
    """The key a client offered as a subprotocol entry, or None (INVALID_ARGUMENT if malformed).

    The key entry is never echoed, so a browser needs one of the route's
    own protocols beside it: without one it would drop the connection.
    """
    headers = request.headers.getall(PROTOCOL_HEADER, [])
    if not headers:
        return None
    if len(headers) > 1:
        raise InvalidArgumentError(PROTOCOL_HEADER, "send the protocols in one header")
    offered = [p.strip() for p in headers[0].split(",")]
    keys = [p[len(KEY_PROTOCOL_PREFIX) :] for p in offered if p.startswith(KEY_PROTOCOL_PREFIX)]
    if not keys:
        return None
    if len(keys) > 1:
        raise InvalidArgumentError(PROTOCOL_HEADER, f"offer one '{KEY_PROTOCOL_PREFIX}…' entry")
    if not any(p in route.protocols for p in offered):
        names = ", ".join(repr(p) for p in route.protocols)
        raise InvalidArgumentError(
            PROTOCOL_HEADER,
            f"offer {names} beside the key: the gateway echoes it (never the key), and a "
            "browser drops a connection whose offered protocols none was echoed",
        )
    return keys[0]


__all__ = [
    "ANY_ORIGIN",
    "CLIENT_SECRETS_ROUTE",
    "DEFAULT_KEY_SECONDS",
    "KEY_PREFIX",
    "KEY_PROTOCOL_PREFIX",
    "MAX_KEY_SECONDS",
    "MIN_KEY_SECONDS",
    "Access",
    "AllowedOrigins",
    "ClientKeys",
    "ClientSecretsEndpoint",
    "parse_allowed_origins",
    "unauthorized_response",
]
