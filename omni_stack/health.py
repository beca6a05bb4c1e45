"""Is a service ready? The launcher's one readiness check, used at start, restart and handover.

- A service is ready when its `grpc.health.v1` answer is SERVING
  (omni_common.server.wait_for_health_sync, over a channel of its own).
- A gateway serving TLS is ready once a TLS handshake with it succeeds
  (`tls_answers`): its certificate need not name this host, and its health
  service may want the token.

Invariant: a check never outlasts its timeout by more than a connection
attempt, and reports the last problem it saw instead of raising.
"""

from __future__ import annotations

import socket
import ssl

from omni_common.errors import UnavailableError
from omni_common.net import dial_host
from omni_common.server import wait_for_health_sync
from omni_stack.commands import ServiceProcess
from omni_stack.config import StackConfig


def check_health(cfg: StackConfig, svc: ServiceProcess, timeout_s: float) -> str | None:
    """None when `svc` answers as ready within timeout_s, else the last problem seen."""
    if svc.role == "gateway" and cfg.tls_cert:
        return tls_answers(dial_host(cfg.host), cfg.port, timeout_s)
    try:
        wait_for_health_sync(svc.target, timeout_s)
    except UnavailableError as exc:
        return str(exc)
    return None


def tls_answers(host: str, port: int, timeout_s: float) -> str | None:
    """None when a TLS handshake with host:port succeeds, else what went wrong."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])
    try:
        with (
            socket.create_connection((host.strip("[]"), port), timeout_s) as raw,
            ctx.wrap_socket(raw, server_hostname=host.strip("[]")),
        ):
            return None
    except (OSError, ssl.SSLError) as exc:
        return f"no TLS handshake: {exc}"
