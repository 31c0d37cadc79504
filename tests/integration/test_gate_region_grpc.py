"""Hard gate: Region B inputs never change prefix_sha256, over the real gRPC server.

The in-process gate (tests/property/test_gate_region.py) cannot fail on its own: build() always
returns the loaded plan's rendered prefix. Here the prefix the caller receives is compared with
the one Plan returned, across generated Builds of the same session (the date, recall lines,
corrections, working state, knowledge passages, conversation items and trailing user input all
varying), across an idempotent re-Plan, and after the server's plan cache is dropped so the
plan is read back from PostgreSQL.
"""

from __future__ import annotations

import json
import uuid

import grpc
import pytest
from context_engine.v1 import context_engine_pb2 as pb
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

from tests.integration.requests import build_request, failure, plan_request
from tests.property import strategies as S

pytestmark = [pytest.mark.gate_region, pytest.mark.integration]

GATE_SETTINGS = settings(max_examples=25, deadline=None, derandomize=True, database=None,
                         suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                HealthCheck.too_slow,
                                                HealthCheck.data_too_large])

RUN = "run-1"
# Trust a caller may give checkpoint content (never UNSPECIFIED, never PLATFORM).
DATA_TRUST = (pb.TRUST_LEVEL_TRUSTED_CONFIGURATION, pb.TRUST_LEVEL_USER, pb.TRUST_LEVEL_MEMORY,
              pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED)
CALL_NAMES = ("web.fetch", "clock.now", "tool.call", "files.read")
TASK_STATES = ("open", "in_progress", "blocked", "completed")


def texts(max_parts: int = 2) -> st.SearchStrategy[str]:
    """The property strategies' tricky text, without NUL (PostgreSQL text cannot hold it and
    the API rejects it before storage)."""
    return S.texts(max_parts=max_parts).map(lambda s: s.replace("\x00", ""))


ids_ = S.safe_names
trusts = st.sampled_from(DATA_TRUST)
# A working-state fact's label: at most USER.
labels = st.sampled_from(DATA_TRUST[1:])
date_texts = st.one_of(S.dates, S.dates, st.just(""),
                       st.datetimes().map(lambda d: d.strftime("%A, %d %B %Y")))
arguments_json = st.builds(
    lambda value, ascii_: json.dumps(value, ensure_ascii=ascii_),
    st.dictionaries(ids_, st.none() | st.booleans() | st.integers(-999, 999) | texts(1),
                    max_size=3),
    st.booleans())

recall_lines = st.lists(st.builds(pb.RecallLine, id=ids_, text=texts()), max_size=3)
correction_lines = st.lists(st.builds(pb.CorrectionLine, id=ids_, text=texts()), max_size=3)
knowledge = st.lists(
    st.builds(pb.KnowledgePassage, id=ids_, source=st.sampled_from(("kb", "docs", "wiki:\u00e9")),
              text=texts(), rank=st.integers(0, 5), trust=trusts),
    max_size=3, unique_by=lambda p: p.id)
# Small enough to stay well under the working state's 1,000-token cap.
working_states = st.one_of(
    st.just(pb.WorkingState()),
    st.builds(
        pb.WorkingState,
        objective=texts(1),
        # a constraint holds text (one of white space alone is refused, as an update's is)
        constraints=st.lists(texts(1).filter(str.strip), max_size=2),
        # a task id once (a state naming one twice is refused, as no state the service writes)
        tasks=st.lists(st.builds(pb.WorkingTask, id=ids_, title=texts(1),
                                 state=st.sampled_from(TASK_STATES)), max_size=2,
                       unique_by=lambda t: t.id),
        facts=st.lists(st.builds(pb.WorkingFact, statement=texts(1),
                                 source_event_ids=st.lists(st.integers(1, 10**6), max_size=3),
                                 trust=labels), max_size=2),
        open_questions=st.lists(texts(1), max_size=1),
        next_action=texts(1)))


@st.composite
def conversations(draw: st.DrawFn) -> list[pb.ConversationItem]:
    """Items of one run, oldest first: user messages, assistant text and tool calls, each call
    answered (results in any order), then zero to two trailing user messages."""
    items: list[pb.ConversationItem] = []
    seq = draw(st.integers(0, 1000))
    calls_made = 0

    def add(trust: int, **kind: object) -> None:
        nonlocal seq
        seq += 1
        items.append(pb.ConversationItem(id=f"item-{len(items) + 1}", sequence=seq, run_id=RUN,
                                         trust=trust, **kind))  # type: ignore[arg-type]

    for _ in range(draw(st.integers(0, 3))):
        add(pb.TRUST_LEVEL_USER, user=pb.UserMessage(text=draw(texts())))
        for _ in range(draw(st.integers(0, 3))):
            if draw(st.booleans()):
                add(pb.TRUST_LEVEL_USER, assistant=pb.AssistantMessage(text=draw(texts())))
                continue
            calls = []
            for _ in range(draw(st.integers(1, 2))):
                calls_made += 1
                calls.append(pb.ToolCall(call_id=f"call-{calls_made}",
                                         name=draw(st.sampled_from(CALL_NAMES)),
                                         arguments_json=draw(arguments_json)))
            add(pb.TRUST_LEVEL_USER, tool_calls=pb.ToolCalls(calls=calls))
            for c in draw(st.permutations(calls)):
                add(pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED, tool_result=pb.ToolResult(
                    call_id=c.call_id, tool_name=c.name, content=draw(texts()),
                    artifact_ref=draw(st.sampled_from(("", "artifact://a/1")))))
    for _ in range(draw(st.integers(0, 2))):  # trailing user input, not yet answered
        add(pb.TRUST_LEVEL_USER, user=pb.UserMessage(text=draw(texts())))
    return items


checkpoints = st.builds(
    pb.Checkpoint,
    active_run_id=st.just(RUN),  # every item is in RUN, so the last one is too
    items=conversations(), working_state=working_states, recall=recall_lines,
    corrections=correction_lines, knowledge=knowledge,
    runtime=st.builds(pb.RuntimeMetadata, current_date=date_texts,
                      surface=st.sampled_from(("", "web", "slack", "cli"))))


def _build(stub, tenant: str, session: str, cp: pb.Checkpoint) -> pb.BuildResponse:
    try:
        return stub.Build(pb.BuildRequest(tenant_id=tenant, session_id=session, checkpoint=cp))
    except grpc.RpcError as err:
        if failure(err).reason == "BUDGET_EXCEEDED":
            reject()  # a never-yield class that cannot fit: the request's failure, not the gate's
        raise


def _assert_plan_prefix(resp: pb.BuildResponse, plan: pb.ContextPlan) -> None:
    assert resp.prefix_sha256 == plan.prefix_sha256
    assert list(resp.request.prefix_blocks) == list(plan.prefix_blocks)
    assert list(resp.request.tools) == list(plan.tools)


@GATE_SETTINGS
@given(instructions=texts(), builds=st.lists(checkpoints, min_size=2, max_size=4))
def test_region_b_never_moves_the_prefix_over_grpc(server, stub, ids, instructions, builds):
    tenant, base = ids
    session = f"{base}-{uuid.uuid4().hex[:8]}"  # one fresh session per example
    agent = pb.AgentSpec(agent_id="helper", version="7",
                         instructions=f"You are a helpful agent. {instructions}",
                         enabled_tools=["web.fetch"], deferred_tools=["mail.send"],
                         enables_tool_call=True)
    request = plan_request(tenant, session, agent=agent)
    opened = stub.Plan(request)
    assert opened.created
    plan = opened.plan

    for cp in builds:
        resp = _build(stub, tenant, session, cp)
        _assert_plan_prefix(resp, plan)
        # Region B did reach the request: the date, when given, is rendered in the body.
        if cp.runtime.current_date:
            assert any(cp.runtime.current_date in m.text for m in resp.request.messages)

    again = stub.Plan(request)
    assert not again.created
    assert again.plan.epoch == plan.epoch and again.plan.prefix_sha256 == plan.prefix_sha256

    server.running.engine.cache.clear()  # read back from PostgreSQL and re-verified
    got = stub.GetPlan(pb.GetPlanRequest(tenant_id=tenant, session_id=session)).plan
    assert got.prefix_sha256 == plan.prefix_sha256
    assert got.prefix_blocks == plan.prefix_blocks and got.tools == plan.tools
    server.running.engine.cache.clear()
    _assert_plan_prefix(_build(stub, tenant, session, builds[-1]), plan)


def test_other_instructions_give_another_prefix(stub, ids):
    """Region A does move the hash: the gate above is not comparing a constant."""
    tenant, session = ids
    first = stub.Plan(plan_request(tenant, session)).plan
    agent = pb.AgentSpec(agent_id="helper", version="7",
                         instructions="You are a terse agent. Never cite sources.",
                         enabled_tools=["web.fetch"], deferred_tools=["mail.send"],
                         enables_tool_call=True)
    other = stub.Plan(plan_request(tenant, f"{session}-other", agent=agent)).plan
    assert other.prefix_sha256 != first.prefix_sha256
    assert other.prefix_blocks != first.prefix_blocks
    resp = stub.Build(build_request(tenant, f"{session}-other"))
    assert resp.prefix_sha256 == other.prefix_sha256
    assert list(resp.request.prefix_blocks) == list(other.prefix_blocks)
