"""Prometheus metrics endpoint shared by the services.

Each service defines its own series (decoder_svc/metrics.py, ...); this only
serves the process's default registry over HTTP at /metrics.
"""

from __future__ import annotations

import logging

from prometheus_client import start_http_server

logger = logging.getLogger(__name__)


def start_metrics_server(port: int, host: str = "127.0.0.1") -> int:
    """Serve /metrics on host:port (0 picks a free port); returns the port.

    A negative port disables the endpoint and returns -1.
    """
    if port < 0:
        return -1
    server, _thread = start_http_server(port, addr=host)
    bound = int(server.server_port)
    logger.info("metrics on http://%s:%d/metrics", host, bound)
    return bound
