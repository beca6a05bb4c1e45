"""Audio continuity: would a real-time player have run dry?

A client plays a stream as it arrives: playback starts once ``buffer_s``
(250 ms by default) of audio is buffered, or when the stream ends if it never
buffers that much; from then on it plays at real time. A stall is the buffer
running empty before the stream's last chunk has arrived: playback waits for
the next chunk and resumes as soon as it arrives (no re-buffering). The
stall time of a stream is the sum of those waits.

Input per stream: its chunks as (arrival, seconds of audio), arrival in
seconds on any clock (the e2e bench uses seconds since the request was
sent), in arrival order. Chunks with no audio are ignored.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from bench.common import summary

BUFFER_S = 0.25


def playback(chunks: Sequence[Sequence[float]], buffer_s: float = BUFFER_S) -> dict[str, float]:
    """One stream: when playback started (``start_s``, on the chunks' clock),
    how many times it stalled and for how long in all (``stall_ms``)."""
    audio = [(float(t), float(d)) for t, d in chunks if d > 0]
    if not audio:
        return {"start_s": float("nan"), "stalls": 0, "stall_ms": 0.0}
    buffered, start_at = 0.0, len(audio) - 1
    for k, (_, d) in enumerate(audio):
        buffered += d
        if buffered >= buffer_s:
            start_at = k
            break
    clock = audio[start_at][0]
    available = sum(d for _, d in audio[: start_at + 1])
    played, stalls, stalled_s = 0.0, 0, 0.0
    for t, d in audio[start_at + 1 :]:
        runs_dry = clock + (available - played)
        if runs_dry < t:  # empty before this chunk came
            stalls += 1
            stalled_s += t - runs_dry
            played = available
        else:
            played += t - clock
        clock = t
        available += d
    return {"start_s": audio[start_at][0], "stalls": stalls, "stall_ms": stalled_s * 1e3}


def continuity_summary(streams: Iterable[Sequence[Sequence[float]]], buffer_s: float = BUFFER_S) -> dict[str, Any]:
    """Many streams: how many stalled (and their share), and the stall time
    per stream (ms; all streams, those that never stalled count 0)."""
    runs = [playback(s, buffer_s) for s in streams]
    stalled = sum(1 for r in runs if r["stalls"])
    return {
        "buffer_ms": buffer_s * 1e3,
        "streams": len(runs),
        "stalled": stalled,
        "stalled_share": stalled / len(runs) if runs else float("nan"),
        "stall_ms": summary([r["stall_ms"] for r in runs]),
    }
