"""Engine settings of an AR stage: what its vLLM engine is built with.

Each AR stage of a profile may carry an ``engine:`` mapping (docs/profiles.md,
"Engine settings"); a deployment overrides any key without editing the
profile, with ``--engine-set [STAGE.]KEY=VALUE`` on the decoder (repeatable;
no ``STAGE.``: every AR stage), the ``OMNI_ENGINE_SET`` environment variable
(the same items, separated by commas) or ``engine_set`` in an ``up`` config
file. Later sources win: profile, then environment, then command line.

Two steps, both refusing a bad value with the key that holds it and the
allowed range:

- :func:`parse_settings` checks what was written (types and ranges), before
  anything starts; ``"auto"`` stays ``"auto"``.
- :func:`resolve` turns the settings into the values the engine is built
  with, once the device and the checkpoint are known (``EffectiveSettings``):
  ``dtype: auto`` is the checkpoint's on CUDA, on CPU bfloat16 where the
  processor has it, else float32; ``max_model_len: auto`` is the checkpoint's
  context, reduced to what the KV budget holds (logged); ``enforce_eager:
  auto`` is eager on CPU and CUDA graphs on CUDA.

``EffectiveSettings.vllm_kwargs`` is what reaches vLLM's ``EngineArgs``;
``EffectiveSettings.report`` is what ``GetDecoderInfo`` and ``/v1/models``
show.

The generation stage (code2wav, not on vLLM) takes two of the keys,
``device`` and ``dtype`` (:data:`VOCODER_KEYS`, :func:`resolve_vocoder`); an
override item without ``STAGE.`` reaches it for those two keys only.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from omni_common.errors import InvalidArgumentError

__all__ = [
    "AUTO",
    "DTYPES",
    "ENV_VAR",
    "EffectiveSettings",
    "EngineSettings",
    "apply_overrides",
    "check_placement",
    "cpu_has_bf16",
    "cuda_index",
    "visible_devices",
    "parse_overrides",
    "parse_settings",
    "share_a_device",
    "resolve",
    "resolve_vocoder",
    "check_vocoder_keys",
    "VOCODER_KEYS",
]

log = logging.getLogger(__name__)

AUTO = "auto"
ENV_VAR = "OMNI_ENGINE_SET"
DTYPES = ("auto", "float32", "bfloat16", "float16")
_TORCH_DTYPES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16", "float16": "float16",
                 "half": "float16"}
MAX_NUM_SEQS_RANGE = (1, 1024)
MIN_MODEL_LEN = 16
MIN_KV_BYTES = 64 * 2**10  # a sanity floor; resolve() checks the budget holds the context
KV_BLOCK_ROUNDING = 256
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


@dataclass(frozen=True)
class EngineSettings:
    """An AR stage's engine settings as written (``"auto"`` or a value)."""

    dtype: str = AUTO
    max_model_len: int | str = AUTO
    max_num_seqs: int = 64
    max_num_batched_tokens: int | str = AUTO
    enable_chunked_prefill: bool = True
    kv_cache_memory: int = 64 * 2**20  # bytes of KV cache on CPU
    gpu_memory_utilization: float = 0.9  # the share of the device's memory on CUDA
    enforce_eager: bool | str = AUTO
    quantization: str = ""  # "" = none (vLLM reads the checkpoint's own, if any)
    device: str = AUTO  # auto | cpu | cuda | cuda:N

    def report(self) -> dict[str, str]:
        return {f.name: _text(getattr(self, f.name)) for f in dataclasses.fields(self)}


KEYS = tuple(f.name for f in dataclasses.fields(EngineSettings))


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _bytes(key: str, value: Any) -> int:
    if isinstance(value, bool):
        raise InvalidArgumentError(key, f"must be a size in bytes (e.g. 67108864, 64MiB, 2GiB), got {value!r}")
    if isinstance(value, int):
        n = value
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
        if m is None or m.group(2).lower() not in _UNITS:
            raise InvalidArgumentError(key, f"must be a size in bytes (e.g. 67108864, 64MiB, 2GiB), got {value!r}")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n < MIN_KV_BYTES:
        raise InvalidArgumentError(key, f"must be at least {MIN_KV_BYTES} bytes (64 KiB), got {n}")
    return n


def _int(key: str, value: Any, low: int, high: int | None = None, *, auto: bool = False) -> int | str:
    if auto and isinstance(value, str) and value.strip().lower() == AUTO:
        return AUTO
    if isinstance(value, str) and re.fullmatch(r"\s*\d+\s*", value):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        allowed = f"an integer in [{low}, {high}]" if high is not None else f"an integer >= {low}"
        raise InvalidArgumentError(key, f"must be {allowed}{' or auto' if auto else ''}, got {value!r}")
    return value


def _bool(key: str, value: Any, *, auto: bool = False) -> bool | str:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if auto and text == AUTO:
        return AUTO
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise InvalidArgumentError(key, f"must be true or false{' or auto' if auto else ''}, got {value!r}")


def _check_value(key: str, name: str, value: Any) -> Any:
    """`value` of setting `name`, checked (`key`: the name the error gives)."""
    if name == "dtype":
        text = str(value).strip().lower()
        text = _TORCH_DTYPES.get(text, text)
        if text not in DTYPES:
            raise InvalidArgumentError(key, f"must be one of {', '.join(DTYPES)}, got {value!r}")
        return text
    if name == "max_model_len":
        return _int(key, value, MIN_MODEL_LEN, auto=True)
    if name == "max_num_seqs":
        return _int(key, value, *MAX_NUM_SEQS_RANGE)
    if name == "max_num_batched_tokens":
        return _int(key, value, 1, auto=True)
    if name == "enable_chunked_prefill":
        return _bool(key, value)
    if name == "kv_cache_memory":
        return _bytes(key, value)
    if name == "gpu_memory_utilization":
        try:
            share = float(value)
        except (TypeError, ValueError):
            share = -1.0
        if isinstance(value, bool) or not 0.0 < share <= 1.0:
            raise InvalidArgumentError(key, f"must be a share of the device's memory in (0, 1], got {value!r}")
        return share
    if name == "enforce_eager":
        return _bool(key, value, auto=True)
    if name == "quantization":
        return "" if value is None else str(value).strip()
    if name == "device":
        text = str(value).strip().lower()
        if not _DEVICE.match(text):
            raise InvalidArgumentError(key, f"must be auto, cpu, cuda or cuda:N, got {value!r}")
        return text
    raise InvalidArgumentError(key, f"unknown engine setting {name!r}; known: {', '.join(KEYS)}")


def parse_settings(raw: Mapping[str, Any] | None, where: str, base: EngineSettings | None = None) -> EngineSettings:
    """`raw` (a profile's ``engine:`` mapping) over `base`, checked; errors name ``<where>.<key>``."""
    base = base or EngineSettings()
    if raw is None:
        return base
    if not isinstance(raw, Mapping):
        raise InvalidArgumentError(where, f"must be a mapping of engine settings, got {type(raw).__name__}")
    values = {name: _check_value(f"{where}.{name}", name, value) for name, value in raw.items()}
    return _consistent(dataclasses.replace(base, **values), where)


def _consistent(s: EngineSettings, where: str) -> EngineSettings:
    if isinstance(s.max_num_batched_tokens, int) and s.max_num_batched_tokens < s.max_num_seqs:
        raise InvalidArgumentError(
            f"{where}.max_num_batched_tokens",
            f"must be at least max_num_seqs ({s.max_num_seqs}): every running request takes a token per step, "
            f"got {s.max_num_batched_tokens}")
    return s


def parse_overrides(items: Iterable[str], source: str) -> list[tuple[str, str, str]]:
    """``[STAGE.]KEY=VALUE`` items: (stage or "", key, value); `source` names where they came from."""
    out = []
    for item in items:
        item = item.strip()
        if not item:
            continue
        name, eq, value = item.partition("=")
        stage, dot, key = name.strip().rpartition(".")
        if not eq or not key:
            raise InvalidArgumentError(source, f"expected [STAGE.]KEY=VALUE, got {item!r}")
        if key not in KEYS:
            raise InvalidArgumentError(f"{source} {name.strip()}",
                                       f"unknown engine setting {key!r}; known: {', '.join(KEYS)}")
        out.append((stage, key, value.strip()))
    return out


def env_overrides(environ: Mapping[str, str] | None = None) -> list[tuple[str, str, str]]:
    """The overrides in ``OMNI_ENGINE_SET`` (comma-separated items)."""
    raw = (environ if environ is not None else os.environ).get(ENV_VAR, "")
    return parse_overrides(raw.split(","), ENV_VAR)


def apply_overrides(stages: Mapping[str, EngineSettings], overrides: Iterable[tuple[str, str, str]],
                    source: str) -> dict[str, EngineSettings]:
    """`stages` (AR stage name -> settings) with `overrides` applied in order."""
    out = dict(stages)
    for stage, key, value in overrides:
        names = [stage] if stage else list(out)
        if stage and stage not in out:
            raise InvalidArgumentError(f"{source} {stage}.{key}",
                                       f"no AR stage {stage!r} in this profile; its AR stages: {', '.join(out)}")
        for name in names:
            where = f"{source} {name}.{key}" if stage else f"{source} {key}"
            out[name] = _consistent(dataclasses.replace(out[name], **{key: _check_value(where, key, value)}),
                                    f"{source} {name}")
    return out


VOCODER_KEYS = ("device", "dtype")
"""The engine settings the generation stage (code2wav) takes."""


def check_vocoder_keys(keys: Iterable[str], where: str, stage: str) -> None:
    """Refuse a key of the generation stage's settings other than :data:`VOCODER_KEYS`."""
    for key in keys:
        if key not in VOCODER_KEYS:
            raise InvalidArgumentError(f"{where}.{key}", f"stage {stage}: the generation stage (code2wav, not on "
                                       f"vLLM) takes {' and '.join(VOCODER_KEYS)} only")


def _placed(settings: EngineSettings, stage: str, platform: str, why_not_cuda: str) -> str:
    """``settings.device`` on `platform`: ``auto`` is ``cuda`` there, else
    ``cpu``; a CUDA device where there is none is refused (`why_not_cuda`)."""
    device = settings.device
    if device == AUTO:
        device = "cuda" if platform == "cuda" else "cpu"
    if device.startswith("cuda") and platform != "cuda":
        raise InvalidArgumentError(f"engine.{stage}.device", f"stage {stage}: {device!r} asked for, but {why_not_cuda}")
    return device


def resolve_vocoder(settings: EngineSettings, *, stage: str, platform: str) -> tuple[str, str]:
    """(device, dtype) the generation stage's vocoder runs in, on `platform`
    ("cuda" where torch sees a CUDA device in the decoder's process, else
    "cpu"): ``device: auto`` is ``cuda`` (the first device the process sees)
    there, else ``cpu``; ``dtype: auto`` is bfloat16 on CUDA and float32 on
    CPU (where the vocoder's parity is measured)."""
    device = _placed(settings, stage, platform, "the decoder's process sees no CUDA device")
    dtype = settings.dtype
    if dtype == AUTO:
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    if dtype == "float16" and not device.startswith("cuda"):
        raise InvalidArgumentError(f"engine.{stage}.dtype", f"stage {stage}: float16 runs on CUDA only; "
                                   "on CPU use float32 or bfloat16")
    return device, dtype


def cuda_index(device: str) -> int | None:
    """N of ``cuda:N``; None for any other device."""
    return int(device.split(":", 1)[1]) if device.startswith("cuda:") else None


def visible_devices(device: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The ``CUDA_VISIBLE_DEVICES`` a stage process on `device` sets before
    it loads vLLM (vLLM builds its engine on the first visible device):
    ``cuda:N`` is the N-th device this process may see (the N-th entry of
    an inherited ``CUDA_VISIBLE_DEVICES``, else device N). None: leave it."""
    index = cuda_index(device)
    if index is None:
        return None
    inherited = (environ if environ is not None else os.environ).get("CUDA_VISIBLE_DEVICES")
    if inherited is None or not inherited.strip():
        return str(index)
    entries = [e.strip() for e in inherited.split(",") if e.strip()]
    if index >= len(entries):
        raise InvalidArgumentError("engine.device", f"cuda:{index} asked for, but CUDA_VISIBLE_DEVICES={inherited!r} "
                                   f"gives this process {len(entries)} device(s)")
    return entries[index]


def check_placement(stages: Iterable[tuple[str, EngineSettings, int]], *, own_processes: bool) -> None:
    """Refuse a ``cuda:N`` the decoder cannot honour: the stages
    ((name, settings, tensor parallel size)) run in the decoder's own process
    (one CUDA context: device 0 of what it sees), or the stage is split over
    several devices (its ranks take the first ones it sees)."""
    for name, settings, tp in stages:
        index = cuda_index(settings.device)
        if index is None:
            continue
        if not own_processes and index != 0:
            raise InvalidArgumentError(f"engine.{name}.device", f"stage {name}: {settings.device} needs the stage in "
                                       "a process of its own (--stage-processes on); in the decoder's process "
                                       "every stage is on cuda:0")
        if tp > 1:
            raise InvalidArgumentError(f"engine.{name}.device", f"stage {name}: {settings.device} names one device, "
                                       f"but tensor_parallel_size={tp} spreads the stage over {tp}: leave device "
                                       "auto and choose the devices with CUDA_VISIBLE_DEVICES")


def share_a_device(devices: Iterable[str], platform: str) -> bool:
    """Whether two of the AR stages' `devices` (their ``device`` settings,
    ``auto`` included) are the same CUDA device on `platform`."""
    if platform != "cuda":
        return False
    keys = ["cuda:0" if d in (AUTO, "cuda") else d for d in devices]
    keys = [k for k in keys if k.startswith("cuda")]
    return len(keys) != len(set(keys))


def cpu_has_bf16() -> bool:
    """Whether this processor computes bfloat16 natively (AVX512-BF16 or AMX on
    x86; bf16 on Arm), which is where vLLM's CPU kernels run bfloat16."""
    import torch

    try:
        if torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported():
            return True
    except AttributeError:
        pass
    return bool(torch.cpu.get_capabilities().get("bf16", False)) if hasattr(torch.cpu, "get_capabilities") else False


@dataclass(frozen=True)
class EffectiveSettings:
    """What an AR stage's engine is built with (every ``auto`` resolved)."""

    device: str  # "cpu" | "cuda" | "cuda:N"
    dtype: str
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    kv_cache_memory: int  # bytes (CPU)
    gpu_memory_utilization: float  # share (CUDA)
    enforce_eager: bool
    quantization: str
    notes: tuple[str, ...] = ()  # what was reduced or chosen, and why

    @property
    def on_cuda(self) -> bool:
        return self.device.startswith("cuda")

    def vllm_kwargs(self) -> dict[str, Any]:
        """vLLM ``EngineArgs`` keyword arguments."""
        kwargs: dict[str, Any] = dict(
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_chunked_prefill=self.enable_chunked_prefill,
            enforce_eager=self.enforce_eager,
        )
        if self.on_cuda:
            kwargs["gpu_memory_utilization"] = self.gpu_memory_utilization
        else:
            kwargs["kv_cache_memory_bytes"] = self.kv_cache_memory
        if self.quantization:
            kwargs["quantization"] = self.quantization
        return kwargs

    def report(self) -> dict[str, str]:
        """The settings as text, by key (``GetDecoderInfo``, ``/v1/models``)."""
        out = {
            "device": self.device,
            "dtype": self.dtype,
            "max_model_len": str(self.max_model_len),
            "max_num_seqs": str(self.max_num_seqs),
            "max_num_batched_tokens": str(self.max_num_batched_tokens),
            "enable_chunked_prefill": _text(self.enable_chunked_prefill),
            "enforce_eager": _text(self.enforce_eager),
            "quantization": self.quantization or "none",
        }
        if self.on_cuda:
            out["gpu_memory_utilization"] = f"{self.gpu_memory_utilization:g}"
        else:
            out["kv_cache_memory"] = str(self.kv_cache_memory)
        return out


def resolve(
    settings: EngineSettings,
    *,
    stage: str,
    platform: str,
    checkpoint_dtype: str,
    checkpoint_context: int,
    kv_elements_per_token: int,
    bf16_cpu: bool | None = None,
) -> EffectiveSettings:
    """`settings` made concrete for `stage` on `platform` ("cpu" or "cuda",
    what vLLM runs on here). ``checkpoint_dtype``: the checkpoint's
    ``torch_dtype``; ``checkpoint_context``: its ``max_position_embeddings``;
    ``kv_elements_per_token``: the KV cache elements one token takes (all
    layers); ``bf16_cpu``: whether this processor computes bfloat16 (None:
    ask it)."""
    notes: list[str] = []
    device = _placed(settings, stage, platform, f"vLLM runs on {platform} here")
    if device == "cpu" and platform == "cuda":
        raise InvalidArgumentError(f"engine.{stage}.device",
                                   f"stage {stage}: 'cpu' asked for, but this vLLM build runs on CUDA")
    on_cuda = device.startswith("cuda")

    dtype = settings.dtype
    if dtype == AUTO:
        if on_cuda:
            dtype = _TORCH_DTYPES.get(checkpoint_dtype, "bfloat16")
            notes.append(f"dtype auto: the checkpoint's ({dtype})")
        else:
            has_bf16 = cpu_has_bf16() if bf16_cpu is None else bf16_cpu
            dtype = "bfloat16" if has_bf16 else "float32"
            notes.append(f"dtype auto: {dtype} (this processor {'has' if has_bf16 else 'lacks'} bfloat16)")
    if dtype == "float16" and not on_cuda:
        raise InvalidArgumentError(f"engine.{stage}.dtype", f"stage {stage}: float16 runs on CUDA only; "
                                   "on CPU use float32 or bfloat16")

    kv_bytes_per_token = max(int(kv_elements_per_token), 1) * (4 if dtype == "float32" else 2)
    budget_tokens = 0
    if not on_cuda:
        # vLLM holds the cache in whole blocks (16 to 256 tokens by backend) and keeps one back (its null block)
        blocks = settings.kv_cache_memory // kv_bytes_per_token // KV_BLOCK_ROUNDING
        budget_tokens = max(blocks - 1, 0) * KV_BLOCK_ROUNDING
    if settings.max_model_len == AUTO:
        max_model_len = int(checkpoint_context)
        if not on_cuda and budget_tokens < max_model_len:
            notes.append(f"max_model_len auto: the checkpoint's {checkpoint_context} tokens reduced to the "
                         f"{budget_tokens} the KV budget holds ({settings.kv_cache_memory} bytes at "
                         f"{kv_bytes_per_token} bytes per token)")
            max_model_len = budget_tokens
        else:
            notes.append(f"max_model_len auto: the checkpoint's {checkpoint_context} tokens")
    else:
        max_model_len = int(settings.max_model_len)
        if max_model_len > checkpoint_context:
            raise InvalidArgumentError(f"engine.{stage}.max_model_len",
                                       f"stage {stage}: {max_model_len} exceeds the checkpoint's context "
                                       f"({checkpoint_context} tokens)")
        if not on_cuda and budget_tokens < max_model_len:
            need = (-(-max_model_len // KV_BLOCK_ROUNDING) + 1) * KV_BLOCK_ROUNDING * kv_bytes_per_token
            raise InvalidArgumentError(
                f"engine.{stage}.kv_cache_memory",
                f"stage {stage}: {settings.kv_cache_memory} bytes hold {budget_tokens} tokens "
                f"({kv_bytes_per_token} bytes each, less a block the engine keeps back), below max_model_len "
                f"{max_model_len}: raise kv_cache_memory to at least {need} or lower max_model_len")
    if max_model_len < MIN_MODEL_LEN:
        raise InvalidArgumentError(f"engine.{stage}.kv_cache_memory",
                                   f"stage {stage}: the KV budget holds {budget_tokens} tokens, below the "
                                   f"minimum context of {MIN_MODEL_LEN}")

    if settings.max_num_batched_tokens == AUTO:
        # without chunked prefill a prompt is prefilled in one step: the step
        # takes the longest prompt there is
        batched = max(max_model_len, settings.max_num_seqs) if not settings.enable_chunked_prefill else max(
            2048, settings.max_num_seqs)
    else:
        batched = int(settings.max_num_batched_tokens)
        if not settings.enable_chunked_prefill and batched < max_model_len:
            raise InvalidArgumentError(
                f"engine.{stage}.max_num_batched_tokens",
                f"stage {stage}: without chunked prefill a step must hold a whole prompt: at least "
                f"max_model_len ({max_model_len}), got {batched}")

    eager = settings.enforce_eager
    if eager == AUTO:
        eager = not on_cuda
    return EffectiveSettings(
        device=device,
        dtype=dtype,
        max_model_len=max_model_len,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=batched,
        enable_chunked_prefill=settings.enable_chunked_prefill,
        kv_cache_memory=settings.kv_cache_memory,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        enforce_eager=bool(eager),
        quantization=settings.quantization,
        notes=tuple(notes),
    )
