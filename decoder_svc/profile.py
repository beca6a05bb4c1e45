"""Deploy profiles: the stage pipeline a decoder runs, loaded from YAML.

Profiles ship inside the package (decoder_svc/profiles/*.yaml) and can also be
given as a path. docs/profiles.md documents every key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from omni_common.errors import InvalidArgumentError
from omni_serving.v1 import materializer_pb2

PROFILE_DIR = Path(__file__).parent / "profiles"

_DEST = {
    "inter_stage": materializer_pb2.PAYLOAD_DESTINATION_INTER_STAGE,
    "client": materializer_pb2.PAYLOAD_DESTINATION_CLIENT,
}
_SEL = {"all": materializer_pb2.ROW_SELECTION_ALL, "last": materializer_pb2.ROW_SELECTION_LAST}
POSTPROCESS_MODES = ("none", "eager", "deferred")


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

    def plan(self) -> materializer_pb2.StagePlan:
        """The stage's payload processing, as the contract states it."""
        plan = materializer_pb2.StagePlan(stage_id=self.stage_id, name=self.name)
        for r in self.routes:
            plan.routes.add(
                source=r["source"], key=r["key"], destination=_DEST[r["destination"]], selection=_SEL[r["selection"]]
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

    def stage(self, name: str) -> StageConfig:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(name)


def available_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def _stage_from_dict(i: int, raw: dict[str, Any]) -> StageConfig:
    where = f"stages[{i}]"
    known = set(StageConfig.__dataclass_fields__)
    unknown = set(raw) - known
    if unknown:
        raise InvalidArgumentError(f"{where}", f"unknown keys {sorted(unknown)}; known: {sorted(known)}")
    for key in ("stage_id", "name", "kind"):
        if key not in raw:
            raise InvalidArgumentError(f"{where}.{key}", "is required")
    if raw["kind"] not in ("ar", "generation"):
        raise InvalidArgumentError(f"{where}.kind", f"must be 'ar' or 'generation', got {raw['kind']!r}")
    if raw.get("postprocess", "none") not in POSTPROCESS_MODES:
        raise InvalidArgumentError(f"{where}.postprocess", f"must be one of {POSTPROCESS_MODES}")
    routes = []
    for j, r in enumerate(raw.get("routes") or ()):
        for key, table in (("destination", _DEST), ("selection", _SEL)):
            if r.get(key) not in table:
                raise InvalidArgumentError(f"{where}.routes[{j}].{key}", f"must be one of {sorted(table)}")
        for key in ("source", "key"):
            if not r.get(key):
                raise InvalidArgumentError(f"{where}.routes[{j}].{key}", "is required")
        routes.append({k: str(r[k]) for k in ("source", "key", "destination", "selection")})
    values = dict(raw)
    values["routes"] = tuple(routes)
    if "initial_chunk_ramp" in values:
        values["initial_chunk_ramp"] = tuple(int(x) for x in values["initial_chunk_ramp"])
    return StageConfig(**values)


def load_profile(name_or_path: str) -> Profile:
    """Load a shipped profile by name ("tts", "omni") or a YAML file by path."""
    path = Path(name_or_path)
    if not path.suffix:
        path = PROFILE_DIR / f"{name_or_path}.yaml"
        if not path.exists():
            raise InvalidArgumentError("profile", f"unknown profile {name_or_path!r}; shipped: {available_profiles()}")
    raw = yaml.safe_load(path.read_text())
    stages = tuple(_stage_from_dict(i, s) for i, s in enumerate(raw.get("stages") or ()))
    if not stages or stages[-1].kind != "generation":
        raise InvalidArgumentError("stages", "a profile ends with a generation stage (code2wav)")
    if [s.stage_id for s in stages] != list(range(len(stages))):
        raise InvalidArgumentError("stages", "stage ids must be 0, 1, 2, ... in order")
    return Profile(
        name=str(raw.get("name", path.stem)),
        async_chunk=bool(raw.get("async_chunk", True)),
        default_modalities=str(raw.get("default_modalities", "audio")),
        stages=stages,
    )
