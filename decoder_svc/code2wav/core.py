"""The code2wav stream core: per-request chunk states, the ready set, which chunk goes next.

Shared by the in-thread worker (``.thread``) and the worker processes
(``.worker``), so both cut the same chunks (``.chunking``), call the vocoder
with the same frames and pick the same order: a worker decodes its ready
chunks not in arrival order but first chunks first, then the request
closest to running dry (``next_request``); each request's chunks stay in
order. ``run_chunks`` is the decode loop both run.

A worker process rebuilds the vocoder from a small picklable spec
(``vocoder.worker_spec()``: an importable factory path and its keyword
arguments; torch modules are never pickled): ``vocoder_spec`` /
``build_vocoder``.
"""

from __future__ import annotations

import itertools
import queue
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from decoder_svc import metrics
from decoder_svc.code2wav.chunking import SAMPLE_RATE_HZ, ChunkState
from decoder_svc.spawned import call_factory
from omni_common.errors import InvalidArgumentError

VocoderSpec = tuple[str, dict[str, Any]]
"""(importable factory "package.module:attr", its keyword arguments)."""

Emit = Callable[[str, np.ndarray, bool, str], None]


def build_vocoder(spec: VocoderSpec):
    """Call the spec's factory: the vocoder, rebuilt in this process."""
    path, kwargs = spec
    return call_factory(path, kwargs, "vocoder_spec")


def vocoder_spec(vocoder) -> VocoderSpec:
    """How a worker process rebuilds `vocoder` (its ``worker_spec()``)."""
    spec = getattr(vocoder, "worker_spec", None)
    if spec is None:
        raise InvalidArgumentError(
            "vocoder", f"{type(vocoder).__name__} has no worker_spec(): it cannot run in a code2wav worker process"
        )
    path, kwargs = spec()
    return str(path), dict(kwargs)


@dataclass(eq=False)
class PendingRequest:
    """A request in a code2wav worker: its chunk state, its chunks ready to
    decode (in order), and the audio it has emitted so far."""

    rid: str
    seq: int  # arrival order: ties go to the older request
    state: ChunkState
    # (start, end, last, reason, ready_at); start None: the empty last of a finish
    ready: deque = field(default_factory=deque)
    audio_s: float = 0.0  # seconds of audio emitted
    first_audio_at: float | None = None  # when its first audio was emitted
    finished: bool = False  # its finish was taken: later items start nothing

    def slack(self, now: float) -> float:
        """Seconds of audio a real-time client still has buffered at `now`
        (negative: it ran dry that long ago)."""
        return self.audio_s - (now - self.first_audio_at)


def next_request(requests: Iterable[PendingRequest], now: float) -> PendingRequest | None:
    """The request whose next ready chunk a worker decodes now (None: no
    chunk is ready). `now` is the worker's clock.

    1. a request that has emitted no audio yet (its first chunk), oldest first;
    2. then the one with the least slack (``PendingRequest.slack``: the
       closest to running dry at a real-time client), the older on a tie.

    Only the order between requests is chosen: a request's own chunks go in
    order, with the boundaries they were cut at."""
    best, best_key = None, None
    for r in requests:
        if not r.ready:
            continue
        key = (0, 0.0, r.seq) if r.first_audio_at is None else (1, r.slack(now), r.seq)
        if best_key is None or key < best_key:
            best, best_key = r, key
    return best


class Code2WavCore:
    """Per-request chunk states, the chunks ready to decode, and which one
    goes next.

    Shared by the in-thread worker and the worker processes, so both cut the
    same chunks, call the vocoder with the same frames and pick the same
    order. ``add`` only cuts chunks (cheap, no vocoder call); ``decode_next``
    decodes one chunk, chosen by ``next_request``."""

    def __init__(self, ramp: Sequence[int], chunk_frames: int, vocoder, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ramp = tuple(int(x) for x in ramp)
        self.chunk_frames = int(chunk_frames)
        self.vocoder = vocoder
        self.clock = clock
        self.num_codebooks = int(vocoder.num_codebooks)
        self.codebook_size = int(vocoder.codebook_size)
        self.sample_rate = float(getattr(vocoder, "sample_rate", SAMPLE_RATE_HZ))
        self._requests: dict[str, PendingRequest] = {}
        self._seq = itertools.count()
        self.chunks = 0  # chunks decoded
        self.queued = 0  # chunks ready and not yet decoded (empty lasts included)
        # of the chunk being emitted: how long it waited when it is its
        # request's first (from the arrival of the frames that completed it
        # to the start of its decode), else None
        self.first_wait: float | None = None
        # of the chunk being emitted: how long the vocoder took (0 for the
        # empty last of a request without frames); also observed in
        # omni_decoder_code2wav_chunk_seconds
        self.decode_s = 0.0

    def has(self, request_id: str) -> bool:
        return request_id in self._requests

    def drop(self, request_id: str) -> None:
        """Forget a request and its chunks not yet decoded."""
        r = self._requests.pop(request_id, None)
        if r is not None:
            self.queued -= len(r.ready)

    def add(self, kind: str, rid: str, voice: str, value, received_at: float | None = None, first: int = 0) -> None:
        """Take a queued item: kind "frames" (value: codes) or "finish" (value:
        the finish reason). Cuts the chunks the item completes into the
        request's ready chunks; decodes nothing. received_at: when the item
        arrived (the worker's clock; default now). first: frames of the
        request's first chunk (0: the ramp's), taken from its first item."""
        r = self._requests.get(rid)
        if r is None:
            state = ChunkState(self.ramp, self.chunk_frames, self.vocoder.new_stream(voice), self.num_codebooks,
                               first)
            r = self._requests[rid] = PendingRequest(rid, next(self._seq), state)
        if r.finished:
            return
        st = r.state
        final = kind == "finish"
        if not final:
            codes = np.asarray(value).reshape(-1, self.num_codebooks)
            # an end-of-speech row (codebook 0 outside the codebook) is no frame
            st.add(codes[codes[:, 0] < self.codebook_size])
        chunks = st.ready_chunks(final)
        if not chunks and not final:
            return
        at = self.clock() if received_at is None else received_at
        for i, (start, end) in enumerate(chunks):
            last = final and i == len(chunks) - 1
            r.ready.append((start, end, last, value if last else "", at))
        if final:
            r.finished = True
            if not chunks:
                r.ready.append((None, None, True, value, at))
        self.queued += len(chunks) + int(final and not chunks)

    def next(self) -> str | None:
        """The request whose chunk ``decode_next`` decodes (None: none ready)."""
        r = next_request(self._requests.values(), self.clock()) if self.queued else None
        return None if r is None else r.rid

    def decode_next(self, rid: str, emit: Emit) -> None:
        """Decode the next ready chunk of `rid` and emit it; its last chunk
        ends the request here."""
        r = self._requests[rid]
        start, end, last, reason, ready_at = r.ready.popleft()
        self.queued -= 1
        first = r.first_audio_at is None
        wait = self.clock() - ready_at if first and start is not None else None
        if last:
            self._requests.pop(rid, None)
        if start is None:
            audio = np.zeros(0, dtype=np.float32)
            self.decode_s = 0.0
        else:
            t0 = time.perf_counter()
            audio = r.state.decode(start, end)
            self.decode_s = time.perf_counter() - t0
            metrics.CODE2WAV_CHUNK_SECONDS.observe(self.decode_s)
            self.chunks += 1
        self.first_wait = wait
        try:
            emit(rid, audio, last, reason)
        finally:
            self.first_wait = None
        r.audio_s += audio.size / self.sample_rate
        if first:
            r.first_audio_at = self.clock()



def run_chunks(
    core: Code2WavCore,
    inbox: Any,
    take: Callable[[tuple], None],
    emit: Callable[[str, np.ndarray, bool, str], None],
    fail: Callable[[str, Exception], None],
    idle: Callable[[], None],
) -> None:
    """The decode loop of a code2wav worker (a process, or the decoder's
    thread): everything that has arrived on `inbox` goes into the core's
    ready set (`take`), which decides the chunk decoded next; the loop waits
    only when nothing is ready (`idle` first). A None item means stop:
    decode what was sent, then return. A failing chunk fails its request
    (`fail`, called inside the handler) and the others go on."""
    stopping = False
    while True:
        while not stopping:
            if core.queued:
                try:
                    item = inbox.get_nowait()
                except queue.Empty:
                    break
            else:
                idle()
                item = inbox.get()
            if item is None:
                stopping = True
            else:
                take(item)
        rid = core.next()
        if rid is None:
            if stopping:
                return
            continue
        try:
            core.decode_next(rid, emit)
        except Exception as exc:  # noqa: BLE001 -- fail this request, keep serving the others
            fail(rid, exc)

