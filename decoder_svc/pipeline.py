"""The stage pipeline: runs a profile's AR stages, then code2wav; requests in, outputs to their sinks.

``Pipeline`` is the decoder's domain object under the servicer: ``submit``,
``abort``, failures (a failed request ends everywhere, with a short error),
and what ``GetDecoderInfo`` reports. Its constructor is the wiring:

- the running requests (``decoder_svc.requests.RequestTable``);
- the routing of materialized steps (``decoder_svc.routing.Router``);
- the AR stages (``decoder_svc.stage``): those whose engine runs in this
  process get their decode loop, this process's arena and one materializer
  link (``stage.assembly.build_stages``); those in a process of their own
  are ``stage.proxy.StageProcess`` es, which stand in for both backend and
  runner;
- code2wav (``decoder_svc.code2wav``): one thread, or worker processes with
  one result reader thread each.

Threads: one runner per in-process AR stage (the decode loop, critical
path), the materializer link's dispatcher/receiver/connector (or in-process
builder), a reader and a writer per stage process, code2wav's. No thread
dies of an exception: a failure ends the affected requests with an error (a
short message, no internals: the log has the traceback), frees their arena
slots, and the thread goes on serving.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import Any

from decoder_svc import metrics
from decoder_svc.backend import ARBackend, RequestSpec
from decoder_svc.code2wav.core import VocoderSpec
from decoder_svc.code2wav.pool import Code2WavProcessPool
from decoder_svc.code2wav.thread import Code2WavWorker
from decoder_svc.guards import GuardDecision
from decoder_svc.inputs import decode_inputs
from decoder_svc.lengths import (
    DeploymentSettings,
    Options,
    check_request,
    deployment_modalities,
    facts_of,
)
from decoder_svc.profile import Profile, StageConfig
from decoder_svc.requests import RequestContext, RequestTable, Sink
from decoder_svc.routing import Router
from decoder_svc.snapshot import SnapshotMeta
from decoder_svc.stage.assembly import build_stages, decide, uses_link
from decoder_svc.stage.proxy import StageProcess
from decoder_svc.stage.runner import StageRunner
from decoder_svc.stops import StopWatch
from omni_common.errors import InvalidArgumentError, OmniError, UnavailableError
from omni_common.modality import OutputModality
from omni_common.shm_arena import ShmArena
from omni_common.voices import resolve_voice, voice_aliases
from omni_serving.v1 import decoder_pb2

logger = logging.getLogger(__name__)


def _stop_runner(name: str, runner) -> None:
    try:
        runner.stop()
    except Exception:  # noqa: BLE001 -- stop the others
        logger.exception("stopping stage %s failed", name)


class Pipeline:
    """Runs a profile: AR stages in order, then code2wav; routes outputs to
    request sinks. Every AR stage decides its output path with the guards."""

    def __init__(
        self,
        profile: Profile,
        backends: dict[str, ARBackend],
        *,
        vocoder,
        materializer_target: str | None,
        shm_prefix: str,
        arena: ShmArena | None,
        inline_transport: bool = False,
        in_process_builder: bool = False,
        readiness_timeout_ms: int = 5000,
        stall_timeout_s: float = 3.0,
        acquire_timeout_s: float = 0.5,
        prepare: Callable[[RequestSpec], RequestSpec] | None = None,
        settings: DeploymentSettings | None = None,
        options: Options | None = None,
        code2wav_workers: int = 0,
        vocoder_spec: VocoderSpec | None = None,
        voice_store: Any = None,
    ) -> None:
        """vocoder: the generation stage's streaming vocoder (``new_stream``,
        ``voices``, ``sample_rate``, ``num_codebooks``, ``codebook_size``):
        the model family's (the fake engine's is a test double). prepare: turns a request into what
        its first stage takes (e.g. a chat prompt, tokenized; for a
        ``verbatim`` request, what the speaking stage takes), or raises
        InvalidArgumentError. stall_timeout_s: the materializer is dropped
        (and retried in the background) when it leaves steps unanswered this
        long, or keeps decode steps waiting for slots more than half of it.
        acquire_timeout_s: the longest a decode step waits for an arena slot.
        settings: caps, defaults and capabilities (decoder_svc.lengths);
        default: from the engine's facts and `options` (the decoder's
        length and guard options; None = their defaults). code2wav_workers:
        0 runs code2wav on a thread here, N > 0 in N worker processes
        (decoder_svc.code2wav.pool) that rebuild the vocoder from
        `vocoder_spec` (default: ``vocoder.worker_spec()``). voice_store: the
        model's voice registry (``decoder_svc.qwen3_tts.voices.VoiceStore``),
        whose voices a request may name beside the vocoder's; None: none."""
        self.profile = profile
        self.backends = backends
        self.arena = arena
        self.requests = RequestTable()
        self.ar_configs = profile.ar_stages
        if not self.ar_configs:
            raise InvalidArgumentError("profile", f"profile {profile.name!r} has no AR stage")
        missing = [s.name for s in self.ar_configs if s.name not in backends]
        if missing:
            raise InvalidArgumentError("backends", f"no engine backend for stages {missing}")
        self.gen_config = profile.stages[-1]
        self.vocoder = vocoder
        self.voices: tuple[str, ...] = tuple(vocoder.voices)
        # "default" and the family's aliases (omni_common.voices), each to one of the voices
        self.voice_aliases = voice_aliases(self.voices, getattr(vocoder, "voice_aliases", {}))
        self.voice_store = voice_store
        self.sample_rate = int(vocoder.sample_rate)
        self._prepare = prepare
        self._roles = [s.engine_role or s.name for s in self.ar_configs]
        # where a text spoken as written starts (GenerateRequest.verbatim): the
        # first stage that speaks; with none, the first stage (which refuses it)
        self._speaking = next((s for s, role in zip(self.ar_configs, self._roles, strict=True) if role == "talker"),
                              self.ar_configs[0])
        self.router = Router(
            self.requests,
            ar_configs=self.ar_configs,
            gen_config=self.gen_config,
            backends=backends,
            # AR stages that start requests from their upstream's first chunk: the
            # profile asks for it and the stage's engine can take input in chunks
            streamed={
                s.stage_id: profile.streams_input(s) and bool(getattr(backends[s.name], "streams_input", False))
                for s in self.ar_configs
            },
            sample_rate=self.sample_rate,
            fail_requests=self._fail_requests,
        )
        # stages whose engine runs in a process of its own (decoder_svc.stage.proxy):
        # their decode loop, arena and materializer link are there
        self.stage_processes = {s.name: b for s in self.ar_configs
                                if isinstance(b := backends[s.name], StageProcess)}
        built = build_stages(
            profile, [s for s in self.ar_configs if s.name not in self.stage_processes], backends,
            materializer_target=materializer_target, in_process_builder=in_process_builder,
            shm_prefix=shm_prefix, arena=arena, deliver=self.router.deliver, fail_step=self._fail_step,
            downstream=self.requests.downstream, on_failure=self._fail_all, inline_transport=inline_transport,
            readiness_timeout_ms=readiness_timeout_ms, stall_timeout_s=stall_timeout_s,
            acquire_timeout_s=acquire_timeout_s,
        )
        self.link = built.link
        use_link = uses_link(materializer_target, in_process_builder)
        self.decisions: dict[int, GuardDecision] = {
            s.stage_id: built.decisions[s.stage_id] if s.name not in self.stage_processes
            else decide(s, profile, backends[s.name], materializer_available=use_link)
            for s in self.ar_configs
        }
        self.runners: dict[int, StageRunner | StageProcess] = {
            s.stage_id: backends[s.name].attach(self.router.deliver, self._fail_requests,
                                                self.decisions[s.stage_id].use_async)
            if s.name in self.stage_processes
            else built.runners[s.stage_id]
            for s in self.ar_configs
        }
        self.settings = self._deployment_settings(settings, options)
        self.router.attach(self.runners, self._code2wav(code2wav_workers, vocoder_spec, shm_prefix))

    @property
    def code2wav(self) -> Code2WavWorker | Code2WavProcessPool:
        """The generation stage (the router feeds it a request's frames)."""
        code2wav = self.router.code2wav
        assert code2wav is not None
        return code2wav

    @code2wav.setter
    def code2wav(self, code2wav: Code2WavWorker | Code2WavProcessPool) -> None:
        """Put another generation stage in its place (before ``start``)."""
        self.router.code2wav = code2wav

    def _deployment_settings(self, settings: DeploymentSettings | None, options: Options | None) -> DeploymentSettings:
        """The given settings, else the deployment's from the engines' facts and `options`."""
        if settings is None:
            produced, instructions = deployment_modalities(self._roles)
            settings = DeploymentSettings.build(
                profile=self.profile.name,
                output_modalities=produced,
                supports_instructions=instructions,
                facts=facts_of([self.backends[s.name] for s in self.ar_configs], self.vocoder),
                options=options,
            )
        if settings.output_modalities & OutputModality.AUDIO and not settings.max_first_chunk_frames:
            settings = dataclasses.replace(settings, max_first_chunk_frames=self.gen_config.codec_chunk_frames)
        return settings

    def _code2wav(self, workers: int, vocoder_spec: VocoderSpec | None,
                  shm_prefix: str) -> Code2WavWorker | Code2WavProcessPool:
        """The generation stage: on a thread (0 workers) or in worker processes."""
        if workers < 0:
            raise InvalidArgumentError("code2wav_workers", f"must be >= 0, got {workers}")
        if workers > 0:  # worker processes: the vocoder off this interpreter
            return Code2WavProcessPool(
                self.gen_config, self.router.emit_audio, vocoder=self.vocoder, spec=vocoder_spec,
                shm_prefix=shm_prefix, workers=workers, on_error=self._fail_audio, live=self.router.live,
            )
        return Code2WavWorker(
            self.gen_config, self.router.emit_audio, vocoder=self.vocoder, on_error=self._fail_audio,
            live=self.router.live,
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

    def wait_ready(self, timeout_s: float) -> bool:
        """After start(): whether the code2wav workers built their vocoders
        within timeout_s (the AR stages are ready once built). Until then a
        request's first audio would wait for a worker's start."""
        if isinstance(self.code2wav, Code2WavProcessPool):
            return self.code2wav.wait_ready(timeout_s)
        return True

    def stop(self) -> None:
        """Stop the stages, deliver what they produced (bounded: a dead
        materializer costs no wait), stop code2wav and the engines, and end the
        requests still running with finish reason "shutdown"."""
        # at once: a stage process takes a second or two to end its engine and exit
        stoppers = [threading.Thread(target=_stop_runner, args=(name, runner), name=f"stop-{name}")
                    for name, runner in self.runners.items()]
        for t in stoppers:
            t.start()
        for t in stoppers:
            t.join()
        if self.link is not None:
            self.link.close()
        self.code2wav.stop()
        for backend in self.backends.values():
            try:
                backend.close()
            except Exception:  # noqa: BLE001 -- stop the others
                logger.exception("closing an engine backend failed")
        for ctx in self.requests.pop_all():
            ctx.sink(decoder_pb2.GenerateResponse(request_id=ctx.spec.request_id, finished=True, finish_reason="shutdown"))

    # -- requests ---------------------------------------------------------------
    def submit(self, spec: RequestSpec, sink: Sink) -> None:
        try:
            voice = resolve_voice(spec.voice, self.voices, self.voice_aliases)
        except InvalidArgumentError:
            if self.voice_store is None or not self.voice_store.has(spec.voice):
                raise
            voice = spec.voice  # a registered voice
        if voice != spec.voice:
            spec = dataclasses.replace(spec, voice=voice)
        settings = self.settings
        check_request(spec, settings)
        spec = decode_inputs(spec, settings)
        if self._prepare is not None:
            spec = self._prepare(spec)
        # each AR stage's token cap: the text stage's from max_tokens, the
        # audio stage's from max_audio_seconds (and max_tokens, when it is first)
        frames = settings.audio_frames(spec.max_audio_seconds)
        first = self._speaking if spec.verbatim else self.ar_configs[0]
        if (first.engine_role or first.name) == "thinker":
            first_max = spec.max_tokens or settings.default_text_tokens
        else:
            first_max = min(spec.max_tokens, frames) if spec.max_tokens else frames
        spec = dataclasses.replace(spec, max_tokens=first_max)
        ctx = RequestContext(spec, sink, sample_rate=self.sample_rate, audio_frames=frames)
        if spec.modality.has_multimodal:
            ctx.guard = settings.new_guard()
        if spec.stop:  # (check_request: a deployment with a text stage, not verbatim)
            ctx.stop_watch = StopWatch(spec.stop)
        self.requests.add(ctx)
        try:
            self.backends[first.name].add_request(spec)
        except BaseException:  # refused by the engine: nothing of the request stays
            self.requests.discard(spec.request_id)
            raise
        self.runners[first.stage_id].notify()

    def abort(self, request_id: str) -> bool:
        ctx = self.requests.abort(request_id)
        if ctx is None:
            return False
        ctx.done = True
        for s in self.ar_configs:
            self.backends[s.name].abort(request_id)
        self.code2wav.abort(request_id)
        metrics.REQUESTS.labels("aborted").inc()
        ctx.sink(decoder_pb2.GenerateResponse(request_id=request_id, finished=True, finish_reason="abort", metrics=ctx.metrics()))
        return True

    def _fail_all(self, exc: BaseException) -> None:
        """A decode step failed: end every running request with an error."""
        self._fail_requests(self.requests.ids(), OmniError("decode step failed; the request was ended"))

    def _fail_step(self, meta: SnapshotMeta, exc: BaseException) -> None:
        """The link could not build or deliver a step: end its requests."""
        self._fail_requests(
            meta.request_ids, OmniError("building the outputs of a decode step failed; "
                                        "the request was ended"))

    def _fail_audio(self, request_id: str, exc: BaseException) -> None:
        """code2wav failed for a request: end it. Its worker process was lost
        (it ended, or was killed for making no progress: UnavailableError,
        whose message says which): UNAVAILABLE naming that; any other
        failure: INTERNAL, its cause only in the log."""
        if isinstance(exc, UnavailableError):
            error: OmniError = UnavailableError(f"audio generation failed: {exc}; the request was ended")
        else:
            error = OmniError("audio generation failed; the request was ended")
        self._fail_requests([request_id], error)

    def _fail_requests(self, request_ids: list[str], error: OmniError) -> None:
        """End these requests (those still running) with `error` and free them
        everywhere. The error's message is what the client sees: short, no
        internals (the log has the cause)."""
        for ctx in self.requests.pop_many(request_ids):
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
                ctx.sink(error)
            except Exception:  # noqa: BLE001 -- a broken sink must not stop the others
                logger.exception("request %s: sending its error failed", rid)

    @property
    def active_requests(self) -> int:
        return len(self.requests)

    @property
    def finished_requests(self) -> int:
        return self.requests.finished

    @property
    def aborted_requests(self) -> int:
        return self.requests.aborted

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

    def _engine_settings(self, stage: str) -> dict[str, str]:
        facts = getattr(self.backends[stage], "engine_facts", None)
        try:
            all_facts = facts() if callable(facts) else {}
        except Exception:  # noqa: BLE001 -- a stage process being restarted says nothing
            return {}
        out = {str(k): str(v) for k, v in all_facts.get("engine_settings", {}).items()}
        if "enable_prefix_caching" in all_facts:  # the profile's, as the engine took it: what is cached
            out["enable_prefix_caching"] = str(bool(all_facts["enable_prefix_caching"])).lower()
        return out

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
                info.restarting = bool(getattr(self.runners[s.stage_id], "restarting", False))  # a stage process
                info.engine_settings.update(self._engine_settings(s.name))
            else:
                info.kind = decoder_pb2.STAGE_KIND_GENERATION
                info.output_path = decoder_pb2.OUTPUT_PATH_SYNC
                info.reason = "generation stage: outputs built by its own worker"
                info.steps = self.code2wav.chunks
                placement = {k: getattr(self.vocoder, k, None) for k in ("device", "dtype")}  # a model's vocoder
                info.engine_settings.update({k: str(v) for k, v in placement.items() if isinstance(v, str)})
            infos.append(info)
        return infos
