"""The realtime voice session: ``GET /v1/realtime`` (WebSocket) and gRPC ``Realtime``.

On the three real services with the fake engine's omni profile (a test
double where the model goes: its thinker takes audio, hearing one token per
80 ms of a clip, and answers 8 + half as many characters). Every event the
gateway sends is checked against the `openai` package's own Realtime types
(`tests.realtime_client`); the official SDK's client (``client.realtime``)
holds a session unmodified. A response must equal gRPC ``Generate`` of the
same conversation with the same seed, text and audio byte for byte; that is
also how the tests see what the model read (the turn detected, a truncated
reply). Voice activity detection runs on speech synthesised by espeak-ng,
with noise from sox.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import shutil
import subprocess
import time
import wave
import zlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import grpc
import numpy as np
import openai
import pytest
from realtime_client import (
    RESPONSE_EVENTS,
    GrpcSession,
    Reply,
    Session,
    WsSession,
    audio_part,
    generate,
    reply_of,
    text_part,
    tone,
    validate,
)

from gateway.realtime_protocol import truncated_transcript
from gateway.realtime_vad import FRAME_SAMPLES, frame_levels
from omni_serving.v1 import decoder_pb2, decoder_pb2_grpc, gateway_pb2_grpc
from omni_stack.config import StackConfig
from omni_stack.stack import Stack

pytestmark = pytest.mark.e2e
RATE = 24_000
LONG_TEXT = " ".join(["Tell me everything about the weather on the coast this week."] * 30)
"""A question whose answer runs for many seconds on the fake engine (a long one to interrupt)."""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = Stack(StackConfig(profile="omni", engine="fake", runtime_dir=str(tmp_path_factory.mktemp("rt")),
                              port=0, http_port=0, log_level="WARNING"))
    stack.start(timeout_s=300)
    yield stack
    assert stack.stop() == []


def ws_url(stack: Stack) -> str:
    return stack.http_url.replace("http://", "ws://") + "/v1/realtime?model=omni"


@contextlib.asynccontextmanager
async def ws_session(stack: Stack, manual: bool = True) -> AsyncIterator[WsSession]:
    async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(stack), max_msg_size=0) as ws:
        session = WsSession(ws)
        await start(session, manual)
        yield session


@contextlib.asynccontextmanager
async def grpc_session(stack: Stack, manual: bool = True) -> AsyncIterator[GrpcSession]:
    async with grpc.aio.insecure_channel(stack.gateway_target) as channel:
        call = gateway_pb2_grpc.OmniGatewayServiceStub(channel).Realtime()
        session = GrpcSession(call)
        await start(session, manual)
        yield session
        if not call.done():  # (a test may have dropped the call)
            await call.done_writing()


TRANSPORTS = pytest.mark.parametrize("transport", ["websocket", "grpc"])


def opened(stack: Stack, transport: str, manual: bool = True) -> contextlib.AbstractAsyncContextManager:
    return (ws_session if transport == "websocket" else grpc_session)(stack, manual)


async def start(session: Session, manual: bool) -> None:
    created = await session.recv()
    assert created["type"] == "session.created", created
    assert created["session"]["audio"]["input"]["turn_detection"]["type"] == "server_vad"  # OpenAI's default
    if manual:  # turns committed by hand
        await session.send("session.update", session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
        updated = (await session.until("session.updated"))[-1]
        assert updated["session"]["audio"]["input"]["turn_detection"] is None, updated


def shape(types: list[str]) -> list[str]:
    """The events without the deltas, after checking every delta falls between
    the content part's start and the audio's (or text's) end."""
    first, last = types.index("response.content_part.added"), types.index("response.content_part.done")
    deltas = [i for i, t in enumerate(types) if t.endswith(".delta")]
    assert all(first < i < last for i in deltas), types
    return [t for t in types if not t.endswith(".delta")]


async def turn(session: Session, pcm: bytes, pieces: int = 3) -> str:
    """Append `pcm` in `pieces` events, commit; the user item's id."""
    step = len(pcm) // pieces // 2 * 2
    for i in range(pieces):
        await session.send("input_audio_buffer.append", audio=pcm[i * step: len(pcm) if i == pieces - 1 else (i + 1) * step])
    await session.send("input_audio_buffer.commit")
    events = await session.until("conversation.item.done")
    assert [e["type"] for e in events] == ["input_audio_buffer.committed", "conversation.item.added",
                                           "conversation.item.done"], events
    item = events[-1]["item"]
    assert (item["role"], item["content"]) == ("user", [{"type": "input_audio", "transcript": None}]), item
    return item["id"]


def check_reply(reply: Reply, audio: bool = True) -> None:
    assert reply.status == "completed", reply.done
    if audio:
        assert shape(reply.types) == [t for t in RESPONSE_EVENTS if not t.endswith(".delta")], reply.types
        assert reply.audio and len(reply.audio) % 2 == 0
    (item,) = reply.done["response"]["output"]
    part = item["content"][0]
    assert (item["status"], part["type"]) == ("completed", "output_audio" if audio else "output_text"), item
    assert part["transcript" if audio else "text"] == reply.text and reply.text, (part, reply.text)


def decoder_active(stack: Stack) -> int:
    with grpc.insecure_channel(stack.decoder_target) as channel:
        info = decoder_pb2_grpc.DecoderServiceStub(channel).GetDecoderInfo(decoder_pb2.GetDecoderInfoRequest(),
                                                                             timeout=10)
    return info.active_requests


def wait_idle(stack: Stack, timeout: float = 30.0) -> float:
    """Seconds until the decoder holds no request."""
    t0 = time.monotonic()
    while decoder_active(stack):
        assert time.monotonic() - t0 < timeout, "the decoder still holds a request"
        time.sleep(0.02)
    return time.monotonic() - t0


# ------------------------------------------------------------------ turns and parity


def test_the_official_sdk_holds_a_session_audio_in_audio_and_transcript_out(stack: Stack) -> None:
    """openai's own client, unmodified: two spoken turns, each answered with audio
    and its transcript, each answer equal to Generate of the conversation so far
    (the first reply read back as its transcript); then barge-in: a long answer
    cancelled at its first audio and truncated to what was heard."""
    first, second = tone(1.2), tone(0.7, hz=330.0)

    async def run() -> list[tuple[str, bytes, str]]:
        client = openai.AsyncOpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0)
        replies = []
        async with client.realtime.connect(model="omni") as conn:
            await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
            for pcm in (first, second):
                for i in range(0, len(pcm), 9600):
                    await conn.input_audio_buffer.append(audio=base64.b64encode(pcm[i:i + 9600]).decode())
                await conn.input_audio_buffer.commit()
                await conn.response.create()
                text, audio = "", b""
                async for event in conn:
                    validate(event.to_dict())
                    assert event.type != "error", event
                    if event.type == "response.output_audio_transcript.delta":
                        text += event.delta
                    elif event.type == "response.output_audio.delta":
                        audio += base64.b64decode(event.delta)
                    elif event.type == "response.done":
                        assert event.response.status == "completed", event
                        assert event.response.usage.output_token_details.text_tokens == len(text)
                        replies.append((text, audio, event.response.id))
                        break
            # barge-in: a long answer cancelled at its first audio, then cut to what was heard
            await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": LONG_TEXT}]})
            await conn.response.create()
            seen = []
            async for event in conn:
                validate(event.to_dict())
                assert event.type != "error", event
                seen.append(event.type)
                if event.type == "response.output_audio.delta" and seen.count(event.type) == 1:
                    await conn.response.cancel()
                elif event.type == "response.done":
                    assert (event.response.status, event.response.status_details.reason) == (
                        "cancelled", "client_cancelled"), event.response
                    await conn.conversation.item.truncate(item_id=event.response.output[0].id, content_index=0,
                                                          audio_end_ms=10)
                elif event.type == "conversation.item.truncated":
                    assert event.audio_end_ms == 10
                    break
        return replies

    (t1, a1, id1), (t2, a2, id2) = asyncio.run(run())
    assert (t1, a1) == generate(stack.gateway_target, [("user", [audio_part(first)])], zlib.crc32(id1.encode()))
    convo = [("user", [audio_part(first)]), ("assistant", [text_part(t1)]), ("user", [audio_part(second)])]
    assert (t2, a2) == generate(stack.gateway_target, convo, zlib.crc32(id2.encode()))
    assert len(t1) == 8 + (1.2 * 16000 // 1280) // 2, t1  # the fake thinker heard 1.2 s


@TRANSPORTS
def test_a_committed_turn_gets_the_events_in_openais_order_on_both_transports(stack: Stack, transport: str) -> None:
    pcm = tone(0.9, hz=180.0)

    async def run() -> tuple[str, Reply, list[dict]]:
        async with opened(stack, transport) as session:
            item = await turn(session, pcm)
            await session.send("response.create", event_id="evt_client_1")
            return item, await session.reply(), session.events

    user_item, reply, events = asyncio.run(run())
    check_reply(reply)
    created = next(e for e in events if e["type"] == "response.created")["response"]
    assert (created["status"], created["output"], created["id"]) == ("in_progress", [], reply.id)
    added = [e for e in events if e["type"] == "conversation.item.added"][-1]
    assert added["previous_item_id"] == user_item and added["item"]["role"] == "assistant"
    usage = reply.done["response"]["usage"]
    assert usage["output_token_details"] == {"text_tokens": len(reply.text),
                                             "audio_tokens": round(len(reply.audio) / 2 / RATE * 12.5)}, usage
    assert (reply.text, reply.audio) == generate(stack.gateway_target, [("user", [audio_part(pcm)])], reply.seed)


def test_a_text_only_session_answers_in_text(stack: Stack) -> None:
    async def run() -> Reply:
        async with ws_session(stack) as session:
            await session.send("session.update", session={"type": "realtime", "output_modalities": ["text"]})
            await session.until("session.updated")
            await session.send("conversation.item.create", item={
                "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello there"}]})
            await session.until("conversation.item.done")
            await session.send("response.create")
            # an item added while the answer runs goes after it, whatever the events' timing
            await session.send("conversation.item.create", item={
                "id": "item_next", "type": "message", "role": "user",
                "content": [{"type": "input_text", "text": "And then?"}]})
            reply = await session.reply()
            added = [e for e in session.events if e["type"] == "conversation.item.added"]
            (nxt,) = [e for e in added if e["item"]["id"] == "item_next"]
            assert nxt["previous_item_id"] == reply.done["response"]["output"][0]["id"], (nxt, reply.done)
            return reply

    reply = asyncio.run(run())
    check_reply(reply, audio=False)
    assert "response.output_text.delta" in reply.types and not reply.audio
    assert not any("audio" in t for t in reply.types), reply.types
    assert reply.text == generate(stack.gateway_target, [("user", [text_part("Hello there")])], reply.seed,
                                  modalities="text")[0]


# ------------------------------------------------------------------ voice activity detection


def synthesised(tmp_path: Path, text: str) -> tuple[np.ndarray, np.ndarray]:
    """(speech, noise): espeak-ng's speech of `text` at 24 kHz peaking at -6 dBFS,
    and sox's white noise at about -45 dBFS RMS, as int16 arrays."""
    for tool in ("espeak-ng", "sox"):
        if shutil.which(tool) is None:
            message = f"{tool} is not installed (Debian package {tool})"
            if os.environ.get("CI") == "true":
                pytest.fail(message + " (CI=true: CI must run this test)")
            pytest.skip(message)
    raw, speech, noise = tmp_path / "raw.wav", tmp_path / "speech.wav", tmp_path / "noise.wav"
    subprocess.run(["espeak-ng", "-w", str(raw), text], check=True, capture_output=True)
    subprocess.run(["sox", str(raw), "-r", "24000", "-c", "1", "-b", "16", str(speech), "norm", "-6"], check=True,
                   capture_output=True)
    subprocess.run(["sox", "-n", "-r", "24000", "-c", "1", "-b", "16", str(noise), "synth", "8", "whitenoise",
                    "vol", "0.01"], check=True, capture_output=True)
    return read_wav(speech), read_wav(noise)


def read_wav(path: Path) -> np.ndarray:
    with wave.open(str(path)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (RATE, 1, 2)
        return np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")


@TRANSPORTS
def test_server_vad_detects_a_spoken_turn_in_noise_and_answers_it(stack: Stack, tmp_path: Path, transport: str) -> None:
    """Default session (server_vad, OpenAI's defaults): noise, a sentence in
    noise, noise. One turn is detected where the speech is; its item holds the
    speech from 300 ms before the start to 500 ms after the end (the fake
    thinker's answer length says how much audio it heard); the answer comes
    by itself. Noise alone starts nothing."""
    speech, noise = synthesised(tmp_path, "Hello, what is the weather like today?")
    lead = int(0.8 * RATE)
    signal = np.zeros(lead + len(speech) + int(1.5 * RATE), dtype=np.int32)
    signal[lead:lead + len(speech)] += speech
    clean_levels = frame_levels(signal.astype(np.int16))
    loud = np.flatnonzero(clean_levels >= 0.5)
    onset_ms, offset_ms = int(loud[0]) * 10, (int(loud[-1]) + 1) * 10
    noisy = np.clip(signal + noise[: len(signal)], -32768, 32767).astype("<i2").tobytes()
    chunk = FRAME_SAMPLES * 10 * 2  # 100 ms

    async def run() -> tuple[list[dict], Reply, list[dict]]:
        async with opened(stack, transport, manual=False) as session:
            for i in range(0, len(noisy), chunk):
                await session.send("input_audio_buffer.append", audio=noisy[i:i + chunk])
            reply = await session.reply()
            detected = list(session.events)
        async with opened(stack, transport, manual=False) as quiet:
            for i in range(0, int(3 * RATE) * 2, chunk):
                await quiet.send("input_audio_buffer.append", audio=noise.tobytes()[i:i + chunk])
            await quiet.send("response.cancel")  # answered at once: nothing is running
            after_noise = await quiet.until("error")
        return detected, reply, after_noise

    events, reply, after_noise = asyncio.run(run())
    types = [e["type"] for e in events]
    assert types[:6] == ["session.created", "input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                         "input_audio_buffer.committed", "conversation.item.added", "conversation.item.done"], types
    started, stopped, committed = events[1], events[2], events[3]
    assert abs(started["audio_start_ms"] - onset_ms) <= 60, (started, onset_ms)
    assert abs(stopped["audio_end_ms"] - (offset_ms + 500)) <= 60, (stopped, offset_ms)
    assert started["item_id"] == stopped["item_id"] == committed["item_id"]
    heard_ms = stopped["audio_end_ms"] - max(0, started["audio_start_ms"] - 300)
    check_reply(reply)
    assert len(reply.text) == 8 + (heard_ms * 16 // 1280) // 2, (len(reply.text), heard_ms)
    assert types.count("input_audio_buffer.speech_started") == 1, types
    assert [e["type"] for e in after_noise] == ["error"] and after_noise[0]["error"]["code"] == \
        "response_cancel_not_active", after_noise


# ------------------------------------------------------------------ barge-in and truncation


async def long_answer(session: Session) -> None:
    """A text question whose answer runs for many seconds; returns at its first audio."""
    await session.send("conversation.item.create", item={
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": LONG_TEXT}]})
    await session.until("conversation.item.done")
    await session.send("response.create")
    await session.until("response.output_audio.delta")


@TRANSPORTS
def test_response_cancel_stops_the_decode_and_frees_the_request(stack: Stack, transport: str) -> None:
    async def run() -> tuple[Reply, float, float]:
        async with opened(stack, transport) as session:
            await long_answer(session)
            t0 = time.monotonic()
            await session.send("response.cancel")
            reply = await session.reply()
            done_s = time.monotonic() - t0
            freed_s = await asyncio.to_thread(wait_idle, stack) + done_s
        return reply, done_s, freed_s

    reply, done_s, freed_s = asyncio.run(run())
    print(f"cancel -> response.done {done_s * 1e3:.0f} ms, -> decoder idle {freed_s * 1e3:.0f} ms")
    response = reply.done["response"]
    assert (response["status"], response["status_details"]) == (
        "cancelled", {"type": "cancelled", "reason": "client_cancelled"}), response
    assert response["output"][0]["status"] == "incomplete"
    assert "response.output_audio.delta" not in reply.types[reply.types.index("response.output_audio.done"):]


@TRANSPORTS
def test_speech_during_an_answer_interrupts_it(stack: Stack, transport: str) -> None:
    """server_vad with interrupt_response: speech while the answer plays cancels it
    (reason turn_detected) before the new turn is committed and answered."""
    async def run() -> list[dict]:
        async with opened(stack, transport, manual=False) as session:
            await long_answer(session)
            await session.send("input_audio_buffer.append", audio=tone(0.4, amplitude=0.5))
            await session.until("response.done")
            await session.send("input_audio_buffer.append", audio=bytes(2 * RATE))  # a second of silence
            await session.until("response.done")
            return session.events

    events = asyncio.run(run())
    types = [e["type"] for e in events]
    started = types.index("input_audio_buffer.speech_started")
    first_done = types.index("response.done")
    assert started < first_done, types
    cancelled = events[first_done]["response"]
    assert (cancelled["status"], cancelled["status_details"]["reason"]) == ("cancelled", "turn_detected"), cancelled
    after = types[first_done + 1:]
    assert after[:4] == ["input_audio_buffer.speech_stopped", "input_audio_buffer.committed",
                         "conversation.item.added", "conversation.item.done"], after
    # the new turn's answer runs to its end: the deployment's text cap, as the
    # fake thinker answers the long conversation at more length than that
    final = events[-1]["response"]
    assert (final["status"], final["status_details"]) == (
        "incomplete", {"type": "incomplete", "reason": "max_output_tokens"}), final
    wait_idle(stack)


@TRANSPORTS
def test_truncate_keeps_what_was_heard_for_the_next_turn(stack: Stack, transport: str) -> None:
    """A reply cut at half its audio keeps the share of its transcript that
    half covers (to the end of a word: `truncated_transcript`), and the next
    turn reads that; a reply cut at 0 ms is left out of what the model reads."""
    first, second, third = tone(1.6), tone(0.5, hz=440.0), tone(0.3, hz=500.0)

    async def run() -> tuple[Reply, dict, dict, Reply, Reply, list[dict]]:
        async with opened(stack, transport) as session:
            await turn(session, first)
            await session.send("response.create")
            reply = await session.reply()
            item_id = reply.done["response"]["output"][0]["id"]
            heard_ms = len(reply.audio) // 2 * 1000 // RATE // 2
            await session.send("conversation.item.truncate", item_id=item_id, content_index=0, audio_end_ms=heard_ms)
            truncated = (await session.until("conversation.item.truncated"))[-1]
            await session.send("conversation.item.retrieve", item_id=item_id)
            retrieved = (await session.until("conversation.item.retrieved"))[-1]
            errors = []
            for bad in ({"item_id": item_id, "content_index": 0, "audio_end_ms": heard_ms + 1},  # past the cut
                        {"item_id": "item_nope", "content_index": 0, "audio_end_ms": 0},
                        {"item_id": item_id, "content_index": 3, "audio_end_ms": 0}):
                await session.send("conversation.item.truncate", **bad)
                errors.append((await session.until("error"))[-1]["error"])
            await turn(session, second)
            await session.send("response.create")
            after = await session.reply()
            await session.send("conversation.item.truncate", item_id=after.done["response"]["output"][0]["id"],
                               content_index=0, audio_end_ms=0)
            await session.until("conversation.item.truncated")
            await turn(session, third)
            await session.send("response.create")
            return reply, truncated, retrieved, after, await session.reply(), errors

    reply, truncated, retrieved, after, last, errors = asyncio.run(run())
    total_ms = len(reply.audio) // 2 * 1000 // RATE
    assert truncated["audio_end_ms"] == total_ms // 2 and truncated["content_index"] == 0
    kept = truncated_transcript(reply.text, (total_ms // 2) / total_ms)
    assert retrieved["item"]["content"][0]["transcript"] == kept, (retrieved, reply.text)
    assert [(e["code"], e["param"]) for e in errors] == [
        ("invalid_argument", "audio_end_ms"), ("item_not_found", "item_id"), ("invalid_argument", "content_index")]
    convo = [("user", [audio_part(first)]), ("assistant", [text_part(kept)]), ("user", [audio_part(second)])]
    assert (after.text, after.audio) == generate(stack.gateway_target, convo, after.seed)
    convo.append(("user", [audio_part(third)]))  # the reply cut at 0 ms is not read
    assert (last.text, last.audio) == generate(stack.gateway_target, convo, last.seed)


# ------------------------------------------------------------------ bad input, vanishing clients

BAD_EVENTS = [
    ({"type": "response.begin"}, "invalid_argument", "type"),
    ({"type": "input_audio_buffer.commit", "item_id": "item_1"}, "invalid_argument", "item_id"),
    ({"type": "input_audio_buffer.append", "audio": "%%%"}, "invalid_argument", "audio"),
    ({"type": "input_audio_buffer.append", "audio": base64.b64encode(b"\x00\x01\x02").decode()}, "invalid_argument",
     "audio"),
    ({"type": "input_audio_buffer.append", "audio": base64.b64encode(bytes(2 * 61 * RATE)).decode()},
     "input_audio_buffer_full", "audio"),
    ({"type": "input_audio_buffer.commit"}, "input_audio_buffer_commit_empty", None),
    ({"type": "response.cancel"}, "response_cancel_not_active", "response_id"),
    ({"type": "response.create"}, "conversation_needs_user_turn", None),
    ({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {"format": {"type": "audio/pcmu"}}}}},
     "invalid_argument", "session.audio.input.format.type"),
    ({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {"turn_detection": {
        "type": "semantic_vad"}}}}}, "invalid_argument", "session.audio.input.turn_detection.type"),
    ({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {"transcription": {
        "model": "whisper-1"}}}}}, "invalid_argument", "session.audio.input.transcription"),
    ({"type": "session.update", "session": {"type": "realtime", "audio": {"output": {"voice": "nobody"}}}},
     "invalid_argument", "session.audio.output.voice"),
    ({"type": "session.update", "session": {"type": "realtime", "output_modalities": ["text", "audio"]}},
     "invalid_argument", "session.output_modalities"),
    ({"type": "session.update", "session": {"type": "realtime", "temperature": 0.7}}, "invalid_argument",
     "session.temperature"),
    ({"type": "conversation.item.create", "item": {"type": "function_call", "name": "f"}}, "invalid_argument",
     "item.type"),
    ({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
        {"type": "input_audio", "audio": ""}]}}, "invalid_argument", "item.content[0].audio"),
    ({"type": "conversation.item.truncate", "item_id": "item_x", "content_index": 0, "audio_end_ms": 0},
     "item_not_found", "item_id"),
    ({"type": "response.create", "response": {"input": []}}, "invalid_argument", "response.input"),
]


@TRANSPORTS
def test_bad_events_are_answered_with_errors_and_the_session_goes_on(stack: Stack, transport: str) -> None:
    async def run() -> tuple[list[dict], list[tuple[str, str]], Reply]:
        async with opened(stack, transport) as session:
            errors = []
            for i, (event, _, _) in enumerate(BAD_EVENTS):
                await session.send_raw({**event, "event_id": f"evt_{i}"})
                errors.append((await session.until("error"))[-1])
            params = await session.send_malformed()
            malformed = [((await session.until("error"))[-1]["error"]["param"], want) for want in params]
            # nothing above changed the session: a turn is answered as usual
            await turn(session, tone(0.5))
            await session.send("response.create")
            await session.send("response.create", event_id="evt_again")  # while one runs: refused
            events = []
            while not events or events[-1]["type"] != "response.done":
                events.append(await session.recv())
            refused = [e for e in events if e["type"] == "error"]
            assert [(e["error"]["code"], e["error"]["event_id"]) for e in refused] == [
                ("conversation_already_has_active_response", "evt_again")], refused
            reply = reply_of(events)
            return errors, malformed, reply

    errors, malformed, reply = asyncio.run(run())
    got = [(e["error"]["code"], e["error"]["param"], e["error"]["event_id"]) for e in errors]
    assert got == [(code, param, f"evt_{i}") for i, (_, code, param) in enumerate(BAD_EVENTS)], got
    assert all(e["error"]["type"] == "invalid_request_error" and e["error"]["message"] for e in errors), errors
    assert all(got == want for got, want in malformed), malformed
    check_reply(reply)


@TRANSPORTS
def test_a_client_that_vanishes_mid_answer_frees_everything(stack: Stack, transport: str) -> None:
    def gateway_streams() -> float:
        with contextlib.closing(__import__("urllib.request").request.urlopen(stack.http_url + "/metrics")) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("omni_gateway_active_streams "):
                    return float(line.split()[1])
        raise AssertionError("no omni_gateway_active_streams")

    wait_idle(stack)  # what earlier tests cancelled is gone

    async def run() -> None:
        async with opened(stack, transport) as session:
            await long_answer(session)
            assert decoder_active(stack) == 1
            await session.vanish()

    asyncio.run(run())
    wait_idle(stack)
    deadline = time.monotonic() + 30
    while gateway_streams():
        assert time.monotonic() < deadline, "the gateway still counts the session's stream"
        time.sleep(0.05)


@TRANSPORTS
def test_items_are_placed_retrieved_and_deleted_and_the_buffer_cleared(stack: Stack, transport: str) -> None:
    def message(item_id: str, role: str, text: str) -> dict:
        kind = "output_text" if role == "assistant" else "input_text"
        return {"id": item_id, "type": "message", "role": role, "content": [{"type": kind, "text": text}]}

    async def run() -> dict:
        seen: dict = {}
        async with opened(stack, transport) as session:
            async def one(type_: str, want: str, **fields: object) -> dict:
                await session.send(type_, **fields)
                return (await session.until(want, "error"))[-1]

            await one("conversation.item.create", "conversation.item.done", item=message("u1", "user", "Hi"))
            seen["root"] = await one("conversation.item.create", "conversation.item.done",
                                     item=message("s0", "system", "Be brief."), previous_item_id="root")
            seen["after"] = await one("conversation.item.create", "conversation.item.done",
                                      item=message("a1", "assistant", "Hello."), previous_item_id="s0")
            seen["again"] = await one("conversation.item.create", "conversation.item.done",
                                      item=message("u1", "user", "Hi again"))
            seen["deleted"] = await one("conversation.item.delete", "conversation.item.deleted", item_id="a1")
            seen["gone"] = await one("conversation.item.retrieve", "conversation.item.retrieved", item_id="a1")
            await session.send("input_audio_buffer.append", audio=tone(0.5))
            seen["cleared"] = await one("input_audio_buffer.clear", "input_audio_buffer.cleared")
            seen["empty"] = await one("input_audio_buffer.commit", "input_audio_buffer.committed")
            # an out-of-band answer: not in the conversation, its metadata echoed
            await session.send("response.create", response={"conversation": "none", "metadata": {"k": "v"}})
            seen["oob"] = await session.reply()
            seen["not_kept"] = await one("conversation.item.retrieve", "conversation.item.retrieved",
                                         item_id=seen["oob"].done["response"]["output"][0]["id"])
            # the running answer's item cannot be deleted
            await long_answer(session)
            running = next(e for e in reversed(session.events) if e["type"] == "response.output_item.added")
            seen["in_progress"] = await one("conversation.item.delete", "conversation.item.deleted",
                                            item_id=running["item"]["id"])
            await session.send("response.cancel")
            await session.until("response.done")
        return seen

    seen = asyncio.run(run())
    assert seen["root"]["previous_item_id"] is None and seen["after"]["previous_item_id"] == "s0", seen
    assert seen["again"]["error"]["code"] == "item_already_exists", seen["again"]
    assert seen["deleted"]["item_id"] == "a1"
    assert (seen["gone"]["error"]["code"], seen["gone"]["error"]["param"]) == ("item_not_found", "item_id")
    assert seen["cleared"]["type"] == "input_audio_buffer.cleared"
    assert seen["empty"]["error"]["code"] == "input_audio_buffer_commit_empty", seen["empty"]
    response = seen["oob"].done["response"]
    assert response["status"] == "completed" and response["conversation_id"] is None, response
    assert response["metadata"] == {"k": "v"} and "conversation.item.added" not in seen["oob"].types
    assert seen["not_kept"]["error"]["code"] == "item_not_found"
    assert seen["in_progress"]["error"]["code"] == "item_in_progress", seen["in_progress"]
    wait_idle(stack)
