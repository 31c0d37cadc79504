"""The service behind a real PgBouncer (1.18: no tracking of protocol-level prepared statements).

- The suite's ``database_url`` really is the pooler, in transaction mode, and the suite's
  servers' statements really go through it; one client's consecutive statements run on
  different backends there.
- With ``CE_DB_POOLER=transaction`` the service's pools run 1,800 statements and transactions
  from 30 clients over two server connections, every answer the right one, and leave no
  prepared statement behind; the same load with the statement cache on fails (the control that
  shows the load would find the problem), and through a pooler in session mode the cache is
  fine.
- Two servers behind one small transaction pool: concurrent Plans of one session make exactly
  one epoch, every call answered.
- Concurrent migrators through the pooler apply each migration once and leave no lock behind;
  ``migrate(target=N)`` stops at N.
- ``CE_DB_TIMEOUT_SECONDS`` holds through the pooler (the cancel reaches PostgreSQL); a pool
  sends nothing but the service's statements (no reset query); the pooler refuses start-up
  settings it does not track; statement mode refuses the service's transactions.
"""

from __future__ import annotations

import asyncio
import collections
import os
import threading
import time
import uuid
from collections.abc import Iterator

import asyncpg
import grpc
import pytest
from context_engine.adapters.postgres.migrate import discover, migrate
from context_engine.adapters.postgres.pool import create_pool
from context_engine.config import Config, Pooler
from context_engine.v1 import context_engine_pb2_grpc as pb_grpc

from tests.conftest import REPO, ServerThread
from tests.conftest import test_config as base_config
from tests.integration.requests import build_request, plan_request
from tests.support.databases import create_database, drop_database, with_database
from tests.support.pgbouncer import PgBouncer

pytestmark = pytest.mark.integration

# Clients and statements of the hammer: far more clients than server connections.
POOLS, POOL_SIZE, TASKS, STATEMENTS = 3, 10, 30, 60


def pooler_of(env: dict[str, str]) -> Pooler:
    """What a server started with ``env`` uses (the variable as ``serve`` reads it)."""
    return Config.from_env(env).db_pooler


@pytest.fixture
def small_pooler(direct_database_url: str) -> Iterator[PgBouncer]:
    """A PgBouncer of this test's own in transaction mode with two server connections."""
    with PgBouncer(direct_database_url, pool_mode="transaction", default_pool_size=2) as b:
        yield b


async def hammer(url: str, pooler: Pooler) -> tuple[int, collections.Counter[str]]:
    """``TASKS`` tasks on ``POOLS`` pools (as several processes would), each running
    ``STATEMENTS`` single statements whose text and arguments are its own, and every fifth a
    two-statement transaction; returns (right answers, problems by kind)."""
    problems: collections.Counter[str] = collections.Counter()
    right = 0
    pools = [await create_pool(url, pooler=pooler, max_size=POOL_SIZE, timeout=10)
             for _ in range(POOLS)]

    async def task(index: int) -> None:
        nonlocal right
        pool = pools[index % POOLS]
        for n in range(STATEMENTS):
            try:
                if n % 5 == 4:
                    async with pool.acquire() as conn, conn.transaction():
                        a = await conn.fetchval(f"SELECT $1::int + {index}", n)
                        b = await conn.fetchval(f"SELECT $1::text || '-{index}'", str(n))
                    got: object = (a, b)
                    expected: object = (n + index, f"{n}-{index}")
                else:
                    # another task's statement would answer with its own multiplier
                    got = await pool.fetchval(f"SELECT $1::int * {index + 2} + {index}", n)
                    expected = n * (index + 2) + index
                if got == expected:
                    right += 1
                else:
                    problems[f"wrong answer {got!r} for {expected!r}"] += 1
            except asyncpg.PostgresError as exc:
                problems[f"{type(exc).__name__}: {str(exc).splitlines()[0]}"] += 1

    try:
        await asyncio.gather(*(task(i) for i in range(TASKS)))
    finally:
        for pool in pools:
            await pool.close()
    return right, problems


# ---------------------------------------------------------------------- the fixture itself


def test_the_suite_goes_through_the_pooler(pgbouncer, database_url, stub, ids):
    """``database_url`` is PgBouncer in transaction mode, and a Plan on the suite's server
    is counted by it: the suite cannot fall back to PostgreSQL unnoticed."""
    assert f"127.0.0.1:{pgbouncer.port}/" in database_url
    (pool,) = pgbouncer.pools()
    assert pool["pool_mode"] == "transaction"
    before = int(pgbouncer.stats()["total_xact_count"] or 0)
    tenant, session = ids
    stub.Plan(plan_request(tenant, session), timeout=30)
    assert int(pgbouncer.stats()["total_xact_count"] or 0) > before
    # the suite's servers are among the pooler's clients
    clients = [c for c in pgbouncer.admin("SHOW CLIENTS")
               if c["database"] == pgbouncer.upstream.database]
    assert clients
    # and `serve` processes the suite starts (tests/integration/processes.py) inherit this
    # environment: they run in pooler mode too
    assert Config.from_env(os.environ).db_pooler is Pooler.TRANSACTION


def test_the_pooler_hands_statements_to_other_server_connections(small_pooler,
                                                                direct_database_url):
    """One client connection, consecutive statements, several backends: what the pooler does
    to a client in transaction mode (and why nothing may stay on a server connection)."""
    async def scenario() -> tuple[set[int], int]:
        mine = await asyncpg.connect(small_pooler.url, statement_cache_size=0)
        others = [await asyncpg.connect(small_pooler.url, statement_cache_size=0)
                  for _ in range(2)]
        try:
            first = await mine.fetchval("SELECT pg_backend_pid()")
            # the others open a transaction each: in transaction mode each holds a server
            # connection until it ends, so together they hold both of the pool's
            held = []
            for other in others:
                transaction = other.transaction()
                await transaction.start()
                held.append((await other.fetchval("SELECT pg_backend_pid()"), transaction))
            assert {pid for pid, _ in held} >= {first}, (first, held)
            # the one not on ``first``'s server connection ends: the next statement of
            # ``mine`` can only go to the connection it frees
            for pid, transaction in held:
                if pid != first:
                    await transaction.commit()
            second = await mine.fetchval("SELECT pg_backend_pid()")
            for pid, transaction in held:
                if pid == first:
                    await transaction.commit()
            direct = await asyncpg.connect(direct_database_url)
            try:
                own = await direct.fetchval("SELECT pg_backend_pid()")
            finally:
                await direct.close()
            return {first, second}, own
        finally:
            for c in (mine, *others):
                await c.close()

    seen, own = asyncio.run(scenario())
    assert len(seen) == 2, seen  # both server connections of the pool, for one client
    assert own not in seen


# ---------------------------------------------------------------------- statements


def test_single_statements_through_a_transaction_pooler(small_pooler, direct_database_url):
    """CE_DB_POOLER=transaction: every answer right, no error, and no prepared statement left
    on the server connections."""
    pooler = pooler_of({"CE_DB_POOLER": "transaction"})
    right, problems = asyncio.run(hammer(small_pooler.url, pooler))
    assert not problems, problems.most_common(5)
    assert right == TASKS * STATEMENTS
    servers = [s for s in small_pooler.admin("SHOW SERVERS")
               if s["database"] == small_pooler.upstream.database]
    assert 1 <= len(servers) <= 2

    async def left_behind() -> list[str]:
        conn = await asyncpg.connect(small_pooler.url, statement_cache_size=0)
        try:
            names: set[str] = set()
            for _ in range(10):
                names |= {r["name"] for r in await conn.fetch(
                    "SELECT name FROM pg_prepared_statements")}
            return sorted(names)
        finally:
            await conn.close()

    assert asyncio.run(left_behind()) == []


def test_the_statement_cache_fails_behind_a_transaction_pooler(small_pooler):
    """The control: the same load with asyncpg's statement cache (CE_DB_POOLER=none) fails
    behind the same pooler, so the test above would see the problem."""
    right, problems = asyncio.run(hammer(small_pooler.url, pooler_of({})))
    assert problems, "named statements worked behind a transaction pooler"
    assert any("prepared statement" in p for p in problems), problems.most_common(3)
    assert right < TASKS * STATEMENTS


def test_the_statement_cache_is_fine_behind_a_session_pooler(direct_database_url):
    """pool_mode=session keeps a server connection per client: CE_DB_POOLER=none works."""
    with PgBouncer(direct_database_url, pool_mode="session",
                   default_pool_size=POOLS * POOL_SIZE) as session_pooler:
        right, problems = asyncio.run(hammer(session_pooler.url, pooler_of({})))
    assert not problems, problems.most_common(5)
    assert right == TASKS * STATEMENTS


def test_a_pool_sends_only_the_services_statements(small_pooler):
    """No reset query on release: N calls are N transactions at the pooler, not 2N."""
    async def scenario() -> int:
        pool = await create_pool(small_pooler.url, pooler=Pooler.TRANSACTION, max_size=2,
                                 timeout=10)
        try:
            await pool.fetchval("SELECT 1")  # the connection's own start-up is done
            before = int(small_pooler.stats()["total_xact_count"] or 0)
            for n in range(20):
                assert await pool.fetchval("SELECT $1::int", n) == n
            return int(small_pooler.stats()["total_xact_count"] or 0) - before
        finally:
            await pool.close()

    assert asyncio.run(scenario()) == 20


def test_a_direct_pool_sends_only_the_services_statements(direct_database_url):
    """CE_DB_POOLER=none: a connection goes back to the pool without asyncpg's reset query (it
    would be a second round trip on every call), and a transaction left open on it is still
    rolled back (the next holder finds none)."""
    async def scenario() -> tuple[list[str], bool]:
        pool = await create_pool(direct_database_url, pooler=Pooler.NONE, max_size=1,
                                 timeout=10)
        queries: list[str] = []
        try:
            async with pool.acquire() as conn:
                conn.add_query_logger(lambda record: queries.append(record.query))
                assert await conn.fetchval("SELECT 41 + 1") == 42
            # released: whatever the release sent was logged on the same connection
            async with pool.acquire() as conn:
                await conn.execute("BEGIN")  # left open: not a managed transaction
            async with pool.acquire() as conn:  # max_size=1: the same connection again
                open_after = conn.is_in_transaction()
                in_server = await conn.fetchval(
                    "SELECT state = 'idle in transaction' FROM pg_stat_activity "
                    "WHERE pid = pg_backend_pid()")
            return queries, open_after or bool(in_server)
        finally:
            await pool.close()

    queries, still_open = asyncio.run(scenario())
    assert queries[0] == "SELECT 41 + 1"
    assert not any("RESET" in q or "UNLISTEN" in q or "advisory" in q for q in queries), queries
    assert not still_open


def test_the_database_timeout_holds_through_the_pooler(small_pooler, direct_database_url):
    """CE_DB_TIMEOUT_SECONDS: the call gives up on time, its cancel reaches PostgreSQL through
    PgBouncer (the backend stops sleeping), and the pool serves the next call."""
    marker = f"ce-timeout-{uuid.uuid4().hex[:8]}"

    async def scenario() -> tuple[float, int]:
        pool = await create_pool(small_pooler.url, pooler=Pooler.TRANSACTION, max_size=2,
                                 timeout=0.5)
        direct = await asyncpg.connect(direct_database_url)
        try:
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                await pool.fetchval(f"SELECT pg_sleep(30) /* {marker} */")
            took = time.monotonic() - started
            deadline = time.monotonic() + 5
            running = 1
            while running and time.monotonic() < deadline:
                running = await direct.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE state = 'active' "
                    "AND query LIKE $1 AND pid <> pg_backend_pid()", f"%{marker}%")
                await asyncio.sleep(0.05)
            assert await pool.fetchval("SELECT 1") == 1
            return took, running
        finally:
            await direct.close()
            await pool.close()

    took, running = asyncio.run(scenario())
    assert took < 3, took
    assert running == 0, "the cancel did not reach PostgreSQL"


@pytest.mark.parametrize("setting", [{"default_transaction_read_only": "on"},
                                     {"statement_timeout": "1000"}])
def test_the_pooler_refuses_untracked_startup_settings(small_pooler, setting):
    """Why ``inspect`` and ``migrate --status`` send none but ``application_name``, and why a
    server-side statement timeout cannot come from the service."""
    async def connect() -> None:
        conn = await asyncpg.connect(small_pooler.url, statement_cache_size=0,
                                     server_settings=setting)
        await conn.close()

    with pytest.raises(asyncpg.ProtocolViolationError, match="unsupported startup parameter"):
        asyncio.run(connect())


def test_statement_mode_refuses_the_services_transactions(direct_database_url):
    """pool_mode=statement is not supported: the service's writes are transactions of several
    statements, which PgBouncer refuses in that mode."""
    async def scenario() -> None:
        with PgBouncer(direct_database_url, pool_mode="statement") as statement_pooler:
            pool = await create_pool(statement_pooler.url, pooler=Pooler.TRANSACTION,
                                     max_size=1, timeout=5)
            try:
                assert await pool.fetchval("SELECT 1") == 1
                with pytest.raises(asyncpg.PostgresError, match="transaction blocks not allowed"):
                    async with pool.acquire() as conn, conn.transaction():
                        await conn.fetchval("SELECT 1")
            finally:
                pool.terminate()

    asyncio.run(scenario())


# ---------------------------------------------------------------------- servers


def test_two_servers_behind_a_small_transaction_pool(small_pooler):
    """Two servers (CE_DB_POOLER=transaction, two server connections between them): concurrent
    Plans of the same sessions from both make exactly one epoch per session, and Builds on
    either answer; no call fails."""
    config = base_config().replace(db_pooler=pooler_of({"CE_DB_POOLER": "transaction"}),
                                   db_pool_size=6)
    servers = [ServerThread(config, small_pooler.url) for _ in range(2)]
    channels = [grpc.insecure_channel(s.address) for s in servers]
    stubs = [pb_grpc.ContextEngineStub(c) for c in channels]
    tenant = f"tenant-{uuid.uuid4().hex[:10]}"
    sessions = [f"s-{i}" for i in range(6)]
    epochs: dict[str, set[int]] = collections.defaultdict(set)
    errors: list[BaseException] = []
    lock = threading.Lock()

    def caller(index: int) -> None:
        try:
            stub = stubs[index % 2]
            for round_ in range(4):
                session = sessions[(index + round_) % len(sessions)]
                plan = stub.Plan(plan_request(tenant, session), timeout=30).plan
                built = stub.Build(build_request(tenant, session), timeout=30)
                with lock:
                    epochs[session].update({plan.epoch, built.epoch})
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    try:
        threads = [threading.Thread(target=caller, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors[:3]
        assert dict(epochs) == {s: {1} for s in sessions}
    finally:
        for c in channels:
            c.close()
        for s in servers:
            s.stop()


# ---------------------------------------------------------------------- migrations


def test_concurrent_migrators_through_the_pooler(direct_database_url):
    """Four migrators at once through two server connections of a transaction pooler: each
    migration is applied once, all finish, and no advisory lock is left on a server
    connection."""
    async def scenario() -> None:
        name = await create_database(direct_database_url, "ce_pooled_migrate")
        try:
            with PgBouncer(direct_database_url, pool_mode="transaction",
                           default_pool_size=2) as b:
                url = with_database(b.url, name)
                applied = await asyncio.wait_for(asyncio.gather(
                    *(migrate(url, REPO / "migrations") for _ in range(4))), 30)
                names = [m.file.removesuffix(".sql") for m in discover(REPO / "migrations")]
                assert sorted(n for batch in applied for n in batch) == names
                assert await asyncio.wait_for(migrate(url, REPO / "migrations"), 30) == []
                direct = await asyncpg.connect(with_database(direct_database_url, name))
                try:
                    recorded = await direct.fetchval("SELECT count(*) FROM schema_migrations")
                    held = await direct.fetchval(
                        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
                        "AND database = (SELECT oid FROM pg_database WHERE datname = $1)", name)
                finally:
                    await direct.close()
                assert (recorded, held) == (len(names), 0)
        finally:
            await drop_database(direct_database_url, name)

    asyncio.run(scenario())


def test_migrate_stops_at_its_target(direct_database_url):
    """``migrate(target=N)`` applies the pending migrations numbered up to N only (through the
    pooler, like the rest); a target with no file is refused before anything is applied."""
    files = discover(REPO / "migrations")
    names = [m.file.removesuffix(".sql") for m in files]

    async def scenario() -> None:
        name = await create_database(direct_database_url, "ce_target_migrate")
        try:
            with PgBouncer(direct_database_url, default_pool_size=2) as b:
                url = with_database(b.url, name)
                with pytest.raises(ValueError, match="no migration numbered 9999"):
                    await migrate(url, REPO / "migrations", target=9999)
                assert await migrate(url, REPO / "migrations", target=files[1].version) == (
                    names[:2])
                assert await migrate(url, REPO / "migrations", target=files[1].version) == []
                assert await migrate(url, REPO / "migrations") == names[2:]
        finally:
            await drop_database(direct_database_url, name)

    asyncio.run(scenario())
