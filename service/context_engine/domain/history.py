"""The history cut (spec: "What history selection retains"). Four rules, each total:

1. Scan backward from the newest item, accumulating estimated tokens; stop at the first unit
   whose inclusion would exceed ``history_tokens``.
2. The cut never falls earlier than the summary floor: items whose event sequence is at or
   below ``replaced_through_sequence`` are represented by the summary and are not candidates.
3. A cut inside a tool pair moves later, past the pair: a call item and all its results
   (parallel calls are one call item with several results) are one atomic unit.
4. Never-yield items are not candidates at all (the caller passes only carried history).

The function returns an index; ``items[cut:]`` is retained, so the result is a suffix.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from context_engine.domain.items import ConversationItem, ToolCallItem, ToolResultItem


def units(items: Sequence[ConversationItem]) -> list[tuple[int, int]]:
    """Atomic [start, end) spans: a tool-call item through its last result, and everything
    between them; any other item alone."""
    last_result: dict[str, int] = {}
    for i, item in enumerate(items):
        if isinstance(item, ToolResultItem):
            last_result[item.call_id] = i
    spans: list[tuple[int, int]] = []
    i = 0
    while i < len(items):
        end = i + 1
        item = items[i]
        if isinstance(item, ToolCallItem):
            for call in item.calls:
                end = max(end, last_result.get(call.call_id, i) + 1)
            # an interleaved later call's results extend the unit too
            j = i + 1
            while j < end:
                inner = items[j]
                if isinstance(inner, ToolCallItem):
                    for call in inner.calls:
                        end = max(end, last_result.get(call.call_id, j) + 1)
                j += 1
        spans.append((i, end))
        i = end
    return spans


def floor_index(items: Sequence[ConversationItem], summary_floor: int) -> int:
    """The first candidate: past every item at or below the floor, and past any unit that the
    floor splits (rule 3 applied to the floor: never admit half a pair)."""
    start = 0
    for i, item in enumerate(items):
        if item.sequence <= summary_floor:
            start = i + 1
    if start == 0:
        return 0  # nothing below the floor: no unit can straddle it
    for begin, end in units(items):
        if begin < start < end:
            return end
    return start


def select_history(items: Sequence[ConversationItem], summary_floor: int,
                   history_tokens: int, cost: Callable[[int], int]) -> int:
    """The cut index: ``items[cut:]`` is the largest contiguous suffix of whole units above the
    summary floor whose cost fits ``history_tokens``. ``cost(i)`` is the estimated tokens of
    ``items[i]``; the floor (an event sequence) and the result (an index) are never compared."""
    lowest = floor_index(items, summary_floor)
    cut = len(items)
    used = 0
    for begin, end in reversed(units(items)):
        if begin < lowest:
            break
        unit_cost = sum(cost(i) for i in range(begin, end))
        if used + unit_cost > history_tokens:
            break
        used += unit_cost
        cut = begin
    return cut
