"""One Materialize stream: validate the opening, then materialize each step.

`StreamSession.materialize` is the per-step dispatch shared by the shipped
implementations:
  1) resolve every tensor of the snapshot: validate its handle, wait for the
     slot's readiness (with a deadline), view the bytes without copying;
  2) build the step's payloads (omni_common.materialize.build_step);
  3) re-check the slots' generations: a slot reused while we read is a
     stale read, refused;
  4) answer with the step (or a StepError: the stream stays open) and the
     slots released.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import grpc

from omni_common.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    OmniError,
    grpc_code_for,
)
from omni_common.materialize import StepView, build_step, validate_plan, view_from_snapshot
from omni_common.shm_arena import ArenaReader
from omni_common.tensor_wire import DTypeInfo, validate_ref
from omni_serving.v1 import materializer_pb2, snapshot_pb2, tensor_pb2

logger = logging.getLogger(__name__)

StepBuilder = Callable[[StepView, materializer_pb2.StagePlan], materializer_pb2.MaterializedStep]


class StreamSession:
    def __init__(
        self,
        open_msg: materializer_pb2.MaterializeStreamOpen,
        reader: ArenaReader,
        *,
        accept_shm: bool = True,
        default_readiness_timeout_ms: int = 5000,
    ) -> None:
        if open_msg.shm_prefix and open_msg.shm_prefix != reader.prefix:
            raise FailedPreconditionError(
                f"open.shm_prefix: stream is for deployment prefix {open_msg.shm_prefix!r}, "
                f"this materializer serves {reader.prefix!r}"
            )
        self.plans: dict[int, materializer_pb2.StagePlan] = {}
        for i, plan in enumerate(open_msg.stages):
            validate_plan(plan, f"open.stages[{i}]")
            self.plans[plan.stage_id] = plan
        self.reader = reader
        self.accept_shm = accept_shm
        self.timeout_s = (open_msg.readiness_timeout_ms or default_readiness_timeout_ms) / 1e3
        self.last_step: dict[int, int] = {}
        self.client_name = open_msg.client_name

    # -- helpers --------------------------------------------------------------
    def handles_of(self, snap: snapshot_pb2.StepSnapshot) -> list[tensor_pb2.ShmHandle]:
        refs = [snap.sampled_token_ids, snap.logprobs, snap.prompt_logprobs, snap.query_start_loc, snap.hidden_states]
        refs += [st.tensor for st in snap.multimodal_outputs]
        return [r.shm for r in refs if r.WhichOneof("data") == "shm"]

    def releases_of(self, snap: snapshot_pb2.StepSnapshot) -> list[materializer_pb2.SlotRelease]:
        seen = {}
        for h in self.handles_of(snap):
            seen.setdefault((h.region, h.slot, h.generation), None)
        return [materializer_pb2.SlotRelease(region=r, slot=s, generation=g) for r, s, g in seen]

    def _resolver(self, deadline: float):
        def resolve(ref: tensor_pb2.TensorRef, field: str) -> tuple[DTypeInfo, memoryview | bytes]:
            info, _, _ = validate_ref(ref, field)
            if ref.WhichOneof("data") == "inline_data":
                return info, ref.inline_data
            if not self.accept_shm:
                raise FailedPreconditionError(f"{field}.shm: this materializer reads inline tensors only")
            self.reader.wait_ready(ref.shm, deadline, f"{field}.shm")
            return info, self.reader.view(ref.shm, f"{field}.shm")

        return resolve

    # -- the per-step dispatch ------------------------------------------------------
    def prepare(self, snap: snapshot_pb2.StepSnapshot) -> tuple[StepView, materializer_pb2.StagePlan]:
        """Checks and 1) tensor resolution; raises OmniError for a bad step."""
        plan = self.plans.get(snap.stage_id)
        if plan is None:
            raise InvalidArgumentError("snapshot.stage_id", f"stage {snap.stage_id} was not declared when the stream opened")
        last = self.last_step.get(snap.stage_id)
        if last is not None and snap.step_id <= last:
            raise InvalidArgumentError("snapshot.step_id", f"{snap.step_id} is not after the previous step {last}")
        self.last_step[snap.stage_id] = snap.step_id
        needed = {r.source for r in plan.routes}
        view = view_from_snapshot(snap, self._resolver(time.monotonic() + self.timeout_s), needed)
        return view, plan

    def finish(self, snap: snapshot_pb2.StepSnapshot, built: materializer_pb2.MaterializedStep) -> materializer_pb2.MaterializeResponse:
        """3) stale check and 4) the answer with releases."""
        for h in self.handles_of(snap):
            self.reader.verify_unchanged(h, "snapshot.shm")
        built.released_slots.extend(self.releases_of(snap))
        return materializer_pb2.MaterializeResponse(step=built)

    def error(self, snap: snapshot_pb2.StepSnapshot, exc: BaseException) -> materializer_pb2.MaterializeResponse:
        code = grpc_code_for(exc)
        if code == grpc.StatusCode.INTERNAL:
            logger.exception("step %d failed", snap.step_id, exc_info=exc)
        return materializer_pb2.MaterializeResponse(
            error=materializer_pb2.StepError(
                step_id=snap.step_id,
                stage_id=snap.stage_id,
                code=code.value[0],
                message=str(exc),
                released_slots=self.releases_of(snap),
            )
        )

    def materialize(self, snap: snapshot_pb2.StepSnapshot, builder: StepBuilder = build_step) -> materializer_pb2.MaterializeResponse:
        """The whole dispatch for one step, errors in-band."""
        try:
            view, plan = self.prepare(snap)
            # 2) build
            built = builder(view, plan)
            return self.finish(snap, built)
        except OmniError as exc:
            return self.error(snap, exc)
