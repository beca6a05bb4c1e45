"""Qwen3-Omni's AR stages on vLLM: the thinker and the talker.

Both are :class:`decoder_svc.vllm_engine.backend.VLLMBackend` s (step
alignment, row selection, snapshots) with the model-specific parts:

- :class:`ThinkerBackend`: vLLM's own Qwen3-Omni thinker on the checkpoint
  directory as given. Prompts arrive tokenized (the chat template is applied
  by :class:`.chat.ChatPrompts`). Each step also captures, per scheduled
  token, the thinker's input embedding (``thinker_embed``) and the hidden
  state after ``accept_hidden_layer`` layers (``thinker_hidden``): what the
  talker needs, routed by the profile. With ``tensor_parallel_size > 1``
  the runner lives in vLLM's worker processes: the layer hooks are installed
  in the worker of TP rank 0 (:func:`_install_rows_in_worker`, run there by
  ``collective_rpc``) and its rows come back with each step's capture
  (:class:`decoder_svc.vllm_engine.capture.WorkerCapture`). A layer's
  output is complete on every TP rank (each layer ends in an all-reduce).
- :class:`TalkerBackend`: the talker (:mod:`.talker`) on a config view in the
  model cache. A request's prompt embeddings are built from the thinker's
  side of the conversation (:mod:`.prompt`): from the captured thinker rows
  (``Generate`` on the omni profile) or, for text given to be spoken as is
  (``Speak``, the tts profile), from the thinker's embedding table. It can
  start from the first rows of the thinker's reply (``RequestSpec.streaming``)
  and take the rest as the thinker produces it (:meth:`TalkerBackend.extend_request`);
  a request whose next step needs a row still to come is held meanwhile
  (``VLLMBackend``, "Streamed input"). The codes are the same as when it
  starts from the whole reply.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from decoder_svc.backend import RequestSpec
from decoder_svc.profile import IN_PROCESS_RUNNER
from decoder_svc.vllm_engine.backend import VLLMBackend
from decoder_svc.vllm_engine.capture import StepCapture, add_worker_extra, is_capturing_rank
from decoder_svc.vllm_engine.engine_factory import get_model_runner, runs_in_process
from omni_common.errors import FailedPreconditionError, InvalidArgumentError

from .checkpoint import OmniCheckpoint
from .prompt import TalkerIds, TalkerPromptBuilder
from .talker import TalkerRequestState, register
from .views import talker_view

log = logging.getLogger(__name__)

__all__ = [
    "ThinkerBackend",
    "TalkerBackend",
    "THINKER_EMBED",
    "THINKER_HIDDEN",
    "THINKER_TOKEN_IDS",
    "prepare_vllm",
]

THINKER_EMBED = "thinker_embed"
THINKER_HIDDEN = "thinker_hidden"
THINKER_TOKEN_IDS = "thinker_token_ids"
THINKER_ARCH = "Qwen3OmniMoeForConditionalGeneration"
# vLLM's per-prompt audio and image limits (they size the encoder budget at
# start; the deployment's own, DeploymentLimits.max_input_*_parts, are checked first)
MAX_MEDIA_PARTS = 16


def prepare_vllm() -> None:
    """Register the architectures in this process (no inspection subprocess)."""
    from vllm import ModelRegistry
    from vllm.model_executor.models.qwen3_omni_moe_thinker import (
        Qwen3OmniMoeThinkerForConditionalGeneration,
    )

    from omni_common import torchvision_compat

    torchvision_compat.install()  # before vLLM imports transformers' image code

    ModelRegistry.register_model(THINKER_ARCH, Qwen3OmniMoeThinkerForConditionalGeneration)
    register()


def _float32_rows(module: torch.nn.Module) -> Any:
    """``module`` (a talker projection, in the talker's dtype) taking and
    giving float32 rows: the talker's prompt and text rows stay float32 up to
    its input, where they meet the step's embeddings in the model's dtype
    (``TalkerSlots.step_inputs``; vLLM casts ``prompt_embeds``)."""
    dtype = next(module.parameters()).dtype
    if dtype == torch.float32:
        return module
    return lambda rows: module(rows.to(dtype)).to(torch.float32)


class _ThinkerRows:
    """Forward hooks on the thinker's language model: the step's input
    embeddings and the hidden state after ``layer`` decoder layers."""

    def __init__(self, model: Any, layer: int) -> None:
        lm = model.language_model.model
        self.embeds: torch.Tensor | None = None
        self.hidden: torch.Tensor | None = None
        # The language model's own forward runs without module hooks (vLLM's
        # compile wrapper calls it directly); its first decoder layer's input
        # is the step's input embeddings.
        self._handles = [
            lm.layers[0].register_forward_pre_hook(self._pre, with_kwargs=True),
            lm.layers[layer - 1].register_forward_hook(self._post),
        ]

    def _pre(self, module, args, kwargs):  # noqa: ANN001
        emb = kwargs["hidden_states"] if "hidden_states" in kwargs else args[1]
        self.embeds = emb.detach().to(torch.float32, copy=True)

    def _post(self, module, args, output):  # noqa: ANN001
        hidden, residual = output
        self.hidden = (
            (hidden + residual).detach().to(torch.float32)
            if residual is not None
            else hidden.detach().float()
        )

    def take(self, num_tokens: int) -> dict[str, torch.Tensor]:
        out = {}
        if self.embeds is not None:
            out[THINKER_EMBED] = self.embeds[:num_tokens]
        if self.hidden is not None:
            out[THINKER_HIDDEN] = self.hidden[:num_tokens]
        self.embeds = self.hidden = None
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def _install_rows_in_worker(worker: Any, layer: int) -> bool:
    """Run in each worker process (``collective_rpc``; module level, so it is
    pickled by name): on TP rank 0, hook the thinker's layers and add their
    rows to each kept capture. True where installed."""
    if not is_capturing_rank():
        return False
    rows = _ThinkerRows(worker.model_runner.model, layer)
    add_worker_extra(lambda cap: rows.take(cap.num_tokens))
    return True


class ThinkerBackend(VLLMBackend):
    """vLLM's Qwen3-Omni thinker (see the module docstring)."""

    def __init__(
        self, checkpoint: OmniCheckpoint, *, capture_talker_inputs: bool = False, **kwargs: Any
    ) -> None:
        self.checkpoint = checkpoint
        self.capture_talker_inputs = capture_talker_inputs
        self._rows: _ThinkerRows | None = None
        kwargs.setdefault("capture_hidden", False)
        kwargs.setdefault("pooling_engine", "off")
        super().__init__(checkpoint.path, role="thinker", **kwargs)

    def _configure(self, role: str | None) -> None:
        cfg = self.checkpoint.config
        text = self.checkpoint.thinker_config["text_config"]
        self.engine_dir = self.checkpoint.path
        self.role = "thinker"
        self.hidden_size = int(text["hidden_size"])
        self.vocab_size = int(text["vocab_size"])
        self.eos_token_id = int(cfg["im_end_token_id"])
        self.num_codebooks = 1
        self.codec_vocab = self.vocab_size
        self.audio_token = int(self.checkpoint.thinker_config.get("audio_token_id", -1))
        self.image_token = int(self.checkpoint.thinker_config.get("image_token_id", -2))
        features = self.checkpoint.audio_input
        # what the decoder resamples a request's audio to (0: no audio input)
        self.audio_input_rate = features.rate if features is not None else 0
        self.image_input = self.checkpoint.image_input is not None

    def _engine_kwargs(self) -> dict[str, Any]:
        prepare_vllm()
        # audio through vLLM's Qwen3-Omni processor (the checkpoint's audio
        # tower); the decoder bounds a request's parts (DeploymentSettings),
        # vLLM's limit only sizes its encoder budget
        audio = MAX_MEDIA_PARTS if self.audio_input_rate else 0
        image = MAX_MEDIA_PARTS if self.image_input else 0
        kwargs: dict[str, Any] = {"limit_mm_per_prompt": {"audio": audio, "image": image, "video": 0},
                                  "mm_processor_cache_gb": 0}
        if self.capture_talker_inputs:
            # Built without engine settings (which decide otherwise): a prompt
            # is prefilled in one step. With chunked prefill every prompt row
            # still reaches the talker (.step_assembly.RowLedger).
            kwargs.update(enable_chunked_prefill=False, max_num_batched_tokens=self._max_model_len)
        return kwargs

    def _after_engine(self) -> None:
        if self.capture_talker_inputs:
            layer = int(self.checkpoint.talker_config["accept_hidden_layer"])
            if runs_in_process(self.engine):
                self._rows = _ThinkerRows(get_model_runner(self.engine).model, layer)
            else:  # tensor parallelism: in the capturing worker (rows come with its captures)
                installed = self.engine.collective_rpc(_install_rows_in_worker, args=(layer,))
                if list(installed).count(True) != 1:  # pragma: no cover - rank layout changed
                    raise RuntimeError(
                        f"thinker layer hooks: expected one capturing rank, got {installed}"
                    )

    def _load_tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.checkpoint.path))

    def _extra_outputs(self, cap: StepCapture) -> dict[str, torch.Tensor]:
        return self._rows.take(cap.num_tokens) if self._rows is not None else {}

    def _prompt(self, spec: RequestSpec) -> dict[str, Any]:
        if not spec.prompt_token_ids:
            raise InvalidArgumentError("prompt", "the thinker takes a tokenized chat prompt")
        if not spec.audio and not spec.images:
            return {"prompt_token_ids": list(spec.prompt_token_ids)}
        if (spec.audio and not self.audio_input_rate) or (spec.images and not self.image_input):
            raise FailedPreconditionError("this thinker takes no such media input")
        # vLLM's processor expands each part's placeholder itself: give it one
        # per part (the decoder's prompt has them expanded, ChatPrompts._expand)
        ids = spec.prompt_token_ids
        pads = (self.audio_token, self.image_token)
        one_each = [t for i, t in enumerate(ids) if t not in pads or i == 0 or ids[i - 1] != t]
        data: dict[str, Any] = {}
        if spec.audio:
            data["audio"] = [(clip, self.audio_input_rate) for clip in spec.audio]
        if spec.images:
            from PIL import Image

            data["image"] = [Image.fromarray(pixels) for pixels in spec.images]
        return {"prompt_token_ids": one_each, "multi_modal_data": data}

    def add_request(self, spec: RequestSpec) -> None:
        super().add_request(spec)
        if not spec.audio and not spec.images:
            return
        # the positions the talker's rows follow are the decoder's prompt's:
        # vLLM's expansion of the media placeholders must agree with it
        with self._lock:
            internal = self._int_of.get(spec.request_id)
            state = self.engine.output_processor.request_states.get(internal)
            got = len(state.prompt_token_ids) if state is not None and state.prompt_token_ids is not None else -1
        if got != len(spec.prompt_token_ids):
            self.abort(spec.request_id)
            raise RuntimeError(
                f"vLLM's prompt for {spec.request_id!r} has {got} tokens, the decoder's {len(spec.prompt_token_ids)}: "
                "the media token counts disagree")

    def close(self) -> None:
        if self._rows is not None:
            self._rows.remove()
        super().close()


def talker_sampling(generation_config: dict, names: dict[str, tuple[str, float]]) -> dict[str, Any]:
    """The talker's sampling settings (temperature, repetition_penalty,
    top_k, top_p and the code predictor's) from a checkpoint's
    generation config: each read under its family's key (``names``:
    setting -> (key, the reference's default when the key is absent))."""
    return {setting: (int if setting.endswith("top_k") else float)(generation_config.get(key, default))
            for setting, (key, default) in names.items()}


class TalkerBackend(VLLMBackend):
    """The Qwen3-Omni talker on vLLM (see the module docstring)."""

    # Tensor/pipeline parallelism is refused (VLLMBackend.__init__,
    # decoder_svc.profile.parallel_refusal): the per-request states set in
    # _prompt and the code predictor run in the step live on the model object
    # in this process.
    in_process_reason = IN_PROCESS_RUNNER["talker"]
    streams_input = True
    # Upstream (thinker) tokens a request needs for any audio: a reply's last
    # token is never spoken (build_talker_prompt), so one token says nothing.
    min_input_tokens = 2

    def __init__(
        self,
        checkpoint: OmniCheckpoint,
        *,
        sampling: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self.checkpoint = checkpoint
        self._read_checkpoint(checkpoint)
        self.sampling.update(sampling or {})
        self._embed_table: torch.Tensor | None = None
        self._model: Any = None
        # requests started from part of the thinker's reply, until it ends
        self._builders: dict[str, TalkerPromptBuilder] = {}
        self._build_lock = threading.Lock()
        kwargs.setdefault("pooling_engine", "off")
        kwargs.setdefault("capture_hidden", False)
        kwargs["enable_prompt_embeds"] = True
        super().__init__(checkpoint.path, role="talker", **kwargs)
        self.stop_token_ids = [self.ids_codec_eos]

    def _read_checkpoint(self, checkpoint: Any) -> None:
        """What the family's prompts and sampling need from the checkpoint:
        ``ids``, ``speakers``, ``end_ids`` and the default ``sampling``."""
        self.ids = TalkerIds.from_config(checkpoint.config)
        self.speakers = {
            str(k).lower(): int(v) for k, v in checkpoint.talker_config["speaker_id"].items()
        }
        self.end_ids = frozenset({int(checkpoint.config["im_end_token_id"])})
        self.sampling = talker_sampling(checkpoint.generation_config, {
            "temperature": ("talker_temperature", 0.9), "repetition_penalty": ("talker_repetition_penalty", 1.05),
            "top_k": ("talker_top_k", 50), "top_p": ("talker_top_p", 1.0),
            "code_predictor_top_k": ("code_predictor_top_k", 50), "code_predictor_top_p": ("code_predictor_top_p", 0.8),
            "code_predictor_temperature": ("code_predictor_temperature", 1.0)})

    @property
    def sampling_defaults(self) -> tuple[float, float, int]:
        """(temperature, top_p, top_k) of the talker: the checkpoint's
        generation config (``talker_temperature``, ``talker_top_p``,
        ``talker_top_k``), what SamplingParams.model_defaults selects."""
        s = self.sampling
        return float(s["temperature"]), float(s["top_p"]), int(s["top_k"])

    @property
    def model_name(self) -> str:
        return self.checkpoint.path.name

    def _configure(self, role: str | None) -> None:
        talker = self.checkpoint.talker_config
        self._talker_facts(talker_view(self.checkpoint).path, talker["text_config"], talker)

    def _talker_facts(self, engine_dir: Any, text: dict, talker: dict) -> None:
        """The engine's view directory, and the facts of the talker's config
        (``text``: its language model's sizes; ``talker``: codec ids and code groups)."""
        self.engine_dir = engine_dir
        self.role = "talker"
        self.hidden_size = int(text["hidden_size"])
        self.vocab_size = int(text["vocab_size"])
        self.ids_codec_eos = int(talker["codec_eos_token_id"])
        self.eos_token_id = self.ids_codec_eos
        self.num_codebooks = int(talker["num_code_groups"])
        self.codec_vocab = int(talker["code_predictor_config"]["vocab_size"])

    def _engine_kwargs(self) -> dict[str, Any]:
        prepare_vllm()
        # Built without engine settings (which decide otherwise): a prompt is
        # prefilled in one step. Chunked prefill works (a seeded request's CPU
        # generator is rewound for a partial prefill's discarded sample by the
        # step hook: .capture._discarded_cpu_generators).
        return {"skip_tokenizer_init": True, "tokenizer": None,
                "enable_chunked_prefill": False, "max_num_batched_tokens": self._max_model_len}

    def _after_engine(self) -> None:
        runner = get_model_runner(self.engine)
        self._model = runner.model
        self._model.bind_runner(runner)
        self._load_host_tables()

    def _load_host_tables(self) -> None:
        """Tables the prompts read on the host, loaded once at startup."""
        self._thinker_embed_table()

    def _load_tokenizer(self):
        return None

    # -- prompts ---------------------------------------------------------------------
    def speaker_id(self, voice: str) -> int:
        sid = self.speakers.get(voice.lower())
        if sid is None:
            raise InvalidArgumentError(
                "voice",
                f"unknown voice {voice!r}; this model has: {', '.join(sorted(self.speakers))}",
            )
        return sid

    def _thinker_embed_table(self) -> torch.Tensor:
        """The thinker's input embeddings, in the checkpoint's dtype (rows are
        converted to float32 when looked up); loaded once, at startup."""
        if self._embed_table is None:
            name = "thinker.model.embed_tokens.weight"
            self._embed_table = self.checkpoint.tensors(name)[name]
        return self._embed_table

    def _prompt(self, spec: RequestSpec) -> dict[str, Any]:
        model = self._model
        cond = spec.conditioning or {}
        prompt_ids = list(spec.prompt_token_ids)
        table = self._thinker_embed_table()  # the tts_* ids' embeddings, and Speak's text

        device = model.text_projection.linear_fc1.weight.device

        def embed(ids: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.embedding(ids, table).to(device=device, dtype=torch.float32)

        if THINKER_EMBED in cond:  # Generate: the thinker's reply and its rows (so far)
            reply = [int(t) for t in cond[THINKER_TOKEN_IDS].reshape(-1).tolist()]
            rows, hidden = cond[THINKER_EMBED].to(device), cond.get(THINKER_HIDDEN)
            if hidden is not None:
                hidden = hidden.to(device)
        elif spec.streaming:
            raise InvalidArgumentError(
                f"conditioning.{THINKER_EMBED}", "a streaming start needs the thinker's rows"
            )
        else:  # Speak: the text as the assistant's reply; no thinker ran
            reply = list(spec.reply_token_ids)
            rows, hidden = embed(torch.tensor(prompt_ids + reply[:-1], dtype=torch.long)), None
        builder = TalkerPromptBuilder(
            self.ids,
            prompt_ids,
            speaker_id=self.speaker_id(spec.voice),
            text_projection=_float32_rows(model.text_projection),
            hidden_projection=_float32_rows(model.hidden_projection),
            codec_embedding=model.embed_input_ids,
            thinker_token_embed=embed,
            end_ids=self.end_ids,
        )
        with torch.inference_mode():
            # the whole reply (build_talker_prompt's steps), or its first rows
            builder.add(reply, rows, finished=not spec.streaming)
            prompt_embeds = builder.head(hidden)
            trailing = builder.take()
        if spec.image_grids:
            self._image_positions(spec, builder, int(prompt_embeds.shape[0]))
        self._add_state(spec, int(prompt_embeds.shape[0]), trailing, builder.pad, builder.complete)
        if not builder.complete:
            self._builders[spec.request_id] = builder
        return {"prompt_embeds": prompt_embeds}

    def _add_state(self, spec: RequestSpec, prompt_len: int, trailing: torch.Tensor, pad: torch.Tensor,
                   complete: bool) -> None:
        """The request's per-step state in the talker's slots: its text rows
        after the prompt, and its sampling (greedy throughout at temperature 0)."""
        greedy = spec.temperature <= 0
        self._model.slots.add(spec.request_id, TalkerRequestState(
            prompt_len=prompt_len,
            trailing=trailing,
            pad=pad,
            complete=complete,
            repetition_penalty=self.sampling["repetition_penalty"],
            temperature=0.0 if greedy else self.sampling["code_predictor_temperature"],
            top_k=self.sampling["code_predictor_top_k"],
            top_p=self.sampling["code_predictor_top_p"],
            seed=int(spec.seed),
        ))

    def _image_positions(self, spec: RequestSpec, builder: TalkerPromptBuilder, length: int) -> None:
        """A prompt with images: the talker's 3-D positions (.talker_rope)
        over its input ids (the user turns' thinker ids, then the assistant
        head's tts_pad ids), with the grids of the images in user turns."""
        from .talker_rope import talker_positions

        rope3 = self._model.rope3
        if rope3 is None:
            raise FailedPreconditionError("this talker has no M-RoPE settings for image positions")
        cfg = self.checkpoint.talker_config
        image = int(cfg["image_token_id"])
        ids = list(spec.prompt_token_ids)
        starts = [i for i, t in enumerate(ids) if t == image and (i == 0 or ids[i - 1] != image)]
        user = set(builder.user_positions)
        grids = [g for s, g in zip(starts, spec.image_grids, strict=True) if s in user]
        talker_ids = [ids[u] for u in builder.user_positions]
        talker_ids += [self.ids.tts_pad] * (length - len(talker_ids))
        merge = int(self.checkpoint.thinker_config["vision_config"]["spatial_merge_size"])
        positions, delta = talker_positions(talker_ids, image, grids, merge,
                                            float(cfg.get("position_id_per_seconds", 1)))
        rope3.add(spec.request_id, positions, delta)

    def _sampling_params(self, spec: RequestSpec):
        params = super()._sampling_params(spec)
        if spec.temperature > 0:
            params.top_k = spec.top_k or self.sampling["top_k"]
            params.top_p = spec.top_p if spec.top_p < 1.0 else self.sampling["top_p"]
        return params

    def add_request(self, spec: RequestSpec) -> None:
        with self._lock:  # before its state is built: never replace a running request's state
            if spec.request_id in self._int_of:
                raise InvalidArgumentError("request_id", f"{spec.request_id!r} is already running")
        try:
            super().add_request(spec)
        except BaseException:
            self._forget(spec.request_id)
            raise

    def extend_request(
        self, request_id: str, conditioning: dict[str, torch.Tensor], finished: bool
    ) -> None:
        """The thinker's next rows for a request started with
        ``RequestSpec.streaming``: ``conditioning`` holds only the new ones
        (``thinker_embed`` [k, H], ``thinker_token_ids`` [m] with the rows
        of all positions forwarded so far, i.e. k = m per thinker step;
        ``thinker_hidden`` is read only for the prompt and may be left out).
        ``finished``: the thinker is done with the request (the chunk may be
        empty); the per-step text then ends as the one-shot start would end
        it (tts_eos after the reply's last forwarded token or at its first
        end of turn, then tts_pad). A request no longer running is ignored;
        one not started with ``streaming`` is refused.
        """
        model = self._model
        with self._build_lock:
            builder = self._builders.get(request_id)
            if builder is None:
                with self._lock:
                    running = request_id in self._int_of
                if running:
                    raise FailedPreconditionError(
                        f"request {request_id!r} was not started with streamed input"
                    )
                return
            device = model.text_projection.linear_fc1.weight.device
            ids = conditioning.get(THINKER_TOKEN_IDS)
            reply = [] if ids is None else [int(t) for t in ids.reshape(-1).tolist()]
            rows = conditioning.get(THINKER_EMBED)
            if rows is None:
                rows = torch.zeros((0, 0), dtype=torch.float32)
            with torch.inference_mode():
                builder.add(reply, rows.to(device), finished=finished)
                new = builder.take()
            model.slots.extend(request_id, new, builder.complete)
            if builder.complete:
                self._builders.pop(request_id, None)
        if builder.complete:
            self._input_complete(request_id)
        else:
            self._input_arrived()

    def _held_requests(self, candidates: list[tuple[str, int]]) -> set[str]:
        # decode step k of a request (position prompt_len + k) reads trailing[k]
        slots = self._model.slots
        return {rid for rid, position in candidates if slots.held(rid, position)}

    # -- the step --------------------------------------------------------------------
    def _codes(self, cap: StepCapture, row_ok: torch.Tensor) -> torch.Tensor:
        # the sampler's own ids, the rows' mask and the last hidden rows, all on the device
        return self._model.on_sampled(
            cap.req_ids, cap.last_hidden_per_request(), cap.sampled_token_ids[:, 0], row_ok
        )

    def _forget(self, request_id: str) -> None:
        self._builders.pop(request_id, None)
        if self._model is not None and self._model.slots is not None:
            self._model.slots.remove(request_id)
        if self._model is not None and self._model.rope3 is not None:
            self._model.rope3.remove(request_id)
