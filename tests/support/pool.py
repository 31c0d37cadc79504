"""A running test server's pool with every connection taken (the store's waits for one)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def every_connection_taken(server: Any, size: int) -> Iterator[None]:
    """Holds ``size`` connections of ``server``'s pool (a ``tests.conftest.ServerThread``;
    all of them when ``size`` is its CE_DB_POOL_SIZE) until the block ends."""
    pool = server.running.pool

    async def take() -> Any:
        return await pool.acquire()

    held = [server.call(take()) for _ in range(size)]
    try:
        yield
    finally:
        for conn in held:
            server.call(pool.release(conn))
