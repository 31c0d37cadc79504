"""A call of the store waits for a connection of the pool at most ``CE_DB_TIMEOUT_SECONDS``
(README, "Pool sizes"): past it, ``UNAVAILABLE`` (``STORE_UNAVAILABLE``), which the clients
retry. The store's reads went through ``pool.fetchrow``, whose acquire asyncpg leaves unbounded
(only the query took the timeout): with every connection taken, a GetPlan waited until its
caller's deadline and ended ``DEADLINE_EXCEEDED``, with no status."""

from __future__ import annotations

import time
import uuid

import grpc
import pytest
from context_engine.v1 import context_engine_pb2 as pb
from context_engine.v1 import context_engine_pb2_grpc as pb_grpc

from tests.conftest import ServerThread
from tests.conftest import test_config as base_config
from tests.integration.requests import build_request, failure, plan_request
from tests.integration.test_budget_rpc import SMALL, long_history
from tests.support.pool import every_connection_taken

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("epoch", [0, 1], ids=["current", "by_epoch"])
def test_a_read_waits_for_a_connection_at_most_the_database_timeout(database_url: str,
                                                                    epoch: int) -> None:
    timeout, size = 1.0, 2
    server = ServerThread(base_config().replace(db_pool_size=size, db_timeout_seconds=timeout),
                          database_url)
    try:
        with every_connection_taken(server, size):
            request = pb.GetPlanRequest(tenant_id=f"tenant-{uuid.uuid4().hex[:10]}",
                                        session_id="never-planned", epoch=epoch)
            with grpc.insecure_channel(server.address) as channel:
                sent = time.perf_counter()
                with pytest.raises(grpc.RpcError) as err:
                    pb_grpc.ContextEngineStub(channel).GetPlan(request, timeout=10 * timeout)
                waited = time.perf_counter() - sent
            f = failure(err.value)
            assert (f.code, f.reason) == (grpc.StatusCode.UNAVAILABLE, "STORE_UNAVAILABLE"), (
                f.code, f.reason, waited)
            assert 0.9 * timeout <= waited < 5 * timeout, waited
    finally:
        server.stop()


def test_an_event_waits_for_a_connection_at_most_the_database_timeout(database_url: str,
                                                                      db) -> None:
    """A Build that yields writes its pressure event, and UpdateWorkingState its transition:
    with every connection taken, each waits for one at most CE_DB_TIMEOUT_SECONDS, then hands
    the event to the outbox and answers (the write went through ``pool.fetchval``/``execute``,
    whose acquire asyncpg leaves unbounded: both waited out their caller's deadline). The
    outbox writes them once a connection is free."""
    timeout, size = 1.0, 2
    server = ServerThread(base_config().replace(db_pool_size=size, db_timeout_seconds=timeout),
                          database_url)
    tenant, session = f"tenant-{uuid.uuid4().hex[:10]}", "s1"
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.ContextEngineStub(channel)
            epoch = stub.Plan(plan_request(tenant, session, model=SMALL)).plan.epoch
            build = build_request(tenant, session, items=long_history(40), epoch=epoch)
            build.estimator_factor = 1.3
            assert stub.Build(build, timeout=30).pressure.steps  # it yields: an event
            update = pb.UpdateWorkingStateRequest(
                tenant_id=tenant, session_id=session, run_id="run-1", sequence=10,
                transition=pb.WorkingStateTransition(
                    update=pb.WorkingStateUpdate(next_action="go")))
            events_before = db.val("SELECT count(*) FROM context_events WHERE tenant_id = $1",
                                   tenant)
            with every_connection_taken(server, size):
                for call in (lambda: stub.Build(build, timeout=10 * timeout),
                             lambda: stub.UpdateWorkingState(update, timeout=10 * timeout)):
                    sent = time.perf_counter()
                    call()
                    waited = time.perf_counter() - sent
                    assert 0.9 * timeout <= waited < 5 * timeout, waited
                assert server.running.events.pending == 2
                assert db.val("SELECT count(*) FROM context_events WHERE tenant_id = $1",
                              tenant) == events_before
            deadline = time.monotonic() + 30
            while server.running.events.pending and time.monotonic() < deadline:
                time.sleep(0.1)
            assert server.running.events.pending == 0
            assert db.val("SELECT count(*) FROM context_events WHERE tenant_id = $1",
                          tenant) == events_before + 2
    finally:
        server.stop()
