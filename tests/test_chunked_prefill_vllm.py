"""Chunked prefill on the real stack: a 1,500-token prompt among 16 decoding requests.

Both AR stages of the omni profile run with chunked prefill and a budget of
``BUDGET`` tokens per step. A long prompt is prefilled over many steps
(thinker: its prompt; talker: the thinker's rows of it), each shared with the
requests that decode, so no step does more than the budget's work and their
audio keeps coming. What is checked, none of it timed:

- no step of either stage schedules more than the budget, while the long
  prompt is prefilled in chunks (steps near the budget) among 16 (8 under
  CI_SHORT, ``tests/ci_budget.py``) streaming text+audio requests (both stages decode them), all of which complete
  with audio;
- the long request's output is the one-step prefill's (a stack without
  chunked prefill, where the same prompt is one step far over the budget):
  the same thinker token ids and the same audio. So every prompt row reached
  the talker (the rows of the chunks that sample nothing are held and handed
  on with the chunk that samples: ``decoder_svc.vllm_engine.step_assembly``),
  and the seeded streams of both stages skipped the discarded samples of the
  partial chunks (``decoder_svc.vllm_engine.capture``).

The longest gap between the decoding requests' audio chunks is wall time on
a shared machine, and on the tiny checkpoint a one-step prefill of 1,500
tokens is itself cheap next to a decode step's fixed costs: the gap is not
asserted here. What bounds it is what is asserted: the tokens of a step.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from omni_serving.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from omni_stack.config import StackConfig
from omni_stack.stack import Stack
from tests.ci_budget import CI_SHORT
from tests.speech_helpers import digest, metric

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.e2e]

BUDGET = 128
PROMPT_TOKENS = 1500
CLIENTS = 8 if CI_SHORT else 16
FRAMES = 24  # each streaming request's talker frames (at most)
TEXT_TOKENS = 8  # and its thinker tokens
CHUNKED = f"max_model_len=2048,enable_chunked_prefill=true,max_num_batched_tokens={BUDGET}"
ONE_STEP = "max_model_len=2048,enable_chunked_prefill=false"  # a step takes a whole prompt


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint


@pytest.fixture(scope="module")
def long_prompt(checkpoint) -> str:
    """Text of at least PROMPT_TOKENS tokens of the checkpoint's tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(checkpoint))
    words = "the quick brown fox jumps over the lazy dog and speaks".split()
    text = " ".join(words[i % len(words)] for i in range(PROMPT_TOKENS))
    n = len(tok(text).input_ids)
    assert PROMPT_TOKENS <= n < 2048 - 64, f"{n} tokens"
    return text


def start(tmp_path_factory, checkpoint, engine_set: str) -> Stack:
    stack = Stack(StackConfig(engine="vllm", profile="omni", model=str(checkpoint), port=0, http_port=0,
                              runtime_dir=str(tmp_path_factory.mktemp("rt")), log_level="WARNING",
                              engine_set=engine_set, max_text_chars=16384))
    stack.start(timeout_s=300)
    return stack


def generate(stack: Stack, prompt: str) -> tuple[list[int], str]:
    """(the reply's token ids, its audio's digest) of one seeded text+audio request."""
    with grpc.insecure_channel(stack.gateway_target) as ch:
        req = gateway_pb2.OmniGatewayServiceGenerateRequest(
            prompt=prompt, output_modalities="text+audio", output_kind=gateway_pb2.OUTPUT_KIND_FINAL_ONLY,
            sampling_params=common_pb2.SamplingParams(seed=5, temperature=0.8, max_tokens=12,
                                                      max_audio_seconds=1.0))
        outs = [r.output for r in gateway_pb2_grpc.OmniGatewayServiceStub(ch).Generate(req, timeout=600)]
    final = outs[-1]
    assert final.finished and final.finish_reason == "length", final.finish_reason
    audio = b"".join(t.tensor.inline_data for t in final.multimodal.tensors if t.name == "audio")
    assert audio, "no audio"
    return list(final.text.token_ids), digest(audio)


def steps_over(stack: Stack, stage: str, tokens: int) -> float:
    """Steps of `stage` that scheduled more than `tokens` tokens (once the
    stage process's series reached the decoder's /metrics: :func:`settled`)."""
    settled(stack, stage)
    return (metric(stack, "omni_decoder_step_tokens_count", stage=stage)
            - metric(stack, "omni_decoder_step_tokens_bucket", stage=stage, le=f"{float(tokens)}"))


def settled(stack: Stack, stage: str) -> None:
    """Wait until an idle stage's series on the decoder's /metrics are
    current: a stage process sends a snapshot of them about once a second,
    so its step count must stay the same over three such periods."""
    from decoder_svc.stage.messages import METRICS_EVERY, STATUS_INTERVAL_S

    period = METRICS_EVERY * STATUS_INTERVAL_S
    deadline = time.monotonic() + 60
    last, since = -1.0, time.monotonic()
    while True:
        count = metric(stack, "omni_decoder_step_tokens_count", stage=stage)
        if count != last:
            last, since = count, time.monotonic()
        elif time.monotonic() - since >= 3 * period:
            return
        assert time.monotonic() < deadline, f"{stage}: its step count kept changing for 60 s"
        time.sleep(period / 2)


@pytest.mark.timeout(900)
def test_a_long_prompt_is_prefilled_within_the_step_budget_among_decoding_requests(
        tmp_path_factory, checkpoint, long_prompt):
    stack = start(tmp_path_factory, checkpoint, ONE_STEP)
    try:
        one_step = generate(stack, long_prompt)
        # the check below can fail: without chunks the prompt is one step far over the budget
        assert steps_over(stack, "thinker", 1024) >= 1 and steps_over(stack, "talker", 1024) >= 1
    finally:
        assert stack.stop() == []

    stack = start(tmp_path_factory, checkpoint, CHUNKED)
    try:
        assert generate(stack, long_prompt) == one_step, "a prompt prefilled in chunks gives other outputs"
        streams: dict[int, list[gateway_pb2.OmniRequestOutput]] = {}
        errors: list[str] = []
        first = threading.Barrier(CLIENTS + 1)

        def chat(k: int) -> None:
            """A streaming text+audio request: both stages decode it."""
            outs: list[gateway_pb2.OmniRequestOutput] = []
            try:
                with grpc.insecure_channel(stack.gateway_target) as ch:
                    req = gateway_pb2.OmniGatewayServiceGenerateRequest(
                        prompt=f"client {k} says hello there", output_modalities="text+audio",
                        output_kind=gateway_pb2.OUTPUT_KIND_DELTA, sampling_params=common_pb2.SamplingParams(
                            seed=k, temperature=0.8, max_tokens=TEXT_TOKENS, max_audio_seconds=FRAMES / 12.5))
                    for r in gateway_pb2_grpc.OmniGatewayServiceStub(ch).Generate(req, timeout=600):
                        outs.append(r.output)
                        if len(outs) == 1:
                            first.wait(timeout=300)
            except (grpc.RpcError, threading.BrokenBarrierError) as exc:
                errors.append(f"client {k}: {exc}")
            streams[k] = outs

        before = {s: (steps_over(stack, s, BUDGET // 2), metric(stack, "omni_decoder_step_tokens_count", stage=s))
                  for s in ("thinker", "talker")}
        clients = [threading.Thread(target=chat, args=(k,)) for k in range(CLIENTS)]
        for t in clients:
            t.start()
        first.wait(timeout=300)  # every stream is decoding: the long prompt arrives among them
        t0 = time.monotonic()
        with_load = generate(stack, long_prompt)
        for t in clients:
            t.join(timeout=600)
        assert not errors, errors
        for k in range(CLIENTS):
            outs = streams[k]
            assert outs and outs[-1].finished and not any(o.finished for o in outs[:-1]), f"client {k}"
            assert any(t.name == "audio" and t.tensor.inline_data for o in outs for t in o.multimodal.tensors), k
        for stage in ("thinker", "talker"):
            assert steps_over(stack, stage, BUDGET) == 0, f"a {stage} step scheduled more than {BUDGET} tokens"
            # the prompt went in chunks: steps more than half full, at least as many as it takes
            chunks = steps_over(stack, stage, BUDGET // 2) - before[stage][0]
            assert chunks >= PROMPT_TOKENS // BUDGET, f"{stage}: {chunks} steps over {BUDGET // 2} tokens"
            steps = metric(stack, "omni_decoder_step_tokens_count", stage=stage) - before[stage][1]
            decoded = TEXT_TOKENS if stage == "thinker" else FRAMES
            assert steps > decoded, f"{stage}: {steps} steps"
        # batched with 16 others the thinker's reply may differ in its last bits (tests/test_vllm_e2e.py:
        # CPU kernels are not batch invariant); it is complete, with audio
        assert len(with_load[0]) == len(one_step[0]), (with_load, one_step, time.monotonic() - t0)
    finally:
        assert stack.stop() == []
