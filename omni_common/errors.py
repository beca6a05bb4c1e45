"""Exception types shared by the services, and the one mapping to gRPC codes.

Every error a client can cause names the offending field. `grpc_code_for`
is the single place that decides which gRPC status code an exception gets;
servicers call it instead of choosing codes themselves.

Only our own classes say "the client is at fault": `InvalidArgumentError`
and `NotFoundError` derive from `OmniError` alone (not `ValueError` or
`LookupError`), so a validation that is meant for a client must raise them,
naming the field. A plain `ValueError`, `TypeError` or `KeyError` (from
numpy, a dict, our own code) is a bug: it maps to INTERNAL, and
`log_internal` logs its traceback under a fresh error id that the client's
message names, with nothing of the exception's own text.

`public_message` is the single place that decides what text a client sees
for an exception: bounded in length, one line, with socket addresses, file
paths and Python type names taken out (they stay in the server's log).
Messages that quote a client's value use `quote_value`, which keeps only a
short prefix of it.
"""

from __future__ import annotations

import logging
import re
import uuid

import grpc

MAX_MESSAGE_CHARS = 512
"""Longest status message a client is sent (gRPC details or an HTTP error message)."""
MAX_QUOTED_CHARS = 40
"""Longest prefix of a client's value quoted back in an error message."""
INTERNAL_MESSAGE = "internal error; the server log has the details"
"""What a client is told about a failure that is not its mistake and not a known condition
(`internal_message` adds the error id under which the server logged it)."""


class OmniError(Exception):
    """Base of all omni-serving errors. `code` is the gRPC status it maps to."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidArgumentError(OmniError):
    """A request field is malformed. The message names the field.

    Not a `ValueError`: code that catches ValueError (around int(), json,
    numpy) does not swallow a client error, and a ValueError of ours is
    never taken for one."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class NotFoundError(OmniError):
    """A named thing (request, region, voice) does not exist (not a `LookupError`:
    a `KeyError` from a dict of ours is a bug, not a missing thing)."""

    code = grpc.StatusCode.NOT_FOUND


class FailedPreconditionError(OmniError):
    """The system is not in a state where the operation can run."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class PermissionDeniedError(OmniError):
    """The caller named something it may not touch (another deployment's memory)."""

    code = grpc.StatusCode.PERMISSION_DENIED


class OutOfRangeError(OmniError):
    """An offset or size points outside the memory it refers to."""

    code = grpc.StatusCode.OUT_OF_RANGE


class ResourceExhaustedError(OmniError):
    """Overload: too many requests, no free slot, queue full."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class UnavailableError(OmniError):
    """A dependency is unreachable or the service is shutting down."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceededError(OmniError, TimeoutError):
    """Something did not happen in time (for example slot readiness)."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class AbortedError(OmniError):
    """The operation was aborted (request cancelled, stale data refused)."""

    code = grpc.StatusCode.ABORTED


class AlreadyExistsError(OmniError):
    """An id is already in use."""

    code = grpc.StatusCode.ALREADY_EXISTS


CLIENT_ERRORS = (OmniError, grpc.RpcError)
"""Exceptions that end a call with the code `grpc_code_for` gives them (ours,
and a decoder's status passed on)."""


def grpc_code_for(exc: BaseException) -> grpc.StatusCode:
    """Map an exception to the gRPC status code a client should see.

    Our own errors carry their code. A plain `ValueError`, `TypeError`,
    `KeyError` or `LookupError` is INTERNAL: the client's mistakes are
    `InvalidArgumentError` / `NotFoundError`, raised where a field is
    checked. Anything else unknown is INTERNAL too (the only code whose
    traceback servers log, see `log_internal`).
    """
    if isinstance(exc, OmniError):
        return exc.code
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        code = exc.code()
        if isinstance(code, grpc.StatusCode):
            return code
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    if isinstance(exc, MemoryError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, (ConnectionError, BrokenPipeError)):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


def new_error_id() -> str:
    """A short random id tying a client's INTERNAL status to one server log record."""
    return uuid.uuid4().hex[:12]


def internal_message(error_id: str) -> str:
    """The client's message for an internal error logged under `error_id`."""
    return f"internal error (error id {error_id}); the server log has the details"


def log_internal(log: logging.Logger, what: str, exc: BaseException) -> str:
    """Log `exc` with its traceback under a new error id; return the client's message.

    The message is `internal_message(id)`: the exception's own text stays in
    the log (it may hold paths, addresses, values of other requests).
    """
    error_id = new_error_id()
    log.error("%s failed [error id %s]", what, error_id, exc_info=exc)
    return internal_message(error_id)


def quote_value(value: object, limit: int = MAX_QUOTED_CHARS) -> str:
    """`value` quoted for an error message: repr-escaped, cut to `limit` characters plus "…".

    Control characters and unpaired surrogates come out escaped, so the result
    is always printable UTF-8 whatever the client sent.
    """
    text = value if isinstance(value, str) else str(value)
    out = repr(text[:limit])
    if len(out) > limit + 2:  # escapes made it longer than the prefix
        out = out[: limit + 1] + out[0]
    return out + ("…" if len(text) > limit else "")


_REDACTIONS: tuple[tuple[re.Pattern[str], str], ...] = (
    # Python reprs: <class 'pkg.mod.Name'>, <pkg.Name object at 0x7f...>
    (re.compile(r"<class '[^'>]*'>"), "[type]"),
    (re.compile(r"<[\w.]+ object at 0x[0-9a-fA-F]+>"), "[object]"),
    # gRPC targets and resolved addresses: unix:///run/x.sock, ipv4:10.0.0.5:50051, ...
    (
        re.compile(
            r"\b(?:unix-abstract|unix|ipv4|ipv6|dns|vsock):(?:[^\s,;'\"()\[\]]*[^\s,;:'\"()\[\]])?"
        ),
        "[address]",
    ),
    # Absolute file paths with at least two components: /tmp/omni/decoder.sock
    (re.compile(r"(?<![\w/.~-])/[^\s/'\",;:()\[\]]+(?:/[^\s/'\",;:()\[\]]*)+"), "[path]"),
    # Qualified Python names: vllm.v1.engine.exceptions.EngineDeadError
    (re.compile(r"\b[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+\.[A-Z]\w*(?:Error|Exception)\b"), "[type]"),
    (re.compile(r"\b[a-z_]\w*(?:\.[a-z_]\w*)+\.[A-Z]\w*\b"), "[type]"),
)
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]+")
_SPACES = re.compile(r"\s{2,}")


def sanitize_message(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """`text` made fit for a client: one line, at most `limit` characters, no internals.

    Socket addresses, absolute paths, Python reprs and qualified class names
    are replaced by placeholders; control characters become spaces;
    unpaired surrogates are escaped (gRPC sends details as UTF-8).
    """
    for pattern, placeholder in _REDACTIONS:
        text = pattern.sub(placeholder, text)
    text = _SPACES.sub(" ", _CONTROL.sub(" ", text)).strip()
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    if len(text) > limit:
        text = text[: limit - 1].rstrip() + "…"
    return text


def public_message(exc: BaseException, limit: int = MAX_MESSAGE_CHARS) -> str:
    """The message a client is sent for `exc` (see `sanitize_message`).

    Our own errors and plain client errors keep their (sanitized) text; an
    unexpected exception, a bug, gets `INTERNAL_MESSAGE` and nothing of its own.
    """
    if not isinstance(exc, OmniError) and grpc_code_for(exc) is grpc.StatusCode.INTERNAL:
        return INTERNAL_MESSAGE
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "details"):
        details = exc.details()
        text = details if isinstance(details, str) else ""
    else:
        text = str(exc)
    return sanitize_message(text, limit) or INTERNAL_MESSAGE
