"""The pool materializer: steps built by worker processes, several in flight.

Where the reference builds one step at a time on a thread of the server
process, this implementation spreads the building over a pool of worker
processes (multiprocessing, 'forkserver' or 'spawn' context) and keeps up to
`pipeline_depth` steps of a stream in flight, answering strictly in the order
the snapshots arrived.

What crosses the process boundary is small: the serialized StepSnapshot
(metadata and handles), the stage's serialized StagePlan and a readiness
deadline go to a worker; the serialized answer comes back. Tensor bytes never
travel: each worker maps the arena read-only itself (its own ArenaReader)
and runs the same `materialize_step` as the reference, so the answers are
byte-identical.

Per stream:
  1) the feeder reads snapshots in arrival order, applies the ordering rules
     (`StreamSession.admit`) and dispatches each admitted step to the pool,
     waiting for a free place in the stream's window (backpressure);
  2) the answer loop awaits the dispatched steps in arrival order and yields
     them, so a slow step holds back later answers but not later work;
  3) a worker that dies fails its steps with UNAVAILABLE (in-band) and the
     pool is replaced; the stream stays open.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures.process import BrokenProcessPool

from materializer_svc.reference import ReferenceMaterializer
from materializer_svc.registry import MaterializerConfig, register
from materializer_svc.session import StreamSession, error_response, materialize_step
from omni_common.errors import InvalidArgumentError, OmniError, UnavailableError
from omni_common.shm_arena import ArenaReader
from omni_serving.v1 import materializer_pb2, snapshot_pb2

logger = logging.getLogger(__name__)

START_METHODS = ("forkserver", "spawn")
_WORKER_START_TIMEOUT_S = 120.0
_PING_HOLD_S = 0.5  # how long each start-up ping holds its worker (see _new_executor)

# --------------------------------------------------------------------------
# Worker side (runs in the pool's processes)
# --------------------------------------------------------------------------

_READER: ArenaReader | None = None


def _watch_parent(parent_pid: int, ppid: int) -> None:
    """Exit when the server process is gone, however it died (SIGKILL too)."""
    while True:
        time.sleep(0.5)
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            os._exit(0)
        except PermissionError:
            pass  # exists, owned by someone else: cannot be our parent any more
        if os.getppid() != ppid:
            os._exit(0)


def _init_worker(prefix: str, parent_pid: int) -> None:
    global _READER
    # Ctrl-C reaches the whole process group; the server decides when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch

    torch.set_num_threads(1)  # one step per process; parallelism comes from the pool
    _READER = ArenaReader(prefix)
    threading.Thread(
        target=_watch_parent, args=(parent_pid, os.getppid()), name="parent-watch", daemon=True
    ).start()


def _ping(hold_s: float = 0.0) -> int:
    time.sleep(hold_s)
    return os.getpid()


def _materialize_in_worker(snapshot: bytes, plan: bytes, deadline: float) -> bytes:
    """One step, in a worker: the same dispatch as the reference, bytes in and out."""
    assert _READER is not None, "worker not initialized"
    snap = snapshot_pb2.StepSnapshot.FromString(snapshot)
    stage_plan = materializer_pb2.StagePlan.FromString(plan)
    return materialize_step(snap, stage_plan, _READER, deadline).SerializeToString()


# --------------------------------------------------------------------------
# Server side
# --------------------------------------------------------------------------


class _Dispatched:
    """A step of a stream: handed to the pool, or answered at once."""

    __slots__ = ("snap", "future", "executor", "resp")

    def __init__(
        self,
        snap: snapshot_pb2.StepSnapshot,
        *,
        future: asyncio.Future | None = None,
        executor: concurrent.futures.ProcessPoolExecutor | None = None,
        resp: materializer_pb2.MaterializeResponse | None = None,
    ) -> None:
        self.snap = snap
        self.future = future
        self.executor = executor
        self.resp = resp


class PoolMaterializer(ReferenceMaterializer):
    implementation = "pool"

    def __init__(self, config: MaterializerConfig) -> None:
        if config.workers < 1:
            raise InvalidArgumentError("workers", f"must be >= 1, got {config.workers}")
        if config.start_method not in START_METHODS:
            raise InvalidArgumentError(
                "start_method", f"must be one of {START_METHODS}, got {config.start_method!r}"
            )
        super().__init__(config)
        self.depth = config.pipeline_depth or 2 * config.workers
        self._ctx = multiprocessing.get_context(config.start_method)
        if config.start_method == "forkserver":
            # Import torch and the builder once in the fork server; workers
            # forked from it start in milliseconds.
            self._ctx.set_forkserver_preload([__name__])
        self._lock = threading.Lock()
        self._closed = False
        self._replacing = False
        self.worker_restarts = 0
        self._executor = self._new_executor()

    # -- the pool ------------------------------------------------------------------
    def _new_executor(self) -> concurrent.futures.ProcessPoolExecutor:
        executor = concurrent.futures.ProcessPoolExecutor(
            max_workers=self.config.workers,
            mp_context=self._ctx,
            initializer=_init_worker,
            initargs=(self.config.shm_prefix, os.getpid()),
        )
        # Start every worker now (one ping each: the pool spawns a process per
        # task while none is idle; each ping holds its worker a moment, so no
        # worker is idle again before the last ping is submitted), so SERVING
        # means ready.
        pings = [executor.submit(_ping, _PING_HOLD_S) for _ in range(self.config.workers)]
        try:
            pids = {f.result(timeout=_WORKER_START_TIMEOUT_S) for f in pings}
        except BaseException:
            self._terminate(executor)
            raise
        logger.info("pool of %d worker process(es) ready: %s", self.config.workers, sorted(pids))
        return executor

    def worker_pids(self) -> list[int]:
        """Process ids of the current workers."""
        with self._lock:
            procs = getattr(self._executor, "_processes", None) or {}
        return sorted(procs)

    def _replace(self, broken: concurrent.futures.ProcessPoolExecutor) -> None:
        """Swap a broken pool for a new one (once, whoever notices first).

        Blocks while the new workers start: call it off the event loop.
        """
        with self._lock:
            if self._closed or self._executor is not broken or self._replacing:
                return
            self._replacing = True
        logger.error("a pool worker died; starting a new pool")
        try:
            fresh = self._new_executor()
        finally:
            with self._lock:
                self._replacing = False
        with self._lock:
            closed = self._closed
            if not closed:
                self._executor = fresh
                self.worker_restarts += 1
        self._terminate(fresh if closed else broken)

    def _submit(self, snap: snapshot_pb2.StepSnapshot, plan: bytes, deadline: float) -> _Dispatched:
        with self._lock:
            if self._closed:
                raise UnavailableError("materializer is shutting down")
            executor = self._executor
        try:
            cf = executor.submit(_materialize_in_worker, snap.SerializeToString(), plan, deadline)
        except BrokenProcessPool:
            asyncio.get_running_loop().run_in_executor(None, self._replace, executor)
            raise UnavailableError(
                f"the worker pool is restarting; step {snap.step_id} was not built"
            ) from None
        return _Dispatched(snap, future=asyncio.wrap_future(cf), executor=executor)

    async def _answer(self, item: _Dispatched) -> materializer_pb2.MaterializeResponse:
        if item.resp is not None:
            return item.resp
        assert item.future is not None and item.executor is not None
        try:
            data = await item.future
        except BrokenProcessPool as exc:
            await asyncio.to_thread(self._replace, item.executor)
            return error_response(
                item.snap,
                UnavailableError(
                    f"a worker process died while building step {item.snap.step_id}: {exc}"
                ),
            )
        except Exception as exc:  # noqa: BLE001  a bug or a pickling failure: INTERNAL StepError, logged
            return error_response(item.snap, exc)
        return materializer_pb2.MaterializeResponse.FromString(data)

    # -- the strategy --------------------------------------------------------------
    async def answers(
        self, session: StreamSession, it: AsyncIterator[materializer_pb2.MaterializeRequest]
    ) -> AsyncIterator[materializer_pb2.MaterializeResponse]:
        plans = {stage_id: plan.SerializeToString() for stage_id, plan in session.plans.items()}
        window = asyncio.Semaphore(self.depth)
        order: asyncio.Queue[_Dispatched | BaseException | None] = asyncio.Queue()
        in_flight = 0

        async def feed() -> None:
            nonlocal in_flight
            try:
                async for req in it:
                    snap = self.snapshot_of(req)
                    await window.acquire()
                    # 1) ordering rules in arrival order, then dispatch
                    try:
                        session.admit(snap)
                        item = self._submit(snap, plans[snap.stage_id], session.deadline())
                    except OmniError as exc:
                        item = _Dispatched(snap, resp=error_response(snap, exc))
                    in_flight += 1
                    self.counters.peak_in_flight = max(self.counters.peak_in_flight, in_flight)
                    order.put_nowait(item)
            except Exception as exc:  # noqa: BLE001  handed to the answer loop, which re-raises it in order
                order.put_nowait(exc)
                return
            order.put_nowait(None)

        feeder = asyncio.create_task(feed(), name="pool-feed")
        try:
            while True:
                # 2) answers strictly in arrival order
                item = await order.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                resp = await self._answer(item)
                in_flight -= 1
                window.release()
                yield resp
        finally:
            feeder.cancel()
            # Steps not started yet are dropped; running ones finish in their worker.
            while not order.empty():
                left = order.get_nowait()
                if isinstance(left, _Dispatched) and left.future is not None:
                    left.future.cancel()

    # -- lifecycle -------------------------------------------------------------------
    @staticmethod
    def _terminate(executor: concurrent.futures.ProcessPoolExecutor) -> None:
        """Stop a pool now: queued steps are dropped, running ones killed.

        ProcessPoolExecutor.shutdown() only waits for workers; before
        Python 3.14 (terminate_workers) its process table is the only handle
        on them, hence the private attribute.
        """
        procs = list((getattr(executor, "_processes", None) or {}).values())
        executor.shutdown(wait=False, cancel_futures=True)
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(1.0)

    def close(self) -> None:
        """Terminate the workers, then release what the reference holds."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            executor = self._executor
        self._terminate(executor)
        super().close()


@register("pool")
def _factory(config: MaterializerConfig) -> PoolMaterializer:
    return PoolMaterializer(config)
