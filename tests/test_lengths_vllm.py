"""Caps and model defaults on the tiny Qwen3-Omni checkpoint (vLLM engine).

Its weights are random: the talker rarely emits its end token, so without a
cap it would run until the deployment's default (60 s). The cap must end it
at the requested seconds with "length"; ``model_defaults`` must make the
seed matter (the checkpoint's talker samples with temperature 0.9), where a
request left at temperature 0 is greedy and ignores it.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from fakes import remove_dir, short_socket_dir

from omni_common.server import wait_for_health_sync
from omni_serving.v1 import common_pb2, decoder_pb2, decoder_pb2_grpc, payload_pb2

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.e2e]

REPO = Path(__file__).resolve().parents[1]
RATE, SPF = 24_000, 1920


@pytest.fixture(scope="module")
def decoder(tiny_checkpoint) -> Iterator[str]:
    ckpt = tiny_checkpoint
    run_dir = short_socket_dir()
    target = f"unix://{run_dir / 'decoder.sock'}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "decoder_svc", "--listen", target, "--engine", "vllm", "--profile", "tts",
         "--model", str(ckpt), "--deployment", f"lenvllm{os.getpid()}", "--log-level", "WARNING"],
        cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(run_dir)}, start_new_session=True,
    )  # fmt: skip
    try:
        wait_for_health_sync(target, 300)
        yield target
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
        remove_dir(run_dir)


def run(target: str, rid: str, **sampling) -> tuple[bytes, str]:
    """(the request's float32 audio bytes, its finish reason)."""
    req = decoder_pb2.GenerateRequest(
        request_id=rid, prompt="Hello world! This is a tiny omni model.", voice="chelsie",
        sampling_params=common_pb2.SamplingParams(**sampling))  # fmt: skip
    with grpc.insecure_channel(target) as ch:
        resps = list(decoder_pb2_grpc.DecoderServiceStub(ch).Generate(req, timeout=300))
    assert resps[-1].finished
    audio = b"".join(
        t.tensor.inline_data
        for r in resps
        for t in r.multimodal_output.tensors
        if t.name == "audio"
    )
    return audio, resps[-1].finish_reason


def test_the_cap_ends_a_random_weight_talker_with_length(decoder: str) -> None:
    audio, reason = run(decoder, "cap-2s", max_audio_seconds=2, temperature=0)
    samples = len(audio) // 4
    assert reason == "length"
    assert 2 * RATE - SPF < samples <= 2 * RATE, samples  # 25 frames

    with grpc.insecure_channel(decoder) as ch:
        info = decoder_pb2_grpc.DecoderServiceStub(ch).GetDecoderInfo(
            decoder_pb2.GetDecoderInfoRequest()
        )
    assert info.model == "qwen3-omni-tiny"
    assert list(info.output_modalities) == [payload_pb2.OUTPUT_MODALITY_AUDIO]
    assert not info.supports_instructions
    limits = info.limits
    assert limits.audio_frames_per_second == 12.5
    # the talker's context (engine setting max_model_len auto: the tiny
    # checkpoint's 4096 tokens) holds more than the 300 s ceiling
    context = int(info.stages[0].engine_settings["max_model_len"])
    assert context == 4096, dict(info.stages[0].engine_settings)
    assert round(limits.max_audio_seconds, 2) == min(300.0, math.floor((context - 1) / 12.5 * 100) / 100) == 300.0
    assert limits.default_audio_seconds == 60
    assert (round(limits.default_temperature, 4), limits.default_top_p, limits.default_top_k) == (
        0.9,
        1.0,
        50,
    )
    assert (limits.default_text_tokens, limits.max_text_tokens) == (0, 0)


def test_model_defaults_make_the_seed_matter(decoder: str) -> None:
    short = {"max_audio_seconds": 0.4}  # 5 frames
    greedy = [run(decoder, f"greedy-{s}", seed=s, **short)[0] for s in (1, 2)]
    assert greedy[0] == greedy[1]  # temperature 0: the seed changes nothing
    sampled = [
        run(decoder, f"md-{i}", seed=s, model_defaults=True, **short)[0]
        for i, s in enumerate((1, 1, 2))
    ]
    assert sampled[0] == sampled[1]
    assert sampled[0] != sampled[2]
    assert sampled[0] != greedy[0]
