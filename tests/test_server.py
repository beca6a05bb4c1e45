"""Server bootstrap against real grpc.aio servers on a UDS and on TCP."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from omni_common.errors import FailedPreconditionError, InvalidArgumentError, UnavailableError
from omni_common.server import (
    MalformedRequestInterceptor,
    ServerConfig,
    build_server,
    client_target,
    set_health,
    wait_for_health,
    wait_for_health_sync,
)
from omni_serving.v1 import decoder_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parent.parent
DECODER = "omni_serving.v1.DecoderService"
HEALTH = "grpc.health.v1.Health"
REFLECTION = "grpc.reflection.v1alpha.ServerReflection"


def register_decoder(server: grpc.aio.Server) -> None:
    # The generated base servicer answers UNIMPLEMENTED; enough to be listed.
    decoder_pb2_grpc.add_DecoderServiceServicer_to_server(
        decoder_pb2_grpc.DecoderServiceServicer(), server
    )


def decoder_config(address: str) -> ServerConfig:
    return ServerConfig(
        address=address,
        service_name=DECODER,
        grace_s=0.5,
        reflection_service_names=[DECODER],
    )


async def health_status(target: str, service: str) -> int:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        response = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        return response.status


async def reflected_services(target: str) -> set[str]:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        call = stub.ServerReflectionInfo(iter([request]), timeout=5)
        names: set[str] = set()
        async for response in call:
            names.update(s.name for s in response.list_services_response.service)
        return names


async def check_serving_and_reflection(bound: str) -> None:
    await wait_for_health(bound, timeout_s=5)
    await wait_for_health(bound, timeout_s=5, service=DECODER)
    for service in ("", DECODER):
        got = await health_status(bound, service)
        want = health_pb2.HealthCheckResponse.SERVING
        assert got == want, f"{service=}: {got=}, {want=}"
    got_names = await reflected_services(bound)
    want_names = {DECODER, HEALTH, REFLECTION, "grpc.reflection.v1.ServerReflection"}
    assert got_names == want_names, f"{got_names=}, {want_names=}"


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_uds_server(tmp_path: Path) -> None:
    sock = tmp_path / "run" / "svc.sock"  # parent does not exist yet

    async def main() -> None:
        server, bound, _health = await build_server(
            decoder_config(f"unix://{sock}"), register_decoder
        )
        try:
            assert bound == f"unix://{sock}", f"{bound=}"
            assert stat.S_ISSOCK(os.lstat(sock).st_mode)
            got = mode_of(sock)
            assert got == 0o600, f"socket mode: got={oct(got)}, want=0o600"
            got = mode_of(sock.parent)
            assert got == 0o700, f"created parent mode: got={oct(got)}, want=0o700"
            await check_serving_and_reflection(bound)
        finally:
            await server.stop(None)

    asyncio.run(main())


def test_tcp_server_on_port_zero_and_port_clash() -> None:
    async def main() -> None:
        server, bound, _health = await build_server(decoder_config("127.0.0.1:0"), register_decoder)
        try:
            host, _, port = bound.rpartition(":")
            assert host == "127.0.0.1" and int(port) > 0, f"{bound=}"
            await check_serving_and_reflection(bound)
            # SO_REUSEPORT is off: a second server on the same port must fail loudly.
            with pytest.raises(FailedPreconditionError, match=port):
                await build_server(decoder_config(f"127.0.0.1:{port}"), register_decoder)
        finally:
            await server.stop(None)

    asyncio.run(main())


def test_wildcard_host_dials_loopback() -> None:
    async def main() -> None:
        server, bound, _health = await build_server(decoder_config("0.0.0.0:0"), register_decoder)
        try:
            assert bound.startswith("127.0.0.1:"), f"{bound=}"
            await wait_for_health(bound, timeout_s=5)
        finally:
            await server.stop(None)

    asyncio.run(main())


def test_relative_uds_address(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)

    async def main() -> None:
        server, bound, _health = await build_server(
            decoder_config("unix:rel.sock"), register_decoder
        )
        try:
            want = f"unix://{tmp_path / 'rel.sock'}"
            assert bound == want, f"{bound=}, {want=}"
            await wait_for_health(bound, timeout_s=5)
        finally:
            await server.stop(None)

    asyncio.run(main())


def test_stale_socket_file_is_replaced(tmp_path: Path) -> None:
    sock = tmp_path / "svc.sock"
    # A socket bound and closed without unlinking: what a crashed server leaves.
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(sock))
    stale.close()
    assert stat.S_ISSOCK(os.lstat(sock).st_mode)

    async def main() -> None:
        server, bound, _health = await build_server(
            decoder_config(f"unix://{sock}"), register_decoder
        )
        try:
            got = mode_of(sock)
            assert got == 0o600, f"got={oct(got)}, want=0o600"
            await wait_for_health(bound, timeout_s=5)
        finally:
            await server.stop(None)

    asyncio.run(main())


def test_live_socket_is_not_taken_over(tmp_path: Path) -> None:
    sock = tmp_path / "svc.sock"
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(str(sock))
    live.listen(1)
    try:
        with pytest.raises(FailedPreconditionError, match="listening"):
            asyncio.run(build_server(decoder_config(f"unix://{sock}"), register_decoder))
        assert stat.S_ISSOCK(os.lstat(sock).st_mode), "the live socket file must stay"
    finally:
        live.close()


def test_regular_file_at_socket_path_is_not_removed(tmp_path: Path) -> None:
    path = tmp_path / "svc.sock"
    path.write_text("precious")
    with pytest.raises(FailedPreconditionError, match="not a socket"):
        asyncio.run(build_server(decoder_config(f"unix://{path}"), register_decoder))
    assert path.read_text() == "precious"


@pytest.mark.parametrize(
    ("address", "want"),
    [
        ("unix:///tmp/a.sock", "unix:///tmp/a.sock"),
        ("unix:/tmp/a.sock", "unix:///tmp/a.sock"),
        ("127.0.0.1:5000", "127.0.0.1:5000"),
        ("0.0.0.0:5000", "127.0.0.1:5000"),
        ("[::]:5000", "127.0.0.1:5000"),
        ("localhost:5000", "127.0.0.1:5000"),
        ("decoder-0.internal:5000", "decoder-0.internal:5000"),
        ("dns:///decoder:5000", "dns:///decoder:5000"),
    ],
)
def test_client_target(address: str, want: str) -> None:
    got = client_target(address)
    assert got == want, f"{address=}: {got=}, {want=}"


def test_client_target_relative_uds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    got = client_target("unix:x.sock")
    want = f"unix://{tmp_path / 'x.sock'}"
    assert got == want, f"{got=}, {want=}"


@pytest.mark.parametrize(
    "address",
    ["", "nohost", "host:port", "host:99999", "unix://relative.sock", "unix:", "unix:///tmp/"]
    + ["unix:///" + "x" * 200],
)
def test_bad_address_is_refused(address: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        ServerConfig(address=address, service_name="s")
    assert info.value.field == "address", f"{info.value.field=}"


def test_client_target_refuses_port_zero() -> None:
    with pytest.raises(InvalidArgumentError, match="port 0"):
        client_target("127.0.0.1:0")


def test_wait_for_health_names_the_target_on_timeout(tmp_path: Path) -> None:
    target = f"unix://{tmp_path / 'nobody.sock'}"
    with pytest.raises(UnavailableError, match="nobody.sock"):
        asyncio.run(wait_for_health(target, timeout_s=0.5))
    with pytest.raises(UnavailableError, match="nobody.sock"):
        wait_for_health_sync(target, timeout_s=0.5)


def test_wait_for_health_unknown_service_times_out(tmp_path: Path) -> None:
    async def main() -> None:
        server, bound, _health = await build_server(
            decoder_config(f"unix://{tmp_path / 's.sock'}"), register_decoder
        )
        try:
            with pytest.raises(UnavailableError, match="NOT_FOUND"):
                await wait_for_health(bound, timeout_s=0.5, service="no.such.Service")
        finally:
            await server.stop(None)

    asyncio.run(main())


SERVER_SCRIPT = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    from omni_common.server import ServerConfig, run_server

    address, marker = sys.argv[1], Path(sys.argv[2])


    async def release() -> None:
        marker.write_text("released")


    run_server(
        ServerConfig(address=address, service_name="omni_serving.v1.Test", grace_s=1.0),
        lambda server: None,
        on_shutdown=release,
        ready=lambda bound: print(bound, flush=True),
    )
    """
)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_graceful_shutdown_in_subprocess(tmp_path: Path, signum: signal.Signals) -> None:
    script = tmp_path / "serve.py"
    script.write_text(SERVER_SCRIPT)
    sock = tmp_path / "svc.sock"
    marker = tmp_path / "released"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), *sys.path])}
    proc = subprocess.Popen(
        [sys.executable, str(script), f"unix://{sock}", str(marker)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        try:
            wait_for_health_sync(f"unix://{sock}", timeout_s=30, service="omni_serving.v1.Test")
        except UnavailableError:
            proc.kill()
            out, err = proc.communicate(timeout=10)
            pytest.fail(f"server never became healthy; rc={proc.returncode}\n{out}\n{err}")
        assert mode_of(sock) == 0o600, f"got={oct(mode_of(sock))}"
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=15)
        assert proc.returncode == 0, f"rc={proc.returncode}\n{out}\n{err}"
        assert out.strip() == f"unix://{sock}", f"ready printed {out!r}"
        assert marker.read_text() == "released", "on_shutdown did not run"
        deadline = time.monotonic() + 3
        while sock.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not sock.exists(), "socket file left behind"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)


def test_health_driven_by_the_service_and_malformed_requests(tmp_path: Path) -> None:
    """serving_at_start=False leaves NOT_SERVING until set_health; bad bytes get INVALID_ARGUMENT."""
    sock = tmp_path / "svc.sock"
    config = dataclasses.replace(
        decoder_config(f"unix://{sock}"),
        serving_at_start=False,
        interceptors=[MalformedRequestInterceptor()],
        max_receive_message_bytes=4096,
    )

    async def main() -> None:
        server, bound, health = await build_server(config, register_decoder)
        try:
            not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
            assert await health_status(bound, "") == not_serving
            assert await health_status(bound, DECODER) == not_serving
            await set_health(health, config.health_names, serving=True)
            await check_serving_and_reflection(bound)
            async with grpc.aio.insecure_channel(bound) as channel:
                check = channel.unary_unary(f"/{HEALTH}/Check")  # raw bytes in and out
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await check(b"\x0a\x05\xff\xff\xff\xff\xff", timeout=5)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert info.value.details() == (
                    "request: not a valid Check request message: String field had bad UTF-8"
                )
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await check(b"\x0a" + b"\x80" * 5000, timeout=5)  # over the receive limit
                assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                # A request stream: the good message is answered, the malformed one ends the call.
                info_call = channel.stream_stream(f"/{REFLECTION}/ServerReflectionInfo")
                good = reflection_pb2.ServerReflectionRequest(list_services="").SerializeToString()
                call = info_call(iter([good, b"\x0a\x05\xff\xff\xff\xff\xff"]), timeout=5)
                answers = []
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    async for answer in call:
                        answers.append(answer)
                assert len(answers) == 1, answers
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert info.value.details() == (
                    "request: not a valid ServerReflectionInfo request message: "
                    "String field had bad UTF-8"
                ), info.value.details()
            await health.enter_graceful_shutdown()
            await set_health(health, config.health_names, serving=True)  # ignored now
            assert await health_status(bound, "") == not_serving
        finally:
            await server.stop(None)

    asyncio.run(main())
