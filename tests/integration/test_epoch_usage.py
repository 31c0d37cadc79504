"""ReportUsage's cache metrics on two replicas sharing one PostgreSQL: what a report needs to know
about the earlier reports of its epoch (was there one, its full input) is in the database, not in
a process, and is counted once per idempotency key."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from context_engine.v1 import context_engine_pb2 as pb
from context_engine.v1 import context_engine_pb2_grpc as pb_grpc

from tests.conftest import ServerThread
from tests.conftest import test_config as base_config
from tests.integration.requests import plan_request

pytestmark = pytest.mark.integration

CLAUDE = pb.ModelSpec(model_id="claude-sonnet-4-5", capabilities=pb.ModelCapabilities(
    context_window=16_000, output_reserve=2_000))


@pytest.fixture(scope="module")
def replicas(database_url: str) -> Iterator[tuple[ServerThread, ServerThread]]:
    a, b = ServerThread(base_config(), database_url), ServerThread(base_config(), database_url)
    yield a, b
    a.stop()
    b.stop()


def observed(server: ServerThread, name: str) -> tuple[float, float]:
    """(count, sum) of a histogram in this replica's own registry."""
    count = server.registry.get_sample_value(f"{name}_count")
    total = server.registry.get_sample_value(f"{name}_sum")
    assert count is not None and total is not None
    return count, total


def test_each_replica_sees_the_reports_another_counted(replicas, ids, db):
    a, b = replicas
    tenant, session = ids
    ch_a, ch_b = grpc.insecure_channel(a.address), grpc.insecure_channel(b.address)
    stub_a, stub_b = pb_grpc.ContextEngineStub(ch_a), pb_grpc.ContextEngineStub(ch_b)
    try:
        plan = stub_a.Plan(plan_request(tenant, session, model=CLAUDE)).plan
        before = {s: {m: observed(s, m) for m in ("context_engine_cached_prefix_ratio",
                                                  "context_engine_cached_input_ratio")}
                  for s in (a, b)}

        def report(stub: pb_grpc.ContextEngineStub, key: str, input_tokens: int,
                   cached: int) -> pb.ReportUsageResponse:
            resp: pb.ReportUsageResponse = stub.ReportUsage(pb.ReportUsageRequest(
                tenant_id=tenant, session_id=session, estimated_input_tokens=input_tokens,
                estimator_factor=1.0, input_tokens=input_tokens, cached_tokens=cached,
                output_tokens=10, idempotency_key=key))
            return resp

        def moved(server: ServerThread, name: str) -> tuple[float, float]:
            count, total = observed(server, name)
            count0, total0 = before[server][name]
            return count - count0, round(total - total0, 9)

        # replica A gets the epoch's first report: a necessary miss, measured by neither ratio
        assert report(stub_a, "u1", 3_000, 0).counted
        assert moved(a, "context_engine_cached_prefix_ratio") == (0, 0)
        assert moved(a, "context_engine_cached_input_ratio") == (0, 0)
        # replica B gets the second: it knows there was a first, and its input
        cached = plan.prefix_tokens + 1_000
        assert report(stub_b, "u2", 3_400, cached).counted
        assert moved(b, "context_engine_cached_prefix_ratio") == (1, 1.0)
        assert moved(b, "context_engine_cached_input_ratio") == (1, round(cached / 3_000, 9))
        # the same key again, on the other replica: counted once, observed by no one
        assert not report(stub_a, "u2", 3_400, cached).counted
        assert moved(a, "context_engine_cached_prefix_ratio") == (0, 0)
        assert moved(a, "context_engine_cached_input_ratio") == (0, 0)
        # a third report measures against the second's input, not the retried key's
        assert report(stub_a, "u3", 3_800, 3_400).counted
        assert moved(a, "context_engine_cached_input_ratio") == (1, 1.0)
        assert moved(a, "context_engine_cached_prefix_ratio") == (1, 1.0)

        row = db.fetch("SELECT epoch, reports, last_input_tokens, previous_input_tokens "
                       "FROM epoch_usage WHERE tenant_id = $1 AND session_id = $2",
                       tenant, session)
        assert [tuple(r) for r in row] == [(1, 3, 3_800, 3_400)]

        # a rotation starts a new epoch: its first report is a miss again
        stub_b.Rotate(pb.RotateRequest(tenant_id=tenant, session_id=session,
                                       reason=pb.ROTATION_REASON_OPERATOR,
                                       idempotency_key="rotate-1"))
        assert report(stub_b, "u4", 3_000, 0).counted
        assert moved(b, "context_engine_cached_prefix_ratio") == (1, 1.0)  # unchanged
        assert moved(b, "context_engine_cached_input_ratio") == (1, round(cached / 3_000, 9))
        assert db.val("SELECT reports FROM epoch_usage WHERE tenant_id = $1 AND epoch = 2",
                      tenant) == 1
    finally:
        ch_a.close()
        ch_b.close()
