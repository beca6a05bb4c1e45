"""What every checkpoint directory the decoder serves shares: reading it, never writing it.

- :class:`CheckpointError`: a directory that cannot be served (``file: key: message``);
- :func:`read_json` / :func:`read_weights`: a JSON file, and the weights (an
  index and its shards, or one ``model.safetensors``) with every tensor's
  shape from the shards' headers (no tensor data read);
- :class:`CheckpointFiles`: an opened directory's config, generation
  config, weight map and shapes, with the tensors read by prefix and a
  fingerprint for cache keys.

Each family's checkpoint class (``decoder_svc.qwen3_omni.checkpoint``,
``decoder_svc.qwen3_tts.checkpoint``) validates its own layout on top.
Files are only opened for reading; tensors are read with safetensors' ``safe_open``.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["CONFIG", "INDEX", "SINGLE", "CheckpointError", "CheckpointFiles", "read_json", "read_weights",
           "shard_keys", "file_stamp"]

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class CheckpointError(Exception):
    """A checkpoint directory that cannot be served: ``file: key: message``."""

    def __init__(self, file: str | Path, key: str, message: str) -> None:
        self.file = file
        self.key = key
        self.message = message
        super().__init__(f"{file}: {key}: {message}")

    def __reduce__(self):  # picklable across processes
        return (type(self), (self.file, self.key, self.message))


def read_json(path: Path, what: str) -> Any:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise CheckpointError(path, what, "file not found") from None
    except OSError as exc:
        raise CheckpointError(path, what, f"cannot read: {exc.strerror or exc}") from exc
    try:
        return json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(path, what, f"not valid JSON: {exc}") from exc


def shard_keys(path: Path) -> dict[str, list[int]]:
    """Tensor name -> shape, from a safetensors file's header (no tensor data read)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {name: list(f.get_slice(name).get_shape()) for name in f.keys()}
    except FileNotFoundError:
        raise CheckpointError(path, "weights", "file not found") from None
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise CheckpointError(path, "header", f"not a readable safetensors file: {exc}") from exc


def file_stamp(path: Path) -> bytes:
    st = path.stat()
    return f"{path.name}:{st.st_size}:{st.st_mtime_ns}".encode()


def read_weights(path: Path) -> tuple[dict[str, str], dict[str, list[int]], Path]:
    """(weight_map, shapes of every tensor, the file that lists them)."""
    index_file = path / INDEX
    if index_file.exists():
        index = read_json(index_file, "weight_map")
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(index_file, "weight_map", "missing or empty (expected tensor -> shard file)")
        for name, shard in weight_map.items():
            if not isinstance(shard, str) or not shard or Path(shard).is_absolute() or ".." in Path(shard).parts:
                raise CheckpointError(index_file, f"weight_map.{name}",
                                      f"shard must be a file name inside the checkpoint, got {shard!r}")
        for shard in sorted(set(weight_map.values())):
            if not (path / shard).is_file():
                raise CheckpointError(path / shard, "weight_map",
                                      f"shard named in {INDEX} is missing")
        by_shard: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            by_shard.setdefault(shard, []).append(name)
        shapes: dict[str, list[int]] = {}
        for shard in sorted(by_shard):
            found = shard_keys(path / shard)
            for name in by_shard[shard]:
                if name not in found:
                    raise CheckpointError(path / shard, name,
                                          f"missing (listed in {INDEX} weight_map, not in the shard)")
                shapes[name] = found[name]
        return dict(weight_map), shapes, index_file
    single = path / SINGLE
    if not single.is_file():
        raise CheckpointError(single, "weights",
                              f"no weights: neither {SINGLE} nor {INDEX} in {path}")
    shapes = shard_keys(single)
    return {name: SINGLE for name in shapes}, shapes, single


@dataclass(frozen=True)
class CheckpointFiles:
    """An opened checkpoint directory: what every family's checkpoint class has."""

    path: Path
    config: dict
    generation_config: dict
    weight_map: dict[str, str]
    # tensor name -> shape, from the shards' headers (no tensor data read)
    shapes: dict[str, list[int]] = field(default_factory=dict, compare=False, repr=False)

    # -- weights
    def shard_files(self, prefix: str = "") -> list[Path]:
        """Shards holding at least one tensor whose name starts with ``prefix``, sorted."""
        names = {shard for name, shard in self.weight_map.items() if name.startswith(prefix)}
        return sorted(self.path / shard for shard in names)

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """Every tensor whose name starts with ``prefix`` (full names as keys), read
        read-only from only the shards that hold them."""
        from safetensors import safe_open

        by_shard: dict[str, list[str]] = {}
        for name, shard in self.weight_map.items():
            if name.startswith(prefix):
                by_shard.setdefault(shard, []).append(name)
        out: dict[str, torch.Tensor] = {}
        for shard in sorted(by_shard):
            with safe_open(str(self.path / shard), framework="pt", device="cpu") as f:
                for name in sorted(by_shard[shard]):
                    out[name] = f.get_tensor(name)
        return out

    def numel(self, prefix: str) -> int:
        """Elements of the tensors named `prefix*` (from the headers)."""
        total = 0
        for name, shape in self.shapes.items():
            if name.startswith(prefix):
                n = 1
                for d in shape:
                    n *= int(d)
                total += n
        return total

    def fingerprint(self) -> str:
        """A short stable hash of what the checkpoint is: its resolved path, config.json,
        the weight index and each shard's size and modification time, and those of
        :meth:`other_files` (for cache keys)."""
        h = hashlib.sha256()
        h.update(os.fsencode(str(self.path.resolve())) + b"\0")
        for name in (CONFIG, INDEX):
            f = self.path / name
            h.update(name.encode() + b"\0")
            h.update(f.read_bytes() if f.exists() else b"")
            h.update(b"\0")
        for shard in sorted(set(self.weight_map.values())):
            h.update(file_stamp(self.path / shard) + b"\0")
        for other in self.other_files():
            h.update(os.fsencode(str(other.relative_to(self.path))) + b"\0")
            h.update((file_stamp(other) if other.exists() else b"") + b"\0")
        return h.hexdigest()[:16]

    def other_files(self) -> list[Path]:
        """Files beyond config.json and the weights that the fingerprint covers (none here)."""
        return []
