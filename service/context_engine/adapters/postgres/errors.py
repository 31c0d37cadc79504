"""Translate driver errors by class (and SQLSTATE class), never by message text, chaining the
cause."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import asyncpg

from context_engine.domain.errors import StoreConflict, StoreUnavailable


class RefusedConnection(Exception):
    """The server answered a new connection of the pool with an error (``pool.connect_refusing``
    raises it): whatever its SQLSTATE, the database did not let this process in, so nothing was
    read or written and a later call may get in. ``ObjectNotInPrerequisiteStateError`` (55000:
    ``ALLOW_CONNECTIONS false``), ``InvalidCatalogNameError`` (3D000: the database was dropped)
    or ``InsufficientPrivilegeError`` (42501: ``CONNECT`` revoked) mean a query is wrong after
    the connection is made, but the database refusing entry before it."""

    def __init__(self, cause: asyncpg.PostgresError) -> None:
        super().__init__(f"{type(cause).__name__} (SQLSTATE {cause.sqlstate}) while connecting: "
                         f"{cause}")
        self.cause = cause


# Errors that mean "the database cannot be reached or went away", not "the query is wrong",
# whatever SQLSTATE they carry (if any).
UNAVAILABLE: tuple[type[BaseException], ...] = (
    OSError,
    asyncio.TimeoutError,
    asyncpg.InterfaceError,  # the driver's side of a connection lost or closed
    RefusedConnection,  # any server error while connecting (acquiring from the pool)
    asyncpg.PostgresConnectionError,
    asyncpg.CannotConnectNowError,
    asyncpg.exceptions.AdminShutdownError,
    asyncpg.exceptions.CrashShutdownError,
    asyncpg.exceptions.TooManyConnectionsError,
)

# The driver's protocol out of step with its connection: a pooled connection the server ended
# (an operator's pg_terminate_backend, a restart) whose error asyncpg had read but whose end it
# had not yet, handed out and used ("cannot switch to state 11; another operation (2) is in
# progress"). Its other InternalClientErrors (a codec missing, a pool holder misused) are
# defects, so only this one.
OUT_OF_STEP = "cannot switch to state"

# SQLSTATE classes that say the same of the database, not of the query, at any moment of a call.
# By class, so that a code of the class asyncpg does not know (UnknownPostgresError) counts too.
UNAVAILABLE_SQLSTATE_CLASSES = frozenset({
    "08",  # connection exception: the connection failed or was refused
    "28",  # invalid authorization specification: pg_hba.conf rejects us, the password or the
           # role no longer works (only ever raised while connecting)
    "53",  # insufficient resources: disk full, out of memory, too many connections
    "57",  # operator intervention: a query cancelled, the server shutting down or crashed,
           # starting up (cannot connect now), the database dropped, an idle session timed out
})
UNAVAILABLE_SQLSTATES = frozenset({
    "25006",  # read_only_sql_transaction: a write reached a read-only server (a standby after a
              # failover, default_transaction_read_only): the other class 25 codes are a
              # transaction used wrongly (a defect), so only this one
})


def store_unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` means the database is unavailable (the call changed nothing and may
    succeed later), not that the call is wrong."""
    if isinstance(exc, UNAVAILABLE):
        return True
    if isinstance(exc, asyncpg.InternalClientError) and str(exc).startswith(OUT_OF_STEP):
        return True
    if isinstance(exc, asyncpg.PostgresError):
        state = str(exc.sqlstate or "")
        return state[:2] in UNAVAILABLE_SQLSTATE_CLASSES or state in UNAVAILABLE_SQLSTATES
    return False


@asynccontextmanager
async def translated() -> AsyncIterator[None]:
    try:
        yield
    except asyncpg.exceptions.TransactionRollbackError as exc:  # SQLSTATE class 40
        raise StoreConflict(f"the database rolled the transaction back "
                            f"({type(exc).__name__}, SQLSTATE {exc.sqlstate}) on a conflict "
                            "with a concurrent call: nothing changed; retry",
                            cause=type(exc).__name__, sqlstate=str(exc.sqlstate or "")) from exc
    except Exception as exc:
        if not store_unavailable(exc):
            raise
        error: BaseException = exc.cause if isinstance(exc, RefusedConnection) else exc
        sqlstate = str(getattr(error, "sqlstate", None) or "")
        if isinstance(exc, RefusedConnection):
            detail = (f"the server refused the connection ({type(error).__name__}, "
                      f"SQLSTATE {sqlstate})")
        elif isinstance(exc, asyncpg.PostgresError):
            detail = f"{type(exc).__name__}, SQLSTATE {sqlstate}"
        else:
            detail = type(exc).__name__
        raise StoreUnavailable(f"database unavailable: {detail}", cause=type(error).__name__,
                               sqlstate=sqlstate) from exc
