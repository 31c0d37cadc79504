"""Traces from a real server into the SDK's in-memory exporter: one server span per RPC under
the caller's W3C trace context, child spans for rendering, build and database calls, and no
tenant id, session id, message text or credential in any attribute. And the JSON log line each
RPC writes."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import secrets
import threading
from collections.abc import Iterator, Sequence
from concurrent import futures
from typing import Any

import grpc
import pytest
from context_engine.api.server import start
from context_engine.config import Config
from context_engine.telemetry.logs import LOGGER, JsonFormatter
from context_engine.telemetry.tracing import (
    caller_context,
    otlp_provider,
    otlp_requested,
    tracer_for,
)
from context_engine.v1 import context_engine_pb2 as pb
from context_engine.v1 import context_engine_pb2_grpc as pb_grpc
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client import CollectorRegistry

from tests.conftest import ServerThread
from tests.conftest import test_config as base_config
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

    # Plan: the prefix rendered, and the database calls that read and pinned it.
    names = sorted(s.name for s in children(spans, rpc_plan))
    assert names == ["context_engine.plan.render", "db plans.get", "db plans.pin"]
    pin = one(spans, "db plans.pin")
    assert pin.kind is SpanKind.CLIENT
    assert (pin.attributes or {})["db.system.name"] == "postgresql"

    # Build: the pure build (with its history selection), the rendering, the factor's read.
    under_build = {s.name for s in children(spans, rpc_build)}
    assert {"context_engine.build", "context_engine.render",
            "db calibrations.get"} <= under_build
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


def test_every_rpc_has_a_span_and_a_call_without_context_starts_a_trace(tstub, ids, exporter):
    tenant, session = ids
    exporter.clear()
    tstub.Plan(plan_request(tenant, session))
    tstub.Rotate(pb.RotateRequest(tenant_id=tenant, session_id=session,
                                  reason=pb.ROTATION_REASON_OPERATOR, idempotency_key="rot-1"))
    tstub.ReportUsage(pb.ReportUsageRequest(
        tenant_id=tenant, session_id=session, estimated_input_tokens=1000,
        estimator_factor=1.0, input_tokens=1100, cached_tokens=900, output_tokens=10,
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


def test_otlp_export_follows_the_standard_variables():
    assert not otlp_requested({})
    assert otlp_requested({"OTEL_TRACES_EXPORTER": "otlp"})
    assert otlp_requested({"OTEL_TRACES_EXPORTER": "console, otlp"})
    assert not otlp_requested({"OTEL_TRACES_EXPORTER": "none",
                               "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"})
    assert otlp_requested({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"})
    assert otlp_requested({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4317"})
    assert not otlp_requested({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"})
    assert not Config.from_env({}).trace_export
    assert Config.from_env({"OTEL_TRACES_EXPORTER": "otlp"}).trace_export


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
    logged_plan, built, failed_build = mine
    assert logged_plan["prefix_sha256"] == plan.prefix_sha256 and logged_plan["created"]
    assert built["prefix_sha256"] == pressed.prefix_sha256
    assert built["yield_steps"] == [s.step for s in pressed.pressure.steps] != []
    assert built["estimated_input_tokens"] == pressed.estimated_input_tokens
    assert failed_build["level"] == "warning" and failed_build["reason"] == "BUDGET_EXCEEDED"
    for secret in (TEXT, TOKEN, "lorem", "question 1", "answer 1", "word word"):
        assert secret not in text


def test_the_otlp_provider_exports_to_a_collector(monkeypatch):
    """``otlp_provider`` ships spans over OTLP/gRPC to the endpoint the variables name."""
    received: list[Any] = []

    class Collector(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:
            received.append(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    collector = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Collector(), collector)
    port = collector.add_insecure_port("127.0.0.1:0")
    collector.start()
    try:
        monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
        monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
        provider = otlp_provider("9.9.9")
        with tracer_for(provider).start_as_current_span("probe"):
            pass
        assert provider.force_flush(10_000)
        provider.shutdown()
    finally:
        collector.stop(None)
    spans = [(r.resource, s) for req in received for r in req.resource_spans
             for ss in r.scope_spans for s in ss.spans]
    assert [s.name for _, s in spans] == ["probe"]
    resource = {a.key: a.value.string_value for a in spans[0][0].attributes}
    assert resource["service.name"] == "context-engine"
    assert resource["service.version"] == "9.9.9"
