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

from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from context_engine.domain.items import (
    ConversationItem,
    ToolCallItem,
    ToolResultItem,
    UserMessageItem,
)

Span = tuple[int, int]


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


@dataclass(frozen=True, slots=True)
class Units:
    """The units of ``items`` (a list of its own), kept so that the units of a longer list
    that begins with the same items are found from what was appended (``units_of``)."""

    items: list[ConversationItem]
    spans: list[Span]
    # a call id -> the first unit whose call item names it
    unit_of_call: dict[str, int]
    # each unit's begin and end, and whether the units tile the items: none empty, each
    # beginning where the one before ends, from the first item to the last (what the history
    # cut's search asks of them; found from the kept units' for what was appended)
    begins: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    tiles: bool = False


def units_of(items: Sequence[ConversationItem], known: Units | None = None) -> Units:
    """``units(items)``, found from ``known`` when ``items`` begins with ``known.items`` (equal
    items have equal units). Appended items change the units before them only where an
    appended result answers a call of an earlier unit: that unit then runs to the result, so
    the units are found again from the first such unit on; those before it stand."""
    held = len(known.items) if known is not None else 0
    if known is None or len(items) < held or list(items[:held]) != known.items:
        return _units_from(list(items), [], {}, 0)
    answered = {item.call_id for item in items[held:] if isinstance(item, ToolResultItem)}
    first = min((known.unit_of_call[c] for c in answered if c in known.unit_of_call),
                default=len(known.spans))
    kept = known.spans[:first]
    unit_of_call = ({c: u for c, u in known.unit_of_call.items() if u < first}
                    if first < len(known.spans) else dict(known.unit_of_call))
    return _units_from(list(items), kept, unit_of_call, kept[-1][1] if kept else 0,
                       (known.begins[:first], known.ends[:first], known.tiles or not first))


def _units_from(items: list[ConversationItem], spans: list[Span], unit_of_call: dict[str, int],
                start: int,
                bounds: tuple[list[int], list[int], bool] = ([], [], True)) -> Units:
    """``spans`` (the units of ``items[:start]``) and what follows: the units of
    ``items[start:]``, offset by ``start``, with the calls each names. ``bounds``: the begins
    and ends of ``spans``, and whether they tile ``items[:start]``."""
    spans = list(spans)
    begins, ends, tiles = list(bounds[0]), list(bounds[1]), bounds[2]
    at = start  # where the next unit must begin for the units to tile the items
    for begin, end in units(items[start:]):
        unit = len(spans)
        for item in items[start + begin:start + end]:
            if isinstance(item, ToolCallItem):
                for call in item.calls:
                    unit_of_call.setdefault(call.call_id, unit)
        spans.append((begin + start, end + start))
        begins.append(begin + start)
        ends.append(end + start)
        tiles = tiles and begin + start == at and end > begin
        at = end + start
    return Units(items=items, spans=spans, unit_of_call=unit_of_call, begins=begins, ends=ends,
                 tiles=tiles and at == len(items))


def floor_index(items: Sequence[ConversationItem], summary_floor: int,
                spans: Sequence[Span] | None = None) -> int:
    """The first candidate: past every item at or below the floor, and past any unit that the
    floor splits (rule 3 applied to the floor: never admit half a pair). ``spans``:
    ``units(items)``, when the caller has them."""
    start = 0
    for i, item in enumerate(items):
        if item.sequence <= summary_floor:
            start = i + 1
    if start == 0:
        return 0  # nothing below the floor: no unit can straddle it
    for begin, end in units(items) if spans is None else spans:
        if begin < start < end:
            return end
    return start


def select_history(items: Sequence[ConversationItem], summary_floor: int | None,
                   history_tokens: int, cost: Callable[[int], int],
                   spans: Sequence[Span] | None = None) -> int:
    """The cut index: ``items[cut:]`` is the largest contiguous suffix of whole units above the
    summary floor whose cost fits ``history_tokens``. ``cost(i)`` is the estimated tokens of
    ``items[i]``; the floor (an event sequence) and the result (an index) are never compared.
    ``summary_floor`` None: no floor, every item is a candidate. ``spans``: ``units(items)``,
    when the caller has them."""
    lowest = 0 if summary_floor is None else floor_index(items, summary_floor, spans)
    cut = len(items)
    used = 0
    for begin, end in reversed(units(items) if spans is None else spans):
        if begin < lowest:
            break
        unit_cost = sum(map(cost, range(begin, end)))
        if used + unit_cost > history_tokens:
            break
        used += unit_cost
        cut = begin
    return cut


def compact_through(items: Sequence[ConversationItem], cut: int,
                    spans: Sequence[Span] | None = None) -> int:
    """The event sequence a compaction replaces through to replace ``items[:cut]``, the
    history a cut left out (``items``: the candidates above the summary floor): the highest
    sequence among them, rounded up past each whole unit from the cut on that begins at or
    below it. A cut inside one event (a model's text left out, its tool call kept: both at the
    event's sequence) leaves the rest of that event at the floor a summary would mark, so the
    whole event is replaced, with the tool unit it begins and so on to where the sequence
    rises; the retained suffix is the cut's all the same. 0: nothing left out. ``spans``:
    ``units(items)``, when the caller has them."""
    if cut <= 0:
        return 0
    # items are ordered oldest first (the checkpoint's validation refuses a sequence below the
    # one before it): the highest left out is the last, and a unit's highest is its last item's
    through = items[cut - 1].sequence
    spans = units(items) if spans is None else spans
    at = bisect_left(spans, (cut, -1))  # the first unit from the cut on (spans are in order)
    while at < len(spans):
        begin, end = spans[at]
        if items[begin].sequence > through:
            break  # the sequence rises: a floor here leaves the rest above it
        through = max(through, items[end - 1].sequence)
        at += 1
    return through


def trailing_start(items: Sequence[ConversationItem], active_run_id: str) -> int:
    """Where the current input begins: the unanswered user messages that end the items
    (including supplemental input on resume), of the active run (any run's where there is
    none). A user message an earlier run left unanswered is carried history, which the summary
    may replace and the history cut may leave out: only the current input never yields."""
    cut = len(items)
    while cut > 0 and isinstance(items[cut - 1], UserMessageItem) and (
            not active_run_id or items[cut - 1].run_id == active_run_id):
        cut -= 1
    return cut
