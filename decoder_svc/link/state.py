"""What the parts of one materializer link share: the settings, the step queue, the streams.

A link (``.materializer_link.MaterializerLink``) is a few parts around one
:class:`LinkState`: the dispatcher (``.dispatch``), in-order delivery
(``.delivery``), failover and drain handover (``.failover``), the stall
watchdog (``.watchdog``) and the transport (``.transport``: the gRPC streams
and the connector). Their shared fields live here, with the two locks:

- ``lock`` guards ``stream``, ``old``, ``handover``, ``pending``, ``unsent``,
  ``local_reason``, ``attachment``, and the streams' ``sent``, ``answers``
  and ``progress_s``;
- ``deliver_lock`` (re-entrant: a failover delivers the pending steps while
  holding it) makes deliveries one at a time, in step order; when both are
  taken, ``deliver_lock`` is taken first.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import grpc

from decoder_svc.snapshot import SnapshotMeta
from omni_common.shm_arena import ShmArena
from omni_serving.v1 import decoder_pb2, materializer_pb2

STOP = object()  # the dispatcher's and a stream's outbox: end
FLUSH = object()  # a stream was attached: send the steps that waited for it


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
class Stream:
    """One Materialize call and what the link knows about it."""

    call: Any  # grpc stream-stream call: iterator of responses, cancel()
    outbox: queue.SimpleQueue
    opened_s: float
    channel: grpc.Channel | None = None
    attachment: Attachment | None = None
    sent: collections.deque[Entry] = field(default_factory=collections.deque)
    answers: int = 0
    # When this stream last showed progress: its last answer, or the moment
    # its sent queue went from empty to non-empty. The watchdog judges each
    # stream by this clock and its own ``sent``, never by the link's queue.
    progress_s: float = field(default_factory=time.monotonic)
    # Steps the handover put on this stream: those that waited for it and
    # were sent on attach, and those sent inline while it had not answered
    # them (no slot was free: the backlog held them). Judged by the clock,
    # not counted against max_pending.
    backlog: int = 0
    backlog_done_s: float = 0.0  # when its answers reached the backlog (0.0: not yet, or none)
    # The answers it owes once the backlog is answered: the steps sent to it
    # meanwhile. A cold replacement still holds their slots; until they are
    # answered a step without a slot is not the materializer's fault either.
    catch_up: int = 0
    draining: bool = False  # the materializer sent StreamDraining; half-closed
    abandoned: bool = False  # its unanswered steps were taken over (in-process)
    cancel_reason: str | None = None
    cancel_detail: str = ""
    receiver: threading.Thread | None = None

    def put(self, entry: Entry, request: materializer_pb2.MaterializeRequest) -> None:
        """Send a step on this stream (under the state's lock)."""
        now = time.monotonic()
        if not self.sent:
            self.progress_s = now  # waiting starts now, not at the last answer
        entry.stream = self
        entry.sent_s = now
        self.sent.append(entry)
        self.outbox.put(request)

    def answered(self) -> Entry | None:
        """The step the next answer is for, taken off ``sent`` (under the lock)."""
        if not self.sent:
            return None
        self.answers += 1
        self.progress_s = time.monotonic()
        if self.answers == self.backlog:
            self.backlog_done_s = self.progress_s
            self.catch_up = self.answers + len(self.sent) - 1
        return self.sent.popleft()


@dataclass(eq=False)
class Entry:
    """A submitted step, from submit until its delivery."""

    meta: SnapshotMeta
    local: str | None = None  # build in-process for this reason when its turn comes
    stream: Stream | None = None  # the stream it was sent on (None: not sent)
    handover: bool = False  # no slot was free because a handover's steps held them
    sent_s: float = 0.0  # time.monotonic() when it was sent
    answer: materializer_pb2.MaterializeResponse | None = None


@dataclass(frozen=True, eq=False)
class Handover:
    """Waiting for a replacement after a StreamDraining."""

    since: float
    old_instance: str
    target: str
    reason: str


class LinkState:
    """The settings of a link and the state its parts share (module docstring)."""

    def __init__(
        self,
        *,
        target: str | None,
        shm_prefix: str,
        plans: dict[int, materializer_pb2.StagePlan],
        arena: ShmArena | None,
        readiness_timeout_ms: int,
        reconnect_interval_s: float,
        probe_timeout_s: float,
        stall_timeout_s: float,
        max_pending: int | None,
        drain_timeout_s: float,
        inline_transport: bool,
        name: str,
    ) -> None:
        self.target = target
        self.shm_prefix = shm_prefix
        self.plans = plans
        self.arena = arena
        self.readiness_timeout_ms = readiness_timeout_ms
        self.reconnect_interval_s = reconnect_interval_s
        self.probe_timeout_s = probe_timeout_s
        self.stall_timeout_s = stall_timeout_s
        slots = arena.num_slots if arena is not None else 16
        self.max_pending = max_pending if max_pending is not None else max(64, 4 * slots)
        self.drain_timeout_s = drain_timeout_s
        self.inline_transport = inline_transport
        self.name = name
        # submitted snapshots, for the dispatcher (and STOP, FLUSH)
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        # Every step submitted and not yet delivered, in step order: sent and
        # waiting for its answer, answered behind an unanswered one, to be
        # built in-process once its turn comes, or waiting for a stream.
        self.pending: collections.deque[Entry] = collections.deque()
        # The tail of pending not sent yet (a handover is under way).
        self.unsent: collections.deque[Entry] = collections.deque()
        self.lock = threading.Lock()
        self.deliver_lock = threading.RLock()
        self.stream: Stream | None = None  # where new steps go
        self.old: list[Stream] = []  # drained streams still answering
        self.handover: Handover | None = None
        self.dial_target = target
        self.local_reason = "unreachable"
        self.local_since = time.monotonic()
        self.closing = threading.Event()
        self.wake = threading.Event()  # pokes the connector
        self.attachment: Attachment | None = None
        # the connector's backoff: why the last attempt failed, failures in a
        # row, when to try next
        self.last_failure = "unreachable"
        self.strikes = 0
        self.next_try = 0.0
