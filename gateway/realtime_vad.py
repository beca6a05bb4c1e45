"""Server-side voice activity detection of a realtime session (``server_vad``).

OpenAI's ``server_vad`` options, on an energy detector: the audio (PCM16 mono,
24 kHz) is read in 10 ms frames; a frame's *level* is its RMS in dBFS mapped
linearly onto 0..1 (``LEVEL_FLOOR_DBFS`` is 0, ``LEVEL_CEIL_DBFS`` is 1), and
a frame is speech when its level is at least ``threshold`` (0.5, the
default, is -35 dBFS; raise it for a noisy room). Speech starts at the first
of ``START_FRAMES`` speech frames in a row (a click is not speech) and stops
once ``silence_duration_ms`` have passed without a speech frame. The turn's
audio runs from ``prefix_padding_ms`` before the start to the stop (the
silence included), as OpenAI's does.

Times are milliseconds from the start of the session's audio (every sample
appended since the session began, cleared or not), as OpenAI reports them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SAMPLE_RATE_HZ = 24_000
FRAME_SAMPLES = SAMPLE_RATE_HZ // 100  # 10 ms
LEVEL_FLOOR_DBFS = -60.0
LEVEL_CEIL_DBFS = -10.0
START_FRAMES = 3
"""Speech frames in a row that start speech (30 ms)."""


@dataclass(frozen=True)
class VadOptions:
    """OpenAI's ``server_vad`` settings (its defaults)."""

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True


@dataclass(frozen=True)
class SpeechStarted:
    audio_start_ms: int


@dataclass(frozen=True)
class SpeechStopped:
    audio_end_ms: int
    turn_start_sample: int
    """Where the turn's audio begins (prefix padding included), in session samples."""
    turn_end_sample: int
    """Where it ends (the silence included), in session samples."""


def frame_levels(pcm: np.ndarray) -> np.ndarray:
    """The level (0..1) of each whole 10 ms frame of int16 samples."""
    n = len(pcm) // FRAME_SAMPLES
    frames = pcm[: n * FRAME_SAMPLES].astype(np.float64).reshape(n, FRAME_SAMPLES) / 32768.0
    rms = np.sqrt(np.mean(np.square(frames), axis=1))
    dbfs = 20.0 * np.log10(np.maximum(rms, 1e-10))
    return np.clip((dbfs - LEVEL_FLOOR_DBFS) / (LEVEL_CEIL_DBFS - LEVEL_FLOOR_DBFS), 0.0, 1.0)


class VoiceActivity:
    """Speech start and stop events of a session's audio, fed as it arrives."""

    def __init__(self, options: VadOptions) -> None:
        self.options = options
        self._pending = np.zeros(0, dtype=np.int16)  # samples short of a whole frame
        self._frames = 0  # whole frames read
        self._run = 0  # speech frames in a row (before speech starts)
        self._speaking = False
        self._start_frame = 0
        self._silent = 0  # frames since the last speech frame (while speaking)

    @property
    def speaking(self) -> bool:
        return self._speaking

    def reset(self, at_sample: int) -> None:
        """Forget the audio so far (the buffer was cleared or committed); the
        next frame starts at session sample `at_sample`."""
        self._pending = np.zeros(0, dtype=np.int16)
        self._frames = at_sample // FRAME_SAMPLES
        self._run = 0
        self._speaking = False
        self._silent = 0

    def feed(self, pcm: np.ndarray) -> list[SpeechStarted | SpeechStopped]:
        """Read int16 samples; return the events they complete, in order."""
        samples = np.concatenate([self._pending, pcm]) if len(self._pending) else pcm
        whole = len(samples) // FRAME_SAMPLES * FRAME_SAMPLES
        self._pending = samples[whole:].copy()
        events: list[SpeechStarted | SpeechStopped] = []
        opts = self.options
        silence_frames = max(1, opts.silence_duration_ms // 10)
        for level in frame_levels(samples[:whole]):
            index = self._frames
            self._frames += 1
            speech = level >= opts.threshold
            if not self._speaking:
                self._run = self._run + 1 if speech else 0
                if self._run >= START_FRAMES:
                    self._speaking = True
                    self._silent = 0
                    self._start_frame = index - START_FRAMES + 1
                    events.append(SpeechStarted(self._start_frame * 10))
                continue
            self._silent = 0 if speech else self._silent + 1
            if self._silent >= silence_frames:
                end = (index + 1) * FRAME_SAMPLES
                start = max(0, self._start_frame * FRAME_SAMPLES - opts.prefix_padding_ms * SAMPLE_RATE_HZ // 1000)
                events.append(SpeechStopped(end * 1000 // SAMPLE_RATE_HZ, start, end))
                self._speaking = False
                self._run = 0
        return events


__all__ = [
    "FRAME_SAMPLES",
    "SAMPLE_RATE_HZ",
    "SpeechStarted",
    "SpeechStopped",
    "VadOptions",
    "VoiceActivity",
    "frame_levels",
]
