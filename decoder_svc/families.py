"""Model families: what the decoder serves, chosen at its entry point from the checkpoint's config.

A family is one kind of model the decoder can serve. It is declared here,
in :data:`FAMILIES`, with what can be known without importing it (its
module may need torch and vLLM):

- the checkpoint architectures it serves (``config.json``'s
  ``architectures``);
- the out-of-tree vLLM model classes it brings (architecture name ->
  ``"package.module:factory"``, a function returning the class), which the
  vLLM plugin (``decoder_svc.vllm_engine.plugin``) registers lazily in every
  process of an engine;
- its module, imported when the family is used, which provides:

  - ``build_engine(profile, model, *, max_num_seqs, launch=None, code2wav_workers=0,
    voice_dir="") -> EngineParts``: open the model (``""``: the family's default) and build
    the AR stages' backends in this process (``max_num_seqs``: None, or a
    caller's value over the stages' engine settings, ``StageConfig.engine``;
    ``code2wav_workers``: the decoder's code2wav worker processes, which a
    memory plan counts; ``voice_dir``: where a model that clones voices
    keeps its voice registry, "" its default), or, with ``launch``, start the
    stage processes (``launch(checkpoint path)``, see
    ``decoder_svc.stage.proxy``) and use them; plus the vocoder, the
    request preparation and the voice registry (None where the model has none). A model the family cannot serve raises
    :class:`UnservableModel` (the message names the file and key);
  - ``build_stage_backend(spec) -> backend``: one AR stage's backend, in a
    stage process (``decoder_svc.stage.host``; ``spec`` is its
    ``StageHostSpec``).

``--engine fake`` is the fake engine's entry (a test double, in
``decoder_svc.testing``); ``--engine vllm`` takes the family whose
architectures the checkpoint's ``config.json`` names. With no model given,
or a checkpoint no family claims (or whose ``config.json`` cannot be read),
the default family takes it: its checks say what is wrong. Each family is
one entry here, and its package (``decoder_svc.qwen3_omni``,
``decoder_svc.qwen3_tts``).

Cheap to import: nothing here imports torch, vLLM or a family's module.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = [
    "FAMILIES",
    "DEFAULT_FAMILY",
    "EngineParts",
    "Family",
    "UnservableModel",
    "family_for",
    "vllm_models",
]


class UnservableModel(Exception):
    """A model directory the family cannot serve (``file: key: message``)."""


@dataclass
class EngineParts:
    """What a family's ``build_engine`` gives the pipeline."""

    backends: dict[str, Any]  # by AR stage name: backends, or stage processes
    vocoder: Any  # the generation stage's streaming vocoder
    prepare: Callable[[Any], Any] | None = None  # RequestSpec -> what the first stage takes
    voices: Any = None  # the voice registry (decoder_svc.qwen3_tts.voices.VoiceStore), where the model clones voices


@dataclass(frozen=True)
class Family:
    name: str
    module: str  # provides build_engine and build_stage_backend (module docstring)
    architectures: tuple[str, ...] = ()  # config.json "architectures" it serves
    # out-of-tree vLLM model classes: architecture -> "package.module:factory"
    vllm_models: dict[str, str] = field(default_factory=dict)
    # the deploy profile --profile auto means (the one the model serves by default)
    default_profile: str = "omni"

    def load(self) -> ModuleType:
        """The family's module (ImportError: its engine is not installed)."""
        return importlib.import_module(self.module)


FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        Family(
            "qwen3_omni",
            "decoder_svc.qwen3_omni.family",
            architectures=("Qwen3OmniMoeForConditionalGeneration",),
            vllm_models={"OmniServingQwen3OmniTalker": "decoder_svc.qwen3_omni.talker:talker_model_class"},
        ),
        Family(
            "qwen3_tts",
            "decoder_svc.qwen3_tts.family",
            architectures=("Qwen3TTSForConditionalGeneration",),
            # the same talker model class as Qwen3-Omni's (a dense MLP, its own text projection)
            vllm_models={"OmniServingQwen3OmniTalker": "decoder_svc.qwen3_omni.talker:talker_model_class"},
            default_profile="tts",
        ),
        Family("fake", "decoder_svc.testing.fake_family"),
    )
}
DEFAULT_FAMILY = "qwen3_omni"
"""Serves the default model (no ``--model``: a tiny random-weight Qwen3-Omni)."""


def family_for(engine: str, model: str) -> Family:
    """The family for ``--engine`` and ``--model`` (module docstring)."""
    if engine in ("fake", "reference"):
        return FAMILIES["fake"]
    if model:
        try:
            config = json.loads((Path(model).expanduser() / "config.json").read_text())
            archs = set(config.get("architectures") or ())
        except (OSError, ValueError, AttributeError, TypeError):
            archs = set()
        for family in FAMILIES.values():
            if archs & set(family.architectures):
                return family
    return FAMILIES[DEFAULT_FAMILY]


def vllm_models() -> dict[str, str]:
    """Every family's out-of-tree vLLM model classes (architecture -> factory path)."""
    return {arch: path for family in FAMILIES.values() for arch, path in family.vllm_models.items()}
