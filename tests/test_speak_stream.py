"""SpeakStream: text in while audio comes out (gRPC and the WebSocket route).

* The segmenter on its own (boundaries, abbreviations, numbers, the cap, CJK).
* Real processes: a fake-engine decoder (``python -m decoder_svc --engine
  fake``, a deterministic test double) and a gateway (``python -m gateway``
  with HTTP), each its own process: a paragraph sent word by word is heard
  before its last word is sent, and is the same audio as Speak of each
  segment; a barge-in aborts the decoder request and the call goes on; bad
  input is refused naming the field; a client that goes away leaves nothing
  running. Both over gRPC and over the WebSocket. The measured times are
  printed (``-s``).
* In-process, against `FakeDecoder` (a paced test double): the call holds
  one admission slot, and a cancel aborts exactly the segment in progress.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import grpc
import pytest
from fakes import FakeDecoder, FakeDecoderConfig, GatewayThread, short_socket_dir

from decoder_svc.testing.fake_engine import FAKE_SLOW_MARKER
from gateway.speak_stream import Segmenter
from omni_common import shm_arena
from omni_common.server import wait_for_health_sync
from omni_serving.v1 import (
    common_pb2,
    decoder_pb2,
    decoder_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
)

REPO = Path(__file__).resolve().parents[1]
MAX_TEXT_CHARS = 1000
SEED = 7
WORD_DELAY_S = 0.03
AUDIO = gateway_pb2.SPEAK_STREAM_EVENT_AUDIO
SEGMENT_END = gateway_pb2.SPEAK_STREAM_EVENT_SEGMENT_END
CANCELLED = gateway_pb2.SPEAK_STREAM_EVENT_CANCELLED
END = gateway_pb2.SPEAK_STREAM_EVENT_END

PARAGRAPH = (
    "Streaming speech should start early. The gateway cuts the text at the end of each "
    "sentence, and at a clause once it is long enough to stand alone, so nobody waits for "
    "the whole answer. Mr. Smith paid 3.14 dollars, e.g. for a cup of tea! Does it really "
    "work? It does, and the last words arrive long after the first audio."
)
# Three sentences of about 200 characters: each is one segment of a few hundred
# decoder steps, slowed (FAKE_SLOW_MARKER: about 2 s each), so that a segment is
# still running when a cancel sent at its first audio arrives.
LONG_SENTENCE = FAKE_SLOW_MARKER + (
    "This sentence is long on purpose because the barge-in test needs a segment that is "
    "still being spoken when the cancel arrives at the gateway and the decoder request is "
    "aborted at once. "
)


# ---------------------------------------------------------------------------
# The segmenter.


def segments_of(text: str, piece: int | None = None, **options: int) -> list[str]:
    """All segments of `text` pushed whole or `piece` characters at a time, then flushed."""
    segmenter = Segmenter(**options)
    pieces = [text] if piece is None else [text[i : i + piece] for i in range(0, len(text), piece)]
    out = [s for p in pieces for s in segmenter.push(p)]
    tail = segmenter.flush()
    return out + ([tail] if tail else [])


@pytest.mark.parametrize(
    ("text", "want"),
    [
        pytest.param(
            "Hello there. How are you? Fine!",
            ["Hello there.", "How are you?", "Fine!"],
            id="sentences",
        ),
        pytest.param(
            "Mr. Smith met Dr. Jones at 3.14 p.m. today. Then e.g. tea, i.e. a drink. Done.",
            [
                "Mr. Smith met Dr. Jones at 3.14 p.m. today.",
                "Then e.g. tea, i.e. a drink.",
                "Done.",
            ],
            id="abbreviations-and-numbers",
        ),
        pytest.param(
            "It costs 3.50 now. Version 2.0.1 ships in 2025. Yes.",
            ["It costs 3.50 now.", "Version 2.0.1 ships in 2025.", "Yes."],
            id="decimals",
        ),
        pytest.param(
            "1. Buy milk. 2. Buy eggs.", ["1. Buy milk.", "2. Buy eggs."], id="list-numbers"
        ),
        pytest.param(
            'He said "Stop." Then he went... away?! Yes.',
            ['He said "Stop."', "Then he went...", "away?!", "Yes."],
            id="closers-and-runs",
        ),
        pytest.param(
            "Well, this first clause is long enough, and this second clause is long enough to "
            "stand alone, but short, not.",
            [
                "Well, this first clause is long enough,",
                "and this second clause is long enough to stand alone,",
                "but short, not.",
            ],
            id="clauses",
        ),
        pytest.param(
            "Right; one: two, three and then the rest of it.",
            ["Right; one: two,", "three and then the rest of it."],
            id="first-clause-early",
        ),
        pytest.param(
            "你好。今天天气很好！你呢？好的",
            ["你好。", "今天天气很好！", "你呢？", "好的"],
            id="cjk",
        ),
        pytest.param(
            "Title line\n\nBody text here", ["Title line", "Body text here"], id="blank-line"
        ),
        pytest.param("... --- Hello. ---", ["... --- Hello."], id="no-letters-alone"),
    ],
)
def test_segmenter_boundaries(text: str, want: list[str]) -> None:
    assert segments_of(text) == want
    # The same cuts whatever the pieces: a boundary waits for the character after it.
    for piece in (1, 2, 7):
        assert segments_of(text, piece) == want, f"{piece=}"


def test_segmenter_waits_for_the_character_after_a_mark() -> None:
    segmenter = Segmenter()
    assert segmenter.push("It costs 3.") == []  # "3." may become "3.14"
    assert segmenter.push("14 now.") == []  # the last "." may still be "now.)"
    assert segmenter.push(" Next") == ["It costs 3.14 now."]
    assert segmenter.flush() == "Next"
    assert segmenter.flush() is None


def test_segmenter_cap_cuts_at_the_last_space() -> None:
    words = " ".join(f"w{i:03d}" for i in range(100))  # no punctuation at all
    segments = segments_of(words, max_chars=50)
    assert all(len(s) <= 50 for s in segments), [len(s) for s in segments]
    assert " ".join(segments) == words  # cut between words only
    assert len(segments[0]) > 40
    # No space within the cap: cut at the cap.
    assert segments_of("x" * 120, max_chars=50) == ["x" * 50, "x" * 50, "x" * 20]


def test_segmenter_clear_drops_the_buffer_and_restarts_the_first_rule() -> None:
    segmenter = Segmenter()
    assert segmenter.push("A long first clause here, then") == ["A long first clause here,"]
    assert segmenter.push(" more, and more") == []  # later clauses need 40 characters
    segmenter.clear()
    assert segmenter.buffered == 0
    assert segmenter.push("Fresh start now, again") == ["Fresh start now,"]


# ---------------------------------------------------------------------------
# Real processes: a fake-engine decoder and a gateway.


class Proc:
    """A service process in its own session, stopped by its pid at the end."""

    def __init__(self, argv: list[str], env: dict[str, str], stdout: int | None = None) -> None:
        self.proc = subprocess.Popen(
            argv,
            env={**os.environ, **env},
            cwd=REPO,
            start_new_session=True,
            stdout=stdout,
            text=True,
        )

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGKILL)
                self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return self.proc.returncode


@dataclass
class Stack:
    gateway_target: str
    decoder_target: str
    http_port: int
    channel: grpc.Channel
    stub: gateway_pb2_grpc.OmniGatewayServiceStub
    decoder_stub: decoder_pb2_grpc.DecoderServiceStub

    def decoder_info(self) -> decoder_pb2.GetDecoderInfoResponse:
        return self.decoder_stub.GetDecoderInfo(decoder_pb2.GetDecoderInfoRequest(), timeout=5)

    def active_streams(self) -> int:
        async def get() -> int:
            async with (
                aiohttp.ClientSession() as session,
                session.get(f"http://127.0.0.1:{self.http_port}/health") as response,
            ):
                return int((await response.json())["active_streams"])

        return asyncio.run(get())

    def speak_pcm(self, text: str) -> tuple[bytes, str]:
        chunks = list(
            self.stub.Speak(
                gateway_pb2.SpeakRequest(
                    text=text, sampling_params=common_pb2.SamplingParams(seed=SEED)
                ),
                timeout=20,
            )
        )
        return b"".join(c.audio for c in chunks), chunks[-1].finish_reason


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    directory = short_socket_dir()
    deployment = f"spkstream{os.getpid()}"
    decoder_target = f"unix://{directory / 'decoder.sock'}"
    gateway_target = f"unix://{directory / 'gateway.sock'}"
    env = {"PYTHONUNBUFFERED": "1", "TMPDIR": str(directory)}
    decoder = Proc(
        [
            sys.executable, "-m", "decoder_svc", "--listen", decoder_target, "--engine", "fake",
            "--profile", "tts", "--deployment", deployment, "--metrics-port", "-1",
            "--log-level", "WARNING",
        ],
        env,
    )  # fmt: skip
    gateway = None
    channel = decoder_channel = None
    try:
        wait_for_health_sync(decoder_target, 120)
        gateway = Proc(
            [
                sys.executable, "-m", "gateway", "--listen", gateway_target,
                "--decoder", decoder_target, "--http-port", "0",
                "--max-text-chars", str(MAX_TEXT_CHARS), "--log-level", "WARNING",
            ],
            env,
            stdout=subprocess.PIPE,
        )  # fmt: skip
        assert gateway.proc.stdout is not None
        line = gateway.proc.stdout.readline()
        assert "HTTP on port " in line, line
        http_port = int(line.split("HTTP on port ")[1].split()[0].rstrip(","))
        wait_for_health_sync(gateway_target, 60)
        channel = grpc.insecure_channel(gateway_target)
        decoder_channel = grpc.insecure_channel(decoder_target)
        yield Stack(
            gateway_target,
            decoder_target,
            http_port,
            channel,
            gateway_pb2_grpc.OmniGatewayServiceStub(channel),
            decoder_pb2_grpc.DecoderServiceStub(decoder_channel),
        )
    finally:
        for ch in (channel, decoder_channel):
            if ch is not None:
                ch.close()
        if gateway is not None:
            assert gateway.stop() == 0, "gateway did not stop cleanly"
        decoder.stop()
        shm_arena.sweep_stale(f"omni-{deployment}")
        shutil.rmtree(directory, ignore_errors=True)


def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"not within {timeout_s}s")
        time.sleep(0.01)
    return time.monotonic() - start


def nothing_running(stack: Stack) -> bool:
    return stack.decoder_info().active_requests == 0 and stack.active_streams() == 0


def config_message(**fields: object) -> gateway_pb2.SpeakStreamRequest:
    fields.setdefault("sampling_params", common_pb2.SamplingParams(seed=SEED))
    return gateway_pb2.SpeakStreamRequest(config=gateway_pb2.SpeakStreamConfig(**fields))


def text_message(text: str) -> gateway_pb2.SpeakStreamRequest:
    return gateway_pb2.SpeakStreamRequest(text=text)


CANCEL_MESSAGE = gateway_pb2.SpeakStreamRequest(cancel=gateway_pb2.SpeakStreamCancel())
END_MESSAGE = gateway_pb2.SpeakStreamRequest(end=gateway_pb2.SpeakStreamEnd())


class Outbox:
    """Client messages of a gRPC call, sent when the test puts them (None ends the stream)."""

    def __init__(self) -> None:
        self._queue: queue.Queue[gateway_pb2.SpeakStreamRequest | None] = queue.Queue()
        self.sent_at: list[float] = []

    def put(self, *messages: gateway_pb2.SpeakStreamRequest | None) -> None:
        for message in messages:
            self._queue.put(message)

    def __iter__(self) -> Iterator[gateway_pb2.SpeakStreamRequest]:
        while (message := self._queue.get()) is not None:
            self.sent_at.append(time.monotonic())
            yield message


@dataclass
class Segment:
    index: int
    text: str = ""
    audio: bytearray = field(default_factory=bytearray)
    finish_reason: str = ""


def segments_from(
    responses: list[gateway_pb2.SpeakStreamResponse], first: int = 0
) -> list[Segment]:
    """The call's segments, checking the order rules (text on first AUDIO, one SEGMENT_END)."""
    segments: dict[int, Segment] = {}
    for r in responses:
        if r.event == AUDIO:
            if r.segment not in segments:
                assert r.segment_text, f"first AUDIO of segment {r.segment} has no text"
                segments[r.segment] = Segment(r.segment, r.segment_text)
            seg = segments[r.segment]
            assert not seg.finish_reason, f"AUDIO of segment {r.segment} after its SEGMENT_END"
            seg.audio += r.audio
        elif r.event == SEGMENT_END:
            seg = segments.setdefault(r.segment, Segment(r.segment, r.segment_text))
            assert r.segment_text == seg.text
            seg.finish_reason = r.finish_reason
    assert list(segments) == list(range(first, first + len(segments))), "segments out of order"
    return list(segments.values())


def check_against_speak(stack: Stack, segments: list[Segment]) -> None:
    """Each segment's audio is byte for byte Speak's audio of its text (same seed and voice)."""
    for seg in segments:
        pcm, finish_reason = stack.speak_pcm(seg.text)
        assert bytes(seg.audio) == pcm, f"segment {seg.index} {seg.text!r}"
        assert seg.finish_reason == (finish_reason or "stop"), seg


def test_grpc_first_audio_before_the_last_word(stack: Stack) -> None:
    words = PARAGRAPH.split(" ")

    def requests() -> Iterator[gateway_pb2.SpeakStreamRequest]:
        yield config_message(request_id="para")
        for i, word in enumerate(words):
            time.sleep(WORD_DELAY_S)
            times["last_word"] = time.monotonic()
            yield text_message(word if i == 0 else " " + word)
        yield END_MESSAGE

    times: dict[str, float] = {}
    responses = []
    start = time.monotonic()
    for response in stack.stub.SpeakStream(requests(), timeout=60):
        if response.event == AUDIO and response.audio and "first_audio" not in times:
            times["first_audio"] = time.monotonic()
        responses.append(response)

    first, last = times["first_audio"] - start, times["last_word"] - start
    print(f"\ngRPC: first audio {first:.3f}s, last word sent {last:.3f}s")
    assert first < last, f"first audio at {first:.3f}s, last word sent at {last:.3f}s"
    assert [r.sequence_number for r in responses] == list(range(len(responses)))
    assert {r.request_id for r in responses} == {"para"}
    assert responses[-1].event == END and [r.event for r in responses].count(END) == 1
    assert responses[-1].metrics.ttfp_ms > 0
    segments = segments_from(responses)
    assert len(segments) >= 5, [s.text for s in segments]
    assert " ".join(s.text for s in segments) == PARAGRAPH
    assert all(s.audio for s in segments)
    total = sum(len(s.audio) for s in segments)
    assert responses[-1].metrics.audio_seconds == pytest.approx(total / 2 / 24000)
    check_against_speak(stack, segments)
    decoder_ids = {f"para/{s.index}" for s in segments}
    assert len(decoder_ids) == len(segments)
    wait_until(lambda: nothing_running(stack))


def test_grpc_barge_in(stack: Stack) -> None:
    aborted_before = stack.decoder_info().aborted_requests
    outbox = Outbox()
    outbox.put(config_message(request_id="barge"), text_message(LONG_SENTENCE * 3))
    call = stack.stub.SpeakStream(iter(outbox), timeout=60)
    responses: list[gateway_pb2.SpeakStreamResponse] = []
    cancel_at = cancelled_at = 0.0
    audio_in_flight = 0
    for response in call:
        responses.append(response)
        if response.event == AUDIO and not cancel_at:
            outbox.put(CANCEL_MESSAGE)  # barge-in at the first audio
            cancel_at = time.monotonic()
        elif response.event == AUDIO and not cancelled_at:
            audio_in_flight += 1
        if response.event == CANCELLED:
            cancelled_at = time.monotonic()
            break
    latency_ms = (cancelled_at - cancel_at) * 1000
    # The decoder request was aborted, and nothing runs on the decoder.
    wait_until(lambda: stack.decoder_info().aborted_requests > aborted_before, 2.0)
    assert stack.decoder_info().active_requests == 0
    # Before CANCELLED: the cut segment ends with "abort", and it was cut short.
    (cut,) = segments_from(responses)
    assert cut.finish_reason == "abort"
    full, _ = stack.speak_pcm(cut.text)
    assert 0 < len(cut.audio) < len(full), f"{len(cut.audio)=} {len(full)=}"
    assert full.startswith(bytes(cut.audio))

    # The call goes on: the next text is spoken, as segment 1.
    outbox.put(text_message("And now for something new."), END_MESSAGE, None)
    rest = list(call)
    print(
        f"\ngRPC barge-in: CANCELLED {latency_ms:.1f} ms after the cancel was sent; "
        f"{audio_in_flight} AUDIO message(s) in between"
    )
    assert all(r.event != AUDIO or r.segment >= 1 for r in rest), "audio of the cut segment"
    assert rest[-1].event == END
    (new,) = segments_from(rest, first=1)
    assert (new.index, new.text, new.finish_reason) == (1, "And now for something new.", "stop")
    check_against_speak(stack, [new])
    everything = responses + rest
    assert [r.sequence_number for r in everything] == list(range(len(everything)))
    wait_until(lambda: nothing_running(stack))


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        pytest.param([text_message("Hello.")], "config", id="text-before-config"),
        pytest.param([END_MESSAGE], "config", id="end-before-config"),
        pytest.param([config_message(), config_message()], "config", id="config-twice"),
        pytest.param(
            [config_message(), text_message("x" * (MAX_TEXT_CHARS + 1))], "text", id="huge-text"
        ),
        pytest.param(
            [config_message(), *[text_message("y " * 300)] * 3], "text", id="too-much-pending"
        ),
        pytest.param([config_message(voice="zed")], "config.voice", id="unknown-voice"),
        pytest.param([config_message(voice="v" * 200)], "config.voice", id="long-voice"),
        pytest.param(
            [config_message(sample_rate_hz=16000)], "config.sample_rate_hz", id="sample-rate"
        ),
        pytest.param([config_message(encoding=7)], "config.encoding", id="encoding"),
        pytest.param(
            [config_message(sampling_params=common_pb2.SamplingParams(top_p=2.0))],
            "config.sampling_params.top_p",
            id="top-p",
        ),
        pytest.param(
            [config_message(), gateway_pb2.SpeakStreamRequest()], "kind", id="empty-message"
        ),
        pytest.param(
            [config_message(), text_message(LONG_SENTENCE), END_MESSAGE, text_message("late")],
            "text",
            id="text-after-end",
        ),
    ],
)
def test_grpc_bad_input(
    stack: Stack, messages: list[gateway_pb2.SpeakStreamRequest], field: str
) -> None:
    def requests() -> Iterator[gateway_pb2.SpeakStreamRequest]:
        yield from messages
        time.sleep(2)  # keep the call open: the gateway must answer, not the end of input

    with pytest.raises(grpc.RpcError) as info:
        list(stack.stub.SpeakStream(requests(), timeout=20))
    err = info.value
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
    assert err.details().startswith(f"{field}:"), err.details()
    assert len(err.details()) <= 512
    wait_until(lambda: nothing_running(stack))


def test_grpc_client_disconnect_aborts_everything(stack: Stack) -> None:
    aborted_before = stack.decoder_info().aborted_requests
    outbox = Outbox()
    outbox.put(config_message(request_id="gone"), text_message(LONG_SENTENCE * 3))
    call = stack.stub.SpeakStream(iter(outbox), timeout=60)
    for response in call:
        if response.event == AUDIO:
            break
    call.cancel()
    outbox.put(None)
    took = wait_until(lambda: nothing_running(stack), 2.0)
    assert stack.decoder_info().aborted_requests > aborted_before
    print(f"\ngRPC disconnect: nothing running {took:.3f}s after the client cancelled")


# ---------------------------------------------------------------------------
# The WebSocket route, on the same processes.


def ws_url(stack: Stack) -> str:
    return f"http://127.0.0.1:{stack.http_port}/v1/audio/speech/stream"


@dataclass
class WsSegment:
    index: int
    text: str
    audio: bytearray = field(default_factory=bytearray)
    finish_reason: str = ""


def ws_segments(frames: list[object], first: int = 0) -> list[WsSegment]:
    """Segments from received frames (dicts for JSON, bytes for audio), checking their order."""
    segments: list[WsSegment] = []
    current: WsSegment | None = None
    for frame in frames:
        if isinstance(frame, bytes):
            assert current is not None and not current.finish_reason, "audio outside a segment"
            current.audio += frame
        elif frame["type"] == "segment.start":
            assert current is None or current.finish_reason, "segment.start inside a segment"
            current = WsSegment(frame["segment"], frame["text"])
            assert current.index == first + len(segments), "segments out of order"
            segments.append(current)
        elif frame["type"] == "segment.end":
            assert current is not None and frame["segment"] == current.index
            assert frame["text"] == current.text
            current.finish_reason = frame["finish_reason"]
            assert frame["audio_seconds"] == pytest.approx(len(current.audio) / 2 / 24000)
    return segments


async def receive(ws: aiohttp.ClientWebSocketResponse) -> object:
    message = await ws.receive(timeout=20)
    if message.type is aiohttp.WSMsgType.BINARY:
        return message.data
    if message.type is aiohttp.WSMsgType.TEXT:
        return json.loads(message.data)
    return message.type  # CLOSE, CLOSED, ERROR


def test_ws_first_audio_before_the_last_word(stack: Stack) -> None:
    words = PARAGRAPH.split(" ")
    times: dict[str, float] = {}

    async def run() -> list[object]:
        async with (
            aiohttp.ClientSession() as session,
            session.ws_connect(ws_url(stack)) as ws,
        ):
            await ws.send_json({"type": "config", "response_format": "pcm", "seed": SEED})

            async def send_words() -> None:
                for i, word in enumerate(words):
                    await asyncio.sleep(WORD_DELAY_S)
                    times["last_word"] = time.monotonic()
                    await ws.send_json({"type": "text", "text": word if i == 0 else " " + word})
                await ws.send_json({"type": "end"})

            sender = asyncio.create_task(send_words())
            frames: list[object] = []
            while True:
                frame = await receive(ws)
                if isinstance(frame, bytes) and "first_audio" not in times:
                    times["first_audio"] = time.monotonic()
                frames.append(frame)
                if isinstance(frame, bytes):
                    continue
                if not isinstance(frame, dict) or frame["type"] in ("end", "error"):
                    break
            await sender
            assert await receive(ws) is aiohttp.WSMsgType.CLOSE
            assert ws.close_code == 1000
            return frames

    start = time.monotonic()
    frames = asyncio.run(run())
    first, last = times["first_audio"] - start, times["last_word"] - start
    print(f"\nWebSocket: first audio {first:.3f}s, last word sent {last:.3f}s")
    assert first < last
    ready = frames[0]
    assert ready["type"] == "ready" and ready["sample_rate"] == 24000 and ready["request_id"]
    assert frames[-1]["type"] == "end"
    segments = ws_segments(frames)
    assert " ".join(s.text for s in segments) == PARAGRAPH
    assert frames[-1]["segments"] == len(segments)
    assert all(s.finish_reason for s in segments)
    check_against_speak(
        stack,
        [Segment(s.index, s.text, s.audio, s.finish_reason) for s in segments],
    )
    wait_until(lambda: nothing_running(stack))


def test_ws_barge_in(stack: Stack) -> None:
    aborted_before = stack.decoder_info().aborted_requests

    async def run() -> tuple[list[object], list[object], float, int]:
        async with (
            aiohttp.ClientSession() as session,
            session.ws_connect(ws_url(stack)) as ws,
        ):
            await ws.send_json({"type": "config", "seed": SEED, "request_id": "wsbarge"})
            await ws.send_json({"type": "text", "text": LONG_SENTENCE * 3})
            before: list[object] = []
            cancel_at = 0.0
            in_flight = 0
            while True:
                frame = await receive(ws)
                before.append(frame)
                if isinstance(frame, bytes):
                    if not cancel_at:
                        await ws.send_json({"type": "cancel"})
                        cancel_at = time.monotonic()
                    else:
                        in_flight += 1
                elif frame["type"] == "cancelled":
                    latency = time.monotonic() - cancel_at
                    break
                else:
                    assert frame["type"] in ("ready", "segment.start", "segment.end"), frame
            await ws.send_json({"type": "text", "text": "And now for something new. "})
            await ws.send_json({"type": "end"})
            after = []
            while isinstance(frame := await receive(ws), (bytes, dict)):
                after.append(frame)
            return before, after, latency, in_flight

    before, after, latency, in_flight = asyncio.run(run())
    print(
        f"\nWebSocket barge-in: cancelled {latency * 1000:.1f} ms after the cancel was sent; "
        f"{in_flight} audio frame(s) in between"
    )
    wait_until(lambda: stack.decoder_info().aborted_requests > aborted_before, 2.0)
    (cut,) = ws_segments(before)
    assert cut.finish_reason == "abort"
    full, _ = stack.speak_pcm(cut.text)
    assert 0 < len(cut.audio) < len(full) and full.startswith(bytes(cut.audio))
    assert after[-1]["type"] == "end" and after[-1]["segments"] == 2
    (new,) = ws_segments(after, first=1)
    assert (new.text, new.finish_reason) == ("And now for something new.", "stop")
    check_against_speak(stack, [Segment(new.index, new.text, new.audio, new.finish_reason)])
    wait_until(lambda: nothing_running(stack))


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        pytest.param([{"type": "text", "text": "Hello."}], "config", id="text-before-config"),
        pytest.param([{"type": "config"}, {"type": "text", "text": "x" * 1001}], "text", id="huge"),
        pytest.param([{"type": "config", "voice": "zed"}], "voice", id="unknown-voice"),
        pytest.param([{"type": "config", "sample_rate": 8000}], "sample_rate", id="rate"),
        pytest.param([{"type": "config", "seed": -1}], "seed", id="seed"),
        pytest.param([{"type": "config", "seed": "1"}], "seed", id="seed-type"),
        pytest.param([{"type": "config", "response_format": "wav"}], "response_format", id="fmt"),
        pytest.param([{"type": "config", "sampleRate": 1}], "sampleRate", id="unknown-field"),
        pytest.param([{"type": "config"}, {"type": "text", "text": 5}], "text", id="text-type"),
        pytest.param([{"type": "config"}, {"type": "shout"}], "type", id="unknown-type"),
        pytest.param(["[1, 2]"], "message", id="not-an-object"),
        pytest.param(["{"], "message", id="not-json"),
    ],
)
def test_ws_bad_input(stack: Stack, messages: list[object], param: str) -> None:
    async def run() -> tuple[list[object], int | None]:
        async with (
            aiohttp.ClientSession() as session,
            session.ws_connect(ws_url(stack)) as ws,
        ):
            for message in messages:
                if isinstance(message, str):
                    await ws.send_str(message)
                else:
                    await ws.send_json(message)
            frames = []
            while isinstance(frame := await receive(ws), (bytes, dict)):
                frames.append(frame)
            return frames, ws.close_code

    frames, close_code = asyncio.run(run())
    error = frames[-1]
    assert error["type"] == "error", frames
    assert error["error"]["param"] == param, error
    assert error["error"]["code"] == "invalid_argument"
    assert error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"].startswith(f"{param}:"), error
    assert close_code == 1008
    wait_until(lambda: nothing_running(stack))


def test_ws_needs_an_upgrade(stack: Stack) -> None:
    async def run() -> tuple[int, dict]:
        async with aiohttp.ClientSession() as session, session.get(ws_url(stack)) as response:
            return response.status, await response.json()

    status, body = asyncio.run(run())
    assert status == 426 and body["error"]["code"] == "upgrade_required"


def test_ws_client_disconnect_aborts_everything(stack: Stack) -> None:
    aborted_before = stack.decoder_info().aborted_requests

    async def run() -> None:
        async with aiohttp.ClientSession() as session:
            ws = await session.ws_connect(ws_url(stack))
            await ws.send_json({"type": "config"})
            await ws.send_json({"type": "text", "text": LONG_SENTENCE * 3})
            while not isinstance(await receive(ws), bytes):
                pass
            await ws.close()

    asyncio.run(run())
    took = wait_until(lambda: nothing_running(stack), 2.0)
    assert stack.decoder_info().aborted_requests > aborted_before
    print(f"\nWebSocket disconnect: nothing running {took:.3f}s after the client closed")


# ---------------------------------------------------------------------------
# In-process, against FakeDecoder (a paced test double).


@pytest.fixture
def paced(sock_dir: Path) -> Iterator[tuple[FakeDecoder, GatewayThread]]:
    config = FakeDecoderConfig(num_chunks=50, delay_s=0.02)
    with (
        FakeDecoder(sock_dir / "d.sock", config) as fake,
        GatewayThread(fake.target, sock_dir, max_concurrent=1, http_port=0) as gw,
    ):
        yield fake, gw


def test_a_call_holds_one_admission_slot(paced: tuple[FakeDecoder, GatewayThread]) -> None:
    fake, gw = paced
    outbox = Outbox()
    outbox.put(config_message(request_id="slot"))
    call = gw.stub.SpeakStream(iter(outbox), timeout=30)
    responses: list[gateway_pb2.SpeakStreamResponse] = []
    reader = threading.Thread(target=lambda: responses.extend(call), daemon=True)
    reader.start()
    wait_until(lambda: gw.loop.run(_active(gw)) == 1)
    # Idle between segments, the call still holds its slot: Speak and the WebSocket are refused.
    with pytest.raises(grpc.RpcError) as info:
        list(gw.stub.Speak(gateway_pb2.SpeakRequest(text="hi"), timeout=10))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

    async def upgrade() -> int:
        url = f"http://127.0.0.1:{gw.http_port}/v1/audio/speech/stream"
        async with aiohttp.ClientSession() as session:
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await session.ws_connect(url)
            return refused.value.status

    assert asyncio.run(upgrade()) == 429
    outbox.put(CANCEL_MESSAGE, text_message("Short one."), END_MESSAGE, None)
    reader.join(10)
    assert [r.event for r in responses][-1] == END
    assert [r.event for r in responses].count(CANCELLED) == 1
    assert gw.loop.run(_active(gw)) == 0
    assert [r.request_id for r in fake.state.requests] == ["slot/0"]


def test_cancel_aborts_the_segment_in_progress(paced: tuple[FakeDecoder, GatewayThread]) -> None:
    fake, gw = paced
    outbox = Outbox()
    outbox.put(config_message(request_id="cut"), text_message("First one is here. Second one. "))
    call = gw.stub.SpeakStream(iter(outbox), timeout=30)
    responses = []
    for response in call:
        responses.append(response)
        if response.event == AUDIO and response.sequence_number == 2:
            outbox.put(CANCEL_MESSAGE)
        if response.event == CANCELLED:
            break
    assert fake.wait_for(lambda: "cut/0" in fake.state.aborts), fake.state.aborts
    assert fake.wait_for(lambda: not fake.state.active)
    # Segment 1 was queued, never started; the cut segment ended with "abort" before CANCELLED.
    assert [r.request_id for r in fake.state.requests] == ["cut/0"]
    assert [(r.event, r.finish_reason) for r in responses[-2:]] == [
        (SEGMENT_END, "abort"),
        (CANCELLED, ""),
    ]
    assert 3 <= sum(r.event == AUDIO for r in responses) < 50
    outbox.put(text_message("Third."), END_MESSAGE, None)
    rest = list(call)
    assert [r.event for r in rest][-2:] == [SEGMENT_END, END]
    assert {r.segment for r in rest if r.event == AUDIO} == {1}
    assert [r.request_id for r in fake.state.requests] == ["cut/0", "cut/1"]
    assert fake.state.requests[1].prompt == "Third."
    assert gw.loop.run(_active(gw)) == 0


async def _active(gw: GatewayThread) -> int:
    return gw.gateway.engine.admission.active


def test_ws_needs_the_token(sock_dir: Path) -> None:
    with (
        FakeDecoder(sock_dir / "d.sock") as fake,
        GatewayThread(fake.target, sock_dir, http_port=0, auth_token="s3cret") as gw,
    ):
        url = f"http://127.0.0.1:{gw.http_port}/v1/audio/speech/stream"

        async def run() -> tuple[int, list[object]]:
            async with aiohttp.ClientSession() as session:
                with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                    await session.ws_connect(url)
                headers = {"Authorization": "Bearer s3cret"}
                async with session.ws_connect(url, headers=headers) as ws:
                    await ws.send_json({"type": "config"})
                    await ws.send_json({"type": "text", "text": "Hi."})
                    await ws.send_json({"type": "end"})
                    frames = []
                    while isinstance(frame := await receive(ws), (bytes, dict)):
                        frames.append(frame)
                return refused.value.status, frames

        status, frames = asyncio.run(run())
    assert status == 401
    assert [f["type"] for f in frames if isinstance(f, dict)] == [
        "ready",
        "segment.start",
        "segment.end",
        "end",
    ]
    assert any(isinstance(f, bytes) for f in frames)
