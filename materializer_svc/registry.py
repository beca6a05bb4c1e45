"""Registry of materializer implementations, chosen at the entry point.

An implementation registers a factory under a name:

    @register("mine")
    def _factory(config: MaterializerConfig) -> MyMaterializer:
        return MyMaterializer(config)

The shipped ones ("reference", "pool") are loaded on first use. Another
module is loaded by naming it: `--impl my_pkg.my_module:mine` imports
`my_pkg.my_module` (which registers "mine") and creates "mine".
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from omni_serving.v1 import materializer_pb2_grpc


@dataclass(frozen=True)
class MaterializerConfig:
    shm_prefix: str
    """Deployment prefix of the arenas this materializer may read."""
    workers: int = 2
    """Worker processes, for implementations that use a pool."""
    readiness_timeout_ms: int = 5000
    """Readiness wait of streams whose open message leaves it at 0."""
    pipeline_depth: int = 0
    """Steps in flight per stream (pool); 0 picks 2 x workers."""
    start_method: str = "forkserver"
    """multiprocessing start method of pool workers: 'forkserver' or 'spawn'."""


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


def create(
    name: str, config: MaterializerConfig
) -> materializer_pb2_grpc.MaterializerServiceServicer:
    _load_builtin()
    if ":" in name:
        module, _, name = name.partition(":")
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise SystemExit(f"cannot import materializer module {module!r}: {exc}") from None
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise SystemExit(
            f"unknown materializer implementation {name!r}; available: {', '.join(sorted(_REGISTRY))}"
        ) from None
    return factory(config)


def _load_builtin() -> None:
    from materializer_svc import pool, reference  # noqa: F401  (they register themselves)
