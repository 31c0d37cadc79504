"""The pairing validator (``pairs.orphans``) names every problem, in order, on requests written
out by hand: parallel calls in one message, a call made twice, a result answered twice, a
result before its call, a call never answered; and nothing for a well-paired request."""

from __future__ import annotations

from context_engine.domain.pairs import orphans
from context_engine.domain.request import Message, Role, ToolCall
from context_engine.domain.trust import TrustLevel


def calls(*ids: str) -> Message:
    return Message(row=10, role=Role.ASSISTANT, trust=TrustLevel.USER,
                   tool_calls=tuple(ToolCall(call_id=i, name="t", arguments_json="{}")
                                    for i in ids))


def answer(call_id: str) -> Message:
    return Message(row=10, role=Role.TOOL, trust=TrustLevel.USER, text="out", call_id=call_id)


def said(text: str) -> Message:
    return Message(row=10, role=Role.USER, trust=TrustLevel.USER, text=text)


def test_a_well_paired_request_with_parallel_calls_has_no_orphan() -> None:
    assert orphans([said("go"), calls("a", "b", "c"), answer("b"), answer("a"), answer("c"),
                    said("again"), calls("d"), answer("d")]) == []


def test_each_problem_is_named_in_order() -> None:
    assert orphans([answer("x"), calls("a", "b"), answer("a"), calls("b", "c"), answer("a"),
                    answer("c"), calls("d", "e")]) == [
        "x: result without an earlier call",
        "b: called twice",
        "a: answered twice",
        "b: call without a result",
        "d: call without a result",
        "e: call without a result",
    ]


def test_the_second_of_parallel_calls_is_seen_as_called() -> None:
    assert orphans([calls("a", "b"), answer("b")]) == ["a: call without a result"]
    assert orphans([calls("a", "b"), answer("a")]) == ["b: call without a result"]
