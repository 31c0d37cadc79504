"""Hard gate: history-cut determinism (spec: "What history selection retains", "Hard gates").

``select_history(items, summary_floor, history_tokens, cost)`` returns one index; the retained
set ``items[cut:]`` must be a contiguous suffix that fits ``history_tokens``, never reaches at
or below the summary floor (an event *sequence*, compared with each item's sequence), never
holds half of a tool pair (parallel calls share one call item and are one unit with all their
results; a call item issued before an earlier one's results arrived joins that unit), is the
largest such suffix, and is identical across two calls on the same input.

The generated histories interleave: a second call item before the first one's results,
results arriving before a later call item, parallel results out of order, messages and
reasoning between them (``tool_exchanges`` in strategies.py).

Every property is checked against an oracle written here from the spec's wording, sharing no
code with ``history.py``: valid cut positions are the indices no call/result pair straddles,
and the expected cut is the smallest valid index above the floor whose suffix fits.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import pytest
from context_engine.domain.budget import _cut
from context_engine.domain.compaction import Target, select
from context_engine.domain.errors import NothingToCompact
from context_engine.domain.history import (
    compact_through,
    floor_index,
    select_history,
    units,
    units_of,
)
from context_engine.domain.items import (
    AssistantMessageItem,
    ConversationItem,
    HistorySummary,
    ReasoningItem,
    RenderContext,
    ToolCallItem,
    ToolResultItem,
    UserMessageItem,
)
from context_engine.domain.request import ToolCall
from context_engine.domain.trust import TrustLevel
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st

from tests import factories as f
from tests.property.strategies import CALL, EXCHANGE_SHAPES, RESULT, tool_exchanges

pytestmark = pytest.mark.gate_history_cut

GATE_SETTINGS = settings(max_examples=100, deadline=None, derandomize=True, database=None,
                         suppress_health_check=[HealthCheck.too_slow,
                                                HealthCheck.data_too_large])

WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa", "omega",
         "{\"k\": 1}", "<div>", "</div>", "ok", "42")


def words(n: int, seed: int) -> str:
    """Word ``i`` is ``WORDS[(seed + 7 * i) % len(WORDS)]``: two alternating words (14 words),
    built from the repeated pair."""
    pair = (WORDS[seed % len(WORDS)], WORDS[(seed + 7) % len(WORDS)])
    whole, rest = divmod(max(n, 0), 2)
    return " ".join([*([" ".join(pair)] * whole), *pair[:rest]])


@dataclass(frozen=True)
class History:
    items: tuple[ConversationItem, ...]
    costs: tuple[int, ...]  # an arbitrary cost per item (huge for huge results)


@st.composite
def histories(draw: st.DrawFn, *, max_blocks: int = 14) -> History:
    """User and assistant messages, reasoning, and tool exchanges (``tool_exchanges``): call
    items with 1-3 parallel calls, often a second call item before the first one's results,
    results arriving before a later call item, parallel results in another order than their
    calls, messages and reasoning between call items and between results; an exchange stays
    in one run. Sequences are non-decreasing (equal sequences allowed, including inside a
    pair); some results are huge."""
    item_no = itertools.count(1)
    call_no = itertools.count(1)
    seq = draw(st.integers(0, 50))
    items: list[ConversationItem] = []
    costs: list[int] = []

    def nseq() -> int:
        nonlocal seq
        seq += draw(st.sampled_from((0, 1, 1, 2, 5)))
        return seq

    def small() -> int:
        return draw(st.integers(0, 400))

    def message(kind: str, run: str) -> None:
        if kind == "user":
            items.append(UserMessageItem(id=f"i{next(item_no)}", sequence=nseq(), run_id=run,
                                         item_trust=TrustLevel.USER,
                                         text=words(draw(st.integers(0, 30)), len(items))))
        elif kind == "assistant":
            items.append(AssistantMessageItem(id=f"i{next(item_no)}", sequence=nseq(),
                                              run_id=run, item_trust=TrustLevel.USER,
                                              text=words(draw(st.integers(0, 30)), len(items))))
        else:
            items.append(ReasoningItem(id=f"i{next(item_no)}", sequence=nseq(), run_id=run,
                                       item_trust=TrustLevel.USER, provider="anthropic",
                                       opaque=bytes(draw(st.integers(0, 60)))))
        costs.append(small())

    def exchange(run: str) -> None:
        batches: list[tuple[ToolCall, ...]] = []
        for kind, k, n in draw(tool_exchanges(late_others=True)):
            if kind == CALL:
                batches.append(tuple(ToolCall(call_id=f"call_{next(call_no)}", name="web.fetch",
                                              arguments_json=json.dumps({"q": len(items)}))
                                     for _ in range(n)))
                items.append(ToolCallItem(id=f"i{next(item_no)}", sequence=nseq(), run_id=run,
                                          item_trust=TrustLevel.USER, calls=batches[k]))
                costs.append(small())
            elif kind == RESULT:
                c = batches[k][n]
                huge = draw(st.integers(0, 4)) == 0
                size = draw(st.integers(2_000, 60_000)) if huge else draw(st.integers(0, 300))
                items.append(ToolResultItem(
                    id=f"i{next(item_no)}", sequence=nseq(), run_id=run,
                    item_trust=draw(st.sampled_from((TrustLevel.EXTERNAL_UNTRUSTED,
                                                     TrustLevel.USER))),
                    call_id=c.call_id, tool_name=c.name,
                    content=words(size // 8 if huge else size // 4, len(items))))
                costs.append(size)
            else:
                message(draw(st.sampled_from(("user", "assistant", "reasoning"))), run)

    for _ in range(draw(st.integers(0, max_blocks))):
        kind = draw(st.sampled_from(("user", "assistant", "reasoning", "tools", "tools",
                                     "tools")))
        run = draw(st.sampled_from(("run-1", "run-2")))
        if kind == "tools":
            exchange(run)
        else:
            message(kind, run)
    return History(items=tuple(items), costs=tuple(costs))


@st.composite
def floors(draw: st.DrawFn, items: Sequence[ConversationItem]) -> int:
    """0 (no summary), a sequence some item carries (often), or anything around them."""
    seqs = [i.sequence for i in items]
    lo, hi = (min(seqs) - 3, max(seqs) + 3) if seqs else (-3, 3)
    return draw(st.one_of(st.just(0), st.sampled_from(seqs) if seqs else st.just(0),
                          st.integers(lo, hi)))


@st.composite
def budgets(draw: st.DrawFn, costs: Sequence[int]) -> int:
    """Anything from nothing to more than everything, often near a suffix boundary."""
    total = sum(costs)
    suffix_sums = [sum(costs[k:]) for k in range(len(costs) + 1)]
    return draw(st.one_of(st.integers(0, total + 10),
                          st.sampled_from(suffix_sums).flatmap(
                              lambda s: st.integers(max(s - 2, 0), s + 2)),
                          st.just(0), st.just(total)))


# --------------------------------------------------------------------------- the oracle

def pair_spans(items: Sequence[ConversationItem]) -> list[tuple[int, int]]:
    """(call index, result index) for every call and each of its results."""
    where_called: dict[str, int] = {}
    spans: list[tuple[int, int]] = []
    for i, item in enumerate(items):
        if isinstance(item, ToolCallItem):
            for call in item.calls:
                where_called[call.call_id] = i
        elif isinstance(item, ToolResultItem):
            spans.append((where_called[item.call_id], i))
    return spans


def valid_cuts(items: Sequence[ConversationItem]) -> list[int]:
    """Indices c such that no call/result pair has its call before c and its result at or
    after c (the only boundaries a suffix may start at)."""
    spans = pair_spans(items)
    return [c for c in range(len(items) + 1)
            if not any(call < c <= res for call, res in spans)]


def first_above_floor(items: Sequence[ConversationItem], floor: int) -> int:
    """Index of the first item whose sequence is above the floor (sequences are
    non-decreasing, so everything before it is at or below the floor)."""
    return next((i for i, item in enumerate(items) if item.sequence > floor), len(items))


def expected_cut(items: Sequence[ConversationItem], floor: int, budget: int,
                 costs: Sequence[int]) -> int:
    lowest = first_above_floor(items, floor)
    return min(c for c in valid_cuts(items)
               if c >= lowest and sum(costs[c:]) <= budget)


def orphans_in(items: Sequence[ConversationItem]) -> list[str]:
    """Call ids in ``items`` whose call or one of whose results is missing from ``items``."""
    called = {c.call_id for i in items if isinstance(i, ToolCallItem) for c in i.calls}
    answered = [i.call_id for i in items if isinstance(i, ToolResultItem)]
    return sorted((called ^ set(answered)) | {a for a in answered if answered.count(a) > 1})


def check_cut(items: Sequence[ConversationItem], floor: int, budget: int,
              costs: Sequence[int]) -> int:
    calls: list[int] = []

    def cost(i: int) -> int:
        calls.append(i)
        return costs[i]

    cut = select_history(items, floor, budget, cost)
    n = len(items)

    # An index, so the retained set is the contiguous suffix items[cut:].
    assert isinstance(cut, int) and not isinstance(cut, bool)
    assert 0 <= cut <= n
    assert all(0 <= i < n for i in calls), "cost() was asked about an index out of range"
    # Fits.
    assert sum(costs[cut:]) <= budget
    # Never at or below the summary floor (sequence compared with sequence).
    assert all(item.sequence > floor for item in items[cut:]), \
        f"retained an item at or below the floor {floor}"
    # Never half a pair.
    assert orphans_in(items[cut:]) == [], f"cut {cut} splits a tool pair"
    # Largest: the previous whole unit would not fit or would cross the floor.
    if cut > 0:
        previous = max(c for c in valid_cuts(items) if c < cut)
        crosses_floor = any(item.sequence <= floor for item in items[previous:cut])
        assert crosses_floor or sum(costs[previous:]) > budget, (
            f"cut {cut} is not the largest suffix: items[{previous}:] also fits "
            f"({sum(costs[previous:])} <= {budget}) above the floor")
    assert cut == expected_cut(items, floor, budget, costs)
    # Identical across two calls (and with an equal, separately built cost function).
    assert select_history(items, floor, budget, cost) == cut
    again = list(costs)
    assert select_history(tuple(items), floor, budget, lambda i: again[i]) == cut
    return cut


# --------------------------------------------------------------------------- properties

@GATE_SETTINGS
@given(data=st.data())
def test_cut_is_the_largest_fitting_pair_safe_suffix_above_the_floor(
        data: st.DataObject) -> None:
    h = data.draw(histories(), label="history")
    floor = data.draw(floors(h.items), label="summary floor")
    budget = data.draw(budgets(h.costs), label="history_tokens")
    check_cut(h.items, floor, budget, h.costs)


@GATE_SETTINGS
@given(data=st.data())
def test_compacting_through_the_cuts_sequence_replaces_what_it_left_out(
        data: st.DataObject) -> None:
    """``compact_through`` (Build's ``compact_through_sequence``) as a compaction's
    ``replace_through``: it replaces every item the cut left out (a summary's floor is a
    sequence, so a cut inside one event takes the rest of that event and the units it runs
    into, to where the sequence rises), replaces nothing past that, and marks the floor at
    that sequence; where the cut is at a rise, exactly what was left out."""
    h = data.draw(histories(), label="history")
    floor = data.draw(floors(h.items), label="summary floor")
    budget = data.draw(budgets(h.costs), label="history_tokens")
    items = h.items
    lowest = floor_index(items, floor)
    cut = select_history(items, floor, budget, h.costs.__getitem__)
    through = compact_through(items[lowest:], cut - lowest)
    assert through == compact_through(items[lowest:], cut - lowest, units(items[lowest:]))
    if cut == lowest:
        assert through == 0
        return
    left = items[lowest:cut]
    assert through >= max(i.sequence for i in left)
    current = HistorySummary(text="", replaced_through_sequence=floor, depth=0)
    try:
        sel = select(items, current, active_run_id="run-9", reason="budget_pressure",
                     target=Target(replace_through=through), cost=lambda _: 1)
    except NothingToCompact:  # opaque reasoning alone is never summarized
        assert all(isinstance(i, ReasoningItem) for i in left)
        return
    end = lowest + len(sel.replaced)
    assert sel.replaced == items[lowest:end] and end >= cut
    assert sel.replaced_through_sequence == through
    assert all(i.sequence > through for i in items[end:])  # none kept falls under the floor
    if cut < len(items) and items[cut].sequence > max(i.sequence for i in left):
        assert end == cut  # a cut where the sequence rises: what was left out, no more
    elif end < len(items):  # past the event the cut fell inside, to a unit beginning above
        assert end in {begin for begin, _ in units(items)}
        assert items[end].sequence > max(i.sequence for i in items[lowest:end])


_MODEL = f.model("gpt-4o", context_window=128_000)
_EST = f.estimator(_MODEL)
_CTX = RenderContext(session_key="tenant-a/session-1")


@settings(max_examples=50, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_cut_with_the_real_estimator_is_stable(data: st.DataObject) -> None:
    """The same gate with costs from the per-model estimator over the rendered items, the way
    the allocator calls it (the estimator is pure: the same numbers on every call)."""
    h = data.draw(histories(max_blocks=10), label="history")
    costs = tuple(_EST.messages(item.messages(_CTX)) for item in h.items)  # type: ignore[attr-defined]
    assert costs == tuple(_EST.messages(item.messages(_CTX))  # type: ignore[attr-defined]
                          for item in h.items)
    floor = data.draw(floors(h.items), label="summary floor")
    budget = data.draw(budgets(costs), label="history_tokens")
    check_cut(h.items, floor, budget, costs)


# --------------------------------------------------------------------------- worked examples

def _call(item_id: str, seq: int, *ids: str) -> ToolCallItem:
    return f.call(item_id, seq, *ids)


def _result(item_id: str, seq: int, call_id: str) -> ToolResultItem:
    return f.result(item_id, seq, call_id, "r")


def test_a_cut_inside_parallel_calls_moves_later_past_all_their_results() -> None:
    items = [f.user("u", "q", 1), _call("c", 2, "a", "b", "c"), _result("ra", 3, "a"),
             _result("rb", 4, "b"), _result("rc", 5, "c"), f.user("u2", "next", 6)]
    costs = [10, 10, 10, 10, 10, 10]
    # 35 tokens would admit "rb" onwards by count alone; the unit is c..rc (40), so only u2.
    assert check_cut(items, 0, 35, costs) == 5
    assert check_cut(items, 0, 50, costs) == 1
    assert check_cut(items, 0, 60, costs) == 0


def test_the_floor_is_a_sequence_and_a_floor_inside_a_pair_excludes_the_pair() -> None:
    # Equal sequences inside the pair: floor 3 covers the call and one result but not the other.
    items = [f.user("u", "q", 1), _call("c", 3, "a", "b"), _result("ra", 3, "a"),
             _result("rb", 4, "b"), f.user("u2", "next", 9)]
    costs = [1, 1, 1, 1, 1]
    assert check_cut(items, 3, 100, costs) == 4
    # A floor below every sequence admits everything; one above admits nothing.
    assert check_cut(items, 0, 100, costs) == 0
    assert check_cut(items, 9, 100, costs) == 5


def test_zero_budget_and_empty_history() -> None:
    assert check_cut([], 0, 0, []) == 0
    items = [f.user("u", "q", 1)]
    assert check_cut(items, 0, 0, [5]) == 1
    assert check_cut(items, 0, 0, [0]) == 0


def test_interleaved_call_items_are_one_unit_with_all_their_results() -> None:
    # A second call item before the first one's result, and the parallel results of the
    # second out of order and after the first's: c1..rb is one unit (a cut at rc or rb would
    # leave c2's other result without its call).
    items = [f.user("u", "q", 1), _call("c1", 2, "a"), _call("c2", 3, "b", "c"),
             _result("ra", 4, "a"), _result("rc", 5, "c"), _result("rb", 6, "b"),
             f.user("u2", "next", 7)]
    costs = [10] * 7
    assert check_cut(items, 0, 35, costs) == 6
    assert check_cut(items, 0, 59, costs) == 6
    assert check_cut(items, 0, 60, costs) == 1
    assert check_cut(items, 0, 70, costs) == 0
    # The summary floor covers the first call item only: the whole exchange stays out.
    assert check_cut(items, 2, 1_000, costs) == 6
    assert check_cut(items, 3, 1_000, costs) == 6


def test_a_result_before_a_later_call_item_keeps_the_exchange_whole() -> None:
    # c1's first result arrives before c2, its second after c2's: one unit c1..rb.
    items = [f.user("u", "q", 1), _call("c1", 2, "a", "b"), _result("ra", 3, "a"),
             _call("c2", 4, "c"), _result("rc", 5, "c"), _result("rb", 6, "b")]
    costs = [1] * 6
    assert check_cut(items, 0, 4, costs) == 6
    assert check_cut(items, 0, 5, costs) == 1
    # Answered in turn, the two call items are two units: the cut may fall between them.
    items = [f.user("u", "q", 1), _call("c1", 2, "a"), _result("ra", 3, "a"),
             _call("c2", 4, "b"), _result("rb", 5, "b")]
    assert check_cut(items, 0, 2, [1] * 5) == 3
    assert check_cut(items, 0, 3, [1] * 5) == 3
    assert check_cut(items, 0, 4, [1] * 5) == 1


@pytest.mark.parametrize("shape", sorted(EXCHANGE_SHAPES))
def test_the_generators_produce_every_interleaving(shape: str) -> None:
    """The exchanges behind every history and ladder generator keep producing each shape
    (found within a few examples, deterministically)."""
    found = find(tool_exchanges(), EXCHANGE_SHAPES[shape],
                 settings=settings(derandomize=True, database=None, max_examples=200))
    assert EXCHANGE_SHAPES[shape](found)


@GATE_SETTINGS
@given(data=st.data())
def test_the_allocators_search_finds_the_walks_cut(data: st.DataObject) -> None:
    """The allocator's cut (``budget._cut``: no floor, found by a search of running sums)
    against this gate's oracle and against the walk (``select_history``), with the units
    given or found, for any room (below nothing too)."""
    h = data.draw(histories(), label="history")
    room = data.draw(st.one_of(budgets(h.costs), st.integers(-50, -1)), label="room")
    spans = data.draw(st.sampled_from((None, units(h.items))), label="spans")
    lowest = min((i.sequence for i in h.items), default=0) - 1  # below every item: no floor
    want = expected_cut(h.items, lowest, max(room, 0), h.costs)
    assert _cut(list(h.items), list(h.costs), room, spans) == want
    assert select_history(h.items, None, max(room, 0), h.costs.__getitem__, spans) == want
    # as the builder hands it the units (which tile the history) and the running sums
    found = units_of(list(h.items))
    assert found.tiles
    assert _cut(list(h.items), list(h.costs), room, found.spans,
                tiling=(found.begins, found.ends),
                sums=[0, *accumulate(h.costs)]) == want


def test_the_allocators_search_walks_where_it_cannot_search() -> None:
    """Units that do not run end to end (short of the last item, a gap, one running backwards)
    or a negative cost: the walk's cut; no units at all: no cut, as the walk finds."""
    items = [f.user("u", "q", 1), _call("c", 2, "a"), _result("ra", 3, "a"),
             f.user("u2", "next", 4)]
    for costs, spans, room, walked in (([5, 5, 5, 5], [(0, 1), (1, 3)], 10, 1),  # not to the end
                                       ([5, 5, 5, 5], [(0, 1), (3, 4)], 12, 0),  # a gap
                                       ([9, -8, 5, 0], [(0, 1), (1, 2), (2, 4)], 0, 4),
                                       ([5, 5, 5, 5], [(0, 2), (2, 1), (1, 4)], 14, 4),
                                       ([5, 5, 5, 5], [], 3, 4)):
        assert select_history(items, None, room, costs.__getitem__, spans) == walked
        assert _cut(items, costs, room, spans) == walked
        if spans and [e for _, e in spans[:-1]] == [b for b, _ in spans[1:]] \
                and spans[-1][1] == len(items) and all(b < e for b, e in spans):
            # spans that tile, handed in as tiling: a negative cost still walks
            tiling = ([b for b, _ in spans], [e for _, e in spans])
            assert _cut(items, costs, room, spans, tiling=tiling) == walked
