"""The reference materializer: one stream, steps built in order on a thread.

The servicer is thin: it opens a `StreamSession` from the first message,
hands each snapshot to `StreamSession.materialize` on a worker thread (the
readiness wait and the copies block), and yields the answers in arrival
order. A bad step is a StepError in the stream; only a broken stream
protocol (no `open` first, `open` twice) ends the call. A bug that escapes
the stream loop ends it with INTERNAL and an error id (the traceback is
logged under it), never with the exception's text.

Subclasses change the strategy by overriding `answers` (see pool.py).

Identity and drain (contract version 2), shared by every subclass:

- GetMaterializerInfo reports this process's `instance_id` (a random UUID),
  its start time, contract version 2, `supports_drain`, whether it is
  draining, and the outcome of the request's `arena_probe`
  (`omni_common.shm_arena.probe_arena`: read-only, nothing kept mapped).
- `begin_drain` (the server calls it on SIGTERM/SIGINT) marks the process
  draining. A stream whose open set contract_version >= 2 gets one
  `StreamDraining` between two answers and is served as before until the
  sender half-closes it; it then ends OK. A stream of an older sender stops
  reading: what was received is answered, then the stream ends OK. Either
  way a stream still open when the grace period ends is ended with
  UNAVAILABLE. `drained` waits until no stream is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from materializer_svc.registry import MaterializerConfig, register
from materializer_svc.session import MaterializerCounters, StreamSession, session_from_first
from omni_common.errors import InvalidArgumentError, OmniError, grpc_code_for, log_internal
from omni_common.shm_arena import ArenaReader, probe_arena
from omni_serving.v1 import materializer_pb2, materializer_pb2_grpc, snapshot_pb2

logger = logging.getLogger(__name__)
VERSION = "0.2.0"
CONTRACT = "omni_serving.v1"
# Highest contract version implemented (2: StreamDraining, identity, arena probe).
CONTRACT_VERSION = 2
# How long a draining materializer keeps answering its open streams.
DEFAULT_DRAIN_GRACE_S = 30.0

_PROBE_RESULTS = {
    "mapped": materializer_pb2.ARENA_PROBE_RESULT_MAPPED,
    "not_found": materializer_pb2.ARENA_PROBE_RESULT_NOT_FOUND,
    "invalid": materializer_pb2.ARENA_PROBE_RESULT_INVALID,
}

# Threads that run steps. Each stream uses one at a time; a step may hold
# its thread for up to the stream's readiness timeout.
_STEP_THREADS = 32


@dataclass(eq=False)
class _OpenStream:
    """A Materialize call in progress, as the drain sees it."""

    contract_version: int
    client_name: str
    drain: asyncio.Event = field(default_factory=asyncio.Event)


class ReferenceMaterializer(materializer_pb2_grpc.MaterializerServiceServicer):
    implementation = "reference"
    version = VERSION

    def __init__(self, config: MaterializerConfig) -> None:
        self.config = config
        self.reader = ArenaReader(config.shm_prefix)
        self.counters = MaterializerCounters()
        self._threads = ThreadPoolExecutor(
            max_workers=_STEP_THREADS, thread_name_prefix="materialize"
        )
        self._released = False
        self.instance_id = str(uuid.uuid4())
        self.start_time_unix_ms = int(time.time() * 1000)
        self.drain_grace_s = DEFAULT_DRAIN_GRACE_S
        self.draining = False
        self.drain_reason = ""
        self._drain_deadline = 0.0  # time.monotonic() at which open streams are ended
        self._streams: set[_OpenStream] = set()
        self._streams_changed: asyncio.Event | None = None  # created on the serving loop

    # -- counters (read by tests and GetMaterializerInfo) ------------------------
    @property
    def active_streams(self) -> int:
        return self.counters.active_streams

    @property
    def steps_materialized(self) -> int:
        return self.counters.steps_materialized

    @property
    def steps_failed(self) -> int:
        return self.counters.steps_failed

    def count(self, resp: materializer_pb2.MaterializeResponse, seconds: float = 0.0) -> None:
        self.counters.record(resp, seconds)

    # -- stream plumbing -----------------------------------------------------------
    async def open_session(
        self, it: AsyncIterator[materializer_pb2.MaterializeRequest]
    ) -> StreamSession:
        first = await anext(it, None)
        return self.session_for(first)

    def session_for(self, first: materializer_pb2.MaterializeRequest | None) -> StreamSession:
        """The session a stream's first message opens (raises OmniError to refuse it)."""
        # A new stream usually means a (re)started decoder: drop mappings of
        # arenas whose segment is gone so their memory is freed.
        self.reader.prune()
        return session_from_first(
            first, self.reader, default_readiness_timeout_ms=self.config.readiness_timeout_ms
        )

    @staticmethod
    def snapshot_of(req: materializer_pb2.MaterializeRequest) -> snapshot_pb2.StepSnapshot:
        """The snapshot of a request after `open`; a second `open` breaks the protocol."""
        kind = req.WhichOneof("kind")
        if kind == "snapshot":
            return req.snapshot
        if kind == "open":
            raise InvalidArgumentError("open", "sent twice on one stream")
        raise InvalidArgumentError("kind", "request carries neither open nor snapshot")

    async def answers(
        self, session: StreamSession, it: AsyncIterator[materializer_pb2.MaterializeRequest]
    ) -> AsyncIterator[materializer_pb2.MaterializeResponse]:
        """The strategy: one step at a time, on a thread, in arrival order."""
        loop = asyncio.get_running_loop()
        async for req in it:
            snap = self.snapshot_of(req)
            self.counters.peak_in_flight = max(self.counters.peak_in_flight, 1)
            yield await loop.run_in_executor(self._threads, session.materialize, snap)

    async def Materialize(self, request_iterator, context: grpc.aio.ServicerContext):
        it = aiter(request_iterator)
        first = await anext(it, None)
        try:
            session = self.session_for(first)
        except OmniError as exc:
            self.counters.streams_refused += 1
            await context.abort(grpc_code_for(exc), str(exc))
            return
        except Exception as exc:  # noqa: BLE001  a bug: INTERNAL, traceback logged under an error id
            self.counters.streams_refused += 1
            await context.abort(grpc.StatusCode.INTERNAL, log_internal(logger, "opening a stream", exc))
            return
        assert first is not None
        stream = _OpenStream(first.open.contract_version or 1, session.client_name)
        self.counters.streams_opened += 1
        self.counters.active_streams += 1
        self._track(stream, opened=True)
        logger.info(
            "stream from %r opened: stages %s, contract version %d",
            session.client_name,
            sorted(session.plans),
            stream.contract_version,
        )
        protocol_error: OmniError | None = None
        internal: str | None = None  # a bug's message for the client (an error id)
        grace_over = False
        requests = it if stream.contract_version >= 2 else self._until_drain(it, stream)
        answers = aiter(self.answers(session, requests))
        pending: asyncio.Future | None = None
        drain_sent = False
        try:
            while True:
                if not self.draining and stream.contract_version < 2:
                    # Nothing to interleave: the plain loop (contract-1 streams
                    # stop reading by themselves on drain, see _until_drain).
                    resp = await anext(answers, None)
                else:
                    if pending is None:
                        pending = asyncio.ensure_future(anext(answers, None))
                    waits: set[asyncio.Future] = {pending}
                    drain_wait = grace_wait = None
                    if stream.contract_version >= 2 and not drain_sent:
                        drain_wait = asyncio.ensure_future(stream.drain.wait())
                        waits.add(drain_wait)
                    if self.draining:
                        grace_wait = asyncio.ensure_future(
                            asyncio.sleep(max(0.0, self._drain_deadline - time.monotonic()))
                        )
                        waits.add(grace_wait)
                    try:
                        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        for w in (drain_wait, grace_wait):
                            if w is not None and not w.done():
                                w.cancel()
                    if drain_wait is not None and drain_wait.done() and not drain_sent:
                        drain_sent = True
                        yield self._draining_message()
                        continue
                    if not pending.done():  # the grace period is over
                        grace_over = True
                        break
                    resp = pending.result()
                    pending = None
                if resp is None:
                    break
                self.count(resp, session.took(resp))
                yield resp
        except OmniError as exc:
            protocol_error = exc
        except asyncio.CancelledError:
            self.counters.streams_cancelled += 1
            raise
        except Exception as exc:  # noqa: BLE001  a bug: INTERNAL, traceback logged under an error id
            internal = log_internal(logger, f"stream from {stream.client_name!r}", exc)
        finally:
            if pending is not None and not pending.done():
                pending.cancel()
                await asyncio.wait({pending})
            for gen in (answers, requests):
                if gen is not it:
                    with contextlib.suppress(Exception):
                        await gen.aclose()  # type: ignore[attr-defined]
            self.counters.active_streams -= 1
            self._track(stream, opened=False)
        if protocol_error is not None:
            await context.abort(grpc_code_for(protocol_error), str(protocol_error))
        elif internal is not None:
            await context.abort(grpc.StatusCode.INTERNAL, internal)
        elif grace_over:
            logger.warning("stream from %r ended: drain grace period over", stream.client_name)
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                "the materializer is stopping: drain grace period over; "
                "unanswered snapshots were not built",
            )

    async def _until_drain(
        self, it: AsyncIterator[materializer_pb2.MaterializeRequest], stream: _OpenStream
    ) -> AsyncIterator[materializer_pb2.MaterializeRequest]:
        """The requests of a contract-1 stream until the drain begins: then
        nothing more is read (what was received is still answered)."""
        while not stream.drain.is_set():
            read: asyncio.Future = asyncio.ensure_future(anext(it, None))
            drain_wait = asyncio.ensure_future(stream.drain.wait())
            try:
                await asyncio.wait({read, drain_wait}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                drain_wait.cancel()
                if not read.done():
                    read.cancel()
                    await asyncio.wait({read})
            if read.cancelled():
                return
            req = read.result()
            if req is None:
                return
            yield req

    def _draining_message(self) -> materializer_pb2.MaterializeResponse:
        grace_ms = max(0, int((self._drain_deadline - time.monotonic()) * 1000))
        return materializer_pb2.MaterializeResponse(
            draining=materializer_pb2.StreamDraining(
                reason=self.drain_reason, grace_ms=min(grace_ms, 2**32 - 1)
            )
        )

    # -- drain ----------------------------------------------------------------------
    def _track(self, stream: _OpenStream, *, opened: bool) -> None:
        if opened:
            self._streams.add(stream)
            if self.draining:
                stream.drain.set()
        else:
            self._streams.discard(stream)
        if self._streams_changed is not None:
            self._streams_changed.set()

    def begin_drain(self, reason: str, grace_s: float | None = None) -> None:
        """Stop taking work (call on the serving event loop): mark the process
        draining, tell every open stream (StreamDraining for contract >= 2
        senders), and end streams still open after `grace_s` (default
        `drain_grace_s`). Idempotent."""
        if self.draining:
            return
        grace = self.drain_grace_s if grace_s is None else grace_s
        self.draining = True
        self.drain_reason = reason
        self._drain_deadline = time.monotonic() + grace
        logger.info(
            "draining (%s): %d open stream(s), grace %.1fs", reason, len(self._streams), grace
        )
        for stream in self._streams:
            stream.drain.set()

    async def drained(self, timeout_s: float) -> bool:
        """Wait until no stream is open, at most `timeout_s`; whether none is."""
        if self._streams_changed is None:
            self._streams_changed = asyncio.Event()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._streams:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            self._streams_changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._streams_changed.wait(), min(remaining, 0.25))
        return True

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    async def GetMaterializerInfo(
        self, request, context
    ) -> materializer_pb2.GetMaterializerInfoResponse:
        probe = materializer_pb2.ARENA_PROBE_RESULT_UNSPECIFIED
        if request.arena_probe:
            probe = _PROBE_RESULTS[probe_arena(request.arena_probe, self.reader.prefix)]
        return materializer_pb2.GetMaterializerInfoResponse(
            implementation=self.implementation,
            version=self.version,
            contract=CONTRACT,
            supports_shm=True,
            supports_inline=True,
            shm_prefix=self.reader.prefix,
            active_streams=self.counters.active_streams,
            steps_materialized=self.counters.steps_materialized,
            steps_failed=self.counters.steps_failed,
            instance_id=self.instance_id,
            start_time_unix_ms=self.start_time_unix_ms,
            contract_version=CONTRACT_VERSION,
            supports_drain=True,
            draining=self.draining,
            arena_probe=probe,
        )

    def close(self) -> None:
        """Release threads and mappings (called once the server has stopped). Idempotent."""
        if self._released:
            return
        self._released = True
        self._threads.shutdown(wait=False, cancel_futures=True)
        self.reader.close()
        logger.info("materializer %s closed: %s", self.implementation, self.counters.as_dict())


@register("reference")
def _factory(config: MaterializerConfig) -> ReferenceMaterializer:
    return ReferenceMaterializer(config)
