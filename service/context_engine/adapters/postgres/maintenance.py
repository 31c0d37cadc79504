"""The data lifecycle, run by the service itself: every replica runs a maintenance cycle at start
and every CE_MAINTENANCE_INTERVAL_SECONDS; one of them does the work.

A cycle:

1. creates the daily partitions of ``context_events`` for today through today +
   CE_EVENT_PARTITIONS_AHEAD_DAYS (UTC days, ``context_events_pYYYYMMDD``);
2. drops the partitions whose upper bound is at or before now - CE_EVENTS_RETENTION_DAYS (every
   row in them is older than the retention), with their rows;
3. deletes, in batches of ``batch_size`` rows, the idempotency keys of retried RPCs (Rotate,
   ReportUsage) and the compaction records (Compact's keys) older than
   CE_IDEMPOTENCY_KEY_TTL_HOURS by PostgreSQL's clock (which made them, and by which a retry
   finds them expired or not), and the fences of ``append_once_durably`` (keys named after
   an event type, ``context.snapshot.used``) made a day before the oldest day step 2 keeps,
   and none when step 2 failed: a fence lives at least as long as the event it fences (cut at
   the retention itself, it went up to a day before its event's partition; cut when step 2
   failed, or by a replica whose clock runs ahead of PostgreSQL's, before it; and a retry
   stored the event twice);
4. claims, in batches of ``batch_size``, the epochs still uncounted in the metrics
   (``plans.counted``, migration 0008) once older than ``uncounted_after`` by PostgreSQL's
   clock, and counts those its statement turned (``count_epoch``: what the epoch's writer
   counts). An epoch is written uncounted and claimed by its writer once its COMMIT answered,
   or, when that answer was lost, by the first Plan or retried Rotate key to read it; one
   whose writer's claim failed, or whose answer was lost with no call reading it again (or a
   Plan reading only the epoch after it), was counted by nothing. The claim is the writer's
   own ``UPDATE ... WHERE NOT counted``: whichever statement turns the row counts it, once,
   however a cycle races a Plan's claim or another replica's cycle. Each batch is counted once
   its COMMIT answered (a batch rolled back counts nothing, and the next cycle takes it). Each
   claim writes a value of its own in the rows it turns (``plans.count_claim``, migration
   0010). A batch whose COMMIT went unanswered (the connection lost during it) is kept, its
   epochs (with their rows' keys), that value and its transaction's id
   (``pg_current_xact_id``), by the process that claimed it alone: a pass of its own a few
   seconds later (``settle``; its next cycle, before anything else, if still unsettled; its
   stop, within two seconds), asks PostgreSQL whether that transaction is still in progress
   (``pg_xact_status``; if so, it is asked again by a later pass, each twice as late as the
   one before, or the next cycle) and, once it is not, reads the
   batch's rows: it counts, once, the epochs whose row shows the claim's value (it committed),
   and counts nothing of the others (it rolled back, or the database lost its COMMIT: their
   rows are uncounted, or counted by another claim, and a cycle claims them anew). The status
   alone does not tell: after a failover to a standby that lacked the claim's COMMIT, the
   new primary gives the claim's transaction id to a transaction of its own, and the status
   is that one's, "committed" while the claim is gone (its epochs were counted twice). An
   epoch whose row is gone (its session erased since) is counted if the status says
   committed. A writer's (or a Plan's) claim whose COMMIT went unanswered is handed to its
   process's cycles alike (``keep``: the store's ``claim_count`` runs in a transaction of its
   own, which returns its id) and settled with the batches. Not run by the cycle at start
   (``epochs=False``): a series' increments before its first scrape are lost to Prometheus'
   ``increase()``.

Every step runs in a transaction that first takes ``pg_try_advisory_xact_lock(LOCK_KEY)``
(released when the transaction ends, so nothing outlives it on the server connection and a
pooler in transaction mode may stand in between): a replica that does not get it skips the rest
of its cycle, because another one is running its own. Each step re-reads what exists under the
lock, so two cycles one after the other neither fail nor drop twice. DDL waits at most
``ddl_lock_timeout_seconds`` for the table's lock (a quarter of a second: while it waits, every
insert of an event or a session queues behind it), and tries again a few times a second apart;
a long reader of ``context_events`` then makes the partition step fail, while steps 3 and 4
still run, and the cycle is logged as failed. A cycle that fails half-way (the database went
away) logs, before it raises, what it had done: the partitions, the steps it finished and the
epochs it counted, with the epochs left unsettled. The time is the injected clock's (but for the
ages of keys, compaction records and uncounted epochs: the database's); partitions not named
``context_events_pYYYYMMDD`` are left alone. What is kept, and why for so long:
deploy/README.md "Data lifecycle".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from uuid import uuid4

import asyncpg

from context_engine.adapters.postgres.errors import UNAVAILABLE
from context_engine.adapters.postgres.store import KEY_TTL, ClaimedEpoch
from context_engine.clock import Clock
from context_engine.telemetry.logs import log

# Arbitrary but fixed key of the advisory lock a maintenance step holds ("mntc").
LOCK_KEY = 0x6D6E7463
PARENT = "context_events"
_PARTITION = re.compile(r"^context_events_p(\d{8})$")

TRY_LOCK = "SELECT pg_try_advisory_xact_lock($1)"
PARTITIONS = f"""
SELECT c.relname FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid
WHERE i.inhparent = '{PARENT}'::regclass"""
# Retry keys are named after their RPC; fences after the event type they fence ("context.").
# A retry key and a compaction record expire by PostgreSQL's clock ($1: the key TTL), the one
# that made them and that a retry's claim judges them by (queries.CLAIM_KEY): a cutoff on the
# replica's clock deleted them early when that clock ran ahead, and a retry inside the TTL was
# then run twice. A fence goes with its event's partition, which the replica's clock dates.
DELETE_KEYS = """
DELETE FROM idempotency_keys WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM idempotency_keys
    WHERE created_at < now() - $1::interval AND rpc NOT LIKE 'context.%' LIMIT $2))"""
DELETE_FENCES = """
DELETE FROM idempotency_keys WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM idempotency_keys
    WHERE created_at < $1 AND rpc LIKE 'context.%' LIMIT $2))"""
DELETE_COMPACTIONS = """
DELETE FROM compactions WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM compactions WHERE created_at < now() - $1::interval LIMIT $2))"""
# Step 4: the epochs left uncounted ($1: older than this, by PostgreSQL's clock, which dated
# them), oldest first, through the partial index plans_uncounted (migration 0009). A row a
# Plan's claim holds is skipped (that claim turns it); NOT counted is checked again on the row
# updated, so a claim committed meanwhile is never counted twice. The batch writes its own
# value in the rows ($3, plans.count_claim): what tells, when its COMMIT goes unanswered,
# whether it committed (CLAIMED_BY).
CLAIM_UNCOUNTED = """
UPDATE plans p SET counted = true, count_claim = $3::uuid
FROM (SELECT tenant_id, session_id, epoch FROM plans
      WHERE NOT counted AND created_at < now() - $1::interval
      ORDER BY created_at LIMIT $2 FOR UPDATE SKIP LOCKED) AS o
WHERE p.tenant_id = o.tenant_id AND p.session_id = o.session_id AND p.epoch = o.epoch
  AND NOT p.counted
RETURNING p.tenant_id, p.session_id, p.epoch, p.reason, p.prefix_tokens,
    pg_current_xact_id()::text AS xid"""
# Whether the transaction of a batch whose COMMIT went unanswered is still in progress (its
# rows then read as before it), and whether it committed: 'committed', 'aborted' or
# 'in progress' (NULL once too old for PostgreSQL to know, PostgreSQL 13 or later). Asked of a
# primary other than the one that gave the id (a failover), it answers for whichever
# transaction has the id there: what settles a batch is its rows (CLAIMED_BY).
XACT_STATUS = "SELECT pg_xact_status($1::text::xid8)"
# The batch's rows that still exist ($1, $2, $3: tenants, sessions, epochs), each with whether
# it shows the batch's claim ($4): counted, by that claim.
CLAIMED_BY = """
SELECT p.tenant_id, p.session_id, p.epoch,
       p.counted AND p.count_claim IS NOT DISTINCT FROM $4::uuid AS ours
FROM plans p
JOIN unnest($1::text[], $2::text[], $3::int[]) AS k(tenant_id, session_id, epoch)
  ON p.tenant_id = k.tenant_id AND p.session_id = k.session_id AND p.epoch = k.epoch"""


def partition_name(day: date) -> str:
    return f"{PARENT}_p{day:%Y%m%d}"


def partition_day(name: str) -> date | None:
    """The day a partition named by ``partition_name`` holds; None for any other name."""
    match = _PARTITION.match(name)
    if match is None:
        return None
    digits = match.group(1)
    try:
        return date(int(digits[:4]), int(digits[4:6]), int(digits[6:]))
    except ValueError:
        return None


def day_start(day: date) -> datetime:
    return datetime(day.year, day.month, day.day, tzinfo=UTC)


def create_partition_sql(day: date) -> str:
    """``CREATE TABLE IF NOT EXISTS`` of the day's partition: [day 00:00 UTC, next day)."""
    lower = day_start(day).strftime("%Y-%m-%d %H:%M:%S+00")
    upper = day_start(day + timedelta(days=1)).strftime("%Y-%m-%d %H:%M:%S+00")
    return (f'CREATE TABLE IF NOT EXISTS "{partition_name(day)}" PARTITION OF {PARENT} '
            f"FOR VALUES FROM ('{lower}') TO ('{upper}')")


def drop_partition_sql(day: date) -> str:
    return f'DROP TABLE IF EXISTS "{partition_name(day)}"'


@dataclass(frozen=True, kw_only=True, slots=True)
class Policy:
    """What a cycle keeps."""

    retention_days: int = 30
    ahead_days: int = 7
    key_ttl: timedelta = KEY_TTL
    batch_size: int = 5000
    lock_timeout_seconds: float = 5.0
    # DDL holds up every insert of the table while it waits: short waits, tried again
    ddl_lock_timeout_seconds: float = 0.25
    ddl_tries: int = 8
    ddl_retry_seconds: float = 1.0
    # An epoch uncounted this long is claimed by a cycle: far beyond the moment its writer
    # claims it (right after its COMMIT) and a caller's retry after a lost answer
    uncounted_after: timedelta = timedelta(minutes=10)

    def __post_init__(self) -> None:
        if (self.retention_days < 1 or self.ahead_days < 1 or self.batch_size < 1
                or self.ddl_tries < 1):
            raise ValueError("retention, ahead window, batch size and tries must be at least 1")
        if (self.key_ttl <= timedelta(0) or self.lock_timeout_seconds <= 0
                or self.ddl_lock_timeout_seconds <= 0 or self.ddl_retry_seconds < 0
                or self.uncounted_after <= timedelta(0)):
            raise ValueError("the key window, the uncounted epochs' age and the lock timeouts "
                             "must be positive")

    def fence_cutoff(self, now: datetime) -> datetime:
        """Fences made before this go: a day before the start of the oldest day whose
        partition is kept (``expired`` keeps the day of now - retention). A fence is dated by
        PostgreSQL's clock and its event by the replica's that wrote it: one running ahead put
        an event of a day's first moments in that day's partition and its fence in the day
        before, deleted with that day's partition while the event stayed."""
        oldest_kept = (now - timedelta(days=self.retention_days)).astimezone(UTC).date()
        return day_start(oldest_kept - timedelta(days=1))

    def wanted(self, now: datetime) -> list[date]:
        """The days that must have a partition at ``now``: today through today + ahead."""
        today = now.astimezone(UTC).date()
        return [today + timedelta(days=n) for n in range(self.ahead_days + 1)]

    def expired(self, day: date, now: datetime) -> bool:
        """Whether the partition of ``day`` holds only rows older than the retention: its
        upper bound (the next day's midnight) is at or before now - retention."""
        return day_start(day + timedelta(days=1)) <= now - timedelta(days=self.retention_days)


@dataclass(frozen=True, kw_only=True, slots=True)
class Outcome:
    """What one cycle did. ``ran``: False when another replica held the lock at its start;
    ``complete``: False when it lost the lock to another replica's cycle half-way."""

    ran: bool
    complete: bool = True
    created: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()
    keys_deleted: int = 0
    fences_deleted: int = 0
    compactions_deleted: int = 0
    epochs_counted: int = 0


# What counts an epoch in the metrics: (epoch, reason, prefix tokens)
CountEpoch = Callable[[int, str, int], None]


@dataclass(frozen=True, slots=True)
class _Batch:
    """A batch of step 4, or a writer's claim (``keep``), whose COMMIT went unanswered: its
    transaction's id, the value it wrote in its rows' ``count_claim`` and its epochs."""

    xid: str
    claim: str
    epochs: tuple[ClaimedEpoch, ...]


@dataclass(slots=True)
class _Tally:
    """What a cycle has done so far: logged when it fails half-way."""

    ran: bool = False
    created: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()
    deleted: list[int] = field(default_factory=list)
    counted: int = 0
    partitions_failed: bool = False


# The longest a claim left unsettled by a pass (still in progress, or unanswered) waits for the
# next: each pass after the first waits twice as long as the one before, up to this.
SETTLE_RETRY_MAX_SECONDS = 300.0


@dataclass
class Maintenance:
    pool: asyncpg.Pool
    clock: Clock
    policy: Policy = field(default_factory=Policy)
    interval_seconds: float = 3600.0
    # counts the epochs step 4 claims; None: the step is not run
    count_epoch: CountEpoch | None = None
    _task: asyncio.Task[None] | None = None
    cycles: int = 0  # cycles that ran (got the lock)
    skipped: int = 0  # cycles another replica was running
    # step 4's batches and the writers' claims (``keep``) whose COMMIT went unanswered,
    # settled by ``settle`` (this process alone knows whether it counted them); shared, in
    # place, by copies made with replace()
    _unsettled: list[_Batch] = field(default_factory=list)
    _closed: bool = False
    # once the cycles run in the background (``start``), a kept claim is settled this long after
    # it was kept by a pass that only settles (``settle``), not an hour later at the next cycle;
    # and a stop settles what it still holds, waiting at most ``stop_settle_seconds``
    settle_after_seconds: float = 5.0
    stop_settle_seconds: float = 2.0
    _soon: asyncio.Event | None = None
    _loop: asyncio.AbstractEventLoop | None = None
    _pass_at: float | None = None  # when the next settling pass is due (the loop's clock)

    def keep(self, xid: str, claim: str, epochs: tuple[ClaimedEpoch, ...]) -> None:
        """A claim of ``epochs`` (tenant, session, epoch, reason, prefix tokens) whose COMMIT
        went unanswered, made by transaction ``xid`` of this process outside a cycle (an
        epoch's writer's, ``PostgresPlanStore.claim_count``), which wrote ``claim`` in their
        rows: settled as a batch of step 4's is, counted once if it committed, by a pass
        ``settle_after_seconds`` later (or the next cycle, or the stop). Once this process's
        cycles have stopped, lost (logged). Any thread may call it."""
        if not epochs:
            return
        if self._closed:
            log("epoch_count_lost", logging.WARNING, epochs=len(epochs),
                reason="process_stopped", xid=xid)
            return
        self._unsettled.append(_Batch(xid=xid, claim=claim, epochs=epochs))
        self._wake()

    def _wake(self) -> None:
        """The background task, told that a claim was kept, to be settled."""
        if self._loop is not None and self._soon is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._kept)

    def _kept(self) -> None:
        """A claim was kept: a pass ``settle_after_seconds`` from now, unless one is due
        sooner."""
        assert self._loop is not None and self._soon is not None
        self._pass_by(self._loop.time() + self.settle_after_seconds)
        self._soon.set()

    def _pass_by(self, at: float) -> None:
        self._pass_at = at if self._pass_at is None else min(self._pass_at, at)

    async def settle(self) -> int:
        """Settles the kept claims now, outside a cycle (as a cycle does first): the epochs it
        counted. A failure is logged, and what it could not settle waits for the next pass or
        cycle. Without ``count_epoch`` (step 4 not run), nothing."""
        if self.count_epoch is None or not self._unsettled:
            return 0
        tally = _Tally()
        try:
            await self._settle(self.count_epoch, tally)
        except (*UNAVAILABLE, asyncpg.PostgresError) as exc:
            log("epoch_count_settle_failed", logging.WARNING, error=type(exc).__name__,
                epochs_counted=tally.counted, epochs_unsettled=self.unsettled)
            return tally.counted
        log("epoch_count_settled", epochs_counted=tally.counted,
            epochs_unsettled=self.unsettled)
        return tally.counted

    @property
    def unsettled(self) -> int:
        """Epochs of batches whose COMMIT went unanswered, not yet known to have committed."""
        return sum(len(batch.epochs) for batch in self._unsettled)

    async def run_once(self, *, ddl_tries: int | None = None, epochs: bool = True) -> Outcome:
        """One cycle (see the module's docstring); ``ddl_tries``: the partition step's tries
        (the policy's unless given); ``epochs`` False: without step 4. Raises what the
        database raises (epochs claimed by a batch before are counted, a batch whose COMMIT
        went unanswered is kept for the next cycle), having logged what it did."""
        tally = _Tally()
        try:
            return await self._cycle(tally, ddl_tries, epochs)
        except BaseException as exc:
            if tally.ran or tally.counted:
                self._log(tally, complete=False, error=type(exc).__name__)
            raise

    async def _cycle(self, tally: _Tally, ddl_tries: int | None, epochs: bool) -> Outcome:
        tries = self.policy.ddl_tries if ddl_tries is None else max(1, ddl_tries)
        now = self.clock.now()
        fence_cutoff = self.policy.fence_cutoff(now)
        count_epoch = self.count_epoch if epochs else None
        if count_epoch is not None and self._unsettled:
            await self._settle(count_epoch, tally)
        async with self.pool.acquire() as conn:
            partitions, failed = await self._partitions_tried(conn, now, tries)
            if partitions is None:
                self.skipped += 1
                log("maintenance", ran=False, note="another replica holds the maintenance lock",
                    epochs_counted=tally.counted, epochs_unsettled=self.unsettled)
                return Outcome(ran=False, epochs_counted=tally.counted)
            tally.ran = True
            created, dropped = partitions
            tally.created, tally.dropped = created, dropped
            tally.partitions_failed = failed is not None
            counts = tally.deleted
            complete = True
            for sql, args in ((DELETE_KEYS, (self.policy.key_ttl,)),
                              (DELETE_FENCES, (fence_cutoff,)),
                              (DELETE_COMPACTIONS, (self.policy.key_ttl,))):
                if sql is DELETE_FENCES and failed is not None:
                    # the partitions step failed: the partitions it was to drop, and their
                    # events, are still there, and so must be the fences of those events
                    counts.append(0)
                    continue
                deleted, complete = await self._delete(conn, sql, *args)
                counts.append(deleted)
                if not complete:  # another replica's cycle goes on from here
                    break
            if complete and count_epoch is not None:
                complete = await self._claim_epochs(conn, count_epoch, tally)
        keys, fences, compactions = [*counts, 0, 0, 0][:3]
        self.cycles += 1
        if failed is not None:
            raise failed  # logged by run_once, as failed
        self._log(tally, complete=complete)
        return Outcome(ran=True, complete=complete, created=created, dropped=dropped,
                       keys_deleted=keys, fences_deleted=fences, compactions_deleted=compactions,
                       epochs_counted=tally.counted)

    def _log(self, tally: _Tally, *, complete: bool, error: str | None = None) -> None:
        """The cycle's ``maintenance`` line: at warning, with ``error``, for one that failed
        (what it did before)."""
        keys, fences, compactions = [*tally.deleted, 0, 0, 0][:3]
        failed = error is not None or tally.partitions_failed
        log("maintenance", logging.WARNING if failed else logging.INFO, ran=tally.ran,
            complete=complete and not failed,
            **({"partitions": "failed"} if tally.partitions_failed else {}),
            **({"error": error} if error is not None else {}),
            partitions_created=list(tally.created), partitions_dropped=list(tally.dropped),
            keys_deleted=keys, fences_deleted=fences, compactions_deleted=compactions,
            epochs_counted=tally.counted, epochs_unsettled=self.unsettled,
            retention_days=self.policy.retention_days, ahead_days=self.policy.ahead_days,
            key_ttl_hours=self.policy.key_ttl / timedelta(hours=1))

    async def _locked(self, conn: asyncpg.Connection, timeout: float | None = None) -> bool:
        got = await conn.fetchval(TRY_LOCK, LOCK_KEY)
        if got:
            seconds = self.policy.lock_timeout_seconds if timeout is None else timeout
            await conn.execute(f"SET LOCAL lock_timeout = '{max(1, int(seconds * 1000))}ms'")
        return bool(got)

    async def _partitions_tried(
            self, conn: asyncpg.Connection, now: datetime, tries: int,
    ) -> tuple[tuple[tuple[str, ...], tuple[str, ...]] | None,
               asyncpg.LockNotAvailableError | None]:
        """``_partitions``, tried again while a reader holds the table: what it made (none,
        with the last lock timeout, when every try met one: the deletes of step 3 run all the
        same, and the cycle is failed after them)."""
        for attempt in range(tries):
            try:
                return await self._partitions(conn, now), None
            except asyncpg.LockNotAvailableError as exc:
                if attempt + 1 == tries:
                    return ((), ()), exc
                await asyncio.sleep(self.policy.ddl_retry_seconds)
        raise AssertionError("unreachable: tries is at least 1")

    async def _partitions(self, conn: asyncpg.Connection,
                          now: datetime) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
        async with conn.transaction():
            if not await self._locked(conn, self.policy.ddl_lock_timeout_seconds):
                return None
            existing: set[date] = set()
            for row in await conn.fetch(PARTITIONS):
                day = partition_day(row["relname"])
                if day is not None:
                    existing.add(day)
            created = []
            for day in self.policy.wanted(now):
                if day not in existing:
                    await conn.execute(create_partition_sql(day))
                    created.append(partition_name(day))
            dropped = []
            for day in sorted(existing):
                if self.policy.expired(day, now):
                    await conn.execute(drop_partition_sql(day))
                    dropped.append(partition_name(day))
        return tuple(created), tuple(dropped)

    async def _delete(self, conn: asyncpg.Connection, sql: str,
                      *args: object) -> tuple[int, bool]:
        """Batches of at most ``batch_size`` rows, each in its own locked transaction, until
        one deletes fewer: (rows deleted, whether it got that far before another replica
        took the lock)."""
        deleted = 0
        while True:
            async with conn.transaction():
                if not await self._locked(conn):
                    return deleted, False
                status = await conn.execute(sql, *args, self.policy.batch_size)
            count = int(status.split()[-1])
            deleted += count
            if count < self.policy.batch_size:
                return deleted, True

    async def _claim_epochs(self, conn: asyncpg.Connection, count_epoch: CountEpoch,
                            tally: _Tally) -> bool:
        """Step 4: batches as ``_delete``'s, each counted (in ``tally`` too) once its COMMIT
        answered, or kept unsettled when that answer was lost: whether it got that far before
        another replica took the lock."""
        while True:
            batch = None
            claim = str(uuid4())
            try:
                async with conn.transaction():
                    if not await self._locked(conn):
                        return False
                    rows = await conn.fetch(CLAIM_UNCOUNTED, self.policy.uncounted_after,
                                            self.policy.batch_size, claim)
                    batch = _Batch(xid=str(rows[0]["xid"]) if rows else "", claim=claim,
                                   epochs=tuple(ClaimedEpoch(
                                       str(row["tenant_id"]), str(row["session_id"]),
                                       int(row["epoch"]), str(row["reason"]),
                                       int(row["prefix_tokens"])) for row in rows))
            except BaseException:
                if batch is not None and batch.epochs:  # its COMMIT sent: committed or not?
                    self._unsettled.append(batch)
                    self._wake()
                raise
            for e in batch.epochs:  # claimed by this statement alone
                count_epoch(e.epoch, e.reason, e.prefix_tokens)
            tally.counted += len(batch.epochs)
            if len(batch.epochs) < self.policy.batch_size:
                return True

    async def _settle(self, count_epoch: CountEpoch, tally: _Tally) -> None:
        """Settles the batches whose COMMIT went unanswered, each once (a cycle running at the
        same time takes none of those this one took): keeps those whose transaction is still
        in progress; of the others, counts the epochs whose row shows the batch's claim (it
        committed) and drops the rest (their rows uncounted, for a cycle to claim, or counted
        by another claim). An epoch whose row is gone (erased since) is counted if the status
        says committed; when PostgreSQL can no longer tell, it is lost, logged."""
        batches = self._unsettled[:]
        del self._unsettled[:len(batches)]  # not one kept meanwhile (keep: any thread)
        kept: list[_Batch] = []
        try:
            async with self.pool.acquire() as conn:
                while batches:
                    batch = batches[0]
                    try:
                        status = await conn.fetchval(XACT_STATUS, batch.xid)
                    except asyncpg.InvalidParameterValueError:  # an id from the future: a
                        status = None  # database other than the one that gave it
                    if status == "in progress":
                        kept.append(batches.pop(0))
                        continue
                    tenants, sessions, epochs = zip(*(e.key for e in batch.epochs),
                                                    strict=True)
                    rows = await conn.fetch(  # read once the transaction has ended
                        CLAIMED_BY, tenants, sessions, epochs, batch.claim)
                    batches.pop(0)
                    ours = {(r["tenant_id"], r["session_id"], r["epoch"]): bool(r["ours"])
                            for r in rows}
                    counted = [e for e in batch.epochs
                               if ours.get(e.key, status == "committed")]
                    for e in counted:
                        count_epoch(e.epoch, e.reason, e.prefix_tokens)
                    tally.counted += len(counted)
                    gone = sum(1 for e in batch.epochs if e.key not in ours)
                    if gone and status not in ("committed", "aborted"):
                        log("epoch_count_lost", logging.WARNING, epochs=gone,
                            reason="transaction_status_unknown", xid=batch.xid)
        finally:
            self._unsettled.extend([*kept, *batches])

    def start(self) -> None:
        """Cycles every ``interval_seconds`` in the background (the first one at start is the
        caller's ``run_once``)."""
        if self._task is None:
            self._loop = asyncio.get_running_loop()
            self._soon = asyncio.Event()
            if self._unsettled:
                self._pass_by(self._loop.time() + self.settle_after_seconds)
            self._task = self._loop.create_task(self._run())

    async def _run(self) -> None:
        assert self._loop is not None and self._soon is not None
        loop, soon = self._loop, self._soon
        retries = 0  # passes in a row that left a claim unsettled
        while True:
            due = loop.time() + self.interval_seconds
            while (now := loop.time()) < due:  # until the cycle is due: the settling passes
                at = self._pass_at
                if at is not None and at <= now:
                    self._pass_at = None
                    try:
                        await self.settle()
                    except Exception as exc:  # a defect: logged, and tried again as below
                        log("maintenance_failed", logging.ERROR, error=type(exc).__name__)
                    if self._unsettled and self.count_epoch is not None:
                        # still in progress, or the database did not answer: again, each time
                        # twice as late (a claim kept meanwhile keeps its own, sooner, pass)
                        retries = min(retries + 1, 16)
                        self._pass_by(loop.time() + min(self.settle_after_seconds * 2 ** retries,
                                                        SETTLE_RETRY_MAX_SECONDS))
                    else:
                        retries = 0
                    continue
                soon.clear()  # woken by a claim kept (its pass due sooner), or when one is due
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(soon.wait(), min(due, at if at is not None else due)
                                           - now)
            try:
                await self.attempt()
            except Exception as exc:  # a defect: logged, and the next cycle runs all the same
                log("maintenance_failed", logging.ERROR, error=type(exc).__name__,
                    retry_in_seconds=self.interval_seconds)

    async def attempt(self, *, ddl_tries: int | None = None,
                      epochs: bool = True) -> Outcome | None:
        """``run_once``, its failure logged instead of raised (the next cycle tries again)."""
        try:
            return await self.run_once(ddl_tries=ddl_tries, epochs=epochs)
        except (*UNAVAILABLE, asyncpg.PostgresError) as exc:
            log("maintenance_failed", logging.ERROR, error=type(exc).__name__,
                detail=str(exc)[:200], retry_in_seconds=self.interval_seconds)
            return None

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._unsettled and self.count_epoch is not None:  # one last pass, bounded
            try:
                await asyncio.wait_for(self.settle(), self.stop_settle_seconds)
            except TimeoutError:
                pass
            except Exception as exc:  # a defect: logged, and the stop goes on
                log("maintenance_failed", logging.ERROR, error=type(exc).__name__)
        if self._unsettled:  # no cycle of this process will count them
            log("epoch_count_lost", logging.WARNING, epochs=self.unsettled,
                reason="process_stopped")
