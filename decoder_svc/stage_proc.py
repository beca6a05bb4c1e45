"""AR stages in their own processes: each stage's engine beside the others, not under one lock.

vLLM keeps its forward context in module globals, so engines that share a
process must take turns (``FORWARD_LOCK``): the thinker and the talker never
compute at the same time. Here each AR stage runs in a process of its own
(``multiprocessing`` "spawn", like vLLM's own engine-core process), with
everything its decode loop touches:

- the engine (``VLLMBackend``; the capture hook runs where the model runner
  runs);
- the decode loop (``pipeline.StageRunner``): step, one copy of the routed
  tensors into a slot of the stage's **own** arena (a segment under the
  deployment's prefix, which the materializer maps like any other), and the
  ``SnapshotMeta`` handed to the stage's **own** ``MaterializerLink``: the
  snapshot goes from the engine's process to the materializer directly, no
  tensor bytes on any socket;
- on the sync path (or the link's in-process fallback), the payloads built
  there.

The decoder process keeps what is not per-stage: the gRPC server, requests,
routing between stages, code2wav. What crosses between them, over two pipes
per stage:

- decoder -> stage: ``add`` / ``extend`` (a request, or the next chunk of its
  input: the thinker's rows the talker reads) and ``embed``, each answered
  (an engine's refusal comes back as the same error); ``abort`` and ``stop``
  are not;
- stage -> decoder: each materialized step (``MaterializedStep`` bytes: the
  payloads, already built, and the step's text deltas and finish reasons),
  step failures, and every ``STATUS_INTERVAL_S`` a status: steps, the link's
  state, the arena's, the step-time and step-gap observations (the
  decoder's metrics) and the stage's forward-pass intervals
  (``decoder_svc.busy``: the stage-overlap metric is computed from them).

A stage process that exits (SIGKILL included) fails only the requests that
were on that stage, its arena segment is swept, and it is started again
(waiting longer after each start that fails); requests given to it
meanwhile are refused with UNAVAILABLE. A stage process ends when its
decoder does (its command pipe closes).
"""

from __future__ import annotations

import collections
import itertools
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from decoder_svc import metrics
from decoder_svc.backend import RequestSpec
from decoder_svc.busy import BUSY
from decoder_svc.guards import evaluate, log_decision
from decoder_svc.profile import Profile, StageConfig
from decoder_svc.spawned import call_factory, pipe_sender
from omni_common import errors
from omni_common.errors import OmniError, UnavailableError
from omni_common.shm_arena import ShmArena, sweep_stale
from omni_serving.v1 import materializer_pb2

logger = logging.getLogger(__name__)

STATUS_INTERVAL_S = 0.2
"""How often a stage process reports its status (steps, link, arena, metrics)."""

# what a stage process tells about its engine (the pipeline reads these of a backend)
FACT_ATTRS = (
    "role", "max_model_len", "sampling_defaults", "model_name", "num_codebooks", "codec_vocab",
    "streams_input", "min_input_tokens", "hidden_size",
)


@dataclass(frozen=True)
class StageHostSpec:
    """What a stage process needs to build its stage (picklable)."""

    profile: Profile
    stage: str  # the stage's name in the profile
    engine: str = "vllm"  # "vllm" | "fake"
    model: str = ""  # checkpoint directory ("": the tiny one in the model cache)
    max_num_seqs: int = 64
    shm_prefix: str = "omni-default"
    arena_slots: int = 16
    arena_slot_bytes: int = 4 * 2**20
    materializer_target: str = ""
    inline_transport: bool = False
    in_process_builder: bool = False
    readiness_timeout_ms: int = 5000
    stall_timeout_s: float = 3.0
    acquire_timeout_s: float = 0.5
    torch_threads: int = 0  # intra-op threads (OMP_NUM_THREADS); 0: torch's default
    log_level: str = "INFO"
    # the fake engine: its backend's factory ("package.module:attr"; default the
    # fake engine's FakeBackend) and keyword arguments (tests and benchmarks)
    fake_factory: str = ""
    fake_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def config(self) -> StageConfig:
        return next(s for s in self.profile.ar_stages if s.name == self.stage)


_ENV_LOCK = threading.Lock()


def _start_with_threads(process, threads: int) -> None:
    """Start `process` with OMP_NUM_THREADS=threads in its environment (0:
    as ours). OpenMP reads it once, when torch loads: every thread of the
    process then agrees on the count (vLLM's CPU attention checks that the
    thread that plans a step and the one that runs it do)."""
    if threads <= 0 or os.environ.get("OMP_NUM_THREADS"):
        process.start()
        return
    with _ENV_LOCK:
        os.environ["OMP_NUM_THREADS"] = str(threads)
        try:
            process.start()
        finally:
            del os.environ["OMP_NUM_THREADS"]


# -- errors across the pipe -----------------------------------------------------------


def _error_of(exc: BaseException) -> tuple[str, str, str]:
    """(class name, field, message) of an OmniError, the class being the
    nearest one of ``omni_common.errors`` (the gRPC code is kept); other
    errors travel as an internal error (the stage process logs their
    traceback)."""
    if isinstance(exc, OmniError):
        kind = next(c.__name__ for c in type(exc).__mro__
                    if issubclass(c, OmniError) and getattr(errors, c.__name__, None) is c)
        field_ = getattr(exc, "field", "")
        msg = str(exc)
        if field_ and msg.startswith(f"{field_}: "):
            msg = msg[len(field_) + 2:]
        return kind, field_, msg
    return "OmniError", "", f"the stage could not take the request ({type(exc).__name__})"


def _rebuild_error(kind: str, field_: str, msg: str) -> OmniError:
    cls = getattr(errors, kind, OmniError)
    if not (isinstance(cls, type) and issubclass(cls, OmniError)):
        cls = OmniError
    if cls is errors.InvalidArgumentError:
        return cls(field_, msg)
    return cls(msg)


# -- the stage process ------------------------------------------------------------------


def _build_backend(spec: StageHostSpec):
    config = spec.config
    if spec.engine in ("fake", "reference"):
        kwargs = {"role": config.engine_role or config.name, "max_num_seqs": spec.max_num_seqs, **spec.fake_kwargs}
        return call_factory(spec.fake_factory or "decoder_svc.fake_engine:FakeBackend", kwargs, "fake_factory")
    from pathlib import Path

    from decoder_svc.qwen3_omni.cache import default_model_dir
    from decoder_svc.qwen3_omni.checkpoint import OmniCheckpoint
    from decoder_svc.qwen3_omni.engine import build_stage_backend

    checkpoint = OmniCheckpoint.open(Path(spec.model) if spec.model else default_model_dir())
    return build_stage_backend(checkpoint, config, max_num_seqs=min(spec.max_num_seqs, 64))


class _StageHost:
    """A stage's engine, decode loop, arena and materializer link, in this process."""

    def __init__(self, spec: StageHostSpec, send) -> None:
        from decoder_svc.materializer_link import MaterializerLink
        from decoder_svc.pipeline import StageRunner

        self.spec = spec
        self._send = send
        self.config = config = spec.config
        self._lock = threading.Lock()
        self._text_only: frozenset[str] = frozenset()
        self.arena: ShmArena | None = None
        self.link = None
        self.backend = _build_backend(spec)
        try:
            use_link = bool(spec.materializer_target) or spec.in_process_builder
            self.decision = evaluate(config, spec.profile, materializer_available=use_link,
                                     engine_facts=getattr(self.backend, "engine_facts", dict)())
            log_decision(config, self.decision)
            if self.decision.use_async:
                if not spec.inline_transport:
                    self.arena = ShmArena(spec.shm_prefix, spec.arena_slots, spec.arena_slot_bytes)
                self.link = MaterializerLink(
                    target=spec.materializer_target or None,
                    shm_prefix=spec.shm_prefix,
                    plans={config.stage_id: config.plan()},
                    arena=self.arena,
                    deliver=self._deliver,
                    fail_step=self._fail_step,
                    readiness_timeout_ms=spec.readiness_timeout_ms,
                    stall_timeout_s=spec.stall_timeout_s,
                    inline_transport=spec.inline_transport,
                    name=f"decoder-{config.name}",
                )
            self.runner = StageRunner(
                config, self.backend, self.decision, arena=self.arena, link=self.link,
                deliver=self._deliver, downstream=self._downstream, on_failure=self._failed,
                inline_transport=spec.inline_transport, acquire_timeout_s=spec.acquire_timeout_s,
            )
        except BaseException:
            self._close_parts()
            raise
        self.runner.observations = collections.deque(maxlen=100_000)
        self.runner.take_input = self._take_command

    def facts(self) -> dict[str, Any]:
        facts = {a: getattr(self.backend, a) for a in FACT_ATTRS if hasattr(self.backend, a)}
        facts["engine_facts"] = dict(getattr(self.backend, "engine_facts", dict)())
        return facts

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
        self._send(("step", msg.SerializeToString(), dict(meta.text_deltas),
                    {rid: list(ids) for rid, ids in meta.new_token_ids.items()}, finished))
        if finished:
            self._forget(finished)

    def _fail_step(self, meta, exc: BaseException) -> None:
        self._send(("fail", list(meta.request_ids), "building the outputs of a decode step failed; "
                                                    "the request was ended"))

    def _failed(self, exc: BaseException) -> None:
        self._send(("fail_all", "decode step failed; the request was ended"))

    # -- commands (the decoder's) ----------------------------------------------------------
    def command(self, op: str, call_id: int, args: tuple) -> None:
        """A request's command (add, extend, abort): applied by the decode
        loop between two steps (like vLLM's engine core: the loop takes its
        input between steps; a command never waits for the engine's lock
        while steps follow each other)."""
        self.runner.put_input((op, call_id, args))

    def _take_command(self, item: tuple) -> None:
        op, call_id, args = item
        if op == "abort":
            try:
                self.abort(*args)
            except Exception:  # noqa: BLE001 -- keep serving
                logger.exception("stage %s: abort failed", self.config.name)
        elif op == "add":
            self.answer(call_id, args[0].request_id, self.add, *args)
        elif op == "extend":
            self.answer(call_id, args[0], self.extend, *args)

    def answer(self, call_id: int, rid: str, fn, *args) -> None:
        """Run a command and answer it; a command that was not waited for
        (call id 0) that fails fails its request."""
        try:
            value = fn(*args)
        except BaseException as exc:  # noqa: BLE001 -- the decoder gets the error
            if not isinstance(exc, OmniError):
                logger.exception("stage %s: a command failed", self.config.name)
            error = _error_of(exc)
            self._send(("reply", call_id, False, error) if call_id else ("fail", [rid], "", error))
            return
        if call_id:
            try:
                self._send(("reply", call_id, True, value))
            except Exception as exc:  # noqa: BLE001 -- an answer that cannot be sent is an error
                logger.exception("stage %s: an answer could not be sent", self.config.name)
                self._send(("reply", call_id, False, _error_of(exc)))

    def refuse_pending(self) -> None:
        """Stopping: answer the commands still queued (their requests end)."""
        while self.runner.inbox:
            op, call_id, args = self.runner.inbox.popleft()
            if op in ("add", "extend"):
                error = ("UnavailableError", "", f"stage {self.config.name} is stopping")
                rid = args[0].request_id if op == "add" else args[0]
                self._send(("reply", call_id, False, error) if call_id else ("fail", [rid], "", error))

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

    def status(self) -> dict[str, Any]:
        runner, link, arena = self.runner, self.link, self.arena
        observations = []
        pending = runner.observations
        while pending:
            observations.append(pending.popleft())
        status: dict[str, Any] = {
            "steps": runner.steps,
            "observations": observations,
            "intervals": BUSY.take_intervals(),
            "connected": bool(link is not None and link.connected),
            "fallback_steps": link.fallback_steps if link is not None else 0,
            "in_flight": link.in_flight if link is not None else 0,
        }
        attachment = link.attachment if link is not None else None
        if attachment is not None:
            status["attachment"] = attachment.to_proto().SerializeToString()
        if arena is not None:
            status["arena"] = (arena.name, arena.slot_bytes, arena.num_slots, arena.in_use, arena.peak_in_use)
        return status

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
        host = _StageHost(spec, send)
        host.start()
    except BaseException as exc:  # noqa: BLE001 -- told to the decoder, which logs it
        logger.exception("stage %s could not start", spec.stage)
        send(("failed", f"{type(exc).__name__}: {exc}"[:2000]))
        return
    send(("ready", os.getpid(), host.facts()))
    stop = threading.Event()

    def report() -> None:
        while not stop.wait(STATUS_INTERVAL_S):
            try:
                status = host.status()
            except Exception:  # noqa: BLE001 -- next time
                logger.exception("stage %s: status failed", spec.stage)
                continue
            if not send(("status", status)):
                return

    reporter = threading.Thread(target=report, name="stage-status", daemon=True)
    reporter.start()

    try:
        while True:
            try:
                op, call_id, args = pickle.loads(commands.recv_bytes())
            except (EOFError, OSError):
                break  # the decoder is gone
            except Exception:  # noqa: BLE001 -- a command we cannot read: the others go on
                logger.exception("stage %s: unreadable command", spec.stage)
                continue
            if op == "stop":
                break
            if op in ("add", "extend", "abort"):
                host.command(op, call_id, args)
            elif op == "embed":  # a pooling pass: not on the command thread
                threading.Thread(target=host.answer, args=(call_id, "", host.backend.embed, *args),
                                 daemon=True).start()
            else:
                send(("reply", call_id, False, ("InvalidArgumentError", "op", f"unknown command {op!r}")))
    finally:
        host.stop()
        stop.set()
        reporter.join(1)
        try:
            send(("status", host.status()))
        except Exception:  # noqa: BLE001 -- the last status is a nicety
            pass
        events.close()


# -- the decoder side -----------------------------------------------------------------


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


class StageProcess:
    """One AR stage run by a process of its own, seen from the decoder.

    It stands in the pipeline for both the stage's backend (``add_request``,
    ``hand_over``, ``extend_request``, ``abort``, ``embed``, the engine's
    facts) and its runner (``start``, ``notify``, ``stop``, ``steps``, the
    step-time and gap series). ``attach`` connects it to the pipeline that
    routes its steps.

    Nothing here waits on the stage process but ``add_request`` and
    ``embed`` (their callers want the engine's answer): commands go through
    a writer thread, and the calls the routing makes (``hand_over``,
    ``extend_request``, ``abort``) do not wait for an answer, so one stage
    busy or restarting never holds up the routing of another's steps.
    """

    def __init__(self, spec: StageHostSpec, *, start_timeout_s: float = 600.0,
                 call_timeout_s: float = 120.0, embed_timeout_s: float = 900.0) -> None:
        self.spec = spec
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
        self._facts: dict[str, Any] = {}
        self._status: dict[str, Any] = {}
        self._stopping = False
        self._relaunching = False
        self._stop_event = threading.Event()
        self._ready = threading.Event()
        self._failed_start: str = ""
        self._proc: _Proc | None = None
        self.restarts = 0
        self._steps_before = 0  # steps and fallbacks of earlier processes of this stage
        self._fallbacks_before = 0
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
                    _start_with_threads(process, self.spec.torch_threads)
                finally:
                    cmd_child.close()
                    ev_child.close()
            except BaseException:
                for end in ends:
                    end.close()
                raise
            self._ready.clear()
            self._failed_start = ""
            self._status = {}
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
        proc.outbox.put(("stop", 0, ()))
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

    # -- the backend's interface ------------------------------------------------------
    def engine_facts(self) -> dict[str, Any]:
        return dict(self._facts.get("engine_facts", {}))

    def __getattr__(self, name: str) -> Any:
        # the engine's facts (role, max_model_len, ...), as its process reported them
        if name in FACT_ATTRS:
            facts = self.__dict__.get("_facts", {})
            if name in facts:
                return facts[name]
        raise AttributeError(name)

    def add_request(self, spec: RequestSpec) -> None:
        """Start a request and wait for the engine's answer (its refusal is
        raised here, as the engine raised it)."""
        with self._lock:
            self._live.add(spec.request_id)
        try:
            self._call("add", self.call_timeout_s, spec)
        except BaseException:
            self.abort(spec.request_id)  # (a refusal left nothing; a call that timed out may still run)
            raise

    def hand_over(self, spec: RequestSpec) -> None:
        """Start a request without waiting: the routing's hand-over from the
        previous stage. A refusal fails the request (`fail_requests`)."""
        self._check_ready()
        with self._lock:
            self._live.add(spec.request_id)
        self._post("add", 0, (spec,))

    def extend_request(self, request_id: str, rows, finished: bool = False) -> None:
        """The next chunk of a request's input, without waiting (a refusal
        fails the request)."""
        self._check_ready()
        self._post("extend", 0, (request_id, rows, finished))

    def abort(self, request_id: str) -> bool:
        """Abort the request in the stage process (sent even when this side
        no longer counts it as running there: a failure may have dropped it
        here while the engine still runs it); True when it was running."""
        with self._lock:
            live = request_id in self._live
            self._live.discard(request_id)
        self._post("abort", 0, (request_id,))
        return live

    def embed(self, spec: RequestSpec):
        return self._call("embed", self.embed_timeout_s, spec)

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._live)

    # -- status -----------------------------------------------------------------------
    @property
    def steps(self) -> int:
        return self._steps_before + int(self._status.get("steps", 0))

    @property
    def link_connected(self) -> bool:
        return bool(self._status.get("connected"))

    @property
    def fallback_steps(self) -> int:
        return self._fallbacks_before + int(self._status.get("fallback_steps", 0))

    @property
    def in_flight(self) -> int:
        return int(self._status.get("in_flight", 0))

    @property
    def attachment_proto(self) -> bytes | None:
        return self._status.get("attachment")

    @property
    def arena_info(self) -> tuple | None:
        return self._status.get("arena")

    # -- the pipes --------------------------------------------------------------------
    def _check_ready(self) -> None:
        if not self._ready.is_set():
            raise UnavailableError(f"stage {self.name} is restarting; try again")

    def _post(self, op: str, call_id: int, args: tuple) -> None:
        """Queue a command for the current process (dropped when there is none)."""
        proc = self._proc
        if proc is not None:
            proc.outbox.put((op, call_id, args))

    def _write_loop(self, proc: _Proc) -> None:
        while True:
            msg = proc.outbox.get()
            if msg is None:
                return
            try:
                data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:  # noqa: BLE001 -- that command fails, the others go on
                logger.exception("stage %s: a %r command cannot be sent", self.name, msg[0])
                op, call_id, args = msg
                if call_id:
                    self._answer(call_id, False, _error_of(exc))
                elif op in ("add", "extend"):  # not waited for: the request fails
                    rid = args[0].request_id if op == "add" else args[0]
                    self._fail([rid], _rebuild_error(*_error_of(exc)))
                continue
            try:
                proc.commands.send_bytes(data)
            except (OSError, ValueError):
                return  # the process is gone: the reader handles it

    def _call(self, op: str, timeout_s: float, *args) -> Any:
        self._check_ready()
        call_id = next(self._call_ids)
        call = _Call()
        with self._lock:
            self._calls[call_id] = call
        try:
            self._post(op, call_id, args)
            if not call.done.wait(timeout_s):
                raise UnavailableError(f"stage {self.name} did not answer within {timeout_s:g} s")
        finally:
            with self._lock:
                self._calls.pop(call_id, None)
        if call.ok:
            return call.value
        if isinstance(call.value, OmniError):
            raise call.value
        raise _rebuild_error(*call.value)

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
                logger.exception("stage %s: handling %r failed", self.name, msg[0])
        self._exited(proc)

    def _take(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "step":
            _, data, deltas, new_ids, finished = msg
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
        elif kind == "status":
            self._take_status(msg[1])
        elif kind == "reply":
            self._answer(msg[1], msg[2], msg[3])
        elif kind == "fail":  # (request ids, message[, the error of a command that was not waited for])
            error = _rebuild_error(*msg[3]) if len(msg) > 3 else OmniError(msg[2])
            self._fail(msg[1], error)
        elif kind == "fail_all":
            with self._lock:
                lost = list(self._live)
            self._fail(lost, OmniError(msg[1]))
        elif kind == "ready":
            _, pid, facts = msg
            self._facts = facts
            self._ready.set()
            logger.info("stage %s: engine ready (pid %d)", self.name, pid)
        elif kind == "failed":
            self._failed_start = msg[1]
            logger.error("stage %s could not start: %s", self.name, msg[1])

    def _take_status(self, status: dict[str, Any]) -> None:
        self._status = status
        for t_step, gap in status.get("observations", ()):
            self.step_times_s.append(t_step)
            self.gaps_s.append(gap)
            self._m_step.observe(t_step)
            self._m_gap.observe(gap)
            if self._m_steps is not None:
                self._m_steps.inc()
        for start, end in status.get("intervals", ()):
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
            self._steps_before += int(self._status.get("steps", 0))
            self._fallbacks_before += int(self._status.get("fallback_steps", 0))
            self._status = {}
            relaunch = was_ready and not stopping and not self._relaunching
            self._relaunching = self._relaunching or relaunch
        for call in calls:
            call.ok, call.value = False, UnavailableError(f"stage {self.name}'s engine process ended")
            call.done.set()
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
        self._fail(lost, UnavailableError(f"the engine process of stage {self.name} ended; the request was ended"))
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


def launch_stages(specs: list[StageHostSpec], *, start_timeout_s: float = 600.0) -> dict[str, StageProcess]:
    """Start one process per spec (the engines build side by side) and wait
    until all are ready; the first that cannot start stops the others, and
    its reason is raised (UnavailableError)."""
    stages: dict[str, StageProcess] = {}
    try:
        for spec in specs:
            stage = StageProcess(spec, start_timeout_s=start_timeout_s)
            stages[spec.stage] = stage
            stage.launch()
        deadline = time.monotonic() + start_timeout_s
        while not all(s.ready for s in stages.values()):
            for stage in stages.values():
                if not stage.ready:
                    stage.check_start(deadline, start_timeout_s)
            time.sleep(0.1)
    except BaseException:
        for stage in stages.values():
            stage.stop()
        raise
    return stages


def stage_specs(profile: Profile, **common: Any) -> list[StageHostSpec]:
    """One spec per AR stage of the profile.

    Each stage process keeps torch's default intra-op threads (every CPU):
    a stage whose partner is idle (the thinker done with its replies, the
    talker still speaking) gets the whole host; a fixed split would leave
    a core idle then."""
    return [StageHostSpec(profile=profile, stage=s.name, **common) for s in profile.ar_stages]
