"""The decoder's side of the Materialize stream.

`submit` is called on the decode critical path and only enqueues. A dispatcher
thread turns snapshots into StepSnapshot messages and sends them; a receiver
thread reads MaterializedSteps (lagged: step N comes back while later steps
run), delivers them in step order and releases their slots.

Nothing is lost when the materializer fails:
  - a StepError for one step: that step is built in-process from its slot;
  - the stream breaks (materializer died or stalled past the deadline):
    every pending step is built in-process, in order, then new steps are
    built in-process by the dispatcher until a reconnect succeeds.
Without a target the link builds on its own thread from the start: the
in-process background-builder baseline.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator

import grpc

from decoder_svc import metrics
from decoder_svc.snapshot import SnapshotMeta
from omni_common.materialize import build_step
from omni_common.shm_arena import ShmArena
from omni_serving.v1 import materializer_pb2, materializer_pb2_grpc

logger = logging.getLogger(__name__)

Deliver = Callable[[materializer_pb2.MaterializedStep, SnapshotMeta], None]
_STOP = object()


class MaterializerLink:
    def __init__(
        self,
        *,
        target: str | None,
        shm_prefix: str,
        plans: dict[int, materializer_pb2.StagePlan],
        arena: ShmArena | None,
        deliver: Deliver,
        readiness_timeout_ms: int = 5000,
        reconnect_interval_s: float = 1.0,
        stall_timeout_s: float = 10.0,
        name: str = "decoder",
    ) -> None:
        self.target = target
        self.shm_prefix = shm_prefix
        self.plans = plans
        self.arena = arena
        self.deliver = deliver
        self.readiness_timeout_ms = readiness_timeout_ms
        self.reconnect_interval_s = reconnect_interval_s
        self.stall_timeout_s = stall_timeout_s
        self._call: grpc.Future | None = None
        self._stalled = False
        self.name = name
        self._inbox: queue.SimpleQueue[SnapshotMeta | object] = queue.SimpleQueue()
        self._outbox: queue.SimpleQueue[SnapshotMeta | object] = queue.SimpleQueue()
        self._pending: collections.deque[SnapshotMeta] = collections.deque()
        self._lock = threading.Lock()  # guards _remote and _pending
        self._deliver_lock = threading.Lock()  # one delivery at a time, in order
        self._remote = False
        self._stopped = threading.Event()
        self._channel: grpc.Channel | None = None
        self.fallback_steps = 0
        self.fallback_by_reason: collections.Counter[str] = collections.Counter()
        self.remote_steps = 0
        self.in_flight_peak = 0
        self._last_connect_try = 0.0
        self._dispatcher = threading.Thread(target=self._dispatch_loop, name=f"{name}-dispatch", daemon=True)
        self._receiver: threading.Thread | None = None

    # -- lifecycle ------------------------------------------------------------
    def start(self) -> None:
        if self.target:
            self._connect()
        self._dispatcher.start()

    @property
    def connected(self) -> bool:
        with self._lock:
            return self._remote

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._pending)

    def close(self) -> None:
        """Deliver what was submitted, then stop threads and the stream."""
        self._inbox.put(_STOP)
        self._dispatcher.join(timeout=30)
        with self._lock:
            self._stopped.set()
        self._outbox.put(_STOP)
        if self._receiver is not None:
            self._receiver.join(timeout=30)
        if self._channel is not None:
            self._channel.close()

    # -- critical path ---------------------------------------------------------
    def submit(self, meta: SnapshotMeta) -> None:
        """Hand a snapshot over without waiting (a queue put)."""
        self._inbox.put(meta)

    # -- remote stream -----------------------------------------------------------
    def _open_message(self) -> materializer_pb2.MaterializeRequest:
        return materializer_pb2.MaterializeRequest(
            open=materializer_pb2.MaterializeStreamOpen(
                shm_prefix=self.shm_prefix,
                stages=list(self.plans.values()),
                readiness_timeout_ms=self.readiness_timeout_ms,
                client_name=self.name,
            )
        )

    def _requests(self, outbox: queue.SimpleQueue) -> Iterator[materializer_pb2.MaterializeRequest]:
        yield self._open_message()
        while True:
            item = outbox.get()
            if item is _STOP:
                return
            assert isinstance(item, SnapshotMeta)
            yield materializer_pb2.MaterializeRequest(snapshot=item.to_proto())

    def _connect(self) -> bool:
        self._last_connect_try = time.monotonic()
        assert self.target
        try:
            if self._channel is None:
                # Large snapshots with inline tensors can exceed the 4 MiB default.
                self._channel = grpc.insecure_channel(
                    self.target,
                    options=[("grpc.max_receive_message_length", 256 * 2**20), ("grpc.max_send_message_length", 256 * 2**20)],
                )
            grpc.channel_ready_future(self._channel).result(timeout=2.0)
        except grpc.FutureTimeoutError:
            logger.warning("materializer %s not reachable; building in-process", self.target)
            return False
        stub = materializer_pb2_grpc.MaterializerServiceStub(self._channel)
        outbox: queue.SimpleQueue = queue.SimpleQueue()
        responses = stub.Materialize(self._requests(outbox))
        with self._lock:
            self._outbox = outbox
            self._remote = True
            self._call = responses
            self._stalled = False
        self._receiver = threading.Thread(target=self._receive_loop, args=(responses,), name=f"{self.name}-recv", daemon=True)
        self._receiver.start()
        logger.info("materializer stream to %s open", self.target)
        return True

    def _receive_loop(self, responses: Iterator[materializer_pb2.MaterializeResponse]) -> None:
        try:
            for resp in responses:
                with self._lock:
                    meta = self._pending.popleft() if self._pending else None
                kind = resp.WhichOneof("kind")
                got = resp.step.step_id if kind == "step" else resp.error.step_id
                if meta is None or got != meta.step_id:
                    raise RuntimeError(f"materializer answered step {got}, expected {meta and meta.step_id}")
                with self._deliver_lock:
                    if kind == "step":
                        self.remote_steps += 1
                        self._finish(resp.step, meta)
                    else:
                        logger.warning(
                            "materializer failed step %d (code %d: %s); building it in-process",
                            meta.step_id, resp.error.code, resp.error.message,
                        )
                        self._build_local(meta, "step_error")
            reason = "stream_closed"
        except grpc.RpcError as exc:
            reason = "stall" if self._stalled else "stream_broken"
            if not self._stopped.is_set():
                logger.warning("materializer stream broke (%s); building pending steps in-process", exc.code())
        except RuntimeError as exc:
            reason = "protocol_error"
            logger.error("materializer protocol error: %s; building pending steps in-process", exc)
        self._fail_over(reason)

    def _fail_over(self, reason: str) -> None:
        """Switch to in-process building; rebuild every pending step in order."""
        with self._deliver_lock:
            with self._lock:
                self._remote = False
                items = list(self._pending)
                self._pending.clear()
                self._outbox.put(_STOP)
            for meta in items:
                self._build_local(meta, reason)

    # -- dispatch ----------------------------------------------------------------
    def _check_stall(self) -> None:
        """Cancel a stream whose oldest pending step waited past the deadline."""
        with self._lock:
            head = self._pending[0] if self._pending else None
            call = self._call if self._remote else None
        if head is not None and call is not None and time.perf_counter() - head.created_s > self.stall_timeout_s:
            logger.warning("materializer stalled on step %d for %.1fs; failing over", head.step_id, self.stall_timeout_s)
            self._stalled = True
            call.cancel()

    def _dispatch_loop(self) -> None:
        while True:
            try:
                item = self._inbox.get(timeout=0.25)
            except queue.Empty:
                self._check_stall()
                continue
            self._check_stall()
            if item is _STOP:
                self._drain_pending()
                return
            assert isinstance(item, SnapshotMeta)
            if (
                not self.connected
                and self.target
                and time.monotonic() - self._last_connect_try > self.reconnect_interval_s
                and self.in_flight == 0
            ):
                self._connect()
            with self._lock:
                remote = self._remote
                if remote:
                    self._pending.append(item)
                    self.in_flight_peak = max(self.in_flight_peak, len(self._pending))
                    self._outbox.put(item)
            if not remote:
                with self._deliver_lock:
                    self._build_local(item, "unreachable")

    def _drain_pending(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.in_flight and self.connected and time.monotonic() < deadline:
            time.sleep(0.005)
        if self.in_flight:
            self._fail_over("shutdown")

    # -- building and delivery (under _deliver_lock) ------------------------------
    def _build_local(self, meta: SnapshotMeta, reason: str) -> None:
        if self.target:  # without a target, in-process building is the mode, not a fallback
            self.fallback_steps += 1
            self.fallback_by_reason[reason] += 1
            metrics.FALLBACK_STEPS.labels(reason).inc()
        built = build_step(meta.local_view(self.arena), self.plans[meta.stage_id])
        self._finish(built, meta)

    def _finish(self, step: materializer_pb2.MaterializedStep, meta: SnapshotMeta) -> None:
        try:
            self.deliver(step, meta)
        finally:
            if meta.lease is not None and self.arena is not None:
                self.arena.release(meta.lease.slot, meta.lease.generation)
                meta.lease = None
