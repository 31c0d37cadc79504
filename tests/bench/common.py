"""What the benchmarks share: a hard deadline, so a run stops by itself."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class Deadline(Exception):
    pass


@contextmanager
def deadline(seconds: int, what: str = "the benchmark") -> Iterator[None]:
    def expire(signum: int, frame: Any) -> None:
        raise Deadline(f"{what} did not finish within {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
