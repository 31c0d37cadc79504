"""The data lifecycle, run by the service itself: real servers (two replicas) on a database of
their own, through PgBouncer in transaction mode, each on a fake clock the test moves days
forward, and each running maintenance cycles (``Running.maintenance``).

- Partitions of ``context_events`` exist for today through today + the ahead window; one whose
  rows are all older than the retention is dropped with its rows, one holding a row inside the
  retention is kept (to the hour).
- Retry keys (Rotate, ReportUsage) and compaction records expire after the key window and not
  before; snapshot fences expire with the events retention.
- Two replicas running a cycle at the same moment neither fail nor drop anything twice; a
  replica that does not get the maintenance lock skips its cycle.
- Sessions, plans and epoch_usage rows are never touched: the session still plans and builds.
- A day without a partition (the clock far ahead of the last cycle): Build still answers and
  its event waits in the outbox, Plan answers UNAVAILABLE; the next cycle makes the partition,
  and both go through.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, replace
from datetime import UTC, date, datetime, timedelta
from typing import Any

import asyncpg
import grpc
import pytest
from context_engine.adapters.postgres.maintenance import LOCK_KEY, Outcome, partition_name
from context_engine.adapters.postgres.migrate import migrate
from context_engine.config import Config
from context_engine.v1 import context_engine_pb2 as pb
from context_engine.v1 import context_engine_pb2_grpc as pb_grpc

from tests.conftest import REPO, Db, ServerThread, run
from tests.conftest import test_config as base_config
from tests.integration.requests import build_request, failure, plan_request
from tests.integration.test_budget_rpc import SMALL, long_history
from tests.integration.test_compact_rpc import compact_request
from tests.support.databases import create_database, drop_database, with_database

pytestmark = pytest.mark.integration

RETENTION_DAYS = 30
AHEAD_DAYS = 7
KEY_TTL_HOURS = 24


class FakeClock:
    """A server's wall clock that the test moves (its monotonic clock is the real one)."""

    def __init__(self, start: datetime) -> None:
        self._now = start
        self._lock = threading.Lock()

    def now(self) -> datetime:
        with self._lock:
            return self._now

    def monotonic(self) -> float:
        return time.monotonic()

    def set(self, when: datetime) -> None:
        with self._lock:
            self._now = when


@dataclass
class OwnDatabase:
    direct: str  # PostgreSQL itself
    pooled: str  # through the suite's PgBouncer (transaction mode)

    @property
    def db(self) -> Db:
        return Db(self.pooled)


@pytest.fixture
def own(direct_database_url: str, database_url: str) -> Iterator[OwnDatabase]:
    """A migrated database of the test's own: its clocks move days and drop partitions.

    The migration makes today's partitions by the database's clock and the replicas start
    from the wall clock read after it: a run that began in the last minutes of a UTC day
    would find one day apart from the other, so it waits for the day to turn first."""
    left = (midnight(datetime.now(UTC).date() + timedelta(days=1))
            - datetime.now(UTC)).total_seconds()
    if left < MIDNIGHT_GUARD_SECONDS:
        time.sleep(left + 2)
    name = run(create_database(direct_database_url, "ce_lifecycle"))
    direct = with_database(direct_database_url, name)
    run(migrate(direct, REPO / "migrations"))
    yield OwnDatabase(direct=direct, pooled=with_database(database_url, name))
    run(drop_database(direct_database_url, name))


MIDNIGHT_GUARD_SECONDS = 180  # longer than the tests of this file take, with their fixtures


def lifecycle_config() -> Config:
    return base_config().replace(events_retention_days=RETENTION_DAYS,
                                 event_partitions_ahead_days=AHEAD_DAYS,
                                 idempotency_key_ttl_hours=KEY_TTL_HOURS)


def midnight(day: date) -> datetime:
    return datetime(day.year, day.month, day.day, tzinfo=UTC)


def partitions(db: Db) -> set[str]:
    return {r["relname"] for r in db.fetch(
        "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
        "WHERE i.inhparent = 'context_events'::regclass")}


def days(first: date, count: int) -> set[str]:
    return {partition_name(first + timedelta(days=n)) for n in range(count)}


def cycle(srv: ServerThread) -> Outcome:
    outcome = srv.call(srv.running.maintenance.run_once())
    assert isinstance(outcome, Outcome)
    return outcome


def events_by_partition(db: Db, tenant: str) -> dict[str, int]:
    return {r["part"]: int(r["n"]) for r in db.fetch(
        "SELECT tableoid::regclass::text AS part, count(*) AS n FROM context_events "
        "WHERE tenant_id = $1 GROUP BY 1", tenant)}


def kept_rows(db: Db, tenant: str) -> dict[str, Any]:
    """What a live session keeps, whatever the lifecycle does."""
    return {
        "sessions": db.fetch("SELECT session_id, current_epoch FROM sessions WHERE tenant_id=$1 "
                             "ORDER BY 1", tenant),
        "plans": db.fetch("SELECT session_id, epoch, prefix_sha256, created_at FROM plans "
                          "WHERE tenant_id=$1 ORDER BY 1, 2", tenant),
        "epoch_usage": db.fetch("SELECT session_id, epoch, reports, last_input_tokens FROM "
                                "epoch_usage WHERE tenant_id=$1 ORDER BY 1, 2", tenant),
        "calibration": db.fetch("SELECT model_id, reports FROM estimator_calibration "
                                "WHERE tenant_id=$1", tenant),
    }


def report(tenant: str, session: str, key: str) -> pb.ReportUsageRequest:
    return pb.ReportUsageRequest(tenant_id=tenant, session_id=session,
                                 estimated_input_tokens=5000, estimator_factor=1.0,
                                 input_tokens=5000, cached_tokens=500, output_tokens=10,
                                 idempotency_key=key)


def age_keys(db: Db, tenant: str, hours: float) -> None:
    """The tenant's retry keys (not its fences) and compaction records made ``hours``
    earlier than they were, on the database that made them."""
    for table, which in (("idempotency_keys", " AND rpc NOT LIKE 'context.%'"),
                         ("compactions", "")):
        db.fetch(f"UPDATE {table} SET created_at = created_at - make_interval(secs => $2) "
                 f"WHERE tenant_id = $1{which}", tenant, hours * 3600)


def pressure_build(stub: pb_grpc.ContextEngineStub, tenant: str, session: str) -> None:
    resp = stub.Build(build_request(tenant, session, items=long_history(40)), timeout=30)
    assert resp.pressure.steps  # so it records a context.budget.pressure event


@pytest.fixture
def replicas(own: OwnDatabase) -> Iterator[tuple[ServerThread, ServerThread, FakeClock,
                                                FakeClock]]:
    start = datetime.now(UTC)
    clock_a, clock_b = FakeClock(start), FakeClock(start)
    a = ServerThread(lifecycle_config(), own.pooled, clock=clock_a)
    try:
        b = ServerThread(lifecycle_config(), own.pooled, clock=clock_b)
    except BaseException:
        a.stop()
        raise
    try:
        yield a, b, clock_a, clock_b
    finally:
        a.stop()
        b.stop()


def test_partitions_keys_and_records_age_out_across_two_replicas(own, replicas):
    a, b, clock_a, clock_b = replicas
    db = own.db
    t0 = clock_a.now()
    day0 = t0.date()
    tenant, session = f"tenant-{uuid.uuid4().hex[:8]}", "s-1"
    ch_a, ch_b = grpc.insecure_channel(a.address), grpc.insecure_channel(b.address)
    stub_a, stub_b = pb_grpc.ContextEngineStub(ch_a), pb_grpc.ContextEngineStub(ch_b)

    def both(when: datetime) -> tuple[Outcome, Outcome]:
        """Both replicas' cycles at the same moment of their clocks, run concurrently."""
        clock_a.set(when)
        clock_b.set(when)
        futures: list[Future[Outcome]] = [
            asyncio.run_coroutine_threadsafe(s.running.maintenance.run_once(), s.loop)
            for s in (a, b)]
        first, second = (f.result(60) for f in futures)
        return first, second

    try:
        # today and the days ahead exist from the start (migration and the start-up cycles)
        assert partitions(db) == days(day0, AHEAD_DAYS + 1)
        stub_a.Plan(plan_request(tenant, session, model=SMALL), timeout=30)
        pressure_build(stub_a, tenant, session)
        stub_b.ReportUsage(report(tenant, session, "use-1"), timeout=30)
        stub_b.Rotate(pb.RotateRequest(tenant_id=tenant, session_id=session,
                                       reason=pb.ROTATION_REASON_OPERATOR,
                                       idempotency_key="rot-1"), timeout=30)
        stub_a.Compact(compact_request(tenant, session, "cmp-1"), timeout=30)
        # a snapshot fence, as append_once_durably claims it
        db.fetch("INSERT INTO idempotency_keys (tenant_id, rpc, key, response) VALUES "
                 "($1, 'context.snapshot.used', 's-1:1:run-1', '{}')", tenant)
        keys = {(r["rpc"], r["key"]) for r in db.fetch(
            "SELECT rpc, key FROM idempotency_keys WHERE tenant_id = $1", tenant)}
        assert keys == {("ReportUsage", "use-1"), ("Rotate", "rot-1"),
                        ("context.snapshot.used", "s-1:1:run-1")}
        assert db.val("SELECT count(*) FROM compactions WHERE tenant_id=$1", tenant) == 1
        kept = kept_rows(db, tenant)
        today = events_by_partition(db, tenant)
        assert set(today) == {partition_name(day0)} and today[partition_name(day0)] == 4

        def keys_left() -> set[str]:
            return {r["key"] for r in db.fetch(
                "SELECT key FROM idempotency_keys WHERE tenant_id = $1", tenant)}

        # keys: not before the window (by the database's clock, which made them) ...
        age_keys(db, tenant, KEY_TTL_HOURS - 1)
        for outcome in both(t0 + timedelta(hours=KEY_TTL_HOURS - 1)):
            assert outcome.dropped == ()
        assert keys_left() == {"use-1", "rot-1", "s-1:1:run-1"}
        assert db.val("SELECT count(*) FROM compactions WHERE tenant_id=$1", tenant) == 1
        # ... but after it (the fence stays: it lives as long as the event it fences)
        age_keys(db, tenant, 2)
        outcomes = both(t0 + timedelta(hours=KEY_TTL_HOURS + 1))
        assert keys_left() == {"s-1:1:run-1"}
        assert db.val("SELECT count(*) FROM compactions WHERE tenant_id=$1", tenant) == 0
        assert sum(o.keys_deleted for o in outcomes) >= 2
        assert sum(o.compactions_deleted for o in outcomes) >= 1

        # ten days on: the partitions ahead follow the clock, nothing is old enough to drop
        clock_b.set(t0 + timedelta(days=10))
        outcome = cycle(b)
        assert outcome.ran and outcome.dropped == ()
        assert set(outcome.created) == days(day0 + timedelta(days=10), AHEAD_DAYS + 1)
        clock_a.set(t0 + timedelta(days=10))
        pressure_build(stub_a, tenant, session)  # an event in the new day's partition
        # (the cycles a day after t0 made the days ahead of theirs: up to day0 + 8, or day0 + 9
        # when t0 was late enough in its day for "a day and an hour later" to be two days on)
        last_early = max((t0 + timedelta(hours=h)).date()
                         for h in (KEY_TTL_HOURS - 1, KEY_TTL_HOURS + 1))
        last_early += timedelta(days=AHEAD_DAYS)
        early = days(day0, (last_early - day0).days + 1)
        assert partitions(db) == early | days(day0 + timedelta(days=10), AHEAD_DAYS + 1)

        # day0's partition holds rows younger than now - retention: kept (a minute before its
        # first row would be too old)
        keep = t0 + timedelta(days=RETENTION_DAYS) - timedelta(minutes=1)
        assert keep - timedelta(days=RETENTION_DAYS) < t0  # a row of day0 is inside
        for outcome in both(keep):
            assert partition_name(day0) not in outcome.dropped
        assert events_by_partition(db, tenant)[partition_name(day0)] == 4
        # a minute past the retention of the fence's own moment, its event's partition (day0)
        # is kept, and so is the fence: cut at the retention itself, it went up to a day
        # before its event, and a retry then stored the event twice
        for outcome in both(t0 + timedelta(days=RETENTION_DAYS, minutes=1)):
            assert partition_name(day0) not in outcome.dropped
        assert keys_left() == {"s-1:1:run-1"}

        # once all of day0 is older than the retention, it goes with its rows; so do the days
        # after it made early on, by both replicas at once, each dropped once
        later = midnight(last_early + timedelta(days=1)) + timedelta(days=RETENTION_DAYS, hours=1)
        outcomes = both(later)
        dropped = [name for o in outcomes for name in o.dropped]
        assert sorted(dropped) == sorted(early), outcomes
        assert all(o.ran or o.dropped == () for o in outcomes)
        assert partitions(db) == (days(day0 + timedelta(days=10), AHEAD_DAYS + 1)
                                  | days(keep.date(), AHEAD_DAYS + 1)
                                  | days(later.date(), AHEAD_DAYS + 1))
        assert events_by_partition(db, tenant) == {
            partition_name(day0 + timedelta(days=10)): 1}
        assert keys_left() == set()  # the fence aged out with its event's partition

        # what the session keeps is untouched, and it still plans and builds
        assert kept_rows(db, tenant) == kept
        assert stub_b.GetPlan(pb.GetPlanRequest(tenant_id=tenant, session_id=session),
                              timeout=30).plan.epoch == 2
        clock_b.set(later)
        stub_b.Build(build_request(tenant, session, items=long_history(40)), timeout=30)
    finally:
        ch_a.close()
        ch_b.close()


def test_keys_age_by_the_database_clock_whatever_the_replica_clock_says(own, replicas):
    """A retry claims its key anew once it is older than the TTL by PostgreSQL's clock; the
    cycles deleted keys and compaction records by the replica's clock instead, so a replica
    whose clock ran three hours ahead deleted them three hours early, and a retry inside the
    TTL was run a second time (a second epoch, a report counted twice). They now go by the
    database's clock both ways: not early when the replica runs ahead, not late when it lags."""
    a, _b, clock_a, _clock_b = replicas
    db = own.db
    tenant, session = f"tenant-{uuid.uuid4().hex[:8]}", "s-1"
    channel = grpc.insecure_channel(a.address)
    stub = pb_grpc.ContextEngineStub(channel)
    rotate = pb.RotateRequest(tenant_id=tenant, session_id=session,
                              reason=pb.ROTATION_REASON_OPERATOR, idempotency_key="rot")

    def counts() -> tuple[int, int]:
        return (db.val("SELECT count(*) FROM idempotency_keys WHERE tenant_id=$1", tenant),
                db.val("SELECT count(*) FROM compactions WHERE tenant_id=$1", tenant))

    try:
        stub.Plan(plan_request(tenant, session, model=SMALL), timeout=30)
        assert stub.Rotate(rotate, timeout=30).rotated
        assert stub.ReportUsage(report(tenant, session, "use"), timeout=30).counted
        assert stub.Compact(compact_request(tenant, session, "cmp"), timeout=30).compacted
        assert counts() == (2, 1)
        age_keys(db, tenant, KEY_TTL_HOURS - 1)  # an hour of the TTL left, by the database

        clock_a.set(datetime.now(UTC) + timedelta(hours=3))  # the replica's clock runs ahead
        outcome = cycle(a)
        assert (outcome.keys_deleted, outcome.compactions_deleted) == (0, 0)
        assert counts() == (2, 1)
        # so the retries inside the TTL are still answered as retries, not run again
        again = stub.Rotate(rotate, timeout=30)
        assert not again.rotated and again.plan.epoch == 2
        assert not stub.ReportUsage(report(tenant, session, "use"), timeout=30).counted
        assert not stub.Compact(compact_request(tenant, session, "cmp"), timeout=30).compacted
        assert db.val("SELECT reports FROM epoch_usage WHERE tenant_id=$1 AND epoch=2",
                      tenant) == 1

        age_keys(db, tenant, 2)  # an hour past the TTL, by the database
        clock_a.set(datetime.now(UTC) - timedelta(hours=3))  # the replica's clock lags
        outcome = cycle(a)
        assert (outcome.keys_deleted, outcome.compactions_deleted) == (2, 1)
        assert counts() == (0, 0)
    finally:
        channel.close()


def test_a_reader_of_the_events_holds_up_a_plan_a_moment_not_the_database_timeout(own,
                                                                                replicas):
    """A partition's DDL queues every insert of an event or a session behind it while it waits
    for a reader of context_events: it waited CE_DB_TIMEOUT_SECONDS (5 s, a Plan's event write
    held as long), and a cycle whose partition step failed deleted no key. It now waits a
    quarter of a second a try; the keys go all the same, and the cycle is reported failed."""
    a, _b, clock_a, _clock_b = replicas
    db = own.db
    maintenance = a.running.maintenance
    policy = maintenance.policy
    maintenance.policy = replace(policy, ddl_tries=3, ddl_retry_seconds=0.5)
    # two days on: the last two days ahead are due, the Plan's day has its partition, and a
    # key made now is older than the TTL
    clock_a.set(clock_a.now() + timedelta(days=2))
    tenant = f"tenant-{uuid.uuid4().hex[:8]}"
    db.fetch("INSERT INTO idempotency_keys (tenant_id, rpc, key, response, created_at) VALUES "
             "($1, 'ReportUsage', 'old', '{}', now() - interval '2 days')",
             tenant)  # older than the TTL
    channel = grpc.insecure_channel(a.address)
    stub = pb_grpc.ContextEngineStub(channel)

    async def with_a_reader() -> tuple[BaseException | None, float]:
        reader = await asyncpg.connect(own.direct)
        watcher = await asyncpg.connect(own.direct)
        try:
            async with reader.transaction():
                await reader.fetchval("SELECT count(*) FROM context_events")
                running = asyncio.wrap_future(asyncio.run_coroutine_threadsafe(
                    maintenance.run_once(), a.loop))
                for _ in range(200):  # its DDL waits on the reader
                    if await watcher.fetchval(
                            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = "
                            "'Lock' AND query LIKE 'CREATE TABLE%'"):
                        break
                    await asyncio.sleep(0.01)
                started = time.monotonic()
                await asyncio.to_thread(stub.Plan, plan_request(tenant, "s-1", model=SMALL),
                                        timeout=30)
                took = time.monotonic() - started
                failed = None
                try:
                    await running
                except asyncpg.LockNotAvailableError as exc:
                    failed = exc
            return failed, took
        finally:
            await reader.close()
            await watcher.close()

    try:
        failed, took = run(with_a_reader())
    finally:
        maintenance.policy = policy
        channel.close()
    assert took < 2.0, f"a Plan waited {took:.2f} s behind the partition's DDL"
    assert isinstance(failed, asyncpg.LockNotAvailableError)  # reported, not swallowed
    assert not db.fetch("SELECT 1 FROM idempotency_keys WHERE tenant_id = $1 AND key = 'old'",
                        tenant)  # step 3 ran all the same
    assert cycle(a).ran  # the reader gone, the next cycle makes the partitions


def test_a_server_starts_without_waiting_out_a_reader_of_the_events(own):
    """Start-up runs a maintenance cycle before serving: with the partition step's retries it
    waited out a reader of context_events (9.7 s measured) when a partition was due. It tries
    the partitions once; the next cycle makes them."""
    holding, release = threading.Event(), threading.Event()

    def reader() -> None:
        async def hold() -> None:
            conn = await asyncpg.connect(own.direct)
            try:
                async with conn.transaction():
                    await conn.fetchval("SELECT count(*) FROM context_events")
                    holding.set()
                    await asyncio.to_thread(release.wait, 60)
            finally:
                await conn.close()
        asyncio.run(hold())

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    assert holding.wait(30)
    clock = FakeClock(datetime.now(UTC) + timedelta(days=2))  # partitions are due
    started = time.monotonic()
    try:
        server = ServerThread(lifecycle_config(), own.pooled, clock=clock)
        took = time.monotonic() - started
        server.stop()
    finally:
        release.set()
        thread.join(30)
    assert took < 6.0, f"start-up took {took:.1f} s behind a reader of the events"


def test_a_replica_without_the_lock_skips_its_cycle(own, replicas):
    a, _b, clock_a, _clock_b = replicas
    db = own.db
    ahead = clock_a.now() + timedelta(days=20)
    clock_a.set(ahead)

    async def holding() -> None:
        conn = await asyncpg.connect(own.direct)
        try:
            async with conn.transaction():
                assert await conn.fetchval("SELECT pg_try_advisory_xact_lock($1)", LOCK_KEY)
                outcome = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(
                    a.running.maintenance.run_once(), a.loop))
                assert outcome == Outcome(ran=False)
        finally:
            await conn.close()

    before = partitions(db)
    run(holding())
    assert partitions(db) == before
    outcome = cycle(a)  # the lock is free again
    assert outcome.ran and set(outcome.created) == days(ahead.date(), AHEAD_DAYS + 1)


def test_a_day_without_a_partition_waits_for_the_next_cycle(own, replicas, caplog):
    caplog.set_level(logging.INFO, logger="context_engine")
    a, _b, clock_a, _clock_b = replicas
    db = own.db
    tenant, session = f"tenant-{uuid.uuid4().hex[:8]}", "s-1"
    channel = grpc.insecure_channel(a.address)
    stub = pb_grpc.ContextEngineStub(channel)
    try:
        stub.Plan(plan_request(tenant, session, model=SMALL), timeout=30)
        far = clock_a.now() + timedelta(days=AHEAD_DAYS + 5)
        clock_a.set(far)  # no cycle has run for that day
        pressure_build(stub, tenant, session)  # Build answers; its event waits
        assert a.running.events.pending == 1
        with pytest.raises(grpc.RpcError) as caught:  # a new epoch's event has nowhere to go
            stub.Plan(plan_request(tenant, "s-2", model=SMALL), timeout=30)
        refused = failure(caught.value)
        assert refused.reason == "STORE_UNAVAILABLE"
        # the missing day in the metadata: an operator's alert need not parse the message
        assert refused.metadata["cause"] == "PartitionMissing", refused.metadata
        assert refused.metadata["created_at"].startswith(far.date().isoformat())
        assert any(r.getMessage() == "event_partition_missing" for r in caplog.records)

        assert partition_name(far.date()) in cycle(a).created
        deadline = time.monotonic() + 10
        while a.running.events.pending:  # the outbox's next flush writes it
            assert time.monotonic() < deadline, "the waiting event was never written"
            time.sleep(0.1)
        stub.Plan(plan_request(tenant, "s-2", model=SMALL), timeout=30)
        assert events_by_partition(db, tenant)[partition_name(far.date())] == 2
        assert a.running.events.discarded == 0 and a.running.events.dropped == 0
    finally:
        channel.close()


def test_a_cycle_deletes_every_expired_key_batch_after_batch(own, replicas):
    """Step 3 deletes in batches of ``batch_size`` rows until a batch deletes fewer: five
    expired keys under a batch size of two go in three batches, all of them in one cycle."""
    a, _b, _clock_a, _clock_b = replicas
    db = own.db
    tenant, session = f"tenant-{uuid.uuid4().hex[:8]}", "s-1"
    channel = grpc.insecure_channel(a.address)
    stub = pb_grpc.ContextEngineStub(channel)
    try:
        stub.Plan(plan_request(tenant, session, model=SMALL), timeout=30)
        for n in range(5):
            assert stub.ReportUsage(report(tenant, session, f"use-{n}"), timeout=30).counted
    finally:
        channel.close()
    keys = "SELECT count(*) FROM idempotency_keys WHERE tenant_id=$1 AND rpc NOT LIKE 'context.%'"
    assert db.val(keys, tenant) == 5
    age_keys(db, tenant, KEY_TTL_HOURS + 1)
    maintenance = a.running.maintenance
    small = replace(maintenance, policy=replace(maintenance.policy, batch_size=2))
    outcome = a.call(small.run_once())
    assert outcome.keys_deleted == 5
    assert db.val(keys, tenant) == 0
