"""context_engine_epochs_total and context_engine_sessions_opened_total against the epochs
PostgreSQL holds, across two replicas of one database: each stored epoch is counted once, by
one replica, whether its writer learnt that its COMMIT succeeded or not."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import pytest
from context_engine.v1 import context_engine_pb2 as pb
from context_engine.v1 import context_engine_pb2_grpc as pb_grpc

from tests.conftest import ServerThread
from tests.conftest import test_config as base_config
from tests.integration.requests import plan_request
from tests.support.commit_drop import CommitDropProxy

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def proxy(database_url: str) -> Iterator[CommitDropProxy]:
    p = CommitDropProxy(database_url)
    yield p
    p.close()


@pytest.fixture(scope="module")
def replicas(database_url: str, proxy: CommitDropProxy) -> Iterator[list[ServerThread]]:
    """Two replicas of one database: the first reaches it through the proxy that can lose a
    COMMIT's answer."""
    servers = [ServerThread(base_config(), proxy.url), ServerThread(base_config(), database_url)]
    yield servers
    for s in servers:
        s.stop()


@pytest.fixture(scope="module")
def stubs(replicas: list[ServerThread]) -> Iterator[list[pb_grpc.ContextEngineStub]]:
    channels = [grpc.insecure_channel(s.address) for s in replicas]
    yield [pb_grpc.ContextEngineStub(ch) for ch in channels]
    for ch in channels:
        ch.close()


def counted(replicas: list[ServerThread]) -> dict[str, float]:
    """Both replicas' counters, summed: 'opened' and each epoch reason."""
    total: dict[str, float] = {}
    for s in replicas:
        total["opened"] = total.get("opened", 0.0) + (
            s.registry.get_sample_value("context_engine_sessions_opened_total") or 0.0)
        for metric in s.registry.collect():
            if metric.name == "context_engine_epochs":
                for sample in metric.samples:
                    if sample.name.endswith("_total"):
                        reason = sample.labels["reason"]
                        total[reason] = total.get(reason, 0.0) + sample.value
    return total


def growth(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def stored(db, tenant: str) -> dict[str, float]:
    """The oracle: the epochs PostgreSQL holds, by reason, and the sessions opened."""
    rows = db.fetch("SELECT reason, count(*) AS n FROM plans WHERE tenant_id = $1 "
                    "GROUP BY reason", tenant)
    found = {r["reason"]: float(r["n"]) for r in rows}
    opened = db.val("SELECT count(*) FROM plans WHERE tenant_id = $1 AND epoch = 1", tenant)
    return {**found, "opened": float(opened)} if found else {}


def test_an_epoch_whose_commit_answer_was_lost_is_counted_once(replicas, stubs, proxy, ids, db):
    """A Plan whose COMMIT reached PostgreSQL but whose answer was lost fails UNAVAILABLE with
    the session opened; its retry (here through the other replica) found the plan current and
    counted nothing, so the session and its epoch were never counted anywhere: epochs per
    session under-read. Now the retry that reads the uncounted epoch counts it, once; a keyed
    Rotate retried after the same loss likewise."""
    tenant, session = ids
    before = counted(replicas)
    proxy.arm()
    with pytest.raises(grpc.RpcError) as err:
        stubs[0].Plan(plan_request(tenant, session))
    assert err.value.code() is grpc.StatusCode.UNAVAILABLE
    assert proxy.dropped == 1 and stored(db, tenant) == {"session_opened": 1.0, "opened": 1.0}
    again = stubs[1].Plan(plan_request(tenant, session))
    assert not again.created and again.plan.epoch == 1
    for stub in stubs:  # read again anywhere: counted already
        assert not stub.Plan(plan_request(tenant, session)).created
    assert growth(before, counted(replicas)) == stored(db, tenant)

    rotate = pb.RotateRequest(tenant_id=tenant, session_id=session,
                              reason=pb.ROTATION_REASON_OPERATOR, idempotency_key="lost")
    proxy.arm()
    with pytest.raises(grpc.RpcError) as err:
        stubs[0].Rotate(rotate)
    assert err.value.code() is grpc.StatusCode.UNAVAILABLE and proxy.dropped == 2
    retried = stubs[1].Rotate(rotate)
    assert not retried.rotated and retried.plan.epoch == 2
    assert not stubs[0].Rotate(rotate).rotated
    for stub in stubs:
        assert not stub.Plan(plan_request(tenant, session)).created
    assert stored(db, tenant) == {"session_opened": 1.0, "operator": 1.0, "opened": 1.0}
    assert growth(before, counted(replicas)) == stored(db, tenant)


def test_replicas_racing_count_each_stored_epoch_once(replicas, stubs, ids, db):
    """Twelve Plans opening one session, twelve rotating it for one reason and twelve Rotates
    of one key, each half through either replica: the counters of both, summed, move by
    exactly the epochs stored."""
    tenant, session = ids
    before = counted(replicas)
    bumped = plan_request(tenant, session)
    bumped.agent.version = "8"
    rotate = pb.RotateRequest(tenant_id=tenant, session_id=session,
                              reason=pb.ROTATION_REASON_OPERATOR, idempotency_key="race")
    errors: list[BaseException] = []

    def race(call) -> None:
        def go(i: int) -> None:
            try:
                call(stubs[i % 2])
            except BaseException as exc:  # asserted below
                errors.append(exc)
        threads = [threading.Thread(target=go, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)

    race(lambda s: s.Plan(plan_request(tenant, session), timeout=30))
    race(lambda s: s.Plan(bumped, timeout=30))
    race(lambda s: s.Rotate(rotate, timeout=30))
    assert not errors
    assert stored(db, tenant) == {"session_opened": 1.0, "agent_version_changed": 1.0,
                                  "operator": 1.0, "opened": 1.0}
    assert growth(before, counted(replicas)) == stored(db, tenant)
