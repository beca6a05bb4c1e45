"""A Qwen3-TTS checkpoint as the decoder's engine: the talker's backend, the vocoder, the prompts.

Served on the ``tts`` profile (talker -> code2wav): ``Speak`` speaks the
given text in the request's voice. A checkpoint's kind decides what a voice
is (:class:`SpeechPrompts`):

- ``custom_voice``: the model's built-in speakers (``voice``), each with an
  optional style (``instructions``);
- ``voice_design``: one voice, ``default``, described by the request's
  ``instructions``;
- ``base``: a voice cloned from a reference clip (its speaker embedding,
  and with its transcript the clip's codes in context).

The vocoder is the speech tokenizer's decoder (:mod:`.speech_decoder`), in
this process or in code2wav worker processes (``worker_spec``). Nothing is
written into the checkpoint's directory.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from decoder_svc.backend import RequestSpec
from decoder_svc.engine_settings import EffectiveSettings, resolve
from decoder_svc.profile import Profile
from decoder_svc.qwen3_omni.engine import vocoder_placement
from decoder_svc.qwen3_omni.vocoder import StreamingVocoder
from omni_common.errors import InvalidArgumentError

from .backend import INSTRUCT_IDS, REF_CODES, REF_TEXT_IDS, XVECTOR, TTSTalkerBackend
from .checkpoint import TTSCheckpoint
from .layout import head_dim
from .prompt import assistant_text, instruct_text, reference_text
from .speech_decoder import SpeechDecoder

log = logging.getLogger(__name__)

__all__ = ["DESIGNED_VOICE", "SpeechPrompts", "SpeechVocoder", "TTSEngine", "build_engine", "build_stage_backend",
           "stage_settings", "voices_of"]

DESIGNED_VOICE = "default"
"""The one voice of voice_design and base models (described by instructions, or cloned per request)."""


def voices_of(checkpoint: TTSCheckpoint) -> tuple[str, ...]:
    """A request's voice names: the built-in speakers (custom_voice), else ``default``."""
    return tuple(checkpoint.speakers) if checkpoint.kind == "custom_voice" else (DESIGNED_VOICE,)


class SpeechPrompts:
    """Requests' token ids through the checkpoint's tokenizer (no chat template: the turns are
    fixed), and a cloned voice's features: from the request's reference clip, or a registered
    voice's (``voices``, a ``.voices.VoiceStore``; ``encoder``: the clip encoders, ``base`` only)."""

    def __init__(self, checkpoint: TTSCheckpoint, *, max_model_len: int = 0, voices: Any = None,
                 encoder: Any = None) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(checkpoint.path))
        self.kind = checkpoint.kind
        self.max_model_len = max_model_len  # the talker's context (0: unknown yet)
        self.voices = voices
        self.encoder = encoder
        self._lock = threading.Lock()  # fast tokenizers are not re-entrant

    def tokens(self, text: str) -> list[int]:
        with self._lock:
            return [int(t) for t in self.tokenizer(text, add_special_tokens=False)["input_ids"]]

    def prepare(self, spec: RequestSpec) -> RequestSpec:
        if not spec.prompt.strip():
            raise InvalidArgumentError("text", "has no tokens to speak")
        ids = self.tokens(assistant_text(spec.prompt))
        cond = dict(spec.conditioning or {})
        if spec.instructions:
            if self.kind == "base":
                raise InvalidArgumentError("instructions", "a voice-clone model takes no instructions")
            instruct = self.tokens(instruct_text(spec.instructions))
            cond[INSTRUCT_IDS] = torch.tensor(instruct, dtype=torch.long)
        context = self._clone(spec, cond)
        n = len(ids) + sum(int(cond[k].numel()) for k in (INSTRUCT_IDS, REF_TEXT_IDS) if k in cond)
        n += 0 if context is None else int(context.shape[0])
        if self.max_model_len and n + 16 >= self.max_model_len:
            raise InvalidArgumentError("text", f"is {n} tokens with the instruction and the voice's reference; the "
                                               f"talker's context is {self.max_model_len}")
        return dataclasses.replace(spec, prompt_token_ids=ids, reply_token_ids=[], conditioning=cond,
                                   audio_context=context, reference_audio=None)

    def _clone(self, spec: RequestSpec, cond: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """A cloned voice's conditioning into ``cond``; returns the reference codes the vocoder
        decodes first (an in-context clone), or None."""
        if self.kind != "base":
            if spec.reference_audio is not None:
                raise InvalidArgumentError("reference_audio", f"this model ({self.kind}) does not clone voices; "
                                                              "a voice-clone (base) model does")
            return None
        if XVECTOR in cond and spec.reference_audio is None:  # features given already (in process: tests, tools)
            return cond.get(REF_CODES)
        if spec.reference_audio is not None:
            from omni_common.media import decode_audio

            limits = self.voices.limits if self.voices is not None else None
            clip = decode_audio(spec.reference_audio, rate=24_000,
                                max_seconds=limits.max_seconds if limits is not None else 30.0)
            if self.voices is not None:
                self.voices.check_clip(clip, f"{spec.reference_audio.field}.data")
                transcript = self.voices.check_transcript(spec.reference_text)
            else:
                transcript = spec.reference_text.strip()
            xvector, codes = self.encoder.x_vector(clip), self.encoder.codes(clip) if transcript else None
        elif self.voices is not None and self.voices.has(spec.voice):
            features = self.voices.features(spec.voice)
            xvector, codes, transcript = features.xvector, features.codes, features.transcript
        else:
            raise InvalidArgumentError("reference_audio", "a voice-clone model speaks in a voice cloned from a "
                                                          "reference clip: send one, or name a registered voice")
        cond[XVECTOR] = xvector
        if codes is None:
            return None
        cond[REF_CODES] = codes
        cond[REF_TEXT_IDS] = torch.tensor(self.tokens(reference_text(transcript)), dtype=torch.long)
        return codes


class SpeechVocoder(StreamingVocoder):
    """The speech tokenizer's decoder behind the generation stage's streaming
    interface, built from the checkpoint directory alone (read only): what a
    code2wav worker process rebuilds from ``worker_spec()``. No voice aliases:
    OpenAI's names map to Qwen3-Omni's speakers only."""

    FACTORY = "decoder_svc.qwen3_tts.engine:SpeechVocoder"

    def __init__(self, model_dir: str, voices: Sequence[str], checkpoint: TTSCheckpoint | None = None, *,
                 device: str = "cpu", dtype: str = "float32") -> None:
        if checkpoint is None:
            checkpoint = TTSCheckpoint.open(model_dir)
        model = SpeechDecoder.from_config_and_tensors(
            checkpoint.speech_config["decoder_config"], checkpoint.speech_tensors("decoder."), prefix="decoder.",
            device=str(device), dtype=getattr(torch, str(dtype)))
        self._setup(model, str(checkpoint.path), voices, device, dtype, {})


def stage_settings(checkpoint: TTSCheckpoint, stage: Any, *, platform: str | None = None, log_notes: bool = True,
                   **given: Any) -> EffectiveSettings:
    """The talker's engine settings on `checkpoint` (as ``qwen3_omni.engine.stage_settings``)."""
    settings = dataclasses.replace(stage.engine, **{k: v for k, v in given.items() if v is not None})
    talker = checkpoint.talker_config
    dtype = talker.get("torch_dtype") or talker.get("dtype") or checkpoint.config.get("torch_dtype") \
        or checkpoint.config.get("dtype") or "bfloat16"
    if platform is None:
        from decoder_svc.vllm_engine.engine_factory import engine_platform

        platform = engine_platform()
    kv = 2 * int(talker["num_hidden_layers"]) * int(talker["num_key_value_heads"]) * head_dim(talker)
    eff = resolve(settings, stage=stage.name, platform=platform, checkpoint_dtype=str(dtype),
                  checkpoint_context=int(talker.get("max_position_embeddings", 32768)), kv_elements_per_token=kv)
    if log_notes:
        for note in eff.notes:
            log.info("stage %s: %s", stage.name, note)
    return eff


def build_stage_backend(checkpoint: TTSCheckpoint, stage: Any, *, max_num_seqs: int | None = None, seed: int = 0,
                        max_model_len: int | None = None, **backend_kwargs: Any) -> TTSTalkerBackend:
    """The talker's backend (its vLLM engine) on an opened checkpoint."""
    role = stage.engine_role or stage.name
    if role != "talker":
        raise InvalidArgumentError(f"stages[{stage.stage_id}].engine_role",
                                   f"a Qwen3-TTS model has a talker only, got {role!r}")
    settings = stage_settings(checkpoint, stage, max_num_seqs=max_num_seqs, max_model_len=max_model_len)
    return TTSTalkerBackend(
        checkpoint, name=stage.name, seed=seed, async_scheduling=stage.async_scheduling,
        enable_prefix_caching=stage.enable_prefix_caching, engine_settings=settings,
        **{**stage.engine_args(), **backend_kwargs},
    )


def make_prompts(checkpoint: TTSCheckpoint, *, max_model_len: int, voice_dir: str | Path = "") -> SpeechPrompts:
    """The prompts, with the voice registry and the clip encoders of a voice-clone (base) model."""
    if checkpoint.kind != "base":
        return SpeechPrompts(checkpoint, max_model_len=max_model_len)
    from decoder_svc.qwen3_omni.cache import model_cache_root

    from .voice_features import VoiceEncoder
    from .voices import VoiceStore

    encoder = VoiceEncoder(checkpoint)

    def encode(clip: np.ndarray, with_codes: bool) -> tuple[Any, Any]:
        return encoder.x_vector(clip), encoder.codes(clip) if with_codes else None

    root = Path(voice_dir) if voice_dir else model_cache_root() / "voices"
    if root.resolve() == checkpoint.path or checkpoint.path in root.resolve().parents:
        raise InvalidArgumentError("voice_dir", f"{root} is inside the model's directory, which is never written")
    try:
        store = VoiceStore(root, fingerprint=checkpoint.fingerprint(), encode=encode, reserved=voices_of(checkpoint))
    except OSError as exc:
        raise InvalidArgumentError("voice_dir", f"cannot use {root} for the voice registry: {exc}") from exc
    log.info("voice registry: %s (%d voices)", store.root, len(store.names()))
    return SpeechPrompts(checkpoint, max_model_len=max_model_len, voices=store, encoder=encoder)


@dataclass
class TTSEngine:
    checkpoint: TTSCheckpoint
    backends: dict[str, Any]
    vocoder: SpeechVocoder
    prompts: SpeechPrompts

    def prepare(self, spec: RequestSpec) -> RequestSpec:
        return self.prompts.prepare(spec)

    def close(self) -> None:
        for b in self.backends.values():
            b.close()


def check_profile(profile: Profile) -> None:
    """A Qwen3-TTS model speaks text: its profile's AR stages are one talker."""
    roles = [s.engine_role or s.name for s in profile.ar_stages]
    if roles != ["talker"]:
        raise InvalidArgumentError("profile", f"a Qwen3-TTS model serves the tts profile (a talker, then code2wav); "
                                              f"profile {profile.name!r} has AR stages {roles}")


def make_vocoder(checkpoint: TTSCheckpoint, profile: Profile) -> SpeechVocoder:
    device, dtype = vocoder_placement(profile, log_it=True)
    return SpeechVocoder(str(checkpoint.path), voices_of(checkpoint), checkpoint=checkpoint, device=device,
                         dtype=dtype)


def build_engine(profile: Profile, checkpoint: TTSCheckpoint, *, max_num_seqs: int | None = None, seed: int = 0,
                 max_model_len: int | None = None, voice_dir: str | Path = "", **backend_kwargs: Any) -> TTSEngine:
    """The talker's backend in this process, the vocoder and the prompts."""
    check_profile(profile)
    stage = profile.ar_stages[0]
    backend = build_stage_backend(checkpoint, stage, max_num_seqs=max_num_seqs, seed=seed,
                                  max_model_len=max_model_len, **backend_kwargs)
    try:
        vocoder = make_vocoder(checkpoint, profile)
        prompts = make_prompts(checkpoint, max_model_len=backend.max_model_len, voice_dir=voice_dir)
    except BaseException:
        backend.close()
        raise
    return TTSEngine(checkpoint, {stage.name: backend}, vocoder, prompts)
