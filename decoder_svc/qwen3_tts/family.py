"""Qwen3-TTS as a model family of the decoder (``decoder_svc.families``).

Chosen for a checkpoint whose ``config.json`` names
``Qwen3TTSForConditionalGeneration``. ``build_engine`` opens and validates
it (:mod:`.checkpoint`) and builds the talker's backend in this process
(``.engine.build_engine``), or, when the talker runs in a stage process of
its own, only the vocoder and the prompts before it starts it;
``build_stage_backend`` builds the talker's backend in its stage process.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from decoder_svc.families import EngineParts, UnservableModel
from decoder_svc.profile import Profile
from omni_common.errors import InvalidArgumentError

from .checkpoint import CheckpointError, TTSCheckpoint
from .engine import build_engine as build_tts
from .engine import build_stage_backend as build_backend
from .engine import check_profile, make_prompts, make_vocoder

log = logging.getLogger(__name__)


def _open(model: str) -> TTSCheckpoint:
    if not model:
        raise UnservableModel("a Qwen3-TTS model is served from its directory: give --model")
    return TTSCheckpoint.open(Path(model))


def build_engine(
    profile: Profile, model: str, *, max_num_seqs: int, launch: Callable[[str], dict[str, Any]] | None = None,
    code2wav_workers: int = 0, voice_dir: str = "",
) -> EngineParts:
    try:
        checkpoint = _open(model)
        check_profile(profile)
    except (CheckpointError, InvalidArgumentError) as exc:
        raise UnservableModel(str(exc)) from exc
    log.info("serving %s (Qwen3-TTS, %s)", checkpoint.path, checkpoint.kind)
    if launch is not None:
        vocoder = make_vocoder(checkpoint, profile)
        backends = launch(str(checkpoint.path))
        try:
            prompts = make_prompts(checkpoint, max_model_len=backends[profile.ar_stages[0].name].max_model_len,
                                   voice_dir=voice_dir)
        except BaseException as exc:
            for b in backends.values():
                b.close()
            if isinstance(exc, InvalidArgumentError):
                raise UnservableModel(str(exc)) from exc
            raise
        return EngineParts(backends, vocoder, prompts.prepare, voices=prompts.voices)
    try:
        engine = build_tts(profile, checkpoint, max_num_seqs=max_num_seqs, voice_dir=voice_dir)
    except InvalidArgumentError as exc:  # the voice registry's directory
        raise UnservableModel(str(exc)) from exc
    return EngineParts(engine.backends, engine.vocoder, engine.prepare, voices=engine.prompts.voices)


def build_stage_backend(spec):  # noqa: ANN001, ANN201
    """The talker's backend in its stage process (``spec``: its StageHostSpec)."""
    return build_backend(_open(spec.model), spec.config, max_num_seqs=spec.max_num_seqs)
