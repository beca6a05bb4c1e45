"""Prometheus metrics of the gateway (served at ``GET /metrics`` by the HTTP facade).

Module-level collectors in the default registry: created once per process,
shared by every servicer, processor and facade in it.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

SKIPPED_TENSORS = Counter(
    "omni_gateway_skipped_tensors",
    "Step tensors dropped because they did not fit their key's earlier pieces",
    ["key"],
)
FAILED_CONSOLIDATIONS = Counter(
    "omni_gateway_failed_consolidations",
    "Requests failed because their multimodal pieces could not be merged",
)
REQUESTS = Counter(
    "omni_gateway_requests",
    "Finished client requests by API and status code",
    ["api", "code"],
)
ACTIVE_STREAMS = Gauge("omni_gateway_active_streams", "Client streams in progress")
TTFP_SECONDS = Histogram(
    "omni_gateway_ttfp_seconds",
    "Time from request arrival at the gateway to its first audio packet",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
RTF = Histogram(
    "omni_gateway_rtf",
    "Real-time factor of finished speech requests (wall time / audio duration)",
    buckets=(0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0),
)

__all__ = [
    "ACTIVE_STREAMS",
    "FAILED_CONSOLIDATIONS",
    "REQUESTS",
    "RTF",
    "SKIPPED_TENSORS",
    "TTFP_SECONDS",
]
