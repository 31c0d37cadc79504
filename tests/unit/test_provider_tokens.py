"""The token oracle (tests/support/provider_tokens.py) and what it made the estimator count:
call ids, the provider form of dotted tool names, and the request's own framing (spec: "The
token estimator")."""

from __future__ import annotations

import json

import pytest
import tiktoken
from context_engine.domain import providers
from context_engine.domain.estimator import (
    MESSAGE_OVERHEAD_TOKENS,
    REQUEST_OVERHEAD_TOKENS,
    RESPONSE_NAME_TOKENS,
    TokenEstimator,
)
from context_engine.domain.plan import request_framing
from context_engine.domain.request import Message, Role, ToolCall
from context_engine.domain.trust import TrustLevel

from tests import factories as f
from tests.support import provider_tokens as pt

CORPUS = ("", "hello world", "Größe naïve 東京 🙂", "<|endoftext|> is text here",
          '{"url":"https://example.com/a?b=c","n":[1,2,3]}', "  leading\n\n\ttabs  \r\n",
          "call_AbC123xyz09LMNopq77", "toolu_01A09q90qw90lq917835lq9", "web__fetch web.fetch",
          "x" * 500, "don't we'll THEY'RE 12345678 3.14159",
          "HTTPServerError camelCaseWord ÄÖÜäöü\n\n  indented\r\n")


def enc(name: str) -> tiktoken.Encoding:
    return pt.encoding(name)


def n(name: str, text: str) -> int:
    return len(enc(name).encode(text, disallowed_special=()))


# --------------------------------------------------------------------------- the oracle


@pytest.mark.parametrize("encoding_name", ["cl100k_base", "o200k_base"])
def test_the_oracles_encodings_count_what_the_services_counter_counts(encoding_name: str) -> None:
    """Two implementations of one encoding (tiktoken over the vocabulary and pattern loaded
    in the oracle; the service's counter, bpe-openai where it can) agree, which checks the
    split pattern the oracle copies from tiktoken."""
    counter, extra = f.REGISTRY.counter_for(encoding_name)
    assert extra == 1.0 and counter.encoding == encoding_name
    oracle = pt.Oracle(encoding_name)
    for text in CORPUS:
        assert oracle.text(text) == counter.count(text), text


def test_the_encoding_follows_the_model_by_tiktokens_own_table() -> None:
    assert pt.encoding_name_for("gpt-4") == "cl100k_base"
    assert pt.encoding_name_for("gpt-4o") == "o200k_base"
    assert pt.encoding_name_for("gpt-4o-mini-2024-07-18") == "o200k_base"
    assert pt.encoding_name_for("claude-sonnet-4-5") == "cl100k_base"  # the lower bound


def test_an_openai_body_counts_every_part_and_its_framing() -> None:
    args = '{"url":"https://example.com","note":"Größe"}'
    schema = {"type": "object", "properties": {"url": {"type": "string"}}}
    body = {"model": "gpt-4o", "instructions": "Be brief.\n\nCite.", "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "function_call", "call_id": "call_9", "name": "web__fetch", "arguments": args},
        {"type": "function_call_output", "call_id": "call_9", "output": "Example Domain."},
        {"type": "reasoning", "id": "rs_1", "encrypted_content": "gAAAA-opaque",
         "summary": [{"type": "summary_text", "text": "Fetched it."}]}],
        "tools": [{"type": "function", "name": "web__fetch", "description": "Fetch a page.",
                   "parameters": schema, "strict": False}],
        "prompt_cache_key": "session-1", "store": False, "max_output_tokens": 100}
    o = "o200k_base"
    expected = {
        "system": n(o, "Be brief.\n\nCite."),
        "messages": n(o, "hi"),
        "call_ids": 2 * n(o, "call_9"),
        "call_names": n(o, "web__fetch"),
        "call_arguments": n(o, args),
        "tool_results": n(o, "Example Domain."),
        "reasoning": n(o, "Fetched it."),
        "tools": n(o, "web__fetch") + n(o, "Fetch a page.") + n(o, json.dumps(
            schema, separators=(",", ":"))),
        "tool_framing": pt.TOOL_FRAMING + pt.TOOLS_END,
        # system message, four items, the user role and the system role, the reply primer
        "framing": 5 * pt.MESSAGE_FRAMING + n(o, "user") + n(o, "system") + pt.REPLY_PRIMER,
    }
    assert pt.breakdown(body, pt.OPENAI_RESPONSES) == expected
    assert pt.count_body(body, pt.OPENAI_RESPONSES) == sum(expected.values())
    # what is not sent to the model is not counted
    body["prompt_cache_key"] = "x" * 400
    assert pt.count_body(body, pt.OPENAI_RESPONSES) == sum(expected.values())


def test_an_anthropic_body_counts_every_block_and_its_framing() -> None:
    body = {"model": "claude-sonnet-4-5", "max_tokens": 100,
            "system": [{"type": "text", "text": "Be brief."},
                       {"type": "text", "text": "Cite.", "cache_control": {"type": "ephemeral"}}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "Both.", "signature": "c2ln" * 50},
                    {"type": "tool_use", "id": "toolu_01", "name": "web__fetch",
                     "input": {"url": "https://a.example", "n": 2}},
                    {"type": "tool_use", "id": "toolu_02", "name": "clock__now", "input": {}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_01", "content": "Page A."},
                    {"type": "tool_result", "tool_use_id": "toolu_02", "content": "12:00"},
                    {"type": "text", "text": "and?"}]}],
            "tools": [{"name": "web__fetch", "input_schema": {"type": "object"}}]}
    c = "cl100k_base"
    expected = {
        "system": n(c, "Be brief.") + n(c, "Cite."),
        "messages": n(c, "hi") + n(c, "and?"),
        "reasoning": n(c, "Both."),
        "call_ids": 2 * (n(c, "toolu_01") + n(c, "toolu_02")),
        "call_names": n(c, "web__fetch") + n(c, "clock__now"),
        "call_arguments": n(c, '{"url":"https://a.example","n":2}') + n(c, "{}"),
        "tool_results": n(c, "Page A.") + n(c, "12:00"),
        "tools": n(c, "web__fetch") + n(c, '{"type":"object"}'),
        "tool_framing": pt.TOOL_FRAMING,
        # three turns, two tool_use and two tool_result blocks, the reply primer
        "framing": 7 * pt.MESSAGE_FRAMING + pt.REPLY_PRIMER,
    }
    assert pt.breakdown(body, pt.ANTHROPIC_MESSAGES) == expected
    assert pt.count_body(body, pt.ANTHROPIC_MESSAGES) == sum(expected.values())


def test_a_chat_completions_body_counts_every_message_call_and_its_framing() -> None:
    args = '{"url":"https://example.com"}'
    schema = {"type": "object", "properties": {"url": {"type": "string"}}}
    body = {"model": "gpt-4o", "prompt_cache_key": "session-1", "max_completion_tokens": 100,
            "messages": [
                {"role": "system", "content": "Be brief.\n\nCite."},
                {"role": "user", "content": "hi", "name": "ada"},
                {"role": "assistant", "content": "Fetching.", "tool_calls": [
                    {"id": "call_9", "type": "function",
                     "function": {"name": "web__fetch", "arguments": args}},
                    {"id": "call_8", "type": "function",
                     "function": {"name": "clock__now", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "call_9", "content": "Example Domain."},
                {"role": "tool", "tool_call_id": "call_8",
                 "content": [{"type": "text", "text": "12:00"}]}],
            "tools": [{"type": "function", "function": {
                "name": "web__fetch", "description": "Fetch a page.", "parameters": schema}}]}
    o = "o200k_base"
    expected = {
        "system": n(o, "Be brief.\n\nCite."),
        "messages": n(o, "hi") + n(o, "Fetching."),
        "call_ids": 2 * (n(o, "call_9") + n(o, "call_8")),
        "call_names": n(o, "web__fetch") + n(o, "clock__now"),
        "call_arguments": n(o, args) + n(o, "{}"),
        "tool_results": n(o, "Example Domain.") + n(o, "12:00"),
        "tools": n(o, "web__fetch") + n(o, "Fetch a page.") + n(o, json.dumps(
            schema, separators=(",", ":"))),
        "tool_framing": pt.TOOL_FRAMING + pt.TOOLS_END,
        # five messages and their roles, a name, two calls, the reply primer
        "framing": 5 * pt.MESSAGE_FRAMING + sum(n(o, r) for r in (
            "system", "user", "assistant", "tool", "tool")) + pt.NAME_FRAMING + n(o, "ada")
        + 2 * pt.MESSAGE_FRAMING + pt.REPLY_PRIMER,
    }
    assert pt.breakdown(body, pt.OPENAI_CHAT_COMPLETIONS) == expected
    assert pt.count_body(body, pt.OPENAI_CHAT_COMPLETIONS) == sum(expected.values())
    body["prompt_cache_key"] = "x" * 400  # not sent to the model
    assert pt.count_body(body, pt.OPENAI_CHAT_COMPLETIONS) == sum(expected.values())


def test_a_gemini_body_counts_every_part_in_the_models_encoding() -> None:
    schema = {"type": "object", "properties": {"url": {"type": "string"}}}
    body = {"systemInstruction": {"parts": [{"text": "Be brief. 東京 Größe naïve"}]},
            "contents": [
                {"role": "user", "parts": [{"text": "hi"}]},
                {"role": "model", "parts": [
                    {"text": "Thinking it over.", "thought": True},
                    {"functionCall": {"id": "call_9", "name": "web.fetch",
                                      "args": {"url": "https://a.example"}},
                     "thoughtSignature": "c2lnbmF0dXJl" * 20}]},
                {"role": "user", "parts": [
                    {"functionResponse": {"id": "call_9", "name": "web.fetch",
                                          "response": {"output": "Page A."}}},
                    {"text": "and?"}]}],
            "tools": [{"functionDeclarations": [
                {"name": "web.fetch", "description": "Fetch a page.",
                 "parametersJsonSchema": schema}]}],
            "generationConfig": {"maxOutputTokens": 100}, "cachedContent": "cachedContents/x"}
    c = "cl100k_base"
    expected = {
        "system": n(c, "Be brief. 東京 Größe naïve"),
        "messages": n(c, "hi") + n(c, "and?"),
        "reasoning": n(c, "Thinking it over."),
        "call_ids": 2 * n(c, "call_9"),
        "call_names": 2 * n(c, "web.fetch"),
        "call_arguments": n(c, '{"url":"https://a.example"}'),
        "tool_results": n(c, '{"output":"Page A."}'),
        "tools": n(c, "web.fetch") + n(c, "Fetch a page.") + n(c, json.dumps(
            schema, separators=(",", ":"))),
        "tool_framing": pt.TOOL_FRAMING,
        # three turns, a call and a response, the reply primer
        "framing": 5 * pt.MESSAGE_FRAMING + pt.REPLY_PRIMER,
    }
    assert pt.breakdown(body, pt.GEMINI_GENERATE_CONTENT, "gemini-2.5-pro") == expected
    assert pt.count_body(body, pt.GEMINI_GENERATE_CONTENT) == sum(expected.values())
    # the model is the URL's: the encoding follows the model named
    in_o200k = pt.breakdown(body, pt.GEMINI_GENERATE_CONTENT, "gpt-4o")
    assert in_o200k["system"] == n("o200k_base", "Be brief. 東京 Größe naïve") < expected["system"]


def test_a_bedrock_body_counts_every_block_and_its_framing() -> None:
    body = {"modelId": "anthropic.claude-sonnet-4-5-20250929-v1:0",
            "system": [{"text": "Be brief."}, {"cachePoint": {"type": "default"}}],
            "messages": [
                {"role": "user", "content": [{"text": "hi"}]},
                {"role": "assistant", "content": [
                    {"reasoningContent": {"reasoningText": {"text": "Both.",
                                                            "signature": "c2ln" * 40}}},
                    {"toolUse": {"toolUseId": "tooluse_1", "name": "web__fetch",
                                 "input": {"url": "https://a.example"}}}]},
                {"role": "user", "content": [
                    {"toolResult": {"toolUseId": "tooluse_1",
                                    "content": [{"text": "Page A."}, {"json": {"n": 2}}]}},
                    {"text": "and?"}, {"cachePoint": {"type": "default"}}]}],
            "toolConfig": {"tools": [
                {"toolSpec": {"name": "web__fetch", "description": "Fetch a page.",
                              "inputSchema": {"json": {"type": "object"}}}},
                {"cachePoint": {"type": "default"}}]},
            "inferenceConfig": {"maxTokens": 100}}
    c = "cl100k_base"
    expected = {
        "system": n(c, "Be brief."),
        "messages": n(c, "hi") + n(c, "and?"),
        "reasoning": n(c, "Both."),
        "call_ids": 2 * n(c, "tooluse_1"),
        "call_names": n(c, "web__fetch"),
        "call_arguments": n(c, '{"url":"https://a.example"}'),
        "tool_results": n(c, "Page A.") + n(c, '{"n":2}'),
        "tools": n(c, "web__fetch") + n(c, "Fetch a page.") + n(c, '{"type":"object"}'),
        "tool_framing": pt.TOOL_FRAMING,
        # three turns, a toolUse and a toolResult, the reply primer
        "framing": 5 * pt.MESSAGE_FRAMING + pt.REPLY_PRIMER,
    }
    assert pt.breakdown(body, pt.BEDROCK_CONVERSE) == expected
    assert pt.count_body(body, pt.BEDROCK_CONVERSE) == sum(expected.values())


def test_the_oracle_counts_every_format_the_service_renders() -> None:
    assert set(pt.FORMATS) == set(providers.FORMATS)


def test_an_unknown_format_is_an_error_not_zero() -> None:
    with pytest.raises(ValueError):
        pt.count_body({"model": "gpt-4o"}, "gemini")


# --------------------------------------------------------------------------- the estimator


def est(model_id: str = "gpt-4o") -> TokenEstimator:
    return f.estimator(f.model(model_id))


def test_a_call_counts_its_id_name_arguments_and_framing() -> None:
    e = est()
    counter = f.REGISTRY.counter_for("o200k_base")[0]
    call = ToolCall(call_id="call_AbC123xyz09LMNopq77", name="shell_exec",
                    arguments_json='{"cmd":"ls -la"}')
    m = Message(row=10, role=Role.ASSISTANT, trust=TrustLevel.USER, item_id="c1",
                tool_calls=(call, call))
    # id, name, arguments, 3 of framing; and the name again, with a token more, for the
    # Gemini functionResponse that answers it (it names the function)
    one = (counter.count(call.call_id) + counter.count(call.name)
           + counter.count(call.arguments_json) + 3
           + counter.count(call.name) + RESPONSE_NAME_TOKENS)
    assert e.raw(m) == 2 * one
    assert e.message(m) == 2 * one + MESSAGE_OVERHEAD_TOKENS


@pytest.mark.parametrize("model_id", ["gpt-4", "gpt-4o"])
def test_a_tool_result_costs_at_least_what_a_gemini_body_sends_for_it(model_id: str) -> None:
    """Gemini receives a result as the JSON object ``{"output": text}``: quotes, backslashes
    and line breaks escaped. The estimate of a result covers that form too."""
    e = est(model_id)
    o = pt.Oracle(pt.encoding_name_for(model_id))
    # (a result's text is never empty: the builder puts every result in its envelope)
    for text in (*CORPUS[1:], '"quoted" \\ back\nslash\n' * 40, "line\n" * 200):
        m = Message(row=10, role=Role.TOOL, trust=TrustLevel.USER, text=text, call_id="c1")
        assert e.raw(m) >= o.json({"output": text}) + o.text("c1"), text[:40]


def test_a_tool_result_counts_the_call_id_it_answers() -> None:
    e = est()
    plain = Message(row=10, role=Role.TOOL, trust=TrustLevel.USER, text="ok")
    answered = Message(row=10, role=Role.TOOL, trust=TrustLevel.USER, text="ok",
                       call_id="toolu_01A09q90qw90lq917835lq9")
    assert e.raw(answered) - e.raw(plain) == n("o200k_base", "toolu_01A09q90qw90lq917835lq9")


@pytest.mark.parametrize("model_id", ["gpt-4", "gpt-4o"])
def test_a_dotted_name_costs_at_least_what_its_provider_form_costs(model_id: str) -> None:
    e = est(model_id)
    encoding_name = pt.encoding_name_for(model_id)
    for name in ("web.fetch", "files.read", "crm.contacts.search", "a.b", "x.y.z.w"):
        call = ToolCall(call_id="", name=name, arguments_json="")
        m = Message(row=10, role=Role.ASSISTANT, trust=TrustLevel.USER, tool_calls=(call,))
        sent = providers.provider_tool_name(name)
        assert e.raw(m) >= n(encoding_name, sent) + 3
        assert e.raw(m) >= n(encoding_name, name) + 3


def test_the_platform_policy_class_carries_the_requests_own_framing() -> None:
    d = f.draft(f.inputs(model_profile=f.model("gpt-4o")))
    e = est()
    blocks = d.rendered.blocks
    assert len(blocks) == 3  # policy, framing, instructions
    policy = next(c for c in d.classes if c.class_name == "platform_policy")
    text = sum(e.text(b.text) for b in blocks if b.row in (1, 2))
    assert request_framing(d.rendered) == REQUEST_OVERHEAD_TOKENS + 2
    # and the user turn Anthropic, Gemini and Bedrock open with when history begins with the
    # model's own turn (any Build may send it)
    lead = n("o200k_base", "(Earlier conversation omitted.)") + MESSAGE_OVERHEAD_TOKENS
    assert policy.tokens == text + REQUEST_OVERHEAD_TOKENS + len(blocks) - 1 + lead
    # the OpenAI body sends the blocks as one instructions text: the joins are counted
    joined = "\n\n".join(b.text for b in blocks)
    assert n("o200k_base", joined) <= sum(e.text(b.text) for b in blocks) + len(blocks) - 1


@pytest.mark.gate_budget
@pytest.mark.parametrize("pinned_by", ["current", "builder@3"])
@pytest.mark.parametrize("fmt", [pt.ANTHROPIC_MESSAGES, pt.GEMINI_GENERATE_CONTENT,
                                 pt.BEDROCK_CONVERSE, pt.OPENAI_RESPONSES])
def test_a_history_that_begins_with_the_models_turn_counts_the_line_that_opens_it(
        fmt: str, pinned_by: str) -> None:
    """Anthropic, Gemini and Bedrock open a body with a user turn when the history kept begins
    with the model's own: a minimal request on gpt-4 counted 563 in those bodies against an
    estimate of 562 before the turn was counted with the request's framing. A plan a builder
    before @4 pinned stored its count without the turn, and no Plan rotates it until the
    session's next one: its Builds count the turn beside it, and estimate what a plan pinned
    now does."""
    from dataclasses import replace

    from context_engine.domain import plan as plans
    from context_engine.domain.builder import Checkpoint, build
    from context_engine.domain.canonical import canonical_json
    from context_engine.domain.items import AssistantMessageItem

    lp = f.loaded(f.inputs(model_profile=f.model("gpt-4", context_window=12_500,
                                                 output_reserve=2_048)))
    estimator = f.estimator(lp.plan.spec.model)
    items = (AssistantMessageItem(id="a1", sequence=1, run_id="run-1",
                                  item_trust=TrustLevel.USER, text="ok"),
             f.user("u2", "hi", 2, run="run-2"))
    cp = Checkpoint(active_run_id="run-2", items=items)
    current = build(lp, cp, estimator=estimator)
    if pinned_by != "current":  # what builder@3 stored: the same plan, counted without the turn
        turn = estimator.message(plans._LEADING_TURN)
        assert turn > 0
        old = replace(lp.plan, spec=replace(lp.plan.spec, counts_leading_turn=False,
                                            builder_version="context-engine-builder@3"),
                      prefix_tokens=lp.plan.prefix_tokens - turn)
        lp = replace(lp, plan=old)
    r = build(lp, cp, estimator=estimator)
    body = json.loads(canonical_json(providers.render(r, fmt)))
    assert pt.count_body(body, fmt, r.model_id) <= r.estimated_input_tokens
    assert r.estimated_input_tokens == current.estimated_input_tokens
