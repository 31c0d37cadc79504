"""Typed Python client of the context-engine gRPC service.

:class:`Client` blocks, :class:`AsyncClient` runs on asyncio; both take the request messages of
``context_engine.v1`` (:mod:`context_engine_client.pb`) as keyword arguments and raise
:class:`ContextEngineError` subclasses::

    from context_engine_client import Client, pb

    with Client(target="127.0.0.1:50051", token="...") as engine:
        plan = engine.plan(request=pb.PlanRequest(tenant_id="acme", session_id="s-1", ...)).plan
"""

from context_engine_client._channel import DEFAULT_TIMEOUT, RetryPolicy
from context_engine_client._pb.context_engine.v1 import context_engine_pb2 as pb
from context_engine_client.aio import AsyncClient
from context_engine_client.client import Client
from context_engine_client.errors import (
    Aborted,
    AlreadyExists,
    Cancelled,
    ContextEngineError,
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    FieldViolation,
    Internal,
    InvalidArgument,
    NotFound,
    OutOfRange,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    Unimplemented,
    Unknown,
)

__all__ = [
    "DEFAULT_TIMEOUT",
    "Aborted",
    "AlreadyExists",
    "AsyncClient",
    "Cancelled",
    "Client",
    "ContextEngineError",
    "DataLoss",
    "DeadlineExceeded",
    "FailedPrecondition",
    "FieldViolation",
    "Internal",
    "InvalidArgument",
    "NotFound",
    "OutOfRange",
    "PermissionDenied",
    "ResourceExhausted",
    "RetryPolicy",
    "Unauthenticated",
    "Unavailable",
    "Unimplemented",
    "Unknown",
    "pb",
]
