"""Routing of materialized steps: text and payloads to the client, frames to code2wav, requests on.

The ``Router`` is the pipeline's one consumer of materialized steps, on the
thread that delivers them (the link's, a stage's reader, or the decode loop
on the sync path), in step order per stage. Per request of a step
(``deliver``, steps numbered there): text deltas and client payloads go to
the request's stream; inter-stage payloads go to the next stage (the next AR
stage's conditioning, or code2wav's frames); a finished request moves on (to
the next AR stage, to code2wav's flush) or completes. With streamed input
the next AR stage starts from the upstream's first chunk and gets the rest as
it comes (``_stream_to``). The runaway guard watches each audio request's
codec frames and ends a request that loops (finish reason "repetition").
code2wav's audio comes back through ``emit_audio``; the last chunk completes
the request.

A request the next stage refuses ends alone (``fail_requests``); the others
go on. A request that ended meanwhile (aborted, failed) is skipped.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from decoder_svc import metrics
from decoder_svc.backend import ARBackend
from decoder_svc.code2wav.core import context_frames
from decoder_svc.code2wav.pool import Code2WavProcessPool
from decoder_svc.code2wav.thread import Code2WavWorker
from decoder_svc.lengths import LENGTH, REPETITION, STOP, RepetitionGuard
from decoder_svc.profile import StageConfig
from decoder_svc.requests import RequestContext, RequestTable
from decoder_svc.snapshot import SnapshotMeta
from decoder_svc.stage.proxy import StageProcess
from decoder_svc.stage.runner import StageRunner
from decoder_svc.stops import HeldStep
from omni_common.errors import OmniError
from omni_common.materialize import LocalStep, client_payload, payload_tensors
from omni_common.tensor_wire import encode_inline
from omni_serving.v1 import decoder_pb2, materializer_pb2, payload_pb2

logger = logging.getLogger(__name__)


class Router:
    """Routes the steps of a profile's AR stages (module docstring)."""

    def __init__(
        self,
        requests: RequestTable,
        *,
        ar_configs: list[StageConfig],
        gen_config: StageConfig,
        backends: dict[str, ARBackend],
        streamed: dict[int, bool],
        sample_rate: int,
        fail_requests: Callable[[list[str], OmniError], None],
    ) -> None:
        """streamed: by stage id, the AR stages that start a request from
        their upstream's first chunk. fail_requests: ends requests with an
        error everywhere (the pipeline's)."""
        self.requests = requests
        self.ar_configs = ar_configs
        self.gen_config = gen_config
        self.backends = backends
        self._streamed = streamed
        self._next_ar = {a.stage_id: b for a, b in itertools.pairwise(ar_configs)}
        self.sample_rate = sample_rate
        self.fail_requests = fail_requests
        # attach(): the stages' runners (woken after a hand-over) and code2wav
        self.runners: dict[int, StageRunner | StageProcess] = {}
        self.code2wav: Code2WavWorker | Code2WavProcessPool | None = None

    def attach(self, runners: dict[int, StageRunner | StageProcess],
               code2wav: Code2WavWorker | Code2WavProcessPool) -> None:
        """The parts built after this router (they deliver and emit to it)."""
        self.runners = runners
        self.code2wav = code2wav

    def live(self, request_id: str) -> bool:
        return self.requests.live(request_id)

    def _first_chunk(self) -> int:
        """Frames of the first audio chunk of a request whose audio starts
        now: by the audio requests in flight (itself included), as the
        profile's generation stage sets it (``first_chunk_by_load``)."""
        return self.gen_config.first_chunk_for_load(self.requests.audio_requests())

    def deliver(self, step: materializer_pb2.MaterializedStep | LocalStep, meta: SnapshotMeta) -> None:
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
            ctx = self.requests.get(req.request_id)
            if ctx is None or ctx.done or ctx.ending:
                continue  # aborted meanwhile, or ended by the pipeline
            ctx.steps += 1
            rid = req.request_id
            if ctx.stop_watch is not None and step.stage_id == self.ar_configs[0].stage_id:
                self._watched(ctx, req, step.stage_id, meta, local, next_ar)
                continue
            # 1) + 2)
            self._send(ctx, req, step.stage_id, local, meta.text_deltas.get(rid), meta.new_token_ids.get(rid, ()))
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
                    sent = codes
                    if not ctx.first_chunk_frames:
                        ctx.first_chunk_frames = ctx.spec.first_chunk_frames or self._first_chunk()
                        metrics.FIRST_CHUNKS.labels(str(ctx.first_chunk_frames)).inc()
                        if ctx.spec.audio_context is not None:  # decoded first, its audio not sent
                            sent = np.concatenate((context_frames(np.asarray(ctx.spec.audio_context)), codes))
                    self.code2wav.frames(rid, ctx.spec.voice, sent, ctx.first_chunk_frames)
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
                self._finished(ctx, step.stage_id, next_ar, meta.finished.get(rid, STOP))

    def _send(self, ctx: RequestContext, req, stage_id: int, local: bool,  # noqa: ANN001
              text: str | None, ids) -> None:  # noqa: ANN001
        """A step's text (None: none this step) and its client payloads, to the client's stream."""
        has_client = bool(req.client) if local else bool(req.client.tensors)
        text_out = text is not None and ctx.spec.modality.has_text
        if not (text_out or has_client):
            return
        resp = decoder_pb2.GenerateResponse(request_id=ctx.spec.request_id, stage_id=stage_id, metrics=ctx.metrics())
        if text_out:
            resp.text_delta = text
            resp.new_token_ids.extend(ids)
        if has_client and local:  # the only payload that becomes a message: the stream's
            client_payload(req.client, into=resp.multimodal_output)
        elif has_client:
            resp.multimodal_output.CopyFrom(req.client)
        ctx.sink(resp)

    def _finished(self, ctx: RequestContext, stage_id: int, next_ar: StageConfig | None, reason: str) -> None:
        """A request's stage ended (``reason``): it moves on to the next AR
        stage, to code2wav's flush, or it completes."""
        rid = ctx.spec.request_id
        if reason == STOP and ctx.upstream_reason == LENGTH:
            reason = LENGTH  # the text the audio speaks was cut at its cap
        if not ctx.spec.modality.has_multimodal:
            self._complete(ctx, decoder_pb2.GenerateResponse(request_id=rid, stage_id=stage_id, finished=True, finish_reason=reason))
        elif next_ar is None:
            self.code2wav.finish(rid, ctx.spec.voice, reason)
        else:
            ctx.upstream_reason = reason
            if not ctx.handovers:
                if ctx.upstream_tokens < getattr(self.backends[next_ar.name], "min_input_tokens", 0):
                    # the reply says nothing the next stage could speak: the
                    # request ends with its text and no audio
                    ctx.handoff.clear()
                    self.emit_audio(rid, np.zeros(0, dtype=np.float32), True, reason)
                else:
                    self._hand_to(next_ar, ctx)
                return
            # started from an earlier chunk: the rest, and the end -- or,
            # when the audio already ended (its cap), the request completes
            with self.requests.lock:
                ctx.upstream_open = False
                audio_reason = ctx.audio_reason
            if not audio_reason:
                self._stream_to(next_ar, ctx, finished=True)
            else:
                if audio_reason == STOP and reason == LENGTH:
                    audio_reason = LENGTH
                self.emit_audio(rid, np.zeros(0, dtype=np.float32), True, audio_reason)

    def _watched(self, ctx: RequestContext, req, stage_id: int, meta: SnapshotMeta,  # noqa: ANN001
                 local: bool, next_ar: StageConfig | None) -> None:
        """A step of a request with stop sequences on its text stage
        (``decoder_svc.stops``): text and the next stage's rows go on only
        once no stop sequence can cut them; a stop ends the stage's request."""
        watch = ctx.stop_watch
        assert watch is not None
        if watch.stopped:
            return  # a step in flight when the stop was found
        rid = ctx.spec.request_id
        if local:
            tensors = {k: t.clone() for k, t in req.inter_stage.items()}
        else:
            tensors = payload_tensors(req.inter_stage) if req.inter_stage.tensors else {}
        released = watch.push(HeldStep(meta.text_deltas.get(rid) or "", tuple(meta.new_token_ids.get(rid, ())),
                                       tensors))
        if req.finished and not watch.stopped:
            released += watch.flush()
        text = "".join(s.text for s in released)
        ids = [t for s in released[:-1] for t in s.ids]
        if released and (released[-1].text or not watch.stopped):  # the token a stop begins in, if it kept text
            ids += released[-1].ids
        self._send(ctx, req, stage_id, local, text if released else None, ids)
        if next_ar is not None and not ctx.audio_reason:
            for s in released:
                if s.tensors:
                    ctx.upstream_tokens += 1
                    for key, t in s.tensors.items():
                        ctx.handoff.setdefault(key, []).append(t)
            if released and self._streamed[next_ar.stage_id] and not req.finished and not watch.stopped:
                self._stream_to(next_ar, ctx)
        if watch.stopped:
            stage = next(s for s in self.ar_configs if s.stage_id == stage_id)
            try:
                self.backends[stage.name].abort(rid)  # the text ends here
            except Exception:  # noqa: BLE001 -- the request goes on without it
                logger.exception("stage %s: stopping request %s at its stop sequence failed", stage.name, rid)
            self._finished(ctx, stage_id, next_ar, STOP)
        elif req.finished:
            self._finished(ctx, stage_id, next_ar, meta.finished.get(rid, STOP))

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
        with self.requests.lock:  # an upstream stage still producing (streamed input) stops too
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
            self.fail_requests([rid], exc)
            return False
        except Exception as exc:  # noqa: BLE001 -- this request ends, the others go on
            logger.error("stage %s could not %s request %s", stage.name, what, rid, exc_info=exc)
            self.fail_requests([rid], OmniError(f"stage {stage.name} could not {what} the request"))
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
            ctx.spec, conditioning=cond, max_tokens=ctx.audio_frames, streaming=streaming, audio=(), images=()
        )  # the media inputs were the first stage's (the image grids stay: the talker's positions)
        ctx.handovers = 1
        ctx.upstream_open = streaming
        backend = self.backends[stage.name]
        # a stage process takes it without the routing waiting for its answer
        # (a refusal fails the request all the same)
        start = getattr(backend, "hand_over", backend.add_request)
        if not self._stage_call(stage, rid, "start", lambda: start(spec)):
            return
        if not self.live(rid):  # aborted while it was being handed over
            backend.abort(rid)
            return
        self.runners[stage.stage_id].notify()

    def emit_audio(self, request_id: str, audio: np.ndarray, last: bool, reason: str) -> None:
        ctx = self.requests.get(request_id)
        if ctx is None or ctx.done:
            return
        if ctx.first_audio_s is None and audio.size:
            ctx.first_audio_s = time.perf_counter()
        ctx.audio_samples += int(audio.size)
        if last:
            with self.requests.lock:
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
            ctx.sink(resp)

    def _complete(self, ctx: RequestContext, resp: decoder_pb2.GenerateResponse) -> None:
        if not self.requests.complete(ctx.spec.request_id):
            return
        ctx.done = True
        metrics.REQUESTS.labels("finished").inc()
        ctx.sink(resp)
