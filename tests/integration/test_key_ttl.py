"""An idempotency key answers a retry with the first call's outcome for
CE_IDEMPOTENCY_KEY_TTL_HOURS, by PostgreSQL's clock, and not a moment longer: after it the same
key is a new request, whether or not a maintenance cycle has deleted the key yet. A snapshot
fence is not an idempotency key of an RPC: it lives as long as the event it fences.

The keys are aged by moving their ``created_at`` back, on the database that made them; no
maintenance cycle runs here (the test server's cycles delete nothing younger than ten years)."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import asyncpg
import grpc
import pytest
from context_engine.adapters.postgres.store import PostgresEventLog
from context_engine.domain.ports import ContextEvent
from context_engine.v1 import context_engine_pb2 as pb

from tests.conftest import run
from tests.conftest import test_config as served_config
from tests.integration.requests import failure, plan_request
from tests.integration.test_compact_rpc import compact_request

pytestmark = pytest.mark.integration

TTL_HOURS = served_config().idempotency_key_ttl_hours


def age(db, table: str, tenant: str, hours: float) -> None:
    """Every key (or compaction record) of the tenant made ``hours`` earlier than it was."""
    db.fetch(f"UPDATE {table} SET created_at = created_at - make_interval(secs => $2) "
             "WHERE tenant_id = $1", tenant, hours * 3600)


def rotate(tenant: str, session: str, key: str, **kw) -> pb.RotateRequest:
    return pb.RotateRequest(tenant_id=tenant, session_id=session, idempotency_key=key,
                            reason=kw.pop("reason", pb.ROTATION_REASON_OPERATOR), **kw)


def usage(tenant: str, session: str, key: str, input_tokens: int = 5000,
          ) -> pb.ReportUsageRequest:
    return pb.ReportUsageRequest(tenant_id=tenant, session_id=session,
                                 estimated_input_tokens=5000, estimator_factor=1.0,
                                 input_tokens=input_tokens, cached_tokens=0, output_tokens=10,
                                 idempotency_key=key)


def test_a_rotation_key_past_its_ttl_rotates_again(stub, ids, db):
    tenant, session = ids
    stub.Plan(plan_request(tenant, session))
    assert stub.Rotate(rotate(tenant, session, "k")).plan.epoch == 2
    age(db, "idempotency_keys", tenant, TTL_HOURS - 0.1)
    again = stub.Rotate(rotate(tenant, session, "k"))  # inside the TTL: a retry
    assert not again.rotated and again.plan.epoch == 2
    age(db, "idempotency_keys", tenant, 0.2)  # now past it
    later = stub.Rotate(rotate(tenant, session, "k"))
    assert later.rotated and later.plan.epoch == 3
    # the key claimed anew is young again: its retry answers epoch 3
    retried = stub.Rotate(rotate(tenant, session, "k"))
    assert not retried.rotated and retried.plan.epoch == 3
    assert db.val("SELECT count(*) FROM plans WHERE tenant_id=$1", tenant) == 3
    assert db.val("SELECT count(*) FROM idempotency_keys WHERE tenant_id=$1", tenant) == 1


def test_an_expired_key_names_another_request_without_being_reused(stub, ids, db):
    """Inside the TTL another request under the key is refused; after it, it is a request
    like any other, in another session too."""
    tenant, session = ids
    stub.Plan(plan_request(tenant, session))
    stub.Plan(plan_request(tenant, "other"))
    stub.Rotate(rotate(tenant, session, "k"))
    with pytest.raises(grpc.RpcError) as err:
        stub.Rotate(rotate(tenant, "other", "k"))
    assert failure(err.value).code is grpc.StatusCode.INVALID_ARGUMENT
    age(db, "idempotency_keys", tenant, TTL_HOURS + 0.1)
    moved = stub.Rotate(rotate(tenant, "other", "k"))
    assert moved.rotated and moved.plan.session_id == "other" and moved.plan.epoch == 2
    rows = db.fetch("SELECT session_id FROM idempotency_keys WHERE tenant_id=$1", tenant)
    assert [r["session_id"] for r in rows] == ["other"]


def test_a_usage_key_past_its_ttl_counts_again(stub, ids, db):
    tenant, session = ids
    stub.Plan(plan_request(tenant, session))
    first = stub.ReportUsage(usage(tenant, session, "u"))
    assert first.counted and first.reports == 1
    age(db, "idempotency_keys", tenant, TTL_HOURS - 0.1)
    retry = stub.ReportUsage(usage(tenant, session, "u"))
    assert not retry.counted and retry.reports == 1
    age(db, "idempotency_keys", tenant, 0.2)
    later = stub.ReportUsage(usage(tenant, session, "u", input_tokens=6000))
    assert later.counted and later.reports == 2
    assert db.val("SELECT reports FROM epoch_usage WHERE tenant_id=$1", tenant) == 2


def test_a_compaction_key_past_its_ttl_compacts_again(stub, ids, db):
    tenant, session = ids
    stub.Plan(plan_request(tenant, session))
    first = stub.Compact(compact_request(tenant, session, "c"))
    age(db, "compactions", tenant, TTL_HOURS - 0.1)
    retry = stub.Compact(compact_request(tenant, session, "c"))
    assert first.compacted and not retry.compacted and retry.summary == first.summary
    age(db, "compactions", tenant, 0.2)
    # another request under the key: a new one now, not a reuse
    later = stub.Compact(compact_request(tenant, session, "c", replace_through_sequence=3))
    assert later.compacted and later.summary.replaced_through_sequence == 3
    rows = db.fetch("SELECT replaced_through_sequence, created_at > now() - interval '1 hour' "
                    "AS young FROM compactions WHERE tenant_id=$1", tenant)
    assert [(r["replaced_through_sequence"], r["young"]) for r in rows] == [(3, True)]
    assert db.val("SELECT count(*) FROM context_events WHERE tenant_id=$1 AND "
                  "type='context.compacted'", tenant) == 2
    retried = stub.Compact(compact_request(tenant, session, "c", replace_through_sequence=3))
    assert not retried.compacted and retried.summary == later.summary


def test_a_fence_outlives_the_key_ttl(stub, ids, db, database_url):
    """The fence of a run's snapshot is kept as long as the event it fences, however old."""
    tenant, session = ids
    stub.Plan(plan_request(tenant, session))

    async def fence() -> bool:
        pool = await asyncpg.create_pool(database_url, min_size=1, max_size=1,
                                         statement_cache_size=0)
        try:
            event = ContextEvent(tenant_id=tenant, session_id=session, epoch=1,
                                 type="context.snapshot.used",
                                 payload={"run_id": "r", "snapshot_id": "s"})
            return await PostgresEventLog(pool).append_once(event, f"{session}:1:r")
        finally:
            await pool.close()

    assert run(fence())
    age(db, "idempotency_keys", tenant, TTL_HOURS * 2)
    assert not run(fence())
    assert db.val("SELECT count(*) FROM context_events WHERE tenant_id=$1 AND "
                  "type='context.snapshot.used'", tenant) == 1


def _outcome(call, request):
    try:
        return call(request, timeout=30)
    except grpc.RpcError as exc:
        return failure(exc)


@pytest.mark.parametrize("kind", ["rotate", "compact"])
def test_a_key_claimed_anew_and_an_erasure_never_deadlock(stub, db, kind):
    """A key claimed anew changes no reference, so it took no lock of the session's row: the
    claim held the key's row, then waited for the session's, which an erasure held while it
    waited to delete the key (8 deadlocks in 15 such races)."""
    for n in range(12):
        tenant, session = f"tenant-{uuid.uuid4().hex[:12]}", "s"
        stub.Plan(plan_request(tenant, session))
        if kind == "rotate":
            stub.Rotate(rotate(tenant, session, "k"))
            call, request, table = stub.Rotate, rotate(tenant, session, "k"), "idempotency_keys"
        else:
            stub.Compact(compact_request(tenant, session, "k"))
            call, request, table = stub.Compact, compact_request(tenant, session, "k"), \
                "compactions"
        age(db, table, tenant, TTL_HOURS + 1)
        with ThreadPoolExecutor(2) as pool:
            claimed = pool.submit(_outcome, call, request)
            erased = pool.submit(_outcome, stub.DeleteSession, pb.DeleteSessionRequest(
                tenant_id=tenant, session_id=session))
            first, second = claimed.result(), erased.result()
        assert isinstance(second, pb.DeleteSessionResponse), (n, second)
        if not isinstance(first, (pb.RotateResponse, pb.CompactResponse)):
            assert (first.code, first.reason) == (grpc.StatusCode.NOT_FOUND,
                                                  "SESSION_NOT_FOUND"), (n, first)
        assert db.counts(tenant) == {"sessions": 0, "plans": 0, "context_events": 0}


def test_concurrent_retries_of_an_expired_compaction_compact_once(stub, ids, db):
    tenant, session = ids
    stub.Plan(plan_request(tenant, session))
    stub.Compact(compact_request(tenant, session, "c"))
    age(db, "compactions", tenant, TTL_HOURS + 1)
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda _: _outcome(stub.Compact,
                                                compact_request(tenant, session, "c")),
                             range(4)))
    assert all(isinstance(o, pb.CompactResponse) for o in outs), outs
    assert sum(o.compacted for o in outs) == 1
    assert db.val("SELECT count(*) FROM context_events WHERE tenant_id=$1 AND "
                  "type='context.compacted'", tenant) == 2
