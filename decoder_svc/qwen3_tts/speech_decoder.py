"""Qwen3-TTS's 12 Hz speech tokenizer decoder: codes [T, 16] -> 24 kHz audio, streaming.

A plain-torch implementation that loads ``speech_tokenizer/model.safetensors``'s
``decoder.*`` tensors by their released names and reproduces the reference
(``Qwen3TTSTokenizerV2Decoder`` of ``qwen-tts``) op for op:

    codes [T, 16] -> split residual VQ: codebook 0 and codebooks 1..15, each
                     part's codebook rows summed and projected (1x1 conv)
                                                          [codebook_dim, T]
      -> causal conv (k=3) to latent_dim                  [latent, T]
      -> input_proj, sliding-window causal transformer,
         output_proj                                      [latent, T]
      -> per upsampling ratio: causal transposed conv
         (kernel == stride) + ConvNeXt block              [latent, T * 4]
      -> the decoder of Qwen3-Omni's Code2Wav (causal conv, SnakeBeta
         blocks with transposed convs, residual units), clamp to [-1, 1]

It is Qwen3-Omni's Code2Wav (:mod:`decoder_svc.qwen3_omni.code2wav`, the
same layers and streams) with another front (the quantizer and the causal
conv before the transformer) and transposed convolutions trimmed on the
right only: T frames give exactly ``T * 1920`` samples, and a stream's
pushes emit every sample once its frame has arrived (no tail). The
concatenated output of all pushes equals the whole-sequence decode up to
float rounding (tests/test_qwen3_tts_speech.py states the tolerance), at
O(pushed frames) cost per push. The reference decodes sequences longer than
300 frames in chunks of 300 with 25 frames of left context; this decoder
keeps the whole causal state instead (its transformer sees the same 72-frame
window), so beyond 300 frames it matches the exact whole decode, not those
chunks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from decoder_svc.qwen3_omni.code2wav import CodecDecoder
from decoder_svc.qwen3_omni.code2wav_layers import (
    CausalConv1d,
    CausalTransConv1d,
    Code2WavConfig,
    ConvNeXtBlock,
    DecoderBlock,
    SnakeBeta,
    Transformer,
)

__all__ = ["SpeechDecoder"]


class _Codebook(nn.Module):
    """One VQ codebook: rows ``embedding_sum / max(cluster_usage, eps)``."""

    def __init__(self, bins: int, dim: int) -> None:
        super().__init__()
        self.cluster_usage = nn.Parameter(torch.ones(bins), requires_grad=False)
        self.embedding_sum = nn.Parameter(torch.zeros(bins, dim), requires_grad=False)

    def table(self) -> torch.Tensor:
        return self.embedding_sum / self.cluster_usage.clamp(min=1e-5)[:, None]


class _VQLayer(nn.Module):
    def __init__(self, bins: int, dim: int) -> None:
        super().__init__()
        self._codebook = _Codebook(bins, dim)


class _VQ(nn.Module):
    def __init__(self, n: int, bins: int, dim: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_VQLayer(bins, dim) for _ in range(n))


class _ResidualVQ(nn.Module):
    """``n`` codebooks whose rows are summed, then projected (a 1x1 conv without bias)."""

    def __init__(self, n: int, bins: int, dim: int, out_dim: int) -> None:
        super().__init__()
        self.input_proj = nn.Conv1d(out_dim, dim, 1, bias=False)  # the encoder side's; kept for the names
        self.output_proj = nn.Conv1d(dim, out_dim, 1, bias=False)
        self.vq = _VQ(n, bins, dim)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, n, T] -> [B, out_dim, T] (the reference's order of sums)."""
        total: torch.Tensor | None = None
        for i, layer in enumerate(self.vq.layers):
            rows = F.embedding(codes[:, i], layer._codebook.table()).transpose(1, 2)
            total = rows if total is None else total + rows
        assert total is not None
        return self.output_proj(total)


class _Quantizer(nn.Module):
    """The split residual VQ: the first (semantic) codebook and the rest, projected apart and summed."""

    def __init__(self, num_quantizers: int, bins: int, codebook_dim: int) -> None:
        super().__init__()
        self.rvq_first = _ResidualVQ(1, bins, codebook_dim // 2, codebook_dim)
        self.rvq_rest = _ResidualVQ(num_quantizers - 1, bins, codebook_dim // 2, codebook_dim)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, Q, T] -> [B, codebook_dim, T]."""
        return self.rvq_first.decode(codes[:, :1]) + self.rvq_rest.decode(codes[:, 1:])


class SpeechDecoder(CodecDecoder):
    """The 12 Hz decoder; parameter names match the released ``decoder.*`` tensors."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        cfg = Code2WavConfig.from_dict(config)
        if "codebook_dim" not in config or "latent_dim" not in config:
            raise ValueError("speech tokenizer decoder_config: codebook_dim and latent_dim are required")
        self.config = cfg
        cd, latent = int(config["codebook_dim"]), int(config["latent_dim"])
        if cd % 2:
            raise ValueError(f"speech tokenizer decoder_config: codebook_dim must be even, got {cd}")
        self.codebook_dim, self.latent_dim = cd, latent
        self.quantizer = _Quantizer(cfg.num_quantizers, cfg.codebook_size, cd)
        self.pre_conv = CausalConv1d(cd, latent, 3)
        self.pre_transformer = Transformer(cfg, io_size=latent)
        self.upsample = nn.ModuleList(
            [
                nn.ModuleList([CausalTransConv1d(latent, latent, f, f, trim_left=False), ConvNeXtBlock(latent)])
                for f in cfg.upsampling_ratios
            ]
        )
        dims = [cfg.decoder_dim // 2**i for i in range(len(cfg.upsample_rates) + 1)]
        self.decoder = nn.ModuleList(
            [CausalConv1d(latent, cfg.decoder_dim, 7)]
            + [DecoderBlock(dims[i], dims[i + 1], r, trim_left=False) for i, r in enumerate(cfg.upsample_rates)]
            + [SnakeBeta(dims[-1]), CausalConv1d(dims[-1], 1, 7)]
        )
        self._setup(cfg.num_quantizers, cfg.codebook_size, cfg.upsampling_ratios, cfg.upsample_rates)

    @classmethod
    def _from_config(cls, config: Mapping[str, Any]) -> SpeechDecoder:
        return cls(config)

    def _embed(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, T, Q] -> the quantizer's rows [B, T, codebook_dim]."""
        return self.quantizer.decode(codes.transpose(1, 2)).transpose(1, 2)

    def _pre_stack(self) -> list[nn.Module]:
        return [self.pre_conv]
