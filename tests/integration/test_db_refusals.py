"""A database that answers but refuses the call, under a real server and a real PostgreSQL of
the test's own: every write answers ``UNAVAILABLE`` with ``STORE_UNAVAILABLE`` (which the
clients retry) and changes nothing, a ``Build`` of a cached plan keeps serving, and the service
recovers by itself when the database takes calls again.

Each fault is one the database's operator or a failover causes, made for real (no mock of the
database): the database refusing connections (``ALLOW_CONNECTIONS false``: SQLSTATE 55000 while
connecting), a read-only database (a standby after a failover: 25006 on the first write),
``pg_hba.conf`` rejecting the service (28000 while connecting), and a statement cancelled by
the server (``statement_timeout``, 57014: operator intervention). Each answered INTERNAL
('internal error') before, which the clients never retry, and a Build of a cached plan failed
while the pool could not connect.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import asyncpg
import grpc
import pytest
from context_engine.v1 import context_engine_pb2 as pb
from context_engine.v1 import context_engine_pb2_grpc as pb_grpc

from tests.conftest import Db, ServerThread, run
from tests.conftest import test_config as base_config
from tests.integration.requests import build_request, failure, plan_request
from tests.integration.test_db_faults import Database

pytestmark = pytest.mark.integration

# every backend of the service's database but the caller's: the pool connects again
TERMINATE = ("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
             "WHERE datname = 'postgres' AND pid <> pg_backend_pid()")


@pytest.fixture(scope="module")
def database() -> Iterator[Database]:
    db = Database()
    yield db
    db.close()


@pytest.fixture(scope="module")
def server(database: Database) -> Iterator[ServerThread]:
    srv = ServerThread(base_config().replace(db_timeout_seconds=5.0), database.url)
    yield srv
    srv.stop()


def admin(database: Database, *sqls: str, db: str = "template1") -> None:
    """Statements run by the database's operator (on ``template1``: the service's database,
    ``postgres``, may be refusing connections)."""
    async def go() -> None:
        conn = await asyncpg.connect(database.url.replace("/postgres?", f"/{db}?"))
        try:
            for sql in sqls:
                await conn.execute(sql)
        finally:
            await conn.close()

    run(go())


def hba_path(database: Database) -> Path:
    return Path(database.server.pgdata) / "pg_hba.conf"


def unavailable(call: Callable[[], object], sqlstate: str, tries: int = 3) -> None:
    """``call`` answers UNAVAILABLE / STORE_UNAVAILABLE naming ``sqlstate``; the first tries
    may instead meet the pool's connections the operator terminated (also unavailable)."""
    for attempt in range(tries):
        with pytest.raises(grpc.RpcError) as info:
            call()
        got = failure(info.value)
        assert (got.code, got.reason, got.domain) == (
            grpc.StatusCode.UNAVAILABLE, "STORE_UNAVAILABLE", "context-engine"), got
        if sqlstate in got.message:
            assert got.metadata.get("sqlstate") == sqlstate, got.metadata
            assert got.metadata.get("cause"), got.metadata
            return
        assert attempt + 1 < tries, f"never answered for SQLSTATE {sqlstate}: {got.message}"


def counts(database: Database, tenant: str) -> dict[str, int]:
    db = Db(database.url)
    return {**db.counts(tenant), "keys": int(db.val(
        "SELECT count(*) FROM idempotency_keys WHERE tenant_id = $1", tenant))}


def scenario(server: ServerThread, database: Database, sqlstate: str,
             fault: Callable[[], None], repair: Callable[[], None]) -> None:
    """A cached session, the fault, the calls under it, the repair, recovery."""
    tenant, session = f"tenant-{uuid.uuid4().hex[:8]}", "cached"
    stub = pb_grpc.ContextEngineStub(grpc.insecure_channel(server.address))
    stub.Plan(plan_request(tenant, session), timeout=30)
    first = stub.Build(build_request(tenant, session), timeout=30)
    before = counts(database, tenant)
    fault()
    try:
        unavailable(lambda: stub.Plan(plan_request(tenant, "new"), timeout=30), sqlstate)
        unavailable(lambda: stub.Rotate(pb.RotateRequest(
            tenant_id=tenant, session_id=session, reason=pb.ROTATION_REASON_OPERATOR,
            idempotency_key="rotate-1"), timeout=30), sqlstate)
        unavailable(lambda: stub.ReportUsage(pb.ReportUsageRequest(
            tenant_id=tenant, session_id=session, idempotency_key="usage-1",
            estimated_input_tokens=100, input_tokens=100, estimator_factor=1.0), timeout=30),
            sqlstate)
        unavailable(lambda: stub.DeleteSession(pb.DeleteSessionRequest(
            tenant_id=tenant, session_id=session), timeout=30), sqlstate)
        # the promise of DESIGN and the README: a Build of a cached plan keeps serving
        again = stub.Build(build_request(tenant, session), timeout=30)
        assert (again.epoch, again.prefix_sha256) == (first.epoch, first.prefix_sha256)
    finally:
        repair()
    deadline = time.monotonic() + 30
    while True:  # the pool connects again by itself
        try:
            stub.GetPlan(pb.GetPlanRequest(tenant_id=tenant, session_id=session), timeout=10)
            break
        except grpc.RpcError:
            assert time.monotonic() < deadline, "the service did not recover"
            time.sleep(0.2)
    assert counts(database, tenant) == before  # nothing the refused calls did was kept
    assert stub.Plan(plan_request(tenant, "new"), timeout=30).created


def test_a_database_refusing_connections_is_unavailable(server: ServerThread,
                                                        database: Database) -> None:
    """ALLOW_CONNECTIONS false: 55000 (object not in prerequisite state) while connecting."""
    scenario(server, database, "55000",
             lambda: admin(database, "ALTER DATABASE postgres ALLOW_CONNECTIONS false",
                           TERMINATE),
             lambda: admin(database, "ALTER DATABASE postgres ALLOW_CONNECTIONS true"))


def test_a_read_only_database_is_unavailable_to_writes(server: ServerThread,
                                                       database: Database) -> None:
    """The service reaches a read-only server (a standby after a failover, here
    default_transaction_read_only): 25006 on the first write; reads still answer."""
    scenario(server, database, "25006",
             lambda: admin(database, "ALTER DATABASE postgres "
                                     "SET default_transaction_read_only = on", TERMINATE),
             lambda: admin(database, "ALTER DATABASE postgres RESET default_transaction_read_only",
                           TERMINATE))


def test_a_connection_pg_hba_rejects_is_unavailable(server: ServerThread,
                                                    database: Database) -> None:
    """pg_hba.conf 'reject' for the service's database: 28000 while connecting."""
    path = hba_path(database)
    original = path.read_text()

    def fault() -> None:
        path.write_text("local postgres all reject\nhost postgres all all reject\n" + original)
        admin(database, "SELECT pg_reload_conf()")
        time.sleep(0.3)  # the postmaster reloads it on SIGHUP
        admin(database, TERMINATE)

    def repair() -> None:
        path.write_text(original)
        admin(database, "SELECT pg_reload_conf()")
        time.sleep(0.3)

    scenario(server, database, "28000", fault, repair)


def test_a_statement_the_server_cancels_is_unavailable(server: ServerThread,
                                                       database: Database) -> None:
    """The server cancels a statement (statement_timeout, while the operator holds the tables
    the calls need): 57014, operator intervention; connecting is never refused."""
    loop = asyncio.new_event_loop()  # the operator's connection lives on one loop
    holder: list[asyncpg.Connection] = []

    async def hold() -> None:
        conn = await asyncpg.connect(database.url)
        holder.append(conn)
        await conn.execute("SET statement_timeout = 0")
        await conn.execute("BEGIN")
        await conn.execute("LOCK TABLE sessions, plans, idempotency_keys, estimator_calibration, "
                           "epoch_usage IN ACCESS EXCLUSIVE MODE")

    async def release() -> None:
        for conn in holder:
            await conn.close()

    def fault() -> None:
        admin(database, "ALTER DATABASE postgres SET statement_timeout = '300ms'", TERMINATE)
        loop.run_until_complete(hold())

    def repair() -> None:
        loop.run_until_complete(release())
        admin(database, "ALTER DATABASE postgres RESET statement_timeout", TERMINATE)

    try:
        scenario(server, database, "57014", fault, repair)
    finally:
        loop.close()


def test_a_cached_build_keeps_the_factor_its_replica_reconciled_while_the_database_is_away(
        server: ServerThread, database: Database) -> None:
    """A replica that reconciled a report knows the factor it wrote: a Build of a cached plan
    while the database refuses connections uses it, as PostgreSQL holds it, not 1.0 (which
    under-counts the request the report showed was under-counted: the provider's overflow the
    factor exists to prevent). The report used to drop the replica's copy of the factor, so
    the next Build, its read refused, fell back to 1.0."""
    tenant, session = f"tenant-{uuid.uuid4().hex[:8]}", "reported"
    stub = pb_grpc.ContextEngineStub(grpc.insecure_channel(server.address))
    stub.Plan(plan_request(tenant, session), timeout=30)  # Claude: the factor scales it all
    first = stub.Build(build_request(tenant, session), timeout=30)
    assert first.estimator_factor == 1.0
    stub.ReportUsage(pb.ReportUsageRequest(
        tenant_id=tenant, session_id=session, epoch=first.epoch, idempotency_key="usage-1",
        estimated_input_tokens=first.estimated_input_tokens, estimator_factor=1.0,
        input_tokens=2 * first.estimated_input_tokens), timeout=30)
    stored = float(Db(database.url).val(
        "SELECT factor FROM estimator_calibration WHERE tenant_id = $1", tenant))
    assert stored == 2.0
    admin(database, "ALTER DATABASE postgres ALLOW_CONNECTIONS false", TERMINATE)
    try:
        during = stub.Build(build_request(tenant, session), timeout=30)
    finally:
        admin(database, "ALTER DATABASE postgres ALLOW_CONNECTIONS true")
    assert during.estimator_factor == stored
    assert during.estimated_input_tokens > first.estimated_input_tokens
