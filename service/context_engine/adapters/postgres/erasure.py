"""Erasure on PostgreSQL: one session's rows (``DeleteSession``) or a whole tenant's
(``context-engine purge-tenant``), each recorded by one row of ``erasures`` that holds no content.

A session's rows go in one transaction that first locks the session's row ``FOR UPDATE`` (or,
when it has none, holds its key with an uncommitted row of its own: ``HOLD_ABSENT_SESSION``).
Every other write of a session's rows takes a key-share lock on that row through a foreign key
(its plans, context events, compactions and idempotency keys all reference it) and holds it
until its transaction ends: the erasure waits for a write that got there first, and sees its
rows; a write that comes later waits for the erasure and then fails, the session being gone (a
Build's event is discarded, a keyed write answers NOT_FOUND). So nothing of the session
survives the erasure and nothing is written for it afterwards. A ``Plan`` of the same session
id afterwards creates a new session (a new incarnation) at epoch 1.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

import asyncpg
from opentelemetry.trace import NoOpTracer, Tracer

from context_engine.adapters.postgres.errors import translated
from context_engine.domain.errors import StoreConflict
from context_engine.domain.ports import Erased
from context_engine.telemetry.tracing import db_call

# The sessions of one erasure, as a text array ($2): one session for DeleteSession, a batch of
# them for a tenant purge.
LOCK_SESSIONS = """
SELECT session_id FROM sessions WHERE tenant_id = $1 AND session_id = ANY($2::text[])
ORDER BY session_id FOR UPDATE"""

# A session with no row to lock is held by a row of the erasure's own, inserted and never
# committed (deleted with the rest): a Plan opening the session meanwhile waits on its key for
# the erasure to end, then opens it afresh. With nothing held, that Plan committed rows between
# the erasure's deletes, which then failed on a foreign key (a plan left naming a deleted
# session) or crossed the Plan's locks (a deadlock). Nothing when another transaction has the
# key (it is locked by LOCK_SESSIONS once that one commits).
HOLD_ABSENT_SESSION = """
INSERT INTO sessions (tenant_id, session_id) VALUES ($1, $2)
ON CONFLICT (tenant_id, session_id) DO NOTHING RETURNING session_id"""
# LOCK_SESSIONS or HOLD_ABSENT_SESSION succeeds within this many tries unless a session is
# created and erased again between every two of them.
HOLD_TRIES = 5

# A batch of a tenant's sessions, locked, in a stable order (purge-tenant).
LOCK_TENANT_BATCH = """
SELECT session_id FROM sessions WHERE tenant_id = $1 ORDER BY session_id LIMIT $2 FOR UPDATE"""

# Children before parents: the foreign keys refuse the other order. (kind, statement)
DELETE_SESSION_ROWS: tuple[tuple[str, str], ...] = (
    ("idempotency_keys", """
DELETE FROM idempotency_keys WHERE tenant_id = $1 AND session_id = ANY($2::text[])"""),
    ("compactions", """
DELETE FROM compactions WHERE tenant_id = $1 AND session_id = ANY($2::text[])"""),
    ("usage_rows", """
DELETE FROM epoch_usage WHERE tenant_id = $1 AND session_id = ANY($2::text[])"""),
    ("plans", """
DELETE FROM plans WHERE tenant_id = $1 AND session_id = ANY($2::text[])"""),
    ("events", """
DELETE FROM context_events WHERE tenant_id = $1 AND session_id = ANY($2::text[])"""),
    ("sessions", """
DELETE FROM sessions WHERE tenant_id = $1 AND session_id = ANY($2::text[])"""),
)

# What a tenant may still hold once its sessions are gone: idempotency keys that name no session
# (written before keys named one), rows of sessions that have no row, and the tenant's
# estimator calibrations. The tenant's API tokens and its erasure records are kept. A session
# opened meanwhile (a caller of the tenant planning while the purge runs) keeps its rows: each
# statement sees that session's row with its rows, or neither (one snapshot per statement).
_NO_SESSION = """NOT EXISTS (SELECT 1 FROM sessions s
                  WHERE s.tenant_id = x.tenant_id AND s.session_id = x.session_id)"""
DELETE_TENANT_ROWS: tuple[tuple[str, str], ...] = (
    ("idempotency_keys", f"""
DELETE FROM idempotency_keys x WHERE tenant_id = $1 AND (session_id IS NULL OR {_NO_SESSION})"""),
    ("compactions", f"DELETE FROM compactions x WHERE tenant_id = $1 AND {_NO_SESSION}"),
    ("usage_rows", f"DELETE FROM epoch_usage x WHERE tenant_id = $1 AND {_NO_SESSION}"),
    ("plans", f"DELETE FROM plans x WHERE tenant_id = $1 AND {_NO_SESSION}"),
    ("events", f"DELETE FROM context_events x WHERE tenant_id = $1 AND {_NO_SESSION}"),
    ("calibrations", "DELETE FROM estimator_calibration WHERE tenant_id = $1"),
)

# Events the migration to a partitioned outbox set aside (their session had no row), if any:
# a tenant's (its purge) or a session id's (DeleteSession, whether the id has a row again or
# none). Only migration 0006 creates the table, and only when it sets rows aside; the operator
# drops it when done, and nothing creates it again.
SET_ASIDE_EXISTS = "SELECT to_regclass($1) IS NOT NULL"  # a set-aside table, by its name
EVENTS_SET_ASIDE = "context_events_orphaned"
DELETE_ORPHANED_EVENTS = "DELETE FROM context_events_orphaned WHERE tenant_id = $1"
DELETE_SESSION_ORPHANED_EVENTS = """
DELETE FROM context_events_orphaned WHERE tenant_id = $1 AND session_id = ANY($2::text[])"""
# Likewise the compaction records migration 0007 set aside in compactions_orphaned
# (migrations/before/0007_erasure.sql): their session had no row to meet the foreign key.
COMPACTIONS_SET_ASIDE = "compactions_orphaned"
DELETE_ORPHANED_COMPACTIONS = "DELETE FROM compactions_orphaned WHERE tenant_id = $1"
DELETE_SESSION_ORPHANED_COMPACTIONS = """
DELETE FROM compactions_orphaned WHERE tenant_id = $1 AND session_id = ANY($2::text[])"""

INSERT_ERASURE = """
INSERT INTO erasures (tenant_id, scope, session_sha256, sessions, plans, events, compactions,
    idempotency_keys, usage_rows, calibrations, requested_by, erased_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)
RETURNING id"""

# A tenant purge's record, brought up to date by each batch's transaction.
UPDATE_ERASURE = """
UPDATE erasures SET sessions = $2, plans = $3, events = $4, compactions = $5,
    idempotency_keys = $6, usage_rows = $7, calibrations = $8, erased_at = $9
WHERE id = $1"""

KINDS = ("sessions", "plans", "events", "compactions", "idempotency_keys", "usage_rows",
         "calibrations")


def session_sha256(session_id: str) -> str:
    """What ``erasures`` records of an erased session: the hex SHA-256 of its id's UTF-8 bytes
    (``printf %s "$SESSION_ID" | sha256sum``)."""
    return hashlib.sha256(session_id.encode("utf-8")).hexdigest()


def _rows(status: str) -> int:
    """The row count of a command status (``DELETE 3``)."""
    return int(status.rsplit(" ", 1)[-1])


async def _hold(conn: Any, tenant_id: str, session_id: str, *, timeout: float) -> bool:
    """Locks the session's row, or holds its key with a row of the erasure's own when it has
    none (True): either way no other transaction writes the session until this one ends."""
    for _ in range(HOLD_TRIES):
        if await conn.fetch(LOCK_SESSIONS, tenant_id, [session_id], timeout=timeout):
            return False
        if await conn.fetchval(HOLD_ABSENT_SESSION, tenant_id, session_id,
                               timeout=timeout) is not None:
            return True
    raise StoreConflict(f"the session was opened and erased again {HOLD_TRIES} times while "
                        "this erasure waited for it: nothing changed; retry")


async def _delete(conn: Any, statements: Sequence[tuple[str, str]], counts: dict[str, int],
                  *args: Any, timeout: float) -> None:
    for kind, sql in statements:
        counts[kind] += _rows(await conn.execute(sql, *args, timeout=timeout))


async def _audit(conn: Any, tenant_id: str, scope: str, session_id: str | None,
                 counts: dict[str, int], requested_by: str, at: datetime,
                 timeout: float) -> int:
    found = await conn.fetchval(INSERT_ERASURE, tenant_id, scope,
                                None if session_id is None else session_sha256(session_id),
                                *(counts[k] for k in KINDS), requested_by, at, timeout=timeout)
    return int(found)


class PostgresErasure:
    def __init__(self, pool: asyncpg.Pool, *, command_timeout: float = 5.0,
                 tracer: Tracer | None = None) -> None:
        self._pool = pool
        self._timeout = command_timeout
        self._tracer = tracer or NoOpTracer()
        # set-aside tables found absent: none comes back, so no erasure asks again
        self._absent: set[str] = set()

    async def _set_aside_exists(self, conn: Any, table: str) -> bool:
        if table in self._absent:
            return False
        if await conn.fetchval(SET_ASIDE_EXISTS, table, timeout=self._timeout):
            return True
        self._absent.add(table)
        return False

    async def erase_session(self, tenant_id: str, session_id: str, *, requested_by: str,
                            at: datetime) -> Erased:
        """One transaction: lock the session's row, delete its rows (its events that
        migration 0006 set aside in ``context_events_orphaned`` and its compaction records
        that 0007 set aside in ``compactions_orphaned`` included, while those tables exist),
        and record the erasure when anything was removed (erasing what is not there
        records nothing)."""
        with db_call(self._tracer, "sessions.erase") as span:
            counts = dict.fromkeys(KINDS, 0)
            async with (translated(), self._pool.acquire(timeout=self._timeout) as conn,
                        conn.transaction()):
                held = await _hold(conn, tenant_id, session_id, timeout=self._timeout)
                await _delete(conn, DELETE_SESSION_ROWS, counts, tenant_id, [session_id],
                              timeout=self._timeout)
                if await self._set_aside_exists(conn, EVENTS_SET_ASIDE):
                    await _delete(conn, (("events", DELETE_SESSION_ORPHANED_EVENTS),), counts,
                                  tenant_id, [session_id], timeout=self._timeout)
                if await self._set_aside_exists(conn, COMPACTIONS_SET_ASIDE):
                    await _delete(conn, (("compactions", DELETE_SESSION_ORPHANED_COMPACTIONS),),
                                  counts, tenant_id, [session_id], timeout=self._timeout)
                counts["sessions"] -= held  # the erasure's own row is no session erased
                if any(counts.values()):
                    await _audit(conn, tenant_id, "session", session_id, counts, requested_by,
                                 at, self._timeout)
            span.set_attribute("context_engine.erased_rows", sum(counts.values()))
            return Erased(**counts, erased_at=at)

    async def purge_tenant(self, tenant_id: str, *, requested_by: str,
                           now: Callable[[], datetime], batch_size: int = 500,
                           on_batch: Callable[[int], None] | None = None) -> Erased:
        """Every session of the tenant, ``batch_size`` sessions per transaction (each batch
        erased as DeleteSession erases one), then what the tenant holds outside its sessions
        (last transaction). One tenant-scope erasure record, created by the first transaction
        that removes anything and brought up to date by each later one: a purge interrupted
        midway records what it removed, and running it again finishes the job (with a record
        of its own). Sessions created meanwhile are taken by a later batch, or kept whole when
        created after the last one. ``on_batch``: told each batch's number of sessions."""
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        totals = dict.fromkeys(KINDS, 0)
        record: int | None = None
        async with translated():
            while True:
                async with (self._pool.acquire(timeout=self._timeout) as conn,
                            conn.transaction()):
                    rows = await conn.fetch(LOCK_TENANT_BATCH, tenant_id, batch_size,
                                            timeout=self._timeout)
                    sessions = [r["session_id"] for r in rows]
                    batch = dict.fromkeys(KINDS, 0)
                    if sessions:
                        await _delete(conn, DELETE_SESSION_ROWS, batch, tenant_id, sessions,
                                      timeout=self._timeout)
                    else:
                        await _delete(conn, DELETE_TENANT_ROWS, batch, tenant_id,
                                      timeout=self._timeout)
                        if await conn.fetchval(SET_ASIDE_EXISTS, EVENTS_SET_ASIDE,
                                               timeout=self._timeout):
                            await _delete(conn, (("events", DELETE_ORPHANED_EVENTS),), batch,
                                          tenant_id, timeout=self._timeout)
                        if await conn.fetchval(SET_ASIDE_EXISTS, COMPACTIONS_SET_ASIDE,
                                               timeout=self._timeout):
                            await _delete(conn, (("compactions", DELETE_ORPHANED_COMPACTIONS),),
                                          batch, tenant_id, timeout=self._timeout)
                    at = now()
                    if any(batch.values()):
                        for kind, n in batch.items():
                            totals[kind] += n
                        if record is None:
                            record = await _audit(conn, tenant_id, "tenant", None, totals,
                                                  requested_by, at, self._timeout)
                        else:
                            await conn.execute(UPDATE_ERASURE, record,
                                               *(totals[k] for k in KINDS), at,
                                               timeout=self._timeout)
                if sessions:
                    if on_batch is not None:
                        on_batch(len(sessions))
                    continue
                return Erased(**totals, erased_at=at)
