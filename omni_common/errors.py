"""Exception types shared by the services, and the one mapping to gRPC codes.

Every error a client can cause names the offending field. `grpc_code_for`
is the single place that decides which gRPC status code an exception gets;
servicers call it instead of choosing codes themselves.
"""

from __future__ import annotations

import grpc


class OmniError(Exception):
    """Base of all omni-serving errors. `code` is the gRPC status it maps to."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidArgumentError(OmniError, ValueError):
    """A request field is malformed. The message names the field."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class NotFoundError(OmniError, LookupError):
    """A named thing (request, region, voice) does not exist."""

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


def grpc_code_for(exc: BaseException) -> grpc.StatusCode:
    """Map an exception to the gRPC status code a client should see.

    Our own errors carry their code. Plain Python errors that mean "the input
    is wrong" map to client codes; anything else is INTERNAL (the only code
    whose traceback servers log).
    """
    if isinstance(exc, OmniError):
        return exc.code
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        code = exc.code()
        if isinstance(code, grpc.StatusCode):
            return code
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    if isinstance(exc, (ValueError, TypeError)):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, KeyError):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, MemoryError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, (ConnectionError, BrokenPipeError)):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL
