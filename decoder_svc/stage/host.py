"""A stage process (the child side): one AR stage's engine, decode loop, arena and link.

``stage_main`` is the target of a ``multiprocessing`` "spawn" process
(``.proxy`` starts it). It builds the stage's backend, then everything its
decode loop touches (``.assembly.build_stages``):

- the engine (the capture hook runs where the model runner runs);
- the decode loop (``.runner.StageRunner``): step, one copy of the routed
  tensors into a slot of the stage's **own** arena (a segment under the
  deployment's prefix, which the materializer maps like any other), and the
  ``SnapshotMeta`` handed to the stage's **own** ``MaterializerLink``: the
  snapshot goes from the engine's process to the materializer directly, no
  tensor bytes on any socket;
- on the sync path (or the link's in-process fallback), the payloads built
  here.

A reporter thread sends a ``Status`` every ``STATUS_INTERVAL_S``: with the
decode loop's liveness (its turn count, advanced by the loop itself, so the
count stops when the loop wedges while the reports go on) and, about once a
second, a snapshot of this process's metrics but the families the decoder
records itself (``PARENT_RECORDED``).

It reports ``Ready`` (or ``StartFailed``), then serves the decoder's
commands (``.messages``) until told to stop or until its command pipe closes
(the decoder is gone). Commands that change requests (add, extend, abort)
are applied by the decode loop between two steps (like vLLM's engine core:
a command never waits for the engine's lock while steps follow each other);
a pooling pass runs on a thread of its own. A command that was not waited
for (call id 0: the hand-over of a request from the previous stage, the
next chunk of its input) reports a failure as the failure of that request.
"""

from __future__ import annotations

import collections
import logging
import multiprocessing
import os
import pickle
import signal
import threading
import time
from typing import Any

from decoder_svc import busy, metrics
from decoder_svc.backend import RequestSpec
from decoder_svc.busy import BUSY
from decoder_svc.engine_settings import visible_devices
from decoder_svc.families import family_for
from decoder_svc.spawned import pipe_sender
from decoder_svc.stage.assembly import build_stages
from decoder_svc.stage.messages import (
    METRICS_EVERY,
    STATUS_INTERVAL_S,
    Abort,
    Add,
    Embed,
    Extend,
    Fail,
    FailAll,
    Ready,
    Reply,
    StageFacts,
    StageHostSpec,
    StartFailed,
    Status,
    Step,
    Stop,
    WireError,
)
from omni_common import metrics_forward
from omni_common.errors import InvalidArgumentError, OmniError, log_internal
from omni_common.fast_exit import exit_now
from omni_serving.v1 import materializer_pb2

logger = logging.getLogger(__name__)

PARENT_RECORDED = frozenset(m._name for m in (
    # the decoder records these from the status's observations and intervals
    metrics.STEP_GAP, metrics.STEP_TIME, metrics.STEPS, busy.FORWARD_SECONDS, busy.OVERLAP_SECONDS,
    # the decoder computes these over itself and every stage process
    metrics.ACTIVE_REQUESTS, metrics.MATERIALIZER_LAG, metrics.SLOTS_IN_USE,
    # the decoder's own parts (routing, code2wav): never set in a stage process
    metrics.REPETITION_STOPS, metrics.STAGE_RESTARTS,
))
"""Families a stage process does not forward (the decoder has them already)."""
PARENT_PREFIXES = ("omni_decoder_code2wav_",)
"""... nor families named so (code2wav runs in the decoder and its workers)."""


def metrics_snapshot() -> list:
    """This process's series that the decoder does not have already."""
    return [f for f in metrics_forward.snapshot(exclude=PARENT_RECORDED) if not f[0].startswith(PARENT_PREFIXES)]


def _build_backend(spec: StageHostSpec):
    """The stage's backend, from its model family (``decoder_svc.families``)."""
    return family_for(spec.engine, spec.model).load().build_stage_backend(spec)


class _StageHost:
    """A stage's engine, decode loop, arena and materializer link, in this process."""

    def __init__(self, spec: StageHostSpec, send) -> None:
        self.spec = spec
        self._send = send
        self.config = config = spec.config
        self._lock = threading.Lock()
        self._text_only: frozenset[str] = frozenset()
        self.arena = None
        self.link = None
        self.backend = _build_backend(spec)
        try:
            built = build_stages(
                spec.profile, [config], {config.name: self.backend},
                materializer_target=spec.materializer_target, in_process_builder=spec.in_process_builder,
                shm_prefix=spec.shm_prefix, own_arena=(spec.arena_slots, spec.arena_slot_bytes),
                deliver=self._deliver, fail_step=self._fail_step, downstream=self._downstream,
                on_failure=self._failed, inline_transport=spec.inline_transport,
                readiness_timeout_ms=spec.readiness_timeout_ms, stall_timeout_s=spec.stall_timeout_s,
                acquire_timeout_s=spec.acquire_timeout_s, link_name=f"decoder-{config.name}",
            )
        except BaseException:
            self._close_parts()
            raise
        self.decision = built.decisions[config.stage_id]
        self.arena, self.link = built.arena, built.link
        self.runner = built.runners[config.stage_id]
        self.runner.observations = collections.deque(maxlen=100_000)
        self.runner.take_input = self._take_command

    def facts(self) -> StageFacts:
        return StageFacts.of(self.backend)

    def start(self) -> None:
        if self.link is not None:
            self.link.start()
        self.runner.start()

    # -- the runner's callbacks (this process) ------------------------------------------
    def _downstream(self, request_ids: list[str]) -> list[str]:
        text_only = self._text_only
        if not text_only:
            return request_ids
        return [rid for rid in request_ids if rid not in text_only]

    def _forget(self, request_ids) -> None:
        if self._text_only:
            with self._lock:
                self._text_only = self._text_only - set(request_ids)

    def _deliver(self, step, meta) -> None:
        """A materialized step (from the materializer, or built here) goes to
        the decoder, as bytes, with what routing reads of the step."""
        msg = step if isinstance(step, materializer_pb2.MaterializedStep) else step.to_proto()
        finished = dict(meta.finished)
        self._send(Step(msg.SerializeToString(), dict(meta.text_deltas),
                        {rid: list(ids) for rid, ids in meta.new_token_ids.items()}, finished))
        if finished:
            self._forget(finished)

    def _fail_step(self, meta, exc: BaseException) -> None:
        self._send(Fail(list(meta.request_ids), "building the outputs of a decode step failed; "
                                                "the request was ended"))

    def _failed(self, exc: BaseException) -> None:
        self._send(FailAll("decode step failed; the request was ended"))

    # -- commands (the decoder's) ----------------------------------------------------------
    def command(self, msg: Add | Extend | Abort) -> None:
        """A request's command (add, extend, abort): applied by the decode
        loop between two steps (like vLLM's engine core: the loop takes its
        input between steps; a command never waits for the engine's lock
        while steps follow each other)."""
        self.runner.put_input(msg)

    def _take_command(self, msg: Add | Extend | Abort) -> None:
        match msg:
            case Abort(request_id=rid):
                try:
                    self.abort(rid)
                except Exception:  # noqa: BLE001 -- keep serving
                    logger.exception("stage %s: abort failed", self.config.name)
            case Add(call_id=call_id, spec=spec):
                self.answer(call_id, spec.request_id, self.add, spec)
            case Extend(call_id=call_id, request_id=rid, rows=rows, finished=finished):
                self.answer(call_id, rid, self.extend, rid, rows, finished)

    def answer(self, call_id: int, rid: str, fn, *args) -> None:
        """Run a command and answer it; a command that was not waited for
        (call id 0) that fails fails its request."""
        try:
            value = fn(*args)
        except BaseException as exc:  # noqa: BLE001 -- the decoder gets the error
            internal = "" if isinstance(exc, OmniError) else log_internal(
                logger, f"stage {self.config.name}: a command", exc)
            error = WireError.of(exc, internal)
            self._send(Reply(call_id, error=error) if call_id else Fail([rid], "", error))
            return
        if call_id:
            try:
                self._send(Reply(call_id, value))
            except Exception as exc:  # noqa: BLE001 -- an answer that cannot be sent is an error
                internal = log_internal(logger, f"stage {self.config.name}: sending an answer", exc)
                self._send(Reply(call_id, error=WireError.of(exc, internal)))

    def refuse_pending(self) -> None:
        """Stopping: answer the commands still queued (their requests end)."""
        while self.runner.inbox:
            msg = self.runner.inbox.popleft()
            if isinstance(msg, Add | Extend):
                error = WireError("UnavailableError", "", f"stage {self.config.name} is stopping")
                self._send(Reply(msg.call_id, error=error) if msg.call_id
                           else Fail([msg.request_id], "", error))

    def add(self, spec: RequestSpec) -> None:
        if not spec.modality.has_multimodal:
            with self._lock:
                self._text_only = self._text_only | {spec.request_id}
        try:
            self.backend.add_request(spec)
        except BaseException:
            self._forget([spec.request_id])
            raise

    def extend(self, request_id: str, rows, finished: bool) -> None:
        self.backend.extend_request(request_id, rows, finished)

    def abort(self, request_id: str) -> None:
        self.backend.abort(request_id)
        self._forget([request_id])

    def status(self, with_metrics: bool = False) -> Status:
        """The stage's status; `with_metrics`: with a snapshot of this
        process's metrics (the families the decoder does not record itself)."""
        runner, link, arena = self.runner, self.link, self.arena
        observations = []
        pending = runner.observations
        while pending:
            observations.append(pending.popleft())
        attachment = link.attachment if link is not None else None
        return Status(
            steps=runner.steps,
            observations=observations,
            intervals=BUSY.take_intervals(),
            connected=bool(link is not None and link.connected),
            fallback_steps=link.fallback_steps if link is not None else 0,
            in_flight=link.in_flight if link is not None else 0,
            attachment=attachment.to_proto().SerializeToString() if attachment is not None else None,
            arena=((arena.name, arena.slot_bytes, arena.num_slots, arena.in_use, arena.peak_in_use)
                   if arena is not None else None),
            turns=runner.progress.count,
            busy=runner.has_work(),
            pace_s=runner.progress.pace_s,
            commands=runner.commands_taken,
            link_turns=link.progress.count if link is not None else 0,
            link_busy=bool(link is not None and link.progress.has_work()),
            link_pace_s=link.progress.pace_s if link is not None else None,
            metrics=metrics_snapshot() if with_metrics else None,
        )

    def stop(self) -> None:
        """Stop the loop, deliver what the link holds, close the engine."""
        self.runner.stop()
        self.refuse_pending()
        self._close_parts()

    def _close_parts(self) -> None:
        for close in (getattr(self.link, "close", None), getattr(self.backend, "close", None),
                      getattr(self.arena, "close", None)):
            if close is None:
                continue
            try:
                close()
            except Exception:  # noqa: BLE001 -- close the others
                logger.exception("stage %s: closing failed", self.config.name)


def _set_title(spec: StageHostSpec) -> None:
    """Name the process in `ps`. Within the length of the original command
    line only (SPT_NOENV): its environment stays readable in
    /proc/<pid>/environ, where the deployment's marker is looked for."""
    os.environ["SPT_NOENV"] = "1"
    try:
        import setproctitle

        setproctitle.setproctitle(f"omni-serving decoder stage {spec.stage} ({spec.shm_prefix})")
    except Exception:  # noqa: BLE001 -- a title is a nicety
        pass


def _place(spec: StageHostSpec) -> None:
    """A stage on ``cuda:N`` sees that device only (set before vLLM loads;
    decoder_svc.engine_settings.visible_devices)."""
    device = spec.config.engine.device
    try:
        visible = visible_devices(device)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"engine.{spec.stage}.device", str(exc)) from exc
    if visible is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
        logger.info("stage %s: %s is CUDA device %s here (CUDA_VISIBLE_DEVICES)", spec.stage, device, visible)


def _watch_parent(parent: int) -> None:
    """End this process when the decoder is gone, even while the engine is
    still being built (the command pipe is read only once it is ready)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(1)


def stage_main(spec: StageHostSpec, commands, events, parent: int) -> None:
    """A stage process: build the stage, report ready (or why not), then
    serve the decoder's commands until told to stop or its pipe closes.

    Commands sent without waiting for the answer (call id 0: the hand-over
    of a request from the previous stage, the next chunk of its input)
    report a failure as the failure of that request."""
    from omni_common.logging_setup import setup_logging

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the decoder decides when we stop
    threading.Thread(target=_watch_parent, args=(parent,), name="stage-parent", daemon=True).start()
    # Started as a daemon (it never outlives the decoder), it may still start
    # processes of its own: vLLM's workers of a tensor-parallel engine.
    multiprocessing.current_process().daemon = False
    setup_logging(spec.log_level, service=f"decoder-{spec.stage}")
    _set_title(spec)
    send = pipe_sender(events, as_bytes=True)
    BUSY.record_intervals(True)
    try:
        _place(spec)
        host = _StageHost(spec, send)
        host.start()
    except BaseException as exc:  # noqa: BLE001 -- told to the decoder, which logs it
        logger.exception("stage %s could not start", spec.stage)
        send(StartFailed(f"{type(exc).__name__}: {exc}"[:2000]))
        return
    send(Ready(os.getpid(), host.facts()))
    stop = threading.Event()

    def report() -> None:
        reports = 0
        while not stop.wait(STATUS_INTERVAL_S):
            reports += 1
            try:
                status = host.status(with_metrics=reports % METRICS_EVERY == 0)
            except Exception:  # noqa: BLE001 -- next time
                logger.exception("stage %s: status failed", spec.stage)
                continue
            if not send(status):
                return

    reporter = threading.Thread(target=report, name="stage-status", daemon=True)
    reporter.start()

    try:
        while True:
            try:
                msg: Any = pickle.loads(commands.recv_bytes())
            except (EOFError, OSError):
                break  # the decoder is gone
            except Exception:  # noqa: BLE001 -- a command we cannot read: the others go on
                logger.exception("stage %s: unreadable command", spec.stage)
                continue
            match msg:
                case Stop():
                    break
                case Add() | Extend() | Abort():
                    host.command(msg)
                case Embed(call_id=call_id, spec=request):  # a pooling pass: not on the command thread
                    threading.Thread(target=host.answer, args=(call_id, "", host.backend.embed, request),
                                     daemon=True).start()
                case _:
                    send(Reply(getattr(msg, "call_id", 0),
                               error=WireError("InvalidArgumentError", "op",
                                               f"unknown command {type(msg).__name__!r}")))
    finally:
        host.stop()
        stop.set()
        reporter.join(1)
        try:
            send(host.status(with_metrics=True))
        except Exception:  # noqa: BLE001 -- the last status is a nicety
            pass
        events.close()
    # stopped in order above: the interpreter's own exit only costs time (omni_common.fast_exit)
    exit_now(0)
