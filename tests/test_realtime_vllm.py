"""The realtime session on the default stack: vLLM serving the tiny Qwen3-Omni
checkpoint (``omni`` profile), its thinker hearing the user's audio.

A spoken question (espeak-ng) through the official SDK's realtime client is
answered with audio and its transcript equal, byte for byte, to gRPC
``Generate`` of the same conversation and seed (and ``Generate`` is held to
the reference implementation by tests/test_omni_input.py); cancelling frees
the decoder's request. The Python examples of docs/realtime.md run as
written against it (only the address is the test's; the decoder's default
caps are short: the random-weight model would speak for as long as they
allow).
"""

from __future__ import annotations

import asyncio
import base64
import os
import re
import shutil
import subprocess
import sys
import time
import wave
import zlib
from pathlib import Path

import aiohttp
import grpc
import numpy as np
import openai
import pytest
from realtime_client import RESPONSE_EVENTS, WsSession, audio_part, generate, validate

from omni_serving.v1 import decoder_pb2, decoder_pb2_grpc
from omni_stack.config import StackConfig
from omni_stack.stack import Stack

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.timeout(900)]

DOC = Path(__file__).resolve().parent.parent / "docs" / "realtime.md"
DOC_URL = "http://127.0.0.1:8000"
RATE = 24_000


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_checkpoint) -> Stack:
    s = Stack(StackConfig(engine="vllm", model=str(tiny_checkpoint), port=0, http_port=0,
                          runtime_dir=str(tmp_path_factory.mktemp("rt")), log_level="WARNING",
                          extra_decoder_args=["--default-audio-seconds", "3", "--default-text-tokens", "10"]))
    s.start(timeout_s=300)
    yield s
    assert s.stop() == []


@pytest.fixture(scope="module")
def question(tmp_path_factory) -> bytes:
    """A spoken question, PCM16 24 kHz (espeak-ng; a tone where it is missing, outside CI)."""
    if shutil.which("espeak-ng") is None or shutil.which("sox") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("espeak-ng and sox are needed (CI=true: CI must run this test)")
        t = np.arange(int(1.5 * RATE)) / RATE
        return (np.sin(2 * np.pi * 220 * t) * 0.3 * 32767).astype("<i2").tobytes()
    d = tmp_path_factory.mktemp("speech")
    subprocess.run(["espeak-ng", "-w", str(d / "raw.wav"), "What is the weather like?"], check=True)
    subprocess.run(["sox", str(d / "raw.wav"), "-r", "24000", "-c", "1", "-b", "16", str(d / "q.wav"), "norm", "-6"],
                   check=True)
    with wave.open(str(d / "q.wav")) as w:
        return w.readframes(w.getnframes())


def decoder_active(stack: Stack) -> int:
    with grpc.insecure_channel(stack.decoder_target) as channel:
        return decoder_pb2_grpc.DecoderServiceStub(channel).GetDecoderInfo(
            decoder_pb2.GetDecoderInfoRequest(), timeout=30).active_requests


def test_a_spoken_question_is_answered_as_generate_answers_it(stack: Stack, question: bytes) -> None:
    async def run() -> tuple[str, bytes, str, list[str]]:
        client = openai.AsyncOpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0)
        async with client.realtime.connect(model="omni") as conn:
            await conn.session.update(session={"type": "realtime", "audio": {
                "input": {"turn_detection": None}, "output": {"voice": "ethan"}}})
            for i in range(0, len(question), 9600):
                await conn.input_audio_buffer.append(audio=base64.b64encode(question[i:i + 9600]).decode())
            await conn.input_audio_buffer.commit()
            await conn.response.create()
            text, audio, types = "", b"", []
            async for event in conn:
                validate(event.to_dict())
                assert event.type != "error", event
                types.append(event.type)
                if event.type == "response.output_audio_transcript.delta":
                    text += event.delta
                elif event.type == "response.output_audio.delta":
                    audio += base64.b64decode(event.delta)
                elif event.type == "response.done":
                    assert event.response.status in ("completed", "incomplete"), event.response
                    return text, audio, event.response.id, types
        raise AssertionError("no response.done")

    # The response's seed is random (its id's): a random-weight model may end its answer at
    # once now and then (its end token first), which Generate must then do too. Up to three
    # sessions, until one answers with audio.
    for _ in range(3):
        text, audio, response_id, types = asyncio.run(run())
        want = generate(stack.gateway_target, [("user", [audio_part(question)])], zlib.crc32(response_id.encode()),
                        voice="ethan")
        assert (text, audio) == want
        if audio:
            break
    assert audio and text, (len(audio), text)
    seen = [t for t in types[types.index("response.created"):] if not t.endswith(".delta")]
    assert seen == [t for t in RESPONSE_EVENTS if not t.endswith(".delta")], types


def test_cancel_frees_the_engines_request(stack: Stack, question: bytes) -> None:
    async def run() -> dict:
        url = stack.http_url.replace("http://", "ws://") + "/v1/realtime"
        async with aiohttp.ClientSession() as http, http.ws_connect(url, max_msg_size=0) as ws:
            session = WsSession(ws)
            await session.recv()
            await session.send("session.update", session={"type": "realtime", "audio": {"input": {
                "turn_detection": None}}})
            await session.until("session.updated")
            await session.send("input_audio_buffer.append", audio=question)
            await session.send("input_audio_buffer.commit")
            await session.send("response.create")
            first = await session.until("response.output_audio_transcript.delta", "response.output_audio.delta",
                                        "response.done")
            if first[-1]["type"] == "response.done":  # an answer that ended at once (see above)
                return first[-1]["response"]
            await session.send("response.cancel")
            return (await session.until("response.done"))[-1]["response"]

    done = asyncio.run(run())
    assert done["status"] in ("cancelled", "completed", "incomplete"), done  # it may end on its own first
    for _ in range(300):
        if not decoder_active(stack):
            break
        time.sleep(0.1)
    assert decoder_active(stack) == 0, "the engine still holds the cancelled request"


def test_the_python_examples_of_the_docs_run_as_written(stack: Stack, question: bytes, tmp_path: Path) -> None:
    blocks = re.findall(r"^```python\n(.*?)^```$", DOC.read_text(), flags=re.S | re.M)
    sdk = next(b for b in blocks if "client.realtime.connect" in b)
    grpc_example = next(b for b in blocks if "Realtime()" in b)
    assert DOC_URL in sdk, "the example's address changed: update DOC_URL"
    with wave.open(str(tmp_path / "question.wav"), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes(question)
    out = subprocess.run([sys.executable, "-c", sdk.replace(DOC_URL, stack.http_url)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"(completed|incomplete) \d+ ms of audio", out.stdout), out.stdout[-2000:]

    played: list[bytes] = []
    scope: dict = {"play": played.append}
    exec(compile(grpc_example, "docs/realtime.md", "exec"), scope)
    for _ in range(3):  # an answer may end at once now and then (see above)
        asyncio.run(scope["session"](stack.gateway_target, question))
        if played:
            break
    assert played and all(len(p) % 2 == 0 for p in played), "the gRPC example heard no audio"
