"""Audio on the client side of the gateway: PCM16 conversion, Speak chunks, WAV headers."""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass

import numpy as np
import torch

from gateway.outputs import RequestMetrics
from omni_serving.v1 import gateway_pb2

AUDIO_KEY = "audio"
"""Payload key of the decoder's audio samples (float32, 1-D, in [-1, 1])."""
SAMPLE_RATE_KEY = "sample_rate"
"""Payload metadata key of the audio's sample rate."""

BYTES_PER_SAMPLE = 2
_PCM16_SCALE = 32767.0
# Data size written in a streaming WAV header, where the length is not yet
# known: the largest even size that keeps the RIFF size within 32 bits.
STREAMING_WAV_DATA_BYTES = 0xFFFFFFFF - 36 - 1


def pcm16le(samples: torch.Tensor | list[torch.Tensor]) -> bytes:
    """Float samples in [-1, 1] as signed 16-bit little-endian PCM.

    Values outside [-1, 1] are clipped, NaN becomes silence; rounding is to
    nearest, so the conversion is deterministic. A list (a key accumulated
    with APPEND_LIST) is converted piece by piece, in order.
    """
    if isinstance(samples, list):
        return b"".join(pcm16le(piece) for piece in samples)
    x = samples.detach().to(device="cpu", dtype=torch.float32).reshape(-1).numpy()
    x = np.clip(np.nan_to_num(x, nan=0.0, posinf=1.0, neginf=-1.0), -1.0, 1.0)
    return np.rint(x * _PCM16_SCALE).astype("<i2").tobytes()


def wav_header(sample_rate_hz: int, data_bytes: int | None = None) -> bytes:
    """A 44-byte PCM16 mono WAV header; `data_bytes=None` writes the streaming maximum."""
    size = STREAMING_WAV_DATA_BYTES if data_bytes is None else data_bytes
    byte_rate = sample_rate_hz * BYTES_PER_SAMPLE
    return (
        b"RIFF"
        + struct.pack("<I", 36 + size)
        + b"WAVEfmt "
        + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate_hz, byte_rate, BYTES_PER_SAMPLE, 16)
        + b"data"
        + struct.pack("<I", size)
    )


def flac_bytes(pcm: bytes, sample_rate_hz: int) -> bytes:
    """PCM16LE mono samples as a FLAC file (lossless: it decodes to the same samples).

    Encoded with libsndfile (the ``soundfile`` package), loaded on first use.
    FLAC's header states the length, so the whole audio is needed first.
    """
    import soundfile

    out = io.BytesIO()
    samples = np.frombuffer(pcm, dtype="<i2")
    soundfile.write(out, samples, sample_rate_hz, format="FLAC", subtype="PCM_16")
    return out.getvalue()


@dataclass(frozen=True)
class AudioChunk:
    """One chunk of a Speak stream."""

    request_id: str
    sequence_number: int
    audio: bytes
    sample_rate_hz: int
    final: bool
    metrics: RequestMetrics
    encoding: int = gateway_pb2.AUDIO_ENCODING_PCM16LE
    finish_reason: str = ""
    """On the final chunk: why the speech ended ("stop", "length", "repetition", "abort")."""

    @property
    def num_samples(self) -> int:
        return len(self.audio) // BYTES_PER_SAMPLE

    def to_pb(self) -> gateway_pb2.SpeakResponse:
        return gateway_pb2.SpeakResponse(
            request_id=self.request_id,
            sequence_number=self.sequence_number,
            audio=self.audio,
            sample_rate_hz=self.sample_rate_hz,
            encoding=self.encoding,
            final=self.final,
            metrics=self.metrics.to_pb(),
            finish_reason=self.finish_reason,
        )


__all__ = [
    "AUDIO_KEY",
    "BYTES_PER_SAMPLE",
    "SAMPLE_RATE_KEY",
    "STREAMING_WAV_DATA_BYTES",
    "AudioChunk",
    "flac_bytes",
    "pcm16le",
    "wav_header",
]
