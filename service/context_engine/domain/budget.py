"""The budget allocator and the yield ladder (spec: "The budget allocator", "Yield order under
pressure"). Pure: the same plan, checkpoint, factor and policy give the same allocation.

Capacity is ``min(model window, policy cap)``; the output reserve comes off first, then the
safety margin, then the measured prefix. What remains is the body. Classes that never yield
fail instead; every other class has an absolute cap except tool results (a share of the body)
and history (the remainder). When the body does not fit, the ladder yields in a fixed order and
no further than needed: knowledge passages drop whole, lowest-ranked first; recall trims to its
floor; tool results become typed pointers, oldest first; then history is cut, which is the
signal that compaction is needed (``compaction_helps``: when what never yields does not fit even
so, only where merging the current summary into a smaller one can make it fit).

History's floor (8,000 tokens, or all of it if less) is guaranteed by Plan, which refuses a plan
whose body budget cannot hold it with the prefix costed as Build costs it at the tenant's
correction factor of the time (``require_history_floor``); when never-yield items still push
history below it at Build, or the body budget itself is below it (the factor raised since Plan,
or pinned higher on the request), ``Pressure.history_floor_shortfall`` says by how much, and
``Pressure.prefix_floor_shortfall`` how much of it is the body budget's.

The prefix is measured once, at Plan time. Where it was counted with the model's own tokenizer
it is exact and never scaled; where the count is itself approximate (a base factor, as for
Claude and Gemini, or a fallback encoding) the correction factor scales it like the body
(``prefix_cost``), because reconciliation then derives the factor from the whole estimate.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from itertools import accumulate, chain, compress, count, repeat
from operator import attrgetter, itemgetter, lt, ne, not_, sub
from typing import cast

from context_engine.domain.errors import BudgetExceeded, HistoryFloorUnreachable
from context_engine.domain.history import Span, compact_through, select_history, units
from context_engine.domain.items import (
    MAX_DEPTH,
    MAX_SUMMARY_TOKENS,
    NARRATIVE_FLOOR,
    ContextItem,
    ConversationItem,
    HistorySummary,
    KnowledgeItem,
    KnowledgePassage,
    MemoryLine,
    RecallItem,
    ToolCallItem,
    ToolResultItem,
)

SKILL_BODY_ITEMS = 2
SKILL_BODY_TOKENS = 6_000
WORKING_STATE_TOKENS = 1_000
KNOWLEDGE_ITEMS = 3
KNOWLEDGE_TOKENS = 3_000
RECALL_TOKENS = 2_000
TOOL_RESULT_SHARE = 0.25
HISTORY_FLOOR_TOKENS = 8_000
STEPS = ("knowledge", "recall", "tool_results", "history")
# a result's typed pointer and what the pointer costs
Pointed = tuple[ToolResultItem, int]
_IS_ELIDED = attrgetter("elided")
_ID = attrgetter("id")
_COST = itemgetter(1)  # of a Pointed


@dataclass(frozen=True, kw_only=True, slots=True)
class BudgetPolicy:
    """Deployment settings of the allocator (explicit inputs of the pure build)."""

    safety_margin_ratio: float = 0.05
    policy_cap_tokens: int = 0  # 0: no policy cap below the model window
    inline_maximum_bytes: int = 16_384
    recall_floor_tokens: int = 500


@dataclass(frozen=True, kw_only=True, slots=True)
class ClassBudget:
    class_name: str
    cap: int  # 0: uncapped
    used: int
    items: int
    yielded: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class YieldStep:
    step: str
    units: int
    ids: tuple[str, ...]
    tokens_before: int
    tokens_after: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Pressure:
    """What the ladder did. Emitted as ``context.budget.pressure`` whenever a step ran."""

    steps: tuple[YieldStep, ...]
    fits: bool
    tokens_before: int
    tokens_after: int
    body_budget: int
    compaction_needed: bool
    left_out_items: int
    left_out_tokens: int
    cut_index: int  # index into the checkpoint's items of the first retained history item
    floor_index: int  # first item above the summary floor
    legacy_tool_excerpts: int
    # history was left this many tokens short of its floor (8,000, or all of the history
    # candidates if less); 0: the floor held. What never yields, or the body budget itself
    # (``prefix_floor_shortfall``), or both
    history_floor_shortfall: int = 0
    # the part of ``history_floor_shortfall`` the body budget itself is short of the floor by,
    # with every other body class empty: the prefix as this Build costs it (at its correction
    # factor, raised by ReportUsage since Plan held the body to the floor, or pinned higher on
    # the request) or a policy cap lowered under the plan, not what never yields; 0: the body
    # budget holds the floor
    prefix_floor_shortfall: int = 0
    # the event sequence a compaction replaces through to replace what the cut left out:
    # rounded up to where the sequence rises (``history.compact_through``); 0: none left out
    compact_through_sequence: int = 0

    @property
    def yielded(self) -> bool:
        return bool(self.steps)


@dataclass(frozen=True, kw_only=True, slots=True)
class BudgetReport:
    total_tokens: int  # min(window, policy cap)
    output_reserve: int
    safety_margin_ratio: float
    margin_tokens: int
    prefix_tokens: int
    body_budget: int
    body_tokens: int
    estimated_total: int  # prefix + body
    estimator_factor: float
    history_floor: int
    classes: tuple[ClassBudget, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class Budget:
    total_tokens: int
    output_reserve: int
    margin_tokens: int
    body_budget: int


def compute_budget(*, window: int, output_reserve: int, prefix_tokens: int,
                   policy: BudgetPolicy) -> Budget:
    total = min(window, policy.policy_cap_tokens) if policy.policy_cap_tokens else window
    available = total - output_reserve  # subtracted first: a request must leave room to answer
    margin = math.ceil(max(available, 0) * policy.safety_margin_ratio)
    body = available - margin - prefix_tokens
    if body <= 0:  # a request needs the prefix and at least one token of body
        room = max(available - margin, 0)
        raise BudgetExceeded("prefix", max(prefix_tokens, room + 1), room)
    return Budget(total_tokens=total, output_reserve=output_reserve, margin_tokens=margin,
                  body_budget=body)


def require_history_floor(budget: Budget, *, model_id: str, window: int, prefix_tokens: int,
                          policy: BudgetPolicy, measured_prefix_tokens: int | None = None,
                          factor: float | None = None) -> None:
    """Plan's guarantee of the history floor: a body budget that cannot hold 8,000 tokens of
    history even with every other body class empty is refused, naming the numbers.
    ``prefix_tokens``: the prefix as Build charges it (``budget`` is computed with it);
    ``measured_prefix_tokens`` and ``factor``, where given, what it measured and the correction
    factor that scaled it, named too where they differ."""
    if budget.body_budget < HISTORY_FLOOR_TOKENS:
        raise HistoryFloorUnreachable(
            model_id=model_id, window=window, policy_cap_tokens=policy.policy_cap_tokens,
            output_reserve=budget.output_reserve, margin_tokens=budget.margin_tokens,
            prefix_tokens=prefix_tokens, body_budget=budget.body_budget,
            history_floor=HISTORY_FLOOR_TOKENS, measured_prefix_tokens=measured_prefix_tokens,
            estimator_factor=factor)


def prefix_cost(prefix_tokens: int, factor: float, *, exact: bool) -> int:
    """What the prefix costs in the budget: its measured count where that count is exact, the
    count scaled by the correction factor (rounded up) where it is itself an estimate."""
    return prefix_tokens if exact else math.ceil(prefix_tokens * factor)


@dataclass
class _Ledger:
    """Mutable working state of one allocation (local to ``allocate``; never escapes)."""

    fixed: dict[str, int]
    knowledge: list[KnowledgePassage]
    recall: list[MemoryLine]
    history: list[ConversationItem]  # carried candidates above the floor
    active: list[ConversationItem]
    history_costs: list[int]
    active_costs: list[int]
    knowledge_cost: int = 0
    recall_cost: int = 0
    steps: dict[str, list[YieldStep]] = field(default_factory=dict)
    cut: int = 0
    # running sums, so that every step of the ladder is O(1) and a build is linear
    fixed_total: int = 0
    history_total: int = 0  # of history_costs[cut:]
    active_total: int = 0
    results_total: int = 0  # of every retained tool result, wherever it sits

    def history_cost(self) -> int:
        return self.history_total

    def total(self) -> int:
        return (self.fixed_total + self.active_total + self.history_total
                + self.knowledge_cost + self.recall_cost)


@dataclass(frozen=True, kw_only=True, slots=True)
class Allocation:
    summary: HistorySummary | None
    history: tuple[ConversationItem, ...]  # retained carried history
    active: tuple[ConversationItem, ...]
    knowledge: tuple[KnowledgePassage, ...]
    recall: tuple[MemoryLine, ...]
    report: BudgetReport
    pressure: Pressure
    # what the pointer steps found over the history candidates, for a later allocation whose
    # candidates begin alike (``KeptSteps``): a cache, not part of what was allocated
    kept: KeptSteps | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class KeptSteps:
    """What an allocation found over its first ``held`` history candidates (``carried[floor:]``),
    for a later allocation whose candidates begin with the same items at the same pricing, so
    with the same costs and pointers: which are results, their ids, the pointer queue over
    them (the results not pointers already) with each queued result's id, gain and the running
    sums of the gains (over the first ``len(gain)`` queued, where a pointer step found them),
    and the history as the first ``taken`` queued results left it (a pointer in place of each
    that frees something) with its costs. Each is a prefix-closed fact of those candidates:
    ``truncated`` keeps what holds of fewer of them."""

    held: int
    results: list[bool]
    ids: list[str]
    queue: list[int]
    queue_ids: list[str]
    gain: list[int]
    reach: list[int]
    taken: int
    history: list[ConversationItem]
    history_costs: list[int]
    # the running sums of ``history_costs`` (sums[i]: the cost of the first i), where the
    # history cut found them; None where it did not run
    sums: list[int] | None = None

    def truncated(self, held: int) -> KeptSteps:
        """What holds of the first ``held`` candidates alone."""
        if held >= self.held:
            return self
        queued = bisect_left(self.queue, held)  # the queue is in candidate order
        taken = min(self.taken, queued)  # the pointers past ``held`` are not in its history
        return KeptSteps(
            held=held, results=self.results[:held], ids=self.ids[:held],
            queue=self.queue[:queued], queue_ids=self.queue_ids[:queued],
            gain=self.gain[:queued], reach=self.reach[:queued], taken=taken,
            history=self.history[:held], history_costs=self.history_costs[:held],
            sums=self.sums[:held + 1] if self.sums is not None else None)


_INIT_FIELDS: dict[type, tuple[str, ...]] = {}


def elided(item: ToolResultItem) -> ToolResultItem:
    """``dataclasses.replace(item, elided=True)``, with the type's field names read once."""
    names = _INIT_FIELDS.get(type(item))
    if names is None:
        names = _INIT_FIELDS[type(item)] = tuple(f.name for f in fields(item) if f.init)
    values = {name: getattr(item, name) for name in names}
    values["elided"] = True
    return type(item)(**values)


def pending_results(active: list[ConversationItem]) -> set[str]:
    """Ids of the results of the active loop's latest call batch that the model has not
    answered yet: never-yield, so they are never turned into pointers. The model is only
    called with every call answered, so the batch starts at the last call item issued while
    no call was open; with interleaved calls it also holds a result that arrived before a
    later call item of the batch. None once anything but a result ends the run."""
    if not active or not isinstance(active[-1], ToolResultItem):
        return set()
    open_calls: set[str] = set()
    start = 0
    for i, item in enumerate(active):
        if isinstance(item, ToolCallItem):
            if not open_calls:
                start = i
            open_calls.update(call.call_id for call in item.calls)
        elif isinstance(item, ToolResultItem):
            open_calls.discard(item.call_id)
    return {item.id for item in active[start:] if isinstance(item, ToolResultItem)}


def allocate(*, budget: Budget, prefix_tokens: int, factor: float, policy: BudgetPolicy,
             summary: HistorySummary | None, carried: list[ConversationItem], floor: int,
             active: list[ConversationItem], fixed: dict[str, int],
             knowledge: list[KnowledgePassage], recall: list[MemoryLine],
             cost: Callable[[ContextItem], int], legacy_tool_excerpts: int,
             position: Callable[[int], int],
             pointer: Callable[[ToolResultItem], ToolResultItem] | None = None,
             spans: Sequence[Span] | None = None,
             costs: Sequence[int] | None = None,
             pointers: list[Pointed | None] | None = None,
             kept: KeptSteps | None = None,
             tiling: tuple[list[int], list[int]] | None = None,
             merged: Callable[[], HistorySummary] | None = None) -> Allocation:
    """Fit the body into ``budget.body_budget``. ``fixed`` holds the costs of the classes that
    never yield (current user message, working state, corrections, skill bodies, summary,
    runtime metadata); ``carried[floor:]`` are the history candidates; ``active`` the active
    run's items (never cut; only its completed results may become pointers). ``position``
    maps an index into ``carried`` to an index into the checkpoint's items; ``pointer`` gives a
    result's typed pointer (``elided``; the caller may keep them); ``spans`` the units of
    ``carried[floor:]`` (``history.units``), and ``costs`` ``cost`` of each item of
    ``carried[floor:]`` then ``active``, when the caller has them. ``pointers``, aligned with
    the same items: each result's pointer and its cost where known (None where not yet); the
    entries a pointer step needs are filled in, so a caller may keep the list for a later
    allocation of items that begin alike (at the same pricing). ``kept``: what an earlier
    allocation found over its first ``kept.held`` history candidates (``Allocation.kept``),
    which the caller has checked are this one's first candidates at the same pricing; the
    allocation takes from it what it would otherwise find again, and returns its own.
    ``tiling``: the begins and ends of ``spans``, which the caller knows tile the candidates
    (``Units.tiles``). ``merged``: what a compaction merging ``summary`` keeps of it
    (``compaction.merge_keeps``: its constraints with the working state's), for
    ``compaction_helps``, made only on a refusal that needs it."""
    B = budget.body_budget
    to_elided = elided if pointer is None else pointer
    knowledge = sorted(knowledge, key=lambda p: (p.rank, p.id))
    ledger = _Ledger(fixed=dict(fixed), knowledge=list(knowledge), recall=list(recall),
                     history=list(carried[floor:]), active=list(active),
                     history_costs=(list(map(cost, carried[floor:])) if costs is None
                                    else list(costs[:len(carried) - floor])),
                     active_costs=(list(map(cost, active)) if costs is None
                                   else list(costs[len(carried) - floor:])))
    ledger.fixed_total = sum(ledger.fixed.values())
    ledger.history_total = sum(ledger.history_costs)
    ledger.active_total = sum(ledger.active_costs)
    held = len(ledger.history)
    if kept is not None:
        kept = kept.truncated(held)
    kept_held = kept.held if kept is not None else 0
    # which items are results (a pointer is one too: it has its result's type), and their
    # ids, at C speed: those of the kept candidates as found before
    new_history = ledger.history[kept_held:]
    history_results = list(map(isinstance, new_history, repeat(ToolResultItem)))
    history_ids = list(map(_ID, new_history))
    if kept is not None:
        history_results = kept.results + history_results
        history_ids = kept.ids + history_ids
    active_results = list(map(isinstance, ledger.active, repeat(ToolResultItem)))
    ledger.results_total = (sum(compress(ledger.history_costs, history_results))
                            + sum(compress(ledger.active_costs, active_results)))
    block_cost = _block_costs(cost)
    ledger.knowledge_cost = block_cost.knowledge(ledger.knowledge)
    ledger.recall_cost = block_cost.recall(ledger.recall)
    before = ledger.total()
    never_pointer = pending_results(ledger.active)

    def record(step: str, ids: list[str], tokens_before: int) -> None:
        if ids:
            ledger.steps.setdefault(step, []).append(YieldStep(
                step=step, units=len(ids), ids=tuple(ids), tokens_before=tokens_before,
                tokens_after=ledger.total()))

    def drop_knowledge() -> str:
        dropped = ledger.knowledge.pop()
        ledger.knowledge_cost = block_cost.knowledge(ledger.knowledge)
        return dropped.id

    def trim_recall(threshold: int) -> list[str]:
        """Recall lines dropped from the end while the block costs more than ``threshold``;
        their ids, the last line first. How many are kept is found in a few renderings of the
        block, galloping down from all of them and then bisecting, not one rendering per line
        dropped (each re-counts the whole block: 4,000 lines took seconds). That is the count
        dropping one line at a time keeps whenever a block costs no less than any of its
        shorter heads. Where a tokenizer's merges would let a longer head cost less than a
        shorter one, the count may be lower; it always fits ``threshold`` (none kept costs 0),
        and so does no head one line longer."""
        lines = ledger.recall
        if not lines or ledger.recall_cost <= threshold:
            return []
        fits, fit_cost, over, step = 0, 0, len(lines), 1
        while len(lines) - step > fits:
            probe = len(lines) - step
            probe_cost = block_cost.recall(lines[:probe])
            if probe_cost <= threshold:
                fits, fit_cost = probe, probe_cost
                break
            over, step = probe, step * 2
        while over - fits > 1:
            mid = (fits + over) // 2
            mid_cost = block_cost.recall(lines[:mid])
            if mid_cost <= threshold:
                fits, fit_cost = mid, mid_cost
            else:
                over = mid
        dropped = [line.id for line in reversed(lines[fits:])]
        del lines[fits:]
        ledger.recall_cost = fit_cost
        return dropped

    # Pointer candidates, oldest first: carried history, then completed active results; each
    # as its index into ``carried[floor:]`` then ``active`` (one sequence, as ``costs`` is),
    # with its id. The kept candidates' are as found before.
    history_result_at = list(compress(range(kept_held, held), history_results[kept_held:]))
    history_queue = list(compress(history_result_at, map(not_, map(_IS_ELIDED, map(
        ledger.history.__getitem__, history_result_at)))))
    history_queue_ids = list(map(history_ids.__getitem__, history_queue))
    if kept is not None:
        history_queue = kept.queue + history_queue
        history_queue_ids = kept.queue_ids + history_queue_ids
    active_queue = [i for i in compress(range(len(ledger.active)), active_results)
                    if not cast(ToolResultItem, ledger.active[i]).elided
                    and ledger.active[i].id not in never_pointer]
    queue = history_queue + [held + i for i in active_queue]
    queue_ids = history_queue_ids + [ledger.active[i].id for i in active_queue]
    queued_in_history = len(history_queue)
    found: list[Pointed | None] = ([None] * (held + len(ledger.active)) if pointers is None
                                   else pointers)
    # What each candidate frees as a pointer (0: a pointer no smaller than its content keeps
    # the content), and those sums running along the queue: found on the first step that
    # has an excess, so a build that needs no pointer computes none (those of the kept
    # candidates' queue as found before).
    gain: list[int] = []
    reach: list[int] = []
    taken = 0  # candidates the pointer steps have gone past, oldest first

    def pointed_at(at: list[int]) -> list[Pointed]:
        """The pointer and its cost of each candidate at ``at`` (indexes into the queue's
        sequence), those no allocation has found yet found now and kept in ``found``."""
        known = list(map(found.__getitem__, at))
        if None in known:
            history, active = ledger.history, ledger.active
            for q, j in enumerate(at):
                if known[q] is None:
                    item = history[j] if j < held else active[j - held]
                    assert isinstance(item, ToolResultItem)
                    pointed = to_elided(item)
                    known[q] = found[j] = (pointed, cost(pointed))
        return cast(list[Pointed], known)

    def gains() -> tuple[list[int], list[int]]:
        """(gain, reach) over the whole queue."""
        gain = kept.gain if kept is not None else []
        reach = kept.reach if kept is not None else []
        rest = queue[len(gain):]
        known = pointed_at(rest)
        contents = map((ledger.history_costs + ledger.active_costs).__getitem__, rest)
        more = list(map(max, map(sub, contents, map(_COST, known)), repeat(0)))
        return gain + more, reach + list(accumulate(more, initial=reach[-1] if reach else 0))[1:]

    def to_pointers(excess: int) -> list[str]:
        """Results become pointers, oldest first, while the tokens they have freed are fewer
        than ``excess`` (a class or the body over its limit by that much: each pointer takes
        what it frees off both) and a candidate is left; their ids. The same decisions as
        taking the candidates one at a time, found by a search of the running sums."""
        nonlocal gain, reach, taken
        if excess <= 0 or taken == len(queue):
            return []
        if not reach:
            gain, reach = gains()
        before = reach[taken - 1] if taken else 0
        # the first candidate after which the freed tokens reach the excess, and it too
        end = min(bisect_left(reach, before + excess, taken) + 1, len(queue))
        # the ids of the candidates that free something (one that frees nothing keeps its
        # content), at C speed
        ids = list(compress(queue_ids[taken:end], gain[taken:end]))
        history, history_costs = ledger.history, ledger.history_costs
        active, active_costs = ledger.active, ledger.active_costs
        start = taken
        if kept is not None and kept.taken > 0 and taken <= kept.taken <= end:
            # the kept history is this one as the first kept.taken queued results leave it
            # (those before ``taken`` are pointers already): taken whole
            history[:kept.held] = kept.history
            history_costs[:kept.held] = kept.history_costs
            start = kept.taken
        chosen = list(compress(range(start, end), gain[start:end]))
        at = list(map(queue.__getitem__, chosen))
        # found by gains() or an earlier allocation (or now: kept gains, not their pointers)
        for j, (pointed, pointer_cost) in zip(at, pointed_at(at), strict=True):
            if j < held:
                history[j], history_costs[j] = pointed, pointer_cost
            else:
                active[j - held], active_costs[j - held] = pointed, pointer_cost
        freed = reach[end - 1] - before
        # history's come first in the queue, then the active run's
        in_history = min(end, queued_in_history)
        freed_in_history = reach[in_history - 1] - before if in_history > taken else 0
        taken = end
        ledger.results_total -= freed
        ledger.history_total -= freed_in_history
        ledger.active_total -= freed - freed_in_history
        return ids

    def tool_result_tokens() -> int:
        return ledger.results_total

    # Class caps first: knowledge 3 passages / 3,000 tokens (dropped whole, lowest-ranked
    # first), recall 2,000 tokens, tool results 25% of the body (oldest become pointers).
    start, ids = ledger.total(), list[str]()
    if len(ledger.knowledge) > KNOWLEDGE_ITEMS:
        # past the item cap, dropped as one at a time would drop them (the lowest-ranked
        # first) but with the block counted once, not once per passage: quadratic otherwise
        ids.extend(p.id for p in reversed(ledger.knowledge[KNOWLEDGE_ITEMS:]))
        del ledger.knowledge[KNOWLEDGE_ITEMS:]
        ledger.knowledge_cost = block_cost.knowledge(ledger.knowledge)
    while ledger.knowledge and ledger.knowledge_cost > KNOWLEDGE_TOKENS:
        ids.append(drop_knowledge())
    record("knowledge", ids, start)
    start = ledger.total()
    record("recall", trim_recall(RECALL_TOKENS), start)
    tool_cap = int(B * TOOL_RESULT_SHARE)
    start = ledger.total()
    record("tool_results", to_pointers(tool_result_tokens() - tool_cap), start)

    # The ladder, in order and no further than needed.
    start, ids = ledger.total(), []
    while ledger.total() > B and ledger.knowledge:
        ids.append(drop_knowledge())
    record("knowledge", ids, start)
    # while the body is over and recall above its floor: recall's cost over both bounds
    start = ledger.total()
    record("recall", trim_recall(max(B - (start - ledger.recall_cost),
                                     policy.recall_floor_tokens)), start)
    start = ledger.total()
    record("tool_results", to_pointers(start - B), start)
    # History's floor (8,000 tokens, or all of it if less) outranks recall's floor: when the
    # room left for history is below it, recall goes below its own floor first.
    if ledger.total() > B:
        start = ledger.total()
        floor_tokens = min(HISTORY_FLOOR_TOKENS, ledger.history_cost())
        # while what is not history is over the room history's floor leaves
        record("recall", trim_recall(B - floor_tokens - (start - ledger.history_cost()
                                                         - ledger.recall_cost)), start)
    start = ledger.total()
    sums: list[int] | None = None
    # Everything but history that is left is what never yields (knowledge and recall are gone
    # by now whenever history cannot keep its floor): the floor's shortfall is theirs, but for
    # what the body budget itself is short of the floor by, which is the prefix's (as this
    # Build costs it) however small the rest.
    floor_tokens = min(HISTORY_FLOOR_TOKENS, ledger.history_cost())
    shortfall = max(floor_tokens - max(B - (start - ledger.history_cost()), 0), 0)
    prefix_shortfall = max(floor_tokens - B, 0)
    if start > B:
        others = start - ledger.history_cost()
        sums = running_sums(ledger.history_costs, kept)
        ledger.cut = _cut(ledger.history, ledger.history_costs, B - others, spans,
                          tiling=tiling, sums=sums)
        left_costs = ledger.history_costs[:ledger.cut]
        ledger.history_total -= sum(left_costs)
        ledger.results_total -= sum(compress(left_costs, history_results[:ledger.cut]))
        left = history_ids[:ledger.cut]  # a pointer has its result's id
        record("history", left, start)

    total = ledger.total()
    steps = tuple(_merge(name, ledger.steps[name]) for name in STEPS if name in ledger.steps)
    left_out_tokens = sum(ledger.history_costs[:ledger.cut])
    pressure = Pressure(
        steps=steps, fits=total <= B, tokens_before=before, tokens_after=total, body_budget=B,
        compaction_needed=compaction_helps(ledger.cut, total, B, summary,
                                           ledger.fixed.get("summary", 0), cost, merged),
        left_out_items=ledger.cut,
        left_out_tokens=left_out_tokens, cut_index=position(floor + ledger.cut),
        floor_index=position(floor), legacy_tool_excerpts=legacy_tool_excerpts,
        history_floor_shortfall=shortfall, prefix_floor_shortfall=prefix_shortfall,
        compact_through_sequence=compact_through(ledger.history, ledger.cut, spans))
    if total > B:
        # Only never-yield items are left: name the largest of their classes.
        shares = {**ledger.fixed, "active_run": sum(ledger.active_costs)}
        largest = max(sorted(shares), key=lambda k: shares[k])
        raise BudgetExceeded(
            largest, total, B, pressure=pressure,
            max_summary_tokens=(summary_cap(total, B, ledger.fixed.get("summary", 0))
                                if pressure.compaction_needed else None))

    classes = (
        ClassBudget(class_name="knowledge", cap=KNOWLEDGE_TOKENS, used=ledger.knowledge_cost,
                    items=len(ledger.knowledge),
                    yielded=len(knowledge) - len(ledger.knowledge)),
        ClassBudget(class_name="recall", cap=RECALL_TOKENS, used=ledger.recall_cost,
                    items=len(ledger.recall), yielded=len(recall) - len(ledger.recall)),
        ClassBudget(class_name="tool_results", cap=tool_cap, used=tool_result_tokens(),
                    items=sum(history_results[ledger.cut:]) + sum(active_results),
                    yielded=sum(map(_IS_ELIDED, chain(
                        compress(ledger.history[ledger.cut:], history_results[ledger.cut:]),
                        compress(ledger.active, active_results))))),
        ClassBudget(class_name="history", cap=max(B - (total - ledger.history_cost()), 0),
                    used=ledger.history_cost(), items=len(ledger.history) - ledger.cut,
                    yielded=ledger.cut),
        ClassBudget(class_name="active_run", cap=0, used=sum(ledger.active_costs),
                    items=len(ledger.active)),
        *(ClassBudget(class_name=name, cap=_FIXED_CAPS.get(name, 0), used=tokens, items=0)
          for name, tokens in sorted(ledger.fixed.items())),
    )
    report = BudgetReport(
        total_tokens=budget.total_tokens, output_reserve=budget.output_reserve,
        safety_margin_ratio=policy.safety_margin_ratio, margin_tokens=budget.margin_tokens,
        prefix_tokens=prefix_tokens, body_budget=B, body_tokens=total,
        estimated_total=prefix_tokens + total, estimator_factor=factor,
        history_floor=HISTORY_FLOOR_TOKENS, classes=classes)
    # what holds of these history candidates for a later allocation (the history as the
    # queued results before ``in_history`` left it: the cut changed none of it)
    in_history = min(taken, queued_in_history)
    if not reach and kept is not None:  # no step found gains: those found before still hold
        gain, reach = kept.gain, kept.reach
    found_steps = KeptSteps(
        held=held, results=history_results, ids=history_ids, queue=history_queue,
        queue_ids=history_queue_ids, gain=gain[:queued_in_history],
        reach=reach[:queued_in_history], taken=in_history, history=ledger.history,
        history_costs=ledger.history_costs, sums=sums)
    return Allocation(summary=summary, history=tuple(ledger.history[ledger.cut:]),
                      active=tuple(ledger.active), knowledge=tuple(ledger.knowledge),
                      recall=tuple(ledger.recall), report=report, pressure=pressure,
                      kept=found_steps)


_FIXED_CAPS = {"skill_bodies": SKILL_BODY_TOKENS, "working_state": WORKING_STATE_TOKENS}


def compaction_helps(left_out: int, total: int, body_budget: int,
                     summary: HistorySummary | None, summary_tokens: int,
                     cost: Callable[[ContextItem], int],
                     merged: Callable[[], HistorySummary] | None = None) -> bool:
    """``Pressure.compaction_needed``: whether compacting the ``left_out`` history items and
    building again lets the body fit. Where it fits already (``total`` tokens of
    ``body_budget``), history was cut: compaction keeps what was left out, unless the summary
    is at the depth cap, where Compact refuses every compaction (spec: the run has outgrown its
    window and escalates to a child run; never true there, fitting or not). Where it does not,
    every history candidate is left out already and only what never yields is left; a
    compaction writes a summary, which never yields either, so it cannot help unless it merges
    the current summary (``summary_tokens`` of the body) into a smaller one: that summary can
    still merge (depth below the cap) and the rest fits with what a merge keeps of it, all
    but its narrative (its constraints, pointers and source ids, which a merge keeps verbatim
    and only adds to), with the least room a compaction gives a narrative (``NARRATIVE_FLOOR``:
    a merge has the earlier one to narrate); ``cost``: what the summary costs so, and a merged
    one costs at least a token more, the sources it adds; ``merged``, where given, makes that
    summary as a merge keeps it: the working state's constraints are written into it too.
    Everything else that never yields (the current user message, the working state,
    corrections, skill bodies, the active run) no compaction touches."""
    if left_out == 0:
        return False  # nothing to compact
    if summary is not None and summary.depth >= MAX_DEPTH:
        return False  # Compact refuses it (COMPACTION_DEPTH_EXCEEDED): escalate instead
    if total <= body_budget:
        return True
    if summary is None or total - summary_tokens >= body_budget:
        return False
    kept = (cost(replace(summary if merged is None else merged(), text=NARRATIVE_FLOOR))
            if summary.text else summary_tokens)
    return total - summary_tokens + kept < body_budget


def summary_cap(total: int, body_budget: int, summary_tokens: int) -> int:
    """The ``max_summary_tokens`` of a compaction that makes a refused body fit, where
    ``compaction_helps`` says one can (every history candidate left out already, so ``total``
    is what never yields, ``summary_tokens`` of it the current summary): the room the rest
    leaves the summary, which the merged one replaces. A compaction measures its summary as
    this build costs it (the same estimator, rendering and correction factor), within the cap:
    one that fits this cap fits the body, and one a token over it does not. At most the
    largest cap a compaction takes (a summary within that fits too)."""
    return min(body_budget - (total - summary_tokens), MAX_SUMMARY_TOKENS)


def running_sums(costs: list[int], kept: KeptSteps | None) -> list[int]:
    """``[0, *accumulate(costs)]``: those ``kept`` found over the costs it holds taken up to
    the first cost that differs from its (a pointer step of this allocation may have changed
    some), the rest summed on from there."""
    if kept is None or kept.sums is None:
        return [0, *accumulate(costs)]
    held = kept.history_costs
    same = (len(held) if costs[:len(held)] == held
            else next(compress(count(), map(ne, costs, held))))
    return [*kept.sums[:same], *accumulate(costs[same:], initial=kept.sums[same])]


def _cut(history: list[ConversationItem], costs: list[int], history_tokens: int,
         spans: Sequence[Span] | None, *, tiling: tuple[list[int], list[int]] | None = None,
         sums: list[int] | None = None) -> int:
    """``select_history`` with no floor (the caller applied it: every item here is a candidate;
    a pointer has its result's units, the same type and call id), found by a search: where the
    units (none empty) follow each other to the last item and no cost is negative, a suffix's
    cost only grows as it begins earlier, so the cut is the first unit whose suffix fits, at
    ``bisect_left`` of the running sums (the same unit the walk from the newest stops after).
    ``tiling``: the spans' begins and ends, known to tile the history (checked here only for
    where they end); ``sums``: the running sums of ``costs``, where the caller has them."""
    room = max(history_tokens, 0)
    if spans is None:
        spans = units(history)
    if tiling is not None and spans and tiling[1][-1] == len(history):
        begins, ends = tiling
        if min(costs, default=0) < 0:
            return select_history(history, None, room, costs.__getitem__, spans)
    else:
        begins = list(map(itemgetter(0), spans))
        ends = list(map(itemgetter(1), spans))
        if spans and (ends[-1] != len(history) or begins[1:] != ends[:-1]
                      or not all(map(lt, begins, ends)) or min(costs, default=0) < 0):
            return select_history(history, None, room, costs.__getitem__, spans)
    if sums is None:
        sums = [0, *accumulate(costs)]  # sums[i]: the cost of history[:i]
    # history[b:] fits when sums[-1] - sums[b] <= room
    first = bisect_left(begins, sums[-1] - room, key=sums.__getitem__)
    return begins[first] if first < len(begins) else len(history)


def _merge(step: str, parts: list[YieldStep]) -> YieldStep:
    """One step of a class that yielded more than once (at its cap, on the ladder, recall below
    its floor): it begins where its first part began and frees what its parts freed, not the
    span between its first part's start and its last part's end, which holds the other steps
    that ran between them."""
    freed = sum(p.tokens_before - p.tokens_after for p in parts)
    return YieldStep(step=step, units=sum(p.units for p in parts),
                     ids=tuple(chain.from_iterable(p.ids for p in parts)),
                     tokens_before=parts[0].tokens_before,
                     tokens_after=parts[0].tokens_before - freed)


@dataclass(frozen=True, slots=True)
class _block_costs:
    cost: Callable[[ContextItem], int]

    def knowledge(self, passages: list[KnowledgePassage]) -> int:
        return self.cost(KnowledgeItem(passages=tuple(passages))) if passages else 0

    def recall(self, lines: list[MemoryLine]) -> int:
        return self.cost(RecallItem(lines=tuple(lines))) if lines else 0

