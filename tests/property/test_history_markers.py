"""Where a history marker lands in the Anthropic and Bedrock bodies (spec: "The history cache
window"): on the last cacheable block of the conversation it closes, as the body lays that
conversation out. A tool result moves next to its call, so a result that came after a user
message, an assistant message or a later call item sits before them in the body: the marker
must still reach the furthest of them, or the next step re-sends them uncached.

The oracle shares no code with ``provider_common``: it names every body block's message from
what the block carries (a call or result by its id; the other blocks by their order, which no
renderer changes) and places each marker itself.
"""

from __future__ import annotations

import json
from typing import Any

from context_engine.domain import providers as p
from context_engine.domain.builder import BuildResult, Checkpoint, RuntimeMetadata
from context_engine.domain.items import (
    AssistantMessageItem,
    ConversationItem,
    ReasoningItem,
    ToolCall,
    ToolCallItem,
    ToolResultItem,
    UserMessageItem,
)
from context_engine.domain.request import Role
from context_engine.domain.trust import TrustLevel
from hypothesis import event, given, settings
from hypothesis import strategies as st

from tests import factories as f
from tests.property.strategies import CALL, RESULT, tool_exchanges

THINKING = {"type": "thinking", "thinking": "Weigh it.", "signature": "c2ln"}
BEDROCK = {"reasoningContent": {"reasoningText": {"text": "Weigh it.", "signature": "c2ln"}}}
OWN_REASONING = {p.ANTHROPIC_MESSAGES: "anthropic", p.BEDROCK_CONVERSE: "bedrock"}
UNCACHEABLE = {p.ANTHROPIC_MESSAGES: {"thinking", "redacted_thinking"},
               p.BEDROCK_CONVERSE: {"reasoningContent"}}
LOADED = f.loaded(f.inputs(enabled=("web.fetch",), catalog=(f.tool("web.fetch"),)))


@st.composite
def conversations(draw: st.DrawFn) -> Checkpoint:
    """One to three runs, the last active: a user message, then tool exchanges whose other
    items (user messages that arrived while a call ran, assistant messages, blank ones too,
    reasoning of Anthropic, Bedrock or OpenAI) sit between call items and between results."""
    items: list[ConversationItem] = []
    runs = [f"run-{k}" for k in range(draw(st.integers(1, 3)))]

    def nid() -> str:
        return f"item-{len(items) + 1}"

    def other(run: str) -> None:
        kind = draw(st.sampled_from(("user", "assistant", "reasoning")))
        trust = TrustLevel.USER
        if kind == "user":
            items.append(UserMessageItem(id=nid(), sequence=len(items), run_id=run,
                                         item_trust=trust, text=f"Also {len(items)}."))
        elif kind == "assistant":
            items.append(AssistantMessageItem(
                id=nid(), sequence=len(items), run_id=run, item_trust=trust,
                text=draw(st.sampled_from(("Working.", "", " ")))))
        else:
            provider = draw(st.sampled_from(("anthropic", "bedrock", "openai")))
            payload = THINKING if provider == "anthropic" else BEDROCK
            items.append(ReasoningItem(id=nid(), sequence=len(items), run_id=run,
                                       item_trust=trust, provider=provider,
                                       opaque=json.dumps(payload).encode()))

    for run in runs:
        items.append(UserMessageItem(id=nid(), sequence=len(items), run_id=run,
                                     item_trust=TrustLevel.USER, text="Go."))
        for _ in range(draw(st.integers(0, 2))):
            batches: list[list[str]] = []
            for kind, k, n in draw(tool_exchanges(late_others=True, early_one_in=1)):
                if kind == CALL:
                    batches.append([f"k{len(items)}_{j}" for j in range(n)])
                    items.append(ToolCallItem(
                        id=nid(), sequence=len(items), run_id=run, item_trust=TrustLevel.USER,
                        calls=tuple(ToolCall(call_id=c, name="web.fetch", arguments_json="{}")
                                    for c in batches[k])))
                elif kind == RESULT:
                    items.append(ToolResultItem(
                        id=nid(), sequence=len(items), run_id=run,
                        item_trust=TrustLevel.EXTERNAL_UNTRUSTED, call_id=batches[k][n],
                        tool_name="web.fetch", content=f"Result {len(items)}."))
                else:
                    other(run)
            if draw(st.booleans()):
                other(run)
    return Checkpoint(active_run_id=runs[-1], items=tuple(items),
                      runtime=RuntimeMetadata(current_date="2026-11-29"))


def _blocks(body: dict[str, Any]) -> list[tuple[dict[str, Any], bool]]:
    """Every message block in order, cache points left out: (block, whether it is marked)."""
    out: list[tuple[dict[str, Any], bool]] = []
    for m in body["messages"]:
        for b in m["content"]:
            if "cachePoint" in b:
                out[-1] = (out[-1][0], True)
            else:
                out.append((b, "cache_control" in b))
    return out


def _ids(b: dict[str, Any]) -> tuple[str, str]:
    """(call id, result id) a block carries; empty where it carries none."""
    if b.get("type") == "tool_use" or "toolUse" in b:
        return b.get("id") or b["toolUse"]["toolUseId"], ""
    if b.get("type") == "tool_result" or "toolResult" in b:
        return "", b.get("tool_use_id") or b["toolResult"]["toolUseId"]
    return "", ""


def owners(r: BuildResult, blocks: list[dict[str, Any]], fmt: str) -> list[int]:
    """The index of the request message each block renders (-1: the leading user line)."""
    msgs = r.request.messages
    answered = {m.call_id: i for i, m in enumerate(msgs) if m.role is Role.TOOL}
    in_order: list[tuple[int, str]] = []  # (message, call id) of every block but results
    for i, m in enumerate(msgs):
        if m.role is Role.TOOL:
            continue
        if m.reasoning_provider:
            if m.reasoning_provider == OWN_REASONING[fmt]:
                in_order.append((i, ""))
            continue
        if m.text.strip():
            in_order.append((i, ""))
        in_order += [(i, c.call_id) for c in m.tool_calls]
    others = [b for b in blocks if not _ids(b)[1]]
    lead = len(others) - len(in_order)
    assert lead in (0, 1), (lead, fmt)
    out: list[int] = []
    k = -lead
    for b in blocks:
        call, result = _ids(b)
        if result:
            out.append(answered[result])
            continue
        out.append(in_order[k][0] if k >= 0 else -1)
        assert call == (in_order[k][1] if k >= 0 else ""), (call, in_order[k])
        k += 1
    return out


def _cacheable(b: dict[str, Any], fmt: str) -> bool:
    if b.get("type") in UNCACHEABLE[fmt] or any(k in UNCACHEABLE[fmt] for k in b):
        return False
    return "text" not in b or bool(str(b["text"]).strip())


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(cp=conversations())
def test_a_history_marker_ends_where_the_body_lays_its_conversation_out(cp: Checkpoint) -> None:
    r = f.run_build(LOADED, cp)
    keys = [m.item_id for m in r.request.messages]
    for fmt in (p.ANTHROPIC_MESSAGES, p.BEDROCK_CONVERSE):
        pairs = _blocks(p.render(r, fmt))  # render runs the format's validator
        blocks = [b for b, _ in pairs]
        owner = owners(r, blocks, fmt)
        expected: set[int] = set()
        for mark in r.cache_breakpoints:
            if not mark.through_item:
                continue
            t = max(i for i, key in enumerate(keys) if key == mark.through_item)
            reached = [j for j, o in enumerate(owner) if 0 <= o <= t]
            if not reached:
                continue
            furthest = max(reached)
            at = next((j for j in range(furthest, -1, -1) if _cacheable(blocks[j], fmt)),
                      None)
            if at is not None:
                expected.add(at)
                if any(o > t for o in owner[:at]) or max(
                        (j for j, o in enumerate(owner) if o == t), default=at) < at:
                    event(f"{fmt}: a marker past its own item's last block")
        assert {j for j, (_, marked) in enumerate(pairs) if marked} == expected, (
            fmt, [(o, b) for o, b in zip(owner, blocks, strict=True)])
