"""Per-request state of the decoder: ``RequestContext``, its ``Sink``, and the table of running requests.

A request lives in the ``RequestTable`` from ``Pipeline.submit`` until it
completes (routing), is aborted or fails; whoever takes it out of the table
sends its last response, so a request ends exactly once. The table's lock
also guards the fields of a request that two threads change
(``upstream_open``, ``audio_reason``: the routing of the upstream stage and
code2wav's emit).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from decoder_svc.backend import RequestSpec
from decoder_svc.lengths import RepetitionGuard
from decoder_svc.stops import StopWatch
from omni_common.errors import AlreadyExistsError, OmniError
from omni_serving.v1 import common_pb2, decoder_pb2

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
    # its stop sequences over the text stage's steps (decoder_svc.stops; None: none)
    stop_watch: StopWatch | None = None

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
            prompt_tokens=len(self.spec.prompt_token_ids),
        )


class RequestTable:
    """The running requests, by id (any thread; one lock, ``lock``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._requests: dict[str, RequestContext] = {}
        # running requests without a multimodal output: no inter-stage payload
        self.text_only: frozenset[str] = frozenset()
        self.finished = 0
        self.aborted = 0

    def add(self, ctx: RequestContext) -> None:
        """A new request; AlreadyExistsError when its id is running."""
        rid = ctx.spec.request_id
        with self.lock:
            if rid in self._requests:
                raise AlreadyExistsError(f"request_id: {rid!r} is already running")
            self._requests[rid] = ctx
            if not ctx.spec.modality.has_multimodal:
                self.text_only = self.text_only | {rid}

    def discard(self, request_id: str) -> None:
        """Forget a request the first stage refused (nothing of it stays)."""
        with self.lock:
            self._requests.pop(request_id, None)
            self.text_only = self.text_only - {request_id}

    def abort(self, request_id: str) -> RequestContext | None:
        """Take out a request the client aborted (None: it is not running)."""
        with self.lock:
            ctx = self._requests.pop(request_id, None)
            if ctx is not None:
                self.aborted += 1
                self.text_only = self.text_only - {request_id}
        return ctx

    def complete(self, request_id: str) -> bool:
        """Take out a request that finished; False when it had ended already."""
        with self.lock:
            if self._requests.pop(request_id, None) is None:
                return False
            self.text_only = self.text_only - {request_id}
            self.finished += 1
        return True

    def pop_many(self, request_ids: list[str]) -> list[RequestContext]:
        """Take out those of these requests that still run."""
        with self.lock:
            popped = [self._requests.pop(rid, None) for rid in request_ids]
            contexts = [c for c in popped if c is not None]
            if contexts:
                self.text_only = self.text_only - {c.spec.request_id for c in contexts}
        return contexts

    def pop_all(self) -> list[RequestContext]:
        """Take out every running request (stopping)."""
        with self.lock:
            contexts = list(self._requests.values())
            self._requests.clear()
        return contexts

    def ids(self) -> list[str]:
        with self.lock:
            return list(self._requests)

    def get(self, request_id: str) -> RequestContext | None:
        with self.lock:
            return self._requests.get(request_id)

    def live(self, request_id: str) -> bool:
        """The request still runs."""
        ctx = self.get(request_id)
        return ctx is not None and not ctx.done

    def __len__(self) -> int:
        with self.lock:
            return len(self._requests)

    def audio_requests(self) -> int:
        """Running requests with a multimodal output (audio)."""
        with self.lock:
            return len(self._requests) - len(self.text_only)

    def downstream(self, request_ids: list[str]) -> list[str]:
        """Requests whose payload the next stage wants this step (those with audio).

        Runs on the critical path: without text-only requests in flight (the
        usual case) it is the batch itself, no loop.
        """
        text_only = self.text_only
        if not text_only:
            return request_ids
        return [rid for rid in request_ids if rid not in text_only]
