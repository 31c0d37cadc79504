"""Domain errors -> google.rpc.Status with exactly one ErrorInfo, in one table (ARCHITECTURE.md
"The API layer")."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status
from opentelemetry.trace import NoOpTracer, Tracer

from context_engine.domain import errors as e
from context_engine.telemetry.logs import log
from context_engine.telemetry.metrics import Metrics
from context_engine.telemetry.tracing import failed, server_span
from context_engine.v1 import context_engine_pb2 as pb

# The service's full name, as spans and service configs name it.
SERVICE = pb.DESCRIPTOR.services_by_name["ContextEngine"].full_name

DOMAIN = "context-engine"

# When the call reached the first of the service's interceptors (``time.perf_counter()``): an
# RPC's latency sample and log line count from here, so the credentials check (a token table
# lookup) is part of the call's time, whether the call is then served or turned away.
CALL_STARTED: ContextVar[float | None] = ContextVar("context_engine_call_started",
                                                    default=None)


@contextlib.contextmanager
def timed_call() -> Iterator[None]:
    """Marks the call as started now, unless an interceptor that saw it first already did."""
    if CALL_STARTED.get() is not None:
        yield
        return
    started = CALL_STARTED.set(time.perf_counter())
    try:
        yield
    finally:
        CALL_STARTED.reset(started)


def call_started() -> float:
    """When the call started (``timed_call``); now when no interceptor marked it."""
    started = CALL_STARTED.get()
    return time.perf_counter() if started is None else started

# The one table. Order matters only for subclasses (none share a parent today).
CODES: tuple[tuple[type[e.ContextEngineError], grpc.StatusCode], ...] = (
    (e.InvalidInput, grpc.StatusCode.INVALID_ARGUMENT),
    (e.PrefixClassOverCap, grpc.StatusCode.FAILED_PRECONDITION),
    (e.RequiredToolUnavailable, grpc.StatusCode.FAILED_PRECONDITION),
    (e.PinnedVersionConflict, grpc.StatusCode.FAILED_PRECONDITION),
    (e.BudgetExceeded, grpc.StatusCode.FAILED_PRECONDITION),
    (e.HistoryFloorUnreachable, grpc.StatusCode.FAILED_PRECONDITION),
    (e.ConstraintCapReached, grpc.StatusCode.FAILED_PRECONDITION),
    (e.CompactionDepthExceeded, grpc.StatusCode.FAILED_PRECONDITION),
    (e.NothingToCompact, grpc.StatusCode.FAILED_PRECONDITION),
    (e.BuildBaseUnknown, grpc.StatusCode.FAILED_PRECONDITION),
    (e.SummarizerUnavailable, grpc.StatusCode.UNAVAILABLE),
    (e.SummarizerRefused, grpc.StatusCode.FAILED_PRECONDITION),  # never retried by clients
    (e.SessionNotFound, grpc.StatusCode.NOT_FOUND),
    (e.PrefixHashMismatch, grpc.StatusCode.INTERNAL),
    (e.StoreUnavailable, grpc.StatusCode.UNAVAILABLE),  # StoreConflict too: retried by clients
    (e.RequestTooLarge, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (e.ResponseTooLarge, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (e.TokenizerUnavailable, grpc.StatusCode.UNAVAILABLE),
    (e.AssemblyError, grpc.StatusCode.INTERNAL),
)


def code_for(error: e.ContextEngineError) -> grpc.StatusCode:
    for cls, code in CODES:
        if isinstance(error, cls):
            return code
    return grpc.StatusCode.INTERNAL


# The status travels in trailers, and clients refuse trailers over 8 KiB (gRPC's default soft
# limit; 16 KiB hard): an error echoing a huge or many-times-wrong request would reach the
# caller as RESOURCE_EXHAUSTED without any status. These bounds keep the whole status (message
# percent-encoded, details base64-encoded) well under that.
MAX_MESSAGE_BYTES = 400
MAX_VIOLATIONS_BYTES = 3000  # all listed field violations together (before base64)
MAX_FIELD_BYTES = 100
MAX_DESCRIPTION_BYTES = 160
MAX_METADATA_BYTES = 200
# A tool result for the model (a refused control-tool call: its errors and the tool's input
# schema) travels in the same trailers, so the violations listed beside it get less room.
MAX_TOOL_RESULT_BYTES = 3000
MAX_VIOLATIONS_BESIDE_TOOL_RESULT = 1200
TOOL_RESULT_LOCALE = "en-US"


def _clip(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` UTF-8 bytes (on a character boundary), marked "…"."""
    data = text.encode()
    if len(data) <= limit:
        return text
    return data[:limit - 3].decode(errors="ignore") + "…"


def rich_status(code: grpc.StatusCode, message: str, reason: str,
                metadata: dict[str, str],
                violations: tuple[e.FieldViolation, ...] = (),
                tool_result: str = "") -> status_pb2.Status:
    """The status of one failed call, bounded in size: field violations in order while they
    fit ``MAX_VIOLATIONS_BYTES`` (when some do not, the metadata's ``violations`` counts them
    all and the message says how many are listed), long values clipped. ``tool_result``, the
    text a runtime returns to the model for its refused tool call, is a LocalizedMessage."""
    metadata = {_clip(k, MAX_METADATA_BYTES): _clip(v, MAX_METADATA_BYTES)
                for k, v in metadata.items()}
    listed: list[error_details_pb2.BadRequest.FieldViolation] = []
    size = 0
    room = MAX_VIOLATIONS_BESIDE_TOOL_RESULT if tool_result else MAX_VIOLATIONS_BYTES
    for v in violations:
        entry = error_details_pb2.BadRequest.FieldViolation(
            field=_clip(v.field, MAX_FIELD_BYTES),
            description=_clip(v.description, MAX_DESCRIPTION_BYTES))
        size += entry.ByteSize() + 3
        if size > room:
            break
        listed.append(entry)
    if len(listed) < len(violations):
        metadata["violations"] = str(len(violations))
        message = (f"{len(violations)} violations (the first {len(listed)} in the "
                   f"details): {message}")
    info = any_pb2.Any()
    info.Pack(error_details_pb2.ErrorInfo(reason=reason, domain=DOMAIN, metadata=metadata))
    details = [info]
    if listed:
        bad = any_pb2.Any()
        bad.Pack(error_details_pb2.BadRequest(field_violations=listed))
        details.append(bad)
    if tool_result:
        text = any_pb2.Any()
        text.Pack(error_details_pb2.LocalizedMessage(
            locale=TOOL_RESULT_LOCALE, message=_clip(tool_result, MAX_TOOL_RESULT_BYTES)))
        details.append(text)
    return status_pb2.Status(code=getattr(code_pb2, code.name),
                             message=_clip(message, MAX_MESSAGE_BYTES), details=details)


def status_for(error: e.ContextEngineError) -> tuple[grpc.StatusCode, status_pb2.Status]:
    code = code_for(error)
    violations = error.violations if isinstance(error, e.InvalidInput) else ()
    return code, rich_status(code, str(error), error.reason, error.metadata(), violations,
                             error.tool_result)


def internal_status() -> tuple[grpc.StatusCode, status_pb2.Status]:
    code = grpc.StatusCode.INTERNAL
    return code, rich_status(code, "internal error", "INTERNAL", {})


def ended(context: grpc.aio.ServicerContext[Any, Any], metrics: Metrics | None, *,
          method: str, code: grpc.StatusCode, reason: str, tenant: str = "",
          tracer: Tracer | None = None) -> None:
    """Record a call that ends (with ``code``, not OK) before the servicer runs, as the
    servicer records its own: the RPC's latency sample (from ``call_started``), its span and
    its one log line. For an interceptor's refusal (``refuse``), and for a call cancelled
    while an interceptor waited (its deadline passed, or its caller gave up, during the
    credentials check's token lookup)."""
    elapsed = time.perf_counter() - call_started()  # the credentials check's lookup included
    # a span of its own, as the servicer's calls have: its log line carries the caller's trace
    with server_span(tracer or NoOpTracer(), SERVICE, method,
                     context.invocation_metadata()) as span:
        if metrics is not None:
            metrics.rpc_seconds.labels(method=method, code=code.name).observe(elapsed)
        log("rpc", logging.WARNING, method=method, code=code.name,
            duration_ms=round(elapsed * 1000, 3), reason=reason, tenant=tenant)
        if span.is_recording():
            span.set_attribute("rpc.grpc.status_code", code.value[0])
            span.set_attribute("context_engine.status_code", code.name)
            failed(span, reason)


async def refuse(context: grpc.aio.ServicerContext[Any, Any], metrics: Metrics | None, *,
                 method: str, code: grpc.StatusCode, reason: str, message: str,
                 metadata: dict[str, str], tenant: str = "",
                 tracer: Tracer | None = None) -> None:
    """Answer a call an interceptor turns away before the servicer runs (credentials,
    limits, shutdown) as the servicer answers its own failures: the rich status, the RPC's
    latency sample (from ``call_started``) and its one log line. Raises, as
    ``context.abort`` does."""
    ended(context, metrics, method=method, code=code, reason=reason, tenant=tenant,
          tracer=tracer)
    status = rich_status(code, message, reason, metadata)
    await context.abort(code, message, rpc_status.to_status(status).trailing_metadata)
