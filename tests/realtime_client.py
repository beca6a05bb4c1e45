"""Clients of the realtime session for the tests: a raw WebSocket client and a
gRPC one that check every server event against the `openai` package's own
Realtime types, and the Generate call a response must equal.

A response's seed is the decoder's default for a request without one: the
CRC-32 of its id, which is the response id (``decoder_svc.servicer``), so
gRPC ``Generate`` with the same conversation and that seed gives the same
text and audio.
"""

from __future__ import annotations

import asyncio
import base64
import json
import zlib
from dataclasses import dataclass, field

import aiohttp
import grpc
import numpy as np
from openai.types.realtime import RealtimeServerEvent
from pydantic import TypeAdapter

from gateway.audio import pcm16le
from omni_common.tensor_wire import decode_inline
from omni_serving.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

SERVER_EVENT: TypeAdapter = TypeAdapter(RealtimeServerEvent)
RATE = 24_000


def validate(event: dict) -> dict:
    """`event` as the openai package's realtime types read it (an error if they cannot)."""
    SERVER_EVENT.validate_python(event)
    return event


def tone(seconds: float, hz: float = 220.0, amplitude: float = 0.3) -> bytes:
    t = np.arange(int(RATE * seconds)) / RATE
    return (np.sin(2 * np.pi * hz * t) * amplitude * 32767).astype("<i2").tobytes()


def b64(pcm: bytes) -> str:
    return base64.b64encode(pcm).decode("ascii")


@dataclass
class Reply:
    """One response as the client saw it, from response.created to response.done."""

    types: list[str] = field(default_factory=list)
    text: str = ""
    audio: bytes = b""
    done: dict = field(default_factory=dict)

    @property
    def id(self) -> str:
        return self.done["response"]["id"]

    @property
    def status(self) -> str:
        return self.done["response"]["status"]

    @property
    def seed(self) -> int:
        return zlib.crc32(self.id.encode())


def reply_of(events: list[dict]) -> Reply:
    """A response as its events give it (from its last response.created on; error events left out)."""
    reply = Reply()
    for event in events:
        if event["type"] == "response.created":
            reply = Reply()
        if event["type"] == "error":
            continue
        reply.types.append(event["type"])
        if event["type"] in ("response.output_audio_transcript.delta", "response.output_text.delta"):
            reply.text += event["delta"]
        elif event["type"] == "response.output_audio.delta":
            reply.audio += event["delta"] if isinstance(event["delta"], bytes) else base64.b64decode(event["delta"])
        elif event["type"] == "response.done":
            reply.done = event
    return reply


def collapsed(types: list[str]) -> list[str]:
    """Event types with runs of one delta type kept once."""
    out: list[str] = []
    for t in types:
        if not (out and out[-1] == t and t.endswith(".delta")):
            out.append(t)
    return out


class Session:
    """Events of one session, whatever carries them (`WsSession`, `GrpcSession`)."""

    def __init__(self) -> None:
        self.events: list[dict] = []

    async def _receive(self) -> dict:
        raise NotImplementedError

    async def send(self, type_: str, audio: bytes | None = None, **fields: object) -> None:
        raise NotImplementedError

    async def send_raw(self, event: dict) -> None:
        """`event` as it is (no audio encoding): what a client with a bug might send."""
        raise NotImplementedError

    async def send_malformed(self) -> list[str]:
        """Messages the transport carries but that are no event; the params their errors name."""
        raise NotImplementedError

    async def vanish(self) -> None:
        """Drop the connection without a word."""
        raise NotImplementedError

    async def recv(self, timeout: float = 120.0) -> dict:
        event = validate(await asyncio.wait_for(self._receive(), timeout))
        self.events.append(event)
        return event

    async def until(self, *types: str, timeout: float = 120.0) -> list[dict]:
        """Events up to and including the first of `types` (an error event
        not among them fails, with its message)."""
        seen = []
        while True:
            event = await self.recv(timeout)
            seen.append(event)
            if event["type"] in types:
                return seen
            assert event["type"] != "error", event

    async def reply(self, timeout: float = 120.0) -> Reply:
        """The events of a response from its response.created to its response.done."""
        return reply_of(await self.until("response.done", timeout=timeout))


class WsSession(Session):
    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        super().__init__()
        self.ws = ws

    async def _receive(self) -> dict:
        message = await self.ws.receive()
        assert message.type is aiohttp.WSMsgType.TEXT, message
        return json.loads(message.data)

    async def send(self, type_: str, audio: bytes | None = None, **fields: object) -> None:
        if audio is not None:
            fields["audio"] = b64(audio)
        await self.ws.send_json({"type": type_, **fields})

    async def send_raw(self, event: dict) -> None:
        await self.ws.send_json(event)

    async def send_malformed(self) -> list[str]:
        await self.ws.send_str("{not json")
        await self.ws.send_bytes(b"\x00\x01")  # audio goes base64 in JSON events
        return ["event", "event"]

    async def vanish(self) -> None:
        await self.ws.close()


class GrpcSession(Session):
    """A gRPC ``Realtime`` call: audio as bytes both ways (a delta's bytes are
    put back in the event as ``delta`` for the checks)."""

    def __init__(self, call: grpc.aio.StreamStreamCall) -> None:
        super().__init__()
        self.call = call

    async def _receive(self) -> dict:
        response = await self.call.read()
        assert response is not grpc.aio.EOF, "the call ended"
        event = json.loads(response.json)
        if event["type"] == "response.output_audio.delta":
            assert "delta" not in event and response.audio, event
            validate({**event, "delta": ""})
            event["delta"] = response.audio
        else:
            assert not response.audio, event
        return event

    async def recv(self, timeout: float = 120.0) -> dict:
        event = await asyncio.wait_for(self._receive(), timeout)
        if event["type"] != "response.output_audio.delta":
            validate(event)
        self.events.append(event)
        return event

    async def send(self, type_: str, audio: bytes | None = None, **fields: object) -> None:
        await self.call.write(gateway_pb2.RealtimeRequest(json=json.dumps({"type": type_, **fields}),
                                                          audio=audio or b""))

    async def send_raw(self, event: dict) -> None:
        await self.call.write(gateway_pb2.RealtimeRequest(json=json.dumps(event)))

    async def send_malformed(self) -> list[str]:
        await self.call.write(gateway_pb2.RealtimeRequest(json="{not json"))
        # audio bytes beside an event that carries none
        await self.call.write(gateway_pb2.RealtimeRequest(json='{"type": "input_audio_buffer.commit"}',
                                                          audio=b"\x00\x00"))
        return ["json", "audio"]

    async def vanish(self) -> None:
        self.call.cancel()


def audio_part(pcm: bytes) -> common_pb2.ContentPart:
    return common_pb2.ContentPart(audio=common_pb2.AudioContent(data=pcm, format="pcm16", sample_rate=RATE))


def generate(target: str, turns: list[tuple[str, list[common_pb2.ContentPart]]], seed: int, *,
             modalities: str = "text+audio", voice: str = "") -> tuple[str, bytes]:
    """(text, PCM16) of gRPC Generate for `turns`, as a realtime response asks (delta
    outputs, the model's sampling defaults)."""
    request = gateway_pb2.OmniGatewayServiceGenerateRequest(
        messages=[common_pb2.ChatMessage(role=role, content=parts) for role, parts in turns],
        output_modalities=modalities, output_kind=gateway_pb2.OUTPUT_KIND_DELTA, voice=voice,
        sampling_params=common_pb2.SamplingParams(seed=seed, model_defaults=True))
    text, pcm = [], []
    with grpc.insecure_channel(target) as channel:
        for response in gateway_pb2_grpc.OmniGatewayServiceStub(channel).Generate(request, timeout=300):
            text.append(response.output.text.text)
            for named in response.output.multimodal.tensors:
                if named.name == "audio":
                    pcm.append(pcm16le(decode_inline(named.tensor)))
    return "".join(text), b"".join(pcm)


def text_part(text: str) -> common_pb2.ContentPart:
    return common_pb2.ContentPart(text=text)


RESPONSE_EVENTS = [
    "response.created", "response.output_item.added", "conversation.item.added", "response.content_part.added",
    "response.output_audio_transcript.delta", "response.output_audio.delta", "response.output_audio.done",
    "response.output_audio_transcript.done", "response.content_part.done", "response.output_item.done",
    "conversation.item.done", "response.done",
]
"""A whole audio response's events in order (deltas collapsed, transcript first: the thinker's text leads)."""
