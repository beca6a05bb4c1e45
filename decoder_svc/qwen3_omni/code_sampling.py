"""The code predictor's sampler: vectorised over rows, with counter-based noise.

Temperature, top-k and top-p per row, greedy rows (temperature 0) in the
same batch, no host sync: :func:`sample` (in a frame, one :func:`plan` and a
:func:`draw` per codebook, :class:`SamplingBatch` holding each row's
settings). Each row draws from its own counter-based stream
(:func:`uniforms`): a hash of (seed, frame index, codebook), so a request's
codes depend on its seed and its own frame count alone, never on which
requests share the batch, and the draw needs no generator state (CUDA graph
replay-safe).

Invariants:
- Sampling semantics follow transformers' warpers (temperature, then top-k,
  then top-p over the top-k distribution, keeping tokens whose preceding mass
  is below top_p), with exact ties broken by the smaller id (top-k keeps
  exactly k); the draw is the inverse CDF of one uniform over the kept
  tokens sorted by (logit desc, id asc) -- inverse CDF rather than
  Gumbel-max: one hash per row and codebook instead of one per vocabulary
  id.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["SamplingBatch", "candidate_count", "draw", "group_keys", "plan", "sample", "seed_words", "uniforms"]

# -- counter-based noise ---------------------------------------------------------
#
# A 32-bit hash on int64 tensors (lanes in [0, 2**32)): every product stays
# below 2**63, so int64 arithmetic is exact on every backend (no reliance on
# wrap-around). Chris Wellons' "lowbias32" mixer.

_M32 = 0xFFFFFFFF
_MIX1, _MIX2 = 0x7FEB352D, 0x846CA68B
_SALT = 0x5BD1E995  # separates this stream from any other hash of the seed
_U24 = 2.0**-24


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32), without an int64 overflow."""
    if c < 2**31:
        return (x * c) & _M32
    return (-(x * (2**32 - c))) & _M32  # x * c == -x * (2**32 - c)  (mod 2**32)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _MIX1)
    x = x ^ (x >> 15)
    x = _mul32(x, _MIX2)
    return x ^ (x >> 16)


def group_keys(num: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The per-codebook keys mixed into :func:`uniforms` (int64 [num])."""
    return _mix32((torch.arange(num, dtype=torch.int64, device=device) + 1) * 0x9E3779B9 & _M32)


def uniforms(seed: torch.Tensor, frame: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """One uniform in [0, 1) per (row, codebook): float32 [n, len(groups)].

    seed: int64 [n, 2], the request seed's low and high 32-bit words; frame:
    int64 [n], the request's frame index (frames predicted before this one);
    groups: :func:`group_keys`. A pure function of (seed, frame, codebook):
    no generator state, the same on every device and in any batch. 24 bits of
    resolution (the float32 mantissa)."""
    k = _mix32(seed[:, 0] ^ _SALT)
    k = _mix32(k ^ seed[:, 1])
    k = _mix32(k ^ (frame & _M32))
    k = _mix32(k ^ ((frame >> 32) & _M32))
    h = _mix32(k[:, None] ^ groups[None, :])
    return (h >> 8).to(torch.float32) * _U24


def seed_words(seed: int) -> tuple[int, int]:
    """A seed (unsigned 64-bit) as its low and high 32-bit words (the ``seed`` rows of :func:`uniforms`)."""
    return int(seed) & _M32, (int(seed) >> 32) & _M32


def candidate_count(temperature: Sequence[float], top_k: Sequence[int], vocab_size: int) -> int:
    """The static ``candidates`` of :func:`sample` for rows with these
    settings (sequences or numpy arrays): 0 when every row is greedy, else a
    power of two (at least 64) covering every sampled row's top-k, or the
    whole vocabulary when a sampled row has none."""
    sampled = [int(k) for t, k in zip(temperature, top_k, strict=True) if t > 0]
    if not sampled:
        return 0
    if all(0 < k < vocab_size for k in sampled):
        return min(vocab_size, max(64, 1 << (max(sampled) - 1).bit_length()))
    return vocab_size


# -- the sampler ------------------------------------------------------------------


@dataclass
class _Plan:
    """A frame's sampler constants: the rows' settings turned into tensors
    over candidate positions once, for the frame's 15 draws."""

    sampled: torch.Tensor  # bool [n, 1]: temperature > 0
    temperature: torch.Tensor  # float32 [n, 1] (1 for greedy rows)
    cut: torch.Tensor  # bool [n, c]: positions past the row's top-k
    top_p: torch.Tensor  # float32 [n, 1]
    kept: torch.Tensor  # bool [n, c]: kept whatever top-p says (the first; all when top_p >= 1)
    zero: torch.Tensor  # float32 [1]
    candidates: int


def plan(temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, candidates: int,
         vocab_size: int) -> _Plan:
    """The constants of :func:`draw` for rows with these settings (see :func:`sample`)."""
    c = min(int(candidates), vocab_size)
    sampled = temperature > 0
    pos = torch.arange(c, dtype=torch.int64, device=temperature.device)
    k = torch.where((top_k > 0) & (top_k < c), top_k, torch.full_like(top_k, c))
    return _Plan(
        sampled=sampled[:, None],
        temperature=torch.where(sampled, temperature, torch.ones_like(temperature))[:, None],
        cut=pos[None, :] >= k[:, None],
        top_p=top_p[:, None],
        kept=(pos[None, :] == 0) | (top_p[:, None] >= 1.0),
        zero=torch.zeros((1,), dtype=torch.float32, device=temperature.device),
        candidates=c,
    )


def draw(logits: torch.Tensor, p: _Plan, uniform: torch.Tensor) -> torch.Tensor:
    """One id per row from logits [n, V] float32 with the plan's settings and
    uniform [n] in [0, 1) (see :func:`sample`)."""
    vals, ids = logits.topk(p.candidates, dim=-1)
    # one canonical order, (logit desc, id asc): a stable sort by value of the candidates in id order
    ids, by_id = ids.sort(dim=-1)
    vals, by_val = vals.gather(-1, by_id).sort(dim=-1, descending=True, stable=True)
    ids = ids.gather(-1, by_val)
    vals = (vals / p.temperature).masked_fill_(p.cut, float("-inf"))
    weight = (vals - vals[:, :1]).exp_()  # unnormalised probabilities, the largest first
    cum = weight.cumsum(-1)
    # top-p: keep an id while the mass before it is below top_p of the whole (always the first)
    keep = ((cum - weight) < p.top_p * cum[:, -1:]) | p.kept
    cum = (weight * keep).cumsum(-1)
    total = cum[:, -1:]
    # the first id whose cumulative mass exceeds u * total; u * total < total even after rounding
    threshold = torch.minimum(uniform[:, None] * total, torch.nextafter(total, p.zero))
    j = torch.searchsorted(cum, threshold, right=True).masked_fill_(~p.sampled, 0)
    return ids.gather(-1, j)[:, 0]


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    uniform: torch.Tensor,
    candidates: int,
) -> torch.Tensor:
    """One id per row (int64 [n]) from logits [n, V] float32.

    temperature [n] (<= 0: greedy), top_k [n] int64 (0: off), top_p [n]
    (>= 1: off), uniform [n] in [0, 1) (the row's draw). ``candidates``
    (static) is how many of the best ids a sampled row may choose from: every
    sampled row's top_k must be in 1..candidates, or candidates must be V
    (0: every row greedy). Greedy is the largest logit, exact ties to the
    smaller id (argmax's).

    Rows are independent, and a row's id does not depend on ``candidates``
    either: the candidates are put in one canonical order (logit desc, id
    asc), every later quantity is a prefix sum (sequential on CPU), and the
    ids past a row's top-k weigh exactly 0. (A tie group straddling the
    candidate boundary could differ, which needs more than candidates - top_k
    equal logits.) No host sync, no data-dependent shape. The predictor
    builds the :func:`plan` once per frame and calls :func:`draw` per
    codebook."""
    if candidates <= 0:
        return logits.argmax(-1)
    return draw(logits, plan(temperature, top_k, top_p, candidates, logits.shape[-1]), uniform)


@dataclass
class SamplingBatch:
    """The code predictor's per-row sampling settings, as tensors on the
    model's device, plus the static candidate count (see :func:`sample`).

    ``frame`` is the request's frame index: its count of frames predicted so
    far, kept per request by the talker (``TalkerSlots.frames``)."""

    temperature: torch.Tensor  # float32 [n]
    top_k: torch.Tensor  # int64 [n]
    top_p: torch.Tensor  # float32 [n]
    seed: torch.Tensor  # int64 [n, 2]: the seed's low and high 32-bit words
    frame: torch.Tensor  # int64 [n]
    candidates: int  # 0: every row greedy; else ids a sampled row may choose from

    def __len__(self) -> int:
        return int(self.temperature.shape[0])

    @classmethod
    def build(
        cls,
        *,
        temperature: Sequence[float],
        top_k: Sequence[int],
        top_p: Sequence[float],
        seed: Sequence[int],
        frame: Sequence[int],
        vocab_size: int,
        device: torch.device | str | None = None,
    ) -> SamplingBatch:
        """From host values (one per row); the tensors are copied to
        ``device`` without a sync. A seed is an unsigned 64-bit integer."""
        n = len(temperature)
        for name, seq in (("top_k", top_k), ("top_p", top_p), ("seed", seed), ("frame", frame)):
            if len(seq) != n:
                raise ValueError(f"{name}: {len(seq)} values for {n} rows")
        candidates = candidate_count(temperature, top_k, vocab_size)
        words = [seed_words(s) for s in seed]

        def put(values: Any, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        return cls(
            temperature=put(list(temperature), torch.float32),
            top_k=put([int(k) for k in top_k], torch.int64),
            top_p=put(list(top_p), torch.float32),
            seed=torch.tensor(words, dtype=torch.int64).reshape(n, 2).to(device, non_blocking=True),
            frame=put([int(f) for f in frame], torch.int64),
            candidates=candidates,
        )

    @classmethod
    def greedy(cls, n: int, device: torch.device | str | None = None) -> SamplingBatch:
        """n greedy rows."""
        return cls.build(temperature=[0.0] * n, top_k=[0] * n, top_p=[1.0] * n, seed=[0] * n,
                         frame=[0] * n, vocab_size=1, device=device)
