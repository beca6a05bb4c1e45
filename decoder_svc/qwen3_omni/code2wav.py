"""Qwen3-Omni Code2Wav: the neural codec decoder, codes [T, Q] -> 24 kHz audio.

A plain-torch implementation that loads the released checkpoint's ``code2wav.*``
tensors by their released names and reproduces the reference model
(transformers' ``Qwen3OmniMoeCode2Wav``) op for op:

    codes [T, Q] -> mean of Q code embeddings            [T, hidden]
      -> sliding-window causal transformer (RoPE)        [T, hidden]
      -> per upsampling ratio: causal transposed conv (kernel == stride)
         + ConvNeXt block (causal depthwise conv)        [hidden, T * 4]
      -> causal conv to decoder_dim
      -> per upsample rate r: SnakeBeta, causal transposed conv
         (kernel 2r, stride r), 3 residual units (dilations 1, 3, 9)
      -> SnakeBeta, causal conv to 1 channel, clamp to [-1, 1]

Every stage is causal, so the audio of the first N frames is a prefix of the
audio of any longer sequence. The transposed convolutions trim ``kernel -
stride`` samples on both sides: an output sample depends on the next input
sample, so the last ``kernel - stride`` samples of every decoder block are
missing. Summed through the later strides that is ``tail_samples`` (8*60 +
5*12 + 4*3 + 3 = 555 for the standard config): T frames give
``T * samples_per_frame - tail_samples`` samples.

``Code2WavStream`` decodes incrementally. Each layer type has a small stream
object carrying exactly the state its layer needs:

- causal conv: the last ``(kernel - 1) * dilation`` input samples (its left
  padding, zeros at the start);
- causal transposed conv: the last ``ceil(kernel / stride) - 1`` input samples
  (their contributions overlap the not-yet-emitted outputs) and the count of
  input samples seen;
- attention: the last ``sliding_window - 1`` keys (after RoPE) and values and
  the absolute position of the next frame;
- ConvNeXt block, residual unit, decoder block: the states of their convs;
  SnakeBeta, norms, linears: none.

A push of n frames costs O(n) (plus the bounded state), and the concatenated
output of all pushes equals the whole-sequence decode up to float rounding.

The layers and their stream objects are in ``.code2wav_layers``; the
vocoder that serves this model to the generation stage (and that a code2wav
worker process rebuilds) is ``.vocoder.CheckpointVocoder``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .code2wav_layers import (
    CausalConv1d,
    CausalTransConv1d,
    Code2WavConfig,
    ConvNeXtBlock,
    DecoderBlock,
    SnakeBeta,
    Transformer,
    _ChainStream,
)

__all__ = [
    "CodecDecoder",
    "Code2Wav",
    "Code2WavStream",
    "decode_with_left_context",
    "random_tensors",
]

SAMPLE_RATE = 24_000

# Non-persistent buffers of the reference that some exports still contain;
# they are derived from the config here, so they are accepted and ignored.
_DERIVED_BUFFERS = frozenset(
    {
        "code_offset",
        "pre_transformer.rotary_emb.inv_freq",
        "pre_transformer.rotary_emb.original_inv_freq",
    }
)



# -------------------------------------------------------------------- model


class CodecDecoder(nn.Module):
    """What a streaming codec decoder has in common (Qwen3-Omni's Code2Wav,
    Qwen3-TTS's 12 Hz decoder): codes [T, Q] -> per-frame rows (``_embed``)
    -> causal convolutions before the transformer (``_pre_stack``; none in
    Code2Wav) -> the sliding-window transformer (``pre_transformer``) ->
    the upsampling and decoder convolutions (``_conv_stack``) -> audio in
    [-1, 1]. Subclasses build the layers and call :meth:`_setup`."""

    code_embedding: nn.Module
    pre_transformer: Transformer
    upsample: nn.ModuleList
    decoder: nn.ModuleList

    def _setup(self, num_quantizers: int, codebook_size: int, upsampling_ratios: tuple[int, ...],
               upsample_rates: tuple[int, ...]) -> None:
        self.num_quantizers = num_quantizers
        self.codebook_size = codebook_size
        self.sample_rate = SAMPLE_RATE
        self.samples_per_frame = math.prod(upsampling_ratios) * math.prod(upsample_rates)
        # Each transposed conv trimmed on its left loses that many samples at its own rate.
        tail, scale = 0, 1
        for layer in reversed([m for m in self.modules() if isinstance(m, CausalTransConv1d)]):
            tail += layer.left * scale
            scale *= layer.stride
        self.tail_samples = tail

    # ---------------------------------------------------------- loading

    @classmethod
    def _from_config(cls, config: Mapping[str, Any]) -> CodecDecoder:
        raise NotImplementedError

    @classmethod
    def expected_shapes(cls, config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
        """Released tensor names (without prefix) -> shapes for this config."""
        with torch.device("meta"):
            model = cls._from_config(config)
        return {name: tuple(t.shape) for name, t in model.state_dict().items()}

    @classmethod
    def from_config_and_tensors(
        cls,
        config: Mapping[str, Any],
        tensors: Mapping[str, torch.Tensor],
        prefix: str = "code2wav.",
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> Any:
        """Build from a config dict and checkpoint tensors, its weights on
        `device` in `dtype` (derived buffers -- rotary frequencies, code
        offsets -- stay float32)."""
        with torch.device("meta"):
            model = cls._from_config(config)
        what = prefix.rstrip(".")
        expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        state: dict[str, torch.Tensor] = {}
        for name, shape in expected.items():
            key = prefix + name
            if key not in tensors:
                raise ValueError(f"{what}: missing tensor {key!r} (expected shape {shape})")
            tensor = tensors[key]
            if tuple(tensor.shape) != shape:
                raise ValueError(
                    f"{what}: tensor {key!r} has shape {tuple(tensor.shape)}, expected {shape}"
                )
            state[name] = tensor.detach().to(device=device, dtype=dtype).contiguous()
        unexpected = sorted(
            key
            for key in tensors
            if key.startswith(prefix)
            and key[len(prefix) :] not in expected
            and key[len(prefix) :] not in _DERIVED_BUFFERS
        )
        if unexpected:
            raise ValueError(
                f"{what}: unexpected tensors {unexpected[:8]} ({len(unexpected)} in all)"
            )
        model.load_state_dict(state, strict=True, assign=True)
        model.requires_grad_(False)
        return model.eval()

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    # ---------------------------------------------------------- decoding

    def _embed(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, T, Q] -> rows [B, T, C] (stateless per frame)."""
        raise NotImplementedError

    def _pre_stack(self) -> list[nn.Module]:
        """Causal layers between the rows and the transformer (all take [B, C, L])."""
        return []

    def _conv_stack(self) -> list[nn.Module]:
        """The layers after the transformer, in order (all take [B, C, L])."""
        return [layer for blocks in self.upsample for layer in blocks] + list(self.decoder)

    def _check_codes(self, codes: torch.Tensor, what: str) -> torch.Tensor:
        if codes.dim() != 2 or codes.shape[1] != self.num_quantizers or codes.shape[0] < 1:
            raise ValueError(
                f"code2wav: {what} expects codes [frames >= 1, {self.num_quantizers}], "
                f"got {tuple(codes.shape)}"
            )
        if codes.dtype.is_floating_point or codes.dtype == torch.bool:
            raise ValueError(f"code2wav: codes must be integers, got {codes.dtype}")
        codes = codes.to(torch.long)
        if int(codes.min()) < 0 or int(codes.max()) >= self.codebook_size:
            raise ValueError(f"code2wav: codes must lie in [0, {self.codebook_size})")
        return codes

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes int [T, Q] -> float32 [T * samples_per_frame - tail_samples], in [-1, 1]."""
        codes = self._check_codes(codes, "decode").to(self.device)
        with torch.inference_mode():
            h = self._embed(codes[None]).transpose(1, 2)
            for layer in self._pre_stack():
                h = layer(h)
            h = self.pre_transformer(h.transpose(1, 2)).permute(0, 2, 1)
            for layer in self._conv_stack():
                h = layer(h)
            return h.clamp(min=-1, max=1)[0, 0].to("cpu", torch.float32)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        return self.decode(codes)

    def new_stream(self) -> Code2WavStream:
        return Code2WavStream(self)


class Code2Wav(CodecDecoder):
    """Qwen3-Omni Code2Wav; parameter names match the released ``code2wav.*`` tensors."""

    def __init__(self, config: Code2WavConfig) -> None:
        super().__init__()
        cfg = config
        self.config = cfg
        h = cfg.hidden_size
        self.code_embedding = nn.Embedding(cfg.codebook_size * cfg.num_quantizers, h)
        self.pre_transformer = Transformer(cfg)
        self.upsample = nn.ModuleList(
            [
                nn.ModuleList([CausalTransConv1d(h, h, f, f), ConvNeXtBlock(h)])
                for f in cfg.upsampling_ratios
            ]
        )
        dims = [cfg.decoder_dim // 2**i for i in range(len(cfg.upsample_rates) + 1)]
        self.decoder = nn.ModuleList(
            [CausalConv1d(h, cfg.decoder_dim, 7)]
            + [DecoderBlock(dims[i], dims[i + 1], r) for i, r in enumerate(cfg.upsample_rates)]
            + [SnakeBeta(dims[-1]), CausalConv1d(dims[-1], 1, 7)]
        )
        self.code_offset = torch.arange(cfg.num_quantizers, device="cpu") * cfg.codebook_size
        self._setup(cfg.num_quantizers, cfg.codebook_size, cfg.upsampling_ratios, cfg.upsample_rates)

    @classmethod
    def _from_config(cls, config: Mapping[str, Any]) -> Code2Wav:
        return cls(Code2WavConfig.from_dict(config))

    @property
    def device(self) -> torch.device:
        return self.code_embedding.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.code_embedding.weight.dtype

    def _embed(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, T, Q] -> [B, T, hidden]: mean over quantizers of the offset embeddings."""
        ids = codes.transpose(1, 2) + self.code_offset.to(codes.device)[None, :, None]  # [B, Q, T]
        return self.code_embedding(ids).mean(1)


class Code2WavStream:
    """Incremental decode: ``push`` new frames, get the samples that became final."""

    def __init__(self, model: CodecDecoder) -> None:
        self.model = model
        self.frames = 0
        self.samples = 0
        pre = model._pre_stack()
        self._pre = _ChainStream([layer.new_stream() for layer in pre]) if pre else None
        self._transformer = model.pre_transformer.new_stream()
        self._convs = _ChainStream([layer.new_stream() for layer in model._conv_stack()])

    def push(self, codes: torch.Tensor) -> torch.Tensor:
        """codes int [n >= 1, Q] (any device) -> float32 samples on the host [emitted so far, frames * spf - tail)."""
        model = self.model
        codes = model._check_codes(codes, "push").to(model.device)
        with torch.inference_mode():
            h = model._embed(codes[None])
            if self._pre is not None:
                h = self._pre.push(h.transpose(1, 2)).transpose(1, 2)
            h = self._transformer.push(h).permute(0, 2, 1)
            wav = self._convs.push(h).clamp(min=-1, max=1)[0, 0].to("cpu", torch.float32)
        self.frames += codes.shape[0]
        self.samples += wav.shape[0]
        expected = self.frames * model.samples_per_frame - model.tail_samples
        if self.samples != expected:  # a layer's bookkeeping is off: never silently drift
            raise RuntimeError(
                f"code2wav stream emitted {self.samples} samples, expected {expected}"
            )
        return wav


def decode_with_left_context(
    model: CodecDecoder, codes: torch.Tensor, chunk: int, left_context: int
) -> torch.Tensor:
    """Gapless chunked re-decode: each chunk is decoded again with earlier frames as context.

    The chunk of frames [s, s + n) is decoded together with the ``left_context``
    frames before it and emits samples [s*spf - tail, (s+n)*spf - tail), the
    first chunk from 0. The first ``tail`` of those samples come from the last
    context frame, so at least ``ceil(tail / spf)`` context frames (1 for the
    standard config) are always used: a smaller ``left_context`` is raised to that.
    """
    if chunk < 1 or left_context < 0:
        raise ValueError("code2wav: chunk must be >= 1 and left_context >= 0")
    spf, tail = model.samples_per_frame, model.tail_samples
    context = max(left_context, -(-tail // spf))
    total = codes.shape[0]
    pieces = []
    for start in range(0, total, chunk):
        end = min(start + chunk, total)
        ctx = min(context, start)
        wav = model.decode(codes[start - ctx : end])
        base = (start - ctx) * spf
        pieces.append(wav[max(0, start * spf - tail) - base : end * spf - tail - base])
    return torch.cat(pieces)


# ------------------------------------------------------------ test weights


def random_tensors(
    config: Mapping[str, Any], seed: int = 0, prefix: str = "code2wav."
) -> dict[str, torch.Tensor]:
    """Seeded random weights under the released names, for tests and benchmarks.

    The reference's own init (std 0.02, layer scales 0.01 / 1e-6) gives outputs
    near the denormal range. Here linears and convs have std gain/sqrt(fan_in)
    with gain 1, except the residual units' 1x1 convs (0.2) and the decoder's
    transposed convs (0.5), which keep the decoder's activations O(1), and the
    output conv (0.5); scales and SnakeBeta parameters are O(1). The audio is
    then moderate (rms ~0.1, rarely clamped), so comparisons measure something.
    """
    gen = torch.Generator().manual_seed(seed)
    shapes = Code2Wav.expected_shapes(config)
    last_decoder = max(int(name.split(".")[1]) for name in shapes if name.startswith("decoder."))

    def normal(shape: tuple[int, ...], std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * std + mean

    out: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        parts = name.split(".")
        if parts[0] == "code_embedding":
            t = normal(shape, 1.0)
        elif parts[-1] == "weight" and parts[-2].endswith("norm"):
            t = normal(shape, 0.1, 1.0)
        elif parts[-1] == "bias":
            t = normal(shape, 0.02)
        elif parts[-1] in ("alpha", "beta"):
            t = normal(shape, 0.2)
        elif parts[-1] in ("scale", "gamma"):
            t = normal(shape, 0.1, 0.5)
        elif parts[0] == "decoder" and parts[2:4] == ["block", "1"]:
            # transposed conv [in, out, 2r] with stride r: 2 * in products per output
            t = normal(shape, 0.5 * (2 * shape[0]) ** -0.5)
        elif parts[0] == "upsample" and parts[2] == "0":
            t = normal(shape, shape[0] ** -0.5)  # transposed conv, kernel == stride
        else:  # linear [out, in] or conv [out, in / groups, k]
            gain = 1.0
            if parts[-3] == "conv2":
                gain = 0.2
            elif parts[0] == "decoder" and int(parts[1]) == last_decoder:
                gain = 0.5
            t = normal(shape, gain * math.prod(shape[1:]) ** -0.5)
        out[prefix + name] = t.float()
    return out


