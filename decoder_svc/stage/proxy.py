"""A stage process seen from the decoder (the parent side): ``StageProcess``.

vLLM keeps its forward context in module globals, so engines that share a
process must take turns (``FORWARD_LOCK``): the thinker and the talker never
compute at the same time. So each AR stage runs in a process of its own
(``multiprocessing`` "spawn", like vLLM's own engine-core process; the child
side is ``.host``), with its engine, decode loop, arena and materializer
link. The decoder process keeps what is not per-stage: the gRPC server,
requests, routing between stages, code2wav. Between them, two pipes per
stage carry the typed messages of ``.messages``.

A stage process that exits (SIGKILL included) fails only the requests that
were on that stage, its arena segment is swept, and it is started again
(waiting longer after each start that fails); requests given to it
meanwhile are refused with UNAVAILABLE. A stage process ends when its
decoder does (its command pipe closes).

Liveness: ``progress`` follows the decode loop's turn count that the
process reports in its ``Status`` (advanced by the loop itself, not by the
reporting thread); work waits while requests are on the stage and the loop
had work or has not applied every command sent to it. A watchdog
(``omni_common.liveness``, wired by ``.liveness``) that finds the stage stuck
calls ``kill_stuck``: the process is killed, its requests end with UNAVAILABLE
naming how long it made no progress, and it is started again as after a crash.

Metrics: the process's own series (its link's fallbacks and switches, ...)
come in its ``Status`` about once a second and go to a ``Forwarded`` store
(``omni_common.metrics_forward.FORWARDED`` by default) as the source
``stage:<name>``, labelled ``stage="<name>"``; the decoder's /metrics serves
them merged with its own. A process that ends is retired there: its counters
carry over to the next process of the stage.
"""

from __future__ import annotations

import collections
import itertools
import logging
import multiprocessing
import os
import pickle
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from decoder_svc import metrics
from decoder_svc.backend import RequestSpec
from decoder_svc.busy import BUSY
from decoder_svc.spawned import start_with_threads
from decoder_svc.stage.facts import ReportedFacts
from decoder_svc.stage.host import stage_main
from decoder_svc.stage.messages import (
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
from omni_common.errors import OmniError, UnavailableError
from omni_common.liveness import Progress, no_progress
from omni_common.metrics_forward import FORWARDED, Forwarded
from omni_common.shm_arena import sweep_stale
from omni_serving.v1 import materializer_pb2

logger = logging.getLogger(__name__)

@dataclass
class RemoteStepMeta:
    """What routing reads of a step that a stage process materialized."""

    request_ids: list[str]
    text_deltas: dict[str, str]
    new_token_ids: dict[str, list[int]]
    finished: dict[str, str]


class _Call:
    __slots__ = ("done", "ok", "value")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.ok = False
        self.value: Any = None


@dataclass(eq=False)
class _Proc:
    """One process of a stage (a restart makes a new one): the process, our
    ends of its pipes, the thread that writes its commands (in order; a
    caller never waits on the pipe) and the one that reads its events."""

    process: Any
    commands: Any
    events: Any
    outbox: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    writer: threading.Thread | None = None
    reader: threading.Thread | None = None
    posted: int = 0  # commands its decode loop applies (add, extend, abort), sent so far
    stalled: str = ""  # why it was killed for making no progress ("" when it was not)


class StageProcess(ReportedFacts):
    """One AR stage run by a process of its own, seen from the decoder.

    It stands in the pipeline for both the stage's backend (``add_request``,
    ``hand_over``, ``extend_request``, ``abort``, ``embed``, and the engine's
    facts: explicit properties over the ``StageFacts`` its process reported)
    and its runner (``start``, ``notify``, ``stop``, ``steps``, the
    step-time and gap series). ``attach`` connects it to the pipeline that
    routes its steps.

    Nothing here waits on the stage process but ``add_request`` and
    ``embed`` (their callers want the engine's answer): commands go through
    a writer thread, and the calls the routing makes (``hand_over``,
    ``extend_request``, ``abort``) do not wait for an answer, so one stage
    busy or restarting never holds up the routing of another's steps.
    """

    def __init__(self, spec: StageHostSpec, *, start_timeout_s: float = 600.0,
                 call_timeout_s: float = 120.0, embed_timeout_s: float = 900.0,
                 forwarded: Forwarded = FORWARDED) -> None:
        self.spec = spec
        self.forwarded = forwarded
        self.metrics_source = f"stage:{spec.stage}"
        self.config = spec.config
        self.name = spec.stage
        self.start_timeout_s = start_timeout_s
        self.call_timeout_s = call_timeout_s
        self.embed_timeout_s = embed_timeout_s
        self._ctx = multiprocessing.get_context("spawn")
        self._lock = threading.Lock()
        self._calls: dict[int, _Call] = {}
        self._call_ids = itertools.count(1)
        self._live: set[str] = set()  # requests on this stage (not finished, failed or aborted)
        self._facts: StageFacts | None = None  # from the process's Ready
        self._status = Status()
        self._stopping = False
        self._relaunching = False
        self._stop_event = threading.Event()
        self._ready = threading.Event()
        self._failed_start: str = ""
        self._proc: _Proc | None = None
        self.restarts = 0
        self._steps_before = 0  # steps, fallbacks and loop turns of earlier processes of this stage
        self._fallbacks_before = 0
        self._turns_before = 0
        self.progress = Progress(f"stage:{self.name}", self._has_work, not_ready=self._not_ready)
        # its materializer link's dispatch loop (in the process; counted there, reported in Status)
        self.link_progress = Progress(f"link:{self.name}", self._link_has_work)
        self._link_turns_before = 0
        self.gaps_s: collections.deque[float] = collections.deque(maxlen=100_000)
        self.step_times_s: collections.deque[float] = collections.deque(maxlen=100_000)
        # set by attach(): where steps and failures go
        self._deliver = None
        self._fail_requests = None
        self._m_gap = metrics.STEP_GAP.labels(self.name)
        self._m_step = metrics.STEP_TIME.labels(self.name)
        self._m_steps = None

    # -- lifecycle --------------------------------------------------------------------
    def launch(self) -> None:
        """Start a process (its engine builds there; `wait_ready` waits for
        it). Refused once the stage is stopping."""
        ends = []
        with self._lock:
            if self._stopping:
                raise UnavailableError(f"stage {self.name} is stopping")
            try:
                cmd_child, cmd_ours = self._ctx.Pipe(duplex=False)
                ends += [cmd_child, cmd_ours]
                ev_ours, ev_child = self._ctx.Pipe(duplex=False)
                ends += [ev_ours, ev_child]
                process = self._ctx.Process(target=stage_main, args=(self.spec, cmd_child, ev_child, os.getpid()),
                                            name=f"stage-{self.name}", daemon=True)
                try:
                    start_with_threads(process, self.spec.torch_threads, self.spec.omp_wait_policy)
                finally:
                    cmd_child.close()
                    ev_child.close()
            except BaseException:
                for end in ends:
                    end.close()
                raise
            self._ready.clear()
            self._failed_start = ""
            self._status = Status()
            proc = self._proc = _Proc(process, cmd_ours, ev_ours)
            proc.writer = threading.Thread(target=self._write_loop, args=(proc,), name=f"stage-{self.name}-write",
                                           daemon=True)
            proc.reader = threading.Thread(target=self._read_loop, args=(proc,), name=f"stage-{self.name}-read",
                                           daemon=True)
            proc.writer.start()
            proc.reader.start()
        logger.info("stage %s: engine process started (pid %d)", self.name, process.pid)

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Wait until the engine is built; raise UnavailableError with the
        stage's reason when it could not be."""
        timeout_s = self.start_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while not self._ready.wait(0.1):
            self.check_start(deadline, timeout_s)

    def check_start(self, deadline: float, timeout_s: float) -> None:
        """Raise UnavailableError when the start failed, its process ended,
        or the deadline passed; return while it may still become ready."""
        if self._failed_start:
            raise UnavailableError(f"stage {self.name} could not start: {self._failed_start}")
        proc = self._proc
        if proc is None or (not proc.process.is_alive() and not proc.reader.is_alive()):
            raise UnavailableError(f"stage {self.name}'s process ended while starting")
        if time.monotonic() > deadline:
            raise UnavailableError(f"stage {self.name} was not ready within {timeout_s:g} s")

    def attach(self, deliver, fail_requests, use_async: bool) -> StageProcess:
        """Route this stage's steps with `deliver(step, meta)` and its failures
        with `fail_requests(request_ids, error)`; the pipeline's runner."""
        self._deliver, self._fail_requests = deliver, fail_requests
        self._m_steps = metrics.STEPS.labels(self.name, "async" if use_async else "sync")
        return self

    def start(self) -> None:  # the runner's: the process runs already
        pass

    def notify(self) -> None:  # the process wakes its own loop on each command
        pass

    def stop(self) -> None:
        """Let the process stop its loop and deliver what its link holds
        (bounded), then end it; no restart after this."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            proc = self._proc
        self._stop_event.set()
        if proc is None:
            return
        proc.outbox.put(Stop())
        proc.outbox.put(None)  # the writer ends after it
        # the reader ends at the process's end (and reaps it): one thread waits on the process
        if proc.reader is not threading.current_thread():
            proc.reader.join(30)
            if proc.reader.is_alive():
                logger.warning("stage %s (pid %d) did not stop in time; killing it", self.name, proc.process.pid)
                proc.process.kill()
                proc.reader.join(10)
        if proc.writer is not None:
            proc.writer.join(5)
        self._close(proc)

    def close(self) -> None:  # the backend's: stop() did it
        self.stop()

    @property
    def process(self):
        proc = self._proc
        return proc.process if proc is not None else None

    @property
    def pid(self) -> int | None:
        p = self.process
        return p.pid if p is not None and p.is_alive() else None

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    # -- the backend's interface (the engine's facts: .facts.ReportedFacts) ----------
    def add_request(self, spec: RequestSpec) -> None:
        """Start a request and wait for the engine's answer (its refusal is
        raised here, as the engine raised it)."""
        with self._lock:
            self._live.add(spec.request_id)
        try:
            self._call(lambda call_id: Add(call_id, spec), self.call_timeout_s)
        except BaseException:
            self.abort(spec.request_id)  # (a refusal left nothing; a call that timed out may still run)
            raise

    def hand_over(self, spec: RequestSpec) -> None:
        """Start a request without waiting: the routing's hand-over from the
        previous stage. A refusal fails the request (`fail_requests`)."""
        self._check_ready()
        with self._lock:
            self._live.add(spec.request_id)
        self._post(Add(0, spec))

    def extend_request(self, request_id: str, rows, finished: bool = False) -> None:
        """The next chunk of a request's input, without waiting (a refusal
        fails the request)."""
        self._check_ready()
        self._post(Extend(0, request_id, rows, finished))

    def abort(self, request_id: str) -> bool:
        """Abort the request in the stage process (sent even when this side
        no longer counts it as running there: a failure may have dropped it
        here while the engine still runs it); True when it was running."""
        with self._lock:
            live = request_id in self._live
            self._live.discard(request_id)
        self._post(Abort(request_id))
        return live

    def embed(self, spec: RequestSpec):
        return self._call(lambda call_id: Embed(call_id, spec), self.embed_timeout_s)

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._live)

    # -- liveness ---------------------------------------------------------------------
    def _has_work(self) -> bool:
        """Work waits for the stage's decode loop: requests are on the stage,
        its process is ready, and its loop had work at its last report or
        has not applied every command sent to it since."""
        with self._lock:
            proc, status = self._proc, self._status
            if not self._live or proc is None or not self._ready.is_set():
                return False
            return bool(status.busy) or proc.posted > status.commands

    def _link_has_work(self) -> bool:
        """Steps wait for its link's dispatch loop (as its process last
        reported), and the process is ready."""
        with self._lock:
            return self._ready.is_set() and self._proc is not None and bool(self._status.link_busy)

    @property
    def restarting(self) -> bool:
        """Its process ended (a crash, a kill) and the next one is not ready yet."""
        return self._relaunching and not self._ready.is_set()

    def _not_ready(self) -> str:
        """The watchdog's question (``Progress.not_ready``): the decoder is not
        ready while a stage is being restarted."""
        return f"restarting (restart {self.restarts}; its engine process ended)" if self.restarting else ""

    def kill_stuck(self, seconds: float, limit_s: float, loop: str = "decode loop") -> None:
        """The watchdog's verdict on one of its loops (`loop`: its decode
        loop, or its materializer link's dispatch loop): no progress for
        `seconds`, over its limit. Kill the process; the reader fails its
        requests (naming the stall) and the stage restarts as after a crash."""
        with self._lock:
            proc = self._proc
            if proc is None or self._stopping or not self._ready.is_set():
                return
            what = "" if loop == "decode loop" else f"({loop}) "
            proc.stalled = what + no_progress(seconds, limit_s)
        logger.error("stage %s: %s %s; killing its engine process (pid %d)",
                     self.name, loop, no_progress(seconds, limit_s), proc.process.pid)
        proc.process.kill()

    # -- status -----------------------------------------------------------------------
    @property
    def steps(self) -> int:
        return self._steps_before + int(self._status.steps)

    @property
    def link_connected(self) -> bool:
        return bool(self._status.connected)

    @property
    def fallback_steps(self) -> int:
        return self._fallbacks_before + int(self._status.fallback_steps)

    @property
    def in_flight(self) -> int:
        return int(self._status.in_flight)

    @property
    def attachment_proto(self) -> bytes | None:
        return self._status.attachment

    @property
    def arena_info(self) -> tuple | None:
        return self._status.arena

    # -- the pipes --------------------------------------------------------------------
    def _check_ready(self) -> None:
        if not self._ready.is_set():
            raise UnavailableError(f"stage {self.name} is restarting; try again")

    def _post(self, msg: Add | Extend | Abort | Embed) -> None:
        """Queue a command for the current process (dropped when there is none)."""
        proc = self._proc
        if proc is not None:
            if isinstance(msg, Add | Extend | Abort):
                with self._lock:
                    proc.posted += 1
            proc.outbox.put(msg)

    def _write_loop(self, proc: _Proc) -> None:
        while True:
            msg = proc.outbox.get()
            if msg is None:
                return
            try:
                data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:  # noqa: BLE001 -- that command fails, the others go on
                logger.exception("stage %s: a %r command cannot be sent", self.name, type(msg).__name__)
                call_id = getattr(msg, "call_id", 0)
                if call_id:
                    self._answer(call_id, False, WireError.of(exc))
                elif isinstance(msg, Add | Extend):  # not waited for: the request fails
                    self._fail([msg.request_id], WireError.of(exc).rebuild())
                continue
            try:
                proc.commands.send_bytes(data)
            except (OSError, ValueError):
                return  # the process is gone: the reader handles it

    def _call(self, command: Callable[[int], Add | Embed], timeout_s: float) -> Any:
        """Send `command(call id)` and wait for its answer (a refusal is raised)."""
        self._check_ready()
        call_id = next(self._call_ids)
        call = _Call()
        with self._lock:
            self._calls[call_id] = call
        try:
            self._post(command(call_id))
            if not call.done.wait(timeout_s):
                raise UnavailableError(f"stage {self.name} did not answer within {timeout_s:g} s")
        finally:
            with self._lock:
                self._calls.pop(call_id, None)
        if call.ok:
            return call.value
        if isinstance(call.value, OmniError):
            raise call.value
        raise call.value.rebuild()

    def _answer(self, call_id: int, ok: bool, value: Any) -> None:
        with self._lock:
            call = self._calls.get(call_id)
        if call is not None:
            call.ok, call.value = ok, value
            call.done.set()

    def _read_loop(self, proc: _Proc) -> None:
        while True:
            try:
                msg = pickle.loads(proc.events.recv_bytes())
            except (EOFError, OSError):
                break
            except Exception:  # noqa: BLE001 -- a message we cannot read: the stage goes on
                logger.exception("stage %s: unreadable message", self.name)
                continue
            try:
                self._take(msg)
            except Exception:  # noqa: BLE001 -- the reader keeps serving
                logger.exception("stage %s: handling %r failed", self.name, type(msg).__name__)
        self._exited(proc)

    def _take(self, msg: Any) -> None:
        match msg:
            case Step(data=data, text_deltas=deltas, new_token_ids=new_ids, finished=finished):
                step = materializer_pb2.MaterializedStep.FromString(data)
                if finished:
                    with self._lock:
                        self._live.difference_update(finished)
                meta = RemoteStepMeta([r.request_id for r in step.requests], deltas, new_ids, finished)
                if self._deliver is None:
                    return
                try:
                    self._deliver(step, meta)
                except Exception:  # noqa: BLE001 -- its requests end; the stage goes on
                    metrics.INTERNAL_ERRORS.labels("stage").inc()
                    logger.exception("stage %s: routing a step failed; failing its requests", self.name)
                    self._fail(meta.request_ids, OmniError("routing the outputs of a decode step failed; "
                                                           "the request was ended"))
            case Status():
                self._take_status(msg)
            case Reply(call_id=call_id, value=value, error=None):
                self._answer(call_id, True, value)
            case Reply(call_id=call_id, error=error):
                self._answer(call_id, False, error)
            case Fail(request_ids=request_ids, message=message, error=error):
                # error: the refusal of a command that was not waited for
                self._fail(request_ids, error.rebuild() if error is not None else OmniError(message))
            case FailAll(message=message):
                with self._lock:
                    lost = list(self._live)
                self._fail(lost, OmniError(message))
            case Ready(pid=pid, facts=facts):
                self._facts = facts
                metrics.note_stage_threads(self.name, facts.engine_facts.get("engine_settings", {}))
                self._ready.set()
                logger.info("stage %s: engine ready (pid %d)", self.name, pid)
            case StartFailed(reason=reason):
                self._failed_start = reason
                logger.error("stage %s could not start: %s", self.name, reason)

    def _take_status(self, status: Status) -> None:
        with self._lock:
            self._status = status
        self.progress.set_count(self._turns_before + int(status.turns))
        if status.pace_s is not None:
            self.progress.pace_s = status.pace_s
        self.link_progress.set_count(self._link_turns_before + int(status.link_turns))
        if status.link_pace_s is not None:
            self.link_progress.pace_s = status.link_pace_s
        if status.metrics is not None:
            self.forwarded.update(self.metrics_source, {"stage": self.name}, status.metrics)
        for t_step, gap in status.observations:
            self.step_times_s.append(t_step)
            self.gaps_s.append(gap)
            self._m_step.observe(t_step)
            self._m_gap.observe(gap)
            if self._m_steps is not None:
                self._m_steps.inc()
        for start, end in status.intervals:
            BUSY.add_interval(self.name, start, end)

    def _fail(self, request_ids: list[str], error: OmniError) -> None:
        """End these requests (the pipeline ends them everywhere, and aborts
        them here, which reaches the stage process too)."""
        if self._fail_requests is not None and request_ids:
            self._fail_requests(list(request_ids), error)
        with self._lock:
            self._live.difference_update(request_ids)

    @staticmethod
    def _close(proc: _Proc) -> None:
        proc.outbox.put(None)
        if proc.writer is not None and proc.writer is not threading.current_thread():
            proc.writer.join(5)
        for end in (proc.commands, proc.events):
            try:
                end.close()
            except OSError:
                pass

    def _exited(self, proc: _Proc) -> None:
        """A process ended: answer its pending calls, fail its requests,
        sweep its arena, and (unless stopping) start the stage again."""
        process = proc.process
        process.join(5)
        if process.is_alive():  # its pipe closed, but it hangs: it must not hold its arena
            process.kill()
            process.join(5)
        self._close(proc)
        with self._lock:
            if proc is not self._proc:
                return  # not the current process (never the case today: a restart starts after this)
            calls = list(self._calls.values())
            lost = list(self._live)
            self._live.clear()
            stopping = self._stopping
            was_ready = self._ready.is_set()
            self._ready.clear()
            self._steps_before += int(self._status.steps)
            self._fallbacks_before += int(self._status.fallback_steps)
            self._turns_before += int(self._status.turns)
            self._link_turns_before += int(self._status.link_turns)
            self._status = Status()
            relaunch = was_ready and not stopping and not self._relaunching
            self._relaunching = self._relaunching or relaunch
        ended = (f"stage {self.name} {proc.stalled}; its engine process was restarted" if proc.stalled
                 else f"the engine process of stage {self.name} ended")
        for call in calls:
            call.ok, call.value = False, UnavailableError(ended)
            call.done.set()
        # its counters carry over to the next process; its gauges go
        self.forwarded.retire(self.metrics_source)
        # its arena segment: its owner is gone (the flock went with it)
        sweep_stale(self.spec.shm_prefix)
        if stopping:
            return
        code = process.exitcode
        how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        if not was_ready:  # it ended starting: whoever started it (wait_ready) sees that
            logger.error("stage %s: engine process (pid %d) ended while starting (%s)", self.name, process.pid, how)
            return
        metrics.INTERNAL_ERRORS.labels("stage").inc()
        logger.error("stage %s: engine process (pid %d) ended (%s); failing its %d request(s) and restarting it",
                     self.name, process.pid, how, len(lost))
        self._fail(lost, UnavailableError(f"{ended}; the request was ended"))
        if relaunch:
            threading.Thread(target=self._relaunch, name=f"stage-{self.name}-restart", daemon=True).start()

    def _relaunch(self) -> None:
        """Start the stage again until a start succeeds or the stage stops,
        waiting longer after each start that fails."""
        attempt = 0
        try:
            while not self._stop_event.is_set():
                self.restarts += 1
                metrics.STAGE_RESTARTS.labels(self.name).inc()
                try:
                    self.launch()
                    self.wait_ready()
                    logger.info("stage %s: restarted (pid %d)", self.name, self.process.pid)
                    return
                except Exception as exc:  # noqa: BLE001 -- retried, waiting longer each time
                    logger.error("stage %s could not be restarted (%s); retrying", self.name, exc)
                    proc = self._proc
                    if proc is not None and proc.process.is_alive():
                        proc.process.kill()
                attempt += 1
                if self._stop_event.wait(min(30.0, 0.5 * 2 ** min(attempt, 6))):
                    return
        finally:
            with self._lock:
                self._relaunching = False
