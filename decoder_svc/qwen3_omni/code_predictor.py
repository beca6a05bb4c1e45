"""The talker's code predictor: the 15 residual codebooks of one codec frame,
built for serving.

Given the talker's last (normalised) hidden row and the first codebook's
code, a small causal transformer predicts codebooks 1..G-1 one after the
other, each pass feeding the embedding of the code just chosen (group ``g``
has its own embedding table and output head). It runs inside the talker's
decode step, batched over the step's requests, with a fresh KV cache per
frame (G positions), so it needs no paged cache of its own.

How it is built (one function, :meth:`CodePredictor._frame`, runs the whole
frame with static shapes):
- Weights are loaded from the released names under ``talker.code_predictor.``
  (``model.codec_embedding.{g}.weight``, ``model.layers.{i}.*``,
  ``model.norm.weight``, ``lm_head.{g}.weight``) and fused at load: q/k/v
  into one ``qkv`` matrix, gate/up into ``gate_up``, the G-1 embedding tables
  and heads stacked. One implementation serves both families' layouts:
  Qwen3-TTS's embedding tables are at the talker's width (``input_size`` in
  the config given), wider than the predictor at 1.7B, where every input row
  goes through ``small_to_mtp_projection`` (weight and bias) first.
- The batch is padded to a bucket (a multiple of :func:`row_tile`, at most
  ``max_bucket`` rows; larger batches run in chunks), except a batch of one
  on CPU without ``batch_invariant`` (below). The KV cache is one
  preallocated buffer per device, written in place at each pass's positions;
  attention reads it without copying K/V for grouped-query attention (the
  query heads of one KV head are that head's query rows).
- Sampling (:mod:`.code_sampling`: :func:`sample`; in the frame, one :func:`plan` and a
  :func:`draw` per codebook) is vectorised over rows: temperature, top-k and
  top-p per row, greedy rows (temperature 0) in the same batch, no host sync.
  Each row draws from its own counter-based stream (:func:`uniforms`): a
  hash of (seed, frame index, codebook), so a request's codes depend on its
  seed and its own frame count alone, never on which requests share the
  batch, and the draw needs no generator state (CUDA graph replay-safe).
- On CUDA each (bucket, candidates) shape is captured once as a CUDA graph
  (:class:`_GraphRunner`) and replayed; elsewhere the same function runs
  eagerly (``torch.compile`` optional: ``compile=True``, off by default).

Batch invariance is a setting (``batch_invariant``; the environment's
``OMNI_CODE_PREDICTOR_BATCH_INVARIANT=1`` when not given; off by default).
Padding a lone request to the host's row tile (4 rows on AVX2 with MKL) made
batch 1 about 3x slower than the unpadded GEMV at the released widths on a
2-core CPU, and slower than transformers' code predictor
(bench/RESULTS.md, the code predictor runs): a small-row GEMM packs the whole
weight matrix each call, a GEMV streams it once. So by default a batch of one
on CPU runs unpadded: its matrix products are GEMVs, whose rows can differ
in the last bits from the same row inside a tiled batch, enough to flip a
sampled code where a draw falls within rounding of a CDF boundary (or a
greedy near-tie). Batches of two or more are padded to the tile as before, so
a request's codes are the same in every batch of two or more; greedy codes
still equal transformers' (the parity suite). With ``batch_invariant`` a batch
of one is padded too and a request's codes are the same alone and in any
batch (bitwise, CPU float32). Off CPU nothing changes (buckets of 8, CUDA
graphs).

Invariants:
- Batch invariance (CPU float32, bitwise; with ``batch_invariant``, else for
  batches of two or more): a row's codes never depend on the
  batch's other rows or size. Every matrix product runs with a row count that
  is a multiple of the host's row tile, measured once per process by
  :func:`row_tile` (MKL computes a row of a full kernel tile with the same
  arithmetic whatever the row count; rows of a GEMV (1 row) or of a partial
  tile differ in their last bits, enough to flip a near-tie). Padding rows
  (zeros, greedy) never change the real rows. Attention is two plain
  matmuls per KV head (each batch row its own small product). On CUDA a
  row's bits are the same in any batch padded to the same bucket; across
  buckets cuBLAS may pick another kernel, so codes can differ only where a
  logit near-tie or a draw within float rounding of a CDF boundary meets
  that last-bit change.
- Sampling: :mod:`.code_sampling` (its semantics and noise stream).
- dtype: the weights' (the talker engine's ``dtype``); inputs are cast to
  it, rotary cos/sin are computed in float32 and cast, attention's softmax
  runs in float32, and logits reach the sampler as float32. Batch
  invariance holds in that dtype where :func:`row_tile` finds a tile for it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .code_sampling import SamplingBatch, draw, group_keys, plan, uniforms

__all__ = ["CodePredictor", "row_tile", "BATCH_INVARIANT_ENV"]

log = logging.getLogger(__name__)

# "1": CodePredictor's batch_invariant when the caller does not give it (module docstring).
BATCH_INVARIANT_ENV = "OMNI_CODE_PREDICTOR_BATCH_INVARIANT"

# -- batch invariance: the row tile ------------------------------------------------

_TILES = (4, 8, 16, 32, 64)
_tile_cache: dict[tuple, int] = {}


def row_tile(shapes: Sequence[tuple[int, int]], max_rows: int, dtype: torch.dtype = torch.float32) -> int:
    """The smallest row count T in (4, 8, 16, 32, 64) such that, on this host and
    at this thread count, torch's CPU ``F.linear`` in ``dtype`` gives each row the
    same bits in calls of T, 2T, 3T, max_rows / 2 and max_rows rows, for each
    (in_features, out_features) in ``shapes``. Measured once per process
    (per shapes, dtype and thread count) on random data: which kernel computes a row
    depends on the shapes, not on the values.

    On an AVX2 host with MKL, rows of calls with 4k rows agree and 1-3 rows
    (GEMV and partial tiles) differ: T = 4. If no T agrees, batch invariance
    does not hold on this host: a warning is logged and 64 is returned."""
    key = (tuple(shapes), int(max_rows), dtype, torch.get_num_threads())
    if key in _tile_cache:
        return _tile_cache[key]
    gen = torch.Generator().manual_seed(0)
    data = [(torch.randn(n, k, generator=gen).to(dtype), torch.randn(max_rows, k, generator=gen).to(dtype))
            for k, n in shapes]
    refs = [F.linear(x, w) for w, x in data]
    found = 0
    for tile in _TILES:
        if max_rows % tile:
            continue
        counts = sorted({tile, 2 * tile, 3 * tile, max_rows // 2} & set(range(tile, max_rows + 1, tile)))
        if all(torch.equal(F.linear(x[:m], w), ref[:m]) for (w, x), ref in zip(data, refs, strict=True)
               for m in counts):
            found = tile
            break
    if not found:
        log.warning("code predictor: no row tile up to %d gives batch-invariant matrix products on this host "
                    "(shapes %s, %s, %d threads): a request's sampled codes may depend on its batch",
                    _TILES[-1], list(shapes), dtype, torch.get_num_threads())
        found = _TILES[-1]
    _tile_cache[key] = found
    return found


# -- the model ---------------------------------------------------------------------


class _Layer(nn.Module):
    """One decoder layer with fused projections (released names: see
    :meth:`CodePredictor.load`)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.inter = heads, kv_heads, head_dim, inter
        self.qkv = nn.Parameter(torch.zeros((heads + 2 * kv_heads) * head_dim, hidden), requires_grad=False)
        self.o = nn.Parameter(torch.zeros(hidden, heads * head_dim), requires_grad=False)
        self.q_norm = nn.Parameter(torch.ones(head_dim), requires_grad=False)
        self.k_norm = nn.Parameter(torch.ones(head_dim), requires_grad=False)
        self.gate_up = nn.Parameter(torch.zeros(2 * inter, hidden), requires_grad=False)
        self.down = nn.Parameter(torch.zeros(hidden, inter), requires_grad=False)
        self.input_norm = nn.Parameter(torch.ones(hidden), requires_grad=False)
        self.post_norm = nn.Parameter(torch.ones(hidden), requires_grad=False)

    def qk_norm_weight(self) -> torch.Tensor:
        """q_norm for each query head and k_norm for each KV head: [heads + kv_heads, D]."""
        d = self.head_dim
        return torch.cat((self.q_norm.expand(self.heads, d), self.k_norm.expand(self.kv_heads, d)))

    def forward(self, x: torch.Tensor, t: int, pos: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor, qk_norm: torch.Tensor, mask: torch.Tensor | None,
                eps: float) -> torch.Tensor:
        """x [b * t, H]: row i * t + j is request i at position pos + j;
        k_cache/v_cache [b, kv, G, D] (written at those positions); cos/sin
        [t, 1, D] (sin signed for the half swap); qk_norm: :meth:`qk_norm_weight`;
        mask [rep * t, pos + t] bool, True where a key is hidden, or None
        (t == 1: every cached key is visible)."""
        hidden = x.shape[1]
        b = x.shape[0] // t
        h, kv, d = self.heads, self.kv_heads, self.head_dim
        rep = h // kv
        qkv = F.linear(F.rms_norm(x, (hidden,), self.input_norm, eps), self.qkv)
        qk = F.rms_norm(qkv[:, : (h + kv) * d].view(b, t, h + kv, d), (d,), None, eps) * qk_norm
        # rotary: x * cos + rotate_half(x) * sin, rotate_half = the halves swapped (sign in ``sin``)
        qk = torch.addcmul(qk * cos, qk.roll(d // 2, -1), sin)
        k_cache.narrow(2, pos, t).copy_(qk[:, :, h:].transpose(1, 2))
        v_cache.narrow(2, pos, t).copy_(qkv[:, (h + kv) * d :].view(b, t, kv, d).transpose(1, 2))
        # the rep query heads of KV head j are its query rows: [b, kv, rep * t, D], no K/V copy.
        # Plain matmuls, not scaled_dot_product_attention: torch's CPU flash kernel gives the
        # batch's last row other bits at some key lengths (9, 11, 13, 15), which breaks batch invariance.
        if t == 1:
            q = qk[:, 0, :h].view(b, kv, rep, d)
        else:
            q = qk[:, :, :h].reshape(b, t, kv, rep, d).permute(0, 2, 3, 1, 4).reshape(b, kv, rep * t, d)
        end = pos + t
        scores = torch.matmul(q, k_cache.narrow(2, 0, end).transpose(-1, -2)) * d**-0.5
        if mask is not None:
            scores = scores.masked_fill(mask, float("-inf"))
        # softmax in float32 (as transformers' attention does for bfloat16)
        probs = scores.softmax(-1) if scores.dtype == torch.float32 else scores.float().softmax(-1).to(scores.dtype)
        out = torch.matmul(probs, v_cache.narrow(2, 0, end))
        if t == 1:
            out = out.view(b, h * d)
        else:
            out = out.view(b, kv, rep, t, d).permute(0, 3, 1, 2, 4).reshape(b * t, h * d)
        x = x + F.linear(out, self.o)
        gu = F.linear(F.rms_norm(x, (hidden,), self.post_norm, eps), self.gate_up)
        return x + F.linear(F.silu(gu[:, : self.inter]) * gu[:, self.inter :], self.down)


class CodePredictor(nn.Module):
    """Predicts codebooks 1..G-1 of a frame (see the module docstring).

    max_bucket: the largest padded batch (larger batches run in chunks of
    it; it sizes the KV cache buffer); compile: ``torch.compile`` the frame
    function on CPU (off by default: compile time lands on the first call of
    each bucket); cuda_graphs: capture each bucket's frame as a CUDA graph on
    CUDA devices; batch_invariant: pad a batch of one on CPU too, so that a
    request's codes are bitwise the same alone and in any batch (slower at
    batch 1; None: ``OMNI_CODE_PREDICTOR_BATCH_INVARIANT=1`` in the
    environment, else off)."""

    def __init__(self, config: Mapping, *, max_bucket: int = 64, compile: bool = False,
                 cuda_graphs: bool = True, batch_invariant: bool | None = None) -> None:
        super().__init__()
        if batch_invariant is None:
            batch_invariant = os.environ.get(BATCH_INVARIANT_ENV, "") == "1"
        self.batch_invariant = bool(batch_invariant)
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        kv = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
        if heads % kv:
            raise ValueError(f"num_attention_heads: {heads} is not a multiple of num_key_value_heads {kv}")
        if head_dim % 2:
            raise ValueError(f"head_dim: {head_dim} must be even (rotary halves)")
        if max_bucket < 8 or max_bucket % 8:
            raise ValueError(f"max_bucket: must be a positive multiple of 8, got {max_bucket}")
        self.eps = float(config.get("rms_norm_eps", 1e-6))
        self.vocab_size = int(config["vocab_size"])
        self.num_groups = int(config["num_code_groups"])
        self.hidden_size, self.heads, self.kv_heads, self.head_dim = hidden, heads, kv, head_dim
        # the talker's width, where its inputs come from (Qwen3-TTS: wider than the predictor's
        # own, and projected by ``small_to_mtp_projection``); Qwen3-Omni: the same width
        self.input_size = int(config.get("input_size") or hidden)
        self.intermediate_size = int(config["intermediate_size"])
        self.max_bucket = int(max_bucket)
        self.use_compile = bool(compile)
        self.cuda_graphs = bool(cuda_graphs)
        g1 = self.num_groups - 1
        self.codec_embedding = nn.Parameter(torch.zeros(g1, self.vocab_size, self.input_size), requires_grad=False)
        self.in_proj: nn.Parameter | None = None
        self.in_proj_bias: nn.Parameter | None = None
        if self.input_size != hidden:
            self.in_proj = nn.Parameter(torch.zeros(hidden, self.input_size), requires_grad=False)
            self.in_proj_bias = nn.Parameter(torch.zeros(hidden), requires_grad=False)
        self.lm_head = nn.Parameter(torch.zeros(g1, self.vocab_size, hidden), requires_grad=False)
        self.norm = nn.Parameter(torch.ones(hidden), requires_grad=False)
        self.layers = nn.ModuleList(
            _Layer(hidden, heads, kv, head_dim, self.intermediate_size)
            for _ in range(int(config["num_hidden_layers"]))
        )
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim))
        freqs = torch.outer(torch.arange(self.num_groups, dtype=torch.float32), inv)
        self.register_buffer("_cos", torch.cat((freqs, freqs), dim=-1).cos()[:, None, :], persistent=False)
        self.register_buffer("_sin", torch.cat((-freqs.sin(), freqs.sin()), dim=-1)[:, None, :], persistent=False)
        rep = heads // kv
        # the first pass's two positions: query row (r, i) sees keys 0..i (True: hidden)
        mask = torch.arange(2)[None, :] > torch.arange(2).repeat(rep)[:, None]
        self.register_buffer("_mask", mask, persistent=False)
        self.register_buffer("_groups", group_keys(g1), persistent=False)
        self._kv: torch.Tensor | None = None
        self._graphs: _GraphRunner | None = None
        self._compiled: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None

    # -- weights ---------------------------------------------------------------------
    def released_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every released tensor name (without the ``talker.code_predictor.``
        prefix) with its shape."""
        hid, d, h, kv, inter = self.hidden_size, self.head_dim, self.heads, self.kv_heads, self.intermediate_size
        out: dict[str, tuple[int, ...]] = {}
        for g in range(self.num_groups - 1):
            out[f"model.codec_embedding.{g}.weight"] = (self.vocab_size, self.input_size)
            out[f"lm_head.{g}.weight"] = (self.vocab_size, hid)
        out["model.norm.weight"] = (hid,)
        if self.in_proj is not None:
            out["small_to_mtp_projection.weight"] = (hid, self.input_size)
            out["small_to_mtp_projection.bias"] = (hid,)
        for i in range(len(self.layers)):
            p = f"model.layers.{i}."
            out.update({
                p + "input_layernorm.weight": (hid,), p + "post_attention_layernorm.weight": (hid,),
                p + "self_attn.q_proj.weight": (h * d, hid), p + "self_attn.k_proj.weight": (kv * d, hid),
                p + "self_attn.v_proj.weight": (kv * d, hid), p + "self_attn.o_proj.weight": (hid, h * d),
                p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                p + "mlp.gate_proj.weight": (inter, hid), p + "mlp.up_proj.weight": (inter, hid),
                p + "mlp.down_proj.weight": (hid, inter),
            })
        return out

    def load(self, tensors: Mapping[str, torch.Tensor], prefix: str = "talker.code_predictor.") -> None:
        """Load by released names and fuse; every tensor must be present with its shape."""
        shapes = self.released_shapes()
        w: dict[str, torch.Tensor] = {}
        for name, shape in shapes.items():
            key = prefix + name
            if key not in tensors:
                raise KeyError(f"{key}: missing from the checkpoint")
            t = tensors[key]
            if tuple(t.shape) != shape:
                raise ValueError(f"{key}: shape {tuple(t.shape)} in the checkpoint, the model needs {shape}")
            w[name] = t
        with torch.no_grad():
            for g in range(self.num_groups - 1):
                self.codec_embedding[g].copy_(w[f"model.codec_embedding.{g}.weight"])
                self.lm_head[g].copy_(w[f"lm_head.{g}.weight"])
            self.norm.copy_(w["model.norm.weight"])
            if self.in_proj is not None and self.in_proj_bias is not None:
                self.in_proj.copy_(w["small_to_mtp_projection.weight"])
                self.in_proj_bias.copy_(w["small_to_mtp_projection.bias"])
            for i, layer in enumerate(self.layers):
                p = f"model.layers.{i}."
                layer.qkv.copy_(torch.cat([w[p + f"self_attn.{x}_proj.weight"].to(layer.qkv.device)
                                           for x in "qkv"]))
                layer.gate_up.copy_(torch.cat([w[p + f"mlp.{x}_proj.weight"].to(layer.gate_up.device)
                                               for x in ("gate", "up")]))
                for param, name in ((layer.o, "self_attn.o_proj"), (layer.down, "mlp.down_proj"),
                                    (layer.q_norm, "self_attn.q_norm"), (layer.k_norm, "self_attn.k_norm"),
                                    (layer.input_norm, "input_layernorm"),
                                    (layer.post_norm, "post_attention_layernorm")):
                    param.copy_(w[p + name + ".weight"])
        self._graphs = None  # captured graphs read the weights in place, but start clean after a load

    # -- buckets -----------------------------------------------------------------------
    def row_tile(self) -> int:
        """Padded batches are multiples of this (see :func:`row_tile`; 8 off CPU, a multiple of the
        warp-sized tiles GPU kernels use)."""
        if self.codec_embedding.device.type != "cpu":
            return 8
        hid, d, h, kv = self.hidden_size, self.head_dim, self.heads, self.kv_heads
        shapes = [(hid, (h + 2 * kv) * d), (h * d, hid), (hid, 2 * self.intermediate_size),
                  (self.intermediate_size, hid), (hid, self.vocab_size)]
        if self.in_proj is not None:
            shapes.append((self.input_size, hid))
        # the first pass has 2 rows a request
        tile = row_tile(sorted(set(shapes)), 2 * self.max_bucket, self.codec_embedding.dtype)
        return tile if self.max_bucket % tile == 0 else self.max_bucket

    def bucket(self, n: int) -> int:
        """The padded row count for a batch of n (n <= max_bucket): 1 for a
        batch of one on CPU without ``batch_invariant`` (a GEMV, module
        docstring), else a multiple of the row tile."""
        if n <= 1 and not self.batch_invariant and self.codec_embedding.device.type == "cpu":
            return 1
        tile = self.row_tile()
        return min(self.max_bucket, -(-max(n, 1) // tile) * tile)

    def _kv_cache(self, rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (k, v) [rows, kv, G, D] views of one buffer for max_bucket rows."""
        w = self.codec_embedding
        if self._kv is None or self._kv.device != w.device or self._kv.dtype != w.dtype:
            self._kv = torch.empty((len(self.layers), 2, self.max_bucket, self.kv_heads, self.num_groups,
                                    self.head_dim), dtype=w.dtype, device=w.device)
        return [(self._kv[i, 0, :rows], self._kv[i, 1, :rows]) for i in range(len(self.layers))]

    # -- the frame ---------------------------------------------------------------------
    def _frame(self, x: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
               seed: torch.Tensor, frame: torch.Tensor, candidates: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The 15 passes of one frame, static shapes: x [b, 2, I] (last hidden,
        code-0 embedding; I: ``input_size``), sampling [b] (seed [b, 2]).
        Returns codes [b, G-1] and the sum of their embeddings [b, I]."""
        b = x.shape[0]
        hidden = self.hidden_size
        kv = self._kv_cache(b)
        qk_norms = [layer.qk_norm_weight() for layer in self.layers]
        sampler = plan(temperature, top_k, top_p, candidates, self.vocab_size) if candidates else None
        u = uniforms(seed, frame, self._groups) if candidates else None
        codes: list[torch.Tensor] = []
        embed_sum: torch.Tensor | None = None
        # the first pass: both positions of each request
        h, t, pos = self._project(x.reshape(b * 2, self.input_size)), 2, 0
        for g in range(self.num_groups - 1):
            cos, sin = self._cos[pos : pos + t].to(h.dtype), self._sin[pos : pos + t].to(h.dtype)
            mask = self._mask if t > 1 else None
            for layer, (kc, vc), qk_norm in zip(self.layers, kv, qk_norms, strict=True):
                h = layer(h, t, pos, kc, vc, cos, sin, qk_norm, mask, self.eps)
            last = h if t == 1 else h.view(b, t, hidden)[:, -1]
            pos += t
            logits = F.linear(F.rms_norm(last, (hidden,), self.norm, self.eps), self.lm_head[g])
            if sampler is None or u is None:
                code = logits.argmax(-1)
            else:
                code = draw(logits.float(), sampler, u[:, g])
            codes.append(code)
            e = F.embedding(code, self.codec_embedding[g])
            embed_sum = e if embed_sum is None else embed_sum + e
            h = self._project(e)
            t = 1
        assert embed_sum is not None
        return torch.stack(codes, dim=1), embed_sum

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        """Inputs at the talker's width to the predictor's (``small_to_mtp_projection``; none when equal)."""
        return x if self.in_proj is None else F.linear(x, self.in_proj, self.in_proj_bias)

    def _graphed(self, device: torch.device) -> bool:
        """Whether frames on ``device`` replay captured CUDA graphs."""
        return device.type == "cuda" and self.cuda_graphs

    def _run_bucket(self, x: torch.Tensor, s: SamplingBatch, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows lo..hi-1, padded to their bucket with zero greedy rows."""
        n = hi - lo
        pad = self.bucket(n) - n
        args = [x[lo:hi], s.temperature[lo:hi], s.top_k[lo:hi], s.top_p[lo:hi], s.seed[lo:hi], s.frame[lo:hi]]
        if pad:
            args = [F.pad(a, (0, 0) * (a.dim() - 1) + (0, pad)) for a in args]
        dev = x.device
        if self._graphed(dev):
            if self._graphs is None:
                self._kv_cache(self.max_bucket)  # allocated once, before any capture
                self._graphs = _GraphRunner(self._frame)
            codes, embed_sum = self._graphs.run((args[0].shape[0], s.candidates), args, s.candidates)
        elif self.use_compile and dev.type == "cpu":
            if self._compiled is None:
                self._compiled = torch.compile(self._frame, dynamic=False)
            codes, embed_sum = self._compiled(*args, s.candidates)
        else:
            codes, embed_sum = self._frame(*args, s.candidates)
        return codes[:n], embed_sum[:n]

    @torch.inference_mode()
    def predict(self, last_hidden: torch.Tensor, code0_embed: torch.Tensor,
                sampling: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """last_hidden, code0_embed: [n, I] (the talker's width, ``input_size``);
        sampling: n rows. Returns (codes [n, G-1] int64, the sum of the
        residual codes' embeddings [n, I]) -- the talker adds that sum to the
        next step's input."""
        n = last_hidden.shape[0]
        if len(sampling) != n:
            raise ValueError(f"sampling: {len(sampling)} rows for {n} hidden rows")
        dtype = self.codec_embedding.dtype
        if n == 0:
            return (torch.empty((0, self.num_groups - 1), dtype=torch.int64, device=last_hidden.device),
                    torch.empty((0, self.input_size), dtype=dtype, device=last_hidden.device))
        x = torch.stack((last_hidden.to(dtype), code0_embed.to(dtype)), dim=1)
        if n <= self.max_bucket:
            return self._run_bucket(x, sampling, 0, n)
        parts = [self._run_bucket(x, sampling, lo, min(n, lo + self.max_bucket))
                 for lo in range(0, n, self.max_bucket)]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


# -- CUDA graphs ---------------------------------------------------------------------


class _CudaGraph:
    """One captured ``torch.cuda.CUDAGraph`` (warm-up on a side stream first:
    lazy library handles and allocations must not happen during capture)."""

    def __init__(self, pool: Any) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, fn: Callable[[], tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(self.graph, pool=self.pool):
            return fn()

    def replay(self) -> None:
        self.graph.replay()


class _GraphRunner:
    """The frame captured once per (bucket, candidates) and replayed.

    Inputs are copied into the entry's static buffers before each replay;
    outputs live in the graph's memory and are cloned before they are
    returned (the next replay overwrites them). The KV cache buffer is the
    predictor's own (allocated before the first capture, never reallocated
    while graphs hold it). ``make_graph`` is a seam for tests (a fake graph
    that re-runs the function on the same buffers)."""

    def __init__(self, frame: Callable[..., tuple[torch.Tensor, torch.Tensor]],
                 make_graph: Callable[[Any], Any] | None = None) -> None:
        self.frame = frame
        self.make_graph = make_graph  # None: CUDA graphs sharing one memory pool
        self.pool: Any = None
        self.entries: dict[tuple[int, int], tuple[Any, list[torch.Tensor], tuple[torch.Tensor, ...]]] = {}

    def run(self, key: tuple[int, int], args: Sequence[torch.Tensor],
            candidates: int) -> tuple[torch.Tensor, torch.Tensor]:
        entry = self.entries.get(key)
        if entry is None:
            if self.make_graph is None:
                if self.pool is None:
                    self.pool = torch.cuda.graph_pool_handle()
                graph = _CudaGraph(self.pool)
            else:
                graph = self.make_graph(self.pool)
            static = [a.clone() for a in args]
            outputs = graph.capture(lambda: self.frame(*static, candidates))
            entry = self.entries[key] = (graph, static, outputs)
        graph, static, outputs = entry
        for dst, src in zip(static, args, strict=True):
            dst.copy_(src)
        graph.replay()
        codes, embed_sum = outputs
        return codes.clone(), embed_sum.clone()
