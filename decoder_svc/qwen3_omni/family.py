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

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from decoder_svc.families import EngineParts, UnservableModel
from decoder_svc.profile import Profile
from omni_common.errors import InvalidArgumentError

from .cache import default_model_dir
from .checkpoint import CheckpointError, OmniCheckpoint
from .engine import build_engine as build_qwen3_omni
from .engine import (
    build_front,
    kv_elements_per_token,
    speaking_context,
    stage_settings,
    vocoder_placement,
)
from .engine import build_stage_backend as build_backend
from .memory_plan import MemoryPlan, PlanRefused, plan_memory

log = logging.getLogger(__name__)


def build_engine(
    profile: Profile, model: str, *, max_num_seqs: int, launch: Callable[[str], dict[str, Any]] | None = None,
    code2wav_workers: int = 0, voice_dir: str = "",
) -> EngineParts:
    try:
        checkpoint = OmniCheckpoint.open(Path(model) if model else default_model_dir())
        plan = memory_plan(checkpoint, profile, code2wav_workers=code2wav_workers, max_num_seqs=max_num_seqs)
        for line in plan.lines():
            log.info("%s", line)
    except (CheckpointError, PlanRefused, InvalidArgumentError) as exc:
        raise UnservableModel(str(exc)) from exc
    try:
        if launch is not None:
            front = build_front(profile, Path(model) if model else None)
            backends = launch(str(front.checkpoint.path))
            # the prompts' context: the first stage's, as its process resolved it
            front.prompts.max_model_len = backends[profile.ar_stages[0].name].max_model_len
            front.prompts.speak_max_model_len = speaking_context(profile, backends)
            return EngineParts(backends, front.vocoder, front.prepare)
        engine = build_qwen3_omni(profile, Path(model) if model else None, max_num_seqs=max_num_seqs)
    except CheckpointError as exc:
        raise UnservableModel(str(exc)) from exc
    # code2wav worker processes rebuild the vocoder from its worker_spec() (the checkpoint directory)
    return EngineParts(engine.backends, engine.vocoder, engine.prepare)


def memory_plan(checkpoint: OmniCheckpoint, profile: Profile, *, code2wav_workers: int,
                max_num_seqs: int | None = None, platform: str | None = None,
                device_totals: dict[str, int] | None = None, host_memory: int | None = None) -> MemoryPlan:
    """The profile's memory plan on `checkpoint` (``.memory_plan``), against
    this host's available memory and its CUDA devices' totals; PlanRefused
    when it does not fit. `platform` ("cpu", "cuda"), `device_totals` and
    `host_memory`: another host's, to plan for it (``omni-serving models
    plan``); `checkpoint` may then be a ``.presets.ConfigCheckpoint``."""
    stages = []
    for stage in profile.ar_stages:
        role = stage.engine_role or stage.name
        stages.append((stage.name, role, stage_settings(checkpoint, stage, log_notes=False, platform=platform,
                                                        max_num_seqs=max_num_seqs)))
    kv_bytes = {name: kv_elements_per_token(checkpoint, role) * (4 if eff.dtype == "float32" else 2)
                for name, role, eff in stages}
    code2wav = vocoder_placement(profile, platform=platform)
    totals = device_totals
    if totals is None:
        totals = cuda_totals() if any(eff.on_cuda for _, _, eff in stages) or code2wav[0] != "cpu" else {}
    return plan_memory(checkpoint, stages, code2wav_workers=code2wav_workers,
                       host_available=host_available() if host_memory is None else host_memory,
                       device_totals=totals, kv_bytes_per_token=kv_bytes, code2wav=code2wav)


def host_available() -> int:
    """Memory this process may still use: the host's available memory, or
    less where a cgroup (a container) limits it."""
    import psutil

    available = int(psutil.virtual_memory().available)
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
        if limit != "max":
            available = min(available, max(int(limit) - used, 0))
    except (OSError, ValueError):
        pass
    return available


def cuda_totals() -> dict[str, int]:
    """Each visible CUDA device's total memory, by "cuda:N"."""
    import torch

    if not torch.cuda.is_available():
        return {}
    return {f"cuda:{i}": int(torch.cuda.get_device_properties(i).total_memory)
            for i in range(torch.cuda.device_count())}


def build_stage_backend(spec):
    """One AR stage's backend on the checkpoint (a stage process's; ``spec``: its StageHostSpec)."""
    checkpoint = OmniCheckpoint.open(Path(spec.model) if spec.model else default_model_dir())
    return build_backend(checkpoint, spec.config, max_num_seqs=spec.max_num_seqs)
