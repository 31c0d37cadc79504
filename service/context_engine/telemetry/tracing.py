"""OpenTelemetry tracing, configured by the SDK itself from the standard ``OTEL_*`` variables.

Off unless those variables ask for trace export (``otlp_requested``). Then the SDK's own
configurator, the one ``opentelemetry-instrument`` runs, reads them: the exporters
(``OTEL_TRACES_EXPORTER``: ``console``, ``otlp`` over gRPC or HTTP by
``OTEL_EXPORTER_OTLP[_TRACES]_PROTOCOL``), endpoint, headers, TLS and timeouts
(``OTEL_EXPORTER_OTLP_*``), the sampler (``OTEL_TRACES_SAMPLER[_ARG]``), the batch processor
(``OTEL_BSP_*``) and the resource (``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_SERVICE_NAME``, which
defaults to ``context-engine`` here). Metrics and logs exporters stay off unless
``OTEL_METRICS_EXPORTER``/``OTEL_LOGS_EXPORTER`` name one: metrics are Prometheus', logs are
JSON lines on stdout. The caller's context is read by the propagators ``OTEL_PROPAGATORS``
names (W3C ``traceparent``/``tracestate`` and baggage by default).

Unconfigured, nothing here loads the SDK or an exporter and every tracer is the API's no-op
tracer: a server pays for a few no-op calls per RPC and connects nowhere. Span attributes
carry sizes, epochs, hashes and the hashed session key, never tenant or session ids, message
content or credentials; asyncpg's spans carry the statement text, never its parameters nor the
message of a statement that failed (its DETAIL quotes the key values).

The RPC's server span is the servicer's own rather than opentelemetry-instrumentation-grpc's:
that interceptor would put the status message (which may quote request values) in the span's
status, add peer addresses and record every abort as an exception event.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer

INSTRUMENTATION = "context_engine"
SERVICE_NAME = "context-engine"
_TRUE = {"true", "1", "yes", "on"}
_ENDPOINTS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


def otlp_requested(env: Mapping[str, str]) -> bool:
    """Whether the standard variables ask for trace export, by any exporter. Off by default:
    ``OTEL_SDK_DISABLED=true`` disables; ``OTEL_TRACES_EXPORTER`` naming exporters enables
    (``none`` disables); unset, an OTLP endpoint variable being set enables OTLP."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() in _TRUE:
        return False
    exporters = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporters:
        return exporters != "none"
    return any(env.get(name) for name in _ENDPOINTS)


OTLP_PROTOCOLS = ("grpc", "http/protobuf")  # what the SDK's configurator maps "otlp" by
_PROTOCOLS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")


# Numbers the SDK reads when it exports traces: a timeout (seconds) it parses as a float and
# fails on otherwise, and the batch processor's settings, which must be positive integers
_SECONDS = ("OTEL_EXPORTER_OTLP_TIMEOUT", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT")
_COUNTS = ("OTEL_BSP_SCHEDULE_DELAY", "OTEL_BSP_EXPORT_TIMEOUT", "OTEL_BSP_MAX_QUEUE_SIZE",
           "OTEL_BSP_MAX_EXPORT_BATCH_SIZE")


def otel_problems(env: Mapping[str, str]) -> list[str]:
    """What in the standard variables OpenTelemetry would fail on: a propagator no installed
    package provides (read for every call's context, traced or not); when trace export is
    asked for, an exporter of traces, metrics or logs no installed package provides, an OTLP
    protocol it does not know, a timeout or a batch setting that is no number. Checked with
    the rest of the configuration, before the server starts."""
    from importlib.metadata import entry_points

    def installed(kind: str) -> list[str]:
        return sorted({ep.name for ep in entry_points(group=f"opentelemetry_{kind}")})

    found: list[str] = []
    raw = env.get("OTEL_PROPAGATORS", "")
    known = installed("propagator")
    for name in (n.strip() for n in raw.split(",") if n.strip()):
        if name.lower() != "none" and name not in known:
            found.append(f"OTEL_PROPAGATORS={raw!r}: no propagator {name!r} is installed "
                         f"({', '.join(known)}, none)")
    if not otlp_requested(env):
        return found
    exporters = installed("traces_exporter")
    raw = env.get("OTEL_TRACES_EXPORTER", "")
    names = [n.strip() for n in raw.split(",")] if raw.strip() else ["otlp"]  # endpoint only
    for name in names:
        if name != "otlp" and name not in exporters:
            found.append(f"OTEL_TRACES_EXPORTER={raw!r}: no trace exporter {name!r} is "
                         f"installed (otlp, {', '.join(exporters)})")
    for kind in ("metrics", "logs"):  # off unless named; the configurator then builds them
        variable = f"OTEL_{kind.upper()}_EXPORTER"
        raw = env.get(variable, "")
        known = installed(f"{kind}_exporter")
        for name in (n.strip() for n in raw.split(",") if n.strip()):
            if name not in ("otlp", "none") and name not in known:
                found.append(f"{variable}={raw!r}: no {kind} exporter {name!r} is installed "
                             f"(otlp, {', '.join(known)}, none)")
    for variable in _SECONDS:
        value = env.get(variable, "").strip()
        if value and not _number(value):
            found.append(f"{variable}={value!r} is not a number of seconds")
    for variable in _COUNTS:
        value = env.get(variable, "").strip()
        if value and not (value.isascii() and value.isdigit() and int(value) > 0):
            found.append(f"{variable}={value!r} is not a positive integer")
    if "otlp" in names:  # the protocol the SDK maps "otlp" by: the traces one, else the general
        named = next((v for v in _PROTOCOLS if env.get(v, "").strip()), None)
        protocol = env.get(named, "").strip() if named else ""
        if named and protocol not in OTLP_PROTOCOLS:
            found.append(f"{named}={protocol!r} is not an OTLP protocol "
                         f"({', '.join(OTLP_PROTOCOLS)})")
    return found


def _number(value: str) -> bool:
    try:
        return float(value) >= 0
    except ValueError:
        return False


def configured_provider(version: str = "") -> trace.TracerProvider:
    """The process's tracer provider: built once by the SDK's configurator from the
    ``OTEL_*`` variables (``os.environ``, as the SDK reads them) and set as the global
    provider; the one already set when there is one (e.g. under ``opentelemetry-instrument``).
    Each serving process (every worker) calls this for itself."""
    current = trace.get_tracer_provider()
    if not isinstance(current, trace.ProxyTracerProvider):
        return current
    _configure_sdk(_resource_defaults(version))
    return trace.get_tracer_provider()


def _resource_defaults(version: str) -> dict[str, str]:
    """``service.name`` and ``service.version`` where the variables set neither: attributes
    passed to the configurator would override ``OTEL_RESOURCE_ATTRIBUTES``/``OTEL_SERVICE_NAME``."""
    from opentelemetry.sdk.resources import OTELResourceDetector

    from_env = OTELResourceDetector().detect().attributes
    defaults = {"service.name": SERVICE_NAME, "service.version": version}
    return {key: value for key, value in defaults.items() if value and key not in from_env}


def _configure_sdk(resource_attributes: dict[str, str]) -> None:
    # Private SDK API, here only: _OTelSDKConfigurator is what opentelemetry-instrument runs and
    # the one place the SDK turns OTEL_* into exporters, protocol, sampler and resource (pinned
    # by tests/integration/test_tracing.py). _get_exporter_entry_point resolves "otlp" to gRPC
    # or HTTP by protocol, for an endpoint set without OTEL_TRACES_EXPORTER (the spec's default).
    from opentelemetry.sdk._configuration import (
        _get_exporter_entry_point,
        _OTelSDKConfigurator,
    )

    implied = [] if os.environ.get("OTEL_TRACES_EXPORTER", "").strip() else \
        [_get_exporter_entry_point("otlp", "traces")]
    configurator = _OTelSDKConfigurator()  # type: ignore[no-untyped-call]  # the SDK's: untyped
    configurator.configure(trace_exporter_names=implied,  # type: ignore[no-untyped-call]
                           resource_attributes=resource_attributes)


def shut_down(provider: trace.TracerProvider, seconds: float) -> bool:
    """Export what the provider's processors still hold and shut them down, waiting at most
    ``seconds``; whether they were done by then. The SDK's ``force_flush`` ignores its
    timeout and its shutdown waits out the exporter's retries (10 s by default against a
    collector that is down or hung), so the shutdown runs on a daemon thread that the
    process does not wait for at exit: what is not exported by then is lost, as the stop's
    bound says. A provider without ``shutdown`` (the API's) holds nothing."""
    import threading

    shutdown = getattr(provider, "shutdown", None)
    if not callable(shutdown):
        return True
    worker = threading.Thread(target=shutdown, name="tracing-shutdown", daemon=True)
    worker.start()
    worker.join(seconds)
    return not worker.is_alive()


class _SilentTracer(Tracer):
    """A tracer whose spans record no exception and put no message in their status: asyncpg's
    instrumentation marks a failed statement ERROR itself, and the driver's message it would
    otherwise record (an exception event, the status description) has a DETAIL quoting the
    row's values, such as ``Key (tenant_id, session_id)=(acme, s1) is not present`` of a
    write naming an erased or unknown session."""

    def __init__(self, inner: Tracer) -> None:
        self._inner = inner

    def start_span(self, name: str, context: Context | None = None,
                   kind: SpanKind = SpanKind.INTERNAL, attributes: Any = None,
                   links: Any = None, start_time: int | None = None,
                   record_exception: bool = True,
                   set_status_on_exception: bool = True) -> Span:
        return self._inner.start_span(name, context, kind, attributes, links, start_time,
                                      record_exception=False, set_status_on_exception=False)

    @contextmanager
    def start_as_current_span(  # type: ignore[override]  # the API's decorator, not ours
            self, name: str, context: Context | None = None,
            kind: SpanKind = SpanKind.INTERNAL, attributes: Any = None, links: Any = None,
            start_time: int | None = None, record_exception: bool = True,
            set_status_on_exception: bool = True, end_on_exit: bool = True) -> Iterator[Span]:
        with self._inner.start_as_current_span(
                name, context, kind, attributes, links, start_time, record_exception=False,
                set_status_on_exception=False, end_on_exit=end_on_exit) as span:
            yield span


class _SilentProvider(trace.TracerProvider):
    """``provider``'s tracers as ``_SilentTracer``s."""

    def __init__(self, provider: trace.TracerProvider) -> None:
        self._provider = provider

    def get_tracer(self, instrumenting_module_name: str,
                   instrumenting_library_version: str | None = None,
                   schema_url: str | None = None, attributes: Any = None) -> Tracer:
        return _SilentTracer(self._provider.get_tracer(
            instrumenting_module_name, instrumenting_library_version, schema_url, attributes))


def instrument_database(provider: trace.TracerProvider) -> None:
    """asyncpg's instrumentation: a client span per statement under the current span, with
    the statement text and never its parameters (they are content), nor the driver's message
    of a statement that failed (its DETAIL quotes values: ``_SilentTracer``). Process-wide:
    the last provider given wins (one traced server per process)."""
    from opentelemetry.instrumentation.asyncpg import AsyncPGInstrumentor

    instrumentor = AsyncPGInstrumentor(  # type: ignore[no-untyped-call]  # untyped package
        capture_parameters=False)
    if instrumentor.is_instrumented_by_opentelemetry:
        instrumentor.uninstrument()
    instrumentor.instrument(tracer_provider=_SilentProvider(provider))


def uninstrument_database() -> None:
    from opentelemetry.instrumentation.asyncpg import AsyncPGInstrumentor

    instrumentor = AsyncPGInstrumentor()  # type: ignore[no-untyped-call]
    if instrumentor.is_instrumented_by_opentelemetry:
        instrumentor.uninstrument()


@contextmanager
def untraced() -> Iterator[None]:
    """Instrumentations record nothing inside (the health probe's ``SELECT 1`` every second
    would otherwise be a trace of its own)."""
    from opentelemetry.instrumentation.utils import suppress_instrumentation

    with suppress_instrumentation():
        yield


def tracer_for(provider: trace.TracerProvider | None) -> Tracer:
    """The service's tracer from ``provider``; the no-op tracer when there is none."""
    if provider is None:
        return trace.NoOpTracer()
    return provider.get_tracer(INSTRUMENTATION)


def caller_context(metadata: Iterable[tuple[str, str | bytes]] | None) -> Context:
    """The caller's context as the configured propagators read it from the call's metadata
    (W3C ``traceparent``/``tracestate`` by default): an empty context when absent or
    malformed, so the RPC span starts a new trace. Propagators read only their own keys;
    nothing else of the metadata (credentials) is kept."""
    carrier = {key.lower(): value for key, value in metadata or ()
               if isinstance(value, str)}
    # imported here: the module reads OTEL_PROPAGATORS when it loads and raises on a name no
    # package provides, which ``otel_problems`` refuses first as a configuration error
    from opentelemetry import propagate

    return propagate.extract(carrier, context=Context())


def server_span(tracer: Tracer, service: str, method: str,
                metadata: Iterable[tuple[str, str | bytes]] | None
                ) -> AbstractContextManager[Span]:
    """The server span of one RPC (the servicer's, or an interceptor's that turns the call
    away), a child of the caller's span when the call's metadata carries one."""
    return tracer.start_as_current_span(
        f"{service}/{method}", context=caller_context(metadata), kind=SpanKind.SERVER,
        record_exception=False, set_status_on_exception=False,
        attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": method})


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
    """A span around one store operation (one statement or one transaction), named after
    it, never the SQL's values; asyncpg's client spans, one per statement, go under it."""
    with child(tracer, f"db {operation}",
               attributes={"db.system.name": "postgresql",
                           "db.operation.name": operation}) as span:
        yield span
