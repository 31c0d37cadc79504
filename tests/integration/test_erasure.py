"""Erasure: ``DeleteSession`` across two replicas of the service sharing one database (each with
its own clock and a warm plan cache), and ``context-engine purge-tenant`` as a process.

* The erased session's rows are gone from every table, and only its: another session of the
  tenant and the same session id in another tenant keep theirs. The response counts what was
  removed; the audit row holds no session id and no content.
* GetPlan and Build without an epoch are NOT_FOUND at once on both replicas; a Build naming its
  epoch is served from a replica's plan cache until that replica's clock passes the plan-cache
  TTL (``plan_cache_seconds``), then NOT_FOUND.
* The same session id planned again is a new session at epoch 1, and no replica serves it the
  erased session's plan.
* Builds racing the erasure answer OK or NOT_FOUND and leave no context event behind; a Plan
  racing it opens the session anew, and a session opened while its tenant is purged keeps its
  rows.
* A Build's event is written only for the incarnation its plan was read for: one queued before
  the erasure (the database away from its replica), or made on the erased plan a replica still
  caches, never lands in the session planned again.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import pytest
from context_engine import cli
from context_engine.adapters.postgres.erasure import PostgresErasure, session_sha256
from context_engine.adapters.postgres.migrate import migrate
from context_engine.clock import SYSTEM_CLOCK
from context_engine.domain.canonical import session_key
from context_engine.domain.errors import StoreUnavailable
from context_engine.v1 import context_engine_pb2 as pb
from context_engine.v1 import context_engine_pb2_grpc as pb_grpc

from tests.conftest import REPO, Db, ServerThread
from tests.conftest import test_config as base_config
from tests.integration.requests import build_request, failure, item, plan_request
from tests.integration.test_budget_rpc import SMALL, long_history
from tests.integration.test_compact_rpc import compact_request
from tests.integration.test_db_faults import Database
from tests.support.databases import create_database, drop_database, with_database
from tests.support.step_clock import StepClock

pytestmark = pytest.mark.integration

CLI = Path(sys.executable).parent / "context-engine"
TTL = 30  # seconds of the replicas' plan-cache lifetime (their clocks are moved, not waited)
# Every table that holds a session's rows, and how a row names its session.
SESSION_TABLES = ("sessions", "plans", "context_events", "compactions", "epoch_usage",
                  "idempotency_keys")




@dataclass
class Replica:
    server: ServerThread
    clock: StepClock
    channel: grpc.Channel
    stub: pb_grpc.ContextEngineStub


@dataclass
class Replicas:
    a: Replica
    b: Replica


@pytest.fixture(scope="module")
def replicas(database_url: str) -> Iterator[Replicas]:
    config = base_config().replace(plan_cache_ttl_seconds=float(TTL))
    made = []
    for _ in range(2):
        clock = StepClock()
        server = ServerThread(config, database_url, clock=clock)
        channel = grpc.insecure_channel(server.address)
        made.append(Replica(server, clock, channel, pb_grpc.ContextEngineStub(channel)))
    yield Replicas(*made)
    for r in made:
        r.channel.close()
        r.server.stop()


def new_ids() -> tuple[str, str]:
    return f"tenant-{uuid.uuid4().hex[:10]}", f"session-{uuid.uuid4().hex[:10]}"


def session_rows(db: Db, tenant: str, session: str) -> dict[str, int]:
    return {t: int(db.val(f"SELECT count(*) FROM {t} WHERE tenant_id = $1 AND session_id = $2",
                          tenant, session)) for t in SESSION_TABLES}


def tenant_rows(db: Db, tenant: str) -> dict[str, int]:
    return {t: int(db.val(f"SELECT count(*) FROM {t} WHERE tenant_id = $1", tenant))
            for t in (*SESSION_TABLES, "estimator_calibration", "api_tokens")}


def usage_request(tenant: str, session: str, estimated: int, key: str) -> pb.ReportUsageRequest:
    return pb.ReportUsageRequest(tenant_id=tenant, session_id=session,
                                 estimated_input_tokens=estimated, estimator_factor=1.0,
                                 input_tokens=estimated + 100, cached_tokens=0,
                                 output_tokens=10, idempotency_key=key)


def populate(r: Replicas, tenant: str, session: str, *, instructions: str = "") -> pb.ContextPlan:
    """A session with rows in every table: two epochs (a keyed Rotate), a usage report (keyed,
    its epoch's usage row), a compaction and their events. Returns the current plan."""
    plan = plan_request(tenant, session)
    if instructions:
        plan.agent.instructions = instructions
    r.a.stub.Plan(plan, timeout=30)
    r.a.stub.Rotate(pb.RotateRequest(tenant_id=tenant, session_id=session,
                                     reason=pb.ROTATION_REASON_OPERATOR,
                                     idempotency_key=f"rotate-{session}"), timeout=30)
    built = r.b.stub.Build(build_request(tenant, session), timeout=30)
    r.a.stub.ReportUsage(usage_request(tenant, session, built.estimated_input_tokens,
                                       f"usage-{session}"), timeout=30)
    r.a.stub.Compact(compact_request(tenant, session, f"compact-{session}"), timeout=30)
    return r.a.stub.GetPlan(pb.GetPlanRequest(tenant_id=tenant, session_id=session),
                            timeout=30).plan


def delete(stub: pb_grpc.ContextEngineStub, tenant: str, session: str,
           **kwargs: Any) -> pb.DeleteSessionResponse:
    return stub.DeleteSession(pb.DeleteSessionRequest(tenant_id=tenant, session_id=session),
                              timeout=30, **kwargs)


def not_found(call: Any, request: Any) -> bool:
    try:
        call(request, timeout=30)
    except grpc.RpcError as err:
        f = failure(err)
        assert (f.code, f.reason) == (grpc.StatusCode.NOT_FOUND, "SESSION_NOT_FOUND"), f
        return True
    return False


def test_delete_session_erases_every_row_of_the_session_and_only_its(replicas, db, caplog):
    caplog.set_level(logging.INFO, logger="context_engine")
    r = replicas
    tenant, session = new_ids()
    other_tenant = f"{tenant}-other"
    populate(r, tenant, session)
    populate(r, tenant, f"{session}-kept")           # another session of the same tenant
    populate(r, other_tenant, session)                # the same session id in another tenant
    before = session_rows(db, tenant, session)
    assert all(before.values()), before               # rows in every table to erase
    # the keyed writes name their session
    assert sorted(db.val("SELECT array_agg(rpc) FROM idempotency_keys WHERE tenant_id = $1 "
                         "AND session_id = $2", tenant, session)) == ["ReportUsage", "Rotate"]
    kept = session_rows(db, tenant, f"{session}-kept")
    elsewhere = session_rows(db, other_tenant, session)
    calibrations = tenant_rows(db, tenant)["estimator_calibration"]

    answer = delete(r.a.stub, tenant, session)
    assert answer.deleted
    assert (answer.plans, answer.events, answer.compactions, answer.idempotency_keys,
            answer.usage_rows) == (before["plans"], before["context_events"],
                                   before["compactions"], before["idempotency_keys"],
                                   before["epoch_usage"])
    assert answer.plan_cache_seconds == TTL
    # its log line counts every row removed, the session's own row too (read before it went)
    [line] = [getattr(x, "fields", {}) for x in caplog.records if x.getMessage() == "rpc"
              and getattr(x, "fields", {}).get("method") == "DeleteSession"
              and getattr(x, "fields", {}).get("tenant") == tenant]
    assert line["rows"] == sum(before.values()) and before["sessions"] == 1
    assert abs(answer.deleted_at.ToDatetime().timestamp()
                - SYSTEM_CLOCK.now().timestamp()) < 60

    assert session_rows(db, tenant, session) == dict.fromkeys(SESSION_TABLES, 0)
    assert session_rows(db, tenant, f"{session}-kept") == kept
    assert session_rows(db, other_tenant, session) == elsewhere
    # the tenant's calibration is the tenant's, not the session's: kept
    assert tenant_rows(db, tenant)["estimator_calibration"] == calibrations
    for stub in (r.a.stub, r.b.stub):
        for t, s in ((tenant, f"{session}-kept"), (other_tenant, session)):
            assert stub.GetPlan(pb.GetPlanRequest(tenant_id=t, session_id=s),
                                timeout=30).plan.epoch == 2

    # one audit row, holding no session id and no content
    (audit,) = db.fetch("SELECT *, to_jsonb(e)::text AS whole FROM erasures e "
                        "WHERE tenant_id = $1", tenant)
    assert audit["scope"] == "session"
    assert audit["session_sha256"] == hashlib.sha256(session.encode()).hexdigest()
    assert (audit["sessions"], audit["plans"], audit["events"], audit["compactions"],
            audit["idempotency_keys"], audit["usage_rows"], audit["calibrations"]) == (
        1, answer.plans, answer.events, answer.compactions, answer.idempotency_keys,
        answer.usage_rows, 0)
    assert audit["requested_by"] == "dev"
    assert audit["erased_at"] == answer.deleted_at.ToDatetime().replace(
        tzinfo=audit["erased_at"].tzinfo)
    whole = audit["whole"]
    for secret in (session, "helpful agent", "example.com", "Example Domain", "question"):
        assert secret not in whole, secret

    # idempotent: nothing left to erase, nothing recorded
    again = delete(r.b.stub, tenant, session)
    assert not again.deleted
    assert (again.plans, again.events, again.compactions, again.idempotency_keys,
            again.usage_rows) == (0, 0, 0, 0, 0)
    assert again.plan_cache_seconds == TTL and again.HasField("deleted_at")
    assert db.val("SELECT count(*) FROM erasures WHERE tenant_id = $1", tenant) == 1


def warm(r: Replicas, tenant: str, session: str) -> tuple[pb.ContextPlan, pb.BuildRequest]:
    """A populated session whose plan both replicas have cached and just confirmed; returns
    the plan and a Build request naming its epoch."""
    plan = populate(r, tenant, session)
    explicit = build_request(tenant, session, epoch=plan.epoch)
    for replica in (r.a, r.b):
        assert replica.stub.Build(explicit, timeout=30).prefix_sha256 == plan.prefix_sha256
        assert replica.stub.Build(build_request(tenant, session),
                                  timeout=30).prefix_sha256 == plan.prefix_sha256
    return plan, explicit


def test_getplan_and_build_without_an_epoch_are_not_found_at_once_on_every_replica(replicas):
    r = replicas
    tenant, session = new_ids()
    plan, explicit = warm(r, tenant, session)
    delete(r.a.stub, tenant, session)
    for replica in (r.a, r.b):
        # naming an epoch first: B has it cached and fresh, yet GetPlan asks the database
        for get in (pb.GetPlanRequest(tenant_id=tenant, session_id=session, epoch=plan.epoch),
                    pb.GetPlanRequest(tenant_id=tenant, session_id=session, epoch=1),
                    pb.GetPlanRequest(tenant_id=tenant, session_id=session)):
            assert not_found(replica.stub.GetPlan, get)
        assert not_found(replica.stub.Build, build_request(tenant, session))
        # having seen it gone, a replica forgets it: the Build naming the epoch is NOT_FOUND
        assert not_found(replica.stub.Build, explicit)


def test_a_build_naming_its_epoch_is_not_found_once_the_replica_clock_passes_the_ttl(
        replicas):
    r = replicas
    tenant, session = new_ids()
    plan, explicit = warm(r, tenant, session)
    delete(r.a.stub, tenant, session)
    # the replica that erased forgot the session at once
    assert not_found(r.a.stub.Build, explicit)
    # B trusts its cached plan for a Build naming the epoch, without a query, until the TTL...
    assert r.b.stub.Build(explicit, timeout=30).prefix_sha256 == plan.prefix_sha256
    r.b.clock.advance(TTL - 1)
    assert r.b.stub.Build(explicit, timeout=30).prefix_sha256 == plan.prefix_sha256
    # ... and once its clock passes it, the database is asked again: gone
    r.b.clock.advance(2)
    assert not_found(r.b.stub.Build, explicit)
    assert not_found(r.b.stub.Build, explicit)


def test_a_session_planned_again_after_erasure_never_gets_the_erased_plan(replicas):
    r = replicas
    tenant, session = new_ids()
    old = r.a.stub.Plan(plan_request(tenant, session), timeout=30).plan
    assert old.epoch == 1
    old_build = build_request(tenant, session, epoch=1)
    assert r.b.stub.Build(old_build, timeout=30).prefix_sha256 == old.prefix_sha256
    assert r.b.stub.Build(build_request(tenant, session),
                          timeout=30).prefix_sha256 == old.prefix_sha256

    delete(r.a.stub, tenant, session)
    again = plan_request(tenant, session)
    again.agent.instructions = "You are a careful agent. Quote sources verbatim."
    new = r.a.stub.Plan(again, timeout=30)
    assert new.created and new.plan.epoch == 1
    assert new.plan.prefix_sha256 != old.prefix_sha256

    # B reads the session's incarnation with its current epoch: the new plan, never the old
    built = r.b.stub.Build(build_request(tenant, session), timeout=30)
    assert (built.epoch, built.prefix_sha256) == (1, new.plan.prefix_sha256)
    assert "Quote sources verbatim" in json.dumps([b.text for b in built.request.prefix_blocks])
    # and from then on the epoch named is the new session's too, GetPlan included
    assert r.b.stub.Build(old_build, timeout=30).prefix_sha256 == new.plan.prefix_sha256
    got = r.b.stub.GetPlan(pb.GetPlanRequest(tenant_id=tenant, session_id=session, epoch=1),
                           timeout=30).plan
    assert got.prefix_sha256 == new.plan.prefix_sha256


def test_a_build_naming_its_epoch_after_the_ttl_gets_the_new_session_not_the_erased_one(
        replicas):
    r = replicas
    tenant, session = new_ids()
    old = r.a.stub.Plan(plan_request(tenant, session), timeout=30).plan
    named = build_request(tenant, session, epoch=1)
    assert r.b.stub.Build(named, timeout=30).prefix_sha256 == old.prefix_sha256

    delete(r.a.stub, tenant, session)
    again = plan_request(tenant, session)
    again.agent.instructions = "You are a terse agent."
    new = r.a.stub.Plan(again, timeout=30).plan
    assert new.epoch == 1 and new.prefix_sha256 != old.prefix_sha256
    r.b.clock.advance(TTL + 1)
    assert r.b.stub.Build(named, timeout=30).prefix_sha256 == new.prefix_sha256


def test_a_run_of_the_session_planned_again_is_bound_to_its_snapshot_again(replicas, db):
    """The snapshot fence is per session: a replica that bound run-1 of the erased session
    still records context.snapshot.used for run-1 of the new one."""
    r = replicas
    tenant, session = new_ids()
    snapshot = pb.MemorySnapshot(snapshot_id="snap-1", recall_trace_id="trace-1",
                                 items=[pb.MemoryItem(id="m1", text="prefers aisle seats")])
    used = "SELECT count(*) FROM context_events WHERE tenant_id = $1 AND session_id = $2 " \
           "AND type = 'context.snapshot.used'"
    r.a.stub.Plan(plan_request(tenant, session, memory_snapshot=snapshot), timeout=30)
    r.b.stub.Build(build_request(tenant, session), timeout=30)
    assert db.val(used, tenant, session) == 1
    delete(r.a.stub, tenant, session)
    r.a.stub.Plan(plan_request(tenant, session, memory_snapshot=snapshot), timeout=30)
    r.b.stub.Build(build_request(tenant, session), timeout=30)
    assert db.val(used, tenant, session) == 1  # the new session's binding


def snapshot_of(trace: str, text: str) -> pb.MemorySnapshot:
    return pb.MemorySnapshot(snapshot_id=f"snap-{trace}", recall_trace_id=trace,
                             items=[pb.MemoryItem(id=f"m-{trace}", text=text)])


def test_a_new_run_naming_an_epoch_cached_from_the_erased_session_is_bound_to_the_new_one(
        replicas, db):
    """B cached epoch 1 of the erased session (within the TTL, not read since). The first
    Build of a run of the session planned again, naming epoch 1 on B: its snapshot binding
    finds another incarnation, so B reads the plan again and builds on the new session's plan,
    and the run is bound to the new snapshot's recall trace, never the erased one's."""
    r = replicas
    tenant, session = new_ids()
    r.a.stub.Plan(plan_request(tenant, session,
                               memory_snapshot=snapshot_of("trace-old", "likes tea")),
                  timeout=30)
    r.b.stub.Build(build_request(tenant, session, epoch=1), timeout=30)
    delete(r.a.stub, tenant, session)
    new = r.a.stub.Plan(plan_request(tenant, session,
                                     memory_snapshot=snapshot_of("trace-new", "likes coffee")),
                        timeout=30).plan
    request = build_request(tenant, session, epoch=1)
    request.checkpoint.active_run_id = "run-2"
    for it in request.checkpoint.items:
        it.run_id = "run-2"
    request.keep_base = True
    built = r.b.stub.Build(request, timeout=30)
    assert built.prefix_sha256 == new.prefix_sha256
    # made again on the new session's plan, it keeps its base (the erased one's are gone)
    kept = r.b.server.running.engine.builds.peek(tenant, session, built.build_id)
    assert kept is not None
    text = json.dumps([b.text for b in built.request.prefix_blocks])
    assert "likes coffee" in text and "likes tea" not in text
    used = db.fetch("SELECT payload->>'run_id' AS run, payload->>'recall_trace_id' AS trace "
                    "FROM context_events WHERE tenant_id = $1 AND session_id = $2 "
                    "AND type = 'context.snapshot.used'", tenant, session)
    assert [(u["run"], u["trace"]) for u in used] == [("run-2", "trace-new")]
    # and B serves the new session's plan from then on
    assert r.b.stub.Build(build_request(tenant, session, epoch=1),
                          timeout=30).prefix_sha256 == new.prefix_sha256


def test_a_build_made_again_after_a_replan_is_observed_once_with_both_assemblies(
        replicas, database_url):
    """The Build of the test above, on a replica B that traces: made again on the new plan, it
    assembled twice (two ``context_engine.build`` spans under its one RPC span), and
    ``context_engine_build_seconds`` observes it once, as the RPC histogram does, with the
    time of both assemblies (at least the two spans' durations, at most the call's)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from tests.integration.test_tracing import TracedServer

    r = replicas
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    b = TracedServer(base_config().replace(plan_cache_ttl_seconds=float(TTL)), database_url,
                     provider)
    try:
        with grpc.insecure_channel(b.address) as ch:
            stub = pb_grpc.ContextEngineStub(ch)
            tenant, session = new_ids()
            r.a.stub.Plan(plan_request(tenant, session,
                                       memory_snapshot=snapshot_of("trace-old", "likes tea")),
                          timeout=30)
            stub.Build(build_request(tenant, session, epoch=1), timeout=30)  # B caches epoch 1
            delete(r.a.stub, tenant, session)
            r.a.stub.Plan(plan_request(tenant, session,
                                       memory_snapshot=snapshot_of("trace-new", "coffee")),
                          timeout=30)
            request = build_request(tenant, session, items=long_history(40), epoch=1)
            request.checkpoint.active_run_id = "run-2"
            for it in request.checkpoint.items:
                it.run_id = "run-2"

            def sample(name: str, **labels: str) -> float:
                return b.registry.get_sample_value(name, labels) or 0.0
            before = (sample("context_engine_build_seconds_count"),
                      sample("context_engine_build_seconds_sum"),
                      sample("context_engine_rpc_seconds_count", method="Build", code="OK"),
                      sample("context_engine_rpc_seconds_sum", method="Build", code="OK"))
            trace_id = uuid.uuid4().hex
            stub.Build(request, timeout=30,
                       metadata=[("traceparent", f"00-{trace_id}-{uuid.uuid4().hex[:16]}-01")])
            after = (sample("context_engine_build_seconds_count"),
                     sample("context_engine_build_seconds_sum"),
                     sample("context_engine_rpc_seconds_count", method="Build", code="OK"),
                     sample("context_engine_rpc_seconds_sum", method="Build", code="OK"))
    finally:
        b.stop()
        provider.shutdown()
    spans = [s for s in exporter.get_finished_spans()
             if s.context is not None and s.context.trace_id == int(trace_id, 16)]
    assembled = [s for s in spans if s.name == "context_engine.build"]
    assert len(assembled) == 2  # the call was made again: it assembled twice
    assert after[2] - before[2] == 1  # one Build call, answered OK
    assert after[0] - before[0] == 1  # observed once, as that call
    both = sum((s.end_time or 0) - (s.start_time or 0) for s in assembled) / 1e9
    observed = after[1] - before[1]
    assert both - 1e-6 <= observed <= after[3] - before[3], (both, observed)


def test_usage_naming_an_epoch_cached_from_the_erased_session_counts_against_the_new_one(
        replicas, db):
    """B cached epochs 1 and 2 of the erased session (within the TTL, not read since), which
    used another model. A report naming epoch 2, which the new session does not have, is
    NOT_FOUND; one naming epoch 1 counts against the new session's plan (its model), once."""
    r = replicas
    tenant, session = new_ids()
    r.a.stub.Plan(plan_request(tenant, session, model=SMALL), timeout=30)
    r.a.stub.Rotate(pb.RotateRequest(tenant_id=tenant, session_id=session,
                                     reason=pb.ROTATION_REASON_OPERATOR,
                                     idempotency_key=f"rotate-{session}"), timeout=30)
    for epoch in (1, 2):
        r.b.stub.Build(build_request(tenant, session, epoch=epoch), timeout=30)
    delete(r.a.stub, tenant, session)
    new = r.a.stub.Plan(plan_request(tenant, session), timeout=30).plan
    assert new.epoch == 1 and new.model_id != SMALL.model_id

    second = usage_request(tenant, session, 5_000, "usage-epoch-2")
    second.epoch = 2
    assert not_found(r.b.stub.ReportUsage, second)
    first = usage_request(tenant, session, 5_000, "usage-epoch-1")
    first.epoch = 1
    answer = r.b.stub.ReportUsage(first, timeout=30)
    assert answer.counted and answer.model_id == new.model_id
    models = {row["model_id"] for row in db.fetch(
        "SELECT model_id FROM estimator_calibration WHERE tenant_id = $1", tenant)}
    assert models == {new.model_id}
    usage = db.fetch("SELECT epoch, reports FROM epoch_usage WHERE tenant_id = $1 "
                     "AND session_id = $2", tenant, session)
    assert [(u["epoch"], u["reports"]) for u in usage] == [(1, 1)]
    keys = db.fetch("SELECT key FROM idempotency_keys WHERE tenant_id = $1 AND rpc = $2",
                    tenant, "ReportUsage")
    assert [k["key"] for k in keys] == ["usage-epoch-1"]


def test_usage_over_the_erased_plans_window_is_checked_against_the_new_one(replicas):
    """B cached epoch 1 of the erased session (a 16k window). The new session's epoch 1 has a
    large window: a 20k-token report naming epoch 1 on B counts against it, as on A."""
    r = replicas
    tenant, session = new_ids()
    r.a.stub.Plan(plan_request(tenant, session, model=SMALL), timeout=30)
    r.b.stub.Build(build_request(tenant, session, epoch=1), timeout=30)
    delete(r.a.stub, tenant, session)
    new = r.a.stub.Plan(plan_request(tenant, session), timeout=30).plan
    assert new.model_id != SMALL.model_id
    for replica, key in ((r.a, "usage-a"), (r.b, "usage-b")):
        report = usage_request(tenant, session, 20_000, key)
        report.epoch = 1
        answer = replica.stub.ReportUsage(report, timeout=30)
        assert answer.counted and answer.model_id == new.model_id


def test_builds_racing_the_erasure_leave_no_event_behind(replicas, db):
    r = replicas
    tenant, session = new_ids()
    r.a.stub.Plan(plan_request(tenant, session, model=SMALL), timeout=30)
    items = long_history(12, size=600)
    first = r.a.stub.Build(build_request(tenant, session, items=items), timeout=30)
    assert first.pressure.steps  # each of these Builds records a context.budget.pressure
    pressure = "SELECT count(*) FROM context_events WHERE tenant_id = $1 AND session_id = $2 " \
               "AND type = 'context.budget.pressure'"
    assert db.val(pressure, tenant, session) == 1

    lock = threading.Lock()
    outcomes: Counter[str] = Counter()
    erased = threading.Event()
    stop = threading.Event()

    def hammer(stub: pb_grpc.ContextEngineStub, epoch: int) -> None:
        request = build_request(tenant, session, items=items, epoch=epoch)
        while not stop.is_set():
            after = erased.is_set()
            try:
                stub.Build(request, timeout=30)
                code = "OK"
            except grpc.RpcError as err:
                code = err.code().name
            with lock:
                outcomes[f"{code} {'after' if after else 'before'}"] += 1

    # A reads the session on every Build; B names the epoch, so it keeps building from its
    # cache after the erasure (within the TTL) and its events come after the session is gone
    threads = [threading.Thread(target=hammer, args=(stub, epoch))
               for stub, epoch in ((r.a.stub, 0), (r.a.stub, 1), (r.b.stub, 1), (r.b.stub, 1))]
    for t in threads:
        t.start()
    time.sleep(0.5)
    answer = delete(r.a.stub, tenant, session)
    erased.set()
    time.sleep(0.5)
    stop.set()
    for t in threads:
        t.join(30)
    assert answer.deleted and answer.events >= 1
    assert {k.split()[0] for k in outcomes} <= {"OK", "NOT_FOUND"}, outcomes
    assert outcomes["OK before"] > 0 and outcomes["NOT_FOUND after"] > 0, outcomes
    # B kept serving the Build naming its epoch from its cache: those events were refused
    assert outcomes["OK after"] > 0, outcomes
    time.sleep(0.2)
    assert session_rows(db, tenant, session) == dict.fromkeys(SESSION_TABLES, 0)
    for replica in (r.a, r.b):
        assert replica.server.running.events.pending == 0


def test_while_the_database_is_away_erasure_is_unavailable_and_cached_plans_keep_serving():
    """DeleteSession needs the database (UNAVAILABLE, nothing changed); a Build naming its
    epoch keeps being served from the cache past the TTL, since nothing can confirm it; once
    the database is back the erasure goes through."""
    database = Database()
    clock = StepClock()
    server = ServerThread(base_config().replace(plan_cache_ttl_seconds=float(TTL)),
                          database.url, clock=clock)
    channel = grpc.insecure_channel(server.address)
    stub = pb_grpc.ContextEngineStub(channel)
    try:
        tenant, session = new_ids()
        plan = stub.Plan(plan_request(tenant, session), timeout=30).plan
        named = build_request(tenant, session, epoch=1)
        assert stub.Build(named, timeout=30).prefix_sha256 == plan.prefix_sha256
        database.crash()
        try:
            with pytest.raises(grpc.RpcError) as err:
                delete(stub, tenant, session)
            f = failure(err.value)
            assert (f.code, f.reason) == (grpc.StatusCode.UNAVAILABLE, "STORE_UNAVAILABLE")
            clock.advance(TTL + 1)
            assert stub.Build(named, timeout=30).prefix_sha256 == plan.prefix_sha256
        finally:
            database.restart()
        deadline = time.monotonic() + 30
        while True:
            try:
                erased = delete(stub, tenant, session)
                break
            except grpc.RpcError as retry:
                assert retry.code() is grpc.StatusCode.UNAVAILABLE, retry
                assert time.monotonic() < deadline, "the pool never recovered"
                time.sleep(0.2)
        assert erased.deleted and erased.plans == 1
        assert not_found(stub.Build, named)
        assert Db(database.url).val("SELECT count(*) FROM sessions WHERE tenant_id = $1",
                                    tenant) == 0
    finally:
        channel.close()
        server.stop()
        database.close()


def test_the_migration_numbers_existing_sessions_and_gives_rotate_keys_their_session(
        direct_database_url):
    """A database from before erasure: each session gets its own incarnation, Rotate's and
    the snapshot fence's keys name their session where it can be told (from the stored
    response; from the key, when exactly one session fits), the others name none; an old
    session then erases completely."""
    async def scenario(url: str) -> None:
        conn = await asyncpg.connect(url)
        try:
            await conn.executemany(
                "INSERT INTO sessions (tenant_id, session_id, current_epoch) VALUES ($1, $2, 0)",
                [("t", "s1"), ("t", "s2"), ("u", "s1"), ("t", "a"), ("t", "a:1")])
            await conn.executemany(
                "INSERT INTO idempotency_keys (tenant_id, rpc, key, response) "
                "VALUES ($1, $2, $3, $4::jsonb)",
                [("t", "Rotate", "k1", '{"epoch": 2, "session_id": "s1", "fingerprint": "f"}'),
                 ("t", "ReportUsage", "k2", '{"fingerprint": "g"}'),
                 ("t", "Rotate", "k3", '{"epoch": 2, "session_id": "gone"}'),
                 ("t", "context.snapshot.used", "s1:1:run-1", "{}"),
                 ("t", "context.snapshot.used", "s2:3:run:x", "{}"),
                 ("t", "context.snapshot.used", "a:1:2:r", "{}"),  # "a" or "a:1"? neither
                 ("t", "context.snapshot.used", "gone:1:r", "{}")])
            await conn.execute(
                "INSERT INTO compactions (tenant_id, idempotency_key, session_id, fingerprint, "
                "depth, replaced_through_sequence, compactor_version, result) "
                "VALUES ('t', 'c1', 's1', 'f', 1, 4, 'v', '{}')")
            await migrate(url, REPO / "migrations")
            numbers = [r["incarnation"] for r in await conn.fetch(
                "SELECT incarnation FROM sessions ORDER BY incarnation")]
            assert len(set(numbers)) == 5 and all(n is not None for n in numbers)
            named = {r["key"]: r["session_id"] for r in await conn.fetch(
                "SELECT key, session_id FROM idempotency_keys")}
            assert named == {"k1": "s1", "k2": None, "k3": None, "s1:1:run-1": "s1",
                             "s2:3:run:x": "s2", "a:1:2:r": None, "gone:1:r": None}
            pool = await asyncpg.create_pool(url, min_size=1, max_size=1)
            try:
                erased = await PostgresErasure(pool).erase_session(
                    "t", "s1", requested_by="test", at=SYSTEM_CLOCK.now())
            finally:
                await pool.close()
            assert (erased.sessions, erased.compactions, erased.idempotency_keys) == (1, 1, 2)
            await conn.execute("INSERT INTO sessions (tenant_id, session_id) VALUES ('t', 's1')")
            assert await conn.fetchval("SELECT incarnation FROM sessions WHERE tenant_id = 't' "
                                       "AND session_id = 's1'") > max(numbers)
        finally:
            await conn.close()

    name = asyncio.run(create_database(direct_database_url, "ce_erasure"))
    try:
        url = with_database(direct_database_url, name)
        asyncio.run(migrate(url, REPO / "migrations", target=6))
        asyncio.run(scenario(url))
    finally:
        asyncio.run(drop_database(direct_database_url, name))


@pytest.mark.parametrize(("tenant", "session", "fields"), [
    ("", "", {"tenant_id", "session_id"}),
    ("t", "", {"session_id"}),
    ("", "s", {"tenant_id"}),
    ("t", "tab\there", {"session_id"}),
    ("t", " padded", {"session_id"}),
    ("t", "s" * 257, {"session_id"}),
    ("t\x00", "s", {"tenant_id"}),
])
def test_bad_ids_are_invalid_argument_with_field_violations(replicas, db, tenant, session,
                                                            fields):
    before = int(db.val("SELECT count(*) FROM erasures"))
    with pytest.raises(grpc.RpcError) as err:
        delete(replicas.a.stub, tenant, session)
    f = failure(err.value)
    assert (f.code, f.reason, f.domain) == (grpc.StatusCode.INVALID_ARGUMENT,
                                            "INVALID_ARGUMENT", "context-engine")
    assert set(f.violations) == fields
    assert int(db.val("SELECT count(*) FROM erasures")) == before


def test_the_audit_row_names_the_token_not_the_caller(secured, db):
    server, tenant, token = secured
    session = f"s-{uuid.uuid4().hex[:8]}"
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.ContextEngineStub(channel)
        metadata = (("authorization", f"Bearer {token}"),)
        stub.Plan(plan_request(tenant, session), metadata=metadata, timeout=30)
        assert delete(stub, tenant, session, metadata=metadata).deleted
    (who,) = [row["requested_by"] for row in db.fetch(
        "SELECT requested_by FROM erasures WHERE tenant_id = $1", tenant)]
    assert who == "token:" + hashlib.sha256(token.encode()).hexdigest()[:12]
    assert token not in who


def purge(database_url: str, *args: str, stdin: str | None = None
          ) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DATABASE_URL": database_url}
    return subprocess.run([str(CLI), "purge-tenant", *args], input=stdin, env=env,
                          capture_output=True, text=True, timeout=120)


def test_purge_tenant_erases_every_session_of_the_tenant_and_keeps_its_tokens(
        replicas, db, database_url, monkeypatch, capsys):
    r = replicas
    tenant, _ = new_ids()
    neighbour, _ = new_ids()
    sessions = [f"s{i}" for i in range(3)]
    for s in sessions:
        populate(r, tenant, s)
    populate(r, neighbour, sessions[0])
    db.fetch("INSERT INTO api_tokens (tenant_id, token_sha256, rpcs) VALUES ($1, $2, $3)",
             tenant, hashlib.sha256(tenant.encode()).hexdigest(), ["*"])
    before = tenant_rows(db, tenant)
    assert before["estimator_calibration"] == 1 and before["sessions"] == 3
    untouched = tenant_rows(db, neighbour)

    # not confirmed (in process: it stops before connecting): nothing erased
    monkeypatch.setenv("DATABASE_URL", database_url)
    monkeypatch.setattr(sys, "stdin", io.StringIO("not-the-tenant\n"))
    assert cli.main(["purge-tenant", "--tenant-id", tenant]) == 1
    assert "Type the tenant id to confirm" in capsys.readouterr().err
    assert tenant_rows(db, tenant) == before

    done = purge(database_url, "--tenant-id", tenant, "--batch-size", "2", "--json",
                 stdin=f"{tenant}\n")
    assert done.returncode == 0, done.stderr
    counts = json.loads(done.stdout)
    assert counts == {
        "tenant_id": tenant, "sessions": 3, "plans": before["plans"],
        "events": before["context_events"], "compactions": before["compactions"],
        "idempotency_keys": before["idempotency_keys"], "usage_rows": before["epoch_usage"],
        "calibrations": 1, "erased_at": counts["erased_at"], "recorded": True}
    after = tenant_rows(db, tenant)
    assert after == {**dict.fromkeys(after, 0), "api_tokens": 1}, after
    assert tenant_rows(db, neighbour) == untouched
    (audit,) = db.fetch("SELECT *, to_jsonb(e)::text AS whole FROM erasures e "
                        "WHERE tenant_id = $1", tenant)
    assert (audit["scope"], audit["session_sha256"], audit["sessions"], audit["calibrations"],
            audit["requested_by"]) == ("tenant", None, 3, 1, "operator-cli")
    assert not any(s in audit["whole"] for s in ("s0", "s1", "s2", "helpful agent"))
    for replica in (r.a, r.b):
        assert not_found(replica.stub.Build, build_request(tenant, sessions[1]))

    # again, with --yes: nothing left, nothing recorded
    empty = purge(database_url, "--tenant-id", tenant, "--yes")
    assert empty.returncode == 0, empty.stderr
    assert "nothing to erase" in empty.stdout
    assert db.val("SELECT count(*) FROM erasures WHERE tenant_id = $1", tenant) == 1


@pytest.mark.parametrize("args", [["--tenant-id", "", "--yes"],
                                  ["--tenant-id", " t", "--yes"],
                                  ["--tenant-id", "t", "--batch-size", "0", "--yes"]])
def test_purge_tenant_refuses_bad_arguments(args, capsys):
    assert cli.main(["purge-tenant", *args]) == 2
    assert "purge-tenant" not in capsys.readouterr().out


def test_a_batch_size_postgresql_cannot_take_is_a_bad_argument(stub, database_url, db):
    """--batch-size is the purge's LIMIT, a PostgreSQL bigint: 2**63 passed the check (only
    `< 1` was refused), asked for confirmation and ended in asyncpg's DataError traceback
    (exit 1). It is a bad argument now, exit 2 before anything is read; the largest size it
    takes still purges."""
    tenant, session = new_ids()
    stub.Plan(plan_request(tenant, session), timeout=30)
    for size in (2**63, 2**31):
        refused = purge(database_url, "--tenant-id", tenant, "--batch-size", str(size), "--yes")
        assert refused.returncode == 2, refused.stderr
        assert "Traceback" not in refused.stderr
        assert refused.stderr.strip() == ("context-engine: --batch-size must be at most "
                                          "2147483647"), refused.stderr
        assert db.val("SELECT count(*) FROM sessions WHERE tenant_id = $1", tenant) == 1
    done = purge(database_url, "--tenant-id", tenant, "--batch-size", str(2**31 - 1), "--yes",
                 "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["sessions"] == 1
    assert db.val("SELECT count(*) FROM sessions WHERE tenant_id = $1", tenant) == 0


def test_purge_tenant_that_cannot_begin_says_why_in_one_line(direct_database_url, tmp_path):
    """A refused connection, an unmigrated database and a data directory with no embedded
    database each printed a traceback (and the last one created a database to purge nothing
    from); each is one line now, saying nothing was erased, exit 1."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(direct_database_url)
    unmigrated = f"ce_unmigrated_{uuid.uuid4().hex[:8]}"
    run_sql(direct_database_url, f"CREATE DATABASE {unmigrated}")
    cases = {
        "refused": ({"DATABASE_URL": urlunsplit(parts._replace(path="/no_such_database"))},
                    "the database refused the connection"),
        "unmigrated": ({"DATABASE_URL": urlunsplit(parts._replace(path=f"/{unmigrated}"))},
                       "the database is not migrated"),
        "no embedded database": ({"DATABASE_URL": "", "CE_DATA_DIR": str(tmp_path)},
                                 "there is no embedded database under"),
        # a pg/ a first start left without a cluster (or an empty volume): once taken for a
        # database, and one was made there to purge nothing from
        "an empty pg/": ({"DATABASE_URL": "", "CE_DATA_DIR": str(tmp_path / "empty")},
                         "there is no embedded database under"),
    }
    (tmp_path / "empty" / "pg").mkdir(parents=True)
    for name, (env, said) in cases.items():
        done = subprocess.run([str(CLI), "purge-tenant", "--tenant-id", "t", "--yes"],
                              env={**os.environ, **env}, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 1 and "Traceback" not in done.stderr, (name, done.stderr)
        (line,) = done.stderr.strip().splitlines()
        assert said in line and line.endswith("nothing was erased"), (name, line)
    # no database was made to purge nothing from
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["empty", "pg"]


def test_purge_tenant_the_database_refuses_says_why_in_one_line(direct_database_url, db):
    """A role that may only read: the first DELETE is refused (permission denied), which
    printed asyncpg's traceback. One line now, naming the refusal, exit 1, nothing erased."""
    from urllib.parse import urlsplit, urlunsplit

    tenant, session = new_ids()
    db.fetch("INSERT INTO sessions (tenant_id, session_id) VALUES ($1, $2)", tenant, session)
    role = f"ce_reader_{uuid.uuid4().hex[:8]}"
    run_sql(direct_database_url, f"CREATE ROLE {role} LOGIN")
    run_sql(direct_database_url, f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {role}")
    parts = urlsplit(direct_database_url)
    host = parts.netloc.rsplit("@", 1)[-1]
    try:
        done = purge(urlunsplit(parts._replace(netloc=f"{role}@{host}")), "--tenant-id",
                     tenant, "--yes")
    finally:
        run_sql(direct_database_url, f"DROP OWNED BY {role}")
        run_sql(direct_database_url, f"DROP ROLE {role}")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("context-engine: the database refused the purge "
                           "(InsufficientPrivilegeError: permission denied for table"), line
    assert db.val("SELECT count(*) FROM sessions WHERE tenant_id = $1", tenant) == 1


def run_sql(url: str, statement: str) -> None:
    async def go() -> None:
        conn = await asyncpg.connect(url)
        try:
            await conn.execute(statement)
        finally:
            await conn.close()
    asyncio.run(go())


async def _plan_waiting_on_a_lock(watcher: asyncpg.Connection, marker: str) -> bool:
    """True once a statement of this database holding ``marker`` waits on a lock
    (pg_stat_activity is read afresh: each query here is its own transaction)."""
    for _ in range(400):
        if await watcher.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND datname = current_database() AND query LIKE $1", f"%{marker}%"):
            return True
        await asyncio.sleep(0.025)
    return False


def test_a_plan_racing_the_erasure_of_its_session_opens_a_new_one(replicas, db,
                                                                  direct_database_url):
    """The erasure locks the session's row, a Plan that rotates it waits for that lock, and the
    erasure deletes the row and commits: the Plan creates the session anew (a new incarnation
    at epoch 1), never INTERNAL. Its incarnation is later than every one handed out while it
    waited (a session of that id opened, read on a replica and erased in that time stands for
    them), so a replica that read one never takes the live session for an erased one."""
    from context_engine.adapters.postgres.erasure import DELETE_SESSION_ROWS, LOCK_SESSIONS
    r = replicas
    tenant, session = new_ids()
    r.a.stub.Plan(plan_request(tenant, session), timeout=30)
    first = db.val("SELECT incarnation FROM sessions WHERE tenant_id = $1 AND session_id = $2",
                   tenant, session)
    newer = plan_request(tenant, session)
    newer.agent.version = "8"  # agent_version_changed: the Plan pins

    async def erase_while_the_plan_waits() -> tuple[Any, int]:
        conn = await asyncpg.connect(direct_database_url)
        watcher = await asyncpg.connect(direct_database_url)
        try:
            async with conn.transaction():
                await conn.execute(LOCK_SESSIONS, tenant, [session])
                answer = r.a.stub.Plan.future(newer, timeout=30)
                # the Plan's statement on the session's row (whatever it is), waiting
                assert await _plan_waiting_on_a_lock(watcher, "sessions")
                handed = int(await watcher.fetchval("SELECT nextval('session_incarnations')"))
                for _, sql in DELETE_SESSION_ROWS:
                    await conn.execute(sql, tenant, [session])
            return answer, handed
        finally:
            await conn.close()
            await watcher.close()

    waited, handed = asyncio.run(erase_while_the_plan_waits())
    answer = waited.result()
    assert answer.created and answer.plan.epoch == 1
    row = db.fetch("SELECT incarnation, current_epoch FROM sessions "
                   "WHERE tenant_id = $1 AND session_id = $2", tenant, session)
    assert len(row) == 1 and row[0]["current_epoch"] == 1 and row[0]["incarnation"] != first
    assert row[0]["incarnation"] > handed
    built = r.b.stub.Build(build_request(tenant, session), timeout=30)
    assert built.prefix_sha256 == answer.plan.prefix_sha256
    assert engine_incarnation(r.b, tenant, session) == row[0]["incarnation"]


def test_a_plan_opening_a_session_while_its_erasure_runs_waits_and_opens_it_afresh(
        replicas, db, direct_database_url):
    """A DeleteSession of a session with no row locked nothing: a Plan opening the session
    meanwhile committed between the erasure's deletes, which then failed on a foreign key (a
    plan left naming the deleted session) or deadlocked with it, both answered INTERNAL (110 of
    600 such erasures in a review's run). The erasure now holds the session's key with an
    uncommitted row of its own: the Plan waits for it, then opens the session, whole. A SHARE
    lock on compactions (a table the erasure empties and a Plan never writes) holds the
    erasure after its first statements while the Plan is sent."""
    r = replicas
    tenant, session = new_ids()

    async def erase_around_a_plan() -> tuple[bool, Any, Any]:
        pool = await asyncpg.create_pool(direct_database_url, min_size=1, max_size=1)
        holder = await asyncpg.connect(direct_database_url)
        watcher = await asyncpg.connect(direct_database_url)
        try:
            async with holder.transaction():
                await holder.execute("LOCK TABLE compactions IN SHARE MODE")
                erasure = asyncio.ensure_future(PostgresErasure(pool).erase_session(
                    tenant, session, requested_by="test", at=SYSTEM_CLOCK.now()))
                assert await _plan_waiting_on_a_lock(watcher, "DELETE FROM compactions")
                opening = r.b.stub.Plan.future(plan_request(tenant, session), timeout=30)
                waited = await _plan_waiting_on_a_lock(watcher, "INSERT INTO sessions")
            return waited, await erasure, await asyncio.to_thread(opening.result)
        finally:
            await holder.close()
            await watcher.close()
            await pool.close()

    waited, erased, opened = asyncio.run(erase_around_a_plan())
    assert waited, "the Plan did not wait for the erasure"
    assert sum(getattr(erased, kind) for kind in ("sessions", "plans", "events")) == 0
    assert not db.fetch("SELECT 1 FROM erasures WHERE tenant_id = $1", tenant)  # none recorded
    assert opened.created and opened.plan.epoch == 1
    kept = session_rows(db, tenant, session)
    assert (kept["sessions"], kept["plans"]) == (1, 1) and kept["context_events"] >= 1, kept
    assert r.b.stub.Build(build_request(tenant, session), timeout=30).prefix_sha256 == \
        opened.plan.prefix_sha256


def test_a_plan_whose_session_is_erased_before_it_answers_opens_it_anew(replicas, monkeypatch):
    """A Plan that pinned the session's plan, then found it erased when it read the plan back
    for its answer (a DeleteSession between the two), answered NOT_FOUND: seen twice in about
    2,000 Plans racing erasures. It plans again, opening the session anew."""
    r = replicas
    tenant, session = new_ids()
    r.a.stub.Plan(plan_request(tenant, session), timeout=30)
    engine = r.b.server.running.engine
    pin = engine.plan
    erased: list[Any] = []

    async def erased_after_the_pin(cmd: Any, **kwargs: Any) -> Any:
        pinned = await pin(cmd, **kwargs)
        if not erased:  # once: the Plan's second pin opens the session anew
            erased.append(await engine.delete_session(cmd.tenant_id, cmd.session_id,
                                                      requested_by="test"))
        return pinned

    monkeypatch.setattr(engine, "plan", erased_after_the_pin)
    answer = r.b.stub.Plan(plan_request(tenant, session), timeout=30)
    assert erased and erased[0].sessions == 1
    assert answer.created and answer.plan.epoch == 1
    built = r.b.stub.Build(build_request(tenant, session), timeout=30)
    assert built.prefix_sha256 == answer.plan.prefix_sha256


def test_plans_and_erasures_of_one_session_racing_on_two_replicas_never_fail_internal(
        replicas):
    """Plans, Rotates and DeleteSessions of one session sent at once to two replicas: each
    succeeds or answers a structured, retryable error; none INTERNAL (a deadlock or a foreign
    key violation escaped as INTERNAL before)."""
    r = replicas
    tenant, session = new_ids()
    stubs = (r.a.stub, r.b.stub)

    def one(i: int) -> str:
        stub = stubs[i % 2]
        try:
            if i % 3 == 0:
                stub.DeleteSession(pb.DeleteSessionRequest(tenant_id=tenant, session_id=session),
                                   timeout=30)
            elif i % 3 == 1:
                stub.Plan(plan_request(tenant, session), timeout=30)
            else:
                stub.Rotate(pb.RotateRequest(tenant_id=tenant, session_id=session,
                                             reason=pb.ROTATION_REASON_OPERATOR,
                                             idempotency_key=f"k-{i}"), timeout=30)
        except grpc.RpcError as exc:
            return f"{exc.code().name} {failure(exc).reason}"
        return "OK"

    outcomes: Counter[str] = Counter()
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(6) as pool:
        for _ in range(40):
            outcomes.update(pool.map(one, range(6)))
    assert not {o for o in outcomes if o.startswith("INTERNAL")}, outcomes
    assert outcomes["OK"] > 0 and set(outcomes) <= {
        "OK", "NOT_FOUND SESSION_NOT_FOUND", "UNAVAILABLE STORE_CONFLICT"}, outcomes


def test_a_session_opened_while_the_tenant_is_purged_keeps_its_plan(replicas, db,
                                                                    direct_database_url):
    """purge-tenant's last transaction (no session left in its batch) removes what the tenant
    holds outside its sessions; a session a caller opens meanwhile keeps every row of its own.
    The tenant has no session when the purge starts, so its first transaction is that last
    one; a SHARE lock on idempotency_keys (the first table that transaction deletes from) holds it
    at that point while the Plan commits."""
    r = replicas
    tenant, session = new_ids()
    populate(r, tenant, "erased")  # its usage report leaves the tenant a calibration
    delete(r.a.stub, tenant, "erased")  # no session left: the purge's first transaction is last

    async def purge_around_a_plan() -> tuple[Any, Any]:
        pool = await asyncpg.create_pool(direct_database_url, min_size=1, max_size=2)
        holder = await asyncpg.connect(direct_database_url)
        watcher = await asyncpg.connect(direct_database_url)
        try:
            async with holder.transaction():
                await holder.execute("LOCK TABLE idempotency_keys IN SHARE MODE")
                purge = asyncio.ensure_future(PostgresErasure(pool).purge_tenant(
                    tenant, requested_by="operator-cli", now=SYSTEM_CLOCK.now))
                assert await _plan_waiting_on_a_lock(watcher, "DELETE FROM idempotency_keys")
                opened = await asyncio.to_thread(r.b.stub.Plan, plan_request(tenant, session),
                                                 timeout=30)
            return opened, await purge
        finally:
            await holder.close()
            await watcher.close()
            await pool.close()

    opened, erased = asyncio.run(purge_around_a_plan())
    assert opened.created and opened.plan.epoch == 1
    assert (erased.sessions, erased.plans, erased.calibrations) == (0, 0, 1)
    kept = session_rows(db, tenant, session)
    assert (kept["sessions"], kept["plans"]) == (1, 1) and kept["context_events"] >= 1, kept
    for replica in (r.a, r.b):
        built = replica.stub.Build(build_request(tenant, session), timeout=30)
        assert built.prefix_sha256 == opened.plan.prefix_sha256
    again = r.a.stub.Plan(plan_request(tenant, session), timeout=30)
    assert not again.created and again.plan.prefix_sha256 == opened.plan.prefix_sha256


@pytest.mark.parametrize("planned_again", [False, True])
def test_a_plan_that_finds_its_session_erased_after_reading_it_opens_a_new_one(
        replicas, db, direct_database_url, planned_again):
    """The session is erased after a Plan read its current epoch (nothing to rotate) and before
    it loaded that plan (not cached here): the Plan opens the session anew, never NOT_FOUND;
    or, when another replica planned it again meanwhile (another snapshot, which never rotates),
    answers that new session's plan. Never the erased plan."""
    from context_engine.adapters.postgres.erasure import DELETE_SESSION_ROWS, LOCK_SESSIONS
    r = replicas
    tenant, session = new_ids()
    old = r.a.stub.Plan(plan_request(tenant, session), timeout=30).plan
    engine = r.a.server.running.engine
    store = engine._store
    replanned: list[pb.ContextPlan] = []

    class ErasedAfterRead:
        def __getattr__(self, name: str) -> Any:
            return getattr(store, name)

        async def get(self, *args: Any, **kwargs: Any) -> Any:
            found = await store.get(*args, **kwargs)
            engine._store = store  # once
            conn = await asyncpg.connect(direct_database_url)
            try:
                async with conn.transaction():
                    await conn.execute(LOCK_SESSIONS, tenant, [session])
                    for _, sql in DELETE_SESSION_ROWS:
                        await conn.execute(sql, tenant, [session])
            finally:
                await conn.close()
            if planned_again:
                request = plan_request(tenant, session,
                                       memory_snapshot=snapshot_of("trace-new", "likes tea"))
                replanned.append((await asyncio.to_thread(r.b.stub.Plan, request,
                                                          timeout=30)).plan)
            return found

    engine.cache.clear()
    engine._store = ErasedAfterRead()
    try:
        again = r.a.stub.Plan(plan_request(tenant, session), timeout=30)
    finally:
        engine._store = store
    assert again.plan.epoch == 1 and again.plan.created_at != old.created_at
    if planned_again:
        assert not again.created
        assert again.plan.prefix_sha256 == replanned[0].prefix_sha256 != old.prefix_sha256
    else:
        assert again.created and again.plan.prefix_sha256 == old.prefix_sha256
    (row,) = db.fetch("SELECT current_epoch FROM sessions WHERE tenant_id = $1 "
                      "AND session_id = $2", tenant, session)
    assert row["current_epoch"] == 1


def engine_incarnation(replica: Replica, tenant: str, session: str) -> int | None:
    """The incarnation of the session ``replica`` holds its current plan of."""
    return replica.server.running.engine.cache.incarnation(tenant, session)


def _held_of(server: ServerThread, tenant: str, session: str, text: str) -> int:
    """How many render-memo entries of the session hold ``text``, on ``server``. A digit at
    either end of ``text`` must not touch another hex digit: an entry's repr also holds object
    ids (15 decimal digits) and hex nonces, one of which holds a four-digit marker such as
    ``4711`` about once in 400 Builds."""
    memo, key = server.running.engine.render_memo, session_key(tenant, session)
    before = "(?<![0-9a-fA-F])" if text[:1].isdigit() else ""
    after = "(?![0-9a-fA-F])" if text[-1:].isdigit() else ""
    found = re.compile(before + re.escape(text) + after)
    return sum(found.search(repr(memo[k])) is not None for k in list(memo) if k[0] == key)


@pytest.mark.parametrize("held", ["a base", "a base it names", "renderings alone"])
def test_a_replica_finding_the_session_planned_again_forgets_what_it_kept_of_the_erased_one(
        replicas, held):
    """B built the session (its items in B's render memo, perhaps a base kept); A erased it
    and planned it again. B's next Build of the current epoch reads the new incarnation: B
    forgets the erased session's renderings and bases, whether or not the Build names the
    erased base, and even when all B still holds of it is renderings (its plan no longer
    cached); it keeps the plan it read and the base it makes on the new one."""
    r = replicas
    tenant, session = new_ids()
    r.a.stub.Plan(plan_request(tenant, session), timeout=30)
    old = build_request(tenant, session, items=[
        item("u1", 1, user=pb.UserMessage(text="the erased secret is 4711"))])
    old.keep_base = held != "renderings alone"
    erased = r.b.stub.Build(old, timeout=30)
    engine = r.b.server.running.engine
    assert (engine.builds.peek(tenant, session, erased.build_id) is not None) is old.keep_base
    assert _held_of(r.b.server, tenant, session, "4711") > 0
    delete(r.a.stub, tenant, session)
    new_plan = r.a.stub.Plan(plan_request(tenant, session), timeout=30).plan
    if held == "renderings alone":  # its plan evicted from B's cache meanwhile
        engine.cache.forget(tenant, session)
    new = build_request(tenant, session, items=[
        item("u1", 1, user=pb.UserMessage(text="a new session's question"))])
    new.keep_base = True
    if held == "a base it names":
        new.base_build_id, new.base_items_kept = erased.build_id, 0
        with pytest.raises(grpc.RpcError) as err:
            r.b.stub.Build(new, timeout=30)
        assert failure(err.value).reason == "BUILD_BASE_UNKNOWN"
        new.ClearField("base_build_id")
        new.base_items_kept = 0
    reads: list[str] = []
    get_plan = engine.get_plan

    async def counted(tenant_id: str, session_id: str, epoch: int | None) -> Any:
        if tenant_id == tenant:
            reads.append(session_id)
        return await get_plan(tenant_id, session_id, epoch)

    engine.get_plan = counted  # type: ignore[method-assign]
    try:
        built = r.b.stub.Build(new, timeout=30)
    finally:
        del engine.get_plan
    assert built.prefix_sha256 == new_plan.prefix_sha256
    assert engine.builds.peek(tenant, session, erased.build_id) is None
    assert _held_of(r.b.server, tenant, session, "4711") == 0
    # the new plan, read once and kept (not dropped with the erased one's, to be read again)
    assert reads == ([] if held == "a base it names" else [session])
    assert engine.cache.newest(tenant, session, 1) is not None
    # what B made of the new session stays: its base, and its items for the next Build
    assert engine.builds.peek(tenant, session, built.build_id) is not None
    again = build_request(tenant, session, items=[
        item("u1", 1, user=pb.UserMessage(text="a new session's question"))])
    again.base_build_id, again.base_items_kept = built.build_id, 1
    again.checkpoint.ClearField("items")
    assert r.b.stub.Build(again, timeout=30).build_id  # on the base: no BUILD_BASE_UNKNOWN


def planned_again(r: Replicas, tenant: str, session: str) -> None:
    """The session erased and planned again through replica A."""
    delete(r.a.stub, tenant, session)
    r.a.stub.Plan(plan_request(tenant, session), timeout=30)


@pytest.mark.parametrize("made", ["by a refused Build",
                                  "by a refused Build on a replica that knew no incarnation",
                                  "after the session was begun again",
                                  "by the Build that found the session planned again",
                                  "by a Build that never read its plan"])
def test_renderings_are_forgotten_with_their_incarnation_whenever_they_were_made(
        replicas, made):
    """What B rendered of a session is of the incarnation a plan read named for it, whether
    the renderings were made before or after the read: by a Build refused once its plan was
    read, after the session alone outgrew half the memo mid-Build (begun again), or after
    the Build found the session planned again (its own renderings, made once it had
    forgotten the erased ones). Once A erases the session and plans it again, B's next Build
    reads the later incarnation and forgets them, even with the plan gone from B's cache. A
    Build that never read its plan (the database away) keeps nothing it rendered: no read
    could name what it was of."""
    r = replicas
    engine = r.b.server.running.engine
    memo = engine.render_memo
    tenant, session = new_ids()
    r.a.stub.Plan(plan_request(tenant, session), timeout=30)
    secret = "the erased secret is 4711"
    said = [item("u1", 1, user=pb.UserMessage(text=secret))]
    if made == "by a refused Build":
        r.b.stub.GetPlan(pb.GetPlanRequest(tenant_id=tenant, session_id=session), timeout=30)
        bad = build_request(tenant, session, epoch=1, items=said)  # a plan-cache hit
        bad.estimator_factor = 10.0
        with pytest.raises(grpc.RpcError) as err:
            r.b.stub.Build(bad, timeout=30)
        assert failure(err.value).code is grpc.StatusCode.INVALID_ARGUMENT
    elif made == "by a refused Build on a replica that knew no incarnation":
        # B has never read this session: the Build begins knowing no incarnation of it, and
        # what it renders is of the one its plan read names, though the Build is refused
        assert engine.latest_incarnation(tenant, session) is None
        bad = build_request(tenant, session, items=said)
        bad.estimator_factor = 10.0
        with pytest.raises(grpc.RpcError) as err:
            r.b.stub.Build(bad, timeout=30)
        assert failure(err.value).code is grpc.StatusCode.INVALID_ARGUMENT
    elif made == "after the session was begun again":
        said = [item(f"f{i}", i, user=pb.UserMessage(text=f"filler {i} " * 40))
                for i in range(1, 6)] + [item("u9", 9, user=pb.UserMessage(text=secret))]
        t0, s0 = new_ids()  # what one Build of these items keeps in the memo
        r.a.stub.Plan(plan_request(t0, s0), timeout=30)
        r.b.stub.Build(build_request(t0, s0, items=said), timeout=30)
        weight = memo._session_bytes[session_key(t0, s0)]
        capacity = memo.capacity_bytes
        memo.capacity_bytes = int(weight * 1.2)  # over half of it: begun again mid-Build
        try:
            r.b.stub.Build(build_request(tenant, session, items=said), timeout=30)
        finally:
            memo.capacity_bytes = capacity
    elif made == "by the Build that found the session planned again":
        r.b.stub.Build(build_request(tenant, session, items=[
            item("u1", 1, user=pb.UserMessage(text="an earlier incarnation's"))]), timeout=30)
        planned_again(r, tenant, session)
        engine.cache.forget(tenant, session)  # its plan evicted from B's cache (LRU)
        r.b.stub.Build(build_request(tenant, session, items=said), timeout=30)
        assert _held_of(r.b.server, tenant, session, "an earlier incarnation's") == 0
    else:
        store = engine._store
        current = store.current
        seen: list[int] = []

        async def away(tenant_id: str, session_id: str) -> Any:
            if tenant_id != tenant:
                return await current(tenant_id, session_id)
            for _ in range(200):  # the checkpoint is mapped while the query is out
                await asyncio.sleep(0.005)
                if _held_of(r.b.server, tenant, session, secret):
                    break
            seen.append(_held_of(r.b.server, tenant, session, secret))
            raise StoreUnavailable("database unavailable: OSError")

        store.current = away
        try:
            with pytest.raises(grpc.RpcError) as err:
                r.b.stub.Build(build_request(tenant, session, items=said), timeout=30)
        finally:
            del store.current
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE
        assert seen and seen[0] > 0  # rendered while the plan was being read
        assert _held_of(r.b.server, tenant, session, secret) == 0
    if made != "by a Build that never read its plan":
        assert _held_of(r.b.server, tenant, session, secret) > 0
    planned_again(r, tenant, session)
    engine.cache.forget(tenant, session)  # its plan evicted from B's cache meanwhile (LRU)
    r.b.stub.Build(build_request(tenant, session, items=[
        item("n1", 1, user=pb.UserMessage(text="a new session's question"))]), timeout=30)
    assert _held_of(r.b.server, tenant, session, secret) == 0
    assert _held_of(r.b.server, tenant, session, "a new session's question") > 0


class Held:
    """Holds the first ``n`` calls of the engine's ``correction_factor`` for ``tenant`` (a
    Build makes it once its plan is read, before it renders the request) until released;
    ``on_enter(i)`` runs as the i-th is held."""

    def __init__(self, engine: Any, tenant: str, n: int, on_enter: Any = None) -> None:
        self.engine = engine
        self.entered = [threading.Event() for _ in range(n)]
        self.release = [threading.Event() for _ in range(n)]
        self.calls = 0
        factor = engine.correction_factor

        async def held(tenant_id: str, spec: Any) -> float:
            if tenant_id == tenant and self.calls < n:
                i = self.calls
                self.calls += 1
                if on_enter is not None:
                    on_enter(i)
                self.entered[i].set()
                await asyncio.to_thread(self.release[i].wait, 30)
            return await factor(tenant_id, spec)

        engine.correction_factor = held

    def undo(self) -> None:
        for e in self.release:
            e.set()
        del self.engine.correction_factor


def _said(text: str, item_id: str = "u1") -> list[pb.ConversationItem]:
    return [item(item_id, 1, user=pb.UserMessage(text=text))]


@pytest.mark.parametrize("learnt", ["by a read alone, the Build's renderings evicted meanwhile",
                                    "by a Build of the new one, which the old one outlives"])
def test_a_build_that_ran_on_an_incarnation_read_as_erased_since_keeps_nothing_of_it(
        replicas, learnt):
    """Build X of incarnation 1 runs on B while the session is erased and planned again
    through A, and B reads incarnation 2 before X ends: by a GetPlan alone (X's renderings
    evicted from B's memo meanwhile, so B holds nothing of 1 to forget then), or by a Build Y
    of incarnation 2 running beside X, which X outlives. X keeps none of what it rendered; Y
    keeps what it rendered of 2, until 2 is erased and planned again in its turn."""
    r = replicas
    engine = r.b.server.running.engine
    memo = engine.render_memo
    tenant, session = new_ids()
    key = session_key(tenant, session)
    r.a.stub.Plan(plan_request(tenant, session), timeout=30)

    def evict(i: int) -> None:  # another session written while X waits: X's entries go
        if learnt.startswith("by a read") and i == 0:
            capacity, weight = memo.capacity_bytes, memo._session_bytes[key]
            memo.capacity_bytes = weight
            memo[("another session", "x")] = "y" * (weight // 2 - 49)
            memo.capacity_bytes = capacity
            assert _held_of(r.b.server, tenant, session, "4711") == 0

    held = Held(engine, tenant, 2, on_enter=evict)
    try:
        x = r.b.stub.Build.future(build_request(tenant, session,
                                                items=_said("the erased secret is 4711")),
                                  timeout=30)
        assert held.entered[0].wait(30)
        planned_again(r, tenant, session)
        if learnt.startswith("by a read"):
            held.release[1].set()
            r.b.stub.GetPlan(pb.GetPlanRequest(tenant_id=tenant, session_id=session),
                             timeout=30)
            held.release[0].set()
            x.result(30)
        else:
            y = r.b.stub.Build.future(build_request(tenant, session,
                                                    items=_said("the next secret is 2222")),
                                      timeout=30)
            assert held.entered[1].wait(30)  # Y read 2, forgot what was held of 1
            held.release[0].set()
            x.result(30)  # X ends while Y is still rendering
            held.release[1].set()
            y.result(30)
            assert _held_of(r.b.server, tenant, session, "2222") > 0  # Y's, of 2, kept
            live = engine.latest_incarnation(tenant, session)  # and the plan Y read
            assert live is not None and engine.cache.incarnation(tenant, session) == live
    finally:
        held.undo()
    assert _held_of(r.b.server, tenant, session, "4711") == 0
    planned_again(r, tenant, session)  # 2 erased and planned again in its turn: 3
    r.b.stub.Build(build_request(tenant, session, items=_said("a third", "n1")), timeout=30)
    assert _held_of(r.b.server, tenant, session, "4711") == 0
    assert _held_of(r.b.server, tenant, session, "2222") == 0


@contextmanager
def plan_read_held(engine: Any, tenant: str) -> Iterator[tuple[threading.Event, threading.Event]]:
    """The engine's first read of a plan of ``tenant`` is answered by the database, then waits
    until released before its caller sees it; yields the events (entered, release)."""
    store = engine._store
    get = store.get
    entered, release = threading.Event(), threading.Event()

    async def late(tenant_id: str, session_id: str, epoch: Any) -> Any:
        got = await get(tenant_id, session_id, epoch)
        if tenant_id == tenant and not entered.is_set():
            entered.set()
            await asyncio.to_thread(release.wait, 30)
        return got

    store.get = late
    try:
        yield entered, release
    finally:
        release.set()
        del store.get


def secret_build_across_a_replan(r: Any, tenant: str, session: str, held: Any,
                                 meanwhile: Callable[[], None]) -> Any:
    """A Build on B of "the erased secret is 4711" whose read ``held`` (a context yielding the
    events entered, release) holds while the session is erased and planned again through A
    and ``meanwhile`` runs; released then: the Build's future."""
    with held as (entered, release):
        build = r.b.stub.Build.future(build_request(tenant, session,
                                                    items=_said("the erased secret is 4711")),
                                      timeout=30)
        assert entered.wait(30)
        planned_again(r, tenant, session)
        meanwhile()
        release.set()
    return build


def test_a_build_whose_plan_read_is_answered_late_keeps_nothing_of_an_erased_incarnation(
        replicas):
    """X's read of incarnation 1 is answered after the session was erased and planned again
    through A, and after a Build of incarnation 2 on B: X ran on an erased incarnation and
    keeps none of what it rendered."""
    r = replicas
    engine = r.b.server.running.engine
    tenant, session = new_ids()
    r.a.stub.Plan(plan_request(tenant, session), timeout=30)
    def meanwhile() -> None:  # a Build of incarnation 2 on B
        r.b.stub.Build(build_request(tenant, session, items=_said("a new question", "n1")),
                       timeout=30)

    x = secret_build_across_a_replan(r, tenant, session, plan_read_held(engine, tenant),
                                     meanwhile)
    x.result(30)
    assert _held_of(r.b.server, tenant, session, "4711") == 0
    r.b.stub.Build(build_request(tenant, session, items=_said("a new question", "n1")),
                   timeout=30)
    assert _held_of(r.b.server, tenant, session, "4711") == 0
    assert _held_of(r.b.server, tenant, session, "a new question") > 0


@contextmanager
def current_held(engine: Any, tenant: str, *,
                 then_away: bool = True) -> Iterator[tuple[threading.Event, threading.Event]]:
    """The engine's first read of a session of ``tenant``'s current incarnation waits until
    released, then fails as with the database away (``then_away``) or is answered; yields the
    events (entered, release)."""
    store = engine._store
    current = store.current
    entered, release = threading.Event(), threading.Event()

    async def held(tenant_id: str, session_id: str) -> Any:
        if tenant_id == tenant and not entered.is_set():
            entered.set()
            await asyncio.to_thread(release.wait, 30)
            if then_away:
                raise StoreUnavailable("database unavailable: OSError")
        return await current(tenant_id, session_id)

    store.current = held
    try:
        yield entered, release
    finally:
        release.set()
        del store.current


def test_a_build_that_never_read_its_plan_keeps_nothing_though_a_read_names_one_meanwhile(
        replicas):
    """P's plan query is out while the session is erased and planned again through A and a
    GetPlan on B reads incarnation 2; the query then fails (the database away). What P
    rendered is of no incarnation known: none of it stays."""
    r = replicas
    engine = r.b.server.running.engine
    tenant, session = new_ids()
    r.a.stub.Plan(plan_request(tenant, session), timeout=30)

    def meanwhile() -> None:
        r.b.stub.GetPlan(pb.GetPlanRequest(tenant_id=tenant, session_id=session), timeout=30)
        assert _held_of(r.b.server, tenant, session, "4711") > 0  # rendered, plan not read

    p = secret_build_across_a_replan(r, tenant, session, current_held(engine, tenant), meanwhile)
    with pytest.raises(grpc.RpcError) as err:
        p.result(30)
    assert err.value.code() is grpc.StatusCode.UNAVAILABLE
    assert _held_of(r.b.server, tenant, session, "4711") == 0


@pytest.mark.parametrize("unread", ["its deadline passed", "the database away",
                                    "its epoch not found"])
def test_a_build_that_never_read_its_plan_keeps_the_live_sessions_renderings(replicas,
                                                                            unread):
    """A Build of a session the replica has read, which never reads its plan itself (its
    caller's deadline passes while the query is out, the database is away, or the epoch it
    names does not exist), rendered for the incarnation known when it began: what the
    session's earlier Builds keep in the memo stays, and so does what it rendered, until a
    read names a later incarnation."""
    r = replicas
    engine = r.b.server.running.engine
    tenant, session = new_ids()
    key = session_key(tenant, session)
    r.a.stub.Plan(plan_request(tenant, session), timeout=30)
    r.b.stub.Build(build_request(tenant, session), timeout=30)
    before = {k for k in engine.render_memo if k[0] == key}
    assert before
    request = build_request(tenant, session, items=_said("a question of the live session"))
    ended = threading.Event()
    judged = engine.forgotten_since

    def judging(tenant_id: str, *args: Any) -> bool:
        if tenant_id == tenant:
            ended.set()  # the Build's end: what it keeps is judged now
        return judged(tenant_id, *args)

    engine.forgotten_since = judging
    try:
        with current_held(engine, tenant, then_away=unread == "the database away") as (
                entered, release), pytest.raises(grpc.RpcError) as err:
            if unread == "its deadline passed":
                r.b.stub.Build(request, timeout=0.5)
            elif unread == "the database away":
                answer = r.b.stub.Build.future(request, timeout=30)
                assert entered.wait(30)
                release.set()
                answer.result(30)
            else:  # the session's row is read (it is there): not held
                release.set()
                request.epoch = 7
                r.b.stub.Build(request, timeout=30)
        assert err.value.code() is {"its deadline passed": grpc.StatusCode.DEADLINE_EXCEEDED,
                                    "the database away": grpc.StatusCode.UNAVAILABLE,
                                    "its epoch not found": grpc.StatusCode.NOT_FOUND}[unread]
        assert ended.wait(30)  # on the server, after its caller gave up
        # a call behind it on the server's loop: the Build's end has run
        r.b.stub.GetPlan(pb.GetPlanRequest(tenant_id=tenant, session_id=session), timeout=30)
    finally:
        del engine.forgotten_since
    assert {k for k in engine.render_memo if k[0] == key} >= before
    assert _held_of(r.b.server, tenant, session, "a question of the live session") > 0
    planned_again(r, tenant, session)
    r.b.stub.Build(build_request(tenant, session, items=_said("a new question", "n1")),
                   timeout=30)
    assert _held_of(r.b.server, tenant, session, "a question of the live session") == 0


@pytest.mark.parametrize("learnt", ["by its DeleteSession", "by a read NOT_FOUND"])
def test_a_build_that_never_read_its_plan_keeps_nothing_of_a_session_known_erased(replicas,
                                                                                 learnt):
    """B knows the session erased (erased through B, or a read on B found it gone), and a
    caller that does not know yet sends B its conversation while B cannot reach the database:
    that Build never reads its plan, knows no live incarnation of the session, and keeps
    nothing it rendered."""
    r = replicas
    engine = r.b.server.running.engine
    tenant, session = new_ids()
    r.a.stub.Plan(plan_request(tenant, session), timeout=30)
    said = _said("the erased conversation")
    r.b.stub.Build(build_request(tenant, session, items=said), timeout=30)
    assert engine.latest_incarnation(tenant, session) is not None
    if learnt == "by its DeleteSession":
        delete(r.b.stub, tenant, session)
    else:
        delete(r.a.stub, tenant, session)
        with pytest.raises(grpc.RpcError) as gone:
            r.b.stub.Build(build_request(tenant, session), timeout=30)
        assert gone.value.code() is grpc.StatusCode.NOT_FOUND
    assert _held_of(r.b.server, tenant, session, "the erased conversation") == 0
    assert engine.latest_incarnation(tenant, session) is None
    store = engine._store
    current = store.current

    async def away(tenant_id: str, session_id: str) -> Any:
        if tenant_id == tenant:
            raise StoreUnavailable("database unavailable: OSError")
        return await current(tenant_id, session_id)

    store.current = away
    try:
        with pytest.raises(grpc.RpcError) as err:
            r.b.stub.Build(build_request(tenant, session, items=said), timeout=30)
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE
    finally:
        del store.current
    assert _held_of(r.b.server, tenant, session, "the erased conversation") == 0


@pytest.mark.parametrize("reader", ["Build", "GetPlan"])
def test_a_read_naming_an_epoch_that_finds_the_session_gone_forgets_it(replicas, reader):
    """B holds a Build's renderings and base of the session, its plan no longer cached; A
    erases the session. A Build or a GetPlan on B naming the epoch is NOT_FOUND, and B
    forgets what it kept (and the conversation that Build was sent), as a read naming no
    epoch would."""
    r = replicas
    engine = r.b.server.running.engine
    tenant, session = new_ids()
    r.a.stub.Plan(plan_request(tenant, session), timeout=30)
    kept = build_request(tenant, session, items=_said("the erased secret is 4711"))
    kept.keep_base = True
    built = r.b.stub.Build(kept, timeout=30)
    engine.cache.forget(tenant, session)  # its plan evicted from B's cache (LRU)
    delete(r.a.stub, tenant, session)
    with pytest.raises(grpc.RpcError) as err:
        if reader == "Build":
            r.b.stub.Build(build_request(tenant, session, epoch=1,
                                         items=_said("sent after the erasure 9999")),
                           timeout=30)
        else:
            r.b.stub.GetPlan(pb.GetPlanRequest(tenant_id=tenant, session_id=session, epoch=1),
                             timeout=30)
    assert err.value.code() is grpc.StatusCode.NOT_FOUND
    assert (_held_of(r.b.server, tenant, session, "4711"),
            _held_of(r.b.server, tenant, session, "9999"),
            engine.builds.peek(tenant, session, built.build_id),
            engine.latest_incarnation(tenant, session)) == (0, 0, None, None)


@pytest.mark.parametrize("erased", ["through B", "through A, found by a read on B"])
@pytest.mark.parametrize("reader", ["GetPlan", "Build"])
def test_a_read_answered_after_the_replica_erased_the_session_keeps_nothing_of_it(
        replicas, reader, erased):
    """A read on B of the session's plan is answered by the database before B erases the
    session (or finds it erased), and resumes after: it is answered, but B caches nothing of
    it and knows no incarnation of the session, so B serves the erased plan to no Build
    naming its epoch, and a Build that then never reads its plan (the database away) keeps
    nothing. (A Build reading late may also find the session gone further on: NOT_FOUND.)"""
    r = replicas
    engine = r.b.server.running.engine
    tenant, session = new_ids()
    r.a.stub.Plan(plan_request(tenant, session), timeout=30)
    with plan_read_held(engine, tenant) as (entered, release):
        read = (r.b.stub.GetPlan.future(pb.GetPlanRequest(tenant_id=tenant,
                                                          session_id=session), timeout=30)
                if reader == "GetPlan" else
                r.b.stub.Build.future(build_request(tenant, session,
                                                    items=_said("the first 1111")), timeout=30))
        assert entered.wait(30)
        if erased == "through B":
            delete(r.b.stub, tenant, session)
        else:
            delete(r.a.stub, tenant, session)
            with pytest.raises(grpc.RpcError) as gone:
                r.b.stub.GetPlan(pb.GetPlanRequest(tenant_id=tenant, session_id=session),
                                 timeout=30)
            assert gone.value.code() is grpc.StatusCode.NOT_FOUND
        release.set()
        try:
            read.result(30)  # answered on what it read, or NOT_FOUND further on (a Build)
        except grpc.RpcError as gone:
            assert reader == "Build" and gone.code() is grpc.StatusCode.NOT_FOUND
    assert engine.cache.incarnation(tenant, session) is None
    assert engine.latest_incarnation(tenant, session) is None
    assert _held_of(r.b.server, tenant, session, "1111") == 0
    with pytest.raises(grpc.RpcError) as err:
        r.b.stub.Build(build_request(tenant, session, epoch=1,
                                     items=_said("sent after the erasure 5555")), timeout=30)
    assert err.value.code() is grpc.StatusCode.NOT_FOUND
    with current_held(engine, tenant) as (_, release):
        release.set()
        with pytest.raises(grpc.RpcError) as err:
            r.b.stub.Build(build_request(tenant, session,
                                         items=_said("sent after the erasure 7777")),
                           timeout=30)
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE
    assert _held_of(r.b.server, tenant, session, "5555") == 0
    assert _held_of(r.b.server, tenant, session, "7777") == 0


def test_the_runs_bound_to_a_snapshot_go_when_a_read_finds_the_session_erased(replicas):
    """B remembers a run bound to the session's memory snapshot; A erases the session, and a
    GetPlan on B finds it gone: B forgets the run with the rest."""
    r = replicas
    engine = r.b.server.running.engine
    tenant, session = new_ids()
    r.a.stub.Plan(plan_request(tenant, session,
                               memory_snapshot=snapshot_of("trace-x", "likes tea")), timeout=30)
    r.b.stub.Build(build_request(tenant, session), timeout=30)

    def runs() -> list[Any]:
        return [k for k in engine._snapshot_runs if k[:2] == (tenant, session)]

    assert runs()
    delete(r.a.stub, tenant, session)
    with pytest.raises(grpc.RpcError) as err:
        r.b.stub.GetPlan(pb.GetPlanRequest(tenant_id=tenant, session_id=session), timeout=30)
    assert err.value.code() is grpc.StatusCode.NOT_FOUND
    assert runs() == []


def test_an_event_buffered_before_the_erasure_is_not_written_into_the_session_planned_again(
        replicas, db, monkeypatch):
    """Replica A cannot reach the database for its events (an outage, a partition) while a
    Build of the session yields: its pressure event waits in A's in-process queue. The session
    is erased and planned again through B meanwhile. When A's queue is flushed, the erased
    session's event (its item ids) must not land in the new session's log."""
    r = replicas
    tenant, session = new_ids()
    r.a.stub.Plan(plan_request(tenant, session, model=SMALL), timeout=30)
    erased_items = long_history(12, size=600)
    for i in erased_items:  # ids only the erased conversation has
        i.id = f"erased-{i.id}"
    events = r.a.server.running.events
    inner = events._inner

    async def away(event: Any, *args: Any, **kwargs: Any) -> Any:
        raise StoreUnavailable("the database is away")
    monkeypatch.setattr(inner, "append", away)
    built = r.a.stub.Build(build_request(tenant, session, items=erased_items, epoch=1),
                           timeout=30)
    assert built.pressure.steps and events.pending == 1  # its pressure event waits

    assert delete(r.b.stub, tenant, session).deleted
    assert r.b.stub.Plan(plan_request(tenant, session, model=SMALL), timeout=30).created
    monkeypatch.undo()  # the database is back for A
    discarded = events.discarded
    r.a.server.call(events.flush())
    assert events.pending == 0 and events.discarded == discarded + 1
    payloads = [json.loads(row[0]) for row in db.fetch(
        "SELECT payload::text FROM context_events WHERE tenant_id = $1 AND session_id = $2",
        tenant, session)]
    assert [p for p in payloads if "erased-" in json.dumps(p)] == [], payloads
    assert session_rows(db, tenant, session)["context_events"] == 1  # the new plan's event


def test_a_build_served_the_erased_plan_after_a_replan_records_no_event_in_the_new_session(
        replicas, db):
    """B cached the erased session's plan; within the TTL a Build naming its epoch is served
    it, and its pressure event (the erased plan's) is dropped, not stored in the new
    session's log."""
    r = replicas
    tenant, session = new_ids()
    r.a.stub.Plan(plan_request(tenant, session, model=SMALL), timeout=30)
    assert r.b.stub.Build(build_request(tenant, session, epoch=1), timeout=30).epoch == 1
    assert delete(r.a.stub, tenant, session).deleted
    assert r.a.stub.Plan(plan_request(tenant, session, model=SMALL), timeout=30).created
    events = r.b.server.running.events
    discarded = events.discarded
    stale = long_history(12, size=600)
    for i in stale:
        i.id = f"stale-{i.id}"
    assert r.b.stub.Build(build_request(tenant, session, items=stale, epoch=1),
                          timeout=30).pressure.steps
    assert events.discarded == discarded + 1 and events.pending == 0
    assert db.val("SELECT count(*) FROM context_events WHERE tenant_id = $1 AND session_id = $2"
                  " AND payload::text LIKE '%stale-%'", tenant, session) == 0


def test_a_compaction_whose_session_is_erased_and_planned_again_meanwhile_is_not_stored_in_it(
        replicas, db, monkeypatch):
    """A Compact reads its session's plan, then summarizes (a model call may take seconds);
    meanwhile the session is erased and planned again through B. The erased conversation's
    summary is not stored as the new session's compaction: the Compact is NOT_FOUND, as a
    keyed write the erasure overtakes is, and the same key then compacts for the new one."""
    r = replicas
    tenant, session = new_ids()
    r.a.stub.Plan(plan_request(tenant, session), timeout=30)
    engine = r.a.server.running.engine
    real_save = engine._compactions.save

    async def save_after_the_erasure(*args: Any, **kwargs: Any) -> Any:
        def erase_and_plan_again() -> None:
            assert delete(r.b.stub, tenant, session).deleted
            assert r.b.stub.Plan(plan_request(tenant, session), timeout=30).created
        await asyncio.to_thread(erase_and_plan_again)
        return await real_save(*args, **kwargs)
    monkeypatch.setattr(engine._compactions, "save", save_after_the_erasure)
    assert not_found(r.a.stub.Compact, compact_request(
        tenant, session, f"compact-{session}", constraints=("erased constraint",)))
    rows = db.fetch("SELECT result::text FROM compactions WHERE tenant_id = $1 "
                    "AND session_id = $2", tenant, session)
    assert rows == [], rows
    assert db.val("SELECT count(*) FROM context_events WHERE tenant_id = $1 AND session_id = $2"
                  " AND type = 'context.compacted'", tenant, session) == 0
    monkeypatch.undo()
    again = r.a.stub.Compact(compact_request(tenant, session, f"compact-{session}"), timeout=30)
    assert again.compacted and session_rows(db, tenant, session)["compactions"] == 1



@contextmanager
def _set_aside(direct_database_url: str, target: int, put: Callable[[str], Awaitable[None]],
               table: str) -> Iterator[tuple[str, ServerThread, Db, Callable[[str, str], int]]]:
    """A new database migrated to ``target``, with ``put``'s rows, served by a server that
    migrates the rest (setting rows aside in ``table``): its URL, the server, a connection,
    and the count of ``table``'s rows of a (tenant, session). Dropped after."""
    name = asyncio.run(create_database(direct_database_url, "ce_orphans"))
    url = with_database(direct_database_url, name)
    server = None
    try:
        asyncio.run(migrate(url, REPO / "migrations", target=target))
        asyncio.run(put(url))
        server = ServerThread(base_config(), url)
        db = Db(url)

        def aside(tenant: str, session: str) -> int:
            return int(db.val(f"SELECT count(*) FROM {table} "
                              "WHERE tenant_id = $1 AND session_id = $2", tenant, session))

        yield url, server, db, aside
    finally:
        if server is not None:
            server.stop()
        asyncio.run(drop_database(direct_database_url, name))

def test_delete_session_erases_its_events_that_migration_0006_set_aside(direct_database_url):
    """A database migrated from before 0006 with events of sessions that had no row: 0006 kept
    them aside in ``context_events_orphaned``. DeleteSession of such a session id erases them
    (counted among its events, in its audit row), whether the session has a row again (planned
    since) or none; those of another session, or of the same id in another tenant, stay. Once
    the table is dropped (what 0006 tells the operator to do when done), erasure still works.
    A tenant purge takes the tenant's set-aside events, and only its."""
    async def set_aside(url: str) -> None:
        conn = await asyncpg.connect(url)
        try:
            await conn.execute("INSERT INTO sessions (tenant_id, session_id) VALUES ('t', 'live')")
            rows = [(t, s, json.dumps({"secret": f"{t}/{s}/{n}"}))
                    for t, s, n in (("t", "gone", 0), ("t", "gone", 1), ("t", "gone", 2),
                                    ("t", "again", 0), ("t", "again", 1), ("t", "other", 0),
                                    ("u", "gone", 0), ("t", "live", 0))]
            await conn.executemany(
                "INSERT INTO context_events (tenant_id, session_id, epoch, type, payload) "
                "VALUES ($1, $2, 1, 'context.plan.created', $3::jsonb)", rows)
        finally:
            await conn.close()

    with _set_aside(direct_database_url, 5, set_aside, "context_events_orphaned") as (
            url, server, db, aside):  # the server migrated the rest (0006 sets 7 rows aside)
        assert (aside("t", "gone"), aside("t", "again"), aside("t", "other"),
                aside("u", "gone"), aside("t", "live")) == (3, 2, 1, 1, 0)
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.ContextEngineStub(channel)
            # a session id with no row: only its set-aside events are left, and they go
            gone = delete(stub, "t", "gone")
            assert gone.deleted and (gone.events, gone.plans) == (3, 0)
            assert aside("t", "gone") == 0
            (audit,) = db.fetch("SELECT sessions, events FROM erasures "
                                "WHERE session_sha256 = $1", session_sha256("gone"))
            assert tuple(audit) == (0, 3)
            # a session id planned again since: its own events and the set-aside ones go
            stub.Plan(plan_request("t", "again"), timeout=30)
            live = int(db.val("SELECT count(*) FROM context_events WHERE tenant_id = 't' "
                              "AND session_id = 'again'"))
            again = delete(stub, "t", "again")
            assert again.deleted and again.events == live + 2
            assert aside("t", "again") == 0
            # the others' stay
            assert (aside("t", "other"), aside("u", "gone")) == (1, 1)
            assert not delete(stub, "t", "gone").deleted  # nothing left: idempotent
            # a tenant purge takes the tenant's set-aside events, and only its
            done = purge(url, "--tenant-id", "t", "--yes", "--json")
            assert done.returncode == 0, done.stderr
            assert json.loads(done.stdout)["events"] == 2  # live's own, other's set aside
            assert (aside("t", "other"), aside("u", "gone")) == (0, 1)
            # the operator drops the table: erasure goes on without it
            db.fetch("DROP TABLE context_events_orphaned")
            stub.Plan(plan_request("t", "after"), timeout=30)
            after = delete(stub, "t", "after")
            assert after.deleted and after.plans == 1
            assert not delete(stub, "u", "gone").deleted


def test_delete_session_erases_its_compactions_that_migration_0007_set_aside(
        direct_database_url):
    """A database whose operator erased sessions by hand before DeleteSession existed keeps
    their compaction records (summaries of the conversation): migration 0007 sets them aside
    in ``compactions_orphaned`` (``migrations/before/0007_erasure.sql``). DeleteSession of such
    a session id erases them (counted among its compactions, in its audit row), whether the id
    has a row again or none; another session's, or the same id's in another tenant, stay. A
    tenant purge takes the tenant's, and only its; once the table is dropped, erasure still
    works."""
    async def erased_by_hand(url: str) -> None:
        conn = await asyncpg.connect(url)
        try:
            await conn.execute("INSERT INTO sessions (tenant_id, session_id) VALUES ('t', 'live')")
            for n, (t, s) in enumerate((("t", "gone"), ("t", "gone"), ("t", "again"),
                                        ("t", "other"), ("u", "gone"), ("t", "live"))):
                await conn.execute(
                    "INSERT INTO compactions (tenant_id, idempotency_key, session_id, "
                    "fingerprint, depth, replaced_through_sequence, compactor_version, result) "
                    "VALUES ($1, $2, $3, 'fp', 1, 0, 'v1', $4::jsonb)",
                    t, f"k{n}", s, json.dumps({"summary": f"secret {t}/{s}/{n}"}))
        finally:
            await conn.close()

    with _set_aside(direct_database_url, 6, erased_by_hand, "compactions_orphaned") as (
            url, server, db, aside):  # the server migrated 0007 (5 records set aside)
        assert (aside("t", "gone"), aside("t", "again"), aside("t", "other"),
                aside("u", "gone"), aside("t", "live")) == (2, 1, 1, 1, 0)
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.ContextEngineStub(channel)
            gone = delete(stub, "t", "gone")  # no row: only its set-aside records are left
            assert gone.deleted and (gone.compactions, gone.plans) == (2, 0)
            assert aside("t", "gone") == 0
            (audit,) = db.fetch("SELECT sessions, compactions FROM erasures "
                                "WHERE session_sha256 = $1", session_sha256("gone"))
            assert tuple(audit) == (0, 2)
            stub.Plan(plan_request("t", "again"), timeout=30)  # planned again since
            again = delete(stub, "t", "again")
            assert again.deleted and again.compactions == 1 and aside("t", "again") == 0
            assert (aside("t", "other"), aside("u", "gone")) == (1, 1)
            assert not delete(stub, "t", "gone").deleted  # nothing left: idempotent
            done = purge(url, "--tenant-id", "t", "--yes", "--json")
            assert done.returncode == 0, done.stderr
            assert json.loads(done.stdout)["compactions"] == 2  # live's own, other's set aside
            assert (aside("t", "other"), aside("u", "gone")) == (0, 1)
            db.fetch("DROP TABLE compactions_orphaned")  # the operator, when done
            stub.Plan(plan_request("t", "after"), timeout=30)
            after = delete(stub, "t", "after")
            assert after.deleted and after.plans == 1
            assert not delete(stub, "u", "gone").deleted


def test_without_set_aside_events_erasure_asks_for_their_table_once(direct_database_url):
    """On a database with no ``context_events_orphaned`` (0006 set nothing aside, or the
    operator dropped it), an erasure store asks whether it exists once, and then no more."""
    async def scenario() -> list[str]:
        statements: list[str] = []

        async def logged(conn: asyncpg.Connection) -> None:
            # the statement and its arguments (the store names the table as an argument)
            conn.add_query_logger(
                lambda record: statements.append(f"{record.query} {record.args!r}"))

        pool = await asyncpg.create_pool(direct_database_url, min_size=1, max_size=1,
                                         init=logged)
        try:
            assert not await pool.fetchval("SELECT to_regclass('context_events_orphaned') "
                                           "IS NOT NULL")
            erasure = PostgresErasure(pool)
            for n in range(3):
                await pool.execute("INSERT INTO sessions (tenant_id, session_id) "
                                   "VALUES ($1, $2)", tenant, f"s{n}")
                erased = await erasure.erase_session(tenant, f"s{n}", requested_by="test",
                                                     at=SYSTEM_CLOCK.now())
                assert erased.sessions == 1
        finally:
            await pool.close()
        return statements

    tenant, _ = new_ids()
    statements = asyncio.run(scenario())
    assert sum("DELETE FROM sessions" in s for s in statements) == 3  # every statement seen
    asked = [s for s in statements if "context_events_orphaned" in s]
    assert len(asked) == 2, asked  # the test's own question, and the store's first
    assert all("to_regclass" in s for s in asked), asked


@pytest.mark.parametrize("writer", ["Plan", "Rotate"])
def test_an_epoch_written_as_its_replica_erases_the_session_is_cached_nowhere(
        replicas, monkeypatch, writer):
    """B writes a new epoch (a Plan routing the session to another model, a Rotate), and its
    own DeleteSession of the session commits between that write and the epoch's caching: the
    epoch written is of the erased session, and B caches nothing of it, so no Build naming
    it is served the erased plan (B served it for the plan-cache TTL). The call itself then
    reads its epoch back and finds the session gone: the Plan opens it anew (epoch 1), the
    Rotate is NOT_FOUND."""
    r = replicas
    tenant, session = new_ids()
    r.a.stub.Plan(plan_request(tenant, session), timeout=30)
    engine = r.b.server.running.engine
    pin = engine._store.pin
    erased: list[Any] = []

    async def erased_after_the_pin(*args: Any, **kwargs: Any) -> Any:
        pinned = await pin(*args, **kwargs)
        if not erased:
            erased.append(await engine.delete_session(tenant, session, requested_by="test"))
        return pinned

    monkeypatch.setattr(engine._store, "pin", erased_after_the_pin)
    if writer == "Plan":
        answer = r.b.stub.Plan(plan_request(tenant, session, model=pb.ModelSpec(
            model_id="gpt-4o")), timeout=30).plan
        assert (answer.epoch, answer.reason) == (1, "session_opened")
    else:
        with pytest.raises(grpc.RpcError) as gone:
            r.b.stub.Rotate(pb.RotateRequest(
                tenant_id=tenant, session_id=session, reason=pb.ROTATION_REASON_OPERATOR,
                idempotency_key=str(uuid.uuid4())), timeout=30)
        assert gone.value.code() is grpc.StatusCode.NOT_FOUND
    assert erased and (erased[0].sessions, erased[0].plans) == (1, 2)
    for stub in (r.b.stub, r.a.stub):
        with pytest.raises(grpc.RpcError) as err:
            stub.Build(build_request(tenant, session, epoch=2), timeout=30)
        assert err.value.code() is grpc.StatusCode.NOT_FOUND
