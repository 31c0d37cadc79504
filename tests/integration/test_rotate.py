"""Rotate: explicit, counted rotations, once per idempotency key, never skipping an epoch."""

from __future__ import annotations

import json
import threading

import grpc
import pytest
from context_engine.v1 import context_engine_pb2 as pb
from context_engine.v1 import context_engine_pb2_grpc as pb_grpc

from tests.integration.requests import build_request, catalog, failure, plan_request

pytestmark = pytest.mark.integration


def rotate(tenant, session, key, reason=pb.ROTATION_REASON_OPERATOR, **kw):
    return pb.RotateRequest(tenant_id=tenant, session_id=session, reason=reason,
                            idempotency_key=key, **kw)


def test_security_revocation_removes_the_tool_from_the_prompt(stub, ids, db):
    tenant, session = ids
    first = stub.Plan(plan_request(tenant, session)).plan
    assert "web.fetch" in first.tool_names
    resp = stub.Rotate(rotate(tenant, session, "rev-1", pb.ROTATION_REASON_SECURITY_REVOCATION,
                              drop_tools=["web.fetch"]))
    assert resp.rotated and resp.plan.epoch == 2 and resp.plan.reason == "security_revocation"
    assert "web.fetch" not in resp.plan.tool_names
    assert all(t.name != "web.fetch" for t in resp.plan.tools)
    assert resp.plan.prefix_sha256 != first.prefix_sha256
    built = stub.Build(build_request(tenant, session, items=[]))
    assert built.epoch == 2 and built.prefix_sha256 == resp.plan.prefix_sha256
    events = db.fetch("SELECT type, epoch, payload->>'reason' AS reason FROM context_events "
                      "WHERE tenant_id=$1 ORDER BY id", tenant)
    assert [(e["type"], e["epoch"], e["reason"]) for e in events] == [
        ("context.plan.created", 1, "session_opened"),
        ("context.epoch.rotated", 2, "security_revocation")]
    # a later Plan with the same inputs keeps the revoked epoch: scope changes never rotate
    assert not stub.Plan(plan_request(tenant, session)).created


def test_dropping_the_last_deferred_tool_retires_tool_call(stub, ids):
    tenant, session = ids
    plan = stub.Plan(plan_request(tenant, session)).plan
    assert list(plan.deferred_tool_names) == ["mail.send"] and "tool.call" in plan.tool_names
    resp = stub.Rotate(rotate(tenant, session, "k", pb.ROTATION_REASON_SECURITY_REVOCATION,
                              drop_tools=["mail.send"]))
    assert not resp.plan.deferred_tool_names and "tool.call" not in resp.plan.tool_names


def test_dropping_skill_load_retires_the_skill_catalog(stub, ids):
    """The catalog is advertised only where skill.load is defined: a revocation of skill.load
    takes the catalog (and its pins) out of the prefix, and a Build that still names a loaded
    skill is refused rather than rendering a skill the plan no longer offers."""
    tenant, session = ids
    catalog = [pb.SkillCatalogEntry(name="triage", description="Sort the inbox.",
                                    trust=pb.TRUST_LEVEL_TRUSTED_CONFIGURATION)]
    plan = stub.Plan(plan_request(tenant, session, skill_catalog=catalog)).plan
    assert "skill.load" in plan.tool_names and [p.name for p in plan.skill_pins] == ["triage"]
    assert any("skill.load" in b.text for b in plan.prefix_blocks)
    resp = stub.Rotate(rotate(tenant, session, "k", pb.ROTATION_REASON_SECURITY_REVOCATION,
                              drop_tools=["skill.load"]))
    assert "skill.load" not in resp.plan.tool_names and not resp.plan.skill_pins
    assert not any("skill.load" in b.text or "Sort the inbox." in b.text
                   for b in resp.plan.prefix_blocks), [b.text for b in resp.plan.prefix_blocks]
    with pytest.raises(grpc.RpcError) as err:
        stub.Build(build_request(tenant, session, loaded_skills=[pb.SkillBody(
            name="triage", body="b", trust=pb.TRUST_LEVEL_TRUSTED_CONFIGURATION)]))
    assert "checkpoint.loaded_skills[0].name" in failure(err.value).violations


def test_a_retried_key_rotates_once(stub, ids, db):
    tenant, session = ids
    stub.Plan(plan_request(tenant, session))
    first = stub.Rotate(rotate(tenant, session, "same"))
    again = stub.Rotate(rotate(tenant, session, "same"))
    assert first.rotated and not again.rotated
    assert again.plan == first.plan
    assert db.val("SELECT count(*) FROM plans WHERE tenant_id=$1", tenant) == 2


def test_a_rotation_key_cannot_be_reused_for_another_request(stub, ids, db):
    tenant, session = ids
    stub.Plan(plan_request(tenant, session))
    stub.Plan(plan_request(tenant, "other"))
    stub.Rotate(rotate(tenant, session, "k1"))
    for req in (rotate(tenant, "other", "k1"),
                rotate(tenant, session, "k1", pb.ROTATION_REASON_SECURITY_REVOCATION,
                       drop_tools=["web.fetch"])):
        with pytest.raises(grpc.RpcError) as err:
            stub.Rotate(req)
        f = failure(err.value)
        assert f.code is grpc.StatusCode.INVALID_ARGUMENT and "idempotency_key" in f.violations
    assert db.val("SELECT count(*) FROM plans WHERE tenant_id=$1", tenant) == 3


def test_operator_rotation_keeps_the_bytes(stub, ids):
    tenant, session = ids
    plan = stub.Plan(plan_request(tenant, session)).plan
    resp = stub.Rotate(rotate(tenant, session, "op"))
    assert resp.plan.epoch == 2 and resp.plan.prefix_sha256 == plan.prefix_sha256
    assert resp.plan.prefix_blocks == plan.prefix_blocks


def test_model_routed_re_measures_for_the_new_model(stub, ids):
    tenant, session = ids
    plan = stub.Plan(plan_request(tenant, session)).plan
    resp = stub.Rotate(rotate(tenant, session, "route", pb.ROTATION_REASON_MODEL_ROUTED,
                              model=pb.ModelSpec(model_id="gpt-4o-2024-08-06")))
    assert resp.plan.model_id == "gpt-4o-2024-08-06" and resp.plan.reason == "model_routed"
    assert resp.plan.tool_names == plan.tool_names
    assert resp.plan.prefix_tokens != plan.prefix_tokens  # Claude's factor is gone


def test_model_routed_refuses_a_model_whose_format_cannot_send_a_defined_tool(stub, ids, db):
    """A Claude plan may define "1" + 63 letters (64 characters, as Anthropic takes it); Gemini
    puts "_" before a leading digit: routed to Gemini, every Build of the epoch in Gemini's
    format would be unrenderable, so the rotation is refused and nothing is written."""
    tenant, session = ids
    name = "1" + "a" * 63
    request = plan_request(tenant, session, tool_catalog=[*catalog(), pb.ToolSpec(
        name=name, description="A tool.", input_schema_json='{"type":"object"}',
        side_effect=pb.SIDE_EFFECT_NONE)])
    request.agent.enabled_tools.append(name)
    assert name in stub.Plan(request).plan.tool_names
    before = db.counts(tenant)
    with pytest.raises(grpc.RpcError) as err:
        stub.Rotate(rotate(tenant, session, "route", pb.ROTATION_REASON_MODEL_ROUTED,
                           model=pb.ModelSpec(model_id="gemini-2.5-pro")))
    f = failure(err.value)
    assert f.code is grpc.StatusCode.INVALID_ARGUMENT and list(f.violations) == ["model.model_id"]
    assert "gemini-2.5-pro cannot be sent in its own format" in f.violations["model.model_id"]
    assert db.counts(tenant) == before
    routed = stub.Rotate(rotate(tenant, session, "route-2", pb.ROTATION_REASON_MODEL_ROUTED,
                                model=pb.ModelSpec(model_id="gpt-4o-2024-08-06")))
    assert name in routed.plan.tool_names


def test_snapshot_invalidated_replaces_the_snapshot(stub, ids):
    tenant, session = ids
    snap = pb.MemorySnapshot(snapshot_id="s1", recall_trace_id="t1",
                             items=[pb.MemoryItem(id="m1", text="likes tea")])
    plan = stub.Plan(plan_request(tenant, session, memory_snapshot=snap)).plan
    assert any(b.row == 8 for b in plan.prefix_blocks)
    resp = stub.Rotate(rotate(tenant, session, "snap", pb.ROTATION_REASON_SNAPSHOT_INVALIDATED))
    assert resp.plan.reason == "snapshot_invalidated"
    assert all(b.row != 8 for b in resp.plan.prefix_blocks)


def test_concurrent_rotations_never_skip_or_duplicate_an_epoch(stub, ids, db):
    tenant, session = ids
    stub.Plan(plan_request(tenant, session))
    results, errors = [], []

    def go(i: int) -> None:
        try:
            results.append(stub.Rotate(rotate(tenant, session, f"c{i % 6}"), timeout=30))
        except BaseException as exc:  # asserted below
            errors.append(exc)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(18)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    epochs = [r["epoch"] for r in db.fetch(
        "SELECT epoch FROM plans WHERE tenant_id=$1 ORDER BY epoch", tenant)]
    assert epochs == list(range(1, 8))  # epoch 1 and one per distinct key
    assert sum(r.rotated for r in results) == 6


def test_dropping_tool_call_retires_the_deferred_index(stub, ids):
    """The index advertised mail.send "through tool.call" after tool.call was revoked."""
    tenant, session = ids
    stub.Plan(plan_request(tenant, session))
    resp = stub.Rotate(rotate(tenant, session, "k", pb.ROTATION_REASON_SECURITY_REVOCATION,
                              drop_tools=["tool.call"]))
    assert "tool.call" not in resp.plan.tool_names and not resp.plan.deferred_tool_names
    built = stub.Build(build_request(tenant, session))
    assert not [b for b in built.request.prefix_blocks if "mail.send" in b.text]
    assert stub.GetPlan(pb.GetPlanRequest(tenant_id=tenant, session_id=session)).plan.epoch == 2


def test_a_snapshot_whose_trace_is_invalidated_is_refused(stub, ids, db):
    """The same Plan rotated on every call (snapshot_invalidated 2, 3, 4...)."""
    tenant, session = ids
    req = plan_request(tenant, session)
    req.memory_snapshot.recall_trace_id = "trace-1"
    req.memory_snapshot.items.add(id="m1", text="likes tea")
    req.invalidated_recall_trace_ids.append("trace-1")
    with pytest.raises(grpc.RpcError) as err:
        stub.Plan(req)
    assert "memory_snapshot.recall_trace_id" in failure(err.value).violations
    assert db.counts(tenant)["plans"] == 0


def test_bad_rotations_change_nothing(stub, ids, db):
    tenant, session = ids
    stub.Plan(plan_request(tenant, session))
    before = db.counts(tenant)
    cases = {
        "drop_tools[0]": rotate(tenant, session, "x", pb.ROTATION_REASON_SECURITY_REVOCATION,
                                drop_tools=["no.such.tool"]),
        "drop_tools": rotate(tenant, session, "x", pb.ROTATION_REASON_SECURITY_REVOCATION),
        "reason": rotate(tenant, session, "x", pb.ROTATION_REASON_UNSPECIFIED),
        "idempotency_key": rotate(tenant, session, ""),
        "model.model_id": rotate(tenant, session, "x", pb.ROTATION_REASON_MODEL_ROUTED),
        # refused as Plan refuses them (a negative budget was stored, and every later Plan
        # and GetPlan of the session failed INTERNAL)
        "model.capabilities.breakpoint_budget": rotate(
            tenant, session, "x", pb.ROTATION_REASON_MODEL_ROUTED, model=pb.ModelSpec(
                model_id="gpt-4o", capabilities=pb.ModelCapabilities(breakpoint_budget=-1))),
        "memory_snapshot.items[0].id": rotate(
            tenant, session, "x", pb.ROTATION_REASON_SNAPSHOT_INVALIDATED,
            memory_snapshot=pb.MemorySnapshot(items=[pb.MemoryItem(id="", text="t")])),
        "memory_snapshot.watermark": rotate(
            tenant, session, "x", pb.ROTATION_REASON_SNAPSHOT_INVALIDATED,
            memory_snapshot=pb.MemorySnapshot(watermark=-5)),
    }
    for field, req in cases.items():
        with pytest.raises(grpc.RpcError) as err:
            stub.Rotate(req)
        f = failure(err.value)
        assert f.code is grpc.StatusCode.INVALID_ARGUMENT and field in f.violations, field
    assert db.counts(tenant) == before
    with pytest.raises(grpc.RpcError) as err:
        stub.Rotate(rotate(tenant, "no-such-session", "y"))
    assert failure(err.value).code is grpc.StatusCode.NOT_FOUND
    assert db.val("SELECT count(*) FROM sessions WHERE tenant_id=$1 AND session_id=$2",
                  tenant, "no-such-session") == 0


def test_a_revocation_rotates_a_plan_an_older_builder_counted_lower(server, stub, ids, db):
    """A plan an older builder pinned may count over a class cap with this one (@3 counts a
    tool's name in its costliest sent form): a security revocation still rotates it, keeping
    the classes it only removed from as they measure now, and the next Plan rotates it once
    more with builder_changed."""
    import json

    from context_engine.domain.canonical import canonical_json, session_key
    from context_engine.domain.plan import PlanSpec, render_prefix

    tenant, session = ids
    big = pb.ToolSpec(name="notes.search", description="Search the notes.",
                      input_schema_json='{"type":"object","properties":{}}',
                      side_effect=pb.SIDE_EFFECT_NONE)
    request = plan_request(tenant, session, tool_catalog=[*catalog(), big])
    request.agent.enabled_tools.append("notes.search")
    stub.Plan(request)
    document = json.loads(db.val("SELECT spec_text FROM plans WHERE tenant_id=$1", tenant))
    # as an older builder pinned it: a tool it counted within the cap, over it counted now
    tool = next(t for t in document["tools"] if t["name"] == "notes.search")
    tool["description"] = " ".join(f"word{i}" for i in range(3_400))
    document["builder_version"] = "context-engine-builder@2"
    rendered = render_prefix(PlanSpec.from_canonical(document), session_key(tenant, session))
    db.fetch("UPDATE plans SET spec_text=$2, prefix_sha256=$3, builder_version=$4 "
             "WHERE tenant_id=$1", tenant, canonical_json(document), rendered.prefix_sha256,
             "context-engine-builder@2")
    server.running.engine.cache.clear()
    assert stub.Build(build_request(tenant, session)).prefix_sha256 == rendered.prefix_sha256

    resp = stub.Rotate(rotate(tenant, session, "rev-old", pb.ROTATION_REASON_SECURITY_REVOCATION,
                              drop_tools=["web.fetch"]))
    assert resp.rotated and resp.plan.epoch == 2 and "web.fetch" not in resp.plan.tool_names
    tools = next(c for c in resp.plan.prefix_classes if c.class_name == "tool_definitions")
    assert tools.tokens > tools.cap == 9_000
    built = stub.Build(build_request(tenant, session))
    assert built.epoch == 2 and built.prefix_sha256 == resp.plan.prefix_sha256
    # another model counts it all afresh: refused, nothing written
    with pytest.raises(grpc.RpcError) as err:
        stub.Rotate(rotate(tenant, session, "routed", pb.ROTATION_REASON_MODEL_ROUTED,
                           model=pb.ModelSpec(model_id="claude-sonnet-4-5")))
    assert failure(err.value).reason == "PREFIX_CLASS_OVER_CAP"
    assert db.val("SELECT max(epoch) FROM plans WHERE tenant_id=$1", tenant) == 2
    replanned = stub.Plan(request)
    assert replanned.created and replanned.plan.reason == "builder_changed"


def test_a_larger_snapshot_that_leaves_no_room_for_historys_floor_is_refused(stub, ids, db):
    """A snapshot_invalidated Rotate replacing the snapshot by a larger one is held to the
    history floor as Plan is (HISTORY_FLOOR_UNREACHABLE, nothing written): it pinned a prefix
    whose body could not hold 8,000 tokens of history, every Build of the epoch short of the
    floor, where a Plan making the same change was refused. A smaller replacement rotates."""
    tenant, session = ids
    model = pb.ModelSpec(model_id="gpt-4o", capabilities=pb.ModelCapabilities(
        context_window=11_557, output_reserve=1_000))

    def request(snapshot: pb.MemorySnapshot, **kw) -> pb.PlanRequest:
        return pb.PlanRequest(
            tenant_id=tenant, session_id=session, model=model, memory_snapshot=snapshot,
            agent=pb.AgentSpec(agent_id="a", version="v1", instructions="Be helpful.",
                               enabled_tools=["web.search"]),
            tool_catalog=[pb.ToolSpec(
                name=n, description="does a thing", side_effect=pb.SIDE_EFFECT_NONE,
                input_schema_json=json.dumps({"type": "object",
                                              "properties": {"q": {"type": "string"}}}))
                for n in ("web.search", "web.fetch")], **kw)

    small = pb.MemorySnapshot(snapshot_id="s1", recall_trace_id="tr1", watermark=1,
                              items=[pb.MemoryItem(id="m0", text="likes tea")])
    big = pb.MemorySnapshot(snapshot_id="s2", recall_trace_id="tr2", watermark=2, items=[
        pb.MemoryItem(id=f"m{i}", text=f"fact number {i} about the user's preferences, " * 3)
        for i in range(40)])
    other = pb.MemorySnapshot(snapshot_id="s3", recall_trace_id="tr3", watermark=3,
                              items=[pb.MemoryItem(id="m1", text="likes coffee")])
    first = stub.Plan(request(small)).plan
    with pytest.raises(grpc.RpcError) as by_plan:
        stub.Plan(request(big, invalidated_recall_trace_ids=["tr1"]))
    with pytest.raises(grpc.RpcError) as by_rotate:
        stub.Rotate(rotate(tenant, session, "bigger", pb.ROTATION_REASON_SNAPSHOT_INVALIDATED,
                           memory_snapshot=big))
    for err in (by_plan, by_rotate):
        f = failure(err.value)
        assert (f.code, f.reason) == (grpc.StatusCode.FAILED_PRECONDITION,
                                      "HISTORY_FLOOR_UNREACHABLE"), (f.code, f.reason)
        assert int(f.metadata["body_budget"]) < int(f.metadata["history_floor"]) == 8_000
    assert db.counts(tenant)["plans"] == 1
    rotated = stub.Rotate(rotate(tenant, session, "other",
                                 pb.ROTATION_REASON_SNAPSHOT_INVALIDATED,
                                 memory_snapshot=other))
    assert rotated.rotated and rotated.plan.epoch == first.epoch + 1
    assert rotated.plan.snapshot_id == "s3"


def test_a_rotation_keeping_the_model_refuses_a_prefix_that_leaves_no_body(stub, ids, db,
                                                                           database_url):
    """Whatever the reason, a rotation whose prefix leaves no body is refused
    (`BUDGET_EXCEEDED`, nothing written), not pinned for every Build of the epoch to fail:
    here a replica whose policy caps the request below the output reserve, since the plan."""
    from tests.conftest import ServerThread, test_config

    tenant, session = ids
    stub.Plan(plan_request(tenant, session))
    plans = db.counts(tenant)["plans"]
    capped = ServerThread(test_config().replace(policy_cap_tokens=1_000), database_url)
    try:
        with grpc.insecure_channel(capped.address) as channel:
            other = pb_grpc.ContextEngineStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                other.Rotate(rotate(tenant, session, "capped"), timeout=30)
        assert failure(err.value).reason == "BUDGET_EXCEEDED", failure(err.value)
        assert db.counts(tenant)["plans"] == plans
    finally:
        capped.stop()
