"""The render memo's bound: entries weighed, sessions evicted whole, least recently written
first, and the weights it holds always the sum of its entries' (a model of its own: a dict
and a list, no eviction logic shared)."""

from __future__ import annotations

import gc
import tracemalloc
from typing import Any

import pytest
from context_engine.api import mapping
from context_engine.render_memo import BoundedMemo, memo_weight
from context_engine.v1 import context_engine_pb2 as pb
from hypothesis import given, settings
from hypothesis import strategies as st


def weigh(value: Any) -> int:
    return int(value)


def test_sessions_go_whole_least_recently_written_first() -> None:
    memo = BoundedMemo(100, weigh=weigh)
    memo[("a", 1)] = 20
    memo[("b", 1)] = 20
    memo[("a", 2)] = 20  # a written after b: b is the least recent
    memo[("c", 1)] = 45  # 105 in all: b goes, whole
    assert sorted(memo) == [("a", 1), ("a", 2), ("c", 1)] and memo.bytes == 85
    memo[("d", 1)] = 30  # 115: a goes (both its entries), c and d stay
    assert sorted(memo) == [("c", 1), ("d", 1)] and memo.bytes == 75
    assert memo.sessions() == 2


def test_a_session_over_half_the_capacity_is_begun_again() -> None:
    memo = BoundedMemo(100, weigh=weigh)
    memo[("a", 1)] = 10
    memo[("b", 1)] = 30
    memo[("b", 2)] = 25  # b at 55, over half: all of b dropped, a kept
    assert sorted(memo) == [("a", 1)] and memo.bytes == 10
    memo[("b", 3)] = 5
    assert memo.get(("b", 3)) == 5 and memo.get(("b", 1)) is None


def test_entries_are_of_the_oldest_incarnation_the_builds_that_made_them_ran_on() -> None:
    """Entries are of no incarnation until a Build that made them ends (``settle``); then of
    the oldest one a Build that ended ran on. Memory dropping them, or their last one deleted,
    drops that too: entries made again are of none until their Build ends."""
    memo = BoundedMemo(100, weigh=weigh)
    memo.settle("a", 2)  # no entries: nothing to be of it
    assert memo.incarnation("a") is None
    memo[("a", 1)] = 10
    assert memo.incarnation("a") is None  # its Build still running
    memo.settle("a", 2)
    assert memo.incarnation("a") == 2
    memo.settle("a", 3)  # a Build of a later one ended too: some entries are of 2
    assert memo.incarnation("a") == 2
    memo.settle("a", 1)
    assert memo.incarnation("a") == 1
    memo[("a", 2)] = 45  # 55: over half, begun again
    assert len(memo) == 0 and memo.incarnation("a") is None
    memo[("a", 3)] = 10
    assert memo.incarnation("a") is None
    memo.settle("a", 4)
    memo[("b", 1)] = 50
    memo[("c", 1)] = 45  # 105: a evicted
    assert ("a", 3) not in memo and memo.incarnation("a") is None
    memo[("a", 4)] = 5
    memo.settle("a", 4)
    del memo[("a", 4)]
    memo[("a", 5)] = 5
    assert memo.incarnation("a") is None
    memo.settle("a", 5)
    memo.clear()
    assert memo.incarnation("a") is None


def test_writing_a_key_again_weighs_it_again() -> None:
    memo = BoundedMemo(100, weigh=weigh)
    memo[("a", 1)] = 40
    memo[("a", 1)] = 5
    assert memo.bytes == 5
    memo[("b", 1)] = 40
    memo[("a", 2)] = 40  # 85: nothing to evict, had the first weight stayed counted it would
    assert len(memo) == 3


def test_deleting_popping_dropping_and_clearing_give_their_weight_back() -> None:
    memo = BoundedMemo(1_000, weigh=weigh)
    for k in range(4):
        memo[("a", k)] = 10
        memo[("b", k)] = 20
    del memo[("a", 0)]
    assert memo.pop(("b", 0)) == 20 and memo.pop(("b", 0), None) is None
    assert memo.bytes == 3 * 10 + 3 * 20
    memo.drop("a")
    memo.drop("nobody")
    assert memo.bytes == 60 and memo.sessions() == 1 and ("a", 1) not in memo
    for k in (1, 2, 3):
        del memo[("b", k)]
    assert memo.bytes == 0 and memo.sessions() == 0
    memo[("c", 1)] = 7
    memo.clear()
    assert (memo.bytes, len(memo), memo.sessions()) == (0, 0, 0)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.lists(st.tuples(st.sampled_from(("set", "set", "set", "del", "drop")),
                          st.sampled_from("abcd"), st.integers(0, 3), st.integers(0, 60)),
                max_size=60))
def test_the_memo_matches_a_model_of_its_rule(ops: list[tuple[str, str, int, int]]) -> None:
    """Against a model: a dict of entries and a list of sessions, least recently written
    first; after each write, a session over half the capacity is emptied, then sessions go
    from the front while the total is over it."""
    cap = 100
    memo = BoundedMemo(cap, weigh=weigh)
    entries: dict[tuple[str, int], int] = {}
    order: list[str] = []
    for op, session, k, weight in ops:
        key = (session, k)
        if op == "set":
            memo[key] = weight
            entries[key] = weight
            if session in order:
                order.remove(session)
            order.append(session)
            if sum(w for (t, _), w in entries.items() if t == session) > cap // 2:
                entries = {e: w for e, w in entries.items() if e[0] != session}
                order.remove(session)
            while sum(entries.values()) > cap and order:
                gone = order.pop(0)
                entries = {e: w for e, w in entries.items() if e[0] != gone}
        elif op == "del" and key in entries:
            del memo[key]
            del entries[key]
            if not any(e[0] == session for e in entries):
                order.remove(session)
        elif op == "drop":
            memo.drop(session)
            entries = {e: w for e, w in entries.items() if e[0] != session}
            if session in order:
                order.remove(session)
        assert dict(memo.items()) == entries
        assert memo.bytes == sum(entries.values())
        assert memo.sessions() == len(order)


def test_an_entry_weighs_what_it_holds() -> None:
    """Text and bytes count in full wherever an entry holds them, one level down."""
    small, large = memo_weight(("x", b"y")), memo_weight(("x" * 10_000, b"y" * 5_000))
    assert large - small == 10_000 - 1 + 5_000 - 1
    assert memo_weight({1: 1, 2: 2}) - memo_weight({}) == 2 * 150


FRAMES = 128  # deep enough that every allocation below a test's body has the test on its stack


def live_here() -> int:
    """Bytes alive that were allocated with this file on the stack (tracemalloc): a server
    thread another test's session fixture left running in this process allocates on a stack of
    its own, and process-wide totals counted it (a 48,885-byte item measured at 276,247)."""
    mine = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(True, __file__, all_frames=True)])
    return sum(trace.size for trace in mine.traces)


@pytest.mark.parametrize("text", ["plain words " * 800, "word \U0001f642 " * 1_000,
                                  "\u4e2d\u6587 " * 2_000, "caf\u00e9 " * 2_000])
@pytest.mark.parametrize("kind", ["user", "tool_result"])
def test_a_mapped_item_weighs_at_least_what_the_memo_keeps_of_it(kind: str, text: str) -> None:
    """An item mapped from the wire and remembered (a copy of the wire item, the domain item,
    their strings): the memo's count of it is at least what it keeps alive (tracemalloc, once
    the mapping's answer is let go), and less than four times that (the copy is counted at twice
    its UTF-8 size, for itself and for the domain item's byte a character, and a non-ASCII str
    with the UTF-8 copy CPython makes of it once C code asks, made or not: here none is).
    English with emoji holds four bytes a character in the domain item's str: counted at the
    wire copy's UTF-8 size (1.4 bytes a character) it falls short."""
    if kind == "user":
        it = pb.ConversationItem(id="u1", sequence=1, run_id="run-1",
                                 trust=pb.TRUST_LEVEL_USER, user=pb.UserMessage(text=text))
    else:
        it = pb.ConversationItem(id="r1", sequence=2, run_id="run-1",
                                 trust=pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED,
                                 tool_result=pb.ToolResult(call_id="c1", tool_name="web.fetch",
                                                           content=text))
    cp = pb.Checkpoint(active_run_id="run-1", items=[it])
    memo = BoundedMemo(1 << 30)
    # warms what the first mapping creates once
    mapping.checkpoint(mapping.Violations(), cp, memo=memo, session_key="s")
    memo.clear()
    gc.collect()
    tracemalloc.start(FRAMES)
    try:
        before = live_here()
        mapping.checkpoint(mapping.Violations(), cp, memo=memo, session_key="s")
        gc.collect()
        kept = live_here() - before
    finally:
        tracemalloc.stop()
    assert len(memo) == 1
    assert kept <= memo.bytes < 4 * kept, (kept, memo.bytes)


@pytest.mark.parametrize("text", ["plain words " * 800, "word \U0001f642 " * 1_000,
                                  "\u4e2d\u6587 " * 2_000, "caf\u00e9 " * 2_000])
def test_a_text_weighs_at_least_what_it_holds_before_and_after_protobuf_reads_it(
        text: str) -> None:
    """A text an entry holds (a rendering's message, a wire form): its weight is at least what
    freeing the str frees (tracemalloc), as made and after a protobuf message has been given it
    (CPython then keeps a UTF-8 copy with the str), the same both times, and less than twice
    what it frees after the read."""

    def fresh() -> str:
        return "".join([text[:1], text[1:]])  # a str of its own, no UTF-8 copy yet

    pb.UserMessage(text=fresh())  # what the first message makes once
    gc.collect()
    tracemalloc.start(FRAMES)
    try:
        made = fresh()
        weight = memo_weight(made)
        held = live_here()
        del made
        freed_made = held - live_here()
        read = fresh()
        pb.UserMessage(text=read)
        gc.collect()
        weight_read = memo_weight(read)
        held = live_here()
        del read
        freed_read = held - live_here()
    finally:
        tracemalloc.stop()
    assert freed_made <= weight and freed_read <= weight, (freed_made, freed_read, weight)
    assert weight_read == weight
    assert weight < 2 * freed_read, (freed_read, weight)


def test_a_session_entries_weigh_what_they_hold_when_its_build_ends() -> None:
    """After each Build of a session whose tool results pass their cap (pointer steps run), the
    memo's count is its entries' weights as they hold now: the record of the last Build's costs
    is weighed with what its allocation found (``KeptSteps``, found after the record is first
    written), and that weighs at least what its lists take (``sys.getsizeof``, an oracle of its
    own)."""
    import sys
    from dataclasses import fields, replace

    from context_engine.domain.budget import KeptSteps
    from context_engine.domain.builder import COSTS, build

    from tests import factories as f

    lp = f.loaded(f.inputs(session_id="memo-steps", model_profile=f.model(
        "gpt-4o", context_window=16_000, output_reserve=4_096)))
    memo = BoundedMemo(64 << 20)
    items = [f.user("u0", "start", 0, run="run-0")]
    for k in range(1, 13):
        items += [f.call(f"c{k}", 2 * k, f"call{k}", run="run-0"),
                  f.result(f"r{k}", 2 * k + 1, f"call{k}", f"line {k} " * 2_000, run="run-0")]
        asked = f.user("u-next", "and now?", 1_000_000, run="run-9")
        got = build(lp, f.checkpoint([*items, asked], run="run-9"),
                    estimator=f.estimator(lp.plan.spec.model), factor=1.0, memo=memo)
        assert memo.bytes == sum(map(memo_weight, memo.values()))
        (record,) = [v for key, v in memo.items() if key[1] == COSTS]
        steps = record.steps
        assert isinstance(steps, KeptSteps) and len(steps.history) > 0
        lists = sum(sys.getsizeof(v) for v in (getattr(steps, x.name) for x in fields(steps))
                    if isinstance(v, list))
        assert memo_weight(record) - memo_weight(replace(record, steps=None)) >= lists
    assert any(s.step == "tool_results" for s in got.pressure.steps)
