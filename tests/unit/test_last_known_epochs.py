"""LastKnownEpochs (adapters/resilience.py) answers which epoch is current while PostgreSQL is
away, from what it saw last: never for a session the database said is gone, the latest
incarnation's epoch over an erased one's, and the sessions seen most recently when it is full.

The database is a dict here; the expected answers are written out."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest
from context_engine.adapters.resilience import LastKnownEpochs
from context_engine.domain.errors import StoreUnavailable
from context_engine.domain.ports import CurrentEpoch, PlanStore

T = "tenant-a"


class Database:
    """A plan store's ``current``: the epochs of a dict, or StoreUnavailable while down."""

    def __init__(self) -> None:
        self.epochs: dict[tuple[str, str], CurrentEpoch] = {}
        self.down = False

    async def current(self, tenant_id: str, session_id: str) -> CurrentEpoch | None:
        if self.down:
            raise StoreUnavailable("database unavailable: ConnectionRefusedError")
        return self.epochs.get((tenant_id, session_id))


def wrapped(db: Database, **kwargs: Any) -> LastKnownEpochs:
    return LastKnownEpochs(cast(PlanStore, db), **kwargs)


def current(epochs: LastKnownEpochs, session_id: str) -> CurrentEpoch | None:
    return asyncio.run(epochs.current(T, session_id))


def test_a_session_the_database_said_is_gone_is_not_answered_for_in_an_outage() -> None:
    db = Database()
    epochs = wrapped(db)
    db.epochs[(T, "s1")] = CurrentEpoch(incarnation=1, epoch=3)
    assert current(epochs, "s1") == CurrentEpoch(incarnation=1, epoch=3)
    del db.epochs[(T, "s1")]  # erased
    assert current(epochs, "s1") is None
    db.down = True
    with pytest.raises(StoreUnavailable):
        current(epochs, "s1")


def test_a_new_incarnation_replaces_a_higher_epoch_of_the_erased_one() -> None:
    db = Database()
    epochs = wrapped(db)
    db.epochs[(T, "s1")] = CurrentEpoch(incarnation=1, epoch=5)
    current(epochs, "s1")
    db.epochs[(T, "s1")] = CurrentEpoch(incarnation=2, epoch=1)  # erased, planned again
    assert current(epochs, "s1") == CurrentEpoch(incarnation=2, epoch=1)
    db.down = True
    assert current(epochs, "s1") == CurrentEpoch(incarnation=2, epoch=1)


def test_when_full_the_session_seen_least_recently_is_forgotten() -> None:
    db = Database()
    epochs = wrapped(db, capacity=2)
    for n, session in enumerate(("s1", "s2", "s3"), start=1):
        db.epochs[(T, session)] = CurrentEpoch(incarnation=1, epoch=n)
        current(epochs, session)
    db.down = True
    assert current(epochs, "s3") == CurrentEpoch(incarnation=1, epoch=3)
    assert current(epochs, "s2") == CurrentEpoch(incarnation=1, epoch=2)
    with pytest.raises(StoreUnavailable):
        current(epochs, "s1")
