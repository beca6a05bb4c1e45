"""`OmniGatewayService`: protobuf in, domain calls, protobuf out. No business logic here.

Errors: every exception the domain raises for a client (`OmniError`, and a
decoder `RpcError` should one escape) is mapped by `grpc_code_for` and ends
the call with `context.abort(code, public_message(exc))`: a bounded,
sanitized message. Any other exception is a bug (a ValueError or KeyError
of ours included): its traceback is logged under an error id and the
client gets INTERNAL with a generic message naming that id (never UNKNOWN,
never the exception's text; `omni_common.errors.log_internal`). A request that does not parse never reaches these
methods (`MalformedRequestInterceptor` answers it with INVALID_ARGUMENT).
A cancelled call raises `asyncio.CancelledError` through the handler (a
write that fails because the client went away is one too, and is counted
CANCELLED, not logged as a bug);
closing the engine's stream (``aclosing``) sends `Abort` to the decoder.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

import grpc

from gateway import metrics
from gateway.decoder_client import DecoderInfo
from gateway.engine import GatewayEngine
from gateway.realtime import serve_grpc as serve_realtime
from gateway.speak_stream import serve_grpc as serve_speak_stream
from gateway.validation import (
    check_instructions,
    check_reference_audio,
    check_response_size,
    generation_request_from_pb,
    speech_request_from_pb,
)
from omni_common.errors import (
    CLIENT_ERRORS,
    InvalidArgumentError,
    OmniError,
    grpc_code_for,
    log_internal,
    public_message,
)
from omni_common.server import cancelled_by_client
from omni_serving.v1 import gateway_pb2, gateway_pb2_grpc, payload_pb2

logger = logging.getLogger(__name__)

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["OmniGatewayService"].full_name


class OmniGatewayService(gateway_pb2_grpc.OmniGatewayServiceServicer):
    """The client-facing gRPC API over a `GatewayEngine`."""

    def __init__(self, engine: GatewayEngine) -> None:
        self._engine = engine

    async def Generate(
        self,
        request: gateway_pb2.OmniGatewayServiceGenerateRequest,
        context: grpc.aio.ServicerContext,
    ) -> None:
        async with _served(context, "Generate"):
            params = generation_request_from_pb(request, self._engine.limits)
            async with contextlib.aclosing(self._engine.generate(params)) as outputs:
                async for output in outputs:
                    response = gateway_pb2.OmniGatewayServiceGenerateResponse(output=output.to_pb())
                    check_response_size(
                        response.ByteSize(), params.output_kind, self._engine.limits
                    )
                    await context.write(response)

    async def Speak(
        self, request: gateway_pb2.SpeakRequest, context: grpc.aio.ServicerContext
    ) -> None:
        async with _served(context, "Speak"):
            params = speech_request_from_pb(request, self._engine.limits)
            async with contextlib.aclosing(self._engine.speak(params)) as chunks:
                async for chunk in chunks:
                    await context.write(chunk.to_pb())

    async def SpeakStream(
        self,
        requests: AsyncIterator[gateway_pb2.SpeakStreamRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        """Text in, audio out, on one call (`gateway.speak_stream`)."""
        async with _served(context, "SpeakStream"):
            await serve_speak_stream(self._engine, requests, context)

    async def Realtime(
        self,
        requests: AsyncIterator[gateway_pb2.RealtimeRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        """A realtime voice session (`gateway.realtime`)."""
        async with _served(context, "Realtime"):
            await serve_realtime(self._engine, requests, context)

    async def RegisterVoice(
        self, request: gateway_pb2.OmniGatewayServiceRegisterVoiceRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.OmniGatewayServiceRegisterVoiceResponse:
        response = gateway_pb2.OmniGatewayServiceRegisterVoiceResponse()
        async with _served(context, "RegisterVoice"):
            audio = check_reference_audio(request.audio if request.HasField("audio") else None, "audio")
            if audio is None:
                raise InvalidArgumentError("audio", "is missing: the reference clip to register")
            transcript = check_instructions(request.transcript, self._engine.limits, "transcript")
            response.voice.CopyFrom(await self._engine.register_voice(request.name, audio, transcript,
                                                                      request.replace))
        return response

    async def ListVoices(
        self, request: gateway_pb2.OmniGatewayServiceListVoicesRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.OmniGatewayServiceListVoicesResponse:
        response = gateway_pb2.OmniGatewayServiceListVoicesResponse()
        async with _served(context, "ListVoices"):
            response.voices.extend(await self._engine.list_voices())
        return response

    async def DeleteVoice(
        self, request: gateway_pb2.OmniGatewayServiceDeleteVoiceRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.OmniGatewayServiceDeleteVoiceResponse:
        async with _served(context, "DeleteVoice"):
            await self._engine.delete_voice(request.name)
        return gateway_pb2.OmniGatewayServiceDeleteVoiceResponse()

    async def ListModels(
        self, request: gateway_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.ListModelsResponse:
        response = gateway_pb2.ListModelsResponse()
        async with _served(context, "ListModels"):
            response.models.append(model_card(await self._engine.decoder_info()))
        return response


def model_card(info: DecoderInfo) -> gateway_pb2.ModelCard:
    """The deployment as clients see it, from the decoder's info (id: the model's name)."""
    card = gateway_pb2.ModelCard(
        id=info.model or info.profile,
        profile=info.profile,
        output_modalities=[
            payload_pb2.OutputModality.Value(f"OUTPUT_MODALITY_{name.upper()}")
            for name in info.output_modalities
        ],
        voices=list(info.voices),
        voice_aliases=info.voice_aliases,
        sample_rate_hz=info.sample_rate_hz,
        supports_instructions=info.supports_instructions,
        speech_instructions=info.speech_instructions,
        voice_registry=info.voice_registry,
        languages=list(info.languages),
    )
    card.limits.CopyFrom(info.limits)
    return card


@contextlib.asynccontextmanager
async def _served(context: grpc.aio.ServicerContext, api: str) -> AsyncIterator[None]:
    """One call of `api`: counted by outcome; client errors end it with their
    code, a bug with INTERNAL (`_abort`), a cancellation as CANCELLED."""
    try:
        yield
    except CLIENT_ERRORS as exc:
        await _abort(context, api, exc)
    except asyncio.CancelledError:
        metrics.REQUESTS.labels(api=api, code="CANCELLED").inc()
        raise
    except Exception as exc:  # noqa: BLE001  a bug: logged with its traceback, INTERNAL
        if await cancelled_by_client(context, exc):  # a write after the client went away
            metrics.REQUESTS.labels(api=api, code="CANCELLED").inc()
            raise asyncio.CancelledError(f"{api}: cancelled by the client") from exc
        await _abort(context, api, exc, bug=True)
    else:
        metrics.REQUESTS.labels(api=api, code="OK").inc()


async def _abort(
    context: grpc.aio.ServicerContext, api: str, exc: BaseException, *, bug: bool = False
) -> None:
    """End the call with the status `grpc_code_for` picks (raises grpc's AbortError).

    A `bug` (an exception outside `CLIENT_ERRORS`) is INTERNAL whatever its
    type: a ValueError from our own code is not the client's mistake.
    """
    code = grpc.StatusCode.INTERNAL if bug else grpc_code_for(exc)
    if not isinstance(code, grpc.StatusCode) or code in (
        grpc.StatusCode.OK,
        grpc.StatusCode.UNKNOWN,
    ):
        code = grpc.StatusCode.INTERNAL
    if code is grpc.StatusCode.INTERNAL and not isinstance(exc, OmniError):
        message = log_internal(logger, api, exc)
    elif code is grpc.StatusCode.INTERNAL:
        logger.error("%s failed", api, exc_info=exc)
        message = public_message(exc)
    else:
        logger.info("%s refused: %s: %s", api, code.name, exc)
        message = public_message(exc)
    metrics.REQUESTS.labels(api=api, code=code.name).inc()
    await context.abort(code, message)


def registrar(engine: GatewayEngine) -> Callable[[grpc.aio.Server], None]:
    """The `register` callback for `omni_common.server.build_server` / `serve`."""

    def register(server: grpc.aio.Server) -> None:
        gateway_pb2_grpc.add_OmniGatewayServiceServicer_to_server(
            OmniGatewayService(engine), server
        )

    return register


__all__ = ["CLIENT_ERRORS", "SERVICE_NAME", "OmniGatewayService", "model_card", "registrar"]
