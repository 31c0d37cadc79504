"""A context event is stored once however often it is written: it gets its identity (an event id
and its created_at, from the server's clock) before its first attempt and keeps it in the
outbox's queue, and the insert does nothing for an identity already stored.

The case that made this necessary: PostgreSQL crashes after an INSERT committed but before its
answer reached the service. The write is reported failed (StoreUnavailable), the event waits in
the outbox, and the flush after recovery writes it again. ``AnswerLost`` reproduces it without
a crash: the real write, then StoreUnavailable once. Through PgBouncer in transaction mode.

An event the database can never hold, because its session was erased, is discarded, logged and
counted, on the first attempt and in the flush alike, and the queue behind it drains.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import asyncpg
import pytest
from context_engine.adapters.postgres.pool import create_pool
from context_engine.adapters.postgres.store import PostgresEventLog
from context_engine.adapters.resilience import BufferedEventLog
from context_engine.config import Pooler
from context_engine.domain.errors import SessionNotFound, StoreUnavailable
from context_engine.domain.ports import ContextEvent, EventLog

from tests.conftest import Db

pytestmark = pytest.mark.integration


class AnswerLost:
    """The real outbox, whose next ``lose`` answers are lost after the write committed."""

    def __init__(self, inner: EventLog, lose: int = 1) -> None:
        self.inner = inner
        self.lose = lose
        self.attempts = 0

    def _lost(self) -> None:
        if self.lose > 0:
            self.lose -= 1
            raise StoreUnavailable("database unavailable: ConnectionDoesNotExistError")

    async def append(self, event: ContextEvent) -> None:
        self.attempts += 1
        await self.inner.append(event)
        self._lost()

    async def append_once(self, event: ContextEvent, key: str) -> bool:
        self.attempts += 1
        appended = await self.inner.append_once(event, key)
        self._lost()
        return appended

    async def append_once_durably(self, event: ContextEvent, key: str, *,
                                  incarnation: int | None = None) -> bool:
        return await self.inner.append_once_durably(event, key, incarnation=incarnation)


class Away:
    """The database is away for the next ``calls`` writes (nothing is written)."""

    def __init__(self, inner: EventLog, calls: int) -> None:
        self.inner = inner
        self.calls = calls

    async def append(self, event: ContextEvent) -> None:
        if self.calls > 0:
            self.calls -= 1
            raise StoreUnavailable("database unavailable: OSError")
        await self.inner.append(event)

    async def append_once(self, event: ContextEvent, key: str) -> bool:
        if self.calls > 0:
            self.calls -= 1
            raise StoreUnavailable("database unavailable: OSError")
        return await self.inner.append_once(event, key)

    async def append_once_durably(self, event: ContextEvent, key: str, *,
                                  incarnation: int | None = None) -> bool:
        return await self.inner.append_once_durably(event, key, incarnation=incarnation)


def pressure(tenant: str, session: str, tag: str) -> ContextEvent:
    return ContextEvent(tenant_id=tenant, session_id=session, epoch=1,
                        type="context.budget.pressure",
                        payload={"epoch": 1, "steps": [{"step": "history_cut",
                                                        "item_ids": [f"{tag}.u0"]}]})


def with_outbox(database_url: str,
                body: Callable[[asyncpg.Pool], Awaitable[Any]]) -> Any:
    async def go() -> Any:
        pool = await create_pool(database_url, pooler=Pooler.TRANSACTION, max_size=2,
                                 timeout=5.0)
        try:
            return await body(pool)
        finally:
            await pool.close()
    return asyncio.run(go())


@pytest.fixture
def session(db: Db) -> tuple[str, str]:
    tenant, session = f"tenant-{uuid.uuid4().hex[:10]}", f"session-{uuid.uuid4().hex[:8]}"
    db.fetch("INSERT INTO sessions (tenant_id, session_id) VALUES ($1, $2)", tenant, session)
    return tenant, session


TAGS = ("SELECT payload #>> '{steps,0,item_ids,0}' AS tag FROM context_events "
        "WHERE tenant_id = $1 ORDER BY id")


def stored(db: Db, tenant: str) -> list[str]:
    return [r["tag"] for r in db.fetch(TAGS, tenant)]


async def stored_now(pool: asyncpg.Pool, tenant: str) -> list[str]:
    return [r["tag"] for r in await pool.fetch(TAGS, tenant)]


def test_an_append_whose_answer_was_lost_is_stored_once(database_url, db, session):
    tenant, sid = session

    async def body(pool: asyncpg.Pool) -> None:
        lossy = AnswerLost(PostgresEventLog(pool))
        outbox = BufferedEventLog(lossy)
        await outbox.append(pressure(tenant, sid, "b1"))
        assert outbox.pending == 1  # reported failed, so it waits ...
        assert await stored_now(pool, tenant) == ["b1.u0"]  # ... though it is stored
        await outbox.append(pressure(tenant, sid, "b2"))  # behind it, in order
        assert await outbox.flush() == 2
        assert lossy.attempts == 3 and outbox.pending == 0

    with_outbox(database_url, body)
    assert stored(db, tenant) == ["b1.u0", "b2.u0"]


def test_an_append_once_whose_answer_was_lost_is_stored_once(database_url, db, session):
    tenant, sid = session

    async def body(pool: asyncpg.Pool) -> None:
        outbox = BufferedEventLog(AnswerLost(PostgresEventLog(pool)))
        assert await outbox.append_once(pressure(tenant, sid, "f1"), "run-1") is True
        assert outbox.pending == 1
        assert await outbox.flush() == 1
        assert await outbox.append_once(pressure(tenant, sid, "f1"), "run-1") is False

    with_outbox(database_url, body)
    assert stored(db, tenant) == ["f1.u0"]


def test_events_waiting_in_the_outbox_keep_their_order(database_url, db, session):
    """An event recorded while older ones wait goes behind them, though the database is back:
    the outbox is written in the order it was recorded."""
    tenant, sid = session

    async def body(pool: asyncpg.Pool) -> None:
        outbox = BufferedEventLog(Away(PostgresEventLog(pool), calls=1))
        await outbox.append(pressure(tenant, sid, "e1"))  # the database is away: it waits
        await outbox.append(pressure(tenant, sid, "e2"))  # back, but e1 waits: behind it
        assert outbox.pending == 2 and await stored_now(pool, tenant) == []
        assert await outbox.flush() == 2

    with_outbox(database_url, body)
    assert stored(db, tenant) == ["e1.u0", "e2.u0"]


def test_the_identity_is_fixed_before_the_first_attempt(database_url, db, session):
    """The same event written by two flushes (the queue re-sent after an answer was lost
    twice) is one row with the id and time it was first given."""
    tenant, sid = session
    ids = iter([uuid.UUID(int=n) for n in range(1, 10)])

    async def body(pool: asyncpg.Pool) -> None:
        lossy = AnswerLost(PostgresEventLog(pool), lose=2)
        outbox = BufferedEventLog(lossy, new_event_id=lambda: next(ids))
        await outbox.append(pressure(tenant, sid, "b1"))
        assert await outbox.flush() == 0 and outbox.pending == 1
        assert await outbox.flush() == 1 and lossy.attempts == 3

    with_outbox(database_url, body)
    rows = db.fetch("SELECT event_id FROM context_events WHERE tenant_id = $1", tenant)
    assert [r["event_id"] for r in rows] == [uuid.UUID(int=1)]


def test_an_erased_sessions_events_are_discarded_not_retried(database_url, db, session,
                                                              caplog):
    caplog.set_level(logging.INFO, logger="context_engine")
    tenant, sid = session
    gone = f"gone-{uuid.uuid4().hex[:8]}"

    async def body(pool: asyncpg.Pool) -> None:
        # the first attempt: the session does not exist (erased)
        outbox = BufferedEventLog(Away(PostgresEventLog(pool), calls=1))
        assert await outbox.append_once(pressure(tenant, gone, "x0"), "k") is True  # queued
        await outbox.append(pressure(tenant, sid, "ok1"))  # waits behind it
        assert await outbox.flush() == 1  # the erased one discarded, the next one written
        assert outbox.pending == 0 and outbox.discarded == 1
        await outbox.append(pressure(tenant, gone, "x1"))  # first attempt, discarded at once
        assert outbox.pending == 0 and outbox.discarded == 2
        # the fence of an erased session: Build answers NOT_FOUND
        with pytest.raises(SessionNotFound):
            await outbox.append_once_durably(pressure(tenant, gone, "x2"), "run")
        # the flush loop goes on
        outbox.start()
        await outbox.append(pressure(tenant, sid, "ok2"))
        await outbox.close()

    with_outbox(database_url, body)
    assert stored(db, tenant) == ["ok1.u0", "ok2.u0"]
    discarded = [getattr(r, "fields", {}) for r in caplog.records
                 if r.getMessage() == "event_discarded"]
    assert [(d["type"], d["tenant"], d["reason"]) for d in discarded] == [
        ("context.budget.pressure", tenant, "session_erased")] * 2
    assert not db.fetch("SELECT 1 FROM idempotency_keys WHERE tenant_id = $1", tenant)


def test_an_event_of_a_day_past_retention_is_discarded(database_url, db, session, caplog):
    """Its day's partition is gone (an outage longer than the retention): waiting would never
    help, so it is discarded, logged and counted, and the queue behind it drains."""
    caplog.set_level(logging.INFO, logger="context_engine")
    tenant, sid = session
    long_ago = datetime(2001, 1, 1, 12, tzinfo=UTC)

    async def body(pool: asyncpg.Pool) -> None:
        outbox = BufferedEventLog(Away(PostgresEventLog(pool), calls=1))
        old = pressure(tenant, sid, "old").identified(uuid.uuid4, lambda: long_ago)
        await outbox.append(old)  # the database is away: it waits
        await outbox.append(pressure(tenant, sid, "new"))
        assert await outbox.flush() == 1
        assert outbox.pending == 0 and outbox.discarded == 1

    with_outbox(database_url, body)
    assert stored(db, tenant) == ["new.u0"]
    (discarded,) = [getattr(r, "fields", {}) for r in caplog.records
                    if r.getMessage() == "event_discarded"]
    assert discarded["reason"] == "past_retention" and discarded["tenant"] == tenant


def test_a_keyed_event_that_waited_is_written_under_its_key(database_url, db, session):
    """An ``append_once`` event queued while the database was away is written by the flush
    under its key: the key is then taken, and a second event under it is not stored."""
    tenant, sid = session

    async def body(pool: asyncpg.Pool) -> None:
        outbox = BufferedEventLog(Away(PostgresEventLog(pool), calls=1))
        assert await outbox.append_once(pressure(tenant, sid, "k1"), "once-1")
        assert outbox.pending == 1
        assert await outbox.flush() == 1
        assert not await outbox.append_once(pressure(tenant, sid, "k2"), "once-1")

    with_outbox(database_url, body)
    assert stored(db, tenant) == ["k1.u0"]
    assert db.val("SELECT count(*) FROM idempotency_keys WHERE tenant_id = $1 AND key = $2",
                  tenant, "once-1") == 1


def test_closing_the_outbox_writes_what_waits(database_url, db, session):
    tenant, sid = session

    async def body(pool: asyncpg.Pool) -> None:
        outbox = BufferedEventLog(Away(PostgresEventLog(pool), calls=1))
        await outbox.append(pressure(tenant, sid, "c1"))
        await outbox.append(pressure(tenant, sid, "c2"))
        assert outbox.pending == 2
        await outbox.close()  # one last attempt, the database being back
        assert outbox.pending == 0

    with_outbox(database_url, body)
    assert stored(db, tenant) == ["c1.u0", "c2.u0"]
