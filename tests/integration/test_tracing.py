"""Traces, configured by the OpenTelemetry SDK from the standard OTEL_* variables.

In process, a real server with a tracer provider of the test's own (the SDK's in-memory
exporter): one server span per RPC under the caller's W3C trace context, child spans for
rendering, build and store operations, asyncpg's client spans under those, and no tenant id,
session id, message text or credential in any attribute; the JSON log line each RPC writes,
with the RPC's trace and span ids.

As real `context-engine serve` processes configured only by the variables: the console
exporter (spans printed as JSON), OTLP over HTTP to a loopback receiver and OTLP over gRPC to a
loopback collector (with worker processes, each of which sets up its own SDK), the sampler and
resource variables, and a server without the variables that loads no SDK at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import os
import secrets
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
import pytest
from context_engine import __version__
from context_engine.api.auth import token_sha256
from context_engine.api.server import start
from context_engine.config import Config
from context_engine.telemetry.logs import LOGGER, JsonFormatter, correlate
from context_engine.telemetry.tracing import (
    caller_context,
    otlp_requested,
    tracer_for,
)
from context_engine.v1 import context_engine_pb2 as pb
from context_engine.v1 import context_engine_pb2_grpc as pb_grpc
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client import CollectorRegistry

from tests.conftest import REPO, ServerThread
from tests.conftest import test_config as base_config
from tests.integration.processes import ServerProcess
from tests.integration.requests import build_request, failure, item, plan_request
from tests.integration.test_budget_rpc import SMALL, long_history

pytestmark = pytest.mark.integration

SERVICE = "context_engine.v1.ContextEngine"
TOKEN = "tok-CANARY-3f1d-credential"
TEXT = "CANARY-7a2e-message-text"


class TracedServer(ServerThread):
    """The fixture's server, started with a tracer provider of the test's own."""

    def __init__(self, config: Config, database_url: str, provider: TracerProvider) -> None:
        self.registry = CollectorRegistry()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.running = self.call(start(config, database_url=database_url,
                                       registry=self.registry, tracer_provider=provider))
        self.address = f"127.0.0.1:{self.running.grpc_port}"


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def traced(database_url: str, exporter: InMemorySpanExporter) -> Iterator[TracedServer]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    srv = TracedServer(base_config(), database_url, provider)
    yield srv
    srv.stop()
    provider.shutdown()


@pytest.fixture
def tstub(traced: TracedServer) -> Iterator[pb_grpc.ContextEngineStub]:
    with grpc.insecure_channel(traced.address) as ch:
        yield pb_grpc.ContextEngineStub(ch)


def caller() -> tuple[str, str, list[tuple[str, str]]]:
    """A caller's trace and span id, and the metadata that carries them (and a credential)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, [("traceparent", f"00-{trace_id}-{span_id}-01"),
                               ("tracestate", "vendor=opaque"),
                               ("authorization", f"Bearer {TOKEN}")]


def spans_of(exporter: InMemorySpanExporter, trace_id: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans()
            if s.context is not None and s.context.trace_id == int(trace_id, 16)]


def one(spans: Sequence[ReadableSpan], name: str) -> ReadableSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, (name, [s.name for s in spans])
    return found[0]


def children(spans: Sequence[ReadableSpan], parent: ReadableSpan) -> list[ReadableSpan]:
    assert parent.context is not None
    return [s for s in spans if s.parent is not None
            and s.parent.span_id == parent.context.span_id]


def assert_clean(spans: Sequence[ReadableSpan], *secrets_: str) -> None:
    """No attribute value, event or status description holds any of ``secrets_``."""
    for s in spans:
        values: list[Any] = [s.name, s.status.description or ""]
        values += [v for v in (s.attributes or {}).values()]
        values += [v for e in s.events for v in (e.attributes or {}).values()]
        text = repr(values)
        for secret in secrets_:
            assert secret not in text, (secret, s.name)


def statements(spans: Sequence[ReadableSpan], parent: ReadableSpan) -> list[ReadableSpan]:
    """asyncpg's client spans under ``parent`` (directly: the store operation's span)."""
    found = [s for s in children(spans, parent) if s.kind is SpanKind.CLIENT]
    for s in found:
        attrs = s.attributes or {}
        assert attrs["db.system"] == "postgresql" and attrs["db.statement"]
        assert not [k for k in attrs if "parameters" in k]  # parameters may be content
    return found


def test_rpc_spans_continue_the_callers_trace(tstub, ids, exporter):
    tenant, session = ids
    trace_id, span_id, md = caller()
    plan = tstub.Plan(plan_request(tenant, session), metadata=md).plan
    items = [item("u1", 1, user=pb.UserMessage(text=f"Summarize this: {TEXT}"))]
    resp = tstub.Build(build_request(tenant, session, items=items), metadata=md)
    spans = spans_of(exporter, trace_id)

    rpc_plan = one(spans, f"{SERVICE}/Plan")
    rpc_build = one(spans, f"{SERVICE}/Build")
    for rpc in (rpc_plan, rpc_build):
        assert rpc.kind is SpanKind.SERVER
        assert rpc.parent is not None and rpc.parent.is_remote
        assert rpc.parent.span_id == int(span_id, 16)  # a child of the caller's span
        assert rpc.status.status_code is not StatusCode.ERROR
        attrs = rpc.attributes or {}
        assert attrs["rpc.system"] == "grpc" and attrs["context_engine.status_code"] == "OK"
        assert attrs["context_engine.epoch"] == 1
        assert attrs["context_engine.prefix_sha256"] == plan.prefix_sha256
        assert attrs["context_engine.session_key"] == resp.session_key
    assert rpc_plan.context is not None and rpc_plan.context.trace_state.get("vendor") == \
        "opaque"

    # Plan: the prefix rendered, and the database calls that read the tenant's correction
    # factor (the body is held to history's floor at it), read and pinned the plan, and
    # claimed the new epoch's count once its COMMIT answered.
    names = sorted(s.name for s in children(spans, rpc_plan))
    assert names == ["context_engine.plan.render", "db calibrations.get",
                     "db plans.claim_count", "db plans.get", "db plans.pin"]
    pin = one(spans, "db plans.pin")
    assert pin.kind is SpanKind.INTERNAL
    assert (pin.attributes or {})["db.system.name"] == "postgresql"
    # asyncpg's statements, one client span each, under the store operation's span
    pinned = statements(spans, pin)
    sql = [str((s.attributes or {})["db.statement"]) for s in pinned]
    assert sql[0].startswith("BEGIN") and any(q.startswith("COMMIT") for q in sql), sql
    assert any("INSERT INTO plans" in q for q in sql), sql
    assert statements(spans, one(spans, "db plans.get"))

    # Build: the pure build (with its history selection), the rendering, the session's read
    # (the factor's read is the Plan's just before, kept for 5 s)
    under_build = {s.name for s in children(spans, rpc_build)}
    assert {"context_engine.build", "context_engine.render",
            "db sessions.current"} <= under_build
    factor_reads = [s for s in spans if s.name == "db calibrations.get"]
    assert factor_reads and all(statements(spans, s) for s in factor_reads)
    build = one(spans, "context_engine.build")
    history = one(children(spans, build), "context_engine.history_selection")
    assert (history.attributes or {})["context_engine.derived"] is True
    assert not [s for s in spans if s.name == "context_engine.yield"]  # it fit

    attrs = rpc_build.attributes or {}
    classes = {c.class_name: c.used for c in resp.budget.classes}
    assert classes and all(attrs[f"context_engine.tokens.{k}"] == v for k, v in classes.items())
    assert attrs["context_engine.prefix_tokens"] == resp.prefix_tokens
    assert attrs["context_engine.estimated_input_tokens"] == resp.estimated_input_tokens
    assert tuple(attrs["context_engine.yield_steps"]) == ()
    assert_clean(spans, tenant, session, TEXT, TOKEN, "Summarize")


def test_yield_steps_are_spans_under_the_build(tstub, ids, exporter):
    tenant, session = ids
    trace_id, _, md = caller()
    tstub.Plan(plan_request(tenant, session, model=SMALL), metadata=md)
    req = build_request(tenant, session, items=long_history(40))
    req.checkpoint.knowledge.extend([
        pb.KnowledgePassage(id=f"k{i}", source="doc", text=f"passage {TEXT} " * 100, rank=i,
                            trust=pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED) for i in range(3)])
    resp = tstub.Build(req, metadata=md)
    steps = [s.step for s in resp.pressure.steps]
    assert steps  # the scenario yields
    spans = spans_of(exporter, trace_id)
    build = one(spans, "context_engine.build")
    yields = [s for s in children(spans, build) if s.name == "context_engine.yield"]
    assert [(s.attributes or {})["context_engine.yield.step"] for s in yields] == steps
    for s, step in zip(yields, resp.pressure.steps, strict=True):
        attrs = s.attributes or {}
        assert attrs["context_engine.yield.tokens_before"] == step.tokens_before
        assert attrs["context_engine.yield.tokens_after"] == step.tokens_after
    # history was cut: the selection's span carries where and the compaction target, the
    # same figures as the response's pressure (and the pressure event's payload)
    assert steps[-1] == "history" and resp.pressure.compact_through_sequence > 0
    selected = one(children(spans, build), "context_engine.history_selection").attributes or {}
    assert selected["context_engine.history.cut_index"] == resp.pressure.history_cut_index
    assert selected["context_engine.history.left_out_tokens"] == \
        resp.pressure.left_out_tokens
    assert selected["context_engine.history.compact_through_sequence"] == \
        resp.pressure.compact_through_sequence
    rpc = one(spans, f"{SERVICE}/Build")
    assert tuple((rpc.attributes or {})["context_engine.yield_steps"]) == tuple(steps)
    # the pressure event is written inside the RPC's trace
    events = one(spans, "db events.append")
    assert (events.attributes or {})["context_engine.event_type"] == "context.budget.pressure"
    assert_clean(spans, tenant, session, TEXT, TOKEN, "lorem", "passage")


def test_errors_carry_the_reason_never_the_message(tstub, ids, exporter):
    tenant, session = ids
    trace_id, _, md = caller()
    tstub.Plan(plan_request(tenant, session, model=SMALL), metadata=md)
    items = [item("u1", 1, user=pb.UserMessage(text=f"{TEXT} " + "word " * 20_000))]
    with pytest.raises(grpc.RpcError) as err:
        tstub.Build(build_request(tenant, session, items=items), metadata=md)
    f = failure(err.value)
    assert f.reason == "BUDGET_EXCEEDED"
    spans = spans_of(exporter, trace_id)
    rpc = one(spans, f"{SERVICE}/Build")
    assert rpc.status.status_code is StatusCode.ERROR
    assert rpc.status.description == "BUDGET_EXCEEDED"
    attrs = rpc.attributes or {}
    assert attrs["error.type"] == "BUDGET_EXCEEDED"
    assert attrs["context_engine.status_code"] == "FAILED_PRECONDITION"
    assert attrs["rpc.grpc.status_code"] == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    build = one(spans, "context_engine.build")
    assert build.status.status_code is StatusCode.ERROR
    assert (build.attributes or {})["context_engine.budget_exceeded.class"] == \
        "current_user_message"
    assert_clean(spans, tenant, session, TEXT, TOKEN, f.message)

    # an unknown session: NOT_FOUND, and the ids in its message stay out of the span
    trace_id, _, md = caller()
    with pytest.raises(grpc.RpcError) as err:
        tstub.GetPlan(pb.GetPlanRequest(tenant_id=tenant, session_id=session + "-x"),
                      metadata=md)
    spans = spans_of(exporter, trace_id)
    rpc = one(spans, f"{SERVICE}/GetPlan")
    assert (rpc.attributes or {})["error.type"] == failure(err.value).reason
    assert_clean(spans, tenant, session, TOKEN)


def test_a_statement_that_fails_keeps_its_values_out_of_its_span(tstub, ids, exporter):
    """A keyed write naming a session that has no row fails its insert on the foreign key, whose
    message's DETAIL quotes the key (``Key (tenant_id, session_id)=(...)``): asyncpg's span of
    the statement is ERROR, and neither an exception event nor its status carries the message."""
    tenant, session = ids
    trace_id, _, md = caller()
    with pytest.raises(grpc.RpcError) as err:
        tstub.Rotate(pb.RotateRequest(tenant_id=tenant, session_id=session + "-none",
                                      reason=pb.ROTATION_REASON_OPERATOR,
                                      idempotency_key="k-none"), metadata=md)
    assert failure(err.value).reason == "SESSION_NOT_FOUND"
    spans = spans_of(exporter, trace_id)
    failed = [s for s in spans if s.kind is SpanKind.CLIENT
              and s.status.status_code is StatusCode.ERROR]
    assert [s.name for s in failed] == ["INSERT"]  # the key's insert, refused
    assert not [e for s in spans for e in s.events if e.name == "exception"]
    assert_clean(spans, tenant, session, TOKEN, "DETAIL")


def test_every_rpc_has_a_span_and_a_call_without_context_starts_a_trace(tstub, ids, exporter):
    tenant, session = ids
    exporter.clear()
    tstub.Plan(plan_request(tenant, session))
    tstub.Rotate(pb.RotateRequest(tenant_id=tenant, session_id=session,
                                  reason=pb.ROTATION_REASON_OPERATOR, idempotency_key="rot-1"))
    tstub.ReportUsage(pb.ReportUsageRequest(
        tenant_id=tenant, session_id=session, estimated_input_tokens=5000,
        estimator_factor=1.0, input_tokens=5500, cached_tokens=900, output_tokens=10,
        idempotency_key="use-1"))
    spans = exporter.get_finished_spans()
    roots = [s for s in spans if s.parent is None]
    assert sorted(s.name for s in roots) == [f"{SERVICE}/Plan", f"{SERVICE}/ReportUsage",
                                             f"{SERVICE}/Rotate"]
    assert len({s.context.trace_id for s in roots if s.context is not None}) == 3
    rotate = one(spans, f"{SERVICE}/Rotate")
    assert (rotate.attributes or {})["context_engine.epoch"] == 2
    assert "context_engine.plan.render" in {s.name for s in spans
                                            if s.context is not None
                                            and rotate.context is not None
                                            and s.context.trace_id == rotate.context.trace_id}
    usage = one(spans, f"{SERVICE}/ReportUsage")
    assert (usage.attributes or {})["context_engine.cached_tokens"] == 900
    assert "db calibrations.reconcile" in {s.name for s in children(spans, usage)}
    assert_clean(spans, tenant, session)


def test_export_follows_the_standard_variables():
    assert not otlp_requested({})
    for exporters in ("otlp", "console", "console, otlp", "otlp_proto_http", " CONSOLE "):
        assert otlp_requested({"OTEL_TRACES_EXPORTER": exporters}), exporters
    assert not otlp_requested({"OTEL_TRACES_EXPORTER": "none",
                               "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"})
    assert not otlp_requested({"OTEL_TRACES_EXPORTER": " None "})
    # the spec's default exporter is otlp: an endpoint alone asks for it
    assert otlp_requested({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"})
    assert otlp_requested({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318"})
    assert not otlp_requested({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "console"})
    assert not otlp_requested({"OTEL_METRICS_EXPORTER": "otlp", "OTEL_LOGS_EXPORTER": "otlp"})
    assert not Config.from_env({}).trace_export
    assert Config.from_env({"OTEL_TRACES_EXPORTER": "console"}).trace_export


def test_without_a_provider_spans_are_no_ops():
    tracer = tracer_for(None)
    with tracer.start_as_current_span("x", context=caller_context(
            [("traceparent", f"00-{'a' * 32}-{'b' * 16}-01")])) as span:
        assert not span.is_recording()
    assert trace.get_current_span() is trace.INVALID_SPAN
    # malformed or absent context: a fresh trace, never an error
    assert trace.get_current_span(caller_context([("traceparent", "garbage")])) is \
        trace.INVALID_SPAN
    assert trace.get_current_span(caller_context(None)) is trace.INVALID_SPAN
    # the propagators read their own keys only; binary metadata is skipped
    remote = trace.get_current_span(caller_context([
        ("authorization", f"Bearer {TOKEN}"), ("x-bin", b"\x00"),
        ("traceparent", f"00-{'a' * 32}-{'b' * 16}-01")])).get_span_context()
    assert remote.is_remote and remote.trace_id == int("a" * 32, 16)


def test_each_rpc_logs_one_json_line_without_content(stub, ids):
    tenant, session = ids
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    level = LOGGER.level
    LOGGER.addHandler(handler)
    LOGGER.setLevel(logging.INFO)
    try:
        plan = stub.Plan(plan_request(tenant, session, model=SMALL)).plan
        req = build_request(tenant, session, items=long_history(40))
        req.checkpoint.items[-1].user.text = f"and now? {TEXT}"
        pressed = stub.Build(req, metadata=[("authorization", f"Bearer {TOKEN}")])
        with pytest.raises(grpc.RpcError):
            stub.Build(build_request(tenant, session, items=[
                item("u1", 1, user=pb.UserMessage(text=f"{TEXT} " + "word " * 20_000))]))
    finally:
        LOGGER.removeHandler(handler)
        LOGGER.setLevel(level)
    text = out.getvalue()
    lines = [json.loads(line) for line in text.splitlines()]
    mine = [line for line in lines if line.get("event") == "rpc" and line["tenant"] == tenant]
    assert [(line["method"], line["code"]) for line in mine] == [
        ("Plan", "OK"), ("Build", "OK"), ("Build", "FAILED_PRECONDITION")]
    for line in mine:
        assert {"ts", "level", "duration_ms", "epoch", "prefix_sha256"} <= set(line)
        assert line["epoch"] == 1 and isinstance(line["duration_ms"], float)
        # no tracing and no caller context: the keys are there, null
        assert line["trace_id"] is None and line["span_id"] is None
    logged_plan, built, failed_build = mine
    assert logged_plan["prefix_sha256"] == plan.prefix_sha256 and logged_plan["created"]
    assert built["prefix_sha256"] == pressed.prefix_sha256
    assert built["yield_steps"] == [s.step for s in pressed.pressure.steps] != []
    assert built["estimated_input_tokens"] == pressed.estimated_input_tokens
    assert failed_build["level"] == "warning" and failed_build["reason"] == "BUDGET_EXCEEDED"
    for secret in (TEXT, TOKEN, "lorem", "question 1", "answer 1", "word word"):
        assert secret not in text


def capture_logs() -> tuple[io.StringIO, logging.Handler]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    LOGGER.addHandler(handler)
    return out, handler


@contextlib.contextmanager
def info_logs() -> Iterator[io.StringIO]:
    """The service's JSON log lines at INFO while the block runs, with trace correlation."""
    correlate()
    out, handler = capture_logs()
    level = LOGGER.level
    LOGGER.setLevel(logging.INFO)
    try:
        yield out
    finally:
        LOGGER.removeHandler(handler)
        LOGGER.setLevel(level)


def test_the_log_line_of_an_rpc_names_its_span(tstub, ids, exporter):
    """Trace and span ids on the JSON line, from the RPC's span (the logging
    instrumentation's record factory, installed per process by ``logs.configure``)."""
    tenant, session = ids
    with info_logs() as out:
        trace_id, _, md = caller()
        tstub.Plan(plan_request(tenant, session), metadata=md)
        tstub.Build(build_request(tenant, session, items=[item("u1", 1, user=pb.UserMessage(
            text=TEXT))]), metadata=md)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    [built] = [line for line in lines if line.get("event") == "rpc"
               and line.get("method") == "Build" and line.get("tenant") == tenant]
    rpc = one(spans_of(exporter, trace_id), f"{SERVICE}/Build")
    assert rpc.context is not None
    assert built["trace_id"] == trace_id == format(rpc.context.trace_id, "032x")
    assert built["span_id"] == format(rpc.context.span_id, "016x")


def test_working_state_calls_log_and_trace_the_epoch_they_ran_on(tstub, ids, exporter):
    """UpdateWorkingState and CarryWorkingState run on the session's current plan (the
    context.working_state.updated event names its epoch): their log line and span name that
    epoch and prefix, as every other call on a plan does, not epoch 0 and no prefix."""
    tenant, session = ids
    with info_logs() as out:
        tstub.Plan(plan_request(tenant, session))
        rotated = tstub.Rotate(pb.RotateRequest(
            tenant_id=tenant, session_id=session, reason=pb.ROTATION_REASON_OPERATOR,
            idempotency_key="rot-ws")).plan
        assert rotated.epoch == 2
        ids_of: dict[str, str] = {}
        trace_id, _, md = caller()
        objective = pb.WorkingStateTransition(user_objective=pb.UserObjective(objective="x"))
        tstub.UpdateWorkingState(pb.UpdateWorkingStateRequest(
            tenant_id=tenant, session_id=session, run_id="run-1", sequence=3,
            transition=objective), metadata=md)
        ids_of["UpdateWorkingState"] = trace_id
        trace_id, _, md = caller()
        tstub.CarryWorkingState(pb.CarryWorkingStateRequest(
            tenant_id=tenant, session_id=session, seed_event_sequence=3, events=[
                pb.WorkingStateEvent(sequence=3, run_id="run-1", transition=objective)]),
            metadata=md)
        ids_of["CarryWorkingState"] = trace_id
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    for method, trace_id in ids_of.items():
        [logged] = [line for line in lines if line.get("event") == "rpc"
                    and line.get("method") == method and line.get("tenant") == tenant]
        assert logged["code"] == "OK", logged
        assert (logged["epoch"], logged["prefix_sha256"]) == \
            (rotated.epoch, rotated.prefix_sha256), logged
        attrs = one(spans_of(exporter, trace_id), f"{SERVICE}/{method}").attributes or {}
        assert attrs.get("context_engine.epoch") == rotated.epoch, method
        assert attrs.get("context_engine.prefix_sha256") == rotated.prefix_sha256, method


def test_a_build_over_the_budget_logs_and_traces_the_steps_that_ran(tstub, ids, exporter, db):
    """A Build that yielded and still did not fit: its log line and span name the yield steps
    that ran, as its context.budget.pressure event (fits false) records them, not none."""
    tenant, session = ids
    tstub.Plan(plan_request(tenant, session, model=SMALL))
    items = long_history(20)
    items[-1].user.text = "word " * 9_000  # the current message alone is over the body
    req = build_request(tenant, session, items=items)
    req.checkpoint.knowledge.extend([
        pb.KnowledgePassage(id=f"k{i}", source="doc", text="passage " * 200, rank=i,
                            trust=pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED) for i in range(3)])
    with info_logs() as out:
        trace_id, _, md = caller()
        with pytest.raises(grpc.RpcError) as err:
            tstub.Build(req, metadata=md)
    assert failure(err.value).reason == "BUDGET_EXCEEDED"
    [payload] = [json.loads(row[0]) for row in db.fetch(
        "SELECT payload::text FROM context_events WHERE tenant_id = $1 AND session_id = $2 "
        "AND type = 'context.budget.pressure'", tenant, session)]
    assert payload["fits"] is False
    ran = [s["step"] for s in payload["steps"]]
    assert ran  # the ladder ran before the Build failed
    [logged] = [json.loads(line) for line in out.getvalue().splitlines()
                if json.loads(line).get("event") == "rpc"
                and json.loads(line).get("tenant") == tenant
                and json.loads(line).get("method") == "Build"]
    assert logged["reason"] == "BUDGET_EXCEEDED"
    assert logged.get("yield_steps") == ran, logged
    rpc = one(spans_of(exporter, trace_id), f"{SERVICE}/Build")
    assert list((rpc.attributes or {}).get("context_engine.yield_steps", ())) == ran


def test_a_call_an_interceptor_turns_away_has_its_span_and_its_log_line_names_it(
        database_url, ids, tmp_path: Path):
    """Calls refused before the servicer (a wrong token, over a limit) got no span, and their
    log line no trace ids, although each RPC is a server span continuing the caller's."""
    tenant, session = ids
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps([{"sha256": token_sha256(TOKEN), "tenant_id": tenant,
                                   "rpcs": ["*"]}]))
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    srv = TracedServer(base_config().replace(dev_mode=False, auth_tokens_file=tokens,
                                             max_items_per_request=2), database_url, provider)
    correlate()
    out, handler = capture_logs()
    level = LOGGER.level
    LOGGER.setLevel(logging.INFO)
    refused: dict[str, tuple[str, str, str]] = {}
    try:
        with grpc.insecure_channel(srv.address) as ch:
            stub = pb_grpc.ContextEngineStub(ch)
            trace_id, span_id, md = caller()
            wrong = [(k, v) if k != "authorization" else (k, "Bearer not-the-token")
                     for k, v in md]
            with pytest.raises(grpc.RpcError) as err:
                stub.Plan(plan_request(tenant, session), metadata=wrong)
            refused["Plan"] = (trace_id, span_id, failure(err.value).reason)
            trace_id, span_id, md = caller()
            many = [item(f"u{i}", i + 1, user=pb.UserMessage(text="hi")) for i in range(3)]
            with pytest.raises(grpc.RpcError) as err:
                stub.Build(build_request(tenant, session, items=many), metadata=md)
            refused["Build"] = (trace_id, span_id, failure(err.value).reason)
    finally:
        LOGGER.removeHandler(handler)
        LOGGER.setLevel(level)
        srv.stop()
        provider.shutdown()
    assert refused["Plan"][2] == "UNAUTHENTICATED"
    assert refused["Build"][2] == "TOO_MANY_ITEMS", refused
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    for method, (trace_id, span_id, reason) in refused.items():
        rpc = one(spans_of(exporter, trace_id), f"{SERVICE}/{method}")
        assert rpc.kind is SpanKind.SERVER and rpc.parent is not None
        assert rpc.parent.span_id == int(span_id, 16)  # the caller's span
        assert rpc.status.status_code is StatusCode.ERROR and rpc.attributes is not None
        assert rpc.attributes["error.type"] == reason
        # gRPC's numbers for the codes (UNAUTHENTICATED 16, RESOURCE_EXHAUSTED 8), as written
        assert (rpc.attributes["rpc.grpc.status_code"],
                rpc.attributes["context_engine.status_code"]) == {
            "Plan": (16, "UNAUTHENTICATED"), "Build": (8, "RESOURCE_EXHAUSTED")}[method]
        assert rpc.context is not None
        [line] = [x for x in lines if x.get("event") == "rpc" and x.get("method") == method
                  and x.get("trace_id") == trace_id]
        assert line["span_id"] == format(rpc.context.span_id, "016x") and line["reason"] == reason
        assert_clean([rpc], TOKEN)


# ------------------------------------------------------------ configured by the variables
# Real `context-engine serve` processes: the SDK reads os.environ once per process, so each
# configuration is a process of its own.

def process_env(database_url: str, **otel: str) -> dict[str, str]:
    return {"DATABASE_URL": database_url, "CE_WORKERS": "1", "OTEL_BSP_SCHEDULE_DELAY": "200",
            **otel}


def serve(env: dict[str, str]) -> ServerProcess:
    """A server with ``env`` over the test run's environment, whose own OTEL_* variables are
    blanked (the SDK takes an empty variable for an unset one)."""
    blank = {k: "" for k in os.environ if k.startswith("OTEL_") and k not in env}
    return ServerProcess({**blank, **env})


def traced_calls(address: str, tenant: str, session: str,
                 md: list[tuple[str, str]]) -> pb.BuildResponse:
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.ContextEngineStub(channel)
        stub.Plan(plan_request(tenant, session), metadata=md, timeout=30)
        return stub.Build(build_request(tenant, session, items=[item("u1", 1, user=pb.UserMessage(
            text=f"Summarize this: {TEXT}"))]), metadata=md, timeout=30)


def rpc_log(server: ServerProcess, method: str, tenant: str) -> dict[str, Any]:
    [line] = [r for r in server.log if r.get("event") == "rpc" and r.get("method") == method
              and r.get("tenant") == tenant]
    return line


def json_objects(text: str) -> list[dict[str, Any]]:
    """Every JSON object in ``text``: the log lines, and the spans the console exporter
    prints (indented over several lines)."""
    decoder = json.JSONDecoder()
    found: list[dict[str, Any]] = []
    at = text.find("{")
    while at != -1:
        try:
            value, end = decoder.raw_decode(text, at)
        except ValueError:
            at = text.find("{", at + 1)
            continue
        if isinstance(value, dict):
            found.append(value)
        at = text.find("{", end)
    return found


def test_the_console_exporter_prints_the_spans(database_url, ids):
    """OTEL_TRACES_EXPORTER=console: the spans as JSON on stdout; the resource from
    OTEL_RESOURCE_ATTRIBUTES with the service name defaulting to context-engine."""
    tenant, session = ids
    trace_id, span_id, md = caller()
    server = serve(process_env(database_url, OTEL_TRACES_EXPORTER="console",
                               OTEL_RESOURCE_ATTRIBUTES="deployment.environment=ci"))
    try:
        traced_calls(server.address, tenant, session, md)
    finally:
        assert server.terminate() == 0
    printed = json_objects("".join(server.raw))
    spans = [o for o in printed if {"context", "kind", "resource"} <= set(o)]
    assert spans, "".join(server.raw)[-3000:]
    build = [s for s in spans if s["name"] == f"{SERVICE}/Build"
             and s["context"]["trace_id"] == f"0x{trace_id}"]
    assert len(build) == 1
    [rpc] = build
    assert rpc["kind"] == "SpanKind.SERVER" and rpc["parent_id"] == f"0x{span_id}"
    by_parent: dict[str, list[dict[str, Any]]] = {}
    for s in spans:
        by_parent.setdefault(s["parent_id"] or "", []).append(s)

    def below(span_id_: str) -> list[dict[str, Any]]:
        direct = by_parent.get(span_id_, [])
        return direct + [d for s in direct for d in below(s["context"]["span_id"])]

    statements_ = [s for s in below(rpc["context"]["span_id"]) if s["kind"] == "SpanKind.CLIENT"]
    assert statements_ and all(s["attributes"]["db.system"] == "postgresql"
                               for s in statements_)
    resource = rpc["resource"]["attributes"]
    assert resource["service.name"] == "context-engine"
    assert resource["service.version"] == __version__
    assert resource["deployment.environment"] == "ci"
    assert TOKEN not in "".join(server.raw) and TEXT not in "".join(server.raw)
    for secret in (tenant, session, "Summarize"):
        assert secret not in json.dumps(spans)
    built = rpc_log(server, "Build", tenant)
    assert (built["trace_id"], built["span_id"]) == (trace_id, rpc["context"]["span_id"][2:])


class Receiver:
    """An OTLP/HTTP receiver on loopback: keeps every POST /v1/traces body and its headers."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.headers: list[dict[str, str]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.path == "/v1/traces":
                    receiver.bodies.append(body)
                    receiver.headers.append({k.lower(): v for k, v in self.headers.items()})
                answer = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if self.path == "/v1/traces" else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"

    def stop(self) -> None:
        self.http.shutdown()
        self.http.server_close()


def exported(requests: Sequence[trace_service_pb2.ExportTraceServiceRequest]
             ) -> list[tuple[dict[str, str], trace_pb2.Span]]:
    """Each exported span with its resource's string attributes."""
    return [({a.key: a.value.string_value for a in rs.resource.attributes}, span)
            for req in requests for rs in req.resource_spans
            for ss in rs.scope_spans for span in ss.spans]


def attributes(span: trace_pb2.Span) -> dict[str, Any]:
    return {a.key: getattr(a.value, a.value.WhichOneof("value") or "string_value")
            for a in span.attributes}


def descendants(spans: Sequence[trace_pb2.Span], root: trace_pb2.Span) -> list[trace_pb2.Span]:
    direct = [s for s in spans if s.parent_span_id == root.span_id]
    return direct + [d for s in direct for d in descendants(spans, s)]


def test_otlp_over_http_from_worker_processes(database_url, ids, tmp_path: Path):
    """OTLP over HTTP (the per-signal protocol variable over the general one), to a loopback
    receiver, from a two-worker server with credentials: the Build span under the caller's,
    asyncpg's statements under it, the token and the message in no exported byte, and the
    RPC's log line naming the exported span."""
    tenant, session = ids
    token = f"tok-CANARY-{secrets.token_hex(8)}"
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps([{"sha256": token_sha256(token), "tenant_id": tenant,
                                   "rpcs": ["*"]}]))
    receiver = Receiver()
    trace_id, span_id, _ = caller()
    md = [("traceparent", f"00-{trace_id}-{span_id}-01"), ("authorization", f"Bearer {token}")]
    server = serve({**process_env(database_url, OTEL_TRACES_EXPORTER="otlp",
                                  OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
                                  OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="http/protobuf",
                                  OTEL_EXPORTER_OTLP_ENDPOINT=receiver.url,
                                  OTEL_EXPORTER_OTLP_HEADERS="x-collector-key=ce-test",
                                  OTEL_SERVICE_NAME="ce-under-test"),
                    "CE_WORKERS": "2", "CE_DEV_MODE": "0", "CE_AUTH_TOKENS_FILE": str(tokens)})
    try:
        traced_calls(server.address, tenant, session, md)
    finally:
        assert server.terminate() == 0
        receiver.stop()
    assert receiver.bodies, "".join(server.raw)[-3000:]
    assert all(h["x-collector-key"] == "ce-test" for h in receiver.headers)
    assert all(h["content-type"] == "application/x-protobuf" for h in receiver.headers)
    raw = b"".join(receiver.bodies)
    for secret in (token, TEXT, "Summarize", tenant, session):
        assert secret.encode() not in raw, secret
    spans = exported([trace_service_pb2.ExportTraceServiceRequest.FromString(b)
                      for b in receiver.bodies])
    mine = [s for _, s in spans if s.trace_id.hex() == trace_id]
    [rpc] = [s for s in mine if s.name == f"{SERVICE}/Build"]
    assert rpc.kind == trace_pb2.Span.SPAN_KIND_SERVER
    assert rpc.parent_span_id.hex() == span_id
    assert attributes(rpc)["context_engine.status_code"] == "OK"
    below = descendants(mine, rpc)
    db = [s for s in below if s.kind == trace_pb2.Span.SPAN_KIND_CLIENT]
    assert db and all(attributes(s)["db.system"] == "postgresql" for s in db)
    assert all(not [k for k in attributes(s) if "parameters" in k] for s in db)
    # the store's reads under it: the session's current epoch, always (its correction factor,
    # "db calibrations.get", only where the worker serving the Build had not read it for the
    # Plan just before)
    assert {"context_engine.build", "db sessions.current"} <= {s.name for s in below}
    resource = next(r for r, s in spans if s.span_id == rpc.span_id)
    assert resource["service.name"] == "ce-under-test"
    assert resource["service.version"] == __version__
    built = rpc_log(server, "Build", tenant)
    assert (built["trace_id"], built["span_id"]) == (trace_id, rpc.span_id.hex())


def test_otlp_over_grpc_from_an_endpoint_alone_and_the_sampler(database_url, ids):
    """OTEL_EXPORTER_OTLP_ENDPOINT alone: OTLP over gRPC (the spec's default exporter and
    protocol) to a loopback collector. OTEL_TRACES_SAMPLER=parentbased_always_off: a call
    continuing a sampled trace is exported, a call starting one is not (its log line still
    names its trace)."""
    tenant, session = ids
    received: list[trace_service_pb2.ExportTraceServiceRequest] = []

    class Collector(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:
            received.append(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    collector = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Collector(), collector)
    port = collector.add_insecure_port("127.0.0.1:0")
    collector.start()
    trace_id, span_id, md = caller()
    server = serve(process_env(database_url,
                               OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{port}",
                               OTEL_EXPORTER_OTLP_INSECURE="true",
                               OTEL_TRACES_SAMPLER="parentbased_always_off"))
    try:
        traced_calls(server.address, tenant, session, md)
        with grpc.insecure_channel(server.address) as channel:
            pb_grpc.ContextEngineStub(channel).GetPlan(
                pb.GetPlanRequest(tenant_id=tenant, session_id=session), timeout=30)
    finally:
        assert server.terminate() == 0
        collector.stop(None)
    spans = exported(received)
    names = {s.name for _, s in spans}
    assert {f"{SERVICE}/Plan", f"{SERVICE}/Build"} <= names
    [plan] = [s for _, s in spans if s.name == f"{SERVICE}/Plan"]
    assert plan.parent_span_id.hex() == span_id
    assert f"{SERVICE}/GetPlan" not in names  # a root the sampler dropped
    assert {s.trace_id.hex() for _, s in spans} == {trace_id}
    [resource] = [dict(r) for r in {tuple(sorted(r.items())) for r, _ in spans}]
    assert resource["service.name"] == "context-engine"
    assert resource["service.version"] == __version__
    unsampled = rpc_log(server, "GetPlan", tenant)
    assert unsampled["trace_id"] not in (None, trace_id) and unsampled["span_id"]


OFF = """
import asyncio, json, os, sys
import asyncpg, grpc
from prometheus_client import CollectorRegistry
from opentelemetry import trace
from context_engine.api.server import start
from context_engine.config import Config
from context_engine.v1 import context_engine_pb2_grpc as pb_grpc
from tests.integration.requests import plan_request

async def main() -> None:
    config = Config.from_env(os.environ).replace(grpc_addr="127.0.0.1:0", metrics_addr="",
                                                 dev_mode=True)
    running = await start(config, database_url=sys.argv[1], registry=CollectorRegistry())
    async with grpc.aio.insecure_channel(f"127.0.0.1:{running.grpc_port}") as channel:
        await pb_grpc.ContextEngineStub(channel).Plan(
            plan_request("tenant-off", "session-off"),
            metadata=[("traceparent", "00-" + "a" * 32 + "-" + "b" * 16 + "-01")])
    await running.stop(1.0)
    print(json.dumps({
        "trace_export": config.trace_export,
        "sdk": sorted(m for m in sys.modules if m.startswith("opentelemetry.sdk")),
        "exporters": sorted(m for m in sys.modules if m.startswith("opentelemetry.exporter")),
        "asyncpg_instrumented": hasattr(asyncpg.connection.Connection.fetch, "__wrapped__"),
        "global_provider": type(trace.get_tracer_provider()).__name__,
    }))

asyncio.run(main())
"""


def test_without_the_variables_no_sdk_is_loaded(database_url):
    """A server started without OTEL_* variables loads neither the SDK nor an exporter (so
    nothing can connect anywhere) and leaves asyncpg as it is."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", OFF, database_url], capture_output=True,
                         text=True, env=env, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report == {"trace_export": False, "sdk": [], "exporters": [],
                      "asyncpg_instrumented": False, "global_provider": "ProxyTracerProvider"}


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_a_collector_that_never_answers_holds_a_stop_a_second_at_most(database_url, ids,
                                                                      protocol):
    """A collector down (gRPC: connection refused) or hung (HTTP: a listener that reads and
    never answers) held every stop 7-10 s past its drain and grace, the exporter retrying
    until its own deadline (the SDK's flush ignores its timeout), towards the supervisor's
    SIGKILL. Now the spans still batched get FLUSH_SECONDS, and the stop says they were not
    all exported."""
    import socket
    import time

    from context_engine.api.server import FLUSH_SECONDS

    tenant, session = ids
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(16)  # accepted by the kernel, never read nor answered
    port = hung.getsockname()[1]
    if protocol == "grpc":
        hung.close()  # nothing listens there: refused
    try:
        server = serve(process_env(
            database_url, OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{port}",
            OTEL_EXPORTER_OTLP_PROTOCOL=protocol, CE_DRAIN_SECONDS="0",
            CE_GRACE_SECONDS="1"))
        try:
            traced_calls(server.address, tenant, session, caller()[2])
        finally:
            began = time.monotonic()
            assert server.terminate() == 0
            took = time.monotonic() - began
    finally:
        hung.close()
    assert took < 1 + FLUSH_SECONDS + 3, took  # grace, the bound, the rest (7-10 s before)
    assert [r for r in server.log if r.get("event") == "trace_export_unfinished"]
