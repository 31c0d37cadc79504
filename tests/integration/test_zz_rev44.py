"""rev44 scratch repro (to be deleted)."""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import grpc
import pytest
from context_engine.domain.canonical import session_key
from context_engine.v1 import context_engine_pb2 as pb

from tests.integration.requests import build_request, failure, item, plan_request
from tests.integration.test_erasure import (Held, _held_of, _said, delete, new_ids,  # noqa
                                            replicas)

pytestmark = pytest.mark.integration


def breq(tenant, session, items=None, epoch=0, **top):
    q = build_request(tenant, session, items=items, epoch=epoch)
    for k, v in top.items():
        setattr(q, k, v)
    return q


class Spy:
    def __init__(self, engine: Any, key: str, tenant: str, session: str) -> None:
        self.engine, self.calls = engine, []
        memo = engine.render_memo
        drop, fs, fe = memo.drop, engine.forget_session, engine._forget_erased

        def d(s: Any) -> None:
            if s == key:
                self.calls.append("memo.drop")
            drop(s)

        def f(t: str, s: str, **kw: Any) -> None:
            if (t, s) == (tenant, session):
                self.calls.append(f"forget_session{kw}")
            fs(t, s, **kw)

        def e(t: str, s: str, found: Any) -> None:
            if (t, s) == (tenant, session):
                self.calls.append(f"_forget_erased({found})")
            fe(t, s, found)
        memo.drop, engine.forget_session, engine._forget_erased = d, f, e

    def undo(self) -> None:
        del self.engine.render_memo.drop
        del self.engine.forget_session
        del self.engine._forget_erased


def test_common_paths_never_drop(replicas):
    r = replicas
    engine = r.b.server.running.engine
    tenant, session = new_ids()
    key = session_key(tenant, session)
    spy = Spy(engine, key, tenant, session)
    try:
        r.a.stub.Plan(plan_request(tenant, session), timeout=30)
        for _ in range(3):  # sequential, first Build on B included
            r.b.stub.Build(build_request(tenant, session), timeout=30)
        futs = [r.b.stub.Build.future(build_request(tenant, session), timeout=30)
                for _ in range(8)]
        for fu in futs:
            fu.result(30)
        r.b.stub.Build(build_request(tenant, session, epoch=1), timeout=30)
        r.a.stub.Rotate(pb.RotateRequest(tenant_id=tenant, session_id=session,
                                         reason=pb.ROTATION_REASON_OPERATOR, idempotency_key="k1"), timeout=30)
        r.b.stub.Build(build_request(tenant, session), timeout=30)
        r.b.stub.Build(build_request(tenant, session, epoch=2), timeout=30)
        r.b.stub.Build(build_request(tenant, session, epoch=1), timeout=30)
        first = r.b.stub.Build(breq(tenant, session, keep_base=True), timeout=30)
        bid = first.build_id
        for n in range(3):
            inc = breq(tenant, session, items=[item(f"x{n}", 4 + n, user=pb.UserMessage(text=f"more {n}"))],
                                base_build_id=bid, base_items_kept=3 + n, keep_base=True)
            bid = r.b.stub.Build(inc, timeout=30).build_id
        r.b.stub.GetPlan(pb.GetPlanRequest(tenant_id=tenant, session_id=session), timeout=30)
        # refused after its plan was read
        bad = breq(tenant, session, estimator_factor=9.0)
        with pytest.raises(grpc.RpcError):
            r.b.stub.Build(bad, timeout=30)
    finally:
        spy.undo()
    assert spy.calls == []
    assert engine.render_memo.incarnation(key) is not None
    assert engine.builds.peek(tenant, session, bid) is not None


def test_cancelled_build_wipes_the_sessions_memo(replicas):
    """A Build of a live session whose caller gives up while its plan query is out drops
    every rendering the session's earlier Builds kept."""
    r = replicas
    engine = r.b.server.running.engine
    tenant, session = new_ids()
    key = session_key(tenant, session)
    r.a.stub.Plan(plan_request(tenant, session), timeout=30)
    r.b.stub.Build(build_request(tenant, session), timeout=30)
    before = {k for k in engine.render_memo if k[0] == key}
    assert before
    store = engine._store
    current = store.current
    entered, release = threading.Event(), threading.Event()

    async def slow(t: str, s: str) -> Any:
        if t == tenant and not entered.is_set():
            entered.set()
            await asyncio.to_thread(release.wait, 30)
        return await current(t, s)
    store.current = slow
    try:
        with pytest.raises(grpc.RpcError) as err:
            r.b.stub.Build(build_request(tenant, session, items=_said("hello", "h1")),
                           timeout=0.5)
        assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        release.set()
        time.sleep(0.5)
    finally:
        release.set()
        del store.current
    after = {k for k in engine.render_memo if k[0] == key}
    print("before", len(before), "after", len(after))
    assert after >= before, f"{len(before)} entries before, {len(after)} after"


def test_build_naming_a_missing_epoch_wipes_the_sessions_memo(replicas):
    r = replicas
    engine = r.b.server.running.engine
    tenant, session = new_ids()
    key = session_key(tenant, session)
    r.a.stub.Plan(plan_request(tenant, session), timeout=30)
    r.b.stub.Build(build_request(tenant, session), timeout=30)
    before = {k for k in engine.render_memo if k[0] == key}
    with pytest.raises(grpc.RpcError) as err:
        r.b.stub.Build(build_request(tenant, session, epoch=7), timeout=30)
    assert err.value.code() is grpc.StatusCode.NOT_FOUND
    after = {k for k in engine.render_memo if k[0] == key}
    assert after >= before, f"{len(before)} entries before, {len(after)} after"


def test_a_lower_incarnation_after_a_higher_one_makes_every_build_cold(replicas, db):
    """The sequence's values are taken when LOCK_SESSION's INSERT starts, not when it commits:
    an INSERT that waited on an erasure can create the session with a lower incarnation than
    one erased meanwhile. Simulated here by lowering the row's incarnation."""
    r = replicas
    engine = r.b.server.running.engine
    tenant, session = new_ids()
    r.a.stub.Plan(plan_request(tenant, session), timeout=30)
    low = int(db.val("SELECT incarnation FROM sessions WHERE tenant_id=$1 AND session_id=$2",
                     tenant, session))
    delete(r.a.stub, tenant, session)
    r.a.stub.Plan(plan_request(tenant, session), timeout=30)
    r.b.stub.Build(build_request(tenant, session), timeout=30)  # B names the higher one
    delete(r.a.stub, tenant, session)
    r.a.stub.Plan(plan_request(tenant, session), timeout=30)
    db.val("UPDATE sessions SET incarnation=$3 WHERE tenant_id=$1 AND session_id=$2 "
           "RETURNING 1", tenant, session, low)
    bid = r.b.stub.Build(breq(tenant, session, keep_base=True), timeout=30).build_id
    kept = engine.builds.peek(tenant, session, bid)
    memo = _held_of(r.b.server, tenant, session, "Summarize")
    print("base kept:", kept is not None, "memo entries:", memo)
    assert kept is not None and memo > 0
