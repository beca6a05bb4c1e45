"""The reference materializer: one stream, steps built in order on a thread."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from materializer_svc.registry import MaterializerConfig, register
from materializer_svc.session import StreamSession
from omni_common.errors import InvalidArgumentError, OmniError, grpc_code_for
from omni_common.shm_arena import ArenaReader
from omni_serving.v1 import materializer_pb2, materializer_pb2_grpc

logger = logging.getLogger(__name__)
VERSION = "0.1.0"


class ReferenceMaterializer(materializer_pb2_grpc.MaterializerServiceServicer):
    implementation = "reference"

    def __init__(self, config: MaterializerConfig) -> None:
        self.config = config
        self.reader = ArenaReader(config.shm_prefix)
        self.active_streams = 0
        self.steps_materialized = 0
        self.steps_failed = 0

    async def open_session(self, it: AsyncIterator[materializer_pb2.MaterializeRequest]) -> StreamSession:
        first = await anext(it, None)
        if first is None:
            raise InvalidArgumentError("open", "stream closed before the open message")
        if first.WhichOneof("kind") != "open":
            raise InvalidArgumentError("open", "the first message of a Materialize stream must be `open`")
        return StreamSession(first.open, self.reader, default_readiness_timeout_ms=self.config.readiness_timeout_ms)

    def count(self, resp: materializer_pb2.MaterializeResponse) -> None:
        if resp.WhichOneof("kind") == "step":
            self.steps_materialized += 1
        else:
            self.steps_failed += 1

    async def Materialize(self, request_iterator, context: grpc.aio.ServicerContext):
        it = aiter(request_iterator)
        try:
            session = await self.open_session(it)
        except OmniError as exc:
            await context.abort(grpc_code_for(exc), str(exc))
            return
        self.active_streams += 1
        try:
            async for req in it:
                if req.WhichOneof("kind") != "snapshot":
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "open: sent twice on one stream")
                    return
                # Blocking work (readiness wait, copies) off the event loop.
                resp = await asyncio.to_thread(session.materialize, req.snapshot)
                self.count(resp)
                yield resp
        finally:
            self.active_streams -= 1

    async def GetMaterializerInfo(self, request, context) -> materializer_pb2.GetMaterializerInfoResponse:
        return materializer_pb2.GetMaterializerInfoResponse(
            implementation=self.implementation,
            version=VERSION,
            contract="omni_serving.v1",
            supports_shm=True,
            supports_inline=True,
            shm_prefix=self.reader.prefix,
            active_streams=self.active_streams,
            steps_materialized=self.steps_materialized,
            steps_failed=self.steps_failed,
        )


@register("reference")
def _factory(config: MaterializerConfig) -> ReferenceMaterializer:
    return ReferenceMaterializer(config)
