"""Regressions found by fuzzing the API: each request below once got an answer outside the
contract (UNKNOWN, or a status the client could not read)."""

from __future__ import annotations

import grpc
import pytest
from context_engine.v1 import context_engine_pb2 as pb

from tests.integration.requests import build_request, failure, item, plan_request

pytestmark = pytest.mark.integration


def test_many_violations_still_reach_the_client_as_a_readable_status(stub, ids, db):
    """Hundreds of violations (or one echoing a huge value) once made trailers over the
    client's metadata limit: the caller saw RESOURCE_EXHAUSTED "Stream removed" and no
    status. Now the status carries the first violations and counts them all."""
    tenant, session = ids
    stub.Plan(plan_request(tenant, session))
    before = db.counts(tenant)
    items = [item(f"u{i}", i + 1, trust=0, user=pb.UserMessage(text="x")) for i in range(300)]
    with pytest.raises(grpc.RpcError) as err:
        stub.Build(build_request(tenant, session, items=items))
    f = failure(err.value)
    assert f.code is grpc.StatusCode.INVALID_ARGUMENT and f.reason == "INVALID_ARGUMENT"
    assert f.domain == "context-engine"
    assert f.metadata["violations"] == "300"
    assert "checkpoint.items[0].trust" in f.violations
    assert 0 < len(f.violations) < 300
    assert db.counts(tenant) == before


def test_a_violation_echoing_a_huge_value_is_clipped(stub, ids):
    tenant, session = ids
    stub.Plan(plan_request(tenant, session))
    req = pb.UpdateWorkingStateRequest(
        tenant_id=tenant, session_id=session, run_id="run-1", sequence=3,
        current=pb.WorkingState(tasks=[pb.WorkingTask(id="t", title="x", state="z" * 200_000)]),
        transition=pb.WorkingStateTransition(ask_user=pb.AskUser(question="Which?")))
    with pytest.raises(grpc.RpcError) as err:
        stub.UpdateWorkingState(req)
    f = failure(err.value)
    assert f.code is grpc.StatusCode.INVALID_ARGUMENT
    assert len(f.violations["current.tasks[0].state"].encode()) <= 160
    assert len(f.message.encode()) <= 400
