"""The working-state control tool through the real server and database: pinned in the plan, the
model's raw call answered with a tool result or refused with one (errors and input schema),
the user's remove_constraint, and carry over logged raw calls."""

from __future__ import annotations

import json

import grpc
import pytest
from context_engine.api import working_state_tool as wst
from context_engine.v1 import context_engine_pb2 as pb
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from tests.integration.requests import failure, plan_request

pytestmark = pytest.mark.integration

NAME = "context.update_working_state"
ARGS = "transition.tool_call.arguments"


def call(arguments: object, *, call_id: str = "toolu_01", name: str = NAME,
         trust: int = pb.TRUST_LEVEL_UNSPECIFIED) -> pb.WorkingStateTransition:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return pb.WorkingStateTransition(tool_call=pb.WorkingStateToolCall(
        call_id=call_id, name=name, arguments_json=text, trust=trust))


def update(tenant: str, session: str, transition: pb.WorkingStateTransition,
           current: pb.WorkingState | None = None, seq: int = 10
           ) -> pb.UpdateWorkingStateRequest:
    return pb.UpdateWorkingStateRequest(tenant_id=tenant, session_id=session, run_id="run-1",
                                        current=current or pb.WorkingState(), sequence=seq,
                                        transition=transition)


def tool_result(err: grpc.RpcError) -> str:
    """The LocalizedMessage of a failed call: the text the runtime returns to the model."""
    assert isinstance(err, grpc.Call)
    status = rpc_status.from_call(err)
    assert status is not None
    texts = []
    for detail in status.details:
        if detail.Is(error_details_pb2.LocalizedMessage.DESCRIPTOR):
            text = error_details_pb2.LocalizedMessage()
            detail.Unpack(text)
            assert text.locale == "en-US"
            texts.append(text.message)
    assert len(texts) <= 1
    return texts[0] if texts else ""


def events(db, tenant: str) -> list[dict]:
    rows = db.fetch("SELECT payload FROM context_events WHERE tenant_id = $1 AND type = "
                    "'context.working_state.updated' ORDER BY id", tenant)
    return [json.loads(r["payload"]) for r in rows]


def test_every_plan_pins_the_tool_unless_the_agent_omits_it(stub, ids):
    tenant, session = ids
    plan = stub.Plan(plan_request(tenant, session)).plan
    assert NAME in plan.tool_names
    (tool,) = [t for t in plan.tools if t.name == NAME]
    assert tool.input_schema_json == wst.input_schema_json()
    assert "Invalid arguments return this tool's input schema." in tool.description
    assert plan.policy_version >= "platform-policy@2026-12-01.2"

    omitting = plan_request(tenant, session + "-omits")
    omitting.agent.omits_working_state_tool = True
    other = stub.Plan(omitting).plan
    assert NAME not in other.tool_names
    tools_class = {c.class_name: c for c in plan.prefix_classes}["tool_definitions"]
    other_class = {c.class_name: c for c in other.prefix_classes}["tool_definitions"]
    assert tools_class.items == other_class.items + 1
    assert tools_class.tokens > other_class.tokens + 300  # it counts against the caps
    # the same agent version with the other choice is other content under a pinned version
    conflicting = pb.PlanRequest()
    conflicting.CopyFrom(omitting)
    conflicting.session_id = session
    with pytest.raises(grpc.RpcError) as err:
        stub.Plan(conflicting)
    assert failure(err.value).reason == "PINNED_VERSION_CONFLICT"


def test_a_raw_call_applies_with_a_tool_result_and_records_no_text(stub, ids, db):
    tenant, session = ids
    stub.Plan(plan_request(tenant, session))
    resp = stub.UpdateWorkingState(update(tenant, session, call(
        {"objective": "Book travel", "add_constraints": ["economy only"],
         "upsert_tasks": [{"id": "t1", "title": "find flights", "state": "open"}],
         "add_facts": [{"statement": "the airline page states fares rise Friday",
                        "source_event_ids": [3], "trust": "external_untrusted"}],
         "next_action": "search"}, name="context__update_working_state")))
    s = resp.state
    assert s.objective == "Book travel" and list(s.constraints) == ["economy only"]
    assert s.facts[0].trust == pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED
    assert s.tasks[0].sequence == 10 and s.tasks[0].run_id == "run-1"
    assert resp.change.transition == "update" and resp.change.facts_added == 1
    assert resp.tool_result == (
        "Working state updated: objective set; 1 constraint added; 1 task updated; 1 fact "
        f"recorded; next action set. The block is {resp.change.tokens:,} of 1,000 tokens.")
    (event,) = events(db, tenant)
    assert event["call_id"] == "toolu_01" and event["tasks_upserted"] == ["t1"]
    text = json.dumps(event)
    assert "fares" not in text and "economy" not in text and "find flights" not in text

    # the call's label bounds what it writes
    low = stub.UpdateWorkingState(update(tenant, session, call(
        {"add_facts": [{"statement": "budget is 500", "source_event_ids": [4]}],
         "next_action": "compare"}, trust=pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED), current=s, seq=11))
    assert low.state.facts[1].trust == pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED
    assert low.state.next_action_trust == pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED
    # the typed form stays, and answers no tool result
    typed = stub.UpdateWorkingState(update(tenant, session, pb.WorkingStateTransition(
        update=pb.WorkingStateUpdate(next_action="book")), current=low.state, seq=12))
    assert typed.state.next_action == "book" and typed.tool_result == ""
    assert "call_id" not in events(db, tenant)[-1]


def test_invalid_arguments_are_refused_with_violations_and_the_schema(stub, ids, db):
    tenant, session = ids
    stub.Plan(plan_request(tenant, session))
    current = pb.WorkingState(constraints=["economy only"])
    with pytest.raises(grpc.RpcError) as err:
        stub.UpdateWorkingState(update(tenant, session, call(
            {"add_constraints": ["a", "b", "c", 4], "remove_constraints": ["economy only"],
             "upsert_tasks": [{"id": "t1", "state": "finished"}],
             "add_facts": [{"statement": "s" * 401, "source_event_ids": ["3"]}]}),
            current=current))
    f = failure(err.value)
    assert f.code is grpc.StatusCode.INVALID_ARGUMENT and f.reason == "INVALID_ARGUMENT"
    assert set(f.violations) == {f"{ARGS}.add_constraints[3]", f"{ARGS}_json",
                                 f"{ARGS}.upsert_tasks[0].state",
                                 f"{ARGS}.add_facts[0].statement",
                                 f"{ARGS}.add_facts[0].source_event_ids[0]"}
    text = tool_result(err.value)
    assert text.startswith("context.update_working_state was not applied: its arguments are "
                           "invalid, so nothing changed.\n")
    assert "- arguments: holds an argument that is not a field of this tool\n" in text
    assert "- add_constraints[3]: Input should be a valid string\n" in text
    assert text.endswith("input schema:\n" + wst.input_schema_json())
    assert json.loads(text.rsplit("\n", 1)[1])["additionalProperties"] is False
    assert events(db, tenant) == []

    with pytest.raises(grpc.RpcError) as err:
        stub.UpdateWorkingState(update(tenant, session, call("not json")))
    assert set(failure(err.value).violations) == {"transition.tool_call.arguments_json"}
    assert "- arguments: is not valid JSON\n" in tool_result(err.value)
    # a name twice: the parse would keep the last value, the call as logged holds both
    with pytest.raises(grpc.RpcError) as err:
        stub.UpdateWorkingState(update(tenant, session, call(
            '{"next_action":"book it","next_action":"cancel it"}')))
    assert failure(err.value).violations == {"transition.tool_call.arguments_json": (
        "holds one name twice in one object: a body that sends it parsed would keep one value; "
        "refused in every format alike")}
    assert "holds one name twice" in tool_result(err.value)
    # what the runtime got wrong is not the model's to hear about
    with pytest.raises(grpc.RpcError) as err:
        stub.UpdateWorkingState(update(tenant, session, call("{}", call_id="", name="x")))
    assert set(failure(err.value).violations) == {"transition.tool_call.call_id",
                                                  "transition.tool_call.name"}
    assert tool_result(err.value) == ""


def test_an_event_id_beyond_int64_is_refused_and_writes_nothing(stub, ids, db):
    """Event ids are int64 on the wire and in the store: a larger one the model writes is a field
    violation told to the model, not an event recorded and then a failure storing the state."""
    tenant, session = ids
    stub.Plan(plan_request(tenant, session))
    for big in (2**63, 10**30):
        with pytest.raises(grpc.RpcError) as err:
            stub.UpdateWorkingState(update(tenant, session, call(
                {"add_facts": [{"statement": "the page states X", "source_event_ids": [3, big]}]})))
        f = failure(err.value)
        assert f.code is grpc.StatusCode.INVALID_ARGUMENT, f
        assert set(f.violations) == {f"{ARGS}.add_facts[0].source_event_ids[1]"}
        assert "- add_facts[0].source_event_ids[1]: " in tool_result(err.value)
    assert events(db, tenant) == []
    ok = stub.UpdateWorkingState(update(tenant, session, call(
        {"add_facts": [{"statement": "the page states X", "source_event_ids": [2**63 - 1]}]})))
    assert list(ok.state.facts[0].source_event_ids) == [2**63 - 1]


def test_the_largest_refusal_still_reaches_the_client_whole(stub, ids):
    """Hundreds of violations (every field of every entry wrong, and unknown fields of long,
    non-ASCII names, named once an object): the status (ErrorInfo, violations, tool result
    with the whole schema) stays within what gRPC clients accept in trailers."""
    tenant, session = ids
    stub.Plan(plan_request(tenant, session))
    wrong = {f"{'ключ' * 100}{i}": "значение" * 50 for i in range(20)}
    with pytest.raises(grpc.RpcError) as err:
        stub.UpdateWorkingState(update(tenant, session, call(
            {"upsert_tasks": [{"id": 1, "title": True, "state": "x" * 300, **wrong}] * 30,
             "add_facts": [{"statement": 5, "source_event_ids": ["a"], **wrong}] * 40,
             **wrong})))
    f = failure(err.value)
    count = int(f.metadata["violations"])
    assert f.code is grpc.StatusCode.INVALID_ARGUMENT and count > 200
    assert 0 < len(f.violations) < count
    text = tool_result(err.value)
    assert text.endswith(wst.input_schema_json()) and f"- and {count - 6} more" in text
    assert "ключ" not in text  # the names the model wrote: not repeated to it


def test_a_valid_call_the_state_refuses_tells_the_model_why(stub, ids, db):
    tenant, session = ids
    stub.Plan(plan_request(tenant, session))
    full = pb.WorkingState(constraints=[f"constraint {i}" for i in range(20)])
    with pytest.raises(grpc.RpcError) as err:
        stub.UpdateWorkingState(update(tenant, session, call({"add_constraints": ["one more"]}),
                                       current=full))
    f = failure(err.value)
    assert f.code is grpc.StatusCode.FAILED_PRECONDITION and f.reason == "CONSTRAINT_CAP_REACHED"
    assert "ask the user whether one no longer applies" in tool_result(err.value)
    with pytest.raises(grpc.RpcError) as err:
        stub.UpdateWorkingState(update(tenant, session, call(
            {"upsert_tasks": [{"id": "t9", "state": "open"}]})))
    f = failure(err.value)
    assert f.code is grpc.StatusCode.INVALID_ARGUMENT
    assert set(f.violations) == {f"{ARGS}.upsert_tasks[0].title"}
    assert "- upsert_tasks[0].title: a new task needs a title" in tool_result(err.value)
    assert "t9" not in tool_result(err.value).rsplit("\n", 1)[0]  # the model's id: not repeated
    assert events(db, tenant) == []


def test_the_user_removes_a_constraint_the_model_cannot(stub, ids, db):
    tenant, session = ids
    stub.Plan(plan_request(tenant, session))
    current = pb.WorkingState(constraints=["economy only", "no red-eye"],
                              constraint_trust=[pb.TRUST_LEVEL_USER, pb.TRUST_LEVEL_MEMORY])
    resp = stub.UpdateWorkingState(update(tenant, session, pb.WorkingStateTransition(
        remove_constraint=pb.RemoveConstraint(constraint="economy only", user_event_id=41)),
        current=current))
    assert list(resp.state.constraints) == ["no red-eye"]
    assert list(resp.state.constraint_trust) == [pb.TRUST_LEVEL_MEMORY]
    assert resp.change.transition == "remove_constraint" and resp.tool_result == ""
    (event,) = events(db, tenant)
    assert event["constraints_removed"] == 1 and event["user_event_id"] == 41
    assert "economy" not in json.dumps(event)

    with pytest.raises(grpc.RpcError) as err:
        stub.UpdateWorkingState(update(tenant, session, pb.WorkingStateTransition(
            remove_constraint=pb.RemoveConstraint(constraint="window seat", user_event_id=42)),
            current=resp.state))
    f = failure(err.value)
    assert f.code is grpc.StatusCode.INVALID_ARGUMENT
    assert set(f.violations) == {"transition.remove_constraint.constraint"}
    # the model's attempts: refused, or applied without removing anything
    for attempt in ({"remove_constraints": ["no red-eye"]}, {"constraints": []},
                    {"add_constraints": []}, {"resolve_questions": ["no red-eye"]}):
        try:
            out = stub.UpdateWorkingState(update(tenant, session, call(attempt),
                                                 current=resp.state))
        except grpc.RpcError as refused:
            assert failure(refused).code is grpc.StatusCode.INVALID_ARGUMENT
        else:
            assert list(out.state.constraints) == ["no red-eye"], attempt


def test_carry_applies_logged_raw_calls_and_removals_and_skips_refused_calls(stub, ids):
    tenant, session = ids
    stub.Plan(plan_request(tenant, session))

    def event(seq: int, transition: pb.WorkingStateTransition) -> pb.WorkingStateEvent:
        return pb.WorkingStateEvent(sequence=seq, run_id="run-1", transition=transition)

    resp = stub.CarryWorkingState(pb.CarryWorkingStateRequest(
        tenant_id=tenant, session_id=session, seed_event_sequence=10, events=[
            event(1, call({"objective": "Book travel",
                           "add_constraints": ["economy only", "no red-eye"],
                           "upsert_tasks": [{"id": "t1", "title": "find", "state": "open"}],
                           "next_action": "search"})),
            event(2, call({"add_constraints": ["x"], "remove_constraints": ["economy only"]},
                          call_id="toolu_02")),
            event(3, call("{not json", call_id="toolu_03")),
            event(4, pb.WorkingStateTransition(remove_constraint=pb.RemoveConstraint(
                constraint="no red-eye", user_event_id=4))),
            event(5, call({"add_facts": [{"statement": "fares rise Friday",
                                          "source_event_ids": [3]}]}, call_id="toolu_05",
                          trust=pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED)),
            event(6, pb.WorkingStateTransition(remove_constraint=pb.RemoveConstraint(
                constraint="window seat", user_event_id=6))),
        ]))
    assert (resp.events_applied, resp.events_skipped) == (3, 3)
    s = resp.state
    assert s.objective == "Book travel" and list(s.constraints) == ["economy only"]
    assert s.facts[0].trust == pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED
    assert [t.id for t in s.tasks] == ["t1"] and s.next_action == ""
    # the runtime's own mistakes in a logged call are still the request's
    with pytest.raises(grpc.RpcError) as err:
        stub.CarryWorkingState(pb.CarryWorkingStateRequest(
            tenant_id=tenant, session_id=session, seed_event_sequence=10,
            events=[event(1, call("{}", call_id=""))]))
    assert set(failure(err.value).violations) == {"events[0].transition.tool_call.call_id"}
