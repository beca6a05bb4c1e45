"""code2wav on a thread of the decoder: the generation stage without worker processes.

``--code2wav-workers 0`` (and tests that build a pipeline by hand) run the
vocoder here, on one thread: the same stream core as the worker processes
(``.core``: same chunks, same bytes, same order), with the same interface as
``.pool.Code2WavProcessPool``, so the pipeline can use either. Callers
never wait: ``frames``/``finish``/``abort`` enqueue. No thread dies of an
exception: a failing request ends alone (``on_error``).

Liveness (``omni_common.liveness``): ``progress`` (part ``code2wav``) counts
the loop's decode turns; work waits while items are queued or chunks are
ready to decode. The decoder's watchdog judges it
(``decoder_svc.stage.liveness``): nothing can restart a thread, so a stuck
loop fails the running requests and the decoder reports not ready.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

import numpy as np

from decoder_svc import metrics
from decoder_svc.code2wav.core import Code2WavCore, run_chunks
from decoder_svc.profile import StageConfig
from omni_common.liveness import Progress

logger = logging.getLogger(__name__)


class Code2WavWorker:
    """The generation stage: codec frames -> audio chunks, per request."""

    def __init__(
        self,
        config: StageConfig,
        emit: Callable[[str, np.ndarray, bool, str], None],
        *,
        vocoder,
        on_error: Callable[[str, BaseException], None] | None = None,
        live: Callable[[str], bool] | None = None,
    ):
        """live(request_id): whether the request still runs; frames of a
        request that ended (an abort raced with a delivery) start nothing."""
        self.config = config
        self.emit = emit
        self.on_error = on_error
        self.live = live
        self.vocoder = vocoder
        # the chunking shared with the worker processes (same chunks, same bytes)
        self._core = Code2WavCore(config.initial_chunk_ramp, config.codec_chunk_frames, vocoder,
                                  max_batch=config.code2wav_max_batch)
        self.num_codebooks = self._core.num_codebooks
        self.codebook_size = self._core.codebook_size
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._queued = 0  # the core's ready chunks, as the gauge has them
        self._thread = threading.Thread(target=self._loop, name="code2wav", daemon=True)
        self.pids: list[int] = []  # no worker process: it runs on a thread here
        # the loop's liveness: advanced once per decode turn, by the loop only
        self.progress = Progress("code2wav", self._has_work)

    @property
    def chunks(self) -> int:
        return self._core.chunks

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """End after the chunk being decoded (what is still queued is dropped: ``run_chunks``)."""
        self._queue.put(None)
        self._thread.join(timeout=30)
        self._report()

    def frames(self, request_id: str, voice: str, codes: np.ndarray, first: int = 0) -> None:
        """first: frames of the request's first chunk (0: the ramp's); its
        first call's value counts."""
        self._queue.put(("frames", request_id, voice, codes, self._core.clock(), first))

    def finish(self, request_id: str, voice: str, reason: str) -> None:
        self._queue.put(("finish", request_id, voice, reason, self._core.clock(), 0))

    def abort(self, request_id: str) -> None:
        self._queue.put(("abort", request_id, "", None, 0.0, 0))

    def _loop(self) -> None:
        """Items arrive on the queue (the callers never wait); everything that
        has arrived goes into the core's ready set, which decides the chunk
        decoded next (first chunks first, then the request closest to
        running dry: Code2WavCore)."""
        run_chunks(self._core, self._queue, self._take, self._emit, self._fail, self._report)

    def _take(self, item: tuple) -> None:
        kind, rid, voice, value, at, first = item
        if kind == "abort":
            self._core.drop(rid)
            return
        if not self._core.has(rid) and self.live is not None and not self.live(rid):
            return
        try:
            self._core.add(kind, rid, voice, value, at, first)
        except Exception as exc:  # noqa: BLE001 -- fail this request, keep serving the others
            self._fail(rid, exc)

    def _has_work(self) -> bool:
        """Work waits for the loop: items queued, or chunks ready to decode."""
        return not self._queue.empty() or self._core.queued > 0

    def _emit(self, rid: str, audio: np.ndarray, last: bool, reason: str) -> None:
        if self._core.turn_first:  # one round of the loop: a vocoder call (or empty lasts only)
            self.progress.advance(self._core.decode_s)
        self._report()
        if self._core.first_wait is not None:
            metrics.CODE2WAV_FIRST_CHUNK_WAIT.observe(self._core.first_wait)
        self.emit(rid, audio, last, reason)

    def _report(self) -> None:
        """The core's ready chunks into the gauge (this worker's share)."""
        queued = self._core.queued
        if queued != self._queued:
            metrics.CODE2WAV_QUEUE_CHUNKS.inc(queued - self._queued)
            self._queued = queued

    def _fail(self, rid: str, exc: Exception) -> None:
        self._core.drop(rid)
        metrics.INTERNAL_ERRORS.labels("code2wav").inc()
        logger.error("code2wav failed for request %s; failing it", rid, exc_info=exc)
        if self.on_error is not None:
            try:
                self.on_error(rid, exc)
            except Exception:  # noqa: BLE001 -- the worker keeps serving
                logger.exception("failing request %s failed", rid)

