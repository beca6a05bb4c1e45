"""A code2wav worker process (the child side of ``.pool``): frames in, audio chunks out.

Runs in a ``multiprocessing`` "spawn" child of the decoder: rebuilds the
vocoder from its spec (``.core.build_vocoder``), then serves the commands of
its pipe (``.messages``) until told to stop or until the decoder's end of the
pipe closes (the decoder exited, however). A receiver thread copies frames
out of their arena slots as soon as they arrive, so slots come back even
while the vocoder is busy; the decode loop (``.core.run_chunks``) picks the
chunks decoded next (one vocoder call for up to ``max_batch`` requests). A request that fails here is reported (``Error``) and
its later items start nothing until the decoder aborts it.

Liveness and metrics: the decode loop counts its vocoder calls (a
``Progress``: its recent time per call too) and the items it has handled,
and says whether it waits for items (nothing ready); a reporter thread
sends them in a ``Status`` when they changed, and about once
a second a snapshot of this process's metrics (``worker_metrics``: the series
a worker sets, e.g. ``omni_decoder_code2wav_chunk_seconds``) when it changed.
The decoder judges the counts (``.pool``; a loop that stops counting while
items wait is stuck) and serves the metrics labelled with the worker.

Memory: while the decode loop waits for items after decoding, the reporter
thread hands the process's freed heap back to the OS, at most every 2 s
(``omni_common.heap``; counted in ``omni_decoder_code2wav_heap_trims_total``):
a decode's temporaries would otherwise stay resident after a burst.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
import traceback
from collections.abc import Sequence

import numpy as np
import torch

from decoder_svc import metrics
from decoder_svc.code2wav.core import Code2WavCore, VocoderSpec, build_vocoder, run_chunks
from decoder_svc.code2wav.messages import (
    METRICS_EVERY,
    STATUS_INTERVAL_S,
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
from decoder_svc.spawned import pipe_sender
from omni_common import metrics_forward
from omni_common.fast_exit import exit_now
from omni_common.heap import HeapTrimmer
from omni_common.liveness import Progress
from omni_common.shm_arena import ArenaReader

PARENT_RECORDED = frozenset(m._name for m in (
    # the decoder records these itself, from the messages of its workers
    metrics.CODE2WAV_WORKERS, metrics.CODE2WAV_RESTARTS, metrics.CODE2WAV_INLINE_FALLBACKS,
    metrics.CODE2WAV_QUEUE_CHUNKS, metrics.CODE2WAV_FIRST_CHUNK_WAIT,
))
"""code2wav families a worker does not forward (the decoder has them already)."""


def worker_metrics() -> list:
    """This process's series that the decoder should serve: its code2wav
    families (but ``PARENT_RECORDED``) and any family outside the decoder's
    (a vocoder's own); the decoder's other families are registered here by
    the import but never set."""
    return [f for f in metrics_forward.snapshot(exclude=PARENT_RECORDED)
            if f[0].startswith("omni_decoder_code2wav_") or not f[0].startswith("omni_decoder_")]


def _load_codes(reader, ref: ShmFrames | InlineFrames, released: list[tuple[int, int]]) -> np.ndarray:
    """The frames a message refers to, copied out of their slot (or its bytes)."""
    if isinstance(ref, InlineFrames):
        return np.frombuffer(bytearray(ref.data), dtype=np.dtype(ref.dtype)).reshape(ref.shape)
    from omni_serving.v1 import tensor_pb2

    released.append((ref.slot, ref.generation))
    handle = tensor_pb2.ShmHandle(region=ref.region, offset=ref.offset, byte_size=ref.nbytes, slot=ref.slot,
                                  generation=ref.generation)
    # marked ready before the message was sent: no real wait
    reader.wait_ready(handle, time.monotonic() + 1.0, "codes")
    data = bytearray(reader.view(handle, "codes"))
    reader.verify_unchanged(handle, "codes")
    return np.frombuffer(data, dtype=np.dtype(ref.dtype)).reshape(ref.shape)


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]


def worker_main(
    spec: VocoderSpec,
    ramp: Sequence[int],
    chunk_frames: int,
    arena_prefix: str,
    commands,
    results,
    torch_threads: int,
    max_batch: int = 1,
) -> None:
    """A code2wav worker: commands in (batches of messages), results out.

    Ends when told to stop or when the decoder's end of the pipe closes (the
    decoder exited, however)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the decoder decides when we stop
    if torch_threads > 0:
        torch.set_num_threads(torch_threads)
    send = pipe_sender(results)
    vocoder = build_vocoder(spec)
    core = Code2WavCore(ramp, chunk_frames, vocoder, max_batch=max_batch)
    reader = ArenaReader(arena_prefix)
    # the decode loop's items: (kind, request id, voice, value, arrival, first frames)
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    send(Ready(os.getpid()))

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
                match msg:
                    case Stop():
                        stop = True
                        break
                    case Frames(request_id=rid, voice=voice, ref=ref, first=first):
                        try:
                            inbox.put(("frames", rid, voice, _load_codes(reader, ref, released), at, first))
                        except Exception as exc:  # noqa: BLE001 -- fail this request only
                            inbox.put(("fail", rid, "", _short(exc), at, 0))
                    case Finish(request_id=rid, voice=voice, reason=reason):
                        inbox.put(("finish", rid, voice, reason, at, 0))
                    case Abort(request_id=rid):
                        inbox.put(("abort", rid, "", None, at, 0))
            if released:
                send(Released(released))
            if stop:
                inbox.put(None)
                return

    threading.Thread(target=receive, name="code2wav-receive", daemon=True).start()

    counted = 0
    reported = 0  # the queue length the decoder last heard of
    failed: set[str] = set()  # their later items start nothing, until the decoder aborts them
    # the decode loop's liveness: advanced by the loop only (never by the reporter)
    progress = Progress("code2wav", lambda: False)
    taken = 0  # items the loop took from its inbox (counted once handled)
    waiting = False  # the loop waits for items (nothing ready to decode)
    done = threading.Event()
    heap = HeapTrimmer()  # a decode's freed temporaries go back to the OS while the loop waits

    def report() -> None:
        """Sends the loop's counts when they changed, and about once a second
        the metrics when they changed, until the loop ends or the decoder is gone."""
        last_counts: tuple[int, int, bool] | None = None
        last_metrics: list | None = None
        looks = 0
        while not done.wait(STATUS_INTERVAL_S):
            looks += 1
            if waiting and heap.idle():  # the loop waits for items: hand its freed heap back
                metrics.CODE2WAV_HEAP_TRIMS.inc()
            counts = (progress.count, taken, waiting)
            snap = worker_metrics() if looks % METRICS_EVERY == 0 else None
            if snap == last_metrics:
                snap = None
            if counts == last_counts and snap is None:
                continue
            if not send(Status(counts[0], counts[1], counts[2], progress.pace_s, snap)):
                return
            last_counts = counts
            if snap is not None:
                last_metrics = snap

    threading.Thread(target=report, name="code2wav-report", daemon=True).start()

    def emit(rid: str, audio: np.ndarray, last: bool, reason: str) -> None:
        nonlocal counted, reported
        chunk = core.chunks != counted  # False for the empty last of a request without frames
        counted = core.chunks
        reported = core.queued
        if core.turn_first:  # one round of the loop: a vocoder call (or empty lasts only)
            progress.advance(core.decode_s)
            heap.worked()
        send(Audio(rid, audio, last, reason, chunk, core.queued, core.first_wait))

    def fail(rid: str, text: str, trace: str) -> None:
        core.drop(rid)
        failed.add(rid)
        # the decoder logs it, with its own log setup
        send(Error(rid, text, trace))

    def take(item: tuple) -> None:
        nonlocal taken, waiting
        waiting = False
        try:
            handle(item)
        finally:
            taken += 1

    def handle(item: tuple) -> None:
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
        nonlocal reported, waiting
        waiting = True
        if reported:
            reported = 0
            send(Queue(0))

    try:
        run_chunks(core, inbox, take, emit, lambda rid, exc: fail(rid, _short(exc), traceback.format_exc()), idle)
    finally:
        done.set()
        reader.close()
        results.close()
    # stopped in order above: the interpreter's own exit only costs time (omni_common.fast_exit)
    exit_now(0)
