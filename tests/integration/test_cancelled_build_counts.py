"""A Build whose deadline passes while it writes its pressure event is not served, and is not
counted as served: ``context_engine_budget_pressure_total`` counts each Build served once
(README, "each event is one Build served"), so a Build cancelled there and sent again counts
once, as its one event does. Counted before the event was written, the cancelled Build counted
its yield steps too and its retry counted them again: twice the pressure for one Build served
and one event."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import asyncpg
import grpc
import pytest
from context_engine.v1 import context_engine_pb2_grpc as pb_grpc

from tests.conftest import ServerThread
from tests.conftest import test_config as base_config
from tests.integration.requests import plan_request
from tests.integration.test_budget_rpc import SMALL
from tests.integration.test_refused_build_writes import pressured

pytestmark = pytest.mark.integration


def test_a_build_cancelled_while_it_writes_its_pressure_event_counts_nothing(
        database_url: str, direct_database_url: str, ids: Any, db: Any) -> None:
    tenant, session = ids
    srv = ServerThread(base_config(), database_url)
    loop = asyncio.new_event_loop()

    def counted() -> float:
        return sum(s.value for m in srv.registry.collect() for s in m.samples
                   if s.name == "context_engine_budget_pressure_total")

    def pressure_events() -> list[dict[str, Any]]:
        return [json.loads(r["payload"]) for r in db.fetch(
            "SELECT payload::text AS payload FROM context_events WHERE tenant_id = $1 "
            "AND type = 'context.budget.pressure'", tenant)]
    try:
        with grpc.insecure_channel(srv.address) as channel:
            stub = pb_grpc.ContextEngineStub(channel)
            stub.Plan(plan_request(tenant, session, model=SMALL), timeout=30)
            before = counted()

            async def lock() -> Any:  # the event's INSERT waits until this ends
                conn = await asyncpg.connect(direct_database_url)
                await conn.execute("BEGIN; LOCK TABLE context_events IN SHARE MODE")
                return conn
            locker = loop.run_until_complete(lock())
            try:
                with pytest.raises(grpc.RpcError) as err:
                    stub.Build(pressured(tenant, session, "call-1"), timeout=1.0)
                assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
                time.sleep(0.2)  # the call has ended on the server
            finally:
                loop.run_until_complete(locker.close())
            assert pressure_events() == []
            assert counted() == before
            served = stub.Build(pressured(tenant, session, "call-1"), timeout=30)
            assert served.pressure.steps
            events = pressure_events()
            assert len(events) == 1
            steps = len(events[0]["steps"]) + (1 if events[0]["history_floor_shortfall"] else 0)
            assert counted() - before == steps
    finally:
        loop.close()
        srv.stop()
