"""Health, reflection, metrics, and the prefix-hash check on a tampered plan."""

from __future__ import annotations

import json
import logging
import urllib.request

import grpc
import pytest
from context_engine.v1 import context_engine_pb2 as pb
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.integration.requests import build_request, failure, plan_request

pytestmark = pytest.mark.integration


def test_health_serving(channel):
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "context_engine.v1.ContextEngine"):
        resp = health.Check(health_pb2.HealthCheckRequest(service=service))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_services(channel):
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = stub.ServerReflectionInfo(iter([
        reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for r in responses for s in r.list_services_response.service}
    assert {"context_engine.v1.ContextEngine", "grpc.health.v1.Health"} <= names


def _scrape(server) -> str:
    port = server.running.metrics_port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return str(resp.read().decode())


def _value(text: str, sample: str) -> float:
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    return 0.0


def test_metrics_are_exported_and_move(server, stub, ids):
    tenant, session = ids
    before = _scrape(server)
    stub.Plan(plan_request(tenant, session))
    stub.Build(build_request(tenant, session))
    text = _scrape(server)
    for name in ("context_engine_sessions_opened_total", "context_engine_epochs_total",
                 "context_engine_prefix_hash_mismatch_total", "context_engine_prefix_tokens",
                 "context_engine_budget_pressure_total", "context_engine_budget_exceeded_total",
                 "context_engine_build_seconds", "context_engine_rpc_seconds",
                 "context_engine_estimator_error_ratio",
                 "context_engine_estimator_correction_factor",
                 "context_engine_cached_prefix_ratio"):
        assert f"# TYPE {name.removesuffix('_total')}" in text, name
    assert _value(text, "context_engine_sessions_opened_total") == \
        _value(before, "context_engine_sessions_opened_total") + 1
    sample = 'context_engine_epochs_total{reason="session_opened"}'
    assert _value(text, sample) == _value(before, sample) + 1
    sample = 'context_engine_rpc_seconds_count{code="OK",method="Build"}'
    assert _value(text, sample) >= _value(before, sample) + 1
    assert _value(text, "context_engine_build_seconds_count") >= 1
    assert tenant not in text and session not in text  # no unbounded labels


def _rpc_lines(caplog: pytest.LogCaptureFixture, method: str) -> list[dict[str, object]]:
    return [fields for r in caplog.records if r.getMessage() == "rpc"
            and (fields := getattr(r, "fields", {})).get("method") == method]


def test_tampered_plan_fails_build_with_both_hashes(server, stub, ids, db, caplog):
    tenant, session = ids
    plan = stub.Plan(plan_request(tenant, session)).plan
    db.fetch("UPDATE plans SET spec_text = replace(spec_text, "
             "'You are a helpful agent.', 'Tampered.') WHERE tenant_id=$1", tenant)
    server.running.engine.cache.clear()  # as a replica that has not seen this plan yet
    before = _value(_scrape(server), "context_engine_prefix_hash_mismatch_total")
    with caplog.at_level(logging.INFO, logger="context_engine"):
        for _ in range(2):
            with pytest.raises(grpc.RpcError) as err:
                stub.Build(build_request(tenant, session))
    f = failure(err.value)
    assert f.code is grpc.StatusCode.INTERNAL and f.reason == "PREFIX_HASH_MISMATCH"
    assert f.metadata["stored_sha256"] == plan.prefix_sha256
    assert len(f.metadata["rendered_sha256"]) == 64
    assert plan.prefix_sha256 in f.message and f.metadata["rendered_sha256"] in f.message
    # a plan that fails the check is not cached: the counter counts calls, as its help says
    assert _value(_scrape(server), "context_engine_prefix_hash_mismatch_total") == before + 2
    # the runbook's log line: which tenant and epoch, pinned and rendered how
    (line, _) = [x for x in _rpc_lines(caplog, "Build") if x.get("tenant") == tenant]
    assert line["reason"] == "PREFIX_HASH_MISMATCH" and line["epoch"] == plan.epoch
    assert line["prefix_sha256"] == plan.prefix_sha256
    assert line["rendered_sha256"] == f.metadata["rendered_sha256"]


def test_report_usage_and_compact_log_the_epoch_and_prefix_they_counted_against(
        stub, ids, caplog):
    """Their log lines said epoch 0 and no prefix_sha256, where every other call on a plan
    names both (an operator follows a session's epochs through them)."""
    from tests.integration.test_compact_rpc import compact_request

    tenant, session = ids
    plan = stub.Plan(plan_request(tenant, session)).plan
    with caplog.at_level(logging.INFO, logger="context_engine"):
        stub.ReportUsage(pb.ReportUsageRequest(
            tenant_id=tenant, session_id=session, estimated_input_tokens=5_000,
            estimator_factor=1.0, input_tokens=5_500, output_tokens=10, idempotency_key="u1"))
        stub.Compact(compact_request(tenant, session, "c1"))
    for method in ("ReportUsage", "Compact"):
        (line,) = [x for x in _rpc_lines(caplog, method) if x.get("tenant") == tenant]
        assert (line["code"], line["epoch"], line["prefix_sha256"]) == \
            ("OK", plan.epoch, plan.prefix_sha256), method


def test_reordered_jsonb_keys_do_not_change_the_hash(server, stub, ids, db):
    """jsonb keeps no key order; a stored plan text in another key order is parsed and
    re-serialized canonically before anything is rendered or hashed."""
    tenant, session = ids
    plan = stub.Plan(plan_request(tenant, session)).plan  # no floats: jsonb keeps every value
    canonical = db.val("SELECT spec_text FROM plans WHERE tenant_id=$1", tenant)
    db.fetch("UPDATE plans SET spec_text = spec::text WHERE tenant_id=$1", tenant)
    stored = db.val("SELECT spec_text FROM plans WHERE tenant_id=$1", tenant)
    # The same document, but jsonb orders keys shorter-first: not the canonical text.
    assert json.loads(stored) == json.loads(canonical)
    assert stored != canonical
    assert list(json.loads(stored)) != list(json.loads(canonical))

    server.running.engine.cache.clear()  # as a replica that has not seen this plan yet
    resp = stub.Build(build_request(tenant, session))
    assert resp.prefix_sha256 == plan.prefix_sha256
    assert list(resp.request.prefix_blocks) == list(plan.prefix_blocks)
    assert list(resp.request.tools) == list(plan.tools)

    server.running.engine.cache.clear()
    got = stub.GetPlan(pb.GetPlanRequest(tenant_id=tenant, session_id=session)).plan
    assert got.prefix_sha256 == plan.prefix_sha256
    assert got.prefix_blocks == plan.prefix_blocks and got.tools == plan.tools
    # Reading never rewrites the row: the non-canonical text is still what is stored.
    assert db.val("SELECT spec_text FROM plans WHERE tenant_id=$1", tenant) == stored


def test_logs_carry_no_content_and_no_reasoning(stub, ids, caplog):
    tenant, session = ids
    caplog.set_level(logging.INFO, logger="context_engine")
    stub.Plan(plan_request(tenant, session))
    items = [
        pb.ConversationItem(id="u1", sequence=1, run_id="run-1", trust=pb.TRUST_LEVEL_USER,
                            user=pb.UserMessage(text="CANARY-USER-TEXT")),
        pb.ConversationItem(id="z1", sequence=2, run_id="run-1", trust=pb.TRUST_LEVEL_USER,
                            reasoning=pb.ReasoningItem(provider="openai",
                                                       opaque=b"CANARY-REASONING")),
        pb.ConversationItem(id="a1", sequence=3, run_id="run-1", trust=pb.TRUST_LEVEL_USER,
                            assistant=pb.AssistantMessage(text="ok")),
        pb.ConversationItem(id="u2", sequence=4, run_id="run-1", trust=pb.TRUST_LEVEL_USER,
                            user=pb.UserMessage(text="CANARY-TRAILING")),
    ]
    resp = stub.Build(build_request(tenant, session, items=items))
    assert resp.request.messages[1].reasoning_opaque == b"CANARY-REASONING"
    assert all("CANARY-REASONING" not in m.text for m in resp.request.messages)
    records = [r for r in caplog.records if r.name == "context_engine"]
    assert any(getattr(r, "fields", {}).get("method") == "Build" for r in records)
    dumped = json.dumps([getattr(r, "fields", {}) for r in records]) + caplog.text
    for canary in ("CANARY-USER-TEXT", "CANARY-REASONING", "CANARY-TRAILING"):
        assert canary not in dumped


def test_numbers_in_schemas_survive_storage(server, stub, ids):
    """1e16 and -0.0 are rewritten by jsonb; the plan is re-read from its canonical text."""
    tenant, session = ids
    schema = json.dumps({"type": "object", "properties": {
        "n": {"type": "number", "maximum": 1e16, "default": -0.0, "multipleOf": 1.5e-07}}})
    tool = pb.ToolSpec(name="calc.eval", description="Evaluate.", input_schema_json=schema,
                       side_effect=pb.SIDE_EFFECT_NONE)
    plan = stub.Plan(plan_request(tenant, session, tool_catalog=[tool])).plan
    server.running.engine.cache.clear()  # force the read back from PostgreSQL
    assert stub.Build(build_request(tenant, session, items=[])).prefix_sha256 == \
        plan.prefix_sha256
    got = stub.GetPlan(pb.GetPlanRequest(tenant_id=tenant, session_id=session)).plan
    assert got.tools == plan.tools and '"default":-0.0' in got.tools[0].input_schema_json


def test_nul_characters_are_rejected_before_storage(stub, ids, db):
    tenant, session = ids
    agent = pb.AgentSpec(agent_id="a", version="1", instructions="before\x00after")
    with pytest.raises(grpc.RpcError) as err:
        stub.Plan(plan_request(tenant, session, agent=agent))
    f = failure(err.value)
    assert f.code is grpc.StatusCode.INVALID_ARGUMENT
    assert "agent.instructions" in f.violations
    assert db.counts(tenant) == {"sessions": 0, "plans": 0, "context_events": 0}
