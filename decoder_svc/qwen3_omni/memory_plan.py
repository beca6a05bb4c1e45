"""The memory plan: what each stage will hold, computed before any engine starts.

For each AR stage (its resolved engine settings, ``engine.stage_settings``)
and for code2wav:

- **weights**: the elements of its tensors (``thinker.*``, ``talker.*``,
  ``code2wav.*``, from the shards' headers, nothing loaded) at the dtype it
  runs in (code2wav: its own dtype, one copy per worker process); on CPU an AR
  stage's token embedding and LM head count twice (``CPU_PACKED``: vLLM's CPU
  GEMM keeps their weights and a packed copy for its matrix products);
- **KV cache**: on CPU its ``kv_cache_memory``; on CUDA what its
  ``gpu_memory_utilization`` share leaves after weights and activations;
- **activations**: an estimate, 16 hidden-size rows per batched token plus
  two float32 rows of logits per request of a step;
- **runtime**: a process's own footprint (interpreter, torch, vLLM), as
  measured here on CPU (``RUNTIME_BYTES``).

On CPU everything adds up against the host's available memory; on CUDA each
device's stages' shares must add up to at most ``MAX_DEVICE_SHARE`` and each
share must hold the stage's weights, activations and one full-context
request's KV. A plan that does not fit is refused with the numbers and what
to change (:class:`PlanRefused`). ``MemoryPlan.lines`` is the printed plan.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from decoder_svc.engine_settings import EffectiveSettings
from omni_common.errors import FailedPreconditionError

from .checkpoint import OmniCheckpoint

__all__ = ["MemoryPlan", "PlanRefused", "StageMemory", "plan_memory", "RUNTIME_BYTES", "MAX_DEVICE_SHARE"]

GiB = 2**30
# A process's own resident memory with no model weights in it, measured on
# CPU with the tiny checkpoint (tests/test_soak.py's processes): a stage
# process ~690 MiB (torch, vLLM, its engine's buffers), the decoder ~370 MiB,
# a code2wav worker ~370 MiB.
RUNTIME_BYTES = {"stage": 700 * 2**20, "decoder": 400 * 2**20, "code2wav": 400 * 2**20}
# vLLM takes its share of the device's total memory; what the shares of the
# stages on one device may add up to (the rest: CUDA contexts, code2wav, torch).
MAX_DEVICE_SHARE = 0.95
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Per AR role, the vocabulary-sized layers vLLM builds as VocabParallelEmbedding:
# on CPU each keeps its weight beside the packed copy its GEMM uses
# (vllm/model_executor/layers/vocab_parallel_embedding.py, remove_weight=False).
CPU_PACKED = {"thinker": ("thinker.model.embed_tokens.", "thinker.lm_head."),
              "talker": ("talker.model.codec_embedding.", "talker.codec_head.")}


class PlanRefused(FailedPreconditionError):
    """The plan does not fit: the message names the stage, the numbers and what to change."""

    def __init__(self, message: str) -> None:
        super().__init__(f"memory plan: {message}")


@dataclass(frozen=True)
class StageMemory:
    name: str
    device: str  # "cpu" | "cuda" | "cuda:N"
    weights: int
    kv: int
    activations: int
    runtime: int
    copies: int = 1  # code2wav: one per worker process
    share: float = 0.0  # CUDA: the stage's gpu_memory_utilization

    @property
    def total(self) -> int:
        return (self.weights + self.activations + self.runtime) * self.copies + self.kv


@dataclass
class MemoryPlan:
    stages: list[StageMemory]
    host_available: int
    device_totals: dict[str, int] = field(default_factory=dict)
    host_needed: int = 0

    def lines(self) -> list[str]:
        out = [f"memory plan ({len(self.stages)} stages):"]
        for s in self.stages:
            copies = f" x {s.copies} processes" if s.copies > 1 else ""
            share = f", share {s.share:g} of {_gib(self.device_totals.get(_device_key(s.device), 0))}" \
                if s.device != "cpu" else ""
            out.append(f"  {s.name:<9} on {s.device:<7} weights {_gib(s.weights)}{copies}, KV {_gib(s.kv)}, "
                       f"activations ~{_gib(s.activations)}, runtime ~{_gib(s.runtime)}{share}: "
                       f"{_gib(s.total)}")
        out.append(f"  host: {_gib(self.host_needed)} needed of {_gib(self.host_available)} available")
        return out


def _gib(n: int | float) -> str:
    return f"{n / GiB:.2f} GiB"


def _device_key(device: str) -> str:
    return "cuda:0" if device == "cuda" else device


def _ar_memory(checkpoint: OmniCheckpoint, name: str, role: str, eff: EffectiveSettings,
               device_totals: Mapping[str, int]) -> StageMemory:
    cfg = checkpoint.thinker_config if role == "thinker" else checkpoint.talker_config
    text = cfg["text_config"]
    width = _DTYPE_BYTES[eff.dtype]
    weights = checkpoint.numel(f"{role}.") * width
    hidden, vocab = int(text["hidden_size"]), int(text["vocab_size"])
    activations = eff.max_num_batched_tokens * hidden * width * 16 + eff.max_num_seqs * vocab * 4 * 2
    if not eff.on_cuda:
        weights += sum(checkpoint.numel(prefix) for prefix in CPU_PACKED.get(role, ())) * width
        return StageMemory(name, "cpu", weights, eff.kv_cache_memory, activations, RUNTIME_BYTES["stage"])
    total = device_totals.get(_device_key(eff.device), 0)
    kv = max(int(eff.gpu_memory_utilization * total) - weights - activations, 0)
    return StageMemory(name, eff.device, weights, kv, activations, 0, share=eff.gpu_memory_utilization)


def _check_vocoder_device(vocoder: StageMemory, ar: list[tuple[StageMemory, EffectiveSettings]],
                          device_totals: Mapping[str, int]) -> None:
    """Code2wav on a CUDA device: its weights (one copy per worker) fit in
    what the AR stages' shares leave on that device, less a margin for the
    processes' CUDA contexts (MAX_DEVICE_SHARE)."""
    device = _device_key(vocoder.device)
    total = device_totals.get(device, 0)
    if total <= 0:
        raise PlanRefused(f"{device}: its total memory is not known (is the device there?)")
    shares = sum(s.share for s, _ in ar if s.device != "cpu" and _device_key(s.device) == device)
    room = int((MAX_DEVICE_SHARE - shares) * total)
    if vocoder.total > room:
        raise PlanRefused(
            f"code2wav on {device}: {vocoder.copies} cop{'y' if vocoder.copies == 1 else 'ies'} of its weights "
            f"{_gib(vocoder.total)} do not fit in the {_gib(max(room, 0))} the AR stages' shares ({shares:.2f}) "
            f"leave: lower their gpu_memory_utilization, use fewer code2wav workers, or put code2wav on "
            "another device (engine setting code2wav.device)")


def plan_memory(
    checkpoint: OmniCheckpoint,
    stages: list[tuple[str, str, EffectiveSettings]],
    *,
    code2wav_workers: int,
    host_available: int,
    device_totals: Mapping[str, int] | None = None,
    kv_bytes_per_token: Mapping[str, int] | None = None,
    code2wav: tuple[str, str] = ("cpu", "float32"),
) -> MemoryPlan:
    """The plan of `stages` ((name, role, resolved settings) per AR stage)
    and code2wav (on its (device, dtype), one copy of its weights per worker
    process, `code2wav_workers`; 0: on a thread of the decoder). Raises
    PlanRefused when it does not fit.
    ``device_totals``: each CUDA device's total memory ("cuda:N"); ``kv_bytes_per_token``:
    per stage name, to check a share holds one full-context request."""
    device_totals = dict(device_totals or {})
    kv_per_token = dict(kv_bytes_per_token or {})
    plan_stages = [_ar_memory(checkpoint, name, role, eff, device_totals) for name, role, eff in stages]
    copies = max(code2wav_workers, 1)
    c2w_device, c2w_dtype = code2wav
    c2w_runtime = RUNTIME_BYTES["code2wav"] if code2wav_workers else 0
    vocoder = StageMemory("code2wav", c2w_device, checkpoint.numel("code2wav.") * _DTYPE_BYTES[c2w_dtype], 0, 0,
                          c2w_runtime if c2w_device == "cpu" else 0, copies=copies)
    plan_stages.append(vocoder)
    plan = MemoryPlan(plan_stages, host_available, device_totals)
    host = RUNTIME_BYTES["decoder"] + sum(
        s.total if s.device == "cpu" else RUNTIME_BYTES["stage"] for s in plan_stages if s is not vocoder)
    host += vocoder.total if c2w_device == "cpu" else c2w_runtime * copies
    plan.host_needed = host

    by_device: dict[str, list[tuple[StageMemory, EffectiveSettings]]] = {}
    for s, (_, _, eff) in zip(plan_stages, stages, strict=False):
        if s.device != "cpu":
            by_device.setdefault(_device_key(s.device), []).append((s, eff))
    for device, members in sorted(by_device.items()):
        total = device_totals.get(device, 0)
        if total <= 0:
            raise PlanRefused(f"{device}: its total memory is not known (is the device there?)")
        shares = sum(s.share for s, _ in members)
        names = ", ".join(f"{s.name} {s.share:g}" for s, _ in members)
        if shares > MAX_DEVICE_SHARE:
            raise PlanRefused(f"{device}: the stages' gpu_memory_utilization add up to {shares:.2f} ({names}), "
                              f"above {MAX_DEVICE_SHARE:g}: lower them (engine setting gpu_memory_utilization) "
                              "or put a stage on another device (engine setting device)")
        for s, eff in members:
            need_kv = eff.max_model_len * kv_per_token.get(s.name, 0)
            if s.kv < need_kv or s.kv <= 0:
                need = s.weights + s.activations + need_kv
                raise PlanRefused(
                    f"stage {s.name} on {device}: its share {s.share:g} is {_gib(s.share * total)}, below its "
                    f"weights {_gib(s.weights)} + activations ~{_gib(s.activations)} + one "
                    f"{eff.max_model_len}-token request's KV {_gib(need_kv)} = {_gib(need)}: raise its "
                    f"gpu_memory_utilization to at least {need / total:.2f}, lower max_model_len or "
                    "max_num_batched_tokens, or choose a smaller dtype or quantization")
    if c2w_device != "cpu":  # after the stages' own checks: their shares are right
        _check_vocoder_device(vocoder, [(s, eff) for s, (_, _, eff) in zip(plan_stages, stages, strict=False)],
                              device_totals)
    if host > host_available:
        worst = max((s for s in plan_stages if s.device == "cpu"), key=lambda s: s.total)
        raise PlanRefused(
            f"the host needs {_gib(host)} and has {_gib(host_available)} available; the largest part is "
            f"{worst.name} ({_gib(worst.total)}: weights {_gib(worst.weights)}, KV {_gib(worst.kv)}): lower "
            "kv_cache_memory (engine setting), use fewer code2wav workers, or choose a smaller dtype")
    return plan
