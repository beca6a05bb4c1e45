"""The stage pipeline: AR stage runners, routing of materialized steps, code2wav.

Threads:
  - one runner per AR stage: the decode loop (critical path);
  - the materializer link's dispatcher/receiver (or in-process builder);
  - code2wav (generation stage): one thread, or worker processes
    (decoder_svc.code2wav.pool) with one result reader thread each.
Request outputs go to per-request sinks (the gRPC Generate streams).

No thread dies of an exception: a failure ends the affected requests with an
error (a short message, no internals: the log has the traceback), frees
their arena slots, and the thread goes on serving. A decode step never waits
for an arena slot longer than `acquire_timeout_s`: without one the step is
built in-process.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from decoder_svc import metrics
from decoder_svc.backend import ARBackend, RequestSpec, StepOutput
from decoder_svc.code2wav.core import VocoderSpec
from decoder_svc.code2wav.pool import Code2WavProcessPool
from decoder_svc.code2wav.thread import Code2WavWorker
from decoder_svc.cuda_staging import CudaStaging
from decoder_svc.guards import GuardDecision, evaluate, log_decision
from decoder_svc.lengths import (
    LENGTH,
    REPETITION,
    STOP,
    DeploymentSettings,
    Options,
    RepetitionGuard,
    check_request,
    deployment_modalities,
    facts_of,
)
from decoder_svc.materializer_link import MaterializerLink
from decoder_svc.profile import Profile, StageConfig
from decoder_svc.snapshot import SnapshotMeta, meta_of, step_tensors, take_snapshot
from decoder_svc.stage_proc import StageProcess
from omni_common.errors import (
    AlreadyExistsError,
    InvalidArgumentError,
    OmniError,
    ResourceExhaustedError,
)
from omni_common.materialize import (
    LocalStep,
    build_local_step,
    client_payload,
    payload_tensors,
    sources_of,
)
from omni_common.modality import OutputModality
from omni_common.shm_arena import ShmArena, SlotLease
from omni_common.tensor_wire import encode_inline
from omni_serving.v1 import common_pb2, decoder_pb2, materializer_pb2, payload_pb2

logger = logging.getLogger(__name__)

Sink = Callable[[decoder_pb2.GenerateResponse | OmniError], None]
"""Receives a request's outputs; an OmniError instead ends the request with that error."""


@dataclass
class RequestContext:
    spec: RequestSpec
    sink: Sink
    arrival_s: float = field(default_factory=time.perf_counter)
    first_audio_s: float | None = None
    audio_samples: int = 0
    steps: int = 0
    done: bool = False
    # inter-stage payload pieces collected for the next AR stage, by key
    handoff: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    # the audio stage's token cap (codec frames), from max_audio_seconds
    audio_frames: int = 0
    # how an earlier AR stage (the thinker) ended: "length" when its text was cut
    upstream_reason: str = ""
    # set when the pipeline ends the request itself (the runaway guard): later
    # steps of it are dropped while code2wav flushes what it has
    ending: str = ""
    guard: RepetitionGuard | None = None
    # streamed input (the next AR stage starts from the upstream's first
    # chunk): upstream tokens delivered so far, handovers made (0: not started)
    upstream_tokens: int = 0
    handovers: int = 0
    # the upstream AR stage still produces while the next one already runs
    # (streamed input): the request completes only after both are done
    upstream_open: bool = False
    # the audio ended while upstream_open: its finish reason, until the upstream ends
    audio_reason: str = ""
    # frames of its first audio chunk, chosen when its first frames reach code2wav
    first_chunk_frames: int = 0

    sample_rate: int = 24_000

    def metrics(self) -> common_pb2.RequestMetrics:
        now = time.perf_counter()
        audio_s = self.audio_samples / self.sample_rate
        return common_pb2.RequestMetrics(
            ttfp_ms=(self.first_audio_s - self.arrival_s) * 1e3 if self.first_audio_s else 0.0,
            rtf=(now - self.arrival_s) / audio_s if audio_s else 0.0,
            num_steps=self.steps,
            audio_seconds=audio_s,
            elapsed_ms=(now - self.arrival_s) * 1e3,
            first_chunk_frames=self.first_chunk_frames,
        )


class _LeaseWatch:
    """The arena as `take_snapshot` uses it, remembering the slot it handed
    out (a snapshot that fails half-way must not keep its slot) and how long
    the step waited for it (the link judges the materializer by that)."""

    def __init__(self, arena: ShmArena) -> None:
        self.arena = arena
        self.slot_bytes = arena.slot_bytes
        self.lease: SlotLease | None = None
        self.waited_s = 0.0

    def acquire(self, timeout: float | None) -> SlotLease:
        t0 = time.perf_counter()
        try:
            self.lease = self.arena.acquire(timeout)
        finally:
            self.waited_s = time.perf_counter() - t0
        return self.lease

    def release(self, slot: int, generation: int) -> bool:
        return self.arena.release(slot, generation)


class StageRunner:
    """The decode loop of one AR stage.

    Per step (the critical path):
      1) forward + sample + eager postprocess (the backend's `step`);
      2) async path: copy the routed tensors into a free arena slot and hand
         a SnapshotMeta to the link (a queue put) -- sync path: slice the
         payloads here (tensors, `build_local_step`) and deliver them;
      3) loop: the next step launches at once.

    Step 2 waits at most `acquire_timeout_s` for a free slot (all held: the
    materializer lags); then, and for the following steps until a slot is
    free again, the step's tensors are copied out and the link builds it
    in-process, after the steps before it.
    """

    def __init__(
        self,
        config: StageConfig,
        backend: ARBackend,
        decision: GuardDecision,
        *,
        arena: ShmArena | None,
        link: MaterializerLink | None,
        deliver: Callable[[materializer_pb2.MaterializedStep | LocalStep, SnapshotMeta], None],
        downstream: Callable[[list[str]], list[str]],
        on_failure: Callable[[BaseException], None],
        inline_transport: bool = False,
        acquire_timeout_s: float = 0.5,
    ) -> None:
        self.config = config
        self.acquire_timeout_s = acquire_timeout_s
        self._starved = False  # the last step found no slot: do not wait for one
        self.on_failure = on_failure
        self.backend = backend
        self.decision = decision
        self.arena = arena
        self.link = link
        self.deliver = deliver
        self.downstream = downstream
        self.inline_transport = inline_transport
        self.plan = config.plan()
        self.sources = sources_of(self.plan)
        self.steps = 0
        # (step time, gap) of each step, for a consumer that drains it (a stage process's status)
        self.observations: collections.deque[tuple[float, float]] | None = None
        # commands the loop applies between steps with `take_input` (a stage
        # process's adds, extends and aborts; `put_input` queues one)
        self.inbox: collections.deque = collections.deque()
        self.take_input: Callable[[Any], None] = lambda item: None
        self.gaps_s: collections.deque[float] = collections.deque(maxlen=100_000)
        self.step_times_s: collections.deque[float] = collections.deque(maxlen=100_000)
        self._wake = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name=f"stage-{config.name}", daemon=True)
        self._step_ids = itertools.count(1)
        self._staging: CudaStaging | None = None  # created at the first CUDA step
        self._leases = _LeaseWatch(arena) if arena is not None else None
        self._m_gap = metrics.STEP_GAP.labels(config.name)
        self._m_step = metrics.STEP_TIME.labels(config.name)
        self._m_steps = metrics.STEPS.labels(config.name, "async" if decision.use_async else "sync")

    def start(self) -> None:
        self._thread.start()

    def notify(self) -> None:
        with self._wake:
            self._wake.notify()

    def put_input(self, item: Any) -> None:
        """Queue a command for the loop to apply before its next step."""
        self.inbox.append(item)
        self.notify()

    def stop(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join(timeout=30)
        if self._staging is not None:
            self._staging.close()

    def _loop(self) -> None:
        inbox = self.inbox
        while True:
            try:
                with self._wake:
                    self._wake.wait_for(lambda: self._stop or bool(inbox) or self.backend.has_unfinished())
                    if self._stop:
                        return
                # requests' commands, between two steps, on this thread: none
                # of them waits for the engine while steps follow each other
                if inbox:
                    while inbox:
                        self.take_input(inbox.popleft())
                    if not self.backend.has_unfinished():
                        continue
            except Exception as exc:  # noqa: BLE001 -- the stage keeps serving
                self._failed(exc)
                time.sleep(0.05)  # a backend that keeps failing must not spin
                continue
            t0 = time.perf_counter()
            try:
                # 1) forward + sample + eager postprocess
                out = self.backend.step()
                t_sampled = time.perf_counter()
                if out is None:
                    continue
                self.steps += 1
                # 2) hand the step's outputs off (or build them, on the sync path)
                self._emit(out)
            except Exception as exc:  # noqa: BLE001 -- nothing partial goes out: the requests in flight fail loudly, the stage keeps serving
                self._failed(exc)
                continue
            t_launch = time.perf_counter()
            self.step_times_s.append(t_sampled - t0)
            self.gaps_s.append(t_launch - t_sampled)
            if self.observations is not None:
                self.observations.append((t_sampled - t0, t_launch - t_sampled))
            self._m_gap.observe(t_launch - t_sampled)
            self._m_step.observe(t_sampled - t0)
            self._m_steps.inc()

    def _failed(self, exc: BaseException) -> None:
        metrics.INTERNAL_ERRORS.labels("stage").inc()
        logger.error("stage %s: decode step failed; failing the requests in flight",
                     self.config.name, exc_info=exc)
        try:
            self.on_failure(exc)
        except Exception:  # noqa: BLE001 -- the stage keeps serving
            logger.exception("stage %s: failing the requests in flight failed", self.config.name)

    def _emit(self, out: StepOutput) -> None:
        meta = meta_of(
            out,
            step_id=next(self._step_ids),
            stage_id=self.config.stage_id,
            downstream_request_ids=self.downstream(out.request_ids),
            connector_signals=[],
        )
        tensors = step_tensors(out, self.sources)
        if self.decision.use_async and self.link is not None:
            arena = None if self.inline_transport else self.arena
            if arena is None or self._leases is None:
                self.link.submit(take_snapshot(meta, tensors, None))
                return
            if self._staging is None and any(t.is_cuda for t, _ in tensors.values()):
                device = next(t.device for t, _ in tensors.values() if t.is_cuda)
                self._staging = CudaStaging(arena, device)
            leases = self._leases
            leases.lease = None
            leases.waited_s = 0.0
            timeout = 0.0 if self._starved else self.acquire_timeout_s
            try:
                snap = take_snapshot(meta, tensors, leases, timeout, staging=self._staging)
            except ResourceExhaustedError:
                self.link.note_slot_wait(leases.waited_s)
                # No slot within the bound (or the step outgrew it): copy the
                # tensors out; the link builds the step in-process, in order.
                self._starved = self._starved or leases.lease is None
                meta.handles = {}
                self.link.submit(take_snapshot(meta, tensors, None), build_local=True)
                return
            except BaseException:
                if leases.lease is not None and meta.lease is None:
                    arena.release(leases.lease.slot, leases.lease.generation)
                raise
            if leases.lease is not None:
                self._starved = False
            if leases.waited_s > 1e-3:
                self.link.note_slot_wait(leases.waited_s)
            self.link.submit(snap)
            return
        # synchronous path: slice here, from the step's own tensors, and route
        # the slices as they are (no serialisation; the router copies what it
        # keeps). Device tensors (CUDA hosts) come to the host first: the
        # slicing reads values. A host tensor's .cpu() is itself.
        host = {name: (t.cpu(), layout) for name, (t, layout) in tensors.items()}
        self.deliver(build_local_step(meta.view_over(host), self.plan), meta)


class Pipeline:
    """Runs a profile: AR stages in order, then code2wav; routes outputs to
    request sinks. Every AR stage decides its output path with the guards."""

    def __init__(
        self,
        profile: Profile,
        backends: dict[str, ARBackend],
        *,
        materializer_target: str | None,
        shm_prefix: str,
        arena: ShmArena | None,
        inline_transport: bool = False,
        in_process_builder: bool = False,
        readiness_timeout_ms: int = 5000,
        stall_timeout_s: float = 3.0,
        acquire_timeout_s: float = 0.5,
        vocoder=None,
        prepare: Callable[[RequestSpec], RequestSpec] | None = None,
        settings: DeploymentSettings | None = None,
        options: Options | None = None,
        code2wav_workers: int = 0,
        vocoder_spec: VocoderSpec | None = None,
    ) -> None:
        """vocoder: the generation stage's streaming vocoder (``new_stream``,
        ``voices``, ``sample_rate``, ``num_codebooks``, ``codebook_size``);
        default: the fake engine's vocoder (a test double). prepare: turns a request into what
        the first stage takes (e.g. a chat prompt, tokenized), or raises
        InvalidArgumentError. stall_timeout_s: the materializer is dropped
        (and retried in the background) when it leaves steps unanswered this
        long, or keeps decode steps waiting for slots more than half of it.
        acquire_timeout_s: the longest a decode step waits for an arena slot.
        settings: caps, defaults and capabilities (decoder_svc.lengths);
        default: from the engine's facts and `options` (the decoder's
        length and guard options; None = their defaults). code2wav_workers:
        0 runs code2wav on a thread here, N > 0 in N worker processes
        (decoder_svc.code2wav.pool) that rebuild the vocoder from
        `vocoder_spec` (default: ``vocoder.worker_spec()``)."""
        self.profile = profile
        self.backends = backends
        self.arena = arena
        self._lock = threading.Lock()
        self._requests: dict[str, RequestContext] = {}
        # running requests without a multimodal output: no inter-stage payload
        self._text_only: frozenset[str] = frozenset()
        self.finished_requests = 0
        self.aborted_requests = 0
        self.ar_configs = profile.ar_stages
        if not self.ar_configs:
            raise InvalidArgumentError("profile", f"profile {profile.name!r} has no AR stage")
        missing = [s.name for s in self.ar_configs if s.name not in backends]
        if missing:
            raise InvalidArgumentError("backends", f"no engine backend for stages {missing}")
        self.gen_config = profile.stages[-1]
        self._next_ar = {a.stage_id: b for a, b in itertools.pairwise(self.ar_configs)}
        # AR stages that start requests from their upstream's first chunk: the
        # profile asks for it and the stage's engine can take input in chunks
        self._streamed = {
            s.stage_id: profile.streams_input(s) and bool(getattr(backends[s.name], "streams_input", False))
            for s in self.ar_configs
        }
        # The link exists when a materializer is configured or the in-process
        # background builder (the in-process thread baseline) is asked for.
        use_link = bool(materializer_target) or in_process_builder
        self.decisions = {
            s.stage_id: evaluate(
                s,
                profile,
                materializer_available=use_link,
                engine_facts=getattr(backends[s.name], "engine_facts", dict)(),
            )
            for s in self.ar_configs
        }
        for s in self.ar_configs:
            log_decision(s, self.decisions[s.stage_id])
        # stages whose engine runs in a process of its own (decoder_svc.stage_proc):
        # their decode loop, arena and materializer link are there
        self.stage_processes = {s.name: b for s in self.ar_configs
                                if isinstance(b := backends[s.name], StageProcess)}
        async_plans = {s.stage_id: s.plan() for s in self.ar_configs
                       if self.decisions[s.stage_id].use_async and s.name not in self.stage_processes}
        self.link = (
            MaterializerLink(
                target=materializer_target or None,
                shm_prefix=shm_prefix,
                plans=async_plans,
                arena=arena,
                deliver=self._deliver,
                fail_step=self._fail_step,
                readiness_timeout_ms=readiness_timeout_ms,
                stall_timeout_s=stall_timeout_s,
                inline_transport=inline_transport,
            )
            if async_plans
            else None
        )
        self.runners: dict[int, StageRunner | StageProcess] = {
            s.stage_id: backends[s.name].attach(self._deliver, self._fail_requests, self.decisions[s.stage_id].use_async)
            if s.name in self.stage_processes
            else StageRunner(
                s,
                backends[s.name],
                self.decisions[s.stage_id],
                arena=arena,
                link=self.link,
                deliver=self._deliver,
                downstream=self._downstream,
                on_failure=self._fail_all,
                inline_transport=inline_transport,
                acquire_timeout_s=acquire_timeout_s,
            )
            for s in self.ar_configs
        }
        if vocoder is None:  # tests that build a Pipeline by hand: the fake engine's vocoder
            from decoder_svc.fake_engine import FakeVocoderFactory

            talker = backends[self.ar_configs[-1].name]
            vocoder = FakeVocoderFactory(
                num_codebooks=getattr(talker, "num_codebooks", 16),
                codec_vocab=getattr(talker, "codec_vocab", 2048),
                left_context=self.gen_config.codec_left_context_frames,
            )
        self.vocoder = vocoder
        self.voices: tuple[str, ...] = tuple(vocoder.voices)
        self.sample_rate = int(vocoder.sample_rate)
        self._prepare = prepare
        self._roles = [s.engine_role or s.name for s in self.ar_configs]
        if settings is None:
            produced, instructions = deployment_modalities(self._roles)
            settings = DeploymentSettings.build(
                profile=profile.name,
                output_modalities=produced,
                supports_instructions=instructions,
                facts=facts_of([backends[s.name] for s in self.ar_configs], vocoder),
                options=options,
            )
        if settings.output_modalities & OutputModality.AUDIO and not settings.max_first_chunk_frames:
            settings = dataclasses.replace(settings, max_first_chunk_frames=self.gen_config.codec_chunk_frames)
        self.settings = settings
        if code2wav_workers < 0:
            raise InvalidArgumentError("code2wav_workers", f"must be >= 0, got {code2wav_workers}")
        self.code2wav: Code2WavWorker | Code2WavProcessPool
        if code2wav_workers > 0:  # worker processes: the vocoder off this interpreter
            self.code2wav = Code2WavProcessPool(
                self.gen_config, self._emit_audio, vocoder=vocoder, spec=vocoder_spec,
                shm_prefix=shm_prefix, workers=code2wav_workers, on_error=self._fail_audio, live=self._live,
            )
        else:
            self.code2wav = Code2WavWorker(
                self.gen_config, self._emit_audio, vocoder=vocoder, on_error=self._fail_audio, live=self._live
            )

    # kept for callers that think in one AR stage
    @property
    def ar_config(self) -> StageConfig:
        return self.ar_configs[0]

    @property
    def decision(self) -> GuardDecision:
        return self.decisions[self.ar_configs[-1].stage_id]

    @property
    def runner(self) -> StageRunner:
        return self.runners[self.ar_configs[-1].stage_id]

    # -- lifecycle ---------------------------------------------------------------
    def start(self) -> None:
        link, arena = self.link, self.arena
        metrics.ACTIVE_REQUESTS.set_function(lambda: self.active_requests)
        stages = list(self.stage_processes.values())
        metrics.MATERIALIZER_LAG.set_function(
            lambda: (link.in_flight if link is not None else 0) + sum(s.in_flight for s in stages))
        metrics.SLOTS_IN_USE.set_function(
            lambda: (arena.in_use if arena is not None else 0) + sum((s.arena_info or (0,) * 5)[3] for s in stages))
        if self.link is not None:
            self.link.start()
        self.code2wav.start()
        for runner in self.runners.values():
            runner.start()

    def stop(self) -> None:
        """Stop the stages, deliver what they produced (bounded: a dead
        materializer costs no wait), stop code2wav and the engines, and end the
        requests still running with finish reason "shutdown"."""
        for runner in self.runners.values():
            runner.stop()
        if self.link is not None:
            self.link.close()
        self.code2wav.stop()
        for backend in self.backends.values():
            try:
                backend.close()
            except Exception:  # noqa: BLE001 -- stop the others
                logger.exception("closing an engine backend failed")
        with self._lock:
            contexts = list(self._requests.values())
            self._requests.clear()
        for ctx in contexts:
            self._send(ctx, decoder_pb2.GenerateResponse(request_id=ctx.spec.request_id, finished=True, finish_reason="shutdown"))

    # -- requests ---------------------------------------------------------------
    def submit(self, spec: RequestSpec, sink: Sink) -> None:
        if spec.voice not in self.voices:
            raise InvalidArgumentError("voice", f"unknown voice {spec.voice!r}; voices: {', '.join(self.voices)}")
        settings = self.settings
        check_request(spec, settings)
        if self._prepare is not None:
            spec = self._prepare(spec)
        # each AR stage's token cap: the text stage's from max_tokens, the
        # audio stage's from max_audio_seconds (and max_tokens, when it is first)
        frames = settings.audio_frames(spec.max_audio_seconds)
        if self._roles[0] == "thinker":
            first_max = spec.max_tokens or settings.default_text_tokens
        else:
            first_max = min(spec.max_tokens, frames) if spec.max_tokens else frames
        spec = dataclasses.replace(spec, max_tokens=first_max)
        ctx = RequestContext(spec, sink, sample_rate=self.sample_rate, audio_frames=frames)
        if spec.modality.has_multimodal:
            ctx.guard = settings.new_guard()
        with self._lock:
            if spec.request_id in self._requests:
                raise AlreadyExistsError(f"request_id: {spec.request_id!r} is already running")
            self._requests[spec.request_id] = ctx
            if not spec.modality.has_multimodal:
                self._text_only = self._text_only | {spec.request_id}
        first = self.ar_configs[0]
        try:
            self.backends[first.name].add_request(spec)
        except BaseException:  # refused by the engine: nothing of the request stays
            with self._lock:
                self._requests.pop(spec.request_id, None)
                self._text_only = self._text_only - {spec.request_id}
            raise
        self.runners[first.stage_id].notify()

    def abort(self, request_id: str) -> bool:
        with self._lock:
            ctx = self._requests.pop(request_id, None)
            if ctx is not None:
                self.aborted_requests += 1
                self._text_only = self._text_only - {request_id}
        if ctx is None:
            return False
        ctx.done = True
        for s in self.ar_configs:
            self.backends[s.name].abort(request_id)
        self.code2wav.abort(request_id)
        metrics.REQUESTS.labels("aborted").inc()
        self._send(ctx, decoder_pb2.GenerateResponse(request_id=request_id, finished=True, finish_reason="abort", metrics=ctx.metrics()))
        return True

    def _fail_all(self, exc: BaseException) -> None:
        """A decode step failed: end every running request with an error."""
        with self._lock:
            request_ids = list(self._requests)
        self._fail_requests(request_ids, OmniError("decode step failed; the request was ended"))

    def _fail_step(self, meta: SnapshotMeta, exc: BaseException) -> None:
        """The link could not build or deliver a step: end its requests."""
        self._fail_requests(
            meta.request_ids, OmniError("building the outputs of a decode step failed; "
                                        "the request was ended"))

    def _fail_audio(self, request_id: str, exc: BaseException) -> None:
        """code2wav failed for a request: end it."""
        self._fail_requests([request_id],
                            OmniError("audio generation failed; the request was ended"))

    def _fail_requests(self, request_ids: list[str], error: OmniError) -> None:
        """End these requests (those still running) with `error` and free them
        everywhere. The error's message is what the client sees: short, no
        internals (the log has the cause)."""
        with self._lock:
            popped = [self._requests.pop(rid, None) for rid in request_ids]
            contexts = [c for c in popped if c is not None]
            if contexts:
                self._text_only = self._text_only - {c.spec.request_id for c in contexts}
        for ctx in contexts:
            ctx.done = True
            rid = ctx.spec.request_id
            for s in self.ar_configs:
                try:
                    self.backends[s.name].abort(rid)
                except Exception:  # noqa: BLE001 -- the request is ended either way
                    logger.exception("stage %s: aborting request %s failed", s.name, rid)
            self.code2wav.abort(rid)
            metrics.REQUESTS.labels("failed").inc()
            try:
                self._send(ctx, error)
            except Exception:  # noqa: BLE001 -- a broken sink must not stop the others
                logger.exception("request %s: sending its error failed", rid)

    def _first_chunk(self) -> int:
        """Frames of the first audio chunk of a request whose audio starts
        now: by the audio requests in flight (itself included), as the
        profile's generation stage sets it (``first_chunk_by_load``)."""
        with self._lock:
            audio = len(self._requests) - len(self._text_only)
        return self.gen_config.first_chunk_for_load(audio)

    @property
    def active_requests(self) -> int:
        with self._lock:
            return len(self._requests)

    def _context(self, request_id: str) -> RequestContext | None:
        with self._lock:
            return self._requests.get(request_id)

    def _downstream(self, request_ids: list[str]) -> list[str]:
        """Requests whose payload the next stage wants this step (those with audio).

        Runs on the critical path: without text-only requests in flight (the
        usual case) it is the batch itself, no loop.
        """
        text_only = self._text_only
        if not text_only:
            return request_ids
        return [rid for rid in request_ids if rid not in text_only]

    @staticmethod
    def _send(ctx: RequestContext, resp: decoder_pb2.GenerateResponse | OmniError) -> None:
        ctx.sink(resp)

    # -- routing of materialized steps (in step order, per stage) -------------------
    def _deliver(self, step: materializer_pb2.MaterializedStep | LocalStep, meta: SnapshotMeta) -> None:
        """Route one materialized step: as the materializer answered it (a
        MaterializedStep), or built in-process (a LocalStep: tensors viewing
        the step's slot or the engine's output, which are reused once this
        returns, so what outlives the call is copied here).

        For each request of the step:
          1) text deltas (text stages) go to the client stream;
          2) client payloads go to the client stream;
          3) inter-stage payloads go to the next stage: the next AR stage's
             conditioning, or code2wav's frames;
          4) a finished request moves on: to the next AR stage, to code2wav's
             flush, or it completes.
        """
        local = isinstance(step, LocalStep)
        next_ar = self._next_ar.get(step.stage_id)
        for req in step.requests:
            ctx = self._context(req.request_id)
            if ctx is None or ctx.done or ctx.ending:
                continue  # aborted meanwhile, or ended by the pipeline
            ctx.steps += 1
            rid = req.request_id
            # 1) + 2)
            delta = meta.text_deltas.get(rid)
            has_client = bool(req.client) if local else bool(req.client.tensors)
            if (delta is not None and ctx.spec.modality.has_text) or has_client:
                resp = decoder_pb2.GenerateResponse(request_id=rid, stage_id=step.stage_id, metrics=ctx.metrics())
                if delta is not None and ctx.spec.modality.has_text:
                    resp.text_delta = delta
                    resp.new_token_ids.extend(meta.new_token_ids.get(rid, ()))
                if has_client and local:  # the only payload that becomes a message: the stream's
                    client_payload(req.client, into=resp.multimodal_output)
                elif has_client:
                    resp.multimodal_output.CopyFrom(req.client)
                self._send(ctx, resp)
            # 3)
            if local:
                tensors = req.inter_stage
            else:
                tensors = payload_tensors(req.inter_stage) if req.inter_stage.tensors else {}
            if tensors:
                if next_ar is None:
                    codes = tensors["codec_codes"].numpy()
                    if local:  # queued for code2wav: the slot it views is reused
                        codes = codes.copy()
                    if not ctx.first_chunk_frames:
                        ctx.first_chunk_frames = ctx.spec.first_chunk_frames or self._first_chunk()
                        metrics.FIRST_CHUNKS.labels(str(ctx.first_chunk_frames)).inc()
                    self.code2wav.frames(rid, ctx.spec.voice, codes, ctx.first_chunk_frames)
                    if ctx.guard is not None and self._loops(ctx.guard, codes):
                        self._end_looping(ctx, step.stage_id)
                        continue
                else:
                    ctx.upstream_tokens += 1  # one sampled token per row and step (no speculative decoding)
                    if not ctx.audio_reason:  # (the audio ended already: nothing more to hand over)
                        for key, t in tensors.items():
                            ctx.handoff.setdefault(key, []).append(t.clone())
                        if self._streamed[next_ar.stage_id] and not req.finished:
                            self._stream_to(next_ar, ctx)
            # 4)
            if req.finished:
                reason = meta.finished.get(rid, STOP)
                if reason == STOP and ctx.upstream_reason == LENGTH:
                    reason = LENGTH  # the text the audio speaks was cut at its cap
                if not ctx.spec.modality.has_multimodal:
                    self._complete(ctx, decoder_pb2.GenerateResponse(request_id=rid, stage_id=step.stage_id, finished=True, finish_reason=reason))
                elif next_ar is None:
                    self.code2wav.finish(rid, ctx.spec.voice, reason)
                else:
                    ctx.upstream_reason = reason
                    if not ctx.handovers:
                        if ctx.upstream_tokens < getattr(self.backends[next_ar.name], "min_input_tokens", 0):
                            # the reply says nothing the next stage could speak: the
                            # request ends with its text and no audio
                            ctx.handoff.clear()
                            self._emit_audio(rid, np.zeros(0, dtype=np.float32), True, reason)
                        else:
                            self._hand_to(next_ar, ctx)
                        continue
                    # started from an earlier chunk: the rest, and the end -- or,
                    # when the audio already ended (its cap), the request completes
                    with self._lock:
                        ctx.upstream_open = False
                        audio_reason = ctx.audio_reason
                    if not audio_reason:
                        self._stream_to(next_ar, ctx, finished=True)
                    else:
                        if audio_reason == STOP and reason == LENGTH:
                            audio_reason = LENGTH
                        self._emit_audio(rid, np.zeros(0, dtype=np.float32), True, audio_reason)

    def _loops(self, guard: RepetitionGuard, codes: np.ndarray) -> bool:
        """Feed a request's new frames (codebook 0; end-of-speech rows left
        out) to its runaway guard; True when the stream is looping."""
        code0 = codes.reshape(-1, self.code2wav.num_codebooks)[:, 0]
        return guard.push(code0[code0 < self.code2wav.codebook_size].tolist())

    def _end_looping(self, ctx: RequestContext, stage_id: int) -> None:
        """The runaway guard tripped: stop the request's AR stage, speak the
        frames it has, end it with finish reason "repetition"."""
        rid = ctx.spec.request_id
        ctx.ending = REPETITION
        guard = ctx.guard
        logger.info("request %s: the codec stream repeats a %d-frame cycle over the last %d frames "
                    "(%d frames in); ending it", rid, guard.period if guard else 0,
                    guard.window if guard else 0, guard.frames if guard else 0)
        metrics.REPETITION_STOPS.inc()
        with self._lock:  # an upstream stage still producing (streamed input) stops too
            upstream = ctx.upstream_open
            ctx.upstream_open = False
        for s in self.ar_configs:
            if s.stage_id == stage_id or (upstream and s.stage_id < stage_id):
                try:
                    self.backends[s.name].abort(rid)
                except Exception:  # noqa: BLE001 -- the request ends either way
                    logger.exception("stage %s: stopping request %s failed", s.name, rid)
        self.code2wav.finish(rid, ctx.spec.voice, REPETITION)

    def _stream_to(self, stage: StageConfig, ctx: RequestContext, finished: bool = False) -> None:
        """Streamed input: start the request on the next AR stage once the
        upstream stage has produced the profile's first chunk
        (``input_chunk_ramp[0]`` tokens), then hand each further chunk over
        as it completes, and the rest at the upstream's finish. The next
        stage holds the request while its next step's input is missing."""
        if not ctx.handovers:
            if ctx.upstream_tokens >= stage.input_chunk_end(0):
                self._hand_to(stage, ctx, streaming=True)
            return
        if not finished and ctx.upstream_tokens < stage.input_chunk_end(ctx.handovers):
            return
        rid = ctx.spec.request_id
        cond = {key: torch.cat(parts) for key, parts in ctx.handoff.items()}
        ctx.handoff.clear()
        ctx.handovers += 1
        extend = self.backends[stage.name].extend_request  # type: ignore[attr-defined]
        if self._stage_call(stage, rid, "continue", lambda: extend(rid, cond, finished)):
            self.runners[stage.stage_id].notify()

    def _stage_call(self, stage: StageConfig, rid: str, what: str, call: Callable[[], None]) -> bool:
        """Give a request to the next stage (start or continue it); a refusal
        ends that request alone, with the stage's error (or a short one)."""
        try:
            call()
        except OmniError as exc:
            self._fail_requests([rid], exc)
            return False
        except Exception as exc:  # noqa: BLE001 -- this request ends, the others go on
            logger.error("stage %s could not %s request %s", stage.name, what, rid, exc_info=exc)
            self._fail_requests([rid], OmniError(f"stage {stage.name} could not {what} the request"))
            return False
        return True

    def _hand_to(self, stage: StageConfig, ctx: RequestContext, streaming: bool = False) -> None:
        """Start a request on the next AR stage, conditioned on what the
        previous stage handed over (e.g. the thinker's hidden states): all
        of it, or (``streaming``) its first chunk, the rest to follow.

        A request the next stage refuses (an empty reply, ...) ends alone,
        with the stage's error; the others in the step go on."""
        rid = ctx.spec.request_id
        cond = {key: torch.cat(parts) for key, parts in ctx.handoff.items()}
        ctx.handoff.clear()
        spec = dataclasses.replace(
            ctx.spec, conditioning=cond, max_tokens=ctx.audio_frames, streaming=streaming
        )
        ctx.handovers = 1
        ctx.upstream_open = streaming
        backend = self.backends[stage.name]
        # a stage process takes it without the routing waiting for its answer
        # (a refusal fails the request all the same)
        start = getattr(backend, "hand_over", backend.add_request)
        if not self._stage_call(stage, rid, "start", lambda: start(spec)):
            return
        if not self._live(rid):  # aborted while it was being handed over
            backend.abort(rid)
            return
        self.runners[stage.stage_id].notify()

    def _live(self, request_id: str) -> bool:
        ctx = self._context(request_id)
        return ctx is not None and not ctx.done

    def _emit_audio(self, request_id: str, audio: np.ndarray, last: bool, reason: str) -> None:
        ctx = self._context(request_id)
        if ctx is None or ctx.done:
            return
        if ctx.first_audio_s is None and audio.size:
            ctx.first_audio_s = time.perf_counter()
        ctx.audio_samples += int(audio.size)
        if last:
            with self._lock:
                if ctx.upstream_open:  # the text goes on: this chunk is not the end yet
                    ctx.audio_reason, last, reason = reason, False, ""
            if not last and not audio.size:
                return
        payload = payload_pb2.MultimodalPayload()
        if audio.size or last:
            payload.tensors.add(name="audio", tensor=encode_inline(torch.from_numpy(audio)))
        payload.metadata["sample_rate"].int_value = self.sample_rate
        payload.metadata["last_chunk"].bool_value = last
        resp = decoder_pb2.GenerateResponse(
            request_id=request_id, stage_id=self.gen_config.stage_id, multimodal_output=payload,
            finished=last, finish_reason=reason if last else "", metrics=ctx.metrics())
        if last:
            self._complete(ctx, resp)
        else:
            self._send(ctx, resp)

    def _complete(self, ctx: RequestContext, resp: decoder_pb2.GenerateResponse) -> None:
        with self._lock:
            if self._requests.pop(ctx.spec.request_id, None) is None:
                return
            self._text_only = self._text_only - {ctx.spec.request_id}
            self.finished_requests += 1
        ctx.done = True
        metrics.REQUESTS.labels("finished").inc()
        self._send(ctx, resp)

    # -- info -------------------------------------------------------------------
    @property
    def materializer_connected(self) -> bool:
        """Every materializer link is connected (this process's and the stage processes')."""
        links = [self.link.connected] if self.link is not None else []
        links += [s.link_connected for s in self.stage_processes.values()
                  if self.decisions[s.config.stage_id].use_async]
        return bool(links) and all(links)

    @property
    def fallback_steps(self) -> int:
        return (self.link.fallback_steps if self.link is not None else 0) + sum(
            s.fallback_steps for s in self.stage_processes.values())

    def materializer_attachment(self) -> decoder_pb2.MaterializerAttachment | None:
        """How the (last) link is attached to its materializer, None when not."""
        if self.link is not None and self.link.attachment is not None:
            return self.link.attachment.to_proto()
        for s in reversed(self.stage_processes.values()):
            if s.attachment_proto is not None:
                return decoder_pb2.MaterializerAttachment.FromString(s.attachment_proto)
        return None

    def arena_info(self) -> tuple[str, int, int, int, int] | None:
        """(name, slot bytes, slots, in use, peak in use) of the step arena: this
        process's, or the last stage process's that has one."""
        if self.arena is not None:
            a = self.arena
            return a.name, a.slot_bytes, a.num_slots, a.in_use, a.peak_in_use
        for s in reversed(self.stage_processes.values()):
            if s.arena_info is not None:
                return tuple(s.arena_info)
        return None

    def stage_infos(self) -> list[decoder_pb2.StageInfo]:
        infos = []
        for s in self.profile.stages:
            info = decoder_pb2.StageInfo(stage_id=s.stage_id, name=s.name)
            if s.kind == "ar":
                decision = self.decisions[s.stage_id]
                info.kind = decoder_pb2.STAGE_KIND_AR
                info.output_path = decoder_pb2.OUTPUT_PATH_ASYNC if decision.use_async else decoder_pb2.OUTPUT_PATH_SYNC
                info.reason = decision.reason
                info.steps = self.runners[s.stage_id].steps
            else:
                info.kind = decoder_pb2.STAGE_KIND_GENERATION
                info.output_path = decoder_pb2.OUTPUT_PATH_SYNC
                info.reason = "generation stage: outputs built by its own worker"
                info.steps = self.code2wav.chunks
            infos.append(info)
        return infos


