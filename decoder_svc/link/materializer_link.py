"""The decoder's side of the Materialize stream: ``MaterializerLink``, a small façade.

``submit`` is called on the decode critical path and only enqueues. Three
kinds of threads do the rest, each part in a module of its own around one
shared :class:`.state.LinkState`:

- the dispatcher (``.dispatch``) turns snapshots into StepSnapshot messages
  and sends them on the stream, or, while there is no stream, builds them
  in-process at once. It never waits on the materializer and never connects;
- a receiver per stream (``.transport``) reads MaterializedSteps (lagged:
  step N comes back while later steps run), and has them delivered in step
  order (``.delivery``), releasing their slots;
- the connector (``.transport``; only with a target) opens streams and has
  the watchdog (``.watchdog``) judge them: a materializer that stops
  answering (stall) or cannot keep up (slow) is dropped, and retried in the
  background with a backoff.

Delivery is in step order on every path. Nothing is lost when the
materializer fails (``.failover``):

- a StepError for one step: that step is built in-process from its slot;
- the stream breaks, stalls or lags: the link switches to in-process
  building (one log line, one metric), every pending step is built
  in-process, in order, and so is every later step until the connector has
  a new stream. Steps built in-process are never sent again; the switch
  back happens between two steps;
- a materializer that drains (StreamDraining) is handed over to its
  successor: later steps wait, unsent and in order, and go there; no step is
  built in-process in a normal handover. If no replacement is attached
  within ``stall_timeout_s``, the link fails over (``no_replacement``).

An exception while building or delivering a step fails that step's requests
(``fail_step``) and frees its slot; the threads keep serving. Without a
target the link builds on its own thread from the start: the in-process
background-builder baseline.

A step built in-process (``build_local_step``) is delivered as a
``LocalStep``: its payloads are tensors viewing the slot (or the detached
copies), never serialised; the slot is released once the delivery returns.
A step the materializer answered is delivered as its ``MaterializedStep``.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

from decoder_svc import metrics
from decoder_svc.link.delivery import Deliver, Delivery, FailStep
from decoder_svc.link.dispatch import Dispatcher
from decoder_svc.link.failover import Failover
from decoder_svc.link.state import STOP, Attachment, LinkState
from decoder_svc.link.transport import Transport
from decoder_svc.link.watchdog import Watchdog
from decoder_svc.snapshot import SnapshotMeta
from omni_common.liveness import Progress
from omni_common.shm_arena import ShmArena
from omni_serving.v1 import materializer_pb2

logger = logging.getLogger(__name__)


class MaterializerLink:
    """One link to a materializer (or the in-process builder): the parts, wired."""

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
        self.state = LinkState(
            target=target,
            shm_prefix=shm_prefix,
            plans=plans,
            arena=arena,
            readiness_timeout_ms=readiness_timeout_ms,
            reconnect_interval_s=reconnect_interval_s,
            probe_timeout_s=probe_timeout_s,
            stall_timeout_s=stall_timeout_s,
            max_pending=max_pending,
            drain_timeout_s=drain_timeout_s,
            inline_transport=inline_transport,
            name=name,
        )
        self.target = target
        self.delivery = Delivery(self.state, deliver, fail_step)
        self.failover = Failover(self.state, self.delivery)
        self.watchdog = Watchdog(self.state)
        self.dispatcher = Dispatcher(self.state, self.delivery, self.failover)
        self.transport = Transport(self.state, self.delivery, self.failover, self.watchdog)
        self._dispatcher = threading.Thread(
            target=self._guarded,
            args=("dispatcher", self.dispatcher.loop),
            name=f"{name}-dispatch",
            daemon=True,
        )
        self._connector = (
            threading.Thread(
                target=self._guarded,
                args=("connector", self.transport.connect_loop),
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
        st = self.state
        metrics.set_mode(False)
        if self.target:
            try:
                connected = self.transport.try_connect(startup=True)
            except Exception:  # noqa: BLE001 -- the connector keeps trying
                logger.exception("materializer %s: opening the stream failed", self.target)
                connected = False
            if not connected:
                st.local_reason = st.last_failure
                self.failover.switch("to_in_process", st.last_failure, rebuilt=0)
        self._dispatcher.start()
        if self._connector is not None:
            self._connector.start()

    def close(self) -> None:
        """Deliver what was submitted, then stop threads and the streams.

        Bounded: steps still unanswered after `drain_timeout_s` are built
        in-process; a dead or stopped materializer costs no wait."""
        st = self.state
        st.closing.set()
        st.wake.set()
        if self._connector is not None and self._connector.is_alive():
            self._connector.join(timeout=st.probe_timeout_s + 2.0)
        st.inbox.put(STOP)
        self._dispatcher.join(timeout=st.drain_timeout_s + 10.0)
        with st.lock:
            streams = [s for s in (st.stream, *st.old) if s is not None]
        for stream in streams:
            stream.cancel_reason = stream.cancel_reason or "shutdown"
            stream.outbox.put(STOP)  # half-close: the materializer ends the stream
        for stream in streams:
            if stream.receiver is not None and stream.receiver.ident is not None:
                stream.receiver.join(timeout=1.0)
                if stream.receiver.is_alive():
                    stream.call.cancel()
                    stream.receiver.join(timeout=5.0)
        with st.lock:
            stuck = st.stream is not None or bool(st.old) or bool(st.pending)
        if stuck:  # a receiver is stuck: take its steps over
            self.failover.fail_over_all("shutdown")
        for stream in streams:
            if stream.channel is not None:
                stream.channel.close()
        probe = self.transport.probe_channel
        if probe is not None:
            probe.close()
            self.transport.probe_channel = None

    # -- critical path ---------------------------------------------------------
    def submit(self, meta: SnapshotMeta, build_local: bool = False) -> None:
        """Hand a snapshot over without waiting (a queue put).

        build_local: no arena slot was free for this step (its tensors are
        detached copies); it is built in-process, after the steps before it."""
        self.state.inbox.put((meta, "no_slot" if build_local else None))

    def note_slot_wait(self, seconds: float) -> None:
        """A decode step waited this long for an arena slot (all held by steps
        the materializer has not answered)."""
        self.watchdog.note_slot_wait(seconds)

    # -- state ----------------------------------------------------------------------
    @property
    def progress(self) -> Progress:
        """The dispatcher loop's liveness counter (``omni_common.liveness``)."""
        return self.dispatcher.progress

    @property
    def connected(self) -> bool:
        """A stream is up, or a handover to a replacement is under way."""
        st = self.state
        with st.lock:
            return st.stream is not None or st.handover is not None

    @property
    def in_flight(self) -> int:
        st = self.state
        with st.lock:
            return len(st.pending)

    @property
    def attachment(self) -> Attachment | None:
        """The materializer instance the current stream is attached to (None: none)."""
        return self.state.attachment

    @property
    def handovers(self) -> int:
        return self.failover.handovers

    @property
    def switches(self) -> collections.Counter[tuple[str, str]]:
        return self.failover.switches

    @property
    def fallback_steps(self) -> int:
        return self.delivery.fallback_steps

    @property
    def fallback_by_reason(self) -> collections.Counter[str]:
        return self.delivery.fallback_by_reason

    @property
    def remote_steps(self) -> int:
        return self.delivery.remote_steps

    @property
    def failed_steps(self) -> int:
        return self.delivery.failed_steps

    @property
    def in_flight_peak(self) -> int:
        return self.delivery.in_flight_peak

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
                if self.state.closing.is_set() and where == "connector":
                    return
                time.sleep(0.05)
