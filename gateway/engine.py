"""The gateway's request orchestration, shared by the gRPC servicer and the HTTP facade.

`GatewayEngine` admits a request (bounded concurrency), checks it against the
decoder's info, picks a decoder replica (`gateway.replicas`), streams that
decoder's outputs through the one `OutputProcessor`, and hands every result
to clients through `wrap_output`. When a stream ends without its final
output (client cancel, error, consumer stopped reading), the decoder it ran
on is told to `Abort` that request; not when the decoder was unreachable
(UNAVAILABLE), since its stream is gone and an Abort could only wait.

Consumers must close the async generators they iterate (``contextlib.aclosing``)
so the abort happens when they stop, not when the generator is collected.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace

import grpc

from gateway import metrics
from gateway.audio import AUDIO_KEY, SAMPLE_RATE_KEY, AudioChunk, pcm16le
from gateway.decoder_client import DecoderClient, DecoderInfo, decoder_error
from gateway.liveness import debug_stall
from gateway.output_processor import OutputKind, OutputProcessor
from gateway.outputs import DecoderOutputError, OmniRequestOutput, RequestMetrics, wrap_output
from gateway.replicas import Assignment, Replica, ReplicaPool
from gateway.validation import (
    GenerationRequest,
    Limits,
    SpeechRequest,
    check_against_decoder,
    check_language_against,
    check_sample_rate,
    check_voice,
    decoder_request,
)
from omni_common.errors import (
    AlreadyExistsError,
    InvalidArgumentError,
    ResourceExhaustedError,
    UnavailableError,
)
from omni_common.modality import OutputModality
from omni_serving.v1 import common_pb2, decoder_pb2

logger = logging.getLogger(__name__)

DEFAULT_MAX_CONCURRENT = 64


class Admission:
    """At most `limit` client streams at once; the next one is refused, not queued."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise InvalidArgumentError("max_concurrent", f"must be >= 1, got {limit}")
        self.limit = limit
        self.active = 0

    @contextlib.contextmanager
    def slot(self) -> Iterator[None]:
        # No await between the check and the increment: one event loop, no race.
        if self.active >= self.limit:
            raise ResourceExhaustedError(
                f"the gateway is serving its limit of {self.limit} concurrent streams; retry later"
            )
        self.active += 1
        metrics.ACTIVE_STREAMS.inc()
        try:
            yield
        finally:
            self.active -= 1
            metrics.ACTIVE_STREAMS.dec()


class GatewayEngine:
    """Runs client requests on the gateway's decoders. Create it inside its event loop.

    `decoder` is the `ReplicaPool` (or one `DecoderClient`, which becomes a
    pool of one). Each request's stream goes to the replica the pool picks
    and stays there; a stream that fails to start because its replica is
    unreachable (UNAVAILABLE before any response) is started once more on
    another healthy replica.
    """

    def __init__(
        self,
        decoder: ReplicaPool | DecoderClient,
        *,
        limits: Limits | None = None,
        max_concurrent: int = DEFAULT_MAX_CONCURRENT,
        processor: OutputProcessor | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pool = decoder if isinstance(decoder, ReplicaPool) else ReplicaPool.of_client(decoder)
        self.limits = limits or Limits()
        self.admission = Admission(max_concurrent)
        self.processor = processor or OutputProcessor(clock=clock)
        self._aborting: set[str] = set()  # ids whose Abort the decoder has not answered yet
        self._clock = clock
        # Room for a SpeakResponse's other fields (ids, metrics) next to its audio.
        self._max_chunk_audio_bytes = max(2, (self.limits.max_response_bytes - 4096) // 2 * 2)

    async def decoder_info(self) -> DecoderInfo:
        return await self.pool.info()

    # -- the voice registry (a voice-clone model's; docs/voices.md) --------------------------
    async def register_voice(self, name: str, audio: common_pb2.AudioContent, transcript: str = "",
                             replace: bool = False) -> common_pb2.Voice:
        """Register a reference clip on the decoder (which encodes it once); every replica
        shares the registry's directory, so one replica registers it for all."""
        request = decoder_pb2.RegisterVoiceRequest(name=name, transcript=transcript, replace=replace)
        request.audio.CopyFrom(audio)
        response = await self.pool.pick().client.voices("RegisterVoice", request)
        return response.voice

    async def list_voices(self) -> list[common_pb2.Voice]:
        response = await self.pool.pick().client.voices("ListVoices", decoder_pb2.ListVoicesRequest())
        return list(response.voices)

    async def delete_voice(self, name: str) -> None:
        await self.pool.pick().client.voices("DeleteVoice", decoder_pb2.DeleteVoiceRequest(name=name))

    async def generate(self, request: GenerationRequest, *, admitted: bool = False) -> AsyncIterator[OmniRequestOutput]:
        """Stream a Generate request's outputs (per its output kind) in an
        admission slot of its own, or in the caller's (`admitted`: a realtime
        session holds one for its whole life)."""
        with contextlib.nullcontext() if admitted else self.admission.slot():
            info = await self.pool.info()
            check_against_decoder(
                info,
                modality=request.output_modality,
                sampling_params=request.sampling_params,
                instructions=request.instructions,
                conversation=request.messages,
            )
            voice = await self.resolve_voice(request.voice, info)
            upstream = decoder_request(
                request.request_id,
                request.prompt,
                request.output_modality,
                voice,
                request.sampling_params,
                request.instructions,
                request.messages,
            )
            async for output in self._stream(
                upstream, request.output_modality, request.output_kind
            ):
                yield output

    async def speak(self, request: SpeechRequest) -> AsyncIterator[AudioChunk]:
        """Stream PCM16 chunks, numbered from 0; the last has `final=True` and full metrics."""
        start = self._clock()
        with self.admission.slot():
            debug_stall(request.text)  # a test hook; nothing unless OMNI_DEBUG_GATEWAY_STALL is set
            info = await self.pool.info()
            check_against_decoder(
                info,
                modality=OutputModality.AUDIO,
                sampling_params=request.sampling_params,
                instructions=request.instructions,
                verbatim=True,
            )
            voice = await self.resolve_voice(request.voice, info)
            check_language_against(request.language, info)
            rate = check_sample_rate(request.sample_rate_hz, info)
            upstream = decoder_request(
                request.request_id, request.text, OutputModality.AUDIO, voice, request.sampling_params,
                request.instructions, verbatim=True, language=request.language,
                reference_audio=request.reference_audio, reference_text=request.reference_text,
            )
            sequence = samples = 0
            first_packet: float | None = None
            async for output in self._stream(upstream, OutputModality.AUDIO, OutputKind.DELTA):
                payload = output.multimodal
                audio = b""
                if payload is not None:
                    rate = int(payload.metadata.get(SAMPLE_RATE_KEY, rate))
                    tensor = payload.tensors.get(AUDIO_KEY)
                    if tensor is not None:
                        audio = pcm16le(tensor)
                if not audio and not output.finished:
                    continue
                # A decoder step may carry more audio than one response may: split it.
                pieces = _split(audio, self._max_chunk_audio_bytes)
                for index, piece in enumerate(pieces):
                    final = output.finished and index == len(pieces) - 1
                    now = self._clock()
                    if piece and first_packet is None:
                        first_packet = now
                        metrics.TTFP_SECONDS.observe(now - start)
                    samples += len(piece) // 2
                    chunk_metrics = _speech_metrics(
                        output.metrics, start, first_packet, now, samples, rate
                    )
                    if final and chunk_metrics.rtf:
                        metrics.RTF.observe(chunk_metrics.rtf)
                    yield AudioChunk(
                        request_id=request.request_id,
                        sequence_number=sequence,
                        audio=piece,
                        sample_rate_hz=rate,
                        final=final,
                        metrics=chunk_metrics,
                        finish_reason=output.finish_reason if final else "",
                    )
                    sequence += 1

    async def resolve_voice(self, voice: str, info: DecoderInfo, field: str = "voice") -> str:
        """The decoder's voice for `voice` (`check_voice`), refreshing the cached
        decoder info once before refusing it; a refusal names `field`."""
        try:
            return check_voice(voice, info, field)
        except InvalidArgumentError:
            return check_voice(voice, await self.pool.info(refresh=True), field)

    async def _stream(
        self, upstream: decoder_pb2.GenerateRequest, modality: OutputModality, kind: OutputKind
    ) -> AsyncIterator[OmniRequestOutput]:
        """One decoder stream through the output processor; aborts it unless it finished."""
        request_id = upstream.request_id
        if request_id in self._aborting:
            raise AlreadyExistsError(f"request_id: {request_id!r} is still being aborted")
        self.processor.add_request(request_id, modality, kind)
        assignment: Assignment | None = None
        call: grpc.aio.UnaryStreamCall | None = None
        finished = unreachable = False
        try:
            replica = self.pool.pick()
            retried = False
            while True:
                assignment = self.pool.begin(request_id, replica)
                call = replica.client.generate(upstream)
                answered = False
                try:
                    async for response in call:
                        answered = True
                        result = self.processor.process_outputs((response,))
                        for failure in result.failures:
                            raise failure.error
                        for engine_output in result.outputs:
                            finished = engine_output.finished
                            yield wrap_output(engine_output, engine_output.stage_id, modality)
                except grpc.aio.AioRpcError as exc:
                    if exc.code() is not grpc.StatusCode.UNAVAILABLE:
                        raise decoder_error(exc, replica.client.target) from exc
                    self.pool.suspect(replica)
                    other = None if answered or retried else self._other(replica)
                    if other is None:  # output was sent, or nowhere else to go
                        unreachable = True
                        raise decoder_error(exc, replica.client.target) from exc
                    logger.info(
                        "request %r: decoder %s is unavailable (%s); starting it on %s",
                        request_id,
                        replica.label,
                        exc.details(),
                        other.label,
                    )
                    self.pool.end(assignment, retried=True)
                    assignment, call, replica, retried = None, None, other, True
                    continue
                break
            if not finished:
                raise DecoderOutputError(
                    f"decoder ended the stream of request {request_id!r} without a final output"
                )
        finally:
            self.processor.abort_requests((request_id,))
            if assignment is not None:
                try:
                    if not finished and not unreachable:
                        if call is not None:
                            call.cancel()
                        # The id stays taken until the decoder has the Abort: a
                        # new request reusing it must not start on the decoder
                        # first and be ended by this Abort (ALREADY_EXISTS instead).
                        self._aborting.add(request_id)
                        # The replica is looked up now; shielded: a second
                        # cancellation must not stop the abort.
                        abort = asyncio.ensure_future(self.pool.abort((request_id,)))
                        abort.add_done_callback(lambda _: self._aborting.discard(request_id))
                        await asyncio.shield(abort)
                finally:
                    self.pool.end(assignment)

    def _other(self, failed: Replica) -> Replica | None:
        """A healthy replica other than `failed` for a retried start, or None."""
        try:
            return self.pool.pick(exclude=(failed,))
        except UnavailableError:
            return None

    async def close(self) -> None:
        await self.pool.close()


def _split(audio: bytes, size: int) -> list[bytes]:
    """`audio` in pieces of at most `size` bytes (one empty piece for no audio)."""
    if len(audio) <= size:
        return [audio]
    return [audio[i : i + size] for i in range(0, len(audio), size)]


def _speech_metrics(
    decoder: RequestMetrics,
    start: float,
    first_packet: float | None,
    now: float,
    samples: int,
    rate: int,
) -> RequestMetrics:
    """Timing as the client sees it: measured at the gateway, from the request's arrival."""
    elapsed_s = now - start
    audio_s = samples / rate if rate else 0.0
    return replace(
        decoder,
        ttfp_ms=0.0 if first_packet is None else (first_packet - start) * 1000.0,
        rtf=elapsed_s / audio_s if audio_s else 0.0,
        audio_seconds=audio_s,
        elapsed_ms=elapsed_s * 1000.0,
    )


__all__ = ["DEFAULT_MAX_CONCURRENT", "Admission", "GatewayEngine"]
