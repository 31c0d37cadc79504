"""How the service's connections to PostgreSQL are made, directly or behind a pooler.

Directly (``Pooler.NONE``, also right behind a pooler in session mode) asyncpg keeps its
statement cache: a named prepared statement per query and connection, parsed once.

Behind a pooler in transaction mode (``Pooler.TRANSACTION``: PgBouncer's ``pool_mode =
transaction``) each transaction of a client connection, and each statement outside one, may run
on another server connection, so nothing may be left on a server connection for later:

- no statement cache (``statement_cache_size=0``): asyncpg prepares every statement unnamed.
  It sends Parse, Describe and Flush, then Bind, Execute and Sync: no Sync in between, so the
  pooler (which lets go of the server connection only at ReadyForQuery outside a transaction)
  keeps both halves on one server connection. A named statement would stay behind on a server
  connection the next statement of the same client may never see. PgBouncer 1.21's
  ``max_prepared_statements`` is not needed for this.
- behind the pooler, asyncpg's reset query (below) would run on whichever server connection is
  free, on state no one of ours left there.
- no session setting in the start-up packet but ``application_name``, which the pooler tracks
  (PgBouncer refuses any other it does not know, e.g. ``default_transaction_read_only``).

Either way a connection goes back to the pool without asyncpg's reset query (which releases
every advisory lock, closes cursors, stops listening and resets settings): the service keeps no
state on a database session past its transaction (no session advisory lock, SET, LISTEN,
temporary table or WITH HOLD cursor; ``tests/unit/test_session_state.py`` checks), so the query
would only add a round trip to every database call. A transaction left open is still rolled
back on release (asyncpg does that whatever the query).
"""

from __future__ import annotations

from typing import Any

import asyncpg

from context_engine.adapters.postgres.errors import RefusedConnection
from context_engine.config import Pooler


class StatelessConnection(asyncpg.Connection):  # type: ignore[misc]
    """A connection of the service's: released without a reset query (it holds no session
    state past a transaction)."""

    def get_reset_query(self) -> str:
        return ""


def connect_options(pooler: Pooler) -> dict[str, Any]:
    """The asyncpg options (``connect`` and ``create_pool``) for connections behind
    ``pooler``."""
    if pooler is Pooler.TRANSACTION:
        return {"statement_cache_size": 0, "connection_class": StatelessConnection}
    return {"connection_class": StatelessConnection}


async def connect_refusing(*args: Any, **kwargs: Any) -> asyncpg.Connection:
    """``asyncpg.connect`` for the pool: a server error while connecting (the database refuses
    connections, pg_hba.conf rejects us, the database was dropped) is ``RefusedConnection``,
    which the store answers as unavailable whatever its SQLSTATE (the same SQLSTATE after the
    connection is made, 55000 say, is a wrong query)."""
    try:
        return await asyncpg.connect(*args, **kwargs)
    except asyncpg.PostgresError as exc:
        raise RefusedConnection(exc) from exc


async def create_pool(dsn: str, *, pooler: Pooler, max_size: int,
                      timeout: float) -> asyncpg.Pool:
    """The serving process's pool: at most ``max_size`` connections, each database call and
    each connection attempt bounded by ``timeout`` seconds; a connection the server refuses is
    ``RefusedConnection``."""
    return await asyncpg.create_pool(dsn, min_size=1, max_size=max_size, command_timeout=timeout,
                                     timeout=timeout, connect=connect_refusing,
                                     **connect_options(pooler))


async def connect(dsn: str, *, pooler: Pooler, **options: Any) -> asyncpg.Connection:
    """One connection outside the pool (``inspect``)."""
    return await asyncpg.connect(dsn, **{**options, **connect_options(pooler)})
