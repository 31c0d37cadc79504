"""How database errors reach callers: by their class, never their message text."""

from __future__ import annotations

import asyncio

import asyncpg
import grpc
import pytest
from context_engine.adapters.postgres.errors import translated
from context_engine.api.status import status_for
from context_engine.domain.errors import StoreConflict, StoreUnavailable


def _raised(exc: BaseException) -> BaseException:
    async def scenario() -> None:
        async with translated():
            raise exc

    with pytest.raises(Exception) as info:
        asyncio.run(scenario())
    return info.value


@pytest.mark.parametrize("exc", [asyncpg.exceptions.DeadlockDetectedError("deadlock detected"),
                                 asyncpg.exceptions.SerializationError("could not serialize"),
                                 asyncpg.exceptions.TransactionRollbackError("rolled back")])
def test_a_transaction_the_database_rolled_back_on_a_conflict_is_retryable(exc) -> None:
    """A deadlock or a serialization failure (SQLSTATE class 40) escaped as INTERNAL, which the
    clients never retry; the call changed nothing and a retry can succeed."""
    raised = _raised(exc)
    assert isinstance(raised, StoreConflict) and raised.__cause__ is exc
    assert isinstance(raised, StoreUnavailable)  # what absorbs an outage (the outbox) absorbs it
    assert exc.sqlstate in str(raised)
    code, _ = status_for(raised)
    assert code is grpc.StatusCode.UNAVAILABLE and raised.reason == "STORE_CONFLICT"


def test_a_database_that_went_away_is_unavailable_and_a_wrong_query_is_not_translated() -> None:
    assert isinstance(_raised(ConnectionResetError()), StoreUnavailable)
    wrong = asyncpg.exceptions.UndefinedTableError("relation does not exist")
    assert _raised(wrong) is wrong
