"""The coordinator's errors, each tied to one gRPC status code.

The core raises these without importing grpc; the servicer turns them into
statuses and the client turns statuses back into them, so a caller on either side
catches the same classes. Messages name the field, the value received, and the fix.
"""

from __future__ import annotations

from weightsync.errors import PermanentError, RetryableError


class InvalidArgument(PermanentError):
    code = "INVALID_ARGUMENT"


class NotFound(PermanentError):
    code = "NOT_FOUND"


class FailedPrecondition(PermanentError):
    code = "FAILED_PRECONDITION"


class Unauthenticated(PermanentError):
    code = "UNAUTHENTICATED"


class PermissionDenied(PermanentError):
    code = "PERMISSION_DENIED"


class ResourceExhausted(PermanentError):
    code = "RESOURCE_EXHAUSTED"


class Unavailable(RetryableError):
    code = "UNAVAILABLE"


class DeadlineExceeded(RetryableError):
    code = "DEADLINE_EXCEEDED"


class Internal(PermanentError):
    code = "INTERNAL"


BY_CODE: dict[str, type[PermanentError | RetryableError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        FailedPrecondition,
        Unauthenticated,
        PermissionDenied,
        ResourceExhausted,
        Unavailable,
        DeadlineExceeded,
        Internal,
    )
}


def code_of(error: BaseException) -> str:
    """The status code name for ``error`` (INVALID_ARGUMENT for other permanent errors, INTERNAL otherwise)."""
    code = getattr(error, "code", None)
    if isinstance(code, str):
        return code
    if isinstance(error, PermanentError):
        return "INVALID_ARGUMENT"
    return "INTERNAL"
