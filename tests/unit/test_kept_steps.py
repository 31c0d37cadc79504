"""What an allocation keeps for the next one (``KeptSteps``: which history candidates are results,
their ids, the pointer queue, the gains and their running sums, the history as the first queued
results left it) changes no allocation: an allocation given what an earlier one found over the
candidates both begin with equals the same allocation given nothing, and finds the same facts.

Two oracles, neither of which shares the cache: ``allocate`` without ``kept`` (every fact found
again from the items), and ``build()`` without a memo. The sessions are drawn so that the pointer
steps run on almost every allocation (results large against a small body) and so that an
allocation takes fewer pointers than the one before it (the last items removed, the body
larger, a result rewritten smaller) as often as more."""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any

from context_engine.domain.budget import (
    Allocation,
    Budget,
    BudgetPolicy,
    KeptSteps,
    allocate,
)
from context_engine.domain.builder import BuildResult, LoadedPlan, build, shared_prefix
from context_engine.domain.history import units_of
from context_engine.domain.items import (
    AssistantMessageItem,
    ConversationItem,
    ToolResultItem,
)
from context_engine.domain.trust import TrustLevel
from context_engine.engine import BoundedMemo
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests import factories as f

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
POINTER_COST = 40


def cost(item: Any) -> int:
    """A result costs the number its content spells (a pointer POINTER_COST); anything else
    its text's length."""
    if isinstance(item, ToolResultItem):
        return POINTER_COST if item.elided else int(item.content)
    return len(getattr(item, "text", "")) + len(getattr(item, "calls", ()))


def allocation(items: list[ConversationItem], body: int, fixed: int,
               kept: KeptSteps | None, tiled: bool = False) -> Allocation:
    """``tiled``: with the units' spans and their tiling handed in, as the builder hands
    them (otherwise the cut finds and checks the units itself)."""
    found = units_of(items) if tiled else None
    return allocate(budget=Budget(total_tokens=body * 2, output_reserve=0, margin_tokens=0,
                                  body_budget=body),
                    prefix_tokens=0, factor=1.0, policy=BudgetPolicy(), summary=None,
                    carried=items, floor=0, active=[], fixed={"current_user_message": fixed},
                    knowledge=[], recall=[], cost=cost, legacy_tool_excerpts=0,
                    position=lambda i: i, pointer=lambda r: replace(r, elided=True), kept=kept,
                    spans=found.spans if found is not None else None,
                    tiling=((found.begins, found.ends) if found is not None and found.tiles
                            else None))


def exchange(k: int, size: int, elided: bool = False) -> list[ConversationItem]:
    return [f.call(f"c{k}", 2 * k, f"call{k}", run="run-0"),
            replace(f.result(f"r{k}", 2 * k + 1, f"call{k}", str(size), run="run-0"),
                    elided=elided)]


def same_facts(a: KeptSteps, b: KeptSteps) -> None:
    assert (a.held, a.results, a.ids, a.queue, a.queue_ids, a.taken) == \
        (b.held, b.results, b.ids, b.queue, b.queue_ids, b.taken)
    assert (a.history, a.history_costs) == (b.history, b.history_costs)
    assert a.sums == b.sums  # the running sums, where the cut found them
    shorter = min(len(a.gain), len(b.gain))  # gains are found only where a step needs them
    assert a.gain[:shorter] == b.gain[:shorter] and a.reach[:shorter] == b.reach[:shorter]


EDITS = ("append", "append", "append", "drop", "rewrite", "body", "fixed", "plain", "plain",
         "plain")


@SETTINGS
@given(st.lists(st.tuples(st.sampled_from(EDITS), st.integers(0, 10_000)), min_size=3,
                max_size=30))
def test_an_allocation_given_what_the_last_found_is_the_allocation_given_nothing(
        edits: list[tuple[str, int]]) -> None:
    numbers = itertools.count(1)
    items: list[ConversationItem] = exchange(0, 900)
    body, fixed = 3_000, 100
    last: tuple[list[ConversationItem], Allocation] | None = None
    used = cuts = sums_kept = 0
    for kind, n in edits:
        k = next(numbers)
        if kind == "append":  # one result or more, some already pointers
            for j in range(1 + n % 3):
                items += exchange(100 * k + j, 50 + (n * (j + 7)) % 1_500, elided=n % 11 == 0)
        elif kind == "drop" and len(items) > 2:  # the last exchange taken back
            items = items[:-2]
        elif kind == "rewrite":  # a result in the middle, same id, another size
            at = [i for i, item in enumerate(items) if isinstance(item, ToolResultItem)]
            if at:
                i = at[n % len(at)]
                items = [*items[:i], replace(items[i], content=str(n % 2_000)),
                         *items[i + 1:]]
        elif kind == "body":
            body = (2_000, 3_000, 6_000, 12_000)[n % 4]
        elif kind == "fixed":  # what never yields moves: the ladder takes more or fewer
            fixed = (0, 100, 900, 1_500)[n % 4]
        elif kind == "plain":
            items.append(AssistantMessageItem(id=f"a{k}", sequence=2 * k, run_id="run-0",
                                              item_trust=TrustLevel.USER, text="x" * (n % 3_000)))
        want = allocation(items, body, fixed, None)  # what never yields always fits here
        kept = None
        if last is not None and last[1].kept is not None:
            kept = last[1].kept.truncated(shared_prefix(tuple(last[0]), tuple(items)))
            used += 1
        got = allocation(items, body, fixed, kept, tiled=True)
        assert got == want, (kind, len(items))
        cuts += got.pressure.left_out_items > 0
        sums_kept += kept is not None and kept.sums is not None
        assert got.kept is not None and want.kept is not None
        same_facts(got.kept, want.kept)
        last = (list(items), got)
    assert used == len(edits) - 1  # every allocation after the first was given what it found
    event("history cut", cuts > 0)
    event("given the running sums of the last cut", sums_kept > 0)


def test_an_appended_turn_cuts_on_the_running_sums_the_last_cut_found() -> None:
    """A session over its budget, a turn appended at a time: each cut after the first is
    found on the last cut's running sums (the costs they sum are the same up to the pointer
    this turn's steps made), and lands where a cut given nothing lands."""
    def turn(k: int) -> list[ConversationItem]:
        return [*exchange(k, 300 + 37 * k),
                AssistantMessageItem(id=f"a{k}", sequence=2 * k + 1, run_id="run-0",
                                     item_trust=TrustLevel.USER, text="x" * 400)]

    items: list[ConversationItem] = [x for k in range(12) for x in turn(k)]
    last = allocation(items, 2_500, 100, None, tiled=True)
    assert last.kept is not None and last.kept.sums is not None and last.pressure.cut_index > 0
    for k in range(12, 20):
        before = list(items)
        items += turn(k)
        assert last.kept is not None
        kept = last.kept.truncated(shared_prefix(tuple(before), tuple(items)))
        assert kept.sums is not None and len(kept.sums) == kept.held + 1
        got = allocation(items, 2_500, 100, kept, tiled=True)
        want = allocation(items, 2_500, 100, None)
        assert got == want and got.pressure.cut_index > 0
        assert got.kept is not None and want.kept is not None
        same_facts(got.kept, want.kept)
        last = got


def test_kept_steps_cut_to_fewer_candidates_hold_what_those_alone_would_give() -> None:
    """``truncated(n)`` is what an allocation of the first n candidates would keep, where its
    pointer steps go as far: the queue, ids and gains before n, and the history with only the
    pointers that lie before n."""
    items = [*exchange(0, 900), *exchange(1, 800), *exchange(2, 700), *exchange(3, 600)]
    whole = allocation(items, 2_000, 100, None).kept
    assert whole is not None and whole.taken == 4  # every result a pointer
    part = whole.truncated(4)
    alone = allocation(items[:4], 1_200, 100, None).kept  # the two results of items[:4] taken
    assert alone is not None and alone.taken == 2
    same_facts(part, alone)
    assert whole.truncated(len(items)) is whole


PLANS: dict[str, LoadedPlan] = {}


def plan() -> LoadedPlan:
    if "p" not in PLANS:  # a small window: the pointer steps run on almost every Build
        PLANS["p"] = f.loaded(f.inputs(
            session_id="kept-steps",
            model_profile=f.model("gpt-4o", context_window=16_000, output_reserve=4_096)))
    return PLANS["p"]


def outcome(lp: LoadedPlan, items: list[ConversationItem], factor: float,
            memo: BoundedMemo | None) -> BuildResult:
    """The Build of ``items`` (carried history: run-0) and a new user message that begins the
    active run."""
    asked = f.user("u-next", "and now?", 1_000_000, run="run-9")
    return build(lp, f.checkpoint([*items, asked], run="run-9"),
                 estimator=f.estimator(lp.plan.spec.model), factor=factor, memo=memo)


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(st.tuples(st.sampled_from(("append", "append", "drop", "rewrite", "factor",
                                           "talk")),
                          st.integers(0, 10_000)), min_size=3, max_size=20))
def test_builds_that_yield_results_on_one_memo_are_the_builds_without_it(
        edits: list[tuple[str, int]]) -> None:
    """``build()`` on one memo, turn after turn, equals ``build()`` without one, in sessions
    whose results pass the tool results' cap on almost every Build: appended, taken back,
    rewritten in place (same id, other content), at another correction factor, and between
    them long replies that no pointer shortens, so that history is cut too."""
    lp = plan()
    memo = BoundedMemo(64 << 20)
    words = ("alpha", "beta", "gamma", "delta", "42", "line\nbreak")
    numbers = itertools.count(1)
    items: list[ConversationItem] = [f.user("u0", "start", 0, run="run-0")]
    factor = 1.0
    for kind, n in edits:
        k = next(numbers)
        if kind == "append":
            text = " ".join(words[(n + i) % len(words)] for i in range(1_500 + n % 1_500))
            items += [f.call(f"c{k}", 2 * k, f"call{k}", run="run-0"),
                      f.result(f"r{k}", 2 * k + 1, f"call{k}", text, run="run-0")]
        elif kind == "drop" and len(items) > 1:  # the last reply or exchange taken back
            items = items[:-1] if isinstance(items[-1], AssistantMessageItem) else items[:-2]
        elif kind == "rewrite":
            at = [i for i, item in enumerate(items) if isinstance(item, ToolResultItem)]
            if at:
                i = at[n % len(at)]
                items[i] = replace(items[i], content=" ".join(words[:1 + n % 5]) * (n % 400))
        elif kind == "factor":
            factor = (1.0, 1.3, 0.8)[n % 3]
        elif kind == "talk":  # what no pointer shortens: history is cut
            items.append(AssistantMessageItem(
                id=f"a{k}", sequence=2 * k, run_id="run-0", item_trust=TrustLevel.USER,
                text=" ".join(words[(n + i) % len(words)] for i in range(2_000 + n % 3_000))))
        got = outcome(lp, items, factor, memo)
        assert got == outcome(lp, items, factor, None), kind
        # the history step names exactly the items before the cut (read off the checkpoint)
        cut = [s.ids for s in got.pressure.steps if s.step == "history"]
        assert cut == ([tuple(i.id for i in items[:got.pressure.cut_index])]
                       if got.pressure.cut_index else [])
        large = sum(isinstance(i, ToolResultItem) and len(i.content) >= 8_000 for i in items)
        if large >= 2:  # two such results pass the cap: the pointer steps must have run
            assert any(s.step == "tool_results" for s in got.pressure.steps)
