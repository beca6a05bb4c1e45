"""The materializer's Prometheus series, fed by MaterializerCounters observers.

Works for any implementation that keeps a `counters` (MaterializerCounters)
attribute, as the shipped ones do.
"""

from __future__ import annotations

import grpc
from prometheus_client import Counter, Gauge, Histogram

from omni_serving.v1 import materializer_pb2

STEPS = Counter("omni_materializer_steps_total", "Steps answered, by outcome", ["outcome"])
BUILD_SECONDS = Histogram(
    "omni_materializer_build_seconds",
    "Time from a step's admission to its answer (readiness wait + build)",
    buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0, 5.0),
)
ERRORS = Counter("omni_materializer_errors_total", "Steps failed, by gRPC status code", ["code"])
ACTIVE_STREAMS = Gauge("omni_materializer_active_streams", "Open Materialize streams")
DRAINING = Gauge(
    "omni_materializer_draining", "1 while the process drains (stopping; its streams are told)"
)

_CODE_NAMES = {c.value[0]: c.name for c in grpc.StatusCode}


def observe(resp: materializer_pb2.MaterializeResponse, seconds: float) -> None:
    if resp.WhichOneof("kind") == "step":
        STEPS.labels("ok").inc()
    else:
        STEPS.labels("error").inc()
        ERRORS.labels(_CODE_NAMES.get(resp.error.code, str(resp.error.code))).inc()
    BUILD_SECONDS.observe(seconds)


def attach(servicer: object) -> None:
    """Export a servicer's counters (no-op for one without `counters`)."""
    counters = getattr(servicer, "counters", None)
    if counters is None:
        return
    counters.observers.append(observe)
    ACTIVE_STREAMS.set_function(lambda: counters.active_streams)
    DRAINING.set_function(lambda: 1 if getattr(servicer, "draining", False) else 0)
