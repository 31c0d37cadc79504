"""The health watch behind a real PgBouncer (transaction pooling) whose server connections are
all busy, under a real server and a real PostgreSQL of the test's own: the service's pooled
connections are free, but their ``SELECT 1`` waits in PgBouncer's queue and answers late. A late
answer on a database that lets a connection in is busy, not away, on a pooled connection as on
the probe's own outside the pool: health stays SERVING with no plan cached (away would be
NOT_SERVING). The probe used to read the pooled late answer as the database away: NOT_SERVING
2.6 s in, for as long as ``pg_sleep`` held PgBouncer's server connections."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import asyncpg
import pytest
from context_engine.api.server import database_reachable
from context_engine.config import Pooler
from grpc_health.v1 import health_pb2

from tests.conftest import ServerThread
from tests.conftest import test_config as base_config
from tests.integration.test_db_faults import Database
from tests.integration.test_health_saturated_pool import health
from tests.support.pgbouncer import PgBouncer

pytestmark = pytest.mark.integration

SERVER_CONNECTIONS = 2  # PgBouncer's, fewer than the service's pool
HELD = 15.0  # seconds each is held in pg_sleep: the probe, 4 s of watching, and slack


@pytest.fixture(scope="module")
def bouncer() -> Iterator[PgBouncer]:
    db = Database()
    with PgBouncer(db.url, pool_mode="transaction",
                   default_pool_size=SERVER_CONNECTIONS) as pooler:
        yield pooler
    db.close()


@pytest.fixture
def server(bouncer: PgBouncer) -> Iterator[ServerThread]:
    srv = ServerThread(base_config().replace(db_pooler=Pooler.TRANSACTION,
                                             db_pool_size=2 * SERVER_CONNECTIONS), bouncer.url)
    yield srv
    srv.stop()


async def _hold(url: str) -> None:
    connection = await asyncpg.connect(url, statement_cache_size=0)
    try:
        await connection.execute(f"SELECT pg_sleep({HELD})", timeout=HELD + 30)
    finally:
        await connection.close()


def _taken(bouncer: PgBouncer) -> int:
    return sum(int(row["sv_active"] or 0) for row in bouncer.pools())


def test_a_pooler_with_every_server_connection_busy_is_busy_not_away(
        bouncer: PgBouncer, server: ServerThread) -> None:
    assert len(server.running.engine.cache) == 0  # nothing cached: NOT_SERVING when away
    held = [asyncio.run_coroutine_threadsafe(_hold(bouncer.url), server.loop)
            for _ in range(SERVER_CONNECTIONS)]
    deadline = time.monotonic() + 10
    while _taken(bouncer) < SERVER_CONNECTIONS:
        assert time.monotonic() < deadline, "PgBouncer's server connections not taken"
        time.sleep(0.05)
    started = time.monotonic()
    reachable = server.call(database_reachable(server.running.pool, 1.0, server.running.probe))
    took = time.monotonic() - started
    assert reachable is None, f"the probe answered {reachable} in {took:.2f} s"
    # the pooled answer and its release, the outside connection's answer and close: 4 bounds
    assert took < 6.0, took
    watched = time.monotonic() + 4.0  # the watch probes every second meanwhile
    statuses = set()
    while time.monotonic() < watched:
        statuses.add(health(server))
        time.sleep(0.1)
    assert statuses == {health_pb2.HealthCheckResponse.SERVING}, statuses
    assert not any(h.done() for h in held), "PgBouncer's server connections freed too early"
    for h in held:
        h.result(HELD + 30)
