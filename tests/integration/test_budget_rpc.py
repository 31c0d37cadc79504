"""Budget report, pressure and exceeded events, and ReportUsage through the real server."""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import threading

import grpc
import pytest
from context_engine.v1 import context_engine_pb2 as pb
from context_engine.v1 import context_engine_pb2_grpc as pb_grpc

from tests.integration.requests import build_request, failure, item, plan_request
from tests.support.provider_tokens import count_body

pytestmark = pytest.mark.integration

SMALL = pb.ModelSpec(model_id="acme-16k", capabilities=pb.ModelCapabilities(
    context_window=16_000, output_reserve=4_000))


def long_history(n: int, size: int = 1_500) -> list[pb.ConversationItem]:
    """Carried history of ``n`` fetches from an earlier run, then a new user message."""
    items: list[pb.ConversationItem] = []
    seq = 0
    for i in range(n):
        seq += 1
        items.append(item(f"u{i}", seq, run="run-0", user=pb.UserMessage(text=f"question {i}")))
        seq += 1
        items.append(item(f"c{i}", seq, run="run-0", tool_calls=pb.ToolCalls(calls=[pb.ToolCall(
            call_id=f"k{i}", name="web.fetch", arguments_json='{"url":"https://e.x"}')])))
        seq += 1
        items.append(item(f"r{i}", seq, pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED, run="run-0",
                          tool_result=pb.ToolResult(call_id=f"k{i}", tool_name="web.fetch",
                                                    content=f"page {i} " + "lorem ipsum " * size,
                                                    event_id=1000 + i)))
        seq += 1
        items.append(item(f"a{i}", seq, run="run-0",
                          assistant=pb.AssistantMessage(text=f"answer {i} " + "word " * 300)))
    items.append(item("now", seq + 1, run="run-1", user=pb.UserMessage(text="and now?")))
    return items


def test_build_reports_the_budget(stub, ids):
    tenant, session = ids
    stub.Plan(plan_request(tenant, session))
    resp = stub.Build(build_request(tenant, session))
    b = resp.budget
    assert b.total_tokens == 200_000 and b.output_reserve == 8_192
    assert b.margin_tokens == -(-(200_000 - 8_192) * 5 // 100)  # ceil of 5%
    assert b.body_budget == 200_000 - 8_192 - b.margin_tokens - resp.prefix_tokens
    assert b.estimated_total == resp.estimated_input_tokens == b.prefix_tokens + b.body_tokens
    assert b.estimator_factor == resp.estimator_factor == 1.0
    classes = {c.class_name: c for c in b.classes}
    assert classes["knowledge"].cap == 3_000 and classes["recall"].cap == 2_000
    assert classes["tool_results"].cap == int(b.body_budget * 0.25)
    assert classes["history"].used >= 0 and b.history_floor == 8_000
    assert not resp.pressure.steps and resp.pressure.fits and not resp.pressure.compaction_needed


def test_overflow_yields_in_order_and_records_pressure(stub, ids, db):
    tenant, session = ids
    stub.Plan(plan_request(tenant, session, model=SMALL))
    req = build_request(tenant, session, items=long_history(40))
    req.checkpoint.active_run_id = "run-1"
    req.checkpoint.knowledge.extend([
        pb.KnowledgePassage(id=f"k{i}", source="doc", text="passage " * 200, rank=i,
                            trust=pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED) for i in range(3)])
    resp = stub.Build(req)
    p = resp.pressure
    steps = [s.step for s in p.steps]
    assert steps == [s for s in ("knowledge", "recall", "tool_results", "history") if s in steps]
    assert steps == ["knowledge", "tool_results", "history"] and p.fits
    assert p.history_floor_shortfall == 0  # only history yielded room: its floor held
    assert p.compaction_needed and p.left_out_items > 0 and p.left_out_tokens > 0
    assert resp.estimated_input_tokens <= resp.context_window - resp.output_reserve
    kept = [m for m in resp.request.messages if m.row == 10]
    first_kept = req.checkpoint.items[p.history_cut_index].id
    assert kept[0].item_id == first_kept
    pointers = [m.text for m in resp.request.messages if "[elided] tool.result" in m.text]
    assert pointers and all(t.startswith("<untrusted ") for t in pointers)
    assert "-> event:" in pointers[0] and "external_untrusted" in pointers[0]
    rows = db.fetch("SELECT payload::text FROM context_events WHERE tenant_id=$1 AND "
                    "type='context.budget.pressure'", tenant)
    assert len(rows) == 1
    payload = json.loads(rows[0]["payload"])
    assert [s["step"] for s in payload["steps"]] == steps and payload["fits"] is True
    # the event records the sizes the response answered, field for field
    assert (payload["tokens_before"], payload["tokens_after"], payload["left_out_items"],
            payload["left_out_tokens"], payload["history_cut_index"],
            payload["compaction_needed"]) == (
        p.tokens_before, p.tokens_after, p.left_out_items, p.left_out_tokens,
        p.history_cut_index, p.compaction_needed)
    assert payload["tokens_before"] > payload["tokens_after"]  # it yielded
    assert "lorem" not in rows[0]["payload"]  # ids and sizes, never content


def ids_digest(ids: list[str]) -> str:
    """SHA-256 of ``ids`` as a canonical JSON array, written here with the standard library
    (not the service's canonical module): the oracle of an event's ``item_ids_sha256``."""
    text = json.dumps(ids, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def test_a_pressure_event_stays_small_as_the_session_grows(stub, ids, db):
    """A step naming more than 64 ids is recorded by their count, ends and digest, which
    match the response's ids; one naming fewer lists them. The event of a session four times
    as long is no larger: a long session's history cut no longer writes every id it left out
    on every Build."""
    tenant, _ = ids
    texts = {}
    for turns in (60, 240):
        session = f"long-{turns}"
        stub.Plan(plan_request(tenant, session, model=SMALL))
        req = build_request(tenant, session, items=long_history(turns, size=40))
        req.checkpoint.active_run_id = "run-1"
        req.checkpoint.knowledge.extend([  # over its cap: a step of three ids
            pb.KnowledgePassage(id=f"k{i}", source="doc", text="passage " * 1_500, rank=i,
                                trust=pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED) for i in range(3)])
        resp = stub.Build(req)
        texts[turns] = db.val("SELECT payload::text FROM context_events WHERE tenant_id=$1 "
                              "AND session_id=$2 AND type='context.budget.pressure'",
                              tenant, session)
        recorded = json.loads(texts[turns])["steps"]
        assert [r["step"] for r in recorded] == [s.step for s in resp.pressure.steps]
        lengths = []
        for step, record in zip(resp.pressure.steps, recorded, strict=True):
            names = list(step.item_ids)
            lengths.append(len(names))
            assert record["item_count"] == len(names) and record["units"] == step.units
            if len(names) <= 64:
                assert record["item_ids"] == names and "item_ids_sha256" not in record
            else:
                assert "item_ids" not in record
                assert (record["first_item_id"], record["last_item_id"]) == (names[0],
                                                                             names[-1])
                assert record["item_ids_sha256"] == ids_digest(names)
        assert max(lengths) > 64 and min(lengths) <= 64  # both forms, in one event
    assert len(texts[240]) <= len(texts[60]) + 40  # a few digits more, no ids more


# The escapes of a JSON string in JavaScript's JSON.stringify (RFC 8785's form of a string):
# every other character is written as itself, in UTF-8.
_SHORT_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n",
                  "\f": "\\f", "\r": "\\r"}


def stringify_digest(ids: list[str]) -> str:
    """SHA-256 of ``ids`` as JSON.stringify writes the array, spelled out here character by
    character (neither the json module nor orjson): what a runtime in another language
    computes from the README's description of ``item_ids_sha256``."""
    def string(s: str) -> str:
        return '"' + "".join(_SHORT_ESCAPES.get(c) or (
            f"\\u{ord(c):04x}" if ord(c) < 0x20 else c) for c in s) + '"'
    return hashlib.sha256(("[" + ",".join(map(string, ids)) + "]").encode()).hexdigest()


# What ids may hold that JSON writers escape differently: HTML's characters (Go's encoding/json
# writes \u003c), non-ASCII and beyond the BMP (Python's json.dumps writes \u00e9 by default),
# quotes, backslashes and a tab (a passage id's one control character).
ODD_IDS = ("<a&b>", "caf\u00e9", 'q"u', "b\\s", "t\tab", "\U0001f600", "\u00a0nbsp")


def test_a_pressure_digest_is_reproducible_from_any_ids(stub, ids, db):
    """A step of more than 64 ids whatever they hold is digested as JSON.stringify writes
    them (RFC 8785's strings): a runtime that writes the array so, in UTF-8, gets the
    event's ``item_ids_sha256`` from the ids the response named, and one that escapes
    otherwise (Python's default ASCII escapes) does not."""
    tenant, session = ids
    stub.Plan(plan_request(tenant, session))
    req = build_request(tenant, session)
    req.checkpoint.knowledge.extend([  # over the knowledge cap: a step of about 80 ids
        pb.KnowledgePassage(id=f"{ODD_IDS[i % len(ODD_IDS)]}{i:03d}", source="doc",
                            text="passage " * 100, rank=i,
                            trust=pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED) for i in range(100)])
    resp = stub.Build(req)
    step = next(s for s in resp.pressure.steps if s.step == "knowledge")
    names = list(step.item_ids)
    assert len(names) > 64 and {n[:-3] for n in names} >= set(ODD_IDS)
    text = db.val("SELECT payload::text FROM context_events WHERE tenant_id=$1 AND "
                  "session_id=$2 AND type='context.budget.pressure'", tenant, session)
    record = next(r for r in json.loads(text)["steps"] if r["step"] == "knowledge")
    assert record["item_count"] == len(names) and "item_ids" not in record
    assert (record["first_item_id"], record["last_item_id"]) == (names[0], names[-1])
    assert record["item_ids_sha256"] == stringify_digest(names) == ids_digest(names)
    assert record["item_ids_sha256"] != hashlib.sha256(
        json.dumps(names, separators=(",", ":")).encode()).hexdigest()


def pressure_count(server, step: str, fits: str) -> float:
    return server.registry.get_sample_value("context_engine_budget_pressure_total",
                                            {"step": step, "fits": fits}) or 0.0


def test_never_yield_items_below_the_history_floor_are_reported(stub, ids, db, server):
    """Issue 13: never-yield items left history 3,572 tokens with no signal. Now the pressure
    says by how much history is short of its 8,000-token floor, in the response, the event
    and the metric."""
    tenant, session = ids
    stub.Plan(plan_request(tenant, session, model=SMALL))
    items = long_history(20)
    items[-1].user.text = "word " * 4_000  # the current user message never yields
    before = pressure_count(server, "history_floor", "true")
    resp = stub.Build(build_request(tenant, session, items=items))
    p = resp.pressure
    history = next(c for c in resp.budget.classes if c.class_name == "history")
    assert p.fits and p.compaction_needed and history.cap < 8_000
    assert history.used + p.left_out_tokens > 8_000  # history had more than its floor
    assert p.history_floor_shortfall == 8_000 - history.cap > 0
    assert pressure_count(server, "history_floor", "true") == before + 1
    payload = json.loads(db.val("SELECT payload::text FROM context_events WHERE tenant_id=$1 "
                                "AND type='context.budget.pressure'", tenant))
    assert payload["history_floor_shortfall"] == p.history_floor_shortfall
    # the same history beside a short message keeps its floor: cut, but not short of it
    items[-1].user.text = "and now?"
    held = stub.Build(build_request(tenant, session, items=items)).pressure
    assert held.compaction_needed and held.history_floor_shortfall == 0
    assert pressure_count(server, "history_floor", "true") == before + 1


def test_plan_refuses_a_model_whose_body_cannot_hold_the_history_floor(stub, ids, db):
    """Issue 13: gpt-4 (8,192 tokens, 2,048 reserved) has a body budget of about 5,400, so
    history could never keep its 8,000-token floor; the plan was accepted silently."""
    tenant, session = ids
    with pytest.raises(grpc.RpcError) as err:
        stub.Plan(plan_request(tenant, session, model=pb.ModelSpec(model_id="gpt-4")))
    f = failure(err.value)
    assert f.code is grpc.StatusCode.FAILED_PRECONDITION
    assert f.reason == "HISTORY_FLOOR_UNREACHABLE"
    m = f.metadata
    assert (m["model"], m["window"], m["output_reserve"], m["history_floor"]) == (
        "gpt-4", "8192", "2048", "8000")
    assert m["margin"] == str(-(-(8_192 - 2_048) * 5 // 100))
    body = int(m["body_budget"])
    assert body == 8_192 - 2_048 - int(m["margin"]) - int(m["prefix_tokens"]) < 8_000
    assert "gpt-4" in f.message and m["body_budget"] in f.message
    assert db.counts(tenant) == {k: 0 for k in db.counts(tenant)}  # nothing was written
    # a session routed to it later is refused the same way, and keeps its epoch
    plan = stub.Plan(plan_request(tenant, session)).plan
    with pytest.raises(grpc.RpcError) as err:
        stub.Rotate(pb.RotateRequest(tenant_id=tenant, session_id=session,
                                     reason=pb.ROTATION_REASON_MODEL_ROUTED,
                                     model=pb.ModelSpec(model_id="gpt-4"),
                                     idempotency_key="to-gpt-4"))
    assert failure(err.value).reason == "HISTORY_FLOOR_UNREACHABLE"
    assert stub.GetPlan(pb.GetPlanRequest(tenant_id=tenant, session_id=session)).plan == plan


LONG_INSTRUCTIONS = "Follow the rules carefully and cite sources. " * 330


def _claude(window: int) -> pb.ModelSpec:
    return pb.ModelSpec(model_id="claude-sonnet-4-5", capabilities=pb.ModelCapabilities(
        context_window=window, output_reserve=2_000))


def _long_agent() -> pb.AgentSpec:
    return pb.AgentSpec(agent_id="helper", version="7", instructions=LONG_INSTRUCTIONS,
                        enabled_tools=["web.fetch"])


def _scaled_past_the_floor(f, factor: float) -> None:
    """A HISTORY_FLOOR_UNREACHABLE naming a prefix the factor scaled past the floor."""
    assert (f.code, f.reason) == (grpc.StatusCode.FAILED_PRECONDITION,
                                  "HISTORY_FLOOR_UNREACHABLE"), (f.code, f.reason, f.message)
    m = f.metadata
    assert float(m["estimator_factor"]) == pytest.approx(factor, rel=1e-3)
    measured, charged = int(m["prefix_measured"]), int(m["prefix_tokens"])
    assert charged == math.ceil(measured * float(m["estimator_factor"])) > measured
    assert int(m["body_budget"]) < 8_000 <= int(m["body_budget"]) + charged - measured


def test_plan_holds_the_floor_with_the_prefix_at_the_tenants_correction_factor(
        stub, ids, db, server):
    """One ReportUsage moved the tenant's Claude factor from 1.0 to
    3.0; Plans were still accepted with the body budget of the unscaled prefix, and every Build
    then cut history far below its floor (7,060 tokens short at a 19,000-token window),
    reported as never-yield items' doing; at a factor of 4 a session Plan accepted failed every
    Build BUDGET_EXCEEDED class=prefix. Plan and a model_routed or larger-snapshot Rotate now
    cost the prefix as Build does; a session opened before the factor moved keeps building,
    its shortfall the prefix's, and a revocation still rotates it."""
    tenant, session = ids
    early, late, routed = f"{session}-early", f"{session}-late", f"{session}-routed"
    agent = _long_agent()
    stub.Plan(plan_request(tenant, session, agent=agent, model=_claude(30_000)))
    stub.Plan(plan_request(tenant, early, agent=agent, model=_claude(19_000)))  # at 1.0
    stub.Plan(plan_request(tenant, routed, agent=agent,
                           model=pb.ModelSpec(model_id="gpt-4o")))
    built = stub.Build(build_request(tenant, session))
    est = built.estimated_input_tokens
    up = stub.ReportUsage(_report(tenant, session, "x3", est, 3 * est))
    assert up.correction_factor == pytest.approx(3.0, rel=1e-3)
    plans = db.counts(tenant)["plans"]
    with pytest.raises(grpc.RpcError) as err:
        stub.Plan(plan_request(tenant, late, agent=agent, model=_claude(19_000)))
    _scaled_past_the_floor(failure(err.value), up.correction_factor)
    with pytest.raises(grpc.RpcError) as err:
        stub.Rotate(pb.RotateRequest(tenant_id=tenant, session_id=routed,
                                     reason=pb.ROTATION_REASON_MODEL_ROUTED,
                                     model=_claude(19_000), idempotency_key="to-claude"))
    _scaled_past_the_floor(failure(err.value), up.correction_factor)
    # the pinned model's factor, read once the locked plan names it: a larger snapshot is
    # held to the floor at it too
    snapshot = pb.MemorySnapshot(snapshot_id="s2", recall_trace_id="tr2", watermark=2,
                                 items=[pb.MemoryItem(id="m1", text="likes tea")])
    with pytest.raises(grpc.RpcError) as err:
        stub.Rotate(pb.RotateRequest(tenant_id=tenant, session_id=early,
                                     reason=pb.ROTATION_REASON_SNAPSHOT_INVALIDATED,
                                     memory_snapshot=snapshot, idempotency_key="bigger"))
    _scaled_past_the_floor(failure(err.value), up.correction_factor)
    assert db.counts(tenant)["plans"] == plans  # nothing was written
    # at a larger window the same prefix holds the floor at the factor
    stub.Plan(plan_request(tenant, late, agent=agent, model=_claude(30_000)))
    # the session opened before the factor moved is not refused for it: it builds, its
    # body budget itself below the floor, and that part of the shortfall is the prefix's
    before = {step: pressure_count(server, step, "true")
              for step in ("history_floor", "history_floor_prefix")}
    resp = stub.Build(build_request(tenant, early, items=long_history(12, size=200)))
    p, B = resp.pressure, resp.budget.body_budget
    assert resp.estimator_factor == pytest.approx(up.correction_factor) and p.fits
    assert B < 8_000 and p.left_out_items > 0
    history = next(c for c in resp.budget.classes if c.class_name == "history")
    never_yield = resp.body_tokens - history.used
    assert p.history_floor_shortfall == 8_000 - B + never_yield
    payload = json.loads(db.val(
        "SELECT payload::text FROM context_events WHERE tenant_id=$1 AND session_id=$2 "
        "AND type='context.budget.pressure'", tenant, early))
    assert payload["prefix_floor_shortfall"] == 8_000 - B
    assert payload["history_floor_shortfall"] == p.history_floor_shortfall
    assert pressure_count(server, "history_floor_prefix", "true") == \
        before["history_floor_prefix"] + 1
    assert pressure_count(server, "history_floor", "true") == before["history_floor"] + 1
    # a revocation rotates it whatever the factor has become
    revoked = stub.Rotate(pb.RotateRequest(tenant_id=tenant, session_id=early,
                                           reason=pb.ROTATION_REASON_SECURITY_REVOCATION,
                                           drop_tools=["web.fetch"], idempotency_key="revoke"))
    assert revoked.plan.epoch == 2


def test_a_request_that_fits_emits_no_pressure_event(stub, ids, db):
    tenant, session = ids
    stub.Plan(plan_request(tenant, session))
    stub.Build(build_request(tenant, session))
    assert db.val("SELECT count(*) FROM context_events WHERE tenant_id=$1 AND "
                  "type LIKE 'context.budget.%'", tenant) == 0


def test_never_yield_overflow_fails_and_records_exceeded(stub, ids, db):
    tenant, session = ids
    stub.Plan(plan_request(tenant, session, model=SMALL))
    items = [item("u1", 1, user=pb.UserMessage(text="word " * 20_000))]
    with pytest.raises(grpc.RpcError) as err:
        stub.Build(build_request(tenant, session, items=items))
    f = failure(err.value)
    assert f.code is grpc.StatusCode.FAILED_PRECONDITION and f.reason == "BUDGET_EXCEEDED"
    assert f.metadata["class"] == "current_user_message"
    types = [r["type"] for r in db.fetch(
        "SELECT type FROM context_events WHERE tenant_id=$1 ORDER BY id", tenant)]
    # nothing yielded (the only item never yields): no pressure event, only the exceeded one
    assert types == ["context.plan.created", "context.budget.exceeded"]


def test_an_overflow_that_yielded_records_its_pressure_then_exceeded(stub, ids, db, server):
    """An overflow after yield steps ran records them (fits false) before the exceeded event;
    one that yielded nothing records only the exceeded event (above)."""
    tenant, session = ids
    stub.Plan(plan_request(tenant, session, model=SMALL))
    items = long_history(20)
    items[-1].user.text = "word " * 20_000  # never yields, and over the window on its own
    before = pressure_count(server, "history", "false")
    with pytest.raises(grpc.RpcError) as err:
        stub.Build(build_request(tenant, session, items=items))
    assert failure(err.value).reason == "BUDGET_EXCEEDED"
    rows = db.fetch("SELECT type, payload::text AS payload FROM context_events "
                    "WHERE tenant_id=$1 ORDER BY id", tenant)
    assert [r["type"] for r in rows] == ["context.plan.created", "context.budget.pressure",
                                         "context.budget.exceeded"]
    payload = json.loads(rows[1]["payload"])
    assert payload["fits"] is False and "history" in [s["step"] for s in payload["steps"]]
    assert pressure_count(server, "history", "false") == before + 1


def test_a_third_skill_is_rejected(stub, ids):
    tenant, session = ids
    stub.Plan(plan_request(tenant, session, skill_catalog=[pb.SkillCatalogEntry(
        name=f"s{i}", description="d", trust=pb.TRUST_LEVEL_TRUSTED_CONFIGURATION)
        for i in range(3)]))
    req = build_request(tenant, session)
    req.checkpoint.loaded_skills.extend([
        pb.SkillBody(name=f"s{i}", body="Do it well.", trust=pb.TRUST_LEVEL_TRUSTED_CONFIGURATION)
        for i in range(3)])
    with pytest.raises(grpc.RpcError) as err:
        stub.Build(req)
    f = failure(err.value)
    assert f.reason == "BUDGET_EXCEEDED" and f.metadata["class"] == "skill_bodies"
    assert f.metadata["unit"] == "items" and f.metadata["limit"] == "2"


def test_skills_built_before_a_rotation_to_another_model_still_build(stub, ids):
    """Two skills built at 5,996 tokens on gpt-4o (o200k_base) measured about 7,800 once a
    model_routed Rotate moved the session to Claude (cl100k_base x 1.3): every Build failed
    BUDGET_EXCEEDED{skill_bodies}, and a skill is never unloaded. The cap is measured with
    the session's first epoch's tokenizer across rotations; the body pays the new model's."""
    tenant, session = ids
    catalog = [pb.SkillCatalogEntry(name=n, description="A skill.", trust=pb.TRUST_LEVEL_USER)
               for n in ("a", "b")]
    stub.Plan(plan_request(tenant, session, skill_catalog=catalog,
                           model=pb.ModelSpec(model_id="gpt-4o")))

    def request(tenant_session: tuple[str, str], words: int) -> pb.BuildRequest:
        body = " ".join(f"rule{i}" for i in range(words))
        return build_request(*tenant_session, loaded_skills=[
            pb.SkillBody(name=n, body=body, trust=pb.TRUST_LEVEL_USER) for n in ("a", "b")])

    def builds(words: int) -> bool:
        try:
            stub.Build(request((tenant, session), words))
            return True
        except grpc.RpcError as err:
            assert failure(err).metadata["class"] == "skill_bodies"
            return False
    lo, hi = 10, 5_000  # the longest bodies the gpt-4o epoch builds
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if builds(mid) else (lo, mid)
    first = stub.Build(request((tenant, session), lo))
    used = next(c.used for c in first.budget.classes if c.class_name == "skill_bodies")
    assert 6_000 / 1.25 < used <= 6_000
    # the oracle that Claude's estimate counts them over the cap: a Claude session refuses them
    stub.Plan(plan_request(tenant, f"{session}-c", skill_catalog=catalog))
    with pytest.raises(grpc.RpcError) as err:
        stub.Build(request((tenant, f"{session}-c"), lo))
    f = failure(err.value)
    assert f.metadata["class"] == "skill_bodies" and int(f.metadata["tokens"]) > 6_000

    stub.Rotate(pb.RotateRequest(tenant_id=tenant, session_id=session,
                                 reason=pb.ROTATION_REASON_MODEL_ROUTED,
                                 model=pb.ModelSpec(model_id="claude-sonnet-4-5"),
                                 idempotency_key="route"))
    for _ in range(2):  # and again, from what the first one kept
        built = stub.Build(request((tenant, session), lo))
        assert built.epoch == 2
        used = next(c.used for c in built.budget.classes if c.class_name == "skill_bodies")
        assert used > 6_000  # charged at Claude's estimate
    assert not builds(hi)  # the cap still holds, as the session first measured it


def _report(tenant, session, key, estimated, actual, factor=1.0, cached=0):
    return pb.ReportUsageRequest(tenant_id=tenant, session_id=session,
                                 estimated_input_tokens=estimated, estimator_factor=factor,
                                 input_tokens=actual, cached_tokens=cached, output_tokens=10,
                                 idempotency_key=key)


@pytest.mark.parametrize("model_id", ["claude-sonnet-4-5", "gpt-4o"])
def test_report_usage_reconciles_once_per_key_and_build_uses_the_factor(stub, ids, db,
                                                                        model_id):
    tenant, session = ids
    stub.Plan(plan_request(tenant, session, model=pb.ModelSpec(model_id=model_id)))
    built = stub.Build(build_request(tenant, session))
    est = built.estimated_input_tokens
    actual = int(est * 1.2)
    up = stub.ReportUsage(_report(tenant, session, "r1", est, actual))
    assert up.counted and up.previous_factor == 1.0
    prefix = built.prefix_tokens
    if model_id == "gpt-4o":
        # the prefix was counted with the model's own encoding, exactly, and is never scaled:
        # the body absorbs the whole error
        assert up.correction_factor == pytest.approx((actual - prefix) / (est - prefix),
                                                     rel=1e-3)
    else:
        # Claude's prefix was counted with cl100k_base x 1.3, an estimate like the body: the
        # factor is the observed ratio over the whole estimate
        assert up.correction_factor == pytest.approx(actual / est, rel=1e-3)
    assert up.error_ratio == pytest.approx((int(est * 1.2) - est) / int(est * 1.2))
    again = stub.ReportUsage(_report(tenant, session, "r1", est, int(est * 1.2)))
    assert not again.counted and again.correction_factor == up.correction_factor
    assert db.val("SELECT reports FROM estimator_calibration WHERE tenant_id=$1", tenant) == 1
    # every Build now uses the reconciled factor, and echoes it
    after = stub.Build(build_request(tenant, session))
    assert after.estimator_factor == pytest.approx(up.correction_factor)
    assert after.body_tokens > built.body_tokens
    # an exact prefix is never scaled, an approximate one is scaled like the body
    assert after.prefix_tokens == prefix  # Region A's measured figure never moves
    assert after.budget.prefix_tokens == (prefix if model_id == "gpt-4o"
                                          else math.ceil(prefix * after.estimator_factor))
    assert after.budget.body_budget == (after.budget.total_tokens - after.output_reserve
                                        - after.budget.margin_tokens
                                        - after.budget.prefix_tokens)
    # corrected at once: no longer under-counted (up to the rounding of each message, which
    # the factor scales)
    assert after.estimated_input_tokens >= actual - math.ceil(
        after.estimator_factor * len(after.request.messages))
    # a pinned factor reproduces the original bytes and numbers
    pinned = build_request(tenant, session)
    pinned.estimator_factor = built.estimator_factor
    assert stub.Build(pinned) == built
    # down slowly
    down = stub.ReportUsage(_report(tenant, session, "r2", after.estimated_input_tokens,
                                    after.estimated_input_tokens // 2,
                                    factor=after.estimator_factor))
    assert 0.5 < down.correction_factor < up.correction_factor
    assert down.correction_factor > up.correction_factor - (up.correction_factor - 0.6) * 0.5


@pytest.mark.parametrize(("model_id", "expected"), [("claude-sonnet-4-5", 2.0),
                                                    ("gemini-2.5-pro", 2.0),
                                                    ("gpt-4o", None)])
def test_twice_the_estimate_doubles_the_factor_where_the_prefix_count_is_approximate(
        stub, ids, model_id, expected):
    """Issue 13's reproduction: actual = 2 x estimate moved the factor from 1.0 to 4.0 (the cap)
    for Claude, because the whole error was charged to the body."""
    tenant, session = ids
    stub.Plan(plan_request(tenant, session, model=pb.ModelSpec(model_id=model_id)))
    built = stub.Build(build_request(tenant, session))
    est, prefix = built.estimated_input_tokens, built.prefix_tokens
    up = stub.ReportUsage(_report(tenant, session, "x2", est, 2 * est))
    if expected is None:  # exact prefix: all of the error is the body's (here over the cap)
        assert (2 * est - prefix) / (est - prefix) > 4.0
        expected = 4.0
    assert up.correction_factor == pytest.approx(expected, rel=1e-3)


@pytest.mark.parametrize("model_id", ["claude-sonnet-4-5", "gpt-4o"])
def test_an_estimate_below_the_prefix_is_no_builds_and_is_refused(stub, ids, db, model_id):
    """One report of an estimate no Build of the plan can give (below its prefix alone, at the
    factor it names) moved the tenant's factor for the model from 1.0 to its cap of 4.0."""
    tenant, session = ids
    stub.Plan(plan_request(tenant, session, model=pb.ModelSpec(model_id=model_id)))
    built = stub.Build(build_request(tenant, session))
    least = built.budget.prefix_tokens  # the prefix at the Build's factor (1.0)
    for estimated, factor in ((10, 1.0), (least - 1, 1.0),
                              (math.ceil(built.prefix_tokens * 1.5) - 1, 1.5)):
        if model_id == "gpt-4o" and factor != 1.0:  # an exact prefix is never scaled
            estimated = built.prefix_tokens - 1
        with pytest.raises(grpc.RpcError) as err:
            stub.ReportUsage(_report(tenant, session, f"low-{estimated}", estimated, 5_000,
                                     factor=factor))
        f = failure(err.value)
        assert f.code is grpc.StatusCode.INVALID_ARGUMENT
        assert "below the" in f.violations["estimated_input_tokens"], f.violations
    assert db.val("SELECT count(*) FROM estimator_calibration WHERE tenant_id=$1 AND "
                  "reports > 0", tenant) == 0
    assert db.val("SELECT count(*) FROM idempotency_keys WHERE tenant_id=$1", tenant) == 0
    # the prefix alone is what a Build with nothing else would estimate: taken
    ok = stub.ReportUsage(_report(tenant, session, "at-least", least, least))
    assert ok.counted


def test_a_builds_own_figures_are_counted_after_a_rotation_grew_the_prefix(stub, ids):
    """Reported under epoch 0 ("current") once another caller rotated the session to a larger
    prefix, a Build's own figures are below the new prefix: the bound is the epoch's the
    report names, so epoch 0 of a session with more than one epoch is not held to it; named,
    the Build's epoch is."""
    tenant, session = ids
    stub.Plan(plan_request(tenant, session))
    built = stub.Build(build_request(tenant, session))
    snapshot = pb.MemorySnapshot(snapshot_id="snap-2", recall_trace_id="trace-2", watermark=2,
                                 items=[pb.MemoryItem(id=f"m{i}", text="Prefers tea. " * 20)
                                        for i in range(8)])
    grown = stub.Rotate(pb.RotateRequest(
        tenant_id=tenant, session_id=session, idempotency_key="grow",
        reason=pb.ROTATION_REASON_SNAPSHOT_INVALIDATED, memory_snapshot=snapshot)).plan
    assert grown.epoch == 2 and grown.prefix_tokens > built.estimated_input_tokens
    current = _report(tenant, session, "as-current", built.estimated_input_tokens,
                      built.estimated_input_tokens)
    assert stub.ReportUsage(current).counted
    named = _report(tenant, session, "as-named", built.estimated_input_tokens,
                    built.estimated_input_tokens)
    named.epoch = built.epoch
    assert stub.ReportUsage(named).counted
    # named wrong, it is held to the epoch it names
    wrong = _report(tenant, session, "named-wrong", built.estimated_input_tokens,
                    built.estimated_input_tokens)
    wrong.epoch = 2
    with pytest.raises(grpc.RpcError) as err:
        stub.ReportUsage(wrong)
    assert "epoch 2's prefix" in failure(err.value).violations["estimated_input_tokens"]


def test_an_idempotency_key_cannot_be_reused_for_another_request(stub, ids, db):
    tenant, session = ids
    stub.Plan(plan_request(tenant, session))
    stub.Plan(plan_request(tenant, "other"))
    stub.ReportUsage(_report(tenant, session, "k", 5000, 5500))
    for req in (_report(tenant, session, "k", 5000, 6500), _report(tenant, "other", "k", 5000,
                                                                    5500)):
        with pytest.raises(grpc.RpcError) as err:
            stub.ReportUsage(req)
        assert "idempotency_key" in failure(err.value).violations
    assert db.val("SELECT reports FROM estimator_calibration WHERE tenant_id=$1", tenant) == 1


def test_a_report_retried_after_a_rotation_gets_its_first_answer(stub, ids, db):
    """The retry repeats the request as sent (epoch 0: current); the session rotating in
    between does not make it "another request"."""
    tenant, session = ids
    stub.Plan(plan_request(tenant, session))
    first = stub.ReportUsage(_report(tenant, session, "retry-me", 5000, 5500))
    assert first.counted
    stub.Rotate(pb.RotateRequest(tenant_id=tenant, session_id=session,
                                 reason=pb.ROTATION_REASON_OPERATOR, idempotency_key="rot"))
    again = stub.ReportUsage(_report(tenant, session, "retry-me", 5000, 5500))
    assert not again.counted and again.correction_factor == first.correction_factor
    assert db.val("SELECT reports FROM estimator_calibration WHERE tenant_id=$1", tenant) == 1


def test_concurrent_reports_are_each_counted_once(stub, ids, db):
    tenant, session = ids
    stub.Plan(plan_request(tenant, session))
    errors: list[BaseException] = []

    def send(key: str) -> None:
        try:
            stub.ReportUsage(_report(tenant, session, key, 5000, 5500), timeout=20)
        except BaseException as exc:  # asserted below
            errors.append(exc)

    threads = [threading.Thread(target=send, args=(f"key-{i % 5}",)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    assert db.val("SELECT reports FROM estimator_calibration WHERE tenant_id=$1", tenant) == 5
    assert db.val("SELECT count(*) FROM idempotency_keys WHERE tenant_id=$1", tenant) == 5


def test_a_report_of_exactly_the_window_is_counted(stub, ids, db):
    """A request may fill gpt-4o's whole window of 128,000 tokens: such a report is usage of
    the plan, counted; one token more is no request of it, refused."""
    tenant, session = ids
    stub.Plan(plan_request(tenant, session, model=pb.ModelSpec(model_id="gpt-4o")))
    counted = stub.ReportUsage(_report(tenant, session, "full", 128_000, 128_000))
    assert counted.counted
    with pytest.raises(grpc.RpcError) as err:
        stub.ReportUsage(_report(tenant, session, "over", 128_000, 128_001))
    assert set(failure(err.value).violations) == {"input_tokens"}
    assert db.val("SELECT reports FROM estimator_calibration WHERE tenant_id=$1", tenant) == 1


def test_bad_usage_reports(stub, ids, db):
    tenant, session = ids
    stub.Plan(plan_request(tenant, session))
    cases = {
        "idempotency_key": _report(tenant, session, "", 10, 10),
        "estimated_input_tokens": _report(tenant, session, "k", 0, 10),
        "cached_tokens": _report(tenant, session, "k", 10, 10, cached=11),
        "estimator_factor": _report(tenant, session, "k", 10, 10, factor=9.0),
        # more than the model's window (200,000) is not usage of this plan
        "input_tokens": _report(tenant, session, "k", 1_000, 4_000_000_000),
    }
    for field, req in cases.items():
        with pytest.raises(grpc.RpcError) as err:
            stub.ReportUsage(req)
        assert field in failure(err.value).violations
    # nothing of them was written (the window's refusal comes inside the report's transaction)
    assert db.val("SELECT count(*) FROM idempotency_keys WHERE tenant_id=$1", tenant) == 0
    assert db.val("SELECT count(*) FROM epoch_usage WHERE tenant_id=$1", tenant) == 0


class SlowPressureWrites:
    """The engine's event log with each pressure event's write held for ``HOLD`` seconds: what
    the Build does meanwhile, and when it answers, is written into ``log``."""

    HOLD = 0.3

    def __init__(self, inner: object, log: list[str]) -> None:
        self._inner, self.log = inner, log

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)

    async def append(self, event: object) -> None:
        if getattr(event, "type", "") == "context.budget.pressure":
            self.log.append("write started")
            await asyncio.sleep(self.HOLD)
            await self._inner.append(event)  # type: ignore[attr-defined]
            self.log.append("written")
        else:
            await self._inner.append(event)  # type: ignore[attr-defined]


def test_the_pressure_event_is_written_after_the_response_is_made_before_it_answers(
        database_url, ids, db, monkeypatch):
    """The pressure event is emitted before the request leaves (the Build answers only once it
    is in the database), and only once the request is assembled and the response made: a
    Build refused there writes nothing (tests/integration/test_refused_build_writes.py)."""
    from context_engine.api import mapping
    from context_engine.domain import builder

    from tests.conftest import ServerThread, test_config
    tenant, session = ids
    log: list[str] = []
    srv = ServerThread(test_config(), database_url)
    try:
        engine = srv.running.engine
        engine._events = SlowPressureWrites(engine._events, log)
        render = mapping.build_pb

        def rendering(*args, **kwargs):
            log.append("rendered")
            return render(*args, **kwargs)

        monkeypatch.setattr(mapping, "build_pb", rendering)
        # The last step of assembly is the pairing validator: the pure one, or the one a Build
        # on the served path's memo resumes; both are marked.
        def marked(check):
            def assembled(*args, **kwargs):
                log.append("assembled")
                return check(*args, **kwargs)
            return assembled

        for name in ("assert_paired", "assert_paired_since"):
            monkeypatch.setattr(builder, name, marked(getattr(builder, name)))
        with grpc.insecure_channel(srv.address) as channel:
            stub = pb_grpc.ContextEngineStub(channel)
            stub.Plan(plan_request(tenant, session, model=SMALL))
            req = build_request(tenant, session, items=long_history(40))
            req.checkpoint.active_run_id = "run-1"
            resp = stub.Build(req, timeout=30)
            assert resp.pressure.steps
            assert log == ["assembled", "rendered", "write started", "written"]
            rows = db.fetch("SELECT 1 FROM context_events WHERE tenant_id=$1 AND "
                            "type='context.budget.pressure'", tenant)
            assert len(rows) == 1
            log.clear()  # a Build that fits writes nothing and still renders
            fits = stub.Build(build_request(tenant, session), timeout=30)
            assert not fits.pressure.steps and log == ["assembled", "rendered"]
    finally:
        srv.stop()


def _tools(n: int) -> list[pb.ToolSpec]:
    schema = '{"type":"object","properties":{"q":{"type":"string"}},"required":["q"]}'
    return [pb.ToolSpec(name=f"t{i:02d}", description=f"Does t{i:02d}. More detail here.",
                        input_schema_json=schema, side_effect=pb.SIDE_EFFECT_NONE)
            for i in range(n)]


def _many_tools_plan(tenant: str, session: str, model_id: str = "gpt-4o") -> pb.PlanRequest:
    """30 small tools: the plan's prefix count frames each conservatively, more than the
    provider counts."""
    req = plan_request(tenant, session, model=pb.ModelSpec(model_id=model_id),
                       tool_catalog=_tools(30), principal_scopes=[])
    req.agent.ClearField("enabled_tools")
    req.agent.enabled_tools.extend(f"t{i:02d}" for i in range(30))
    req.agent.ClearField("deferred_tools")
    req.agent.enables_tool_call = False
    return req


@pytest.mark.gate_budget
def test_honest_reports_never_take_an_exact_count_below_itself(stub, ids):
    """Reports of a request's true count (tiktoken over the body sent: the oracle) once took
    gpt-4o's factor from 1.0 to 0.507 in 12 turns, the estimate's designed slack (the tools'
    conservative framing) read as drift; the next Build of a long conversation, counted 105,060
    tokens, was 204,279 against a window less reserve of 111,616."""
    tenant, session = ids
    stub.Plan(_many_tools_plan(tenant, session))
    factors = []
    for turn in range(12):
        items = [item(f"u{turn}", 1, run="run-1",
                      user=pb.UserMessage(text="What is on my calendar today?"))]
        built = stub.Build(build_request(tenant, session, items))
        actual = count_body(json.loads(built.provider_body_json), "openai_responses", "gpt-4o")
        assert actual < built.estimated_input_tokens  # the slack the reports measure
        got = stub.ReportUsage(_report(tenant, session, f"k{turn}",
                                       built.estimated_input_tokens, actual,
                                       factor=built.estimator_factor))
        factors.append(got.correction_factor)
    assert factors == [1.0] * 12
    text = " ".join(f"word{i} alpha beta gamma" for i in range(400))
    items = [item(f"h{i}", i + 1, run="run-0", user=pb.UserMessage(text=text))
             for i in range(200)]
    items.append(item("now", 1000, run="run-1", user=pb.UserMessage(text="Summarize.")))
    built = stub.Build(build_request(tenant, session, items))
    assert built.estimator_factor == 1.0
    actual = count_body(json.loads(built.provider_body_json), "openai_responses", "gpt-4o")
    assert actual <= built.budget.total_tokens - built.output_reserve
    assert actual <= built.estimated_input_tokens


def test_a_factor_reconciled_for_another_encoding_is_not_applied(stub, ids, db):
    """A model's factor is reconciled for the encoding its plans were counted with: a row of
    another encoding (a tokenizer since changed) is no factor of this count, which starts
    again at 1.0."""
    tenant, session = ids
    # (written before the Plans: a Plan reads the factor as Build does, and the replica
    # keeps what it read for CE_CALIBRATION_TTL_SECONDS)
    db.fetch("INSERT INTO estimator_calibration (tenant_id, model_id, encoding, factor, "
             "reports) VALUES ($1, 'gpt-4o', 'cl100k_base', 2.0, 9) RETURNING 1", tenant)
    stub.Plan(plan_request(tenant, session, model=pb.ModelSpec(model_id="gpt-4o")))
    assert stub.Build(build_request(tenant, session)).estimator_factor == 1.0
    own = f"{tenant}-own"  # the same row of the plan's own encoding is applied
    db.fetch("INSERT INTO estimator_calibration (tenant_id, model_id, encoding, factor, "
             "reports) VALUES ($1, 'gpt-4o', 'o200k_base', 2.0, 9) RETURNING 1", own)
    stub.Plan(plan_request(own, session, model=pb.ModelSpec(model_id="gpt-4o")))
    assert stub.Build(build_request(own, session)).estimator_factor == 2.0


def test_a_factor_stored_below_the_floor_is_raised_to_it(stub, ids, db):
    """A factor reconciled below 1.0 for an exact count before the floor held is read as 1.0
    and moves up from there; an approximate count (cl100k_base x 1.3) keeps a lower factor down
    to 1 / 1.3, where the estimate is cl100k_base's own count, which Claude's does not go below,
    and one stored lower is read as that."""
    tenant, session = ids
    other, third = f"{session}-claude", f"{session}-gemini"
    # (written before the Plans, which read the factors as Build does)
    for model_id, encoding, factor in (("gpt-4o", "o200k_base", 0.6),
                                       ("claude-sonnet-4-5", "cl100k_base", 0.6),
                                       ("gemini-2.5-pro", "cl100k_base", 0.8)):
        db.fetch("INSERT INTO estimator_calibration (tenant_id, model_id, encoding, factor, "
                 "reports) VALUES ($1, $2, $3, $4, 9) RETURNING 1", tenant, model_id, encoding,
                 factor)
    stub.Plan(plan_request(tenant, session, model=pb.ModelSpec(model_id="gpt-4o")))
    stub.Plan(plan_request(tenant, other))
    stub.Plan(plan_request(tenant, third, model=pb.ModelSpec(model_id="gemini-2.5-pro")))
    assert stub.Build(build_request(tenant, session)).estimator_factor == 1.0
    assert stub.Build(build_request(tenant, other)).estimator_factor == pytest.approx(1 / 1.3)
    assert stub.Build(build_request(tenant, third)).estimator_factor == pytest.approx(0.8)
    built = stub.Build(build_request(tenant, session))
    est = built.estimated_input_tokens
    down = stub.ReportUsage(_report(tenant, session, "low", est, est // 2))
    assert down.previous_factor == pytest.approx(0.6) and down.correction_factor == 1.0
    # reports far below Claude's estimate (its input_tokens without the cached ones, say) walk
    # its factor down to 1 / 1.3 and no lower
    for k in range(12):  # each report of a Build at the factor of its time
        built = stub.Build(build_request(tenant, third))
        est = built.estimated_input_tokens
        down = stub.ReportUsage(_report(tenant, third, f"low-{k}", est, est // 4,
                                        factor=built.estimator_factor))
    assert 1 / 1.3 <= down.correction_factor < 1 / 1.3 + 1e-3  # (it falls slowly to it)


def test_a_pinned_factor_below_an_exact_count_is_refused(stub, ids):
    tenant, session = ids
    stub.Plan(plan_request(tenant, session, model=pb.ModelSpec(model_id="gpt-4o")))
    pinned = build_request(tenant, session)
    pinned.estimator_factor = 0.8
    with pytest.raises(grpc.RpcError) as err:
        stub.Build(pinned)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "below 1.0" in failure(err.value).violations["estimator_factor"]
    compact = pb.CompactRequest(tenant_id=tenant, session_id=session,
                                checkpoint=pinned.checkpoint, reason="budget_pressure",
                                idempotency_key="pinned", tokens_to_free=1_000,
                                estimator_factor=0.8)
    with pytest.raises(grpc.RpcError) as err:
        stub.Compact(compact)
    assert "estimator_factor" in failure(err.value).violations
    pinned.estimator_factor = 1.0
    stub.Build(pinned)
    # an approximate count (Claude: cl100k_base x 1.3) may be scaled down to 1 / 1.3, no lower
    claude = f"{session}-claude"
    stub.Plan(plan_request(tenant, claude))
    low = build_request(tenant, claude)
    low.estimator_factor = 0.76
    with pytest.raises(grpc.RpcError) as err:
        stub.Build(low)
    assert failure(err.value).violations["estimator_factor"].startswith(
        "0.76 is below 0.7692, the least for claude-sonnet-4-5, counted as cl100k_base x 1.3")
    low.estimator_factor = 1 / 1.3
    assert stub.Build(low).estimator_factor == pytest.approx(1 / 1.3)
    # a fallback encoding stands in for the model's own (cl100k_base x 2.5 where an encoding
    # cannot be loaded; gpt-oss's o200k_harmony loads from the bundled o200k_base file), which
    # may count well below it: the general floor; the model's own encoding is exact: 1.0
    oss = f"{session}-oss"
    plan = stub.Plan(plan_request(tenant, oss, model=pb.ModelSpec(model_id="gpt-oss-120b"))).plan
    pinned = build_request(tenant, oss)
    pinned.estimator_factor = 0.6
    if "fallback" in plan.tokenizer:
        assert stub.Build(pinned).estimator_factor == pytest.approx(0.6)
    else:
        with pytest.raises(grpc.RpcError) as err:
            stub.Build(pinned)
        assert "below 1.0" in failure(err.value).violations["estimator_factor"]


def test_a_request_cached_whole_reads_a_whole_prefix(stub, ids, server):
    """The plan's prefix count frames tools conservatively: a request read whole from the cache
    held fewer tokens than it, and the ratio read 0.864 (the alert fires below 0.9)."""
    tenant, session = ids
    stub.Plan(_many_tools_plan(tenant, session))
    registry = server.registry

    def sample(name: str) -> float:
        return registry.get_sample_value(name) or 0.0
    before = (sample("context_engine_cached_prefix_ratio_sum"),
              sample("context_engine_cached_prefix_ratio_count"))
    items = [item("u0", 1, run="run-1", user=pb.UserMessage(text="What is on my calendar?"))]
    for turn in range(2):
        built = stub.Build(build_request(tenant, session, items))
        total = count_body(json.loads(built.provider_body_json), "openai_responses", "gpt-4o")
        assert total < built.prefix_tokens
        stub.ReportUsage(_report(tenant, session, f"c{turn}", built.estimated_input_tokens,
                                 total, cached=total))
    after = (sample("context_engine_cached_prefix_ratio_sum"),
             sample("context_engine_cached_prefix_ratio_count"))
    # the epoch's first report writes the cache and is not measured; the second is whole
    assert after[1] - before[1] == 1 and after[0] - before[0] == pytest.approx(1.0)


@pytest.mark.parametrize("model_id", ["claude-sonnet-4-5", "gemini-2.5-pro"])
def test_a_prefix_read_whole_from_the_cache_reads_whole_where_its_count_is_an_estimate(
        stub, ids, server, model_id):
    """The plan counts a Claude or Gemini prefix as cl100k_base x 1.3: a request whose prefix
    alone the cache held (its history not: the cut moved) read about 0.77, under the alert's
    0.9, though the prefix was read whole. The provider's tokens are taken here as
    cl100k_base's own count of the body (the least either counts)."""
    tenant, session = ids
    stub.Plan(plan_request(tenant, session, model=pb.ModelSpec(model_id=model_id)))
    registry = server.registry

    def sample(name: str) -> float:
        return registry.get_sample_value(name) or 0.0
    before = (sample("context_engine_cached_prefix_ratio_sum"),
              sample("context_engine_cached_prefix_ratio_count"))
    items = long_history(3, size=200)
    for turn in range(2):
        built = stub.Build(build_request(tenant, session, items))
        fmt = mapping_format(built.provider_format)
        body = json.loads(built.provider_body_json)
        total = count_body(body, fmt, model_id)
        bare = {**body, ("contents" if fmt == "gemini_generate_content" else "messages"): []}
        prefix = count_body(bare, fmt, model_id)  # system and tools: what the cache held
        assert prefix < built.prefix_tokens  # the plan's count is over the provider's
        stub.ReportUsage(_report(tenant, session, f"p{turn}", built.estimated_input_tokens,
                                 total, factor=built.estimator_factor, cached=prefix))
    after = (sample("context_engine_cached_prefix_ratio_sum"),
             sample("context_engine_cached_prefix_ratio_count"))
    assert after[1] - before[1] == 1  # the epoch's first report wrote the cache
    assert after[0] - before[0] >= 0.9


def mapping_format(value: int) -> str:
    from context_engine.api import mapping
    return mapping.FORMAT_FROM_PB[value]


def test_a_usage_retry_after_a_model_routed_rotation_names_the_model_it_was_counted_for(
        stub, ids):
    """A retried ReportUsage answers its first call's factors; it named the new plan's model
    beside them after a rotation to another model."""
    tenant, session = ids
    stub.Plan(plan_request(tenant, session))
    report = pb.ReportUsageRequest(tenant_id=tenant, session_id=session,
                                   estimated_input_tokens=5_000, estimator_factor=1.0,
                                   input_tokens=5_200, output_tokens=10,
                                   idempotency_key="usage-routed")
    first = stub.ReportUsage(report)
    assert first.counted and first.model_id == "claude-sonnet-4-5"
    stub.Rotate(pb.RotateRequest(tenant_id=tenant, session_id=session,
                                 reason=pb.ROTATION_REASON_MODEL_ROUTED,
                                 model=pb.ModelSpec(model_id="gpt-4o-2024-08-06"),
                                 idempotency_key="route-1"))
    retry = stub.ReportUsage(report)
    assert not retry.counted and retry.correction_factor == first.correction_factor
    assert retry.model_id == "claude-sonnet-4-5"


def test_report_usage_asks_for_no_tokenizer_where_the_plan_counts_its_framing(
        server, stub, ids, db, monkeypatch):
    """Reconciliation adds the leading turn to an exact prefix's count only for a plan whose
    count leaves it out, and only then asks for the plan's tokenizer: a plan pinned now
    reconciles without it (asked for on every report, a replica without the encoding refused
    them all, and loading it costs milliseconds on the event loop)."""
    tenant, session = ids
    stub.Plan(plan_request(tenant, session, model=pb.ModelSpec(model_id="gpt-4o")))
    est = stub.Build(build_request(tenant, session)).estimated_input_tokens

    def unavailable(spec):  # type: ignore[no-untyped-def]
        raise AssertionError("the tokenizer was asked for")

    monkeypatch.setattr(server.running.engine, "plan_estimator", unavailable)
    up = stub.ReportUsage(_report(tenant, session, "r1", est, int(est * 1.1)))
    assert up.counted and up.correction_factor > 1.0
