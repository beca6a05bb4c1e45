"""The speech and chat examples of docs/gateway.md, run as written against
the default stack (``omni-serving up``: vLLM, the ``omni`` profile, the tiny
Qwen3-Omni checkpoint): one deployment serves both routes. Only the address
is the test's (and the decoder's default caps: the random-weight model
would speak and write for as long as they allow).

They use OpenAI's voice name ``alloy``, which the model serves through its
voice aliases (``omni_common.voices``; Qwen3-Omni's table in
``decoder_svc/qwen3_omni/vocoder.py``): the WAV the curl example writes is,
sample for sample, what gRPC ``Speak`` gives for the voice ``alloy`` stands
for, with the same seed.
"""

from __future__ import annotations

import base64
import io
import json
import math
import re
import subprocess
import sys
import wave
from pathlib import Path

import grpc
import pytest

from omni_serving.v1 import common_pb2, decoder_pb2, decoder_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from omni_stack.config import StackConfig
from omni_stack.stack import Stack
from tests.speech_helpers import check_chunks

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.timeout(600)]

GATEWAY_DOC = Path(__file__).resolve().parent.parent / "docs" / "gateway.md"
SECTION = "### `POST /v1/audio/speech`"
CHAT_SECTION = "### `POST /v1/chat/completions`"
DOC_URL = "http://127.0.0.1:8000"


def section_blocks(heading: str) -> list[tuple[str, str]]:
    """The fenced code blocks (info string, code) between `heading` and the next heading of its level."""
    text = GATEWAY_DOC.read_text()
    start = text.index(heading)
    level = heading.split(" ", 1)[0] + " "
    end = text.find("\n" + level, start + len(heading))
    body = text[start : end if end >= 0 else len(text)]
    return re.findall(r"^```([a-z]*)\n(.*?)^```$", body, flags=re.S | re.M)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_checkpoint):
    # the examples set no cap on most requests: the random-weight model would speak the default 60 s
    s = Stack(StackConfig(engine="vllm", model=str(tiny_checkpoint), port=0, http_port=0,
                          runtime_dir=str(tmp_path_factory.mktemp("rt")), log_level="WARNING",
                          extra_decoder_args=["--default-audio-seconds", "4", "--default-text-tokens", "12"]))
    s.start(timeout_s=300)
    yield s
    assert s.stop() == []


def stage_steps(stack) -> dict[str, int]:
    """Decode steps so far, by AR stage, and each AR stage's enable_prefix_caching."""
    with grpc.insecure_channel(stack.decoder_target) as ch:
        info = decoder_pb2_grpc.DecoderServiceStub(ch).GetDecoderInfo(decoder_pb2.GetDecoderInfoRequest(), timeout=30)
    assert info.profile == "omni", "the default stack serves both routes"
    ar = [s for s in info.stages if s.kind == decoder_pb2.STAGE_KIND_AR]
    # nothing is served from earlier requests' KV cache (docs/profiles.md, "What is cached")
    assert {s.name: s.engine_settings["enable_prefix_caching"] for s in ar} == {"thinker": "false", "talker": "false"}
    return {s.name: s.steps for s in ar}


def test_the_speech_examples_run_as_written(stack, tmp_path):
    before = stage_steps(stack)
    blocks = section_blocks(SECTION)
    (shell,) = [code for info, code in blocks if "curl " in code]
    (python,) = [code for info, code in blocks if info == "python"]
    assert DOC_URL in shell and DOC_URL in python, "the examples' address changed: update DOC_URL"

    run = subprocess.run(["bash", "-euo", "pipefail", "-c", shell.replace(DOC_URL, stack.http_url)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    events = [line for line in run.stdout.splitlines() if line.startswith("data: ")]
    assert events and '"speech.audio.done"' in events[-1], run.stdout[-1000:]
    assert all('"speech.audio.delta"' in e for e in events[:-1]) and len(events) >= 2, run.stdout[-1000:]
    with wave.open(io.BytesIO((tmp_path / "hello.wav").read_bytes())) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 24000)
        wav_pcm = w.readframes(w.getnframes())
    assert wav_pcm, "hello.wav holds no audio"
    # "alloy" is an alias: the same audio as its voice, seed 7, the model's sampling defaults
    with grpc.insecure_channel(stack.gateway_target) as ch:
        (card,) = gateway_pb2_grpc.OmniGatewayServiceStub(ch).ListModels(
            gateway_pb2.ListModelsRequest(), timeout=30).models
        voice = card.voice_aliases["alloy"]
        assert voice in card.voices and card.voice_aliases["default"] == card.voices[0], card
        chunks = list(gateway_pb2_grpc.OmniGatewayServiceStub(ch).Speak(gateway_pb2.SpeakRequest(
            text="Hello there", voice=voice, sampling_params=common_pb2.SamplingParams(seed=7, model_defaults=True)),
            timeout=120))
    assert check_chunks(chunks) == wav_pcm, f"the alias 'alloy' did not speak as {voice!r}"

    checks = "\nassert pcm and len(pcm) % 2 == 0, len(pcm)\nassert flac[:4] == b'fLaC', flac[:8]\nprint('ok')\n"
    run = subprocess.run([sys.executable, "-c", python.replace(DOC_URL, stack.http_url) + checks],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-2000:]
    # speech is spoken as written: the talker ran, the thinker did not
    after = stage_steps(stack)
    assert after["thinker"] == before["thinker"] and after["talker"] > before["talker"], (before, after)


def test_the_chat_examples_run_as_written(stack, tmp_path):
    blocks = section_blocks(CHAT_SECTION)
    (shell,) = [code for info, code in blocks if "curl " in code and "input_audio" not in code]
    (asked_aloud,) = [code for info, code in blocks if "curl " in code and "input_audio" in code]
    (python,) = [code for info, code in blocks if info == "python"]
    assert DOC_URL in shell and DOC_URL in python and DOC_URL in asked_aloud, \
        "the examples' address changed: update DOC_URL"
    before = stage_steps(stack)

    # the question asked aloud: the example reads question.wav (a 16-bit WAV, here 1.5 s of a tone)
    with wave.open(str(tmp_path / "question.wav"), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(b"".join(int(8000 * math.sin(i / 16000 * 2 * math.pi * 220)).to_bytes(2, "little", signed=True)
                               for i in range(24000)))
    run = subprocess.run(["bash", "-euo", "pipefail", "-c", asked_aloud.replace(DOC_URL, stack.http_url)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    answer = json.loads(run.stdout)
    assert answer["choices"][0]["message"]["content"], answer
    assert answer["usage"]["prompt_tokens"] > 19, answer["usage"]  # 1.5 s of audio: 20 audio tokens alone

    run = subprocess.run(["bash", "-euo", "pipefail", "-c", shell.replace(DOC_URL, stack.http_url)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    events = [line.removeprefix("data: ") for line in run.stdout.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", run.stdout[-1000:]
    audio = [c["choices"][0]["delta"].get("audio") or {} for c in map(json.loads, events[:-1]) if c["choices"]]
    assert "".join(a.get("transcript", "") for a in audio), run.stdout[-2000:]
    assert b"".join(base64.b64decode(a.get("data", "")) for a in audio), run.stdout[-2000:]

    checks = ("\nassert pcm and len(pcm) % 2 == 0, len(pcm)\nassert ''.join(transcript), transcript"
              "\nprint('ok')\n")
    run = subprocess.run([sys.executable, "-c", python.replace(DOC_URL, stack.http_url) + checks],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-2000:]
    after = stage_steps(stack)
    assert after["thinker"] > before["thinker"] and after["talker"] > before["talker"], (before, after)
