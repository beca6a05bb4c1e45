"""Async scheduling follows the platform (decoder_svc/vllm_engine/engine_factory.py,
``engine_config``): a stage that asks for it gets vLLM's choice (on where the
executor overlaps steps, off on vLLM's CPU platform), one that does not gets
it off everywhere, and ``OMNI_CPU_ASYNC_SCHEDULING=1`` turns an asked-for
setting back on on CPU. The real CPU platform, and a fake platform that
leaves the setting alone as CUDA's does (``FakeCudaLikePlatform``: the CPU
platform's config update with async scheduling kept as vLLM's own rules set
it), on vLLM's real config building; no engine is started.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed", allow_module_level=True)

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from decoder_svc.profile import load_profile  # noqa: E402

STANDIN_OMNI = os.path.join(os.path.dirname(__file__), "fakes", "standin_omni.yaml")

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def talker_dir(tmp_path_factory):
    from decoder_svc.testing.standin_profiles import create_profile_models

    dirs = create_profile_models(load_profile(STANDIN_OMNI), tmp_path_factory.mktemp("async-sched"))
    return dirs["talker"]


def _config(model_dir, asked: bool):
    from decoder_svc.vllm_engine import engine_factory as ef

    kwargs = dict(model=str(model_dir), tokenizer=str(model_dir), max_model_len=256, dtype="float32",
                  enforce_eager=True, kv_cache_memory_bytes=16 * 2**20)
    return ef.engine_config(kwargs, async_scheduling=asked).scheduler_config.async_scheduling


@pytest.fixture
def fake_cuda_like_platform(monkeypatch):
    """FakeCudaLikePlatform: vLLM's CPU platform whose config update keeps
    async scheduling as vLLM's own rules set it (CUDA's platform does not
    touch it)."""
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.check_and_update_config.__func__

    def keep_async_scheduling(cls, vllm_config):
        before = vllm_config.scheduler_config.async_scheduling
        original(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = before

    monkeypatch.setattr(CpuPlatform, "check_and_update_config", classmethod(keep_async_scheduling))


def test_cpu_platform_keeps_async_scheduling_off(talker_dir, monkeypatch):
    from decoder_svc.vllm_engine.engine_factory import FORCE_ASYNC_ENV

    monkeypatch.delenv(FORCE_ASYNC_ENV, raising=False)
    assert _config(talker_dir, asked=True) is False, "asked for on vLLM's CPU platform: should stay off"
    assert _config(talker_dir, asked=False) is False, "not asked for: should be off"
    monkeypatch.setenv(FORCE_ASYNC_ENV, "1")
    assert _config(talker_dir, asked=True) is True, f"{FORCE_ASYNC_ENV}=1 and asked for: should be on"
    assert _config(talker_dir, asked=False) is False, f"{FORCE_ASYNC_ENV}=1 but not asked for: should be off"


def test_overlapping_platform_gets_what_the_stage_asks(talker_dir, monkeypatch, fake_cuda_like_platform):
    from decoder_svc.vllm_engine.engine_factory import FORCE_ASYNC_ENV

    monkeypatch.delenv(FORCE_ASYNC_ENV, raising=False)
    assert _config(talker_dir, asked=True) is True, "asked for where the platform keeps it: should be on"
    # vLLM's own default there would be on: not asking must turn it off
    assert _config(talker_dir, asked=False) is False, "not asked for: should be off on any platform"


def test_async_scheduling_is_not_an_engine_argument(talker_dir):
    from decoder_svc.vllm_engine.engine_factory import engine_config

    with pytest.raises(ValueError, match="async_scheduling"):
        engine_config({"model": str(talker_dir), "async_scheduling": True}, async_scheduling=False)
