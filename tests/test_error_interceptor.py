"""No exception leaves a servicer as UNKNOWN (omni_common.server.InternalErrorInterceptor).

A real grpc.aio server made by `build_server` (as every service's is),
serving a test service whose methods (``test.Boom/*``, raw bytes, a test
double of a servicer) raise on purpose: unary, server-streaming (an async
generator, and a coroutine that writes), client-streaming and bidi. A plain
exception must reach the client as INTERNAL with an error id and none of
its text (the log has the id with the traceback), also after some messages
were streamed; an `OmniError` keeps its code and message; a status set with
``context.set_code`` before raising is kept; an abort passes through; a
method that returns normally is untouched; health still answers. A client
that stops reading a stream and cancels it, while the server's write waits
(an async generator, and a coroutine that writes), ends the call as a
cancellation: the servicer's stream is closed, and nothing is logged as an
error (grpc's core fails the waiting write; that is not a bug).
"""

from __future__ import annotations

import logging
import re
import threading
import time

import grpc
import pytest

from omni_common.errors import InvalidArgumentError, NotFoundError, UnavailableError
from omni_common.server import ServerConfig, build_server
from tests.fakes.fake_decoder import BackgroundLoop

ERROR_ID = re.compile(r"^internal error \(error id ([0-9a-f]{12})\); the server log has the details$")
SECRET = "/srv/omni/secret.py: bad shape (3, 4)"


async def unary(request: bytes, context) -> bytes:
    what = request.decode()
    if what == "ok":
        return b"fine"
    if what == "bug":
        raise ValueError(SECRET)
    if what == "invalid":
        raise InvalidArgumentError("voice", "no such voice 'x'")
    if what == "missing":
        raise NotFoundError("request 'r1' is not running")
    if what == "set_code":
        context.set_code(grpc.StatusCode.RESOURCE_EXHAUSTED)
        context.set_details("too many")
        raise RuntimeError(SECRET)
    if what == "abort":
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, "not yours")
    raise AssertionError(f"unknown case {what!r}")


async def stream(request: bytes, context):
    yield b"one"
    yield b"two"
    if request == b"unavailable":
        raise UnavailableError("the decoder went away")
    raise KeyError(SECRET)


async def writes(request: bytes, context) -> None:
    await context.write(b"one")
    raise TypeError(SECRET)


FLOOD_CHUNK = b"x" * (1 << 20)
flood_closed: dict[str, threading.Event] = {}


async def flood(request: bytes, context):
    """Writes until the call ends (1 MiB messages: the transport's windows fill at once)."""
    try:
        while True:
            yield FLOOD_CHUNK
    finally:
        flood_closed[request.decode()].set()


async def flood_writes(request: bytes, context) -> None:
    try:
        while True:
            await context.write(FLOOD_CHUNK)
    finally:
        flood_closed[request.decode()].set()


async def client_stream(requests, context) -> bytes:
    async for _ in requests:
        pass
    raise RuntimeError(SECRET)


async def bidi(requests, context):
    async for r in requests:
        yield r
    raise ZeroDivisionError(SECRET)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    loop = BackgroundLoop("error-interceptor-test")
    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "Stream": grpc.unary_stream_rpc_method_handler(stream),
        "Writes": grpc.unary_stream_rpc_method_handler(writes),
        "Flood": grpc.unary_stream_rpc_method_handler(flood),
        "FloodWrites": grpc.unary_stream_rpc_method_handler(flood_writes),
        "ClientStream": grpc.stream_unary_rpc_method_handler(client_stream),
        "Bidi": grpc.stream_stream_rpc_method_handler(bidi),
    }

    def register(server: grpc.aio.Server) -> None:
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Boom", handlers),))

    sock = tmp_path_factory.mktemp("boom") / "b.sock"
    server, address, _ = loop.run(build_server(ServerConfig(address=f"unix://{sock}", service_name="test.Boom"),
                                               register))
    try:
        yield address
    finally:
        loop.run(server.stop(0))
        loop.close()


def check_internal(err: grpc.RpcError, caplog: pytest.LogCaptureFixture) -> None:
    assert err.code() == grpc.StatusCode.INTERNAL, f"{err.code()}: {err.details()}"
    match = ERROR_ID.match(err.details())
    assert match, f"not the internal message with an error id: {err.details()!r}"
    logged = [r for r in caplog.records if match.group(1) in r.getMessage()]
    assert len(logged) == 1, f"error id {match.group(1)} in {len(logged)} log records"
    assert logged[0].exc_info is not None and SECRET in str(logged[0].exc_info[1]), logged[0].exc_info
    assert "test.Boom" in logged[0].getMessage(), f"the log does not name the method: {logged[0].getMessage()}"


def call(target: str, method: str, request: bytes):
    with grpc.insecure_channel(target) as ch:
        return ch.unary_unary(f"/test.Boom/{method}")(request, timeout=10)


def test_a_plain_exception_from_a_unary_method_is_internal_with_an_id(target, caplog):
    caplog.set_level(logging.ERROR, logger="omni_common.server")
    assert call(target, "Unary", b"ok") == b"fine", "a method that returns was changed"
    with pytest.raises(grpc.RpcError) as err:
        call(target, "Unary", b"bug")
    check_internal(err.value, caplog)


@pytest.mark.parametrize(("case", "code", "text"), [
    ("invalid", grpc.StatusCode.INVALID_ARGUMENT, "voice"),
    ("missing", grpc.StatusCode.NOT_FOUND, "is not running"),
    ("set_code", grpc.StatusCode.RESOURCE_EXHAUSTED, "too many"),
    ("abort", grpc.StatusCode.PERMISSION_DENIED, "not yours"),
])
def test_our_errors_set_statuses_and_aborts_keep_their_codes(target, case, code, text):
    with pytest.raises(grpc.RpcError) as err:
        call(target, "Unary", case.encode())
    assert err.value.code() == code and text in err.value.details(), (
        f"{case}: {err.value.code()} {err.value.details()!r}, want {code}"
    )
    assert SECRET not in err.value.details(), err.value.details()


@pytest.mark.parametrize("method", ["Stream", "Writes"])
def test_a_plain_exception_after_streamed_messages_is_internal_with_an_id(target, caplog, method):
    caplog.set_level(logging.ERROR, logger="omni_common.server")
    got = []
    with grpc.insecure_channel(target) as ch, pytest.raises(grpc.RpcError) as err:
        for m in ch.unary_stream(f"/test.Boom/{method}")(b"bug", timeout=10):
            got.append(m)
    assert got and got[0] == b"one", f"{method}: the messages before the error: {got}"
    check_internal(err.value, caplog)


def test_an_omni_error_in_a_stream_keeps_its_code(target):
    with grpc.insecure_channel(target) as ch, pytest.raises(grpc.RpcError) as err:
        list(ch.unary_stream("/test.Boom/Stream")(b"unavailable", timeout=10))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, f"{err.value.code()}: {err.value.details()}"
    assert "the decoder went away" in err.value.details(), err.value.details()


def test_client_streaming_and_bidi_bugs_are_internal_with_an_id(target, caplog):
    caplog.set_level(logging.ERROR, logger="omni_common.server")
    with grpc.insecure_channel(target) as ch:
        with pytest.raises(grpc.RpcError) as err:
            ch.stream_unary("/test.Boom/ClientStream")(iter([b"a", b"b"]), timeout=10)
        check_internal(err.value, caplog)
        with pytest.raises(grpc.RpcError) as err:
            list(ch.stream_stream("/test.Boom/Bidi")(iter([b"a", b"b"]), timeout=10))
        check_internal(err.value, caplog)


def test_health_still_answers(target):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING, resp


@pytest.mark.parametrize("method", ["Flood", "FloodWrites"])
def test_a_client_that_cancels_while_a_write_waits_is_a_cancellation(target, caplog, method):
    caplog.set_level(logging.DEBUG)
    flood_closed[method] = closed = threading.Event()
    with grpc.insecure_channel(target) as ch:
        call = ch.unary_stream(f"/test.Boom/{method}")(method.encode(), timeout=30)
        assert next(call) == FLOOD_CHUNK
        time.sleep(0.5)  # not read further: the server's writes wait on the transport
        assert not closed.is_set(), "the stream ended before the client cancelled"
        call.cancel()
        assert closed.wait(5), "the servicer's stream was not closed"
        assert call.code() == grpc.StatusCode.CANCELLED
    time.sleep(0.2)  # what the server logs after the stream closed
    # the server's loggers: ours (a bug's error id) and grpc's of this call (an error raised in core)
    errors = [
        r
        for r in caplog.records
        if r.levelno >= logging.WARNING
        and (r.name.startswith("omni_common") or (r.name.startswith("grpc") and method in r.getMessage()))
    ]
    assert not errors, [f"{r.name}: {r.getMessage()}" for r in errors]
