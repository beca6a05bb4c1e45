"""A backend's tap on its engine's scheduler: step alignment, steps in flight, held requests, preemptions,
tokens per step.

The step hook fires inside the runner, right after sampling; the engine's
``RequestOutput`` s (finish reasons, detokenized text) come from
``Scheduler.update_from_output`` for that step. With synchronous scheduling
both happen within the same ``engine.step()`` call. With async scheduling
(batch queue of 2) ``engine.step()`` runs step N and returns the outputs of
step N - 1 (the first call returns none). So the backend keys each capture
by its ``SchedulerOutput``, and :class:`SchedulerTap` records which
``SchedulerOutput`` each ``update_from_output`` processed (an instance
wrapper on the in-process scheduler): the backend's ``step()`` returns the
captured rows of the step whose outputs the engine just processed, together
with those outputs.

The tap also keeps the scheduled steps that carry tokens and are not
processed yet (``in_flight``), and holds requests whose next decode step
needs input that has not arrived (streamed input): ``schedule`` is wrapped
to take such requests out of ``scheduler.running`` for that call and put
them back afterwards, in their order (they keep their KV blocks; admission
of waiting requests counts them as running, so the batch never outgrows
``max_num_seqs``). When held requests fill the batch and nothing else could
run, it marks the stage ``stalled``: no step can make progress until input
arrives, a request is added or one is aborted.

Runs under the backend's engine lock (the scheduler is called from
``engine.step()``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from decoder_svc import metrics
from omni_common.errors import FailedPreconditionError


class SchedulerTap:
    """Wraps an in-process engine's scheduler (module docstring)."""

    def __init__(self, engine: Any, held: Callable[[Any], set[str]], stage: str = "") -> None:
        """held(scheduler): internal ids of the running requests to hold this step;
        stage: the label of its series (``omni_decoder_preemptions_total``,
        ``omni_decoder_step_tokens``)."""
        core = getattr(engine.engine_core, "engine_core", None)
        if core is None:  # pragma: no cover - make_engine is always in-process
            raise FailedPreconditionError("VLLMBackend needs an in-process engine core")
        sched = self.scheduler = core.scheduler
        self.updated: list[Any] = []  # SchedulerOutputs processed during the current engine.step()
        self.in_flight: dict[int, Any] = {}  # scheduled steps with tokens, not processed yet
        # the last schedule held requests and scheduled nothing: no step can make
        # progress until input arrives, a request is added or one is aborted
        self.stalled = False
        # requests the scheduler preempted (KV freed for others; recomputed when they resume)
        self.preemptions = 0
        preempted = metrics.PREEMPTIONS.labels(stage)
        step_tokens = metrics.STEP_TOKENS.labels(stage)
        orig = sched.update_from_output
        orig_schedule = sched.schedule
        updated = self.updated
        in_flight = self.in_flight

        def update_from_output(scheduler_output, model_runner_output):
            updated.append(scheduler_output)
            in_flight.pop(id(scheduler_output), None)
            return orig(scheduler_output, model_runner_output)

        def schedule(*args, **kwargs):
            hold = held(sched)
            if not hold:
                out = orig_schedule(*args, **kwargs)
            else:
                before = sched.running
                sched.running = [r for r in before if r.request_id not in hold]
                # held requests keep their runner slots: admit no more than fit
                caps = [c for c in ("max_num_running_reqs", "max_num_active_reqs") if hasattr(sched, c)]
                for c in caps:
                    setattr(sched, c, getattr(sched, c) - len(hold))
                try:
                    out = orig_schedule(*args, **kwargs)
                finally:
                    for c in caps:
                        setattr(sched, c, getattr(sched, c) + len(hold))
                    after = sched.running
                    kept = {id(r) for r in after}
                    known = {id(r) for r in before}
                    sched.running = [r for r in before if r.request_id in hold or id(r) in kept] + [
                        r for r in after if id(r) not in known
                    ]
            if out.preempted_req_ids:
                self.preemptions += len(out.preempted_req_ids)
                preempted.inc(len(out.preempted_req_ids))
            if out.total_num_scheduled_tokens > 0:
                in_flight[id(out)] = out
                step_tokens.observe(out.total_num_scheduled_tokens)
            # Held requests fill the batch (or keep KV blocks a waiting request
            # needs) and nothing else could run: sleep until the input changes.
            self.stalled = bool(hold) and out.total_num_scheduled_tokens == 0
            return out

        sched.update_from_output = update_from_output
        sched.schedule = schedule
