"""The health watch's database probe: a failure that means the database went away answers
unreachable; it never ends the watch (found in a full run: asyncpg's "cannot switch to state
12; another operation (2) is in progress", a pooled connection the server had ended, escaped the
probe, ended the watch task, and failed the server's stop)."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import pytest
from context_engine.adapters.postgres.errors import RefusedConnection
from context_engine.api.server import database_reachable


class _Connection:
    def __init__(self, exc: BaseException | None) -> None:
        self.exc = exc
        self.closed = False

    async def fetchval(self, *args: Any, **kwargs: Any) -> int:
        if self.exc is not None:
            raise self.exc
        return 1

    async def close(self, **kwargs: Any) -> None:
        self.closed = True


class _Pool:
    """A pool whose connection answers ``SELECT 1`` with ``exc``; ``busy``: none frees."""

    def __init__(self, exc: BaseException | None, *, busy: bool = False) -> None:
        self.connection = _Connection(exc)
        self.busy = busy
        self.released = 0
        self.refused: BaseException | None = None

    async def acquire(self, *, timeout: float) -> _Connection:
        if self.busy:
            raise TimeoutError
        if self.refused is not None:
            raise self.refused
        return self.connection

    async def release(self, connection: _Connection, *, timeout: float) -> None:
        self.released += 1


@pytest.mark.parametrize("exc", [
    asyncpg.InternalClientError("cannot switch to state 12; another operation (2) is in "
                                "progress"),
    ConnectionResetError(),
    asyncpg.ObjectNotInPrerequisiteStateError("database is not accepting connections"),
])
def test_the_database_going_away_is_unreachable(exc: BaseException) -> None:
    assert asyncio.run(database_reachable(_Pool(exc), 1.0)) is False  # type: ignore[arg-type]


def test_a_reachable_database_and_a_defect_are_told_apart() -> None:
    assert asyncio.run(database_reachable(_Pool(None), 1.0)) is True  # type: ignore[arg-type]
    with pytest.raises(asyncpg.InternalClientError):
        asyncio.run(database_reachable(  # type: ignore[arg-type]
            _Pool(asyncpg.InternalClientError("no decoder for OID 99999")), 1.0))


def _outside(exc: BaseException | None = None, query: BaseException | None = None
             ) -> tuple[Any, list[_Connection]]:
    opened: list[_Connection] = []

    async def connect() -> _Connection:
        if exc is not None:
            raise exc
        opened.append(_Connection(query))
        return opened[-1]

    return connect, opened


def test_a_busy_pool_is_probed_outside_it_and_never_taken_for_the_database_away() -> None:
    busy = _Pool(None, busy=True)
    # no connection outside the pool to ask: busy, the caller keeps its state
    assert asyncio.run(database_reachable(busy, 1.0)) is None  # type: ignore[arg-type]
    connect, opened = _outside()
    assert asyncio.run(database_reachable(busy, 1.0, connect)) is True  # type: ignore[arg-type]
    assert len(opened) == 1 and opened[0].closed  # opened for the probe, closed after it
    # let in but too busy to answer, or refused for too many connections: busy, not away
    connect, opened = _outside(query=TimeoutError())
    assert asyncio.run(database_reachable(busy, 1.0, connect)) is None  # type: ignore[arg-type]
    assert opened[0].closed
    connect, _ = _outside(asyncpg.TooManyConnectionsError("sorry, too many clients"))
    assert asyncio.run(database_reachable(busy, 1.0, connect)) is None  # type: ignore[arg-type]


@pytest.mark.parametrize("exc", [TimeoutError(), ConnectionRefusedError(),
                                 asyncpg.CannotConnectNowError("the database is starting up")])
def test_a_busy_pool_and_no_connection_outside_it_is_the_database_away(
        exc: BaseException) -> None:
    connect, _ = _outside(exc)
    assert asyncio.run(database_reachable(  # type: ignore[arg-type]
        _Pool(None, busy=True), 1.0, connect)) is False


def test_a_pooled_connection_is_given_back_whatever_the_probe_met() -> None:
    for exc in (None, ConnectionResetError()):
        pool = _Pool(exc)
        asyncio.run(database_reachable(pool, 1.0))  # type: ignore[arg-type]
        assert pool.released == 1


def test_a_pooled_connection_answering_late_is_asked_about_outside_the_pool() -> None:
    """Late is how a busy database answers (a pooler's queue) and how a hung one does: the
    pooled connection's late answer is read as the connection outside the pool's is, never as
    the database away by itself."""
    late = _Pool(TimeoutError())
    assert asyncio.run(database_reachable(late, 1.0)) is None  # type: ignore[arg-type]
    assert late.released == 1
    connect, opened = _outside()
    assert asyncio.run(database_reachable(late, 1.0, connect)) is True  # type: ignore[arg-type]
    assert len(opened) == 1 and opened[0].closed and late.released == 2
    connect, _ = _outside(query=TimeoutError())  # let in, late too: busy
    assert asyncio.run(database_reachable(late, 1.0, connect)) is None  # type: ignore[arg-type]
    connect, _ = _outside(TimeoutError())  # no connection within the bound: away
    assert asyncio.run(database_reachable(late, 1.0, connect)) is False  # type: ignore[arg-type]


def test_a_late_pooled_connection_the_pool_fails_to_give_back_is_still_busy() -> None:
    class _Stuck(_Pool):  # its cancel unanswered: the release times out (the pool ends it)
        async def release(self, connection: _Connection, *, timeout: float) -> None:
            self.released += 1
            raise TimeoutError

    stuck = _Stuck(TimeoutError())
    assert asyncio.run(database_reachable(stuck, 1.0)) is None  # type: ignore[arg-type]
    connect, _ = _outside(query=TimeoutError())
    assert asyncio.run(database_reachable(stuck, 1.0, connect)) is None  # type: ignore[arg-type]
    assert stuck.released == 2


def test_the_pools_new_connection_refused_for_too_many_is_busy_not_away() -> None:
    """Every pooled connection busy, the pool opens another and PostgreSQL refuses it for too
    many connections (53300): the server answered, full, and health keeps its state (README,
    "Reliability"); read as the database away, health turned NOT_SERVING under load and back
    as soon as a connection freed. Any other refusal of it is the database away."""
    full = _Pool(None)
    full.refused = RefusedConnection(asyncpg.TooManyConnectionsError(
        'too many connections for role "ce"'))
    connect, opened = _outside()
    for outside in (None, connect):
        assert asyncio.run(database_reachable(full, 1.0, outside)) is None  # type: ignore[arg-type]
    assert not opened and not full.released
    closed = _Pool(None)
    closed.refused = RefusedConnection(asyncpg.ObjectNotInPrerequisiteStateError(
        "database is not accepting connections"))
    assert asyncio.run(database_reachable(closed, 1.0, connect)) is False  # type: ignore[arg-type]
