"""Qwen3-Omni as a model family of the decoder (``decoder_svc.families``).

``build_engine`` opens the checkpoint (default: the tiny random-weight one in
the model cache, created on first use) and builds the AR stages' vLLM
backends in this process (``.engine.build_engine``), or, when the stages run
in processes of their own, only what this process needs of the checkpoint
(the vocoder and the prompts: ``.engine.build_front``) before it starts them.
``build_stage_backend`` builds one stage's backend in its stage process.
Each engine is built with its stage's engine settings (``StageConfig.engine``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from decoder_svc.families import EngineParts, UnservableModel
from decoder_svc.profile import Profile

from .cache import default_model_dir
from .checkpoint import CheckpointError, OmniCheckpoint
from .engine import build_engine as build_qwen3_omni
from .engine import build_front
from .engine import build_stage_backend as build_backend

def build_engine(
    profile: Profile, model: str, *, max_num_seqs: int, launch: Callable[[str], dict[str, Any]] | None = None
) -> EngineParts:
    try:
        if launch is not None:
            front = build_front(profile, Path(model) if model else None)
            backends = launch(str(front.checkpoint.path))
            # the prompts' context: the first stage's, as its process resolved it
            front.prompts.max_model_len = backends[profile.ar_stages[0].name].max_model_len
            return EngineParts(backends, front.vocoder, front.prepare)
        engine = build_qwen3_omni(profile, Path(model) if model else None, max_num_seqs=max_num_seqs)
    except CheckpointError as exc:
        raise UnservableModel(str(exc)) from exc
    # code2wav worker processes rebuild the vocoder from its worker_spec() (the checkpoint directory)
    return EngineParts(engine.backends, engine.vocoder, engine.prepare)


def build_stage_backend(spec):
    """One AR stage's backend on the checkpoint (a stage process's; ``spec``: its StageHostSpec)."""
    checkpoint = OmniCheckpoint.open(Path(spec.model) if spec.model else default_model_dir())
    return build_backend(checkpoint, spec.config, max_num_seqs=spec.max_num_seqs)
