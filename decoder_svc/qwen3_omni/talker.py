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

Per-request state (text queue, residual embedding sum, generated codes for
the repetition penalty, the code predictor's sampling settings, seed and
frame count) lives here,
keyed by the request id the caller gave vLLM; rows are mapped to requests
through the model runner's batch (``bind_runner``).

Weights come from the checkpoint by their released names (``talker.*``);
``thinker.*`` and ``code2wav.*`` are skipped. vLLM sees a talker config view
(``qwen3_moe`` model type, see :func:`talker_config_view`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import torch
from torch import nn

from .code_predictor import CodePredictor
from .code_sampling import SamplingBatch

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

    Text-only positions make the talker's M-RoPE (t = h = w) the plain 1-D
    rotary embedding, so the mrope keys are dropped.
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
    return view


@dataclass
class TalkerRequestState:
    """What the talker keeps per request between steps."""

    prompt_len: int
    trailing: torch.Tensor  # [N, H] projected text embeddings, one per step
    pad: torch.Tensor  # [H] projected tts_pad embedding
    # False while the thinker's reply is still arriving: steps past
    # ``trailing`` wait for its rows (the backend holds the request) instead
    # of reading ``pad``; ``trailing`` only grows meanwhile.
    complete: bool = True
    repetition_penalty: float = 1.0
    temperature: float = 0.0  # code predictor
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0  # the request's seed (unsigned 64-bit): the code predictor's noise key
    # Frames whose residual codes were predicted: the frame index of the code
    # predictor's counter-based noise, keyed by (seed, frame, codebook). It
    # counts frames, not steps or batch rows, so the draws never depend on the
    # batch. Under preemption with recompute, vLLM re-prefills the tokens
    # already sampled without sampling them again, so no frame is predicted
    # twice and the counter resumes where it stopped; a state rebuilt from
    # scratch sets it to the number of frames the request already emitted.
    frames: int = 0
    residual_sum: torch.Tensor | None = None  # [H]: residual codes of the last frame
    seen: set[int] = field(default_factory=set)  # codebook-0 ids sampled so far
    seen_ids: torch.Tensor | None = None  # the same ids as a tensor, for the repetition penalty


def sampled_frame_codes(
    talker: Any,
    req_ids: Sequence[str],
    last_hidden: torch.Tensor,
    code0: torch.Tensor,
    valid: torch.Tensor,
    code0_device: torch.Tensor | None = None,
) -> torch.Tensor:
    """The talker's step postprocess: codebooks 1..G-1 of the frame each row
    just sampled, and each request's state for the next step. Returns codes
    [n, G] int64 on ``last_hidden``'s device.

    req_ids: external ids; last_hidden [n, H] (normalised, what
    ``codec_head`` saw; on the model's device); code0 [n] and valid [n] bool:
    host tensors (what the Python side decides from, without a device sync
    per row); code0_device: the same ids on the model's device (default:
    ``code0`` moved there). Rows that are invalid, end the speech (codec
    eos) or have no state get zeros for the residual codes and update
    nothing. ``talker`` is the talker model (``states``, ``states_lock``,
    ``code_predictor``, ``model.codec_embedding``, ``_suppress``).
    """
    n = len(req_ids)
    cp = talker.code_predictor
    dev = last_hidden.device
    code0 = code0.reshape(-1)
    if code0_device is None:
        code0_device = code0.to(dev, non_blocking=True)
    code0_device = code0_device.reshape(-1).to(torch.int64)
    codes = torch.zeros((n, cp.num_groups), dtype=torch.int64, device=dev)
    codes[:, 0] = code0_device
    ids = code0.tolist()
    ok = valid.tolist()
    with talker.states_lock:
        states = [talker.states.get(r) for r in req_ids]
    rows = [i for i in range(n) if states[i] is not None and ok[i] and ids[i] < cp.vocab_size]
    if not rows:
        return codes
    idx = torch.tensor(rows, dtype=torch.int64).to(dev, non_blocking=True)
    sts = [states[i] for i in rows]
    emb0 = talker.model.codec_embedding(code0_device.index_select(0, idx))
    sampling = SamplingBatch.build(
        temperature=[s.temperature for s in sts],
        top_k=[s.top_k for s in sts],
        top_p=[s.top_p for s in sts],
        seed=[s.seed for s in sts],
        frame=[s.frames for s in sts],
        vocab_size=cp.vocab_size,
        device=dev,
    )
    residual, embed_sum = cp.predict(last_hidden.index_select(0, idx), emb0, sampling)
    codes[idx, 1:] = residual
    seen_device = talker._suppress.device
    with talker.states_lock:
        for j, (i, st) in enumerate(zip(rows, sts, strict=True)):
            st.residual_sum = embed_sum[j]
            st.frames += 1
            token = ids[i]
            if token not in st.seen:  # the tensor changes only when a new id appears
                st.seen.add(token)
                st.seen_ids = torch.tensor(sorted(st.seen), dtype=torch.long).to(seen_device)
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
            th = int(extra["thinker_hidden_size"])
            self.text_projection = _ResizeMLP(th, config.intermediate_size, config.hidden_size)
            self.hidden_projection = _ResizeMLP(th, config.intermediate_size, config.hidden_size)
            self.code_predictor = CodePredictor(extra["code_predictor_config"])
            suppress = torch.zeros(config.vocab_size, dtype=torch.bool)
            suppress[max(0, config.vocab_size - NUM_SUPPRESSED) :] = True
            suppress[self.codec_eos_token_id] = False
            self.register_buffer("_suppress", suppress, persistent=False)
            self.states: dict[str, TalkerRequestState] = {}
            self.states_lock = threading.Lock()
            self._runner: Any = None

        # -- wiring -------------------------------------------------------------
        def bind_runner(self, runner: Any) -> None:
            """The model runner whose batch maps rows to requests."""
            self._runner = runner

        def _batch(self) -> tuple[list[str], list[int]]:
            """(external request ids in batch order, query_start_loc as a list),
            from the runner's host-side buffers."""
            r = self._runner
            n = r.input_batch.num_reqs
            return [_external_id(x) for x in r.input_batch.req_ids[:n]], r.query_start_loc.cpu[: n + 1].tolist()

        def _computed(self, n: int) -> list[int]:
            """Tokens in KV before this step, per batch row (host side). The
            runner's positions are these plus the token's offset in the step
            (``GPUModelRunner._prepare_inputs``; the device copy differs only
            under asynchronous speculative decoding, which the talker never
            runs), so no position is read back from the device."""
            return self._runner.input_batch.num_computed_tokens_cpu[:n].tolist()

        # -- vLLM model interface ---------------------------------------------------
        def embed_input_ids(self, input_ids: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            return self.model.codec_embedding(input_ids)

        def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
            if inputs_embeds is None:
                inputs_embeds = self.embed_input_ids(input_ids)
            if self._runner is not None and self.states:
                inputs_embeds = self._add_step_inputs(inputs_embeds, positions)
            return self.model(positions, inputs_embeds)

        def _add_step_inputs(self, embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            """Decode rows: + residual codes' embeddings + the step's text embedding."""
            req_ids, qsl = self._batch()
            computed = self._computed(len(req_ids))
            rows: list[int] = []
            extra: list[torch.Tensor] = []
            with self.states_lock:
                for i, rid in enumerate(req_ids):
                    st = self.states.get(rid)
                    if st is None or st.residual_sum is None:
                        continue
                    row = qsl[i + 1] - 1  # decode: one row per request
                    step = computed[i] + (row - qsl[i]) - st.prompt_len  # == positions[row] - prompt_len
                    if step < 0:
                        continue
                    text = st.trailing[step] if step < st.trailing.shape[0] else st.pad
                    rows.append(row)
                    extra.append(st.residual_sum + text)
            if not rows:
                return embeds
            out = embeds.clone()
            out[torch.tensor(rows, device=out.device)] += torch.stack(extra).to(out.dtype)
            return out

        def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
            logits = self.logits_processor(self.codec_head, hidden_states)
            if logits is None:
                return None
            logits = logits.masked_fill(self._suppress[: logits.shape[-1]], float("-inf"))
            if self._runner is None or not self.states:
                return logits
            req_ids, _ = self._batch()
            with self.states_lock:
                for i, rid in enumerate(req_ids[: logits.shape[0]]):
                    st = self.states.get(rid)
                    if st is None or st.repetition_penalty == 1.0 or st.seen_ids is None:
                        continue
                    ids = st.seen_ids
                    score = logits[i, ids]
                    p = st.repetition_penalty
                    logits[i, ids] = torch.where(score < 0, score * p, score / p)
            return logits

        # -- the code predictor, right after sampling (inside the step) ---------------
        def on_sampled(self, req_ids: Sequence[str], last_hidden: torch.Tensor, code0: torch.Tensor,
                       valid: torch.Tensor, code0_device: torch.Tensor | None = None) -> torch.Tensor:
            """Fill codebooks 1..G-1 for the rows just sampled (see :func:`sampled_frame_codes`)."""
            return sampled_frame_codes(self, req_ids, last_hidden, code0, valid, code0_device)

        # -- weights ---------------------------------------------------------------
        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            cp_prefix = "talker.code_predictor."
            cp: dict[str, torch.Tensor] = {}

            def talker_weights():
                for name, w in weights:
                    if name.startswith(cp_prefix):
                        cp[name] = w
                    elif name.startswith("talker."):
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
