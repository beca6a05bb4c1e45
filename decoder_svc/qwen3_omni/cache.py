"""The model cache: the default tiny checkpoint and files derived from checkpoints.

Layout under ``model_cache_root()``::

    qwen3-omni-tiny-v<TINY_FORMAT>/    the tiny checkpoint served when no model is given
    qwen3-omni-released-l<N>-v<F>/     the released widths at N layers (``models create --preset released``)
    derived/<fingerprint>/<name>/      files derived from a checkpoint (e.g. config views)
    .qwen3-omni-tiny.lock              serializes creating the checkpoints above

A checkpoint directory a user gives is only ever read; whatever serving
derives from it goes under ``derived/``, keyed by the checkpoint's fingerprint
(path, config, index, shard sizes and times), so a changed checkpoint gets
fresh derived files.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from decoder_svc.qwen3_omni.checkpoint import CheckpointError
from decoder_svc.qwen3_omni.tiny import TINY_FORMAT, create_tiny_checkpoint

if TYPE_CHECKING:
    from decoder_svc.qwen3_omni.checkpoint import OmniCheckpoint

__all__ = ["model_cache_root", "default_model_dir", "released_model_dir", "derived_dir", "TINY_DIR_NAME"]

TINY_DIR_NAME = f"qwen3-omni-tiny-v{TINY_FORMAT}"
_LOCK_NAME = ".qwen3-omni-tiny.lock"


def model_cache_root() -> Path:
    """``$OMNI_SERVING_MODEL_DIR`` when set, else ``${XDG_CACHE_HOME:-~/.cache}/omni-serving/models``."""
    base = os.environ.get("OMNI_SERVING_MODEL_DIR")
    if base:
        return Path(base).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache).expanduser() / "omni-serving" / "models"


def default_model_dir(*, create: bool = True) -> Path:
    """The tiny checkpoint's directory in the cache; written on first use when ``create``.

    Two processes starting at once write it once: creation runs under an
    exclusive lock on a file in the cache root, and the checkpoint is written
    to a temporary sibling that is renamed into place, so the directory either
    does not exist or is complete. Temporary siblings left by a killed writer
    are removed under the same lock.
    """
    return _cached(TINY_DIR_NAME, create_tiny_checkpoint, create=create)


def released_model_dir(layers: int, *, create: bool = True, progress=None) -> Path:  # noqa: ANN001
    """The released-widths checkpoint with ``layers`` layers per stack (seed 0)
    in the cache, written on first use when ``create`` (as :func:`default_model_dir`)."""
    from decoder_svc.qwen3_omni.released import RELEASED_FORMAT, create_released_checkpoint

    if layers < 1:
        raise ValueError(f"layers: at least 1, got {layers}")
    return _cached(f"qwen3-omni-released-l{layers}-v{RELEASED_FORMAT}",
                   lambda target: create_released_checkpoint(target, layers=layers, progress=progress), create=create)


def _cached(name: str, write, *, create: bool) -> Path:  # noqa: ANN001
    root = model_cache_root()
    target = root / name
    if target.is_dir() or not create:
        return target
    root.mkdir(parents=True, exist_ok=True)
    with open(root / _LOCK_NAME, "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            if target.is_dir():  # another process wrote it while we waited
                return target
            for stale in root.glob(f".{name}-*"):
                if stale.is_dir():
                    shutil.rmtree(stale, ignore_errors=True)
            write(target)
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
    return target


def derived_dir(checkpoint: OmniCheckpoint, name: str) -> Path:
    """``<root>/derived/<fingerprint>/<name>``, created: where files derived from
    ``checkpoint`` go (never into the checkpoint's own directory)."""
    if not name or name in (".", "..") or "/" in name or os.sep in name or "\0" in name:
        raise ValueError(f"derived_dir: name must be a single path component, got {name!r}")
    out = model_cache_root() / "derived" / checkpoint.fingerprint() / name
    if out.resolve().is_relative_to(checkpoint.path.resolve()):
        raise CheckpointError(
            checkpoint.path, "OMNI_SERVING_MODEL_DIR",
            f"the model cache ({model_cache_root()}) is inside the model directory, which is never written; "
            "point OMNI_SERVING_MODEL_DIR elsewhere",
        )
    out.mkdir(parents=True, exist_ok=True)
    return out
