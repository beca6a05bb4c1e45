"""grpc_code_for: the one exception -> status code table."""

from __future__ import annotations

import grpc
import pytest

from omni_common.accumulation import TensorAccumulationError, TensorConsolidationError
from omni_common.errors import (
    INTERNAL_MESSAGE,
    MAX_MESSAGE_CHARS,
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
    log_internal,
    public_message,
    quote_value,
    sanitize_message,
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
        # plain Python errors are our bugs, never the client's fault
        (ValueError("bad"), C.INTERNAL),
        (TypeError("bad"), C.INTERNAL),
        (KeyError("k"), C.INTERNAL),
        (LookupError("k"), C.INTERNAL),
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


def test_client_error_classes_are_not_python_errors() -> None:
    """Catching ValueError / LookupError never swallows a client error, and a
    ValueError / KeyError of ours is never mistaken for one."""
    for exc in (InvalidArgumentError("prompt", "empty"), NotFoundError("request r1")):
        for base in (ValueError, TypeError, LookupError):
            assert not isinstance(exc, base), f"{type(exc).__name__} is a {base.__name__}"


def test_omni_errors_win_over_their_python_bases() -> None:
    # DeadlineExceededError is a TimeoutError: the class's own code decides.
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
    assert grpc_code_for(err) == C.INVALID_ARGUMENT, grpc_code_for(err)
    assert public_message(err) == "sampling.temperature: must be >= 0, got -1", public_message(err)


# ---------------------------------------------------------------------------
# What clients are told.


def test_quote_value_keeps_a_short_escaped_prefix() -> None:
    assert quote_value("zed") == "'zed'"
    long = quote_value("a" * 10_000)
    assert long == "'" + "a" * 40 + "'…", long
    weird = quote_value("\x00\u202e\ud800" * 30)
    assert weird.isprintable() and len(weird) <= 43, weird
    weird.encode("utf-8")  # no unpaired surrogate left
    assert quote_value(10**400).endswith("…") and len(quote_value(10**400)) <= 43


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("decoder at unix:///run/omni/decoder.sock: down", "decoder at [address]: down"),
        ("ipv4:10.0.0.5:50051: Connection refused", "[address]: Connection refused"),
        ("cannot open /srv/models/x/config.json", "cannot open [path]"),
        (
            "Unexpected <class 'vllm.v1.engine.exceptions.EngineDeadError'>: x",
            "Unexpected [type]: x",
        ),
        ("raised omni_common.errors.InvalidArgumentError", "raised [type]"),
        ("<torch.Tensor object at 0x7f00aa>", "[object]"),
        ("line one\nline two\t\x00 end", "line one line two end"),
        ("text+audio, a/b, 1/2, sampling_params.top_p: bad", None),  # left alone
    ],
)
def test_sanitize_message(text: str, want: str | None) -> None:
    assert sanitize_message(text) == (text if want is None else want)


def test_sanitize_message_bounds_length() -> None:
    out = sanitize_message("x" * 5000)
    assert len(out) == MAX_MESSAGE_CHARS and out.endswith("…")
    assert sanitize_message("\ud800 lone").encode("utf-8")


def test_public_message_hides_bugs() -> None:
    assert public_message(RuntimeError("at /secret/path <class 'x.Y'>")) == INTERNAL_MESSAGE
    for bug in (ValueError("x at /srv/a.py"), KeyError("secret_key"), TypeError("t")):
        assert public_message(bug) == INTERNAL_MESSAGE, f"{bug!r}: {public_message(bug)!r}"
    assert public_message(InvalidArgumentError("voice", "bad " + "v" * 900)).startswith(
        "voice: bad"
    )
    assert len(public_message(InvalidArgumentError("voice", "v" * 900))) == MAX_MESSAGE_CHARS
    assert public_message(OmniError("decoder at unix:///a/b.sock")) == "decoder at [address]"


def test_log_internal_names_an_id_the_log_also_has(caplog: pytest.LogCaptureFixture) -> None:
    """The client's message has the error id and nothing of the exception; the
    log record has the same id and the traceback."""
    import logging

    try:
        {}["secret_key"]
    except KeyError as exc:
        with caplog.at_level(logging.ERROR, logger="test.errors"):
            message = log_internal(logging.getLogger("test.errors"), "Speak", exc)
    assert message.startswith("internal error (error id "), message
    assert "secret_key" not in message and "KeyError" not in message, message
    error_id = message.split("error id ", 1)[1].split(")", 1)[0]
    assert len(error_id) == 12, error_id
    records = [r for r in caplog.records if error_id in r.getMessage()]
    assert len(records) == 1, [r.getMessage() for r in caplog.records]
    assert records[0].exc_info is not None and records[0].exc_info[0] is KeyError, records[0].exc_info
    again = log_internal(logging.getLogger("test.errors"), "Speak", KeyError("k"))
    assert again != message, "two internal errors got the same id"
