"""PayloadAccumulator: strategies, skipping, delta vs. consolidated views."""

from __future__ import annotations

import logging

import grpc
import pytest
import torch

from omni_common.accumulation import (
    MultimodalOutputError,
    PayloadAccumulator,
    TensorAccumulationError,
    TensorAccumulationStrategy,
    TensorConsolidationError,
    default_strategy_for,
)
from omni_common.errors import OmniError, grpc_code_for
from omni_common.modality import OutputModality

S = TensorAccumulationStrategy
M = OutputModality


def assert_tensor(got: object, want: torch.Tensor) -> None:
    assert isinstance(got, torch.Tensor), f"{got=}, {want=}"
    assert got.dtype == want.dtype, f"{got.dtype=}, {want.dtype=}"
    assert torch.equal(got, want), f"{got=}, {want=}"


def assert_tensor_list(got: object, want: list[torch.Tensor]) -> None:
    assert isinstance(got, list) and len(got) == len(want), f"{got=}, {want=}"
    for g, w in zip(got, want, strict=True):
        assert_tensor(g, w)


@pytest.mark.parametrize(
    ("modality", "want"),
    [
        (M.TEXT, S.CONCAT_DIM0),
        (M.AUDIO, S.CONCAT_LAST),
        (M.TEXT | M.AUDIO, S.CONCAT_LAST),
        (M.AUDIO | M.IMAGE, S.CONCAT_LAST),
        (M.IMAGE, S.CONCAT_DIM0),
        (M.LATENT, S.CONCAT_DIM0),
        (M.TEXT | M.IMAGE, S.CONCAT_DIM0),
    ],
)
def test_default_strategy_for(modality: OutputModality, want: TensorAccumulationStrategy) -> None:
    got = default_strategy_for(modality)
    assert got is want, f"{modality=}: {got=}, {want=}"
    acc = PayloadAccumulator.for_modality(modality)
    assert acc.strategy_for("anything") is want


def test_concat_dim0() -> None:
    acc = PayloadAccumulator.for_modality(M.IMAGE)
    a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    b = torch.arange(6, 9, dtype=torch.float32).reshape(1, 3)
    assert acc.add({"x": a}) == []
    assert acc.add({"x": b}) == []
    tensors, _ = acc.consolidate()
    assert_tensor(tensors["x"], torch.arange(9, dtype=torch.float32).reshape(3, 3))


def test_concat_last() -> None:
    acc = PayloadAccumulator.for_modality(M.AUDIO)
    acc.add({"audio": torch.tensor([[1.0, 2.0], [3.0, 4.0]])})
    acc.add({"audio": torch.tensor([[5.0], [6.0]])})
    acc.add({"audio": torch.tensor([[7.0, 8.0, 9.0], [10.0, 11.0, 12.0]])})
    tensors, _ = acc.consolidate()
    want = torch.tensor([[1.0, 2.0, 5.0, 7.0, 8.0, 9.0], [3.0, 4.0, 6.0, 10.0, 11.0, 12.0]])
    assert_tensor(tensors["audio"], want)


def test_append_list_keeps_pieces_of_any_shape() -> None:
    acc = PayloadAccumulator(S.APPEND_LIST)
    pieces = [torch.zeros(2, 2), torch.ones(3), torch.tensor(7.0)]
    for piece in pieces:
        assert acc.add({"img": piece}) == []
    tensors, _ = acc.consolidate()
    assert_tensor_list(tensors["img"], pieces)


def test_replace_keeps_latest() -> None:
    acc = PayloadAccumulator(S.REPLACE)
    acc.add({"h": torch.zeros(4)})
    acc.add({"h": torch.ones(2, 2)})
    tensors, _ = acc.consolidate()
    assert_tensor(tensors["h"], torch.ones(2, 2))


def test_per_key_override() -> None:
    acc = PayloadAccumulator.for_modality(
        M.TEXT | M.AUDIO, overrides={"codes": S.CONCAT_DIM0, "speaker": S.REPLACE}
    )
    assert acc.strategy_for("audio") is S.CONCAT_LAST
    assert acc.strategy_for("codes") is S.CONCAT_DIM0
    acc.add(
        {
            "audio": torch.tensor([0.1, 0.2]),
            "codes": torch.tensor([[1, 2, 3, 4]]),
            "speaker": torch.tensor([1.0]),
        }
    )
    acc.add(
        {
            "audio": torch.tensor([0.3]),
            "codes": torch.tensor([[5, 6, 7, 8]]),
            "speaker": torch.tensor([2.0]),
        }
    )
    tensors, _ = acc.consolidate()
    assert_tensor(tensors["audio"], torch.tensor([0.1, 0.2, 0.3]))
    assert_tensor(tensors["codes"], torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]))
    assert_tensor(tensors["speaker"], torch.tensor([2.0]))


@pytest.mark.parametrize(
    ("strategy", "first", "bad"),
    [
        (S.CONCAT_DIM0, torch.zeros(2, 3), torch.zeros(1, 4)),  # trailing dim differs
        (S.CONCAT_DIM0, torch.zeros(2, 3), torch.zeros(3)),  # rank differs
        (S.CONCAT_DIM0, torch.zeros(2, 3), torch.zeros(1, 3, dtype=torch.float64)),
        (S.CONCAT_DIM0, torch.zeros(2, 3), torch.tensor(1.0)),  # 0-d
        (S.CONCAT_LAST, torch.zeros(1, 5), torch.zeros(2, 5)),  # leading dim differs
        (S.CONCAT_LAST, torch.zeros(5), torch.zeros(5, dtype=torch.int64)),
    ],
)
def test_mismatch_is_skipped_and_prior_value_kept(
    strategy: TensorAccumulationStrategy,
    first: torch.Tensor,
    bad: torch.Tensor,
    caplog: pytest.LogCaptureFixture,
) -> None:
    acc = PayloadAccumulator(strategy)
    acc.add({"x": first, "other": torch.ones(1)})
    with caplog.at_level(logging.WARNING, logger="omni_common.accumulation"):
        skipped = acc.add({"x": bad, "other": torch.ones(1)})
    assert skipped == ["x"], f"{skipped=}"
    assert acc.skipped_total == 1, f"{acc.skipped_total=}"
    warning = caplog.text
    assert "'x'" in warning and str(tuple(bad.shape)) in warning, warning
    tensors, _ = acc.consolidate()
    assert_tensor(tensors["x"], first)
    assert_tensor(tensors["other"], torch.ones(2))

    # A later good piece still joins.
    acc.add({"x": first})
    tensors, _ = acc.consolidate()
    dim = 0 if strategy is S.CONCAT_DIM0 else -1
    assert_tensor(tensors["x"], torch.cat([first, first], dim=dim))


def test_first_piece_rejected_leaves_key_absent() -> None:
    acc = PayloadAccumulator(S.CONCAT_LAST)
    assert acc.add({"x": torch.tensor(3.0)}) == ["x"]
    tensors, _ = acc.consolidate()
    assert tensors == {}, f"{tensors=}"
    assert len(acc) == 0
    assert acc.skipped_total == 1


def test_mismatch_errors_are_internal_and_recoverable_type() -> None:
    err = TensorAccumulationError("x", "bad")
    assert isinstance(err, MultimodalOutputError) and isinstance(err, OmniError)
    assert err.key == "x" and "'x'" in str(err)
    assert grpc_code_for(err) == grpc.StatusCode.INTERNAL
    assert grpc_code_for(TensorConsolidationError("x", "bad")) == grpc.StatusCode.INTERNAL


def test_wrong_value_type_raises_before_storing_anything() -> None:
    acc = PayloadAccumulator(S.CONCAT_DIM0)
    with pytest.raises(TypeError, match="'b'"):
        acc.add({"a": torch.ones(1), "b": [1.0]})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="'m'"):
        acc.add({"a": torch.ones(1)}, {"m": object()})  # type: ignore[dict-item]
    tensors, meta = acc.consolidate()
    assert tensors == {} and meta == {}, f"{tensors=}, {meta=}"


def test_bad_override_type_is_refused() -> None:
    with pytest.raises(TypeError, match="'k'"):
        PayloadAccumulator.for_modality(M.AUDIO, {"k": "replace"})  # type: ignore[dict-item]


def test_metadata_replaces() -> None:
    acc = PayloadAccumulator.for_modality(M.AUDIO)
    acc.add({}, {"sample_rate": 24000, "last": False, "voice": "a"})
    acc.add({}, {"last": True, "gain": 0.5})
    _, meta = acc.consolidate()
    want = {"sample_rate": 24000, "last": True, "voice": "a", "gain": 0.5}
    assert meta == want, f"got={meta}, {want=}"


def test_take_delta_vs_consolidate() -> None:
    acc = PayloadAccumulator.for_modality(
        M.AUDIO, overrides={"frames": S.APPEND_LIST, "state": S.REPLACE}
    )
    acc.add(
        {"audio": torch.tensor([1.0, 2.0]), "frames": torch.zeros(1), "state": torch.tensor([0])},
        {"sample_rate": 24000},
    )
    acc.add({"audio": torch.tensor([3.0]), "frames": torch.ones(2)})

    tensors, meta = acc.take_delta()
    assert_tensor(tensors["audio"], torch.tensor([1.0, 2.0, 3.0]))
    assert_tensor_list(tensors["frames"], [torch.zeros(1), torch.ones(2)])
    assert_tensor(tensors["state"], torch.tensor([0]))
    assert meta == {"sample_rate": 24000}, f"{meta=}"

    # Nothing new: empty delta.
    tensors, meta = acc.take_delta()
    assert tensors == {} and meta == {}, f"{tensors=}, {meta=}"

    acc.add({"audio": torch.tensor([4.0, 5.0])}, {"sample_rate": 24000, "last": True})
    acc.add({"audio": torch.tensor([6.0]), "state": torch.tensor([9])})
    tensors, meta = acc.take_delta()
    assert set(tensors) == {"audio", "state"}, f"{set(tensors)=}"
    assert_tensor(tensors["audio"], torch.tensor([4.0, 5.0, 6.0]))
    assert_tensor(tensors["state"], torch.tensor([9]))
    assert meta == {"last": True}, f"unchanged sample_rate must not repeat: {meta=}"

    # The cumulative view still has everything.
    tensors, meta = acc.consolidate()
    assert_tensor(tensors["audio"], torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]))
    assert_tensor_list(tensors["frames"], [torch.zeros(1), torch.ones(2)])
    assert_tensor(tensors["state"], torch.tensor([9]))
    assert meta == {"sample_rate": 24000, "last": True}, f"{meta=}"


def test_consolidate_repeatedly_and_interleaved_with_delta() -> None:
    acc = PayloadAccumulator(S.CONCAT_DIM0)
    expected: list[int] = []
    for step in range(5):
        acc.add({"codes": torch.tensor([step])})
        expected.append(step)
        tensors, _ = acc.consolidate()
        assert_tensor(tensors["codes"], torch.tensor(expected))
    # Deltas never taken: the first delta is everything since the start.
    tensors, _ = acc.take_delta()
    assert_tensor(tensors["codes"], torch.tensor(expected))

    acc.add({"codes": torch.tensor([5])})
    acc.add({"codes": torch.tensor([6])})
    tensors, _ = acc.take_delta()
    assert_tensor(tensors["codes"], torch.tensor([5, 6]))
    acc.add({"codes": torch.tensor([7])})
    tensors, _ = acc.consolidate()
    assert_tensor(tensors["codes"], torch.arange(8))
    tensors, _ = acc.take_delta()
    assert_tensor(tensors["codes"], torch.tensor([7]))


def test_consolidated_result_is_not_changed_by_later_adds() -> None:
    acc = PayloadAccumulator(S.CONCAT_LAST)
    acc.add({"audio": torch.tensor([1.0])})
    acc.add({"audio": torch.tensor([2.0])})
    first, _ = acc.consolidate()
    acc.add({"audio": torch.tensor([3.0])})
    second, _ = acc.consolidate()
    assert_tensor(first["audio"], torch.tensor([1.0, 2.0]))
    assert_tensor(second["audio"], torch.tensor([1.0, 2.0, 3.0]))


@pytest.mark.parametrize(
    ("modality", "dtype"),
    [
        (M.AUDIO, torch.float32),
        (M.AUDIO, torch.bfloat16),
        (M.LATENT, torch.bfloat16),
        (M.LATENT, torch.int64),
        (M.IMAGE, torch.uint8),
    ],
)
def test_dtype_generic(modality: OutputModality, dtype: torch.dtype) -> None:
    acc = PayloadAccumulator.for_modality(modality)
    dim = -1 if OutputModality.AUDIO in modality else 0
    pieces = [torch.arange(6).reshape(2, 3).to(dtype), torch.arange(6, 12).reshape(2, 3).to(dtype)]
    for piece in pieces:
        assert acc.add({"t": piece}) == []
    tensors, _ = acc.consolidate()
    assert_tensor(tensors["t"], torch.cat(pieces, dim=dim))


def test_consolidation_failure_raises() -> None:
    acc = PayloadAccumulator(S.CONCAT_DIM0)
    first = torch.zeros(2, 3)
    acc.add({"x": first})
    acc.add({"x": torch.zeros(1, 3)})
    # A producer that writes into a tensor after handing it over breaks the
    # invariant `add` checked; merging then fails and the request must fail.
    first.resize_(2, 4)
    with pytest.raises(TensorConsolidationError) as info:
        acc.consolidate()
    assert info.value.key == "x"
    assert "concat_dim0" in str(info.value), str(info.value)
