"""The gateway's client of `DecoderService`: one channel, cached decoder info, error translation.

Decoder failures reach the gateway as `grpc.aio.AioRpcError`; `decoder_error`
turns them into the shared exception types so the servicer and the HTTP
facade map them through one table. What the client sees starts with
``decoder: CODE:`` and is sanitized (no decoder address, paths or class
names); a decoder failure that is not a known condition (UNKNOWN, INTERNAL,
...) reaches the client as INTERNAL with a generic message, and its details
only the gateway's log.

The channel reconnects fast (`fast_reconnect_options`): a restarted decoder
is reachable again about a second after it listens. `probe` is the health
check `DecoderMonitor` (gateway.health) runs on the same channel. With
several decoders, `gateway.replicas.ReplicaPool` holds one client per
decoder.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from omni_common.errors import (
    AbortedError,
    AlreadyExistsError,
    DeadlineExceededError,
    FailedPreconditionError,
    NotFoundError,
    OmniError,
    OutOfRangeError,
    ResourceExhaustedError,
    UnavailableError,
    sanitize_message,
)
from omni_common.server import client_options, client_target, fast_reconnect_options
from omni_serving.v1 import common_pb2, decoder_pb2, decoder_pb2_grpc, payload_pb2

logger = logging.getLogger(__name__)

DEFAULT_SAMPLE_RATE_HZ = 24000
"""Rate assumed when the decoder does not report one."""


_DECODER_DETAILS_CHARS = 400
_FIELD = re.compile(r"([A-Za-z_][\w.\[\]]*): ")


class DecoderRejectedError(OmniError):
    """The decoder refused a request as malformed (its message names the field)."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class DecoderFailedError(OmniError):
    """The decoder failed a request for a reason that is not the client's (INTERNAL)."""


_ERRORS_BY_CODE: dict[grpc.StatusCode, type[OmniError]] = {
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExistsError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.ABORTED: AbortedError,
    grpc.StatusCode.CANCELLED: AbortedError,
    grpc.StatusCode.OUT_OF_RANGE: OutOfRangeError,
}


def decoder_error(exc: grpc.aio.AioRpcError, target: str) -> OmniError:
    """The shared exception for a failed decoder call, with a message fit for the client.

    Known conditions keep their code and the decoder's sanitized details
    (``decoder: INVALID_ARGUMENT: text: is 5000 tokens ...``). UNKNOWN,
    INTERNAL and any other code become INTERNAL with a generic message; the
    details are logged here, with the decoder's address.
    """
    code = exc.code()
    details = exc.details() or ""
    name = code.name if isinstance(code, grpc.StatusCode) else str(code)
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        text = sanitize_message(details, _DECODER_DETAILS_CHARS)
        match = _FIELD.match(text)
        return DecoderRejectedError(
            f"decoder: INVALID_ARGUMENT: {text}", match.group(1) if match else None
        )
    cls = _ERRORS_BY_CODE.get(code) if isinstance(code, grpc.StatusCode) else None
    if cls is None:
        logger.error("decoder at %s failed a call: %s: %s", target, name, details)
        return DecoderFailedError(
            f"decoder: failed the request ({name}); the gateway log has the details"
        )
    logger.info("decoder at %s answered %s: %s", target, name, details)
    return cls(f"decoder: {name}: {sanitize_message(details, _DECODER_DETAILS_CHARS)}")


@dataclass(frozen=True)
class DecoderInfo:
    """What the gateway needs from `GetDecoderInfo`."""

    voices: tuple[str, ...]
    sample_rate_hz: int
    active_requests: int = 0
    profile: str = ""
    fallback_steps: int = 0
    finished_requests: int = 0
    output_modalities: tuple[str, ...] = ()
    """What the deployment can produce, lower-case names ("text", "audio", ...);
    empty when the decoder does not say (an older decoder)."""
    limits: common_pb2.DeploymentLimits = field(default_factory=common_pb2.DeploymentLimits)
    supports_instructions: bool = False
    model: str = ""
    engine_settings: dict[str, dict[str, str]] = field(default_factory=dict)
    """The stages' engine settings as built (code2wav: device and dtype), by stage name (`StageInfo.engine_settings`)."""
    voice_aliases: dict[str, str] = field(default_factory=dict)
    """Other voice names the decoder accepts, each to one of `voices` ("default", OpenAI's names)."""
    speech_instructions: bool = False
    """Speak takes style instructions (a text-to-speech model's)."""
    voice_registry: bool = False
    """The model clones voices: reference clips, and registered voices by name."""
    languages: tuple[str, ...] = ()
    """Languages a request may name besides "auto"."""

    @classmethod
    def from_pb(cls, pb: decoder_pb2.GetDecoderInfoResponse) -> DecoderInfo:
        limits = common_pb2.DeploymentLimits()
        limits.CopyFrom(pb.limits)
        return cls(
            voices=tuple(pb.voices),
            sample_rate_hz=pb.sample_rate_hz or DEFAULT_SAMPLE_RATE_HZ,
            active_requests=pb.active_requests,
            profile=pb.profile,
            fallback_steps=pb.fallback_steps,
            finished_requests=pb.finished_requests,
            output_modalities=tuple(
                payload_pb2.OutputModality.Name(m).removeprefix("OUTPUT_MODALITY_").lower()
                for m in pb.output_modalities
                if m != payload_pb2.OUTPUT_MODALITY_UNSPECIFIED
            ),
            limits=limits,
            supports_instructions=pb.supports_instructions,
            model=pb.model,
            engine_settings={st.name: dict(st.engine_settings) for st in pb.stages if st.engine_settings},
            voice_aliases=dict(sorted(pb.voice_aliases.items())),
            speech_instructions=pb.speech_instructions,
            voice_registry=pb.voice_registry,
            languages=tuple(pb.languages),
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
        options: Sequence[tuple[str, int | str]] = (),
    ) -> None:
        self.target = client_target(target)
        # client_options: message size limits matching the servers, and
        # keepalive so a dead decoder is noticed on an idle channel.
        # fast_reconnect_options: back within ~1 s of a restarted decoder.
        # `options`: more channel arguments (the replica pool pins pick_first).
        channel_options: list[tuple[str, int | str]] = [
            *client_options(),
            *fast_reconnect_options(),
            *options,
        ]
        self._channel = grpc.aio.insecure_channel(self.target, options=channel_options)
        self._stub = decoder_pb2_grpc.DecoderServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._info_ttl_s = info_ttl_s
        self._info_timeout_s = info_timeout_s
        self._abort_timeout_s = abort_timeout_s
        self._info: DecoderInfo | None = None
        self._info_time = 0.0

    async def info(self, *, refresh: bool = False, timeout_s: float | None = None) -> DecoderInfo:
        """Decoder info, cached for `info_ttl_s` (UnavailableError if unreachable)."""
        now = asyncio.get_running_loop().time()
        if refresh or self._info is None or now - self._info_time > self._info_ttl_s:
            try:
                pb = await self._stub.GetDecoderInfo(
                    decoder_pb2.GetDecoderInfoRequest(),
                    timeout=self._info_timeout_s if timeout_s is None else timeout_s,
                )
            except grpc.aio.AioRpcError as exc:
                raise decoder_error(exc, self.target) from exc
            self._info, self._info_time = DecoderInfo.from_pb(pb), now
        return self._info

    async def probe(self, timeout_s: float) -> str | None:
        """One health check of the decoder; None if it is SERVING, else why not.

        Uses grpc.health.v1 on the request channel, so it also exercises the
        channel's reconnects. A decoder without the health service counts as
        up when it answers `GetDecoderInfo` (which also refreshes the cache).
        """
        try:
            response = await self._health.Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() is not grpc.StatusCode.UNIMPLEMENTED:
                return f"{exc.code().name}: {exc.details()}"
        else:
            if response.status == health_pb2.HealthCheckResponse.SERVING:
                return None
            return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
        try:
            await self.info(refresh=True, timeout_s=timeout_s)
        except OmniError as exc:
            return str(exc)
        return None

    def connected(self) -> bool:
        """True while the channel holds a live connection (READY)."""
        return self._channel.get_state(try_to_connect=False) is grpc.ChannelConnectivity.READY

    async def voices(self, rpc: str, request: Any, timeout_s: float = 120.0) -> Any:
        """A voice-registry call (``RegisterVoice``, ``ListVoices``, ``DeleteVoice``) on the decoder."""
        try:
            return await getattr(self._stub, rpc)(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise decoder_error(exc, self.target) from exc

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
    "DecoderFailedError",
    "DecoderInfo",
    "DecoderRejectedError",
    "decoder_error",
]
