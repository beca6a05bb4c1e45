"""The memory plan (decoder_svc/qwen3_omni/memory_plan.py): computed from the
checkpoint's headers and the stages' engine settings before any engine
starts; printed; refused with the numbers when it does not fit. CUDA plans
are checked with a fake device (its total memory given), no GPU needed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from decoder_svc.engine_settings import EngineSettings, resolve
from decoder_svc.profile import load_profile
from decoder_svc.qwen3_omni.checkpoint import OmniCheckpoint
from decoder_svc.qwen3_omni.memory_plan import RUNTIME_BYTES, PlanRefused, plan_memory

GiB = 2**30


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tiny):
    return OmniCheckpoint.open(tiny)


def _cpu(**kw):
    return resolve(EngineSettings(**{"dtype": "float32", **kw}), stage="s", platform="cpu",
                   checkpoint_dtype="bfloat16", checkpoint_context=4096, kv_elements_per_token=256)


def _cuda(share: float, **kw):
    return resolve(EngineSettings(gpu_memory_utilization=share, **kw), stage="s", platform="cuda",
                   checkpoint_dtype="bfloat16", checkpoint_context=4096, kv_elements_per_token=256)


def test_the_weights_come_from_the_headers(ckpt):
    talker = sum(n for n in (_numel(shape) for name, shape in ckpt.shapes.items() if name.startswith("talker.")))
    assert ckpt.numel("talker.") == talker > 0
    assert ckpt.numel("") == sum(_numel(s) for s in ckpt.shapes.values())


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def test_a_cpu_plan_adds_up_and_prints(ckpt):
    talker = _cpu(kv_cache_memory=64 * 2**20)
    plan = plan_memory(ckpt, [("talker", "talker", talker)], code2wav_workers=2, host_available=64 * GiB)
    t, c = plan.stages
    # on CPU vLLM keeps the codec embedding and head twice (their weights and a packed copy)
    packed = ckpt.numel("talker.model.codec_embedding.") + ckpt.numel("talker.codec_head.")
    assert packed == 2 * 3072 * ckpt.talker_config["text_config"]["hidden_size"]
    assert (t.weights, t.kv, t.runtime) == ((ckpt.numel("talker.") + packed) * 4, 64 * 2**20, RUNTIME_BYTES["stage"])
    assert (c.name, c.copies, c.weights) == ("code2wav", 2, ckpt.numel("code2wav.") * 4)
    assert plan.host_needed == RUNTIME_BYTES["decoder"] + t.total + c.total
    text = "\n".join(plan.lines())
    assert "talker" in text and "code2wav" in text and "x 2 processes" in text and "available" in text


def test_a_cpu_plan_that_does_not_fit_is_refused_with_its_numbers(ckpt):
    big = _cpu(kv_cache_memory=40 * GiB)
    with pytest.raises(PlanRefused) as err:
        plan_memory(ckpt, [("talker", "talker", big)], code2wav_workers=1, host_available=16 * GiB)
    msg = str(err.value)
    assert "host needs" in msg and "16.00 GiB available" in msg and "talker" in msg and "kv_cache_memory" in msg


def test_cuda_shares_of_one_device_must_add_up(ckpt):
    totals = {"cuda:0": 141 * GiB}
    thinker, talker = _cuda(0.6), _cuda(0.4)
    with pytest.raises(PlanRefused) as err:
        plan_memory(ckpt, [("thinker", "thinker", thinker), ("talker", "talker", talker)], code2wav_workers=1,
                    host_available=64 * GiB, device_totals=totals)
    assert "add up to 1.00 (thinker 0.6, talker 0.4)" in str(err.value)
    plan = plan_memory(ckpt, [("thinker", "thinker", _cuda(0.6)), ("talker", "talker", _cuda(0.3))],
                       code2wav_workers=1, host_available=64 * GiB, device_totals=totals)
    assert [s.share for s in plan.stages[:2]] == [0.6, 0.3]
    assert plan.stages[0].kv == int(0.6 * totals["cuda:0"]) - plan.stages[0].weights - plan.stages[0].activations
    # on two devices each share stands alone
    plan_memory(ckpt, [("thinker", "thinker", _cuda(0.9, device="cuda:0")),
                       ("talker", "talker", _cuda(0.9, device="cuda:1"))], code2wav_workers=1,
                host_available=64 * GiB, device_totals={"cuda:0": 80 * GiB, "cuda:1": 80 * GiB})


def test_a_share_too_small_for_its_stage_names_the_share_it_needs(ckpt):
    tiny_device = {"cuda:0": 2**20}  # 1 MiB: nothing fits
    with pytest.raises(PlanRefused) as err:
        plan_memory(ckpt, [("talker", "talker", _cuda(0.5))], code2wav_workers=1, host_available=64 * GiB,
                    device_totals=tiny_device, kv_bytes_per_token={"talker": 512})
    msg = str(err.value)
    assert "stage talker on cuda:0" in msg and "raise its gpu_memory_utilization to at least" in msg
    with pytest.raises(PlanRefused, match="total memory is not known"):
        plan_memory(ckpt, [("talker", "talker", _cuda(0.5, device="cuda:3"))], code2wav_workers=1,
                    host_available=64 * GiB, device_totals=tiny_device)


def test_code2wav_on_a_device_fits_beside_the_stages_shares(ckpt):
    """code2wav on CUDA: one copy of its weights per worker, in its dtype, in
    what the AR stages' shares leave on that device; the host then holds only
    the workers' runtime."""
    weights = ckpt.numel("code2wav.") * 2  # bfloat16
    total = int(weights * 3 / (0.95 - 0.6)) + 1  # room for 3 copies beside a 0.6 share
    thinker = [("thinker", "thinker", _cuda(0.6))]
    plan = plan_memory(ckpt, thinker, code2wav_workers=3, host_available=64 * GiB,
                       device_totals={"cuda:0": total}, code2wav=("cuda", "bfloat16"))
    c = plan.stages[-1]
    assert (c.device, c.weights, c.copies, c.runtime) == ("cuda", weights, 3, 0)
    assert plan.host_needed == RUNTIME_BYTES["decoder"] + RUNTIME_BYTES["stage"] + 3 * RUNTIME_BYTES["code2wav"]
    with pytest.raises(PlanRefused) as err:
        plan_memory(ckpt, thinker, code2wav_workers=4, host_available=64 * GiB, device_totals={"cuda:0": total},
                    code2wav=("cuda", "bfloat16"))
    msg = str(err.value)
    assert "code2wav on cuda:0: 4 copies" in msg and "shares (0.60)" in msg and "code2wav.device" in msg


@pytest.mark.vllm
def test_the_family_plans_the_profile_on_this_host(ckpt):
    pytest.importorskip("vllm")
    from decoder_svc.qwen3_omni.family import memory_plan

    plan = memory_plan(ckpt, load_profile("omni"), code2wav_workers=1)
    assert [s.name for s in plan.stages] == ["thinker", "talker", "code2wav"]
    packed = ckpt.numel("thinker.model.embed_tokens.") + ckpt.numel("thinker.lm_head.")  # twice on CPU
    assert packed == 2 * 1024 * 128
    assert plan.stages[0].weights == (ckpt.numel("thinker.") + packed) * 4  # float32 (tests pin it)
    assert 0 < plan.host_needed <= plan.host_available


@pytest.mark.vllm
def test_the_decoder_refuses_a_plan_that_does_not_fit_before_loading(tiny, tmp_path):
    pytest.importorskip("vllm")
    sock = f"unix://{tmp_path}/d.sock"
    run = subprocess.run([sys.executable, "-m", "decoder_svc", "--model", str(tiny), "--listen", sock,
                          "--deployment", "planrefused", "--engine-set", "talker.kv_cache_memory=100000GiB"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert "memory plan: the host needs" in run.stderr and "kv_cache_memory" in run.stderr, run.stderr[-2000:]
    assert "Loading safetensors" not in run.stderr, "an engine started before the plan was refused"


# -- a checkpoint that is not here: the released configuration, and `models plan` -------------

def test_the_released_configuration_counts_what_a_checkpoint_holds(tiny, ckpt):
    """Element counts from the configuration alone (the model on the meta
    device) equal the tiny checkpoint's headers; the released configuration
    is a 35 B model, about 1.8 B at one layer per stack, with its
    layer-indexed settings moved to the same relative depth."""
    from decoder_svc.qwen3_omni.checkpoint import _validate_config
    from decoder_svc.qwen3_omni.presets import (
        RELEASED_LAYERS,
        ConfigCheckpoint,
        released_config,
        stage_numel,
    )

    assert stage_numel(ckpt.config) == {p: ckpt.numel(p) for p in ("thinker.", "talker.", "code2wav.")}
    full = ConfigCheckpoint(released_config())
    assert full.thinker_config["text_config"]["num_hidden_layers"] == RELEASED_LAYERS["thinker"] == 48
    assert 35.0e9 < sum(full.numel(p) for p in ("thinker.", "talker.", "code2wav.")) < 35.5e9
    assert 31.5e9 < full.numel("thinker.") < 32e9 and 3.2e9 < full.numel("talker.") < 3.4e9
    one = released_config(1)
    assert one["talker_config"]["accept_hidden_layer"] == 1  # hidden states: 0 is the embeddings
    assert one["thinker_config"]["vision_config"]["deepstack_visual_indexes"] == [0, 0, 0]
    assert 1.7e9 < sum(stage_numel(one).values()) < 1.9e9
    twelve = released_config(12)
    assert twelve["talker_config"]["accept_hidden_layer"] == 6
    assert twelve["thinker_config"]["vision_config"]["deepstack_visual_indexes"] == [4, 7, 11]
    for layers in (1, 2, 3, 12, 48):  # what a checkpoint's config.json must satisfy
        _validate_config(Path("config.json"), released_config(layers))
    with pytest.raises(ValueError, match="layers"):
        released_config(0)


@pytest.fixture
def plan_cli(monkeypatch, capsys):
    """`omni-serving models plan ARGS` in this process: (exit code, stdout, stderr). The
    deployment's settings only (the tests' float32 default left out: the released checkpoint's dtype)."""
    from omni_cli.main import main

    monkeypatch.delenv("OMNI_ENGINE_SET", raising=False)

    def run(*argv: str) -> tuple[int, str, str]:
        code = main(["models", "plan", *argv])
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


def test_models_plan_for_a_host_that_is_not_this_one(tiny, plan_cli):
    """`omni-serving models plan`: the released checkpoint on one 141 GB GPU
    (refused with the profile's default shares, planned with shares that add
    up) and on two; a checkpoint directory on this host."""
    one_gpu = ("--preset", "released", "--gpus", "1", "--gpu-memory", "141GB", "--host-memory", "64GiB")
    code, _, err = plan_cli(*one_gpu)
    assert code == 1 and "add up to 1.80 (thinker 0.9, talker 0.9)" in err, err
    code, out, err = plan_cli(*one_gpu, "--engine-set",
                              "thinker.gpu_memory_utilization=0.75,talker.gpu_memory_utilization=0.15")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == "memory plan (3 stages):" and "thinker   on cuda    weights 59.08 GiB" in lines[1], lines
    assert "share 0.75 of 131.32 GiB" in lines[1] and "talker    on cuda    weights 6.19 GiB" in lines[2], lines
    code, out, err = plan_cli("--preset", "released", "--gpus", "2", "--gpu-memory", "141GB", "--host-memory",
                              "64GiB", "--engine-set", "talker.device=cuda:1,code2wav.device=cuda:1")
    assert code == 0 and "talker    on cuda:1" in out and "thinker   on cuda " in out, (out, err)
    code, out, err = plan_cli(str(tiny))
    assert code == 0 and "host:" in out.splitlines()[-1], err
    for bad, needle in [((), "give a checkpoint directory or --preset"),
                        (("--preset", "released", "--gpus", "1"), "--gpus needs --gpu-memory"),
                        ((str(tiny), "--layers", "2"), "--layers goes with --preset")]:
        code, _, err = plan_cli(*bad)
        assert code == 2 and needle in err, (bad, err)


def test_the_cli_runs_models_plan():
    run = subprocess.run([sys.executable, "-m", "omni_cli.main", "models", "plan", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "--gpu-memory" in run.stdout, run.stderr
