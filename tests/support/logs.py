"""A log handler that keeps the events the service logs (``telemetry.logs.log``: a record's
message is its event name)."""

from __future__ import annotations

import logging


class Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.events: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.events.append(record.getMessage())
