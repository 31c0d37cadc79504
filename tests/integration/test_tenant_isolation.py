"""Tenant isolation on a real server with credentials: tenant B's token can neither read nor
change tenant A's session, whether B names tenant A (PERMISSION_DENIED, refused before anything
is read) or names itself with A's session id (NOT_FOUND: every row is keyed by tenant). A's
rows are unchanged after every attempt. Nor does B's event hold back A's in a replica's
outbox."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import grpc
import pytest
from context_engine.adapters.postgres.maintenance import create_partition_sql, partition_name
from context_engine.api.auth import token_sha256
from context_engine.domain.ports import ContextEvent
from context_engine.v1 import context_engine_pb2 as pb
from context_engine.v1 import context_engine_pb2_grpc as pb_grpc

from tests.conftest import ServerThread
from tests.conftest import test_config as base_config
from tests.integration.requests import build_request, failure, plan_request
from tests.integration.test_compact_rpc import compact_request
from tests.integration.test_lifecycle import FakeClock

pytestmark = pytest.mark.integration

TABLES = ("sessions", "plans", "context_events", "compactions", "idempotency_keys",
          "estimator_calibration")


@dataclass
class Tenants:
    stub: pb_grpc.ContextEngineStub
    a: str
    b: str
    token_a: str
    token_b: str
    session: str  # A's session
    epoch: int
    prefix_sha256: str


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def rows(db: Any, tenant: str) -> dict[str, int]:
    return {t: int(db.val(f"SELECT count(*) FROM {t} WHERE tenant_id = $1", tenant))
            for t in TABLES}


@pytest.fixture(scope="module")
def tenants(database_url: str, db: Any, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[Tenants]:
    a, b = f"tenant-a-{uuid.uuid4().hex[:8]}", f"tenant-b-{uuid.uuid4().hex[:8]}"
    token_a, token_b = f"a-{uuid.uuid4().hex}", f"b-{uuid.uuid4().hex}"
    path = tmp_path_factory.mktemp("tenants") / "tokens.json"
    path.write_text(json.dumps([
        {"sha256": token_sha256(token_a), "tenant_id": a, "rpcs": ["*"]},
        {"sha256": token_sha256(token_b), "tenant_id": b, "rpcs": ["*"]},
    ]))
    server = ServerThread(base_config().replace(dev_mode=False, auth_tokens_file=path),
                          database_url)
    channel = grpc.insecure_channel(server.address)
    stub = pb_grpc.ContextEngineStub(channel)
    session = f"shared-{uuid.uuid4().hex[:8]}"
    # A's session has an epoch, a build, a reconciled usage report and a compaction.
    plan = stub.Plan(plan_request(a, session), metadata=bearer(token_a), timeout=30).plan
    built = stub.Build(build_request(a, session), metadata=bearer(token_a), timeout=30)
    stub.ReportUsage(usage(a, session, built.estimated_input_tokens), metadata=bearer(token_a),
                     timeout=30)
    stub.Compact(compact_request(a, session, "a-compaction"), metadata=bearer(token_a),
                 timeout=30)
    yield Tenants(stub=stub, a=a, b=b, token_a=token_a, token_b=token_b, session=session,
                  epoch=plan.epoch, prefix_sha256=plan.prefix_sha256)
    channel.close()
    server.stop()


def usage(tenant: str, session: str, estimated: int) -> pb.ReportUsageRequest:
    return pb.ReportUsageRequest(tenant_id=tenant, session_id=session,
                                 estimated_input_tokens=estimated, estimator_factor=1.0,
                                 input_tokens=int(estimated * 1.5), cached_tokens=0,
                                 output_tokens=10, idempotency_key=f"u-{uuid.uuid4().hex[:8]}")


# Each attempt on A's session id, for a given tenant_id in the request.
ATTEMPTS: dict[str, Callable[[Tenants, str], tuple[Callable[..., Any], Any]]] = {
    "GetPlan": lambda t, tenant: (t.stub.GetPlan, pb.GetPlanRequest(
        tenant_id=tenant, session_id=t.session)),
    "Rotate": lambda t, tenant: (t.stub.Rotate, pb.RotateRequest(
        tenant_id=tenant, session_id=t.session, reason=pb.ROTATION_REASON_SECURITY_REVOCATION,
        drop_tools=["mail.send"], idempotency_key=f"r-{uuid.uuid4().hex[:8]}")),
    "Compact": lambda t, tenant: (t.stub.Compact, compact_request(
        tenant, t.session, f"c-{uuid.uuid4().hex[:8]}")),
    "Build": lambda t, tenant: (t.stub.Build, build_request(tenant, t.session)),
    "ReportUsage": lambda t, tenant: (t.stub.ReportUsage, usage(tenant, t.session, 5000)),
    "Plan": lambda t, tenant: (t.stub.Plan, plan_request(tenant, t.session)),
    "DeleteSession": lambda t, tenant: (t.stub.DeleteSession, pb.DeleteSessionRequest(
        tenant_id=tenant, session_id=t.session)),
}


def a_is_untouched(t: Tenants, db: Any, before: dict[str, int]) -> None:
    assert rows(db, t.a) == before
    current = t.stub.GetPlan(pb.GetPlanRequest(tenant_id=t.a, session_id=t.session),
                             metadata=bearer(t.token_a), timeout=30).plan
    assert (current.epoch, current.prefix_sha256) == (t.epoch, t.prefix_sha256)


@pytest.mark.parametrize("rpc", list(ATTEMPTS))
def test_b_naming_tenant_a_is_denied(tenants: Tenants, db: Any, rpc: str) -> None:
    t = tenants
    before, before_b = rows(db, t.a), rows(db, t.b)
    call, request = ATTEMPTS[rpc](t, t.a)
    with pytest.raises(grpc.RpcError) as err:
        call(request, metadata=bearer(t.token_b), timeout=30)
    f = failure(err.value)
    assert (f.code, f.reason) == (grpc.StatusCode.PERMISSION_DENIED, "TENANT_MISMATCH")
    assert f.metadata == {"rpc": rpc, "tenant_id": t.a, "token_tenant_id": t.b}
    assert rows(db, t.b) == before_b
    a_is_untouched(t, db, before)


# Plan opens a session of B's own; DeleteSession of a session B does not have erases nothing
@pytest.mark.parametrize("rpc", [r for r in ATTEMPTS if r not in ("Plan", "DeleteSession")])
def test_b_naming_itself_with_a_session_id_finds_nothing(tenants: Tenants, db: Any,
                                                        rpc: str) -> None:
    t = tenants
    before = rows(db, t.a)
    before_b = rows(db, t.b)
    call, request = ATTEMPTS[rpc](t, t.b)
    with pytest.raises(grpc.RpcError) as err:
        call(request, metadata=bearer(t.token_b), timeout=30)
    f = failure(err.value)
    assert (f.code, f.reason) == (grpc.StatusCode.NOT_FOUND, "SESSION_NOT_FOUND")
    assert f.metadata.get("tenant_id", t.b) == t.b
    assert rows(db, t.b) == before_b  # a failed call changes nothing, for B either
    a_is_untouched(t, db, before)


def test_b_planning_a_session_id_opens_its_own_session(tenants: Tenants, db: Any) -> None:
    """Plan creates: B naming A's session id gets a separate session of its own tenant, with
    its own session key, never A's plan."""
    t = tenants
    before = rows(db, t.a)
    mine = t.stub.Plan(plan_request(t.b, t.session), metadata=bearer(t.token_b),
                       timeout=30).plan
    assert mine.epoch == 1
    assert mine.prefix_sha256 != t.prefix_sha256  # the session key is per tenant
    assert db.val("SELECT count(*) FROM plans WHERE tenant_id = $1 AND session_id = $2",
                  t.b, t.session) == 1
    a_is_untouched(t, db, before)


def test_b_erasing_a_session_id_erases_only_its_own(tenants: Tenants, db: Any) -> None:
    """DeleteSession names the caller's tenant: B erasing the session id it shares with A
    removes B's session and leaves A's as it was."""
    t = tenants
    before = rows(db, t.a)
    t.stub.Plan(plan_request(t.b, t.session), metadata=bearer(t.token_b), timeout=30)
    erased = t.stub.DeleteSession(pb.DeleteSessionRequest(tenant_id=t.b, session_id=t.session),
                                  metadata=bearer(t.token_b), timeout=30)
    assert erased.deleted and erased.plans == 1
    assert db.val("SELECT count(*) FROM sessions WHERE tenant_id = $1 AND session_id = $2",
                  t.b, t.session) == 0
    a_is_untouched(t, db, before)


def recall(tag: str, nul: bool = False) -> list[pb.RecallLine]:
    """Recall well over its 2,000-token cap: a Build trims it, and its pressure event names the
    lines trimmed. ``nul``: their ids hold a NUL, which PostgreSQL's jsonb cannot store."""
    return [pb.RecallLine(id=f"{tag}{i}" + ("\x00" if nul else ""), text="a fact " * 60)
            for i in range(30)]


def recall_trimmed(db: Any, tenant: str, session: str) -> list[str]:
    """Whose recall lines (their tag) each stored pressure event of the session trimmed."""
    rows = db.fetch("SELECT payload FROM context_events WHERE tenant_id = $1 "
                    "AND session_id = $2 AND type = 'context.budget.pressure' ORDER BY id",
                    tenant, session)
    return [next(s["item_ids"][0].split("-")[0] for s in json.loads(r["payload"])["steps"]
                 if s["step"] == "recall") for r in rows]


def test_an_event_postgresql_cannot_store_stops_no_other_tenants_events(
        database_url: str, db: Any, tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Recall line ids holding a NUL (which PostgreSQL's jsonb cannot store) are refused at the
    API now, and nothing is written; the outbox still never lets an event PostgreSQL refuses
    hold back others': tenant B's such event (put in the running server's outbox directly, as
    no request can make one any more) waits between tenant A's while their day has no
    partition yet (as in an outage); once it has, A's events, the one queued after B's
    included, are written, and B's is discarded (logged with B's tenant), not retried at the
    head of the queue for ever."""
    caplog.set_level(logging.INFO, logger="context_engine")
    a, b = f"tenant-a-{uuid.uuid4().hex[:8]}", f"tenant-b-{uuid.uuid4().hex[:8]}"
    token_a, token_b = f"a-{uuid.uuid4().hex}", f"b-{uuid.uuid4().hex}"
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps([
        {"sha256": token_sha256(token_a), "tenant_id": a, "rpcs": ["*"]},
        {"sha256": token_sha256(token_b), "tenant_id": b, "rpcs": ["*"]},
    ]))
    clock = FakeClock(datetime.now(UTC))
    server = ServerThread(base_config().replace(dev_mode=False, auth_tokens_file=path),
                          database_url, clock=clock)
    later = datetime.now(UTC) + timedelta(days=900)  # no partition holds its day yet
    day = later.date()
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.ContextEngineStub(channel)
            for tenant, token in ((a, token_a), (b, token_b)):
                stub.Plan(plan_request(tenant, "s"), metadata=bearer(token), timeout=30)
            with pytest.raises(grpc.RpcError) as refused:
                stub.Build(build_request(b, "s", recall=recall("b0-", nul=True)),
                           metadata=bearer(token_b), timeout=30)
            assert failure(refused.value).code is grpc.StatusCode.INVALID_ARGUMENT
            assert recall_trimmed(db, b, "s") == []
            clock.set(later)
            stub.Build(build_request(a, "s", recall=recall("a1-")), metadata=bearer(token_a),
                       timeout=30)
            unstorable = ContextEvent(tenant_id=b, session_id="s", epoch=1,
                                      type="context.budget.pressure",
                                      payload={"epoch": 1, "steps": [
                                          {"step": "recall", "item_ids": ["b1-0\x00"]}]})
            server.call(server.running.events.append(unstorable))
            stub.Build(build_request(a, "s", recall=recall("a2-")), metadata=bearer(token_a),
                       timeout=30)
            assert server.running.events.pending == 3  # their day has no partition
            db.fetch(create_partition_sql(day))
            deadline = time.monotonic() + 15
            while server.running.events.pending and time.monotonic() < deadline:
                time.sleep(0.1)
            assert recall_trimmed(db, a, "s") == ["a1", "a2"]
            assert recall_trimmed(db, b, "s") == []
            assert server.running.events.pending == 0
            assert server.running.events.discarded == 1
            discarded = [getattr(r, "fields", {}) for r in caplog.records
                         if r.getMessage() == "event_discarded"]
            assert [(d["tenant"], d["reason"]) for d in discarded] == [(b, "unstorable")]
    finally:
        server.stop()
        db.fetch(f'DROP TABLE IF EXISTS "{partition_name(day)}"')
