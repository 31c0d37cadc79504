"""What keeps Build serving while PostgreSQL is away.

* :class:`LastKnownEpochs` wraps the plan store: when the database cannot say which epoch is
  current, the last epoch this process saw pinned or current answers instead. Epochs only
  move forward and only through a write, and no write can happen while the database is away,
  so the answer is the current epoch unless another replica rotated in the moments before the
  outage; the plan itself still has to come from the process's plan cache.
* :class:`BufferedEventLog` wraps the outbox: an event that cannot be written (Build's
  pressure and exceeded events) waits in a bounded in-process queue, in order, and is written
  when the database returns. Nothing is dropped unless the queue overflows, which is logged
  with the number dropped. ``context.snapshot.used`` is never queued: it fences the snapshot,
  so it is written durably or Build fails UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict, deque

from context_engine.domain.errors import StoreUnavailable
from context_engine.domain.plan import ContextPlan
from context_engine.domain.ports import ContextEvent, Decide, EventLog, PlanStore
from context_engine.telemetry.logs import log


class LastKnownEpochs:
    def __init__(self, inner: PlanStore, *, capacity: int = 65_536) -> None:
        self._inner = inner
        self._capacity = capacity
        self._epochs: OrderedDict[tuple[str, str], int] = OrderedDict()

    def _remember(self, tenant_id: str, session_id: str, epoch: int) -> None:
        key = (tenant_id, session_id)
        self._epochs[key] = max(epoch, self._epochs.get(key, 0))
        self._epochs.move_to_end(key)
        while len(self._epochs) > self._capacity:
            self._epochs.popitem(last=False)

    async def get(self, tenant_id: str, session_id: str,
                  epoch: int | None = None) -> ContextPlan | None:
        plan = await self._inner.get(tenant_id, session_id, epoch)
        if plan is not None and epoch is None:
            self._remember(tenant_id, session_id, plan.epoch)
        return plan

    async def current_epoch(self, tenant_id: str, session_id: str) -> int | None:
        try:
            epoch = await self._inner.current_epoch(tenant_id, session_id)
        except StoreUnavailable:
            known = self._epochs.get((tenant_id, session_id))
            if known is None:
                raise
            return known
        if epoch is not None:
            self._remember(tenant_id, session_id, epoch)
        return epoch

    async def pin(self, tenant_id: str, session_id: str, decide: Decide, *,
                  idempotency_key: str | None = None,
                  fingerprint: str = "") -> tuple[ContextPlan, bool]:
        plan, created = await self._inner.pin(tenant_id, session_id, decide,
                                              idempotency_key=idempotency_key,
                                              fingerprint=fingerprint)
        self._remember(tenant_id, session_id, plan.epoch)
        return plan, created


class BufferedEventLog:
    def __init__(self, inner: EventLog, *, capacity: int = 100_000,
                 retry_seconds: float = 1.0) -> None:
        self._inner = inner
        self._capacity = capacity
        self._retry = retry_seconds
        # (event, once-key or None), oldest first
        self._pending: deque[tuple[ContextEvent, str | None]] = deque()
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self.dropped = 0

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def append(self, event: ContextEvent) -> None:
        await self._write(event, None)

    async def append_once(self, event: ContextEvent, key: str) -> bool:
        return await self._write(event, key)

    async def append_once_durably(self, event: ContextEvent, key: str) -> bool:
        """Never queued: a fence holds only if it is in the database (StoreUnavailable
        propagates)."""
        return await self._inner.append_once_durably(event, key)

    async def _write(self, event: ContextEvent, key: str | None) -> bool:
        if not self._pending:  # keep the log's order: nothing jumps the queue
            try:
                if key is None:
                    await self._inner.append(event)
                    return True
                return await self._inner.append_once(event, key)
            except StoreUnavailable:
                pass
        self._enqueue(event, key)
        return True

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
                await self.flush()

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
