"""The units of a history found from the previous build's (``history.units_of``) are the units
found from nothing (``history.units``, itself checked against an oracle by the history-cut
gate), whatever was appended: results answering calls of any earlier unit, results of no call,
call ids named twice, items replaced rather than appended. The spans the builder hands the cut
when a summary floor is set (the units past the floor, shifted) are the units of the items past
the floor."""

from __future__ import annotations

import itertools

from context_engine.domain.history import Units, floor_index, units, units_of
from context_engine.domain.items import (
    AssistantMessageItem,
    ConversationItem,
    ToolCallItem,
    ToolResultItem,
)
from context_engine.domain.request import ToolCall
from context_engine.domain.trust import TrustLevel
from hypothesis import given, settings
from hypothesis import strategies as st

SETTINGS = settings(max_examples=250, deadline=None, derandomize=True, database=None)
CALL_IDS = [f"c{i}" for i in range(12)]  # few, so that results answer earlier calls often


@st.composite
def item_lists(draw: st.DrawFn, max_size: int = 40) -> list[ConversationItem]:
    """Call items naming 1-3 call ids, results of any of those ids (before or after their call,
    several for one id, or of no call at all) and plain messages, in any order."""
    numbers = itertools.count(1)
    items: list[ConversationItem] = []
    sequence = 0
    for kind in draw(st.lists(st.sampled_from(("call", "result", "result", "message")),
                              max_size=max_size)):
        n = next(numbers)
        sequence += draw(st.sampled_from((0, 1, 2)))
        common = {"id": f"i{n}", "sequence": sequence, "run_id": "r",
                  "item_trust": TrustLevel.USER}
        if kind == "call":
            ids = draw(st.lists(st.sampled_from(CALL_IDS), min_size=1, max_size=3))
            items.append(ToolCallItem(**common, calls=tuple(
                ToolCall(call_id=c, name="t", arguments_json="{}") for c in ids)))
        elif kind == "result":
            items.append(ToolResultItem(**common, call_id=draw(st.sampled_from(CALL_IDS)),
                                        tool_name="t", content=f"r{n}"))
        else:
            items.append(AssistantMessageItem(**common, text=f"m{n}"))
    return items


def first_units_of_calls(items: list[ConversationItem], spans: list[tuple[int, int]]
                         ) -> dict[str, int]:
    """Written here: each call id -> the first unit holding a call item that names it."""
    found: dict[str, int] = {}
    for unit, (begin, end) in enumerate(spans):
        for item in items[begin:end]:
            if isinstance(item, ToolCallItem):
                for call in item.calls:
                    if call.call_id not in found:
                        found[call.call_id] = unit
    return found


def tile(spans: list[tuple[int, int]], length: int) -> bool:
    """Written here: the spans, none empty, cover [0, length) one after another."""
    at = 0
    for begin, end in spans:
        if begin != at or end <= begin:
            return False
        at = end
    return at == length


def assert_units(found: Units, items: list[ConversationItem]) -> None:
    assert found.spans == units(items)
    assert found.items == items
    assert found.unit_of_call == first_units_of_calls(items, found.spans)
    assert found.begins == [b for b, _ in found.spans]
    assert found.ends == [e for _, e in found.spans]
    assert found.tiles == tile(found.spans, len(items))


@SETTINGS
@given(st.lists(item_lists(max_size=16), min_size=1, max_size=5))
def test_units_found_from_the_previous_ones_are_the_units(parts: list[list]) -> None:
    """Each list appends a part to the one before; the units of each are found from the
    units of the one before."""
    items: list[ConversationItem] = []
    known: Units | None = None
    for part in parts:
        items = items + part
        known = units_of(items, known)
        assert_units(known, items)


@SETTINGS
@given(item_lists(), item_lists(max_size=10), st.data())
def test_a_list_that_does_not_begin_with_the_known_items_is_found_from_nothing(
        items: list, appended: list, data: st.DataObject) -> None:
    """An item replaced anywhere in what was known, or a shorter list: the units are the
    list's own, never the known ones."""
    known = units_of(items)
    changed = list(items)
    if changed:
        at = data.draw(st.integers(0, len(changed) - 1))
        changed[at] = AssistantMessageItem(id="other", sequence=changed[at].sequence,
                                           run_id="r", item_trust=TrustLevel.USER, text="x")
    changed += appended
    assert_units(units_of(changed, known), changed)
    shorter = items[:data.draw(st.integers(0, len(items)))]
    assert_units(units_of(shorter, known), shorter)


@SETTINGS
@given(item_lists(), st.integers(0, 60))
def test_the_units_past_a_floor_are_the_units_of_the_items_past_it(items: list,
                                                                    summary_floor: int) -> None:
    """What the builder hands the cut when a summary sets a floor."""
    spans = units(items)
    floor = floor_index(items, summary_floor, spans)
    assert floor == floor_index(items, summary_floor)
    assert [(b - floor, e - floor) for b, e in spans if b >= floor] == units(items[floor:])


def test_an_appended_result_of_an_early_call_joins_everything_after_it() -> None:
    """The case the resumption exists for, by hand: the first call's late result makes one
    unit of the whole list."""
    def call(n: int, call_id: str) -> ToolCallItem:
        return ToolCallItem(id=f"i{n}", sequence=n, run_id="r", item_trust=TrustLevel.USER,
                            calls=(ToolCall(call_id=call_id, name="t", arguments_json="{}"),))

    def result(n: int, call_id: str) -> ToolResultItem:
        return ToolResultItem(id=f"i{n}", sequence=n, run_id="r", item_trust=TrustLevel.USER,
                              call_id=call_id, tool_name="t", content="x")

    items: list[ConversationItem] = [call(1, "a"), call(2, "b"), result(3, "b")]
    known = units_of(items)
    assert known.spans == [(0, 1), (1, 3)]
    longer = [*items, result(4, "a")]
    found = units_of(longer, known)
    assert found.spans == [(0, 4)] == units(longer)
    assert found.unit_of_call == {"a": 0, "b": 0}
