"""The snapshot fence holds while PostgreSQL is away (spec: "context.snapshot.used binds a run
to the opaque recall-trace ID and epoch of its nonempty frozen snapshot before provider
egress").

A real server on a database of its own, which the test crashes: the first Build of a run on a
plan with a memory snapshot must not return the snapshot until ``context.snapshot.used`` is in
the database. With the database away, that Build answers UNAVAILABLE (STORE_UNAVAILABLE) and
returns nothing, while a run the process had already bound, and a session without a snapshot,
keep building from the plan cache. Once the database is back, the same Build succeeds and each
run is bound exactly once.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import pytest
from context_engine.v1 import context_engine_pb2 as pb
from context_engine.v1 import context_engine_pb2_grpc as pb_grpc

from tests.conftest import Db, ServerThread
from tests.conftest import test_config as base_config
from tests.integration.requests import build_request, failure, plan_request
from tests.integration.test_db_faults import Database

pytestmark = pytest.mark.integration

SNAPSHOT = pb.MemorySnapshot(snapshot_id="snap-1", recall_trace_id="trace-1",
                             items=[pb.MemoryItem(id="m1", text="prefers aisle seats")])


@pytest.fixture(scope="module")
def database() -> Iterator[Database]:
    db = Database()
    yield db
    db.close()


def build_of(tenant: str, session: str, run: str) -> pb.BuildRequest:
    req = build_request(tenant, session)
    req.checkpoint.active_run_id = run
    for it in req.checkpoint.items:
        it.run_id = run
    return req


def test_first_build_of_a_run_needs_its_snapshot_binding_in_the_database(
        database: Database) -> None:
    srv = ServerThread(base_config(), database.url)
    db = Db(database.url)
    ch = grpc.insecure_channel(srv.address)
    stub = pb_grpc.ContextEngineStub(ch)
    try:
        stub.Plan(plan_request("t-fence", "with-snapshot", memory_snapshot=SNAPSHOT))
        stub.Plan(plan_request("t-fence", "no-snapshot"))
        bound = stub.Build(build_of("t-fence", "with-snapshot", "run-a"), timeout=10)
        assert any(b.row == 8 and "aisle" in b.text for b in bound.request.prefix_blocks)
        stub.Build(build_of("t-fence", "no-snapshot", "run-a"), timeout=10)

        database.crash()
        try:
            # a run this process already bound keeps serving from the plan cache
            again = stub.Build(build_of("t-fence", "with-snapshot", "run-a"), timeout=10)
            assert again.request == bound.request
            # so does a session with no snapshot to fence
            stub.Build(build_of("t-fence", "no-snapshot", "run-b"), timeout=10)
            # a new run would see the snapshot before its binding is recorded: refused
            with pytest.raises(grpc.RpcError) as err:
                stub.Build(build_of("t-fence", "with-snapshot", "run-b"), timeout=10)
            f = failure(err.value)
            assert (f.code, f.reason) == (grpc.StatusCode.UNAVAILABLE, "STORE_UNAVAILABLE")
        finally:
            database.restart()

        late = stub.Build(build_of("t-fence", "with-snapshot", "run-b"), timeout=10)
        assert any(b.row == 8 and "aisle" in b.text for b in late.request.prefix_blocks)
        rows = db.fetch("SELECT payload FROM context_events WHERE tenant_id = 't-fence' "
                        "AND type = 'context.snapshot.used' ORDER BY id")
        assert sorted(json.loads(r["payload"])["run_id"] for r in rows) == ["run-a", "run-b"]
    finally:
        ch.close()
        srv.stop()
