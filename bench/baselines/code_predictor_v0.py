"""Baseline for `bench code-predictor`: the code predictor as it was before
the serving rewrite (commit 4765be9, ``decoder_svc/qwen3_omni/code_predictor.py``),
kept verbatim below this paragraph so the benchmark can time it against the
serving implementation with the same weights and inputs. Not used by the
services.

The talker's code predictor: the 15 residual codebooks of one codec frame.

Given the talker's last (normalised) hidden row and the first codebook's code,
a small causal transformer predicts codebooks 1..G-1 one after the other,
each step feeding the embedding of the code just chosen (group ``g`` has its
own embedding table and output head). It runs inside the talker's decode
step, batched over the step's requests, with a fresh KV cache per frame
(G + 1 positions at most), so it needs no paged cache of its own.

Weights use the released names under ``talker.code_predictor.``:
``model.codec_embedding.{g}.weight``, ``model.layers.{i}.*``,
``model.norm.weight``, ``lm_head.{g}.weight``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["CodePredictor", "sample_rows"]


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class _Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int, eps: float) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.self_attn.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.self_attn.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.self_attn.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.self_attn.q_norm = _RMSNorm(head_dim, eps)
        self.self_attn.k_norm = _RMSNorm(head_dim, eps)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.mlp.up_proj = nn.Linear(hidden, inter, bias=False)
        self.mlp.down_proj = nn.Linear(inter, hidden, bias=False)
        self.input_layernorm = _RMSNorm(hidden, eps)
        self.post_attention_layernorm = _RMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: list[torch.Tensor]) -> torch.Tensor:
        """x [n, t, H]; cos/sin [t, D]; cache: [] or [k, v] of [n, kv, s, D] (updated in place)."""
        a = self.self_attn
        n, t, _ = x.shape
        h = self.input_layernorm(x)
        q = a.q_norm(a.q_proj(h).view(n, t, self.heads, self.head_dim)).transpose(1, 2)
        k = a.k_norm(a.k_proj(h).view(n, t, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = a.v_proj(h).view(n, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if cache:
            k = torch.cat((cache[0], k), dim=2)
            v = torch.cat((cache[1], v), dim=2)
        cache[:] = [k, v]
        rep = self.heads // self.kv_heads
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        # causal over the new rows: row i sees the cached rows and new rows <= i
        out = F.scaled_dot_product_attention(q, k, v, is_causal=t > 1 and k.shape[2] == t, scale=self.head_dim**-0.5)
        x = x + a.o_proj(out.transpose(1, 2).reshape(n, t, -1))
        m = self.mlp
        h = self.post_attention_layernorm(x)
        return x + m.down_proj(F.silu(m.gate_proj(h)) * m.up_proj(h))


def sample_rows(
    logits: torch.Tensor,
    temperature: Sequence[float],
    top_k: Sequence[int],
    top_p: Sequence[float],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """One id per row: greedy where temperature is 0, else temperature +
    top-k + top-p sampling with the row's generator. logits [n, V] float32."""
    out = logits.argmax(-1)
    for i, temp in enumerate(temperature):
        if temp <= 0:
            continue
        row = logits[i] / temp
        k = top_k[i]
        if 0 < k < row.numel():
            kth = torch.topk(row, k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        p = top_p[i]
        if p < 1.0:
            sorted_logits, idx = torch.sort(row, descending=True)
            probs = sorted_logits.softmax(-1)
            remove = probs.cumsum(-1) - probs > p  # keep the smallest prefix reaching p
            row = row.masked_fill(torch.zeros_like(remove).scatter(0, idx, remove), float("-inf"))
        probs = row.softmax(-1)
        out[i] = torch.multinomial(probs, 1, generator=generators[i])[0]
    return out


class CodePredictor(nn.Module):
    """Predicts codebooks 1..G-1 of a frame (see the module docstring)."""

    def __init__(self, config: Mapping) -> None:
        super().__init__()
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        kv = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
        eps = float(config.get("rms_norm_eps", 1e-6))
        vocab = int(config["vocab_size"])
        self.num_groups = int(config["num_code_groups"])
        self.vocab_size = vocab
        self.model = nn.Module()
        self.model.codec_embedding = nn.ModuleList(nn.Embedding(vocab, hidden) for _ in range(self.num_groups - 1))
        self.model.layers = nn.ModuleList(
            _Layer(hidden, heads, kv, head_dim, int(config["intermediate_size"]), eps)
            for _ in range(int(config["num_hidden_layers"]))
        )
        self.model.norm = _RMSNorm(hidden, eps)
        self.lm_head = nn.ModuleList(nn.Linear(hidden, vocab, bias=False) for _ in range(self.num_groups - 1))
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim))
        pos = torch.arange(self.num_groups + 1, dtype=torch.float32)
        freqs = torch.outer(pos, inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("_cos", emb.cos(), persistent=False)
        self.register_buffer("_sin", emb.sin(), persistent=False)

    def load(self, tensors: Mapping[str, torch.Tensor], prefix: str = "talker.code_predictor.") -> None:
        """Load by released names; every parameter must be present with its shape."""
        own = dict(self.named_parameters())
        with torch.no_grad():
            for name, p in own.items():
                key = prefix + name
                if key not in tensors:
                    raise KeyError(f"{key}: missing from the checkpoint")
                t = tensors[key]
                if tuple(t.shape) != tuple(p.shape):
                    raise ValueError(f"{key}: shape {tuple(t.shape)} in the checkpoint, the model needs {tuple(p.shape)}")
                p.copy_(t.to(p.dtype))

    @torch.inference_mode()
    def predict(
        self,
        last_hidden: torch.Tensor,
        code0_embed: torch.Tensor,
        *,
        temperature: Sequence[float],
        top_k: Sequence[int],
        top_p: Sequence[float],
        generators: Sequence[torch.Generator | None],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """last_hidden, code0_embed: [n, H]. Returns (codes [n, G-1] int64,
        the sum of the residual codes' embeddings [n, H]) -- the talker adds
        that sum to the next step's input."""
        n = last_hidden.shape[0]
        dtype = self._cos.dtype
        x = torch.stack((last_hidden.to(dtype), code0_embed.to(dtype)), dim=1)  # [n, 2, H]
        caches: list[list[torch.Tensor]] = [[] for _ in self.model.layers]
        codes = torch.empty((n, self.num_groups - 1), dtype=torch.int64, device=x.device)
        embed_sum = torch.zeros((n, x.shape[-1]), dtype=dtype, device=x.device)
        pos = 0
        for g in range(self.num_groups - 1):
            t = x.shape[1]
            cos, sin = self._cos[pos : pos + t], self._sin[pos : pos + t]
            h = x
            for layer, cache in zip(self.model.layers, caches, strict=True):
                h = layer(h, cos, sin, cache)
            pos += t
            logits = self.lm_head[g](self.model.norm(h[:, -1]))
            code = sample_rows(logits.float(), temperature, top_k, top_p, generators)
            codes[:, g] = code
            emb = self.model.codec_embedding[g](code)
            embed_sum += emb
            x = emb[:, None, :]
        return codes, embed_sum
