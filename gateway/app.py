"""Assembly of the gateway process: engine + gRPC server + optional HTTP facade, one event loop.

`serve_gateway` is what ``python -m gateway`` runs (signals, graceful
shutdown via `omni_common.server.serve`); `start_gateway` starts the same
parts and returns a handle, for tests and embedding.

The gateway's grpc.health.v1 status starts NOT_SERVING and then follows its
decoders' (`gateway.replicas.ReplicaPool`: SERVING while any replica is),
except while its event loop is stuck (`gateway.liveness`: NOT_SERVING); the
entry `omni_serving.liveness` goes NOT_SERVING once it has been stuck past
its grace. With a TLS certificate both
listeners (gRPC and HTTP) serve TLS; with a token both require it (health
excepted; the HTTP WebSocket routes also take browser credentials and check
``Origin``, `gateway.http_auth`).
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from gateway.engine import DEFAULT_MAX_CONCURRENT, GatewayEngine
from gateway.health import DEFAULT_INTERVAL_S
from gateway.http_auth import parse_allowed_origins
from gateway.http_facade import HttpFacade
from gateway.liveness import LoopLiveness
from gateway.replicas import (
    BALANCE_ROUND_ROBIN,
    DEFAULT_RESOLVE_INTERVAL_S,
    DecoderTarget,
    ReplicaPool,
    Resolver,
    parse_decoder_targets,
)
from gateway.servicer import SERVICE_NAME, registrar
from gateway.validation import DEFAULT_MAX_RESPONSE_BYTES, DEFAULT_MAX_TEXT_CHARS, Limits
from omni_common.errors import FailedPreconditionError, InvalidArgumentError
from omni_common.liveness import DEFAULT_FACTOR, StallLimits
from omni_common.server import (
    BearerTokenInterceptor,
    HealthServicer,
    MalformedRequestInterceptor,
    ServerConfig,
    TlsFiles,
    build_server,
    serve,
)

MAX_REQUEST_BYTES = 16 * 2**20
"""Largest request message accepted: text is at most a few thousand characters,
but a conversation may carry audio parts (16 MiB: 8 minutes of 16 kHz PCM16)."""

logger = logging.getLogger(__name__)


@dataclass
class GatewayConfig:
    """Everything ``python -m gateway`` takes on its command line."""

    listen: str
    """gRPC listen address (``unix:///abs/path.sock`` or ``host:port``)."""
    decoder: str | Sequence[str]
    """Decoder target(s): ``unix:///abs/path.sock``, ``host:port``, ``dns:///name:port``;
    several as a sequence and/or comma-separated (see `gateway.replicas`)."""
    http_host: str = "127.0.0.1"
    http_port: int | None = None
    """HTTP facade port (0 = any free port); None = no HTTP facade."""
    max_text_chars: int = DEFAULT_MAX_TEXT_CHARS
    max_concurrent: int = DEFAULT_MAX_CONCURRENT
    grace_s: float = 5.0
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES
    """Largest response message (a bigger CUMULATIVE/FINAL_ONLY output is RESOURCE_EXHAUSTED)."""
    tls_cert: str | None = None
    """PEM certificate chain: serve gRPC and HTTP over TLS (needs `tls_key`)."""
    tls_key: str | None = None
    """PEM private key of `tls_cert`."""
    auth_token: str | None = None
    """Bearer token every client call must carry (health excepted); None = open."""
    allowed_origins: Sequence[str] = ()
    """Origins besides the gateway's own whose pages may open its WebSockets
    (``scheme://host[:port]``, or ``*`` for any); see `gateway.http_auth`."""
    health_interval_s: float = DEFAULT_INTERVAL_S
    """Time between two health checks of each decoder."""
    decoder_balance: str = BALANCE_ROUND_ROBIN
    """How new requests are spread over healthy decoders (`replicas.BALANCE_POLICIES`)."""
    decoder_resolve_interval_s: float = DEFAULT_RESOLVE_INTERVAL_S
    """Time between two lookups of a DNS target's addresses."""
    decoder_resolver: Resolver | None = None
    """Looks up a DNS target's addresses; None = `socket.getaddrinfo` (tests inject one)."""
    stall_after_s: float = 30.0
    """Client streams in flight and the event loop has not run for this long: not ready (gateway.liveness)."""
    liveness_grace_s: float = 120.0
    """Stuck this long: the health entry omni_serving.liveness goes NOT_SERVING (restart me)."""
    decoder_targets: tuple[DecoderTarget, ...] = field(init=False, repr=False)
    """`decoder`, parsed."""

    def __post_init__(self) -> None:
        self.decoder_targets = parse_decoder_targets(self.decoder)
        self.stall_limits()  # refused here, naming the field
        if (self.tls_cert is None) != (self.tls_key is None):
            raise InvalidArgumentError("tls", "give both a certificate and its key, or neither")
        if self.auth_token is not None and not self.auth_token.strip():
            raise InvalidArgumentError("auth_token", "must not be empty")
        self.allowed_origins = parse_allowed_origins(self.allowed_origins, "allowed_origins")
        Limits(max_text_chars=self.max_text_chars, max_response_bytes=self.max_response_bytes)

    def stall_limits(self) -> StallLimits:
        """The event loop's liveness limits (InvalidArgumentError naming the field)."""
        return StallLimits(floor_s=self.stall_after_s, factor=DEFAULT_FACTOR, grace_s=self.liveness_grace_s)

    def build_liveness(self, engine: GatewayEngine, server_config: ServerConfig) -> LoopLiveness:
        """The event loop's liveness watchdog and the health it drives."""
        return LoopLiveness(lambda: engine.admission.active, self.stall_limits(), server_config.health_names)

    @property
    def tls(self) -> TlsFiles | None:
        if self.tls_cert is None or self.tls_key is None:
            return None
        return TlsFiles(self.tls_cert, self.tls_key)

    def server_config(self) -> ServerConfig:
        interceptors: list[grpc.aio.ServerInterceptor] = []
        if self.auth_token is not None:
            interceptors.append(BearerTokenInterceptor(self.auth_token))
        interceptors.append(MalformedRequestInterceptor())
        return ServerConfig(
            address=self.listen,
            service_name=SERVICE_NAME,
            grace_s=self.grace_s,
            reflection_service_names=(SERVICE_NAME,),
            max_receive_message_bytes=MAX_REQUEST_BYTES,
            tls=self.tls,
            interceptors=interceptors,
            serving_at_start=False,  # the decoder monitor decides
        )

    def http_ssl_context(self) -> ssl.SSLContext | None:
        """The HTTP facade's TLS context (same certificate as gRPC), or None."""
        tls = self.tls
        if tls is None:
            return None
        tls.read()  # a readable PEM pair, or an error naming the file
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            context.load_cert_chain(tls.cert_path, tls.key_path)
        except (ssl.SSLError, OSError) as exc:
            raise FailedPreconditionError(
                f"TLS certificate {tls.cert_path} / key {tls.key_path}: cannot load them: {exc}"
            ) from exc
        return context

    def build_pool(self) -> ReplicaPool:
        """The decoder replicas (one channel each); call inside the event loop."""
        return ReplicaPool(
            self.decoder_targets,
            balance=self.decoder_balance,
            resolve_interval_s=self.decoder_resolve_interval_s,
            health_interval_s=self.health_interval_s,
            resolver=self.decoder_resolver,
        )

    def build_engine(self) -> GatewayEngine:
        """The engine, with its decoder channels; call inside the event loop."""
        return GatewayEngine(
            self.build_pool(),
            limits=Limits(
                max_text_chars=self.max_text_chars, max_response_bytes=self.max_response_bytes
            ),
            max_concurrent=self.max_concurrent,
        )

    def build_http(self, engine: GatewayEngine, monitor: ReplicaPool) -> HttpFacade | None:
        if self.http_port is None:
            return None
        return HttpFacade(
            engine,
            monitor=monitor,
            auth_token=self.auth_token,
            allowed_origins=self.allowed_origins,
            ssl_context=self.http_ssl_context(),
        )


def _monitor(engine: GatewayEngine, liveness: LoopLiveness) -> ReplicaPool:
    """The engine's decoder pool; its health is the gateway's readiness's dependency."""

    async def on_change(healthy: bool) -> None:
        await liveness.health.set_dependency(healthy)

    engine.pool.on_change = on_change
    return engine.pool


@dataclass
class RunningGateway:
    """A started gateway (see `start_gateway`)."""

    engine: GatewayEngine
    server: grpc.aio.Server
    address: str
    health: HealthServicer
    http: HttpFacade | None
    monitor: ReplicaPool
    """The decoder replicas and their health checks (the same object as `engine.pool`)."""
    liveness: LoopLiveness
    """The event loop's progress, watched; drives the health entries."""

    @property
    def http_port(self) -> int | None:
        return None if self.http is None else self.http.port

    async def stop(self, grace_s: float | None = 0.5) -> None:
        await self.health.enter_graceful_shutdown()
        await self.liveness.stop()
        await self.monitor.stop()
        await self.server.stop(grace_s)
        if self.http is not None:
            await self.http.stop()
        await self.engine.close()


async def start_gateway(config: GatewayConfig) -> RunningGateway:
    """Start engine, gRPC server and (if configured) the HTTP facade in this loop."""
    server_config = config.server_config()  # refuse a malformed address before opening anything
    engine = config.build_engine()
    liveness = config.build_liveness(engine, server_config)
    monitor = _monitor(engine, liveness)
    try:
        http = config.build_http(engine, monitor)
        server, address, health = await build_server(server_config, registrar(engine))
    except BaseException:
        await engine.close()
        raise
    await liveness.health.started(server, health)
    await liveness.start()
    await monitor.start()
    if http is not None:
        try:
            await http.start(config.http_host, config.http_port or 0)
        except BaseException:
            await liveness.stop()
            await monitor.stop()
            await server.stop(0)
            await engine.close()
            raise
    return RunningGateway(engine, server, address, health, http, monitor, liveness)


async def serve_gateway(config: GatewayConfig) -> None:
    """Run until SIGTERM/SIGINT, then shut down gracefully (health, gRPC, HTTP, decoder channels)."""
    server_config = config.server_config()  # refuse a malformed address before opening anything
    engine = config.build_engine()
    liveness = config.build_liveness(engine, server_config)
    monitor = _monitor(engine, liveness)
    http = config.build_http(engine, monitor)
    if http is not None:
        await http.start(config.http_host, config.http_port or 0)

    async def on_started(server: grpc.aio.Server, health: HealthServicer) -> None:
        await liveness.health.started(server, health)
        await liveness.start()
        await monitor.start()

    async def on_shutdown() -> None:
        await liveness.stop()
        await monitor.stop()
        if http is not None:
            await http.stop()
        await engine.close()

    def ready(address: str) -> None:
        http_note = f", HTTP on port {http.port}" if http is not None else ""
        tls_note = " (TLS)" if config.tls is not None else ""
        print(f"gateway listening on {address}{http_note}{tls_note}", flush=True)

    await serve(
        server_config,
        registrar(engine),
        on_shutdown=on_shutdown,
        ready=ready,
        on_started=on_started,
    )


__all__ = ["GatewayConfig", "RunningGateway", "serve_gateway", "start_gateway"]
