"""code2wav in worker processes: the generation stage off the decoder's interpreter.

The vocoder is CPU-heavy Python and torch; on a thread of the decoder it
competes for the interpreter lock with the decode loops. Here it runs in one
or more worker processes (``multiprocessing`` "spawn": vLLM and gRPC live in
the parent), each rebuilding the vocoder from a small picklable spec
(``vocoder.worker_spec()``: an importable factory path and its keyword
arguments; torch modules are never pickled).

What travels where:

- codec frames, decoder -> worker: written into a slot of a small
  shared-memory arena of the deployment (``omni_common.shm_arena``, same
  prefix, same sweeping as the decoder's step arena); the pipe carries only
  (request, kind, slot, generation, offset, shape). The worker copies the
  frames out at once and hands the slot back. When no slot is free within
  ``slot_wait_s`` (or the frames do not fit one), the bytes go in the message
  instead (counted in ``omni_decoder_code2wav_inline_fallbacks_total``): the
  AR stage never waits on code2wav.
- audio chunks, worker -> decoder: over the worker's result pipe. A chunk is
  produced once per 5-25 frames, is read once and goes straight into a gRPC
  message, so a pipe's copy costs little and needs no slot bookkeeping in the
  other direction (a worker killed mid-write leaves nothing to reclaim).

A request is pinned to the least-loaded worker at its first frame (of those
whose vocoder is built, if any: not to one still starting), so its
chunk state (left context, stream state) lives in one process, and one reader
thread per worker calls ``emit`` in order. A worker decodes its ready chunks
not in arrival order but first chunks first, then the request closest to
running dry (``next_request``); each request's chunks stay in order.
``frames``/``finish``/``abort`` only enqueue: a sender thread per worker
writes to the pipe, so a slow worker never blocks the caller. A worker that
exits (SIGKILL included) fails only the requests pinned to it
(``on_error``), its slots are reclaimed and it is restarted; new requests
are served by the new process. A restart that cannot start its process
fails the requests pinned to it meanwhile and is retried, waiting longer
each time.
"""

from __future__ import annotations

import importlib
import itertools
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from decoder_svc import metrics
from decoder_svc.code2wav import SAMPLE_RATE_HZ, ChunkState
from omni_common.errors import InvalidArgumentError, UnavailableError
from omni_common.shm_arena import ArenaReader, ShmArena

logger = logging.getLogger(__name__)

VocoderSpec = tuple[str, dict[str, Any]]
"""(importable factory "package.module:attr", its keyword arguments)."""

Emit = Callable[[str, np.ndarray, bool, str], None]


def call_factory(path: str, kwargs: dict[str, Any], field: str):
    """Import "package.module:attr" and call it with `kwargs` (a process
    rebuilding what it cannot be sent: torch modules are never pickled)."""
    module, _, attr = path.partition(":")
    if not module or not attr:
        raise InvalidArgumentError(field, f"{path!r} is not 'package.module:factory'")
    factory = getattr(importlib.import_module(module), attr)
    return factory(**dict(kwargs))


def pipe_sender(conn, *, as_bytes: bool = False) -> Callable[[tuple], bool]:
    """A thread-safe send of messages on a worker's end of a pipe; False once
    the decoder is gone. `as_bytes`: pickled here and sent as bytes (plain
    pickle: tensors travel by value, never as shared-memory handles of
    ``torch.multiprocessing``)."""
    lock = threading.Lock()

    def send(msg: tuple) -> bool:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL) if as_bytes else None
        try:
            with lock:
                if data is None:
                    conn.send(msg)
                else:
                    conn.send_bytes(data)
            return True
        except (OSError, ValueError):  # the decoder is gone
            return False

    return send


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
        else:
            audio = r.state.decode(start, end)
            self.chunks += 1
        self.first_wait = wait
        try:
            emit(rid, audio, last, reason)
        finally:
            self.first_wait = None
        r.audio_s += audio.size / self.sample_rate
        if first:
            r.first_audio_at = self.clock()


# -- the worker process ------------------------------------------------------------


def _load_codes(reader, ref: tuple, released: list[tuple[int, int]]) -> np.ndarray:
    """The frames a message refers to, copied out of their slot (or its bytes)."""
    if ref[0] == "raw":
        _, data, dtype, shape = ref
        return np.frombuffer(bytearray(data), dtype=np.dtype(dtype)).reshape(shape)
    from omni_serving.v1 import tensor_pb2

    _, region, offset, nbytes, slot, generation, dtype, shape = ref
    released.append((slot, generation))
    handle = tensor_pb2.ShmHandle(region=region, offset=offset, byte_size=nbytes, slot=slot, generation=generation)
    # marked ready before the message was sent: no real wait
    reader.wait_ready(handle, time.monotonic() + 1.0, "codes")
    data = bytearray(reader.view(handle, "codes"))
    reader.verify_unchanged(handle, "codes")
    return np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape)


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]


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


def worker_main(
    spec: VocoderSpec,
    ramp: Sequence[int],
    chunk_frames: int,
    arena_prefix: str,
    commands,
    results,
    torch_threads: int,
) -> None:
    """A code2wav worker: commands in (batches of messages), results out.

    Ends when told to stop or when the decoder's end of the pipe closes (the
    decoder exited, however)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the decoder decides when we stop
    if torch_threads > 0:
        torch.set_num_threads(torch_threads)
    send = pipe_sender(results)
    vocoder = build_vocoder(spec)
    core = Code2WavCore(ramp, chunk_frames, vocoder)
    reader = ArenaReader(arena_prefix)
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    send(("ready", os.getpid()))

    def receive() -> None:
        """Copies frames out of their slots as soon as they arrive, so slots
        come back even while the vocoder is busy; stamps each item with its
        arrival (the first chunk's wait)."""
        while True:
            try:
                batch = commands.recv()
            except (EOFError, OSError):
                inbox.put(None)
                return
            at = core.clock()
            released: list[tuple[int, int]] = []
            stop = False
            for msg in batch:
                if msg[0] == "stop":
                    stop = True
                    break
                if msg[0] == "frames":
                    _, rid, voice, ref, first = msg
                    try:
                        inbox.put(("frames", rid, voice, _load_codes(reader, ref, released), at, first))
                    except Exception as exc:  # noqa: BLE001 -- fail this request only
                        inbox.put(("fail", rid, "", _short(exc), at, 0))
                else:
                    inbox.put((*msg, at, 0))
            if released:
                send(("rel", released))
            if stop:
                inbox.put(None)
                return

    threading.Thread(target=receive, name="code2wav-receive", daemon=True).start()

    counted = 0
    reported = 0  # the queue length the decoder last heard of
    failed: set[str] = set()  # their later items start nothing, until the decoder aborts them

    def emit(rid: str, audio: np.ndarray, last: bool, reason: str) -> None:
        nonlocal counted, reported
        chunk = core.chunks != counted  # False for the empty last of a request without frames
        counted = core.chunks
        reported = core.queued
        send(("audio", rid, audio, last, reason, chunk, core.queued, core.first_wait))

    def fail(rid: str, text: str, trace: str) -> None:
        core.drop(rid)
        failed.add(rid)
        # the decoder logs it, with its own log setup
        send(("error", rid, text, trace))

    def take(item: tuple) -> None:
        kind, rid, voice, value, at, first = item
        if kind == "abort":
            core.drop(rid)
            failed.discard(rid)
        elif rid in failed:
            pass
        elif kind == "fail":
            fail(rid, value, "")
        else:
            try:
                core.add(kind, rid, voice, value, at, first)
            except Exception as exc:  # noqa: BLE001 -- fail this request, keep serving the others
                fail(rid, _short(exc), traceback.format_exc())

    def idle() -> None:
        nonlocal reported
        if reported:
            reported = 0
            send(("queue", 0))

    try:
        run_chunks(core, inbox, take, emit, lambda rid, exc: fail(rid, _short(exc), traceback.format_exc()), idle)
    finally:
        reader.close()
        results.close()


# -- the decoder side ----------------------------------------------------------------


@dataclass(eq=False)
class _Worker:
    """One process of a worker index; a restart makes a new _Worker."""

    index: int
    number: int  # restarts of this index so far
    sendq: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    process: Any = None
    commands: Any = None  # our end of the command pipe
    results: Any = None  # our end of the result pipe
    alive: bool = True  # False once its exit was handled
    ready: threading.Event = field(default_factory=threading.Event)
    load: int = 0  # requests pinned to it
    slots: set[tuple[int, int]] = field(default_factory=set)  # (slot, generation) not yet read
    queued: int = 0  # chunks ready in it and not yet decoded, as it last said
    sender: threading.Thread | None = None
    reader: threading.Thread | None = None


@dataclass(eq=False)
class _Pin:
    worker: _Worker
    finishing: bool = False  # finish sent: later frames of the request are late
    failed: bool = False  # its worker died: dropped until abort()


class Code2WavProcessPool:
    """The generation stage in worker processes; the same interface as the
    in-thread ``Code2WavWorker``, so the pipeline can use either."""

    def __init__(
        self,
        config,
        emit: Emit,
        *,
        vocoder,
        shm_prefix: str,
        workers: int = 1,
        spec: VocoderSpec | None = None,
        on_error: Callable[[str, BaseException], None] | None = None,
        live: Callable[[str], bool] | None = None,
        slots: int = 256,
        slot_bytes: int = 4096,
        slot_wait_s: float = 0.002,
        torch_threads: int = 1,
        stop_timeout_s: float = 2.0,
    ) -> None:
        """config: the generation stage (chunk ramp and size). vocoder: the
        parent's vocoder (its codebook facts); spec: how workers rebuild it
        (default ``vocoder.worker_spec()``). slot_wait_s: the longest
        ``frames`` waits for a free slot before sending the bytes inline."""
        if workers < 1:
            raise InvalidArgumentError("code2wav_workers", f"must be >= 1 for worker processes, got {workers}")
        self.config = config
        self.emit = emit
        self.on_error = on_error
        self.live = live
        self.spec = spec if spec is not None else vocoder_spec(vocoder)
        self.num_codebooks = int(vocoder.num_codebooks)
        self.codebook_size = int(vocoder.codebook_size)
        self.num_workers = workers
        self.shm_prefix = shm_prefix
        self.num_slots = slots
        self.slot_bytes = slot_bytes
        self.slot_wait_s = slot_wait_s
        self.torch_threads = torch_threads
        self.stop_timeout_s = stop_timeout_s
        self.chunks = 0
        self.restarts = 0
        self.inline_fallbacks = 0
        self.arena: ShmArena | None = None  # from start()
        self._ctx = multiprocessing.get_context("spawn")
        self._lock = threading.Lock()
        self._pins: dict[str, _Pin] = {}
        self._workers: list[_Worker] = []
        self._stopping = False
        self._starved = False  # the last acquire found no slot in time
        self._stop_event = threading.Event()
        self._restarting: set[threading.Thread] = set()
        # frames() calls writing into the arena now: stop() waits for them
        # before it unmaps the arena
        self._staging = 0
        self._staged = threading.Condition(self._lock)

    # -- lifecycle ---------------------------------------------------------------
    def start(self) -> None:
        self.arena = ShmArena(self.shm_prefix, self.num_slots, self.slot_bytes)
        try:
            for i in range(self.num_workers):
                w = _Worker(i, 0)
                self._workers.append(w)
                self._launch(w)
        except BaseException:
            self.stop()
            raise

    def _launch(self, w: _Worker) -> None:
        """Start w's process and its sender and reader threads. On failure
        (spawn, no file descriptors, no memory) nothing of it is left running
        or open, and the error is raised."""
        ends = []
        try:
            cmd_child, cmd_ours = self._ctx.Pipe(duplex=False)
            ends += [cmd_child, cmd_ours]
            res_ours, res_child = self._ctx.Pipe(duplex=False)
            ends += [res_ours, res_child]
            c = self.config
            w.process = self._ctx.Process(
                target=worker_main,
                args=(self.spec, tuple(c.initial_chunk_ramp), int(c.codec_chunk_frames), self.shm_prefix,
                      cmd_child, res_child, self.torch_threads),
                name=f"code2wav-{w.index}",
                daemon=True,
            )
            try:
                w.process.start()
            finally:
                # Only the child holds its ends now: its exit closes the result
                # pipe (EOF for our reader), ours closing stops it.
                cmd_child.close()
                res_child.close()
        except BaseException:
            for end in ends:
                end.close()
            w.process = None
            raise
        w.commands, w.results = cmd_ours, res_ours
        logger.info("code2wav worker %d started (pid %d)", w.index, w.process.pid)
        try:
            w.sender = threading.Thread(target=self._send_loop, args=(w,), name=f"code2wav-send-{w.index}",
                                        daemon=True)
            w.sender.start()
            w.reader = threading.Thread(target=self._read_loop, args=(w,), name=f"code2wav-read-{w.index}",
                                        daemon=True)
            w.reader.start()
        except BaseException:
            w.process.kill()
            w.process.join(5)
            self._close_pipes(w)
            raise

    def stop(self) -> None:
        """Let the workers finish what was sent (bounded: stop_timeout_s),
        kill those still running, and remove the arena."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            restarting = list(self._restarting)
            # no frames() starts writing into the arena now; those writing
            # finish first (a slot write is a memmove into the mapping)
            self._staged.wait_for(lambda: not self._staging)
        self._stop_event.set()
        for t in restarting:  # a restart under way finishes first (bounded)
            if t is not threading.current_thread():
                t.join(5)
        with self._lock:
            workers = list(self._workers)
        for w in workers:
            w.sendq.put(None)
        deadline = time.monotonic() + self.stop_timeout_s
        for w in workers:
            if w.process is not None:
                w.process.join(max(0.0, deadline - time.monotonic()))
        for w in workers:
            if w.process is not None and w.process.is_alive():
                logger.warning("code2wav worker %d (pid %d) did not stop in time; killing it", w.index, w.process.pid)
                w.process.kill()
                w.process.join(5)
        for w in workers:
            if w.reader is not None and w.reader is not threading.current_thread():
                w.reader.join(2)
            if w.ready.is_set() and w.alive:
                metrics.CODE2WAV_WORKERS.dec()
            w.alive = False
            self._set_queued(w, 0)
            self._close_pipes(w)
        if self.arena is not None:
            self.arena.close()

    def wait_ready(self, timeout_s: float) -> bool:
        """Whether every worker is up (its vocoder built) within timeout_s."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                workers = list(self._workers)
            if all(w.ready.is_set() for w in workers):
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            next(w for w in workers if not w.ready.is_set()).ready.wait(min(left, 0.1))

    @property
    def pids(self) -> list[int]:
        """The pids of the worker processes running now."""
        with self._lock:
            return [w.process.pid for w in self._workers if w.process is not None and w.process.is_alive()]

    # -- the stage's interface -------------------------------------------------------
    def frames(self, request_id: str, voice: str, codes: np.ndarray, first: int = 0) -> None:
        w = self._route(request_id)
        if w is None:
            return
        arr = np.ascontiguousarray(codes)
        staged = self._stage(arr)
        if staged is None:  # stopping: the arena is closing
            return
        ref, lease = staged
        with self._lock:
            pin = self._pins.get(request_id)
            if self._stopping or pin is None or pin.worker is not w or not w.alive or pin.failed:
                send = False  # its worker died meanwhile (the request is failing), or we stop
            else:
                send = True
                if lease is not None:
                    w.slots.add((lease.slot, lease.generation))
                w.sendq.put(("frames", request_id, voice, ref, first))
        if not send and lease is not None:
            self.arena.release(lease.slot, lease.generation)

    def finish(self, request_id: str, voice: str, reason: str) -> None:
        w = self._route(request_id)
        if w is None:
            return
        with self._lock:
            pin = self._pins.get(request_id)
            if pin is not None and pin.worker is w and w.alive and not pin.failed:
                pin.finishing = True
                w.sendq.put(("finish", request_id, voice, reason))

    def abort(self, request_id: str) -> None:
        with self._lock:
            pin = self._unpin(request_id)
            # failed by its worker (still alive): the worker drops the id's
            # later items until this abort
            if pin is not None and pin.worker.alive:
                pin.worker.sendq.put(("abort", request_id, "", None))

    # -- routing -----------------------------------------------------------------
    def _unpin(self, request_id: str) -> _Pin | None:
        """(under the lock)"""
        pin = self._pins.pop(request_id, None)
        if pin is not None and not pin.failed:
            pin.worker.load -= 1
        return pin

    def _route(self, request_id: str) -> _Worker | None:
        """The worker of a request; a new request (still live) is pinned to
        the least-loaded worker that is ready (its vocoder built), else to
        the least-loaded one (still starting: its items wait for it). None:
        drop the item."""
        with self._lock:
            pin = self._pins.get(request_id)
            if pin is not None:
                return None if pin.failed or pin.finishing else pin.worker
        # outside our lock: live() takes the pipeline's
        if self.live is not None and not self.live(request_id):
            return None
        with self._lock:
            if self._stopping or not self._workers:
                return None
            pin = self._pins.get(request_id)
            if pin is None:
                alive = [x for x in self._workers if x.alive] or self._workers
                ready = [x for x in alive if x.ready.is_set()]
                w = min(ready or alive, key=lambda x: x.load)
                w.load += 1
                pin = self._pins[request_id] = _Pin(w)
            return None if pin.failed or pin.finishing else pin.worker

    def _stage(self, arr: np.ndarray):
        """(message reference, lease): the frames in an arena slot, or inline.
        None: the pool stops (nothing written)."""
        with self._lock:
            if self._stopping:
                return None
            self._staging += 1
        try:
            return self._stage_frames(arr)
        finally:
            with self._lock:
                self._staging -= 1
                if not self._staging:
                    self._staged.notify_all()

    def _stage_frames(self, arr: np.ndarray):
        nbytes = arr.nbytes
        reason = "too_large"
        if nbytes <= self.arena.slot_bytes:
            try:
                # once none came in time, no more waiting until one comes back:
                # a stalled worker must not cost every decode step slot_wait_s
                lease = self.arena.acquire(0 if self._starved else self.slot_wait_s)
            except Exception:  # noqa: BLE001 -- no slot in time (or closing): inline
                reason = "no_slot"
                self._starved = True
            else:
                h = lease.write(torch.from_numpy(arr.reshape(-1).view(np.uint8))).shm
                lease.mark_ready()
                ref = ("shm", h.region, h.offset, h.byte_size, h.slot, h.generation, arr.dtype.str, arr.shape)
                return ref, lease
        with self._lock:
            self.inline_fallbacks += 1
        metrics.CODE2WAV_INLINE_FALLBACKS.labels(reason).inc()
        return ("raw", arr.tobytes(), arr.dtype.str, arr.shape), None

    # -- per-worker threads -----------------------------------------------------------
    def _send_loop(self, w: _Worker) -> None:
        """Writes w's queued items to its pipe, in batches; a full pipe (a
        busy worker) blocks only this thread."""
        while True:
            batch = [w.sendq.get()]
            while len(batch) < 256:
                try:
                    batch.append(w.sendq.get_nowait())
                except queue.Empty:
                    break
            stop = None in batch
            if stop:
                batch = batch[: batch.index(None)] + [("stop",)]
            try:
                w.commands.send(batch)
            except (OSError, ValueError):  # the worker is gone: its reader handles it
                return
            if stop:
                return

    def _read_loop(self, w: _Worker) -> None:
        """Results of w in order: slot releases, audio (emit), request errors;
        at EOF (the worker exited) its requests fail and it is restarted."""
        while True:
            try:
                msg = w.results.recv()
            except (EOFError, OSError):
                break
            kind = msg[0]
            if kind == "rel":
                self._starved = False
                with self._lock:
                    for slot, gen in msg[1]:
                        w.slots.discard((slot, gen))
                for slot, gen in msg[1]:
                    self.arena.release(slot, gen)
            elif kind == "audio":
                _, rid, audio, last, reason, chunk, queued, first_wait = msg
                self._set_queued(w, queued)
                if first_wait is not None:
                    metrics.CODE2WAV_FIRST_CHUNK_WAIT.observe(first_wait)
                with self._lock:
                    self.chunks += int(chunk)
                    pin = self._pins.get(rid)
                    if last and pin is not None and pin.worker is w:
                        self._unpin(rid)
                try:
                    self.emit(rid, audio, last, reason)
                except Exception:  # noqa: BLE001 -- the reader keeps serving
                    logger.exception("code2wav: emitting audio of request %s failed", rid)
            elif kind == "error":
                _, rid, text, trace = msg
                with self._lock:
                    pin = self._pins.get(rid)
                    first = pin is not None and pin.worker is w and not pin.failed
                    if first:
                        self._unpin(rid)
                        self._pins[rid] = _Pin(w, failed=True)  # dropped until the pipeline aborts it
                if first:
                    metrics.INTERNAL_ERRORS.labels("code2wav").inc()
                    logger.error("code2wav failed for request %s (worker %d): %s; failing it\n%s",
                                 rid, w.index, text, trace.rstrip())
                    self._fail(rid, UnavailableError(f"code2wav failed: {text}"))
            elif kind == "queue":
                self._set_queued(w, msg[1])
            elif kind == "ready":
                with self._lock:
                    if w.alive and not self._stopping:
                        w.ready.set()
                        metrics.CODE2WAV_WORKERS.inc()
        self._exited(w)

    def _set_queued(self, w: _Worker, queued: int) -> None:
        """w's ready chunks now (0 once it is gone), into the gauge of all workers."""
        with self._lock:
            delta, w.queued = queued - w.queued, queued
        if delta:
            metrics.CODE2WAV_QUEUE_CHUNKS.inc(delta)

    @staticmethod
    def _close_pipes(w: _Worker) -> None:
        """Close our ends of w's pipes once no thread of ours uses them."""
        if w.sender is not None:
            w.sendq.put(None)  # wakes an idle sender; a send to a dead worker fails at once
            w.sender.join(5)
        if w.commands is not None and (w.sender is None or not w.sender.is_alive()):
            w.commands.close()
        if w.results is not None and (w.reader is None or not w.reader.is_alive()
                                      or w.reader is threading.current_thread()):
            w.results.close()

    def _fail(self, rid: str, exc: BaseException) -> None:
        if self.on_error is None:
            return
        try:
            self.on_error(rid, exc)
        except Exception:  # noqa: BLE001 -- the reader keeps serving
            logger.exception("failing request %s failed", rid)

    def _exited(self, w: _Worker) -> None:
        """w's process is gone: fail its requests, reclaim its slots, restart it."""
        w.process.join(5)
        with self._lock:
            if self._stopping or not w.alive:
                return
            w.alive = False
            lost = [rid for rid, pin in self._pins.items() if pin.worker is w and not pin.failed]
            for rid in lost:
                self._pins[rid] = _Pin(w, failed=True)  # dropped until the pipeline aborts it
            slots, w.slots = list(w.slots), set()
            was_ready = w.ready.is_set()
            # the new process takes items at once (queued until it runs)
            new = _Worker(w.index, w.number + 1)
            self._workers[w.index] = new
            me = threading.current_thread()
            self._restarting.add(me)
        try:
            self._close_pipes(w)
            for slot, gen in slots:
                self.arena.release(slot, gen)
            if was_ready:
                metrics.CODE2WAV_WORKERS.dec()
            self._set_queued(w, 0)
            self.restarts += 1
            metrics.CODE2WAV_RESTARTS.inc()
            code = w.process.exitcode
            how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            logger.error("code2wav worker %d (pid %d) ended (%s); failing its %d request(s) and restarting it",
                         w.index, w.process.pid, how, len(lost))
            for rid in lost:
                self._fail(rid, UnavailableError("the code2wav worker of the request ended"))
            # one that died starting: no spinning on a vocoder that cannot be built
            self._relaunch(new, backoff=not was_ready)
        finally:
            with self._lock:
                self._restarting.discard(me)

    def _relaunch(self, w: _Worker, backoff: bool) -> None:
        """Start w (the restart of its index) until a launch succeeds or the
        pool stops; each failed launch fails the requests pinned to it
        meanwhile, and the next try waits longer."""
        while True:
            if backoff and self._stop_event.wait(min(10.0, 0.5 * 2 ** min(w.number, 5))):
                return
            if self._stopping:
                return
            try:
                self._launch(w)
                return
            except Exception:  # noqa: BLE001 -- retried below; its requests fail
                logger.exception("code2wav worker %d could not be restarted; retrying", w.index)
            with self._lock:
                w.alive = False
                lost = [rid for rid, pin in self._pins.items() if pin.worker is w and not pin.failed]
                for rid in lost:
                    self._pins[rid] = _Pin(w, failed=True)  # dropped until the pipeline aborts it
                slots, w.slots = list(w.slots), set()
                stopping = self._stopping
                if not stopping:
                    # the next try takes new requests (queued until it runs)
                    nxt = _Worker(w.index, w.number + 1)
                    self._workers[w.index] = nxt
            for slot, gen in slots:
                self.arena.release(slot, gen)
            for rid in lost:
                self._fail(rid, UnavailableError("the code2wav worker of the request could not be started"))
            if stopping:
                return
            w, backoff = nxt, True
