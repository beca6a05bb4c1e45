"""The code2wav stream core: per-request chunk states, the ready set, which chunk goes next.

Shared by the in-thread worker (``.thread``) and the worker processes
(``.worker``), so both cut the same chunks (``.chunking``), call the vocoder
with the same frames and pick the same order: a worker decodes its ready
chunks not in arrival order but first chunks first, then the request
closest to running dry (``next_request``); each request's chunks stay in
order. A turn of the loop takes the next chunk of up to ``max_batch``
requests in that order and decodes them in one vocoder call
(``vocoder.push_many``, when it has one: the checkpoint's Code2Wav runs one
forward over the stacked stream states). ``run_chunks`` is the decode loop
both run.

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
from decoder_svc.code2wav.chunking import SAMPLE_RATE_HZ, ChunkState, as_audio
from decoder_svc.spawned import call_factory
from omni_common.errors import InvalidArgumentError

CONTEXT_MARK = 1 << 20
"""Added to codebook 0 of context frames: frames at the start of a request's
first codes (``context_frames``, a cloned voice's reference clip) that the
vocoder decodes before the request's own, whose audio is not sent."""


def context_frames(codes: np.ndarray) -> np.ndarray:
    """``codes`` [F, Q] marked as context (``CONTEXT_MARK``)."""
    out = np.array(codes, dtype=np.int64).reshape(codes.shape[0], -1)
    out[:, 0] += CONTEXT_MARK
    return out


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
    """Per-request chunk states, the chunks ready to decode, and which go next.

    Shared by the in-thread worker and the worker processes, so both cut the
    same chunks, call the vocoder with the same frames and pick the same
    order. ``add`` only cuts chunks (cheap, no vocoder call); ``decode_turn``
    decodes the next ready chunk of up to ``max_batch`` requests, chosen by
    ``next_request``, in one vocoder call when the vocoder has ``push_many``
    (one forward over every stream's state; a stream's audio does not depend
    on which others share it) and emits them in that order."""

    def __init__(self, ramp: Sequence[int], chunk_frames: int, vocoder, *, max_batch: int = 1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_batch < 1:
            raise InvalidArgumentError("code2wav_max_batch", f"must be >= 1, got {max_batch}")
        self.ramp = tuple(int(x) for x in ramp)
        self.chunk_frames = int(chunk_frames)
        self.vocoder = vocoder
        self.max_batch = int(max_batch)
        self.clock = clock
        self.num_codebooks = int(vocoder.num_codebooks)
        self.codebook_size = int(vocoder.codebook_size)
        self.sample_rate = float(getattr(vocoder, "sample_rate", SAMPLE_RATE_HZ))
        self._push_many = getattr(vocoder, "push_many", None)
        self._requests: dict[str, PendingRequest] = {}
        self._seq = itertools.count()
        self.chunks = 0  # chunks decoded (counted as each is emitted)
        self.queued = 0  # chunks ready and not yet decoded (empty lasts included)
        # of the chunk being emitted: how long it waited when it is its
        # request's first (from the arrival of the frames that completed it
        # to the start of its decode), else None
        self.first_wait: float | None = None
        # how long the vocoder call of this turn took (0: a turn of empty
        # lasts only); also observed in omni_decoder_code2wav_chunk_seconds
        self.decode_s = 0.0
        # the chunk being emitted is its turn's first (a worker counts a
        # turn, not a chunk, as one round of its loop)
        self.turn_first = False

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
        codes = None if kind == "finish" else np.asarray(value).reshape(-1, self.num_codebooks)
        if r is None:
            stream = self.vocoder.new_stream(voice)
            if codes is not None and codes.shape[0] and codes[0, 0] >= CONTEXT_MARK:  # its context, decoded first
                context = codes[codes[:, 0] >= CONTEXT_MARK].copy()
                context[:, 0] -= CONTEXT_MARK
                stream.push(context)  # (its audio is not sent)
                codes = codes[codes[:, 0] < CONTEXT_MARK]
            state = ChunkState(self.ramp, self.chunk_frames, stream, self.num_codebooks, first)
            r = self._requests[rid] = PendingRequest(rid, next(self._seq), state)
        if r.finished:
            return
        st = r.state
        final = kind == "finish"
        if codes is not None:
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

    def next_batch(self) -> list[str]:
        """The requests whose next chunk ``decode_turn`` decodes, in the order
        ``next_request`` picks them (at most ``max_batch``; empty: none ready)."""
        if not self.queued:
            return []
        now, picked = self.clock(), list[str]()
        left = [r for r in self._requests.values() if r.ready]
        while len(picked) < self.max_batch:
            r = next_request(left, now)
            if r is None:
                break
            picked.append(r.rid)
            left.remove(r)
        return picked

    def decode_turn(self, rids: Sequence[str], emit: Emit, fail: Callable[[str, Exception], None]) -> None:
        """Decode the next ready chunk of each of `rids` (``next_batch``) and
        emit them in that order; a request's last chunk ends it here. A chunk
        that fails fails its request (`fail`), the others go on; a vocoder
        call that fails as a whole fails every request in it."""
        now = self.clock()
        turn: list[_Turn] = []
        for rid in rids:
            r = self._requests[rid]
            start, end, last, reason, ready_at = r.ready.popleft()
            self.queued -= 1
            if last:
                self._requests.pop(rid, None)
            t = _Turn(r, last, reason, ready_at if r.first_audio_at is None and start is not None else None)
            if start is not None:
                try:
                    t.block = r.state.take(start, end)
                except Exception as exc:  # noqa: BLE001 -- fail this request, keep serving the others
                    t.error = exc
            turn.append(t)
        rows = [t for t in turn if t.block is not None]
        t0 = time.perf_counter()
        if rows:
            self._decode(rows)
        self.decode_s = time.perf_counter() - t0 if rows else 0.0
        if rows:
            metrics.CODE2WAV_CHUNK_SECONDS.observe(self.decode_s)
            metrics.CODE2WAV_BATCH_CHUNKS.observe(len(rows))
        self.turn_first = True
        for t in turn:
            rid = t.request.rid
            if t.error is not None:
                self.drop(rid)
                fail(rid, t.error)
                continue
            audio = t.audio if t.audio is not None else np.zeros(0, dtype=np.float32)
            if t.block is not None:
                self.chunks += 1
            self.first_wait = None if t.ready_at is None else now - t.ready_at
            try:
                emit(rid, audio, t.last, t.reason)
            except Exception as exc:  # noqa: BLE001 -- fail this request, keep serving the others
                self.drop(rid)
                fail(rid, exc)
                continue
            finally:
                self.first_wait = None
                self.turn_first = False
            r = t.request
            r.audio_s += audio.size / self.sample_rate
            if r.first_audio_at is None:
                r.first_audio_at = self.clock()

    def _decode(self, rows: list[_Turn]) -> None:
        """The vocoder over the rows' blocks: one call when it can push many
        streams at once, else stream by stream. Sets each row's audio or error."""
        if self._push_many is None or len(rows) == 1:
            for t in rows:
                try:
                    t.audio = as_audio(t.request.state.stream.push(t.block))
                except Exception as exc:  # noqa: BLE001 -- this request only
                    t.error = exc
            return
        left = list(rows)
        while left:
            try:
                out = self._push_many([t.request.state.stream for t in left], [t.block for t in left])
            except Exception as exc:  # noqa: BLE001 -- a bad row, or the whole call
                index = getattr(exc, "index", None)
                if isinstance(index, int) and 0 <= index < len(left):
                    left.pop(index).error = getattr(exc, "cause", exc)  # nothing changed: again without it
                    continue
                for t in left:
                    t.error = exc
                return
            for t, audio in zip(left, out, strict=True):
                t.audio = as_audio(audio)
            return


@dataclass(eq=False)
class _Turn:
    """One request's chunk in a decode turn."""

    request: PendingRequest
    last: bool
    reason: str
    ready_at: float | None  # its first chunk: when it became ready (its wait), else None
    block: np.ndarray | None = None  # its frames (None: an empty last)
    audio: np.ndarray | None = None
    error: Exception | None = None


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
    ready set (`take`), which decides the chunks decoded next (one turn:
    up to ``max_batch`` requests' next chunks in one vocoder call); the loop waits
    only when nothing is ready (`idle` first). A None item means stop:
    return at once, dropping what is still queued (the decoder stops after
    its drain: the requests still running end with finish reason
    "shutdown", so their audio would go nowhere; a long queue would only
    delay the stop). A failing chunk fails its request (`fail`, called
    inside the handler) and the others go on."""
    while True:
        while True:
            if core.queued:
                try:
                    item = inbox.get_nowait()
                except queue.Empty:
                    break
            else:
                idle()
                item = inbox.get()
            if item is None:
                return
            take(item)
        rids = core.next_batch()
        if rids:
            core.decode_turn(rids, emit, fail)

