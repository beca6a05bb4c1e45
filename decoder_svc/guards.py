"""Per-stage guards: may this AR stage hand its outputs to the materializer?

Every condition must hold for the async path; otherwise the stage builds its
payloads inside the step (synchronous path) and still serves. The decision and
its reason are logged once per stage and reported by GetDecoderInfo.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from decoder_svc.profile import Profile, StageConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GuardDecision:
    use_async: bool
    reason: str


def evaluate(stage: StageConfig, profile: Profile, *, materializer_available: bool) -> GuardDecision:
    """Decide the output path of one AR stage. First failing check wins."""
    checks = (
        (stage.kind == "ar", "not an AR stage"),
        (stage.async_scheduling, "async scheduling is off for this stage"),
        (profile.async_chunk, "async_chunk is off in the profile"),
        (stage.use_async_output, "the stage does not opt in to async output"),
        (not stage.speculative_decoding, "speculative decoding is on (its state is not snapshotted)"),
        (not stage.routed_experts, "routed-expert output needs the synchronous path"),
        (stage.postprocess in ("none", "eager"), "postprocess is deferred (the next step needs its state)"),
        (materializer_available, "no materializer configured"),
    )
    for ok, why in checks:
        if not ok:
            return GuardDecision(False, why)
    return GuardDecision(True, "all guards pass")


def log_decision(stage: StageConfig, decision: GuardDecision) -> None:
    path = "async (materializer)" if decision.use_async else "sync (in-process)"
    logger.info("stage %d (%s) output path: %s: %s", stage.stage_id, stage.name, path, decision.reason)
