"""Regressions found by fuzzing the API: each request below once got an answer outside the
contract (UNKNOWN, or a status the client could not read)."""

from __future__ import annotations

import grpc
import pytest
from context_engine.v1 import context_engine_pb2 as pb

from tests.integration.requests import build_request, failure, item, plan_request
from tests.support import fuzz

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


@pytest.mark.parametrize("payload", [
    b"\xff\xff\xff",                                      # corrupt wire format
    fuzz.length_delimited(1, b"\xc3\x28"),                # tenant_id with invalid UTF-8
    fuzz.tag(1, 2) + fuzz.varint(2**32 + 5) + b"x",       # a length past the end
    fuzz.nested_groups(5000),                             # nesting past the parser's limit
], ids=["corrupt", "invalid-utf8", "overlong-length", "deep-groups"])
@pytest.mark.parametrize("rpc", fuzz.RPCS)
def test_undecodable_request_is_invalid_argument(channel, rpc, payload):
    """gRPC answers a request that does not decode with UNKNOWN and the parser's exception
    name; the service answers INVALID_ARGUMENT with its ErrorInfo."""
    call = channel.unary_unary(fuzz.path(rpc), request_serializer=lambda b: b,
                               response_deserializer=fuzz.METHODS[rpc][1].FromString)
    with pytest.raises(grpc.RpcError) as err:
        call(payload, timeout=30)
    f = failure(err.value)
    assert f.code is grpc.StatusCode.INVALID_ARGUMENT, (f.code, f.message)
    assert f.reason == "INVALID_ARGUMENT" and f.domain == "context-engine"
    assert "request" in f.violations
