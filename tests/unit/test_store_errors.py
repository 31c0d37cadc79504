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
    # told apart from a failover by the metadata, not the message's text
    assert raised.metadata() == {"cause": type(exc).__name__, "sqlstate": exc.sqlstate}
    code, _ = status_for(raised)
    assert code is grpc.StatusCode.UNAVAILABLE and raised.reason == "STORE_CONFLICT"


def test_a_database_that_went_away_is_unavailable_and_a_wrong_query_is_not_translated() -> None:
    gone = _raised(ConnectionResetError())
    assert isinstance(gone, StoreUnavailable)
    assert gone.metadata() == {"cause": "ConnectionResetError"}  # no SQLSTATE: none was given
    wrong = asyncpg.exceptions.UndefinedTableError("relation does not exist")
    assert _raised(wrong) is wrong


def _server_error(sqlstate: str) -> asyncpg.PostgresError:
    """What asyncpg raises for an ErrorResponse with ``sqlstate`` (its class for a code it
    knows, UnknownPostgresError for one it does not)."""
    error = asyncpg.PostgresError.new({"C": sqlstate, "M": "from the server", "S": "FATAL"})
    assert isinstance(error, asyncpg.PostgresError) and error.sqlstate == sqlstate
    return error


# The database's state, not the call: each of these changed nothing, and a retry may succeed.
# Written as SQLSTATEs (the PostgreSQL manual's Appendix A), not asyncpg's classes.
UNAVAILABLE_STATES = [
    "08000", "08001", "08003", "08004", "08006", "08P01",  # class 08: connection exception
    "28000", "28P01",  # class 28: pg_hba.conf reject, a password that no longer works
    "53000", "53100", "53200", "53300", "53400",  # class 53: insufficient resources
    "57000", "57014", "57P01", "57P02", "57P03", "57P04", "57P05",  # class 57: operator
    "25006",  # a write on a read-only server (a standby after a failover)
    "08P99", "28P99", "53999", "57P99",  # codes of those classes asyncpg does not know
]
# A query or a transaction used wrongly: a defect, answered INTERNAL.
DEFECT_STATES = ["42P01", "42601", "23505", "22P02", "25P02", "25001", "55000", "55P03",
                 "3D000", "42501", "XX000"]


@pytest.mark.parametrize("sqlstate", UNAVAILABLE_STATES)
def test_a_server_error_of_an_unavailable_class_is_store_unavailable(sqlstate: str) -> None:
    """A database refusing us (pg_hba.conf), read-only after a failover, out of resources or
    stopped by its operator answered INTERNAL ('internal error'), which clients never retry."""
    error = _server_error(sqlstate)
    raised = _raised(error)
    assert type(raised) is StoreUnavailable and raised.__cause__ is error
    assert sqlstate in str(raised)
    assert raised.metadata() == {"cause": type(error).__name__, "sqlstate": sqlstate}
    code, _ = status_for(raised)
    assert code is grpc.StatusCode.UNAVAILABLE and raised.reason == "STORE_UNAVAILABLE"


def test_a_connection_the_server_ended_while_pooled_is_store_unavailable() -> None:
    """Seen under load while an operator terminated the pool's connections: asyncpg had read the
    server's goodbye but not yet the connection's end, and the next query on it raised this
    (answered INTERNAL, which clients never retry)."""
    error = asyncpg.InternalClientError(
        "cannot switch to state 11; another operation (2) is in progress")
    raised = _raised(error)
    assert type(raised) is StoreUnavailable and raised.__cause__ is error
    code, _ = status_for(raised)
    assert code is grpc.StatusCode.UNAVAILABLE and raised.reason == "STORE_UNAVAILABLE"


@pytest.mark.parametrize("message", ["no binary format encoder for type x (OID 1)",
                                     "PoolConnectionHolder.release() called on a free "
                                     "connection holder"])
def test_the_drivers_other_internal_errors_are_defects(message: str) -> None:
    error = asyncpg.InternalClientError(message)
    assert _raised(error) is error


@pytest.mark.parametrize("sqlstate", DEFECT_STATES)
def test_a_server_error_of_another_class_is_not_translated(sqlstate: str) -> None:
    error = _server_error(sqlstate)
    assert _raised(error) is error


@pytest.mark.parametrize("sqlstate", ["55000", "3D000", "42501", "28000", "XX000"])
def test_any_server_error_while_the_pool_connects_is_store_unavailable(sqlstate: str) -> None:
    """A pool's new connection the server refuses (ALLOW_CONNECTIONS false is 55000, a dropped
    database 3D000, CONNECT revoked 42501): unavailable, though the same SQLSTATE after the
    connection is made is a wrong query."""
    from context_engine.adapters.postgres import pool
    from context_engine.adapters.postgres.errors import RefusedConnection

    error = _server_error(sqlstate)

    async def refused(*args: object, **kwargs: object) -> None:
        raise error

    async def scenario() -> None:
        original = pool.asyncpg.connect
        pool.asyncpg.connect = refused
        try:
            async with translated():
                await pool.connect_refusing("postgresql://nowhere/db", timeout=1)
        finally:
            pool.asyncpg.connect = original

    with pytest.raises(StoreUnavailable) as info:
        asyncio.run(scenario())
    assert isinstance(info.value.__cause__, RefusedConnection)
    assert info.value.__cause__.cause is error and sqlstate in str(info.value)
    # the server's error, not the wrapper that carried it out of the pool
    assert info.value.metadata() == {"cause": type(error).__name__, "sqlstate": sqlstate}
    code, _ = status_for(info.value)
    assert code is grpc.StatusCode.UNAVAILABLE and info.value.reason == "STORE_UNAVAILABLE"
