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

Attaching. Before each stream it opens, the connector asks
GetMaterializerInfo, with `arena_probe` set to the arena's name, and logs
the instance it found (`Attachment`, also in GetDecoderInfo and the
`omni_decoder_materializer_info` gauge). A materializer of another contract
is refused (ERROR, retried with the backoff above); one without
GetMaterializerInfo is contract version 1 with arena handles. The stream
speaks the lower of the two contract versions and carries arena handles
when the probe came back MAPPED, else inline bytes (copied out of the slot
by the dispatcher, see `SnapshotMeta.to_proto`; the slot stays held until
the step is answered, as with handles). `inline_transport` forces inline.

Handover. A materializer that stops sends StreamDraining (contract 2). The
link stops sending on that stream at once and half-closes it; its receiver
keeps reading it until it ends. Later steps wait, unsent and in order,
while the connector opens a new stream (to the message's successor, else
the same target) on a fresh connection, every 50 ms, skipping an instance
that is draining or is the one that said it drains. They are then sent
there; answers of both streams are delivered in global step order. No step
is built in-process in a normal handover. If no replacement is attached
within `stall_timeout_s`, or the stall rules fire meanwhile, the link fails
over as below (`no_replacement`). An old stream that ends with steps
unanswered (its grace period passed, it died) has just those steps built
in-process.

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

A step built in-process (`build_local_step`) is delivered as a `LocalStep`:
its payloads are tensors viewing the slot (or the detached copies), never
serialised; the slot is released once the delivery returns. A step the
materializer answered is delivered as its `MaterializedStep`.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from decoder_svc import metrics
from decoder_svc.snapshot import SnapshotMeta
from omni_common.materialize import LocalStep, build_local_step
from omni_common.server import client_options
from omni_common.shm_arena import ShmArena
from omni_serving.v1 import decoder_pb2, materializer_pb2, materializer_pb2_grpc

logger = logging.getLogger(__name__)

Deliver = Callable[[materializer_pb2.MaterializedStep | LocalStep, SnapshotMeta], None]
"""Routes a step: as the materializer answered it, or built in-process (tensors)."""
FailStep = Callable[[SnapshotMeta, BaseException], None]
_STOP = object()
_FLUSH = object()  # a stream was attached: send the steps that waited for it

CONTRACT = "omni_serving.v1"
# Highest contract version this decoder speaks (2: StreamDraining, identity, arena probe).
CONTRACT_VERSION = 2

# Large snapshots with inline tensors can exceed gRPC's 4 MiB default. A
# restarted materializer must be dialled again quickly: gRPC's own reconnect
# backoff (1 s growing to 120 s) would otherwise delay the switch back. Each
# channel has its own connection (no shared subchannel): after a handover on
# the same address, a new channel must reach the new process, not reuse the
# connection to the one that is draining.
_CHANNEL_OPTIONS = [
    *client_options(256 * 2**20),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
    ("grpc.use_local_subchannel_pool", 1),
]
# A stream that failed without answering, stalled or lagged is retried after
# reconnect_interval_s * 2**strikes, at most this long.
_MAX_BACKOFF_S = 30.0
# A stream that ran this long before failing counts as healthy again.
_HEALTHY_STREAM_S = 30.0
# While a replacement is awaited after StreamDraining, how often to try.
_HANDOVER_RETRY_S = 0.05

_MAPPED = materializer_pb2.ARENA_PROBE_RESULT_MAPPED
_UNSPECIFIED = materializer_pb2.ARENA_PROBE_RESULT_UNSPECIFIED


class _ProtocolError(Exception):
    """The materializer answered a step that is not the next one."""


class _Refused(Exception):
    """The materializer cannot be used by this decoder (contract, transport)."""


@dataclass(frozen=True)
class Attachment:
    """The materializer instance a stream is attached to, as it reported itself."""

    target: str
    instance_id: str  # empty: a contract-1 materializer without GetMaterializerInfo
    implementation: str
    version: str
    contract_version: int  # spoken on the stream: the lower of both sides'
    start_time_unix_ms: int
    transport: str  # "shm" (arena handles) or "inline"

    def to_proto(self) -> decoder_pb2.MaterializerAttachment:
        return decoder_pb2.MaterializerAttachment(
            instance_id=self.instance_id,
            implementation=self.implementation,
            version=self.version,
            contract_version=self.contract_version,
            start_time_unix_ms=self.start_time_unix_ms,
            transport=self.transport,
        )

    def describe(self) -> str:
        who = self.instance_id or "(no GetMaterializerInfo)"
        what = f"{self.implementation} {self.version}".strip() or "unknown implementation"
        return (
            f"instance {who} ({what}, contract version {self.contract_version}, "
            f"transport {self.transport})"
        )


@dataclass(eq=False)
class _Stream:
    """One Materialize call and what the link knows about it."""

    call: Any  # grpc stream-stream call: iterator of responses, cancel()
    outbox: queue.SimpleQueue
    opened_s: float
    channel: grpc.Channel | None = None
    attachment: Attachment | None = None
    sent: collections.deque[_Entry] = field(default_factory=collections.deque)
    answers: int = 0
    draining: bool = False  # the materializer sent StreamDraining; half-closed
    abandoned: bool = False  # its unanswered steps were taken over (in-process)
    cancel_reason: str | None = None
    cancel_detail: str = ""
    receiver: threading.Thread | None = None


@dataclass(eq=False)
class _Entry:
    """A submitted step, from submit until its delivery."""

    meta: SnapshotMeta
    local: str | None = None  # build in-process for this reason when its turn comes
    stream: _Stream | None = None  # the stream it was sent on (None: not sent)
    answer: materializer_pb2.MaterializeResponse | None = None


@dataclass(frozen=True, eq=False)
class _Handover:
    """Waiting for a replacement after a StreamDraining."""

    since: float
    old_instance: str
    target: str
    reason: str


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
        inline_transport: bool = False,
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
        self.inline_transport = inline_transport
        self.name = name
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        # Every step submitted and not yet delivered, in step order: sent and
        # waiting for its answer, answered behind an unanswered one, to be
        # built in-process once its turn comes, or waiting for a stream.
        self._pending: collections.deque[_Entry] = collections.deque()
        # The tail of _pending not sent yet (a handover is under way).
        self._unsent: collections.deque[_Entry] = collections.deque()
        # guards _stream, _old, _handover, _pending, _unsent, _last_progress,
        # _local_reason, attachment, and the streams' `sent`
        self._lock = threading.Lock()
        # One delivery at a time, in order. Re-entrant: a failover delivers
        # the pending steps while holding it.
        self._deliver_lock = threading.RLock()
        self._stream: _Stream | None = None  # where new steps go
        self._old: list[_Stream] = []  # drained streams still answering
        self._handover: _Handover | None = None
        self._dial_target = target
        self._last_progress = time.monotonic()
        self._local_reason = "unreachable"
        self._local_since = time.monotonic()
        self._closing = threading.Event()
        self._wake = threading.Event()  # pokes the connector
        self._probe_channel: grpc.Channel | None = None  # the connector's, until a stream owns it
        self._last_failure = "unreachable"
        self._strikes = 0
        self._next_try = 0.0
        self._slot_wait_s = 0.0  # decode time spent waiting for slots, this window
        self._window_start = time.monotonic()
        self.attachment: Attachment | None = None
        self.handovers = 0
        self.fallback_steps = 0
        self.fallback_by_reason: collections.Counter[str] = collections.Counter()
        self.switches: collections.Counter[tuple[str, str]] = collections.Counter()
        self.remote_steps = 0
        self.failed_steps = 0
        self.in_flight_peak = 0
        self._dispatcher = threading.Thread(
            target=self._guarded,
            args=("dispatcher", self._dispatch_loop),
            name=f"{name}-dispatch",
            daemon=True,
        )
        self._connector = (
            threading.Thread(
                target=self._guarded,
                args=("connector", self._connect_loop),
                name=f"{name}-connect",
                daemon=True,
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
                self._local_reason = self._last_failure
                self._switch("to_in_process", self._last_failure, rebuilt=0)
        self._dispatcher.start()
        if self._connector is not None:
            self._connector.start()

    @property
    def connected(self) -> bool:
        """A stream is up, or a handover to a replacement is under way."""
        with self._lock:
            return self._stream is not None or self._handover is not None

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._pending)

    def close(self) -> None:
        """Deliver what was submitted, then stop threads and the streams.

        Bounded: steps still unanswered after `drain_timeout_s` are built
        in-process; a dead or stopped materializer costs no wait."""
        self._closing.set()
        self._wake.set()
        if self._connector is not None and self._connector.is_alive():
            self._connector.join(timeout=self.probe_timeout_s + 2.0)
        self._inbox.put(_STOP)
        self._dispatcher.join(timeout=self.drain_timeout_s + 10.0)
        with self._lock:
            streams = [s for s in (self._stream, *self._old) if s is not None]
        for stream in streams:
            stream.cancel_reason = stream.cancel_reason or "shutdown"
            stream.outbox.put(_STOP)  # half-close: the materializer ends the stream
        for stream in streams:
            if stream.receiver is not None and stream.receiver.ident is not None:
                stream.receiver.join(timeout=1.0)
                if stream.receiver.is_alive():
                    stream.call.cancel()
                    stream.receiver.join(timeout=5.0)
        with self._lock:
            stuck = self._stream is not None or bool(self._old) or bool(self._pending)
        if stuck:  # a receiver is stuck: take its steps over
            self._fail_over_all("shutdown")
        for stream in streams:
            if stream.channel is not None:
                stream.channel.close()
        if self._probe_channel is not None:
            self._probe_channel.close()
            self._probe_channel = None

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
            if item is _FLUSH:
                self._flush_unsent()
                continue
            meta, local = item
            try:
                self._dispatch(meta, local)
            except Exception as exc:  # noqa: BLE001 -- fail this step, keep serving
                self._fail(meta, exc, "link_dispatcher")

    def _encode(self, meta: SnapshotMeta, stream: _Stream) -> materializer_pb2.MaterializeRequest:
        inline = stream.attachment is not None and stream.attachment.transport == "inline"
        snap = meta.to_proto(inline_from=self.arena) if inline and meta.handles else meta.to_proto()
        return materializer_pb2.MaterializeRequest(snapshot=snap)

    def _encode_failed(self, meta: SnapshotMeta) -> None:
        metrics.INTERNAL_ERRORS.labels("link_encode").inc()
        logger.exception("step %d could not be encoded; building it in-process", meta.step_id)

    def _append(self, entry: _Entry) -> None:
        """Queue a step behind the pending ones (under _lock)."""
        if not self._pending:
            self._last_progress = time.monotonic()
        self._pending.append(entry)
        self.in_flight_peak = max(self.in_flight_peak, len(self._pending))

    def _send(self, entry: _Entry) -> bool:
        """Send a step on the current stream, after the steps that waited for
        it; False when there is no stream (or the step cannot be encoded:
        then entry.local says so)."""
        self._flush_unsent()
        while True:
            with self._lock:
                stream = self._stream
            if stream is None:
                return False
            try:
                request = self._encode(entry.meta, stream)
            except Exception:  # noqa: BLE001 -- a step that cannot be encoded is built here
                self._encode_failed(entry.meta)
                entry.local = "encode_error"
                return False
            with self._lock:
                if self._stream is stream and not self._unsent:
                    self._append(entry)
                    entry.stream = stream
                    stream.sent.append(entry)
                    stream.outbox.put(request)
                    return True
            self._flush_unsent()  # the stream changed meanwhile: try again

    def _flush_unsent(self) -> None:
        """Send the steps that waited for a stream, in order (dispatcher only)."""
        failed = False
        while True:
            with self._lock:
                stream = self._stream
                if stream is None or not self._unsent:
                    break
                entry = self._unsent[0]
            try:
                request: materializer_pb2.MaterializeRequest | None = self._encode(
                    entry.meta, stream
                )
            except Exception:  # noqa: BLE001 -- built in-process when its turn comes
                self._encode_failed(entry.meta)
                request = None
            with self._lock:
                if not self._unsent or self._unsent[0] is not entry:
                    continue  # taken over meanwhile (failover)
                if request is None:
                    self._unsent.popleft()
                    entry.local = "encode_error"
                    failed = True
                    continue
                if self._stream is not stream:
                    continue
                self._unsent.popleft()
                entry.stream = stream
                stream.sent.append(entry)
                stream.outbox.put(request)
        if failed:
            self._deliver_heads()

    def _dispatch(self, meta: SnapshotMeta, local: str | None) -> None:
        """Send a step, queue it behind the pending ones, or build it now.

        local: why this step must be built in-process (None: send it when
        there is a stream)."""
        entry = _Entry(meta, local)
        while True:
            if entry.local is None and self._send(entry):  # the usual case
                return
            with self._deliver_lock:
                with self._lock:
                    if entry.local is None and self._stream is not None:
                        retry = True  # a stream was attached meanwhile
                    elif entry.local is None and self._handover is not None:
                        # waiting for a replacement: the step waits, unsent
                        self._append(entry)
                        self._unsent.append(entry)
                        return
                    elif entry.local is not None and self._pending:
                        self._append(entry)  # built when its turn comes
                        return
                    else:
                        retry = False
                        reason = entry.local or self._local_reason
                if not retry:
                    # No stream (or a local step with nothing before it): build
                    # now. The deliver lock is held from the check on, so a
                    # receiver cannot deliver an earlier step after this one.
                    self._build_local(meta, reason)
                    return

    def _drain_on_close(self) -> None:
        deadline = time.monotonic() + self.drain_timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if not self._pending:
                    return
                head = self._pending[0]
                if head.stream is None and head.answer is None and head.local is None:
                    break  # it waits for a replacement that will not come now
            time.sleep(0.005)
        with self._lock:
            left = len(self._pending)
        if left:
            logger.warning(
                "materializer %s: %d steps unanswered at shutdown; building them in-process",
                self.target,
                left,
            )
            self._fail_over_all("shutdown")

    # -- remote stream -----------------------------------------------------------
    def _open_message(self, attachment: Attachment) -> materializer_pb2.MaterializeRequest:
        return materializer_pb2.MaterializeRequest(
            open=materializer_pb2.MaterializeStreamOpen(
                # a stream of inline tensors reads no arena: no deployment prefix to check
                shm_prefix=self.shm_prefix if attachment.transport == "shm" else "",
                stages=list(self.plans.values()),
                readiness_timeout_ms=self.readiness_timeout_ms,
                client_name=self.name,
                contract_version=attachment.contract_version,
            )
        )

    def _requests(self, first: materializer_pb2.MaterializeRequest, outbox: queue.SimpleQueue):
        yield first
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

    def _transport(self, info: materializer_pb2.GetMaterializerInfoResponse) -> str:
        """How tensors travel to this materializer; _Refused if they cannot."""
        if self.inline_transport or self.arena is None:
            if not info.supports_inline:
                raise _Refused(
                    "it does not read inline tensors, and this decoder sends inline "
                    "tensors only (--inline-transport)"
                )
            return "inline"
        probe = info.arena_probe
        # UNSPECIFIED: an implementation that does not probe (contract 1): handles, as before
        if info.supports_shm and probe in (_MAPPED, _UNSPECIFIED):
            return "shm"
        if info.supports_inline:
            return "inline"
        outcome = materializer_pb2.ArenaProbeResult.Name(probe)
        raise _Refused(
            f"it cannot read this decoder's arena {self.arena.name!r} ({outcome}, "
            f"supports_shm={info.supports_shm}) and does not read inline tensors"
        )

    def _identify(
        self, channel: grpc.Channel, target: str, startup: bool, handover: _Handover | None
    ) -> Attachment | None:
        """Ask the materializer who it is (and whether it maps our arena).
        None: not usable now (try again soon); _Refused: not usable at all."""
        probe = self.arena.name if self.arena is not None and not self.inline_transport else ""
        try:
            info = materializer_pb2_grpc.MaterializerServiceStub(channel).GetMaterializerInfo(
                materializer_pb2.GetMaterializerInfoRequest(arena_probe=probe),
                timeout=max(self.probe_timeout_s, 2.0) if startup else self.probe_timeout_s,
            )
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                logger.debug("materializer %s: GetMaterializerInfo failed: %s", target, exc.code())
                return None
            # contract version 1 without GetMaterializerInfo: handles, as before
            transport = "inline" if self.inline_transport or self.arena is None else "shm"
            return Attachment(target, "", "", "", 1, 0, transport)
        if info.contract != CONTRACT:
            raise _Refused(
                f"it implements contract {info.contract!r}; this decoder speaks {CONTRACT!r}"
            )
        if info.draining or (
            handover is not None and info.instance_id and info.instance_id == handover.old_instance
        ):
            logger.debug(
                "materializer %s: instance %s is draining; waiting for its replacement",
                target,
                info.instance_id,
            )
            return None
        return Attachment(
            target=target,
            instance_id=info.instance_id,
            implementation=info.implementation,
            version=info.version,
            contract_version=min(CONTRACT_VERSION, info.contract_version or 1),
            start_time_unix_ms=info.start_time_unix_ms,
            transport=self._transport(info),
        )

    def _refused(self, target: str, why: str) -> None:
        logger.error(
            "materializer %s refused: %s; building in-process, retrying in %.1fs",
            target,
            why,
            min(_MAX_BACKOFF_S, self.reconnect_interval_s * 2 ** (self._strikes + 1)),
        )
        self._strikes += 1
        self._last_failure = "refused"
        self._next_try = time.monotonic() + min(
            _MAX_BACKOFF_S, self.reconnect_interval_s * 2**self._strikes
        )

    def _try_connect(self, startup: bool = False, handover: _Handover | None = None) -> bool:
        """Probe the materializer; when it is SERVING and usable, open a stream
        and switch to it. Runs on the connector thread (and once in `start`).
        Every attempt dials a fresh connection (a failed one is closed): a
        connection kept from an earlier attempt may reach a process that is
        draining while its replacement already owns the address."""
        target = self._dial_target
        assert target
        channel = grpc.insecure_channel(target, options=_CHANNEL_OPTIONS)
        self._probe_channel = channel
        opened = False
        try:
            self._last_failure = "unreachable"
            if not self._healthy(channel, startup):
                return False
            try:
                attachment = self._identify(channel, target, startup, handover)
            except _Refused as exc:
                self._refused(target, str(exc))
                return False
            if attachment is None:
                return False
            opened = self._open_stream(channel, attachment, handover)
            return opened
        finally:
            if not opened:
                channel.close()
                if self._probe_channel is channel:
                    self._probe_channel = None

    def _open_stream(
        self, channel: grpc.Channel, attachment: Attachment, handover: _Handover | None
    ) -> bool:
        stub = materializer_pb2_grpc.MaterializerServiceStub(channel)
        outbox: queue.SimpleQueue = queue.SimpleQueue()
        call = stub.Materialize(self._requests(self._open_message(attachment), outbox))
        stream = _Stream(
            call=call,
            outbox=outbox,
            opened_s=time.monotonic(),
            channel=channel,
            attachment=attachment,
        )
        stream.receiver = threading.Thread(
            target=self._receive_loop, args=(stream,), name=f"{self.name}-recv", daemon=True
        )
        with self._deliver_lock:  # between two deliveries: the switch is at a step boundary
            with self._lock:
                if self._closing.is_set() or self._handover is not handover:
                    call.cancel()  # closing, or the handover ended meanwhile (failover)
                    outbox.put(_STOP)  # ends the request iterator gRPC's thread waits on
                    return False
                self._stream = stream
                self._handover = None
                self._last_progress = time.monotonic()
                self._window_start = time.monotonic()
                self._slot_wait_s = 0.0
                was_local_s = time.monotonic() - self._local_since
                previous, self.attachment = self.attachment, attachment
                waiting = len(self._unsent)
            self._probe_channel = None  # the stream owns it now
            self._publish(previous, attachment)
            if handover is not None:
                self.handovers += 1
                metrics.MATERIALIZER_ATTACHMENTS.labels("handover").inc()
                logger.info(
                    "materializer %s: handover from instance %s (%s) to %s; %d waiting steps "
                    "go there",
                    attachment.target,
                    handover.old_instance or "?",
                    handover.reason or "draining",
                    attachment.describe(),
                    waiting,
                )
            else:
                metrics.MATERIALIZER_ATTACHMENTS.labels("connect").inc()
                logger.info(
                    "materializer %s: attached to %s", attachment.target, attachment.describe()
                )
                self._switch("to_remote", "connected", in_process_s=was_local_s)
        stream.receiver.start()
        self._inbox.put(_FLUSH)
        return True

    @staticmethod
    def _publish(previous: Attachment | None, current: Attachment | None) -> None:
        """The info gauge: one series, for the attached instance."""
        if previous is not None and previous != current:
            with contextlib.suppress(KeyError):
                metrics.MATERIALIZER_INFO.remove(*metrics.attachment_labels(previous))
        if current is not None:
            metrics.MATERIALIZER_INFO.labels(*metrics.attachment_labels(current)).set(1)

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
        try:
            self._stream_ended(stream, reason)
        finally:
            if stream.channel is not None:
                stream.channel.close()

    def _on_response(self, stream: _Stream, resp: materializer_pb2.MaterializeResponse) -> None:
        kind = resp.WhichOneof("kind")
        if kind == "draining":
            self._on_draining(stream, resp.draining)
            return
        if kind not in ("step", "error"):
            raise _ProtocolError("a response carries neither step nor error")
        got = resp.step.step_id if kind == "step" else resp.error.step_id
        with self._deliver_lock:
            with self._lock:
                if stream.abandoned:
                    return  # failed over meanwhile: its steps were built in-process
                entry = stream.sent.popleft() if stream.sent else None
                if entry is None or got != entry.meta.step_id:
                    if entry is not None:
                        stream.sent.appendleft(entry)
                    raise _ProtocolError(
                        f"answered step {got}, expected {entry.meta.step_id if entry else 'none'}"
                    )
                entry.answer = resp
                self._last_progress = time.monotonic()
                stream.answers += 1
            self._deliver_heads()

    def _on_draining(self, stream: _Stream, msg: materializer_pb2.StreamDraining) -> None:
        """The materializer stops: send nothing more on this stream, keep
        reading it, and have the connector attach a replacement."""
        with self._lock:
            if stream.abandoned or stream.draining:
                return
            stream.draining = True
            current = self._stream is stream
            if current:
                old = stream.attachment.instance_id if stream.attachment else ""
                # empty successor: the same target as this stream's (a successor's, after one)
                target = msg.successor or self._dial_target or self.target or ""
                self._stream = None
                self._old.append(stream)
                self._handover = _Handover(time.monotonic(), old, target, msg.reason)
                self._dial_target = target
            in_flight = len(stream.sent)
        stream.outbox.put(_STOP)  # half-close: what was sent is still answered
        who = stream.attachment.describe() if stream.attachment else "materializer"
        logger.info(
            "materializer %s: %s is draining (%s, grace %d ms, %d steps in flight); "
            "attaching to %s",
            self._dial_target,
            who,
            msg.reason or "no reason given",
            msg.grace_ms,
            in_flight,
            msg.successor or "its replacement",
        )
        if current:
            self._next_try = 0.0
            self._wake.set()

    def _stream_ended(self, stream: _Stream, reason: str) -> None:
        """A stream's call is over. The current one: fail over. A drained one:
        done; steps it left unanswered are built in-process."""
        with self._deliver_lock:
            with self._lock:
                if stream.abandoned:
                    return
                current = self._stream is stream
                drained = stream in self._old
                left: list[_Entry] = []
                if drained:
                    self._old.remove(stream)
                    stream.abandoned = True
                    left = list(stream.sent)
                    stream.sent.clear()
                    for entry in left:
                        entry.local = reason
            if current:
                self._fail_over_all(reason, stream.cancel_detail, ended=stream)
                return
            if not drained:
                return
            who = stream.attachment.describe() if stream.attachment else "materializer"
            if left:
                logger.warning(
                    "materializer %s: the drained stream of %s ended (%s) with %d "
                    "steps unanswered; building them in-process",
                    self.target,
                    who,
                    reason,
                    len(left),
                )
            else:
                logger.info("materializer %s: the drained stream of %s ended", self.target, who)
            self._deliver_heads()

    def _fail_over_all(self, reason: str, detail: str = "", ended: _Stream | None = None) -> None:
        """Switch to in-process building: every pending step is delivered in
        order (answered ones as answered, the others built in-process), every
        stream is dropped."""
        with self._deliver_lock:
            with self._lock:
                current = self._stream
                streams = [s for s in (current, *self._old) if s is not None]
                handover = self._handover
                if not streams and handover is None and not self._pending:
                    return
                self._stream = None
                self._old = []
                self._handover = None
                entries = list(self._pending)
                self._pending.clear()
                self._unsent.clear()
                for s in streams:
                    s.abandoned = True
                    s.sent.clear()
                rebuilt = 0
                for entry in entries:
                    if entry.answer is None:
                        entry.local = entry.local or reason
                        rebuilt += 1
                self._local_reason = reason
                self._local_since = time.monotonic()
                self._dial_target = self.target
                previous, self.attachment = self.attachment, None
            for s in streams:
                s.outbox.put(_STOP)
            self._publish(previous, None)
            if reason == "shutdown" and not rebuilt:
                metrics.set_mode(False)
            else:
                self._switch("to_in_process", reason, rebuilt=rebuilt, detail=detail)
            for entry in entries:
                self._deliver_entry(entry)
        judged = ended or current or (streams[0] if streams else None)
        if judged is not None:
            lived = time.monotonic() - judged.opened_s
            bad = (
                reason in ("stall", "slow", "protocol_error", "no_replacement")
                or judged.answers == 0
            )
        else:
            lived, bad = 0.0, True
        self._strikes = self._strikes + 1 if bad and lived < _HEALTHY_STREAM_S else 0
        delay = self.reconnect_interval_s * 2**self._strikes if self._strikes else 0.0
        self._next_try = time.monotonic() + min(_MAX_BACKOFF_S, delay)
        for s in streams:
            if not (s is ended and reason == "stream_closed"):
                s.call.cancel()
        self._wake.set()

    def _deliver_heads(self) -> None:
        """Deliver the steps at the head of the queue whose turn came: answered
        ones, and those to build in-process."""
        with self._deliver_lock:
            while True:
                with self._lock:
                    if not self._pending:
                        return
                    head = self._pending[0]
                    if head.answer is None and head.local is None:
                        return
                    self._pending.popleft()
                    if not self._pending:
                        self._last_progress = time.monotonic()
                self._deliver_entry(head)

    def _deliver_entry(self, entry: _Entry) -> None:
        """Deliver one step whose turn it is (under _deliver_lock)."""
        resp = entry.answer
        if resp is None:
            self._build_local(entry.meta, entry.local or "no_slot")
        elif resp.WhichOneof("kind") == "step":
            self.remote_steps += 1
            self._finish(resp.step, entry.meta)
        else:
            logger.warning(
                "materializer failed step %d (code %d: %s); building it in-process",
                entry.meta.step_id,
                resp.error.code,
                resp.error.message,
            )
            self._build_local(entry.meta, "step_error")

    # -- connector ------------------------------------------------------------------
    def _connect_loop(self) -> None:
        while not self._closing.is_set():
            with self._lock:
                stream = self._stream
                handover = self._handover
            if stream is not None:
                self._watch(stream)
                self._wait(0.05)
                continue
            if handover is not None:
                waited = time.monotonic() - handover.since
                if waited >= self.stall_timeout_s:
                    self._fail_over_all(
                        "no_replacement",
                        f"instance {handover.old_instance or '?'} drains and no replacement "
                        f"answered on {handover.target} within {self.stall_timeout_s:g}s",
                    )
                elif not self._try_connect(handover=handover):
                    self._wait(_HANDOVER_RETRY_S)
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
                head = self._pending[0].meta
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
        stream.cancel_detail = (
            f"decode waited for slots {blocked:.0%} of the last {self.stall_timeout_s:g}s, "
            if blocked > 0.5
            else ""
        )
        stream.cancel_detail += (
            f"oldest step waiting {head_age:.1f}s, no answer for "
            f"{since_answer:.1f}s, {pending} steps waiting"
        )
        stream.cancel_reason = reason
        stream.call.cancel()

    # -- building and delivery (under _deliver_lock) ------------------------------
    def _switch(
        self,
        direction: str,
        reason: str,
        rebuilt: int = 0,
        in_process_s: float = 0.0,
        detail: str = "",
    ) -> None:
        first = not self.switches
        self.switches[(direction, reason)] += 1
        metrics.MATERIALIZER_SWITCHES.labels(direction, reason).inc()
        metrics.set_mode(direction == "to_remote")
        if direction == "to_remote" and first:
            logger.info("materializer %s: stream open", self.target)
        elif direction == "to_remote":
            logger.warning(
                "materializer %s: stream open; building on the materializer again "
                "(after %.1fs in-process)",
                self.target,
                in_process_s,
            )
        else:
            logger.warning(
                "materializer %s: %s%s; building in-process (%d pending steps rebuilt), "
                "reconnecting in the background",
                self.target,
                reason,
                f" ({detail})" if detail else "",
                rebuilt,
            )

    def _build_local(self, meta: SnapshotMeta, reason: str) -> None:
        with self._deliver_lock:
            if self.target:  # without a target, in-process building is the mode, not a fallback
                self.fallback_steps += 1
                self.fallback_by_reason[reason] += 1
                metrics.FALLBACK_STEPS.labels(reason).inc()
            try:
                # tensors viewing the slot, handed to the router as they are: the
                # router copies what it keeps, the slot is released after it
                built = build_local_step(meta.local_view(self.arena), self.plans[meta.stage_id])
            except Exception as exc:  # noqa: BLE001 -- fail this step's requests, keep serving
                self._fail(meta, exc, "link_build")
                return
            self._finish(built, meta)

    def _finish(self, step: materializer_pb2.MaterializedStep | LocalStep, meta: SnapshotMeta) -> None:
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
        logger.error(
            "step %d of stage %d failed (%s); failing its %d request(s)",
            meta.step_id,
            meta.stage_id,
            where,
            len(meta.request_ids),
            exc_info=exc,
        )
        try:
            if self.fail_step is not None:
                self.fail_step(meta, exc)
        except Exception:  # noqa: BLE001 -- the slot is freed below whatever happens
            logger.exception("failing the requests of step %d failed", meta.step_id)
        finally:
            self._release(meta)
