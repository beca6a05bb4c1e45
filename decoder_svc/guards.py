"""Per-stage guards: may this AR stage hand its outputs to the materializer?

Every condition must hold for the async path; otherwise the stage builds its
payloads inside the step (synchronous path) and still serves. The decision and
its reason are logged once per stage and reported by GetDecoderInfo; the
reason ends with the engine's effective async scheduling (``; async
scheduling on|off``) when the engine reports it.

Async scheduling (vLLM's) is NOT a condition: the seed required it, but here
the snapshot and the materializer handoff happen after ``step()`` has
returned the step's rows, so the async output path needs nothing of the
engine's scheduling. It is on only where the executor overlaps steps (not on
vLLM's CPU platform: ``decoder_svc.vllm_engine.engine_factory``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from decoder_svc.profile import Profile, StageConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GuardDecision:
    use_async: bool
    reason: str


def evaluate(
    stage: StageConfig,
    profile: Profile,
    *,
    materializer_available: bool,
    engine_facts: Mapping[str, Any] | None = None,
) -> GuardDecision:
    """Decide the output path of one AR stage. First failing check wins.

    `engine_facts` (from a backend's `engine_facts()`) are what the engine
    was actually built with; they win over the profile's stage settings.
    """
    facts = dict(engine_facts or {})
    speculative = bool(facts.get("speculative_decoding", stage.speculative_decoding))
    routed = bool(facts.get("routed_experts", stage.routed_experts))
    postprocess = str(facts.get("postprocess", stage.postprocess))
    checks = (
        (stage.kind == "ar", "not an AR stage"),
        (profile.async_chunk, "async_chunk is off in the profile"),
        (stage.use_async_output, "the stage does not opt in to async output"),
        (not speculative, "speculative decoding is on (its state is not snapshotted)"),
        (not routed, "routed-expert output needs the synchronous path"),
        (postprocess in ("none", "eager"), "postprocess is deferred (the next step needs its state)"),
        (materializer_available, "no materializer configured"),
    )
    scheduling = ""
    if "async_scheduling" in facts:
        scheduling = f"; async scheduling {'on' if facts['async_scheduling'] else 'off'}"
    for ok, why in checks:
        if not ok:
            return GuardDecision(False, why + scheduling)
    return GuardDecision(True, "all guards pass" + scheduling)


def log_decision(stage: StageConfig, decision: GuardDecision) -> None:
    path = "async (materializer)" if decision.use_async else "sync (in-process)"
    logger.info("stage %d (%s) output path: %s: %s", stage.stage_id, stage.name, path, decision.reason)
