"""PlanStore on PostgreSQL: one row per epoch, serialized per session by a row lock."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple
from uuid import UUID, uuid4

import asyncpg
import orjson
from opentelemetry.trace import NoOpTracer, Tracer

from context_engine.adapters.postgres import queries
from context_engine.adapters.postgres.errors import translated
from context_engine.clock import SYSTEM_CLOCK, Clock
from context_engine.domain.calibration import Calibration, Reconciled
from context_engine.domain.canonical import canonical_json
from context_engine.domain.compaction import (
    CompactionResult,
    result_document,
    result_from_document,
)
from context_engine.domain.errors import CountUnsettled, SessionNotFound, StoreUnavailable
from context_engine.domain.plan import ClassUsage, ContextPlan, PlanSpec
from context_engine.domain.ports import (
    ContextEvent,
    CurrentEpoch,
    Decide,
    EpochHistory,
    EpochUsage,
    EventRejected,
    IncarnationChanged,
    Reconcile,
    StoredCompaction,
    check_stored,
    key_reused,
    pinned,
    plan_event,
)
from context_engine.telemetry.logs import log
from context_engine.telemetry.tracing import db_call

NewEventId = Callable[[], UUID]


class ClaimedEpoch(NamedTuple):
    """An epoch a claim turned counted: its row's key, and what counting it takes."""

    tenant_id: str
    session_id: str
    epoch: int
    reason: str
    prefix_tokens: int

    @property
    def key(self) -> tuple[str, str, int]:
        return self.tenant_id, self.session_id, self.epoch


# Where a claim of epochs' counts whose COMMIT went unanswered goes, to be settled by the
# process's maintenance cycles (``Maintenance.keep``): its transaction's id, the value it wrote
# in its rows' ``count_claim`` and its epochs.
KeepUnsettled = Callable[[str, str, tuple[ClaimedEpoch, ...]], None]
# How long an idempotency key of Rotate, ReportUsage or Compact answers a retry with the first
# call's outcome (CE_IDEMPOTENCY_KEY_TTL_HOURS); after it the same key is a new request.
KEY_TTL = timedelta(hours=24)


class PartitionMissing(StoreUnavailable):
    """No partition of ``context_events`` holds the event's day: the partitions ahead have not
    been created (maintenance has not run, or the clock is off by more than
    CE_EVENT_PARTITIONS_AHEAD_DAYS), or the day was dropped by retention. Nothing was written;
    the caller may retry once the partition exists."""

    def __init__(self, event: ContextEvent) -> None:
        self.event = event
        super().__init__(f"no partition of context_events for {event.created_at}")

    def metadata(self) -> dict[str, str]:
        day = self.event.created_at
        return {"cause": "PartitionMissing", **({"created_at": day.isoformat()} if day else {})}


def event_json(payload: dict[str, Any]) -> str:
    """An event's payload as the JSON text its jsonb column is written from: sorted keys, no
    insignificant whitespace, UTF-8. For what the service's payloads hold (strings, 64-bit
    integers, booleans, None, lists and string-keyed objects) it is ``canonical_json``'s text;
    a float may be spelled otherwise (``1e-7`` for ``1e-07``: the same jsonb value), a
    non-finite float would be written as null (the payloads' floats are validated finite) and
    a larger integer or a key that is not a string raises TypeError. orjson, since a pressure
    event, written on every Build of a long session that yields, is on the Build's path: about
    6x faster than the standard encoder on item ids."""
    return orjson.dumps(payload, option=orjson.OPT_SORT_KEYS).decode()


async def insert_event(conn: Any, event: ContextEvent, *, timeout: float) -> None:
    """Write one identified event (``ContextEvent.identified``) on ``conn`` (a connection in
    the caller's transaction, or the pool). Writing it again stores nothing new. Its session
    erased, or, for an event made for one incarnation (``event.incarnation``), another
    incarnation now: ``EventRejected`` (SESSION_ERASED); a payload PostgreSQL refuses (a data
    exception): ``EventRejected`` (UNSTORABLE); no partition for its day: ``PartitionMissing``,
    logged."""
    if event.event_id is None or event.created_at is None:
        raise ValueError("an event is written with its identity (ContextEvent.identified)")
    try:
        if event.incarnation is None:
            await conn.execute(queries.INSERT_EVENT, event.event_id, event.created_at,
                               event.tenant_id, event.session_id, event.epoch, event.type,
                               event_json(event.payload), timeout=timeout)
        elif not await conn.fetchval(queries.INSERT_EVENT_OF_INCARNATION, event.event_id,
                                     event.created_at, event.tenant_id, event.session_id,
                                     event.epoch, event.type, event_json(event.payload),
                                     event.incarnation, timeout=timeout):
            raise EventRejected(event, EventRejected.SESSION_ERASED)
    except asyncpg.ForeignKeyViolationError as exc:
        raise EventRejected(event, EventRejected.SESSION_ERASED) from exc
    except asyncpg.DataError as exc:  # never storable: not retried at an outbox queue's head
        raise EventRejected(event, EventRejected.UNSTORABLE) from exc
    except asyncpg.CheckViolationError as exc:
        if getattr(exc, "constraint_name", None):  # a constraint of the table: not routing
            raise
        log("event_partition_missing", logging.ERROR, type=event.type, tenant=event.tenant_id,
            created_at=event.created_at.isoformat(),
            advice="the maintenance cycle creates partitions ahead "
                   "(CE_EVENT_PARTITIONS_AHEAD_DAYS); check its log lines and the clock")
        raise PartitionMissing(event) from exc


def _plan_from_row(row: asyncpg.Record) -> ContextPlan:
    # Parse and rebuild from the canonical text (jsonb would have rewritten numbers); the
    # canonical form is then re-derived, so stored key order can never matter.
    document = json.loads(row["spec_text"])
    spec = PlanSpec.from_canonical(document)
    classes = tuple(ClassUsage(**c) for c in json.loads(row["classes"]))
    return ContextPlan(tenant_id=row["tenant_id"], session_id=row["session_id"],
                       epoch=row["epoch"], reason=row["reason"], spec=spec,
                       prefix_sha256=row["prefix_sha256"], prefix_tokens=row["prefix_tokens"],
                       classes=classes, created_at=row["created_at"], recorded=document,
                       incarnation=int(row["incarnation"]), counted=bool(row["counted"]))


async def _same_incarnation(conn: Any, tenant_id: str, session_id: str,
                            incarnation: int | None, *, timeout: float) -> None:
    """The session is still the incarnation a write is made for (its row then held until the
    transaction ends); erased: SessionNotFound; erased and planned again: IncarnationChanged."""
    if incarnation is None:
        return
    found = await conn.fetchval(queries.SESSION_INCARNATION, tenant_id, session_id,
                                timeout=timeout)
    if found is None:
        raise SessionNotFound(tenant_id, session_id)
    if int(found) != incarnation:
        raise IncarnationChanged(tenant_id, session_id, incarnation, int(found))


@contextmanager
def _session_required(tenant_id: str, session_id: str) -> Iterator[None]:
    """A keyed write names its session, whose row the foreign key needs: a session that does
    not exist (never planned, or erased meanwhile) is SessionNotFound, and nothing is
    written."""
    try:
        yield
    except asyncpg.ForeignKeyViolationError as exc:
        raise SessionNotFound(tenant_id, session_id) from exc


def _classes_json(plan: ContextPlan) -> str:
    return canonical_json([{"class_name": c.class_name, "tokens": c.tokens, "cap": c.cap,
                            "items": c.items, "item_cap": c.item_cap} for c in plan.classes])


class PostgresPlanStore:
    def __init__(self, pool: asyncpg.Pool, *, command_timeout: float = 5.0,
                 tracer: Tracer | None = None, clock: Clock = SYSTEM_CLOCK,
                 new_event_id: NewEventId = uuid4, key_ttl: timedelta = KEY_TTL,
                 unsettled: KeepUnsettled | None = None) -> None:
        """``unsettled``: where ``claim_count`` hands a claim whose COMMIT went unanswered
        (without it, such a claim is logged ``epoch_count_lost``: nothing would settle it)."""
        self._pool = pool
        self._unsettled = unsettled
        self._key_ttl = key_ttl
        self._timeout = command_timeout
        self._tracer = tracer or NoOpTracer()
        self._clock = clock
        self._new_event_id = new_event_id

    async def get(self, tenant_id: str, session_id: str,
                  epoch: int | None = None) -> ContextPlan | None:
        with db_call(self._tracer, "plans.get"):
            return await self._get(tenant_id, session_id, epoch)

    async def _get(self, tenant_id: str, session_id: str,
                   epoch: int | None) -> ContextPlan | None:
        async with translated(), self._pool.acquire(timeout=self._timeout) as conn:
            if epoch is None:
                row = await conn.fetchrow(queries.GET_CURRENT_PLAN, tenant_id, session_id,
                                          timeout=self._timeout)
            else:
                row = await conn.fetchrow(queries.GET_PLAN, tenant_id, session_id, epoch,
                                          timeout=self._timeout)
        return None if row is None else _plan_from_row(row)

    async def current_epoch(self, tenant_id: str, session_id: str) -> int | None:
        with db_call(self._tracer, "sessions.current_epoch"):
            async with translated(), self._pool.acquire(timeout=self._timeout) as conn:
                epoch = await conn.fetchval(queries.CURRENT_EPOCH, tenant_id, session_id,
                                            timeout=self._timeout)
        return int(epoch) if epoch else None

    async def current(self, tenant_id: str, session_id: str) -> CurrentEpoch | None:
        with db_call(self._tracer, "sessions.current"):
            async with translated(), self._pool.acquire(timeout=self._timeout) as conn:
                row = await conn.fetchrow(queries.CURRENT_SESSION, tenant_id, session_id,
                                          timeout=self._timeout)
        if row is None or not row["current_epoch"]:
            return None
        return CurrentEpoch(int(row["incarnation"]), int(row["current_epoch"]))

    async def incarnation(self, tenant_id: str, session_id: str, epoch: int) -> int | None:
        with db_call(self._tracer, "plans.incarnation"):
            async with translated(), self._pool.acquire(timeout=self._timeout) as conn:
                found = await conn.fetchval(queries.PLAN_INCARNATION, tenant_id,
                                            session_id, epoch, timeout=self._timeout)
        return None if found is None else int(found)

    async def pin(self, tenant_id: str, session_id: str, decide: Decide, *,
                  idempotency_key: str | None = None, fingerprint: str = "",
                  then: Callable[[ContextPlan], object] | None = None
                  ) -> tuple[ContextPlan, bool]:
        with db_call(self._tracer, "plans.pin") as span:
            plan, created = await self._pin(tenant_id, session_id, decide,
                                            idempotency_key=idempotency_key,
                                            fingerprint=fingerprint, then=then)
            span.set_attribute("context_engine.epoch", plan.epoch)
            span.set_attribute("context_engine.created", created)
            return plan, created

    async def _pin(self, tenant_id: str, session_id: str, decide: Decide, *,
                   idempotency_key: str | None, fingerprint: str,
                   then: Callable[[ContextPlan], object] | None) -> tuple[ContextPlan, bool]:
        async with (translated(), self._pool.acquire(timeout=self._timeout) as conn,
                    conn.transaction()):
            if idempotency_key is not None:
                # the session's row first, as the key's foreign key takes it for a new key: a
                # key claimed anew (expired) changes no reference, so takes no lock of it, and
                # an erasure then deadlocked with this call (the key's row, then the session's)
                await conn.fetchval(queries.SESSION_INCARNATION, tenant_id, session_id,
                                    timeout=self._timeout)
                with _session_required(tenant_id, session_id):  # Rotate needs a session
                    claimed = await conn.fetchval(queries.CLAIM_KEY, tenant_id, "Rotate",
                                                  idempotency_key, session_id, self._key_ttl,
                                                  timeout=self._timeout)
                if claimed is None:  # a retry: the epoch the first call left current
                    stored = json.loads(await conn.fetchval(
                        queries.GET_KEY, tenant_id, "Rotate", idempotency_key,
                        timeout=self._timeout))
                    if (stored.get("session_id"), stored.get("fingerprint")) != (
                            session_id, fingerprint):
                        raise key_reused()
                    row = await conn.fetchrow(queries.GET_PLAN, tenant_id, session_id,
                                              stored["epoch"], timeout=self._timeout)
                    return _plan_from_row(row), False
            locked = await conn.fetchrow(queries.LOCK_SESSION, tenant_id, session_id,
                                         timeout=self._timeout)
            epoch, incarnation = int(locked["current_epoch"]), int(locked["incarnation"])
            if locked["inserted"]:
                incarnation = int(await conn.fetchval(queries.NUMBER_SESSION, tenant_id,
                                                      session_id, timeout=self._timeout))
            current = None
            if epoch:
                row = await conn.fetchrow(queries.GET_PLAN, tenant_id, session_id, epoch,
                                          timeout=self._timeout)
                current = _plan_from_row(row)
            rotation = decide(current)  # may raise: the transaction rolls back
            if rotation is None:
                assert current is not None
                return current, False
            plan = replace(pinned(tenant_id, session_id, epoch + 1, rotation),
                           incarnation=incarnation)
            created_at = await self._insert(conn, plan)
            if idempotency_key is not None:
                await conn.execute(queries.SET_KEY_RESPONSE, tenant_id, "Rotate",
                                   idempotency_key,
                                   canonical_json({"epoch": plan.epoch, "session_id": session_id,
                                                   "fingerprint": fingerprint}),
                                   timeout=self._timeout)
            plan = replace(plan, created_at=created_at)
            if then is not None:  # before COMMIT: what it raises (a response refused) rolls
                then(plan)  # the epoch, its event and the key back
            return plan, True

    async def claim_count(self, plan: ContextPlan) -> bool:
        """In a transaction of its own: one that failed before its COMMIT was sent rolled back
        (StoreUnavailable: the epoch is uncounted still, for the next call to read it or a
        maintenance cycle). One whose COMMIT was sent and went unanswered may have committed:
        it is handed, with its transaction's id and the value it wrote in the row
        (``count_claim``), to the process's maintenance cycles, which count the epoch once
        that transaction has ended if the row shows that value (CountUnsettled)."""
        xid: str | None = None  # the claim's transaction, once its UPDATE turned the row
        claim = str(uuid4())  # written in the row: what tells this claim committed
        with db_call(self._tracer, "plans.claim_count"):
            try:
                async with (translated(), self._pool.acquire(timeout=self._timeout) as conn,
                            conn.transaction()):
                    found = await conn.fetchval(queries.CLAIM_EPOCH_COUNT, plan.tenant_id,
                                                plan.session_id, plan.epoch, plan.incarnation,
                                                claim, timeout=self._timeout)
                    xid = None if found is None else str(found)
            except BaseException as exc:
                if xid is None:  # rolled back: nothing claimed
                    raise
                self._keep_unsettled(plan, xid, claim)  # its COMMIT sent: committed or not?
                if isinstance(exc, Exception):
                    raise CountUnsettled(f"the claim's COMMIT went unanswered: "
                                         f"{type(exc).__name__}") from exc
                raise
        return xid is not None

    def _keep_unsettled(self, plan: ContextPlan, xid: str, claim: str) -> None:
        epochs = (ClaimedEpoch(plan.tenant_id, plan.session_id, plan.epoch, plan.reason,
                               plan.prefix_tokens),)
        if self._unsettled is None:
            log("epoch_count_lost", logging.WARNING, epochs=1, reason="no_maintenance",
                xid=xid)
            return
        self._unsettled(xid, claim, epochs)

    async def _insert(self, conn: Any, plan: ContextPlan) -> datetime:
        spec = plan.spec
        created_at = await conn.fetchval(
            queries.INSERT_PLAN, plan.tenant_id, plan.session_id, plan.epoch, plan.reason,
            spec.canonical_json(), plan.prefix_sha256, plan.prefix_tokens, _classes_json(plan),
            spec.model.model_id, spec.tokenizer, list(spec.tool_names),
            list(spec.deferred_tool_names), list(spec.skipped_tool_names),
            list(spec.authority_scope_hashes or ()), spec.builder_version, spec.assets.version,
            spec.cache_ttl, timeout=self._timeout)
        status = await conn.execute(queries.ADVANCE_SESSION, plan.tenant_id, plan.session_id,
                                    plan.epoch, timeout=self._timeout)
        if status != "UPDATE 1":  # the row lock makes this unreachable; never skip an epoch
            raise RuntimeError(f"session epoch did not advance to {plan.epoch}: {status}")
        event = plan_event(plan).identified(self._new_event_id, self._clock.now)
        await insert_event(conn, event, timeout=self._timeout)
        assert isinstance(created_at, datetime)
        return created_at


class PostgresEventLog:
    """The outbox on ``context_events``. An event without an identity gets one here (an id
    from ``new_event_id`` and the clock's time); a caller that may retry gives it one first,
    and a retry of a write that did land then stores nothing new. An event whose payload
    PostgreSQL refuses (a data exception) is ``EventRejected`` (UNSTORABLE): writing it again
    would fail again."""

    def __init__(self, pool: asyncpg.Pool, *, command_timeout: float = 5.0,
                 tracer: Tracer | None = None, clock: Clock = SYSTEM_CLOCK,
                 new_event_id: NewEventId = uuid4) -> None:
        self._pool = pool
        self._timeout = command_timeout
        self._tracer = tracer or NoOpTracer()
        self._clock = clock
        self._new_event_id = new_event_id

    def _identified(self, event: ContextEvent) -> ContextEvent:
        return event.identified(self._new_event_id, self._clock.now)

    def _rejected_when_past(self, missing: PartitionMissing) -> EventRejected | None:
        """A day before today has no partition: it was dropped by retention (or never made,
        and maintenance only makes today's and later ones), so waiting will not help."""
        created = missing.event.created_at
        assert created is not None
        today = self._clock.now().astimezone(UTC).date()
        if created.astimezone(UTC).date() < today:
            return EventRejected(missing.event, EventRejected.PAST_RETENTION)
        return None

    async def append(self, event: ContextEvent) -> None:
        with db_call(self._tracer, "events.append") as span:
            span.set_attribute("context_engine.event_type", event.type)
            await self._append(self._identified(event))

    async def _append(self, event: ContextEvent) -> None:
        try:
            # a connection waited for no longer than a query (the pool's own execute waits
            # for one without a bound): past it, StoreUnavailable, and an outbox keeps it
            async with translated(), self._pool.acquire(timeout=self._timeout) as conn:
                await insert_event(conn, event, timeout=self._timeout)
        except PartitionMissing as missing:
            rejected = self._rejected_when_past(missing)
            if rejected is None:
                raise
            raise rejected from missing

    async def append_once(self, event: ContextEvent, key: str, *,
                          incarnation: int | None = None) -> bool:
        with db_call(self._tracer, "events.append_once") as span:
            span.set_attribute("context_engine.event_type", event.type)
            return await self._append_once(self._identified(event), key, incarnation)

    async def append_once_durably(self, event: ContextEvent, key: str, *,
                                  incarnation: int | None = None) -> bool:
        # every write here is durable or raises; a fence of an erased session is NOT_FOUND
        try:
            return await self.append_once(event, key, incarnation=incarnation)
        except EventRejected as exc:
            if exc.reason == EventRejected.SESSION_ERASED:
                raise SessionNotFound(event.tenant_id, event.session_id) from exc
            raise StoreUnavailable(str(exc)) from exc

    async def _append_once(self, event: ContextEvent, key: str,
                           incarnation: int | None) -> bool:
        try:
            async with (translated(), self._pool.acquire(timeout=self._timeout) as conn,
                        conn.transaction()):
                await _same_incarnation(conn, event.tenant_id, event.session_id, incarnation,
                                        timeout=self._timeout)
                try:
                    claimed = await conn.fetchval(queries.CLAIM_KEY, event.tenant_id,
                                                  event.type, key, event.session_id, None,
                                                  timeout=self._timeout)
                except asyncpg.ForeignKeyViolationError as exc:  # the key names its session
                    raise EventRejected(event, EventRejected.SESSION_ERASED) from exc
                if claimed is None:
                    return False
                await insert_event(conn, event, timeout=self._timeout)
                return True
        except PartitionMissing as missing:
            rejected = self._rejected_when_past(missing)
            if rejected is None:
                raise
            raise rejected from missing


def _calibration(row: asyncpg.Record | None) -> Calibration | None:
    if row is None or row["reports"] == 0:  # a placeholder row is no calibration yet
        return None
    return Calibration(model_id=row["model_id"], encoding=row["encoding"],
                       factor=float(row["factor"]), reports=int(row["reports"]))


def _reconciled_json(r: Reconciled, fingerprint: str) -> str:
    c = r.calibration
    return canonical_json({"model_id": c.model_id, "encoding": c.encoding, "factor": c.factor,
                           "reports": c.reports, "previous_factor": r.previous_factor,
                           "error_ratio": r.error_ratio, "fingerprint": fingerprint})


def _reconciled_from(text: str) -> Reconciled:
    d = json.loads(text)
    return Reconciled(calibration=Calibration(model_id=d["model_id"], encoding=d["encoding"],
                                              factor=d["factor"], reports=d["reports"]),
                      previous_factor=d["previous_factor"], error_ratio=d["error_ratio"])


class PostgresCalibrationStore:
    RPC = "ReportUsage"

    def __init__(self, pool: asyncpg.Pool, *, command_timeout: float = 5.0,
                 tracer: Tracer | None = None, key_ttl: timedelta = KEY_TTL) -> None:
        self._pool = pool
        self._timeout = command_timeout
        self._tracer = tracer or NoOpTracer()
        self._key_ttl = key_ttl

    async def calibration(self, tenant_id: str, model_id: str) -> Calibration | None:
        with db_call(self._tracer, "calibrations.get"):
            return await self._calibration(tenant_id, model_id)

    async def _calibration(self, tenant_id: str, model_id: str) -> Calibration | None:
        async with translated(), self._pool.acquire(timeout=self._timeout) as conn:
            row = await conn.fetchrow(queries.GET_CALIBRATION, tenant_id, model_id,
                                      timeout=self._timeout)
        return _calibration(row)

    async def latest_factors(self) -> list[tuple[str, float]]:
        with db_call(self._tracer, "calibrations.latest"):
            async with translated(), self._pool.acquire(timeout=self._timeout) as conn:
                rows = await conn.fetch(queries.LATEST_FACTORS, timeout=self._timeout)
        return [(row["model_id"], float(row["factor"])) for row in rows]

    async def reconcile(self, tenant_id: str, model_id: str, idempotency_key: str,
                        apply: Reconcile, fingerprint: str = "", *,
                        usage: EpochUsage) -> tuple[Reconciled, EpochHistory | None]:
        with db_call(self._tracer, "calibrations.reconcile"):
            return await self._reconcile(tenant_id, model_id, idempotency_key, apply,
                                         fingerprint, usage)

    async def _reconcile(self, tenant_id: str, model_id: str, idempotency_key: str,
                         apply: Reconcile, fingerprint: str,
                         usage: EpochUsage) -> tuple[Reconciled, EpochHistory | None]:
        async with (translated(), self._pool.acquire(timeout=self._timeout) as conn,
                    conn.transaction()):
            await _same_incarnation(conn, tenant_id, usage.session_id, usage.incarnation,
                                    timeout=self._timeout)
            with _session_required(tenant_id, usage.session_id):
                claimed = await conn.fetchval(queries.CLAIM_KEY, tenant_id, self.RPC,
                                              idempotency_key, usage.session_id, self._key_ttl,
                                              timeout=self._timeout)
            if claimed is None:  # a retry: the first report's outcome, counted once
                stored = await conn.fetchval(queries.GET_KEY, tenant_id, self.RPC,
                                             idempotency_key, timeout=self._timeout)
                if json.loads(stored).get("fingerprint") != fingerprint:
                    raise key_reused()
                return _reconciled_from(stored), None
            await conn.execute(queries.ENSURE_CALIBRATION, tenant_id, model_id,
                               timeout=self._timeout)
            row = await conn.fetchrow(queries.LOCK_CALIBRATION, tenant_id, model_id,
                                      timeout=self._timeout)
            outcome = apply(_calibration(row))
            c = outcome.calibration
            await conn.execute(queries.UPSERT_CALIBRATION, tenant_id, model_id, c.encoding,
                               c.factor, c.reports, timeout=self._timeout)
            await conn.execute(queries.SET_KEY_RESPONSE, tenant_id, self.RPC, idempotency_key,
                               _reconciled_json(outcome, fingerprint), timeout=self._timeout)
            epoch = await conn.fetchrow(queries.COUNT_EPOCH_REPORT, tenant_id, usage.session_id,
                                        usage.epoch, usage.input_tokens, timeout=self._timeout)
            return outcome, EpochHistory(reports_before=int(epoch["reports"]) - 1,
                                         previous_input_tokens=int(
                                             epoch["previous_input_tokens"] or 0))


def _stored_compaction(row: asyncpg.Record) -> StoredCompaction:
    return StoredCompaction(session_id=row["session_id"], fingerprint=row["fingerprint"],
                            result=result_from_document(json.loads(row["result"])))


class PostgresCompactionStore:
    def __init__(self, pool: asyncpg.Pool, *, command_timeout: float = 5.0,
                 tracer: Tracer | None = None, clock: Clock = SYSTEM_CLOCK,
                 new_event_id: NewEventId = uuid4, key_ttl: timedelta = KEY_TTL) -> None:
        self._pool = pool
        self._key_ttl = key_ttl
        self._timeout = command_timeout
        self._tracer = tracer or NoOpTracer()
        self._clock = clock
        self._new_event_id = new_event_id

    async def stored(self, tenant_id: str, idempotency_key: str) -> StoredCompaction | None:
        with db_call(self._tracer, "compactions.stored"):
            return await self._stored(tenant_id, idempotency_key)

    async def _stored(self, tenant_id: str, idempotency_key: str) -> StoredCompaction | None:
        async with translated(), self._pool.acquire(timeout=self._timeout) as conn:
            row = await conn.fetchrow(queries.GET_LIVE_COMPACTION, tenant_id,
                                      idempotency_key, self._key_ttl, timeout=self._timeout)
        return None if row is None else _stored_compaction(row)

    async def save(self, tenant_id: str, session_id: str, idempotency_key: str,
                   fingerprint: str, result: CompactionResult, event: ContextEvent, *,
                   incarnation: int | None = None) -> tuple[CompactionResult, bool]:
        with db_call(self._tracer, "compactions.save"):
            return await self._save(tenant_id, session_id, idempotency_key, fingerprint,
                                    result, event, incarnation)

    async def _save(self, tenant_id: str, session_id: str, idempotency_key: str,
                    fingerprint: str, result: CompactionResult, event: ContextEvent,
                    incarnation: int | None) -> tuple[CompactionResult, bool]:
        async with (translated(), self._pool.acquire(timeout=self._timeout) as conn,
                    conn.transaction()):
            # the session's row first (see _pin: a record claimed anew takes no lock of it);
            # erased and planned again since the compaction's plan was read: nothing stored
            found = await conn.fetchval(queries.SESSION_INCARNATION, tenant_id, session_id,
                                        timeout=self._timeout)
            if incarnation is not None and found is not None and int(found) != incarnation:
                raise IncarnationChanged(tenant_id, session_id, incarnation, int(found))
            with _session_required(tenant_id, session_id):  # erased since it was loaded
                claimed = await conn.fetchval(
                    queries.CLAIM_COMPACTION, tenant_id, idempotency_key, session_id,
                    fingerprint, result.depth, result.replaced_through_sequence,
                    result.compactor_version, canonical_json(result_document(result)),
                    self._key_ttl, timeout=self._timeout)
            if claimed is None:  # a concurrent retry stored it first
                row = await conn.fetchrow(queries.GET_COMPACTION, tenant_id, idempotency_key,
                                          timeout=self._timeout)
                return check_stored(_stored_compaction(row), session_id, fingerprint), False
            try:
                await insert_event(conn, event.identified(self._new_event_id, self._clock.now),
                                   timeout=self._timeout)
            except EventRejected as exc:  # the session was erased meanwhile: nothing stored
                raise SessionNotFound(tenant_id, session_id) from exc
            return result, True
