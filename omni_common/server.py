"""gRPC (asyncio) server bootstrap shared by the decoder, materializer and gateway.

Each service's entry point builds a `ServerConfig`, passes a `register`
callback that adds its servicers, and calls `run_server`. This module adds
what every service needs on top: health checking (`grpc.health.v1`),
reflection (``grpc.reflection.v1`` and ``v1alpha``, `enable_reflection`),
listening on TCP or a Unix domain socket (UDS), and an orderly shutdown on
SIGTERM/SIGINT:

1. health goes NOT_SERVING, so clients and load balancers stop sending work;
2. `server.stop(grace_s)` lets in-flight RPCs finish, then cancels the rest;
3. the caller's `on_shutdown` releases backends (engine, shared memory);
4. the socket file is removed.

Every server `build_server` makes has `InternalErrorInterceptor` outermost:
no exception leaves a servicer as UNKNOWN (a bug is INTERNAL with an error
id, an `OmniError` keeps its code).

Addresses are ``unix:///abs/path.sock``, ``unix:relative/path.sock`` or
``host:port`` (port 0 picks a free port). `build_server` returns the address
a client should dial, with the real port filled in; what a host means
(wildcards, ``localhost``, socket path length) is omni_common.net's.

Optional, per service (`ServerConfig`): TLS from a certificate and key file
(`TlsFiles`), server interceptors (`BearerTokenInterceptor` requires a
token on every method but health; `MalformedRequestInterceptor` answers a
request that does not parse with INVALID_ARGUMENT instead of UNKNOWN), and
health that starts NOT_SERVING until the service says otherwise
(`set_health`), for services whose readiness depends on another one.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import inspect
import logging
import os
import re
import signal
import socket
import stat
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from omni_common.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    OmniError,
    UnavailableError,
    log_internal,
    public_message,
    sanitize_message,
)
from omni_common.net import MAX_UDS_PATH_BYTES, dial_host, uds_path_bytes

logger = logging.getLogger(__name__)

HealthServicer: TypeAlias = health_aio.HealthServicer

DEFAULT_MAX_MESSAGE_BYTES = 64 * 2**20

# Keepalive: a peer that vanished without closing its connection (killed
# container, dropped network path) otherwise leaves streams open until the
# kernel gives up, which for TCP can take hours. Pinging an idle connection
# every 30 s and waiting 10 s for the ack bounds that to well under a minute.
_KEEPALIVE_TIME_MS = 30_000
_KEEPALIVE_TIMEOUT_MS = 10_000
# Server side: accept client pings at most this often. It must not be above
# the clients' keepalive time, or the server answers their pings with GOAWAY
# ("too_many_pings") and drops the connection.
_MIN_CLIENT_PING_INTERVAL_MS = 10_000

# Schemes a client target may already carry; passed through unchanged.
_CLIENT_SCHEMES = ("dns:", "ipv4:", "ipv6:", "unix-abstract:", "vsock:")

# Reconnect backoff for channels to a peer that is expected back quickly (a
# restarted local service). gRPC's defaults (1 s initial, x1.6, up to 120 s)
# leave a client failing for many seconds after its peer is back.
_FAST_RECONNECT_INITIAL_MS = 100
_FAST_RECONNECT_MAX_MS = 1000
# gRPC core reads this one as the deadline of one connection attempt
# (default 20 s): a hung attempt must not outlast the backoff above by much.
_FAST_RECONNECT_CONNECT_TIMEOUT_MS = 1000

CANCEL_NOTICE_S = 0.2
"""How long a handler whose write failed in grpc's core waits for the call's
cancellation (`cancelled_by_client`); it came within milliseconds in tests."""

HEALTH_METHOD_PREFIX = "/grpc.health.v1.Health/"
"""Methods of the standard health service; left open by `BearerTokenInterceptor`."""


@dataclass(frozen=True)
class TlsFiles:
    """A server certificate chain and its private key, PEM files."""

    cert_path: str
    key_path: str

    def read(self) -> tuple[bytes, bytes]:
        """(certificate chain, private key); FailedPreconditionError naming an unreadable file."""
        out = []
        for what, path in (("certificate", self.cert_path), ("key", self.key_path)):
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except OSError as exc:
                raise FailedPreconditionError(
                    f"TLS {what} {path}: cannot read it: {exc.strerror}"
                ) from exc
            if b"-----BEGIN" not in data:
                raise FailedPreconditionError(f"TLS {what} {path}: not a PEM file")
            out.append(data)
        return out[0], out[1]

    def server_credentials(self) -> grpc.ServerCredentials:
        cert, key = self.read()
        return grpc.ssl_server_credentials([(key, cert)])


@dataclass
class ServerConfig:
    """Where and how one service listens."""

    address: str
    """``unix:///abs/path.sock``, ``unix:relative.sock`` or ``host:port`` (port 0 allowed)."""
    service_name: str
    """Full proto name reported by health, e.g. ``omni_serving.v1.DecoderService``."""
    grace_s: float = 5.0
    """How long in-flight RPCs may run after shutdown starts."""
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    """Largest message accepted or sent, in either direction."""
    reflection_service_names: Sequence[str] = ()
    """Full names of the registered services to expose through reflection."""
    max_receive_message_bytes: int | None = None
    """Largest request accepted, when below `max_message_bytes` (a front end's small requests)."""
    tls: TlsFiles | None = None
    """Serve TLS with this certificate and key instead of plaintext."""
    interceptors: Sequence[grpc.aio.ServerInterceptor] = ()
    """Server interceptors, outermost first."""
    serving_at_start: bool = True
    """Health SERVING once started; False leaves NOT_SERVING until `set_health` says so."""

    def __post_init__(self) -> None:
        _parse_address(self.address)  # refuse a malformed address before anything starts
        if not self.service_name:
            raise InvalidArgumentError("service_name", "must not be empty")
        if self.grace_s < 0:
            raise InvalidArgumentError("grace_s", f"must be >= 0, got {self.grace_s}")
        if self.max_message_bytes <= 0:
            raise InvalidArgumentError(
                "max_message_bytes", f"must be > 0, got {self.max_message_bytes}"
            )
        if self.max_receive_message_bytes is not None and self.max_receive_message_bytes <= 0:
            raise InvalidArgumentError(
                "max_receive_message_bytes", f"must be > 0, got {self.max_receive_message_bytes}"
            )

    @property
    def health_names(self) -> tuple[str, ...]:
        """The health entries this service reports: the server as a whole ("") and its name."""
        return tuple(dict.fromkeys(["", self.service_name]))


@dataclass(frozen=True)
class _Address:
    uds_path: str | None  # absolute socket path for UDS, else None
    host: str = ""
    port: int = 0


def _parse_address(address: str, *, field: str = "address") -> _Address:
    """Split a listen/dial address; UDS paths come back absolute."""
    if address.startswith("unix://"):
        path = address[len("unix://") :]
        if not path.startswith("/"):
            raise InvalidArgumentError(
                field, f"{address!r}: 'unix://' needs an absolute path (unix:///abs/path.sock)"
            )
    elif address.startswith("unix:"):
        path = address[len("unix:") :]
    else:
        host, sep, port_text = address.rpartition(":")
        if not sep or not port_text.isdigit() or int(port_text) > 65535:
            raise InvalidArgumentError(
                field, f"{address!r}: expected host:port, unix:///abs/path or unix:relative/path"
            )
        return _Address(None, host, int(port_text))
    if not path or path.endswith("/"):
        raise InvalidArgumentError(field, f"{address!r}: missing socket file name")
    path = os.path.abspath(path)
    if uds_path_bytes(path) > MAX_UDS_PATH_BYTES:
        raise InvalidArgumentError(
            field, f"{address!r}: socket path is longer than {MAX_UDS_PATH_BYTES} bytes"
        )
    return _Address(path)


def client_target(address: str) -> str:
    """The target a grpc channel should dial to reach `address`.

    UDS addresses become ``unix:///abs/path``; wildcard or ``localhost``
    hosts become ``127.0.0.1``; targets with another gRPC scheme
    (``dns:``, ``ipv4:``, ...) pass through unchanged.
    """
    if address.startswith(_CLIENT_SCHEMES):
        return address
    parsed = _parse_address(address, field="target")
    if parsed.uds_path is not None:
        return f"unix://{parsed.uds_path}"
    if parsed.port == 0:
        raise InvalidArgumentError("target", f"{address!r}: cannot dial port 0")
    return f"{dial_host(parsed.host)}:{parsed.port}"


def server_options(
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, max_receive_message_bytes: int | None = None
) -> list[tuple[str, int]]:
    """Channel arguments for a service's server, each with the reason it is set."""
    return [
        # gRPC refuses incoming messages above 4 MiB by default. Inline tensors
        # (audio chunks, codec codes, latents) exceed that, so raise the limit;
        # keep it finite so one bad request cannot make us buffer gigabytes.
        ("grpc.max_receive_message_length", max_receive_message_bytes or max_message_bytes),
        # Same bound for what we send, so a response that would be refused by
        # a peer using the same limit fails here, with our error, instead.
        ("grpc.max_send_message_length", max_message_bytes),
        # gRPC sets SO_REUSEPORT on Linux, which lets a second server bind the
        # same TCP port and silently take half the connections. Turn it off
        # so a port clash fails at startup. (No effect on UDS.)
        ("grpc.so_reuseport", 0),
        # Ping idle clients so a vanished one is noticed and its streams end.
        ("grpc.keepalive_time_ms", _KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", _KEEPALIVE_TIMEOUT_MS),
        # Let clients keep long-lived idle channels alive with their own
        # pings (the gateway holds channels to decoders between requests)...
        ("grpc.keepalive_permit_without_calls", 1),
        # ...at the rate they are configured with, without being disconnected
        # for "too many pings".
        ("grpc.http2.min_ping_interval_without_data_ms", _MIN_CLIENT_PING_INTERVAL_MS),
    ]


def client_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """Channel arguments for a client of our services, matching `server_options`."""
    return [
        # Responses carry tensors above the 4 MiB default; accept up to the
        # same bound the server sends.
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        # Detect a dead server on an idle channel instead of hanging the next
        # call; 30 s is above the server's minimum ping interval.
        ("grpc.keepalive_time_ms", _KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", _KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


def fast_reconnect_options() -> list[tuple[str, int]]:
    """Channel arguments for a client that must be back within about a second of its peer.

    Reconnect attempts start 100 ms after a failure and are at most 1 s
    apart (plus gRPC's 20 % jitter); one attempt may take at most 1 s. For
    local peers (a Unix socket, a container on the same network), where a
    failed connect fails at once, this costs nothing.
    """
    return [
        ("grpc.initial_reconnect_backoff_ms", _FAST_RECONNECT_INITIAL_MS),
        ("grpc.max_reconnect_backoff_ms", _FAST_RECONNECT_MAX_MS),
        ("grpc.min_reconnect_backoff_ms", _FAST_RECONNECT_CONNECT_TIMEOUT_MS),
    ]


# ---------------------------------------------------------------------------
# Interceptors.


_BEARER = re.compile(r"\s*bearer\s+(\S+)\s*", re.IGNORECASE)


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


def bearer_token_matches(header: str | bytes | None, token: str) -> bool:
    """Whether an ``Authorization`` value is ``Bearer <token>``; constant time in the token.

    Both sides are hashed first, so neither the comparison time nor an early
    exit on length tells a caller anything about the expected token.
    """
    if header is None:
        return False
    if isinstance(header, bytes):
        header = header.decode("utf-8", "surrogateescape")
    match = _BEARER.fullmatch(header)
    presented = match.group(1) if match else ""
    return hmac.compare_digest(_digest(presented), _digest(token)) and bool(match)


def _same_kind_handler(
    handler: grpc.RpcMethodHandler,
    behavior: Callable[..., Any],
    request_deserializer: Callable[[bytes], Any] | None,
) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind as `handler`, with a new behaviour."""
    if handler.request_streaming and handler.response_streaming:
        make = grpc.stream_stream_rpc_method_handler
    elif handler.request_streaming:
        make = grpc.stream_unary_rpc_method_handler
    elif handler.response_streaming:
        make = grpc.unary_stream_rpc_method_handler
    else:
        make = grpc.unary_unary_rpc_method_handler
    return make(
        behavior,
        request_deserializer=request_deserializer,
        response_serializer=handler.response_serializer,
    )


def _behavior_of(handler: grpc.RpcMethodHandler) -> Callable[..., Any]:
    """The servicer function of `handler`, whatever its streaming kind."""
    if handler.request_streaming:
        return handler.stream_stream if handler.response_streaming else handler.stream_unary
    return handler.unary_stream if handler.response_streaming else handler.unary_unary


def _aborting(code: grpc.StatusCode, message: str) -> Callable[..., Awaitable[None]]:
    async def abort(request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    return abort


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Every call must carry ``authorization: Bearer <token>`` metadata; health stays open.

    A call without it, or with another token, ends with UNAUTHENTICATED
    before its request is even parsed.
    """

    MESSAGE = "authorization: missing or invalid bearer token (metadata 'authorization: Bearer …')"

    def __init__(self, token: str, *, open_prefixes: Sequence[str] = (HEALTH_METHOD_PREFIX,)):
        if not token:
            raise InvalidArgumentError("token", "must not be empty")
        self._token = token
        self._open_prefixes = tuple(open_prefixes)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method or ""
        handler = await continuation(handler_call_details)
        if handler is None or method.startswith(self._open_prefixes):
            return handler
        header = None
        for key, value in handler_call_details.invocation_metadata or ():
            if key.lower() == "authorization":
                header = value
                break
        if bearer_token_matches(header, self._token):
            return handler
        logger.info("refused %s: no valid bearer token", method)
        return _same_kind_handler(
            handler, _aborting(grpc.StatusCode.UNAUTHENTICATED, self.MESSAGE), None
        )


@dataclass(frozen=True)
class _Malformed:
    """What the safe deserializer hands on instead of a request that does not parse."""

    error: str


class InternalErrorInterceptor(grpc.aio.ServerInterceptor):
    """No exception leaves a servicer as UNKNOWN (installed by `build_server` on every server).

    grpc.aio ends a call whose handler raises with UNKNOWN and the
    exception's class and text in the message: a bug of ours would read as
    nothing in particular, and its text (paths, addresses, other requests'
    values) would reach the client. This interceptor wraps every method,
    unary and streaming (an async generator or a coroutine that writes;
    a synchronous handler, which grpc runs on a thread, is left alone):

    - an `OmniError` ends the call with its own code and its (sanitized) message;
    - a status the servicer already set (``context.set_code``) before raising
      is kept, with its details;
    - an abort (``context.abort``) and a cancellation pass through untouched;
      so does any error on a call the client has cancelled, as a
      cancellation (`cancelled_by_client`: a response written after the
      client went away fails in grpc's core);
    - anything else is a bug: INTERNAL with a message naming an error id,
      under which `log_internal` logs the traceback.

    It is the outermost interceptor, so the other interceptors' aborts
    (authentication, malformed requests) pass through it unchanged.
    """

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method or "a call"
        behavior = _behavior_of(handler)
        if not (inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)):
            return handler  # a synchronous handler: grpc runs it on a thread, left as it is
        return _same_kind_handler(handler, _guarded(behavior, method), handler.request_deserializer)


def _guarded(behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
    """`behavior`, its escaping exceptions turned into a status (`InternalErrorInterceptor`)."""
    if inspect.isasyncgenfunction(behavior):
        # Served as a handler that writes (grpc takes either kind for a
        # response stream): a write that fails because the client went away
        # then fails here, where it is known for a cancellation, and not in
        # grpc's own loop, which logs it as an error of the servicer.

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> None:
            async with _status_for_errors(context, method):
                async with contextlib.aclosing(behavior(request, context)) as items:
                    async for item in items:
                        await context.write(item)

        return stream

    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        async with _status_for_errors(context, method):
            result = behavior(request, context)
            return await result if inspect.isawaitable(result) else result

    return call


@contextlib.asynccontextmanager
async def _status_for_errors(context: grpc.aio.ServicerContext, method: str) -> AsyncIterator[None]:
    """An exception escaping the block ends the call (`_abort_for`); aborts and cancellations pass."""
    try:
        yield
    except (grpc.aio.AbortError, asyncio.CancelledError):
        raise
    except Exception as exc:  # noqa: BLE001 -- every escaping error gets a status
        if await cancelled_by_client(context, exc):
            raise asyncio.CancelledError(f"{method}: cancelled by the client") from exc
        await _abort_for(exc, context, method)


async def cancelled_by_client(context: grpc.aio.ServicerContext, exc: BaseException) -> bool:
    """Whether `exc`, escaping a handler, is the client's departure and not a bug.

    A response written after the client went away (it cancelled, its
    deadline passed, its connection closed) fails with an error of grpc's
    core (``ExecuteBatchError``), and the call's cancellation reaches the
    handler only afterwards. For an exception of grpc's own this waits for
    it, up to `CANCEL_NOTICE_S`: True if the call was cancelled (the caller
    ends it as cancelled: grpc sends no status on a cancelled call). Any
    other exception, a failed call of ours to another server (`grpc.RpcError`)
    included, is answered at once (False, unless already cancelled).
    """
    if context.cancelled():
        return True
    if isinstance(exc, grpc.RpcError) or not type(exc).__module__.startswith("grpc"):
        return False  # (an RpcError: a call of ours to another server failed)
    deadline = time.monotonic() + CANCEL_NOTICE_S
    try:
        while not context.cancelled() and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
    except asyncio.CancelledError:  # the cancellation itself: the caller raises one again
        return True
    return context.cancelled()


async def _abort_for(exc: Exception, context: grpc.aio.ServicerContext, method: str) -> None:
    """End the call for `exc` escaping `method` (raises grpc's AbortError)."""
    if isinstance(exc, OmniError):
        await context.abort(exc.code, public_message(exc))
    code = context.code()
    if code is not None and code is not grpc.StatusCode.OK:
        details = context.details()
        await context.abort(code, details.decode(errors="replace") if isinstance(details, bytes) else details or "")
    await context.abort(grpc.StatusCode.INTERNAL, log_internal(logger, method, exc))


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """A unary request that does not parse ends with INVALID_ARGUMENT, not UNKNOWN.

    gRPC reports a failing request deserializer as UNKNOWN, with the
    exception's class in the message. This interceptor wraps the deserializer
    of every method: a parse failure becomes a marker that the wrapped
    behaviour answers with INVALID_ARGUMENT ("request: ..."). A single
    request never reaches the servicer; on a request stream, the messages
    before the malformed one are served and the call ends there.
    """

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer
        method = handler_call_details.method or ""
        behavior = _behavior_of(handler)
        checked = _checked_stream if handler.request_streaming else _checked
        return _same_kind_handler(handler, checked(behavior, method), _safe(parse))


def _safe(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except Exception as exc:  # noqa: BLE001  any parse failure is the client's malformed bytes
            # protobuf: "Error parsing message with type 'pkg.Name': <reason>"
            reason = str(exc).rpartition("': ")[2] or "cannot be parsed"
            return _Malformed(sanitize_message(reason, 120))

    return deserialize


def _malformed_message(method: str, error: str) -> str:
    return f"request: not a valid {method.rsplit('/', 1)[-1]} request message: {error}"


def _checked(behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
    """`behavior`, answering a `_Malformed` request with INVALID_ARGUMENT instead."""
    if inspect.isasyncgenfunction(behavior):

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if isinstance(request, _Malformed):
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, _malformed_message(method, request.error)
                )
            async for item in behavior(request, context):
                yield item

        return stream

    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Malformed):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, _malformed_message(method, request.error)
            )
        result = behavior(request, context)
        if inspect.isawaitable(result):
            result = await result
        return result

    return call


def _checked_stream(behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
    """`behavior` of a request-streaming method, its request stream ending the
    call with INVALID_ARGUMENT at the first `_Malformed` message."""

    async def checked(
        requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        async for request in requests:
            if isinstance(request, _Malformed):
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, _malformed_message(method, request.error)
                )
            yield request

    if inspect.isasyncgenfunction(behavior):

        async def stream(requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async for item in behavior(checked(requests, context), context):
                yield item

        return stream

    async def call(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        result = behavior(checked(requests, context), context)
        if inspect.isawaitable(result):
            result = await result
        return result

    return call


def _prepare_uds(path: str) -> None:
    """Make the socket's directory and clear a stale socket file at `path`.

    A socket file nobody listens on (left by a crashed process) is removed.
    A live socket, or a file that is not a socket, is refused: gRPC would
    otherwise unlink it and steal the address from a running server.
    """
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        os.makedirs(parent, mode=0o700, exist_ok=True)
        os.chmod(parent, 0o700)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise FailedPreconditionError(f"{path}: exists and is not a socket; not removing it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        logger.info("removing stale socket file %s", path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    except OSError as exc:
        raise FailedPreconditionError(f"{path}: cannot tell whether it is in use: {exc}") from exc
    finally:
        probe.close()
    raise FailedPreconditionError(f"{path}: another process is listening on this socket")


def _remove_uds(path: str) -> None:
    """Remove our socket file if it is still there (gRPC usually unlinks it on stop)."""
    try:
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)
    except FileNotFoundError:
        pass


REFLECTION_V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"
REFLECTION_V1ALPHA_SERVICE_NAME = reflection.SERVICE_NAME
_REFLECTION_V1_FILE = "grpc/reflection/v1/reflection.proto"
_V1ALPHA_PREFIX = ".grpc.reflection.v1alpha."
_V1_PREFIX = ".grpc.reflection.v1."


def _add_reflection_v1_descriptor() -> None:
    """Put ``grpc/reflection/v1/reflection.proto`` in the default descriptor pool.

    grpcio-reflection ships only v1alpha. v1 has the same messages with the
    same field numbers in another package, so its file is v1alpha's renamed;
    with it in the pool, reflection describes its own v1 service too.
    """
    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(_REFLECTION_V1_FILE)
        return  # added already (or shipped by a newer grpcio-reflection)
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    proto.name = _REFLECTION_V1_FILE
    proto.package = "grpc.reflection.v1"
    proto.ClearField("options")
    for message in proto.message_type:
        for field in message.field:
            if field.type_name.startswith(_V1ALPHA_PREFIX):
                field.type_name = _V1_PREFIX + field.type_name.removeprefix(_V1ALPHA_PREFIX)
    for service in proto.service:
        service.ClearField("options")
        for method in service.method:
            method.input_type = _V1_PREFIX + method.input_type.removeprefix(_V1ALPHA_PREFIX)
            method.output_type = _V1_PREFIX + method.output_type.removeprefix(_V1ALPHA_PREFIX)
    pool.AddSerializedFile(proto.SerializeToString())


def enable_reflection(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Serve server reflection as ``grpc.reflection.v1`` and ``grpc.reflection.v1alpha``.

    Clients such as grpcurl ask v1 first and fall back to v1alpha. One
    servicer (grpcio-reflection's) answers both: the two protocols' messages
    are the same on the wire, so v1 is the v1alpha handler registered under
    the v1 service name. Both reflection services are listed.
    """
    _add_reflection_v1_descriptor()
    names = list(
        dict.fromkeys([*service_names, REFLECTION_V1_SERVICE_NAME, REFLECTION_V1ALPHA_SERVICE_NAME])
    )
    servicer = reflection.aio.ReflectionServicer(names)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.method_handlers_generic_handler(
        REFLECTION_V1_SERVICE_NAME,
        {
            "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
                servicer.ServerReflectionInfo,
                request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
                response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
            )
        },
    )
    server.add_generic_rpc_handlers((v1,))


async def build_server(
    config: ServerConfig, register: Callable[[grpc.aio.Server], None]
) -> tuple[grpc.aio.Server, str, HealthServicer]:
    """Create, bind and start a server for `config`.

    `register` adds the service's servicers. Returns the started server, the
    address a client dials (``unix:///...`` or ``127.0.0.1:<port>``), and the
    health servicer (SERVING once this returns).
    """
    parsed = _parse_address(config.address)
    credentials = config.tls.server_credentials() if config.tls is not None else None
    server = grpc.aio.server(
        options=server_options(config.max_message_bytes, config.max_receive_message_bytes),
        interceptors=[InternalErrorInterceptor(), *config.interceptors],
    )
    register(server)

    # Health: NOT_SERVING until the server has started.
    health_servicer = HealthServicer()
    health_names = config.health_names
    for name in health_names:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)

    enable_reflection([*config.reflection_service_names, health.SERVICE_NAME], server)

    # Bind.
    if parsed.uds_path is not None:
        _prepare_uds(parsed.uds_path)
        bind_to = f"unix://{parsed.uds_path}"
    else:
        bind_to = config.address
    try:
        if credentials is not None:
            port = server.add_secure_port(bind_to, credentials)
        else:
            port = server.add_insecure_port(bind_to)
    except RuntimeError as exc:  # grpc's only signal that bind() failed
        raise FailedPreconditionError(f"cannot listen on {config.address!r}: {exc}") from exc
    if parsed.uds_path is not None:
        # Only our user may connect. gRPC binds in add_insecure_port, so the
        # file exists now, before any client can be accepted.
        os.chmod(parsed.uds_path, 0o600)
        bound = f"unix://{parsed.uds_path}"
    else:
        bound = f"{dial_host(parsed.host)}:{port}"

    await server.start()
    if config.serving_at_start:
        await set_health(health_servicer, health_names, serving=True)
    logger.info("%s listening on %s%s", config.service_name, bound, " (TLS)" if credentials else "")
    return server, bound, health_servicer


async def set_health(servicer: HealthServicer, names: Iterable[str], *, serving: bool) -> None:
    """Report SERVING or NOT_SERVING for `names` (see `ServerConfig.health_names`).

    Ignored once graceful shutdown has begun: a stopping server stays NOT_SERVING.
    """
    status = (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    for name in names:
        await servicer.set(name, status)


async def serve(
    config: ServerConfig,
    register: Callable[[grpc.aio.Server], None],
    *,
    on_shutdown: Callable[[], Awaitable[None]] | None = None,
    ready: Callable[[str], None] | None = None,
    on_started: Callable[[grpc.aio.Server, HealthServicer], Awaitable[None]] | None = None,
) -> None:
    """Run a server until SIGTERM or SIGINT, then shut it down gracefully.

    `on_started` is awaited once the server has started (for services that
    drive their own health with `set_health`). `ready` is called with the
    client address once the server is started and the signal handlers are in
    place. `on_shutdown` runs after in-flight RPCs are done (or the grace
    period ran out).
    """
    server, bound, health_servicer = await build_server(config, register)
    if on_started is not None:
        await on_started(server, health_servicer)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = (signal.SIGTERM, signal.SIGINT)

    def _on_signal(signum: int) -> None:
        logger.info("%s: got %s, shutting down", config.service_name, signal.Signals(signum).name)
        stop.set()

    for sig in signals:
        loop.add_signal_handler(sig, _on_signal, sig)
    uds_path = _parse_address(config.address).uds_path
    try:
        if ready is not None:
            ready(bound)
        await stop.wait()
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        try:
            # 1) Tell health checkers first so no new work is routed here.
            await health_servicer.enter_graceful_shutdown()
            # 2) Let in-flight RPCs finish within the grace period.
            await server.stop(config.grace_s)
            # 3) Release whatever the servicers were using.
            if on_shutdown is not None:
                await on_shutdown()
        finally:
            # 4) Leave no socket file behind.
            if uds_path is not None:
                _remove_uds(uds_path)
            logger.info("%s stopped", config.service_name)


def run_server(
    config: ServerConfig,
    register: Callable[[grpc.aio.Server], None],
    *,
    on_shutdown: Callable[[], Awaitable[None]] | None = None,
    ready: Callable[[str], None] | None = None,
) -> None:
    """Blocking entry point for ``python -m <service>``: `serve` in a new event loop."""
    asyncio.run(serve(config, register, on_shutdown=on_shutdown, ready=ready))


def _not_serving_error(target: str, timeout_s: float, last: str) -> UnavailableError:
    return UnavailableError(f"{target}: not SERVING after {timeout_s:g}s (last: {last})")


def _status_name(status: int) -> str:
    return health_pb2.HealthCheckResponse.ServingStatus.Name(status)


_POLL_INTERVAL_S = 0.05
_ATTEMPT_TIMEOUT_S = 1.0


def _channel_args(tls_server_name: str | None) -> list[tuple[str, str]]:
    return [("grpc.ssl_target_name_override", tls_server_name)] if tls_server_name else []


async def wait_for_health(
    target: str,
    timeout_s: float,
    service: str = "",
    *,
    credentials: grpc.ChannelCredentials | None = None,
    tls_server_name: str | None = None,
) -> None:
    """Poll `target`'s health until `service` is SERVING.

    Raises `UnavailableError` naming the target and the last answer seen if
    that does not happen within `timeout_s`. `credentials` dial a TLS server
    (`tls_server_name`: the name its certificate carries, when not the
    target's host).
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    request = health_pb2.HealthCheckRequest(service=service)
    last = "no answer"
    dial = client_target(target)
    options = _channel_args(tls_server_name)
    channel = (
        grpc.aio.secure_channel(dial, credentials, options=options)
        if credentials is not None
        else grpc.aio.insecure_channel(dial, options=options)
    )
    async with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while (remaining := deadline - loop.time()) > 0:
            try:
                response = await stub.Check(
                    request, timeout=min(remaining, _ATTEMPT_TIMEOUT_S), wait_for_ready=True
                )
            except grpc.aio.AioRpcError as exc:
                last = f"{exc.code().name}: {exc.details()}"
            else:
                if response.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = _status_name(response.status)
            await asyncio.sleep(min(_POLL_INTERVAL_S, max(deadline - loop.time(), 0)))
    raise _not_serving_error(target, timeout_s, last)


def wait_for_health_sync(
    target: str,
    timeout_s: float,
    service: str = "",
    *,
    credentials: grpc.ChannelCredentials | None = None,
    tls_server_name: str | None = None,
) -> None:
    """Blocking `wait_for_health`, for scripts and tests without an event loop."""
    deadline = time.monotonic() + timeout_s
    request = health_pb2.HealthCheckRequest(service=service)
    last = "no answer"
    dial = client_target(target)
    options = _channel_args(tls_server_name)
    sync_channel = (
        grpc.secure_channel(dial, credentials, options=options)
        if credentials is not None
        else grpc.insecure_channel(dial, options=options)
    )
    with sync_channel as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                response = stub.Check(
                    request, timeout=min(remaining, _ATTEMPT_TIMEOUT_S), wait_for_ready=True
                )
            except grpc.RpcError as exc:
                code = exc.code() if hasattr(exc, "code") else None
                details = exc.details() if hasattr(exc, "details") else str(exc)
                last = f"{getattr(code, 'name', code)}: {details}"
            else:
                if response.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = _status_name(response.status)
            time.sleep(min(_POLL_INTERVAL_S, max(deadline - time.monotonic(), 0)))
    raise _not_serving_error(target, timeout_s, last)


__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "HEALTH_METHOD_PREFIX",
    "BearerTokenInterceptor",
    "HealthServicer",
    "MalformedRequestInterceptor",
    "REFLECTION_V1ALPHA_SERVICE_NAME",
    "REFLECTION_V1_SERVICE_NAME",
    "ServerConfig",
    "TlsFiles",
    "bearer_token_matches",
    "build_server",
    "client_options",
    "client_target",
    "enable_reflection",
    "fast_reconnect_options",
    "run_server",
    "serve",
    "server_options",
    "set_health",
    "InternalErrorInterceptor",
    "wait_for_health",
    "wait_for_health_sync",
]
