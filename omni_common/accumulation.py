"""Per-request accumulation of multimodal tensors across decode steps.

A model emits named tensors step by step (audio samples, codec codes, image
latents). `PayloadAccumulator` collects them for one request and hands them
out either as the whole so far (`consolidate`, for cumulative and final-only
output) or as what is new since the last hand-out (`take_delta`, for delta
output).

How pieces of one key combine is a `TensorAccumulationStrategy`. The
strategy is picked once, when the accumulator is made for the request's
modality (`PayloadAccumulator.for_modality`), and may be overridden per key.
After that nothing branches on the modality: each key's strategy indexes a
table of functions.

Errors follow two levels:

* `TensorAccumulationError` - one step's tensor does not fit what the key has
  so far (shape or dtype). `add` logs it, counts it in `skipped_total`, and
  drops only that tensor; the request continues.
* `TensorConsolidationError` - the stored pieces cannot be merged. The
  request cannot produce a correct payload and should fail.

Anything else (a non-tensor value, a bad metadata type) is a bug in the
caller and propagates unchanged.

Cost: `add` appends references, O(1) per key plus an O(ndim) layout check;
no data is copied. Concatenation is deferred to `consolidate` /
`take_delta`, which copy each stored byte once per call. `consolidate` then
keeps the merged tensor as the key's only piece, so a later call copies the
merged prefix plus the new pieces. Streaming a cumulative payload every step
therefore costs O(total bytes) per step, the same order as sending it.
Memory is O(total bytes) per request; tensors are held by reference, so a
producer must not write into a tensor after handing it over.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from omni_common.errors import OmniError
from omni_common.modality import OutputModality

logger = logging.getLogger(__name__)

Scalar = bool | int | float | str
"""A metadata value; matches the proto `MetadataValue` oneof."""

MergedValue = torch.Tensor | list[torch.Tensor]
"""A consolidated key: one tensor, or a list for `APPEND_LIST` keys."""


class TensorAccumulationStrategy(enum.Enum):
    """How the pieces produced for one key over several steps combine."""

    CONCAT_DIM0 = "concat_dim0"
    """Stack along dim 0 (frames, images, latent tokens); trailing dims must agree."""
    CONCAT_LAST = "concat_last"
    """Join along the last dim (audio samples); leading dims must agree."""
    APPEND_LIST = "append_list"
    """Keep every piece as is, in order; pieces may differ in shape."""
    REPLACE = "replace"
    """Keep only the latest piece."""


def default_strategy_for(modality: OutputModality) -> TensorAccumulationStrategy:
    """The strategy a request with `modality` uses for keys without an override.

    Audio grows along time, its last dimension; images and latents grow along
    the batch-like first dimension. A set containing audio uses the audio
    strategy; per-key overrides handle the other keys of mixed outputs.
    """
    if OutputModality.AUDIO in modality:
        return TensorAccumulationStrategy.CONCAT_LAST
    if modality & (OutputModality.IMAGE | OutputModality.LATENT):
        return TensorAccumulationStrategy.CONCAT_DIM0
    return TensorAccumulationStrategy.CONCAT_DIM0


class MultimodalOutputError(OmniError):
    """Base of the errors raised while building a multimodal payload."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"tensor {key!r}: {message}")
        self.key = key


class TensorAccumulationError(MultimodalOutputError):
    """One step's tensor cannot join its key; recoverable by skipping it."""


class TensorConsolidationError(MultimodalOutputError):
    """Stored pieces cannot be merged; the request's payload is lost."""


@dataclass
class _KeyState:
    """Everything stored for one tensor key."""

    strategy: TensorAccumulationStrategy
    pieces: list[torch.Tensor] = field(default_factory=list)
    # Index of the first piece not yet returned by `take_delta`.
    delta_from: int = 0


def _describe(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {t.dtype} on {t.device}"


def _check_joinable(key: str, state: _KeyState, t: torch.Tensor, dim: int) -> None:
    """Raise `TensorAccumulationError` unless `t` concatenates with the stored pieces on `dim`."""
    if t.dim() == 0:
        raise TensorAccumulationError(key, f"cannot concatenate a 0-d tensor ({_describe(t)})")
    if not state.pieces:
        return
    ref = state.pieces[0]
    d = dim % t.dim()
    axis = "the first" if dim == 0 else "the last"
    if (
        t.dtype != ref.dtype
        or t.device != ref.device
        or t.dim() != ref.dim()
        or t.shape[:d] != ref.shape[:d]
        or t.shape[d + 1 :] != ref.shape[d + 1 :]
    ):
        raise TensorAccumulationError(
            key,
            f"{state.strategy.value}: incoming {_describe(t)} does not fit "
            f"stored {_describe(ref)} (dtype, device and every dim but {axis} must match)",
        )


def _append_concat_dim0(key: str, state: _KeyState, t: torch.Tensor) -> None:
    _check_joinable(key, state, t, 0)
    state.pieces.append(t)


def _append_concat_last(key: str, state: _KeyState, t: torch.Tensor) -> None:
    _check_joinable(key, state, t, -1)
    state.pieces.append(t)


def _append_list(key: str, state: _KeyState, t: torch.Tensor) -> None:
    state.pieces.append(t)


def _append_replace(key: str, state: _KeyState, t: torch.Tensor) -> None:
    state.pieces[:] = [t]
    state.delta_from = 0


def _cat(dim: int) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    def merge(pieces: list[torch.Tensor]) -> torch.Tensor:
        # One piece is returned as is: no copy for the common single-step case.
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)

    return merge


def _merge_list(pieces: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(pieces)


def _merge_replace(pieces: list[torch.Tensor]) -> torch.Tensor:
    return pieces[-1]


@dataclass(frozen=True)
class _StrategyOps:
    """The functions that implement one strategy."""

    append: Callable[[str, _KeyState, torch.Tensor], None]
    merge: Callable[[list[torch.Tensor]], MergedValue]
    # True when the merged result may replace the pieces it came from.
    compacts: bool


_OPS: dict[TensorAccumulationStrategy, _StrategyOps] = {
    TensorAccumulationStrategy.CONCAT_DIM0: _StrategyOps(_append_concat_dim0, _cat(0), True),
    TensorAccumulationStrategy.CONCAT_LAST: _StrategyOps(_append_concat_last, _cat(-1), True),
    TensorAccumulationStrategy.APPEND_LIST: _StrategyOps(_append_list, _merge_list, False),
    TensorAccumulationStrategy.REPLACE: _StrategyOps(_append_replace, _merge_replace, False),
}


def _merge(key: str, state: _KeyState, pieces: list[torch.Tensor]) -> MergedValue:
    try:
        return _OPS[state.strategy].merge(pieces)
    except RuntimeError as exc:  # torch's error for size/dtype mismatch and out-of-memory
        shapes = ", ".join(_describe(p) for p in pieces[:4])
        more = f" and {len(pieces) - 4} more" if len(pieces) > 4 else ""
        raise TensorConsolidationError(
            key, f"{state.strategy.value} of {len(pieces)} pieces ({shapes}{more}) failed: {exc}"
        ) from exc


class PayloadAccumulator:
    """Collects one request's named tensors and scalar metadata.

    Build it with `for_modality`. Not thread-safe: one request is driven by
    one task.
    """

    def __init__(
        self,
        default: TensorAccumulationStrategy,
        overrides: Mapping[str, TensorAccumulationStrategy] | None = None,
    ) -> None:
        overrides = dict(overrides or {})
        for key, strategy in [("<default>", default), *overrides.items()]:
            if not isinstance(strategy, TensorAccumulationStrategy):
                raise TypeError(
                    f"strategy for {key!r} must be a TensorAccumulationStrategy, got {strategy!r}"
                )
        self.default_strategy = default
        self._overrides = overrides
        self._keys: dict[str, _KeyState] = {}
        self._metadata: dict[str, Scalar] = {}
        self._metadata_changed: set[str] = set()
        self.skipped_total = 0
        """Tensors dropped by `add` because they did not fit their key."""

    @classmethod
    def for_modality(
        cls,
        modality: OutputModality,
        overrides: Mapping[str, TensorAccumulationStrategy] | None = None,
    ) -> PayloadAccumulator:
        """An accumulator using `default_strategy_for(modality)`, except for keys in `overrides`."""
        return cls(default_strategy_for(modality), overrides)

    def strategy_for(self, key: str) -> TensorAccumulationStrategy:
        """The strategy `key` uses."""
        return self._overrides.get(key, self.default_strategy)

    def __len__(self) -> int:
        """Number of tensor keys holding data."""
        return len(self._keys)

    def add(
        self,
        tensors: Mapping[str, torch.Tensor],
        metadata: Mapping[str, Scalar] | None = None,
    ) -> list[str]:
        """Add one step's output; return the keys whose tensor was skipped.

        A tensor that does not fit its key's earlier pieces is skipped with a
        warning and the key keeps its earlier value. Metadata always replaces.
        A value of the wrong type raises `TypeError` before anything is stored.
        """
        # 1) Refuse caller bugs up front so a bad step leaves no partial state.
        for key, tensor in tensors.items():
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(
                    f"tensor {key!r}: expected torch.Tensor, got {type(tensor).__name__}"
                )
        metadata = metadata or {}
        for key, value in metadata.items():
            if not isinstance(value, Scalar):
                raise TypeError(
                    f"metadata {key!r}: expected bool, int, float or str, got {type(value).__name__}"
                )

        # 2) One loop over the keys: look up the strategy, dispatch through the table.
        skipped: list[str] = []
        for key, tensor in tensors.items():
            state = self._keys.get(key)
            if state is None:
                state = _KeyState(self.strategy_for(key))
            try:
                _OPS[state.strategy].append(key, state, tensor)
            except TensorAccumulationError as exc:
                self.skipped_total += 1
                skipped.append(key)
                logger.warning("skipping this step's tensor: %s", exc)
                continue
            self._keys[key] = state

        # 3) Metadata: latest value wins; remember which keys really changed.
        for key, value in metadata.items():
            old = self._metadata.get(key, _MISSING)
            if type(old) is not type(value) or old != value:
                self._metadata[key] = value
                self._metadata_changed.add(key)
        return skipped

    def consolidate(self) -> tuple[dict[str, MergedValue], dict[str, Scalar]]:
        """Everything so far: one merged value per key, and all metadata.

        Raises `TensorConsolidationError` when a key's pieces cannot be merged.
        Returned tensors may share memory with stored ones; don't modify them.
        """
        merged: dict[str, MergedValue] = {}
        for key, state in self._keys.items():
            value = _merge(key, state, state.pieces)
            merged[key] = value
            # Keep the merge so the next call does not redo it. Only when no
            # delta boundary falls inside the pieces: compaction would lose it.
            if (
                _OPS[state.strategy].compacts
                and len(state.pieces) > 1
                and state.delta_from in (0, len(state.pieces))
                and isinstance(value, torch.Tensor)
            ):
                state.delta_from = 0 if state.delta_from == 0 else 1
                state.pieces[:] = [value]
        return merged, dict(self._metadata)

    def take_delta(self) -> tuple[dict[str, MergedValue], dict[str, Scalar]]:
        """What was added since the previous `take_delta` (or since the start).

        Concatenating keys give the concatenation of their new pieces,
        `APPEND_LIST` keys the list of new pieces, `REPLACE` keys their value
        if one was set since the last call. Keys with nothing new are absent,
        and so is metadata whose value did not change.
        """
        delta: dict[str, MergedValue] = {}
        for key, state in self._keys.items():
            if state.delta_from < len(state.pieces):
                delta[key] = _merge(key, state, state.pieces[state.delta_from :])
        # Advance only after every key merged, so a failure leaves nothing half-taken.
        for state in self._keys.values():
            state.delta_from = len(state.pieces)
        meta = {key: self._metadata[key] for key in self._metadata if key in self._metadata_changed}
        self._metadata_changed.clear()
        return delta, meta


_MISSING = object()

__all__ = [
    "MergedValue",
    "MultimodalOutputError",
    "PayloadAccumulator",
    "Scalar",
    "TensorAccumulationError",
    "TensorAccumulationStrategy",
    "TensorConsolidationError",
    "default_strategy_for",
]
