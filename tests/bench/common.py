"""What the benchmarks share: a hard deadline, so a run stops by itself, and the event-loop
thread the Build benchmark runs its servers (and all its tokenization) on."""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar, cast

T = TypeVar("T")


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


class Loop:
    """One event-loop thread for a whole run. Every server of the Build benchmark is started on
    it (and so is every Build served on it), and the raw counter passes and trim_messages run on
    it too: tiktoken was measured here to encode about 1.45x slower on any thread other than the
    first one that used the encoding in the process, so all tokenization shares this one thread
    (the real ``serve`` runs its loop, and so its tokenization, on the main thread)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                       name="bench-loop")
        self.thread.start()

    def call(self, coro: Any, timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def run(self, fn: Callable[[], T], timeout: float = 120) -> T:
        """``fn()`` on the loop thread (while no RPC is in flight), its result here."""
        async def wrapped() -> T:
            return fn()
        return cast(T, self.call(wrapped(), timeout))

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()
