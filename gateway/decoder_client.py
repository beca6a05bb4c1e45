"""The gateway's client of `DecoderService`: one channel, cached decoder info, error translation.

Decoder failures reach the gateway as `grpc.aio.AioRpcError`; `decoder_error`
turns them into the shared exception types (with the decoder named in the
message) so the servicer and the HTTP facade map them through one table.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass

import grpc

from omni_common.errors import (
    AbortedError,
    AlreadyExistsError,
    DeadlineExceededError,
    FailedPreconditionError,
    NotFoundError,
    OmniError,
    ResourceExhaustedError,
    UnavailableError,
)
from omni_common.server import client_options, client_target
from omni_serving.v1 import decoder_pb2, decoder_pb2_grpc

logger = logging.getLogger(__name__)

DEFAULT_SAMPLE_RATE_HZ = 24000
"""Rate assumed when the decoder does not report one."""


class DecoderRejectedError(OmniError):
    """The decoder refused a request as malformed (its message names the field)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


_ERRORS_BY_CODE: dict[grpc.StatusCode, type[OmniError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: DecoderRejectedError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExistsError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.ABORTED: AbortedError,
    grpc.StatusCode.CANCELLED: AbortedError,
}


def decoder_error(exc: grpc.aio.AioRpcError, target: str) -> OmniError:
    """The shared exception for a failed decoder call; unknown codes become INTERNAL."""
    cls = _ERRORS_BY_CODE.get(exc.code(), OmniError)
    return cls(f"decoder at {target}: {exc.code().name}: {exc.details()}")


@dataclass(frozen=True)
class DecoderInfo:
    """What the gateway needs from `GetDecoderInfo`."""

    voices: tuple[str, ...]
    sample_rate_hz: int
    active_requests: int = 0
    profile: str = ""

    @classmethod
    def from_pb(cls, pb: decoder_pb2.GetDecoderInfoResponse) -> DecoderInfo:
        return cls(
            voices=tuple(pb.voices),
            sample_rate_hz=pb.sample_rate_hz or DEFAULT_SAMPLE_RATE_HZ,
            active_requests=pb.active_requests,
            profile=pb.profile,
        )


class DecoderClient:
    """Calls one decoder. Create it inside the event loop that will use it."""

    def __init__(
        self,
        target: str,
        *,
        info_ttl_s: float = 5.0,
        info_timeout_s: float = 5.0,
        abort_timeout_s: float = 5.0,
    ) -> None:
        self.target = client_target(target)
        # client_options: message size limits matching the servers, and
        # keepalive so a dead decoder is noticed on an idle channel.
        self._channel = grpc.aio.insecure_channel(self.target, options=client_options())
        self._stub = decoder_pb2_grpc.DecoderServiceStub(self._channel)
        self._info_ttl_s = info_ttl_s
        self._info_timeout_s = info_timeout_s
        self._abort_timeout_s = abort_timeout_s
        self._info: DecoderInfo | None = None
        self._info_time = 0.0

    async def info(self, *, refresh: bool = False) -> DecoderInfo:
        """Decoder info, cached for `info_ttl_s` (UnavailableError if unreachable)."""
        now = asyncio.get_running_loop().time()
        if refresh or self._info is None or now - self._info_time > self._info_ttl_s:
            try:
                pb = await self._stub.GetDecoderInfo(
                    decoder_pb2.GetDecoderInfoRequest(), timeout=self._info_timeout_s
                )
            except grpc.aio.AioRpcError as exc:
                raise decoder_error(exc, self.target) from exc
            self._info, self._info_time = DecoderInfo.from_pb(pb), now
        return self._info

    def generate(self, request: decoder_pb2.GenerateRequest) -> grpc.aio.UnaryStreamCall:
        """Start a decoder stream; iterate it, and translate AioRpcError with `decoder_error`."""
        return self._stub.Generate(request)

    async def abort(self, request_ids: Iterable[str]) -> list[str]:
        """Abort requests on the decoder; return those it reports as aborted.

        Used on cleanup paths: a failed call is logged, not raised.
        """
        ids = list(request_ids)
        try:
            response = await self._stub.Abort(
                decoder_pb2.AbortRequest(request_ids=ids), timeout=self._abort_timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            logger.warning("abort of %s on decoder %s failed: %s", ids, self.target, exc.details())
            return []
        return list(response.aborted_request_ids)

    async def close(self) -> None:
        await self._channel.close()


__all__ = [
    "DEFAULT_SAMPLE_RATE_HZ",
    "DecoderClient",
    "DecoderInfo",
    "DecoderRejectedError",
    "decoder_error",
]
