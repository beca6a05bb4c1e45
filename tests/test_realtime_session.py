"""The realtime session over a fake engine (`FakeRealtimeEngine`, a test double
whose answers arrive slowly) and a fake transport that fails if two sends
overlap, as a gRPC call's writes may not: events the client sends while an
answer streams are answered between its deltas, never during one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import torch

from gateway.decoder_client import DecoderInfo
from gateway.outputs import MultimodalPayload, OmniRequestOutput
from gateway.realtime import RealtimeSession
from gateway.validation import GenerationRequest, Limits
from omni_serving.v1 import common_pb2


class FakeRealtimeEngine:
    """What a session uses of `GatewayEngine`: limits, a pool's info, and
    generate() yielding `outputs` pieces of text and 40 ms of audio, 5 ms apart."""

    def __init__(self, outputs: int = 200) -> None:
        self.limits = Limits()
        self.outputs = outputs
        self.requests: list[GenerationRequest] = []

    async def generate(self, request: GenerationRequest, *, admitted: bool = False) -> AsyncIterator[OmniRequestOutput]:
        assert admitted, "a session's responses run in its own slot"
        self.requests.append(request)
        for i in range(self.outputs):
            await asyncio.sleep(0.005)
            audio = torch.full((960,), 0.1 * (i % 5))
            yield OmniRequestOutput(request_id=request.request_id, finished=i == self.outputs - 1, text="ab",
                                    token_ids=[1, 2], multimodal=MultimodalPayload(tensors={"audio": audio}),
                                    finish_reason="stop" if i == self.outputs - 1 else "")


def info() -> DecoderInfo:
    limits = common_pb2.DeploymentLimits(max_input_audio_parts=4, max_input_audio_seconds=60,
                                         audio_frames_per_second=12.5)
    return DecoderInfo(voices=("alice",), sample_rate_hz=24000, output_modalities=("text", "audio"),
                       limits=limits, supports_instructions=True, profile="omni")


def test_sends_never_overlap_while_an_answer_streams() -> None:
    sent: list[dict] = []
    overlapped: list[str] = []
    busy = False

    async def send(event: dict) -> None:  # a transport that takes one write at a time
        nonlocal busy
        if busy:
            overlapped.append(event["type"])
        busy = True
        await asyncio.sleep(0.002)
        sent.append(event)
        busy = False

    async def run() -> None:
        engine = FakeRealtimeEngine()  # an answer of 200 outputs: 1 s at least, the refusals take 0.1 s
        session = RealtimeSession(engine, info(), send, model="m")  # type: ignore[arg-type]
        await session.start()
        await session.handle({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}})
        await session.handle({"type": "response.create"})
        for i in range(20):  # while it streams: each refused, answered between deltas
            await session.handle({"type": "response.create", "event_id": f"again_{i}"})
            await asyncio.sleep(0.003)
        await session.finish()
        await session.close()
        assert len(engine.requests) == 1

    asyncio.run(run())
    assert not overlapped, f"sends while another was in progress: {overlapped}"
    types = [e["type"] for e in sent]
    assert types.count("error") == 20 and types[-1] == "response.done", types
    assert [e["error"]["event_id"] for e in sent if e["type"] == "error"] == [f"again_{i}" for i in range(20)]
    assert [int(e["event_id"].split("_")[1]) for e in sent] == list(range(1, len(sent) + 1)), "ids out of send order"
    deltas = [e for e in sent if e["type"] == "response.output_audio.delta"]
    assert len(deltas) == 200 and all(isinstance(d["delta"], bytes) and len(d["delta"]) == 1920 for d in deltas)
    done = sent[-1]["response"]
    assert done["status"] == "completed" and done["usage"]["output_token_details"] == {
        "text_tokens": 400, "audio_tokens": round(200 * 960 / 24000 * 12.5)}, done


def test_truncation_leaves_the_oldest_turns_out_of_what_a_response_reads() -> None:
    """One audio part per request: with truncation "auto" the older spoken turn is left
    out, the instructions kept; with "disabled" the response is refused
    (conversation_too_large)."""
    one_part = info()
    one_part.limits.max_input_audio_parts = 1
    sent: list[dict] = []

    async def send(event: dict) -> None:
        sent.append(event)

    async def run() -> FakeRealtimeEngine:
        engine = FakeRealtimeEngine(outputs=2)
        session = RealtimeSession(engine, one_part, send, model="m")  # type: ignore[arg-type]
        await session.handle({"type": "session.update", "session": {"type": "realtime", "instructions": "Be brief.",
                                                                    "audio": {"input": {"turn_detection": None}}}})
        for _ in range(2):
            await session.handle({"type": "input_audio_buffer.append"}, audio=bytes(4800))
            await session.handle({"type": "input_audio_buffer.commit"})
            await session.handle({"type": "response.create"})
            await session.finish()
        await session.handle({"type": "session.update", "session": {"type": "realtime", "truncation": "disabled"}})
        await session.handle({"type": "response.create", "event_id": "too_big"})
        return engine

    engine = asyncio.run(run())
    first, second = (r.messages for r in engine.requests)
    assert [role for role, _ in first] == ["system", "user"] and first[0] == ("system", "Be brief.")
    # the older spoken turn left out (the oldest message first, until the rest fits); its reply stays
    assert [role for role, _ in second] == ["system", "assistant", "user"], second
    assert second[1] == ("assistant", "abab") and second[2][1][0].field != first[1][1][0].field  # the newer clip
    errors = [e["error"] for e in sent if e["type"] == "error"]
    assert [(e["code"], e["event_id"]) for e in errors] == [("conversation_too_large", "too_big")], errors
