"""Limits and backpressure on a real server: items per request, bytes per item, concurrent
RPCs per process, the whole-message cap, and client deadlines stopping server-side work."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
from context_engine.api.server import server_options
from context_engine.v1 import context_engine_pb2 as pb
from context_engine.v1 import context_engine_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.conftest import ServerThread
from tests.conftest import test_config as base_config
from tests.integration.requests import build_request, failure, item, plan_request
from tests.integration.test_compact_rpc import compact_request
from tests.support.fake_llm import FakeProvider


@pytest.fixture(scope="module")
def slow() -> Iterator[FakeProvider]:
    """A summarizer that answers after 1.5 s: long enough to hold an RPC slot."""
    provider = FakeProvider(delay=1.5)
    yield provider
    provider.stop()


@pytest.fixture(scope="module")
def limited(database_url: str, slow: FakeProvider) -> Iterator[ServerThread]:
    config = base_config().replace(max_concurrent_rpcs=1, max_items_per_request=50,
                     max_item_bytes=4096, max_receive_bytes=256 * 1024,
                     max_send_bytes=64 * 1024,
                     summarizer_url=slow.url, summarizer_model="fake",
                     summarizer_timeout_seconds=10.0)
    srv = ServerThread(config, database_url)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def limited_stub(limited: ServerThread) -> Iterator[pb_grpc.ContextEngineStub]:
    channel = grpc.insecure_channel(limited.address, options=[
        ("grpc.max_send_message_length", 8 * 1024 * 1024)])
    yield pb_grpc.ContextEngineStub(channel)
    channel.close()


def many_items(n: int, size: int = 10) -> list[pb.ConversationItem]:
    return [item(f"u{i}", i + 1, user=pb.UserMessage(text="x" * size)) for i in range(n)]


def test_too_many_items_is_resource_exhausted_and_writes_nothing(limited_stub, ids, db):
    tenant, session = ids
    limited_stub.Plan(plan_request(tenant, session))
    before = db.counts(tenant)
    with pytest.raises(grpc.RpcError) as info:
        limited_stub.Build(build_request(tenant, session, items=many_items(51)))
    f = failure(info.value)
    assert f.code is grpc.StatusCode.RESOURCE_EXHAUSTED and f.reason == "TOO_MANY_ITEMS"
    assert f.metadata == {"field": "checkpoint.items", "size": "51", "limit": "50"}
    assert f.domain == "context-engine"
    assert db.counts(tenant) == before
    # at the limit it is served
    assert limited_stub.Build(build_request(tenant, session, items=many_items(50))).request


def test_a_repeated_field_inside_an_element_is_held_to_the_item_limit(limited_stub, ids, db):
    """The limit held only for repeated fields reached through singular messages: 100,001
    calls in one checkpoint item were taken, and a Plan with a tool of 1,000,000 required
    scopes stored a 20 MB plans row."""
    tenant, session = ids
    limited_stub.Plan(plan_request(tenant, session))
    before = db.counts(tenant)
    items = many_items(3)
    items[2] = item("c1", 3, tool_calls=pb.ToolCalls(calls=[
        pb.ToolCall(call_id=f"k{i}", name="web.fetch", arguments_json="{}")
        for i in range(51)]))
    with pytest.raises(grpc.RpcError) as info:
        limited_stub.Build(build_request(tenant, session, items=items))
    f = failure(info.value)
    assert f.code is grpc.StatusCode.RESOURCE_EXHAUSTED and f.reason == "TOO_MANY_ITEMS"
    assert f.metadata == {"field": "checkpoint.items[2].tool_calls.calls", "size": "51",
                          "limit": "50"}
    plan = plan_request(tenant, "scopes")
    del plan.tool_catalog[0].required_scopes[:]
    plan.tool_catalog[0].required_scopes.extend(f"s{i}" for i in range(51))
    with pytest.raises(grpc.RpcError) as info:
        limited_stub.Plan(plan)
    f = failure(info.value)
    assert f.code is grpc.StatusCode.RESOURCE_EXHAUSTED and f.reason == "TOO_MANY_ITEMS"
    assert f.metadata == {"field": "tool_catalog[0].required_scopes", "size": "51",
                          "limit": "50"}
    assert db.counts(tenant) == before
    # at the limit the request is not refused for its size
    del plan.tool_catalog[0].required_scopes[50:]
    assert limited_stub.Plan(plan).created


def test_a_response_over_the_send_limit_is_resource_exhausted_with_its_size(limited_stub, ids):
    """A Build whose response (the request, and a provider body repeating it) is over
    CE_MAX_SEND_BYTES is answered RESPONSE_TOO_LARGE with its size and the limit, not gRPC's bare
    RESOURCE_EXHAUSTED; the same checkpoint without a provider body fits and is served."""
    tenant, session = ids
    limited_stub.Plan(plan_request(tenant, session))
    items = many_items(12, size=4000)  # about 48 KB of text: twice that with a body
    with pytest.raises(grpc.RpcError) as info:
        limited_stub.Build(build_request(tenant, session, items=items))
    f = failure(info.value)
    assert f.code is grpc.StatusCode.RESOURCE_EXHAUSTED and f.reason == "RESPONSE_TOO_LARGE"
    assert f.metadata["limit"] == str(64 * 1024) and int(f.metadata["size"]) > 64 * 1024
    assert "CE_MAX_SEND_BYTES" in f.message and "PROVIDER_FORMAT_NONE" in f.message
    req = build_request(tenant, session, items=items)
    req.provider_format = pb.PROVIDER_FORMAT_NONE
    lean = limited_stub.Build(req)
    assert 48_000 < lean.ByteSize() <= 64 * 1024 and not lean.provider_body_json


def test_a_response_over_the_send_limit_keeps_no_base(limited_stub, ids, caplog):
    """A Build asking to keep its base whose response is refused RESPONSE_TOO_LARGE keeps nothing:
    its build_id never reached the caller, so a kept base would only evict (the session keeps 4)
    the base the caller's next Build names. Its log line still says what it built."""
    caplog.set_level(logging.INFO, logger="context_engine")
    tenant, session = ids
    limited_stub.Plan(plan_request(tenant, session))
    small = many_items(3)
    first = build_request(tenant, session, items=small)
    first.keep_base = True
    base_id = limited_stub.Build(first).build_id
    assert base_id
    for n in range(5):
        big = build_request(tenant, session, items=many_items(12 + n, size=4000))
        big.keep_base = True
        with pytest.raises(grpc.RpcError) as info:
            limited_stub.Build(big)
        assert failure(info.value).reason == "RESPONSE_TOO_LARGE"
    # one naming the base, refused alike: its line names the base's items it kept
    big = build_request(tenant, session, items=many_items(12, size=4000)[len(small):])
    big.base_build_id, big.base_items_kept = base_id, len(small)
    with pytest.raises(grpc.RpcError) as info:
        limited_stub.Build(big)
    assert failure(info.value).reason == "RESPONSE_TOO_LARGE"
    lines = [getattr(r, "fields", {}) for r in caplog.records if r.getMessage() == "rpc"]
    refused = [f for f in lines if f.get("reason") == "RESPONSE_TOO_LARGE"]
    assert len(refused) == 6 and all(f.get("provider_format") and f.get("estimated_input_tokens")
                                     for f in refused), refused
    assert refused[-1].get("base_items_kept") == len(small) and refused[-1].get("messages_sent")
    again = build_request(tenant, session, items=[])
    again.base_build_id, again.base_items_kept = base_id, len(small)
    assert limited_stub.Build(again).build_id  # served from the base: it was not evicted


def test_an_item_over_the_byte_limit_is_resource_exhausted(limited_stub, ids, db):
    tenant, session = ids
    limited_stub.Plan(plan_request(tenant, session))
    before = db.counts(tenant)
    items = many_items(3)
    items[1] = item("big", 2, user=pb.UserMessage(text="y" * 5000))
    with pytest.raises(grpc.RpcError) as info:
        limited_stub.Build(build_request(tenant, session, items=items))
    f = failure(info.value)
    assert f.code is grpc.StatusCode.RESOURCE_EXHAUSTED and f.reason == "ITEM_TOO_LARGE"
    assert f.metadata["field"] == "checkpoint.items[1]" and f.metadata["limit"] == "4096"
    assert int(f.metadata["size"]) > 5000
    assert db.counts(tenant) == before


def test_a_message_over_the_receive_limit_is_resource_exhausted(limited_stub, ids, db):
    tenant, session = ids
    limited_stub.Plan(plan_request(tenant, session))
    before = db.counts(tenant)
    request = build_request(tenant, session, items=many_items(40, size=4000) * 2)
    assert 256 * 1024 < request.ByteSize() < 512 * 1024
    with pytest.raises(grpc.RpcError) as info:
        limited_stub.Build(request)
    f = failure(info.value)
    assert f.code is grpc.StatusCode.RESOURCE_EXHAUSTED and f.reason == "REQUEST_TOO_LARGE"
    assert f.metadata == {"size": str(request.ByteSize()), "limit": str(256 * 1024)}
    assert db.counts(tenant) == before
    # beyond twice the limit gRPC itself refuses it, before any handler runs
    huge = build_request(tenant, session, items=many_items(150, size=4000))
    assert huge.ByteSize() > 512 * 1024
    with pytest.raises(grpc.RpcError) as info:
        limited_stub.Build(huge)
    assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert db.counts(tenant) == before


def test_a_request_of_exactly_the_receive_limit_is_parsed(limited_stub, ids):
    """CE_MAX_RECEIVE_BYTES (256 KiB here) holds at its edge: a request of exactly that many
    bytes is parsed and judged on its fields (a session id far over its length: INVALID_ARGUMENT),
    one byte more is REQUEST_TOO_LARGE before it is parsed."""
    tenant, _ = ids
    # tenant_id: tag, a one-byte length, the id; session_id: tag, a three-byte length, the id
    room = 256 * 1024 - (1 + 1 + len(tenant)) - (1 + 3)
    exact = pb.GetPlanRequest(tenant_id=tenant, session_id="s" * room)
    assert exact.ByteSize() == 262_144
    with pytest.raises(grpc.RpcError) as info:
        limited_stub.GetPlan(exact)
    f = failure(info.value)
    assert f.code is grpc.StatusCode.INVALID_ARGUMENT and "session_id" in f.violations
    over = pb.GetPlanRequest(tenant_id=tenant, session_id="s" * (room + 1))
    with pytest.raises(grpc.RpcError) as info:
        limited_stub.GetPlan(over)
    f = failure(info.value)
    assert f.code is grpc.StatusCode.RESOURCE_EXHAUSTED and f.reason == "REQUEST_TOO_LARGE"
    assert f.metadata == {"size": "262145", "limit": "262144"}


def test_excess_concurrency_is_refused_quickly_not_queued(limited, limited_stub, ids, db,
                                                          slow):
    tenant, session = ids
    limited_stub.Plan(plan_request(tenant, session))
    slow.started.clear()
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(limited_stub.Compact, compact_request(tenant, session, "slow-1"))
        assert slow.started.wait(10), "the summarizer was never called"
        started = time.perf_counter()
        with pytest.raises(grpc.RpcError) as info:
            limited_stub.GetPlan(pb.GetPlanRequest(tenant_id=tenant, session_id=session))
        refused_after = time.perf_counter() - started
        f = failure(info.value)
        assert f.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f.reason == "TOO_MANY_CONCURRENT_RPCS" and f.metadata == {"limit": "1"}
        assert refused_after < 0.5, refused_after
        # health is never limited: probes get through a saturated server
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(limited.address))
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=2).status == \
            health_pb2.HealthCheckResponse.SERVING
        assert first.result(timeout=20).compacted
    # the slot is free again
    assert limited_stub.GetPlan(pb.GetPlanRequest(tenant_id=tenant, session_id=session)).plan


def test_a_client_deadline_stops_the_work_and_writes_nothing(limited_stub, ids, db, slow):
    tenant, session = ids
    limited_stub.Plan(plan_request(tenant, session))
    slow.started.clear()
    calls = slow.calls
    with pytest.raises(grpc.RpcError) as info:
        limited_stub.Compact(compact_request(tenant, session, "deadline"), timeout=0.5)
    assert info.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert slow.started.wait(5)
    time.sleep(slow.delay + 0.5)  # the summarizer has answered by now
    assert slow.calls == calls + 1
    assert db.val("SELECT count(*) FROM compactions WHERE tenant_id=$1", tenant) == 0
    assert db.val("SELECT count(*) FROM context_events WHERE tenant_id=$1 AND "
                  "type='context.compacted'", tenant) == 0
    # the process slot was released when the call was cancelled
    assert limited_stub.GetPlan(pb.GetPlanRequest(tenant_id=tenant, session_id=session)).plan


def test_keepalive_and_connection_age_follow_the_configuration():
    options = dict(server_options(base_config().replace(keepalive_time_seconds=30,
                                          keepalive_timeout_seconds=5,
                                          max_connection_age_seconds=600,
                                          grace_seconds=2.0)))
    assert options["grpc.keepalive_time_ms"] == 30_000
    assert options["grpc.keepalive_timeout_ms"] == 5_000
    assert options["grpc.max_connection_age_ms"] == 600_000
    assert options["grpc.max_connection_age_grace_ms"] == 7_000
    assert options["grpc.http2.min_ping_interval_without_data_ms"] == 10_000
    assert options["grpc.keepalive_permit_without_calls"] == 1


# -- a write whose response is refused RESPONSE_TOO_LARGE writes nothing ------------------------

TIGHT = 1024  # the least CE_MAX_SEND_BYTES allows


@pytest.fixture(scope="module")
def tight(database_url: str) -> Iterator[ServerThread]:
    srv = ServerThread(base_config().replace(max_send_bytes=TIGHT), database_url)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def tight_stub(tight: ServerThread) -> Iterator[pb_grpc.ContextEngineStub]:
    channel = grpc.insecure_channel(tight.address)
    yield pb_grpc.ContextEngineStub(channel)
    channel.close()


def written(db, tenant: str) -> dict[str, object]:
    """Everything a write of the tenant leaves in the database, read with SQL."""
    rows = {t: db.fetch(f"SELECT * FROM {t} WHERE tenant_id = $1 ORDER BY 1, 2, 3", tenant)
            for t in ("sessions", "plans", "context_events", "compactions", "idempotency_keys",
                      "estimator_calibration", "epoch_usage")}
    return {t: [dict(r) for r in found] for t, found in rows.items()}


WRITE_COUNTERS = ("context_engine_epochs", "context_engine_sessions_opened",
                  "context_engine_compactions", "context_engine_estimator_error_ratio",
                  "context_engine_elided_spans")


def write_counts(server: ServerThread) -> dict[str, float]:
    """The counters and histograms that count writes, summed over their labels."""
    from tests.integration.test_metrics_scrape import scrape
    families = scrape(server)
    return {name: sum(s.value for s in families[name][1]
                      if s.name.endswith(("_total", "_count")))
            for name in WRITE_COUNTERS if name in families}


def too_large(call: Any) -> None:
    with pytest.raises(grpc.RpcError) as info:
        call()
    f = failure(info.value)
    assert f.code is grpc.StatusCode.RESOURCE_EXHAUSTED and f.reason == "RESPONSE_TOO_LARGE", f
    assert f.metadata["limit"] == str(TIGHT) and int(f.metadata["size"]) > TIGHT


def test_a_plan_refused_for_its_response_size_opens_no_session(tight, tight_stub, stub, ids,
                                                               db):
    """DESIGN 2: a failed call changes nothing. A Plan whose response is over the send limit
    stored the session (epoch 1, its event, sessions_opened counted) and answered
    RESPONSE_TOO_LARGE: GetPlan then found it. Now nothing is written, and the same Plan on a
    server with room opens it anew."""
    tenant, session = ids
    before, counted = written(db, tenant), write_counts(tight)
    too_large(lambda: tight_stub.Plan(plan_request(tenant, session)))
    assert written(db, tenant) == before
    assert write_counts(tight) == counted
    assert tight.running.engine.cache.incarnation(tenant, session) is None  # nothing cached
    with pytest.raises(grpc.RpcError) as info:
        tight_stub.GetPlan(pb.GetPlanRequest(tenant_id=tenant, session_id=session))
    assert failure(info.value).reason == "SESSION_NOT_FOUND"
    opened = stub.Plan(plan_request(tenant, session))
    assert opened.created and opened.plan.epoch == 1


def test_a_rotation_refused_for_its_response_size_writes_no_epoch(tight, tight_stub, stub, ids,
                                                                  db):
    """A keyed Rotate refused RESPONSE_TOO_LARGE writes no epoch and keeps no key: its retry
    on a server with room rotates (as new), and a retry of that answers the same epoch."""
    tenant, session = ids
    stub.Plan(plan_request(tenant, session))
    before, counted = written(db, tenant), write_counts(tight)
    rotate = pb.RotateRequest(tenant_id=tenant, session_id=session,
                              reason=pb.ROTATION_REASON_OPERATOR, idempotency_key="rot-big")
    too_large(lambda: tight_stub.Rotate(rotate))
    assert written(db, tenant) == before
    assert write_counts(tight) == counted
    assert tight.running.engine.cache.newest(tenant, session, 2) is None  # nor cached
    rotated = stub.Rotate(rotate)
    assert rotated.rotated and rotated.plan.epoch == 2
    again = stub.Rotate(rotate)
    assert not again.rotated and again.plan.epoch == 2


def test_a_compaction_refused_for_its_response_size_stores_nothing(tight, tight_stub, stub, ids,
                                                                   db):
    from tests.integration.test_compact_rpc import compact_request
    tenant, session = ids
    stub.Plan(plan_request(tenant, session))
    items = [item(f"u{i}", i + 1, run="run-0", user=pb.UserMessage(text=f"question {i}"))
             for i in range(60)] + [item("last", 61, user=pb.UserMessage(text="now"))]
    request = compact_request(tenant, session, "cmp-big", items=items)
    before, counted = written(db, tenant), write_counts(tight)
    too_large(lambda: tight_stub.Compact(request))
    assert written(db, tenant) == before
    assert write_counts(tight) == counted
    done = stub.Compact(request)
    assert done.compacted and len(done.replaced_item_ids) == 60
    assert not stub.Compact(request).compacted  # the key's stored answer


def test_a_usage_report_refused_for_its_response_size_counts_nothing(tight, tight_stub, stub,
                                                                     ids, db):
    """ReportUsage's response names the model: an id of 256 four-byte characters takes it over
    1,024 bytes. Refused, it calibrates nothing and keeps no key."""
    tenant, session = ids
    model = pb.ModelSpec(model_id="\U0001F600" * 256, capabilities=pb.ModelCapabilities(
        context_window=100_000, output_reserve=4_000))
    stub.Plan(plan_request(tenant, session, model=model))
    built = stub.Build(build_request(tenant, session))
    report = pb.ReportUsageRequest(
        tenant_id=tenant, session_id=session,
        estimated_input_tokens=built.estimated_input_tokens,
        estimator_factor=built.estimator_factor, input_tokens=built.estimated_input_tokens + 7,
        output_tokens=10, idempotency_key="use-big")
    before, counted = written(db, tenant), write_counts(tight)
    too_large(lambda: tight_stub.ReportUsage(report))
    assert written(db, tenant) == before
    assert write_counts(tight) == counted
    done = stub.ReportUsage(report)
    assert done.counted and done.reports == 1


def test_a_state_update_refused_for_its_response_size_records_no_event(tight, tight_stub, stub,
                                                                       ids, db):
    tenant, session = ids
    stub.Plan(plan_request(tenant, session))
    update = pb.UpdateWorkingStateRequest(
        tenant_id=tenant, session_id=session, run_id="run-1", sequence=3,
        transition=pb.WorkingStateTransition(user_objective=pb.UserObjective(
            objective="find the cheapest flight " * 50)))
    before, counted = written(db, tenant), write_counts(tight)
    too_large(lambda: tight_stub.UpdateWorkingState(update))
    assert written(db, tenant) == before
    assert write_counts(tight) == counted
    done = stub.UpdateWorkingState(update)
    assert done.state.objective.startswith("find the cheapest")
    assert len(written(db, tenant)["context_events"]) == len(before["context_events"]) + 1


def test_a_refusal_of_the_limits_logs_the_tenant_the_request_names(limited_stub, ids, caplog):
    """Metrics carry no tenant: the log line is where an operator finds who runs into the
    limits, as every other refusal's line names its tenant (it said "")."""
    tenant, session = ids
    caplog.set_level(logging.INFO, logger="context_engine")
    with pytest.raises(grpc.RpcError):
        limited_stub.Build(build_request(tenant, session, items=many_items(51)))
    long = "t" * 300  # not yet validated when refused: cut to an id's longest
    with pytest.raises(grpc.RpcError):
        limited_stub.Build(build_request(long, session, items=many_items(51)))
    lines = [getattr(r, "fields", {}) for r in caplog.records if r.getMessage() == "rpc"]
    refused = [(f["reason"], f["tenant"]) for f in lines if f.get("method") == "Build"]
    assert refused == [("TOO_MANY_ITEMS", tenant), ("TOO_MANY_ITEMS", "t" * 256)], refused
