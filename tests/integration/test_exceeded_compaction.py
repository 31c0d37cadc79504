"""A Build refused BUDGET_EXCEEDED says ``compaction_needed`` only where a compaction can make
it fit, through the real server and PostgreSQL: never-yield items over the body are not helped
by compacting the history left out (the summary it writes never yields either, so a runtime
that compacted and built again failed again); a summary over the body that a merge can shrink
is."""

from __future__ import annotations

import json

import grpc
import pytest
from context_engine.v1 import context_engine_pb2 as pb

from tests.integration.requests import Failure, build_request, failure, item, plan_request
from tests.integration.test_budget_rpc import SMALL, long_history

pytestmark = pytest.mark.integration


def refused(stub, req: pb.BuildRequest):
    with pytest.raises(grpc.RpcError) as err:
        stub.Build(req)
    f = failure(err.value)
    assert f.code is grpc.StatusCode.FAILED_PRECONDITION and f.reason == "BUDGET_EXCEEDED"
    return f


def last_pressure(db, tenant: str) -> dict:
    return json.loads(db.val("SELECT payload::text FROM context_events WHERE tenant_id=$1 AND "
                             "type='context.budget.pressure' ORDER BY id DESC LIMIT 1", tenant))


def compact(stub, tenant: str, session: str, req: pb.BuildRequest, key: str, tokens: int,
            **fields) -> pb.Summary:
    resp = stub.Compact(pb.CompactRequest(
        tenant_id=tenant, session_id=session, checkpoint=req.checkpoint,
        reason="budget_pressure", idempotency_key=key, tokens_to_free=tokens, **fields))
    assert resp.compacted
    return resp.summary


def test_never_yield_items_over_the_body_need_no_compaction(stub, ids, db):
    tenant, session = ids
    stub.Plan(plan_request(tenant, session, model=SMALL))
    items = long_history(20)
    items[-1].user.text = "word " * 12_000  # the current user message alone is over the body
    req = build_request(tenant, session, items=items)
    f = refused(stub, req)
    assert f.metadata["class"] == "current_user_message"
    p = last_pressure(db, tenant)
    assert p["fits"] is False and p["left_out_items"] > 0  # every carried item was left out
    assert p["compaction_needed"] is False
    # what a runtime following it would have done: compact what was left out, build again,
    # and be refused again (the summary is one more thing that never yields)
    req.checkpoint.summary.CopyFrom(compact(stub, tenant, session, req, "c1",
                                            p["left_out_tokens"]))
    again = refused(stub, req)
    assert again.metadata["class"] == "current_user_message"
    assert int(again.metadata["tokens"]) > int(f.metadata["tokens"])  # and further over


def test_a_summary_over_the_body_that_a_merge_can_shrink_needs_compaction(stub, ids, db):
    tenant, session = ids
    stub.Plan(plan_request(tenant, session, model=SMALL))
    items = long_history(6)
    req = build_request(tenant, session, items=items)
    # a summary written under a larger cap, of the first run's first two fetches, built on a
    # window it does not fit: it never yields, and a merge under a smaller cap shrinks it
    req.checkpoint.summary.CopyFrom(pb.Summary(
        text="narrative " * 14_000, depth=1, replaced_through_sequence=8,
        trust=pb.TRUST_LEVEL_USER))
    f = refused(stub, req)
    assert f.metadata["class"] == "summary"
    p = last_pressure(db, tenant)
    assert p["fits"] is False and p["left_out_items"] > 0
    assert p["compaction_needed"] is True
    merged = compact(stub, tenant, session, req, "m1", p["left_out_tokens"],
                     max_summary_tokens=2_000)
    assert merged.depth == 2
    req.checkpoint.summary.CopyFrom(merged)
    assert stub.Build(req).pressure.fits  # the merge made it fit
    # the same summary merged already (depth 2) cannot be merged again: no compaction helps
    req.checkpoint.summary.CopyFrom(pb.Summary(
        text="narrative " * 14_000, depth=2, replaced_through_sequence=8,
        trust=pb.TRUST_LEVEL_USER))
    refused(stub, req)
    assert last_pressure(db, tenant)["compaction_needed"] is False


def dense(i: int, n: int) -> str:
    """Text of many tokens per character, which a summary's narrative fills its cap with."""
    return " ".join(f"{i}x{j}q" for j in range(n))


def decided_history(n: int) -> list[pb.ConversationItem]:
    """Carried history of ``n`` exchanges of an earlier run, each a long request and a long
    answer (what the structured summarizer keeps as decisions), then a new user message."""
    items: list[pb.ConversationItem] = []
    for i in range(n):
        items.append(item(f"u{i}", 2 * i + 1, run="run-0",
                          user=pb.UserMessage(text=f"step {i}: " + dense(i, 120))))
        items.append(item(f"a{i}", 2 * i + 2, run="run-0",
                          assistant=pb.AssistantMessage(text=f"done {i}: " + dense(i + 100, 120))))
    items.append(item("now", 2 * n + 1, user=pb.UserMessage(text="and now?")))
    return items


def test_a_refusal_compaction_helps_names_the_summary_cap_that_makes_it_fit(stub, ids, db):
    """The runtime's exchange: a checkpoint with a summary over the body, a Build refused
    with compaction_needed, and a compaction whose max_summary_tokens the refusal names (the
    runtime does not know what the summary costs in the body, so ``tokens - limit`` alone
    does not tell it): compacting with that cap builds; with twice the cap, the merged summary
    fills more than the body has for it and the Build is refused again."""
    tenant, session = ids
    stub.Plan(plan_request(tenant, session, model=SMALL))
    req = build_request(tenant, session, items=decided_history(12))
    req.checkpoint.summary.CopyFrom(pb.Summary(
        text=dense(7, 5_000), depth=1, replaced_through_sequence=2, trust=pb.TRUST_LEVEL_USER))
    f = refused(stub, req)
    p = last_pressure(db, tenant)
    assert p["fits"] is False and p["compaction_needed"] is True
    assert {k: v for k, v in f.metadata.items() if k != "max_summary_tokens"} == {
        "class": "summary", "tokens": f.metadata["tokens"], "limit": f.metadata["limit"],
        "unit": "tokens"}
    cap = int(f.metadata["max_summary_tokens"])
    over = int(f.metadata["tokens"]) - int(f.metadata["limit"])
    assert 0 < cap < int(f.metadata["limit"]) < over  # the excess is no cap
    exceeded = json.loads(db.val(
        "SELECT payload::text FROM context_events WHERE tenant_id=$1 AND "
        "type='context.budget.exceeded' ORDER BY id DESC LIMIT 1", tenant))
    assert exceeded["max_summary_tokens"] == str(cap)

    def compact_and_build(key: str, max_summary_tokens: int
                          ) -> tuple[int, pb.BuildResponse | Failure]:
        again = pb.BuildRequest()
        again.CopyFrom(req)
        resp = stub.Compact(pb.CompactRequest(
            tenant_id=tenant, session_id=session, checkpoint=again.checkpoint,
            reason="budget_pressure", idempotency_key=key, tokens_to_free=p["left_out_tokens"],
            max_summary_tokens=max_summary_tokens))
        assert resp.compacted and resp.summary.depth == 2
        again.checkpoint.summary.CopyFrom(resp.summary)
        try:
            return resp.tokens_after, stub.Build(again)
        except grpc.RpcError as err:
            return resp.tokens_after, failure(err)

    after, built = compact_and_build("at-cap", cap)
    assert isinstance(built, pb.BuildResponse) and built.pressure.fits
    summary = {c.class_name: c.used for c in built.budget.classes}["summary"]
    assert summary == after <= cap  # Compact measures the summary as Build costs it
    after, again = compact_and_build("twice", 2 * cap)
    assert after > cap and isinstance(again, Failure)
    assert again.reason == "BUDGET_EXCEEDED" and again.metadata["class"] == "summary"
    # a summary at the depth cap merges no more: no compaction helps, and no cap is named
    assert "max_summary_tokens" not in again.metadata



def test_a_summary_whose_constraints_alone_are_over_the_room_needs_no_compaction(
        stub, ids, db):
    """The rest fits without the summary, but not with what a merge keeps of it (its
    constraints verbatim): no cap makes the merged summary fit, so no compaction helps."""
    tenant, session = ids
    stub.Plan(plan_request(tenant, session, model=SMALL))
    rules = [f"rule {i}: " + "always cite the primary source verbatim " * 8 for i in range(12)]
    req = build_request(tenant, session, items=long_history(6))
    req.checkpoint.summary.CopyFrom(pb.Summary(
        text="short narrative", depth=1, replaced_through_sequence=8,
        trust=pb.TRUST_LEVEL_USER, constraints=rules))
    summary = {c.class_name: c.used for c in stub.Build(req).budget.classes}["summary"]

    def attempt(words: int):
        req.checkpoint.items[-1].user.text = "word " * words
        return refused(stub, req), last_pressure(db, tenant)

    # the current user message sized so that the rest leaves the summary a quarter of its cost
    a, _ = attempt(12_000)
    b, _ = attempt(13_000)
    per_word = (int(b.metadata["tokens"]) - int(a.metadata["tokens"])) / 1_000
    rest = int(a.metadata["tokens"]) - summary
    f, p = attempt(12_000 + int((int(a.metadata["limit"]) - summary // 4 - rest) / per_word))
    assert f.metadata["class"] == "current_user_message"
    over = int(f.metadata["tokens"]) - int(f.metadata["limit"])
    assert p["left_out_items"] > 0 and 0 < over < summary  # the rest fits without the summary
    assert p["compaction_needed"] is False
    # what a runtime following it would have done: every cap that could fit is refused (the
    # constraints are kept verbatim), and the summary's own cost merges into one no smaller
    for cap in (summary - over, summary // 2):
        with pytest.raises(grpc.RpcError) as err:
            compact(stub, tenant, session, req, f"m{cap}", p["left_out_tokens"],
                    max_summary_tokens=cap)
        assert failure(err.value).reason == "BUDGET_EXCEEDED"


def test_a_cap_the_working_state_constraints_leave_no_room_in_is_not_named(stub, ids, db):
    """A merge writes the working state's constraints into the summary beside the summary's
    own, verbatim: where those alone are over the room the rest leaves the summary, every cap
    is refused ``summary_constraints`` (or the merged summary does not fit), so no compaction
    helps and no cap is named; where the room holds them, one is."""
    tenant, session = ids
    stub.Plan(plan_request(tenant, session, model=SMALL))
    rules = [f"rule {i}: " + "always cite the primary source verbatim " * 8 for i in range(10)]
    req = build_request(tenant, session, items=long_history(6))
    req.checkpoint.working_state.constraints.extend(rules)
    req.checkpoint.working_state.constraint_trust.extend([pb.TRUST_LEVEL_USER] * len(rules))
    req.checkpoint.summary.CopyFrom(pb.Summary(  # a narrative a merge shrinks, no constraint
        text="narrative " * 14_000, depth=1, replaced_through_sequence=8,
        trust=pb.TRUST_LEVEL_USER))

    def attempt(words: int):
        req.checkpoint.items[-1].user.text = "word " * words
        return refused(stub, req), last_pressure(db, tenant)

    a, pa = attempt(1_000)
    assert pa["compaction_needed"] is True  # room for the constraints: a cap is named
    b, _ = attempt(2_000)
    per_word = (int(b.metadata["tokens"]) - int(a.metadata["tokens"])) / 1_000
    # the current user message sized so that the rest leaves the summary about 300 tokens
    f, p = attempt(1_000 + int((int(a.metadata["max_summary_tokens"]) - 300) / per_word))
    assert f.metadata["class"] == "summary" and p["left_out_items"] > 0
    assert p["compaction_needed"] is False and "max_summary_tokens" not in f.metadata
    # what a runtime told to compact within the room would have met
    with pytest.raises(grpc.RpcError) as err:
        compact(stub, tenant, session, req, "room", p["left_out_tokens"],
                max_summary_tokens=300)
    refusal = failure(err.value)
    assert (refusal.reason, refusal.metadata["class"]) == ("BUDGET_EXCEEDED",
                                                           "summary_constraints")
