"""A response's pressure with the yielded ids of long steps kept in protobuf form from Build to
Build (``mapping.pressure_pb`` with the render memo) against the same pressure built without
it: the same bytes over drawn sequences of ids that slide on, grow, shrink, change in the middle
or start again, over two steps and two sessions sharing one memo."""

from __future__ import annotations

from unittest import mock

from context_engine.api import mapping
from context_engine.domain.budget import Pressure, YieldStep
from hypothesis import given, settings
from hypothesis import strategies as st

POOL = [f"i{n:05d}" for n in range(400)]


def pressure(steps: dict[str, tuple[str, ...]]) -> Pressure:
    return Pressure(steps=tuple(YieldStep(step=name, units=len(ids), ids=ids, tokens_before=9,
                                          tokens_after=3) for name, ids in steps.items()),
                    fits=True, tokens_before=9, tokens_after=3, body_budget=10,
                    compaction_needed=False, left_out_items=4, left_out_tokens=5, cut_index=6,
                    floor_index=0, legacy_tool_excerpts=0)


MOVES = st.tuples(st.sampled_from(("slide", "grow", "shrink", "middle", "anew", "same")),
                  st.integers(0, 30), st.integers(0, 30))


def moved(ids: tuple[str, ...], move: tuple[str, int, int]) -> tuple[str, ...]:
    kind, a, b = move
    fresh = tuple(POOL[(len(ids) + a + j) % len(POOL)] for j in range(b))
    if kind == "slide":  # the usual turn: a few off the front, a few on the end
        return ids[a:] + fresh
    if kind == "grow":
        return ids + fresh
    if kind == "shrink":
        return ids[:max(len(ids) - a, 0)]
    if kind == "middle" and ids:
        k = a % len(ids)
        return (*ids[:k], "changed", *ids[k + 1:])
    if kind == "anew":
        return tuple(POOL[(a + j) % len(POOL)] for j in range(b + 5))
    return ids


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(MOVES, MOVES, st.booleans()), max_size=25),
       st.integers(0, 40), st.integers(0, 40))
def test_kept_ids_are_the_ids(moves: list[tuple[tuple[str, int, int], tuple[str, int, int],
                                                bool]], first: int, second: int) -> None:
    memo: dict[object, object] = {}
    results, history = tuple(POOL[:first]), tuple(POOL[100:100 + second])
    other = tuple(POOL[200:260])
    with mock.patch.object(mapping, "STEP_IDS_KEPT", 3):
        for a, b, other_session in moves:
            results, history = moved(results, a), moved(history, b)
            p = pressure({"tool_results": results, "history": history})
            got = mapping.pressure_pb(p, memo, "session-a")
            assert got.SerializeToString() == mapping.pressure_pb(p).SerializeToString()
            assert [list(s.item_ids) for s in got.steps] == [list(results), list(history)]
            if other_session:  # another session's steps on the same memo
                q = pressure({"history": other})
                assert mapping.pressure_pb(q, memo, "session-b") == mapping.pressure_pb(q)


def test_a_slide_is_brought_up_in_place() -> None:
    """The kept message itself is brought up (no new one), and what it was copied into keeps
    what it held."""
    memo: dict[object, object] = {}
    ids = tuple(POOL[:300])
    first = mapping.pressure_pb(pressure({"history": ids}), memo, "s")
    kept = mapping.step_ids(ids, memo, ("s", mapping._STEP_IDS, "history"))
    slid = (*ids[7:], "new-1", "new-2")
    assert mapping.step_ids(slid, memo, ("s", mapping._STEP_IDS, "history")) is kept
    assert list(kept.item_ids) == list(slid)
    assert list(first.steps[0].item_ids) == list(ids)  # a copy, not the kept message


def test_every_field_of_the_pressure_reaches_the_response() -> None:
    """Each field of the domain's Pressure, set apart from its default and from every other,
    lands in its protobuf field, in the Pressure alone and in a whole response (where it is
    written in place), with and without the memo; the pb names written out here, not read from
    the mapping."""
    long_ids = tuple(POOL[:300])  # kept in protobuf form when a memo is given
    p = Pressure(steps=(YieldStep(step="tool_results", units=300, ids=long_ids,
                                  tokens_before=901, tokens_after=902),
                        YieldStep(step="history", units=2, ids=("a", "b"), tokens_before=903,
                                  tokens_after=904)),
                 fits=True, tokens_before=11, tokens_after=12, body_budget=13,
                 compaction_needed=True, left_out_items=14, left_out_tokens=15, cut_index=16,
                 floor_index=17, legacy_tool_excerpts=18, history_floor_shortfall=19,
                 compact_through_sequence=20)
    expected = {"fits": True, "tokens_before": 11, "tokens_after": 12,
                "compaction_needed": True, "left_out_items": 14, "left_out_tokens": 15,
                "history_cut_index": 16, "summary_floor_index": 17,
                "legacy_tool_excerpts": 18, "history_floor_shortfall": 19,
                "compact_through_sequence": 20}
    steps = [("tool_results", 300, list(long_ids), 901, 902), ("history", 2, ["a", "b"], 903, 904)]
    for memo in (None, {}):
        out = mapping.pressure_pb(p, memo, "s")
        response = mapping.pb.BuildResponse()
        mapping.pressure_into(response.pressure, p, memo, "s")
        for got in (out, response.pressure):
            assert {k: getattr(got, k) for k in expected} == expected
            assert [(s.step, s.units, list(s.item_ids), s.tokens_before, s.tokens_after)
                    for s in got.steps] == steps
