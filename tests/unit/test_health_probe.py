"""The health watch's database probe: a failure that means the database went away answers
unreachable; it never ends the watch (found in a full run: asyncpg's "cannot switch to state
12; another operation (2) is in progress", a pooled connection the server had ended, escaped the
probe, ended the watch task, and failed the server's stop)."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import pytest
from context_engine.api.server import database_reachable


class _Pool:
    def __init__(self, exc: BaseException | None) -> None:
        self.exc = exc

    async def fetchval(self, *args: Any, **kwargs: Any) -> int:
        if self.exc is not None:
            raise self.exc
        return 1


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
