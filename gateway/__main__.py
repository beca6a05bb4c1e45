"""``python -m gateway --listen ADDR --decoder TARGET[,TARGET...] [options]`` (see docs/gateway.md).

``--decoder`` may be repeated, and each value may be a comma-separated list;
``dns:///name:port`` (or a plain ``name:port``) stands for every address the
name resolves to (gateway.replicas).

Environment variables stand in for some options (the option wins):
``OMNI_GATEWAY_TLS_CERT``, ``OMNI_GATEWAY_TLS_KEY`` (TLS on gRPC and HTTP),
``OMNI_GATEWAY_TOKEN`` (the bearer token itself) and
``OMNI_GATEWAY_TOKEN_FILE`` (a file holding it), ``OMNI_GATEWAY_ALLOWED_ORIGINS``
(the origins, besides the gateway's own, whose pages may open its WebSockets).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from gateway.app import GatewayConfig, serve_gateway
from gateway.engine import DEFAULT_MAX_CONCURRENT
from gateway.http_auth import parse_allowed_origins
from gateway.replicas import (
    BALANCE_POLICIES,
    BALANCE_ROUND_ROBIN,
    DEFAULT_RESOLVE_INTERVAL_S,
    parse_decoder_targets,
)
from gateway.validation import DEFAULT_MAX_RESPONSE_BYTES, DEFAULT_MAX_TEXT_CHARS
from omni_common.errors import InvalidArgumentError, OmniError
from omni_common.fast_exit import run_service
from omni_common.liveness import StallLimits
from omni_common.logging_setup import setup_logging
from omni_common.net import LOOPBACK

TLS_CERT_ENV = "OMNI_GATEWAY_TLS_CERT"
TLS_KEY_ENV = "OMNI_GATEWAY_TLS_KEY"
TOKEN_ENV = "OMNI_GATEWAY_TOKEN"
TOKEN_FILE_ENV = "OMNI_GATEWAY_TOKEN_FILE"
ALLOWED_ORIGINS_ENV = "OMNI_GATEWAY_ALLOWED_ORIGINS"


def read_token_file(path: str) -> str:
    """The token in `path`: its content without surrounding whitespace (ValueError if empty)."""
    with open(path, encoding="utf-8") as f:
        token = f.read().strip()
    if not token:
        raise ValueError(f"{path} is empty")
    if any(c.isspace() for c in token):
        raise ValueError(f"{path}: the token must be one word (no whitespace inside)")
    return token


def default_http_host(listen: str) -> str:
    """Bind HTTP where gRPC listens: the --listen host, or loopback for a Unix socket."""
    if listen.startswith("unix:"):
        return LOOPBACK
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
        "--decoder",
        required=True,
        action="append",
        metavar="TARGET[,TARGET...]",
        help="decoder target(s): unix:///abs/path.sock, host:port, or dns:///name:port (every "
        "address of the name); repeat the option or separate targets with commas",
    )
    parser.add_argument(
        "--decoder-balance",
        choices=BALANCE_POLICIES,
        default=BALANCE_ROUND_ROBIN,
        help="how new requests are spread over healthy decoders: round-robin (default) or "
        "least-outstanding (fewest streams open from this gateway)",
    )
    parser.add_argument(
        "--decoder-resolve-interval-s",
        type=float,
        default=DEFAULT_RESOLVE_INTERVAL_S,
        metavar="S",
        help="look DNS decoder targets up again every S seconds (default %(default)s)",
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
    parser.add_argument(
        "--max-response-bytes",
        type=int,
        default=DEFAULT_MAX_RESPONSE_BYTES,
        help="largest response message; a bigger CUMULATIVE/FINAL_ONLY Generate output ends "
        "the stream with RESOURCE_EXHAUSTED (Speak audio is split instead)",
    )
    parser.add_argument(
        "--tls-cert",
        default=os.environ.get(TLS_CERT_ENV) or None,
        help=f"PEM certificate chain: serve gRPC and HTTP over TLS (env {TLS_CERT_ENV})",
    )
    parser.add_argument(
        "--tls-key",
        default=os.environ.get(TLS_KEY_ENV) or None,
        help=f"PEM private key of --tls-cert (env {TLS_KEY_ENV})",
    )
    parser.add_argument(
        "--auth-token-file",
        default=os.environ.get(TOKEN_FILE_ENV) or None,
        help="require 'authorization: Bearer <token>' on gRPC and HTTP (health excepted); the "
        f"file holds the token (env {TOKEN_FILE_ENV}, or the token itself in {TOKEN_ENV})",
    )
    parser.add_argument(
        "--allowed-origins",
        action="append",
        default=None,
        metavar="ORIGIN[,ORIGIN...]",
        help="origins besides the gateway's own whose pages may open its WebSockets: "
        "scheme://host[:port], or * for any; repeat the option or separate with commas "
        f"(env {ALLOWED_ORIGINS_ENV})",
    )
    parser.add_argument("--grace-s", type=float, default=5.0, help="shutdown grace period")
    parser.add_argument(
        "--stall-after-s",
        type=float,
        default=30.0,
        metavar="S",
        help="client streams in flight and the event loop has not run for S seconds: the "
        "gateway reports not ready and logs where the loop is stuck (default %(default)s)",
    )
    parser.add_argument(
        "--liveness-grace-s",
        type=float,
        default=120.0,
        metavar="S",
        help="stuck this long: the health entry omni_serving.liveness goes NOT_SERVING "
        "(restart me); at least --stall-after-s (default %(default)s)",
    )
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    try:
        parse_decoder_targets(args.decoder, field="--decoder")
    except InvalidArgumentError as exc:
        parser.error(str(exc))
    if not args.decoder_resolve_interval_s > 0:
        parser.error("--decoder-resolve-interval-s must be > 0")
    if args.max_text_chars < 1:
        parser.error("--max-text-chars must be >= 1")
    if args.max_concurrent < 1:
        parser.error("--max-concurrent must be >= 1")
    if args.max_response_bytes < 65536:
        parser.error("--max-response-bytes must be >= 65536")
    if (args.tls_cert is None) != (args.tls_key is None):
        parser.error(f"--tls-cert and --tls-key ({TLS_CERT_ENV}/{TLS_KEY_ENV}) go together")
    origins = args.allowed_origins or [os.environ.get(ALLOWED_ORIGINS_ENV, "")]
    try:
        allowed_origins = parse_allowed_origins(origins)
    except InvalidArgumentError as exc:
        parser.error(str(exc))
    token = None
    if args.auth_token_file:
        try:
            token = read_token_file(args.auth_token_file)
        except (OSError, ValueError) as exc:
            parser.error(f"--auth-token-file: {exc}")
    elif os.environ.get(TOKEN_ENV, "").strip():
        token = os.environ[TOKEN_ENV].strip()
    try:
        StallLimits(floor_s=args.stall_after_s, grace_s=args.liveness_grace_s)
    except InvalidArgumentError as exc:
        parser.error(f"--{exc.field.replace('_', '-')}: {str(exc).split(': ', 1)[-1]}")
    setup_logging(args.log_level, service="gateway")
    return GatewayConfig(
        listen=args.listen,
        decoder=tuple(args.decoder),
        decoder_balance=args.decoder_balance,
        decoder_resolve_interval_s=args.decoder_resolve_interval_s,
        http_host=args.http_host or default_http_host(args.listen),
        http_port=args.http_port,
        max_text_chars=args.max_text_chars,
        max_concurrent=args.max_concurrent,
        grace_s=args.grace_s,
        max_response_bytes=args.max_response_bytes,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        auth_token=token,
        allowed_origins=allowed_origins,
        stall_after_s=args.stall_after_s,
        liveness_grace_s=args.liveness_grace_s,
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
    run_service(main)
