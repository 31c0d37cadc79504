"""A server's clock for tests: real wall time (event partitions are by day), and a monotonic
time the test moves forward past a TTL instead of waiting for it."""

from __future__ import annotations

from datetime import datetime

from context_engine.clock import SYSTEM_CLOCK


class StepClock:
    def __init__(self) -> None:
        self.offset = 0.0

    def now(self) -> datetime:
        return SYSTEM_CLOCK.now()

    def monotonic(self) -> float:
        return SYSTEM_CLOCK.monotonic() + self.offset

    def advance(self, seconds: float) -> None:
        self.offset += seconds
