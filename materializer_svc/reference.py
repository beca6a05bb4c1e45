"""The reference materializer: one stream, steps built in order on a thread.

The servicer is thin: it opens a `StreamSession` from the first message,
hands each snapshot to `StreamSession.materialize` on a worker thread (the
readiness wait and the copies block), and yields the answers in arrival
order. A bad step is a StepError in the stream; only a broken stream
protocol (no `open` first, `open` twice) ends the call.

Subclasses change the strategy by overriding `answers` (see pool.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import grpc

from materializer_svc.registry import MaterializerConfig, register
from materializer_svc.session import MaterializerCounters, StreamSession, session_from_first
from omni_common.errors import InvalidArgumentError, OmniError, grpc_code_for
from omni_common.shm_arena import ArenaReader
from omni_serving.v1 import materializer_pb2, materializer_pb2_grpc, snapshot_pb2

logger = logging.getLogger(__name__)
VERSION = "0.2.0"
CONTRACT = "omni_serving.v1"

# Threads that run steps. Each stream uses one at a time; a step may hold
# its thread for up to the stream's readiness timeout.
_STEP_THREADS = 32


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
        try:
            session = await self.open_session(it)
        except OmniError as exc:
            self.counters.streams_refused += 1
            await context.abort(grpc_code_for(exc), str(exc))
            return
        self.counters.streams_opened += 1
        self.counters.active_streams += 1
        logger.info("stream from %r opened: stages %s", session.client_name, sorted(session.plans))
        protocol_error: OmniError | None = None
        try:
            async for resp in self.answers(session, it):
                self.count(resp, session.took(resp))
                yield resp
        except OmniError as exc:
            protocol_error = exc
        except asyncio.CancelledError:
            self.counters.streams_cancelled += 1
            raise
        finally:
            self.counters.active_streams -= 1
        if protocol_error is not None:
            await context.abort(grpc_code_for(protocol_error), str(protocol_error))

    async def GetMaterializerInfo(
        self, request, context
    ) -> materializer_pb2.GetMaterializerInfoResponse:
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
