"""Translate driver errors by class, never by message text, chaining the cause."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import asyncpg

from context_engine.domain.errors import StoreConflict, StoreUnavailable

# Errors that mean "the database cannot be reached or went away", not "the query is wrong".
UNAVAILABLE: tuple[type[BaseException], ...] = (
    OSError,
    asyncio.TimeoutError,
    asyncpg.PostgresConnectionError,
    asyncpg.CannotConnectNowError,
    asyncpg.InterfaceError,
    asyncpg.exceptions.AdminShutdownError,
    asyncpg.exceptions.CrashShutdownError,
    asyncpg.exceptions.TooManyConnectionsError,
)


@asynccontextmanager
async def translated() -> AsyncIterator[None]:
    try:
        yield
    except UNAVAILABLE as exc:
        raise StoreUnavailable(f"database unavailable: {type(exc).__name__}") from exc
    except asyncpg.exceptions.TransactionRollbackError as exc:  # SQLSTATE class 40
        raise StoreConflict(f"the database rolled the transaction back "
                            f"({type(exc).__name__}, SQLSTATE {exc.sqlstate}) on a conflict "
                            "with a concurrent call: nothing changed; retry") from exc
