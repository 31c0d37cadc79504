"""A Build refused before its plan is read (an epoch out of range) keeps nothing of what it
sent: sent for a session erased meanwhile, no lookup would find it erased and drop it."""

from __future__ import annotations

import grpc
import pytest
from context_engine.api.mapping import MAX_EPOCH
from context_engine.domain.canonical import session_key
from context_engine.v1 import context_engine_pb2 as pb
from context_engine.v1 import context_engine_pb2_grpc as pb_grpc

from tests.conftest import ServerThread
from tests.integration.requests import build_request, failure, plan_request

pytestmark = pytest.mark.integration
TENANT = "t-refused-memo"


@pytest.mark.parametrize(("epoch", "code"), [(0, grpc.StatusCode.NOT_FOUND),
                                             (MAX_EPOCH + 1, grpc.StatusCode.INVALID_ARGUMENT)])
def test_a_refused_build_of_an_erased_session_keeps_nothing(server: ServerThread, epoch: int,
                                                            code: grpc.StatusCode) -> None:
    session = f"erased-then-built-{epoch}"
    memo, key = server.running.engine.render_memo, session_key(TENANT, session)
    with grpc.insecure_channel(server.address) as ch:
        stub = pb_grpc.ContextEngineStub(ch)
        stub.Plan(plan_request(TENANT, session), timeout=30)
        stub.Build(build_request(TENANT, session), timeout=30)
        stub.DeleteSession(pb.DeleteSessionRequest(tenant_id=TENANT, session_id=session),
                           timeout=30)
        assert not any(k[0] == key for k in memo)
        with pytest.raises(grpc.RpcError) as err:
            stub.Build(build_request(TENANT, session, epoch=epoch), timeout=30)
        assert failure(err.value).code is code
    held = [k[1:] for k in memo if k[0] == key]
    assert not held, f"the erased session's key holds {len(held)} memo entries: {held}"


def test_a_build_refused_before_its_plan_is_read_leaves_the_sessions_renderings(
        server: ServerThread) -> None:
    """A Build refused before it reads its plan rendered nothing: what the session's earlier
    Builds keep in the memo, and the incarnation they are of, stay for its next Build."""
    session = "built-then-refused"
    memo, key = server.running.engine.render_memo, session_key(TENANT, session)
    with grpc.insecure_channel(server.address) as ch:
        stub = pb_grpc.ContextEngineStub(ch)
        stub.Plan(plan_request(TENANT, session), timeout=30)
        stub.Build(build_request(TENANT, session), timeout=30)
        kept = {k for k in memo if k[0] == key}
        assert kept and memo.incarnation(key) is not None
        with pytest.raises(grpc.RpcError) as err:
            stub.Build(build_request(TENANT, session, epoch=MAX_EPOCH + 1), timeout=30)
        assert failure(err.value).code is grpc.StatusCode.INVALID_ARGUMENT
    assert {k for k in memo if k[0] == key} == kept
    assert memo.incarnation(key) is not None
