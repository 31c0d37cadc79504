"""Typed errors: one root, one subclass per gRPC status code.

The service answers a failed call with a ``google.rpc.Status`` in the
``grpc-status-details-bin`` trailer: exactly one ``ErrorInfo`` (domain ``context-engine``, an
UPPER_SNAKE_CASE reason, metadata with every dynamic value) and, for malformed input, a
``BadRequest`` listing every bad field. Branch on :attr:`ContextEngineError.reason` and the
class, never on the message text. When the failed call was the model's own
``context.update_working_state`` call, a ``LocalizedMessage`` holds the tool result to return to
the model (:attr:`ContextEngineError.tool_result`: what was wrong, and the tool's input schema).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, cast

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status


@dataclass(frozen=True, kw_only=True)
class FieldViolation:
    """One bad field of a malformed request (``google.rpc.BadRequest.FieldViolation``)."""

    field: str
    description: str


class ContextEngineError(Exception):
    """A failed call. ``reason``, ``domain`` and ``metadata`` come from the status's
    ``ErrorInfo`` (empty when the failure did not come from the service, e.g. a deadline);
    ``field_violations`` from its ``BadRequest``; ``tool_result`` from its
    ``LocalizedMessage``: for a refused ``context.update_working_state`` call, the text to
    return to the model as that call's result ("" otherwise)."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, *, code: grpc.StatusCode | None = None, reason: str = "",
                 domain: str = "", metadata: Mapping[str, str] | None = None,
                 field_violations: Sequence[FieldViolation] = (),
                 tool_result: str = "") -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.message = message
        self.reason = reason
        self.domain = domain
        self.metadata: Mapping[str, str] = MappingProxyType(dict(metadata or {}))
        self.field_violations: tuple[FieldViolation, ...] = tuple(field_violations)
        self.tool_result = tool_result

    def __str__(self) -> str:
        head = f"{self.code.name}"
        if self.reason and self.reason != head:  # malformed input's reason is the code's name
            head += f" {self.reason}"
        return f"{head}: {self.message}" if self.message else head

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(code={self.code.name}, reason={self.reason!r}, "
                f"message={self.message!r}, metadata={dict(self.metadata)!r})")

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled (a process pool hands a worker's error back so) and copied whole: every
        attribute, the metadata as a plain dict (a read-only view cannot be pickled)."""
        return (_rebuilt, (type(self), self.args, {**self.__dict__,
                                                   "metadata": dict(self.metadata)}))


def _rebuilt(cls: type[ContextEngineError], args: tuple[Any, ...],
             state: dict[str, Any]) -> ContextEngineError:
    """An error ``__reduce__`` took apart, as it was."""
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    error.__dict__.update(state)
    error.metadata = MappingProxyType(dict(state["metadata"]))
    return error


class Cancelled(ContextEngineError):
    code = grpc.StatusCode.CANCELLED


CLOSED = "the client is closed: nothing was sent"
CLOSED_DURING = "the client was closed during the call: it may have reached the service"


class ClientClosed(Cancelled):
    """A call made on a client after its ``close()`` (nothing was sent), or cancelled by it
    while in flight (the message says which)."""

    def __init__(self, message: str = CLOSED) -> None:
        super().__init__(message)


class Unknown(ContextEngineError):
    code = grpc.StatusCode.UNKNOWN


class InvalidArgument(ContextEngineError):
    """Malformed input; ``field_violations`` lists every bad field."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class DeadlineExceeded(ContextEngineError):
    """The call's deadline passed before the service answered."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFound(ContextEngineError):
    """An unknown session or epoch (reason ``SESSION_NOT_FOUND``)."""

    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(ContextEngineError):
    code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDenied(ContextEngineError):
    """The credentials do not allow this RPC, or the request names another tenant."""

    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(ContextEngineError):
    """A request over the server's limits (size, items, concurrency)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(ContextEngineError):
    """The request is well formed but cannot be served as it is (e.g. ``BUDGET_EXCEEDED``,
    ``PREFIX_CLASS_OVER_CAP``, ``COMPACTION_DEPTH_EXCEEDED``)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Aborted(ContextEngineError):
    code = grpc.StatusCode.ABORTED


class OutOfRange(ContextEngineError):
    code = grpc.StatusCode.OUT_OF_RANGE


class Unimplemented(ContextEngineError):
    code = grpc.StatusCode.UNIMPLEMENTED


class Internal(ContextEngineError):
    code = grpc.StatusCode.INTERNAL


class Unavailable(ContextEngineError):
    """The service or one of its dependencies cannot answer now; nothing changed. Retried
    already where that is safe (see the client's retry policy)."""

    code = grpc.StatusCode.UNAVAILABLE


class DataLoss(ContextEngineError):
    code = grpc.StatusCode.DATA_LOSS


class Unauthenticated(ContextEngineError):
    """No credentials, or credentials the service does not know."""

    code = grpc.StatusCode.UNAUTHENTICATED


_BY_CODE: Mapping[grpc.StatusCode, type[ContextEngineError]] = {
    cls.code: cls for cls in (
        Cancelled, Unknown, InvalidArgument, DeadlineExceeded, NotFound, AlreadyExists,
        PermissionDenied, ResourceExhausted, FailedPrecondition, Aborted, OutOfRange,
        Unimplemented, Internal, Unavailable, DataLoss, Unauthenticated)
}


def error_class(code: grpc.StatusCode) -> type[ContextEngineError]:
    """The subclass raised for ``code``."""
    return _BY_CODE.get(code, ContextEngineError)


def from_rpc_error(err: grpc.RpcError) -> ContextEngineError:
    """The typed error for a failed call (``grpc.RpcError`` of a sync or an asyncio channel).
    The rich status is decoded by ``grpc_status``; a status whose details contradict the call's
    own code or message, or a trailer that does not decode as one, is ignored (the call's code
    and message stand)."""
    if not isinstance(err, grpc.Call | grpc.aio.AioRpcError):
        # an RpcError that is not a call (e.g. raised before one started)
        return ContextEngineError(str(err), code=grpc.StatusCode.UNKNOWN)
    code, message = err.code(), err.details() or ""
    try:
        # an AioRpcError answers the same code(), details() and trailing_metadata() it reads
        status = rpc_status.from_call(cast("grpc.Call", err))
    except (ValueError, DecodeError):  # a contradicting status, or bytes that are not one
        status = None
    return from_status(code, message, status)


def from_status(code: grpc.StatusCode, message: str,
                status: status_pb2.Status | None) -> ContextEngineError:
    """The typed error for a status code, its message and its rich status, if any. A status
    one of whose details does not decode as the type it names is not read at all."""
    reason, domain = "", ""
    metadata: dict[str, str] = {}
    violations: list[FieldViolation] = []
    tool_result = ""
    try:
        for detail in status.details if status is not None else ():
            info = error_details_pb2.ErrorInfo()
            bad = error_details_pb2.BadRequest()
            text = error_details_pb2.LocalizedMessage()
            if detail.Unpack(info):  # False when the detail is another message type
                if not reason:  # the service sends exactly one
                    reason, domain, metadata = info.reason, info.domain, dict(info.metadata)
            elif detail.Unpack(bad):
                violations.extend(FieldViolation(field=v.field, description=v.description)
                                  for v in bad.field_violations)
            elif detail.Unpack(text) and not tool_result:
                tool_result = text.message
    except DecodeError:  # a corrupted status: none of it is the call's to report
        reason, domain, metadata, violations, tool_result = "", "", {}, [], ""
    return error_class(code)(message, code=code, reason=reason, domain=domain,
                             metadata=metadata, field_violations=violations,
                             tool_result=tool_result)
