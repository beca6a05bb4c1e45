"""materializer_svc entry point: `python -m materializer_svc --impl NAME`."""

from __future__ import annotations

import argparse
import os

import grpc

from materializer_svc import metrics, registry
from omni_common.logging_setup import setup_logging
from omni_common.metrics import start_metrics_server
from omni_common.server import ServerConfig, run_server
from omni_serving.v1 import materializer_pb2, materializer_pb2_grpc

SERVICE_NAME = materializer_pb2.DESCRIPTOR.services_by_name["MaterializerService"].full_name


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--listen",
        default=os.environ.get(
            "OMNI_MATERIALIZER_LISTEN", "unix:///tmp/omni-serving/materializer.sock"
        ),
    )
    p.add_argument(
        "--impl",
        default=os.environ.get("OMNI_MATERIALIZER_IMPL", "reference"),
        help="implementation from the registry (see --list)",
    )
    p.add_argument(
        "--deployment",
        default=os.environ.get("OMNI_DEPLOYMENT", "default"),
        help="deployment name; only segments omni-<deployment>-* are read",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=int(os.environ.get("OMNI_MATERIALIZER_WORKERS", "2")),
        help="worker processes (implementations that use a pool)",
    )
    p.add_argument(
        "--pipeline-depth",
        type=int,
        default=int(os.environ.get("OMNI_MATERIALIZER_PIPELINE_DEPTH", "0")),
        help="steps in flight per stream (pool); 0 = 2 x workers",
    )
    p.add_argument(
        "--start-method",
        choices=("forkserver", "spawn"),
        default=os.environ.get("OMNI_MATERIALIZER_START_METHOD", "forkserver"),
        help="how pool workers are started",
    )
    p.add_argument(
        "--readiness-timeout-ms",
        type=int,
        default=int(os.environ.get("OMNI_MATERIALIZER_READINESS_TIMEOUT_MS", "5000")),
        help="readiness wait for streams whose open message does not set one",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=int(os.environ.get("OMNI_MATERIALIZER_METRICS_PORT", "-1")),
        help="serve Prometheus /metrics on this port (0 = any free port, -1 = off)",
    )
    p.add_argument("--metrics-host", default=os.environ.get("OMNI_METRICS_HOST", "127.0.0.1"))
    p.add_argument("--list", action="store_true", help="list implementations and exit")
    p.add_argument("--log-level", default=os.environ.get("OMNI_LOG_LEVEL", "INFO"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="materializer_svc", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(registry.names()))
        return
    setup_logging(args.log_level, service="materializer")
    start_metrics_server(args.metrics_port, args.metrics_host)
    config = registry.MaterializerConfig(
        shm_prefix=f"omni-{args.deployment}",
        workers=args.workers,
        readiness_timeout_ms=args.readiness_timeout_ms,
        pipeline_depth=args.pipeline_depth,
        start_method=args.start_method,
    )
    servicer = registry.create(args.impl, config)
    metrics.attach(servicer)

    def register(server: grpc.aio.Server) -> None:
        materializer_pb2_grpc.add_MaterializerServiceServicer_to_server(servicer, server)

    def close() -> None:
        closer = getattr(servicer, "close", None)
        if closer is not None:
            closer()  # idempotent: terminates pool workers, drops mappings

    async def on_shutdown() -> None:
        close()

    try:
        run_server(
            ServerConfig(
                address=args.listen,
                service_name=SERVICE_NAME,
                reflection_service_names=[SERVICE_NAME],
            ),
            register,
            on_shutdown=on_shutdown,
        )
    finally:
        close()  # also when the server never started (bind failure)
