"""The budget allocator, class caps, never-yield classes, tool-result pointers and excerpts,
the summary floor, attachments and estimator reconciliation, by example (spec: "The budget
allocator" through "The token estimator")."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, cast

import pytest
from context_engine.domain import calibration
from context_engine.domain.budget import (
    HISTORY_FLOOR_TOKENS,
    BudgetPolicy,
    Pressure,
    compute_budget,
    require_history_floor,
)
from context_engine.domain.builder import (
    BuildResult,
    LoadedPlan,
    SkillBody,
    build,
    prefix_exact,
    working_state_tokens,
)
from context_engine.domain.calibration import Calibration, reconcile
from context_engine.domain.errors import BudgetExceeded, HistoryFloorUnreachable
from context_engine.domain.estimator import (
    ATTACHMENT_BUDGET_TOKENS,
    MESSAGE_OVERHEAD_TOKENS,
    WORST_IMAGE_TOKENS,
    TokenEstimator,
    attachment_tokens,
)
from context_engine.domain.excerpts import head_tail_excerpt, normalize_tool_results
from context_engine.domain.items import (
    MAX_DEPTH,
    AssistantMessageItem,
    ConversationItem,
    HistorySummary,
    KnowledgePassage,
    MemoryLine,
    ReasoningItem,
    RecallItem,
    RenderContext,
    ToolResultItem,
    UserMessageItem,
    WorkingState,
    WorkingStateItem,
)
from context_engine.domain.request import Attachment, AttachmentKind, Message, Role
from context_engine.domain.trust import TrustLevel
from context_engine.domain.working_state import Update, apply_update
from hypothesis import given, settings
from hypothesis import strategies as st

from tests import factories as f
from tests.support.provider_tokens import encoding as oracle_encoding
from tests.unit import helpers as h

WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa", "omega",
         "ok", "42", "{\"id\": 7,", "<td>", "</td>", "the", "result")


def words(n: int, seed: int = 0) -> str:
    return " ".join(WORDS[(seed + 7 * i + i // 5) % len(WORDS)] for i in range(n))


_PLANS: dict[tuple[str, int, int | None], LoadedPlan] = {}


def plan(model_id: str = "gpt-4o", window: int = 16_000, reserve: int | None = 4_096
         ) -> LoadedPlan:
    key = (model_id, window, reserve)
    if key not in _PLANS:
        caps = {"context_window": window}
        if reserve is not None:
            caps["output_reserve"] = reserve
        _PLANS[key] = f.loaded(f.inputs(model_profile=f.model(model_id, **caps),
                                        skills=f.skill_catalog("a", "b", "c")))
    return _PLANS[key]


def run(lp: LoadedPlan, items: list[ConversationItem], *, run_id: str = "run-1",
        policy: BudgetPolicy | None = None, factor: float = 1.0, **fields: Any) -> BuildResult:
    cp = f.checkpoint(items, run=run_id, **fields)
    return build(lp, cp, estimator=f.estimator(lp.plan.spec.model), factor=factor,
                 policy=policy or BudgetPolicy())


def cost_of(lp: LoadedPlan, item: Any, factor: float = 1.0) -> int:
    ctx = RenderContext(session_key=lp.session_key)
    return f.estimator(lp.plan.spec.model).messages(item.messages(ctx), factor)


def recount(lp: LoadedPlan, r: BuildResult, factor: float = 1.0) -> int:
    est = f.estimator(lp.plan.spec.model)
    return sum(est.message(m, factor) for m in r.request.messages)


def assistant(item_id: str, text: str, seq: int, run_id: str = "run-0") -> AssistantMessageItem:
    return AssistantMessageItem(id=item_id, sequence=seq, run_id=run_id,
                                item_trust=TrustLevel.USER, text=text)


def klass(r: BuildResult, name: str) -> Any:
    return next(c for c in r.budget.classes if c.class_name == name)


def by_id(r: BuildResult) -> dict[str, Message]:
    return {m.item_id: m for m in r.request.messages if m.item_id}


def body(m: Message) -> str:
    """The content of a message's one envelope, as the content was given (the envelope puts
    it on its own lines)."""
    text = h.unescape(h.only_envelope(m.text).body)
    assert text.startswith("\n") and text.endswith("\n")
    return text[1:-1]


def last_user(text: str = "and now?", seq: int = 100, **kw: Any) -> UserMessageItem:
    return f.user("u-last", text, seq, run="run-1", **kw)


# ----------------------------------------------------------------------------- arithmetic

def test_budget_arithmetic_reserve_first_then_margin_then_prefix() -> None:
    b = compute_budget(window=200_000, output_reserve=8_192, prefix_tokens=1_000,
                       policy=BudgetPolicy())
    assert b.total_tokens == 200_000
    assert b.output_reserve == 8_192
    # the 5% margin is taken of what is left after the reserve, rounded up
    assert b.margin_tokens == math.ceil((200_000 - 8_192) * 0.05) == 9_591
    assert b.body_budget == 200_000 - 8_192 - 9_591 - 1_000


@pytest.mark.parametrize(("window", "cap", "total"), [
    (200_000, 0, 200_000), (200_000, 50_000, 50_000), (32_000, 50_000, 32_000),
    (1_000_000, 128_000, 128_000)])
def test_capacity_is_the_smaller_of_window_and_policy_cap(window: int, cap: int,
                                                          total: int) -> None:
    b = compute_budget(window=window, output_reserve=8_192, prefix_tokens=500,
                       policy=BudgetPolicy(policy_cap_tokens=cap))
    assert b.total_tokens == total
    assert b.body_budget == total - 8_192 - math.ceil((total - 8_192) * 0.05) - 500


@pytest.mark.parametrize("ratio", [0.0, 0.05, 0.1, 0.2])
def test_the_safety_margin_is_configurable(ratio: float) -> None:
    b = compute_budget(window=100_000, output_reserve=10_000, prefix_tokens=0,
                       policy=BudgetPolicy(safety_margin_ratio=ratio))
    assert b.margin_tokens == math.ceil(90_000 * ratio)
    assert b.body_budget == 90_000 - b.margin_tokens


def test_a_prefix_that_leaves_no_body_fails() -> None:
    with pytest.raises(BudgetExceeded) as info:
        compute_budget(window=16_000, output_reserve=8_000, prefix_tokens=7_700,
                       policy=BudgetPolicy())
    assert info.value.class_name == "prefix"
    # 8,000 - 400 (5%) = 7,600 allowed
    assert (info.value.tokens, info.value.limit) == (7_700, 7_600)


def test_a_prefix_that_leaves_a_body_of_zero_names_a_shortfall() -> None:
    """A prefix exactly filling the room read "needs 7600 tokens but only 7600 are allowed":
    the request needs the prefix and at least one token of body."""
    with pytest.raises(BudgetExceeded) as info:
        compute_budget(window=16_000, output_reserve=8_000, prefix_tokens=7_600,
                       policy=BudgetPolicy())
    assert (info.value.tokens, info.value.limit) == (7_601, 7_600)
    assert "needs 7601 tokens but only 7600" in str(info.value)
    assert compute_budget(window=16_000, output_reserve=8_000, prefix_tokens=7_599,
                          policy=BudgetPolicy()).body_budget == 1


@pytest.mark.parametrize(("model_id", "reserve"), [("claude-sonnet-4-5", 8_192),
                                                   ("gpt-4o", 16_384)])
def test_build_reports_the_budget_with_the_models_default_reserve(model_id: str,
                                                                  reserve: int) -> None:
    lp = plan(model_id, 128_000, None)
    r = run(lp, [last_user()], factor=1.25)
    b = r.budget
    assert r.output_reserve == b.output_reserve == reserve
    assert b.total_tokens == 128_000
    assert b.margin_tokens == math.ceil((128_000 - reserve) * 0.05)
    # Claude's prefix was counted with cl100k_base x 1.3, an estimate: the factor scales it like
    # the body; gpt-4o's was counted with its own encoding and is never scaled
    prefix = (math.ceil(lp.plan.prefix_tokens * 1.25) if model_id.startswith("claude")
              else lp.plan.prefix_tokens)
    assert b.body_budget == 128_000 - reserve - b.margin_tokens - prefix
    assert b.prefix_tokens == prefix and r.prefix_tokens == lp.plan.prefix_tokens  # measured
    assert b.estimated_total == r.estimated_input_tokens == b.prefix_tokens + r.body_tokens
    assert b.body_tokens == r.body_tokens == recount(lp, r, 1.25)
    assert b.estimator_factor == r.estimator_factor == 1.25
    assert b.safety_margin_ratio == 0.05
    assert b.history_floor == HISTORY_FLOOR_TOKENS == 8_000
    names = {c.class_name for c in b.classes}
    assert {"knowledge", "recall", "tool_results", "history", "current_user_message"} <= names
    assert klass(r, "knowledge").cap == 3_000 and klass(r, "recall").cap == 2_000
    assert klass(r, "tool_results").cap == int(b.body_budget * 0.25)
    assert klass(r, "current_user_message").used == r.body_tokens - klass(
        r, "runtime_metadata").used


def test_a_pinned_factor_scales_the_body_and_is_echoed() -> None:
    lp = plan()
    items = [f.user("u0", words(300), 1, run="run-0"), assistant("a0", words(300, 1), 2),
             last_user(words(50, 2))]
    plain, scaled = run(lp, items), run(lp, items, factor=1.5)
    assert scaled.estimator_factor == 1.5 and plain.estimator_factor == 1.0
    assert scaled.body_tokens > plain.body_tokens
    assert scaled.body_tokens == recount(lp, scaled, 1.5)
    assert scaled.prefix_tokens == plain.prefix_tokens  # the prefix is measured exactly


# ----------------------------------------------------------------------------- class caps

def passage(pid: str, n: int, rank: int) -> KnowledgePassage:
    return KnowledgePassage(id=pid, source="handbook", text=words(n, rank) + f" [{pid}]",
                            rank=rank, trust=TrustLevel.EXTERNAL_UNTRUSTED)


def knowledge_text(r: BuildResult) -> str:
    return "".join(m.text for m in r.request.messages
                   if m.text.startswith("Knowledge passages"))


def test_knowledge_keeps_at_most_three_passages_dropping_the_lowest_ranked_whole() -> None:
    lp = plan("claude-sonnet-4-5", 200_000, None)
    ps = (passage("p4", 50, 4), passage("p1", 50, 1), passage("p3", 50, 3),
          passage("p2", 50, 2), passage("p0", 50, 0))
    r = run(lp, [last_user()], knowledge=ps)
    text = knowledge_text(r)
    kept = [p for p in ps if f'id="{p.id}"' in text]
    assert sorted(p.id for p in kept) == ["p0", "p1", "p2"]
    for p in kept:
        assert p.text in text  # verbatim, never truncated
    step = next(s for s in r.pressure.steps if s.step == "knowledge")
    assert step.ids == ("p4", "p3")
    assert klass(r, "knowledge").items == 3


class CountingCounter:
    """A token counter that adds up the characters it is asked to count."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.name, self.encoding = inner.name, inner.encoding
        self.characters = 0

    def count(self, text: str) -> int:
        self.characters += len(text)
        return int(self._inner.count(text))


def test_passages_past_the_item_cap_are_counted_once_not_once_each() -> None:
    """4,000 one-word passages took 235 s: each dropped passage re-rendered and re-counted the
    whole block (quadratic). The characters counted now grow with the passages, not with their
    square, and the step still names every dropped passage, lowest-ranked first."""
    lp = plan("gpt-4o", 128_000, None)
    counted = []
    for n in (500, 2_000):
        ps = tuple(KnowledgePassage(id=f"k{k}", source="s", text="x", rank=k,
                                    trust=TrustLevel.EXTERNAL_UNTRUSTED) for k in range(n))
        counter = CountingCounter(f.REGISTRY.counter_for(lp.plan.spec.encoding)[0])
        r = build(lp, f.checkpoint([last_user()], knowledge=ps),
                  estimator=TokenEstimator(counter, lp.plan.spec.estimator_factor),
                  policy=BudgetPolicy())
        step = next(s for s in r.pressure.steps if s.step == "knowledge")
        assert step.ids == tuple(f"k{k}" for k in reversed(range(3, n)))
        assert klass(r, "knowledge").items == 3
        counted.append(counter.characters)
    assert counted[1] < 6 * counted[0], counted  # 4x the passages: 4x, not 16x


def test_the_knowledge_class_reports_how_many_passages_yielded() -> None:
    lp = plan("claude-sonnet-4-5", 200_000, None)
    ps = tuple(passage(f"p{k}", 50, k) for k in range(5))
    r = run(lp, [last_user()], knowledge=ps)
    assert klass(r, "knowledge").items == 3
    assert klass(r, "knowledge").yielded == 2


def test_knowledge_over_3000_tokens_drops_whole_passages_never_truncates() -> None:
    lp = plan("claude-sonnet-4-5", 200_000, None)
    ps = (passage("a", 500, 0), passage("b", 500, 1), passage("c", 500, 2))
    r = run(lp, [last_user()], knowledge=ps)
    used = klass(r, "knowledge").used
    assert 0 < used <= 3_000
    text = knowledge_text(r)
    for p in ps:
        present = f'id="{p.id}"' in text
        assert present == (p.text in text), f"passage {p.id} was cut, not dropped"
    kept = [p.id for p in ps if f'id="{p.id}"' in text]
    assert kept == ["a", "b"]  # the lowest-ranked passage went, whole
    step = next(s for s in r.pressure.steps if s.step == "knowledge")
    assert step.ids == ("c",)


def test_recall_is_capped_at_2000_tokens_trimmed_from_the_end() -> None:
    lp = plan("claude-sonnet-4-5", 200_000, None)
    lines = tuple(MemoryLine(id=f"m{k}", text=words(300, k)) for k in range(6))
    r = run(lp, [last_user()], recall=lines)
    rec = klass(r, "recall")
    assert 0 < rec.used <= 2_000 and rec.items + rec.yielded == 6 and rec.yielded > 0
    text = "".join(m.text for m in r.request.messages if m.text.startswith("Recalled"))
    assert all(f"[m{k}] " in text for k in range(rec.items))
    assert not any(f"[m{k}] " in text for k in range(rec.items, 6))


def recall_kept_one_line_at_a_time(lp: LoadedPlan, lines: tuple[MemoryLine, ...],
                                   thresholds: tuple[int, ...]) -> int:
    """The reference: for each threshold in turn, the last line dropped while the block costs
    more than it (the block re-rendered and re-counted for every line); the count kept."""
    k = len(lines)
    for threshold in thresholds:
        while k and cost_of(lp, RecallItem(lines=lines[:k])) > threshold:
            k -= 1
    return k


@pytest.mark.parametrize("model_id", ["gpt-4o", "claude-sonnet-4-5"])
@pytest.mark.parametrize("floor", [500, 0])
@pytest.mark.parametrize("history_items", [0, 40, 160])
def test_recall_keeps_the_lines_dropping_one_at_a_time_keeps(model_id: str, floor: int,
                                                            history_items: int) -> None:
    """Against the reference above, through the class cap and the three ladder steps that trim
    recall. No results and no knowledge: what is not recall is a fixed total and history, so
    each step is a threshold on the block's cost: recall's cap; the body budget less the rest
    but not below recall's floor; the room history's floor (8,000 tokens, or all of it) leaves.
    Windows from roomy to too small to keep any line; histories of none, of less than history's
    floor and of more (where recall keeps its floor and history is cut instead)."""
    lines = tuple(MemoryLine(id=f"m{k}", text=words(5 + (k * 37) % 90, k)) for k in range(60))
    history: list[ConversationItem] = [
        f.user(f"h{k}", words(60, k), k + 1, run="run-0") if k % 2 == 0
        else assistant(f"h{k}", words(60, k), k + 1) for k in range(history_items)]
    # the reference agrees with any search only where a longer head never costs less
    roomy = plan(model_id, 200_000, None)
    costs = [cost_of(roomy, RecallItem(lines=lines[:k])) if k else 0
             for k in range(len(lines) + 1)]
    assert costs == sorted(costs)
    alone = run(roomy, [last_user()], recall=lines)
    fixed = alone.pressure.tokens_after - klass(alone, "recall").used  # the turn's own rows
    seen = set()
    for window in (*range(1_100, 2_000, 20), *range(2_000, 12_000, 100),
                   *range(12_000, 30_001, 500), 200_000):
        lp = plan(model_id, window, 1_000)
        try:
            r = run(lp, [*history, last_user(seq=1_000)], recall=lines,
                    policy=BudgetPolicy(recall_floor_tokens=floor))
        except (BudgetExceeded, HistoryFloorUnreachable):
            continue
        rec = klass(r, "recall")
        # what is not recall as the recall steps saw it: before history's cut
        others = r.pressure.tokens_after - rec.used + r.pressure.left_out_tokens
        held = others - fixed  # history's cost
        B = r.pressure.body_budget
        expected = recall_kept_one_line_at_a_time(lp, lines, (
            2_000, max(B - others, floor), B - min(8_000, held) - (others - held)))
        assert rec.items == expected, window
        assert rec.used == (cost_of(lp, RecallItem(lines=lines[:expected])) if expected else 0)
        dropped = tuple(f"m{k}" for k in reversed(range(expected, len(lines))))
        assert next(s for s in r.pressure.steps if s.step == "recall").ids == dropped
        seen.add("none" if not expected else "under the cap" if B - others < 2_000 else "cap")
    assert seen == {"none", "under the cap", "cap"}, seen


def test_recall_over_its_cap_is_counted_a_few_times_not_once_per_line() -> None:
    """4,000 recall lines took 13-23 s: each line dropped re-rendered and re-counted the whole
    block (quadratic). The characters counted now grow with the lines times their logarithm,
    not with their square."""
    lp = plan("gpt-4o", 128_000, None)
    counted = []
    for n in (500, 2_000):
        lines = tuple(MemoryLine(id=f"m{k}", text=f"fact {k}") for k in range(n))
        counter = CountingCounter(f.REGISTRY.counter_for(lp.plan.spec.encoding)[0])
        r = build(lp, f.checkpoint([last_user()], recall=lines),
                  estimator=TokenEstimator(counter, lp.plan.spec.estimator_factor),
                  policy=BudgetPolicy())
        rec = klass(r, "recall")
        assert rec.used <= 2_000 and rec.items + rec.yielded == n
        assert rec.items == recall_kept_one_line_at_a_time(lp, lines, (2_000,))
        counted.append(counter.characters)
    assert counted[1] < 7 * counted[0], counted  # 4x the lines: about 5x, not 16x


def test_tool_results_over_a_quarter_of_the_body_become_pointers_oldest_first() -> None:
    lp = plan()  # 16k window: a body of about 10.8k tokens, 2.7k for tool results
    items: list[ConversationItem] = [f.user("u0", "fetch four pages", 1, run="run-0")]
    for k in range(4):
        items += [f.call(f"c{k}", 2 + 2 * k, f"x{k}", run="run-0"),
                  f.result(f"r{k}", 3 + 2 * k, f"x{k}", words(400, k), run="run-0")]
    items += [assistant("a0", "done", 20), last_user()]
    r = run(lp, items)
    B = r.budget.body_budget
    tool = klass(r, "tool_results")
    assert tool.cap == int(B * 0.25)
    assert tool.used <= tool.cap
    msgs = by_id(r)
    elided = [k for k in range(4) if "[elided]" in msgs[f"r{k}"].text]
    assert elided == list(range(len(elided))) and 0 < len(elided) < 4  # oldest first
    # no further than the cap needs: restoring the newest pointer would exceed it
    newest = next(i for i in items if i.id == f"r{elided[-1]}")
    assert isinstance(newest, ToolResultItem)
    assert tool.used - cost_of(lp, replace(newest, elided=True)) + cost_of(lp, newest) \
        > tool.cap
    assert r.body_tokens <= B and not r.pressure.compaction_needed


def _exact_allocation(fixed: int, costs: list[int], *, active: bool = False,
                      sent: list[str] | None = None) -> list[str]:
    """``allocate`` over results whose pointer costs 100 tokens (a result costs the number its
    content spells), a body of 10,000 (tool results' cap 2,500) and ``fixed`` tokens that
    never yield; the ids of the results that became pointers. ``active``: the results are the
    active run's (completed: an answer closes the run), not history's."""
    from context_engine.domain.budget import Budget, allocate

    results: list[ConversationItem] = [
        ToolResultItem(id=f"r{k}", sequence=k + 1, run_id="run-0", item_trust=TrustLevel.USER,
                       call_id=f"c{k}", tool_name="t", content=str(c))
        for k, c in enumerate(costs)]

    def cost(item: Any) -> int:
        return 100 if getattr(item, "elided", False) else int(getattr(item, "content", "0"))

    closing = assistant("a", "done", len(costs) + 1)
    a = allocate(budget=Budget(total_tokens=20_000, output_reserve=0, margin_tokens=0,
                               body_budget=10_000),
                 prefix_tokens=0, factor=1.0, policy=BudgetPolicy(), summary=None,
                 carried=[] if active else results, floor=0,
                 active=[*results, closing] if active else [],
                 fixed={"current_user_message": fixed},
                 knowledge=[], recall=[], cost=cost, legacy_tool_excerpts=0,
                 position=lambda i: i, pointer=lambda r: replace(r, elided=True))
    assert a.pressure.fits
    if sent is not None:  # what the request holds of each result: "pointer" or its content
        sent += [("pointer" if cast(ToolResultItem, r).elided else cast(ToolResultItem, r).content)
                 for r in (*a.history, *a.active) if isinstance(r, ToolResultItem)]
    return [i for s in a.pressure.steps if s.step == "tool_results" for i in s.ids]


def test_results_become_pointers_until_the_excess_is_freed_and_not_one_more() -> None:
    """Over the cap by exactly what one pointer frees (900): one pointer, the class then at its
    cap; over the body by exactly what one more frees, after the cap's two: three."""
    assert _exact_allocation(0, [1_000, 1_000, 1_000, 400]) == ["r0"]
    assert _exact_allocation(0, [1_000, 1_000, 1_000, 401]) == ["r0", "r1"]
    assert _exact_allocation(8_700, [1_000] * 4) == ["r0", "r1", "r2"]
    assert _exact_allocation(8_701, [1_000] * 4) == ["r0", "r1", "r2", "r3"]


def test_the_active_runs_results_take_the_same_steps_from_its_first_item() -> None:
    """Completed results of the active run become pointers like history's, the run's first
    item included (here the run begins with a result)."""
    assert _exact_allocation(0, [1_000, 1_000, 1_000, 401], active=True) == ["r0", "r1"]
    assert _exact_allocation(8_700, [1_000] * 4, active=True) == ["r0", "r1", "r2"]


def test_what_pointers_free_comes_off_the_class_that_holds_them() -> None:
    """The tokens a pointer frees come off the class of the item it replaced: with every
    result in the active run (completed), history holds one plain message at its own cost and
    the active run its results at their pointers' (100 each) or contents' costs."""
    from context_engine.domain.budget import Budget, allocate

    def cost(item: Any) -> int:
        if isinstance(item, ToolResultItem):
            return 100 if item.elided else int(item.content)
        return 7

    results: list[ConversationItem] = [
        ToolResultItem(id=f"r{k}", sequence=k + 2, run_id="run-1", item_trust=TrustLevel.USER,
                       call_id=f"c{k}", tool_name="t", content=str(c))
        for k, c in enumerate([1_000, 1_000, 1_000, 401])]
    a = allocate(budget=Budget(total_tokens=20_000, output_reserve=0, margin_tokens=0,
                               body_budget=10_000),
                 prefix_tokens=0, factor=1.0, policy=BudgetPolicy(), summary=None,
                 carried=[assistant("h", "earlier", 1)], floor=0,
                 active=[*results, assistant("a", "done", 9, run_id="run-1")],
                 fixed={"current_user_message": 0}, knowledge=[], recall=[], cost=cost,
                 legacy_tool_excerpts=0, position=lambda i: i,
                 pointer=lambda r: replace(r, elided=True))
    assert [i for s in a.pressure.steps for i in s.ids] == ["r0", "r1"]
    used = {c.class_name: c.used for c in a.report.classes}
    assert used["history"] == 7
    assert used["active_run"] == 100 + 100 + 1_000 + 401 + 7
    assert used["tool_results"] == 100 + 100 + 1_000 + 401


FLOOR = 20  # what the least narrative a compaction writes costs here, its envelope included


def _over_with_summary(summary_tokens: int, *, bare: int = 300, rest: int = 3_000,
                       body: int = 10_000, depth: int = 1) -> BudgetExceeded | None:
    """``allocate`` with a summary that costs ``summary_tokens`` (``bare`` without its
    narrative, what a merge keeps, and ``FLOOR`` more with the least narrative a compaction
    writes), a current user message of ``rest`` tokens and two history items a body of
    ``body`` leaves out: the refusal, or None where it fits."""
    from context_engine.domain.budget import Budget, allocate
    from context_engine.domain.items import NARRATIVE_FLOOR

    summary = HistorySummary(text="narrative", depth=depth, replaced_through_sequence=1)
    carried: list[ConversationItem] = [assistant(f"a{k}", "600", k + 2) for k in range(2)]

    def cost(item: Any) -> int:
        if isinstance(item, HistorySummary):
            if item.text == NARRATIVE_FLOOR:
                return bare + FLOOR
            return summary_tokens if item.text else bare
        return int(cast(AssistantMessageItem, item).text)

    try:
        allocate(budget=Budget(total_tokens=body, output_reserve=0, margin_tokens=0,
                               body_budget=body),
                 prefix_tokens=0, factor=1.0, policy=BudgetPolicy(), summary=summary,
                 carried=carried, floor=0, active=[],
                 fixed={"current_user_message": rest, "summary": summary_tokens},
                 knowledge=[], recall=[], cost=cost, legacy_tool_excerpts=0,
                 position=lambda i: i)
    except BudgetExceeded as exc:
        return exc
    return None


def test_a_refusal_compaction_helps_names_the_largest_summary_cap_that_fits() -> None:
    """The room the rest leaves the summary: a merged summary costing the cap fits the body,
    one costing a token more does not; the other keys are as they were."""
    over = _over_with_summary(12_000)
    assert over is not None and cast(Pressure, over.pressure).compaction_needed
    meta = over.metadata()
    assert meta == {"class": "summary", "tokens": "15000", "limit": "10000", "unit": "tokens",
                    "max_summary_tokens": "7000"}
    cap = int(meta["max_summary_tokens"])
    assert _over_with_summary(cap) is None  # all of the history left out, but it fits
    assert _over_with_summary(cap + 1) is not None


def test_no_summary_cap_where_compaction_cannot_help() -> None:
    """Not where a merge cannot make it fit (the summary at the depth cap, its constraints
    and pointers alone over the room, the rest over the body without it): no cap does."""
    for over in (_over_with_summary(12_000, depth=2), _over_with_summary(12_000, bare=7_000),
                 _over_with_summary(12_000, rest=10_500),
                 # the kept part fits the room, but not with the least narrative (a merge has
                 # the earlier narrative to narrate): Compact would refuse that cap
                 _over_with_summary(12_000, bare=7_000 - FLOOR)):
        assert over is not None and not cast(Pressure, over.pressure).compaction_needed
        assert "max_summary_tokens" not in over.metadata()


def test_the_summary_cap_is_at_most_the_largest_a_compaction_takes() -> None:
    over = _over_with_summary(130_000, body=100_000)
    assert over is not None and over.metadata()["max_summary_tokens"] == "32000"


def test_a_result_whose_pointer_frees_nothing_keeps_its_content() -> None:
    """Results that cost no more than their pointer (100) are passed over: the step goes on to
    the next ones, and names only the results that became pointers."""
    sent: list[str] = []
    assert _exact_allocation(0, [50, 100, 1_000, 1_000, 1_000, 1_000], sent=sent) == ["r2", "r3"]
    assert sent == ["50", "100", "pointer", "pointer", "1000", "1000"]


def test_a_pointer_keeps_trust_envelope_bytes_event_and_artifact() -> None:
    content = "x" * 4_214
    item = ToolResultItem(id="8f21", sequence=3, run_id="run-0",
                          item_trust=TrustLevel.EXTERNAL_UNTRUSTED, call_id="x0",
                          tool_name="web.fetch", content=content, artifact_ref="artifact:a/9d02",
                          event_id=77)
    assert replace(item, elided=True).pointer() == \
        "[elided] tool.result 8f21 (external_untrusted, 4,214 bytes) -> artifact:a/9d02 (event:77)"
    no_artifact = replace(item, artifact_ref="", item_trust=TrustLevel.USER)
    assert no_artifact.pointer() == "[elided] tool.result 8f21 (user, 4,214 bytes) -> event:77"
    # the byte count is of the canonical content, also when an excerpt is rendered
    excerpted = replace(item, content="short", context_content="", byte_length=4_214)
    assert "(external_untrusted, 4,214 bytes)" in excerpted.pointer()

    ctx = RenderContext(session_key="tenant-a/session-1")
    [m] = replace(item, elided=True).messages(ctx)
    assert m.role is Role.TOOL and m.call_id == "x0" and m.item_id == "8f21"
    assert m.trust is TrustLevel.EXTERNAL_UNTRUSTED
    env = h.only_envelope(m.text)
    assert env.tag == "untrusted" and env.source == "tool:web.fetch" and env.item_id == "8f21"
    assert body(m) == replace(item, elided=True).pointer()


def test_pointers_in_a_build_keep_each_results_trust_and_reference() -> None:
    lp = plan()
    trusts = (TrustLevel.EXTERNAL_UNTRUSTED, TrustLevel.USER, TrustLevel.MEMORY)
    items: list[ConversationItem] = [f.user("u0", "go", 1, run="run-0"),
                                     f.call("c0", 2, "x0", "x1", "x2", run="run-0")]
    for k, trust in enumerate(trusts):
        items.append(replace(f.result(f"r{k}", 3, f"x{k}", words(900, k), run="run-0",
                                      trust=trust),
                             event_id=500 + k, artifact_ref="artifact://big/1" if k == 2 else ""))
    items += [assistant("a0", "ok", 4), last_user()]
    r = run(lp, items)
    msgs = by_id(r)
    pointed = [k for k in range(3) if "[elided]" in msgs[f"r{k}"].text]
    assert pointed
    for k in pointed:
        m, original = msgs[f"r{k}"], items[2 + k]
        assert isinstance(original, ToolResultItem)
        assert m.trust is trusts[k] and m.call_id == f"x{k}"
        ref = "artifact://big/1" if k == 2 else f"event:{500 + k}"
        size = len(original.content.encode())
        assert body(m) == (
            f"[elided] tool.result r{k} ({trusts[k].value}, {size:,} bytes) -> {ref}")


def _pending_case(pending_words: int) -> list[ConversationItem]:
    return [f.user("u1", "look these up", 1),
            f.call("c0", 2, "x0", "x1"),
            f.result("r0", 3, "x0", words(900, 1)), f.result("r1", 3, "x1", words(900, 2)),
            assistant("a1", "and two more", 4, run_id="run-1"),
            f.call("c1", 5, "x2", "x3"),
            f.result("r2", 6, "x2", words(pending_words, 3)),
            f.result("r3", 6, "x3", words(pending_words, 4))]


def test_pending_results_of_the_active_loop_never_become_pointers() -> None:
    lp = plan()
    r = run(lp, _pending_case(900))
    msgs = by_id(r)
    assert "[elided]" not in msgs["r2"].text and "[elided]" not in msgs["r3"].text
    # completed results of the same run did yield, oldest first
    assert "[elided]" in msgs["r0"].text
    assert klass(r, "tool_results").used > klass(r, "tool_results").cap  # pending are kept


def test_pending_results_that_alone_do_not_fit_fail_naming_the_active_run() -> None:
    with pytest.raises(BudgetExceeded) as info:
        run(plan(), _pending_case(6_000), policy=BudgetPolicy(inline_maximum_bytes=10**6))
    assert info.value.class_name == "active_run"
    assert info.value.metadata()["class"] == "active_run"


# ----------------------------------------------------------------------------- never-yield

def skill(name: str, n: int) -> SkillBody:
    return SkillBody(name=name, body=words(n), trust=TrustLevel.TRUSTED_CONFIGURATION)


def test_a_third_loaded_skill_fails_rather_than_evicting() -> None:
    lp = plan("claude-sonnet-4-5", 200_000, None)
    assert run(lp, [last_user()], loaded_skills=(skill("a", 10), skill("b", 10)))
    with pytest.raises(BudgetExceeded) as info:
        run(lp, [last_user()], loaded_skills=(skill("a", 10), skill("b", 10), skill("c", 10)))
    assert info.value.class_name == "skill_bodies"
    assert info.value.unit == "items" and info.value.limit == 2
    assert info.value.metadata() == {"class": "skill_bodies", "items": "3", "limit": "2",
                                     "unit": "items"}


def test_skill_bodies_over_6000_tokens_fail() -> None:
    lp = plan("claude-sonnet-4-5", 200_000, None)
    with pytest.raises(BudgetExceeded) as info:
        run(lp, [last_user()], loaded_skills=(skill("a", 1_800), skill("b", 1_800)))
    assert info.value.class_name == "skill_bodies" and info.value.limit == 6_000
    assert info.value.tokens > 6_000


def test_the_skill_cap_is_measured_without_the_correction_factor() -> None:
    """Skills loaded within 6,000 tokens keep building once ReportUsage raises the factor (a
    skill is never unloaded), and skills over it fail at any factor; the factor still scales
    what they cost in the body."""
    lp = plan("claude-sonnet-4-5", 200_000, None)
    within = (skill("a", 1_000), skill("b", 1_000))
    costs = [klass(run(lp, [last_user()], factor=factor, loaded_skills=within),
                   "skill_bodies").used for factor in (1.0, 1.6, 4.0)]
    assert costs[0] <= 6_000 < costs[1] < costs[2]  # built at every factor, scaled by it
    for factor in (0.5, 1.0):
        with pytest.raises(BudgetExceeded) as info:
            run(lp, [last_user()], factor=factor,
                loaded_skills=(skill("a", 1_800), skill("b", 1_800)))
        assert info.value.class_name == "skill_bodies" and info.value.tokens > 6_000


def test_a_working_state_over_1000_tokens_fails() -> None:
    lp = plan("claude-sonnet-4-5", 200_000, None)
    ok = run(lp, [last_user()], working_state=WorkingState(objective=words(200)))
    assert klass(ok, "working_state").used <= 1_000 and klass(ok, "working_state").cap == 1_000
    with pytest.raises(BudgetExceeded) as info:
        run(lp, [last_user()], working_state=WorkingState(objective=words(800)))
    assert info.value.class_name == "working_state" and info.value.limit == 1_000


def state_measuring(lp: LoadedPlan, low: float, high: int) -> tuple[WorkingState, int]:
    """A working state whose block measures in (low, high] tokens against its ceiling."""
    est = f.estimator(lp.plan.spec.model)
    ctx = RenderContext(session_key=lp.session_key)
    for n in range(100, 1_000):
        state = WorkingState(objective=words(n))
        tokens = working_state_tokens(est, ctx, state)
        if low < tokens <= high:
            return state, tokens
    raise AssertionError(f"no objective measures in ({low}, {high}]")


@pytest.mark.parametrize("model_id", ["claude-sonnet-4-5", "gpt-4o"])
def test_a_working_state_the_service_accepted_builds_whatever_the_factor(model_id: str) -> None:
    """Issue 13: a state of ~960 tokens accepted at factor 1.0 failed every Build with
    BUDGET_EXCEEDED{working_state, 1,056} once ReportUsage moved the factor to 1.1. The ceiling
    is measured without the factor, at update time and at Build time alike."""
    lp = plan(model_id, 200_000, None)
    state, tokens = state_measuring(lp, 1_000 / 1.1, 1_000)
    est = f.estimator(lp.plan.spec.model)
    ctx = RenderContext(session_key=lp.session_key)

    def measure(s: WorkingState) -> int:
        return working_state_tokens(est, ctx, s)

    accepted, changes = apply_update(WorkingState(), Update(objective=state.objective),
                                     run_id="run-1", sequence=1, measure=measure)
    assert changes.tokens == tokens and changes.objective_changed
    for factor in (1.0, 1.1, 1.5, 4.0):
        r = run(lp, [last_user()], factor=factor, working_state=accepted)
        used = klass(r, "working_state").used
        # the factor still scales what the block costs in the body
        assert used == cost_of(lp, WorkingStateItem(state=accepted), factor)
        assert (used > 1_000) == (factor >= 1.1)
    # the ceiling itself still holds, at every factor
    over, _ = state_measuring(lp, 1_000, 1_100)
    for factor in (0.5, 1.0):
        with pytest.raises(BudgetExceeded) as info:
            run(lp, [last_user()], factor=factor, working_state=over)
        assert info.value.class_name == "working_state" and info.value.tokens > 1_000
        with pytest.raises(BudgetExceeded):
            apply_update(WorkingState(), Update(objective=over.objective), run_id="run-1",
                         sequence=1, measure=measure)


def test_a_current_user_message_larger_than_the_body_fails_never_returns_without_it() -> None:
    lp = plan()
    items = [f.user("u0", words(100), 1, run="run-0"), assistant("a0", words(100), 2),
             last_user(words(12_000))]
    with pytest.raises(BudgetExceeded) as info:
        run(lp, items, knowledge=(passage("k", 100, 0),),
            recall=(MemoryLine(id="m", text="likes tea"),))
    e = info.value
    assert e.class_name == "current_user_message" and e.tokens > e.limit
    pressure = e.pressure  # what the ladder did first
    assert isinstance(pressure, Pressure) and not pressure.fits
    assert {s.step for s in pressure.steps} >= {"knowledge", "recall", "history"}


# ----------------------------------------------------------------------------- summary floor

def floor_items() -> list[ConversationItem]:
    return [f.user("u0", "old", 1, run="run-0"), assistant("a0", "old answer", 2),
            f.call("c0", 3, "x0", run="run-0"), f.result("r0", 4, "x0", "data", run="run-0"),
            f.user("u1", "newer", 5, run="run-0"), assistant("a1", "newer answer", 6),
            last_user(seq=7)]


@pytest.mark.parametrize(("through", "first_kept"), [(0, 0), (2, 2), (3, 4), (4, 4), (6, 6)])
def test_items_at_or_below_the_summary_floor_are_never_rendered(through: int,
                                                                first_kept: int) -> None:
    items = floor_items()
    summary = HistorySummary(text="They said hello.", replaced_through_sequence=through)
    r = run(plan(), items, summary=summary)
    sent = [m.item_id for m in r.request.messages if m.row == 10]
    assert sent == [i.id for i in items[first_kept:6]]
    assert [m.row for m in r.request.messages][:1] == [9]
    # the narrative is data, in its own envelope at its label
    assert "\nThey said hello.\n</user:" in r.request.messages[0].text
    assert r.pressure.floor_index == first_kept == r.pressure.cut_index
    assert not r.pressure.compaction_needed and r.pressure.left_out_items == 0


def test_history_cut_reports_compaction_and_what_was_left_out() -> None:
    lp = plan()
    items: list[ConversationItem] = [f.user("u0", "covered", 1, run="run-0")]
    seq = 2
    for k in range(6):
        items += [f.user(f"q{k}", words(400, k), seq, run="run-0"),
                  assistant(f"a{k}", words(400, k + 1), seq + 1)]
        seq += 2
    items.append(last_user(words(2_000), seq=seq))
    summary = HistorySummary(text="Greetings.", replaced_through_sequence=1)
    r = run(lp, items, summary=summary)
    p = r.pressure
    assert p.compaction_needed and p.fits and r.body_tokens <= r.budget.body_budget
    sent = [m.item_id for m in r.request.messages if m.row == 10]
    carried = [i for i in items[1:-1]]
    left = carried[:len(carried) - len(sent)]
    assert sent == [i.id for i in carried[len(left):]]
    assert p.left_out_items == len(left) > 0
    assert p.left_out_tokens == sum(cost_of(lp, i) for i in left)
    assert p.floor_index == 1 and p.cut_index == 1 + len(left)
    assert "u0" not in sent
    # the report's history class agrees
    hist = klass(r, "history")
    assert hist.yielded == len(left) and hist.used == sum(cost_of(lp, i)
                                                          for i in carried[len(left):])
    # and the next unit would not have fit
    assert r.body_tokens + cost_of(lp, left[-1]) > r.budget.body_budget


def long_history(n: int = 12) -> list[ConversationItem]:
    """An earlier run's ``n`` exchanges of about 1,400 tokens each."""
    items: list[ConversationItem] = []
    for k in range(n):
        items += [f.user(f"q{k}", words(400, k), 2 * k + 1, run="run-0"),
                  assistant(f"a{k}", words(400, k + 1), 2 * k + 2)]
    return items


def test_never_yield_items_that_push_history_below_its_floor_report_the_shortfall() -> None:
    """Issue 13: never-yield items left history 3,572 tokens with no signal."""
    lp = plan()  # gpt-4o, 16,000 / 4,096: a body budget of about 11,000
    r = run(lp, [*long_history(), last_user(words(4_000), seq=99)],
            knowledge=(passage("k", 300, 0),), recall=(MemoryLine(id="m", text=words(300)),))
    p, B = r.pressure, r.budget.body_budget
    never_yield = r.body_tokens - klass(r, "history").used
    room = B - never_yield
    assert 0 < room < HISTORY_FLOOR_TOKENS and p.fits and p.compaction_needed
    # knowledge and recall went first, all of them: they never hold history below its floor
    assert klass(r, "knowledge").items == klass(r, "recall").items == 0
    assert p.history_floor_shortfall == HISTORY_FLOOR_TOKENS - room == HISTORY_FLOOR_TOKENS - \
        klass(r, "history").cap
    assert p.prefix_floor_shortfall == 0  # the body budget holds the floor: none is the prefix's
    # a smaller message leaves the floor whole: history is still cut, but keeps 8,000
    held = run(lp, [*long_history(), last_user(words(1_000), seq=99)])
    assert held.pressure.compaction_needed and held.pressure.history_floor_shortfall == 0
    assert klass(held, "history").cap >= HISTORY_FLOOR_TOKENS


def test_a_body_budget_below_the_floor_is_the_prefixs_shortfall_not_never_yield_items() -> None:
    """A Claude prefix is an estimate, scaled by the correction factor: once ReportUsage raises
    the factor past what Plan held the body to, the body budget itself is below history's floor.
    The shortfall was reported whole as if never-yield items had caused it (7,060 tokens at a
    19,000-token window, beside a three-word message); the body budget's own part is the
    prefix's, and only the rest is what never yields."""
    lp = plan("claude-sonnet-4-5", window=14_000)
    assert not prefix_exact(lp.plan.spec)
    items = [*long_history(), last_user(seq=99)]
    held = run(lp, items)  # at the factor Plan held it to: the floor holds
    assert held.budget.body_budget >= HISTORY_FLOOR_TOKENS
    assert held.pressure.history_floor_shortfall == held.pressure.prefix_floor_shortfall == 0
    for factor in (2.0, 4.0):
        r = run(lp, items, factor=factor)
        p, B = r.pressure, r.budget.body_budget
        assert r.budget.prefix_tokens == math.ceil(lp.plan.prefix_tokens * factor)
        never_yield = r.body_tokens - klass(r, "history").used
        assert 0 < never_yield < B < HISTORY_FLOOR_TOKENS and p.fits
        assert p.prefix_floor_shortfall == HISTORY_FLOOR_TOKENS - B
        assert p.history_floor_shortfall - p.prefix_floor_shortfall == never_yield
    # a failed Build's whole floor is short; the body budget's part of it is the prefix's
    with pytest.raises(BudgetExceeded) as info:
        run(lp, [*long_history(), last_user(words(12_000), seq=99)], factor=4.0)
    over = info.value.pressure
    assert isinstance(over, Pressure) and not over.fits
    assert over.history_floor_shortfall == HISTORY_FLOOR_TOKENS
    assert over.prefix_floor_shortfall == HISTORY_FLOOR_TOKENS - info.value.limit


def test_a_scaled_prefix_is_named_with_its_measure_and_factor_when_it_leaves_no_floor() -> None:
    """Plan refuses a Claude prefix a raised factor scales past the floor: the error names the
    prefix as Build costs it, what it measured and the factor."""
    policy = BudgetPolicy()
    b = compute_budget(window=14_000, output_reserve=4_096, prefix_tokens=3_292, policy=policy)
    with pytest.raises(HistoryFloorUnreachable) as info:
        require_history_floor(b, model_id="claude-sonnet-4-5", window=14_000,
                              prefix_tokens=3_292, policy=policy, measured_prefix_tokens=823,
                              factor=4.0)
    meta = info.value.metadata()
    assert (meta["prefix_tokens"], meta["prefix_measured"], meta["estimator_factor"]) == (
        "3292", "823", "4")
    assert "prefix 3292 (823 measured, at the correction factor 4" in str(info.value)
    with pytest.raises(HistoryFloorUnreachable) as info:  # an exact count: no factor named
        require_history_floor(b, model_id="m", window=14_000, prefix_tokens=3_292,
                              policy=policy, measured_prefix_tokens=3_292, factor=1.0)
    assert "prefix_measured" not in info.value.metadata()


@settings(max_examples=30)
@given(depth=st.integers(0, MAX_DEPTH), exchanges=st.integers(0, 14),
       message=st.integers(1, 9_000))
def test_compaction_is_never_asked_for_over_a_summary_at_the_depth_cap(
        depth: int, exchanges: int, message: int) -> None:
    """Following the documented loop (Compact with tokens_to_free = left_out_tokens, build
    again) reached depth 2, and from then on every Build said compaction_needed for a Compact
    that always refuses COMPACTION_DEPTH_EXCEEDED. A Build that fits asks for compaction
    exactly where history was cut and the summary can still merge; none, fitting or not, asks
    for it over a depth-2 summary."""
    summary = HistorySummary(text="Earlier: greetings.", depth=depth,
                             replaced_through_sequence=0)
    items = [*long_history(exchanges), last_user(words(message), seq=99)]
    try:
        p = run(plan(), items, summary=summary).pressure
    except BudgetExceeded as e:
        assert isinstance(e.pressure, Pressure) or e.pressure is None
        if isinstance(e.pressure, Pressure) and e.pressure.compaction_needed:
            assert depth < MAX_DEPTH
        return
    assert p.compaction_needed == (p.left_out_items > 0 and depth < MAX_DEPTH)


def test_history_shorter_than_its_floor_falls_short_only_of_what_it_has() -> None:
    """The floor is 8,000 tokens or all of history if less: a short history that fits beside
    never-yield items is not short of anything, one that is cut is short of its own size."""
    lp = plan()
    short = long_history(3)  # about 4,300 tokens
    history = sum(cost_of(lp, i) for i in short)
    fits = run(lp, [*short, last_user(words(3_000), seq=99)])
    assert not fits.pressure.compaction_needed and fits.pressure.history_floor_shortfall == 0
    cut = run(lp, [*short, last_user(words(4_500), seq=99)])
    room = cut.budget.body_budget - (cut.body_tokens - klass(cut, "history").used)
    assert cut.pressure.compaction_needed and 0 < room < history
    assert cut.pressure.history_floor_shortfall == history - room


def test_a_failed_build_reports_the_whole_floor_as_its_shortfall() -> None:
    with pytest.raises(BudgetExceeded) as info:
        run(plan(), [*long_history(), last_user(words(12_000), seq=99)])
    pressure = info.value.pressure
    assert isinstance(pressure, Pressure) and not pressure.fits
    assert pressure.history_floor_shortfall == HISTORY_FLOOR_TOKENS


def test_a_body_budget_below_the_history_floor_is_refused_with_its_numbers() -> None:
    """Issue 13: gpt-4 (8,192 tokens, 2,048 reserved) leaves a body of about 5,400."""
    policy = BudgetPolicy()
    b = compute_budget(window=8_192, output_reserve=2_048, prefix_tokens=430, policy=policy)
    with pytest.raises(HistoryFloorUnreachable) as info:
        require_history_floor(b, model_id="gpt-4", window=8_192, prefix_tokens=430,
                              policy=policy)
    assert info.value.metadata() == {
        "model": "gpt-4", "window": "8192", "output_reserve": "2048",
        "margin": str(b.margin_tokens), "prefix_tokens": "430",
        "body_budget": str(b.body_budget), "history_floor": "8000"}
    assert b.body_budget == 8_192 - 2_048 - b.margin_tokens - 430 == 5_406
    assert "gpt-4" in str(info.value) and "5406" in str(info.value)
    # the boundary: exactly the floor is enough, one token less is not
    exact = replace(b, body_budget=HISTORY_FLOOR_TOKENS)
    require_history_floor(exact, model_id="m", window=1, prefix_tokens=0, policy=policy)
    with pytest.raises(HistoryFloorUnreachable):
        require_history_floor(replace(exact, body_budget=HISTORY_FLOOR_TOKENS - 1),
                              model_id="m", window=1, prefix_tokens=0, policy=policy)
    # the prefix is paid before the floor: 12,000 - 2,000 - 500 leaves 9,500, which holds the
    # floor beside a 1,400-token prefix and not beside a 1,600-token one
    for prefix, holds in ((1_400, True), (1_600, False)):
        b = compute_budget(window=12_000, output_reserve=2_000, prefix_tokens=prefix,
                           policy=policy)
        if holds:
            require_history_floor(b, model_id="m", window=12_000, prefix_tokens=prefix,
                                  policy=policy)
        else:
            with pytest.raises(HistoryFloorUnreachable):
                require_history_floor(b, model_id="m", window=12_000, prefix_tokens=prefix,
                                      policy=policy)
    # a policy cap below the window is named too: it is what the arithmetic used
    capped = BudgetPolicy(policy_cap_tokens=10_000)
    b = compute_budget(window=200_000, output_reserve=2_000, prefix_tokens=500, policy=capped)
    with pytest.raises(HistoryFloorUnreachable) as info:
        require_history_floor(b, model_id="claude-x", window=200_000, prefix_tokens=500,
                              policy=capped)
    assert info.value.metadata()["policy_cap"] == "10000"


def test_a_request_that_fits_reports_no_pressure() -> None:
    r = run(plan(), floor_items())
    p = r.pressure
    assert p.steps == () and not p.yielded and p.fits and not p.compaction_needed
    assert p.tokens_before == p.tokens_after == r.body_tokens
    assert p.left_out_items == p.left_out_tokens == 0 and p.legacy_tool_excerpts == 0


def test_floor_and_cut_indexes_count_dropped_reasoning_items() -> None:
    items: list[ConversationItem] = [
        f.user("u0", "q", 1, run="run-0"),
        ReasoningItem(id="rs", sequence=2, run_id="run-0", item_trust=TrustLevel.USER,
                      provider="openai", opaque=b"x" * 10),
        assistant("a0", "answer", 3),
        f.user("u9", "next", 4, run="run-1")]
    r = run(plan(), items, summary=HistorySummary(text="s", replaced_through_sequence=3))
    assert [m.item_id for m in r.request.messages if m.row == 10] == []
    # the first item above the floor (sequence 3) is u9, at index 3 of checkpoint.items
    assert r.pressure.floor_index == 3
    assert r.pressure.cut_index == 3


# ----------------------------------------------------------------------------- excerpts

def legacy(content: str, **kw: Any) -> ToolResultItem:
    fields: dict[str, Any] = {"id": "r0", "sequence": 3, "run_id": "run-0",
                              "item_trust": TrustLevel.EXTERNAL_UNTRUSTED, "call_id": "x0",
                              "tool_name": "web.fetch", "content": content, "event_id": 42}
    fields.update(kw)
    return ToolResultItem(**fields)


def test_a_result_over_the_inline_maximum_gets_a_head_tail_excerpt_naming_its_event() -> None:
    content = "A" * 10_000 + "B" * 10_000 + "C" * 10_000
    item = legacy(content)
    [out], n = normalize_tool_results([item], 16_384)
    assert n == 1 and isinstance(out, ToolResultItem)
    head, tail = 16_384 * 2 // 3, 16_384 - 16_384 * 2 // 3
    assert out.content == ("A" * 10_000 + "B" * (head - 10_000)
                           + f"\n[... excerpt: {30_000 - head - tail:,} of 30,000 bytes omitted; "
                           "full result: event:42 ...]\n" + "C" * tail)
    assert out.item_trust is TrustLevel.EXTERNAL_UNTRUSTED and out.id == "r0"
    assert out.call_id == "x0" and out.bytes == 30_000 and not out.elided
    assert item.content == content  # the input is never changed
    # deterministic
    assert normalize_tool_results([item], 16_384) == normalize_tool_results([item], 16_384)


def test_excerpts_cut_on_character_boundaries() -> None:
    content = "\u00e9\u6f22\U0001f642" * 3_000  # 2, 3 and 4 bytes
    out = head_tail_excerpt(legacy(content), 1_000)
    assert "\ufffd" not in out
    head, rest = out.split("\n[... excerpt: ", 1)
    tail = rest.split("...]\n", 1)[1]
    assert len(head.encode()) <= 666 and len(tail.encode()) <= 334
    assert content.startswith(head) and content.endswith(tail)
    # the marker counts bytes, not characters: 27,000 bytes in 9,000 characters
    whole = len(content.encode())
    omitted = whole - len(head.encode()) - len(tail.encode())
    assert whole == 27_000 and omitted >= 26_000
    assert rest.startswith(f"{omitted:,} of {whole:,} bytes omitted; ")


def test_results_within_the_inline_maximum_are_unchanged() -> None:
    item = legacy("x" * 16_384)
    assert normalize_tool_results([item], 16_384) == ((item,), 0)


def test_context_content_is_used_instead_of_content_and_is_not_a_legacy_excerpt() -> None:
    item = legacy("full canonical " * 5_000, context_content="the persisted excerpt")
    [out], n = normalize_tool_results([item], 16_384)
    assert n == 0 and isinstance(out, ToolResultItem)
    assert out.content == "the persisted excerpt" and out.context_content == ""
    assert out.bytes == len(item.content.encode())  # a pointer still names the full size


def test_a_persisted_excerpt_over_the_inline_maximum_is_cut_like_a_legacy_result() -> None:
    """ADR-0137: a carried result whose content, once its persisted excerpt is selected,
    still exceeds the inline maximum (a limit lowered since it was persisted) gets the same
    head/tail excerpt, naming its event; the item keeps the canonical size."""
    persisted = "P" * 3_000 + "Q" * 3_000 + "R" * 4_000
    item = legacy("full canonical " * 5_000, context_content=persisted)
    [out], n = normalize_tool_results([item], 2_000)
    assert n == 1 and isinstance(out, ToolResultItem)
    head, tail = 2_000 * 2 // 3, 2_000 - 2_000 * 2 // 3
    # the marker names the size of what was cut and of the whole result
    assert out.content == ("P" * head + f"\n[... excerpt: {10_000 - head - tail:,} of 10,000 "
                           "bytes omitted; full result (75,000 bytes): event:42 ...]\n"
                           + "R" * tail)
    assert out.context_content == "" and out.bytes == len(item.content.encode())
    assert normalize_tool_results([item], 10_000) == ((replace(
        item, content=persisted, context_content="", byte_length=item.bytes),), 0)


def test_build_renders_excerpts_with_their_trust_and_counts_legacy_ones() -> None:
    lp = plan("claude-sonnet-4-5", 200_000, None)
    big = "<html>" + "row " * 10_000 + "</html>"
    items: list[ConversationItem] = [
        f.user("u0", "go", 1, run="run-0"), f.call("c0", 2, "x0", "x1", "x2", run="run-0"),
        legacy(big, id="r0", call_id="x0", item_trust=TrustLevel.EXTERNAL_UNTRUSTED),
        legacy(big, id="r1", call_id="x1", item_trust=TrustLevel.USER,
               context_content="persisted excerpt"),
        legacy("small", id="r2", call_id="x2"), assistant("a0", "ok", 4), last_user()]
    r = run(lp, items)
    msgs = by_id(r)
    assert r.pressure.legacy_tool_excerpts == 1
    r0 = body(msgs["r0"])
    assert "full result: event:42 ...]" in r0 and r0.startswith("<html>row")
    assert r0.endswith("row </html>") and len(r0.encode()) < len(big.encode())
    assert msgs["r0"].trust is TrustLevel.EXTERNAL_UNTRUSTED
    assert h.only_envelope(msgs["r0"].text).tag == "untrusted"
    assert body(msgs["r1"]) == "persisted excerpt"
    assert msgs["r1"].trust is TrustLevel.USER
    assert body(msgs["r2"]) == "small"
    assert "row row row" not in msgs["r1"].text
    assert r.body_tokens == recount(lp, r)


def test_an_excerpt_keeps_the_artifact_reference_on_the_item() -> None:
    item = legacy("z" * 40_000, artifact_ref="artifact://store/9")
    [out], _ = normalize_tool_results([item], 16_384)
    assert isinstance(out, ToolResultItem) and out.artifact_ref == "artifact://store/9"
    assert replace(out, elided=True).pointer().endswith("-> artifact://store/9 (event:42)")


def test_an_excerpt_of_a_result_with_an_artifact_still_references_its_event() -> None:
    out = head_tail_excerpt(legacy("z" * 40_000, artifact_ref="artifact://store/9"), 16_384)
    assert "event:42" in out


# ----------------------------------------------------------------------------- attachments

def img(name: str = "a.png") -> Attachment:
    return Attachment(kind=AttachmentKind.IMAGE, name=name, ref=f"blob:{name}")


def pdf(pages: int, name: str = "doc.pdf") -> Attachment:
    return Attachment(kind=AttachmentKind.PDF, name=name, ref=f"blob:{name}", pages=pages)


def txt(chars: int, name: str = "notes.txt") -> Attachment:
    return Attachment(kind=AttachmentKind.TEXT, name=name, ref=f"blob:{name}",
                      text_chars=chars)


def test_attachment_estimates_image_flat_pdf_per_page_text_by_length() -> None:
    assert attachment_tokens(img(), image_tokens=1_445) == 1_445  # the model's figure
    assert attachment_tokens(img()) == WORST_IMAGE_TOKENS == 48_169  # none given: the largest
    assert attachment_tokens(pdf(7), image_tokens=1_445) == 7 * (3_000 + 1_445) == 31_115
    assert attachment_tokens(pdf(0), image_tokens=1_445) == 4_445  # at least one page
    assert attachment_tokens(txt(3_001)) == 3_001  # a token a character
    assert attachment_tokens(txt(3_001), 1.3) == 3_902  # times the base factor, rounded up
    assert attachment_tokens(txt(3_001), 1.3, 2.0) == 7_803  # and the correction factor
    assert attachment_tokens(txt(0)) == 0


# Texts of the scripts a token a character underestimates, and of those it does not: emoji
# (with ZWJ sequences and skin tones), CJK ideographs of the extension blocks, Georgian,
# Myanmar, Sinhala, then Latin, Cyrillic and common CJK prose, and white space.
_SCRIPTS = st.one_of(
    st.text(st.characters(min_codepoint=0x1F300, max_codepoint=0x1FAFF), min_size=1),
    st.lists(st.sampled_from(["\U0001F469\u200d\U0001F4BB", "\U0001F44B\U0001F3FD",
                              "\U0001F1EF\U0001F1F5"]), min_size=1).map("".join),
    st.text(st.characters(min_codepoint=0x20000, max_codepoint=0x2A6DF), min_size=1),
    st.text(st.characters(min_codepoint=0x3400, max_codepoint=0x4DBF), min_size=1),
    st.text(st.characters(min_codepoint=0x10A0, max_codepoint=0x10FF), min_size=1),
    st.text(st.characters(min_codepoint=0x1000, max_codepoint=0x109F), min_size=1),
    st.text(st.characters(min_codepoint=0x0D80, max_codepoint=0x0DFF), min_size=1),
    st.text(min_size=1),
    st.sampled_from(["The quick brown fox. ", "Съешь же ещё этих мягких булок. ",
                     "今日は良い天気です。", " \n\t "]).map(lambda t: t * 40),
)


@settings(max_examples=150)
@given(st.lists(_SCRIPTS, min_size=1, max_size=4).map("".join))
def test_a_text_file_stating_its_bytes_is_estimated_at_no_less_than_it_counts(
        text: str) -> None:
    """Checked against tiktoken's own encodings (tests/support/provider_tokens.py), not the
    service's counter: a token a byte bounds what either encoding makes of any text."""
    attachment = Attachment(kind=AttachmentKind.TEXT, name="f.txt", ref="r",
                            text_chars=len(text), text_bytes=len(text.encode()))
    estimate = attachment_tokens(attachment)
    for name in ("cl100k_base", "o200k_base"):
        assert estimate >= len(oracle_encoding(name).encode_ordinary(text)), name


def test_a_token_a_character_is_exceeded_by_emoji_and_a_token_a_byte_is_not() -> None:
    text = "\U0001F600\U0001F680\U0001F9E0" * 2_000
    counted = len(oracle_encoding("cl100k_base").encode_ordinary(text))
    by_chars = attachment_tokens(txt(len(text)))
    by_bytes = attachment_tokens(replace(txt(len(text)), text_bytes=len(text.encode())))
    assert by_chars < counted <= by_bytes, (by_chars, counted, by_bytes)
    assert by_bytes == 24_000  # four bytes a character, a token a byte
    assert attachment_tokens(replace(txt(3_001), text_bytes=3_002), 1.3, 2.0) == 7_806


def _openai_patches(w: int, h: int, multiplier: float) -> int:
    """OpenAI's vision guide, patch models: 32 px patches, scaled down to at most 1,536."""
    patches = math.ceil(w / 32) * math.ceil(h / 32)
    if patches > 1_536:
        shrink = math.sqrt(32 * 32 * 1_536 / (w * h))
        w2, h2 = w * shrink, h * shrink
        fit = min(math.floor(w2 / 32) / (w2 / 32), math.floor(h2 / 32) / (h2 / 32))
        patches = math.ceil(w2 * fit / 32) * math.ceil(h2 * fit / 32)
    return math.ceil(min(patches, 1_536) * multiplier)


def _openai_tiles(w: int, h: int, base: int, tile: int) -> int:
    """OpenAI's vision guide, tile models at high detail: fit in 2,048 x 2,048, then the
    short side to 768 px, then base + tile tokens a 512 px tile."""
    if max(w, h) > 2_048:
        w, h = w * 2_048 / max(w, h), h * 2_048 / max(w, h)
    if min(w, h) > 768:
        w, h = w * 768 / min(w, h), h * 768 / min(w, h)
    return base + tile * math.ceil(w / 512) * math.ceil(h / 512)


def _gemini_tiles(w: int, h: int) -> int:
    """Vertex AI's image requirements: scaled down to fit 3,072 x 3,072; 258 tokens if both
    sides are at most 384 px, else 258 a tile, the tile the short side / 1.5 held between 256
    and 768 px."""
    if max(w, h) > 3_072:
        w, h = w * 3_072 / max(w, h), h * 3_072 / max(w, h)
    if w <= 384 and h <= 384:
        return 258
    unit = min(max(min(w, h) / 1.5, 256), 768)
    return 258 * math.ceil(w / unit) * math.ceil(h / unit)


def _claude_patches(w: int, h: int, long_edge: int, most: int) -> int:
    """Anthropic's vision guide: a token a 28 px patch, the image resized to fit its tier
    (Opus 4.7 on: 2,576 px on the long edge, 4,784 patches)."""
    if max(w, h) > long_edge:
        w, h = w * long_edge / max(w, h), h * long_edge / max(w, h)
    return min(math.ceil(w / 28) * math.ceil(h / 28), most)


# The documented cost of one large image (hand-computed from each provider's docs).
IMAGE_COSTS = {
    "gpt-4.1-mini": max(_openai_patches(2048, 2048, 1.62), math.ceil(1_536 * 1.62)),
    "o4-mini": max(_openai_patches(2048, 2048, 1.72), math.ceil(1_536 * 1.72)),
    "gpt-5-nano": max(_openai_patches(2048, 2048, 2.46), math.ceil(1_536 * 2.46)),
    "gpt-4o": _openai_tiles(768, 2048, 85, 170),  # 2 x 4 tiles of 512 px
    "gpt-4o-mini": _openai_tiles(1000, 4000, 2_833, 5_667),  # 48,169: up to 8 tiles
    "gpt-4o-mini-2024-07-18": _openai_tiles(768, 2048, 2_833, 5_667),
    "gpt-4.5-preview": _openai_tiles(768, 2048, 85, 170),
    "o3": _openai_tiles(768, 2048, 75, 150),
    "gemini-2.5-pro": max(_gemini_tiles(3840, 2160),  # a 4K image
                          _gemini_tiles(2817, 257), _gemini_tiles(12_000, 1_100)),
    "gemini-2.0-flash": max(_gemini_tiles(2817, 257), _gemini_tiles(8000, 8000)),
    "gemini-3-pro-preview": _gemini_tiles(2817, 257),
    "claude-sonnet-4-5": math.ceil(1092 * 1092 / 750),  # Claude's largest unresized image
    "claude-opus-4-7": _claude_patches(2576, 1456, 2_576, 4_784),  # 92 x 52 patches
    "claude-3-5-sonnet-20241022": math.ceil(1092 * 1092 / 750),
    "us.anthropic.claude-opus-4-7": _claude_patches(4000, 2261, 2_576, 4_784),
    "some-unlisted-model": _openai_tiles(768, 2048, 2_833, 5_667),
}


@pytest.mark.parametrize("model_id", sorted(IMAGE_COSTS))
def test_an_image_is_estimated_at_no_less_than_its_documented_cost(model_id: str) -> None:
    """An image was a flat 3,870 tokens whatever the model: gpt-4o-mini's 48,169, Claude Opus
    4.7's 4,784 and a Gemini image of 24 tiles (6,192) were under-counted."""
    lp = f.loaded(f.inputs(model_profile=f.model(model_id, context_window=400_000)))

    def estimate(*atts: Attachment) -> int:
        u = UserMessageItem(id="u1", sequence=1, run_id="run-1", item_trust=TrustLevel.USER,
                            text="Describe.", attachments=atts)
        return f.run_build(lp, f.checkpoint([u])).estimated_input_tokens

    assert estimate(img()) - estimate() >= IMAGE_COSTS[model_id]
    # a PDF page is its text (up to 3,000 tokens) and the page read as an image
    assert estimate(pdf(1)) - estimate() >= 3_000 + IMAGE_COSTS[model_id]


# Text files of several scripts: what the adapter inlines, counted by the oracle's tiktoken.
TEXT_FILES = {
    "chinese": ("这是一个关于季度财务报告的文件，包含收入、成本和利润的详细分析。"
                "我们需要检查每个部门的预算执行情况。") * 200,
    "japanese": ("このファイルには四半期の財務報告が含まれています。"
                 "各部門の予算執行状況を確認する必要があります。") * 200,
    "russian": ("Этот файл содержит квартальный финансовый отчёт "
                "с подробным анализом доходов. ") * 200,
    "emoji_log": "✅ build ok 🚀 deploy 🔥 hotfix ⚠️ warn ❌ fail 🧪 test\n" * 200,
    "english": "This file contains the quarterly financial report with a detailed analysis. " * 200,
}


@pytest.mark.parametrize("model_id", ["gpt-4o", "claude-sonnet-4-5"])
@pytest.mark.parametrize("name", sorted(TEXT_FILES))
def test_a_text_attachment_is_estimated_at_no_less_than_its_inlined_text(
        model_id: str, name: str) -> None:
    """Chinese text was estimated at a third of a token a character (3,345 for 10,000
    characters o200k_base counts at 6,200; 3,348 where cl100k_base counts 10,000)."""
    from tests.support.provider_tokens import encoding, encoding_name_for

    text = TEXT_FILES[name]
    lp = f.loaded(f.inputs(model_profile=f.model(model_id)))

    def estimate(*atts: Attachment) -> int:
        u = UserMessageItem(id="u1", sequence=1, run_id="run-1", item_trust=TrustLevel.USER,
                            text="Summarize the attached file.", attachments=atts)
        return f.run_build(lp, f.checkpoint([u])).estimated_input_tokens

    added = estimate(txt(len(text), "report.txt")) - estimate()
    sent = len(encoding(encoding_name_for(model_id)).encode(text, disallowed_special=()))
    assert added >= sent


def with_attachments(*atts: Attachment, item_id: str = "u-last", seq: int = 100,
                     run_id: str = "run-1") -> UserMessageItem:
    return UserMessageItem(id=item_id, sequence=seq, run_id=run_id, item_trust=TrustLevel.USER,
                           text="see attached", attachments=atts)


def test_attachments_are_counted_on_top_of_their_labels() -> None:
    lp = plan("claude-sonnet-4-5", 200_000, None)
    atts = (img(), pdf(3), txt(900))
    r = run(lp, [with_attachments(*atts)])
    [m] = [m for m in r.request.messages if m.row == 15]
    for a in atts:
        assert f"[attachment {a.kind.value}: {a.name}]" in m.text  # labels are in the text
    # Claude's image figure, 4,784 (Opus 4.7 on), and a page 3,000 more; text: 900 x 1.3
    assert r.body_tokens == recount(lp, r) + 4_784 + 3 * 7_784 + 1_170


def test_attachment_content_is_capped_request_wide() -> None:
    lp = plan("claude-sonnet-4-5", 400_000, None)
    older = with_attachments(pdf(40, "a.pdf"), item_id="u0", seq=1, run_id="run-0")
    items: list[ConversationItem] = [older, assistant("a0", "read it", 2),
                                     with_attachments(pdf(40, "b.pdf"), img())]
    r = run(lp, items)
    assert r.body_tokens == recount(lp, r) + ATTACHMENT_BUDGET_TOKENS
    assert "[attachment pdf: b.pdf]" in r.request.messages[-1].text


def test_the_trailing_user_message_carries_its_attachments() -> None:
    atts = (img(), pdf(2))
    r = run(plan("claude-sonnet-4-5", 200_000, None), [with_attachments(*atts)])
    assert r.request.messages[-1].item_id == "u-last"
    assert r.request.messages[-1].attachments == atts


def test_attachments_not_in_the_request_do_not_consume_the_request_wide_budget() -> None:
    lp = plan("claude-sonnet-4-5", 400_000, None)
    items: list[ConversationItem] = [
        with_attachments(pdf(60, "old.pdf"), item_id="u0", seq=1, run_id="run-0"),
        assistant("a0", "done", 2),
        with_attachments(img("kept.png"), item_id="u1", seq=3, run_id="run-1"),
        assistant("a1", "seen", 4, run_id="run-1"),
        f.user("u9", "and now?", 5, run="run-2")]
    r = run(lp, items, run_id="run-2",
            summary=HistorySummary(text="s", replaced_through_sequence=2))
    sent = {m.item_id: m for m in r.request.messages}
    assert "u0" not in sent and sent["u1"].attachments == (img("kept.png"),)
    assert r.body_tokens == recount(lp, r) + 4_784  # Claude's image figure


# ----------------------------------------------------------------------------- estimator

class _Chars:
    name = encoding = "chars"

    def count(self, text: str) -> int:
        return len(text)


def test_the_estimator_rounds_up_and_counts_framing() -> None:
    est = TokenEstimator(_Chars(), 1.3)
    m = Message(row=10, role=Role.USER, trust=TrustLevel.USER, text="abc")
    assert est.message(m) == math.ceil(3 * 1.3) + MESSAGE_OVERHEAD_TOKENS == 8
    assert est.message(m, 1.01) == math.ceil(3 * 1.3 * 1.01) + MESSAGE_OVERHEAD_TOKENS
    empty = Message(row=10, role=Role.ASSISTANT, trust=TrustLevel.USER)
    assert est.message(empty) == MESSAGE_OVERHEAD_TOKENS
    assert est.message(m) == est.message(m)  # pure


# ----------------------------------------------------------------------------- calibration

def rec(current: Calibration | None, estimated: int, actual: int, *, factor_used: float = 1.0,
        encoding: str = "o200k_base", model_id: str = "gpt-4o") -> calibration.Reconciled:
    return reconcile(current, model_id=model_id, encoding=encoding, estimated=estimated,
                     actual=actual, factor_used=factor_used)


def test_an_under_count_moves_the_factor_up_at_once() -> None:
    r = rec(None, 1_000, 1_200)
    assert r.calibration.factor == pytest.approx(1.2)
    assert r.previous_factor == 1.0 and r.calibration.reports == 1
    assert r.error_ratio == pytest.approx((1_200 - 1_000) / 1_200)  # signed: positive = under


def test_an_over_count_moves_the_factor_down_slowly_and_converges() -> None:
    r = rec(None, 1_000, 800)
    assert r.calibration.factor == pytest.approx(1.0 - 0.2 * calibration.DOWN_RATE)
    assert r.error_ratio == pytest.approx(-0.25)
    current = r.calibration
    for _ in range(30):  # the same reality, reported with the factor then in use
        current = rec(current, round(800 * current.factor / 0.8), 800,
                      factor_used=current.factor).calibration
    assert current.factor == pytest.approx(0.8, abs=1e-3)
    assert current.reports == 31


def test_up_after_down_is_immediate() -> None:
    down = rec(None, 1_000, 500).calibration
    assert down.factor < 1.0
    up = rec(down, 1_000, 1_500, factor_used=down.factor).calibration
    assert up.factor == pytest.approx(down.factor * 1.5, abs=1e-6)


def test_the_factor_resets_when_the_encoding_or_model_changes() -> None:
    high = rec(None, 1_000, 2_000).calibration
    assert high.factor == pytest.approx(2.0) and high.reports == 1
    other = rec(high, 1_000, 1_000, encoding="cl100k_base").calibration
    assert other.factor == pytest.approx(1.0) and other.reports == 1
    assert other.encoding == "cl100k_base"
    moved = rec(high, 1_000, 1_000, model_id="gpt-4.1").calibration
    assert moved.factor == pytest.approx(1.0) and moved.reports == 1


def test_the_factor_is_clamped() -> None:
    assert rec(None, 100, 10_000).calibration.factor == calibration.MAX_FACTOR == 4.0
    low = None
    for _ in range(60):
        low = rec(low, 10_000, 100).calibration
    assert low is not None and low.factor == pytest.approx(calibration.MIN_FACTOR, abs=1e-3)
    assert low.factor >= calibration.MIN_FACTOR == 0.5


def test_the_factor_is_the_observed_ratio_over_the_whole_estimate_when_nothing_is_exact(
        ) -> None:
    """An approximate prefix (fixed=0): actual = 2 x estimate doubles the factor."""
    r = reconcile(None, model_id="claude-sonnet-4-5", encoding="cl100k_base", estimated=10_000,
                  actual=20_000, factor_used=1.0, fixed=0)
    assert r.calibration.factor == pytest.approx(2.0)
    again = reconcile(r.calibration, model_id="claude-sonnet-4-5", encoding="cl100k_base",
                      estimated=20_000, actual=20_000, factor_used=2.0, fixed=0)
    assert again.calibration.factor == pytest.approx(2.0)  # converged: the ratio is 1 now


def test_an_exact_prefix_leaves_the_whole_error_to_the_body() -> None:
    """An exact prefix (fixed = its tokens) is never scaled: the body's factor absorbs it all."""
    r = reconcile(None, model_id="gpt-4o", encoding="o200k_base", estimated=10_000,
                  actual=12_000, factor_used=1.0, fixed=8_000)
    assert r.calibration.factor == pytest.approx((12_000 - 8_000) / (10_000 - 8_000)) == 2.0
    capped = reconcile(None, model_id="gpt-4o", encoding="o200k_base", estimated=10_000,
                       actual=20_000, factor_used=1.0, fixed=8_000)
    assert capped.calibration.factor == calibration.MAX_FACTOR


@pytest.mark.parametrize(("model_id", "exact"), [("gpt-4o", True), ("gpt-4", True),
                                                 ("claude-sonnet-4-5", False),
                                                 ("gemini-2.5-pro", False),
                                                 ("mystery-model", False)])
def test_which_prefix_counts_are_exact(model_id: str, exact: bool) -> None:
    lp = f.loaded(f.inputs(model_profile=f.model(model_id, context_window=200_000)))
    assert prefix_exact(lp.plan.spec) is exact


def test_a_fallback_encoding_makes_the_prefix_count_approximate() -> None:
    lp = plan()
    fell_back = replace(lp.plan.spec, encoding="cl100k_base", estimator_factor=1.1)
    assert prefix_exact(lp.plan.spec) and not prefix_exact(fell_back)


def test_a_report_without_an_estimate_keeps_the_factor() -> None:
    current = Calibration(model_id="gpt-4o", encoding="o200k_base", factor=1.3, reports=4)
    r = rec(current, 0, 900)
    assert r.calibration.factor == 1.3 and r.calibration.reports == 5
    assert rec(current, 100, 0).error_ratio == 0.0


def test_the_tool_results_class_counts_the_results_and_pointers_the_request_holds() -> None:
    """Results that became pointers and were then left out with history are neither in the
    tool results class's items nor among its yielded: the class reports what the request
    holds (counted here from the request's messages)."""
    lp = plan()
    items: list[ConversationItem] = [f.user("u0", "fetch six pages", 1, run="run-0")]
    seq = 2
    for k in range(6):
        items += [f.call(f"c{k}", seq, f"x{k}", run="run-0"),
                  f.result(f"r{k}", seq + 1, f"x{k}", words(400, k), run="run-0")]
        seq += 2
        if k == 2:  # three results, then long exchanges, then three more
            for n in range(6):
                items += [f.user(f"q{n}", words(500, n), seq, run="run-0"),
                          assistant(f"a{n}", words(500, n + 1), seq + 1)]
                seq += 2
    items.append(last_user(seq=seq))
    r = run(lp, items)
    steps = {s.step: s.ids for s in r.pressure.steps}
    # the case at hand: some results became pointers, some of those history then left out,
    # and some pointers are still sent
    sent = by_id(r)
    pointed = set(steps["tool_results"])
    assert pointed & set(steps["history"]) and pointed & set(sent)
    results = [m for item_id, m in sent.items() if item_id.startswith("r")]
    tool = klass(r, "tool_results")
    assert tool.items == len(results) > 0
    assert tool.yielded == sum("[elided]" in m.text for m in results) > 0
    est = f.estimator(lp.plan.spec.model)
    assert tool.used == sum(est.message(m, 1.0) for m in results)


def _claude(current: Calibration | None, estimated: int, actual: int, bounded: int,
            factor_used: float = 1.0) -> Calibration:
    return reconcile(current, model_id="claude-sonnet-4-5", encoding="cl100k_base",
                     estimated=estimated, actual=actual, factor_used=factor_used,
                     bounded=bounded, floor=1 / 1.3).calibration


def test_attachments_that_cost_less_than_their_bound_do_not_pull_the_factor_down() -> None:
    """A Claude request: 6,000 tokens of text estimated, one image at its bound of 4,784. The
    provider counts 5,500 for the text and 1,600 for the image (7,100 of 10,784 estimated).
    Reconciled over the whole estimate the factor fell toward 7,100 / 10,784 = 0.658 (held at
    the floor 0.769): 0.931 after one report. With the bound known, even an image that cost
    nothing leaves the text at 7,100 / 6,000 = 1.18, above 1.0: no over-count is proven and
    the factor is kept; the text (5,500 / 6,000) needs no lower one."""
    whole = _claude(None, 10_784, 7_100, 0)
    assert whole.factor == pytest.approx(1.0 + (1 / 1.3 - 1.0) * 0.3, abs=1e-6)
    kept = _claude(None, 10_784, 7_100, 4_784)
    assert kept.factor == 1.0 and kept.reports == 1


def test_a_report_with_attachments_raises_the_factor_only_by_what_it_proves() -> None:
    """Text estimated at 6,000, an image bounded at 4,784: the provider counts 12,000. Even with
    the image at its whole bound the text took 12,000 - 4,784 = 7,216: the factor rises at once
    to 7,216 / 6,000 = 1.2027 (not to 12,000 / 6,000 = 2.0, which charges the image to the
    text)."""
    up = _claude(None, 10_784, 12_000, 4_784)
    assert up.factor == pytest.approx(7_216 / 6_000, abs=1e-6)


def test_a_report_with_attachments_lowers_the_factor_toward_the_most_the_text_can_be() -> None:
    """Text estimated at 6,000 at factor 1.2 (5,000 at 1.0), an image bounded at 4,784; the
    provider counts 5,400. Even were the image free, the text took at most 5,400 tokens, so the
    factor that would have matched is at most 1.2 x 5,400 / 6,000 = 1.08: it falls toward
    that, at the slow rate."""
    current = Calibration(model_id="claude-sonnet-4-5", encoding="cl100k_base", factor=1.2,
                          reports=3)
    down = _claude(current, 10_784, 5_400, 4_784, factor_used=1.2)
    assert down.factor == pytest.approx(1.2 + (1.08 - 1.2) * 0.3, abs=1e-6)


def test_a_request_of_attachments_alone_keeps_the_factor() -> None:
    current = Calibration(model_id="claude-sonnet-4-5", encoding="cl100k_base", factor=1.1,
                          reports=1)
    assert _claude(current, 4_784, 1_600, 4_784, factor_used=1.1).factor == 1.1
