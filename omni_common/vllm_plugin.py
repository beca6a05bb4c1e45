"""vLLM general plugin: what every process that runs a vLLM engine part needs.

Registered as the ``omni_serving`` entry point of the ``vllm.general_plugins``
group (pyproject.toml). vLLM calls :func:`register` once per process in every
process it starts for an engine: the decoder process (when engine arguments
are built), and each worker process of a multi-process executor (tensor
parallelism: ``WorkerWrapperBase.init_worker``, before the model is built).
Worker processes are spawned fresh interpreters, so without this they would
lack:

- the torchvision import shim (:mod:`omni_common.torchvision_compat`): on a
  CPU torch the Qwen3-Omni thinker's import of transformers' image code fails
  with ``operator torchvision::nms does not exist``;
- the decoder's out-of-tree architecture (the Qwen3-Omni talker,
  ``OmniServingQwen3OmniTalker``), registered lazily: its class is built only
  if a process loads that model. An architecture already registered (the
  decoder registers its classes in process before it builds an engine) is
  left as it is.

Importing this module is cheap; it imports vLLM only inside :func:`register`,
which vLLM calls.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["register", "TALKER_ARCH"]

# decoder_svc.qwen3_omni.talker.TALKER_ARCH (not imported here: that module needs torch and vLLM).
TALKER_ARCH = "OmniServingQwen3OmniTalker"


def register() -> None:
    """Install the torchvision shim and register the talker (idempotent)."""
    from omni_common import torchvision_compat

    torchvision_compat.install()
    from vllm import ModelRegistry

    if TALKER_ARCH not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(TALKER_ARCH, f"{__name__}:{TALKER_ARCH}")


def __getattr__(name: str) -> Any:
    """``<this module>:OmniServingQwen3OmniTalker`` (vLLM's lazy model loading)."""
    if name == TALKER_ARCH:
        talker = importlib.import_module("decoder_svc.qwen3_omni.talker")
        return talker.talker_model_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
