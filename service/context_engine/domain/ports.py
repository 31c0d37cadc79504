"""Ports of the domain, named after domain operations, each with an in-memory fake beside it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, Protocol
from uuid import UUID

from context_engine.domain.calibration import Calibration, Reconciled
from context_engine.domain.compaction import CompactionResult
from context_engine.domain.errors import InvalidInput
from context_engine.domain.plan import ContextPlan, PlanDraft


@dataclass(frozen=True, kw_only=True, slots=True)
class Rotation:
    """A decision to pin ``draft`` as the session's next epoch, for ``reason``."""

    reason: str
    draft: PlanDraft


Decide = Callable[[ContextPlan | None], Rotation | None]


@dataclass(frozen=True, kw_only=True, slots=True)
class ContextEvent:
    tenant_id: str
    session_id: str
    epoch: int
    type: str
    payload: dict[str, Any]
    # The event's identity, fixed at the first attempt to write it (``identified``) and kept
    # by every retry: a retry of a write that did land stores nothing new. None: not yet.
    event_id: UUID | None = None
    created_at: datetime | None = None
    # The incarnation of the session the event was made for (its plan's): written only while
    # the session is still that one, else rejected as erased, so an event made before an
    # erasure and written after it (queued while the database was away) never lands in the
    # session planned again. None: written for whichever session has the id.
    incarnation: int | None = None

    def identified(self, new_id: Callable[[], UUID],
                   now: Callable[[], datetime]) -> ContextEvent:
        """This event with an identity: its own if it has one, else a new id and ``now()``."""
        if self.event_id is not None and self.created_at is not None:
            return self
        return replace(self, event_id=new_id(), created_at=now())


class EventRejected(Exception):
    """An event the outbox can never hold, so retrying it is pointless: its session was
    erased (``SESSION_ERASED``; or erased and planned again, for an event made for the erased
    incarnation), its day is before the oldest kept partition of the outbox
    (``PAST_RETENTION``), or PostgreSQL refuses what its payload holds (``UNSTORABLE``: a
    data exception, such as a NUL in a caller's recall line id, which jsonb cannot hold)."""

    SESSION_ERASED = "session_erased"
    PAST_RETENTION = "past_retention"
    UNSTORABLE = "unstorable"

    def __init__(self, event: ContextEvent, reason: str) -> None:
        self.event = event
        self.reason = reason
        super().__init__(f"{event.type} event of tenant {event.tenant_id} rejected: {reason}")


class IncarnationChanged(Exception):
    """A write made for a plan of one incarnation of its session found another: the session
    was erased and planned again since the plan was read (``found``: the incarnation now).
    Nothing was written; the plan is to be read again."""

    def __init__(self, tenant_id: str, session_id: str, expected: int, found: int) -> None:
        self.tenant_id, self.session_id = tenant_id, session_id
        self.expected, self.found = expected, found
        super().__init__(f"session of tenant {tenant_id} is incarnation {found} now, "
                         f"not {expected}")


@dataclass(frozen=True, slots=True)
class CurrentEpoch:
    """A session's current epoch, and which incarnation of the session it is: a session erased
    and planned again starts at epoch 1 again under a new (higher) incarnation."""

    incarnation: int
    epoch: int


class PlanStore(Protocol):
    async def get(self, tenant_id: str, session_id: str,
                  epoch: int | None = None) -> ContextPlan | None:
        """The given epoch's plan, or the current one when ``epoch`` is None, with the
        session's incarnation."""
        ...

    async def current(self, tenant_id: str, session_id: str) -> CurrentEpoch | None:
        """The session's incarnation and current epoch, or None for an unknown session."""
        ...

    async def incarnation(self, tenant_id: str, session_id: str, epoch: int) -> int | None:
        """The incarnation of the session if it has ``epoch``, else None (unknown session or
        epoch): re-verifies a cached plan without reading it again."""
        ...

    async def pin(self, tenant_id: str, session_id: str, decide: Decide, *,
                  idempotency_key: str | None = None, fingerprint: str = "",
                  then: Callable[[ContextPlan], object] | None = None
                  ) -> tuple[ContextPlan, bool]:
        """Atomically: read the session's current plan, ask ``decide``, and if it returns a
        rotation write it as the next epoch with its event. Concurrent callers for one session
        serialize; exactly one epoch is written per decision. With an idempotency key, a
        retried key decides nothing and returns the epoch its first call left current; a key
        reused for another session or another request (``fingerprint``) is InvalidInput.
        ``then``: given the epoch written (with its ``created_at``) before the write commits;
        what it raises rolls the whole write back (the caller's response, refused). Returns
        (plan, created). An epoch written here is uncounted (``ContextPlan.counted`` False)
        until ``claim_count`` claims it."""
        ...

    async def claim_count(self, plan: ContextPlan) -> bool:
        """Marks the stored epoch ``plan`` counted in the metrics; True only for the one call
        that does (any replica's), so each epoch is counted once: by its writer once the write
        committed, or, when the writer never learnt that it did (its COMMIT's answer lost),
        by the first call that reads it after. False for an epoch counted already, or gone.
        StoreUnavailable: nothing claimed (the epoch is left to the next call that reads it);
        CountUnsettled, a kind of it: the claim may have committed, and what settles it counts
        the epoch once it knows it did (the caller counts nothing)."""
        ...


def key_reused() -> InvalidInput:
    return InvalidInput.one("idempotency_key", "was already used for another request; a retry "
                            "must repeat its request exactly")


def plan_event(plan: ContextPlan) -> ContextEvent:
    """``context.plan.created`` for epoch 1, ``context.epoch.rotated`` after."""
    spec = plan.spec
    payload: dict[str, Any] = {
        "epoch": plan.epoch,
        "reason": plan.reason,
        "prefix_sha256": plan.prefix_sha256,
        "prefix_tokens": plan.prefix_tokens,
        "model_id": spec.model.model_id,
        "tool_names": list(spec.tool_names),
        "deferred_tool_names": list(spec.deferred_tool_names),
        "skipped_tool_names": list(spec.skipped_tool_names),
        "tokenizer": spec.tokenizer,
        "builder_version": spec.builder_version,
        "policy_version": spec.assets.version,
    }
    kind = "context.plan.created" if plan.epoch == 1 else "context.epoch.rotated"
    return ContextEvent(tenant_id=plan.tenant_id, session_id=plan.session_id, epoch=plan.epoch,
                        type=kind, payload=payload)


def pinned(tenant_id: str, session_id: str, epoch: int, rotation: Rotation) -> ContextPlan:
    d = rotation.draft
    return ContextPlan(tenant_id=tenant_id, session_id=session_id, epoch=epoch,
                       reason=rotation.reason, spec=d.spec,
                       prefix_sha256=d.rendered.prefix_sha256, prefix_tokens=d.prefix_tokens,
                       classes=d.classes, counted=False)


@dataclass
class InMemoryPlanStore:
    """Fake PlanStore for unit tests: same contract, state asserted directly."""

    plans: dict[tuple[str, str], list[ContextPlan]] = field(default_factory=dict)
    events: list[ContextEvent] = field(default_factory=list)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def get(self, tenant_id: str, session_id: str,
                  epoch: int | None = None) -> ContextPlan | None:
        epochs = self.plans.get((tenant_id, session_id), [])
        if not epochs:
            return None
        if epoch is None:
            return epochs[-1]
        return epochs[epoch - 1] if 0 < epoch <= len(epochs) else None

    async def current_epoch(self, tenant_id: str, session_id: str) -> int | None:
        epochs = self.plans.get((tenant_id, session_id))
        return len(epochs) if epochs else None

    async def current(self, tenant_id: str, session_id: str) -> CurrentEpoch | None:
        epochs = self.plans.get((tenant_id, session_id))
        return CurrentEpoch(0, len(epochs)) if epochs else None

    async def incarnation(self, tenant_id: str, session_id: str, epoch: int) -> int | None:
        epochs = self.plans.get((tenant_id, session_id), [])
        return 0 if 0 < epoch <= len(epochs) else None

    keys: dict[tuple[str, str], tuple[str, str, int]] = field(default_factory=dict)

    async def pin(self, tenant_id: str, session_id: str, decide: Decide, *,
                  idempotency_key: str | None = None, fingerprint: str = "",
                  then: Callable[[ContextPlan], object] | None = None
                  ) -> tuple[ContextPlan, bool]:
        async with self._lock:
            epochs = self.plans.setdefault((tenant_id, session_id), [])
            if idempotency_key is not None and (tenant_id, idempotency_key) in self.keys:
                session, fp, epoch = self.keys[(tenant_id, idempotency_key)]
                if (session, fp) != (session_id, fingerprint):
                    raise key_reused()
                return epochs[epoch - 1], False
            current = epochs[-1] if epochs else None
            rotation = decide(current)
            if rotation is None:
                assert current is not None
                return current, False
            plan = pinned(tenant_id, session_id, len(epochs) + 1, rotation)
            if then is not None:  # before anything is kept: what it raises keeps nothing
                then(plan)
            epochs.append(replace(plan))
            self.events.append(plan_event(plan))
            if idempotency_key is not None:
                self.keys[(tenant_id, idempotency_key)] = (session_id, fingerprint, plan.epoch)
            return plan, True

    async def claim_count(self, plan: ContextPlan) -> bool:
        epochs = self.plans.get((plan.tenant_id, plan.session_id), [])
        if not 0 < plan.epoch <= len(epochs) or epochs[plan.epoch - 1].counted:
            return False
        epochs[plan.epoch - 1] = replace(epochs[plan.epoch - 1], counted=True)
        return True


class EventLog(Protocol):
    """The outbox. An event keeps the identity it is first written with (``identified``), so
    writing it again stores nothing new. ``append`` and ``append_once`` raise
    ``EventRejected`` for an event that can never be written (its session was erased)."""

    async def append(self, event: ContextEvent) -> None:
        """Append one context event to the outbox."""
        ...

    async def append_once(self, event: ContextEvent, key: str) -> bool:
        """Append the event unless one with this key was already appended (by any replica).
        Returns whether it was appended now."""
        ...

    async def append_once_durably(self, event: ContextEvent, key: str, *,
                                  incarnation: int | None = None) -> bool:
        """``append_once``, written before it returns, never deferred to a later retry: raises
        StoreUnavailable when it cannot be written now, SessionNotFound when its session was
        erased, and, given the ``incarnation`` of the plan it is written for,
        IncarnationChanged when the session is another one now (erased and planned again).
        For an event that fences what the caller may do next (``context.snapshot.used``)."""
        ...


Reconcile = Callable[[Calibration | None], Reconciled]


@dataclass(frozen=True, kw_only=True, slots=True)
class EpochUsage:
    """Where a usage report belongs: its session, the epoch it resolved to, and the request's
    full input tokens."""

    session_id: str
    epoch: int
    input_tokens: int
    incarnation: int | None = None  # the plan's: another one now is IncarnationChanged


@dataclass(frozen=True, kw_only=True, slots=True)
class EpochHistory:
    """What the reports of the same session and epoch counted before this one had told: how
    many there were, and the full input tokens of the last of them (0 when there was none)."""

    reports_before: int
    previous_input_tokens: int


class CalibrationStore(Protocol):
    async def calibration(self, tenant_id: str, model_id: str) -> Calibration | None: ...

    async def reconcile(self, tenant_id: str, model_id: str, idempotency_key: str,
                        apply: Reconcile, fingerprint: str = "", *,
                        usage: EpochUsage) -> tuple[Reconciled, EpochHistory | None]:
        """Atomically apply one usage report to the model's calibration and record it against
        its session's epoch (``usage``), once per key, whichever replica it reaches. Returns
        the outcome and, when this call counted it, what the epoch's earlier reports told
        (None: a retried key, whose original outcome is returned and which counts nothing)."""
        ...

    async def latest_factors(self) -> list[tuple[str, float]]:
        """The latest reconciled factor of every model id (across tenants), oldest first."""
        ...


@dataclass
class InMemoryEventLog:
    events: list[ContextEvent] = field(default_factory=list)
    keys: set[tuple[str, str]] = field(default_factory=set)

    async def append(self, event: ContextEvent) -> None:
        self.events.append(event)

    async def append_once(self, event: ContextEvent, key: str) -> bool:
        if (event.tenant_id, key) in self.keys:
            return False
        self.keys.add((event.tenant_id, key))
        self.events.append(event)
        return True

    async def append_once_durably(self, event: ContextEvent, key: str, *,
                                  incarnation: int | None = None) -> bool:
        return await self.append_once(event, key)


@dataclass
class InMemoryCalibrationStore:
    rows: dict[tuple[str, str], Calibration] = field(default_factory=dict)
    keys: dict[tuple[str, str], tuple[str, Reconciled]] = field(default_factory=dict)
    # (tenant, session, epoch) -> (reports, input tokens of the last one)
    epochs: dict[tuple[str, str, int], tuple[int, int]] = field(default_factory=dict)

    async def calibration(self, tenant_id: str, model_id: str) -> Calibration | None:
        return self.rows.get((tenant_id, model_id))

    async def reconcile(self, tenant_id: str, model_id: str, idempotency_key: str,
                        apply: Reconcile, fingerprint: str = "", *,
                        usage: EpochUsage) -> tuple[Reconciled, EpochHistory | None]:
        seen = self.keys.get((tenant_id, idempotency_key))
        if seen is not None:
            if seen[0] != fingerprint:
                raise key_reused()
            return seen[1], None
        outcome = apply(self.rows.get((tenant_id, model_id)))
        self.rows.pop((tenant_id, model_id), None)  # re-inserted last: the latest update
        self.rows[(tenant_id, model_id)] = outcome.calibration
        self.keys[(tenant_id, idempotency_key)] = (fingerprint, outcome)
        epoch = (tenant_id, usage.session_id, usage.epoch)
        reports, previous = self.epochs.get(epoch, (0, 0))
        self.epochs[epoch] = (reports + 1, usage.input_tokens)
        return outcome, EpochHistory(reports_before=reports, previous_input_tokens=previous)

    async def latest_factors(self) -> list[tuple[str, float]]:
        latest: dict[str, float] = {}
        for (_, model_id), calibration in self.rows.items():
            latest.pop(model_id, None)
            latest[model_id] = calibration.factor
        return list(latest.items())


@dataclass(frozen=True, kw_only=True, slots=True)
class StoredCompaction:
    session_id: str
    fingerprint: str
    result: CompactionResult


class CompactionStore(Protocol):
    async def stored(self, tenant_id: str, idempotency_key: str) -> StoredCompaction | None:
        """The compaction a key already made, if any."""
        ...

    async def save(self, tenant_id: str, session_id: str, idempotency_key: str,
                   fingerprint: str, result: CompactionResult, event: ContextEvent, *,
                   incarnation: int | None = None) -> tuple[CompactionResult, bool]:
        """Atomically store the compaction with its ``context.compacted`` event, once per key.
        A key already used returns its stored result (False); a key reused for another
        session or request (``fingerprint``) is InvalidInput. Its session erased:
        SessionNotFound; given the ``incarnation`` of the plan it was made on, the session
        erased and planned again since: IncarnationChanged. Nothing is stored then."""
        ...


def check_stored(stored: StoredCompaction, session_id: str,
                 fingerprint: str) -> CompactionResult:
    if (stored.session_id, stored.fingerprint) != (session_id, fingerprint):
        raise key_reused()
    return stored.result


@dataclass
class InMemoryCompactionStore:
    rows: dict[tuple[str, str], StoredCompaction] = field(default_factory=dict)
    events: list[ContextEvent] = field(default_factory=list)

    async def stored(self, tenant_id: str, idempotency_key: str) -> StoredCompaction | None:
        return self.rows.get((tenant_id, idempotency_key))

    async def save(self, tenant_id: str, session_id: str, idempotency_key: str,
                   fingerprint: str, result: CompactionResult, event: ContextEvent, *,
                   incarnation: int | None = None) -> tuple[CompactionResult, bool]:
        seen = self.rows.get((tenant_id, idempotency_key))
        if seen is not None:
            return check_stored(seen, session_id, fingerprint), False
        self.rows[(tenant_id, idempotency_key)] = StoredCompaction(
            session_id=session_id, fingerprint=fingerprint, result=result)
        self.events.append(event)
        return result, True


@dataclass(frozen=True, kw_only=True, slots=True)
class Erased:
    """What one erasure removed, in rows by kind, and when (the server's clock). ``sessions``
    is 0 when there was nothing to erase."""

    sessions: int = 0
    plans: int = 0
    events: int = 0
    compactions: int = 0
    idempotency_keys: int = 0
    usage_rows: int = 0
    calibrations: int = 0  # a tenant's estimator calibrations (tenant purge only)
    erased_at: datetime

    @property
    def deleted(self) -> bool:
        return any((self.sessions, self.plans, self.events, self.compactions,
                    self.idempotency_keys, self.usage_rows, self.calibrations))


class SessionEraser(Protocol):
    async def erase_session(self, tenant_id: str, session_id: str, *, requested_by: str,
                            at: datetime) -> Erased:
        """Atomically remove the session's plans (every epoch), its current epoch, context
        events, compaction records, usage rows and idempotency keys, and, when anything was
        removed, record an audit row that holds no content (``requested_by``, ``at``)."""
        ...
