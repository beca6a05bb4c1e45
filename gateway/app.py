"""Assembly of the gateway process: engine + gRPC server + optional HTTP facade, one event loop.

`serve_gateway` is what ``python -m gateway`` runs (signals, graceful
shutdown via `omni_common.server.serve`); `start_gateway` starts the same
parts and returns a handle, for tests and embedding.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc

from gateway.decoder_client import DecoderClient
from gateway.engine import DEFAULT_MAX_CONCURRENT, GatewayEngine
from gateway.http_facade import HttpFacade
from gateway.servicer import SERVICE_NAME, registrar
from gateway.validation import DEFAULT_MAX_TEXT_CHARS, Limits
from omni_common.server import HealthServicer, ServerConfig, build_server, serve

logger = logging.getLogger(__name__)


@dataclass
class GatewayConfig:
    """Everything ``python -m gateway`` takes on its command line."""

    listen: str
    """gRPC listen address (``unix:///abs/path.sock`` or ``host:port``)."""
    decoder: str
    """Decoder target (``unix:///abs/path.sock`` or ``host:port``)."""
    http_host: str = "127.0.0.1"
    http_port: int | None = None
    """HTTP facade port (0 = any free port); None = no HTTP facade."""
    max_text_chars: int = DEFAULT_MAX_TEXT_CHARS
    max_concurrent: int = DEFAULT_MAX_CONCURRENT
    grace_s: float = 5.0

    def server_config(self) -> ServerConfig:
        return ServerConfig(
            address=self.listen,
            service_name=SERVICE_NAME,
            grace_s=self.grace_s,
            reflection_service_names=(SERVICE_NAME,),
        )

    def build_engine(self) -> GatewayEngine:
        """The engine, with its decoder channel; call inside the event loop."""
        return GatewayEngine(
            DecoderClient(self.decoder),
            limits=Limits(max_text_chars=self.max_text_chars),
            max_concurrent=self.max_concurrent,
        )


@dataclass
class RunningGateway:
    """A started gateway (see `start_gateway`)."""

    engine: GatewayEngine
    server: grpc.aio.Server
    address: str
    health: HealthServicer
    http: HttpFacade | None

    @property
    def http_port(self) -> int | None:
        return None if self.http is None else self.http.port

    async def stop(self, grace_s: float | None = 0.5) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
        if self.http is not None:
            await self.http.stop()
        await self.engine.close()


async def start_gateway(config: GatewayConfig) -> RunningGateway:
    """Start engine, gRPC server and (if configured) the HTTP facade in this loop."""
    server_config = config.server_config()  # refuse a malformed address before opening anything
    engine = config.build_engine()
    server, address, health = await build_server(server_config, registrar(engine))
    http = None
    if config.http_port is not None:
        http = HttpFacade(engine)
        await http.start(config.http_host, config.http_port)
    return RunningGateway(engine, server, address, health, http)


async def serve_gateway(config: GatewayConfig) -> None:
    """Run until SIGTERM/SIGINT, then shut down gracefully (health, gRPC, HTTP, decoder channel)."""
    server_config = config.server_config()  # refuse a malformed address before opening anything
    engine = config.build_engine()
    http = HttpFacade(engine) if config.http_port is not None else None
    if http is not None:
        await http.start(config.http_host, config.http_port)

    async def on_shutdown() -> None:
        if http is not None:
            await http.stop()
        await engine.close()

    def ready(address: str) -> None:
        http_note = f", HTTP on port {http.port}" if http is not None else ""
        print(f"gateway listening on {address}{http_note}", flush=True)

    await serve(server_config, registrar(engine), on_shutdown=on_shutdown, ready=ready)


__all__ = ["GatewayConfig", "RunningGateway", "serve_gateway", "start_gateway"]
