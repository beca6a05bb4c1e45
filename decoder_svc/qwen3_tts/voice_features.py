"""A reference clip's features for voice cloning: its x-vector and its codes.

A ``base`` (voice-clone) checkpoint conditions the talker on a reference
clip in two ways (:mod:`.prompt`): the clip's speaker embedding (an
x-vector, ``speaker_encoder.*``: ECAPA-TDNN over a 128-bin log-mel
spectrogram) in the voice's slot, and, when the clip's transcript is given,
the clip's codes (the speech tokenizer's encoder, ``encoder.*``: Mimi's,
its first 16 codebooks) in context. :class:`VoiceEncoder` computes both,
once per clip, as the reference implementation does (qwen-tts'
``extract_speaker_embedding`` and ``Qwen3TTSTokenizer.encode``):

- x-vector: mel spectrogram (n_fft 1024, hop 256, Hann window 1024, reflect
  padding of 384 each side, no centring; slaney mel scale and norm, 0 Hz to
  12 kHz; log of the magnitudes clamped at 1e-5), then the encoder below;
- codes: the clip at 24 kHz through transformers' ``MimiModel`` encoder
  (the reference's own building block), codebooks 0..15, ``ceil(samples /
  1920)`` frames.

Clips are float32 mono at 24 kHz (callers resample: ``omni_common.media``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SpeakerEncoder", "VoiceEncoder", "log_mel", "SAMPLE_RATE"]

SAMPLE_RATE = 24_000
_MEL = {"n_fft": 1024, "hop": 256, "win": 1024, "mels": 128, "fmin": 0.0, "fmax": 12_000.0}


def _mel_filters(n_fft: int, mels: int, sample_rate: int, fmin: float, fmax: float) -> torch.Tensor:
    """[mels, n_fft // 2 + 1]: triangular filters on the slaney mel scale, slaney-normalised (librosa's default)."""
    from transformers.audio_utils import mel_filter_bank

    bank = mel_filter_bank(num_frequency_bins=n_fft // 2 + 1, num_mel_filters=mels, min_frequency=fmin,
                           max_frequency=fmax, sampling_rate=sample_rate, norm="slaney", mel_scale="slaney")
    return torch.from_numpy(np.ascontiguousarray(bank.T)).float()


def log_mel(clip: torch.Tensor) -> torch.Tensor:
    """clip [n] float32 at 24 kHz -> log-mel [frames, 128] (module docstring)."""
    m = _MEL
    window = torch.hann_window(m["win"])
    pad = (m["n_fft"] - m["hop"]) // 2
    y = F.pad(clip.reshape(1, 1, -1), (pad, pad), mode="reflect").reshape(1, -1)
    spec = torch.stft(y, m["n_fft"], hop_length=m["hop"], win_length=m["win"], window=window, center=False,
                      pad_mode="reflect", normalized=False, onesided=True, return_complex=True)
    spec = torch.sqrt(torch.view_as_real(spec).pow(2).sum(-1) + 1e-9)
    mel = torch.matmul(_mel_filters(m["n_fft"], m["mels"], SAMPLE_RATE, m["fmin"], m["fmax"]), spec)
    return torch.log(torch.clamp(mel, min=1e-5))[0].transpose(0, 1)


class _TDNN(nn.Module):
    """Conv1d ('same' length, reflect padding) + ReLU."""

    def __init__(self, c_in: int, c_out: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(c_in, c_out, kernel, dilation=dilation, padding="same", padding_mode="reflect")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv(x))


class _Res2Net(nn.Module):
    def __init__(self, channels: int, scale: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.scale = scale
        self.blocks = nn.ModuleList(_TDNN(channels // scale, channels // scale, kernel, dilation)
                                    for _ in range(scale - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: list[torch.Tensor] = []
        for i, part in enumerate(torch.chunk(x, self.scale, dim=1)):
            out.append(part if i == 0 else self.blocks[i - 1](part if i == 1 else part + out[-1]))
        return torch.cat(out, dim=1)


class _SqueezeExcitation(nn.Module):
    def __init__(self, channels: int, se: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(channels, se, 1, padding="same", padding_mode="reflect")
        self.conv2 = nn.Conv1d(se, channels, 1, padding="same", padding_mode="reflect")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = torch.sigmoid(self.conv2(F.relu(self.conv1(x.mean(dim=2, keepdim=True)))))
        return x * s


class _SERes2NetBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, scale: int, se: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.tdnn1 = _TDNN(c_in, c_out, 1, 1)
        self.res2net_block = _Res2Net(c_out, scale, kernel, dilation)
        self.tdnn2 = _TDNN(c_out, c_out, 1, 1)
        self.se_block = _SqueezeExcitation(c_out, se)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x)))) + x


def _stats(x: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mean = (weights * x).sum(2)
    std = torch.sqrt((weights * (x - mean.unsqueeze(2)).pow(2)).sum(2).clamp(1e-12))
    return mean, std


class _AttentivePooling(nn.Module):
    """Attentive statistics pooling over the whole clip (one sequence, no padding)."""

    def __init__(self, channels: int, attention: int) -> None:
        super().__init__()
        self.tdnn = _TDNN(channels * 3, attention, 1, 1)
        self.conv = nn.Conv1d(attention, channels, 1, padding="same", padding_mode="reflect")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[-1]
        uniform = torch.ones(x.shape[0], 1, length, dtype=x.dtype, device=x.device)
        mean, std = _stats(x, uniform / uniform.sum(dim=2, keepdim=True))
        context = torch.cat([x, mean.unsqueeze(2).repeat(1, 1, length), std.unsqueeze(2).repeat(1, 1, length)], 1)
        attention = F.softmax(self.conv(torch.tanh(self.tdnn(context))), dim=2)
        mean, std = _stats(x, attention)
        return torch.cat((mean, std), dim=1).unsqueeze(2)


_SPEAKER_DEFAULTS: dict[str, Any] = {
    "mel_dim": 128, "enc_dim": 1024, "enc_channels": [512, 512, 512, 512, 1536],
    "enc_kernel_sizes": [5, 3, 3, 3, 1], "enc_dilations": [1, 2, 3, 4, 1], "enc_attention_channels": 128,
    "enc_res2net_scale": 8, "enc_se_channels": 128,
}


class SpeakerEncoder(nn.Module):
    """ECAPA-TDNN: log-mel [B, frames, mel_dim] -> x-vector [B, enc_dim]; names match ``speaker_encoder.*``."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        cfg = {**_SPEAKER_DEFAULTS, **config}
        ch, ks, dil = list(cfg["enc_channels"]), list(cfg["enc_kernel_sizes"]), list(cfg["enc_dilations"])
        if not len(ch) == len(ks) == len(dil) >= 3:
            raise ValueError("speaker_encoder_config: enc_channels, enc_kernel_sizes and enc_dilations need the "
                             "same length, at least 3")
        blocks: list[nn.Module] = [_TDNN(int(cfg["mel_dim"]), ch[0], ks[0], dil[0])]
        blocks += [_SERes2NetBlock(ch[i - 1], ch[i], int(cfg["enc_res2net_scale"]), int(cfg["enc_se_channels"]),
                                   ks[i], dil[i]) for i in range(1, len(ch) - 1)]
        self.blocks = nn.ModuleList(blocks)
        self.mfa = _TDNN(ch[-1], ch[-1], ks[-1], dil[-1])
        self.asp = _AttentivePooling(ch[-1], int(cfg["enc_attention_channels"]))
        self.fc = nn.Conv1d(ch[-1] * 2, int(cfg["enc_dim"]), 1, padding="same", padding_mode="reflect")

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        x = mel.transpose(1, 2)
        outs = []
        for block in self.blocks:
            x = block(x)
            outs.append(x)
        x = self.mfa(torch.cat(outs[1:], dim=1))
        return self.fc(self.asp(x)).squeeze(-1)


def _load(module: nn.Module, tensors: Mapping[str, torch.Tensor], prefix: str, what: str) -> None:
    state = {}
    for name, param in module.state_dict().items():
        key = prefix + name
        if key not in tensors:
            raise ValueError(f"{what}: missing tensor {key!r}")
        if tuple(tensors[key].shape) != tuple(param.shape):
            raise ValueError(f"{what}: {key!r} has shape {tuple(tensors[key].shape)}, expected {tuple(param.shape)}")
        state[name] = tensors[key].to(torch.float32)
    module.load_state_dict(state, strict=True)
    module.requires_grad_(False)
    module.eval()


class VoiceEncoder:
    """A ``base`` checkpoint's clip encoders, on the CPU in float32 (once per clip: small next to a request)."""

    def __init__(self, checkpoint: Any) -> None:
        from omni_common import torchvision_compat

        torchvision_compat.install()  # before transformers' models
        from transformers import MimiConfig, MimiModel

        self.speaker = SpeakerEncoder(checkpoint.config.get("speaker_encoder_config") or {})
        _load(self.speaker, checkpoint.tensors("speaker_encoder."), "speaker_encoder.", "speaker encoder")
        speech = checkpoint.speech_config
        mimi = MimiModel(MimiConfig(**speech["encoder_config"]))
        mimi.upsample = mimi.decoder_transformer = mimi.decoder = None  # the decoder side is the talker's vocoder's
        _load(mimi, checkpoint.speech_tensors("encoder."), "encoder.", "speech tokenizer encoder")
        self.mimi = mimi
        self.quantizers = int(speech.get("encoder_valid_num_quantizers", 16))
        self.samples_per_frame = int(speech.get("encode_downsample_rate", 1920))

    @torch.inference_mode()
    def x_vector(self, clip: np.ndarray) -> torch.Tensor:
        """The clip's speaker embedding [enc_dim] (float32)."""
        mel = log_mel(torch.from_numpy(np.ascontiguousarray(clip, dtype=np.float32)))
        return self.speaker(mel[None])[0]

    @torch.inference_mode()
    def codes(self, clip: np.ndarray) -> torch.Tensor:
        """The clip's codes [ceil(samples / 1920), 16] (int64)."""
        wav = torch.from_numpy(np.ascontiguousarray(clip, dtype=np.float32))
        out = self.mimi.encode(input_values=wav.reshape(1, 1, -1), return_dict=True)
        frames = math.ceil(wav.shape[0] / self.samples_per_frame)
        return out.audio_codes[0, : self.quantizers, :frames].transpose(0, 1).to(torch.int64).contiguous()
