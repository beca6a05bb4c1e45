"""Derived checkpoint views: a directory vLLM can load one stage from.

vLLM loads a model from a directory: its ``config.json`` and the
``*.safetensors`` files there, filtered by ``model.safetensors.index.json``
when one is present (every file the index names must be in the directory).
The talker is served from such a view of the checkpoint: a config view of its
own, links to the checkpoint's shards that hold a ``talker.*`` tensor, and an
index written for the view naming exactly those tensors and shards. However
the checkpoint's tensors are split across its shards (one file, a shard per
stage, a shard per tensor, stages mixed in a shard), the view's index and its
links agree. The checkpoint's own directory is never written: the view lives
in the model cache (``cache.derived_dir``), keyed by the checkpoint's
fingerprint.

``omni-serving models check`` builds and checks the same views the decoder
builds, so a checkpoint it passes is one the decoder can load.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .cache import derived_dir
from .checkpoint import INDEX, CheckpointError, OmniCheckpoint

__all__ = ["StageView", "build_view", "talker_view", "check_view", "TALKER_VIEW", "TALKER_PREFIX"]

TALKER_VIEW = "talker-vllm"
TALKER_PREFIX = "talker."


@dataclass(frozen=True)
class StageView:
    """A built view: its directory, the shard files it links, how many tensors its index names."""

    path: Path
    shards: tuple[str, ...]
    tensors: int


def _write_text(path: Path, text: str) -> None:
    """Write `path` atomically, only when its content differs (a link left by
    an older layout is replaced by a file, never written through)."""
    if path.is_file() and not path.is_symlink() and path.read_text() == text:
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _link(path: Path, target: Path) -> None:
    """`path` -> `target`, replaced atomically when it points elsewhere (two
    processes building the same view at once both succeed)."""
    if path.is_symlink() and os.readlink(path) == str(target):
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.link")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    tmp.symlink_to(target)
    os.replace(tmp, path)


def build_view(checkpoint: OmniCheckpoint, name: str, config: dict[str, Any], prefix: str) -> StageView:
    """The view `name` of `checkpoint`: `config` as its config.json, links to
    the shards holding a tensor named `prefix*`, and an index of those tensors."""
    entries = {t: f for t, f in sorted(checkpoint.weight_map.items()) if t.startswith(prefix)}
    if not entries:
        raise CheckpointError(checkpoint.path / INDEX, prefix + "*", "missing (no tensor with this prefix)")
    view = derived_dir(checkpoint, name)
    _write_text(view / "config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")
    shards = tuple(sorted(set(entries.values())))
    for shard in shards:
        _link(view / shard, checkpoint.path / shard)
    # links of an earlier layout (the fingerprint covers the shards, so only
    # after a view of this same checkpoint was built another way)
    for stale in view.glob("*.safetensors"):
        if stale.name not in shards and stale.is_symlink():
            stale.unlink()
    index = {"metadata": {"derived_from": str(checkpoint.path), "view": name}, "weight_map": entries}
    _write_text(view / INDEX, json.dumps(index, indent=2, sort_keys=True) + "\n")
    return StageView(view, shards, len(entries))


def talker_view(checkpoint: OmniCheckpoint) -> StageView:
    """The view the talker's vLLM engine loads (its config: ``talker_config_view``)."""
    from .talker import talker_config_view

    return build_view(checkpoint, TALKER_VIEW, talker_config_view(checkpoint.config), TALKER_PREFIX)


def check_view(view: StageView, checkpoint: OmniCheckpoint, prefix: str) -> None:
    """Raise CheckpointError unless `view` is what vLLM will load without
    error and with every `prefix*` tensor of `checkpoint`: every file its index
    names is in the view (as vLLM requires) and is the checkpoint's shard,
    and the index names every such tensor in the shard that holds it."""
    index_file = view.path / INDEX
    try:
        weight_map = json.loads(index_file.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(index_file, "weight_map", f"unreadable view index: {exc}") from exc
    for shard in sorted(set(weight_map.values())):
        linked = view.path / shard
        if not linked.exists():
            raise CheckpointError(index_file, shard, "named by the view's index, missing from the view")
        if linked.resolve() != (checkpoint.path / shard).resolve():
            raise CheckpointError(index_file, shard, f"links to {linked.resolve()}, not the checkpoint's shard")
    want = {t: f for t, f in checkpoint.weight_map.items() if t.startswith(prefix)}
    if weight_map != want:
        missing = sorted(set(want) - set(weight_map))
        extra = sorted(set(weight_map) - set(want))
        moved = sorted(t for t in set(want) & set(weight_map) if want[t] != weight_map[t])
        raise CheckpointError(index_file, (missing or extra or moved)[0],
                              f"the view's index disagrees with the checkpoint ({len(missing)} missing, "
                              f"{len(extra)} extra, {len(moved)} in another shard)")
