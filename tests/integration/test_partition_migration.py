"""Migration 0006 converts a populated ``context_events`` into a table partitioned by day without
losing a row: a database migrated up to 0005 is filled with thousands of events over two months,
several tenants and sessions (and a few events of sessions that no longer exist), then 0006 runs.
Every row keeps its id, tenant, session, epoch, type, payload and created_at and sits in the
partition of its UTC day; the orphans are kept aside unchanged; new rows are numbered after the
old ones; ``inspect``'s reads still work."""

from __future__ import annotations

import asyncio
import json
import random
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest
from context_engine.adapters.postgres.inspect import read_session
from context_engine.adapters.postgres.maintenance import partition_name
from context_engine.adapters.postgres.migrate import migrate

from tests.conftest import REPO
from tests.support.databases import create_database, drop_database, with_database

pytestmark = pytest.mark.integration

MIGRATIONS = REPO / "migrations"
ROWS = 3000
DAYS = 60
TENANTS = ("tenant-a", "tenant-b", "tenant-c")
SESSIONS = 8  # per tenant
ORPHANS = 5


@pytest.fixture
def fresh(direct_database_url: str) -> Iterator[str]:
    """A database of its own (PostgreSQL itself: the test rewrites the schema)."""
    name = asyncio.run(create_database(direct_database_url, "ce_partition"))
    yield with_database(direct_database_url, name)
    asyncio.run(drop_database(direct_database_url, name))


async def _populate(conn: asyncpg.Connection, now: datetime) -> list[asyncpg.Record]:
    """Sessions, and events spread over the last DAYS days (as the old schema wrote them)."""
    rng = random.Random(6)
    sessions = [(t, f"s-{t[-1]}-{i}") for t in TENANTS for i in range(SESSIONS)]
    await conn.executemany("INSERT INTO sessions (tenant_id, session_id, current_epoch) "
                           "VALUES ($1, $2, 1)", sessions)
    rows = []
    for n in range(ROWS):
        tenant, session = sessions[rng.randrange(len(sessions))]
        created = now - timedelta(seconds=rng.uniform(0, DAYS * 86_400))
        if n % 500 == 0:  # exactly midnight: the lower bound of its own day
            created = created.replace(hour=0, minute=0, second=0, microsecond=0)
        payload = {"n": n, "steps": [{"step": "cut", "item_ids": [f"i{n}"]}],
                   "big": 10**16 + n, "text": "é\u2028"}
        rows.append((tenant, session, rng.choice([None, 1, 2]),
                     rng.choice(["context.budget.pressure", "context.compacted"]),
                     json.dumps(payload), created))
    for n in range(ORPHANS):  # a session that is gone (deleted by hand)
        rows.append(("tenant-a", "gone", 1, "context.plan.created", json.dumps({"orphan": n}),
                     now - timedelta(days=n)))
    await conn.executemany(
        "INSERT INTO context_events (tenant_id, session_id, epoch, type, payload, created_at) "
        "VALUES ($1, $2, $3, $4, $5::jsonb, $6)", rows)
    return list(await conn.fetch(
        "SELECT id, tenant_id, session_id, epoch, type, payload::text AS payload, created_at "
        "FROM context_events ORDER BY id"))


def _key(row: asyncpg.Record) -> tuple[object, ...]:
    return (row["id"], row["tenant_id"], row["session_id"], row["epoch"], row["type"],
            row["payload"], row["created_at"])


def test_a_populated_outbox_is_partitioned_without_losing_a_row(fresh):
    async def scenario() -> None:
        assert await migrate(fresh, MIGRATIONS, target=5)
        conn = await asyncpg.connect(fresh)
        try:
            now = await conn.fetchval("SELECT now()")
            before = await _populate(conn, now)
            assert len(before) == ROWS + ORPHANS
            old_max = max(r["id"] for r in before)
        finally:
            await conn.close()

        assert await migrate(fresh, MIGRATIONS, target=6) == ["0006_partitioned_events"]

        conn = await asyncpg.connect(fresh)
        try:
            # a partitioned table, with no DEFAULT partition
            assert await conn.fetchval("SELECT relkind::text FROM pg_class "
                                       "WHERE relname = 'context_events'") == "p"
            assert await conn.fetchval(
                "SELECT count(*) FROM pg_partitioned_table p JOIN pg_class c "
                "ON c.oid = p.partdefid WHERE p.partrelid = 'context_events'::regclass") == 0

            after = await conn.fetch(
                "SELECT id, tenant_id, session_id, epoch, type, payload::text AS payload, "
                "created_at, event_id, tableoid::regclass::text AS part FROM context_events "
                "ORDER BY id")
            orphaned = await conn.fetch(
                "SELECT id, tenant_id, session_id, epoch, type, payload::text AS payload, "
                "created_at FROM context_events_orphaned ORDER BY id")
            kept = [r for r in before if r["session_id"] != "gone"]
            assert [_key(r) for r in after] == [_key(r) for r in kept]
            assert [_key(r) for r in orphaned] == [_key(r) for r in before
                                                    if r["session_id"] == "gone"]
            # every row in the partition of its UTC day
            for row in after:
                assert row["part"] == partition_name(row["created_at"].astimezone(UTC).date())
            assert len({r["event_id"] for r in after}) == len(after)
            assert all(isinstance(r["event_id"], uuid.UUID) for r in after)

            # partitions: every day with rows, and today through 7 days ahead
            parts = {r["relname"] for r in await conn.fetch(
                "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
                "WHERE i.inhparent = 'context_events'::regclass")}
            today = now.astimezone(UTC).date()
            wanted = {partition_name(r["created_at"].astimezone(UTC).date()) for r in after}
            wanted |= {partition_name(today + timedelta(days=n)) for n in range(8)}
            assert parts == wanted

            # inspect's reads: a session's most recent events by id, and their count
            for tenant, session in {(r["tenant_id"], r["session_id"]) for r in after[:50]}:
                record = await read_session(conn, tenant, session, events=5)
                assert record is not None
                mine = [r for r in after if (r["tenant_id"], r["session_id"]) == (
                    tenant, session)]
                assert record.events_total == len(mine)
                assert [e.id for e in record.events] == [r["id"] for r in mine[-5:]]
            indexed = await conn.fetchval(
                "SELECT count(*) FROM pg_indexes WHERE tablename = $1 AND indexdef LIKE "
                "'%(tenant_id, session_id, id)%'", partition_name(today))
            assert indexed == 1

            # new rows are numbered after every old one, orphans included
            new_id = await conn.fetchval(
                "INSERT INTO context_events (tenant_id, session_id, epoch, type, payload) "
                "VALUES ('tenant-a', 's-a-0', 1, 'context.test', '{}') RETURNING id")
            assert new_id > old_max
            # ... and an event needs its session
            with pytest.raises(asyncpg.ForeignKeyViolationError):
                await conn.execute(
                    "INSERT INTO context_events (tenant_id, session_id, epoch, type, payload) "
                    "VALUES ('tenant-a', 'gone', 1, 'context.test', '{}')")

            # erasing a session takes its events with it (ON DELETE CASCADE)
            await conn.execute("DELETE FROM sessions WHERE tenant_id = 'tenant-b' AND "
                               "session_id = 's-b-3'")
            assert await conn.fetchval("SELECT count(*) FROM context_events WHERE "
                                       "tenant_id = 'tenant-b' AND session_id = 's-b-3'") == 0
        finally:
            await conn.close()

    asyncio.run(scenario())


def test_without_orphans_no_side_table_is_left(fresh):
    async def scenario() -> None:
        await migrate(fresh, MIGRATIONS, target=5)
        conn = await asyncpg.connect(fresh)
        try:
            await conn.execute("INSERT INTO sessions (tenant_id, session_id) VALUES ('t', 's')")
            await conn.execute(
                "INSERT INTO context_events (tenant_id, session_id, epoch, type, payload) "
                "VALUES ('t', 's', 1, 'context.plan.created', '{}')")
        finally:
            await conn.close()
        await migrate(fresh, MIGRATIONS, target=6)
        conn = await asyncpg.connect(fresh)
        try:
            assert await conn.fetchval("SELECT to_regclass('context_events_orphaned')") is None
            assert await conn.fetchval("SELECT count(*) FROM context_events") == 1
        finally:
            await conn.close()

    asyncio.run(scenario())
