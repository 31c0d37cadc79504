"""Hard gate: budget conformance end to end, counted by the independent oracle (spec: "The token
estimator", "Hard gates").

Through the real gRPC server and PostgreSQL: sessions on an exact model (gpt-4, gpt-4o), on
Claude and on Gemini, each built several times with a growing tool-call-heavy conversation
(parallel batches, long arguments, provider-style call ids) until the body has to yield. Every
Build asks for a provider body; ``tests.support.provider_tokens`` counts what
``provider_body_json`` sends (in the encoding of the response's model: a Gemini body names
none), and for each response, in each of the five provider formats:

    oracle(provider_body_json) <= estimated_input_tokens <= context_window - output_reserve
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from context_engine.v1 import context_engine_pb2 as pb

from tests.integration.requests import item, plan_request
from tests.support.provider_tokens import breakdown, count_body

pytestmark = [pytest.mark.gate_budget, pytest.mark.integration]

FORMATS = {pb.PROVIDER_FORMAT_ANTHROPIC_MESSAGES: "anthropic_messages",
           pb.PROVIDER_FORMAT_OPENAI_RESPONSES: "openai_responses",
           pb.PROVIDER_FORMAT_OPENAI_CHAT_COMPLETIONS: "openai_chat_completions",
           pb.PROVIDER_FORMAT_GEMINI_GENERATE_CONTENT: "gemini_generate_content",
           pb.PROVIDER_FORMAT_BEDROCK_CONVERSE: "bedrock_converse"}
# gpt-4's real 8,192 tokens cannot hold history's 8,000-token floor (Plan refuses it): the
# exact cl100k_base model runs at the smallest window that can
MODELS = {"gpt-4": (12_500, 2_048), "gpt-4o": (16_000, 4_096),
          "claude-sonnet-4-5": (16_000, 2_000), "gemini-2.5-pro": (16_000, 2_000)}
BATCHES = (1, 4, 10, 24)  # parallel batches in the conversation of each successive Build
BASE62 = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
TEXT = ("Größe", "naïve", "the", "result", "<td>", "42", "\"name\":", "東京", "null", "ok")


def text(n: int, seed: int) -> str:
    return " ".join(TEXT[(seed + 3 * i + i // 7) % len(TEXT)] for i in range(n))


def conversation(batches: int) -> list[pb.ConversationItem]:
    """A carried run of ``batches`` parallel batches (1-5 calls each, long arguments, large
    results), then the active run's question."""
    rng = random.Random(batches)
    untrusted = pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED
    entries = [item("u0", 1, run="run-0", user=pb.UserMessage(text="Gather the pages."))]
    seq = 2
    for b in range(batches):
        calls = []
        for k in range(1 + b % 5):
            call_id = "toolu_01" + "".join(rng.choice(BASE62) for _ in range(22))
            if k % 2:
                calls.append(pb.ToolCall(call_id=call_id, name="clock.now",
                                         arguments_json=json.dumps({"tz": "Europe/Berlin"})))
            else:
                calls.append(pb.ToolCall(call_id=call_id, name="web.fetch", arguments_json=(
                    json.dumps({"url": f"https://example.com/{b}/{k}", "timeout": 30,
                                "note": text(40 + 20 * k, b + k)}, ensure_ascii=False))))
        entries.append(item(f"c{b}", seq, run="run-0",
                            tool_calls=pb.ToolCalls(calls=calls)))
        seq += 1
        for k, call in enumerate(calls):
            entries.append(item(f"r{b}-{k}", seq, trust=untrusted, run="run-0",
                                tool_result=pb.ToolResult(
                                    call_id=call.call_id, tool_name=call.name,
                                    content=text(60 + 90 * (k % 3), b * 7 + k))))
            seq += 1
        if b % 3 == 2:
            entries.append(item(f"a{b}", seq, run="run-0", assistant=pb.AssistantMessage(
                text=text(30, b))))
            seq += 1
    entries.append(item("u9", seq, run="run-1",
                        user=pb.UserMessage(text="Which of them changed most recently?")))
    return entries


def build(stub: Any, tenant: str, session: str, batches: int,
          fmt: int) -> tuple[pb.BuildResponse, dict[str, Any]]:
    req = pb.BuildRequest(tenant_id=tenant, session_id=session, checkpoint=pb.Checkpoint(
        active_run_id="run-1", items=conversation(batches),
        runtime=pb.RuntimeMetadata(current_date="2026-11-29")))
    req.provider_format = fmt  # type: ignore[assignment]
    resp = stub.Build(req)
    return resp, json.loads(resp.provider_body_json)


@pytest.mark.parametrize("model_id", list(MODELS))
def test_every_build_fits_by_the_oracles_count_of_the_provider_body(stub, ids, model_id):
    tenant, session = ids
    window, reserve = MODELS[model_id]
    stub.Plan(plan_request(tenant, session, model=pb.ModelSpec(
        model_id=model_id, capabilities=pb.ModelCapabilities(context_window=window,
                                                             output_reserve=reserve))))
    yielded = 0
    for batches in BATCHES:
        for fmt, name in FORMATS.items():
            resp, body = build(stub, tenant, session, batches, fmt)
            assert resp.provider_format == fmt
            assert resp.context_window == window and resp.output_reserve == reserve
            counted = count_body(body, name, resp.model_id)
            assert counted <= resp.estimated_input_tokens, (
                f"{model_id} {name}, {batches} batches: the provider receives {counted} "
                f"tokens, the service estimated {resp.estimated_input_tokens}; "
                f"{breakdown(body, name, resp.model_id)}")
            assert resp.estimated_input_tokens <= window - reserve
            assert counted <= window - reserve
            assert calls_in(body, name) >= min(batches, 3)
        yielded += bool(resp.pressure.steps)
    assert yielded, "no Build had to yield: the conversation is too small to test the budget"


def calls_in(body: dict[str, Any], name: str) -> int:
    """How many tool calls a body sends."""
    if name == "openai_responses":
        return sum(i.get("type") == "function_call" for i in body["input"])
    if name == "openai_chat_completions":
        return sum(len(m.get("tool_calls") or []) for m in body["messages"])
    if name == "gemini_generate_content":
        return sum("functionCall" in p for c in body["contents"] for p in c["parts"])
    if name == "bedrock_converse":
        return sum("toolUse" in b for m in body["messages"] for b in m["content"])
    return sum(b.get("type") == "tool_use" for m in body["messages"] for b in m["content"])
