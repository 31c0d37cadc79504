"""Structured JSON logs: one line per event, never message content.

Every line has ``trace_id`` and ``span_id`` (lowercase hex): the span current where the line
was logged, so a line written inside an RPC names the RPC's server span (with tracing off, the
caller's span when the call carried ``traceparent``), and ``null`` where there is none (outside
any RPC, or tracing off and no caller context). opentelemetry-instrumentation-logging's record
factory puts them on each record when it is created (``correlate``, called by ``configure``).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

LOGGER = logging.getLogger("context_engine")


def _otel_id(value: object) -> str | None:
    """The instrumentation writes "0" for no span (and nothing before ``correlate``)."""
    return value if isinstance(value, str) and value.strip("0") else None


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "event": record.getMessage(),
            "trace_id": _otel_id(getattr(record, "otelTraceID", None)),
            "span_id": _otel_id(getattr(record, "otelSpanID", None)),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            line.update(fields)
        if record.exc_info and record.exc_info[0] is not None:
            line["exception"] = record.exc_info[0].__name__
        return json.dumps(line, sort_keys=True, default=str)


def correlate() -> None:
    """Trace and span ids on every log record of this process (``otelTraceID``,
    ``otelSpanID``), from the current span. Only that: no OpenTelemetry log handler on the
    root logger and no ``logging.basicConfig`` (``OTEL_PYTHON_LOG_CORRELATION`` is ignored)."""
    from opentelemetry.instrumentation.logging import LoggingInstrumentor

    instrumentor = LoggingInstrumentor()
    if not instrumentor.is_instrumented_by_opentelemetry:
        instrumentor.instrument(inject_trace_context=True, set_logging_format=False,
                                enable_log_auto_instrumentation=False)


def configure(level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(JsonFormatter())
    LOGGER.handlers[:] = [handler]
    LOGGER.setLevel(level.upper())
    LOGGER.propagate = False
    correlate()


def log(event: str, level: int = logging.INFO, **fields: Any) -> None:
    LOGGER.log(level, event, extra={"fields": fields})


def log_always(event: str, level: int, **fields: Any) -> None:
    """A line printed at its level whatever CE_LOG_LEVEL filters out: a notice an operator
    must not miss (the dev-mode warning, a misspelt setting): handed to the handlers as it is,
    past the logger's level."""
    LOGGER.handle(LOGGER.makeRecord(LOGGER.name, level, "(log)", 0, event, (), None,
                                    extra={"fields": fields}))
