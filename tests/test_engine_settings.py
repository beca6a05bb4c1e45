"""Engine settings of the AR stages (decoder_svc/engine_settings.py): parsing,
overrides by source, resolution against a checkpoint and a platform, and what
reaches vLLM's config (on CPU; the CUDA arguments are checked as vLLM's
EngineArgs takes them, no GPU needed)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from decoder_svc.engine_settings import (
    EngineSettings,
    apply_overrides,
    parse_overrides,
    parse_settings,
    resolve,
    resolve_vocoder,
)
from decoder_svc.profile import load_profile
from omni_common.errors import InvalidArgumentError

# a checkpoint's facts as resolve takes them: 4096 tokens of context, 1 KiB
# of KV per token in float32 (2 x 2 layers x 2 heads x 32)
CKPT = dict(checkpoint_dtype="bfloat16", checkpoint_context=4096, kv_elements_per_token=256)


def _error(fn, *args, **kwargs) -> InvalidArgumentError:
    with pytest.raises(InvalidArgumentError) as err:
        fn(*args, **kwargs)
    return err.value


def test_defaults_and_sizes():
    s = parse_settings({"kv_cache_memory": "2GiB", "max_num_seqs": "32", "dtype": "bfloat16",
                        "enforce_eager": "false", "max_model_len": 8192}, "stages[1].engine")
    assert (s.kv_cache_memory, s.max_num_seqs, s.dtype, s.enforce_eager, s.max_model_len) == (
        2 * 2**30, 32, "bfloat16", False, 8192)
    assert parse_settings({"kv_cache_memory": 67108864}, "x").kv_cache_memory == 64 * 2**20
    assert parse_settings({"kv_cache_memory": "1.5 GB"}, "x").kv_cache_memory == 1_500_000_000
    assert parse_settings(None, "x") == EngineSettings()
    assert EngineSettings().report()["dtype"] == "auto"


@pytest.mark.parametrize("key,value,says", [
    ("dtype", "float64", "must be one of auto, float32, bfloat16, float16"),
    ("max_num_seqs", 0, "an integer in [1, 1024]"),
    ("max_num_seqs", 5000, "an integer in [1, 1024]"),
    ("max_num_seqs", True, "an integer in [1, 1024]"),
    ("max_model_len", 8, "an integer >= 16 or auto"),
    ("kv_cache_memory", "lots", "a size in bytes"),
    ("kv_cache_memory", "10KiB", "at least 65536 bytes"),
    ("gpu_memory_utilization", 1.5, "in (0, 1]"),
    ("gpu_memory_utilization", 0, "in (0, 1]"),
    ("enforce_eager", "maybe", "true or false or auto"),
    ("enable_chunked_prefill", "auto", "true or false"),
    ("device", "tpu", "auto, cpu, cuda or cuda:N"),
    ("batch", 4, "unknown engine setting 'batch'"),
])
def test_a_bad_value_names_its_key_and_the_allowed_range(key, value, says):
    err = _error(parse_settings, {key: value}, "stages[1].engine")
    assert err.field == f"stages[1].engine.{key}" and says in str(err), (err.field, str(err))


def test_batched_tokens_below_the_requests_per_step_is_refused():
    err = _error(parse_settings, {"max_num_seqs": 64, "max_num_batched_tokens": 16}, "stages[0].engine")
    assert err.field == "stages[0].engine.max_num_batched_tokens" and "at least max_num_seqs (64)" in str(err)


def test_overrides_apply_to_one_stage_or_all_in_order():
    stages = {"thinker": EngineSettings(), "talker": EngineSettings()}
    items = parse_overrides(["dtype=float32", "talker.max_num_seqs=8", " ", "talker.dtype=bfloat16"], "--engine-set")
    out = apply_overrides(stages, items, "--engine-set")
    assert (out["thinker"].dtype, out["talker"].dtype) == ("float32", "bfloat16")
    assert (out["thinker"].max_num_seqs, out["talker"].max_num_seqs) == (64, 8)
    err = _error(apply_overrides, stages, parse_overrides(["code2wav.dtype=float32"], "--engine-set"), "--engine-set")
    assert err.field == "--engine-set code2wav.dtype" and "its AR stages: thinker, talker" in str(err)
    err = _error(parse_overrides, ["talker.speed=2"], "--engine-set")
    assert err.field == "--engine-set talker.speed" and "unknown engine setting 'speed'" in str(err)
    err = _error(parse_overrides, ["dtype"], "OMNI_ENGINE_SET")
    assert err.field == "OMNI_ENGINE_SET" and "[STAGE.]KEY=VALUE" in str(err)
    err = _error(apply_overrides, stages, parse_overrides(["max_num_seqs=-1"], "--engine-set"), "--engine-set")
    assert err.field == "--engine-set max_num_seqs"


def test_profile_then_environment_then_command_line(tmp_path):
    from decoder_svc.server import add_arguments, deployed_profile

    profile = tmp_path / "p.yaml"
    text = (Path(__file__).parents[1] / "decoder_svc" / "profiles" / "tts.yaml").read_text()
    profile.write_text(text.replace("    engine_role: talker\n",
                                    "    engine_role: talker\n    engine: {max_num_seqs: 4, dtype: float32}\n"))
    assert load_profile(str(profile), environ={}).stage("talker").engine.max_num_seqs == 4
    env = {"OMNI_ENGINE_SET": "max_num_seqs=6,talker.kv_cache_memory=32MiB"}
    talker = load_profile(str(profile), environ=env).stage("talker").engine
    assert (talker.max_num_seqs, talker.kv_cache_memory, talker.dtype) == (6, 32 * 2**20, "float32")

    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--profile", str(profile), "--engine-set", "talker.max_num_seqs=9"])
    assert deployed_profile(args).stage("talker").engine.max_num_seqs == 9
    args = parser.parse_args(["--profile", str(profile), "--max-num-seqs", "12"])
    assert deployed_profile(args).stage("talker").engine.max_num_seqs == 12
    err = _error(load_profile, str(profile), environ={"OMNI_ENGINE_SET": "talker.dtype=float64"})
    assert err.field == "OMNI_ENGINE_SET talker.dtype"


def test_a_profile_engine_section_is_checked(tmp_path):
    text = (Path(__file__).parents[1] / "decoder_svc" / "profiles" / "tts.yaml").read_text()
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace("    engine_role: talker\n", "    engine_role: talker\n    engine: {dtype: int8}\n"))
    err = _error(load_profile, str(bad), environ={})
    assert err.field == "stages[0].engine.dtype"
    gen = tmp_path / "gen.yaml"
    gen.write_text(text.replace("    kind: generation\n", "    kind: generation\n    engine: {max_num_seqs: 4}\n"))
    err = _error(load_profile, str(gen), environ={})
    assert err.field == "stages[1].engine.max_num_seqs" and "takes device and dtype only" in str(err)


def test_the_generation_stage_takes_device_and_dtype(tmp_path):
    """code2wav's device and dtype: in its profile section, by its name, or
    by an item without STAGE. (which its other keys do not reach)."""
    text = (Path(__file__).parents[1] / "decoder_svc" / "profiles" / "tts.yaml").read_text()
    gen = tmp_path / "gen.yaml"
    gen.write_text(text.replace("    kind: generation\n", "    kind: generation\n    engine: {dtype: bfloat16}\n"))
    code2wav = load_profile(str(gen), environ={}).stage("code2wav").engine
    assert (code2wav.device, code2wav.dtype) == ("auto", "bfloat16")
    env = {"OMNI_ENGINE_SET": "max_num_seqs=6,dtype=float32,code2wav.device=cpu"}
    profile = load_profile(str(gen), environ=env)
    code2wav, talker = profile.stage("code2wav").engine, profile.stage("talker").engine
    assert (code2wav.device, code2wav.dtype, code2wav.max_num_seqs) == ("cpu", "float32", 64)
    assert (talker.max_num_seqs, talker.dtype) == (6, "float32")
    err = _error(load_profile, str(gen), environ={"OMNI_ENGINE_SET": "code2wav.max_model_len=512"})
    assert err.field == "OMNI_ENGINE_SET code2wav.max_model_len" and "device and dtype only" in str(err)

    assert resolve_vocoder(EngineSettings(), stage="code2wav", platform="cpu") == ("cpu", "float32")
    assert resolve_vocoder(EngineSettings(), stage="code2wav", platform="cuda") == ("cuda", "bfloat16")
    assert resolve_vocoder(EngineSettings(device="cuda:1", dtype="float32"), stage="code2wav",
                           platform="cuda") == ("cuda:1", "float32")
    assert resolve_vocoder(EngineSettings(dtype="bfloat16"), stage="code2wav", platform="cpu") == ("cpu", "bfloat16")
    err = _error(resolve_vocoder, EngineSettings(device="cuda"), stage="code2wav", platform="cpu")
    assert err.field == "engine.code2wav.device" and "sees no CUDA device" in str(err)
    err = _error(resolve_vocoder, EngineSettings(dtype="float16"), stage="code2wav", platform="cpu")
    assert err.field == "engine.code2wav.dtype"


def test_the_vocoder_is_built_and_rebuilt_in_its_dtype(tmp_path):
    """The checkpoint's vocoder in the generation stage's dtype; a code2wav
    worker rebuilds it from its spec in the same dtype."""
    import importlib

    import numpy as np
    import torch

    from decoder_svc.qwen3_omni.engine import build_front
    from decoder_svc.qwen3_omni.tiny import create_tiny_checkpoint

    ckpt = create_tiny_checkpoint(tmp_path / "tiny")
    profile = load_profile("tts", environ={"OMNI_ENGINE_SET": "code2wav.dtype=bfloat16"})
    vocoder = build_front(profile, ckpt).vocoder
    assert (vocoder.device, vocoder.dtype, vocoder.model.dtype) == ("cpu", "bfloat16", torch.bfloat16)
    path, kwargs = vocoder.worker_spec()
    module, name = path.split(":")
    rebuilt = getattr(importlib.import_module(module), name)(**kwargs)
    assert rebuilt.model.dtype == torch.bfloat16
    codes = np.random.default_rng(0).integers(0, vocoder.codebook_size, (6, vocoder.num_codebooks))
    audio = rebuilt.new_stream("default").push(codes)
    assert audio.dtype == np.float32 and np.array_equal(audio, vocoder.new_stream("default").push(codes))
    assert build_front(load_profile("tts", environ={}), ckpt).vocoder.model.dtype == torch.float32


def test_resolve_on_cpu():
    eff = resolve(EngineSettings(), stage="talker", platform="cpu", bf16_cpu=False, **CKPT)
    # 64 MiB at 1 KiB per float32 token: 65536 tokens, above the checkpoint's 4096
    assert (eff.device, eff.dtype, eff.max_model_len, eff.enforce_eager) == ("cpu", "float32", 4096, True)
    assert eff.max_num_batched_tokens == 2048 and eff.enable_chunked_prefill  # prompts past 2048 tokens: in chunks
    assert any("lacks bfloat16" in n for n in eff.notes)
    kwargs = eff.vllm_kwargs()
    assert kwargs["kv_cache_memory_bytes"] == 64 * 2**20 and "gpu_memory_utilization" not in kwargs
    assert resolve(EngineSettings(), stage="talker", platform="cpu", bf16_cpu=True, **CKPT).dtype == "bfloat16"


def test_resolve_reduces_the_context_to_the_kv_budget_and_says_so():
    # 2048 tokens of 1 KiB, less one block vLLM keeps back (counted as 256 tokens)
    small = EngineSettings(kv_cache_memory=2 * 2**20, dtype="float32")
    eff = resolve(small, stage="talker", platform="cpu", **CKPT)
    assert eff.max_model_len == 1792
    assert any("reduced to the 1792 the KV budget holds" in n for n in eff.notes), eff.notes
    # vLLM's CPU engine refuses 256 KiB for a 256-token context (128-token blocks, one kept back): so do we
    err = _error(resolve, EngineSettings(kv_cache_memory=256 * 2**10, max_model_len=256, dtype="float32"),
                 stage="talker", platform="cpu", **CKPT)
    assert err.field == "engine.talker.kv_cache_memory" and "hold 0 tokens" in str(err), err
    ok = resolve(EngineSettings(kv_cache_memory=512 * 2**10, max_model_len=256, dtype="float32"),
                 stage="talker", platform="cpu", **CKPT)
    assert ok.max_model_len == 256
    err = _error(resolve, dataclasses.replace(small, max_model_len=3000), stage="talker", platform="cpu", **CKPT)
    assert err.field == "engine.talker.kv_cache_memory" and "raise kv_cache_memory to at least 3407872" in str(err)
    err = _error(resolve, EngineSettings(max_model_len=5000), stage="talker", platform="cpu", **CKPT)
    assert err.field == "engine.talker.max_model_len" and "checkpoint's context (4096" in str(err)


def test_resolve_refusals():
    err = _error(resolve, EngineSettings(device="cuda:1"), stage="talker", platform="cpu", **CKPT)
    assert err.field == "engine.talker.device" and "vLLM runs on cpu" in str(err)
    err = _error(resolve, EngineSettings(dtype="float16"), stage="talker", platform="cpu", **CKPT)
    assert err.field == "engine.talker.dtype"
    err = _error(resolve, EngineSettings(max_num_batched_tokens=1024, dtype="float32", enable_chunked_prefill=False),
                 stage="talker", platform="cpu", **CKPT)
    assert err.field == "engine.talker.max_num_batched_tokens" and "at least max_model_len (4096)" in str(err)
    for stage in ("thinker", "talker"):  # a step's budget below the context: prompts are prefilled in chunks
        chunked = resolve(EngineSettings(enable_chunked_prefill=True, max_num_batched_tokens=512, dtype="float32"),
                          stage=stage, platform="cpu", **CKPT)
        assert (chunked.enable_chunked_prefill, chunked.max_num_batched_tokens) == (True, 512)


def test_resolve_on_cuda_and_the_arguments_vllm_takes():
    eff = resolve(EngineSettings(gpu_memory_utilization=0.4, quantization="fp8"), stage="thinker",
                  platform="cuda", **CKPT)
    assert (eff.device, eff.dtype, eff.enforce_eager, eff.max_model_len) == ("cuda", "bfloat16", False, 4096)
    kwargs = eff.vllm_kwargs()
    assert kwargs["gpu_memory_utilization"] == 0.4 and "kv_cache_memory_bytes" not in kwargs
    assert kwargs["quantization"] == "fp8" and kwargs["enforce_eager"] is False
    assert eff.report()["gpu_memory_utilization"] == "0.4" and "kv_cache_memory" not in eff.report()
    assert resolve(EngineSettings(enforce_eager=True), stage="t", platform="cuda", **CKPT).enforce_eager is True
    vllm_args = pytest.importorskip("vllm.engine.arg_utils")
    # every argument is one vLLM's EngineArgs has (a typo would only fail on a GPU host)
    fields = {f.name for f in dataclasses.fields(vllm_args.EngineArgs)}
    assert set(kwargs) <= fields, set(kwargs) - fields
    assert set(resolve(EngineSettings(), stage="t", platform="cpu", **CKPT).vllm_kwargs()) <= fields


@pytest.mark.vllm
def test_settings_reach_vllms_config_on_cpu(tmp_path, monkeypatch):
    """A stage's settings, resolved for the tiny checkpoint, are what vLLM's config holds."""
    pytest.importorskip("vllm")
    from decoder_svc.qwen3_omni.checkpoint import OmniCheckpoint
    from decoder_svc.qwen3_omni.engine import stage_settings
    from decoder_svc.qwen3_omni.tiny import create_tiny_checkpoint
    from decoder_svc.qwen3_omni.views import talker_view
    from decoder_svc.vllm_engine.engine_factory import _set_env_defaults, engine_config, settings_of

    monkeypatch.setenv("OMNI_SERVING_MODEL_DIR", str(tmp_path / "cache"))
    ckpt = OmniCheckpoint.open(create_tiny_checkpoint(tmp_path / "tiny"))
    profile = load_profile("tts", environ={"OMNI_ENGINE_SET": "max_num_seqs=8,kv_cache_memory=16MiB,"
                                                              "max_model_len=1024,dtype=float32,"
                                                              "enable_chunked_prefill=true,max_num_batched_tokens=96"})
    eff = stage_settings(ckpt, profile.stage("talker"))
    assert (eff.max_num_seqs, eff.max_model_len, eff.kv_cache_memory) == (8, 1024, 16 * 2**20)
    assert (eff.enable_chunked_prefill, eff.max_num_batched_tokens) == (True, 96)
    _set_env_defaults()
    from decoder_svc.qwen3_omni.backends import prepare_vllm

    prepare_vllm()
    view = talker_view(ckpt).path
    vc = engine_config({"model": str(view), "tokenizer": str(view), "skip_tokenizer_init": True,
                        "enable_prompt_embeds": True, **eff.vllm_kwargs()}, async_scheduling=False)
    assert settings_of(vc) == eff.report()


def test_decoder_refuses_a_bad_setting_before_loading(tmp_path):
    sock = f"unix://{tmp_path}/d.sock"
    run = subprocess.run([sys.executable, "-m", "decoder_svc", "--engine", "fake", "--listen", sock,
                          "--deployment", "badset", "--engine-set", "talker.max_num_seqs=0"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "--engine-set talker.max_num_seqs" in run.stderr and "[1, 1024]" in run.stderr, run.stderr[-2000:]


def test_a_stage_on_cuda_n_sees_that_device_only():
    """Device bookkeeping without a GPU: what a stage process on cuda:N sets
    before vLLM loads, and the placements the decoder refuses."""
    from decoder_svc.engine_settings import check_placement, visible_devices

    assert visible_devices("cuda:1", {}) == "1"
    assert visible_devices("cuda:1", {"CUDA_VISIBLE_DEVICES": "4, 6"}) == "6"
    assert visible_devices("cuda", {}) is None and visible_devices("auto", {}) is None
    assert visible_devices("cpu", {"CUDA_VISIBLE_DEVICES": "3"}) is None
    err = _error(visible_devices, "cuda:2", {"CUDA_VISIBLE_DEVICES": "4,6"})
    assert "gives this process 2 device(s)" in str(err)
    on = EngineSettings(device="cuda:1")
    check_placement([("thinker", EngineSettings(device="cuda:0"), 1), ("talker", on, 1)], own_processes=True)
    err = _error(check_placement, [("talker", on, 1)], own_processes=False)
    assert err.field == "engine.talker.device" and "--stage-processes on" in str(err)
    err = _error(check_placement, [("thinker", on, 2)], own_processes=True)
    assert err.field == "engine.thinker.device" and "tensor_parallel_size=2" in str(err)


def test_stage_process_places_itself_before_building(monkeypatch):
    from decoder_svc.stage import host
    from decoder_svc.stage.messages import StageHostSpec

    profile = load_profile("tts", environ={"OMNI_ENGINE_SET": "talker.device=cuda:1"})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5")
    host._place(StageHostSpec(profile=profile, stage="talker", engine="fake"))
    import os

    assert os.environ["CUDA_VISIBLE_DEVICES"] == "5"
