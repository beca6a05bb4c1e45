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
from decoder_svc.profile import Profile
from omni_common.errors import InvalidArgumentError
from omni_common.materialize import sources_of

from .backends import THINKER_EMBED, THINKER_HIDDEN, TalkerBackend, ThinkerBackend
from .cache import default_model_dir
from .checkpoint import OmniCheckpoint
from .vocoder import CheckpointVocoder

log = logging.getLogger(__name__)

__all__ = ["Qwen3OmniEngine", "build_engine", "build_front", "build_stage_backend", "EngineFront", "ChatPrompts", "NeuralVocoder"]


class ChatPrompts:
    """Chat prompts through the checkpoint's tokenizer and chat template."""

    def __init__(self, checkpoint: OmniCheckpoint, *, max_model_len: int) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(checkpoint.path))
        self.end_of_turn = int(checkpoint.config["im_end_token_id"])
        self.max_model_len = max_model_len
        self._lock = threading.Lock()  # fast tokenizers are not re-entrant

    def _user_prompt(self, text: str, instructions: str = "") -> list[int]:
        messages = [{"role": "user", "content": text}]
        if instructions:  # Qwen3-Omni style: the instructions are the system turn
            messages.insert(0, {"role": "system", "content": instructions})
        with self._lock:
            out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = out if isinstance(out, list) else out["input_ids"]
        return [int(t) for t in ids]

    def _tokens(self, text: str) -> list[int]:
        with self._lock:
            return [int(t) for t in self.tokenizer(text, add_special_tokens=False)["input_ids"]]

    def _check_length(self, n: int, max_tokens: int, field: str) -> None:
        if n >= self.max_model_len:
            raise InvalidArgumentError(
                field,
                f"is {n} tokens with the chat template; the model's context is {self.max_model_len}",
            )
        if n + max_tokens > self.max_model_len:
            raise InvalidArgumentError(
                "sampling_params.max_tokens",
                f"{max_tokens} plus the prompt's {n} tokens exceeds the model's context of {self.max_model_len}",
            )

    def speak(self, spec: RequestSpec) -> RequestSpec:
        """The text as the assistant's reply (tts profile)."""
        reply = self._tokens(spec.prompt)
        if not reply:
            raise InvalidArgumentError("text", "has no tokens to speak")
        prompt = self._user_prompt(spec.prompt)
        self._check_length(len(prompt) + len(reply), 0, "text")
        return dataclasses.replace(
            spec, prompt_token_ids=prompt, reply_token_ids=reply + [self.end_of_turn]
        )

    def chat(self, spec: RequestSpec) -> RequestSpec:
        """The text as the user's message (omni profile), after a system turn
        holding the request's instructions, if any."""
        prompt = self._user_prompt(spec.prompt, spec.instructions)
        self._check_length(len(prompt), spec.max_tokens, "prompt")
        return dataclasses.replace(spec, prompt_token_ids=prompt)


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
        if isinstance(first, ThinkerBackend):
            return self.prompts.chat(spec)
        return self.prompts.speak(spec)

    def close(self) -> None:
        for b in self.backends.values():
            b.close()


def build_stage_backend(
    checkpoint: OmniCheckpoint,
    stage,
    *,
    max_num_seqs: int = 32,
    seed: int = 0,
    max_model_len: int = 2048,
    **backend_kwargs: Any,
):
    """One AR stage's backend (its vLLM engine) on an opened checkpoint: what
    :func:`build_engine` builds per stage, and what a stage process builds
    for its own stage (``decoder_svc.stage.host``)."""
    role = stage.engine_role or stage.name
    common = dict(
        name=stage.name,
        max_num_seqs=max_num_seqs,
        seed=seed,
        async_scheduling=stage.async_scheduling,
        enable_prefix_caching=stage.enable_prefix_caching,
        max_model_len=max_model_len,
        # the stage's parallelism, unless given
        **{**stage.engine_args(), **backend_kwargs},
    )
    if role == "thinker":
        wants = sources_of(stage.plan())
        return ThinkerBackend(
            checkpoint,
            capture_talker_inputs=bool(wants & {THINKER_EMBED, THINKER_HIDDEN}),
            **common,
        )
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
        if self.first_role == "thinker":
            return self.prompts.chat(spec)
        return self.prompts.speak(spec)


def _speakers(checkpoint: OmniCheckpoint) -> tuple[str, ...]:
    return tuple(str(k).lower() for k in checkpoint.talker_config["speaker_id"])


def build_front(profile: Profile, model: str | Path | None = None, *, max_model_len: int = 2048) -> EngineFront:
    """Open the checkpoint (default: the tiny one in the model cache, created
    on first use) and build the vocoder and the prompts, no engine."""
    checkpoint = OmniCheckpoint.open(Path(model) if model else default_model_dir())
    log.info("serving %s (%s)", checkpoint.path, checkpoint.config.get("architectures"))
    first = profile.ar_stages[0]
    return EngineFront(
        checkpoint,
        NeuralVocoder(str(checkpoint.path), _speakers(checkpoint), checkpoint=checkpoint),
        ChatPrompts(checkpoint, max_model_len=max_model_len),
        first.engine_role or first.name,
    )


def build_engine(
    profile: Profile,
    model: str | Path | None = None,
    *,
    max_num_seqs: int = 32,
    seed: int = 0,
    max_model_len: int = 2048,
    **backend_kwargs: Any,
) -> Qwen3OmniEngine:
    """Open the checkpoint (default: the tiny one in the model cache, created
    on first use) and build one backend per AR stage of the profile."""
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
        vocoder = NeuralVocoder(str(checkpoint.path), _speakers(checkpoint), checkpoint=checkpoint)
        prompts = ChatPrompts(checkpoint, max_model_len=max_model_len)
    except BaseException:
        for b in backends.values():
            b.close()
        raise
    return Qwen3OmniEngine(checkpoint, backends, vocoder, prompts)
