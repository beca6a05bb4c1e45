"""A Qwen3-Omni checkpoint as the decoder's engine: backends, vocoder, prompts.

:func:`build_engine` opens (and validates) one checkpoint directory and
builds what a deploy profile asks for:

- ``omni`` (thinker -> talker -> code2wav): ``Generate``; the thinker answers
  the user's message (chat template), the talker speaks the answer;
- ``tts`` (talker -> code2wav): ``Speak``; the given text is spoken as is,
  as the assistant's turn of a conversation whose user turn is the same text
  (the talker reads the thinker's embeddings of the text; no thinker runs).

Both read the same checkpoint; nothing is written into its directory.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from decoder_svc.backend import RequestSpec
from decoder_svc.engine_settings import EffectiveSettings, EngineSettings, resolve, resolve_vocoder
from decoder_svc.profile import Profile
from omni_common.conversation import image_parts
from omni_common.errors import FailedPreconditionError, InvalidArgumentError
from omni_common.materialize import sources_of
from omni_common.media import ImageInput

from .backends import THINKER_EMBED, THINKER_HIDDEN, TalkerBackend, ThinkerBackend
from .cache import default_model_dir
from .checkpoint import OmniCheckpoint
from .media_features import MAX_ASPECT_RATIO
from .vocoder import CheckpointVocoder

log = logging.getLogger(__name__)

__all__ = ["Qwen3OmniEngine", "build_engine", "build_front", "build_stage_backend", "EngineFront", "ChatPrompts", "NeuralVocoder"]


class ChatPrompts:
    """Chat prompts through the checkpoint's tokenizer and chat template."""

    def __init__(self, checkpoint: OmniCheckpoint, *, max_model_len: int, speak_max_model_len: int = 0) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(checkpoint.path))
        self.end_of_turn = int(checkpoint.config["im_end_token_id"])
        self.audio_input = getattr(checkpoint, "audio_input", None)  # None: no audio input
        self.image_input = getattr(checkpoint, "image_input", None)  # None: no image input
        thinker = checkpoint.config.get("thinker_config", {})
        self.audio_token = int(thinker.get("audio_token_id", -1))
        self.image_token = int(thinker.get("image_token_id", -2))
        # the first stage's context (a chat prompt's), and the talker's (a
        # text spoken as written; 0: the first stage's)
        self.max_model_len = max_model_len
        self.speak_max_model_len = speak_max_model_len
        self._lock = threading.Lock()  # fast tokenizers are not re-entrant

    def _user_prompt(self, text: str, instructions: str = "") -> list[int]:
        messages = [{"role": "user", "content": text}]
        if instructions:  # Qwen3-Omni style: the instructions are the system turn
            messages.insert(0, {"role": "system", "content": instructions})
        return self._render(messages)

    def _render(self, messages: list[dict[str, Any]]) -> list[int]:
        """The conversation's ids through the chat template, the assistant's turn opened."""
        with self._lock:
            out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = out if isinstance(out, list) else out["input_ids"]
        return [int(t) for t in ids]

    def _tokens(self, text: str) -> list[int]:
        with self._lock:
            return [int(t) for t in self.tokenizer(text, add_special_tokens=False)["input_ids"]]

    def _check_length(self, n: int, max_tokens: int, field: str, context: int = 0) -> None:
        context = context or self.max_model_len
        if n >= context:
            raise InvalidArgumentError(
                field,
                f"is {n} tokens with the chat template; the model's context is {context}",
            )
        if n + max_tokens > context:
            raise InvalidArgumentError(
                "sampling_params.max_tokens",
                f"{max_tokens} plus the prompt's {n} tokens exceeds the model's context of {context}",
            )

    def speak(self, spec: RequestSpec) -> RequestSpec:
        """The text as the assistant's reply (tts profile; a ``verbatim`` request)."""
        reply = self._tokens(spec.prompt)
        if not reply:
            raise InvalidArgumentError("text", "has no tokens to speak")
        prompt = self._user_prompt(spec.prompt)
        self._check_length(len(prompt) + len(reply), 0, "text", self.speak_max_model_len)
        return dataclasses.replace(
            spec, prompt_token_ids=prompt, reply_token_ids=reply + [self.end_of_turn]
        )

    def chat(self, spec: RequestSpec) -> RequestSpec:
        """The request's conversation through the chat template, every turn
        in order (omni profile); or its text as the user's message, after a
        system turn holding its instructions, if any. Media placeholders are
        expanded (:meth:`_expand`)."""
        if spec.messages:
            prompt = self._render([{"role": role, "content": _template_content(content)}
                                   for role, content in spec.messages])
            if spec.audio or spec.images:
                spec = self._expand(prompt, spec)
                prompt = spec.prompt_token_ids
        else:
            prompt = self._user_prompt(spec.prompt, spec.instructions)
        self._check_length(len(prompt), spec.max_tokens, "messages" if spec.messages else "prompt")
        return dataclasses.replace(spec, prompt_token_ids=prompt)

    def _expand(self, prompt: list[int], spec: RequestSpec) -> RequestSpec:
        """``spec`` with the prompt whose media placeholders (one token per part,
        where the chat template put it) are each repeated as many times as the
        part has tokens: the ids the thinker's positions follow. Clips are
        padded to whole feature frames (the count the audio tower and the
        reference processor agree on); each image's patch grid is recorded
        (``image_grids``: the talker's 3-D positions)."""
        import numpy as np

        clips, images = spec.audio, spec.images
        audio, vision = self.audio_input, self.image_input
        if (clips and audio is None) or (images and vision is None):  # refused before this (DeploymentSettings)
            raise FailedPreconditionError("this model takes no such media input (its preprocessor_config.json)")
        counts: list[int] = []
        if clips:
            clips = tuple(np.pad(c, (0, -len(c) % audio.hop)) for c in clips)  # type: ignore[union-attr]
            counts += [audio.tokens(len(c)) for c in clips]  # type: ignore[union-attr]
        grids: list[tuple[int, int, int]] = []
        for part, image in zip(image_parts(spec.messages), images, strict=True):
            height, width = int(image.shape[0]), int(image.shape[1])
            if max(height, width) > MAX_ASPECT_RATIO * min(height, width):
                raise InvalidArgumentError(
                    f"{part.field}.data", f"is {width}x{height}: its long side may be at most {MAX_ASPECT_RATIO} times "
                                          "its short side")
            grids.append(vision.grid(height, width))  # type: ignore[union-attr]
        if prompt.count(self.audio_token) != len(clips) or prompt.count(self.image_token) != len(images):
            raise InvalidArgumentError(
                "messages", "the prompt's media placeholders do not match its media parts: a text part may not "
                            "contain the model's audio or image token")
        tokens = {self.audio_token: iter(counts),
                  self.image_token: iter(t * h * w // vision.merge ** 2 for t, h, w in grids)}  # type: ignore[union-attr]
        out: list[int] = []
        for t in prompt:
            out += [t] * next(tokens[t]) if t in tokens else [t]
        return dataclasses.replace(spec, prompt_token_ids=out, audio=clips, image_grids=tuple(grids))


def _template_content(content: Any) -> Any:
    """A turn's content as the chat template takes it: its text, or its parts
    (text, and media parts as ``{"type": "audio"}`` / ``{"type": "image"}``:
    the template writes their placeholders)."""
    if isinstance(content, str):
        return content
    return [{"type": "text", "text": p} if isinstance(p, str)
            else {"type": "image" if isinstance(p, ImageInput) else "audio"} for p in content]


# The checkpoint's Code2Wav behind the generation stage's streaming interface
# (stateful: each chunk decodes only its new frames); also what a code2wav
# worker process rebuilds (its worker_spec()).
NeuralVocoder = CheckpointVocoder


@dataclass
class Qwen3OmniEngine:
    checkpoint: OmniCheckpoint
    backends: dict[str, Any]
    vocoder: NeuralVocoder
    prompts: ChatPrompts

    def prepare(self, spec: RequestSpec) -> RequestSpec:
        first = next(iter(self.backends.values()))
        if isinstance(first, ThinkerBackend) and not spec.verbatim:
            return self.prompts.chat(spec)
        return self.prompts.speak(spec)

    def close(self) -> None:
        for b in self.backends.values():
            b.close()


def stage_settings(checkpoint: OmniCheckpoint, stage, *, platform: str | None = None, log_notes: bool = True,
                   **given: Any) -> EffectiveSettings:
    """The engine settings `stage` is built with on `checkpoint`: its
    profile's (with the deployment's overrides) and `given` (keyword
    arguments of a caller: max_num_seqs, max_model_len), resolved against the
    checkpoint and the platform (``decoder_svc.engine_settings.resolve``)."""
    role = stage.engine_role or stage.name
    settings = dataclasses.replace(stage.engine, **{k: v for k, v in given.items() if v is not None})
    cfg = checkpoint.thinker_config if role == "thinker" else checkpoint.talker_config
    text = cfg["text_config"]
    kv_elements = kv_elements_per_token(checkpoint, role)
    dtype = (text.get("torch_dtype") or text.get("dtype") or cfg.get("torch_dtype")
             or checkpoint.config.get("torch_dtype") or checkpoint.config.get("dtype") or "bfloat16")
    if platform is None:
        from decoder_svc.vllm_engine.engine_factory import engine_platform

        platform = engine_platform()
    eff = resolve(settings, stage=stage.name, platform=platform, checkpoint_dtype=str(dtype),
                  checkpoint_context=int(text["max_position_embeddings"]), kv_elements_per_token=kv_elements)
    if log_notes:
        for note in eff.notes:
            log.info("stage %s: %s", stage.name, note)
    return eff


def kv_elements_per_token(checkpoint: OmniCheckpoint, role: str) -> int:
    """KV cache elements one token takes in `role`'s engine: keys and values of every layer."""
    text = (checkpoint.thinker_config if role == "thinker" else checkpoint.talker_config)["text_config"]
    heads = int(text["num_attention_heads"])
    head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
    return 2 * int(text["num_hidden_layers"]) * int(text.get("num_key_value_heads") or heads) * head_dim


def _feeds_talker(stage) -> bool:
    return bool(sources_of(stage.plan()) & {THINKER_EMBED, THINKER_HIDDEN})


def build_stage_backend(
    checkpoint: OmniCheckpoint,
    stage,
    *,
    max_num_seqs: int | None = None,
    seed: int = 0,
    max_model_len: int | None = None,
    **backend_kwargs: Any,
):
    """One AR stage's backend (its vLLM engine) on an opened checkpoint: what
    :func:`build_engine` builds per stage, and what a stage process builds
    for its own stage (``decoder_svc.stage.host``). Its engine settings:
    :func:`stage_settings` (`max_num_seqs`, `max_model_len`: over the
    stage's own when given)."""
    role = stage.engine_role or stage.name
    settings = stage_settings(checkpoint, stage, max_num_seqs=max_num_seqs, max_model_len=max_model_len)
    common = dict(
        name=stage.name,
        seed=seed,
        async_scheduling=stage.async_scheduling,
        enable_prefix_caching=stage.enable_prefix_caching,
        engine_settings=settings,
        # the stage's parallelism, unless given
        **{**stage.engine_args(), **backend_kwargs},
    )
    if role == "thinker":
        return ThinkerBackend(checkpoint, capture_talker_inputs=_feeds_talker(stage), **common)
    if role == "talker":
        return TalkerBackend(checkpoint, **common)
    raise InvalidArgumentError(
        f"stages[{stage.stage_id}].engine_role", f"'thinker' or 'talker', got {role!r}"
    )


@dataclass
class EngineFront:
    """What the decoder's own process needs of the checkpoint when the AR
    stages' engines run in their own processes: the vocoder (code2wav, and
    its facts) and the prompts."""

    checkpoint: OmniCheckpoint
    vocoder: NeuralVocoder
    prompts: ChatPrompts
    first_role: str

    def prepare(self, spec: RequestSpec) -> RequestSpec:
        if self.first_role == "thinker" and not spec.verbatim:
            return self.prompts.chat(spec)
        return self.prompts.speak(spec)


def speaking_context(profile: Profile, backends: dict[str, Any]) -> int:
    """The context of the profile's talker (a text spoken as written starts
    there); 0 without one."""
    talker = next((s for s in profile.ar_stages if (s.engine_role or s.name) == "talker"), None)
    return int(backends[talker.name].max_model_len) if talker is not None else 0


def _speakers(checkpoint: OmniCheckpoint) -> tuple[str, ...]:
    return tuple(str(k).lower() for k in checkpoint.talker_config["speaker_id"])


def vocoder_placement(profile: Profile, *, log_it: bool = False, platform: str | None = None) -> tuple[str, str]:
    """(device, dtype) of the profile's generation stage (code2wav): its
    ``engine:`` device and dtype, resolved for this process (or for
    `platform`: "cpu", "cuda") (``decoder_svc.engine_settings.resolve_vocoder``)."""
    if platform is None:
        import torch

        platform = "cuda" if torch.cuda.is_available() else "cpu"
    gen = next((s for s in profile.stages if s.kind == "generation"), None)
    name = gen.name if gen is not None else "code2wav"
    placement = resolve_vocoder(gen.engine if gen is not None else EngineSettings(), stage=name,
                                platform=platform)
    if log_it:
        log.info("stage %s: code2wav on %s in %s", name, *placement)
    return placement


def _vocoder(checkpoint: OmniCheckpoint, profile: Profile) -> CheckpointVocoder:
    device, dtype = vocoder_placement(profile, log_it=True)
    return NeuralVocoder(str(checkpoint.path), _speakers(checkpoint), checkpoint=checkpoint, device=device, dtype=dtype)


def build_front(profile: Profile, model: str | Path | None = None, *, max_model_len: int = 0) -> EngineFront:
    """Open the checkpoint (default: the tiny one in the model cache, created
    on first use) and build the vocoder and the prompts, no engine. The
    prompts' context is the first AR stage's (``prompts.max_model_len``: set
    it once the stage says its effective one; 0 until then)."""
    checkpoint = OmniCheckpoint.open(Path(model) if model else default_model_dir())
    log.info("serving %s (%s)", checkpoint.path, checkpoint.config.get("architectures"))
    first = profile.ar_stages[0]
    return EngineFront(
        checkpoint,
        _vocoder(checkpoint, profile),
        ChatPrompts(checkpoint, max_model_len=max_model_len),
        first.engine_role or first.name,
    )


def build_engine(
    profile: Profile,
    model: str | Path | None = None,
    *,
    max_num_seqs: int | None = None,
    seed: int = 0,
    max_model_len: int | None = None,
    **backend_kwargs: Any,
) -> Qwen3OmniEngine:
    """Open the checkpoint (default: the tiny one in the model cache, created
    on first use) and build one backend per AR stage of the profile (with
    its engine settings; `max_num_seqs` and `max_model_len` win when given)."""
    path = Path(model) if model else default_model_dir()
    checkpoint = OmniCheckpoint.open(path)
    log.info("serving %s (%s)", checkpoint.path, checkpoint.config.get("architectures"))
    backends: dict[str, Any] = {}
    try:
        for stage in profile.ar_stages:
            backends[stage.name] = build_stage_backend(
                checkpoint, stage, max_num_seqs=max_num_seqs, seed=seed, max_model_len=max_model_len,
                **backend_kwargs,
            )
        vocoder = _vocoder(checkpoint, profile)
        prompts = ChatPrompts(checkpoint, max_model_len=backends[profile.ar_stages[0].name].max_model_len,
                              speak_max_model_len=speaking_context(profile, backends))
    except BaseException:
        for b in backends.values():
            b.close()
        raise
    return Qwen3OmniEngine(checkpoint, backends, vocoder, prompts)
