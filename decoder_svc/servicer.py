"""DecoderService servicer: protobuf <-> domain, nothing else.

Errors: an `OmniError` ends a call with the code `grpc_code_for` gives and
its own (short, written for the client) message. Any other exception that
reaches a handler is a bug of ours, a ValueError or KeyError included: the
call ends with INTERNAL and a message naming an error id, under which the
traceback is logged (`log_internal`); its text never reaches the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import zlib
from collections.abc import AsyncIterator

import grpc

from decoder_svc.backend import RequestSpec
from decoder_svc.lengths import DeploymentSettings
from decoder_svc.pipeline import Pipeline
from decoder_svc.requests import Sink
from omni_common.conversation import conversation_from_pb, last_user_text
from omni_common.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    OmniError,
    UnavailableError,
    grpc_code_for,
    log_internal,
)
from omni_common.liveness import Watchdog
from omni_common.media import AudioInput, decode_audio
from omni_common.modality import OutputModality
from omni_common.stop_strings import check_stops
from omni_common.tensor_wire import encode_inline
from omni_serving.v1 import common_pb2, decoder_pb2, decoder_pb2_grpc

logger = logging.getLogger(__name__)

MAX_PROMPT_CHARS = 8192


def spec_from_pb(
    req: decoder_pb2.GenerateRequest, default_modalities: str, settings: DeploymentSettings | None = None
) -> RequestSpec:
    """Validate a GenerateRequest and turn it into a RequestSpec.

    With ``sampling_params.model_defaults``, a temperature, top_p or top_k
    left at 0 takes the model's default (``settings``' default_*) instead of
    meaning greedy / off. The checks that need the deployment (caps,
    modalities, instructions) are the pipeline's (``lengths.check_request``).
    """
    if not req.request_id:
        raise InvalidArgumentError("request_id", "is empty")
    audio_parts = settings.max_input_audio_parts if settings is not None else 0
    image_parts = settings.max_input_image_parts if settings is not None else 0
    messages = (conversation_from_pb(req.messages, MAX_PROMPT_CHARS, max_audio_parts=audio_parts,
                                     max_image_parts=image_parts)
                if req.messages else ())
    if messages:
        if req.prompt:
            raise InvalidArgumentError("messages", "give prompt or messages, not both")
        if req.instructions:
            raise InvalidArgumentError("instructions", "with messages, style instructions are a system turn")
    elif not req.prompt.strip():
        raise InvalidArgumentError("prompt", "is empty")
    if len(req.prompt) > MAX_PROMPT_CHARS:
        raise InvalidArgumentError("prompt", f"has {len(req.prompt)} characters; at most {MAX_PROMPT_CHARS}")
    sp = req.sampling_params
    for name in ("temperature", "top_p", "max_audio_seconds"):
        value = getattr(sp, name)
        if not math.isfinite(value) or value < 0:
            raise InvalidArgumentError(f"sampling_params.{name}", f"must be a finite number >= 0, got {value}")
    if sp.top_p > 1:
        raise InvalidArgumentError("sampling_params.top_p", f"must be in [0, 1] (0 or 1 = off), got {sp.top_p}")
    if sp.top_k < 0:
        raise InvalidArgumentError("sampling_params.top_k", f"must be >= 0 (0 = off), got {sp.top_k}")
    if len(req.instructions) > MAX_PROMPT_CHARS:
        raise InvalidArgumentError(
            "instructions", f"has {len(req.instructions)} characters; at most {MAX_PROMPT_CHARS}"
        )
    temperature, top_p, top_k = sp.temperature, sp.top_p, sp.top_k
    if sp.model_defaults and settings is not None:
        temperature = temperature or settings.default_temperature
        top_p = top_p or settings.default_top_p
        top_k = top_k or settings.default_top_k
    if req.output_modalities:
        modality = OutputModality.from_proto(req.output_modalities)
    else:  # a text spoken as written is audio only, whatever the profile's default
        modality = OutputModality.AUDIO if req.verbatim else OutputModality.from_string(default_modalities)
    if req.verbatim:
        _check_verbatim(req, modality, settings)
    task = "embed" if req.task == common_pb2.REQUEST_TASK_EMBED else "generate"
    return RequestSpec(
        request_id=req.request_id,
        prompt=last_user_text(messages) if messages else req.prompt,
        messages=messages,
        max_tokens=sp.max_tokens,
        temperature=temperature,
        top_p=top_p or 1.0,
        top_k=top_k,
        # unset seed: a stable one derived from the request id
        seed=sp.seed if sp.HasField("seed") else zlib.crc32(req.request_id.encode()),
        voice=req.voice,  # empty: the model's first voice (Pipeline.submit resolves names)
        task=task,
        modality=modality,
        max_audio_seconds=sp.max_audio_seconds,
        first_chunk_frames=sp.first_chunk_frames,
        stop=check_stops(sp.stop),
        instructions=req.instructions.strip(),
        verbatim=req.verbatim,
        language=_language(req.language, settings),
        reference_audio=(AudioInput(req.reference_audio.data, req.reference_audio.format,
                                    req.reference_audio.sample_rate, "reference_audio")
                         if req.HasField("reference_audio") else None),
        reference_text=req.reference_text,
    )


def _language(language: str, settings: DeploymentSettings | None) -> str:
    """A request's language: "" / "auto", or one the model lists (case-insensitive)."""
    lang = language.strip().lower()
    if lang in ("", "auto") or settings is None:
        return lang
    if not settings.languages:
        raise InvalidArgumentError("language", f"this model takes no language (it speaks the text as it is "
                                               f"written); got {language!r}")
    if lang not in settings.languages:
        raise InvalidArgumentError("language", f"unknown language {language!r}; this model speaks: auto, "
                                               f"{', '.join(settings.languages)}")
    return lang


def _check_verbatim(req: decoder_pb2.GenerateRequest, modality: OutputModality,
                    settings: DeploymentSettings | None = None) -> None:
    """A text to speak as written: audio out, one prompt, no instructions
    (unless the speaking stage takes them: a text-to-speech model's voices)."""
    if req.messages:
        raise InvalidArgumentError("messages", "a text spoken as written (verbatim) is one prompt, not a conversation")
    if req.instructions.strip() and not (settings is not None and settings.speech_instructions):
        raise InvalidArgumentError(
            "instructions", "a text spoken as written (verbatim) has no turn to carry style instructions"
        )
    if req.task == common_pb2.REQUEST_TASK_EMBED:
        raise InvalidArgumentError("task", "a text spoken as written (verbatim) is a generation request")
    if modality != OutputModality.AUDIO:
        raise InvalidArgumentError(
            "output_modalities", f"a text spoken as written (verbatim) produces audio only, got {modality.to_string()}"
        )


def voice_pb(info) -> common_pb2.Voice:  # noqa: ANN001
    """A registered voice (``decoder_svc.qwen3_tts.voices.VoiceInfo``) as the API's Voice."""
    return common_pb2.Voice(name=info.name, transcript=info.transcript, duration_seconds=info.seconds,
                            sha256=info.sha256, created_unix=info.created_unix)


@contextlib.asynccontextmanager
async def _answered(context: grpc.aio.ServicerContext, rpc: str) -> AsyncIterator[None]:
    """A unary call's errors: ours end it with their code, anything else is INTERNAL (logged)."""
    try:
        yield
    except OmniError as exc:
        await context.abort(grpc_code_for(exc), str(exc))
    except Exception as exc:  # noqa: BLE001  a bug: INTERNAL, traceback logged under an error id
        await context.abort(grpc.StatusCode.INTERNAL, log_internal(logger, rpc, exc))


def stuck_parts(watchdog: Watchdog) -> list[decoder_pb2.StuckPart]:
    """The watchdog's last look as GetDecoderInfo's stuck_parts: stuck parts, then restarting ones."""
    parts = [decoder_pb2.StuckPart(name=s.name, seconds=s.seconds, limit_s=s.limit_s, description=s.describe())
             for s in watchdog.stuck()]
    parts += [decoder_pb2.StuckPart(name=w.name, restarting=True, description=w.describe())
              for w in watchdog.waiting()]
    return parts


class DecoderServicer(decoder_pb2_grpc.DecoderServiceServicer):
    def __init__(self, pipeline: Pipeline, *, engine: str, materializer_target: str,
                 watchdog: Watchdog | None = None) -> None:
        self.pipeline = pipeline
        self.watchdog = watchdog  # its verdicts go into GetDecoderInfo (stuck_parts, not_live)
        self.engine = engine
        self.materializer_target = materializer_target
        # Generate streams in progress: request id -> its sink (ends the stream)
        self._streams: dict[str, Sink] = {}
        self._closing = False

    async def drain(self, timeout_s: float) -> None:
        """Shutdown: refuse new requests, let the running ones finish for up
        to `timeout_s`, then end the rest with UNAVAILABLE."""
        self._closing = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._streams and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self._streams:
            logger.info("ending %d request stream(s) at shutdown", len(self._streams))
        for sink in list(self._streams.values()):
            sink(UnavailableError("the decoder is shutting down; the request was not finished"))

    async def Generate(
        self, request: decoder_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decoder_pb2.GenerateResponse]:
        try:
            spec = spec_from_pb(request, self.pipeline.profile.default_modalities, self.pipeline.settings)
            if spec.task == "embed":
                backend = self.pipeline.backends[self.pipeline.ar_config.name]
                vector = await asyncio.to_thread(backend.embed, spec)
                yield decoder_pb2.GenerateResponse(
                    request_id=spec.request_id, pooling_output=encode_inline(vector), finished=True, finish_reason="stop"
                )
                return
            if self._closing:
                raise UnavailableError("the decoder is shutting down")
            loop = asyncio.get_running_loop()
            outputs: asyncio.Queue[decoder_pb2.GenerateResponse | OmniError] = asyncio.Queue()

            def sink(resp: decoder_pb2.GenerateResponse | OmniError) -> None:
                if not loop.is_closed():
                    loop.call_soon_threadsafe(outputs.put_nowait, resp)

            # off the event loop: an engine holds its lock for a whole step
            await asyncio.to_thread(self.pipeline.submit, spec, sink)
        except OmniError as exc:
            await context.abort(grpc_code_for(exc), str(exc))
            return
        except Exception as exc:  # noqa: BLE001  a bug: INTERNAL, traceback logged under an error id
            await context.abort(grpc.StatusCode.INTERNAL, log_internal(logger, "Generate", exc))
            return
        finished = False
        self._streams[spec.request_id] = sink
        try:
            while not finished:
                resp = await outputs.get()
                if isinstance(resp, OmniError):  # the request ended with an error
                    # (`finished` stays False: the pipeline frees it, if it still runs)
                    await context.abort(grpc_code_for(resp), str(resp))
                    return
                finished = resp.finished
                yield resp
        finally:
            self._streams.pop(spec.request_id, None)
            if not finished:  # the client went away, or the stream ended early: free the request
                asyncio.get_running_loop().run_in_executor(None, self.pipeline.abort, spec.request_id)

    async def Abort(self, request: decoder_pb2.AbortRequest, context: grpc.aio.ServicerContext) -> decoder_pb2.AbortResponse:
        ids = list(request.request_ids)
        aborted = await asyncio.to_thread(lambda: [rid for rid in ids if self.pipeline.abort(rid)])
        return decoder_pb2.AbortResponse(aborted_request_ids=aborted)

    # -- the voice registry (a voice-clone model's) -----------------------------------
    def _voices(self):  # noqa: ANN202
        store = self.pipeline.voice_store
        if store is None:
            raise FailedPreconditionError("this model does not clone voices: it has no voice registry")
        return store

    async def RegisterVoice(self, request: decoder_pb2.RegisterVoiceRequest,
                            context: grpc.aio.ServicerContext) -> decoder_pb2.RegisterVoiceResponse:
        async with _answered(context, "RegisterVoice"):
            store = self._voices()
            store.check_name(request.name)
            if not request.HasField("audio"):
                raise InvalidArgumentError("audio", "is missing: the reference clip to register")
            part = AudioInput(request.audio.data, request.audio.format, request.audio.sample_rate, "audio")
            clip = await asyncio.to_thread(decode_audio, part, rate=24_000, max_seconds=store.limits.max_seconds)
            info = await asyncio.to_thread(store.register, request.name, clip, request.transcript,
                                           replace=request.replace, field="audio.data")
            return decoder_pb2.RegisterVoiceResponse(voice=voice_pb(info))
        return decoder_pb2.RegisterVoiceResponse()

    async def ListVoices(self, request: decoder_pb2.ListVoicesRequest,
                         context: grpc.aio.ServicerContext) -> decoder_pb2.ListVoicesResponse:
        async with _answered(context, "ListVoices"):
            store = self._voices()
            infos = await asyncio.to_thread(store.list)
            return decoder_pb2.ListVoicesResponse(voices=[voice_pb(i) for i in infos])
        return decoder_pb2.ListVoicesResponse()

    async def DeleteVoice(self, request: decoder_pb2.DeleteVoiceRequest,
                          context: grpc.aio.ServicerContext) -> decoder_pb2.DeleteVoiceResponse:
        async with _answered(context, "DeleteVoice"):
            await asyncio.to_thread(self._voices().delete, request.name)
        return decoder_pb2.DeleteVoiceResponse()

    async def GetDecoderInfo(
        self, request: decoder_pb2.GetDecoderInfoRequest, context: grpc.aio.ServicerContext
    ) -> decoder_pb2.GetDecoderInfoResponse:
        p = self.pipeline
        resp = decoder_pb2.GetDecoderInfoResponse(
            profile=p.profile.name,
            engine=self.engine,
            stages=p.stage_infos(),
            active_requests=p.active_requests,
            materializer_target=self.materializer_target,
            materializer_connected=p.materializer_connected,
            fallback_steps=p.fallback_steps,
            aborted_requests=p.aborted_requests,
            finished_requests=p.finished_requests,
            voices=list(self.pipeline.voices),
            voice_aliases=self.pipeline.voice_aliases,
            sample_rate_hz=self.pipeline.sample_rate,
            output_modalities=p.settings.output_modalities.to_proto(),
            limits=p.settings.limits_pb(),
            supports_instructions=p.settings.supports_instructions,
            model=p.settings.model,
            speech_instructions=p.settings.speech_instructions,
            voice_registry=p.voice_store is not None,
            languages=list(p.settings.languages),
        )
        attachment = p.materializer_attachment()
        if attachment is not None:
            resp.materializer.CopyFrom(attachment)
        arena = p.arena_info()
        if arena is not None:
            (resp.arena.region, resp.arena.slot_bytes, resp.arena.num_slots,
             resp.arena.slots_in_use, resp.arena.peak_slots_in_use) = arena
        if self.watchdog is not None:
            resp.stuck_parts.extend(stuck_parts(self.watchdog))
            resp.not_live = not self.watchdog.live
        return resp
