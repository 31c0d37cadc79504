"""Interleaved tool calls reach every provider paired.

A second call item issued before the first one's results, a result arriving before a later
call item, parallel results out of order: the request keeps the checkpoint's order, and each
provider body is what its wire format requires (Anthropic and Bedrock: every assistant turn's
calls answered by the results that open the next user turn; OpenAI Responses: every
function_call with one function_call_output after it; Chat Completions: every assistant
message's tool_calls answered by the tool messages right after it; Gemini: every model turn's
functionCall parts answered, in their order, by the functionResponse parts of the next user
turn). The bodies pass our validators, the tool-pair gate's independent checks, and the
official SDKs offline (``through_sdk`` of tests/integration/test_provider_bodies.py: mock
transports and botocore's before-send hook; nothing leaves the process).
"""
from __future__ import annotations

import json
from typing import Any

import pytest
from context_engine.domain import pairs
from context_engine.domain import providers as p
from context_engine.domain.builder import BuildResult
from context_engine.domain.items import AssistantMessageItem, ConversationItem, ReasoningItem
from context_engine.domain.trust import TrustLevel

from tests import factories as f
from tests.integration.test_provider_bodies import through_sdk
from tests.property.test_gate_tool_pairs import (
    check_paired,
    check_provider_bodies,
    synthetic_overflow,
)
from tests.support import tool_pairs

THINKING = {"type": "thinking", "thinking": "Both are needed.", "signature": "c2ln"}
REASONING = {"type": "reasoning", "id": "rs_1", "summary": [],
             "encrypted_content": "gAAAAB-opaque"}


def _reasoning(item_id: str, seq: int, provider: str, payload: dict[str, Any]) -> ReasoningItem:
    return ReasoningItem(id=item_id, sequence=seq, run_id="run-1", item_trust=TrustLevel.USER,
                         provider=provider, opaque=json.dumps(payload).encode())


def interleaved() -> list[ConversationItem]:
    """A carried run: c0 (a, b), then c0x (c) before any result, answered b, c, a. The active
    run: reasoning, c1 (d, e), a message, c1x (g), answered e, g, d; then c2 (h, i) whose h
    arrives before c2x (j), and i last."""
    return [
        f.user("u0", "Compare three pages.", 1, run="run-0"),
        f.call("c0", 2, "a", "b", run="run-0"), f.call("c0x", 3, "c", run="run-0"),
        f.result("rb", 4, "b", "Page B.", run="run-0"),
        f.result("rc", 5, "c", "Page C.", run="run-0"),
        f.result("ra", 6, "a", "Page A.", run="run-0"),
        f.user("u1", "And now two more, and the time.", 7),
        _reasoning("th1", 8, "anthropic", THINKING), _reasoning("rs1", 8, "openai", REASONING),
        f.call("c1", 9, "d", "e"),
        AssistantMessageItem(id="a1", sequence=10, run_id="run-1", item_trust=TrustLevel.USER,
                             text="And the clock."),
        f.call("c1x", 11, "g"),
        f.result("re", 12, "e", "E"), f.result("rg", 13, "g", "G"), f.result("rd", 14, "d", "D"),
        f.call("c2", 15, "h", "i"), f.result("rh", 16, "h", "H"), f.call("c2x", 17, "j"),
        f.result("rj", 18, "j", "J"), f.result("ri", 19, "i", "I"),
    ]


def _shape(body: dict[str, Any]) -> list[tuple[str, list[str]]]:
    return [(t["role"], [b.get("id") or b.get("tool_use_id") or b["type"]
                         for b in t["content"]]) for t in body["messages"]]


def test_interleaved_calls_keep_their_order_and_pair_in_both_bodies() -> None:
    r = f.run_build(f.loaded(), f.checkpoint(interleaved()))
    ids = [m.item_id for m in r.request.messages if m.row == 10]
    assert ids == [i.id for i in interleaved()]  # the request keeps the checkpoint's order
    assert pairs.orphans(r.request.messages) == []
    check_paired(r.request.messages)
    bodies = check_provider_bodies(r)
    # Anthropic: one assistant turn per stretch of model output; each result moves to the
    # start of the user turn right after its call's turn (i before the call item c2x).
    assert _shape(bodies[p.ANTHROPIC_MESSAGES]) == [
        ("user", ["text"]),
        ("assistant", ["a", "b", "c"]),
        ("user", ["b", "c", "a", "text"]),
        ("assistant", ["thinking", "d", "e", "text", "g"]),
        ("user", ["e", "g", "d"]),
        ("assistant", ["h", "i"]),
        ("user", ["h", "i"]),
        ("assistant", ["j"]),
        ("user", ["j", "text"]),
    ]
    # OpenAI Responses pairs by call_id: the checkpoint's order is kept as it is.
    items = bodies[p.OPENAI_RESPONSES]["input"]
    assert [i.get("call_id") for i in items if i["type"].startswith("function_call")] == [
        "a", "b", "c", "b", "c", "a", "d", "e", "g", "e", "g", "d", "h", "i", "h", "j", "j",
        "i"]


def _builds() -> dict[str, BuildResult]:
    return {
        "fits": f.run_build(f.loaded(), f.checkpoint(interleaved())),
        # interleaved batches, a 16k window: pointers, and the history cut at a unit boundary
        "history cut": synthetic_overflow(4).build(),
    }


@pytest.mark.parametrize("case", ["fits", "history cut"])
def test_interleaved_bodies_through_the_official_sdks(case: str) -> None:
    r = _builds()[case]
    bodies = check_provider_bodies(r)
    assert set(bodies) == set(p.FORMATS)
    for provider_format, body in bodies.items():
        assert p.validate(body, provider_format) == []
        assert tool_pairs.problems_of(body, provider_format) == []
        through_sdk(body, provider_format, model=r.model_id)
