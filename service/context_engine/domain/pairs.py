"""Tool-pair integrity of an assembled request (spec: "Tool call and result items are atomic
budget units ... a validator rejects any assembled request containing an orphan")."""

from __future__ import annotations

from collections.abc import Sequence

from context_engine.domain.request import Message, Role


def orphans(messages: Sequence[Message]) -> list[str]:
    """Call ids that are called without a result, answered without a call, answered before
    being called, or answered twice. Empty for a well-formed request."""
    called: set[str] = set()
    answered: set[str] = set()
    problems: list[str] = []
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
