"""The server's clock: the one place the service reads the time.

Nothing that reaches a model request reads it: ``build()`` is pure and takes no time at all, and
the prefix is pinned at Plan time from the caller's inputs (the date a request shows is the
caller's ``runtime.current_date``, Region B). The engine reads this clock for its caches' ages
and for telemetry timestamps; a test injects its own (``start(..., clock=...)``) to run a real
server across midnight, a month's end and a year's end. A static test keeps every other module
off the wall clock.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Protocol


class Clock(Protocol):
    def now(self) -> datetime:
        """Wall-clock time, timezone-aware UTC."""
        ...

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back, for ages and deadlines."""
        ...


class SystemClock:
    def now(self) -> datetime:
        return datetime.now(UTC)

    def monotonic(self) -> float:
        return time.monotonic()


SYSTEM_CLOCK = SystemClock()


def time_ns(clock: Clock) -> int:
    """The clock's wall time in nanoseconds since the epoch (for span timestamps)."""
    return int(clock.now().timestamp() * 1_000_000_000)
