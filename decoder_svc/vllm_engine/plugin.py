"""vLLM general plugin: what every process that runs a vLLM engine part needs.

Registered as the ``omni_serving`` entry point of the ``vllm.general_plugins``
group (pyproject.toml). vLLM calls :func:`register` once per process in every
process it starts for an engine: the decoder process (when engine arguments
are built), a stage process, and each worker process of a multi-process
executor (tensor parallelism: ``WorkerWrapperBase.init_worker``, before the
model is built). Worker processes are spawned fresh interpreters, so without
this they would lack:

- the torchvision import shim (:mod:`omni_common.torchvision_compat`): on a
  CPU torch the Qwen3-Omni thinker's import of transformers' image code fails
  with ``operator torchvision::nms does not exist``;
- the out-of-tree architectures of the model families
  (``decoder_svc.families``: the Qwen3-Omni talker,
  ``OmniServingQwen3OmniTalker``), registered lazily: a class is built only
  if a process loads that model. An architecture already registered (the
  decoder registers its classes in process before it builds an engine) is
  left as it is.

Importing this module is cheap; it imports vLLM only inside :func:`register`,
which vLLM calls.
"""

from __future__ import annotations

import importlib
from typing import Any

from decoder_svc.families import vllm_models

__all__ = ["register", "architectures"]


def architectures() -> list[str]:
    """The out-of-tree architectures this plugin registers."""
    return sorted(vllm_models())


def register() -> None:
    """Install the torchvision shim and register the families' models (idempotent)."""
    from omni_common import torchvision_compat

    torchvision_compat.install()
    from vllm import ModelRegistry

    supported = ModelRegistry.get_supported_archs()
    for arch in architectures():
        if arch not in supported:
            ModelRegistry.register_model(arch, f"{__name__}:{arch}")


def __getattr__(name: str) -> Any:
    """``<this module>:<architecture>``: the class, from its family's factory
    (vLLM's lazy model loading)."""
    path = vllm_models().get(name)
    if path is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, _, factory = path.partition(":")
    return getattr(importlib.import_module(module), factory)()
