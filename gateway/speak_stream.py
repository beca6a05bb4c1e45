"""SpeakStream: text comes in while audio goes out, on one call (gRPC and WebSocket).

A client sends text pieces as it has them (for example the tokens of a
language model). `Segmenter` cuts the text into segments at sentence and
clause boundaries; each segment is spoken as one decoder request
(``<call id>/<n>``) and its audio streamed back at once.

Segmentation rule (`Segmenter`):

* A **sentence** ends at ``.``, ``!``, ``?`` or ``…`` (a run of them, such
  as ``?!`` or ``...``, and any closing quotes or brackets after it) followed
  by whitespace. A ``.`` does not end a sentence after a known abbreviation
  (``Mr.``, ``Dr.``, ``vs.``, ``approx.``, ... see `ABBREVIATIONS`), after
  initials or dotted abbreviations (``J.``, ``e.g.``, ``i.e.``, ``U.S.``), or
  after a number that is all the segment has so far (a list item ``1.``).
  Decimals (``3.14``), versions and addresses never cut: no whitespace follows
  their dots.
* A **clause** ends at ``,``, ``;`` or ``:`` followed by whitespace, but only
  once the segment has at least `min_clause_chars` (40) characters, so short
  fragments are not spoken alone. The first segment of a call (and the first
  after a cancel) may end at a clause from `first_min_clause_chars` (12)
  characters on, so the first audio comes fast.
* CJK: ``。``, ``！`` and ``？`` end a sentence and ``；`` and ``，`` a clause
  (with the same length rule) without any whitespace after them.
* A blank line (two line breaks) ends a segment.
* A segment never exceeds `max_chars` (200, or the gateway's max text length
  if smaller): a longer run without a boundary is cut at its last whitespace
  within the cap (at the cap if it has none).
* A boundary is only decided once the character after it has arrived, so a
  trailing ``.`` waits for the next piece (it may be ``3.`` of ``3.14``).
  ``flush`` and ``end`` speak what is buffered regardless.
* Segments are stripped of surrounding whitespace. Text without any letter or
  digit is not spoken on its own: a boundary is not cut before the segment
  has one, and such a remainder is dropped at ``flush``/``end``.

Call logic (`SpeakStreamCall`): the first message must be the config (voice,
sample rate and instructions are checked against the decoder then, with the
same functions as Speak); segments are spoken one at a time, in order, with
one voice and one sequence numbering; ``cancel`` aborts the decoder request
in progress at once (the engine's abort path), drops queued segments and
buffered text, and the call stays open; ``end`` (or the client closing its
side of a gRPC call) speaks what is buffered, then ``END`` ends the call. A
call holds one of the gateway's `--max-concurrent` stream slots from start
to end. A client that goes away gets everything aborted.

Each segment runs on the engine's decoder stream (`GatewayEngine._stream`,
what Speak runs inside its admission slot: replica choice, output processor,
abort on early exit), without a slot of its own.

Internally three coroutines share a call: the reader (client messages →
segments), the speaker (segments → decoder → audio events), and the writer
(events → the client, in the caller's task; it alone writes, and numbers
the messages). The speaker's events wait in a short queue, so a cancel
drops whatever the writer has not sent yet: at most the one message being
written goes out after the cancel took effect.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import logging
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace

import grpc

from gateway.audio import AUDIO_KEY, BYTES_PER_SAMPLE, SAMPLE_RATE_KEY, pcm16le
from gateway.engine import GatewayEngine
from gateway.output_processor import OutputKind
from gateway.outputs import RequestMetrics
from gateway.validation import (
    Limits,
    check_against_decoder,
    check_encoding,
    check_instructions,
    check_language,
    check_language_against,
    check_reference_audio,
    check_request_id,
    check_sample_rate,
    check_sample_rate_shape,
    check_sampling_params,
    check_voice,
    check_voice_shape,
    decoder_request,
)
from omni_common.errors import InvalidArgumentError
from omni_common.modality import OutputModality
from omni_serving.v1 import common_pb2, gateway_pb2

logger = logging.getLogger(__name__)

DEFAULT_MAX_SEGMENT_CHARS = 200
DEFAULT_MIN_CLAUSE_CHARS = 40
DEFAULT_FIRST_MIN_CLAUSE_CHARS = 12
MAX_PENDING_EVENTS = 4
"""Audio events the speaker may have waiting for the writer (what a cancel drops)."""
FINISH_ABORT = "abort"
FINISH_STOP = "stop"

# ---------------------------------------------------------------------------
# Segmentation.

SENTENCE_MARKS = frozenset(".!?…")
CLAUSE_MARKS = frozenset(",;:")
CJK_SENTENCE_MARKS = frozenset("。！？")
CJK_CLAUSE_MARKS = frozenset("；，")
CLOSERS = frozenset("\"')]}»”’」』）】")
_OPENERS = "\"'([{«“‘「『（【"
ABBREVIATIONS = frozenset(
    """mr mrs ms mx dr prof sr jr st mt ft vs cf approx fig figs eq inc ltd corp dept
    lt capt sgt gov jan feb apr jun jul aug sep sept oct nov dec""".split()
)
"""Words whose ``.`` does not end a sentence (compared in lower case)."""
_INITIALS = re.compile(r"(?:[^\W\d_]\.)*[^\W\d_]")  # J  e.g  U.S  i.e
_LIST_NUMBER = re.compile(r"\d{1,3}")


def _speakable(text: str) -> bool:
    return any(ch.isalnum() for ch in text)


class Segmenter:
    """Cuts streamed text into segments to speak (the rule is in the module docstring).

    `push` appends text and returns the segments it completed; `flush`
    returns what is left (None if nothing speakable); `clear` drops the
    buffer and makes the next segment a "first" one again.
    """

    def __init__(
        self,
        *,
        max_chars: int = DEFAULT_MAX_SEGMENT_CHARS,
        min_clause_chars: int = DEFAULT_MIN_CLAUSE_CHARS,
        first_min_clause_chars: int = DEFAULT_FIRST_MIN_CLAUSE_CHARS,
    ) -> None:
        if max_chars < 1:
            raise ValueError(f"max_chars must be >= 1, got {max_chars}")
        self.max_chars = max_chars
        self.min_clause_chars = min_clause_chars
        self.first_min_clause_chars = first_min_clause_chars
        self._buf = ""  # never starts with whitespace
        self._scan = 0  # marks before this index are decided (not a cut)
        self._first = True

    @property
    def buffered(self) -> int:
        """Characters waiting for a boundary."""
        return len(self._buf)

    def push(self, text: str) -> list[str]:
        self._buf = (self._buf + text) if self._buf else text.lstrip()
        segments = []
        while (segment := self._next()) is not None:
            if _speakable(segment):  # a forced cut through a run of symbols
                segments.append(segment)
        return segments

    def flush(self) -> str | None:
        text, self._buf, self._scan = self._buf.strip(), "", 0
        if not _speakable(text):
            return None
        self._first = False
        return text

    def clear(self) -> None:
        self._buf, self._scan, self._first = "", 0, True

    def _cut(self, end: int) -> str:
        segment = self._buf[:end].strip()
        self._buf, self._scan, self._first = self._buf[end:].lstrip(), 0, False
        return segment

    def _next(self) -> str | None:
        buf, n = self._buf, len(self._buf)
        i = self._scan
        while i < n:
            ch = buf[i]
            if ch == "\n":
                j = i + 1
                while j < n and buf[j] in " \t\r":
                    j += 1
                if j >= n:
                    break  # undecided: a second line break may follow
                if buf[j] == "\n" and _speakable(buf[:i]):
                    return self._cut(i)
                i = j
                continue
            cjk = ch in CJK_SENTENCE_MARKS or ch in CJK_CLAUSE_MARKS
            if not (cjk or ch in SENTENCE_MARKS or ch in CLAUSE_MARKS):
                i += 1
                continue
            sentence = ch in SENTENCE_MARKS or ch in CJK_SENTENCE_MARKS
            j = i + 1
            if sentence:
                while j < n and (buf[j] in SENTENCE_MARKS or buf[j] in CJK_SENTENCE_MARKS):
                    j += 1
            while j < n and buf[j] in CLOSERS:
                j += 1
            if j >= n:
                break  # undecided until the next character arrives
            if (cjk or buf[j].isspace()) and self._boundary(buf, i, j, sentence):
                return self._cut(j)
            i = j
        self._scan = i
        return self._forced()

    def _boundary(self, buf: str, mark: int, end: int, sentence: bool) -> bool:
        segment = buf[:end].strip()
        if not _speakable(segment):
            return False
        if not sentence:
            least = self.first_min_clause_chars if self._first else self.min_clause_chars
            return len(segment) >= least
        if buf[mark] == "." and (mark + 1 == end or buf[mark + 1] not in SENTENCE_MARKS):
            start = mark
            while start > 0 and not buf[start - 1].isspace():
                start -= 1
            word = buf[start:mark].lstrip(_OPENERS)
            if word.lower() in ABBREVIATIONS or _INITIALS.fullmatch(word):
                return False
            if start == 0 and _LIST_NUMBER.fullmatch(word):
                return False
        return True

    def _forced(self) -> str | None:
        """A segment cut at the cap, when the buffer outgrew it without a boundary."""
        buf = self._buf
        if len(buf) <= self.max_chars:
            return None
        window = buf[: self.max_chars + 1]
        cut = max((k for k, ch in enumerate(window) if ch.isspace()), default=0)
        return self._cut(cut if cut > 0 else self.max_chars)


# ---------------------------------------------------------------------------
# Client messages and server events, independent of the transport.


@dataclass(frozen=True)
class StreamConfig:
    """A validated call config; voice, rate and instructions are checked against the decoder."""

    request_id: str
    voice: str = ""
    sample_rate_hz: int = 0
    sampling_params: common_pb2.SamplingParams | None = None
    instructions: str = ""
    language: str = ""
    reference_audio: common_pb2.AudioContent | None = None  # a voice-clone model's reference clip
    reference_text: str = ""
    voice_field: str = "voice"
    sample_rate_field: str = "sample_rate_hz"
    instructions_field: str = "instructions"
    sampling_params_field: str = "sampling_params"


@dataclass(frozen=True)
class TextPiece:
    text: str


class Control(enum.Enum):
    FLUSH = "flush"
    CANCEL = "cancel"
    END = "end"


ClientMessage = StreamConfig | TextPiece | Control


class EventKind(enum.Enum):
    READY = "ready"
    """The config was accepted (WebSocket only; gRPC sends nothing for it)."""
    AUDIO = "audio"
    SEGMENT_END = "segment_end"
    CANCELLED = "cancelled"
    END = "end"


@dataclass(frozen=True)
class StreamEvent:
    """One thing the client is told; the transport numbers and encodes it."""

    kind: EventKind
    segment: int = 0
    text: str = ""
    """The segment's text: on its first AUDIO event and on SEGMENT_END."""
    audio: bytes = b""
    sample_rate_hz: int = 0
    finish_reason: str = ""
    metrics: RequestMetrics | None = None
    first: bool = False
    """True on the first event of a segment (its first AUDIO, or a SEGMENT_END without audio)."""
    voice: str = ""
    """READY: the voice the call speaks with."""
    segments: int = 0
    """END: segments spoken (started) in the call."""


class ClientGone(Exception):  # noqa: N818  a condition, not an error
    """The client went away (WebSocket closed); the call ends without an answer."""


_CANCEL_MARK = object()
_END_MARK = object()


# ---------------------------------------------------------------------------
# The call.


class SpeakStreamCall:
    """One SpeakStream call over `engine`; `run` drives it until it ends.

    `messages` yields the client's messages, already parsed (a parse error is
    raised from it as an `InvalidArgumentError`); `emit` sends one event to the
    client. The caller holds the admission slot.
    """

    def __init__(
        self,
        engine: GatewayEngine,
        messages: AsyncGenerator[ClientMessage, None],
        *,
        text_field: str = "text",
        config_field: str = "config",
        max_segment_chars: int = DEFAULT_MAX_SEGMENT_CHARS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._engine = engine
        self._messages = messages
        self._text_field = text_field
        self._config_field = config_field
        self._clock = clock
        limits: Limits = engine.limits
        self._max_pending = limits.max_text_chars
        self._segmenter = Segmenter(max_chars=min(max_segment_chars, limits.max_text_chars))
        self.call_id = ""
        self._voice = ""
        self._rate = 0
        self._config: StreamConfig | None = None
        self._segments: collections.deque[object] = collections.deque()
        self._segments_ready = asyncio.Event()
        self._out: asyncio.Queue[object] = asyncio.Queue()
        self._drained = asyncio.Event()
        self._reader: asyncio.Task[None] | None = None
        self._speaker: asyncio.Task[None] | None = None
        self._failed = False
        self._ended = False
        self._next_segment = 0
        # Call metrics (the writer's view).
        self._first_text_at: float | None = None
        self._first_audio_at: float | None = None
        self._samples = 0
        self._started_at = clock()

    # -- the writer ----------------------------------------------------------

    async def run(self, emit: Callable[[StreamEvent], Awaitable[None]]) -> None:
        """Serve the call; returns after END, raises the error that ended it otherwise."""
        self._reader = asyncio.create_task(self._read(), name="speak-stream-reader")
        open_segment: tuple[int, str] | None = None
        open_samples = 0
        try:
            while True:
                item = await self._out.get()
                self._drained.set()
                if isinstance(item, BaseException):
                    raise item
                if item is _CANCEL_MARK:
                    if open_segment is not None:
                        await emit(
                            StreamEvent(
                                EventKind.SEGMENT_END,
                                segment=open_segment[0],
                                text=open_segment[1],
                                finish_reason=FINISH_ABORT,
                                sample_rate_hz=self._rate,
                                metrics=RequestMetrics(
                                    audio_seconds=open_samples / self._rate if self._rate else 0.0
                                ),
                            )
                        )
                        open_segment = None
                    await emit(StreamEvent(EventKind.CANCELLED, sample_rate_hz=self._rate))
                    continue
                assert isinstance(item, StreamEvent)
                if item.kind is EventKind.AUDIO:
                    if item.first:
                        open_segment, open_samples = (item.segment, item.text), 0
                    if item.audio:
                        open_samples += len(item.audio) // BYTES_PER_SAMPLE
                        self._samples += len(item.audio) // BYTES_PER_SAMPLE
                        if self._first_audio_at is None:
                            self._first_audio_at = self._clock()
                elif item.kind is EventKind.SEGMENT_END:
                    open_segment = None
                elif item.kind is EventKind.END:
                    item = replace(item, metrics=self._call_metrics(), segments=self._next_segment)
                await emit(item)
                if item.kind is EventKind.END:
                    return
        finally:
            await self._stop()

    async def _stop(self) -> None:
        """Stop the reader and the speaker; the speaker's decoder request is aborted."""
        tasks = [t for t in (self._reader, self._speaker) if t is not None and not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            # The engine's abort is shielded: a second cancellation of this task
            # cannot stop it, and waiting here keeps nothing running after the call.
            await asyncio.wait(tasks)

    def _call_metrics(self) -> RequestMetrics:
        now = self._clock()
        audio_s = self._samples / self._rate if self._rate else 0.0
        ttfp = 0.0
        if self._first_audio_at is not None and self._first_text_at is not None:
            ttfp = max(0.0, self._first_audio_at - self._first_text_at) * 1000.0
        # No rtf: the call's wall time includes the waits for the client's text.
        return RequestMetrics(
            ttfp_ms=ttfp, audio_seconds=audio_s, elapsed_ms=(now - self._started_at) * 1000.0
        )

    def _fail(self, exc: BaseException) -> None:
        """End the call with `exc`: what the writer has not sent yet is dropped."""
        if self._failed:
            return
        self._failed = True
        self._purge()
        self._out.put_nowait(exc)

    def _purge(self) -> None:
        while not self._out.empty():
            self._out.get_nowait()
        self._drained.set()

    async def _put(self, event: StreamEvent) -> None:
        """Queue an event for the writer, waiting while it has enough to send."""
        while self._out.qsize() >= MAX_PENDING_EVENTS:
            self._drained.clear()
            await self._drained.wait()
        self._out.put_nowait(event)

    # -- the reader ------------------------------------------------------------

    async def _read(self) -> None:
        try:
            async with contextlib.aclosing(self._messages) as messages:
                async for message in messages:
                    await self._handle(message)
            # The client closed its side without `end`: as `end`.
            if not self._ended:
                if self._config is None:
                    raise InvalidArgumentError(
                        self._config_field, "the call ended before its config was sent"
                    )
                self._end()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001  ends the call; the transport maps it
            self._fail(exc)

    async def _handle(self, message: ClientMessage) -> None:
        if self._config is None:
            if not isinstance(message, StreamConfig):
                raise InvalidArgumentError(
                    self._config_field,
                    f"the first message must be the config, got {_message_name(message)}",
                )
            await self._configure(message)
            return
        if isinstance(message, StreamConfig):
            raise InvalidArgumentError(self._config_field, "only the first message may be config")
        if message is Control.CANCEL:
            await self._cancel()
            return
        if self._ended:
            raise InvalidArgumentError(
                _message_field(message, self._text_field),
                "the call is ending (end was sent); only cancel may follow",
            )
        if isinstance(message, TextPiece):
            self._text(message.text)
        elif message is Control.FLUSH:
            self._queue(self._segmenter.flush())
        elif message is Control.END:
            self._end()

    async def _configure(self, config: StreamConfig) -> None:
        engine = self._engine
        info = await engine.decoder_info()
        try:
            voice = check_voice(config.voice, info, config.voice_field)
        except InvalidArgumentError:
            info = await engine.pool.info(refresh=True)
            voice = check_voice(config.voice, info, config.voice_field)
        rate = check_sample_rate(config.sample_rate_hz, info, config.sample_rate_field)
        check_language_against(config.language, info, config.voice_field.replace("voice", "language"))
        check_against_decoder(
            info,
            modality=OutputModality.AUDIO,
            sampling_params=config.sampling_params,
            instructions=config.instructions,
            field=config.sampling_params_field,
            verbatim=True,
            instructions_field=config.instructions_field,
        )
        self._config, self._voice, self._rate = config, voice, rate
        self.call_id = config.request_id
        self._speaker = asyncio.create_task(self._speak_loop(), name="speak-stream-speaker")
        self._out.put_nowait(
            StreamEvent(EventKind.READY, voice=voice, sample_rate_hz=rate, text=config.request_id)
        )

    def _text(self, text: str) -> None:
        if not text:
            return
        pending = self._segmenter.buffered + sum(
            len(s) for s in self._segments if isinstance(s, str)
        )
        if pending + len(text) > self._max_pending:
            raise InvalidArgumentError(
                self._text_field,
                f"{pending + len(text)} characters would be waiting to be spoken; the limit is "
                f"{self._max_pending} (send text no faster than it is spoken)",
            )
        if self._first_text_at is None:
            self._first_text_at = self._clock()
        for segment in self._segmenter.push(text):
            self._queue(segment)

    def _queue(self, segment: object) -> None:
        if segment is None:
            return
        self._segments.append(segment)
        self._segments_ready.set()

    def _end(self) -> None:
        self._queue(self._segmenter.flush())
        self._queue(_END_MARK)
        self._ended = True

    async def _cancel(self) -> None:
        """Barge-in: abort the segment being spoken, drop everything not yet spoken."""
        self._segmenter.clear()
        self._segments.clear()
        speaker = self._speaker
        if speaker is not None:
            speaker.cancel()
            await asyncio.wait([speaker])  # its decoder request is aborted by now
        if self._failed:
            return
        self._purge()
        self._out.put_nowait(_CANCEL_MARK)
        if self._ended:
            self._queue(_END_MARK)
        self._speaker = asyncio.create_task(self._speak_loop(), name="speak-stream-speaker")

    # -- the speaker -----------------------------------------------------------

    async def _speak_loop(self) -> None:
        try:
            while True:
                while not self._segments:
                    self._segments_ready.clear()
                    await self._segments_ready.wait()
                item = self._segments.popleft()
                if item is _END_MARK:
                    await self._put(StreamEvent(EventKind.END, sample_rate_hz=self._rate))
                    return
                assert isinstance(item, str)
                index = self._next_segment
                self._next_segment += 1
                await self._speak(index, item)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001  ends the call; the transport maps it
            self._fail(exc)

    async def _speak(self, index: int, text: str) -> None:
        config = self._config
        assert config is not None
        upstream = decoder_request(
            f"{self.call_id}/{index}", text, OutputModality.AUDIO, self._voice, config.sampling_params,
            config.instructions, verbatim=True, language=config.language,
            reference_audio=config.reference_audio, reference_text=config.reference_text,
        )
        limits = self._engine.limits
        max_audio = max(2, (limits.max_response_bytes - 4096 - 4 * len(text)) // 2 * 2)
        start = self._clock()
        first_audio: float | None = None
        samples = 0
        rate = self._rate
        first = True
        finish_reason = ""
        decoder_metrics = RequestMetrics()
        stream = self._engine._stream(upstream, OutputModality.AUDIO, OutputKind.DELTA)
        async with contextlib.aclosing(stream) as outputs:
            async for output in outputs:
                audio = b""
                payload = output.multimodal
                if payload is not None:
                    rate = int(payload.metadata.get(SAMPLE_RATE_KEY, rate))
                    tensor = payload.tensors.get(AUDIO_KEY)
                    if tensor is not None:
                        audio = pcm16le(tensor)
                if output.finished:
                    finish_reason = output.finish_reason
                    decoder_metrics = output.metrics
                for k in range(0, len(audio), max_audio):
                    piece = audio[k : k + max_audio]
                    if first_audio is None:
                        first_audio = self._clock()
                    samples += len(piece) // BYTES_PER_SAMPLE
                    await self._put(
                        StreamEvent(
                            EventKind.AUDIO,
                            segment=index,
                            text=text if first else "",
                            audio=piece,
                            sample_rate_hz=rate,
                            first=first,
                        )
                    )
                    first = False
        now = self._clock()
        audio_s = samples / rate if rate else 0.0
        metrics = replace(
            decoder_metrics,
            ttfp_ms=0.0 if first_audio is None else (first_audio - start) * 1000.0,
            rtf=(now - start) / audio_s if audio_s else 0.0,
            audio_seconds=audio_s,
            elapsed_ms=(now - start) * 1000.0,
        )
        await self._put(
            StreamEvent(
                EventKind.SEGMENT_END,
                segment=index,
                text=text,
                sample_rate_hz=rate,
                finish_reason=finish_reason or FINISH_STOP,
                metrics=metrics,
                first=first,
            )
        )


def _message_name(message: ClientMessage) -> str:
    if isinstance(message, TextPiece):
        return "text"
    if isinstance(message, Control):
        return message.value
    return "config"


def _message_field(message: ClientMessage, text_field: str) -> str:
    return text_field if isinstance(message, TextPiece) else _message_name(message)


# ---------------------------------------------------------------------------
# gRPC.


def config_from_pb(config: gateway_pb2.SpeakStreamConfig, limits: Limits) -> StreamConfig:
    """Validate a `SpeakStreamConfig` (fields named ``config.<field>``)."""
    request_id = check_request_id(config.request_id, "config.request_id")
    check_encoding(config.encoding, "config.encoding")
    return StreamConfig(
        request_id=request_id,
        voice=check_voice_shape(config.voice, "config.voice"),
        sample_rate_hz=check_sample_rate_shape(config.sample_rate_hz, "config.sample_rate_hz"),
        sampling_params=check_sampling_params(
            config.sampling_params if config.HasField("sampling_params") else None,
            "config.sampling_params",
        ),
        instructions=check_instructions(config.instructions, limits, "config.instructions"),
        language=check_language(config.language, "config.language"),
        reference_audio=check_reference_audio(config.reference_audio if config.HasField("reference_audio") else None,
                                              "config.reference_audio"),
        reference_text=check_instructions(config.reference_text, limits, "config.reference_text"),
        voice_field="config.voice",
        sample_rate_field="config.sample_rate_hz",
        instructions_field="config.instructions",
        sampling_params_field="config.sampling_params",
    )


async def _grpc_messages(
    requests: AsyncIterator[gateway_pb2.SpeakStreamRequest], limits: Limits
) -> AsyncGenerator[ClientMessage, None]:
    async for request in requests:
        kind = request.WhichOneof("kind")
        if kind == "config":
            yield config_from_pb(request.config, limits)
        elif kind == "text":
            yield TextPiece(request.text)
        elif kind == "flush":
            yield Control.FLUSH
        elif kind == "cancel":
            yield Control.CANCEL
        elif kind == "end":
            yield Control.END
        else:
            raise InvalidArgumentError(
                "kind", "a message must set one of config, text, flush, cancel, end"
            )


_GRPC_EVENTS = {
    EventKind.AUDIO: gateway_pb2.SPEAK_STREAM_EVENT_AUDIO,
    EventKind.SEGMENT_END: gateway_pb2.SPEAK_STREAM_EVENT_SEGMENT_END,
    EventKind.CANCELLED: gateway_pb2.SPEAK_STREAM_EVENT_CANCELLED,
    EventKind.END: gateway_pb2.SPEAK_STREAM_EVENT_END,
}


async def serve_grpc(
    engine: GatewayEngine,
    requests: AsyncIterator[gateway_pb2.SpeakStreamRequest],
    context: grpc.aio.ServicerContext,
) -> None:
    """Serve one `SpeakStream` gRPC call; errors are raised for the servicer to map."""
    with engine.admission.slot():
        call = SpeakStreamCall(engine, _grpc_messages(requests, engine.limits))
        sequence = 0

        async def emit(event: StreamEvent) -> None:
            nonlocal sequence
            kind = _GRPC_EVENTS.get(event.kind)
            if kind is None:  # READY: nothing to send over gRPC
                return
            response = gateway_pb2.SpeakStreamResponse(
                event=kind,
                request_id=call.call_id,
                sequence_number=sequence,
                segment=event.segment,
                segment_text=event.text if event.kind is not EventKind.END else "",
                audio=event.audio,
                sample_rate_hz=event.sample_rate_hz,
                encoding=gateway_pb2.AUDIO_ENCODING_PCM16LE,
                finish_reason=event.finish_reason,
            )
            if event.metrics is not None:
                response.metrics.CopyFrom(event.metrics.to_pb())
            await context.write(response)
            sequence += 1

        await call.run(emit)


__all__ = [
    "ABBREVIATIONS",
    "DEFAULT_FIRST_MIN_CLAUSE_CHARS",
    "DEFAULT_MAX_SEGMENT_CHARS",
    "DEFAULT_MIN_CLAUSE_CHARS",
    "ClientGone",
    "ClientMessage",
    "Control",
    "EventKind",
    "Segmenter",
    "SpeakStreamCall",
    "StreamConfig",
    "StreamEvent",
    "TextPiece",
    "config_from_pb",
    "serve_grpc",
]
