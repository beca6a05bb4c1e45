"""code2wav: chunking of the generation stage that turns codec frames into audio.

Frames arrive per request as the talker produces them. They are decoded in
chunks whose boundaries depend only on the frame index and the request's
first chunk (an initial ramp of small chunks for a fast first packet, then
`codec_chunk_frames`; the first chunk may be smaller, chosen per request
when its audio starts: StageConfig.first_chunk_by_load), each chunk
re-decoding up to `codec_left_context_frames` earlier frames and dropping
their samples. Because the vocoder's receptive field is inside that left
context, chunked audio equals the audio of decoding the whole sequence at
once: sample for sample with the fake engine's vocoder (the current and the
previous frame), within float rounding with the checkpoint's Code2Wav (which
streams its layers' state; tests/test_code2wav_neural.py). Two runs of one
request with the same chunks give the same bytes.

The vocoder itself comes from the engine: the checkpoint's Code2Wav
(decoder_svc/qwen3_omni/code2wav.py, served by decoder_svc/qwen3_omni/vocoder.py),
or the fake engine's test double.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

SAMPLE_RATE_HZ = 24_000
FRAME_RATE_HZ = 12.5
SAMPLES_PER_FRAME = int(SAMPLE_RATE_HZ / FRAME_RATE_HZ)  # 1920


def _ramp_boundaries(ramp: Sequence[int], chunk_frames: int):
    end = 0
    for size in ramp:
        end += size
        yield end
    while True:
        end += chunk_frames
        yield end


def chunk_boundaries(ramp: Sequence[int], chunk_frames: int, first: int = 0):
    """Frame indices where chunks end: cumulative ramp, then every
    chunk_frames. first > 0: the first chunk ends at frame `first`, the
    later ones at those boundaries beyond it (a first chunk of 2 with ramp
    (5, 10) and chunk 25: 2, 5, 15, 40, ...)."""
    if first > 0:
        yield first
    for end in _ramp_boundaries(ramp, chunk_frames):
        if end > first:
            yield end


class ChunkState:
    """Per-request chunking of code2wav: frames arrive, chunks go out at
    boundaries that depend only on the frame index and the request's first
    chunk (``chunk_boundaries``)."""

    def __init__(self, ramp: Sequence[int], chunk_frames: int, stream, num_codebooks: int, first: int = 0):
        """first: frames of the first chunk (0: the ramp's)."""
        self.num_codebooks = num_codebooks
        self._pending: list[np.ndarray] = []  # frames received, not yet decoded
        self.received = 0  # frames received
        self._bounds = chunk_boundaries(ramp, chunk_frames, first)
        self.next_end = next(self._bounds)
        self.emitted = 0  # frames whose audio went out
        self.decoded = 0  # frames handed to the stream
        self.stream = stream
        self.chunk_index = 0

    def add(self, codes: np.ndarray) -> None:
        codes = codes.reshape(-1, self.num_codebooks)
        if codes.shape[0]:
            self._pending.append(codes)
            self.received += codes.shape[0]

    def ready_chunks(self, final: bool) -> list[tuple[int, int]]:
        """Frame ranges [start, end) ready to decode now."""
        out = []
        while self.received >= self.next_end:
            out.append((self.emitted, self.next_end))
            self.emitted = self.next_end
            self.next_end = next(self._bounds)
        if final and self.received > self.emitted:
            out.append((self.emitted, self.received))
            self.emitted = self.received
        return out

    def take(self, start: int, end: int) -> np.ndarray:
        """The frames [start, end) to hand to the stream, taken off the pending
        ones (ranges in order: only frames not yet decoded are kept, so each
        frame is copied once)."""
        if start != self.decoded:
            raise ValueError(f"chunk [{start}, {end}) is not the next one (decoded up to {self.decoded})")
        block = self._pending[0] if len(self._pending) == 1 else np.concatenate(self._pending)
        n = end - start
        self._pending = [block[n:]] if block.shape[0] > n else []
        self.decoded = end
        self.chunk_index += 1
        return block[:n]

    def decode(self, start: int, end: int) -> np.ndarray:
        """The new samples that frames [start, end) complete (``take``, then the stream)."""
        return as_audio(self.stream.push(self.take(start, end)))


def as_audio(audio) -> np.ndarray:
    """A vocoder stream's output as the flat float32 samples a chunk carries."""
    return np.asarray(audio, dtype=np.float32).reshape(-1)
