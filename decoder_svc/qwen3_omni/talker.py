"""The Qwen3-Omni talker as a vLLM model (registered out of tree).

The talker is an MoE decoder (Qwen3-style attention with q/k norms, MoE
blocks with a sigmoid-gated shared expert) over codec tokens. Each decode
step samples codebook 0 of one codec frame with ``codec_head``; the code
predictor then fills codebooks 1..G-1 (:meth:`TalkerForCausalLM.on_sampled`,
called right after sampling, inside the step). The next step's input is

    codec_embedding(code0) + sum of the residual codes' embeddings
                           + the next thinker text embedding (projected)

or the ``tts_pad`` embedding once the text has run out. The prompt arrives
as ``prompt_embeds`` (built by :mod:`.prompt`); the text embeddings may keep
arriving while the request runs (a request started from the first chunk of
the thinker's reply: :class:`TalkerRequestState` ``complete`` False).

Per-request state (text rows and every frame's residual embedding sum, by
position, the codebook-0 ids sampled so far for the repetition penalty, the code
predictor's sampling settings, seed and frame count) lives in tensors
indexed by each request's slot (:mod:`.talker_slots`); the step reads and
updates it with batched tensor ops, and each step's rows are mapped to slots
once, before its forward (``bind_runner``).

Weights come from the checkpoint by their released names (``talker.*``);
``thinker.*`` and ``code2wav.*`` are skipped. vLLM sees a talker config view
(``qwen3_moe`` model type, see :func:`talker_config_view`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import islice
from typing import Any

import torch
from torch import nn

from .code_predictor import CodePredictor
from .talker_rope import StepRotary, TalkerRope
from .talker_slots import TalkerRequestState, TalkerSlots

__all__ = [
    "TALKER_ARCH",
    "talker_model_class",
    "TalkerRequestState",
    "talker_config_view",
    "register",
    "sampled_frame_codes",
]

TALKER_ARCH = "OmniServingQwen3OmniTalker"
NUM_SUPPRESSED = 1024  # the last 1024 ids of the codec vocab are control tokens


def talker_config_view(config: Mapping[str, Any]) -> dict[str, Any]:
    """config.json for vLLM: the talker's text config as a ``qwen3_moe``
    model, plus what the talker model needs from the talker config.

    Text and audio positions make the talker's M-RoPE (t = h = w) the plain
    1-D rotary embedding, so vLLM gets no mrope keys; the talker applies
    M-RoPE itself to requests with images (``omni_talker.mrope``, .talker_rope).
    """
    talker = config["talker_config"]
    text = dict(talker["text_config"])
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta", text.get("rope_theta", 1_000_000.0)))
    view = {k: v for k, v in text.items() if k not in ("rope_parameters", "rope_scaling", "model_type", "architectures")}
    view.update(
        model_type="qwen3_moe",
        architectures=[TALKER_ARCH],
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        tie_word_embeddings=False,
        dtype="float32",
        head_dim=int(text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]),
        omni_talker={
            k: talker[k]
            for k in (
                "num_code_groups",
                "thinker_hidden_size",
                "codec_eos_token_id",
                "code_predictor_config",
            )
        },
    )
    view["omni_talker"]["code_predictor_config"] = dict(talker["code_predictor_config"])
    if rope.get("mrope_section"):  # the M-RoPE the talker applies itself to image positions (.talker_rope)
        # (interleaved, as the reference lays Qwen3-Omni's sections out)
        view["omni_talker"]["mrope"] = {"mrope_section": list(rope["mrope_section"]), "rope_theta": theta}
    return view


def sampled_frame_codes(
    slots: TalkerSlots,
    code_predictor: CodePredictor,
    codec_embedding: Any,
    req_ids: Sequence[str],
    last_hidden: torch.Tensor,
    code0: torch.Tensor,
    valid: torch.Tensor,
    key: Callable[[str], str] | None = None,
) -> torch.Tensor:
    """The talker's step postprocess: codebooks 1..G-1 of the frame each row
    just sampled, and each request's state for the next step. Returns codes
    [n, G] int64 on ``last_hidden``'s device.

    req_ids: the step's requests in batch order (``key``: to the ids the
    slots know them by); last_hidden [n, H] (normalised, what ``codec_head``
    saw); code0 [n]: the sampled codebook-0 ids; valid [n] bool: rows whose
    id counts (host or device; copied to the device without a sync). Rows
    that are invalid, end the speech (a control id past the codebook) or
    have no slot get zeros for the residual codes and update nothing. Every
    row goes through the code predictor (a fixed shape, no host decision per
    row); a row's codes do not depend on the others'."""
    cp = code_predictor
    dev = last_hidden.device
    n = len(req_ids)
    code0 = code0.reshape(-1).to(dev, torch.int64, non_blocking=True)
    slot, sampling = slots.frame_rows(req_ids, cp.vocab_size, key)
    ok = valid.reshape(-1).to(dev, non_blocking=True) & (slot > 0) & (code0 >= 0) & (code0 < cp.vocab_size)
    safe = torch.where(ok, code0, 0)
    residual, embed_sum = cp.predict(last_hidden, codec_embedding(safe), sampling)
    codes = torch.zeros((n, cp.num_groups), dtype=torch.int64, device=dev)
    codes[:, 0] = code0
    codes[:, 1:] = torch.where(ok[:, None], residual, 0)
    slots.record(slot, ok, safe, embed_sum)
    return codes


def _external_id(internal_id: str) -> str:
    """vLLM appends ``-<8 chars>`` to the caller's request id."""
    if len(internal_id) > 9 and internal_id[-9] == "-":
        return internal_id[:-9]
    return internal_id


class _ResizeMLP(nn.Module):
    def __init__(self, d_in: int, d_mid: int, d_out: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(d_in, d_mid, bias=True)
        self.linear_fc2 = nn.Linear(d_mid, d_out, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(torch.nn.functional.silu(self.linear_fc1(x)))


def _build_classes():
    """The vLLM module classes (imported lazily: vLLM is heavy)."""
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )
    from vllm.model_executor.models.qwen2 import Qwen2MLP
    from vllm.model_executor.models.qwen2_moe import Qwen2MoeSparseMoeBlock
    from vllm.model_executor.models.qwen3_moe import Qwen3MoeAttention
    from vllm.model_executor.models.utils import (
        AutoWeightsLoader,
        WeightsMapper,
        make_layers,
        maybe_prefix,
    )

    class TalkerDecoderLayer(nn.Module):
        def __init__(self, config, cache_config, quant_config, prefix: str) -> None:
            super().__init__()
            self.self_attn = Qwen3MoeAttention(
                hidden_size=config.hidden_size,
                num_heads=config.num_attention_heads,
                num_kv_heads=config.num_key_value_heads,
                rope_parameters=config.rope_parameters,
                max_position_embeddings=config.max_position_embeddings,
                head_dim=config.head_dim,
                rms_norm_eps=config.rms_norm_eps,
                qkv_bias=False,
                cache_config=cache_config,
                quant_config=quant_config,
                prefix=f"{prefix}.self_attn",
            )
            if config.omni_talker.get("dense_mlp"):  # Qwen3-TTS
                self.mlp = Qwen2MLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                                    quant_config=quant_config, prefix=f"{prefix}.mlp")
            else:
                self.mlp = Qwen2MoeSparseMoeBlock(config=config, quant_config=quant_config, prefix=f"{prefix}.mlp")
            self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

        def forward(self, positions, hidden_states, residual):
            if residual is None:
                residual = hidden_states
                hidden_states = self.input_layernorm(hidden_states)
            else:
                hidden_states, residual = self.input_layernorm(hidden_states, residual)
            hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states)
            hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
            return self.mlp(hidden_states), residual

    class TalkerModel(nn.Module):
        def __init__(self, *, vllm_config, prefix: str = "") -> None:
            super().__init__()
            config = vllm_config.model_config.hf_config
            self.codec_embedding = VocabParallelEmbedding(
                config.vocab_size, config.hidden_size, prefix=f"{prefix}.codec_embedding"
            )
            self.start_layer, self.end_layer, self.layers = make_layers(
                config.num_hidden_layers,
                lambda prefix: TalkerDecoderLayer(config, vllm_config.cache_config, vllm_config.quant_config, prefix),
                prefix=f"{prefix}.layers",
            )
            self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

        def forward(self, positions, inputs_embeds):
            hidden_states, residual = inputs_embeds, None
            for layer in islice(self.layers, self.start_layer, self.end_layer):
                hidden_states, residual = layer(positions, hidden_states, residual)
            hidden_states, _ = self.norm(hidden_states, residual)
            return hidden_states

    class TalkerForCausalLM(nn.Module):
        """The talker (see the module docstring)."""

        hf_to_vllm_mapper = WeightsMapper(
            orig_to_new_prefix={"talker.": ""},
            orig_to_new_stacked={
                ".q_proj": (".qkv_proj", "q"),
                ".k_proj": (".qkv_proj", "k"),
                ".v_proj": (".qkv_proj", "v"),
                ".shared_expert.gate_proj": (".shared_expert.gate_up_proj", 0),
                ".shared_expert.up_proj": (".shared_expert.gate_up_proj", 1),
                ".mlp.gate_proj": (".mlp.gate_up_proj", 0),  # a dense MLP (Qwen3-TTS)
                ".mlp.up_proj": (".mlp.gate_up_proj", 1),
            },
        )
        packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

        def __init__(self, *, vllm_config, prefix: str = "") -> None:
            super().__init__()
            config = vllm_config.model_config.hf_config
            extra = dict(config.omni_talker)
            self.config = config
            self.vocab_size = int(config.vocab_size)
            self.codec_eos_token_id = int(extra["codec_eos_token_id"])
            self.model = TalkerModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
            self.codec_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix=maybe_prefix(prefix, "codec_head"))
            self.logits_processor = LogitsProcessor(config.vocab_size)
            # text rows into the talker: Qwen3-Omni projects the thinker's embeddings and hidden
            # states (thinker width -> intermediate -> hidden); Qwen3-TTS its own text embeddings
            # (``text_projection``: [in, mid])
            text_in, text_mid = extra.get("text_projection") or (int(extra["thinker_hidden_size"]),
                                                                  config.intermediate_size)
            self.text_projection = _ResizeMLP(int(text_in), int(text_mid), config.hidden_size)
            self.hidden_projection = None
            if extra.get("thinker_hidden_size"):
                th = int(extra["thinker_hidden_size"])
                self.hidden_projection = _ResizeMLP(th, config.intermediate_size, config.hidden_size)
            self.code_predictor = CodePredictor(extra["code_predictor_config"])
            suppress = torch.zeros(config.vocab_size, dtype=torch.bool)
            suppress[max(0, config.vocab_size - NUM_SUPPRESSED) :] = True
            suppress[self.codec_eos_token_id] = False
            self.register_buffer("_suppress", suppress, persistent=False)
            self.slots: TalkerSlots | None = None  # per-request state (bind_runner)
            self.rope3: TalkerRope | None = None  # 3-D positions of image requests (bind_runner)
            self._mrope = None
            if extra.get("mrope"):  # built here: vLLM's rotary modules need the model's config context
                from vllm.model_executor.layers.rotary_embedding import get_rope

                m = extra["mrope"]
                self._mrope = get_rope(config.head_dim, config.max_position_embeddings, True,
                                       {"rope_type": "default", "rope_theta": m["rope_theta"],
                                        "mrope_section": m["mrope_section"], "mrope_interleaved": True})

        # -- wiring -------------------------------------------------------------
        def bind_runner(self, runner: Any) -> None:
            """Serve requests through this model runner: the per-request
            state store is created on the model's device, and each step's rows
            are mapped to their requests' slots before its forward (the
            runner's ``_preprocess``, which every step runs before the model,
            outside any captured graph; it reads only host-side buffers).
            vLLM internals used (pinned version; re-check on an upgrade):
            ``runner._preprocess``, ``runner.max_num_reqs``,
            ``input_batch.num_reqs`` / ``req_ids`` /
            ``num_computed_tokens_cpu`` and ``query_start_loc.np``."""
            self.slots = TalkerSlots(
                self.config.hidden_size, self.vocab_size, device=self._suppress.device,
                capacity=2 * int(getattr(runner, "max_num_reqs", 8)) + 1,
            )
            preprocess = runner._preprocess
            if self._mrope:
                self._bind_rope3()

            def _preprocess(*args: Any, **kwargs: Any) -> Any:
                ib = runner.input_batch
                n = ib.num_reqs
                qsl, computed = runner.query_start_loc.np[: n + 1], ib.num_computed_tokens_cpu[:n]
                self.slots.prepare(ib.req_ids[:n], qsl, computed, key=_external_id)
                if self.rope3 is not None:
                    self.rope3.prepare(ib.req_ids[:n], qsl, computed, key=_external_id)
                return preprocess(*args, **kwargs)

            runner._preprocess = _preprocess

        def _bind_rope3(self) -> None:
            """Every layer's rotary embedding applies M-RoPE to the rows of
            requests with 3-D positions (:mod:`.talker_rope`)."""
            layers = list(islice(self.model.layers, self.model.start_layer, self.model.end_layer))
            self.rope3 = TalkerRope(self._suppress.device)
            step = StepRotary(layers[0].self_attn.rotary_emb, self._mrope, self.rope3)
            for layer in layers:
                layer.self_attn.rotary_emb = step

        # -- vLLM model interface ---------------------------------------------------
        def embed_input_ids(self, input_ids: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            return self.model.codec_embedding(input_ids)

        def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
            if inputs_embeds is None:
                inputs_embeds = self.embed_input_ids(input_ids)
            if self.slots is not None:  # decode rows: + residual codes' embeddings + the step's text row
                inputs_embeds = self.slots.step_inputs(inputs_embeds, positions)
            return self.model(positions, inputs_embeds)

        def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
            logits = self.logits_processor(self.codec_head, hidden_states)
            if logits is None:
                return None
            logits = logits.masked_fill(self._suppress[: logits.shape[-1]], float("-inf"))
            return logits if self.slots is None else self.slots.penalize(logits)

        # -- the code predictor, right after sampling (inside the step) ---------------
        def on_sampled(self, req_ids: Sequence[str], last_hidden: torch.Tensor, code0: torch.Tensor,
                       valid: torch.Tensor) -> torch.Tensor:
            """Fill codebooks 1..G-1 for the rows just sampled (see :func:`sampled_frame_codes`;
            ``req_ids``: the runner's ids)."""
            assert self.slots is not None, "bind_runner() first"
            return sampled_frame_codes(self.slots, self.code_predictor, self.model.codec_embedding, req_ids,
                                       last_hidden, code0, valid, key=_external_id)

        # -- weights ---------------------------------------------------------------
        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            cp_prefix = "talker.code_predictor."
            cp: dict[str, torch.Tensor] = {}
            # Qwen3-TTS's text embedding table: read by the prompts on the host (its backend), not here
            host_side = "talker.model.text_embedding."

            def talker_weights():
                for name, w in weights:
                    if name.startswith(cp_prefix):
                        cp[name] = w
                    elif name.startswith("talker.") and not name.startswith(host_side):
                        yield name, w

            loader = AutoWeightsLoader(self)
            loaded = loader.load_weights(talker_weights(), mapper=self.hf_to_vllm_mapper)
            self.code_predictor.load(cp, prefix=cp_prefix)
            loaded |= {"code_predictor." + n for n, _ in self.code_predictor.named_parameters()}
            return loaded

    return TalkerForCausalLM


_CLASSES: dict[str, Any] = {}


def talker_model_class() -> type:
    """The vLLM talker model class (built on first use: vLLM is imported then)."""
    if "talker" not in _CLASSES:
        _CLASSES["talker"] = _build_classes()
    return _CLASSES["talker"]


def register() -> None:
    """Register the talker architecture with vLLM (idempotent)."""
    from vllm import ModelRegistry

    if TALKER_ARCH not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(TALKER_ARCH, talker_model_class())
