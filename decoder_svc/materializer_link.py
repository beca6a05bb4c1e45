"""The decoder's side of the Materialize stream.

`submit` is called on the decode critical path and only enqueues. Three kinds
of threads do the rest:

- the dispatcher turns snapshots into StepSnapshot messages and sends them
  on the stream, or, while there is no stream, builds them in-process at
  once. It never waits on the materializer and never connects;
- a receiver per stream reads MaterializedSteps (lagged: step N comes back
  while later steps run), delivers them in step order and releases their
  slots;
- the connector (only with a target) opens streams and watches them: while
  there is no stream it polls the materializer's health with a short
  timeout and opens a stream once it is SERVING (also while the decoder is
  idle); while there is one it cancels it when the materializer stops
  answering (`stall_timeout_s` without an answer while steps wait: stall)
  or cannot keep up (slow: the oldest waiting step is older than that, more
  than `max_pending` steps wait, or decode steps spent more than half of the
  last `stall_timeout_s` waiting for arena slots it holds). After a broken
  stream (the materializer died) it polls every `reconnect_interval_s`;
  after a stream that stalled, fell behind or never answered, it waits
  `reconnect_interval_s * 2**n` first (n such failures in a row, at most
  30 s), so a materializer that keeps failing is not retried on every poll.

Delivery is in step order on every path. A step that no slot was free for
(`submit(meta, build_local=True)`) is built in-process, but only once the
steps before it were delivered. Nothing is lost when the materializer fails:

- a StepError for one step: that step is built in-process from its slot;
- the stream breaks, stalls or lags: the link switches to in-process
  building (one log line, one metric), every pending step is built
  in-process, in order, and so is every later step until the connector has
  a new stream. Steps built in-process are never sent again; the switch
  back happens between two steps.

An exception while building or delivering a step fails that step's requests
(`fail_step`) and frees its slot; the threads keep serving. Without a target
the link builds on its own thread from the start: the in-process
background-builder baseline.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from decoder_svc import metrics
from decoder_svc.snapshot import SnapshotMeta
from omni_common.materialize import build_step
from omni_common.server import client_options
from omni_common.shm_arena import ShmArena
from omni_serving.v1 import materializer_pb2, materializer_pb2_grpc

logger = logging.getLogger(__name__)

Deliver = Callable[[materializer_pb2.MaterializedStep, SnapshotMeta], None]
FailStep = Callable[[SnapshotMeta, BaseException], None]
_STOP = object()

# Large snapshots with inline tensors can exceed gRPC's 4 MiB default. A
# restarted materializer must be dialled again quickly: gRPC's own reconnect
# backoff (1 s growing to 120 s) would otherwise delay the switch back.
_CHANNEL_OPTIONS = [
    *client_options(256 * 2**20),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
]
# A stream that failed without answering, stalled or lagged is retried after
# reconnect_interval_s * 2**strikes, at most this long.
_MAX_BACKOFF_S = 30.0
# A stream that ran this long before failing counts as healthy again.
_HEALTHY_STREAM_S = 30.0


class _ProtocolError(Exception):
    """The materializer answered a step that is not the next one."""


@dataclass
class _Stream:
    """One Materialize call and what the link knows about it."""

    call: grpc.Future
    outbox: queue.SimpleQueue
    opened_s: float
    answers: int = 0
    cancel_reason: str | None = None
    cancel_detail: str = ""
    receiver: threading.Thread | None = None


class MaterializerLink:
    def __init__(
        self,
        *,
        target: str | None,
        shm_prefix: str,
        plans: dict[int, materializer_pb2.StagePlan],
        arena: ShmArena | None,
        deliver: Deliver,
        fail_step: FailStep | None = None,
        readiness_timeout_ms: int = 5000,
        reconnect_interval_s: float = 0.25,
        probe_timeout_s: float = 0.5,
        stall_timeout_s: float = 3.0,
        max_pending: int | None = None,
        drain_timeout_s: float = 2.0,
        name: str = "decoder",
    ) -> None:
        self.target = target
        self.shm_prefix = shm_prefix
        self.plans = plans
        self.arena = arena
        self.deliver = deliver
        self.fail_step = fail_step
        self.readiness_timeout_ms = readiness_timeout_ms
        self.reconnect_interval_s = reconnect_interval_s
        self.probe_timeout_s = probe_timeout_s
        self.stall_timeout_s = stall_timeout_s
        slots = arena.num_slots if arena is not None else 16
        self.max_pending = max_pending if max_pending is not None else max(64, 4 * slots)
        self.drain_timeout_s = drain_timeout_s
        self.name = name
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        # (meta, None) for a step sent and waiting for its answer, (meta, reason)
        # for one to build in-process once the steps before it were delivered.
        self._pending: collections.deque[tuple[SnapshotMeta, str | None]] = collections.deque()
        self._lock = threading.Lock()  # guards _stream, _pending, _last_progress, _local_reason
        # One delivery at a time, in order. Re-entrant: a failover delivers
        # the pending steps while holding it.
        self._deliver_lock = threading.RLock()
        self._stream: _Stream | None = None
        self._last_progress = time.monotonic()
        self._local_reason = "unreachable"
        self._local_since = time.monotonic()
        self._closing = threading.Event()
        self._wake = threading.Event()  # pokes the connector
        self._channel: grpc.Channel | None = None
        self._channel_stale = False
        self._strikes = 0
        self._next_try = 0.0
        self._slot_wait_s = 0.0  # decode time spent waiting for slots, this window
        self._window_start = time.monotonic()
        self.fallback_steps = 0
        self.fallback_by_reason: collections.Counter[str] = collections.Counter()
        self.switches: collections.Counter[tuple[str, str]] = collections.Counter()
        self.remote_steps = 0
        self.failed_steps = 0
        self.in_flight_peak = 0
        self._dispatcher = threading.Thread(
            target=self._guarded, args=("dispatcher", self._dispatch_loop),
            name=f"{name}-dispatch", daemon=True,
        )
        self._connector = (
            threading.Thread(
                target=self._guarded, args=("connector", self._connect_loop),
                name=f"{name}-connect", daemon=True,
            )
            if target
            else None
        )

    # -- lifecycle ------------------------------------------------------------
    def start(self) -> None:
        """Start the threads. With a target, one bounded attempt to open the
        stream is made here (startup, not the decode path); the connector
        keeps trying in the background if it fails."""
        metrics.set_mode(False)
        if self.target:
            try:
                connected = self._try_connect(startup=True)
            except Exception:  # noqa: BLE001 -- the connector keeps trying
                logger.exception("materializer %s: opening the stream failed", self.target)
                connected = False
            if not connected:
                self._switch("to_in_process", "unreachable", rebuilt=0)
        self._dispatcher.start()
        if self._connector is not None:
            self._connector.start()

    @property
    def connected(self) -> bool:
        with self._lock:
            return self._stream is not None

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._pending)

    def close(self) -> None:
        """Deliver what was submitted, then stop threads and the stream.

        Bounded: steps still unanswered after `drain_timeout_s` are built
        in-process; a dead or stopped materializer costs no wait."""
        self._closing.set()
        self._wake.set()
        if self._connector is not None and self._connector.is_alive():
            self._connector.join(timeout=self.probe_timeout_s + 2.0)
        self._inbox.put(_STOP)
        self._dispatcher.join(timeout=self.drain_timeout_s + 10.0)
        with self._lock:
            stream = self._stream
        if stream is not None:
            stream.cancel_reason = "shutdown"
            stream.outbox.put(_STOP)  # half-close: the materializer ends the stream
            if stream.receiver is not None:
                stream.receiver.join(timeout=1.0)
                if stream.receiver.is_alive():
                    stream.call.cancel()
                    stream.receiver.join(timeout=5.0)
            with self._lock:
                still_open = self._stream is stream
            if still_open:  # the receiver is stuck: take its steps over
                self._fail_over(stream, "shutdown")
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    # -- critical path ---------------------------------------------------------
    def submit(self, meta: SnapshotMeta, build_local: bool = False) -> None:
        """Hand a snapshot over without waiting (a queue put).

        build_local: no arena slot was free for this step (its tensors are
        detached copies); it is built in-process, after the steps before it."""
        self._inbox.put((meta, "no_slot" if build_local else None))

    def note_slot_wait(self, seconds: float) -> None:
        """A decode step waited this long for an arena slot (all held by steps
        the materializer has not answered)."""
        self._slot_wait_s += seconds

    # -- threads -------------------------------------------------------------------
    def _guarded(self, where: str, loop: Callable[[], None]) -> None:
        """Run a thread's loop; an exception that escapes it restarts it."""
        while True:
            try:
                loop()
                return
            except Exception:  # noqa: BLE001 -- the thread must outlive any bug in one iteration
                metrics.INTERNAL_ERRORS.labels(f"link_{where}").inc()
                logger.exception("materializer link %s failed; restarting it", where)
                if self._closing.is_set() and where == "connector":
                    return
                time.sleep(0.05)

    # -- dispatch ----------------------------------------------------------------
    def _dispatch_loop(self) -> None:
        while True:
            item = self._inbox.get()
            if item is _STOP:
                try:
                    self._drain_on_close()
                except Exception:  # noqa: BLE001 -- close() takes the rest over
                    logger.exception("materializer link: draining at shutdown failed")
                return
            meta, local = item
            try:
                self._dispatch(meta, local)
            except Exception as exc:  # noqa: BLE001 -- fail this step, keep serving
                self._fail(meta, exc, "link_dispatcher")

    def _dispatch(self, meta: SnapshotMeta, local: str | None) -> None:
        """Send a step, queue it behind the pending ones, or build it now.

        local: why this step must be built in-process (None: send it when
        there is a stream)."""
        request = None
        if local is None:
            with self._lock:
                remote = self._stream is not None
            if remote:
                try:
                    request = materializer_pb2.MaterializeRequest(snapshot=meta.to_proto())
                except Exception:  # noqa: BLE001 -- a step that cannot be encoded is built here
                    metrics.INTERNAL_ERRORS.labels("link_encode").inc()
                    logger.exception("step %d could not be encoded; building it in-process",
                                     meta.step_id)
                    local = "encode_error"
        if request is not None:  # the usual case: send it (ordering is the receiver's)
            with self._lock:
                stream = self._stream
                if stream is not None:
                    if not self._pending:
                        self._last_progress = time.monotonic()
                    self._pending.append((meta, None))
                    self.in_flight_peak = max(self.in_flight_peak, len(self._pending))
                    stream.outbox.put(request)
                    return
        with self._deliver_lock:
            with self._lock:
                stream = self._stream
                if stream is not None and (request is not None or (local and self._pending)):
                    if not self._pending:
                        self._last_progress = time.monotonic()
                    self._pending.append((meta, local))
                    self.in_flight_peak = max(self.in_flight_peak, len(self._pending))
                    if request is not None:
                        stream.outbox.put(request)
                    return
                reason = local if local and stream is not None else self._local_reason
            # No stream (or a local step with nothing before it): build now.
            # The deliver lock is held from the check on, so a receiver cannot
            # deliver an earlier step after this one.
            self._build_local(meta, reason)

    def _drain_on_close(self) -> None:
        deadline = time.monotonic() + self.drain_timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if not self._pending or self._stream is None:
                    return
            time.sleep(0.005)
        with self._lock:
            stream = self._stream
        if stream is not None:
            logger.warning("materializer %s: %d steps unanswered at shutdown; building them "
                           "in-process", self.target, self.in_flight)
            self._fail_over(stream, "shutdown")

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

    def _requests(self, outbox: queue.SimpleQueue):
        yield self._open_message()
        while True:
            item = outbox.get()
            if item is _STOP:
                return
            yield item

    def _healthy(self, channel: grpc.Channel, startup: bool) -> bool:
        """One health check with a short timeout. In the background it fails
        fast while the channel cannot connect; at startup it waits up to 2 s
        for the first connection."""
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""),
                timeout=max(self.probe_timeout_s, 2.0) if startup else self.probe_timeout_s,
                wait_for_ready=startup,
            )
        except grpc.RpcError as exc:
            # A materializer without the health service: the connection is up.
            return exc.code() == grpc.StatusCode.UNIMPLEMENTED
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    def _try_connect(self, startup: bool = False) -> bool:
        """Probe the materializer; when it is SERVING open a stream and switch
        to it. Runs on the connector thread (and once in `start`)."""
        assert self.target
        if self._channel is not None and self._channel_stale:
            self._channel.close()
            self._channel = None
        if self._channel is None:
            self._channel = grpc.insecure_channel(self.target, options=_CHANNEL_OPTIONS)
            self._channel_stale = False
        if not self._healthy(self._channel, startup):
            return False
        stub = materializer_pb2_grpc.MaterializerServiceStub(self._channel)
        outbox: queue.SimpleQueue = queue.SimpleQueue()
        call = stub.Materialize(self._requests(outbox))
        stream = _Stream(call=call, outbox=outbox, opened_s=time.monotonic())
        stream.receiver = threading.Thread(
            target=self._receive_loop, args=(stream,), name=f"{self.name}-recv", daemon=True
        )
        with self._deliver_lock:  # between two deliveries: the switch is at a step boundary
            with self._lock:
                if self._closing.is_set():
                    call.cancel()
                    return False
                self._stream = stream
                self._last_progress = time.monotonic()
                self._window_start = time.monotonic()
                self._slot_wait_s = 0.0
                was_local_s = time.monotonic() - self._local_since
            self._switch("to_remote", "connected", in_process_s=was_local_s)
        stream.receiver.start()
        return True

    def _receive_loop(self, stream: _Stream) -> None:
        reason = "stream_closed"
        try:
            for resp in stream.call:
                self._on_response(stream, resp)
            reason = stream.cancel_reason or reason
        except grpc.RpcError as exc:
            reason = stream.cancel_reason or "stream_broken"
            if stream.cancel_reason is None:
                logger.debug("materializer stream ended: %s", exc.code())
        except _ProtocolError as exc:
            reason = "protocol_error"
            logger.error("materializer %s: protocol error: %s", self.target, exc)
        except Exception:  # noqa: BLE001 -- a receiver bug must not lose steps: fail over
            reason = "internal_error"
            metrics.INTERNAL_ERRORS.labels("link_receiver").inc()
            logger.exception("materializer %s: receiver failed", self.target)
        self._fail_over(stream, reason)

    def _on_response(self, stream: _Stream, resp: materializer_pb2.MaterializeResponse) -> None:
        kind = resp.WhichOneof("kind")
        got = resp.step.step_id if kind == "step" else resp.error.step_id
        with self._deliver_lock:
            self._deliver_local_heads()
            with self._lock:
                if self._stream is not stream:
                    return  # failed over meanwhile: its steps were built in-process
                meta = self._pending.popleft()[0] if self._pending else None
                if meta is None or got != meta.step_id:
                    if meta is not None:
                        self._pending.appendleft((meta, None))
                    raise _ProtocolError(
                        f"answered step {got}, expected {meta.step_id if meta else 'none'}")
                self._last_progress = time.monotonic()
                stream.answers += 1
            if kind == "step":
                self.remote_steps += 1
                self._finish(resp.step, meta)
            else:
                logger.warning(
                    "materializer failed step %d (code %d: %s); building it in-process",
                    meta.step_id, resp.error.code, resp.error.message,
                )
                self._build_local(meta, "step_error")
            self._deliver_local_heads()

    def _deliver_local_heads(self) -> None:
        """Build the in-process steps now at the head of the queue (their turn came)."""
        with self._deliver_lock:
            while True:
                with self._lock:
                    if not (self._pending and self._pending[0][1]):
                        return
                    meta, reason = self._pending.popleft()
                    if not self._pending:
                        self._last_progress = time.monotonic()
                self._build_local(meta, reason or "no_slot")

    def _fail_over(self, stream: _Stream, reason: str) -> None:
        """Switch to in-process building; build every pending step, in order."""
        with self._deliver_lock:
            with self._lock:
                if self._stream is not stream:
                    return
                self._stream = None
                items = list(self._pending)
                self._pending.clear()
                self._local_reason = reason
                self._local_since = time.monotonic()
                self._channel_stale = True
            stream.outbox.put(_STOP)
            if reason == "shutdown" and not items:
                metrics.set_mode(False)
            else:
                self._switch("to_in_process", reason, rebuilt=len(items),
                             detail=stream.cancel_detail)
            for meta, local in items:
                self._build_local(meta, local or reason)
        lived = time.monotonic() - stream.opened_s
        bad = reason in ("stall", "slow", "protocol_error") or stream.answers == 0
        self._strikes = self._strikes + 1 if bad and lived < _HEALTHY_STREAM_S else 0
        delay = self.reconnect_interval_s * 2**self._strikes if self._strikes else 0.0
        self._next_try = time.monotonic() + min(_MAX_BACKOFF_S, delay)
        if stream.call is not None and reason != "stream_closed":
            stream.call.cancel()
        self._wake.set()

    # -- connector ------------------------------------------------------------------
    def _connect_loop(self) -> None:
        while not self._closing.is_set():
            with self._lock:
                stream = self._stream
            if stream is not None:
                self._watch(stream)
                self._wait(0.05)
                continue
            now = time.monotonic()
            if now < self._next_try:
                self._wait(min(self._next_try - now, self.reconnect_interval_s))
                continue
            if not self._try_connect():
                self._wait(self.reconnect_interval_s)

    def _wait(self, seconds: float) -> None:
        self._wake.wait(seconds)
        self._wake.clear()

    def _watch(self, stream: _Stream) -> None:
        """Cancel a stream whose materializer stopped answering (stall) or
        falls behind (slow): no answer for stall_timeout_s while steps wait,
        the oldest waiting step older than that, or more than max_pending
        steps waiting."""
        now = time.monotonic()
        window = now - self._window_start
        blocked = 0.0
        if window >= self.stall_timeout_s:
            blocked = self._slot_wait_s / window
            self._slot_wait_s = 0.0
            self._window_start = now
        with self._lock:
            if self._stream is not stream:
                return
            if not self._pending:
                if blocked <= 0.5:
                    return
                head, pending, since_answer = None, 0, 0.0
            else:
                since_answer = now - self._last_progress
                head = self._pending[0][0]
                pending = len(self._pending)
        head_age = time.perf_counter() - head.created_s if head is not None else 0.0
        if since_answer >= self.stall_timeout_s:  # nothing came back for the whole deadline
            reason = "stall"
        elif pending > self.max_pending:
            # stalled if nothing came back for a second (or ever), else slow
            reason = "stall" if since_answer >= 1.0 or not stream.answers else "slow"
        elif head_age > self.stall_timeout_s or blocked > 0.5:
            reason = "slow"
        else:
            return
        stream.cancel_detail = (f"decode waited for slots {blocked:.0%} of the last "
                                f"{self.stall_timeout_s:g}s, " if blocked > 0.5 else "")
        stream.cancel_detail += (f"oldest step waiting {head_age:.1f}s, no answer for "
                                 f"{since_answer:.1f}s, {pending} steps waiting")
        stream.cancel_reason = reason
        stream.call.cancel()

    # -- building and delivery (under _deliver_lock) ------------------------------
    def _switch(self, direction: str, reason: str, rebuilt: int = 0,
                in_process_s: float = 0.0, detail: str = "") -> None:
        first = not self.switches
        self.switches[(direction, reason)] += 1
        metrics.MATERIALIZER_SWITCHES.labels(direction, reason).inc()
        metrics.set_mode(direction == "to_remote")
        if direction == "to_remote" and first:
            logger.info("materializer %s: stream open", self.target)
        elif direction == "to_remote":
            logger.warning(
                "materializer %s: stream open; building on the materializer again "
                "(after %.1fs in-process)", self.target, in_process_s,
            )
        else:
            logger.warning(
                "materializer %s: %s%s; building in-process (%d pending steps rebuilt), "
                "reconnecting in the background", self.target, reason,
                f" ({detail})" if detail else "", rebuilt,
            )

    def _build_local(self, meta: SnapshotMeta, reason: str) -> None:
        with self._deliver_lock:
            if self.target:  # without a target, in-process building is the mode, not a fallback
                self.fallback_steps += 1
                self.fallback_by_reason[reason] += 1
                metrics.FALLBACK_STEPS.labels(reason).inc()
            try:
                built = build_step(meta.local_view(self.arena), self.plans[meta.stage_id])
            except Exception as exc:  # noqa: BLE001 -- fail this step's requests, keep serving
                self._fail(meta, exc, "link_build")
                return
            self._finish(built, meta)

    def _finish(self, step: materializer_pb2.MaterializedStep, meta: SnapshotMeta) -> None:
        try:
            self.deliver(step, meta)
        except Exception as exc:  # noqa: BLE001 -- fail this step's requests, keep serving
            self._fail(meta, exc, "link_deliver")
        finally:
            self._release(meta)

    def _release(self, meta: SnapshotMeta) -> None:
        lease = meta.lease
        if lease is not None and self.arena is not None:
            meta.lease = None
            self.arena.release(lease.slot, lease.generation)

    def _fail(self, meta: SnapshotMeta, exc: BaseException, where: str) -> None:
        """A step could not be built or delivered: fail its requests, free its slot."""
        self.failed_steps += 1
        metrics.INTERNAL_ERRORS.labels(where).inc()
        logger.error("step %d of stage %d failed (%s); failing its %d request(s)",
                     meta.step_id, meta.stage_id, where, len(meta.request_ids), exc_info=exc)
        try:
            if self.fail_step is not None:
                self.fail_step(meta, exc)
        except Exception:  # noqa: BLE001 -- the slot is freed below whatever happens
            logger.exception("failing the requests of step %d failed", meta.step_id)
        finally:
            self._release(meta)
