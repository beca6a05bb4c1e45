"""Structured (key=value) logs with the service name, shared by all services.

`setup_logging` is the first call of every service's `main()`, so it also
arms the service's parent-death signal when `omni-serving up` started it
(omni_common.lifeline): one place, early, for all three services.
"""

from __future__ import annotations

import logging
import sys

from omni_common.lifeline import die_with_launcher


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
    """Log lines like `ts=... level=INFO service=decoder logger=... request_id=- msg="..."`.

    First, a service started by `omni-serving up` starts following it: it gets
    SIGTERM when the launcher dies (omni_common.lifeline.die_with_launcher).
    """
    die_with_launcher()
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
