"""code2wav in worker processes (the parent side): the generation stage off the decoder's interpreter.

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
  a reference (``.messages.Frames`` with ``ShmFrames``: slot, generation,
  offset, dtype, shape). The worker (``.worker``) copies the
  frames out at once and hands the slot back. When no slot is free within
  ``slot_wait_s`` (or the frames do not fit one), the bytes go in the message
  instead (``InlineFrames``; counted in
  ``omni_decoder_code2wav_inline_fallbacks_total``): the
  AR stage never waits on code2wav.
- audio chunks, worker -> decoder: over the worker's result pipe. A chunk is
  produced once per 5-25 frames, is read once and goes straight into a gRPC
  message, so a pipe's copy costs little and needs no slot bookkeeping in the
  other direction (a worker killed mid-write leaves nothing to reclaim).

Every message is a typed class of ``.messages``, dispatched by type.

A request is pinned to the least-loaded worker at its first frame (of those
whose vocoder is built, if any: not to one still starting), so its
chunk state (left context, stream state) lives in one process, and one reader
thread per worker calls ``emit`` in order. A worker decodes its ready chunks
not in arrival order but first chunks first, then the request closest to
running dry (``.core.next_request``); each request's chunks stay in order.
``frames``/``finish``/``abort`` only enqueue: a sender thread per worker
writes to the pipe, so a slow worker never blocks the caller. A worker that
exits (SIGKILL included) fails only the requests pinned to it
(``on_error``), its slots are reclaimed and it is restarted; new requests
are served by the new process. A restart that cannot start its process
fails the requests pinned to it meanwhile and is retried, waiting longer
each time.

Liveness: each worker index has a ``Progress`` (``progress[index]``, part
``code2wav:<index>``) whose count follows the chunks the worker's decode loop
reports having decoded (``.messages.Status``: counted by the loop, not by the
reporting thread); work waits while the worker is ready and has items sent
that its loop has not handled, or its loop did not wait for items at its last
report (a chunk to decode). A watchdog (``omni_common.liveness``, wired by
``decoder_svc.stage.liveness``) that finds it stuck calls ``kill_stuck``:
the process is killed, the requests pinned to it end with UNAVAILABLE naming
the stall ("code2wav worker 0 of the request made no progress for 2.1 s
with work waiting (limit 2.0 s); it was restarted"), and it is restarted as
after a crash.

Metrics: the series a worker sets in its own registry (the vocoder's time
per chunk, ``omni_decoder_code2wav_chunk_seconds``; ``.worker.worker_metrics``)
come in its ``Status`` about once a second when they changed and go to a
``Forwarded`` store (``omni_common.metrics_forward.FORWARDED`` by default) as
the source ``code2wav:<index>``, labelled ``stage="code2wav"`` and
``worker="<index>"``; the decoder's /metrics serves them merged with its own.
A worker that ends is retired there: its counters carry over to the next
process of its index.
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from decoder_svc import metrics
from decoder_svc.code2wav.core import Emit, VocoderSpec, vocoder_spec
from decoder_svc.code2wav.messages import (
    Abort,
    Audio,
    Error,
    Finish,
    Frames,
    InlineFrames,
    Queue,
    Ready,
    Released,
    ShmFrames,
    Status,
    Stop,
)
from decoder_svc.code2wav.worker import worker_main
from decoder_svc.spawned import start_with_threads
from omni_common.errors import InvalidArgumentError, OmniError, UnavailableError
from omni_common.liveness import Progress, no_progress
from omni_common.metrics_forward import FORWARDED, Forwarded
from omni_common.shm_arena import ShmArena

logger = logging.getLogger(__name__)

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
    sent: int = 0  # items (frames, finish, abort) put to it
    taken: int = 0  # items its decode loop handled, as it last said
    waiting: bool = True  # its decode loop waited for items (nothing to decode), as it last said
    turns: int = 0  # chunks its decode loop decoded, as it last said
    stalled: str = ""  # why it was killed for making no progress ("" when it was not)
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
        forwarded: Forwarded = FORWARDED,
    ) -> None:
        """config: the generation stage (chunk ramp and size). vocoder: the
        parent's vocoder (its codebook facts); spec: how workers rebuild it
        (default ``vocoder.worker_spec()``). slot_wait_s: the longest
        ``frames`` waits for a free slot before sending the bytes inline.
        forwarded: where the workers' metrics go (see the module docstring)."""
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
        self.forwarded = forwarded
        # one per worker index, across its restarts (see the module docstring)
        self.progress = [Progress(f"code2wav:{i}", functools.partial(self._has_work, i)) for i in range(workers)]
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
                      cmd_child, res_child, self.torch_threads, int(c.code2wav_max_batch)),
                name=f"code2wav-{w.index}",
                daemon=True,
            )
            try:
                start_with_threads(w.process, 0)  # its threads are set inside (torch_threads)
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
        """Stop the workers (each ends after the chunk it is decoding, what is
        still queued dropped: ``run_chunks``; bounded: stop_timeout_s), kill
        those still running, and remove the arena."""
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
            self.forwarded.retire(self._metrics_source(w.index))
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
                self._post(w, Frames(request_id, voice, ref, first))
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
                self._post(w, Finish(request_id, voice, reason))

    def abort(self, request_id: str) -> None:
        with self._lock:
            pin = self._unpin(request_id)
            # failed by its worker (still alive): the worker drops the id's
            # later items until this abort
            if pin is not None and pin.worker.alive:
                self._post(pin.worker, Abort(request_id))

    @staticmethod
    def _post(w: _Worker, msg: Frames | Finish | Abort) -> None:
        """(under the lock) Queue an item for w's decode loop."""
        w.sent += 1
        w.sendq.put(msg)

    # -- liveness ------------------------------------------------------------------
    def _has_work(self, index: int) -> bool:
        """Work waits for the decode loop of worker `index`: it is ready, and
        it has items sent that its loop has not handled, or its loop did not
        wait for items at its last report."""
        with self._lock:
            if self._stopping or index >= len(self._workers):
                return False
            w = self._workers[index]
            if not w.alive or not w.ready.is_set():
                return False
            return w.sent > w.taken or not w.waiting

    def kill_stuck(self, index: int, seconds: float, limit_s: float) -> None:
        """The watchdog's verdict on worker `index` (no progress for `seconds`,
        over its limit): kill its process; its reader fails the requests
        pinned to it (naming the stall) and restarts it as after a crash."""
        with self._lock:
            w = self._workers[index] if index < len(self._workers) else None
            if w is None or self._stopping or not w.alive or not w.ready.is_set() or w.process is None:
                return
            w.stalled = no_progress(seconds, limit_s)
        logger.error("code2wav worker %d %s; killing it (pid %d)", w.index, w.stalled, w.process.pid)
        w.process.kill()

    def _take_status(self, w: _Worker, status: Status) -> None:
        """w's decode loop as it last reported; its metrics to the store."""
        with self._lock:
            turns, w.turns = status.turns - w.turns, status.turns
            w.taken, w.waiting = status.taken, status.waiting
        progress = self.progress[w.index]
        progress.set_count(progress.count + turns)
        if status.pace_s is not None:
            progress.pace_s = status.pace_s
        if status.metrics is not None:
            self.forwarded.update(self._metrics_source(w.index), {"stage": "code2wav", "worker": str(w.index)},
                                  status.metrics)

    @staticmethod
    def _metrics_source(index: int) -> str:
        return f"code2wav:{index}"

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
                ref = ShmFrames(h.region, h.offset, h.byte_size, h.slot, h.generation, arr.dtype.str, arr.shape)
                return ref, lease
        with self._lock:
            self.inline_fallbacks += 1
        metrics.CODE2WAV_INLINE_FALLBACKS.labels(reason).inc()
        return InlineFrames(arr.tobytes(), arr.dtype.str, arr.shape), None

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
                batch = batch[: batch.index(None)] + [Stop()]
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
            match msg:
                case Released(slots=released):
                    self._starved = False
                    with self._lock:
                        for slot, gen in released:
                            w.slots.discard((slot, gen))
                    for slot, gen in released:
                        self.arena.release(slot, gen)
                case Audio(request_id=rid, audio=audio, last=last, reason=reason, chunk=chunk, queued=queued,
                           first_wait=first_wait):
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
                case Error(request_id=rid, text=text, trace=trace):
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
                        self._fail(rid, OmniError(f"code2wav failed: {text}"))
                case Queue(queued=queued):
                    self._set_queued(w, queued)
                case Status():
                    self._take_status(w, msg)
                case Ready():
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
            # its counters carry over to the next process of the index; its gauges go
            self.forwarded.retire(self._metrics_source(w.index))
            self.restarts += 1
            metrics.CODE2WAV_RESTARTS.inc()
            code = w.process.exitcode
            how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            if w.stalled:
                logger.error("code2wav worker %d (pid %d) %s and was killed; failing its %d request(s) and "
                             "restarting it", w.index, w.process.pid, w.stalled, len(lost))
                ended = f"code2wav worker {w.index} of the request {w.stalled}; it was restarted"
            else:
                logger.error("code2wav worker %d (pid %d) ended (%s); failing its %d request(s) and restarting it",
                             w.index, w.process.pid, how, len(lost))
                ended = "the code2wav worker of the request ended"
            for rid in lost:
                self._fail(rid, UnavailableError(ended))
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
