"""code2wav: the generation stage that turns codec frames into audio.

Frames arrive per request as the talker produces them. They are decoded in
chunks whose boundaries depend only on the frame index (an initial ramp of
small chunks for a fast first packet, then `codec_chunk_frames`), each chunk
re-decoding up to `codec_left_context_frames` earlier frames and dropping
their samples. Because the vocoder's receptive field (the current and the
previous frame) is inside that left context, chunked audio equals the audio
of decoding the whole sequence at once, sample for sample.

The reference vocoder is integer arithmetic (a sine table, per-codebook
frequencies and amplitudes, a crossfade from the previous frame), so its
output is exact whatever the chunking: float32 samples are int16 / 32768.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

SAMPLE_RATE_HZ = 24_000
FRAME_RATE_HZ = 12.5
SAMPLES_PER_FRAME = int(SAMPLE_RATE_HZ / FRAME_RATE_HZ)  # 1920
_TABLE_BITS = 12
_TABLE = np.round(np.sin(2 * np.pi * np.arange(1 << _TABLE_BITS) / (1 << _TABLE_BITS)) * 32767).astype(np.int64)
VOICES: tuple[str, ...] = ("default", "alloy", "echo", "fable", "onyx", "nova", "shimmer")


def chunk_boundaries(ramp: Sequence[int], chunk_frames: int):
    """Frame indices where chunks end: cumulative ramp, then every chunk_frames."""
    end = 0
    for size in ramp:
        end += size
        yield end
    while True:
        end += chunk_frames
        yield end


class ReferenceVocoder:
    """Deterministic integer vocoder: codes [T, Q] -> int16-valued samples."""

    def __init__(self, num_codebooks: int = 16, codec_vocab: int = 2048, overlap: int = 240) -> None:
        self.num_codebooks = num_codebooks
        self.codec_vocab = codec_vocab
        self.overlap = overlap
        c = np.arange(codec_vocab, dtype=np.int64)
        q = np.arange(num_codebooks, dtype=np.int64)[:, None]
        # phase increment per sample (table units << 8) and amplitude per (codebook, code)
        self._step = ((c[None, :] * 7 + q * 131) % 997 + 20 + q * 40) << 8  # [Q, V]
        self._amp = ((c[None, :] * 13 + q * 17) % 64 + 16) // (q + 1)  # [Q, V]

    def _voice_offset(self, voice: str) -> int:
        return (VOICES.index(voice) if voice in VOICES else 0) * 37

    def _synth(self, codes: np.ndarray, first_frame: int, voice_offset: int, length: int) -> np.ndarray:
        """Raw sum of sinusoids for each frame over `length` samples: [T, length]."""
        t = (np.arange(codes.shape[0], dtype=np.int64)[:, None] + first_frame) * SAMPLES_PER_FRAME
        t = t + np.arange(length, dtype=np.int64)[None, :]  # global sample index
        acc = np.zeros((codes.shape[0], length), dtype=np.int64)
        for q in range(self.num_codebooks):
            step = self._step[q, codes[:, q]][:, None] + (voice_offset << 8)
            amp = self._amp[q, codes[:, q]][:, None]
            acc += amp * _TABLE[((step * t) >> 8) & ((1 << _TABLE_BITS) - 1)]
        return acc >> 10

    def decode(self, codes: np.ndarray, first_frame: int, voice: str = "default") -> np.ndarray:
        """Decode frames [first_frame, first_frame + T) -> float32 [T * 1920].

        Frame k's first `overlap` samples crossfade from frame k-1's sound,
        so frame k depends on frames k-1 and k: the caller passes at least one
        frame of left context (or starts at frame 0).
        """
        codes = np.asarray(codes, dtype=np.int64).reshape(-1, self.num_codebooks) % self.codec_vocab
        voice_offset = self._voice_offset(voice)
        cur = self._synth(codes, first_frame, voice_offset, SAMPLES_PER_FRAME)
        ov = self.overlap
        if codes.shape[0] > 1:
            # previous frame's sinusoids continued into this frame's first samples
            prev = self._synth(codes[:-1], first_frame + 1, voice_offset, ov)
            # synthesize with the previous frame's codes at this frame's times
            fade = np.arange(ov, dtype=np.int64)[None, :]
            cur[1:, :ov] = (cur[1:, :ov] * fade + prev * (ov - fade)) // ov
        out = np.clip(cur, -32768, 32767).reshape(-1)
        return (out.astype(np.float32) / np.float32(32768.0)).astype(np.float32)


class ReferenceStream:
    """One request's audio from the reference vocoder: frames in, samples out.

    Each push re-decodes up to ``left_context`` earlier frames (inside the
    vocoder's receptive field, so chunked audio equals whole-sequence audio).
    """

    def __init__(self, vocoder: ReferenceVocoder, voice: str, left_context: int) -> None:
        self.vocoder = vocoder
        self.voice = voice
        self.left_context = left_context
        self.frames = np.zeros((0, vocoder.num_codebooks), dtype=np.int64)

    def push(self, codes: np.ndarray) -> np.ndarray:
        start = self.frames.shape[0]
        self.frames = np.concatenate([self.frames, np.asarray(codes, dtype=np.int64).reshape(-1, self.frames.shape[1])])
        ctx_start = max(0, start - self.left_context)
        audio = self.vocoder.decode(self.frames[ctx_start:], ctx_start, self.voice)
        return audio[(start - ctx_start) * SAMPLES_PER_FRAME :]


class ReferenceVocoderFactory:
    """The reference vocoder behind the streaming-vocoder interface the
    generation stage uses: ``new_stream(voice)``, ``voices``, ``sample_rate``,
    ``num_codebooks``, ``codebook_size``."""

    sample_rate = SAMPLE_RATE_HZ
    voices = VOICES

    def __init__(self, num_codebooks: int = 16, codec_vocab: int = 2048, left_context: int = 25) -> None:
        self.vocoder = ReferenceVocoder(num_codebooks=num_codebooks, codec_vocab=codec_vocab)
        self.num_codebooks = num_codebooks
        self.codebook_size = codec_vocab
        self.left_context = left_context

    def new_stream(self, voice: str) -> ReferenceStream:
        return ReferenceStream(self.vocoder, voice, self.left_context)


class ChunkState:
    """Per-request chunking of code2wav: frames arrive, chunks go out at
    boundaries that depend only on the frame index (ramp, then chunk_frames)."""

    def __init__(self, ramp: Sequence[int], chunk_frames: int, stream, num_codebooks: int):
        self.frames = np.zeros((0, num_codebooks), dtype=np.int64)
        self._bounds = chunk_boundaries(ramp, chunk_frames)
        self.next_end = next(self._bounds)
        self.emitted = 0  # frames whose audio went out
        self.stream = stream
        self.chunk_index = 0

    def add(self, codes: np.ndarray) -> None:
        self.frames = np.concatenate([self.frames, codes.reshape(-1, self.frames.shape[1])], axis=0)

    def ready_chunks(self, final: bool) -> list[tuple[int, int]]:
        """Frame ranges [start, end) ready to decode now."""
        out = []
        while self.frames.shape[0] >= self.next_end:
            out.append((self.emitted, self.next_end))
            self.emitted = self.next_end
            self.next_end = next(self._bounds)
        if final and self.frames.shape[0] > self.emitted:
            out.append((self.emitted, self.frames.shape[0]))
            self.emitted = self.frames.shape[0]
        return out

    def decode(self, start: int, end: int) -> np.ndarray:
        """The new samples that frames [start, end) complete."""
        self.chunk_index += 1
        audio = self.stream.push(self.frames[start:end])
        return np.asarray(audio, dtype=np.float32).reshape(-1)
