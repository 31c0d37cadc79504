"""What keeps Build serving while PostgreSQL is away.

* :class:`LastKnownEpochs` wraps the plan store: when the database cannot say which epoch is
  current, the last epoch this process saw pinned or current answers instead. Epochs only
  move forward and only through a write, and no write can happen while the database is away,
  so the answer is the current epoch unless another replica rotated in the moments before the
  outage; the plan itself still has to come from the process's plan cache. A session the
  database answers unknown (erased) is forgotten.
* :class:`BufferedEventLog` wraps the outbox: an event that cannot be written (Build's
  pressure and exceeded events) waits in a bounded in-process queue, in order, and is written
  when the database returns. Nothing is dropped unless the queue overflows, which is logged
  with the number dropped. ``context.snapshot.used`` is never queued: it fences the snapshot,
  so it is written durably or Build fails UNAVAILABLE. Each event gets its identity (an id and
  the clock's time) before its first attempt and keeps it in the queue, so writing it again
  after an attempt that did land but whose answer was lost (the database crashed after the
  commit) stores nothing new. An event the database can never hold (``EventRejected``: its
  session was erased, its day is past retention, or its payload is refused) is discarded,
  logged (``event_discarded``) and counted (``discarded``), never retried: it never holds back
  the events behind it, another tenant's included.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict, deque
from collections.abc import Callable
from uuid import UUID, uuid4

from context_engine.clock import SYSTEM_CLOCK, Clock
from context_engine.domain.errors import StoreUnavailable
from context_engine.domain.plan import ContextPlan
from context_engine.domain.ports import (
    ContextEvent,
    CurrentEpoch,
    Decide,
    EventLog,
    EventRejected,
    PlanStore,
)
from context_engine.telemetry.logs import log


class LastKnownEpochs:
    def __init__(self, inner: PlanStore, *, capacity: int = 65_536) -> None:
        self._inner = inner
        self._capacity = capacity
        self._epochs: OrderedDict[tuple[str, str], CurrentEpoch] = OrderedDict()

    def _remember(self, tenant_id: str, session_id: str, seen: CurrentEpoch) -> None:
        """A later incarnation replaces an earlier one whatever its epoch (a session erased
        and planned again restarts at epoch 1)."""
        key = (tenant_id, session_id)
        known = self._epochs.get(key)
        if known is None or (seen.incarnation, seen.epoch) > (known.incarnation, known.epoch):
            self._epochs[key] = seen
        self._epochs.move_to_end(key)
        while len(self._epochs) > self._capacity:
            self._epochs.popitem(last=False)

    async def get(self, tenant_id: str, session_id: str,
                  epoch: int | None = None) -> ContextPlan | None:
        plan = await self._inner.get(tenant_id, session_id, epoch)
        if plan is not None and epoch is None:
            self._remember(tenant_id, session_id, CurrentEpoch(plan.incarnation, plan.epoch))
        return plan

    async def current(self, tenant_id: str, session_id: str) -> CurrentEpoch | None:
        try:
            found = await self._inner.current(tenant_id, session_id)
        except StoreUnavailable:
            known = self._epochs.get((tenant_id, session_id))
            if known is None:
                raise
            return known
        if found is None:  # unknown, or erased: nothing of it is remembered
            self._epochs.pop((tenant_id, session_id), None)
        else:
            self._remember(tenant_id, session_id, found)
        return found

    async def incarnation(self, tenant_id: str, session_id: str, epoch: int) -> int | None:
        return await self._inner.incarnation(tenant_id, session_id, epoch)

    async def pin(self, tenant_id: str, session_id: str, decide: Decide, *,
                  idempotency_key: str | None = None, fingerprint: str = "",
                  then: Callable[[ContextPlan], object] | None = None
                  ) -> tuple[ContextPlan, bool]:
        plan, created = await self._inner.pin(tenant_id, session_id, decide,
                                              idempotency_key=idempotency_key,
                                              fingerprint=fingerprint, then=then)
        self._remember(tenant_id, session_id, CurrentEpoch(plan.incarnation, plan.epoch))
        return plan, created

    async def claim_count(self, plan: ContextPlan) -> bool:
        return await self._inner.claim_count(plan)


class BufferedEventLog:
    def __init__(self, inner: EventLog, *, capacity: int = 100_000,
                 retry_seconds: float = 1.0, clock: Clock = SYSTEM_CLOCK,
                 new_event_id: Callable[[], UUID] = uuid4) -> None:
        self._inner = inner
        self._capacity = capacity
        self._retry = retry_seconds
        self._clock = clock
        self._new_event_id = new_event_id
        # (event with its identity, once-key or None), oldest first
        self._pending: deque[tuple[ContextEvent, str | None]] = deque()
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self.dropped = 0  # the queue overflowed
        self.discarded = 0  # rejected by the database for good (EventRejected)

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def append(self, event: ContextEvent) -> None:
        await self._write(event, None)

    async def append_once(self, event: ContextEvent, key: str) -> bool:
        return await self._write(event, key)

    async def append_once_durably(self, event: ContextEvent, key: str, *,
                                  incarnation: int | None = None) -> bool:
        """Never queued: a fence holds only if it is in the database (StoreUnavailable
        propagates)."""
        return await self._inner.append_once_durably(event, key, incarnation=incarnation)

    async def _write(self, event: ContextEvent, key: str | None) -> bool:
        # the identity every attempt writes it with, this one and the queue's alike
        event = event.identified(self._new_event_id, self._clock.now)
        if not self._pending:  # keep the log's order: nothing jumps the queue
            try:
                if key is None:
                    await self._inner.append(event)
                    return True
                return await self._inner.append_once(event, key)
            except StoreUnavailable:
                pass
            except EventRejected as rejected:
                self._discard(rejected)
                return False
        self._enqueue(event, key)
        return True

    def _discard(self, rejected: EventRejected) -> None:
        self.discarded += 1
        event = rejected.event
        log("event_discarded",
            logging.WARNING if rejected.reason == EventRejected.SESSION_ERASED else logging.ERROR,
            type=event.type, tenant=event.tenant_id, reason=rejected.reason,
            discarded=self.discarded)

    def _enqueue(self, event: ContextEvent, key: str | None) -> None:
        if not self._pending:
            log("events_buffered", logging.WARNING, type=event.type, tenant=event.tenant_id)
        self._pending.append((event, key))
        while len(self._pending) > self._capacity:
            self._pending.popleft()
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log("events_dropped", logging.ERROR, dropped=self.dropped,
                    capacity=self._capacity)

    async def flush(self) -> int:
        """Write what waits, oldest first, until the queue is empty or the database fails
        again. Returns the number written."""
        written = 0
        async with self._lock:
            while self._pending:
                event, key = self._pending[0]
                try:
                    if key is None:
                        await self._inner.append(event)
                    else:
                        await self._inner.append_once(event, key)
                except StoreUnavailable:
                    break
                except EventRejected as rejected:
                    self._pending.popleft()
                    self._discard(rejected)
                    continue
                self._pending.popleft()
                written += 1
        if written:
            log("events_flushed", written=written, pending=len(self._pending))
        return written

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._retry)
            if self._pending:
                try:
                    await self.flush()
                except Exception as exc:  # the loop outlives one bad write
                    log("events_flush_failed", logging.ERROR, error=type(exc).__name__,
                        pending=len(self._pending))

    async def close(self) -> None:
        """Stop retrying and make one last attempt; what still cannot be written is logged."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._pending:
            await self.flush()
        if self._pending:
            log("events_not_recorded", logging.ERROR, pending=len(self._pending))
