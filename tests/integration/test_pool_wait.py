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
from tests.integration.requests import failure
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
