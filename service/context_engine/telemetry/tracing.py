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

import math
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


# Numbers the SDK reads when it exports traces: a timeout (seconds) it parses as a float and
# fails on otherwise (and exports nothing within when it is no finite number above 0); the
# batch processor's settings, integers it checks against each other (with its defaults where
# unset)
_SECONDS = ("OTEL_EXPORTER_OTLP_TIMEOUT", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT")
_BSP = {"OTEL_BSP_SCHEDULE_DELAY": 5000, "OTEL_BSP_EXPORT_TIMEOUT": 30000,
        "OTEL_BSP_MAX_QUEUE_SIZE": 2048, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": 512}


def otel_problems(env: Mapping[str, str]) -> list[str]:
    """What in the standard variables OpenTelemetry would fail on, read as it reads them: a
    propagator no installed package provides (read for every call's context, traced or not);
    when trace export is asked for (the SDK's configurator then builds every signal's
    exporters), an exporter of traces, metrics or logs no installed package provides, an OTLP
    protocol it does not know for a signal exported over OTLP, a timeout that is no finite
    number of seconds above 0, a batch setting that is no integer or that the batch processor
    refuses, or an export timeout of 0 or below (which it takes unchecked). Checked with the
    rest of the configuration, before the server starts."""
    from importlib.metadata import entry_points

    def installed(kind: str) -> list[str]:
        return sorted({ep.name for ep in entry_points(group=f"opentelemetry_{kind}")})

    found: list[str] = []
    raw = env.get("OTEL_PROPAGATORS", "")
    if raw:  # as opentelemetry.propagate reads it: up to the first "none", each name stripped
        known = installed("propagator")
        for name in (n.strip() for n in raw.split(",")):
            if name.lower() == "none":
                break
            if name not in known:
                found.append(f"OTEL_PROPAGATORS={raw!r}: " + (
                    f"no propagator {name!r} is installed ({', '.join(known)}, none)" if name
                    else "an empty name (a comma too many?)"))
    if not otlp_requested(env):
        return found
    for signal in ("traces", "metrics", "logs"):
        variable = f"OTEL_{signal.upper()}_EXPORTER"
        raw = env.get(variable, "")
        if signal == "traces" and not raw.strip():
            names = ["otlp"]  # an endpoint alone: OTLP, by protocol
        elif not raw or raw.lower().strip() == "none":  # as the SDK's _get_exporter_names
            continue
        else:
            names = [n.strip() for n in raw.split(",")]
        known = installed(f"{signal}_exporter")
        for name in names:
            if name == "otlp":
                protocol = _protocol(env, signal)
                if protocol is not None:
                    found.append(protocol)
            elif name not in known:
                kind = "trace" if signal == "traces" else signal
                found.append(f"{variable}={raw!r}: no {kind} exporter {name!r} is installed "
                             f"(otlp, {', '.join(known)}; or none alone)")
    for variable in _SECONDS:
        value = env.get(variable, "").strip()
        if value and not _number(value):
            found.append(f"{variable}={value!r} is not a number of seconds")
        elif value and not _waitable(float(value)):
            found.append(f"{variable}={value!r} must be a finite number of seconds above 0")
    found += _batch_problems(env)
    return found


def _protocol(env: Mapping[str, str], signal: str) -> str | None:
    """The problem with the protocol the SDK maps a signal's "otlp" by (the signal's own
    variable, else the general one), or None."""
    for variable in (f"OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL",
                     "OTEL_EXPORTER_OTLP_PROTOCOL"):
        if env.get(variable):
            protocol = env[variable].strip()
            if protocol in OTLP_PROTOCOLS:
                return None
            return (f"{variable}={protocol!r} is not an OTLP protocol "
                    f"({', '.join(OTLP_PROTOCOLS)})")
    return None


def _batch_problems(env: Mapping[str, str]) -> list[str]:
    """The batch processor's settings as it reads them (``int()``; a value that is none it
    would replace by its default, which is refused here as the typo it is) and checks them."""
    found: list[str] = []
    values = dict(_BSP)
    for variable in _BSP:
        raw = env.get(variable, "")
        if not raw:
            continue
        try:
            values[variable] = int(raw)
        except ValueError:
            found.append(f"{variable}={raw!r} is not an integer")
    queue, delay, batch, timeout = (
        values["OTEL_BSP_MAX_QUEUE_SIZE"], values["OTEL_BSP_SCHEDULE_DELAY"],
        values["OTEL_BSP_MAX_EXPORT_BATCH_SIZE"], values["OTEL_BSP_EXPORT_TIMEOUT"])
    if queue <= 0:
        found.append(f"OTEL_BSP_MAX_QUEUE_SIZE={queue} must be positive")
    if timeout <= 0:  # the processor does not check it: no export could finish within it
        found.append(f"OTEL_BSP_EXPORT_TIMEOUT={timeout} must be positive")
    if delay <= 0:
        found.append(f"OTEL_BSP_SCHEDULE_DELAY={delay} must be positive")
    if batch <= 0:
        found.append(f"OTEL_BSP_MAX_EXPORT_BATCH_SIZE={batch} must be positive")
    elif batch > queue > 0:
        found.append(f"OTEL_BSP_MAX_EXPORT_BATCH_SIZE={batch} must be at most "
                     f"OTEL_BSP_MAX_QUEUE_SIZE ({queue})")
    return found


def _number(value: str) -> bool:
    try:
        float(value)
    except ValueError:
        return False
    return True


def _waitable(seconds: float) -> bool:
    """Whether the SDK's exporter can wait ``seconds`` for a collector: a finite number above
    0 (it takes nan, inf and -5 alike, and every export then ends DEADLINE_EXCEEDED, each span
    lost)."""
    return math.isfinite(seconds) and seconds > 0


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
