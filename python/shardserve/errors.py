"""shardserve's exceptions: one class per gRPC status code, all under :class:`Error`.

Every failure a call can meet (an answer with a non-OK status, a broken connection, a deadline
that passed, bad input caught before sending) raises an :class:`Error` whose ``code`` is the
``grpc.StatusCode`` and whose ``message`` is the server's (or the client's) explanation, naming
the field, the value and the bound as the server does. Catch a subclass to handle one kind::

    try:
        client.embedding("emb", ids)
    except shardserve.NotFoundError:
        ...  # no such table
"""

from typing import Dict, Optional, Type

import grpc

__all__ = [
    "Error",
    "CancelledError",
    "UnknownError",
    "InvalidArgumentError",
    "DeadlineExceededError",
    "NotFoundError",
    "AlreadyExistsError",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "FailedPreconditionError",
    "AbortedError",
    "OutOfRangeError",
    "UnimplementedError",
    "InternalError",
    "UnavailableError",
    "DataLossError",
    "UnauthenticatedError",
    "code_from_number",
    "error_for_code",
    "from_rpc_error",
]


class Error(Exception):
    """A failed shardserve call.

    Attributes:
        code: the ``grpc.StatusCode`` of the failure.
        message: what went wrong (the server's status message, or the client's).
    """

    #: The status code every instance of this class carries (``UNKNOWN`` for the base class,
    #: which is only raised directly for a code without a class of its own).
    code_class: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, code: Optional[grpc.StatusCode] = None) -> None:
        super().__init__(message)
        self.code: grpc.StatusCode = code if code is not None else self.code_class
        self.message: str = message

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"

    def __reduce__(self):  # picklable (e.g. across multiprocessing), with its code
        return (_rebuild, (self.code.value[0], self.message))


def _rebuild(number: int, message: str) -> "Error":
    return error_for_code(_CODE_BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN), message)


class CancelledError(Error):
    """The call was cancelled (CANCELLED)."""

    code_class = grpc.StatusCode.CANCELLED


class UnknownError(Error):
    """An error the server did not classify (UNKNOWN)."""

    code_class = grpc.StatusCode.UNKNOWN


class InvalidArgumentError(Error, ValueError):
    """Bad input: ids out of range, bad offsets, shape or dtype mismatch, bad table spec
    (INVALID_ARGUMENT). Nothing changed on the server."""

    code_class = grpc.StatusCode.INVALID_ARGUMENT


class DeadlineExceededError(Error, TimeoutError):
    """The call's deadline passed before an answer came (DEADLINE_EXCEEDED)."""

    code_class = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFoundError(Error, LookupError):
    """Unknown table (or worker) (NOT_FOUND)."""

    code_class = grpc.StatusCode.NOT_FOUND


class AlreadyExistsError(Error):
    """A table of that name exists (ALREADY_EXISTS)."""

    code_class = grpc.StatusCode.ALREADY_EXISTS


class PermissionDeniedError(Error):
    """PERMISSION_DENIED."""

    code_class = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhaustedError(Error):
    """A request over the size limits, or a worker whose queue is full (RESOURCE_EXHAUSTED)."""

    code_class = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPreconditionError(Error):
    """The table is not loaded on every rank yet, or a worker could not load it
    (FAILED_PRECONDITION)."""

    code_class = grpc.StatusCode.FAILED_PRECONDITION


class AbortedError(Error):
    """The operation was overtaken, e.g. a table created again during its export (ABORTED)."""

    code_class = grpc.StatusCode.ABORTED


class OutOfRangeError(Error):
    """OUT_OF_RANGE."""

    code_class = grpc.StatusCode.OUT_OF_RANGE


class UnimplementedError(Error):
    """The server does not have this method (UNIMPLEMENTED)."""

    code_class = grpc.StatusCode.UNIMPLEMENTED


class InternalError(Error):
    """A server-side invariant broke, or an answer did not match its own shape (INTERNAL)."""

    code_class = grpc.StatusCode.INTERNAL


class UnavailableError(Error, ConnectionError):
    """No worker could answer within the deadline: a rank died, the group is re-forming, the
    connection broke (UNAVAILABLE). The client has already retried until the deadline."""

    code_class = grpc.StatusCode.UNAVAILABLE


class DataLossError(Error):
    """DATA_LOSS."""

    code_class = grpc.StatusCode.DATA_LOSS


class UnauthenticatedError(Error):
    """UNAUTHENTICATED."""

    code_class = grpc.StatusCode.UNAUTHENTICATED


_CLASS_BY_CODE: Dict[grpc.StatusCode, Type[Error]] = {
    cls.code_class: cls
    for cls in (
        CancelledError,
        UnknownError,
        InvalidArgumentError,
        DeadlineExceededError,
        NotFoundError,
        AlreadyExistsError,
        PermissionDeniedError,
        ResourceExhaustedError,
        FailedPreconditionError,
        AbortedError,
        OutOfRangeError,
        UnimplementedError,
        InternalError,
        UnavailableError,
        DataLossError,
        UnauthenticatedError,
    )
}

# google.rpc.Code numbers (StreamResponse.code) -> grpc.StatusCode.
_CODE_BY_NUMBER: Dict[int, grpc.StatusCode] = {c.value[0]: c for c in grpc.StatusCode}


def code_from_number(number: int) -> grpc.StatusCode:
    """The ``grpc.StatusCode`` of a google.rpc.Code number (UNKNOWN for a number gRPC lacks)."""
    return _CODE_BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN)


def error_for_code(code: grpc.StatusCode, message: str) -> Error:
    """An instance of the :class:`Error` subclass for ``code``."""
    return _CLASS_BY_CODE.get(code, Error)(message, code)


def from_rpc_error(err: grpc.RpcError) -> Error:
    """The :class:`Error` for a ``grpc.RpcError`` (sync or asyncio), with its code and details."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    return error_for_code(code or grpc.StatusCode.UNKNOWN, details or "")
