"""Registry of materializer implementations, chosen at the entry point."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from omni_serving.v1 import materializer_pb2_grpc


@dataclass(frozen=True)
class MaterializerConfig:
    shm_prefix: str
    workers: int = 2
    readiness_timeout_ms: int = 5000


Factory = Callable[[MaterializerConfig], materializer_pb2_grpc.MaterializerServiceServicer]
_REGISTRY: dict[str, Factory] = {}


def register(name: str) -> Callable[[Factory], Factory]:
    def deco(factory: Factory) -> Factory:
        _REGISTRY[name] = factory
        return factory

    return deco


def names() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def create(name: str, config: MaterializerConfig) -> materializer_pb2_grpc.MaterializerServiceServicer:
    _load_builtin()
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise SystemExit(f"unknown materializer implementation {name!r}; available: {', '.join(sorted(_REGISTRY))}") from None
    return factory(config)


def _load_builtin() -> None:
    from materializer_svc import reference  # noqa: F401  (registers itself)
