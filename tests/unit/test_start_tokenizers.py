"""How the server's start waits for its tokenizers' thread (``server.joined``, ``settled``): a
thread cannot be stopped, so a start that is cancelled or fails ends only after the loads have,
and a failed load is logged rather than lost."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest
from context_engine.api.server import joined, settled

from tests.support.logs import Captured


def slow_load(release: threading.Event, done: list[str], fail: bool = False) -> None:
    release.wait(10)
    done.append("loaded")
    if fail:
        raise RuntimeError("no vocabulary")


def test_a_cancelled_start_returns_only_once_the_loads_have_ended():
    release = threading.Event()
    done: list[str] = []

    async def scenario() -> tuple[list[str], bool]:
        loads = asyncio.ensure_future(asyncio.to_thread(slow_load, release, done))
        starting = asyncio.ensure_future(joined(loads))
        await asyncio.sleep(0.05)
        starting.cancel()
        await asyncio.sleep(0.05)
        assert not starting.done()  # still waiting for the thread
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await starting
        return list(done), loads.cancelled()

    seen, cancelled = asyncio.run(scenario())
    assert seen == ["loaded"] and not cancelled


def test_a_load_that_fails_fails_the_start_and_is_logged_when_the_start_failed_first():
    release = threading.Event()
    release.set()
    handler = Captured()
    logger = logging.getLogger("context_engine")
    logger.addHandler(handler)
    try:
        async def joined_failure() -> None:
            await joined(asyncio.ensure_future(
                asyncio.to_thread(slow_load, release, [], True)))

        with pytest.raises(RuntimeError, match="no vocabulary"):
            asyncio.run(joined_failure())

        async def settled_failure() -> None:
            await settled(asyncio.ensure_future(
                asyncio.to_thread(slow_load, release, [], True)))

        asyncio.run(settled_failure())  # the start's own error is what it raises
    finally:
        logger.removeHandler(handler)
    assert handler.events == ["tokenizers_failed"]
