"""Plan, GetPlan and Build through the real server and a real PostgreSQL."""

from __future__ import annotations

import grpc
import pytest
from context_engine.v1 import context_engine_pb2 as pb

from tests.integration.requests import build_request, failure, plan_request

pytestmark = pytest.mark.integration


def test_plan_creates_epoch_one_and_is_idempotent(stub, ids, db):
    tenant, session = ids
    first = stub.Plan(plan_request(tenant, session))
    assert first.created and first.plan.epoch == 1 and first.plan.reason == "session_opened"
    assert len(first.plan.prefix_sha256) == 64
    assert first.plan.prefix_tokens == sum(c.tokens for c in first.plan.prefix_classes) > 0
    again = stub.Plan(plan_request(tenant, session))
    assert not again.created
    assert again.plan == first.plan
    assert db.counts(tenant) == {"sessions": 1, "plans": 1, "context_events": 1}
    event = db.fetch("SELECT type, epoch, payload::text FROM context_events WHERE tenant_id=$1",
                     tenant)[0]
    assert event["type"] == "context.plan.created" and event["epoch"] == 1
    assert first.plan.prefix_sha256 in event["payload"]


def test_plan_pins_selection_and_records_it(stub, ids):
    tenant, session = ids
    plan = stub.Plan(plan_request(tenant, session)).plan
    # enabled web.fetch, discovered clock.now, tool.call because mail.send is deferred, and
    # the working-state control tool every plan pins unless the agent omits it
    assert list(plan.tool_names) == ["clock.now", "context.update_working_state", "tool.call",
                                     "web.fetch"]
    assert list(plan.deferred_tool_names) == ["mail.send"]
    assert [t.name for t in plan.tools] == list(plan.tool_names)
    assert list(plan.authority_scope_hashes) == sorted(plan.authority_scope_hashes)
    assert plan.cache_ttl == "5m" and plan.tokenizer.startswith("cl100k_base")
    rows = [b.row for b in plan.prefix_blocks]
    assert rows == sorted(rows) and rows[:3] == [1, 2, 3] and 6 in rows
    index = next(b for b in plan.prefix_blocks if b.row == 6)
    assert "mail.send(to, body): Send an email." in index.text


def test_scheduled_sessions_get_the_one_hour_ttl(stub, ids):
    tenant, session = ids
    req = plan_request(tenant, session, session=pb.SessionSpec(kind=pb.SESSION_KIND_SCHEDULED))
    assert stub.Plan(req).plan.cache_ttl == "1h"


def test_get_plan_returns_the_stored_plan(stub, ids):
    tenant, session = ids
    plan = stub.Plan(plan_request(tenant, session)).plan
    assert stub.GetPlan(pb.GetPlanRequest(tenant_id=tenant, session_id=session)).plan == plan
    assert stub.GetPlan(pb.GetPlanRequest(tenant_id=tenant, session_id=session,
                                          epoch=1)).plan == plan
    with pytest.raises(grpc.RpcError) as err:
        stub.GetPlan(pb.GetPlanRequest(tenant_id=tenant, session_id=session, epoch=2))
    f = failure(err.value)
    assert f.code is grpc.StatusCode.NOT_FOUND and f.metadata["epoch"] == "2"


def test_unknown_session_is_not_found(stub, ids):
    tenant, session = ids
    for call in (lambda: stub.GetPlan(pb.GetPlanRequest(tenant_id=tenant, session_id=session)),
                 lambda: stub.Build(build_request(tenant, session))):
        with pytest.raises(grpc.RpcError) as err:
            call()
        f = failure(err.value)
        assert f.code is grpc.StatusCode.NOT_FOUND
        assert f.reason == "SESSION_NOT_FOUND" and f.domain == "context-engine"


def test_build_returns_the_pinned_prefix_and_an_enveloped_body(stub, ids):
    tenant, session = ids
    plan = stub.Plan(plan_request(tenant, session)).plan
    resp = stub.Build(build_request(tenant, session))
    assert resp.prefix_sha256 == plan.prefix_sha256 and resp.epoch == 1
    assert list(resp.request.prefix_blocks) == list(plan.prefix_blocks)
    assert list(resp.request.tools) == list(plan.tools)
    rows = [m.row for m in resp.request.messages]
    assert rows == [10, 10, 10, 14]
    tool_msg = resp.request.messages[2]
    assert tool_msg.role == pb.ROLE_TOOL and tool_msg.call_id == "call-1"
    assert tool_msg.trust == pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED
    assert tool_msg.text.startswith('<untrusted source="tool:web.fetch" id="r1" nonce="')
    assert "&lt;/untrusted:0000>" in tool_msg.text
    assert resp.estimated_input_tokens == resp.prefix_tokens + resp.body_tokens
    assert resp.estimated_input_tokens <= resp.context_window - resp.output_reserve
    assert resp.session_key.startswith("session-") and len(resp.session_key) == 40
    # the same checkpoint builds the same bytes
    assert stub.Build(build_request(tenant, session)) == resp


def test_region_b_changes_never_touch_the_prefix(stub, ids):
    tenant, session = ids
    stub.Plan(plan_request(tenant, session))
    a = stub.Build(build_request(tenant, session, date="2026-11-29"))
    b = stub.Build(build_request(tenant, session, date="2026-11-30",
                                 recall=[pb.RecallLine(id="m1", text="likes tea")]))
    assert a.prefix_sha256 == b.prefix_sha256
    assert list(a.request.prefix_blocks) == list(b.request.prefix_blocks)
    assert a.request.messages != b.request.messages


def test_scope_changes_do_not_rotate_but_a_model_change_does(stub, ids, db):
    tenant, session = ids
    first = stub.Plan(plan_request(tenant, session)).plan
    narrowed = stub.Plan(plan_request(tenant, session, principal_scopes=["web"]))
    assert not narrowed.created and narrowed.plan.tool_names == first.tool_names
    rotated = stub.Plan(plan_request(tenant, session,
                                     model=pb.ModelSpec(model_id="gpt-4o-2024-08-06")))
    assert rotated.created and rotated.plan.epoch == 2 and rotated.plan.reason == "model_changed"
    assert rotated.plan.prefix_sha256 != first.prefix_sha256
    types = [r["type"] for r in db.fetch(
        "SELECT type FROM context_events WHERE tenant_id=$1 ORDER BY id", tenant)]
    assert types == ["context.plan.created", "context.epoch.rotated"]
    # Build without an epoch uses the current one; the old epoch still builds.
    assert stub.Build(build_request(tenant, session)).epoch == 2
    old = stub.Build(build_request(tenant, session, epoch=1))
    assert old.epoch == 1 and old.prefix_sha256 == first.prefix_sha256


def test_new_agent_version_rotates_and_same_version_new_content_conflicts(stub, ids, db):
    tenant, session = ids
    stub.Plan(plan_request(tenant, session))
    before = db.counts(tenant)
    changed = pb.AgentSpec(agent_id="helper", version="7", instructions="Something else.",
                           enabled_tools=["web.fetch"])
    with pytest.raises(grpc.RpcError) as err:
        stub.Plan(plan_request(tenant, session, agent=changed))
    f = failure(err.value)
    assert f.code is grpc.StatusCode.FAILED_PRECONDITION
    assert f.reason == "PINNED_VERSION_CONFLICT" and f.metadata == {"what": "agent",
                                                                    "version": "7"}
    assert db.counts(tenant) == before
    changed.version = "8"
    rotated = stub.Plan(plan_request(tenant, session, agent=changed))
    assert rotated.plan.epoch == 2 and rotated.plan.reason == "agent_version_changed"


def test_same_version_new_content_conflicts_whatever_else_changes(stub, ids, db):
    """The same agent version (or persona revision) with other content is a conflict, also
    in a Plan that rotates for another reason: a new model does not let version 7 hold other
    instructions, nor a new agent version let persona revision r1 hold other entries."""
    tenant, session = ids
    persona = pb.Persona(revision="r1", entries=[pb.PersonaEntry(key="tone", text="Brief.")])
    stub.Plan(plan_request(tenant, session, persona=persona))
    before = db.counts(tenant)
    edited = plan_request(tenant, session, persona=persona,
                          model=pb.ModelSpec(model_id="gpt-4o-2024-08-06"))
    edited.agent.instructions = "Something else."
    with pytest.raises(grpc.RpcError) as err:
        stub.Plan(edited)
    f = failure(err.value)
    assert f.code is grpc.StatusCode.FAILED_PRECONDITION
    assert f.reason == "PINNED_VERSION_CONFLICT" and f.metadata == {"what": "agent",
                                                                    "version": "7"}
    reworded = pb.Persona(revision="r1", entries=[pb.PersonaEntry(key="tone", text="Long.")])
    bumped = plan_request(tenant, session, persona=reworded)
    bumped.agent.version = "8"
    with pytest.raises(grpc.RpcError) as err:
        stub.Plan(bumped)
    assert failure(err.value).metadata == {"what": "persona", "version": "r1"}
    assert db.counts(tenant) == before  # nothing written
    edited.agent.instructions = plan_request(tenant, session).agent.instructions
    rotated = stub.Plan(edited)
    assert rotated.plan.epoch == 2 and rotated.plan.reason == "model_changed"


def test_a_plan_declaring_other_capabilities_of_the_pinned_model_is_refused(stub, ids, db):
    """A Plan of the pinned model id that declares another window, output reserve or breakpoint
    budget, and changes nothing that rotates, was answered with the pinned plan: a caller that
    said the window is 50,000 got Builds sized for 200,000. It is refused, naming the field
    and both values; leaving a capability out (or sending the pinned one) keeps the plan, a
    model_routed Rotate changes it, and a Plan that rotates for another reason takes it."""
    tenant, session = ids
    first = stub.Plan(plan_request(tenant, session)).plan  # claude-sonnet-4-5 from the catalog
    before = db.counts(tenant)
    declared = {"context_window": 50_000, "output_reserve": 4_000, "breakpoint_budget": 2}
    pinned = {"context_window": 200_000, "output_reserve": 8_192, "breakpoint_budget": 4}
    for name, value in declared.items():
        with pytest.raises(grpc.RpcError) as err:
            stub.Plan(plan_request(tenant, session, model=pb.ModelSpec(
                model_id="claude-sonnet-4-5",
                capabilities=pb.ModelCapabilities(**{name: value}))))
        f = failure(err.value)
        assert f.code is grpc.StatusCode.FAILED_PRECONDITION
        assert f.reason == "PINNED_VERSION_CONFLICT" and f.metadata == {
            "what": "model", "version": "claude-sonnet-4-5",
            "field": f"model.capabilities.{name}", "pinned": str(pinned[name]),
            "requested": str(value)}
    assert db.counts(tenant) == before  # nothing written
    same = stub.Plan(plan_request(tenant, session, model=pb.ModelSpec(
        model_id="claude-sonnet-4-5", capabilities=pb.ModelCapabilities(**pinned))))
    assert not same.created and same.plan.epoch == 1
    built = stub.Build(build_request(tenant, session))
    assert (built.context_window, built.output_reserve) == (200_000, 8_192)

    small = pb.ModelSpec(model_id="claude-sonnet-4-5", capabilities=pb.ModelCapabilities(
        context_window=50_000, output_reserve=4_000))
    routed = stub.Rotate(pb.RotateRequest(tenant_id=tenant, session_id=session,
                                          reason=pb.ROTATION_REASON_MODEL_ROUTED, model=small,
                                          idempotency_key="resize"))
    assert routed.rotated and routed.plan.epoch == 2
    built = stub.Build(build_request(tenant, session))
    assert (built.epoch, built.context_window, built.output_reserve) == (2, 50_000, 4_000)
    for model in (small, pb.ModelSpec(model_id="claude-sonnet-4-5")):
        kept = stub.Plan(plan_request(tenant, session, model=model))
        assert not kept.created and kept.plan.epoch == 2
    # a Plan that rotates for another reason drafts the new epoch with what it declares
    bumped = plan_request(tenant, session, model=pb.ModelSpec(
        model_id="claude-sonnet-4-5", capabilities=pb.ModelCapabilities(context_window=60_000)))
    bumped.agent.version = "8"
    rotated = stub.Plan(bumped)
    assert rotated.plan.epoch == 3 and rotated.plan.reason == "agent_version_changed"
    assert stub.Build(build_request(tenant, session)).context_window == 60_000
    assert first.prefix_sha256 == routed.plan.prefix_sha256  # the same bytes throughout


def test_persona_revision_rotates(stub, ids):
    tenant, session = ids
    p1 = pb.Persona(revision="r1", entries=[pb.PersonaEntry(key="tone", text="warm")])
    first = stub.Plan(plan_request(tenant, session, persona=p1)).plan
    assert any(b.row == 4 and "tone: warm" in b.text for b in first.prefix_blocks)
    p2 = pb.Persona(revision="r2", entries=[pb.PersonaEntry(key="tone", text="brief")])
    rotated = stub.Plan(plan_request(tenant, session, persona=p2))
    assert rotated.created and rotated.plan.reason == "persona_changed"


def test_prefix_class_over_cap_fails_and_writes_nothing(stub, ids, db):
    tenant, session = ids
    huge = pb.AgentSpec(agent_id="helper", version="1", instructions="word " * 6000)
    with pytest.raises(grpc.RpcError) as err:
        stub.Plan(plan_request(tenant, session, agent=huge))
    f = failure(err.value)
    assert f.code is grpc.StatusCode.FAILED_PRECONDITION
    assert f.reason == "PREFIX_CLASS_OVER_CAP"
    assert f.metadata["class"] == "agent_instructions" and f.metadata["cap"] == "4000"
    assert int(f.metadata["tokens"]) > 4000
    assert db.counts(tenant) == {"sessions": 0, "plans": 0, "context_events": 0}


def test_unknown_model_needs_capabilities(stub, ids):
    tenant, session = ids
    with pytest.raises(grpc.RpcError) as err:
        stub.Plan(plan_request(tenant, session, model=pb.ModelSpec(model_id="acme-1")))
    assert failure(err.value).violations.keys() == {"model.model_id"}
    sized = pb.ModelSpec(model_id="acme-1", capabilities=pb.ModelCapabilities(
        context_window=32_000))
    plan = stub.Plan(plan_request(tenant, session, model=sized)).plan
    assert plan.context_window == 32_000 and plan.output_reserve == 8192


def test_whole_window_check_fails_with_budget_exceeded(stub, ids):
    tenant, session = ids
    # the smallest window whose body holds history's 8,000-token floor (Plan refuses less)
    small = pb.ModelSpec(model_id="acme-small", capabilities=pb.ModelCapabilities(
        context_window=12_000, output_reserve=1_000))
    plan = stub.Plan(plan_request(tenant, session, model=small)).plan
    items = [pb.ConversationItem(id="u1", sequence=1, run_id="run-1",
                                 trust=pb.TRUST_LEVEL_USER,
                                 user=pb.UserMessage(text="lorem ipsum " * 4000))]
    with pytest.raises(grpc.RpcError) as err:
        stub.Build(build_request(tenant, session, items=items))
    f = failure(err.value)
    assert f.code is grpc.StatusCode.FAILED_PRECONDITION and f.reason == "BUDGET_EXCEEDED"
    # the message never yields; the body is 12,000 - 1,000 reserve - 5% margin - the prefix
    assert f.metadata["class"] == "current_user_message"
    body = 12_000 - 1_000 - 550 - plan.prefix_tokens
    assert 8_000 <= int(f.metadata["limit"]) == body < int(f.metadata["tokens"])


def test_a_rotation_for_another_reason_keeps_the_capabilities_it_leaves_out(stub, ids, db):
    """A session pinned with a declared window of 50,000 and reserve of 4,000 kept them while
    later Plans left them out, but a Plan rotating it for another reason (a new agent version)
    that also left them out drafted the new epoch at the catalog's 200,000 and 8,192: Builds
    sized four times past what the caller said its model takes. Capabilities left out keep the
    pinned ones there too; one declared is taken; an unknown model needs no re-declaration."""
    tenant, session = ids
    small = pb.ModelSpec(model_id="claude-sonnet-4-5", capabilities=pb.ModelCapabilities(
        context_window=50_000, output_reserve=4_000))
    stub.Plan(plan_request(tenant, session, model=small))
    assert not stub.Plan(plan_request(tenant, session)).created
    bumped = plan_request(tenant, session)  # claude-sonnet-4-5, no capabilities
    bumped.agent.version = "8"
    rotated = stub.Plan(bumped)
    assert rotated.created and rotated.plan.reason == "agent_version_changed"
    built = stub.Build(build_request(tenant, session))
    assert (built.epoch, built.context_window, built.output_reserve) == (2, 50_000, 4_000)
    widened = plan_request(tenant, session, model=pb.ModelSpec(
        model_id="claude-sonnet-4-5", capabilities=pb.ModelCapabilities(context_window=60_000)))
    widened.agent.version = "9"
    assert stub.Plan(widened).plan.reason == "agent_version_changed"
    built = stub.Build(build_request(tenant, session))
    assert (built.epoch, built.context_window, built.output_reserve) == (3, 60_000, 4_000)

    other = f"{session}-acme"
    acme = pb.ModelSpec(model_id="acme-1", capabilities=pb.ModelCapabilities(
        context_window=40_000, output_reserve=2_000))
    stub.Plan(plan_request(tenant, other, model=acme))
    bumped = plan_request(tenant, other, model=pb.ModelSpec(model_id="acme-1"))
    bumped.agent.version = "8"
    assert stub.Plan(bumped).plan.reason == "agent_version_changed"
    built = stub.Build(build_request(tenant, other))
    assert (built.epoch, built.context_window, built.output_reserve) == (2, 40_000, 2_000)
    assert [r["reason"] for r in db.fetch(
        "SELECT reason FROM plans WHERE tenant_id = $1 AND session_id = $2 ORDER BY epoch",
        tenant, session)] == ["session_opened", "agent_version_changed", "agent_version_changed"]
