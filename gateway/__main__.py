"""``python -m gateway --listen ADDR --decoder TARGET [--http-port N] [--max-text-chars N] [--max-concurrent N]``."""

from __future__ import annotations

import argparse
import asyncio
import sys

from gateway.app import GatewayConfig, serve_gateway
from gateway.engine import DEFAULT_MAX_CONCURRENT
from gateway.validation import DEFAULT_MAX_TEXT_CHARS
from omni_common.errors import OmniError
from omni_common.logging_setup import setup_logging


def default_http_host(listen: str) -> str:
    """Bind HTTP where gRPC listens: the --listen host, or loopback for a Unix socket."""
    if listen.startswith("unix:"):
        return "127.0.0.1"
    host = listen.rpartition(":")[0].strip("[]")
    return host or "0.0.0.0"


def parse_args(argv: list[str] | None = None) -> GatewayConfig:
    parser = argparse.ArgumentParser(
        prog="python -m gateway", description="omni-serving client-facing gateway"
    )
    parser.add_argument(
        "--listen", required=True, help="gRPC address: unix:///abs/path.sock or host:port"
    )
    parser.add_argument(
        "--decoder", required=True, help="decoder target: unix:///abs/path.sock or host:port"
    )
    parser.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="serve the OpenAI-compatible HTTP facade on this port (0 = any free port)",
    )
    parser.add_argument(
        "--http-host",
        default=None,
        help="HTTP facade bind address (default: the --listen host, or 127.0.0.1 for a UDS)",
    )
    parser.add_argument(
        "--max-text-chars",
        type=int,
        default=DEFAULT_MAX_TEXT_CHARS,
        help="longest text/prompt accepted, in characters",
    )
    parser.add_argument(
        "--max-concurrent",
        type=int,
        default=DEFAULT_MAX_CONCURRENT,
        help="client streams served at once; more are refused with RESOURCE_EXHAUSTED / HTTP 429",
    )
    parser.add_argument("--grace-s", type=float, default=5.0, help="shutdown grace period")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    if args.max_text_chars < 1:
        parser.error("--max-text-chars must be >= 1")
    if args.max_concurrent < 1:
        parser.error("--max-concurrent must be >= 1")
    setup_logging(args.log_level, service="gateway")
    return GatewayConfig(
        listen=args.listen,
        decoder=args.decoder,
        http_host=args.http_host or default_http_host(args.listen),
        http_port=args.http_port,
        max_text_chars=args.max_text_chars,
        max_concurrent=args.max_concurrent,
        grace_s=args.grace_s,
    )


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    try:
        asyncio.run(serve_gateway(config))
    except OmniError as exc:
        print(f"gateway: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
