"""The real stack on the vLLM engine: async (materializer) and sync paths agree.

One pair of default (omni) stacks answers both routes: Generate (text and
audio) and Speak (spoken from the talker, as a tts deployment would). Each
comparison sends 8 prompts; under CI=true 4 (CI time is budgeted), all 8
again with ``OMNI_SOAK_FULL=1``. A tts deployment's engine settings are
checked on a tts stack of its own.
"""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import urllib.request
import wave

import grpc
import psutil
import pytest

from omni_serving.v1 import common_pb2, decoder_pb2, decoder_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from omni_stack.config import StackConfig
from omni_stack.stack import Stack
from tests.ci_budget import CI_SHORT
from tests.fs_helpers import tree_snapshot
from tests.speech_helpers import check_chunks, describe_pcm_difference, digest, metric, speak_chunks

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.e2e]

PROMPTS = [(f"sentence number {i} for the speech engine", 1000 + i) for i in range(4 if CI_SHORT else 8)]


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint


def start(tmp_path_factory, checkpoint, profile: str, sync: bool) -> Stack:
    # requests that set no audio cap (Speak here) stop at 5.12 s of audio, not the 60 s default
    stack = Stack(StackConfig(engine="vllm", profile=profile, model=str(checkpoint), sync=sync, port=0, http_port=0,
                              runtime_dir=str(tmp_path_factory.mktemp("rt")), log_level="WARNING",
                              extra_decoder_args=["--default-audio-seconds", "5.12"]))
    stack.start(timeout_s=300)
    return stack


def decoder_info(stack: Stack) -> decoder_pb2.GetDecoderInfoResponse:
    with grpc.insecure_channel(stack.decoder_target) as ch:
        return decoder_pb2_grpc.DecoderServiceStub(ch).GetDecoderInfo(decoder_pb2.GetDecoderInfoRequest())


# Results compared for equality between the async and sync stacks come from
# prompts sent one at a time, so every step runs the same batch in both stacks.
# Sent together, the batches form by timing and differ between the stacks:
# torch's CPU linear gives different bits for one row (GEMV) than for several
# (GEMM), and vLLM's MoE per-expert GEMMs vary with the batch, so a sampled
# token can rarely flip. Concurrency is checked apart (`*_concurrently`):
# every prompt completes without an error; no equality is asked of it.


def speak_all(stack: Stack) -> dict[str, bytes]:
    """Each prompt's PCM, one prompt at a time (compared between stacks)."""
    return {text: check_chunks(speak_chunks(stack.gateway_target, text, seed)) for text, seed in PROMPTS}


def speak_concurrently(stack: Stack) -> None:
    """All prompts at once: each completes with audio and no error (batches
    form by timing here: not compared)."""
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(lambda p: speak_chunks(stack.gateway_target, p[0], p[1]), PROMPTS))
    for (text, _), chunks in zip(PROMPTS, results, strict=True):
        assert check_chunks(chunks), f"{text!r}: no audio when spoken beside {len(PROMPTS) - 1} others"


def assert_same_audio(got_async: dict[str, bytes], got_sync: dict[str, bytes]) -> None:
    """Byte-identical PCM per prompt; a difference is described (where, how
    large), not only hashed."""
    differ = {t: describe_pcm_difference(got_async[t], got_sync[t]) for t in got_async if got_async[t] != got_sync[t]}
    hashes = {t: (digest(got_async[t]), digest(got_sync[t])) for t in differ}
    assert not differ, f"async and sync audio differ for {len(differ)} of {len(got_async)} prompts: {differ} {hashes}"


def generate_one(stack: Stack, prompt: tuple[str, int]) -> tuple[str, str]:
    """One prompt's final text and audio digest (text+audio, final only)."""
    text, seed = prompt
    with grpc.insecure_channel(stack.gateway_target) as ch:
        stub = gateway_pb2_grpc.OmniGatewayServiceStub(ch)
        req = gateway_pb2.OmniGatewayServiceGenerateRequest(
            prompt=text, output_modalities="text+audio", output_kind=gateway_pb2.OUTPUT_KIND_FINAL_ONLY,
            sampling_params=common_pb2.SamplingParams(seed=seed, temperature=0.8, max_tokens=24,
                                                      max_audio_seconds=5.12))
        outs = [r.output for r in stub.Generate(req, timeout=300)]
    final = outs[-1]
    assert final.finished, f"{text!r} did not finish"
    audio = b"".join(t.tensor.inline_data for t in final.multimodal.tensors if t.name == "audio")
    return final.text.text, digest(audio)


def generate_all(stack: Stack) -> dict[str, tuple[str, str]]:
    """Each prompt's text and audio digest, one prompt at a time (compared between stacks)."""
    return {p[0]: generate_one(stack, p) for p in PROMPTS}


def generate_concurrently(stack: Stack) -> None:
    """All prompts at once: each finishes with text and no error (not compared)."""
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(lambda p: generate_one(stack, p), PROMPTS))
    for (prompt, _), (text, _) in zip(PROMPTS, results, strict=True):
        assert text, f"{prompt!r}: no text when generated beside {len(PROMPTS) - 1} others"


def embed(stack: Stack, text: str) -> decoder_pb2.GenerateResponse:
    with grpc.insecure_channel(stack.decoder_target) as ch:
        stub = decoder_pb2_grpc.DecoderServiceStub(ch)
        req = decoder_pb2.GenerateRequest(request_id=f"embed-{text}", prompt=text, task=common_pb2.REQUEST_TASK_EMBED)
        (resp,) = list(stub.Generate(req, timeout=300))
    return resp


def test_engine_settings_reach_the_engine_and_are_reported(tmp_path_factory, checkpoint):
    """`up --engine-set` items reach the talker's engine; GetDecoderInfo and
    /v1/models report the settings as the engine took them; it serves, with
    the talker and Code2Wav in bfloat16 (what ``dtype: auto`` gives on a
    processor with bfloat16). The decoder's thread budget for its stage
    processes reaches the talker's process and is reported beside them."""
    import json

    stack = Stack(StackConfig(engine="vllm", profile="tts", model=str(checkpoint), sync=True, port=0, http_port=0,
                              runtime_dir=str(tmp_path_factory.mktemp("rt")), log_level="WARNING",
                              engine_set="talker.max_num_seqs=8, talker.kv_cache_memory=48MiB,max_model_len=1024,"
                                         "dtype=bfloat16",
                              extra_decoder_args=["--stage-threads", "1", "--omp-wait-policy", "passive"]))
    stack.start(timeout_s=300)
    try:
        talker, code2wav = decoder_info(stack).stages[:2]
        settings = dict(talker.engine_settings)
        assert dict(code2wav.engine_settings) == {"device": "cpu", "dtype": "bfloat16"}
        assert {k: settings[k] for k in ("max_num_seqs", "kv_cache_memory", "max_model_len", "dtype",
                                         "device", "enforce_eager", "enable_chunked_prefill", "intra_op_threads",
                                         "omp_wait_policy")} == {
            "max_num_seqs": "8", "kv_cache_memory": str(48 * 2**20), "max_model_len": "1024",
            "dtype": "bfloat16", "device": "cpu", "enforce_eager": "true", "enable_chunked_prefill": "true",
            "intra_op_threads": "1", "omp_wait_policy": "passive",
        }, settings
        env = psutil.Process(stage_pid(stack, "talker")).environ()
        assert (env.get("OMP_NUM_THREADS"), env.get("OMP_WAIT_POLICY")) == ("1", "PASSIVE")
        with urllib.request.urlopen(stack.service("decoder").metrics_url, timeout=30) as resp:
            exposition = resp.read().decode()
        assert 'omni_decoder_stage_intra_op_threads{omp_wait_policy="passive",stage="talker"} 1.0' in exposition
        with urllib.request.urlopen(f"{stack.http_url}/v1/models", timeout=30) as resp:
            (card,) = json.load(resp)["data"]
        assert card["engine_settings"] == {"talker": settings, "code2wav": {"device": "cpu", "dtype": "bfloat16"}}
        assert check_chunks(speak_chunks(stack.gateway_target, PROMPTS[0][0], PROMPTS[0][1]))
    finally:
        assert stack.stop() == []


def test_decoder_refuses_a_bad_checkpoint_before_serving(tmp_path, checkpoint):
    """Wrong architecture / missing tensor: exit status != 0, the file and key named."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(checkpoint, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    sock = f"unix://{tmp_path}/d.sock"
    run = subprocess.run([sys.executable, "-m", "decoder_svc", "--model", str(bad), "--listen", sock,
                          "--deployment", "badckpt"], capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert "config.json" in run.stderr and "architectures" in run.stderr, run.stderr[-2000:]

    cfg["architectures"] = ["Qwen3OmniMoeForConditionalGeneration"]
    (bad / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(bad / "model.safetensors"))
    del tensors["talker.codec_head.weight"]
    save_file(tensors, str(bad / "model.safetensors"))
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    del index["weight_map"]["talker.codec_head.weight"]
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    run = subprocess.run([sys.executable, "-m", "decoder_svc", "--model", str(bad), "--listen", sock,
                          "--deployment", "badckpt"], capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert "talker.codec_head.weight" in run.stderr and "missing" in run.stderr, run.stderr[-2000:]


def first_audio_and_thinker_end(stack: Stack, text: str, max_tokens: int) -> tuple[int, int, int]:
    """Generate text+audio as deltas: (index of the first output with audio,
    index of the last output with text, number of outputs)."""
    with grpc.insecure_channel(stack.gateway_target) as ch:
        stub = gateway_pb2_grpc.OmniGatewayServiceStub(ch)
        req = gateway_pb2.OmniGatewayServiceGenerateRequest(
            prompt=text, output_modalities="text+audio", output_kind=gateway_pb2.OUTPUT_KIND_DELTA,
            sampling_params=common_pb2.SamplingParams(seed=3, temperature=0.8, max_tokens=max_tokens,
                                                      max_audio_seconds=5.12))
        outs = [r.output for r in stub.Generate(req, timeout=300)]
    audio = [i for i, o in enumerate(outs) if any(t.tensor.inline_data for t in o.multimodal.tensors)]
    texts = [i for i, o in enumerate(outs) if o.text.text]
    assert audio and texts, f"{len(audio)=} {len(texts)=}"
    return audio[0], texts[-1], len(outs)


def generate_final(stack: Stack, text: str, max_tokens: int, audio_s: float) -> gateway_pb2.OmniRequestOutput:
    with grpc.insecure_channel(stack.gateway_target) as ch:
        stub = gateway_pb2_grpc.OmniGatewayServiceStub(ch)
        req = gateway_pb2.OmniGatewayServiceGenerateRequest(
            prompt=text, output_modalities="text+audio", output_kind=gateway_pb2.OUTPUT_KIND_FINAL_ONLY,
            sampling_params=common_pb2.SamplingParams(seed=5, temperature=0.8, max_tokens=max_tokens,
                                                      max_audio_seconds=audio_s))
        (out,) = [r.output for r in stub.Generate(req, timeout=300)]
    assert out.finished
    return out


def audio_bytes(out: gateway_pb2.OmniRequestOutput) -> int:
    return sum(len(t.tensor.inline_data) for t in out.multimodal.tensors if t.name == "audio")


def stage_pid(stack: Stack, stage: str) -> int:
    """The pid of the decoder's engine process for `stage`."""
    decoder = psutil.Process(stack.service("decoder").proc.pid)
    (pid,) = [c.pid for c in decoder.children() if f"decoder stage {stage}" in " ".join(c.cmdline())]
    return pid


def engine_processes(stack: Stack) -> dict[str, list[str]]:
    """The decoder's child processes by kind: each AR stage's engine, code2wav workers."""
    decoder = psutil.Process(stack.service("decoder").proc.pid)
    kinds: dict[str, list[str]] = {}
    for child in decoder.children():
        cmd = " ".join(child.cmdline())
        kind = next((k for k in ("stage thinker", "stage talker") if f"decoder {k}" in cmd), "other")
        kinds.setdefault(kind, []).append(cmd)
    return kinds


@pytest.mark.timeout(900)  # two vLLM stacks, prompts one at a time
def test_omni_stack_async_equals_sync_for_text_audio_and_speech(tmp_path_factory, tmp_path, checkpoint):
    """The default (omni) deployment, async and sync: the same text and
    audio for Generate, the same PCM for Speak (spoken from the talker, as a
    tts deployment does); the model directory untouched."""
    before = tree_snapshot(checkpoint)
    texts, speech = {}, {}
    for sync in (False, True):
        stack = start(tmp_path_factory, checkpoint, "omni", sync=sync)
        try:
            if not sync:  # the stage-streaming checks; the sync stack only answers the same requests
                # The talker starts from the thinker's first chunk (profile omni:
                # input_chunk_ramp): a long reply's first audio comes before its
                # last text.
                first_audio, last_text, n = first_audio_and_thinker_end(stack, "Tell me a long story.", 160)
                assert first_audio < last_text, f"{first_audio=} {last_text=} of {n} outputs"
                # The audio reaching its cap long before the text ends cuts no text.
                short = generate_final(stack, "Tell me a long story.", 40, 0.4)
                full = generate_final(stack, "Tell me a long story.", 40, 5.12)
                assert len(short.text.token_ids) == 40 and short.text.text == full.text.text
                assert short.finish_reason == "length", short.finish_reason
                assert 0 < audio_bytes(short) < audio_bytes(full)
                assert decoder_info(stack).active_requests == 0, "a stage still runs a finished request"
                # A one-token reply has nothing to speak (its last token is never
                # spoken): the text comes back with no audio, not an error.
                one = generate_final(stack, "Hi.", 1, 5.12)
                assert len(one.text.token_ids) == 1 and audio_bytes(one) == 0
                assert one.finish_reason == "length", one.finish_reason
                # the Qwen3-Omni stages have no pooling engine: a clear refusal, not a hang
                with pytest.raises(grpc.RpcError) as err:
                    embed(stack, "an embedding beside speech")
                assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value
                out = tmp_path / "hello.wav"
                subprocess.run([sys.executable, "-m", "omni_cli.main", "speak", "Hello there", "-o", str(out), "-q",
                                "--target", stack.gateway_target], check=True, timeout=300)
                with wave.open(str(out)) as w:
                    assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 24000)
                    assert w.getnframes() > 0
            texts[sync] = generate_all(stack)
            speech[sync] = speak_all(stack)
            if not sync:  # concurrency through the materializer (the sync stack shares the rest)
                generate_concurrently(stack)
                speak_concurrently(stack)
            # one process per AR stage engine beside the decoder (and the code2wav
            # worker), and the two engines' forward passes ran at the same time
            procs = engine_processes(stack)
            assert len(procs.get("stage thinker", ())) == 1 and len(procs.get("stage talker", ())) == 1, procs
            assert procs.get("other"), f"no code2wav worker: {procs}"
            assert metric(stack, "omni_decoder_stage_forward_overlap_seconds_total") > 0
            info = decoder_info(stack)
            assert info.engine == "vllm"
            paths = {s.name: s.output_path for s in info.stages}
            want = decoder_pb2.OUTPUT_PATH_SYNC if sync else decoder_pb2.OUTPUT_PATH_ASYNC
            assert paths["thinker"] == want and paths["talker"] == want, paths
            if not sync:
                assert info.fallback_steps == 0 and info.materializer_connected
        finally:
            assert stack.stop() == []
    assert all(text for text, _ in texts[False].values()), "no text produced"
    assert texts[False] == texts[True], f"async and sync differ: {texts=}"
    assert_same_audio(speech[False], speech[True])
    assert tree_snapshot(checkpoint) == before, "serving changed the model directory"
