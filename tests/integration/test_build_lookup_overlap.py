"""A Build reads its plan while it maps and scans the checkpoint, and still answers a refused
request as before: the lookup is awaited only once the request is known to be valid."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import asyncpg
import grpc
import pytest
from context_engine.api import servicer
from context_engine.v1 import context_engine_pb2_grpc as pb_grpc

from tests.conftest import ServerThread
from tests.conftest import test_config as base_config
from tests.integration.requests import build_request, failure, plan_request

pytestmark = pytest.mark.integration

HOLD = 0.2  # how long each plan lookup is held


def test_the_plan_is_read_while_the_checkpoint_is_scanned(database_url: str, ids: Any,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    tenant, session = ids
    log: list[str] = []
    srv = ServerThread(base_config(), database_url)
    try:
        engine = srv.running.engine
        loaded = engine.loaded

        async def slow_loaded(*args: Any, **kwargs: Any) -> Any:
            log.append("lookup started")
            try:
                await asyncio.sleep(HOLD)
                return await loaded(*args, **kwargs)
            finally:
                log.append("lookup done")

        scan = servicer.checkpoint_scan

        def scanning(*args: Any, **kwargs: Any) -> Any:
            log.append("scanned")
            return scan(*args, **kwargs)

        monkeypatch.setattr(engine, "loaded", slow_loaded)
        monkeypatch.setattr(servicer, "checkpoint_scan", scanning)
        with grpc.insecure_channel(srv.address) as channel:
            stub = pb_grpc.ContextEngineStub(channel)
            stub.Plan(plan_request(tenant, session), timeout=30)
            log.clear()
            stub.Build(build_request(tenant, session), timeout=30)
            assert log[:3] == ["lookup started", "scanned", "lookup done"]
            # a refused request is refused as before, whatever its lookup finds
            log.clear()
            bad = build_request(tenant, "no-such-session")
            bad.checkpoint.items[0].id = ""
            with pytest.raises(grpc.RpcError) as err:
                stub.Build(bad, timeout=30)
            assert failure(err.value).code is grpc.StatusCode.INVALID_ARGUMENT
            assert log == ["lookup started", "scanned", "lookup done"], log
            log.clear()
            with pytest.raises(grpc.RpcError) as err:
                stub.Build(build_request(tenant, "no-such-session"), timeout=30)
            assert failure(err.value).code is grpc.StatusCode.NOT_FOUND
            # ... and answers only once its lookup has ended (nothing of it outlives the answer)
            assert log[-1] == "lookup done", log
            log.clear()
            unknown = build_request(tenant, session)
            unknown.base_build_id, unknown.base_items_kept = "never-built", 1
            with pytest.raises(grpc.RpcError) as err:
                stub.Build(unknown, timeout=30)
            assert failure(err.value).reason == "BUILD_BASE_UNKNOWN"
            assert log == []  # an unknown base is refused before the plan is read
    finally:
        srv.stop()


def test_a_build_whose_rendering_fails_still_logs_what_it_built(
        database_url: str, ids: Any, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The response is rendered inside the Build (while its pressure event is written): a
    failure there is INTERNAL, and the call's log line still carries the Build's figures."""
    from context_engine.api import mapping
    tenant, session = ids
    srv = ServerThread(base_config(), database_url)
    try:
        def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("rendering broke")

        with grpc.insecure_channel(srv.address) as channel:
            stub = pb_grpc.ContextEngineStub(channel)
            stub.Plan(plan_request(tenant, session), timeout=30)
            monkeypatch.setattr(mapping, "build_pb", broken)
            caplog.set_level(logging.INFO, logger="context_engine")
            with pytest.raises(grpc.RpcError) as err:
                stub.Build(build_request(tenant, session), timeout=30)
            assert err.value.code() is grpc.StatusCode.INTERNAL
    finally:
        srv.stop()
    lines = [getattr(r, "fields", {}) for r in caplog.records if r.getMessage() == "rpc"]
    built = [f for f in lines if f.get("method") == "Build"]
    assert built and built[-1].get("estimated_input_tokens", 0) > 0, lines
    assert built[-1].get("epoch") == 1, built[-1]



@pytest.mark.parametrize("refused", [False, True], ids=["valid", "refused"])
def test_a_build_cancelled_while_its_plan_is_read_stops_the_read(
        database_url: str, direct_database_url: str, ids: Any, refused: bool) -> None:
    """A Build whose deadline passes while its plan lookup waits on the database stops the
    lookup: nothing of the call runs on after it, holding a connection of the pool for a caller
    gone (and outside the concurrency limit, which no longer counts the call). A refused
    request (here an estimator_factor out of range) waits for its lookup before it answers;
    cancelled in that wait, it left the lookup waiting on the database until
    CE_DB_TIMEOUT_SECONDS."""
    tenant, session = ids
    size = 2
    srv = ServerThread(base_config().replace(db_pool_size=size, db_timeout_seconds=30.0),
                       database_url)
    loop = asyncio.new_event_loop()
    locker: Any = None
    try:
        with grpc.insecure_channel(srv.address) as channel:
            stub = pb_grpc.ContextEngineStub(channel)
            stub.Plan(plan_request(tenant, session), timeout=30)

            async def lock() -> Any:  # a plain read of sessions waits until it is rolled back
                conn = await asyncpg.connect(direct_database_url)
                await conn.execute("BEGIN; LOCK TABLE sessions IN ACCESS EXCLUSIVE MODE")
                return conn
            locker = loop.run_until_complete(lock())
            request = build_request(tenant, session)
            if refused:
                request.estimator_factor = 9.0
            with pytest.raises(grpc.RpcError) as err:
                stub.Build(request, timeout=0.5)
            assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED

            def waiting() -> tuple[int, int]:
                """(the server's backends waiting on the lock, its pool's connections in use)"""
                held = loop.run_until_complete(locker.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE pid <> pg_backend_pid() "
                    "AND datname = current_database() AND wait_event_type = 'Lock' "
                    "AND query LIKE '%FROM sessions%'"))
                pool = srv.running.pool
                return int(held), pool.get_size() - pool.get_idle_size()
            deadline = time.monotonic() + 3
            while waiting() != (0, 0) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert waiting() == (0, 0)
    finally:
        if locker is not None:
            loop.run_until_complete(locker.close())
        loop.close()
        srv.stop()
