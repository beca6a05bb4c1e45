"""Structured (key=value) logs with the service name, shared by all services."""

from __future__ import annotations

import logging
import sys


class _ServiceFilter(logging.Filter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def filter(self, record: logging.LogRecord) -> bool:
        record.service = self.service
        if not hasattr(record, "request_id"):
            record.request_id = "-"
        return True


def setup_logging(level: str = "INFO", *, service: str) -> None:
    """Log lines like `ts=... level=INFO service=decoder logger=... request_id=- msg="..."`."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_ServiceFilter(service))
    handler.setFormatter(
        logging.Formatter(
            'ts=%(asctime)s level=%(levelname)s service=%(service)s logger=%(name)s '
            'request_id=%(request_id)s msg="%(message)s"'
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
