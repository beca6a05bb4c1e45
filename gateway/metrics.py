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
HTTP_REQUESTS = Counter(
    "omni_gateway_http_requests",
    "HTTP requests by route template (api, e.g. /v1/chat/completions) and status "
    "(499: the client went away first)",
    ["api", "status"],
)
HTTP_REQUEST_SECONDS = Histogram(
    "omni_gateway_http_request_seconds",
    "Time from an HTTP request's arrival to the end of its response (streams included)",
    ["api"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
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


# Per decoder replica (gateway.replicas). The label is the replica's address
# as the operator configured it or DNS returned it (`replicas.replica_label`);
# a replica's series are removed when it leaves the pool.
DECODER_UP = Gauge(
    "omni_gateway_decoder_up",
    "1 while the decoder replica passes its health checks, else 0",
    ["decoder"],
)
DECODER_REQUESTS = Counter(
    "omni_gateway_decoder_requests",
    "Decoder streams this gateway started on the replica (a retried start counts on both)",
    ["decoder"],
)
DECODER_IN_FLIGHT = Gauge(
    "omni_gateway_decoder_in_flight",
    "Decoder streams this gateway has open on the replica",
    ["decoder"],
)
DECODER_RETRIES = Counter(
    "omni_gateway_decoder_retries",
    "Requests that failed to start on the replica (UNAVAILABLE) and were retried on another",
    ["decoder"],
)
DECODER_ACTIVE_REQUESTS = Gauge(
    "omni_gateway_decoder_active_requests",
    "Requests running on the replica, all gateways together (polled GetDecoderInfo)",
    ["decoder"],
)
DECODER_FALLBACK_STEPS = Gauge(
    "omni_gateway_decoder_fallback_steps",
    "Steps the replica built in-process since it started (polled GetDecoderInfo)",
    ["decoder"],
)
DECODER_FINISHED_REQUESTS = Gauge(
    "omni_gateway_decoder_finished_requests",
    "Requests the replica finished since it started (polled GetDecoderInfo)",
    ["decoder"],
)
DECODER_COLLECTORS: tuple[Gauge | Counter, ...] = (
    DECODER_UP,
    DECODER_REQUESTS,
    DECODER_IN_FLIGHT,
    DECODER_RETRIES,
    DECODER_ACTIVE_REQUESTS,
    DECODER_FALLBACK_STEPS,
    DECODER_FINISHED_REQUESTS,
)
"""Every collector labelled by decoder replica."""

__all__ = [
    "ACTIVE_STREAMS",
    "DECODER_ACTIVE_REQUESTS",
    "DECODER_COLLECTORS",
    "DECODER_FALLBACK_STEPS",
    "DECODER_FINISHED_REQUESTS",
    "DECODER_IN_FLIGHT",
    "DECODER_REQUESTS",
    "DECODER_RETRIES",
    "DECODER_UP",
    "FAILED_CONSOLIDATIONS",
    "HTTP_REQUESTS",
    "HTTP_REQUEST_SECONDS",
    "REQUESTS",
    "RTF",
    "SKIPPED_TENSORS",
    "TTFP_SECONDS",
]
