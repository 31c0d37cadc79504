"""The pairing validator resumed from the last request it found well paired
(``pairs.orphans_since``, what a Build on a memo runs) finds exactly what ``pairs.orphans`` finds
over the whole request, problems named in the same order, whatever the next request keeps of
the last one (all of it, a prefix, nothing) and whatever it adds; and a Build on a memo rejects
an assembly that drops a result, near its end or in the part the last Build sent alike.

The oracle of well-pairedness here (``well_paired``) is written out in the test and shares no
code with ``pairs.py``."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import pytest
from context_engine.domain import builder
from context_engine.domain.builder import build
from context_engine.domain.errors import AssemblyError
from context_engine.domain.items import ConversationItem
from context_engine.domain.pairs import Paired, orphans, orphans_since
from context_engine.domain.request import Message, ModelRequest, Role
from context_engine.domain.trust import TrustLevel
from context_engine.engine import BoundedMemo
from hypothesis import given, settings
from hypothesis import strategies as st

from tests import factories as f
from tests.unit.test_pairs import answer, calls

pytestmark = pytest.mark.gate_tool_pairs

IDS = ("a", "b", "c", "d", "e", "f")  # few: calls made twice and answers to nothing happen


SAID = Message(row=10, role=Role.USER, trust=TrustLevel.USER, text="go")


def well_paired(messages: Sequence[Message]) -> bool:
    """Each call id made once, each answered once, after it, by a tool message."""
    made: dict[str, int] = {}
    answered: dict[str, int] = {}
    for k, m in enumerate(messages):
        for call in m.tool_calls:
            if call.call_id in made:
                return False
            made[call.call_id] = k
        if m.role is Role.TOOL:
            if m.call_id in answered or made.get(m.call_id, k) >= k:
                return False
            answered[m.call_id] = k
    return made.keys() == answered.keys()


def paired_run(draw: Any, ids: Iterator[str]) -> list[Message]:
    """A call message and its answers in some order: well paired on its own."""
    made = [next(ids) for _ in range(draw(st.integers(1, 3)))]
    return [calls(*made), *map(answer, draw(st.permutations(made)))]


def closed_at(messages: Sequence[Message]) -> list[int]:
    """The positions where every call made before is answered before: a stretch between two
    of them is whole exchanges (what a history cut leaves out)."""
    out, made, answered = [0], set(), set()
    for k, m in enumerate(messages, 1):
        made |= {call.call_id for call in m.tool_calls}
        if m.role is Role.TOOL:
            answered.add(m.call_id)
        if made == answered:
            out.append(k)
    return out


@st.composite
def requests(draw: Any) -> list[tuple[Message, ...]]:
    """A sequence of requests, each keeping a prefix of the one before (or all of it, or
    nothing), often with a stretch of it left out (whole exchanges, as a history cut leaves
    out, or any stretch), some kept messages sent as equal copies (other objects), and adding
    messages: mostly well-paired runs, now and then a stray one (a call made again, an answer
    to nothing or given twice, a call never answered) or a call answered in a later run."""
    fresh = (f"x{i}" for i in range(10_000))
    out: list[tuple[Message, ...]] = []
    last: tuple[Message, ...] = ()
    due: list[str] = []  # calls made in a run and not answered yet
    for _ in range(draw(st.integers(1, 12))):
        cut = draw(st.sampled_from((len(last), len(last), 0,
                                    draw(st.integers(0, len(last))))))
        gap = draw(st.sampled_from(("none", "exchanges", "exchanges", "any")))
        if gap == "exchanges":
            begin, end = sorted(draw(st.lists(st.sampled_from(closed_at(last[:cut])),
                                              min_size=2, max_size=2)))
        elif gap == "any":
            begin, end = sorted(draw(st.lists(st.integers(0, cut), min_size=2, max_size=2)))
        else:
            begin = end = 0
        new = [*last[:begin], *last[end:cut]]
        # some kept messages sent as copies: equal to the last request's, other objects
        for k in draw(st.sets(st.integers(0, max(len(new) - 1, 0)), max_size=3)):
            if k < len(new):
                new[k] = replace(new[k])
        for _ in range(draw(st.integers(0, 4))):
            kind = draw(st.sampled_from(("run", "run", "run", "said", "stray call",
                                         "stray answer", "call answered later",
                                         "answers due")))
            if kind == "run":
                new += paired_run(draw, fresh)
            elif kind == "call answered later":  # answered in a later run, or never
                made = next(fresh)
                new.append(calls(made))
                due.append(made)
            elif kind == "answers due":
                new += map(answer, due)
                due.clear()
            elif kind == "said":
                new.append(SAID)
            elif kind == "stray call":
                new.append(calls(draw(st.sampled_from(IDS))))
            else:
                new.append(answer(draw(st.sampled_from(IDS))))
        last = tuple(new)
        out.append(last)
    return out


@settings(max_examples=400, deadline=None, derandomize=True, database=None)
@given(requests())
def test_the_resumed_validator_finds_what_the_whole_walk_finds(
        sequence: list[tuple[Message, ...]]) -> None:
    known: Paired | None = None
    for messages in sequence:
        found, known = orphans_since(messages, known)
        assert found == orphans(messages)
        assert (found == []) == well_paired(messages)
        assert (known is None) == (found != [])
        if known is not None:
            assert known.messages == messages


def test_a_request_that_keeps_part_of_the_last_one_is_walked_from_where_they_differ() -> None:
    first = (SAID, calls("a"), answer("a"), calls("b"), answer("b"))
    _, known = orphans_since(first, None)
    assert known is not None
    # the last exchange sent again under the same id after a change: not "called twice"
    again = (SAID, calls("a"), answer("a"), SAID, calls("b"), answer("b"))
    found, known = orphans_since(again, known)
    assert found == [] and known is not None
    # the first answer dropped: found although the request begins like the last one
    found, known = orphans_since((SAID, calls("a"), SAID, calls("b"), answer("b")), known)
    assert found == ["a: call without a result"] and known is None


def test_a_request_that_leaves_out_a_stretch_of_the_last_one_is_checked_without_it() -> None:
    c1, r1, c2, r2, c3, r3 = calls("a"), answer("a"), calls("b"), answer("b"), calls("c"), \
        answer("c")
    _, known = orphans_since((SAID, c1, r1, c2, r2, SAID), None)
    # the first exchange cut away (closed: nothing else loses its call or result), one added
    found, known = orphans_since((SAID, c2, r2, c3, r3), known)
    assert found == [] and known is not None
    # its call id is free again: made anew after the cut, it is not a call made twice
    c4, r4 = calls("d"), answer("d")
    _, known = orphans_since((SAID, c1, r1, c2, r2, c3, r3, c4, r4, SAID), None)
    found, known = orphans_since((SAID, c2, r2, c3, r3, c4, r4, calls("a"), answer("a")),
                                 known)
    assert found == [] and known is not None
    # a stretch that is not closed: the calls whose results stay are left without them
    _, known = orphans_since((c1, c2, r1, r2, SAID), None)
    found, known = orphans_since((r1, r2, SAID), known)
    assert found == ["a: result without an earlier call", "b: result without an earlier call"]
    assert known is None


def test_the_state_is_taken_over_where_that_walks_less_than_a_walk_of_the_whole() -> None:
    """White box: a state whose sets hold an id its messages never call shows whether it was
    taken over (the id is still there, called and never answered) or a new walk began."""
    exchanges = [m for k in "abcdefgh" for m in (calls(k), answer(k))]

    def planted(messages: tuple[Message, ...]) -> Paired:
        _, known = orphans_since(messages, None)
        assert known is not None
        known.called.add("planted")
        return known

    last = (SAID, *exchanges, SAID)
    # all but the first exchange and the last message kept: 15 of 18 messages
    found, _ = orphans_since((SAID, *exchanges[2:], SAID), planted(last))
    assert found == ["planted: call without a result"]
    # 4 of 18 kept: taking the other 14 back out would cost more than walking 5
    found, _ = orphans_since((SAID, *exchanges[:2], SAID, SAID), planted(last))
    assert found == []


def dropping(which: int) -> Any:
    """ModelRequest as builder makes it, with its ``which``-th tool message left out."""
    def make(**fields: Any) -> ModelRequest:
        messages = fields["messages"]
        results = [k for k, m in enumerate(messages) if m.role is Role.TOOL]
        gone = results[which]
        return ModelRequest(**{**fields, "messages": messages[:gone] + messages[gone + 1:]})
    return make


@pytest.mark.parametrize("which", [0, -1], ids=["first result", "last result"])
def test_a_build_on_a_memo_rejects_an_assembly_that_drops_a_result(
        which: int, monkeypatch: pytest.MonkeyPatch) -> None:
    lp = f.loaded(f.inputs(session_id="pairs-resumed"))
    estimator = f.estimator(lp.plan.spec.model)
    items: list[ConversationItem] = [f.user("u0", "start", 0, run="run-1")]
    for k in range(1, 6):
        items += [f.call(f"c{k}", 2 * k - 1, f"call{k}", run="run-1"),
                  f.result(f"r{k}", 2 * k, f"call{k}", f"out {k}", run="run-1")]
    memo = BoundedMemo(64 << 20)
    before = build(lp, f.checkpoint(items[:-2], run="run-1"), estimator=estimator, memo=memo)
    assert sum(m.role is Role.TOOL for m in before.request.messages) == 4
    cp = f.checkpoint(items, run="run-1")
    with monkeypatch.context() as patched:
        patched.setattr(builder, "ModelRequest", dropping(which))
        with pytest.raises(AssemblyError, match="call without a result"):
            build(lp, cp, estimator=estimator, memo=memo)
    # nothing of the rejected request is kept: the same Build, assembled right, passes
    assert build(lp, cp, estimator=estimator, memo=memo) == build(lp, cp,
                                                                   estimator=estimator)
