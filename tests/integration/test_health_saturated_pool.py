"""The health watch with every pooled connection busy, under a real server and a real
PostgreSQL of the test's own (connected directly): a pool busy serving is not a database away
(health stays SERVING and the probe answers within its bound), and a database that stops
answering while the pool is busy is noticed (NOT_SERVING, no plan being cached) rather than
waited out behind the busy connections; nor is a database that hangs while the pool is idle (its
pooled ``SELECT 1`` answers late, which alone is busy: ``test_health_busy_pooler.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Iterator

import asyncpg
import psutil
import pytest
from context_engine.api.server import POOL_CLOSE_SECONDS, database_reachable, watch_health
from context_engine.config import Pooler
from grpc_health.v1 import health_pb2

from tests.conftest import ServerThread
from tests.conftest import test_config as base_config
from tests.integration.test_db_faults import Database

pytestmark = pytest.mark.integration

POOL = 2
HELD = 8.0  # seconds each busy connection is held in pg_sleep


@pytest.fixture(scope="module")
def database() -> Iterator[Database]:
    db = Database()
    yield db
    db.close()


@pytest.fixture
def server(database: Database) -> Iterator[ServerThread]:
    srv = ServerThread(base_config().replace(db_pooler=Pooler.NONE, db_pool_size=POOL),
                       database.url)
    yield srv
    srv.stop()


def saturate(srv: ServerThread) -> list[asyncio.Future[object]]:
    """Every pooled connection taken by a call in pg_sleep (a long transaction, a lock wait)."""
    pool = srv.running.pool

    async def hold() -> None:
        async with pool.acquire() as connection:
            await connection.execute(f"SELECT pg_sleep({HELD})", timeout=HELD + 30)

    held = [asyncio.run_coroutine_threadsafe(hold(), srv.loop) for _ in range(POOL)]
    deadline = time.monotonic() + 10
    while srv.call(_idle(pool)) > 0 or srv.running.pool.get_size() < POOL:
        assert time.monotonic() < deadline, "the pool did not fill"
        time.sleep(0.05)
    return held  # type: ignore[return-value]


async def _idle(pool) -> int:  # type: ignore[no-untyped-def]
    return int(pool.get_idle_size())


def health(srv: ServerThread) -> int:
    async def status() -> int:
        servicer = srv.running.health
        return int(servicer._server_status[""])  # what Check answers

    return int(srv.call(status()))


def test_a_busy_pool_is_healthy_and_the_probe_keeps_its_bound(server: ServerThread) -> None:
    held = saturate(server)
    started = time.monotonic()
    # a bound of 2 s a step: a connection outside the pool opened in over 1 s on a loaded
    # machine (two cores, the suite's three processes) once read as the database away
    reachable = server.call(database_reachable(server.running.pool, 2.0, server.running.probe))
    took = time.monotonic() - started
    assert reachable is True and took < 5.0, (reachable, took)  # not HELD seconds
    time.sleep(2.5)  # the watch runs every second meanwhile
    assert health(server) == health_pb2.HealthCheckResponse.SERVING
    for h in held:
        h.result(HELD + 30)


def _postgres(database: Database) -> list[psutil.Process]:
    pid = database.server.get_pid()
    assert pid is not None
    main = psutil.Process(pid)
    return [main, *main.children(recursive=True)]


def hung_until_noticed(database: Database, server: ServerThread, *, within: float) -> None:
    """PostgreSQL hung (SIGSTOP: no connection is reset, none answers) until health says
    NOT_SERVING, which must come within ``within`` seconds; then resumed, and health must come
    back to SERVING by itself."""
    stopped = _postgres(database)
    for process in stopped:
        os.kill(process.pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + within
        while health(server) != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() < deadline, "health still SERVING: the away went unnoticed"
            time.sleep(0.1)
    finally:
        for process in stopped:
            os.kill(process.pid, signal.SIGCONT)
    deadline = time.monotonic() + 20
    while health(server) != health_pb2.HealthCheckResponse.SERVING:
        assert time.monotonic() < deadline, "health did not come back"
        time.sleep(0.1)


def test_a_database_that_stops_answering_while_the_pool_is_busy_is_noticed(
        database: Database, server: ServerThread) -> None:
    assert len(server.running.engine.cache) == 0  # nothing cached: NOT_SERVING when away
    held = saturate(server)
    # interval + pool bound + connect bound, and slack
    hung_until_noticed(database, server, within=6)
    for h in held:
        h.result(HELD + 30)


def test_a_database_that_hangs_while_the_pool_is_idle_is_noticed(
        database: Database, server: ServerThread) -> None:
    """The pooled ``SELECT 1`` answers late (a late answer alone is busy, not away); the
    connection outside the pool is not let in within the bound: away."""
    assert len(server.running.engine.cache) == 0
    deadline = time.monotonic() + 10
    while server.call(_idle(server.running.pool)) == 0:
        assert time.monotonic() < deadline, "no idle pooled connection"
        time.sleep(0.05)
    # interval + late answer + release (its cancel unanswered) + connect bound, and slack
    hung_until_noticed(database, server, within=8)


def test_the_server_stops_when_asked_as_the_probes_connection_opens(
        database: Database) -> None:
    """Stopping cancels the health watch; a cancel that lands as the probe's connection outside
    the pool opens (the connection made, the watch not yet resumed) still ends the watch, and
    the probe's connection is closed: stop never waits on a watch that went on probing."""
    srv = ServerThread(base_config().replace(db_pooler=Pooler.NONE, db_pool_size=POOL),
                       database.url)
    running = srv.running
    opened: list[asyncpg.Connection] = []
    stopping: list[asyncio.Task[None]] = []

    async def rewatch() -> None:
        assert running.watch is not None and running.probe is not None
        running.watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running.watch
        probe = running.probe

        async def outside() -> asyncpg.Connection:
            connection = await probe()
            opened.append(connection)
            if not stopping:  # the stop's cancel arrives while this connection is handed over
                stopping.append(asyncio.get_running_loop().create_task(
                    running.stop(1.0)))
            return connection

        running.watch = asyncio.get_running_loop().create_task(watch_health(
            running.health, running.pool, running.engine, interval=0.05, timeout=1.0,
            outside=outside))

    held = saturate(srv)
    srv.call(rewatch())
    deadline = time.monotonic() + 10
    while not stopping:
        assert time.monotonic() < deadline, "the probe never went outside the busy pool"
        time.sleep(0.05)

    async def watch_ended() -> bool:
        assert running.watch is not None
        done, _ = await asyncio.wait([running.watch], timeout=5)
        return bool(done)

    try:
        # (stop goes on to close the pool once the busy calls end)
        assert srv.call(watch_ended()), "the health watch went on probing: stop waits on it"
        assert all(c.is_closed() for c in opened)
        srv.call(asyncio.wait_for(stopping[0], HELD + 30))
    finally:
        for h in held:
            with contextlib.suppress(Exception):
                h.result(HELD + 30)
        srv.loop.call_soon_threadsafe(srv.loop.stop)
        srv.thread.join(10)


def test_a_stop_while_the_database_hangs_ends_cleanly(database: Database) -> None:
    """SIGTERM's path (``Running.stop``) with PostgreSQL hung: the pool's goodbyes go
    unanswered, its connections are ended without them within POOL_CLOSE_SECONDS, logged, and
    the rest of the stop is done (the metrics endpoint shut). It raised TimeoutError: the stop
    ended there, in a traceback and exit 1, a failed worker to its supervisor."""
    srv = ServerThread(base_config().replace(db_pooler=Pooler.NONE, db_pool_size=POOL,
                                             db_timeout_seconds=1.0), database.url)
    running = srv.running
    deadline = time.monotonic() + 10
    while srv.call(_idle(running.pool)) == 0:  # a pooled connection to say goodbye on
        assert time.monotonic() < deadline, "no idle pooled connection"
        time.sleep(0.05)
    stopped = _postgres(database)
    for process in stopped:
        os.kill(process.pid, signal.SIGSTOP)
    logged: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = logged.append  # type: ignore[method-assign]
    logger = logging.getLogger("context_engine")
    logger.addHandler(handler)
    try:
        started = time.monotonic()
        srv.call(running.stop(1.0), timeout=30)  # raised TimeoutError
        took = time.monotonic() - started
    finally:
        logger.removeHandler(handler)
        for process in stopped:
            os.kill(process.pid, signal.SIGCONT)
        srv.loop.call_soon_threadsafe(srv.loop.stop)
    assert took < 1.0 + POOL_CLOSE_SECONDS + 3, took
    (failed,) = [r for r in logged if r.getMessage() == "pool_close_failed"]
    assert failed.levelno == logging.WARNING
    assert running.pool.is_closing()
