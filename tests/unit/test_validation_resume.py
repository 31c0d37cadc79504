"""Validation resumed from a base's scan state (builder.ItemScan, checkpoint_violations with
``resume``): an incremental Build that appends to all of its base's items scans only the items
it adds, and must find exactly what the whole scan finds, with the same indexes.

The items are valid conversations (tests/property/strategies.py ``conversation``) with rogue
items put in anywhere: duplicate item and call ids, results for unknown or answered calls, a
result in another run than its call, another run's item inside an open pair, sequences going
back, empty ids and names, arguments that are no JSON object, a call item with no calls. A base
counts the state it keeps in its size."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from context_engine.build_cache import SCAN_ID_BYTES, BuildBase
from context_engine.domain.builder import (
    Checkpoint,
    ItemScan,
    SkillBody,
    checkpoint_scan,
    checkpoint_violations,
)
from context_engine.domain.errors import FieldViolation
from context_engine.domain.items import (
    AssistantMessageItem,
    ConversationItem,
    HistorySummary,
    ToolCallItem,
    ToolResultItem,
    UserMessageItem,
)
from context_engine.domain.request import ToolCall
from context_engine.domain.trust import TrustLevel
from hypothesis import given, settings
from hypothesis import strategies as st

from tests import factories as f
from tests.property.strategies import conversation

SETTINGS = settings(max_examples=200, deadline=None, derandomize=True, database=None)


@st.composite
def rogue(draw: st.DrawFn, items: list[ConversationItem], n: int) -> ConversationItem:
    """An item that may break a rule against ``items`` (the ids, calls and runs they hold)."""
    ids = [i.id for i in items] or ["item-1"]
    calls = [c for i in items if isinstance(i, ToolCallItem) for c in i.calls]
    call_ids = [c.call_id for c in calls] or ["call_1"]
    answered = {i.call_id for i in items if isinstance(i, ToolResultItem)}
    open_ids = [c for c in call_ids if c not in answered]
    runs = sorted({i.run_id for i in items} | {"run-1", "run-x"})
    sequences = [i.sequence for i in items] or [0]
    item_id = draw(st.sampled_from((f"rogue-{n}", f"rogue-{n}", "", *ids)))
    sequence = draw(st.sampled_from((max(sequences), max(sequences) + 1, min(sequences) - 1,
                                     *sequences)))
    run = draw(st.sampled_from(runs))
    kind = draw(st.sampled_from(("call", "result", "result", "user", "assistant")))
    if kind == "call":
        made = [ToolCall(call_id=draw(st.sampled_from((f"rc_{n}_{j}", f"rc_{n}_{j}", "",
                                                       *call_ids))),
                         name=draw(st.sampled_from(("web.fetch", "files.read", ""))),
                         arguments_json=draw(st.sampled_from(('{"q": 1}', "{}", "[1]", "no"))))
                for j in range(draw(st.integers(0, 2)))]
        return ToolCallItem(id=item_id, sequence=sequence, run_id=run,
                            item_trust=TrustLevel.USER, calls=tuple(made))
    if kind == "result":
        return ToolResultItem(id=item_id, sequence=sequence, run_id=run,
                              item_trust=TrustLevel.EXTERNAL_UNTRUSTED,
                              call_id=draw(st.sampled_from(("unknown", *call_ids, *open_ids,
                                                            *open_ids))),
                              tool_name=draw(st.sampled_from(("", "web.fetch", "other.tool"))),
                              content="r")
    if kind == "user":
        return UserMessageItem(id=item_id, sequence=sequence, run_id=run,
                               item_trust=TrustLevel.USER, text="u")
    return AssistantMessageItem(id=item_id, sequence=sequence, run_id=run,
                                item_trust=TrustLevel.USER, text="a")


@st.composite
def checkpoints(draw: st.DrawFn) -> Checkpoint:
    """A valid conversation, or one with rogue items put in (often after a clean head)."""
    active, valid = draw(conversation())
    items = list(valid)
    for n in range(draw(st.sampled_from((0, 1, 1, 2, 3, 5)))):
        after_calls = [k + 1 for k, i in enumerate(items) if isinstance(i, ToolCallItem)]
        at = draw(st.integers(0, len(items)) if not after_calls or draw(st.booleans())
                  else st.sampled_from(after_calls))  # often inside a pair
        items.insert(at, draw(rogue(items[:at] or items, n)))
    results = [k for k, i in enumerate(items) if isinstance(i, ToolResultItem)]
    if results and draw(st.integers(0, 3)) == 0:  # a call left open: its result dropped
        del items[draw(st.sampled_from(results))]
    summary = None
    if draw(st.integers(0, 4)) == 0:
        summary = HistorySummary(text="s", replaced_through_sequence=draw(st.integers(0, 1100)))
    skills = tuple(SkillBody(name=n, body="b", trust=TrustLevel.USER)
                   for n in draw(st.lists(st.sampled_from(("skill", "")), max_size=2)))
    return Checkpoint(active_run_id=draw(st.sampled_from((active, active, "", "run-x"))),
                      items=tuple(items), summary=summary, loaded_skills=skills)


def state(scan: ItemScan) -> tuple[Any, ...]:
    return (dict(scan.calls_by_id), dict(scan.runs_by_call), set(scan.seen_ids),
            list(scan.open_calls.items()), set(scan.answered), scan.last_sequence,
            set(scan.interrupted), list(scan.pending), scan.count)


def head_scan(items: tuple[ConversationItem, ...], k: int, field: str) -> ItemScan | None:
    """The scan state after ``items[:k]``, if they scan without a violation (as a base's)."""
    scan, found = ItemScan(), list[FieldViolation]()
    scan.scan(items[:k], found, field)
    return scan if not found else None


def spanning(violations: list[FieldViolation]) -> list[FieldViolation]:
    return [v for v in violations if "sits between" in v.description]


@SETTINGS
@given(checkpoints(), st.sampled_from(("checkpoint", "req.cp")))
def test_resumed_scan_finds_what_the_whole_scan_and_the_slow_oracle_find(cp: Checkpoint,
                                                                         field: str) -> None:
    """Resumed after every head that scans clean, the scan finds what the whole scan finds;
    and the "pair spanning two runs" violations, whole and resumed, are those of an oracle
    that shares no state with the scan (``spans_oracle``). One property over one draw of
    checkpoints: the generation is most of its cost."""
    whole, end = checkpoint_scan(cp, field)
    assert whole == checkpoint_violations(cp, field)
    expected = spans_oracle(cp.items, field)
    assert spanning(whole) == expected
    for k in range(len(cp.items) + 1):
        base = head_scan(cp.items, k, field)
        if base is None:
            break  # no longer the head of a base, nor is any longer head
        before = state(base)
        first, first_end = checkpoint_scan(cp, field, resume=base)
        assert first == whole, k
        assert state(first_end) == state(end)
        # the base's state is forked, never scanned on: a second Build from it finds the same
        assert state(base) == before
        resumed = checkpoint_violations(cp, field, resume=base)
        assert resumed == whole
        assert spanning(resumed) == expected
        assert state(base) == before


def spans_oracle(items: tuple[ConversationItem, ...], field: str) -> list[FieldViolation]:
    """The "another run's item sits inside an open pair" violations, found the slow way: for
    each item, the calls open just before it are worked out again from the start (a call id
    opens when it is neither open nor answered, a result answers an open call), and those of
    another run that no earlier item reported are reported, in the order they were made."""
    out: list[FieldViolation] = []
    reported: set[str] = set()
    for i, item in enumerate(items):
        opened: dict[str, str] = {}  # call id -> its run, in the order made
        done: set[str] = set()
        for earlier in items[:i]:
            if isinstance(earlier, ToolCallItem):
                for call in earlier.calls:
                    if call.call_id and call.call_id not in opened and call.call_id not in done:
                        opened[call.call_id] = earlier.run_id
            elif isinstance(earlier, ToolResultItem) and earlier.call_id in opened:
                del opened[earlier.call_id]
                done.add(earlier.call_id)
        inside = [c for c, run in opened.items() if run != item.run_id and c not in reported]
        if inside:
            reported.update(inside)
            out.append(FieldViolation(
                f"{field}.items[{i}].run_id",
                f"run {item.run_id!r} sits between call(s) {', '.join(map(repr, inside))} "
                f"of run {opened[inside[0]]!r} and their results: a tool pair never spans "
                "two runs"))
    return out


def test_the_pairs_check_looks_at_one_run_per_item_not_every_open_call() -> None:
    """One item of 2,000 parallel calls, then their 2,000 results, then another run's item:
    every item is checked against the open calls in one look (their run), not one look per
    open call (4,000 items x up to 2,000 open calls, seconds at 20,000 calls)."""

    class Counting(dict[str, str]):
        reads = 0

        def __getitem__(self, key: str) -> str:
            Counting.reads += 1
            return super().__getitem__(key)

    n = 2000
    calls = [f.call("c", 1, *[f"call-{j}" for j in range(n)])]
    results = [f.result(f"r{j}", 2 + j, f"call-{j}", "a") for j in range(n)]
    items = [f.user("u1", "q", 0), *calls, *results[:-1],
             f.user("u2", "q", n + 1, run="run-2"), results[-1]]
    scan = ItemScan()
    scan.runs_by_call = Counting()
    found: list[FieldViolation] = []
    scan.scan(items, found)
    assert Counting.reads <= 2 * len(items) + n, Counting.reads
    # and it found the one call still open when run-2's item came, as the oracle does
    assert found == spans_oracle(tuple(items), "checkpoint")
    assert [v.field for v in found] == ["checkpoint.items[2001].run_id"]
    assert "call(s) 'call-1999' of run 'run-1'" in found[0].description


def test_the_checkpoints_drawn_break_each_rule_after_a_clean_head() -> None:
    """The strategy reaches what the property is about: violations of every kind found by a
    scan resumed after at least one clean item."""
    kinds: set[str] = set()

    # the rarest kind (an empty call id after a clean head) turns up in about 3% of the
    # checkpoints drawn: 400 of them miss it with a chance of about 1 in 200,000, where 150
    # missed it with about 1 in 100 (and did, on one machine's draw)
    @settings(max_examples=400, deadline=None, derandomize=True, database=None)
    @given(checkpoints())
    def collect(cp: Checkpoint) -> None:
        k = 0  # the longest head that scans clean
        while k < len(cp.items) and head_scan(cp.items, k + 1, "checkpoint") is not None:
            k += 1
        if k:
            base = head_scan(cp.items, k, "checkpoint")
            kinds.update(kind(v) for v in checkpoint_violations(cp, resume=base))

    collect()
    missing = {"id", "duplicate id", "sequence", "run_id", "orphan result", "answered",
               "duplicate call", "call_id", "name", "arguments_json", "tool_calls", "tool_name",
               "open call"} - kinds
    assert not missing, missing


def kind(v: FieldViolation) -> str:
    last = v.field.rsplit(".", 1)[-1]
    if v.description.startswith("duplicate item"):
        return "duplicate id"
    if v.description.startswith("duplicate call"):
        return "duplicate call"
    if "already has a result" in v.description:
        return "answered"
    if v.description.startswith("no earlier tool call"):
        return "orphan result"
    if "has no result" in v.description:
        return "open call"
    return last


def test_a_second_build_from_one_base_sees_the_first_builds_items_as_new() -> None:
    """Two Builds append to one base: the items of the first are not the base's, so the same
    ids sent again by the second are no duplicates, and a duplicate of a base id is one."""
    base_items = (f.user("u1", "q", 1), f.call("c1", 2, "call-1"), f.result("r1", 3, "call-1", "a"))
    _, base = checkpoint_scan(f.checkpoint(list(base_items)))
    added = (f.call("c2", 4, "call-2"), f.result("r2", 5, "call-2", "b"))
    for _ in range(2):
        assert checkpoint_violations(f.checkpoint([*base_items, *added]), resume=base) == []
    again = f.checkpoint([*base_items, f.user("u1", "dup", 4), f.result("r3", 5, "call-1", "x")])
    found = checkpoint_violations(again, resume=base)
    assert found == checkpoint_violations(again)
    assert [v.field for v in found] == ["checkpoint.items[3].id",
                                        "checkpoint.items[4].tool_result.call_id"]


def test_a_state_after_more_items_than_the_checkpoint_holds_is_refused() -> None:
    _, base = checkpoint_scan(f.checkpoint([f.user("u1", "q", 1), f.user("u2", "r", 2)]))
    with pytest.raises(ValueError):
        checkpoint_violations(f.checkpoint([f.user("u1", "q", 1)]), resume=base)


def test_fork_copies_every_container() -> None:
    _, scan = checkpoint_scan(f.checkpoint([f.user("u1", "q", 1), f.call("c1", 2, "call-1")]))
    other = scan.fork()
    for name in ("calls_by_id", "runs_by_call", "seen_ids", "open_calls", "answered",
                 "interrupted", "pending"):
        assert getattr(other, name) == getattr(scan, name)
        assert getattr(other, name) is not getattr(scan, name), name
    assert (other.count, other.last_sequence) == (scan.count, scan.last_sequence) == (2, 2)


def test_a_base_counts_its_scan_state_in_its_size() -> None:
    _, scan = checkpoint_scan(f.checkpoint([f.user("u1", "q", 1), f.call("c1", 2, "call-1"),
                                            f.result("r1", 3, "call-1", "a")]))
    # three item ids; call-1 answered (its name and run are kept only while it is open)
    assert scan.held == 3 + 1
    assert (scan.calls_by_id, scan.runs_by_call, scan.answered) == ({}, {}, {"call-1"})
    _, opened = checkpoint_scan(f.checkpoint([f.user("u1", "q", 1), f.call("c1", 2, "call-1")]))
    assert (opened.calls_by_id, opened.runs_by_call) == ({"call-1": "web.fetch"},
                                                         {"call-1": "run-1"})
    plain = BuildBase(tenant_id="t", session_id="s", incarnation=1, build_id="b", items=(),
                      item_bytes=(0, 500), messages=(), message_entries=(), prefix=((), ()),
                      prefix_bytes=0, texts=(b"", b"", b""), response_bytes=20)
    assert plain.size == 520
    assert replace(plain, scan=scan).size == 520 + SCAN_ID_BYTES * scan.held
