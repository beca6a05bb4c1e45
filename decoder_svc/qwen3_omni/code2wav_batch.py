"""One Code2Wav forward for the next chunk of many streams: ``push_many``.

Each stream keeps its own state (``Code2WavStream``: per layer the last
inputs of a causal conv, the last inputs and the input count of a causal
transposed conv, the rolling keys/values and the position of the
transformer). ``push_many`` stacks those states, runs the layers once over
all streams, and writes each stream's new state back, so a stream's audio is
the same whichever other streams shared its forward, and equal to pushing it
alone within float rounding (tests/test_code2wav_batch.py: 1e-4 of the whole
decode, as for any chunking).

Ragged chunks (streams at different points of their ramp) are right-padded
to the longest. Every layer is causal, so a stream's real samples never
depend on the padding after them; its new state is taken at its own end,
never at the batch's. At every layer the batch is a padded tensor
``[B, C, L]`` and each stream's real length ``lengths[i]``.

The transformer's streams sit at different positions with different numbers
of cached keys: rotary angles are per row, cached keys are left-padded to the
longest cache, and the attention mask hides the padding (and keeps the
sliding window per row).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .code2wav import Code2WavStream
from .code2wav_layers import (
    _CausalConvStream,
    _CausalTransConvStream,
    _ChainStream,
    _ConvNeXtStream,
    _KVCache,
    _ResidualStream,
    _StatelessStream,
    _TransformerStream,
)

__all__ = ["InvalidRow", "push_many"]


class InvalidRow(ValueError):
    """The codes of row ``index`` cannot be decoded; no stream's state changed."""

    def __init__(self, index: int, cause: Exception) -> None:
        super().__init__(f"row {index}: {cause}")
        self.index = index
        self.cause = cause


def push_many(streams: Sequence[Code2WavStream], codes: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``stream.push(codes)`` for every stream, in one forward: the samples each
    stream's new frames made final. All codes are checked before any state
    changes (``InvalidRow`` names the first bad row)."""
    if len(streams) != len(codes):
        raise ValueError(f"code2wav: {len(streams)} streams but {len(codes)} code blocks")
    if not streams:
        return []
    model = streams[0].model
    if any(s.model is not model for s in streams):
        raise ValueError("code2wav: push_many needs streams of one model")
    checked = []
    for i, c in enumerate(codes):
        try:
            checked.append(model._check_codes(c, "push"))
        except ValueError as exc:
            raise InvalidRow(i, exc) from exc
    if len(streams) == 1:
        return [streams[0].push(checked[0])]
    lengths = [c.shape[0] for c in checked]
    padded = checked[0].new_zeros(len(checked), max(lengths), model.num_quantizers)
    for i, c in enumerate(checked):
        padded[i, : c.shape[0]] = c
    padded = padded.to(model.device)
    with torch.inference_mode():
        h = model._embed(padded)  # [B, T, C]
        if streams[0]._pre is not None:  # convolutions before the transformer (Qwen3-TTS's pre_conv)
            h, _ = _push([s._pre for s in streams], h.transpose(1, 2), lengths)
            h = h.transpose(1, 2)
        h = _transformer([s._transformer for s in streams], h, lengths).permute(0, 2, 1)
        h, out = _push([s._convs for s in streams], h, lengths)
        wav = h.clamp(min=-1, max=1).to("cpu", torch.float32)  # the audio's one device-to-host copy
    pieces = []
    for i, s in enumerate(streams):
        piece = wav[i, 0, : out[i]].clone()
        s.frames += lengths[i]
        s.samples += piece.shape[0]
        expected = s.frames * model.samples_per_frame - model.tail_samples
        if s.samples != expected:  # a layer's bookkeeping is off: never silently drift
            raise RuntimeError(f"code2wav stream emitted {s.samples} samples, expected {expected}")
        pieces.append(piece)
    return pieces


# ------------------------------------------------------------------ conv stack


def _push(streams: list, x: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, list[int]]:
    """One layer's (or chain's) push over a batch of same-kind streams:
    x [B, C, L] right-padded, lengths the real ones; returns the same."""
    first = streams[0]
    if isinstance(first, _ChainStream):
        for k in range(len(first.streams)):
            x, lengths = _push([s.streams[k] for s in streams], x, lengths)
        return x, lengths
    if isinstance(first, _StatelessStream):
        return first.layer(x), lengths
    if isinstance(first, _ResidualStream):
        h, lengths = _push([s.inner for s in streams], x, lengths)
        return h + x, lengths
    if isinstance(first, _ConvNeXtStream):
        h, lengths = _push([s.dwconv for s in streams], x, lengths)
        return first.block._after_dwconv(x, h), lengths
    if isinstance(first, _CausalConvStream):
        return _causal_conv(streams, x, lengths), lengths
    if isinstance(first, _CausalTransConvStream):
        return _causal_trans_conv(streams, x, lengths)
    raise TypeError(f"code2wav: no batched push for {type(first).__name__}")


def _history(streams: list, x: torch.Tensor, size: int) -> torch.Tensor:
    """The streams' last `size` inputs [B, C, size], zeros where a stream has
    fewer (before its first push: a causal layer's zero padding)."""
    rows = []
    for s in streams:
        h = s.history
        if h is None:
            rows.append(x.new_zeros(x.shape[1], size))
        elif h.shape[-1] < size:
            rows.append(torch.cat([h.new_zeros(x.shape[1], size - h.shape[-1]), h[0]], dim=-1))
        else:
            rows.append(h[0])
    return torch.stack(rows)


def _causal_conv(streams: list, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    layer = streams[0].layer
    conv, pad = layer.conv, layer.padding
    if pad == 0:
        return conv(x).contiguous()
    padded = torch.cat([_history(streams, x, pad), x], dim=-1)
    for i, s in enumerate(streams):  # its last `pad` real inputs
        s.history = padded[i : i + 1, :, lengths[i] : lengths[i] + pad].clone()
    return conv(padded).contiguous()


def _causal_trans_conv(
    streams: list, x: torch.Tensor, lengths: list[int]
) -> tuple[torch.Tensor, list[int]]:
    """As ``_CausalTransConvStream.push`` per row. With a history of `keep`
    inputs (zeros before the first push: a zero input adds nothing to any
    output), row i's window starts at input ``inputs_i - keep``; its outputs
    are [max(left, inputs_i * s), (inputs_i + n_i) * s) in the untrimmed
    coordinates of its whole sequence."""
    layer = streams[0].layer
    conv, s, left, keep = layer.conv, layer.stride, layer.left, streams[0].keep
    window = torch.cat([_history(streams, x, keep), x], dim=-1) if keep else x
    y = conv(window)
    spans = []
    for i, st in enumerate(streams):
        prev, n = st.inputs, lengths[i]
        st.inputs += n
        if keep:
            st.history = window[i : i + 1, :, n : n + keep].clone()
        base = (prev - keep) * s  # untrimmed position of y[i, :, 0]
        lo, hi = max(left, prev * s) - base, (prev + n) * s - base
        spans.append((lo, max(lo, hi)))
    out = [hi - lo for lo, hi in spans]
    width = max(out)
    if len({lo for lo, _ in spans}) == 1:  # one slice; a shorter row's tail is padding
        lo = spans[0][0]
        return y[..., lo : lo + width].contiguous(), out
    packed = y.new_zeros(y.shape[0], y.shape[1], width)
    for i, (lo, hi) in enumerate(spans):
        packed[i, :, : hi - lo] = y[i, :, lo:hi]
    return packed, out


# ------------------------------------------------------------------ transformer


class _BatchCache:
    """The streams' caches of one layer as one: ``extend`` returns the left-
    padded cached keys/values followed by the new ones, and keeps each
    stream's last ``size`` real keys/values in its own cache."""

    def __init__(self, caches: list[_KVCache], lengths: list[int], cached: list[int], width: int) -> None:
        self.caches, self.lengths, self.cached, self.width = caches, lengths, cached, width

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, heads, _, d = k.shape
        old_k = k.new_zeros(b, heads, self.width, d)
        old_v = v.new_zeros(b, heads, self.width, d)
        for i, cache in enumerate(self.caches):
            n_old, n = self.cached[i], self.lengths[i]
            if n_old:
                old_k[i, :, self.width - n_old :] = cache.keys[0]
                old_v[i, :, self.width - n_old :] = cache.values[0]
            # its own extend: cached + its real new keys, the last `size` kept
            cache.keys = cache.keys if n_old else None
            cache.values = cache.values if n_old else None
            cache.extend(k[i : i + 1, :, :n], v[i : i + 1, :, :n])
        return torch.cat([old_k, k], dim=2), torch.cat([old_v, v], dim=2)


def _transformer(streams: list[_TransformerStream], x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """``_TransformerStream.push`` per row: x [B, N, hidden] right-padded."""
    model = streams[0].model
    x = model.input_proj(x)
    n = x.shape[1]
    starts = torch.tensor([s.position for s in streams], device=x.device)
    positions = starts[:, None] + torch.arange(n, device=x.device)[None, :]  # [B, N]
    freqs = positions[..., None].float() * model.inv_freq.to(x.device)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, N, D]
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    cached = [0 if s.caches[0].keys is None else s.caches[0].keys.shape[2] for s in streams]
    width = max(cached)
    # keys: slot m < width is cached key (position start - (width - m)), valid
    # when the row has that many; slot width + j is new key j
    slot = torch.arange(width + n, device=x.device)
    key_pos = starts[:, None] + slot[None, :] - width  # [B, width + N]
    valid = slot[None, :] >= (width - torch.tensor(cached, device=x.device))[:, None]
    q = positions[:, :, None]  # [B, N, 1]
    k = key_pos[:, None, :]  # [B, 1, width + N]
    mask = (k <= q) & (k > q - model.window) & valid[:, None, :]
    mask = mask[:, None]  # [B, 1, N, width + N]
    for i, layer in enumerate(model.layers):
        cache = _BatchCache([s.caches[i] for s in streams], lengths, cached, width)
        x = layer(x, cos, sin, mask, cache)
    for s, length in zip(streams, lengths, strict=True):
        s.position += length
    return model.output_proj(model.norm(x))
