"""Stand-in checkpoints and vLLM backends for a deploy profile (tests).

- :func:`create_profile_models`: the tiny local checkpoints a profile's AR
  stages need (tts: talker; omni: thinker + talker), written with
  :func:`.standin_models.create_model`; idempotent.
- :func:`build_backends`: one :class:`.standin_backend.StandinBackend` per AR
  stage, configured from the stage's profile settings.

Heavy imports (torch, vllm) happen only inside these functions.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from decoder_svc.profile import Profile, StageConfig, load_profile
from omni_common.errors import InvalidArgumentError
from omni_common.materialize import HIDDEN_STATES, sources_of

from .standin_models import FORMAT_VERSION, STAGE_CONFIG_FILE, read_stage_config

if TYPE_CHECKING:  # pragma: no cover
    from .standin_backend import StandinBackend

__all__ = [
    "DEFAULT_MODEL_SIZES",
    "NGRAM_SPECULATIVE_CONFIG",
    "build_backends",
    "create_profile_models",
    "default_model_root",
    "stage_model_config",
]


# Sizes of the tiny checkpoints (see models.create_model). The thinker and the
# talker share hidden_size: the talker takes thinker hidden rows as prompt embeds.
DEFAULT_MODEL_SIZES: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 128,
    "num_layers": 2,
    "num_codebooks": 16,
}

# Used when a stage sets speculative_decoding: true (thinker only).
NGRAM_SPECULATIVE_CONFIG: dict[str, Any] = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
}


def default_model_root(profile_name: str) -> Path:
    """``$OMNI_SERVING_MODEL_DIR/<profile>`` or ``~/.cache/omni-serving/models/<profile>``
    (``$XDG_CACHE_HOME`` replaces ``~/.cache`` when set)."""
    base = os.environ.get("OMNI_SERVING_MODEL_DIR")
    if base:
        return Path(base) / profile_name
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "omni-serving" / "models" / profile_name


def _profile(profile: Profile | str) -> Profile:
    return profile if isinstance(profile, Profile) else load_profile(profile)


def _role(stage: StageConfig) -> str:
    role = stage.engine_role or stage.name
    if role not in ("talker", "thinker"):
        raise InvalidArgumentError(
            f"stages[{stage.stage_id}].engine_role",
            f"vLLM stages are 'talker' or 'thinker', got {role!r}",
        )
    return role


def stage_model_config(role: str, seed: int = 0) -> dict[str, Any]:
    """The omni_stage.json values a checkpoint for `role` must have."""
    cfg: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "kind": role,
        "seed": int(seed),
        "vocab_size": DEFAULT_MODEL_SIZES["vocab_size"],
        "hidden_size": DEFAULT_MODEL_SIZES["hidden_size"],
        "num_layers": DEFAULT_MODEL_SIZES["num_layers"],
    }
    if role == "talker":
        cfg["num_codebooks"] = DEFAULT_MODEL_SIZES["num_codebooks"]
        cfg["codec_vocab_size"] = DEFAULT_MODEL_SIZES["vocab_size"]
    return cfg


def _matches(model_dir: Path, want: dict[str, Any]) -> bool:
    if (
        not (model_dir / STAGE_CONFIG_FILE).is_file()
        or not (model_dir / "model.safetensors").is_file()
    ):
        return False
    try:
        have = read_stage_config(model_dir)
    except (OSError, ValueError):
        return False
    return all(have.get(k) == v for k, v in want.items())


def _write_stage_model(stage: StageConfig, target: Path, seed: int) -> None:
    from .standin_models import create_model_atomically

    create_model_atomically(
        _role(stage),
        target,
        seed=seed,
        vocab_size=DEFAULT_MODEL_SIZES["vocab_size"],
        hidden_size=DEFAULT_MODEL_SIZES["hidden_size"],
        num_layers=DEFAULT_MODEL_SIZES["num_layers"],
        num_codebooks=DEFAULT_MODEL_SIZES["num_codebooks"],
    )


def create_profile_models(
    profile_name: str | Profile, out_dir: Path, *, seed: int = 0
) -> dict[str, Path]:
    """Write one checkpoint per AR stage of the profile: {stage name: dir}.

    Layout: ``out_dir/<stage name>/``. A directory whose omni_stage.json
    matches the wanted config (kind, seed, sizes) is kept as is
    (idempotent); anything else there is refused (never deleted). Each checkpoint is written
    to a temporary sibling directory and renamed into place, so an
    interrupted run never leaves a half-written model that looks complete.
    """
    profile = _profile(profile_name)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Path] = {}
    for stage in profile.ar_stages:
        target = out_dir / stage.name
        if not _matches(target, stage_model_config(_role(stage), seed)):
            _write_stage_model(stage, target, seed)
        result[stage.name] = target
    return result


def build_backends(
    profile: Profile | str,
    model_dir: Path | None = None,
    *,
    max_num_seqs: int = 32,
    seed: int = 0,
    **backend_kwargs: Any,
) -> dict[str, StandinBackend]:
    """One StandinBackend per AR stage: {stage name: backend}.

    model_dir: the directory holding one checkpoint per stage,
    ``<model_dir>/<stage name>`` (as written by create_profile_models);
    missing ones are written, present ones used as they are. None ->
    create_profile_models under :func:`default_model_root`.

    Per stage: role from ``engine_role``; ``capture_hidden`` when a route
    reads ``hidden_states``; ``async_scheduling``,
    ``enable_prefix_caching`` and ``speculative_decoding`` from the stage;
    ``tensor_parallel_size``, ``pipeline_parallel_size`` and
    ``distributed_executor_backend`` (:meth:`StageConfig.engine_args`) go to
    the engine (the backend refuses what the stage's role cannot run:
    ``decoder_svc.profile.parallel_refusal``).
    backend_kwargs go to every backend (they override the above).
    """
    from .standin_backend import StandinBackend

    prof = _profile(profile)
    if model_dir is None:
        dirs = create_profile_models(prof, default_model_root(prof.name), seed=seed)
    else:
        # Given checkpoints are used as they are; only missing ones are written.
        root = Path(model_dir)
        root.mkdir(parents=True, exist_ok=True)
        dirs = {}
        for stage in prof.ar_stages:
            target = root / stage.name
            if not _matches(target, {"kind": _role(stage)}):
                if (target / STAGE_CONFIG_FILE).exists():
                    raise InvalidArgumentError(
                        "model_dir",
                        f"{target} holds a {read_stage_config(target).get('kind')!r} model, stage {stage.name!r} needs {_role(stage)!r}",
                    )
                _write_stage_model(stage, target, seed)
            dirs[stage.name] = target
    backends: dict[str, StandinBackend] = {}
    try:
        for stage in prof.ar_stages:
            kwargs: dict[str, Any] = dict(
                role=_role(stage),
                name=stage.name,
                capture_hidden=HIDDEN_STATES in sources_of(stage.plan()),
                max_num_seqs=max_num_seqs,
                seed=seed,
                async_scheduling=stage.async_scheduling,
                enable_prefix_caching=stage.enable_prefix_caching,
                speculative_config=dict(NGRAM_SPECULATIVE_CONFIG)
                if stage.speculative_decoding
                else None,
                **stage.engine_args(),
            )
            kwargs.update(backend_kwargs)
            backends[stage.name] = StandinBackend(dirs[stage.name], **kwargs)
    except BaseException:
        for b in backends.values():
            b.close()
        raise
    return backends
