"""The Qwen3-TTS talker on vLLM: Qwen3-Omni's talker backend with this family's prompts.

The talker model is Qwen3-Omni's (``decoder_svc.qwen3_omni.talker``, one
implementation): a dense MLP instead of the MoE, the text rows projected
from its own text embeddings, the code predictor behind its input
projection (:func:`talker_config_view` says so in the view's config). What
differs is the request's prompt (:mod:`.prompt`): the text to speak, the
voice (a built-in speaker, an instruction describing one, or a cloned
voice's x-vector and reference codes) and the language. The whole text is
known when a request starts, so it never streams input.

Per-request inputs beyond the text (``RequestSpec.conditioning``, built by
the family's request preparation, :mod:`.engine`):

- ``tts_instruct_ids`` [n] int64: the instruction's ids (:func:`.prompt.instruct_text`);
- ``tts_xvector`` [H] float32: a cloned voice's speaker embedding;
- ``tts_ref_codes`` [F, G] int64 and ``tts_ref_text_ids`` [m] int64: an
  in-context clone's reference clip codes and transcript ids;
- ``tts_text_streaming`` (a bool scalar): lay the text out as streamed (its
  first token in the prompt, one more each step) or whole; by default as
  the reference does for the kind (streamed for clones, whole otherwise).

The request's ``language`` (``""`` or ``auto``: none) picks the codec
language id; a built-in speaker with a dialect speaks it for Chinese and
``auto``, as the reference does.
"""

from __future__ import annotations

from typing import Any

import torch

from decoder_svc.backend import RequestSpec
from decoder_svc.qwen3_omni.backends import TalkerBackend, _float32_rows, talker_sampling
from decoder_svc.qwen3_omni.talker import TALKER_ARCH
from decoder_svc.qwen3_omni.views import TALKER_PREFIX, TALKER_VIEW, StageView, build_view
from omni_common.errors import FailedPreconditionError, InvalidArgumentError

from .checkpoint import TTSCheckpoint
from .layout import head_dim
from .prompt import TTSIds, VoicePrompt, build_prompt

__all__ = ["TTSTalkerBackend", "talker_config_view", "talker_view", "INSTRUCT_IDS", "XVECTOR", "REF_CODES",
           "REF_TEXT_IDS", "TEXT_STREAMING"]

INSTRUCT_IDS = "tts_instruct_ids"
XVECTOR = "tts_xvector"
REF_CODES = "tts_ref_codes"
REF_TEXT_IDS = "tts_ref_text_ids"
TEXT_STREAMING = "tts_text_streaming"
# The reference's talker never ends before its second frame (min_new_tokens).
MIN_FRAMES = 2


def talker_config_view(config: dict[str, Any]) -> dict[str, Any]:
    """config.json for vLLM: the talker as a dense ``qwen3`` model, and what
    the talker model needs beyond it (``omni_talker``). The talker's M-RoPE
    sees the same position on its three axes (text only), so it is the plain
    rotary embedding: vLLM gets no mrope keys."""
    t = config["talker_config"]
    rope = dict(t.get("rope_parameters") or t.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta", t.get("rope_theta", 10000.0)))
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "hidden_act")
    view: dict[str, Any] = {k: t[k] for k in keys if k in t}
    cp = dict(t["code_predictor_config"])
    cp["input_size"] = int(t["hidden_size"])  # its embeddings are at the talker's width
    view.update(
        model_type="qwen3",
        architectures=[TALKER_ARCH],
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        tie_word_embeddings=False,
        attention_bias=False,
        dtype="float32",
        head_dim=head_dim(t),
        omni_talker={
            "num_code_groups": int(t["num_code_groups"]),
            "codec_eos_token_id": int(t["codec_eos_token_id"]),
            "code_predictor_config": cp,
            "text_projection": [int(t["text_hidden_size"]), int(t["text_hidden_size"])],
            "dense_mlp": True,
        },
    )
    return view


def talker_view(checkpoint: TTSCheckpoint) -> StageView:
    """The view the talker's vLLM engine loads (in the model cache, keyed by the checkpoint)."""
    return build_view(checkpoint, TALKER_VIEW, talker_config_view(checkpoint.config), TALKER_PREFIX)


class TTSTalkerBackend(TalkerBackend):
    """The Qwen3-TTS talker (see the module docstring)."""

    streams_input = False
    min_input_tokens = 0

    def _read_checkpoint(self, checkpoint: Any) -> None:
        self.ids = TTSIds.from_config(checkpoint.config)
        self.speakers = checkpoint.speakers
        self.languages = checkpoint.languages
        self.kind = checkpoint.kind
        # style instructions: a speaker's (custom_voice) or the voice described (voice_design)
        self.speech_instructions = self.kind != "base"
        talker = checkpoint.talker_config
        self._all_languages = {str(k).lower(): int(v) for k, v in talker["codec_language_id"].items()}
        self._dialects = {str(k).lower(): v for k, v in talker["spk_is_dialect"].items()}
        self.end_ids = frozenset()
        self.sampling = talker_sampling(checkpoint.generation_config, {
            "temperature": ("temperature", 0.9), "repetition_penalty": ("repetition_penalty", 1.05),
            "top_k": ("top_k", 50), "top_p": ("top_p", 1.0), "code_predictor_top_k": ("subtalker_top_k", 50),
            "code_predictor_top_p": ("subtalker_top_p", 1.0), "code_predictor_temperature": ("subtalker_temperature", 0.9)})

    def _configure(self, role: str | None) -> None:
        talker = self.checkpoint.talker_config
        self._talker_facts(talker_view(self.checkpoint).path, talker, talker)  # (one config: no text_config)

    def _load_host_tables(self) -> None:
        name = "talker.model.text_embedding.weight"
        self._embed_table = self.checkpoint.tensors(name)[name]

    # -- prompts ---------------------------------------------------------------------
    def language_id(self, language: str, speaker: str | None) -> int | None:
        """The codec language id of a request (None: ``auto``), a speaker's dialect applied."""
        lang = (language or "auto").lower()
        if lang != "auto" and lang not in self.languages:
            raise InvalidArgumentError(
                "language", f"unknown language {language!r}; this model has: auto, {', '.join(sorted(self.languages))}")
        dialect = self._dialects.get(speaker) if speaker else False
        if lang in ("chinese", "auto") and dialect:
            return self._all_languages[str(dialect).lower()]
        return None if lang == "auto" else self.languages[lang]

    def _voice(self, spec: RequestSpec) -> tuple[int | torch.Tensor | None, str | None]:
        """(the prompt's voice slot, the built-in speaker's name or None)."""
        cond = spec.conditioning or {}
        if XVECTOR in cond:
            return cond[XVECTOR].to(torch.float32).reshape(-1), None
        if self.kind == "custom_voice":
            return self.speaker_id(spec.voice), spec.voice.lower()
        if self.kind == "base":
            raise InvalidArgumentError("reference_audio", "a voice-clone model needs a reference clip or a "
                                                          "registered voice")
        return None, None

    def _prompt(self, spec: RequestSpec) -> dict[str, Any]:
        if spec.streaming:
            raise FailedPreconditionError("the Qwen3-TTS talker takes its whole text at the start")
        model = self._model
        cond = spec.conditioning or {}
        table = self._embed_table
        assert table is not None
        device = model.text_projection.linear_fc1.weight.device
        project = _float32_rows(model.text_projection)
        cp = model.code_predictor

        def text_rows(ids: torch.Tensor) -> torch.Tensor:
            return project(torch.nn.functional.embedding(ids, table).to(device=device, dtype=torch.float32))

        def codec_rows(ids: torch.Tensor) -> torch.Tensor:
            return model.embed_input_ids(ids.to(device)).to(torch.float32)

        def frame_rows(codes: torch.Tensor) -> torch.Tensor:
            codes = codes.to(device=device, dtype=torch.long)
            rows = [model.embed_input_ids(codes[:, 0]).to(torch.float32)]
            rows += [torch.nn.functional.embedding(codes[:, g], cp.codec_embedding[g - 1]).to(torch.float32)
                     for g in range(1, codes.shape[1])]
            return torch.stack(rows, dim=1).sum(1)

        speaker, speaker_name = self._voice(spec)
        instruct = cond.get(INSTRUCT_IDS)
        ref_codes = cond.get(REF_CODES)
        ref_text = cond.get(REF_TEXT_IDS)
        voice = VoicePrompt(
            text_ids=list(spec.prompt_token_ids),
            instruct_ids=None if instruct is None else [int(t) for t in instruct.reshape(-1).tolist()],
            language=self.language_id(spec.language, speaker_name),
            speaker=speaker,
            non_streaming=not bool(cond[TEXT_STREAMING]) if TEXT_STREAMING in cond else self.kind != "base",
            ref_text_ids=None if ref_text is None else [int(t) for t in ref_text.reshape(-1).tolist()],
            ref_codes=ref_codes,
        )
        with torch.inference_mode():
            built = build_prompt(self.ids, voice, text_rows, codec_rows, frame_rows)
        self._add_state(spec, int(built.prompt_embeds.shape[0]), built.trailing, built.pad, complete=True)
        return {"prompt_embeds": built.prompt_embeds}

    def _sampling_params(self, spec: RequestSpec):
        params = super()._sampling_params(spec)
        params.min_tokens = MIN_FRAMES
        return params

    def extend_request(self, request_id: str, conditioning: dict[str, torch.Tensor], finished: bool) -> None:
        raise FailedPreconditionError(f"request {request_id!r}: the Qwen3-TTS talker takes no streamed input")
