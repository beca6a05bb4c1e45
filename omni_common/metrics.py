"""Prometheus metrics endpoint shared by the services.

Each service defines its own series (decoder_svc/metrics.py, ...); this only
serves them over HTTP at /metrics: the process's default registry, or the
registry given (the decoder's: its own series merged with its children's,
``omni_common.metrics_forward.MergedRegistry``).
"""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import REGISTRY, start_http_server

logger = logging.getLogger(__name__)


def start_metrics_server(port: int, host: str = "127.0.0.1", registry: Any = REGISTRY) -> int:
    """Serve `registry` (anything with ``collect()``) as /metrics on host:port
    (0 picks a free port); returns the port.

    A negative port disables the endpoint and returns -1.
    """
    if port < 0:
        return -1
    server, _thread = start_http_server(port, addr=host, registry=registry)
    bound = int(server.server_port)
    logger.info("metrics on http://%s:%d/metrics", host, bound)
    return bound
