"""Checkpoint validation and the whole-window check (builder.validate_checkpoint, build)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from context_engine.domain.budget import BudgetPolicy
from context_engine.domain.builder import SkillBody, build, validate_checkpoint
from context_engine.domain.errors import BudgetExceeded, InvalidInput
from context_engine.domain.items import ConversationItem, ToolCallItem
from context_engine.domain.request import ToolCall
from context_engine.domain.trust import TrustLevel

from tests import factories as f


def call_with_args(item_id: str, seq: int, call_id: str, arguments_json: str) -> ToolCallItem:
    return ToolCallItem(id=item_id, sequence=seq, run_id="run-1", item_trust=TrustLevel.USER,
                        calls=(ToolCall(call_id=call_id, name="web.fetch",
                                        arguments_json=arguments_json),))


def violations(items: list[ConversationItem], **fields: object) -> dict[str, str]:
    with pytest.raises(InvalidInput) as exc:
        validate_checkpoint(f.checkpoint(items, **fields))  # type: ignore[arg-type]
    e = exc.value
    assert e.metadata()["fields"] == ",".join(v.field for v in e.violations)
    return {v.field: v.description for v in e.violations}


def test_well_formed_checkpoint_passes() -> None:
    validate_checkpoint(f.checkpoint([
        f.user("u1", "q", 1), f.call("c1", 2, "call-1", "call-2"),
        f.result("r1", 3, "call-2", "b"), f.result("r2", 4, "call-1", "a"),
        f.user("u2", "more", 5),
    ]))


def test_duplicate_item_ids() -> None:
    v = violations([f.user("u1", "a", 1), f.user("u1", "b", 2)])
    assert list(v) == ["checkpoint.items[1].id"]
    assert "duplicate item id 'u1'" in v["checkpoint.items[1].id"]


def test_empty_item_id() -> None:
    v = violations([f.user("", "a", 1)])
    assert list(v) == ["checkpoint.items[0].id"]


def test_result_whose_call_is_absent() -> None:
    v = violations([f.user("u1", "q", 1), f.result("r1", 2, "call-9", "x")])
    assert list(v) == ["checkpoint.items[1].tool_result.call_id"]
    assert "orphan" in v["checkpoint.items[1].tool_result.call_id"]


def test_result_before_its_call() -> None:
    v = violations([f.user("u1", "q", 1), f.result("r1", 2, "call-1", "x"),
                    f.call("c1", 3, "call-1")])
    assert list(v) == ["checkpoint.items[1].tool_result.call_id", "checkpoint.items[2].tool_calls"]
    assert "no earlier tool call" in v["checkpoint.items[1].tool_result.call_id"]
    assert "has no result" in v["checkpoint.items[2].tool_calls"]


def test_call_without_a_result() -> None:
    v = violations([f.user("u1", "q", 1), f.call("c1", 2, "call-1", "call-2"),
                    f.result("r1", 3, "call-1", "x")])
    assert list(v) == ["checkpoint.items[1].tool_calls"]
    assert "'call-2' has no result" in v["checkpoint.items[1].tool_calls"]


def test_duplicate_results() -> None:
    v = violations([f.call("c1", 1, "call-1"), f.result("r1", 2, "call-1", "x"),
                    f.result("r2", 3, "call-1", "y")])
    assert list(v) == ["checkpoint.items[2].tool_result.call_id"]
    assert "already has a result" in v["checkpoint.items[2].tool_result.call_id"]


def test_duplicate_call_ids() -> None:
    v = violations([f.call("c1", 1, "call-1"), f.result("r1", 2, "call-1", "x"),
                    f.call("c2", 3, "call-1"), f.result("r2", 4, "call-1", "y")])
    assert "checkpoint.items[2].tool_calls.calls[0].call_id" in v


@pytest.mark.parametrize("arguments_json", [
    "[1, 2]", '"a string"', "42", "null", "true", "not json", "{'q': 1}", "", "{",
    '{"q": NaN}',
])
def test_non_json_object_arguments(arguments_json: str) -> None:
    v = violations([call_with_args("c1", 1, "call-1", arguments_json),
                    f.result("r1", 2, "call-1", "x")])
    assert list(v) == ["checkpoint.items[0].tool_calls.calls[0].arguments_json"]
    assert v["checkpoint.items[0].tool_calls.calls[0].arguments_json"] == "is not a JSON object"


def test_json_object_arguments_pass() -> None:
    validate_checkpoint(f.checkpoint([call_with_args("c1", 1, "call-1", '{"q": [1, {}]}'),
                                      f.result("r1", 2, "call-1", "x")]))


def test_call_item_without_calls_and_nameless_call() -> None:
    empty = ToolCallItem(id="c0", sequence=1, run_id="run-1", item_trust=TrustLevel.USER,
                         calls=())
    nameless = ToolCallItem(id="c1", sequence=2, run_id="run-1", item_trust=TrustLevel.USER,
                            calls=(ToolCall(call_id="call-1", name="", arguments_json="{}"),))
    v = violations([empty, nameless, f.result("r1", 3, "call-1", "x")])
    assert list(v) == ["checkpoint.items[0].tool_calls",
                       "checkpoint.items[1].tool_calls.calls[0].name"]


def test_items_out_of_sequence_order() -> None:
    v = violations([f.user("u1", "a", 5), f.user("u2", "b", 4)])
    assert list(v) == ["checkpoint.items[1].sequence"]


def test_nameless_loaded_skill() -> None:
    v = violations([f.user("u1", "a", 1)],
                   loaded_skills=(SkillBody(name="", body="x", trust=TrustLevel.USER),))
    assert list(v) == ["checkpoint.loaded_skills[0].name"]


def test_every_problem_is_reported_at_once() -> None:
    v = violations([
        f.user("u1", "q", 1), f.user("u1", "dup", 2),
        call_with_args("c1", 3, "call-1", "[]"),
        f.result("r0", 4, "call-0", "orphan"),
    ])
    assert list(v) == ["checkpoint.items[1].id",
                       "checkpoint.items[2].tool_calls.calls[0].arguments_json",
                       "checkpoint.items[3].tool_result.call_id",
                       "checkpoint.items[2].tool_calls"]


def test_a_negative_sequence_is_refused_on_the_pure_path_too() -> None:
    v = violations([f.user("u1", "a", -1), f.user("u2", "b", 0)])
    assert list(v) == ["checkpoint.items[0].sequence"]
    validate_checkpoint(f.checkpoint([f.user("u1", "a", 0), f.user("u2", "b", 0)]))


def test_a_working_state_over_its_caps_is_refused_by_the_pure_build() -> None:
    """The pure build() refuses what the served one does: a checkpoint's working state over a
    cap of the spec, or naming a task twice."""
    from context_engine.domain.items import WorkingState, WorkingTask

    lp = f.loaded()
    over = WorkingState(constraints=tuple(f"c{i}" for i in range(21)), tasks=(
        WorkingTask(id="t", title="a", state="open"), WorkingTask(id="t", title="b",
                                                                 state="open")))
    with pytest.raises(InvalidInput) as exc:
        f.run_build(lp, f.checkpoint([f.user("u1", "go", 1)], working_state=over))
    assert [v.field for v in exc.value.violations] == [
        "checkpoint.working_state.constraints", "checkpoint.working_state.tasks[1]"]
    at_caps = WorkingState(constraints=tuple(f"c{i}" for i in range(20)))
    f.run_build(lp, f.checkpoint([f.user("u1", "go", 1)], working_state=at_caps))


def test_a_knowledge_passages_attributes_are_one_line_on_the_pure_path_too() -> None:
    from context_engine.domain.items import KnowledgePassage

    passages = (KnowledgePassage(id="k\u2028x", source="docs", text="t", rank=1,
                                 trust=TrustLevel.MEMORY),
                KnowledgePassage(id="k2", source="a\rb", text="t", rank=2,
                                 trust=TrustLevel.MEMORY),
                # tag characters: text a reader does not see and a model may read
                KnowledgePassage(id="k3", source="docs\U000e0053\U000e0059\U000e0053", text="t",
                                 rank=3, trust=TrustLevel.MEMORY))
    v = violations([f.user("u1", "a", 1)], knowledge=passages)
    assert list(v) == ["checkpoint.knowledge[0].id", "checkpoint.knowledge[1].source",
                       "checkpoint.knowledge[2].source"]


def test_a_plans_envelope_attributes_are_one_line_on_the_pure_path_too() -> None:
    """A tool's server (the index entry's source, row 6) and the snapshot's id (row 8): the
    pure drafts refuse what the API refuses, a line break or a bidi override in either."""
    from context_engine.domain.canonical import session_key
    from context_engine.domain.model import MemoryItem, MemorySnapshot
    from context_engine.domain.plan import draft_pinned, redraft

    bad = MemorySnapshot(snapshot_id="s\u2028\u202e1", items=(MemoryItem(id="m", text="t"),))
    i = f.inputs(tool_call=True, deferred=("mail.send",), catalog=(
        f.tool("web.fetch", server="web"), f.tool("mail.send", server="srv\u2028\u202eevil")),
                 snapshot=bad)
    with pytest.raises(InvalidInput) as exc:
        f.draft(i)
    assert [v.field for v in exc.value.violations] == ["tool_catalog[1].server",
                                                       "memory_snapshot.snapshot_id"]
    good = f.inputs()
    key, est = session_key(good.tenant_id, good.session_id), f.estimator(good.model)
    pinned = f.draft(good).spec
    for draft in (lambda: draft_pinned(replace(good, memory_snapshot=bad), pinned, key, est),
                  lambda: redraft(pinned, key, est, snapshot=bad)):
        with pytest.raises(InvalidInput) as exc:
            draft()
        assert [v.field for v in exc.value.violations] == ["memory_snapshot.snapshot_id"]


def test_build_rejects_a_malformed_checkpoint() -> None:
    lp = f.loaded()
    with pytest.raises(InvalidInput) as exc:
        f.run_build(lp, f.checkpoint([f.call("c1", 1, "call-1")]))
    assert exc.value.metadata() == {"fields": "checkpoint.items[0].tool_calls"}


def test_field_prefix_is_configurable() -> None:
    with pytest.raises(InvalidInput) as exc:
        validate_checkpoint(f.checkpoint([f.result("r1", 1, "x", "y")]), field="req.cp")
    assert exc.value.violations[0].field == "req.cp.items[0].tool_result.call_id"


# ----------------------------------------------------------------------------- whole window

def _loaded(window: int, reserve: int = 1_000):  # type: ignore[no-untyped-def]
    return f.loaded(f.inputs(model_profile=f.model(context_window=window,
                                                   output_reserve=reserve)))


def test_budget_exceeded_when_prefix_and_body_exceed_window_minus_reserve() -> None:
    lp = _loaded(4_000, reserve=1_000)
    big = " ".join(f"w{i}" for i in range(3_000))
    with pytest.raises(BudgetExceeded) as exc:
        f.run_build(lp, f.checkpoint([f.user("u1", big, 1)]))
    e = exc.value
    # the current user message never yields: the call fails naming its class
    assert e.class_name == "current_user_message"
    body_budget = 3_000 - 150 - lp.plan.prefix_tokens  # reserve off first, then the 5% margin
    assert e.limit == body_budget
    assert e.tokens > body_budget
    assert e.metadata() == {"class": "current_user_message", "tokens": str(e.tokens),
                            "limit": str(body_budget), "unit": "tokens"}


def test_window_boundary_is_exact() -> None:
    exact = BudgetPolicy(safety_margin_ratio=0.0)
    cp = f.checkpoint([f.user("u1", "hello " * 200, 1)])
    lp0 = f.loaded()
    total = build(lp0, cp, estimator=f.estimator(lp0.plan.spec.model),
                  policy=exact).estimated_input_tokens
    lp = _loaded(total + 1_000)
    fits = build(lp, cp, estimator=f.estimator(lp.plan.spec.model), policy=exact)
    assert fits.estimated_input_tokens == total
    assert fits.estimated_input_tokens <= fits.context_window - fits.output_reserve
    lp = _loaded(total + 999)
    with pytest.raises(BudgetExceeded) as exc:
        build(lp, cp, estimator=f.estimator(lp.plan.spec.model), policy=exact)
    body = total - lp.plan.prefix_tokens
    assert (exc.value.tokens, exc.value.limit) == (body, body - 1)


def test_prefix_alone_can_exceed_a_tiny_window() -> None:
    lp = _loaded(1_200, reserve=1_000)
    assert lp.plan.prefix_tokens > 200
    with pytest.raises(BudgetExceeded) as exc:
        f.run_build(lp, f.checkpoint([f.user("u1", "hi", 1)]))
    assert exc.value.class_name == "prefix"


def test_correction_factor_counts_toward_the_window() -> None:
    cp = f.checkpoint([f.user("u1", "hello " * 400, 1)])
    total = f.run_build(f.loaded(), cp).estimated_input_tokens
    lp = _loaded(total + 1_000 + total // 15)  # room for the 5% safety margin
    f.run_build(lp, cp, factor=1.0)
    with pytest.raises(BudgetExceeded):
        f.run_build(lp, cp, factor=1.5)


def test_reserve_is_never_spent_on_input() -> None:
    lp = _loaded(10_000, reserve=8_000)
    body = " ".join(f"w{i}" for i in range(300))
    r = build(lp, f.checkpoint([f.user("u1", body, 1)]),
              estimator=f.estimator(lp.plan.spec.model))
    assert r.estimated_input_tokens <= r.context_window - r.output_reserve
    with pytest.raises(BudgetExceeded):
        build(lp, f.checkpoint([f.user("u1", body * 3, 1)]),
              estimator=f.estimator(lp.plan.spec.model))


def test_another_runs_item_inside_a_tool_pair() -> None:
    """The cut sees the two runs apart and would split the pair under pressure: refused at the
    boundary (INVALID_ARGUMENT), never an assembly error later."""
    items: list[ConversationItem] = [
        f.user("u0", "q", 1, run="run-1"), f.call("c1", 2, "call-1", run="run-1"),
        f.user("u1", "meanwhile", 3, run="run-2"), f.result("r1", 4, "call-1", "x", run="run-1"),
        f.user("u2", "more", 5, run="run-1")]
    v = violations(items, run="run-1")
    assert list(v) == ["checkpoint.items[2].run_id"]
    assert "a tool pair never spans two runs" in v["checkpoint.items[2].run_id"]
