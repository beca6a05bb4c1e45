"""grpc_code_for: the one exception -> status code table."""

from __future__ import annotations

import grpc
import pytest

from omni_common.accumulation import TensorAccumulationError, TensorConsolidationError
from omni_common.errors import (
    AbortedError,
    AlreadyExistsError,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    OmniError,
    OutOfRangeError,
    ResourceExhaustedError,
    UnavailableError,
    grpc_code_for,
)
from omni_common.modality import UnknownModalityError

C = grpc.StatusCode


@pytest.mark.parametrize(
    ("exc", "want"),
    [
        (OmniError("boom"), C.INTERNAL),
        (InvalidArgumentError("prompt", "empty"), C.INVALID_ARGUMENT),
        (NotFoundError("request r1"), C.NOT_FOUND),
        (FailedPreconditionError("not started"), C.FAILED_PRECONDITION),
        (OutOfRangeError("offset"), C.OUT_OF_RANGE),
        (ResourceExhaustedError("queue full"), C.RESOURCE_EXHAUSTED),
        (UnavailableError("shutting down"), C.UNAVAILABLE),
        (DeadlineExceededError("slot not ready"), C.DEADLINE_EXCEEDED),
        (AbortedError("cancelled"), C.ABORTED),
        (AlreadyExistsError("id in use"), C.ALREADY_EXISTS),
        (UnknownModalityError("smell"), C.INVALID_ARGUMENT),
        (TensorAccumulationError("audio", "shape"), C.INTERNAL),
        (TensorConsolidationError("audio", "cat"), C.INTERNAL),
        (ValueError("bad"), C.INVALID_ARGUMENT),
        (TypeError("bad"), C.INVALID_ARGUMENT),
        (KeyError("k"), C.NOT_FOUND),
        (TimeoutError(), C.DEADLINE_EXCEEDED),
        (IndexError(3), C.INTERNAL),  # a LookupError but not a missing key
        (MemoryError(), C.RESOURCE_EXHAUSTED),
        (ConnectionError("reset"), C.UNAVAILABLE),
        (BrokenPipeError(), C.UNAVAILABLE),
        (RuntimeError("bug"), C.INTERNAL),
        (Exception("bug"), C.INTERNAL),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else None,
)
def test_grpc_code_for(exc: BaseException, want: grpc.StatusCode) -> None:
    got = grpc_code_for(exc)
    assert got == want, f"{exc!r}: {got=}, {want=}"


def test_omni_errors_win_over_their_python_bases() -> None:
    # InvalidArgumentError is a ValueError, NotFoundError a LookupError,
    # DeadlineExceededError a TimeoutError: the class's own code decides.
    assert isinstance(NotFoundError("x"), LookupError)
    assert grpc_code_for(NotFoundError("x")) == C.NOT_FOUND
    assert isinstance(DeadlineExceededError("x"), TimeoutError)
    assert grpc_code_for(DeadlineExceededError("x")) == C.DEADLINE_EXCEEDED


class _FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code


def test_rpc_error_keeps_its_code() -> None:
    got = grpc_code_for(_FakeRpcError(C.RESOURCE_EXHAUSTED))
    assert got == C.RESOURCE_EXHAUSTED, f"{got=}"


def test_invalid_argument_names_the_field() -> None:
    err = InvalidArgumentError("sampling.temperature", "must be >= 0, got -1")
    assert err.field == "sampling.temperature"
    assert "sampling.temperature" in str(err), str(err)
    assert str(err) == "sampling.temperature: must be >= 0, got -1", str(err)
    assert isinstance(err, ValueError)
