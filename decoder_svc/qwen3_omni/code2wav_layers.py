"""Qwen3-Omni Code2Wav's layers and their streaming state (the model: ``.code2wav``).

``Code2WavConfig`` (the fields of ``Qwen3OmniMoeCode2WavConfig`` that shape
the computation) and the plain-torch layers of the reference model
(transformers' ``Qwen3OmniMoeCode2Wav``), each with parameter names that
match the released ``code2wav.*`` tensors. Every layer is causal and has a
``new_stream()``: a small object carrying exactly the state its layer needs
to decode incrementally (``.code2wav`` lists them), so that the
concatenated output of all pushes equals the whole-sequence forward up to
float rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "relu": F.relu,
}


# --------------------------------------------------------------------- config


@dataclass(frozen=True)
class Code2WavConfig:
    """The fields of ``Qwen3OmniMoeCode2WavConfig`` that shape the computation."""

    codebook_size: int = 2048
    num_quantizers: int = 16
    hidden_size: int = 1024
    num_hidden_layers: int = 8
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int = 64
    intermediate_size: int = 3072
    hidden_act: str = "silu"
    attention_bias: bool = False
    sliding_window: int = 72
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    upsampling_ratios: tuple[int, ...] = (2, 2)
    upsample_rates: tuple[int, ...] = (8, 5, 4, 3)
    decoder_dim: int = 1536

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Code2WavConfig:
        """From a ``code2wav_config`` dict; unknown keys are ignored, missing ones default."""
        names = {f.name for f in fields(cls)} - {"head_dim", "rope_theta"}
        kwargs: dict[str, Any] = {k: raw[k] for k in names if raw.get(k) is not None}
        for key in ("upsampling_ratios", "upsample_rates"):
            if key in kwargs:
                kwargs[key] = tuple(int(v) for v in kwargs[key])
        hidden = int(kwargs.get("hidden_size", cls.hidden_size))
        heads = int(kwargs.get("num_attention_heads", cls.num_attention_heads))
        kwargs["head_dim"] = int(raw.get("head_dim") or hidden // heads)
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"code2wav: unsupported rope_type {rope_type!r} (only 'default')")
        theta = rope.get("rope_theta", raw.get("rope_theta"))
        kwargs["rope_theta"] = float(theta) if theta is not None else cls.rope_theta
        cfg = cls(**kwargs)
        cfg._validate()
        return cfg

    def _validate(self) -> None:
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"code2wav: unsupported hidden_act {self.hidden_act!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                "code2wav: num_attention_heads must be a multiple of num_key_value_heads"
            )
        if self.sliding_window < 1:
            raise ValueError("code2wav: sliding_window must be >= 1")
        if self.decoder_dim % 2 ** len(self.upsample_rates):
            raise ValueError("code2wav: decoder_dim must halve evenly through every decoder block")


# ------------------------------------------------------------ stream protocol


class _Stream(Protocol):
    def push(self, x: torch.Tensor) -> torch.Tensor: ...


class _StatelessStream:
    """Stream of a pointwise layer: every push is just the layer."""

    def __init__(self, layer: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.layer = layer

    def push(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


class _ChainStream:
    """Streams applied one after the other."""

    def __init__(self, streams: Sequence[_Stream]) -> None:
        self.streams = list(streams)

    def push(self, x: torch.Tensor) -> torch.Tensor:
        for stream in self.streams:
            x = stream.push(x)
        return x


# ------------------------------------------------------------- conv layers


class SnakeBeta(nn.Module):
    """x + 1 / (exp(beta) + 1e-9) * sin(x * exp(alpha))^2, per channel; x is [B, C, L]."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = torch.exp(self.alpha.unsqueeze(0).unsqueeze(-1))
        beta = torch.exp(self.beta.unsqueeze(0).unsqueeze(-1))
        return x + (1.0 / (beta + 0.000000001)) * torch.pow(torch.sin(x * alpha), 2)

    def new_stream(self) -> _Stream:
        return _StatelessStream(self)


class CausalConv1d(nn.Module):
    """Stride-1 conv left-padded with ``(kernel - 1) * dilation`` zeros; x is [B, C, L]."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        dilation: int = 1,
        groups: int = 1,
    ) -> None:
        super().__init__()
        self.conv = nn.Conv1d(
            in_channels, out_channels, kernel_size, dilation=dilation, groups=groups
        )
        self.padding = (kernel_size - 1) * dilation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (self.padding, 0), mode="constant", value=0)).contiguous()

    def new_stream(self) -> _Stream:
        return _CausalConvStream(self)


class _CausalConvStream:
    """State: the last ``padding`` input samples (zeros before the first push)."""

    def __init__(self, layer: CausalConv1d) -> None:
        self.layer = layer
        self.history: torch.Tensor | None = None

    def push(self, x: torch.Tensor) -> torch.Tensor:
        conv, pad = self.layer.conv, self.layer.padding
        if x.shape[-1] == 0:
            return x.new_zeros(x.shape[0], conv.out_channels, 0)
        if pad == 0:
            return conv(x).contiguous()
        if self.history is None:
            self.history = x.new_zeros(x.shape[0], x.shape[1], pad)
        padded = torch.cat([self.history, x], dim=-1)
        self.history = padded[..., -pad:].clone()
        return conv(padded).contiguous()


class CausalTransConv1d(nn.Module):
    """Transposed conv trimmed by ``kernel - stride`` samples on both sides
    (Qwen3-Omni's Code2Wav), or on the right only (``trim_left=False``:
    Qwen3-TTS's 12 Hz decoder).

    Trimmed on both sides, output sample j depends on input samples up to
    ``(j + kernel - stride) // stride`` (one ahead of its own for kernel
    2 * stride) and L inputs give ``L * stride - (kernel - stride)`` outputs;
    trimmed on the right only, output j depends on inputs up to
    ``j // stride`` and L inputs give ``L * stride`` outputs.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int,
                 *, trim_left: bool = True) -> None:
        super().__init__()
        if kernel_size < stride:
            raise ValueError("code2wav: transposed conv kernel must be >= its stride")
        self.conv = nn.ConvTranspose1d(in_channels, out_channels, kernel_size, stride=stride)
        self.kernel_size = kernel_size
        self.stride = stride
        self.trim = kernel_size - stride  # removed on the right; on the left too unless trim_left is False
        self.left = self.trim if trim_left else 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return y[..., self.left : y.shape[-1] - self.trim].contiguous()

    def new_stream(self) -> _Stream:
        return _CausalTransConvStream(self)


class _CausalTransConvStream:
    """State: the last ``ceil(kernel / stride) - 1`` input samples and the input count.

    In untrimmed output coordinates, input i contributes to [i*s, i*s + k), so
    after N inputs the outputs t < N*s are final; the reference keeps
    t in [left, L*s), so exactly those are emitted, each computed once.
    """

    def __init__(self, layer: CausalTransConv1d) -> None:
        self.layer = layer
        self.keep = -(-layer.kernel_size // layer.stride) - 1
        self.history: torch.Tensor | None = None
        self.inputs = 0

    def push(self, x: torch.Tensor) -> torch.Tensor:
        conv, s, left = self.layer.conv, self.layer.stride, self.layer.left
        prev = self.inputs
        self.inputs += x.shape[-1]
        if x.shape[-1] == 0:
            return x.new_zeros(x.shape[0], conv.out_channels, 0)
        window = x if self.history is None else torch.cat([self.history, x], dim=-1)
        first = prev - (window.shape[-1] - x.shape[-1])  # input index of window[..., 0]
        if self.keep:
            self.history = window[..., -self.keep :].clone()
        lo = max(left, prev * s) - first * s
        hi = self.inputs * s - first * s
        if hi <= lo:
            return x.new_zeros(x.shape[0], conv.out_channels, 0)
        return conv(window)[..., lo:hi].contiguous()


class ConvNeXtBlock(nn.Module):
    """Causal depthwise conv (k=7), LayerNorm, MLP (4x, GELU), layer scale, residual."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = CausalConv1d(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._after_dwconv(x, self.dwconv(x))

    def _after_dwconv(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        h = h.permute(0, 2, 1)
        h = self.pwconv2(F.gelu(self.pwconv1(self.norm(h))))
        h = (self.gamma * h).permute(0, 2, 1)
        return x + h

    def new_stream(self) -> _Stream:
        return _ConvNeXtStream(self)


class _ConvNeXtStream:
    """State: the depthwise conv's history."""

    def __init__(self, block: ConvNeXtBlock) -> None:
        self.block = block
        self.dwconv = block.dwconv.new_stream()

    def push(self, x: torch.Tensor) -> torch.Tensor:
        return self.block._after_dwconv(x, self.dwconv.push(x))


class ResidualUnit(nn.Module):
    """x + conv2(snake(conv1(snake(x)))), conv1 k=7 dilated, conv2 k=1."""

    def __init__(self, dim: int, dilation: int) -> None:
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv1d(dim, dim, 7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv1d(dim, dim, 1)

    def _layers(self) -> list[nn.Module]:
        return [self.act1, self.conv1, self.act2, self.conv2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for layer in self._layers():
            h = layer(h)
        return h + x

    def new_stream(self) -> _Stream:
        return _ResidualStream(_ChainStream([m.new_stream() for m in self._layers()]))


class _ResidualStream:
    def __init__(self, inner: _Stream) -> None:
        self.inner = inner

    def push(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner.push(x) + x


class DecoderBlock(nn.Module):
    """SnakeBeta, causal transposed conv (kernel 2r, stride r), residual units 1/3/9."""

    def __init__(self, in_dim: int, out_dim: int, rate: int, *, trim_left: bool = True) -> None:
        super().__init__()
        self.block = nn.ModuleList(
            [SnakeBeta(in_dim), CausalTransConv1d(in_dim, out_dim, 2 * rate, rate, trim_left=trim_left)]
            + [ResidualUnit(out_dim, d) for d in (1, 3, 9)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.block:
            x = layer(x)
        return x

    def new_stream(self) -> _Stream:
        return _ChainStream([m.new_stream() for m in self.block])


# -------------------------------------------------------------- transformer


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


class LayerScale(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class Mlp(nn.Module):
    def __init__(self, cfg: Code2WavConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _KVCache:
    """Rolling window of the last ``size`` keys/values ([B, kv_heads, <=size, D])."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached + new keys/values for this step; keeps the last ``size`` for the next."""
        if self.keys is not None and self.values is not None:
            k = torch.cat([self.keys, k], dim=2)
            v = torch.cat([self.values, v], dim=2)
        keep = min(self.size, k.shape[2])
        self.keys = k[:, :, k.shape[2] - keep :].clone() if keep else k[:, :, :0]
        self.values = v[:, :, v.shape[2] - keep :].clone() if keep else v[:, :, :0]
        return k, v


class Attention(nn.Module):
    def __init__(self, cfg: Code2WavConfig) -> None:
        super().__init__()
        h, d, bias = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.q_proj = nn.Linear(h, cfg.num_attention_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=bias)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=bias)
        self.head_dim = d
        self.groups = cfg.num_attention_heads // cfg.num_key_value_heads
        self.scaling = d**-0.5

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        cache: _KVCache | None = None,
    ) -> torch.Tensor:
        """x [B, n, H]; cos/sin [n, D]; mask [n, cached + n] (True = attend)."""
        shape = (*x.shape[:-1], -1, self.head_dim)
        q = self.q_proj(x).view(shape).transpose(1, 2)
        k = self.k_proj(x).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        q = (q * cos) + (_rotate_half(q) * sin)
        k = (k * cos) + (_rotate_half(k) * sin)
        if cache is not None:
            k, v = cache.extend(k, v)
        if self.groups > 1:
            k = k.repeat_interleave(self.groups, dim=1)
            v = v.repeat_interleave(self.groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling)
        out = out.transpose(1, 2).reshape(*x.shape[:-1], -1).contiguous()
        return self.o_proj(out)


class TransformerLayer(nn.Module):
    def __init__(self, cfg: Code2WavConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = Mlp(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn_layer_scale = LayerScale(cfg.hidden_size)
        self.mlp_layer_scale = LayerScale(cfg.hidden_size)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        cache: _KVCache | None = None,
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        x = x + self.self_attn_layer_scale(attn)
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class Transformer(nn.Module):
    """Sliding-window causal transformer: query p attends to keys (p - window, p].

    With ``io_size`` (Qwen3-TTS's decoder) it reads and writes rows of that
    width through ``input_proj`` / ``output_proj`` (linear, per row)."""

    def __init__(self, cfg: Code2WavConfig, io_size: int | None = None) -> None:
        super().__init__()
        self.layers = nn.ModuleList([TransformerLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_proj: nn.Module = nn.Identity()
        self.output_proj: nn.Module = nn.Identity()
        if io_size is not None:
            self.input_proj = nn.Linear(io_size, cfg.hidden_size)
            self.output_proj = nn.Linear(cfg.hidden_size, io_size)
        self.window = cfg.sliding_window
        arange = torch.arange(0, cfg.head_dim, 2, dtype=torch.float, device="cpu")
        self.inv_freq = 1.0 / (cfg.rope_theta ** (arange / cfg.head_dim))

    def rope(self, start: int, n: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [n, head_dim] for absolute positions start .. start + n - 1."""
        positions = torch.arange(start, start + n, device=like.device)
        freqs = positions[:, None].float() * self.inv_freq.to(like.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(like.dtype), emb.sin().to(like.dtype)

    def mask(self, start: int, n: int, cached: int, device: torch.device) -> torch.Tensor:
        """[n, cached + n] bool: queries start.., keys start - cached.. ."""
        q = torch.arange(start, start + n, device=device)[:, None]
        k = torch.arange(start - cached, start + n, device=device)[None, :]
        return (k <= q) & (k > q - self.window)

    def run(self, x: torch.Tensor, start: int, caches: Sequence[_KVCache] | None) -> torch.Tensor:
        x = self.input_proj(x)
        n = x.shape[1]
        cos, sin = self.rope(start, n, x)
        cached = 0
        if caches is not None and caches and caches[0].keys is not None:
            cached = caches[0].keys.shape[2]
        mask = self.mask(start, n, cached, x.device)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, None if caches is None else caches[i])
        return self.output_proj(self.norm(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(x, 0, None)

    def new_stream(self) -> _Stream:
        return _TransformerStream(self)


class _TransformerStream:
    """State: per layer the last ``window - 1`` keys/values, and the next position."""

    def __init__(self, model: Transformer) -> None:
        self.model = model
        self.caches = [_KVCache(model.window - 1) for _ in model.layers]
        self.position = 0

    def push(self, x: torch.Tensor) -> torch.Tensor:
        out = self.model.run(x, self.position, self.caches)
        self.position += x.shape[1]
        return out


