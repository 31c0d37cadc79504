"""Tool-pair integrity of an assembled request (spec: "Tool call and result items are atomic
budget units ... a validator rejects any assembled request containing an orphan")."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import compress, count, repeat
from operator import is_

from context_engine.domain.prefixes import shared_prefix
from context_engine.domain.request import Message, Role


def orphans(messages: Sequence[Message]) -> list[str]:
    """Call ids that are called without a result, answered without a call, answered before
    being called, or answered twice. Empty for a well-formed request."""
    return _scan(messages, set(), set(), [])


@dataclass(slots=True, eq=False)
class Paired:
    """Messages the validator found well paired, with the call ids they make and answer (each
    once, since they are well paired): where the validation of a request that begins with the
    same messages resumes (``orphans_since``)."""

    messages: tuple[Message, ...]
    called: set[str]
    answered: set[str]


def orphans_since(messages: tuple[Message, ...], known: Paired | None
                  ) -> tuple[list[str], Paired | None]:
    """``orphans(messages)``, and the state to resume from next time (None when a problem was
    found). ``known`` (an earlier request's, well paired) is taken over: its sets are changed
    in place, so it must not be used again.

    The messages this request has of ``known``'s are not walked again: those both begin with,
    and, after them, a stretch of ``known``'s that this request picks up again after leaving
    some out (a history cut that moved on) when what it leaves out is closed (each call made
    there answered there, so nothing else loses its call or its result). Being well paired
    there, each of their ids was called or answered once: the ids of ``known``'s other
    messages are taken back out, and only the rest of ``messages`` is walked."""
    if known is None:
        return _walked(messages)
    old, called, answered = known.messages, known.called, known.answered
    held = shared_prefix(old, messages)
    start, resume, left_out = held, held, old[:0]  # messages[:start]: old[:held] + old[skip:resume]
    if held < len(messages):
        skip = next(compress(count(held), map(is_, old[held:], repeat(messages[held]))), None)
        if skip is not None and _made(old[held:skip]) == _answers(old[held:skip]):
            left_out = old[held:skip]
            resume = skip + shared_prefix(old[skip:], messages[held:])
            start = held + resume - skip
    if 2 * start < len(old):  # taking the rest of old out would cost more than walking it all
        return _walked(messages)
    _take_out(left_out, called, answered)
    _take_out(old[resume:], called, answered)
    return _found(messages, _scan(messages[start:], called, answered, []), called, answered)


def _walked(messages: tuple[Message, ...]) -> tuple[list[str], Paired | None]:
    """``orphans_since`` walking every message afresh."""
    called, answered = set[str](), set[str]()
    return _found(messages, _scan(messages, called, answered, []), called, answered)


def _made(messages: Sequence[Message]) -> set[str]:
    return {call.call_id for m in messages for call in m.tool_calls}


def _answers(messages: Sequence[Message]) -> set[str]:
    return {m.call_id for m in messages if m.role is Role.TOOL}


def _take_out(messages: Sequence[Message], called: set[str], answered: set[str]) -> None:
    called.difference_update(_made(messages))
    answered.difference_update(_answers(messages))


def _found(messages: tuple[Message, ...], problems: list[str], called: set[str],
           answered: set[str]) -> tuple[list[str], Paired | None]:
    return problems, (None if problems else Paired(messages, called, answered))


def _scan(messages: Sequence[Message], called: set[str], answered: set[str],
          problems: list[str]) -> list[str]:
    """Walk ``messages`` on from the ids already ``called`` and ``answered`` (well paired so
    far), adding theirs; every problem found, then every call left without a result."""
    call_made, call_answered, tool = called.add, answered.add, Role.TOOL  # read once
    for m in messages:
        calls = m.tool_calls
        if calls:  # most messages make none
            for call in calls:
                if call.call_id in called:
                    problems.append(f"{call.call_id}: called twice")
                call_made(call.call_id)
        if m.role is tool:
            call_id = m.call_id
            if call_id not in called:
                problems.append(f"{call_id}: result without an earlier call")
            elif call_id in answered:
                problems.append(f"{call_id}: answered twice")
            call_answered(call_id)
    problems += [f"{c}: call without a result" for c in sorted(called - answered)]
    return problems
