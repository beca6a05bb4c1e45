"""Per-stage guards: each failing condition falls back to the sync path, which still serves."""

from __future__ import annotations

import dataclasses
import os

import pytest
import yaml

from decoder_svc.guards import evaluate
from decoder_svc.profile import PROFILE_DIR, load_profile
from omni_common.shm_arena import ShmArena
from tests.test_pipeline import run_batch

PROFILE = load_profile("tts")
TALKER = PROFILE.stage("talker")

FALLBACKS = [
    ("profile", {"async_chunk": False}, {}, "async_chunk"),
    ("stage", {"use_async_output": False}, {}, "opt in"),
    ("stage", {"speculative_decoding": True}, {}, "speculative"),
    ("stage", {"routed_experts": True}, {}, "routed-expert"),
    ("stage", {"postprocess": "deferred"}, {}, "postprocess"),
    ("engine", {}, {"speculative_decoding": True}, "speculative"),
]


def test_all_guards_pass_for_the_shipped_profiles():
    for name in ("tts", "omni"):
        p = load_profile(name)
        for s in p.ar_stages:
            d = evaluate(s, p, materializer_available=True)
            assert d.use_async, f"{name}/{s.name}: {d.reason}"


def test_no_materializer_means_sync():
    d = evaluate(TALKER, PROFILE, materializer_available=False)
    assert not d.use_async and "materializer" in d.reason


def test_async_output_does_not_need_async_scheduling():
    """The handoff to the materializer happens after step() returns: a stage
    or an engine without async scheduling (vLLM's CPU platform turns it off)
    still takes the async path, and the reason says which scheduling the
    engine runs."""
    off = dataclasses.replace(TALKER, async_scheduling=False)
    for stage, facts in ((off, {}), (TALKER, {"async_scheduling": False}), (off, {"async_scheduling": False})):
        d = evaluate(stage, PROFILE, materializer_available=True, engine_facts=facts)
        assert d.use_async, f"stage async_scheduling={stage.async_scheduling}, facts {facts}: {d.reason}"
    d = evaluate(TALKER, PROFILE, materializer_available=True, engine_facts={"async_scheduling": False})
    assert d.reason == "all guards pass; async scheduling off", d.reason
    d = evaluate(TALKER, PROFILE, materializer_available=False, engine_facts={"async_scheduling": True})
    assert d.reason.endswith("; async scheduling on") and "materializer" in d.reason, d.reason


@pytest.mark.parametrize(("where", "change", "facts", "reason"), FALLBACKS)
def test_each_condition_falls_back(where, change, facts, reason):
    stage, profile = TALKER, PROFILE
    if where == "stage":
        stage = dataclasses.replace(TALKER, **change)
    elif where == "profile":
        profile = dataclasses.replace(PROFILE, **change)
    d = evaluate(stage, profile, materializer_available=True, engine_facts=facts)
    assert not d.use_async, f"{where} {change or facts} should fall back"
    assert reason in d.reason, f"{d.reason=} does not mention {reason!r}"


@pytest.mark.parametrize("change", [{"use_async_output": False}, {"postprocess": "deferred"}, {"speculative_decoding": True}])
def test_fallback_stage_still_serves_same_audio(tmp_path, change):
    """A stage whose guard fails runs the sync path and gives the same audio."""
    base, _ = run_batch("tts", n=4, materializer_target=None, arena=None)
    raw = yaml.safe_load((PROFILE_DIR / "tts.yaml").read_text())
    raw["stages"][0].update(change)
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(raw))
    with ShmArena(f"omni-guardtest{os.getpid()}", 4, 1 << 20) as arena:
        got, pipeline = run_batch(str(path), n=4, materializer_target=None, arena=arena, in_process_builder=True)
    assert not pipeline.decision.use_async, pipeline.decision
    assert got == base
