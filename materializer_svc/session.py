"""One Materialize stream: validate the opening, then materialize each step.

Two layers, shared by every shipped implementation:

* `materialize_step` is the stateless per-step dispatch. It needs only the
  snapshot, the stage's plan, an `ArenaReader` and a deadline, so a worker
  process can run it as well as a thread:
    1) resolve the tensors the plan reads: validate each handle, wait for the
       slot's readiness (until the deadline), view the bytes without copying;
    2) build the step's payloads (omni_common.materialize.build_step);
    3) re-check the generations of the slots that were read: a slot reused
       while we read is a stale read, refused;
    4) answer with the step, or with a StepError (the stream stays open),
       releasing every slot the snapshot names either way.
* `StreamSession` holds what a stream decided when it opened (stage plans,
  readiness timeout) and the ordering rules that need state (declared
  stages, strictly increasing step ids). `admit` applies them; it must be
  called in arrival order.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from omni_common.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    OmniError,
    grpc_code_for,
    log_internal,
)
from omni_common.materialize import (
    StepView,
    build_step,
    sources_of,
    validate_plan,
    view_from_snapshot,
)
from omni_common.shm_arena import ArenaReader
from omni_common.tensor_wire import DTypeInfo, validate_ref
from omni_serving.v1 import materializer_pb2, snapshot_pb2, tensor_pb2

logger = logging.getLogger(__name__)

StepBuilder = Callable[[StepView, materializer_pb2.StagePlan], materializer_pb2.MaterializedStep]


# --------------------------------------------------------------------------
# Counters (plain numbers; exporting them is the metrics layer's business)
# --------------------------------------------------------------------------


@dataclass
class MaterializerCounters:
    """What a materializer process did since it started.

    Updated from the servicer's event loop only (no lock needed); the first
    three are reported by GetMaterializerInfo, the rest by `as_dict`.
    `observers` are called with every answer and the seconds from the step's
    admission to its answer: the seam for exporting metrics.
    """

    active_streams: int = 0
    steps_materialized: int = 0
    steps_failed: int = 0
    streams_opened: int = 0
    streams_refused: int = 0
    streams_cancelled: int = 0
    payload_bytes: int = 0
    peak_in_flight: int = 0
    build_seconds_total: float = 0.0
    failed_by_code: collections.Counter[str] = field(default_factory=collections.Counter)
    observers: list[Callable[[materializer_pb2.MaterializeResponse, float], None]] = field(
        default_factory=list, repr=False
    )

    def record(self, resp: materializer_pb2.MaterializeResponse, seconds: float = 0.0) -> None:
        if resp.WhichOneof("kind") == "step":
            self.steps_materialized += 1
            self.payload_bytes += resp.step.ByteSize()
        else:
            self.steps_failed += 1
            self.failed_by_code[_code_name(resp.error.code)] += 1
        self.build_seconds_total += seconds
        for observe in self.observers:
            observe(resp, seconds)

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            k: v for k, v in vars(self).items() if k not in ("failed_by_code", "observers")
        }
        out["failed_by_code"] = dict(self.failed_by_code)
        return out


def _code_name(code: int) -> str:
    for c in grpc.StatusCode:
        if c.value[0] == code:
            return c.name
    return str(code)


# --------------------------------------------------------------------------
# The stateless per-step dispatch
# --------------------------------------------------------------------------


def handles_of(snap: snapshot_pb2.StepSnapshot) -> list[tensor_pb2.ShmHandle]:
    """Every shared-memory handle a snapshot carries, read by a route or not."""
    refs = [
        snap.sampled_token_ids,
        snap.logprobs,
        snap.prompt_logprobs,
        snap.query_start_loc,
        snap.hidden_states,
    ]
    refs += [st.tensor for st in snap.multimodal_outputs]
    return [r.shm for r in refs if r.WhichOneof("data") == "shm"]


def releases_of(snap: snapshot_pb2.StepSnapshot) -> list[materializer_pb2.SlotRelease]:
    """One release per distinct (region, slot, generation) the snapshot names,
    in first-appearance order. Sent in every answer, StepErrors included."""
    seen: dict[tuple[str, int, int], None] = {}
    for h in handles_of(snap):
        seen.setdefault((h.region, h.slot, h.generation), None)
    return [materializer_pb2.SlotRelease(region=r, slot=s, generation=g) for r, s, g in seen]


def error_response(
    snap: snapshot_pb2.StepSnapshot, exc: BaseException
) -> materializer_pb2.MaterializeResponse:
    """The in-band answer for a step that failed; logs a traceback only for INTERNAL.

    A bug (any exception not an `OmniError`: a ValueError of ours too) is
    INTERNAL with a message naming the error id its traceback is logged
    under, never the exception's text."""
    code = grpc_code_for(exc)
    what = f"step {snap.step_id} of stage {snap.stage_id}"
    if not isinstance(exc, OmniError):
        message = log_internal(logger, what, exc)
    else:
        if code == grpc.StatusCode.INTERNAL:
            logger.error("%s failed", what, exc_info=exc)
        message = str(exc) or type(exc).__name__
    return materializer_pb2.MaterializeResponse(
        error=materializer_pb2.StepError(
            step_id=snap.step_id,
            stage_id=snap.stage_id,
            code=code.value[0],
            message=message,
            released_slots=releases_of(snap),
        )
    )


def _resolver(
    reader: ArenaReader,
    deadline: float,
    accept_shm: bool,
    read: list[tuple[tensor_pb2.ShmHandle, str]],
) -> Callable[[tensor_pb2.TensorRef, str], tuple[DTypeInfo, memoryview | bytes]]:
    def resolve(ref: tensor_pb2.TensorRef, field: str) -> tuple[DTypeInfo, memoryview | bytes]:
        info, _, _ = validate_ref(ref, field)
        if ref.WhichOneof("data") == "inline_data":
            return info, ref.inline_data
        if not accept_shm:
            raise FailedPreconditionError(
                f"{field}.shm: this materializer reads inline tensors only"
            )
        shm_field = f"{field}.shm"
        reader.wait_ready(ref.shm, deadline, shm_field)
        read.append((ref.shm, shm_field))
        return info, reader.view(ref.shm, shm_field)

    return resolve


def materialize_step(
    snap: snapshot_pb2.StepSnapshot,
    plan: materializer_pb2.StagePlan,
    reader: ArenaReader,
    deadline: float,
    *,
    accept_shm: bool = True,
    builder: StepBuilder = build_step,
) -> materializer_pb2.MaterializeResponse:
    """Materialize one admitted step; never raises (errors are answered in-band).

    `deadline` is a time.monotonic() value bounding the readiness wait.
    """
    read: list[tuple[tensor_pb2.ShmHandle, str]] = []
    try:
        # 1) resolve (zero-copy views of shared memory or inline bytes)
        view = view_from_snapshot(
            snap, _resolver(reader, deadline, accept_shm, read), sources_of(plan)
        )
        # 2) build (the one builder every path uses)
        built = builder(view, plan)
        del view  # drop the views into shared memory before answering
        # 3) stale check: refuse what a reused slot may have overwritten
        for handle, field_name in read:
            reader.verify_unchanged(handle, field_name)
        # 4) answer, releasing every slot of the snapshot
        built.released_slots.extend(releases_of(snap))
        return materializer_pb2.MaterializeResponse(step=built)
    except OmniError as exc:
        return error_response(snap, exc)
    except Exception as exc:  # noqa: BLE001  a bug, not bad input: INTERNAL StepError, traceback logged
        return error_response(snap, exc)


# --------------------------------------------------------------------------
# Per-stream state
# --------------------------------------------------------------------------


def session_from_first(
    first: materializer_pb2.MaterializeRequest | None,
    reader: ArenaReader,
    *,
    default_readiness_timeout_ms: int = 5000,
) -> StreamSession:
    """Open a session from a stream's first message (raises OmniError to refuse it)."""
    if first is None:
        raise InvalidArgumentError("open", "stream closed before the open message")
    if first.WhichOneof("kind") != "open":
        raise InvalidArgumentError(
            "open", "the first message of a Materialize stream must be `open`"
        )
    return StreamSession(
        first.open, reader, default_readiness_timeout_ms=default_readiness_timeout_ms
    )


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
            if plan.stage_id in self.plans:
                raise InvalidArgumentError(
                    f"open.stages[{i}].stage_id", f"stage {plan.stage_id} is declared twice"
                )
            self.plans[plan.stage_id] = plan
        self.reader = reader
        self.accept_shm = accept_shm
        self.timeout_s = (open_msg.readiness_timeout_ms or default_readiness_timeout_ms) / 1e3
        self.last_step: dict[int, int] = {}
        self._admitted: dict[tuple[int, int], float] = {}
        self.client_name = open_msg.client_name

    # -- helpers (kept for callers of the earlier per-session API) -------------
    def handles_of(self, snap: snapshot_pb2.StepSnapshot) -> list[tensor_pb2.ShmHandle]:
        return handles_of(snap)

    def releases_of(self, snap: snapshot_pb2.StepSnapshot) -> list[materializer_pb2.SlotRelease]:
        return releases_of(snap)

    def error(
        self, snap: snapshot_pb2.StepSnapshot, exc: BaseException
    ) -> materializer_pb2.MaterializeResponse:
        return error_response(snap, exc)

    def deadline(self) -> float:
        """The readiness deadline of a step that starts now."""
        return time.monotonic() + self.timeout_s

    # -- ordering rules (call in arrival order) -------------------------------
    def admit(self, snap: snapshot_pb2.StepSnapshot) -> materializer_pb2.StagePlan:
        """The step's plan, after the checks that depend on earlier steps.

        Raises InvalidArgumentError for an undeclared stage or a step id that
        does not increase. A refused step does not move the stage's counter.
        """
        plan = self.plans.get(snap.stage_id)
        if plan is None:
            declared = sorted(self.plans)
            raise InvalidArgumentError(
                "snapshot.stage_id",
                f"stage {snap.stage_id} was not declared when the stream opened (declared: {declared})",
            )
        last = self.last_step.get(snap.stage_id)
        if last is not None and snap.step_id <= last:
            raise InvalidArgumentError(
                "snapshot.step_id",
                f"{snap.step_id} is not after the previous step {last} of stage {snap.stage_id}",
            )
        self.last_step[snap.stage_id] = snap.step_id
        self._admitted[(snap.stage_id, snap.step_id)] = time.perf_counter()
        return plan

    def took(self, resp: materializer_pb2.MaterializeResponse) -> float:
        """Seconds from the answered step's admission to now (0 if it was refused)."""
        body = resp.step if resp.WhichOneof("kind") == "step" else resp.error
        start = self._admitted.pop((body.stage_id, body.step_id), None)
        return 0.0 if start is None else time.perf_counter() - start

    # -- the whole dispatch, in the calling thread ------------------------------
    def materialize(
        self, snap: snapshot_pb2.StepSnapshot, builder: StepBuilder = build_step
    ) -> materializer_pb2.MaterializeResponse:
        """Admit and materialize one step; errors come back in-band."""
        try:
            plan = self.admit(snap)
        except OmniError as exc:
            return error_response(snap, exc)
        return materialize_step(
            snap, plan, self.reader, self.deadline(), accept_shm=self.accept_shm, builder=builder
        )
