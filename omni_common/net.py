"""Host and address helpers: the one place that knows what a host name means here.

Used by the services' gRPC bootstrap (omni_common.server) and the launcher
(omni_stack); every caller that turns a bind address into something to dial,
picks a free port or checks a Unix socket path goes through this module.

- A **wildcard** host (`WILDCARD_HOSTS`: "", "*", "0.0.0.0", "::", "[::]")
  means every interface; a client on this host reaches such a server on
  loopback, 127.0.0.1.
- **localhost** depends on who listens. gRPC servers and aiohttp bind every
  address the name resolves to (127.0.0.1 and ::1), so a gRPC client dials
  127.0.0.1 (`dial_host`): one fixed target, no name lookup, no IPv6 attempt
  first. prometheus_client's `/metrics` server binds only the *first*
  address the name resolves to, which is ::1 on hosts whose /etc/hosts lists
  it first; so a URL keeps the name (`url_host`) and the HTTP client tries
  each address, as the server's lookup did.
- A Unix socket path holds at most `MAX_UDS_PATH_BYTES` bytes (sun_path is
  108 bytes including the terminating NUL).
"""

from __future__ import annotations

import os
import random
import socket

WILDCARD_HOSTS = frozenset({"", "*", "0.0.0.0", "::", "[::]"})
"""Bind hosts that mean every interface."""

LOOPBACK = "127.0.0.1"
"""Where a client on this host dials a server bound to a wildcard host."""

LOCAL_DIAL_HOSTS = WILDCARD_HOSTS | {"localhost"}
"""Hosts a gRPC (or plain socket) client on this machine dials at `LOOPBACK`."""

# sun_path holds 108 bytes including the terminating NUL.
MAX_UDS_PATH_BYTES = 107


def dial_host(host: str) -> str:
    """Where a gRPC or socket client on this host reaches a server bound to `host`:
    127.0.0.1 for a wildcard host or localhost, else `host` unchanged."""
    return LOOPBACK if host in LOCAL_DIAL_HOSTS else host


def url_host(host: str) -> str:
    """The host part of an http:// URL for a server bound to `host`: 127.0.0.1
    for a wildcard host, localhost kept as a name (see the module docstring),
    an IPv6 address in brackets."""
    if host in WILDCARD_HOSTS:
        return LOOPBACK
    if ":" in host and not host.startswith("["):
        return f"[{host}]"
    return host


def _bind_host(host: str) -> str:
    """`host` as socket.bind takes it: no brackets; "*" is the IPv4 wildcard."""
    return "" if host == "*" else host.strip("[]")


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


# Where free_port looks first: below the kernel's ephemeral range.
_PICK_FROM = 10000
_EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range of local ports for outgoing connections (Linux's default where it cannot be read)."""
    try:
        with open(_EPHEMERAL_RANGE_FILE) as f:
            lo, hi = (int(x) for x in f.read().split()[:2])
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port free on `host` right now (for `--port 0`), for a server that
    binds it later. It is picked below the kernel's ephemeral range when
    there is room (a random free one of [10000, start of that range)): a
    port the OS hands out for port 0 comes from the ephemeral range, where
    any outgoing connection of any process may take it as its local port
    before the server binds it (a service started a minute later found its
    port so taken). Else the OS picks."""
    lo, _ = ephemeral_range()
    rng = random.SystemRandom()
    for _ in range(64 if lo - _PICK_FROM >= 1024 else 0):
        port = rng.randrange(_PICK_FROM, lo)
        if port_free(host, port):
            return port
    with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
        sock.bind((_bind_host(host), 0))
        return int(sock.getsockname()[1])


def port_free(host: str, port: int) -> bool:
    """Whether a server could bind TCP `port` on `host` now (SO_REUSEADDR, as servers do)."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((_bind_host(host), port))
        except OSError:
            return False
    return True


def uds_path_bytes(path: str | os.PathLike[str]) -> int:
    """The length of a Unix socket path as the kernel counts it (compare with
    MAX_UDS_PATH_BYTES)."""
    return len(os.fsencode(path))


__all__ = [
    "LOCAL_DIAL_HOSTS",
    "LOOPBACK",
    "MAX_UDS_PATH_BYTES",
    "WILDCARD_HOSTS",
    "dial_host",
    "free_port",
    "port_free",
    "uds_path_bytes",
    "url_host",
]
