"""Load and soak on the real stack (vLLM engine, tiny Qwen3-Omni checkpoint).

- 64 concurrent Speak streams for a while: zero errors, zero sequence gaps.
- Many decode steps: after warm-up, the RSS of the decoder and of each of its
  child processes (stage engine, code2wav worker) grows by at most 5%.

Shortened by default (and in CI); the full runs (60 s of load, 10,000 decode
steps) with ``OMNI_SOAK_FULL=1``::

    OMNI_SOAK_FULL=1 .venv/bin/python -m pytest -m soak
"""

from __future__ import annotations

import os
import threading
import time

import grpc
import psutil
import pytest

from omni_serving.v1 import common_pb2, decoder_pb2, decoder_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from omni_stack.config import StackConfig
from omni_stack.stack import Stack

pytest.importorskip("vllm")
FULL = os.environ.get("OMNI_SOAK_FULL") == "1"
pytestmark = [pytest.mark.soak, pytest.mark.vllm, pytest.mark.e2e, pytest.mark.timeout(2400 if FULL else 600)]

LOAD_SECONDS = 60.0 if FULL else 12.0
RSS_STEPS = 10_000 if FULL else 500
WORDS = "the quick brown fox jumps over the lazy dog and speaks a little more".split()


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_checkpoint):
    s = Stack(StackConfig(engine="vllm", profile="tts", model=str(tiny_checkpoint), port=0, http_port=0,
                          runtime_dir=str(tmp_path_factory.mktemp("rt")), log_level="WARNING"))
    s.start(timeout_s=300)
    yield s
    assert s.stop() == []


def _speak(target: str, text: str, seed: int, frames: int) -> tuple[int, list[int]]:
    with grpc.insecure_channel(target) as ch:
        stub = gateway_pb2_grpc.OmniGatewayServiceStub(ch)
        req = gateway_pb2.SpeakRequest(text=text, sampling_params=common_pb2.SamplingParams(
            seed=seed, temperature=0.8, max_tokens=frames))
        chunks = list(stub.Speak(req, timeout=300))
    return sum(len(c.audio) for c in chunks), [c.sequence_number for c in chunks]


def _decoder_steps(stack: Stack) -> int:
    with grpc.insecure_channel(stack.decoder_target) as ch:
        info = decoder_pb2_grpc.DecoderServiceStub(ch).GetDecoderInfo(decoder_pb2.GetDecoderInfoRequest(), timeout=30)
    return sum(s.steps for s in info.stages if s.kind == decoder_pb2.STAGE_KIND_AR)


def _decoder_process(stack: Stack) -> psutil.Process:
    (svc,) = [s for s in stack.services if s.name == "decoder"]
    return psutil.Process(svc.proc.pid)


def _load(target: str, clients: int, until, frames: int) -> tuple[int, list[str]]:
    """`clients` closed-loop Speak clients until until() is true: (requests done, errors)."""
    done = [0]
    errors: list[str] = []
    lock = threading.Lock()

    def client(k: int) -> None:
        i = 0
        while not until() and not errors:
            text = " ".join(WORDS[(k + i) % len(WORDS):][:6]) or "hello"
            try:
                nbytes, seqs = _speak(target, text, seed=k * 1000 + i, frames=frames)
                if seqs != list(range(len(seqs))) or nbytes == 0:
                    with lock:
                        errors.append(f"client {k} request {i}: sequence numbers {seqs}, {nbytes} bytes")
            except grpc.RpcError as exc:
                with lock:
                    errors.append(f"client {k} request {i}: {exc.code().name}: {exc.details()}")
            with lock:
                done[0] += 1
            i += 1

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    return done[0], errors


def test_64_concurrent_speak_streams_without_errors_or_gaps(stack):
    end = time.monotonic() + LOAD_SECONDS
    done, errors = _load(stack.gateway_target, 64, lambda: time.monotonic() > end, frames=16)
    assert not errors, errors[:5]
    assert done >= 64, f"only {done} requests finished in {LOAD_SECONDS:.0f} s"


def _rss_by_process(decoder: psutil.Process) -> dict[str, int]:
    """RSS of the decoder and of each of its child processes (the AR stage's
    engine process, the code2wav worker), by pid and title."""
    out = {f"{decoder.pid} decoder": decoder.memory_info().rss}
    for child in decoder.children(recursive=True):
        out[f"{child.pid} {' '.join(child.cmdline())[:60]}"] = child.memory_info().rss
    return out


def test_decoder_rss_growth_after_warmup_is_bounded(stack):
    """The decoder service's processes (its own and its children's, each on
    its own) stop growing after warm-up: over RSS_STEPS decode steps each
    grows by at most 5%, or, where caches are still filling, its growth has
    levelled off (the second half of the steps adds at most 1.5%). A leak
    grows in both halves alike and fails either way."""
    proc = _decoder_process(stack)
    start = _decoder_steps(stack)
    # the stage's engine process settles after ~400 steps here (vLLM's and
    # the allocator's caches fill: ~680 -> ~810 MiB, then +-20 MiB; after
    # the 64-stream test before this one, and on other CPUs, it may still
    # be filling: 826 -> 861 -> 862 MiB here after 600 steps)
    warm = start + max(RSS_STEPS // 3, 1000)
    _load(stack.gateway_target, 16, lambda: _decoder_steps(stack) >= warm, frames=32)
    rss_warm = _rss_by_process(proc)
    assert any("decoder stage talker" in name for name in rss_warm), f"no talker stage process: {list(rss_warm)}"
    assert len(rss_warm) >= 3, f"expected the decoder, its stage process and a code2wav worker: {list(rss_warm)}"
    samples, done, errors = [rss_warm], 0, []
    for _ in range(2):
        target = _decoder_steps(stack) + RSS_STEPS // 2
        n, errs = _load(stack.gateway_target, 16, lambda t=target: _decoder_steps(stack) >= t, frames=32)
        done, errors = done + n, errors + errs
        samples.append(_rss_by_process(proc))
    assert not errors, errors[:5]
    rss_mid, rss_end = samples[1], samples[2]
    assert rss_end.keys() == rss_warm.keys() == rss_mid.keys(), f"processes changed under load: {[list(x) for x in samples]}"
    report = {name: " -> ".join(f"{x[name] / 2**20:.0f}" for x in samples)
              + f" MiB ({rss_end[name] / rss_warm[name] - 1:+.1%}; second half {(rss_end[name] - rss_mid[name]) / rss_warm[name]:+.1%})"
              for name in rss_warm}
    print(f"decoder RSS after warm-up, mid, end: {report}")
    grew = [name for name in rss_warm
            if rss_end[name] > 1.05 * rss_warm[name] and rss_end[name] - rss_mid[name] > 0.015 * rss_warm[name]]
    assert not grew, f"RSS grew over {RSS_STEPS} steps after warm-up ({done} requests) and did not level off: {grew}; {report}"
