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
    for m in messages:
        for call in m.tool_calls:
            if call.call_id in called:
                problems.append(f"{call.call_id}: called twice")
            called.add(call.call_id)
        if m.role is Role.TOOL:
            if m.call_id not in called:
                problems.append(f"{m.call_id}: result without an earlier call")
            elif m.call_id in answered:
                problems.append(f"{m.call_id}: answered twice")
            answered.add(m.call_id)
    problems += [f"{c}: call without a result" for c in sorted(called - answered)]
    return problems
