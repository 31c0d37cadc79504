"""Read-only access to one session's epochs and context events, for ``context-engine inspect``.

Every statement runs inside one explicit READ ONLY, REPEATABLE READ transaction: PostgreSQL
itself refuses any write, and the epochs and events printed come from one consistent snapshot.
Connected directly, the connection's transactions also default to READ ONLY; behind a pooler in
transaction mode a session default cannot hold (the pooler refuses it in the start-up packet,
and the next transaction may run on another server connection), so the explicit transaction is
the guard there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg

from context_engine.adapters.postgres.pool import connect
from context_engine.config import Pooler
from context_engine.domain.plan import ClassUsage

SESSION = """
SELECT current_epoch, created_at, updated_at FROM sessions
WHERE tenant_id = $1 AND session_id = $2"""

# ``spec`` and ``spec_text`` are left out on purpose: the pinned specification holds the
# instructions, persona and tool texts, which an operator's terminal must never show.
EPOCHS = """
SELECT epoch, reason, created_at, prefix_sha256, prefix_tokens, classes::text AS classes,
    model_id, tokenizer, tool_names, deferred_tool_names, skipped_tool_names,
    authority_scope_hashes, builder_version, policy_version, cache_ttl
FROM plans
WHERE tenant_id = $1 AND session_id = $2 AND ($3::integer IS NULL OR epoch = $3)
ORDER BY epoch"""

EVENT_COUNT = """
SELECT count(*) FROM context_events
WHERE tenant_id = $1 AND session_id = $2 AND ($3::integer IS NULL OR epoch = $3)"""

# The most recent ``$4`` events (highest ids), returned oldest first.
RECENT_EVENTS = """
SELECT id, epoch, type, payload::text AS payload, created_at FROM (
    SELECT id, epoch, type, payload, created_at FROM context_events
    WHERE tenant_id = $1 AND session_id = $2 AND ($3::integer IS NULL OR epoch = $3)
    ORDER BY id DESC LIMIT $4
) recent
ORDER BY id"""

READ_ONLY_SETTINGS = {
    "default_transaction_read_only": "on",
    "application_name": "context-engine inspect",
}
# Behind a pooler in transaction mode: only what the pooler tracks per client.
POOLED_SETTINGS = {"application_name": "context-engine inspect"}


@dataclass(frozen=True, kw_only=True, slots=True)
class StoredEpoch:
    """One pinned plan row, without its specification text."""

    epoch: int
    reason: str
    created_at: datetime
    prefix_sha256: str
    prefix_tokens: int
    classes: tuple[ClassUsage, ...]
    model_id: str
    tokenizer: str
    tool_names: tuple[str, ...]
    deferred_tool_names: tuple[str, ...]
    skipped_tool_names: tuple[str, ...]
    authority_scope_hashes: tuple[str, ...]
    builder_version: str
    policy_version: str
    cache_ttl: str


@dataclass(frozen=True, kw_only=True, slots=True)
class StoredEvent:
    """One row of the context event outbox (its payload carries ids, counts and hashes)."""

    id: int
    epoch: int | None
    type: str
    payload: dict[str, Any]
    created_at: datetime


@dataclass(frozen=True, kw_only=True, slots=True)
class SessionRecord:
    """A session as the database holds it: its epochs and its most recent events."""

    tenant_id: str
    session_id: str
    current_epoch: int
    created_at: datetime
    updated_at: datetime
    epochs: tuple[StoredEpoch, ...]
    events: tuple[StoredEvent, ...]
    events_total: int


async def connect_read_only(dsn: str, *, pooler: Pooler = Pooler.NONE,
                            timeout: float = 10.0) -> asyncpg.Connection:
    """A connection on which every transaction is READ ONLY unless a statement asks
    otherwise (``read_session`` never does); behind a pooler in transaction mode, a connection
    on which only ``read_session``'s explicit transaction is READ ONLY."""
    settings = POOLED_SETTINGS if pooler is Pooler.TRANSACTION else READ_ONLY_SETTINGS
    return await connect(dsn, pooler=pooler, timeout=timeout, server_settings=settings)


def _classes(text: str) -> tuple[ClassUsage, ...]:
    return tuple(ClassUsage(class_name=str(c["class_name"]), tokens=int(c["tokens"]),
                            cap=int(c["cap"]), items=int(c["items"]),
                            item_cap=int(c["item_cap"]))
                 for c in json.loads(text))


def _epoch(row: asyncpg.Record) -> StoredEpoch:
    return StoredEpoch(
        epoch=int(row["epoch"]), reason=row["reason"], created_at=row["created_at"],
        prefix_sha256=row["prefix_sha256"], prefix_tokens=int(row["prefix_tokens"]),
        classes=_classes(row["classes"]), model_id=row["model_id"], tokenizer=row["tokenizer"],
        tool_names=tuple(row["tool_names"]),
        deferred_tool_names=tuple(row["deferred_tool_names"]),
        skipped_tool_names=tuple(row["skipped_tool_names"]),
        authority_scope_hashes=tuple(row["authority_scope_hashes"]),
        builder_version=row["builder_version"], policy_version=row["policy_version"],
        cache_ttl=row["cache_ttl"])


def _event(row: asyncpg.Record) -> StoredEvent:
    payload = json.loads(row["payload"])
    return StoredEvent(id=int(row["id"]), epoch=row["epoch"], type=row["type"],
                       payload=payload if isinstance(payload, dict) else {"value": payload},
                       created_at=row["created_at"])


async def read_session(conn: asyncpg.Connection, tenant_id: str, session_id: str, *,
                       events: int, epoch: int | None = None,
                       timeout: float = 10.0) -> SessionRecord | None:
    """The session's epochs (only ``epoch`` when given) and its last ``events`` context events
    (of that epoch when given), or None for an unknown session."""
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        session = await conn.fetchrow(SESSION, tenant_id, session_id, timeout=timeout)
        if session is None:
            return None
        plans = await conn.fetch(EPOCHS, tenant_id, session_id, epoch, timeout=timeout)
        total = await conn.fetchval(EVENT_COUNT, tenant_id, session_id, epoch, timeout=timeout)
        rows = await conn.fetch(RECENT_EVENTS, tenant_id, session_id, epoch, events,
                                timeout=timeout) if events > 0 else []
    return SessionRecord(tenant_id=tenant_id, session_id=session_id,
                         current_epoch=int(session["current_epoch"]),
                         created_at=session["created_at"], updated_at=session["updated_at"],
                         epochs=tuple(_epoch(r) for r in plans),
                         events=tuple(_event(r) for r in rows), events_total=int(total))
