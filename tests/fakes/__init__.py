"""Test doubles (fakes) and harnesses for the gateway tests; none of them is a real service.

`GatewayThread` runs the REAL gateway (`gateway.app.start_gateway`) on a
background event loop, listening on a Unix socket (and optionally HTTP on
127.0.0.1:0), so blocking clients in the test thread talk to it over real
sockets.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import grpc

from gateway.app import GatewayConfig, RunningGateway, start_gateway
from omni_serving.v1 import gateway_pb2_grpc

from .fake_decoder import BackgroundLoop, FakeDecoder, FakeDecoderConfig


def short_socket_dir() -> Path:
    """A fresh directory with a short path (UDS paths are limited to 107 bytes)."""
    return Path(tempfile.mkdtemp(prefix="omni-gw-", dir="/tmp"))


class GatewayThread:
    """The real gateway on its own loop and thread, with a blocking gRPC stub."""

    def __init__(self, decoder_target: str, socket_dir: Path, **config: object) -> None:
        self.loop = BackgroundLoop("gateway")
        gateway_config = GatewayConfig(
            listen=f"unix://{socket_dir / 'gateway.sock'}", decoder=decoder_target, **config
        )
        self.gateway: RunningGateway = self.loop.run(start_gateway(gateway_config))
        self.channel = grpc.insecure_channel(self.gateway.address)
        self.stub = gateway_pb2_grpc.OmniGatewayServiceStub(self.channel)

    @property
    def http_port(self) -> int | None:
        return self.gateway.http_port

    def close(self) -> None:
        self.channel.close()
        self.loop.run(self.gateway.stop(0.5))
        self.loop.close()

    def __enter__(self) -> GatewayThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def remove_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


__all__ = [
    "FakeDecoder",
    "FakeDecoderConfig",
    "GatewayThread",
    "remove_dir",
    "short_socket_dir",
]
