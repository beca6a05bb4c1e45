"""Building AR stages: each stage's guard decision, the arena, the materializer link, the decode loops.

One function, :func:`build_stages`, used by both places a decode loop runs:

- the decoder's own process (``decoder_svc.pipeline.Pipeline``), for the
  stages whose engine runs there: they share the decoder's arena (given)
  and one link (one Materialize stream, every async stage's plan);
- a stage process (``.host``), for its one stage: its own arena (made here
  when the stage takes the async path and tensors travel as handles) and
  its own link, named after the stage.

Each stage's output path is decided once, at startup, by the guards
(``decoder_svc.guards``: :func:`decide`), from the profile, the engine's
facts and whether a materializer (or the in-process builder) is there. A
link exists when some stage takes the async path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from decoder_svc.backend import ARBackend
from decoder_svc.guards import GuardDecision, evaluate, log_decision
from decoder_svc.link.delivery import Deliver, FailStep
from decoder_svc.link.materializer_link import MaterializerLink
from decoder_svc.profile import Profile, StageConfig
from decoder_svc.stage.runner import StageRunner
from omni_common.shm_arena import ShmArena


@dataclass
class BuiltStages:
    """What :func:`build_stages` made: by stage id, the decisions and the runners."""

    decisions: dict[int, GuardDecision]
    arena: ShmArena | None  # given, or made here (owns_arena)
    link: MaterializerLink | None  # not started
    runners: dict[int, StageRunner]  # not started
    owns_arena: bool = False


def uses_link(materializer_target: str | None, in_process_builder: bool) -> bool:
    """Whether a link can exist: a materializer is configured, or the
    in-process background builder (the in-process thread baseline) is asked for."""
    return bool(materializer_target) or in_process_builder


def decide(config: StageConfig, profile: Profile, backend: ARBackend, *, materializer_available: bool) -> GuardDecision:
    """A stage's output path (logged once)."""
    decision = evaluate(
        config,
        profile,
        materializer_available=materializer_available,
        engine_facts=getattr(backend, "engine_facts", dict)(),
    )
    log_decision(config, decision)
    return decision


def build_stages(
    profile: Profile,
    stages: list[StageConfig],
    backends: dict[str, ARBackend],
    *,
    materializer_target: str | None,
    in_process_builder: bool,
    shm_prefix: str,
    deliver: Deliver,
    fail_step: FailStep,
    downstream: Callable[[list[str]], list[str]],
    on_failure: Callable[[BaseException], None],
    arena: ShmArena | None = None,
    own_arena: tuple[int, int] | None = None,
    inline_transport: bool = False,
    readiness_timeout_ms: int = 5000,
    stall_timeout_s: float = 3.0,
    acquire_timeout_s: float = 0.5,
    link_name: str = "decoder",
) -> BuiltStages:
    """Decide each stage's path and build the link and runners for `stages`.

    arena: the arena the stages share (the decoder's); own_arena: (slots,
    slot bytes) of one to make here instead when a stage takes the async
    path and tensors travel as handles (not ``inline_transport``). deliver /
    fail_step: where the link and the sync path hand materialized steps and
    failed steps; downstream: the requests of a step whose payload the next
    stage wants; on_failure: a decode step failed."""
    use_link = uses_link(materializer_target, in_process_builder)
    decisions = {
        s.stage_id: decide(s, profile, backends[s.name], materializer_available=use_link) for s in stages
    }
    async_plans = {s.stage_id: s.plan() for s in stages if decisions[s.stage_id].use_async}
    owns_arena = False
    try:
        if async_plans and arena is None and own_arena is not None and not inline_transport:
            arena = ShmArena(shm_prefix, *own_arena)
            owns_arena = True
        link = (
            MaterializerLink(
                target=materializer_target or None,
                shm_prefix=shm_prefix,
                plans=async_plans,
                arena=arena,
                deliver=deliver,
                fail_step=fail_step,
                readiness_timeout_ms=readiness_timeout_ms,
                stall_timeout_s=stall_timeout_s,
                inline_transport=inline_transport,
                name=link_name,
            )
            if async_plans
            else None
        )
        runners = {
            s.stage_id: StageRunner(
                s,
                backends[s.name],
                decisions[s.stage_id],
                arena=arena,
                link=link,
                deliver=deliver,
                downstream=downstream,
                on_failure=on_failure,
                inline_transport=inline_transport,
                acquire_timeout_s=acquire_timeout_s,
            )
            for s in stages
        }
    except BaseException:
        if owns_arena and arena is not None:
            arena.close()
        raise
    return BuiltStages(decisions, arena, link, runners, owns_arena)
