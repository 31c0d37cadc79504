"""A Build refused once its request is assembled (the asked format cannot carry an item, or the
response is over the send limit) writes nothing: not the run's snapshot binding, not the
pressure event its yields would have recorded. The same Build, answered, writes both."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from context_engine.v1 import context_engine_pb2 as pb
from context_engine.v1 import context_engine_pb2_grpc as pb_grpc

from tests.conftest import ServerThread
from tests.conftest import test_config as base_config
from tests.integration.requests import build_request, failure, item, plan_request
from tests.integration.test_budget_rpc import SMALL, long_history

pytestmark = pytest.mark.integration

SNAPSHOT = pb.MemorySnapshot(snapshot_id="snap-1", recall_trace_id="trace-1", watermark=5,
                             items=[pb.MemoryItem(id="m1", text="Prefers tea.")])


def written(db, tenant: str) -> dict[str, object]:
    return {
        "events": [r["type"] for r in db.fetch(
            "SELECT type FROM context_events WHERE tenant_id = $1 ORDER BY id", tenant)],
        "keys": [r["rpc"] for r in db.fetch(
            "SELECT rpc FROM idempotency_keys WHERE tenant_id = $1", tenant)],
    }


def pressured(tenant: str, session: str, call_id: str) -> pb.BuildRequest:
    """Forty earlier fetches that must yield, then a run whose call has ``call_id``."""
    items = long_history(40)
    seq = items[-1].sequence
    items += [item("cA", seq + 1, run="run-1", tool_calls=pb.ToolCalls(calls=[pb.ToolCall(
                  call_id=call_id, name="web.fetch", arguments_json='{"url":"https://e.x"}')])),
              item("rA", seq + 2, pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED, run="run-1",
                   tool_result=pb.ToolResult(call_id=call_id, tool_name="web.fetch",
                                             content="page"))]
    return build_request(tenant, session, items=items)


def test_a_build_its_format_cannot_carry_writes_nothing(stub, ids, db):
    tenant, session = ids
    stub.Plan(plan_request(tenant, session, model=SMALL, memory_snapshot=SNAPSHOT))
    before = written(db, tenant)
    assert before == {"events": ["context.plan.created"], "keys": []}
    refused = pressured(tenant, session, "call.1")  # Anthropic's ids are [a-zA-Z0-9_-]
    refused.provider_format = pb.PROVIDER_FORMAT_ANTHROPIC_MESSAGES
    with pytest.raises(grpc.RpcError) as info:
        stub.Build(refused)
    f = failure(info.value)
    assert (f.code, f.reason) == (grpc.StatusCode.INVALID_ARGUMENT,
                                  "PROVIDER_FORMAT_UNRENDERABLE")
    assert written(db, tenant) == before
    # the same checkpoint in a format that carries the id: bound, and its pressure recorded
    served = pressured(tenant, session, "call.1")
    served.provider_format = pb.PROVIDER_FORMAT_OPENAI_CHAT_COMPLETIONS
    resp = stub.Build(served)
    assert resp.pressure.steps
    assert written(db, tenant) == {
        "events": ["context.plan.created", "context.snapshot.used", "context.budget.pressure"],
        "keys": ["context.snapshot.used"]}


@pytest.fixture(scope="module")
def small_sends(database_url: str) -> Iterator[pb_grpc.ContextEngineStub]:
    srv = ServerThread(base_config().replace(max_send_bytes=48 * 1024), database_url)
    channel = grpc.insecure_channel(srv.address)
    yield pb_grpc.ContextEngineStub(channel)
    channel.close()
    srv.stop()


def test_a_build_whose_response_is_too_large_writes_nothing(small_sends, ids, db):
    tenant, session = ids
    small_sends.Plan(plan_request(tenant, session, model=SMALL, memory_snapshot=SNAPSHOT))
    before = written(db, tenant)
    whole = pressured(tenant, session, "k-1")  # the request (37 KB), and a body repeating it
    whole.provider_format = pb.PROVIDER_FORMAT_OPENAI_CHAT_COMPLETIONS
    with pytest.raises(grpc.RpcError) as info:
        small_sends.Build(whole)
    assert failure(info.value).reason == "RESPONSE_TOO_LARGE"
    assert written(db, tenant) == before
    lean = pressured(tenant, session, "k-1")
    lean.provider_format = pb.PROVIDER_FORMAT_NONE
    assert small_sends.Build(lean).pressure.steps
    assert written(db, tenant)["events"] == [
        "context.plan.created", "context.snapshot.used", "context.budget.pressure"]
