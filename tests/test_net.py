"""omni_common.net: what a host means, checked against real servers.

The `localhost` rule is the one worth a real server each: gRPC servers bind
every address the name resolves to, so a gRPC client dials 127.0.0.1;
prometheus_client's /metrics server binds only the first, which is ::1 on
hosts whose /etc/hosts lists it first, so a metrics URL keeps the name.
The second is shown on this host by resolving `localhost` the Debian way
(::1 first) for the duration of the test.
"""

from __future__ import annotations

import asyncio
import socket
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import start_http_server

from omni_common.net import (
    LOCAL_DIAL_HOSTS,
    MAX_UDS_PATH_BYTES,
    WILDCARD_HOSTS,
    dial_host,
    free_port,
    port_free,
    uds_path_bytes,
    url_host,
)
from omni_common.server import ServerConfig, build_server, client_target
from omni_stack.commands import metrics_url


@pytest.mark.parametrize("host", sorted(WILDCARD_HOSTS))
def test_wildcard_hosts_are_dialed_and_fetched_on_loopback(host):
    assert dial_host(host) == "127.0.0.1", f"dial_host({host!r}) = {dial_host(host)!r}"
    assert url_host(host) == "127.0.0.1", f"url_host({host!r}) = {url_host(host)!r}"


@pytest.mark.parametrize(
    ("host", "dial", "url"),
    [
        ("localhost", "127.0.0.1", "localhost"),
        ("127.0.0.1", "127.0.0.1", "127.0.0.1"),
        ("10.1.2.3", "10.1.2.3", "10.1.2.3"),
        ("decoder.internal", "decoder.internal", "decoder.internal"),
        ("::1", "::1", "[::1]"),
        ("[::1]", "[::1]", "[::1]"),
    ],
)
def test_named_and_numeric_hosts(host, dial, url):
    assert (dial_host(host), url_host(host)) == (dial, url), (
        f"{host!r}: got dial {dial_host(host)!r}, url {url_host(host)!r}; want {dial!r}, {url!r}"
    )


def test_local_dial_hosts_are_the_wildcards_and_localhost():
    assert LOCAL_DIAL_HOSTS == WILDCARD_HOSTS | {"localhost"}, sorted(LOCAL_DIAL_HOSTS)
    assert "localhost" not in WILDCARD_HOSTS, "localhost is one interface, not every one"


@pytest.mark.parametrize("host", ["127.0.0.1", "*", "", "::1", "[::1]"])
def test_free_port_is_free_until_bound(host):
    port = free_port(host)
    assert 0 < port <= 65535, f"free_port({host!r}) = {port}"
    assert port_free(host, port), f"port {port} on {host!r} should be free"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as taken:
        taken.bind(("" if host == "*" else host.strip("[]"), port))
        taken.listen()
        assert not port_free(host, port), f"port {port} on {host!r} is bound, yet reported free"


def test_free_port_is_outside_the_ephemeral_range(monkeypatch):
    """Outgoing connections take local ports from the kernel's ephemeral range: a
    port picked there could be taken before its server binds it."""
    from omni_common import net

    lo, hi = net.ephemeral_range()
    assert 0 < lo <= hi <= 65535
    ports = {free_port() for _ in range(20)}
    if lo - 10000 >= 1024:
        assert all(10000 <= p < lo for p in ports), (sorted(ports), lo)
    monkeypatch.setattr(net, "_EPHEMERAL_RANGE_FILE", "/nonexistent")
    assert net.ephemeral_range() == (32768, 60999)
    monkeypatch.setattr(net, "ephemeral_range", lambda: (1024, 65535))  # no room below: the OS picks
    assert port_free("127.0.0.1", free_port())


def test_uds_path_length_is_counted_in_bytes():
    assert uds_path_bytes("/tmp/é.sock") == len("/tmp/é.sock") + 1, "é is two bytes in UTF-8"
    assert MAX_UDS_PATH_BYTES == 107, "sun_path is 108 bytes with its NUL"


def test_grpc_server_on_localhost_is_dialed_at_loopback():
    async def main() -> None:
        server, bound, _ = await build_server(
            ServerConfig(address="localhost:0", service_name="omni_serving.test.Net", grace_s=0),
            lambda s: None,
        )
        try:
            port = int(bound.rpartition(":")[2])
            assert bound == f"127.0.0.1:{port}", f"build_server returned {bound!r}"
            target = client_target(f"localhost:{port}")
            assert target == bound, f"client_target gives {target!r}, the server says {bound!r}"
            async with grpc.aio.insecure_channel(target) as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=10
                )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, reply
        finally:
            await server.stop(0)

    asyncio.run(main())


@pytest.fixture
def localhost_is_ipv6_first(monkeypatch):
    """`localhost` resolves to ::1, then 127.0.0.1 (Debian's /etc/hosts order)."""
    real = socket.getaddrinfo

    def getaddrinfo(host, port, family=0, type=0, proto=0, flags=0):
        if host != "localhost":
            return real(host, port, family, type, proto, flags)
        port = int(port or 0)
        kind = type or socket.SOCK_STREAM
        both = [
            (socket.AF_INET6, kind, 6, "", ("::1", port, 0, 0)),
            (socket.AF_INET, kind, 6, "", ("127.0.0.1", port)),
        ]
        return [a for a in both if family in (0, socket.AF_UNSPEC, a[0])]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


def _fetch(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return reply.read()


def test_metrics_url_keeps_localhost_where_the_server_binds_ipv6_only(localhost_is_ipv6_first):
    server, thread = start_http_server(0, addr="localhost")
    try:
        port = int(server.server_port)
        assert server.address_family == socket.AF_INET6, "prometheus bound the first address"
        url = metrics_url("localhost", port)
        assert url == f"http://localhost:{port}/metrics", url
        assert b"python_info" in _fetch(url), f"{url} did not serve metrics"
        # dial_host's answer, right for a gRPC server, is refused by this one.
        with pytest.raises(urllib.error.URLError):
            _fetch(f"http://{dial_host('localhost')}:{port}/metrics")
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
