"""The JSON log line: its keys, and the trace and span ids of the span current where it was
logged (opentelemetry-instrumentation-logging's record factory, ``logs.correlate``)."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from context_engine.telemetry.logs import LOGGER, JsonFormatter, correlate, log
from context_engine.telemetry.tracing import caller_context, tracer_for
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN_ID = "00f067aa0ba902b7"


@pytest.fixture
def lines() -> Iterator[io.StringIO]:
    correlate()
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    level = LOGGER.level
    LOGGER.addHandler(handler)
    LOGGER.setLevel(logging.INFO)
    yield out
    LOGGER.removeHandler(handler)
    LOGGER.setLevel(level)


def logged(out: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_outside_any_span_the_ids_are_null(lines):
    log("started", workers=2)
    [line] = logged(lines)
    assert line["trace_id"] is None and line["span_id"] is None
    assert line["event"] == "started" and line["workers"] == 2 and line["level"] == "info"
    assert set(line) == {"ts", "level", "event", "trace_id", "span_id", "workers"}


def test_inside_a_span_the_line_names_it(lines):
    tracer = tracer_for(TracerProvider())
    with tracer.start_as_current_span("rpc") as span:
        log("rpc", method="Build")
        with tracer.start_as_current_span("child") as inner:
            log("inner")
    log("after")
    rpc, nested, after = logged(lines)
    assert rpc["trace_id"] == format(span.get_span_context().trace_id, "032x")
    assert rpc["span_id"] == format(span.get_span_context().span_id, "016x")
    assert nested["trace_id"] == rpc["trace_id"]
    assert nested["span_id"] == format(inner.get_span_context().span_id, "016x")
    assert after["trace_id"] is None and after["span_id"] is None


def test_an_unsampled_span_still_names_its_trace(lines):
    with tracer_for(TracerProvider(sampler=ALWAYS_OFF)).start_as_current_span("rpc") as span:
        assert not span.is_recording()
        log("rpc")
    [line] = logged(lines)
    assert line["trace_id"] == format(span.get_span_context().trace_id, "032x")


def test_without_tracing_a_call_names_the_callers_trace(lines):
    """No provider (the no-op tracer) and a caller's traceparent: the line carries the
    caller's trace and span ids, so it still joins the caller's trace."""
    context = caller_context([("traceparent", f"00-{TRACE_ID}-{SPAN_ID}-01")])
    with tracer_for(None).start_as_current_span("rpc", context=context):
        log("rpc")
    [line] = logged(lines)
    assert (line["trace_id"], line["span_id"]) == (TRACE_ID, SPAN_ID)


def test_a_record_made_before_correlation_has_null_ids():
    record = logging.LogRecord("context_engine", logging.WARNING, __file__, 1, "event", (),
                               None)
    for name in ("otelTraceID", "otelSpanID"):
        record.__dict__.pop(name, None)
    line = json.loads(JsonFormatter().format(record))
    assert line["trace_id"] is None and line["span_id"] is None and line["level"] == "warning"


def test_an_exception_is_named_never_its_message(lines):
    try:
        raise ValueError("secret value")
    except ValueError:
        LOGGER.exception("failed", extra={"fields": {"method": "Build"}})
    [line] = logged(lines)
    assert line["exception"] == "ValueError" and "secret value" not in json.dumps(line)
