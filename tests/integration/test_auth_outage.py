"""Table tokens while PostgreSQL is away, on a real server and a database of its own that the
test crashes and restarts.

While it is away, a token this process read before the outage keeps working (Build serves the
plans it has cached), a token seen revoked stays refused, and a token never seen is
UNAVAILABLE, not UNAUTHENTICATED: the server cannot tell. Using stale grants is logged once.
When the database returns, every token is looked up again.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import grpc
import pytest
from context_engine.api.auth import token_sha256
from context_engine.v1 import context_engine_pb2 as pb
from context_engine.v1 import context_engine_pb2_grpc as pb_grpc

from tests.conftest import Db, ServerThread
from tests.conftest import test_config as base_config
from tests.integration.requests import build_request, failure, plan_request
from tests.integration.test_auth import bearer, debug_logs
from tests.integration.test_db_faults import Database
from tests.support.logs import Captured

pytestmark = pytest.mark.integration

CACHE_SECONDS = 0.2  # every cached lookup has expired soon after the crash


@pytest.fixture(scope="module")
def database() -> Iterator[Database]:
    db = Database()
    yield db
    db.close()


def refused(call, request, metadata) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call(request, metadata=metadata, timeout=10)
    return err.value


def test_table_tokens_ride_out_a_database_outage(database: Database) -> None:
    db = Db(database.url)
    tenant = f"tenant-{uuid.uuid4().hex[:8]}"
    session = f"s-{uuid.uuid4().hex[:8]}"
    token, revoked, unknown = (f"{kind}-{uuid.uuid4().hex}"
                               for kind in ("token", "revoked", "unknown"))
    for t in (token, revoked):
        db.fetch("INSERT INTO api_tokens (tenant_id, token_sha256, rpcs) VALUES ($1, $2, $3)",
                 tenant, token_sha256(t), ["*"])
    config = base_config().replace(dev_mode=False, auth_db_tokens=True,
                     auth_cache_seconds=CACHE_SECONDS)
    srv = ServerThread(config, database.url)
    channel = grpc.insecure_channel(srv.address)
    stub = pb_grpc.ContextEngineStub(channel)
    events = Captured()
    try:
        with debug_logs(events):
            # before: the token is read once (and its session's plan cached by Plan)
            plan = stub.Plan(plan_request(tenant, session), metadata=bearer(token), timeout=30)
            built = stub.Build(build_request(tenant, session), metadata=bearer(token), timeout=30)
            assert built.prefix_sha256 == plan.plan.prefix_sha256
            get = pb.GetPlanRequest(tenant_id=tenant, session_id=session)
            assert stub.GetPlan(get, metadata=bearer(revoked), timeout=30).plan.epoch == 1
            db.fetch("UPDATE api_tokens SET revoked_at = now() WHERE token_sha256 = $1",
                     token_sha256(revoked))
            time.sleep(CACHE_SECONDS * 2)
            f = failure(refused(stub.GetPlan, get, bearer(revoked)))
            assert f.code is grpc.StatusCode.UNAUTHENTICATED  # seen revoked

            database.crash()
            time.sleep(CACHE_SECONDS * 2)
            for _ in range(5):  # each of these looks the token up again, and fails to
                again = stub.Build(build_request(tenant, session), metadata=bearer(token),
                                   timeout=10)
                assert again.prefix_sha256 == built.prefix_sha256
                time.sleep(CACHE_SECONDS)
            # a write needs the database: authorized from the stale grant, then UNAVAILABLE
            f = failure(refused(stub.Plan, plan_request(tenant, "during-outage"), bearer(token)))
            assert (f.code, f.reason) == (grpc.StatusCode.UNAVAILABLE, "STORE_UNAVAILABLE")
            f = failure(refused(stub.Build, build_request(tenant, session), bearer(unknown)))
            assert (f.code, f.reason) == (grpc.StatusCode.UNAVAILABLE, "STORE_UNAVAILABLE")
            f = failure(refused(stub.Build, build_request(tenant, session), bearer(revoked)))
            assert (f.code, f.reason) == (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED")
            assert events.events.count("auth_stale_grants") == 1

            database.restart()
            deadline = time.monotonic() + 30
            while True:
                try:
                    after = stub.Plan(plan_request(tenant, "after-restart"),
                                      metadata=bearer(token), timeout=5)
                    break
                except grpc.RpcError as err:
                    assert err.code() is grpc.StatusCode.UNAVAILABLE, err
                    assert time.monotonic() < deadline, "the pool never recovered"
                    time.sleep(0.2)
            assert after.created
            f = failure(refused(stub.Build, build_request(tenant, session), bearer(unknown)))
            assert (f.code, f.reason) == (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED")
            f = failure(refused(stub.GetPlan, get, bearer(revoked)))
            assert f.code is grpc.StatusCode.UNAUTHENTICATED
            assert stub.Build(build_request(tenant, session), metadata=bearer(token),
                              timeout=10).prefix_sha256 == built.prefix_sha256
            assert events.events.count("auth_stale_grants") == 1
    finally:
        channel.close()
        srv.stop()
