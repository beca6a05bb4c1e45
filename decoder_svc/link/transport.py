"""A link's transport: the Materialize streams, their receivers, and the connector that opens them.

- A receiver per stream reads MaterializedSteps (lagged: step N comes back
  while later steps run), matches each to the step it answers and has the
  steps delivered in order (``.delivery``); a StreamDraining hands over
  (``.failover``); the end of the stream fails over (or, for a drained
  stream, builds just its unanswered steps in-process).
- The connector (only with a target) opens streams and watches them: while
  there is no stream it polls the materializer's health with a short
  timeout and opens a stream once it is SERVING (also while the decoder is
  idle); while there is one the watchdog (``.watchdog``) judges it, and
  drained streams still answering are judged on their own. After a
  broken stream (the materializer died) it polls every
  ``reconnect_interval_s``; after a stream that stalled, fell behind or
  never answered, it waits ``reconnect_interval_s * 2**n`` first (n such
  failures in a row, at most 30 s), so a materializer that keeps failing is
  not retried on every poll. While a handover waits for a replacement it
  tries every 50 ms, skipping an instance that is draining or is the one
  that said it drains; none within ``stall_timeout_s``: it fails over
  (``no_replacement``).

Attaching. Before each stream it opens, the connector asks
GetMaterializerInfo, with ``arena_probe`` set to the arena's name, and logs
the instance it found (``Attachment``, also in GetDecoderInfo and the
``omni_decoder_materializer_info`` gauge). A materializer of another contract
is refused (ERROR, retried with the backoff above); one without
GetMaterializerInfo is contract version 1 with arena handles. The stream
speaks the lower of the two contract versions and carries arena handles
when the probe came back MAPPED, else inline bytes. ``inline_transport``
forces inline. Every attempt dials a fresh connection: after a handover on
the same address, a new channel must reach the new process, not reuse the
connection to the one that is draining.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from decoder_svc import metrics
from decoder_svc.link.delivery import Delivery
from decoder_svc.link.failover import MAX_BACKOFF_S, Failover, publish
from decoder_svc.link.state import FLUSH, STOP, Attachment, Handover, LinkState, Stream
from decoder_svc.link.watchdog import Watchdog
from omni_common.server import client_options
from omni_serving.v1 import materializer_pb2, materializer_pb2_grpc

logger = logging.getLogger(__name__)

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
# While a replacement is awaited after StreamDraining, how often to try.
_HANDOVER_RETRY_S = 0.05

_MAPPED = materializer_pb2.ARENA_PROBE_RESULT_MAPPED
_UNSPECIFIED = materializer_pb2.ARENA_PROBE_RESULT_UNSPECIFIED


class _ProtocolError(Exception):
    """The materializer answered a step that is not the next one."""


class _Refused(Exception):
    """The materializer cannot be used by this decoder (contract, transport)."""


class Transport:
    """Opens, reads and watches the link's streams (module docstring)."""

    def __init__(self, state: LinkState, delivery: Delivery, failover: Failover, watchdog: Watchdog) -> None:
        self.state = state
        self.delivery = delivery
        self.failover = failover
        self.watchdog = watchdog
        self.probe_channel: grpc.Channel | None = None  # the connector's, until a stream owns it

    # -- the connector thread ---------------------------------------------------------------
    def connect_loop(self) -> None:
        st = self.state
        while not st.closing.is_set():
            self.watchdog.watch_draining()
            with st.lock:
                stream = st.stream
                handover = st.handover
            if stream is not None:
                self.watchdog.watch(stream)
                self._wait(0.05)
                continue
            if handover is not None:
                waited = time.monotonic() - handover.since
                if waited >= st.stall_timeout_s:
                    self.failover.fail_over_all(
                        "no_replacement",
                        f"instance {handover.old_instance or '?'} drains and no replacement "
                        f"answered on {handover.target} within {st.stall_timeout_s:g}s",
                    )
                elif not self.try_connect(handover=handover):
                    self._wait(_HANDOVER_RETRY_S)
                continue
            now = time.monotonic()
            if now < st.next_try:
                self._wait(min(st.next_try - now, st.reconnect_interval_s))
                continue
            if not self.try_connect():
                self._wait(st.reconnect_interval_s)

    def _wait(self, seconds: float) -> None:
        self.state.wake.wait(seconds)
        self.state.wake.clear()

    # -- connecting ----------------------------------------------------------------------------
    def _open_message(self, attachment: Attachment) -> materializer_pb2.MaterializeRequest:
        st = self.state
        return materializer_pb2.MaterializeRequest(
            open=materializer_pb2.MaterializeStreamOpen(
                # a stream of inline tensors reads no arena: no deployment prefix to check
                shm_prefix=st.shm_prefix if attachment.transport == "shm" else "",
                stages=list(st.plans.values()),
                readiness_timeout_ms=st.readiness_timeout_ms,
                client_name=st.name,
                contract_version=attachment.contract_version,
            )
        )

    @staticmethod
    def _requests(first: materializer_pb2.MaterializeRequest, outbox: queue.SimpleQueue):
        yield first
        while True:
            item = outbox.get()
            if item is STOP:
                return
            yield item

    def _healthy(self, channel: grpc.Channel, startup: bool) -> bool:
        """One health check with a short timeout. In the background it fails
        fast while the channel cannot connect; at startup it waits up to 2 s
        for the first connection."""
        probe_timeout_s = self.state.probe_timeout_s
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""),
                timeout=max(probe_timeout_s, 2.0) if startup else probe_timeout_s,
                wait_for_ready=startup,
            )
        except grpc.RpcError as exc:
            # A materializer without the health service: the connection is up.
            return exc.code() == grpc.StatusCode.UNIMPLEMENTED
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    def _transport(self, info: materializer_pb2.GetMaterializerInfoResponse) -> str:
        """How tensors travel to this materializer; _Refused if they cannot."""
        st = self.state
        if st.inline_transport or st.arena is None:
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
            f"it cannot read this decoder's arena {st.arena.name!r} ({outcome}, "
            f"supports_shm={info.supports_shm}) and does not read inline tensors"
        )

    def _identify(
        self, channel: grpc.Channel, target: str, startup: bool, handover: Handover | None
    ) -> Attachment | None:
        """Ask the materializer who it is (and whether it maps our arena).
        None: not usable now (try again soon); _Refused: not usable at all."""
        st = self.state
        probe = st.arena.name if st.arena is not None and not st.inline_transport else ""
        try:
            info = materializer_pb2_grpc.MaterializerServiceStub(channel).GetMaterializerInfo(
                materializer_pb2.GetMaterializerInfoRequest(arena_probe=probe),
                timeout=max(st.probe_timeout_s, 2.0) if startup else st.probe_timeout_s,
            )
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                logger.debug("materializer %s: GetMaterializerInfo failed: %s", target, exc.code())
                return None
            # contract version 1 without GetMaterializerInfo: handles, as before
            transport = "inline" if st.inline_transport or st.arena is None else "shm"
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
        st = self.state
        logger.error(
            "materializer %s refused: %s; building in-process, retrying in %.1fs",
            target,
            why,
            min(MAX_BACKOFF_S, st.reconnect_interval_s * 2 ** (st.strikes + 1)),
        )
        st.strikes += 1
        st.last_failure = "refused"
        st.next_try = time.monotonic() + min(MAX_BACKOFF_S, st.reconnect_interval_s * 2**st.strikes)

    def try_connect(self, startup: bool = False, handover: Handover | None = None) -> bool:
        """Probe the materializer; when it is SERVING and usable, open a stream
        and switch to it. Runs on the connector thread (and once in `start`).
        Every attempt dials a fresh connection (a failed one is closed): a
        connection kept from an earlier attempt may reach a process that is
        draining while its replacement already owns the address."""
        st = self.state
        target = st.dial_target
        assert target
        channel = grpc.insecure_channel(target, options=_CHANNEL_OPTIONS)
        self.probe_channel = channel
        opened = False
        try:
            st.last_failure = "unreachable"
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
                if self.probe_channel is channel:
                    self.probe_channel = None

    def _open_stream(
        self, channel: grpc.Channel, attachment: Attachment, handover: Handover | None
    ) -> bool:
        st = self.state
        stub = materializer_pb2_grpc.MaterializerServiceStub(channel)
        outbox: queue.SimpleQueue = queue.SimpleQueue()
        call = stub.Materialize(self._requests(self._open_message(attachment), outbox))
        stream = Stream(
            call=call,
            outbox=outbox,
            opened_s=time.monotonic(),
            channel=channel,
            attachment=attachment,
        )
        stream.receiver = threading.Thread(
            target=self._receive_loop, args=(stream,), name=f"{st.name}-recv", daemon=True
        )
        with st.deliver_lock:  # between two deliveries: the switch is at a step boundary
            with st.lock:
                if st.closing.is_set() or st.handover is not handover:
                    call.cancel()  # closing, or the handover ended meanwhile (failover)
                    outbox.put(STOP)  # ends the request iterator gRPC's thread waits on
                    return False
                st.stream = stream
                st.handover = None
                self.watchdog.reset_window()
                was_local_s = time.monotonic() - st.local_since
                previous, st.attachment = st.attachment, attachment
                waiting = len(st.unsent)
            self.probe_channel = None  # the stream owns it now
            publish(previous, attachment)
            self.failover.attached(attachment, handover, waiting, was_local_s)
        stream.receiver.start()
        st.inbox.put(FLUSH)
        return True

    # -- a stream's receiver thread ------------------------------------------------------------
    def _receive_loop(self, stream: Stream) -> None:
        target = self.state.target
        reason = "stream_closed"
        try:
            for resp in stream.call:
                self.on_response(stream, resp)
            reason = stream.cancel_reason or reason
        except grpc.RpcError as exc:
            reason = stream.cancel_reason or "stream_broken"
            if stream.cancel_reason is None:
                logger.debug("materializer stream ended: %s", exc.code())
        except _ProtocolError as exc:
            reason = "protocol_error"
            logger.error("materializer %s: protocol error: %s", target, exc)
        except Exception:  # noqa: BLE001 -- a receiver bug must not lose steps: fail over
            reason = "internal_error"
            metrics.INTERNAL_ERRORS.labels("link_receiver").inc()
            logger.exception("materializer %s: receiver failed", target)
        try:
            self.failover.stream_ended(stream, reason)
        finally:
            if stream.channel is not None:
                stream.channel.close()

    def on_response(self, stream: Stream, resp: materializer_pb2.MaterializeResponse) -> None:
        st = self.state
        kind = resp.WhichOneof("kind")
        if kind == "draining":
            self.failover.on_draining(stream, resp.draining)
            return
        if kind not in ("step", "error"):
            raise _ProtocolError("a response carries neither step nor error")
        got = resp.step.step_id if kind == "step" else resp.error.step_id
        with st.deliver_lock:
            with st.lock:
                if stream.abandoned:
                    return  # failed over meanwhile: its steps were built in-process
                head = stream.sent[0] if stream.sent else None
                if head is None or got != head.meta.step_id:
                    raise _ProtocolError(
                        f"answered step {got}, expected {head.meta.step_id if head else 'none'}"
                    )
                entry = stream.answered()
                assert entry is head
                entry.answer = resp
            self.delivery.deliver_heads()
