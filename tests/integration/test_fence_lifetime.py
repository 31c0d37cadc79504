"""A snapshot fence lives at least as long as the event it fences (deploy/README.md, "Data
lifecycle"): a cycle whose partition step fails deletes no fence (it deleted those of the
partitions it failed to drop, and a retry of the same run stored its event twice), and a fence
PostgreSQL dated the day before its event's partition (a replica's clock ahead of
PostgreSQL's, across midnight) stays until a day after that partition's day."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest
from context_engine.adapters.postgres.maintenance import Maintenance, Policy
from context_engine.adapters.postgres.migrate import migrate
from context_engine.adapters.postgres.store import PostgresEventLog
from context_engine.domain.ports import ContextEvent

from tests.conftest import REPO, run
from tests.support.databases import create_database, drop_database, with_database

pytestmark = pytest.mark.integration


class Clock:
    def __init__(self, at: datetime) -> None:
        self.at = at

    def now(self) -> datetime:
        return self.at

    def monotonic(self) -> float:
        return time.monotonic()


def used(run_id: str) -> ContextEvent:
    return ContextEvent(tenant_id="t", session_id="s", epoch=1, type="context.snapshot.used",
                        payload={"run_id": run_id, "epoch": 1})


async def stored(pool: asyncpg.Pool, run_id: str) -> int:
    return int(await pool.fetchval(
        "SELECT count(*) FROM context_events WHERE type = 'context.snapshot.used' "
        "AND payload->>'run_id' = $1", run_id))


@pytest.fixture
def own_database(direct_database_url: str):  # type: ignore[no-untyped-def]
    name = run(create_database(direct_database_url, "ce_fence"))
    url = with_database(direct_database_url, name)
    run(migrate(url, REPO / "migrations"))
    yield url
    run(drop_database(direct_database_url, name))


async def _pool(url: str) -> asyncpg.Pool:
    pool = await asyncpg.create_pool(url, min_size=1, max_size=3)
    await pool.execute("INSERT INTO sessions (tenant_id, session_id) VALUES ('t', 's')")
    return pool


def test_a_cycle_whose_partition_step_fails_deletes_no_fence(own_database: str) -> None:
    async def scenario() -> None:
        pool = await _pool(own_database)
        try:
            now = (await pool.fetchval("SELECT now()")).astimezone(UTC)
            log = PostgresEventLog(pool, clock=Clock(now))
            assert await log.append_once_durably(used("run-1"), "s:1:run-1")
            reader = await asyncpg.connect(own_database)  # holds context_events: no DROP
            async with reader.transaction():
                await reader.fetch("SELECT count(*) FROM context_events")
                # late enough that the fence is past its cutoff, margin and all
                cycle = Maintenance(pool=pool, clock=Clock(now + timedelta(days=3, hours=1)),
                                    policy=Policy(retention_days=1, ahead_days=2))
                with pytest.raises(asyncpg.LockNotAvailableError):
                    await cycle.run_once(epochs=False, ddl_tries=1)
            await reader.close()
            assert await pool.fetchval("SELECT count(*) FROM idempotency_keys") == 1
            assert not await log.append_once_durably(used("run-1"), "s:1:run-1")
            assert await stored(pool, "run-1") == 1
        finally:
            await pool.close()

    run(scenario())


def test_a_fence_dated_the_day_before_its_event_stays_while_the_event_does(
        own_database: str) -> None:
    async def scenario() -> None:
        pool = await _pool(own_database)
        try:
            db_now = (await pool.fetchval("SELECT now()")).astimezone(UTC)
            # the replica's clock a moment past the next midnight: its event goes in
            # tomorrow's partition, its fence (PostgreSQL's now) is dated today
            ahead = datetime.combine(db_now.date() + timedelta(days=1), datetime.min.time(),
                                     UTC) + timedelta(seconds=30)
            log = PostgresEventLog(pool, clock=Clock(ahead))
            cycle = Maintenance(pool=pool, clock=Clock(ahead),
                                policy=Policy(retention_days=1, ahead_days=2))
            await cycle.run_once(epochs=False)  # tomorrow's partition and the days ahead
            assert await log.append_once_durably(used("run-2"), "s:1:run-2")
            # a cycle that drops today's partition and keeps tomorrow's
            later = Clock(ahead + timedelta(days=1, hours=1))
            cycle = Maintenance(pool=pool, clock=later,
                                policy=Policy(retention_days=1, ahead_days=2))
            outcome = await cycle.run_once(epochs=False)
            tomorrow = f"context_events_p{ahead:%Y%m%d}"
            assert tomorrow not in outcome.dropped and outcome.fences_deleted == 0, outcome
            assert not await log.append_once_durably(used("run-2"), "s:1:run-2")
            assert await stored(pool, "run-2") == 1
        finally:
            await pool.close()

    run(scenario())
