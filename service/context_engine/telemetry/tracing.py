"""OpenTelemetry tracing: off unless the standard ``OTEL_*`` variables ask for OTLP export.

Without a provider every tracer here is the API's no-op tracer, so an unconfigured server pays
for a few no-op calls per RPC and nothing else. Span attributes carry sizes, epochs, hashes and
the hashed session key, never tenant or session ids, message content or credentials.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

INSTRUMENTATION = "context_engine"
SERVICE_NAME = "context-engine"
# Only W3C trace context is read from the caller: never any other metadata (credentials).
_PROPAGATOR = TraceContextTextMapPropagator()
_TRACE_KEYS = frozenset({"traceparent", "tracestate"})
_TRUE = {"true", "1", "yes", "on"}

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider


def otlp_requested(env: Mapping[str, str]) -> bool:
    """Whether the standard variables ask for OTLP trace export. Off by default:
    ``OTEL_SDK_DISABLED=true`` disables; ``OTEL_TRACES_EXPORTER`` naming ``otlp`` enables
    (``none`` disables); otherwise an OTLP endpoint variable being set enables."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() in _TRUE:
        return False
    exporters = {e.strip().lower() for e in env.get("OTEL_TRACES_EXPORTER", "").split(",")
                 if e.strip()}
    if exporters:
        return "otlp" in exporters
    return bool(env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def otlp_provider(version: str = "") -> TracerProvider:
    """A provider batching spans to the OTLP/gRPC exporter. The SDK reads the endpoint,
    headers, TLS, timeout and resource (``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``)
    from the standard variables itself; the service name defaults to ``context-engine``."""
    # imported here: only a server that exports pays for loading the SDK and the exporter
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({"service.version": version} if version else {})
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": SERVICE_NAME}))
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider


def tracer_for(provider: trace.TracerProvider | None) -> Tracer:
    """The service's tracer from ``provider``; the no-op tracer when there is none."""
    if provider is None:
        return trace.NoOpTracer()
    return provider.get_tracer(INSTRUMENTATION)


def caller_context(metadata: Iterable[tuple[str, str | bytes]] | None) -> Context:
    """The caller's span context from W3C ``traceparent``/``tracestate`` metadata (an empty
    context when absent or malformed, so the RPC span starts a new trace)."""
    carrier: dict[str, str] = {}
    for key, value in metadata or ():
        if key.lower() in _TRACE_KEYS and isinstance(value, str):
            carrier[key.lower()] = value
    return _PROPAGATOR.extract(carrier) if carrier else Context()


def failed(span: Span, reason: str) -> None:
    """ERROR status with the ErrorInfo reason only: messages carry values, reasons do not."""
    span.set_status(Status(StatusCode.ERROR, reason))
    span.set_attribute("error.type", reason)


@contextmanager
def child(tracer: Tracer, name: str, *, kind: SpanKind = SpanKind.INTERNAL,
          attributes: Mapping[str, Any] | None = None) -> Iterator[Span]:
    """A child span of the current one. An exception leaving it marks it ERROR with the
    exception's ``reason`` (domain errors) or class name; never its message."""
    with tracer.start_as_current_span(name, kind=kind, attributes=attributes,
                                      record_exception=False,
                                      set_status_on_exception=False) as span:
        try:
            yield span
        except BaseException as exc:
            if span.is_recording():
                reason = getattr(exc, "reason", None)
                failed(span, reason if isinstance(reason, str) else type(exc).__name__)
            raise


@contextmanager
def db_call(tracer: Tracer, operation: str) -> Iterator[Span]:
    """A client span around one database operation (one statement or one transaction),
    named after the store operation, never the SQL's values."""
    with child(tracer, f"db {operation}", kind=SpanKind.CLIENT,
               attributes={"db.system.name": "postgresql",
                           "db.operation.name": operation}) as span:
        yield span
