"""A realtime voice session: OpenAI's Realtime API (GA event names) on Generate.

One session per connection, whatever carries it (the WebSocket route
``GET /v1/realtime``, `gateway.http_realtime`; gRPC ``Realtime``,
`gateway.servicer`): the transport hands each client event to
`RealtimeSession.handle` and sends the events the session emits, in order.

The session holds a conversation (messages: system text; user text, audio
and images; the assistant's replies as their transcripts) and an input audio
buffer (PCM16 mono 24 kHz). A user turn is committed by hand
(``input_audio_buffer.commit``) or by server-side voice activity detection
(``server_vad``, `gateway.realtime_vad`, on by default as in OpenAI's API).
A response (``response.create``, or the end of speech with
``create_response``) runs the conversation through the deployment's chat
path as one Generate request (audio and transcript out, or text), its audio
streamed as ``response.output_audio.delta`` events as the decoder makes it.

Barge-in: ``response.cancel``, or speech starting while a response plays
(``interrupt_response``), cancels the decoder request at once (the decoder
aborts it and frees its KV cache) and ends the response ``cancelled``; deltas
not yet sent are dropped. ``conversation.item.truncate`` then cuts the
reply to what was heard: its transcript keeps the share of its words that
the heard audio covers (to the end of the word being spoken), which is what
the model reads of it in later turns.

What the model reads: every message in order, the instructions first (as a
system turn). Audio is not transcribed: user audio goes to the model as
audio. With ``truncation: "auto"`` (the default) the oldest messages are
left out of what a response reads when the conversation holds more audio or
image parts, or more text, than the deployment takes in one request; with
``"disabled"`` such a response fails instead.

Errors: a client event that is malformed, unknown, or not possible in the
session's state is answered with an ``error`` event (its ``event_id`` the
client's, its ``param`` the field as the client spelled it) and changes
nothing; the session goes on. A response the decoder fails ends ``failed``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import grpc
import numpy as np

from gateway.audio import AUDIO_KEY, SAMPLE_RATE_KEY, pcm16le
from gateway.decoder_client import DecoderInfo
from gateway.engine import GatewayEngine
from gateway.http_common import error_body, model_id
from gateway.output_processor import OutputKind
from gateway.outputs import OmniRequestOutput
from gateway.realtime_protocol import (
    CLIENT_EVENTS,
    EVENT_FIELDS,
    EventIds,
    Item,
    Part,
    ResponseOptions,
    SessionConfig,
    SessionError,
    base64_audio,
    item_from_json,
    known,
    new_id,
    obj,
    response_json,
    response_options,
    session_update,
    truncated_transcript,
)
from gateway.realtime_vad import SAMPLE_RATE_HZ, SpeechStarted, VoiceActivity
from gateway.validation import GenerationRequest, check_voice
from omni_common.conversation import Turn
from omni_common.errors import CLIENT_ERRORS, InvalidArgumentError, quote_value
from omni_common.media import AudioInput, ImageInput, resample
from omni_common.modality import OutputModality
from omni_serving.v1 import common_pb2, gateway_pb2

logger = logging.getLogger(__name__)

Send = Callable[[dict], Awaitable[None]]
MIN_COMMIT_SAMPLES = SAMPLE_RATE_HZ // 10
"""A commit needs at least 100 ms of audio (as OpenAI's)."""


@dataclass
class _Response:
    id: str
    options: ResponseOptions
    voice: str
    item: Item
    request: GenerationRequest
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    task: asyncio.Task | None = None
    pump: asyncio.Task | None = None
    cancel_reason: str = ""
    previous_item: str | None = None
    text: list[str] = field(default_factory=list)
    prompt_tokens: int = 0
    text_tokens: int = 0
    finish_reason: str = ""

    @property
    def audio(self) -> bool:
        return "audio" in self.options.output_modalities

    def where(self) -> dict:
        return {"response_id": self.id, "item_id": self.item.id, "output_index": 0, "content_index": 0}


class RealtimeSession:
    """One session: client events in (`handle`), server events out (`send`)."""

    def __init__(self, engine: GatewayEngine, info: DecoderInfo, send: Send, *, model: str) -> None:
        self._engine = engine
        self._info = info
        self._send = send
        self._model = model
        self.id = new_id("sess")
        self._conversation_id = new_id("conv")
        self._ids = EventIds()
        self._send_lock = asyncio.Lock()
        self.config = SessionConfig()
        self._voice = check_voice("", info)
        self._items: list[Item] = []
        self._buffer = bytearray()  # uncommitted input audio (PCM16)
        self._buffer_start = 0  # session sample of the buffer's first sample
        self._samples = 0  # session audio appended in all, in samples
        self._vad = VoiceActivity(self.config.vad) if self.config.vad else None
        self._speech_item = ""
        self._response: _Response | None = None
        self._max_samples = int(info.limits.max_input_audio_seconds * SAMPLE_RATE_HZ)

    # ------------------------------------------------------------------ transport side

    async def start(self) -> None:
        logger.info("realtime session %s opened", self.id)
        await self._emit({"type": "session.created", "session": self._session_json()})

    async def handle(self, event: object, audio: bytes | None = None) -> None:
        """Take one client event (a decoded JSON object; `audio`: an append's
        PCM16 when the transport carries it as bytes). A refusal is an
        ``error`` event; the session goes on."""
        client_event_id = event.get("event_id") if isinstance(event, dict) else None
        try:
            body = obj(event, "event")
            kind = body.get("type")
            if kind not in CLIENT_EVENTS:
                raise InvalidArgumentError(
                    "type", f"unknown event type {quote_value(str(kind))[:80]}; one of {', '.join(CLIENT_EVENTS)}")
            known(body, "", ("type", "event_id", *EVENT_FIELDS[kind]))
            if audio is not None and (kind != "input_audio_buffer.append" or "audio" in body):
                raise InvalidArgumentError("audio", "only an input_audio_buffer.append carries audio, "
                                                    "as bytes or as base64 in its JSON (not both)")
            await getattr(self, "_on_" + kind.replace(".", "_"))(body, audio)
        except CLIENT_ERRORS as exc:
            await self.error(exc, client_event_id if isinstance(client_event_id, str) else None)

    async def handle_json(self, text: str | bytes, audio: bytes | None = None, field: str = "event") -> None:
        """`handle` for an event as the transport carries it, JSON text (`field`
        names the message part that holds it, for the error when it is not JSON)."""
        try:
            event = json.loads(text)
        except ValueError:
            await self.error(InvalidArgumentError(field, "is not JSON"))
            return
        await self.handle(event, audio)

    async def error(self, exc: BaseException, client_event_id: str | None = None) -> None:
        """An ``error`` event for `exc` (OpenAI's error object)."""
        _, error = error_body(exc)
        code = getattr(exc, "realtime_code", None)
        if code:
            error["code"] = code
            error["param"] = getattr(exc, "field", None)
        error["event_id"] = client_event_id
        await self._emit({"type": "error", "error": error})

    async def finish(self) -> None:
        """No more client events (a gRPC client half-closed): let the running response end."""
        resp = self._response
        if resp is not None and resp.task is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(resp.task)

    async def close(self) -> None:
        """The client is gone: stop the running response (its decoder request is cancelled)."""
        logger.info("realtime session %s closed (%d items%s)", self.id, len(self._items),
                    ", its running response cancelled" if self._response is not None else "")
        resp, self._response = self._response, None
        if resp is not None:
            resp.cancel_reason = resp.cancel_reason or "client_gone"
            for task in (resp.pump, resp.task):
                if task is not None:
                    task.cancel()
            for task in (resp.pump, resp.task):
                if task is not None:
                    with contextlib.suppress(BaseException):
                        await task

    async def _emit(self, event: dict) -> None:
        # one send at a time, numbered in send order: the handler and the response task
        # both emit, and a gRPC call takes one write at a time
        async with self._send_lock:
            await self._send({"event_id": self._ids.next(), **event})

    def _session_json(self) -> dict:
        return self.config.to_json(self.id, self._model, self._voice)

    # ------------------------------------------------------------------ session and audio

    async def _on_session_update(self, body: dict, audio: bytes | None) -> None:
        config = session_update(self.config, body.get("session"))
        voice = self._voice
        if config.voice != self.config.voice:
            voice = await self._engine.resolve_voice(config.voice, self._info, "session.audio.output.voice")
        self._check_modalities(config.output_modalities, "session.output_modalities")
        if config.vad != self.config.vad:
            self._vad = VoiceActivity(config.vad) if config.vad else None
            if self._vad is not None:
                self._vad.reset(self._samples)
        self.config, self._voice = config, voice
        await self._emit({"type": "session.updated", "session": self._session_json()})

    def _check_modalities(self, modalities: tuple[str, ...], where: str) -> None:
        produced = self._info.output_modalities
        if produced and any(m not in produced for m in modalities):
            raise InvalidArgumentError(where, f"this deployment produces {', '.join(produced)}")

    async def _on_input_audio_buffer_append(self, body: dict, audio: bytes | None) -> None:
        pcm = audio if audio is not None else base64_audio(body.get("audio"), "audio")
        if not self._max_samples:
            raise InvalidArgumentError("audio", "this deployment takes no audio input")
        if len(pcm) % 2:
            raise InvalidArgumentError("audio", "PCM16 audio is whole 2-byte samples")
        if (len(self._buffer) + len(pcm)) // 2 > self._max_samples:
            raise SessionError("input_audio_buffer_full",
                               f"the input audio buffer holds at most {self._max_samples / SAMPLE_RATE_HZ:g} s "
                               "(this deployment's longest audio part); commit or clear it", "audio")
        self._buffer += pcm
        self._samples += len(pcm) // 2
        if self._vad is None:
            return
        for event in self._vad.feed(np.frombuffer(pcm, dtype="<i2")):
            if isinstance(event, SpeechStarted):
                self._speech_item = new_id("item")
                await self._emit({"type": "input_audio_buffer.speech_started",
                                  "audio_start_ms": event.audio_start_ms, "item_id": self._speech_item})
                if self._response is not None and self.config.vad and self.config.vad.interrupt_response:
                    await self._cancel("turn_detected")
                continue
            item_id, self._speech_item = self._speech_item, ""
            await self._emit({"type": "input_audio_buffer.speech_stopped", "audio_end_ms": event.audio_end_ms,
                              "item_id": item_id})
            await self._commit(event.turn_start_sample, event.turn_end_sample, item_id)
            if self.config.vad and self.config.vad.create_response and self._response is None:
                await self._start_response(response_options(self.config, None))
        if not self._vad.speaking:  # keep only what a turn starting now could take as its padding
            self._trim_to(self._samples - self._vad.options.prefix_padding_ms * SAMPLE_RATE_HZ // 1000
                          - MIN_COMMIT_SAMPLES)

    def _trim_to(self, sample: int) -> None:
        drop = min(len(self._buffer) // 2, max(0, sample - self._buffer_start))
        if drop:
            del self._buffer[: 2 * drop]
            self._buffer_start += drop

    async def _on_input_audio_buffer_commit(self, body: dict, audio: bytes | None) -> None:
        if len(self._buffer) // 2 < MIN_COMMIT_SAMPLES:
            raise SessionError("input_audio_buffer_commit_empty",
                               f"the input audio buffer holds {len(self._buffer) // 2 * 1000 // SAMPLE_RATE_HZ} ms; "
                               "a commit needs at least 100 ms of audio")
        item_id, self._speech_item = self._speech_item or new_id("item"), ""
        await self._commit(self._buffer_start, self._samples, item_id)
        if self._vad is not None:
            self._vad.reset(self._samples)

    async def _commit(self, start: int, end: int, item_id: str) -> None:
        """The buffer's audio from session sample `start` to `end` as a user message."""
        start = max(start, self._buffer_start)
        pcm = bytes(self._buffer[2 * (start - self._buffer_start): 2 * (end - self._buffer_start)])
        self._trim_to(end)
        previous = self._items[-1].id if self._items else None
        item = Item(item_id, "user", [Part("input_audio", audio=pcm)])
        self._items.append(item)
        await self._emit({"type": "input_audio_buffer.committed", "item_id": item.id, "previous_item_id": previous})
        await self._item_added(item, previous)

    async def _item_added(self, item: Item, previous: str | None) -> None:
        for kind in ("conversation.item.added", "conversation.item.done"):
            await self._emit({"type": kind, "previous_item_id": previous, "item": item.to_json()})

    async def _on_input_audio_buffer_clear(self, body: dict, audio: bytes | None) -> None:
        self._trim_to(self._samples)
        self._speech_item = ""
        if self._vad is not None:
            self._vad.reset(self._samples)
        await self._emit({"type": "input_audio_buffer.cleared"})

    # ------------------------------------------------------------------ the conversation

    def _find(self, item_id: object, where: str = "item_id") -> int:
        if not isinstance(item_id, str):
            raise InvalidArgumentError(where, "must be an item id (a string)")
        for i, item in enumerate(self._items):
            if item.id == item_id:
                return i
        raise SessionError("item_not_found", f"no item {quote_value(item_id)[:80]} in the conversation", where)

    async def _on_conversation_item_create(self, body: dict, audio: bytes | None) -> None:
        item = item_from_json(body.get("item"), "item", self._max_samples)
        if any(i.id == item.id for i in self._items):
            raise SessionError("item_already_exists", f"the conversation has an item {item.id}", "item.id")
        previous = body.get("previous_item_id")
        index = len(self._items)
        if previous == "root":
            index = 0
        elif previous is not None:
            index = self._find(previous, "previous_item_id") + 1
        self._items.insert(index, item)
        await self._item_added(item, self._items[index - 1].id if index else None)

    async def _on_conversation_item_delete(self, body: dict, audio: bytes | None) -> None:
        index = self._find(body.get("item_id"))
        if self._response is not None and self._items[index] is self._response.item:
            raise SessionError("item_in_progress", "the item is the running response's; cancel it first", "item_id")
        item = self._items.pop(index)
        await self._emit({"type": "conversation.item.deleted", "item_id": item.id})

    async def _on_conversation_item_retrieve(self, body: dict, audio: bytes | None) -> None:
        item = self._items[self._find(body.get("item_id"))]
        await self._emit({"type": "conversation.item.retrieved", "item": item.to_json()})

    async def _on_conversation_item_truncate(self, body: dict, audio: bytes | None) -> None:
        item = self._items[self._find(body.get("item_id"))]
        index, end_ms = body.get("content_index"), body.get("audio_end_ms")
        if isinstance(index, bool) or not isinstance(index, int):
            raise InvalidArgumentError("content_index", "must be an integer")
        if isinstance(end_ms, bool) or not isinstance(end_ms, int) or end_ms < 0:
            raise InvalidArgumentError("audio_end_ms", "must be an integer >= 0")
        if item.role != "assistant" or not 0 <= index < len(item.content) or item.content[index].type != "output_audio":
            raise InvalidArgumentError("content_index", "must point at an assistant message's audio")
        if self._response is not None and self._response.item is item:  # the user stopped listening
            await self._cancel("client_cancelled")
        total_ms = item.audio_samples * 1000 // SAMPLE_RATE_HZ
        if end_ms > total_ms:
            raise InvalidArgumentError("audio_end_ms", f"is past the end of the item's audio ({total_ms} ms)")
        part = item.content[index]
        part.transcript = truncated_transcript(part.transcript or "", end_ms / total_ms if total_ms else 0.0)
        item.audio_samples = end_ms * SAMPLE_RATE_HZ // 1000
        await self._emit({"type": "conversation.item.truncated", "item_id": item.id, "content_index": index,
                          "audio_end_ms": end_ms})

    def _context(self, options: ResponseOptions) -> tuple[Turn, ...]:
        """The turns a response reads (see the module docstring)."""
        turns: list[Turn] = []
        for item in self._items:
            parts: list[str | AudioInput | ImageInput] = []
            for i, p in enumerate(item.content):
                where = f"item {item.id} content[{i}]"
                if p.type == "input_audio":
                    parts.append(AudioInput(p.audio, "pcm16", SAMPLE_RATE_HZ, where))
                elif p.type == "input_image":
                    parts.append(ImageInput(p.image, where))
                elif p.text or p.transcript:
                    parts.append(p.text or p.transcript or "")
            if not parts:
                continue  # a reply cut to nothing, or one that failed before its first word
            texts = all(isinstance(p, str) for p in parts)
            turns.append((item.role, "\n".join(parts) if texts else tuple(parts)))  # type: ignore[arg-type]
        if options.instructions:  # counted with the rest, never left out
            turns.insert(0, ("system", options.instructions))
        limits = self._info.limits
        while self._over(turns, limits):
            droppable = [i for i, (role, _) in enumerate(turns) if role != "system"]
            if self.config.truncation == "disabled" or len(droppable) <= 1:
                raise SessionError("conversation_too_large",
                                   "the conversation holds more than this deployment takes in one request "
                                   f"({limits.max_input_audio_parts} audio parts, {limits.max_input_image_parts} "
                                   f"images, {self._engine.limits.max_text_chars} characters); delete items "
                                   'or set truncation to "auto"')
            del turns[droppable[0]]
        if not turns or turns[-1][0] != "user":
            raise SessionError("conversation_needs_user_turn",
                               "the conversation does not end with a user message: commit audio or create a "
                               "user item before response.create")
        return tuple(turns)

    def _over(self, turns: list[Turn], limits: common_pb2.DeploymentLimits) -> bool:
        counts = {AudioInput: 0, ImageInput: 0}
        chars = 0
        for _, content in turns:
            for p in (content,) if isinstance(content, str) else content:
                if isinstance(p, str):
                    chars += len(p)
                else:
                    counts[type(p)] += 1
        return (counts[AudioInput] > limits.max_input_audio_parts or counts[ImageInput] > limits.max_input_image_parts
                or chars > self._engine.limits.max_text_chars)

    # ------------------------------------------------------------------ responses

    async def _on_response_create(self, body: dict, audio: bytes | None) -> None:
        if self._response is not None:
            raise SessionError("conversation_already_has_active_response",
                               f"response {self._response.id} is still running; cancel it or wait for response.done")
        await self._start_response(response_options(self.config, body.get("response")))

    async def _on_response_cancel(self, body: dict, audio: bytes | None) -> None:
        wanted = body.get("response_id")
        if self._response is None or (wanted is not None and wanted != self._response.id):
            raise SessionError("response_cancel_not_active", "no such response is running", "response_id")
        await self._cancel("client_cancelled")

    async def _start_response(self, options: ResponseOptions) -> None:
        self._check_modalities(options.output_modalities, "response.output_modalities")
        voice = (await self._engine.resolve_voice(options.voice, self._info, "response.audio.output.voice")
                 if options.voice != self.config.voice else self._voice)
        turns = self._context(options)
        response_id = new_id("resp")
        audio = "audio" in options.output_modalities
        modality = OutputModality.TEXT | OutputModality.AUDIO if audio else OutputModality.TEXT
        sampling = common_pb2.SamplingParams(model_defaults=True)
        if options.max_output_tokens is not None:
            sampling.max_tokens = options.max_output_tokens
        request = GenerationRequest(request_id=response_id, prompt="", messages=turns, output_modality=modality,
                                    output_kind=OutputKind.DELTA, voice=voice, sampling_params=sampling)
        part = Part("output_audio", transcript="") if audio else Part("output_text")
        item = Item(new_id("item"), "assistant", [part], status="in_progress")
        resp = _Response(response_id, options, voice, item, request)
        if options.in_conversation:  # in place now: items the client adds from here on come after it
            resp.previous_item = self._items[-1].id if self._items else None
            self._items.append(item)
        self._response = resp
        resp.task = asyncio.create_task(self._run(resp), name=f"realtime {response_id}")

    async def _cancel(self, reason: str) -> None:
        """End the running response now (its decoder request cancelled); wait for its last events."""
        resp = self._response
        if resp is None or resp.task is None:
            return
        if not resp.cancel_reason:
            resp.cancel_reason = reason
            if resp.pump is not None:
                resp.pump.cancel()
            resp.queue.put_nowait(("cancelled", None))
        with contextlib.suppress(Exception):
            await asyncio.shield(resp.task)

    async def _pump(self, resp: _Response) -> None:
        """The decoder's outputs into the response's queue."""
        try:
            async with contextlib.aclosing(self._engine.generate(resp.request, admitted=True)) as outputs:
                async for output in outputs:
                    resp.queue.put_nowait(("output", output))
            resp.queue.put_nowait(("end", None))
        except CLIENT_ERRORS as exc:
            resp.queue.put_nowait(("error", exc))
        except Exception as exc:  # noqa: BLE001  a bug: reported as a failed response
            logger.error("realtime response %s failed", resp.id, exc_info=exc)
            resp.queue.put_nowait(("error", exc))

    async def _run(self, resp: _Response) -> None:
        try:
            await self._respond(resp)
        finally:
            if self._response is resp:
                self._response = None

    async def _respond(self, resp: _Response) -> None:
        options, item = resp.options, resp.item
        await self._emit({"type": "response.created", "response": self._response_json(resp, "in_progress", [])})
        await self._emit({"type": "response.output_item.added", "response_id": resp.id, "output_index": 0,
                          "item": item.to_json()})
        if options.in_conversation:
            await self._emit({"type": "conversation.item.added", "previous_item_id": resp.previous_item,
                              "item": item.to_json()})
        await self._emit({"type": "response.content_part.added", **resp.where(),
                          "part": {"type": "audio", "transcript": ""} if resp.audio else {"type": "text", "text": ""}})
        resp.pump = asyncio.create_task(self._pump(resp), name=f"realtime {resp.id} decoder")
        status, details = "completed", None
        while True:
            kind, value = await resp.queue.get()
            if kind == "output" and not resp.cancel_reason:
                await self._deltas(resp, value)
            elif kind == "end":
                if resp.finish_reason == "length":
                    status, details = "incomplete", {"type": "incomplete", "reason": "max_output_tokens"}
                break
            elif kind == "error":
                _, error = error_body(value)
                status, details = "failed", {"type": "failed", "error": {"type": error["type"], "code": error["code"]}}
                await self.error(value)
                break
            elif kind == "cancelled":
                reason = resp.cancel_reason if resp.cancel_reason in ("turn_detected", "client_cancelled") else None
                status, details = "cancelled", {"type": "cancelled", "reason": reason}
                break
        with contextlib.suppress(asyncio.CancelledError):
            await resp.pump  # cancelled: the decoder request is cancelled once this returns
        await self._finish(resp, status, details)

    async def _deltas(self, resp: _Response, output: OmniRequestOutput) -> None:
        resp.prompt_tokens = max(resp.prompt_tokens, output.metrics.prompt_tokens)
        resp.text_tokens += len(output.token_ids)
        if output.finished:
            resp.finish_reason = output.finish_reason
        part = resp.item.content[0]
        if output.text:
            resp.text.append(output.text)
            kind = "response.output_audio_transcript.delta" if resp.audio else "response.output_text.delta"
            if resp.audio:
                part.transcript = "".join(resp.text)
            else:
                part.text = "".join(resp.text)
            await self._emit({"type": kind, **resp.where(), "delta": output.text})
        pcm = _pcm24k(output)
        if pcm and resp.audio:
            resp.item.audio_samples += len(pcm) // 2
            await self._emit({"type": "response.output_audio.delta", **resp.where(),
                              "delta": pcm})  # the transport encodes it (base64 in JSON)

    async def _finish(self, resp: _Response, status: str, details: dict | None) -> None:
        item, text = resp.item, "".join(resp.text)
        item.status = "completed" if status == "completed" else "incomplete"
        if resp.audio:
            await self._emit({"type": "response.output_audio.done", **resp.where()})
            await self._emit({"type": "response.output_audio_transcript.done", **resp.where(), "transcript": text})
            part_json = {"type": "audio", "transcript": text}
        else:
            await self._emit({"type": "response.output_text.done", **resp.where(), "text": text})
            part_json = {"type": "text", "text": text}
        await self._emit({"type": "response.content_part.done", **resp.where(), "part": part_json})
        await self._emit({"type": "response.output_item.done", "response_id": resp.id, "output_index": 0,
                          "item": item.to_json()})
        if resp.options.in_conversation and item in self._items:
            index = self._items.index(item)
            await self._emit({"type": "conversation.item.done", "item": item.to_json(),
                              "previous_item_id": self._items[index - 1].id if index else None})
        fps = self._info.limits.audio_frames_per_second
        audio_tokens = round(item.audio_samples / SAMPLE_RATE_HZ * fps) if fps else 0
        usage = {"total_tokens": resp.prompt_tokens + resp.text_tokens + audio_tokens,
                 "input_tokens": resp.prompt_tokens, "output_tokens": resp.text_tokens + audio_tokens,
                 "output_token_details": {"text_tokens": resp.text_tokens, "audio_tokens": audio_tokens}}
        await self._emit({"type": "response.done", "response": self._response_json(
            resp, status, [item.to_json()], details=details, usage=usage)})

    def _response_json(self, resp: _Response, status: str, output: list[dict], **kw: dict | None) -> dict:
        conversation = self._conversation_id if resp.options.in_conversation else None
        return response_json(resp.id, conversation, resp.options, resp.voice, status, output, **kw)


async def serve_grpc(engine: GatewayEngine, requests: AsyncIterator[gateway_pb2.RealtimeRequest],
                     context: grpc.aio.ServicerContext) -> None:
    """The gRPC ``Realtime`` call: the session over `RealtimeRequest` / `RealtimeResponse`
    (JSON events, audio as bytes beside them). The call holds one admission
    slot; the client's half-close lets a running response end first."""
    with engine.admission.slot():
        info = await engine.decoder_info()

        async def send(event: dict) -> None:
            audio = event.get("delta") if event.get("type") == "response.output_audio.delta" else None
            if isinstance(audio, bytes):
                event = {k: v for k, v in event.items() if k != "delta"}
            await context.write(gateway_pb2.RealtimeResponse(json=json.dumps(event), audio=audio or b""))

        session = RealtimeSession(engine, info, send, model=model_id(info))
        try:
            await session.start()
            async for request in requests:
                await session.handle_json(request.json, request.audio or None, field="json")
            await session.finish()
        finally:
            await session.close()


def _pcm24k(output: OmniRequestOutput) -> bytes:
    """An output's audio as PCM16 at 24 kHz (resampled from the deployment's rate if it differs)."""
    payload = output.multimodal
    samples = payload.tensors.get(AUDIO_KEY) if payload is not None else None
    if samples is None or not samples.numel():
        return b""
    rate = payload.metadata.get(SAMPLE_RATE_KEY, SAMPLE_RATE_HZ) if payload is not None else SAMPLE_RATE_HZ
    if isinstance(rate, int) and rate != SAMPLE_RATE_HZ:
        import torch

        samples = torch.from_numpy(resample(samples.float().reshape(-1).numpy(), rate, SAMPLE_RATE_HZ))
    return pcm16le(samples)


__all__ = ["RealtimeSession", "serve_grpc"]
