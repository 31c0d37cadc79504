"""Provider-ready bodies: the Anthropic Messages and OpenAI Responses
renderings of a BuildResult, their breakpoints, tool-name mapping and structural validators
(the other formats: test_provider_chat.py, test_provider_gemini.py, test_provider_bedrock.py;
which one Build renders: test_provider_defaults.py)."""

from __future__ import annotations

import copy
import json
import re
from dataclasses import replace
from typing import Any

import pytest
from context_engine.api import mapping
from context_engine.domain import providers as p
from context_engine.domain.breakpoints import CacheBreakpoint
from context_engine.domain.builder import BuildResult
from context_engine.domain.errors import AssemblyError, InvalidInput
from context_engine.domain.items import (
    AssistantMessageItem,
    ConversationItem,
    HistorySummary,
    ReasoningItem,
)
from context_engine.domain.model import SessionKind
from context_engine.domain.trust import TrustLevel

from tests import factories as f
from tests.support import tool_schemas

THINKING = {"type": "thinking", "thinking": "Compare both pages.", "signature": "c2lnbmF0dXJl"}
OPENAI_REASONING = {"type": "reasoning", "id": "rs_1", "summary": [],
                    "encrypted_content": "gAAAAB-opaque"}
CATALOG = (f.tool("web.fetch"), f.tool("clock_now", description="The current time."))


def assistant(item_id: str, text: str, seq: int, run: str = "run-1") -> AssistantMessageItem:
    return AssistantMessageItem(id=item_id, sequence=seq, run_id=run,
                                item_trust=TrustLevel.TRUSTED_CONFIGURATION, text=text)


def reasoning(item_id: str, seq: int, provider: str, payload: dict[str, Any] | bytes,
              run: str = "run-1") -> ReasoningItem:
    opaque = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return ReasoningItem(id=item_id, sequence=seq, run_id=run,
                         item_trust=TrustLevel.TRUSTED_CONFIGURATION, provider=provider,
                         opaque=opaque)


def built(items: list[ConversationItem], *, kind: SessionKind = SessionKind.INTERACTIVE,
          budget: int | None = None, catalog: tuple[Any, ...] = CATALOG,
          model_id: str = "claude-sonnet-4-5", **fields: Any) -> BuildResult:
    caps = {} if budget is None else {"breakpoint_budget": budget}
    i = f.inputs(enabled=tuple(t.name for t in catalog), catalog=catalog, kind=kind,
                 model_profile=f.model(model_id, **caps))
    return f.run_build(f.loaded(i), f.checkpoint(items, **fields))


def two_runs() -> list[ConversationItem]:
    """A carried run (one call) and an active run with parallel calls and reasoning."""
    return [
        f.user("u0", "Check the weather.", 1, run="run-0"),
        f.call("c0", 2, "k0", run="run-0"),
        f.result("r0", 3, "k0", "Sunny.", run="run-0"),
        assistant("a0", "It is sunny.", 4, run="run-0"),
        f.user("u1", "Compare two pages.", 5),
        reasoning("th1", 6, "anthropic", THINKING),
        reasoning("rs1", 7, "openai", OPENAI_REASONING),
        f.call("c1", 8, "k1", "k2"),
        f.result("r1", 9, "k1", "Page one."),
        f.result("r2", 10, "k2", "Page two."),
    ]


def marked(body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(where, cache_control) for every breakpoint, in request order."""
    out = [(f"tools[{i}]", t["cache_control"]) for i, t in enumerate(body.get("tools", []))
           if "cache_control" in t]
    out += [(f"system[{i}]", b["cache_control"]) for i, b in enumerate(body["system"])
            if "cache_control" in b]
    for i, m in enumerate(body["messages"]):
        out += [(f"messages[{i}].content[{j}]", b["cache_control"])
                for j, b in enumerate(m["content"]) if "cache_control" in b]
    return out


def block_texts(turn: dict[str, Any]) -> list[str]:
    return [b.get("text") or b.get("content") or b["type"] for b in turn["content"]]


# ----------------------------------------------------------------------------- Anthropic

def test_anthropic_top_level_tools_and_system() -> None:
    r = built(two_runs())
    body = p.anthropic_messages(r)
    assert body["model"] == r.model_id == "claude-sonnet-4-5"
    assert body["max_tokens"] == r.output_reserve
    assert [b["text"] for b in body["system"]] == [b.text for b in r.request.prefix_blocks]
    assert all(b["type"] == "text" for b in body["system"])
    assert [t["name"] for t in body["tools"]] == ["clock_now", "web__fetch"]
    for tool, definition in zip(body["tools"], r.request.tools, strict=True):
        assert tool["input_schema"] == json.loads(definition.input_schema_json)
        assert tool["description"] == definition.description
    assert p.validate_anthropic(body) == []


def test_anthropic_turns_merge_and_alternate() -> None:
    body = p.anthropic_messages(built(two_runs()))
    roles = [m["role"] for m in body["messages"]]
    assert roles == ["user", "assistant", "user", "assistant", "user", "assistant", "user"]
    # a0 (assistant) and u1 (user) are separate turns; the last user turn carries the results
    # of the parallel batch first, then the fresh runtime row.
    last = body["messages"][-1]["content"]
    assert [b["type"] for b in last] == ["tool_result", "tool_result", "text"]
    assert last[2]["text"].startswith("Runtime:")


def test_anthropic_parallel_calls_share_a_turn_and_their_results_the_next() -> None:
    body = p.anthropic_messages(built(two_runs()))
    calls = body["messages"][-2]["content"]
    uses = [b for b in calls if b["type"] == "tool_use"]
    assert [(u["id"], u["name"], u["input"]) for u in uses] == [
        ("k1", "web__fetch", {"q": "k1"}), ("k2", "web__fetch", {"q": "k2"})]
    results = body["messages"][-1]["content"][:2]
    assert [b["tool_use_id"] for b in results] == ["k1", "k2"]
    assert "Page one." in results[0]["content"] and "Page two." in results[1]["content"]


def test_anthropic_results_come_first_and_follow_their_calls_turn() -> None:
    items: list[ConversationItem] = [
        f.user("u1", "Go.", 1),
        f.call("c1", 2, "k1"),
        f.user("u2", "Also check the other one.", 3),  # arrived while k1 ran
        f.call("c2", 4, "k2"),
        f.result("r1", 5, "k1", "One."),
        f.result("r2", 6, "k2", "Two."),
    ]
    body = p.anthropic_messages(built(items))
    kinds = [[b["type"] for b in m["content"]] for m in body["messages"]]
    assert kinds == [["text"], ["tool_use"], ["tool_result", "text"], ["tool_use"],
                     ["tool_result", "text"]]
    assert body["messages"][2]["content"][0]["tool_use_id"] == "k1"
    assert body["messages"][4]["content"][0]["tool_use_id"] == "k2"
    assert p.validate_anthropic(body) == []


def test_anthropic_pointer_results_stay_paired() -> None:
    pointer = replace(f.result("r1", 3, "k1", "x" * 5000), elided=True,
                      artifact_ref="artifact://results/r1")
    body = p.anthropic_messages(built([f.user("u1", "Fetch.", 1), f.call("c1", 2, "k1"),
                                       pointer]))
    result = body["messages"][-1]["content"][0]
    assert result["type"] == "tool_result" and result["tool_use_id"] == "k1"
    assert "[elided] tool.result r1" in result["content"]
    assert "artifact://results/r1" in result["content"] and "x" * 100 not in result["content"]
    assert p.validate_anthropic(body) == []


def test_anthropic_reasoning_is_replayed_verbatim_and_other_providers_are_omitted() -> None:
    body = p.anthropic_messages(built(two_runs()))
    calls = body["messages"][-2]["content"]
    assert calls[0] == THINKING  # decoded from the opaque payload, untouched, first
    assert [b["type"] for b in calls] == ["thinking", "tool_use", "tool_use"]
    assert "encrypted_content" not in json.dumps(body)  # the OpenAI item is not sent


def test_reasoning_of_an_earlier_run_reaches_neither_provider() -> None:
    items: list[ConversationItem] = [
        f.user("u0", "Hi.", 1, run="run-0"),
        reasoning("th0", 2, "anthropic", THINKING, run="run-0"),
        reasoning("rs0", 3, "openai", OPENAI_REASONING, run="run-0"),
        assistant("a0", "Hello.", 4, run="run-0"),
        f.user("u1", "Again.", 5),
    ]
    r = built(items)
    assert "thinking" not in json.dumps(p.anthropic_messages(r))
    assert all(i.get("type") != "reasoning" for i in p.openai_responses(r)["input"])


@pytest.mark.parametrize(("provider", "payload"), [
    ("anthropic", b"\xff not json"),
    ("anthropic", b'["thinking"]'),
    ("anthropic", json.dumps({"type": "tool_use", "id": "x", "name": "n", "input": {}}).encode()),
    # a key Anthropic never returns on a thinking block: cache_control, which it refuses there
    # (and the body's own rules too), or any other, and a field that is missing or no string
    ("anthropic", json.dumps({**THINKING, "cache_control": {"type": "ephemeral"}}).encode()),
    ("anthropic", json.dumps({**THINKING, "cache_control": {"type": "ephemeral",
                                                            "ttl": "1h"}}).encode()),
    ("anthropic", json.dumps({"type": "redacted_thinking", "data": "ZGF0YQ==",
                              "cache_control": {"type": "ephemeral"}}).encode()),
    ("anthropic", json.dumps({**THINKING, "citations": []}).encode()),
    ("anthropic", json.dumps({"type": "thinking", "thinking": "x"}).encode()),
    ("anthropic", json.dumps({"type": "redacted_thinking", "data": 7}).encode()),
    ("openai", json.dumps({"type": "function_call", "call_id": "x"}).encode()),
])
def test_an_unreplayable_reasoning_payload_is_a_clear_error(provider: str,
                                                            payload: bytes) -> None:
    items: list[ConversationItem] = [f.user("u1", "Go.", 1),
                                     reasoning("th1", 2, provider, payload),
                                     f.call("c1", 3, "k1"), f.result("r1", 4, "k1", "ok")]
    render = p.anthropic_messages if provider == "anthropic" else p.openai_responses
    fmt = p.ANTHROPIC_MESSAGES if provider == "anthropic" else p.OPENAI_RESPONSES
    with pytest.raises(p.ProviderFormatError) as err:
        render(built(items))
    assert "'th1'" in str(err.value) and "cannot be replayed" in str(err.value)
    assert isinstance(err.value, InvalidInput)
    assert err.value.metadata()["provider_format"] == fmt
    # the item's own field, once the servicer knows its position
    located = err.value.located({"u1": 0, "th1": 1, "c1": 2, "r1": 3})
    assert [v.field for v in located.violations] == ["checkpoint.items[1].reasoning.opaque"]


@pytest.mark.parametrize(("fmt", "bad"), [
    (p.ANTHROPIC_MESSAGES, "functions.web_fetch:0"),  # outside [a-zA-Z0-9_-]
    (p.BEDROCK_CONVERSE, "call/1"),  # outside [a-zA-Z0-9_.:-]
    (p.OPENAI_CHAT_COMPLETIONS, "c" * 41),  # over 40 characters
    (p.OPENAI_RESPONSES, "c" * 65),  # over 64
])
def test_a_call_id_the_format_refuses_is_located_at_the_call_and_its_result(
        fmt: str, bad: str) -> None:
    """The refusal names the call (the second of two parallel ones) and its result, each at
    its own field of the checkpoint once the servicer knows the items' positions; the call
    the provider takes is not named."""
    items: list[ConversationItem] = [f.user("u1", "Go.", 1), f.call("c1", 2, "k1", bad),
                                     f.result("r1", 3, "k1", "one"),
                                     f.result("r2", 4, bad, "two")]
    with pytest.raises(p.ProviderFormatError) as err:
        p.render(built(items, model_id="anthropic.claude-sonnet-4-5-v1:0"
                       if fmt == p.BEDROCK_CONVERSE else "claude-sonnet-4-5"), fmt)
    assert err.value.metadata()["provider_format"] == fmt
    located = err.value.located({"u1": 0, "c1": 1, "r1": 2, "r2": 3})
    assert [v.field for v in located.violations] == [
        "checkpoint.items[1].tool_calls.calls[1].call_id",
        "checkpoint.items[3].tool_result.call_id"]
    assert all(repr(bad) in v.description and fmt in v.description
               for v in located.violations)


@pytest.mark.parametrize("payload", [
    THINKING, {"type": "redacted_thinking", "data": "cmVkYWN0ZWQ="},
])
def test_an_anthropic_thinking_block_as_the_api_returned_it_is_replayed(
        payload: dict[str, Any]) -> None:
    items: list[ConversationItem] = [f.user("u1", "Go.", 1),
                                     reasoning("th1", 2, "anthropic", payload),
                                     f.call("c1", 3, "k1"), f.result("r1", 4, "k1", "ok")]
    body = p.anthropic_messages(built(items))
    assert body["messages"][1]["content"][0] == payload


def test_a_history_that_opens_with_the_models_turn_gets_a_leading_user_turn() -> None:
    items: list[ConversationItem] = [assistant("a0", "Earlier answer.", 1, run="run-0"),
                                     f.user("u1", "Next.", 2)]
    body = p.anthropic_messages(built(items))
    assert body["messages"][0] == {"role": "user", "content": [
        {"type": "text", "text": p.LEADING_USER_TEXT}]}
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "user"]
    assert p.validate_anthropic(body) == []


# ----------------------------------------------------------------------------- breakpoints

def test_breakpoints_with_a_one_hour_plan_and_a_budget_of_four() -> None:
    r = built(two_runs(), kind=SessionKind.SCHEDULED, budget=4)
    assert [(b.name, b.ttl) for b in r.cache_breakpoints] == [
        ("after_system", "1h"), ("after_tools", "1h"), ("carried_history", "5m"),
        ("run", "5m")]
    body = p.anthropic_messages(r)
    hour = {"type": "ephemeral", "ttl": "1h"}
    five = {"type": "ephemeral"}
    assert marked(body) == [("tools[1]", hour), (f"system[{len(body['system']) - 1}]", hour),
                            ("messages[3].content[0]", five),  # a0: the carried history
                            ("messages[4].content[0]", five)]  # u1: the run, before reasoning
    assert body["messages"][3]["content"][0]["text"] == "It is sunny."
    assert "u1" in body["messages"][4]["content"][0]["text"]
    assert p.validate_anthropic(body) == []


@pytest.mark.parametrize(("budget", "names"), [
    (3, ["after_system", "after_tools", "carried_history"]),
    (2, ["after_system", "after_tools"]),
])
def test_smaller_budgets_drop_the_run_marker_first(budget: int, names: list[str]) -> None:
    r = built(two_runs(), kind=SessionKind.SCHEDULED, budget=budget)
    assert [b.name for b in r.cache_breakpoints] == names
    body = p.anthropic_messages(r)
    found = marked(body)
    assert len(found) == budget
    assert [cc.get("ttl") for _, cc in found] == ["1h", "1h", None][:budget]
    assert p.validate_anthropic(body) == []


def test_the_summary_marker_sits_on_the_summary() -> None:
    items: list[ConversationItem] = [f.user("u0", "Old.", 1, run="run-0"),
                                     f.user("u1", "New.", 2), f.call("c1", 3, "k1"),
                                     f.result("r1", 4, "k1", "Done.")]
    r = built(items, summary=HistorySummary(text="We talked.", replaced_through_sequence=1))
    assert [b.through_item for b in r.cache_breakpoints][2:] == ["@summary", "r1"]
    body = p.anthropic_messages(r)
    first = body["messages"][0]["content"]
    assert first[0]["text"].startswith("Summary of the earlier conversation")
    assert first[0]["cache_control"] == {"type": "ephemeral"}
    assert "cache_control" not in first[1]  # u1
    last = body["messages"][-1]["content"]
    assert last[0]["type"] == "tool_result"
    assert last[0]["cache_control"] == {"type": "ephemeral"}  # r1, the run marker
    assert "cache_control" not in last[1]  # the fresh runtime row
    assert p.validate_anthropic(body) == []


def user_between_calls(run: str = "run-1") -> list[ConversationItem]:
    """u2 arrives while k1 runs; k2 is called and answered before k1's result: the body moves
    r1 next to its call, so r1, the last item, is not the conversation's last block."""
    return [f.user("u1", "Go.", 1, run=run), f.call("c1", 2, "k1", run=run),
            f.user("u2", "Also this.", 3, run=run), f.call("c2", 4, "k2", run=run),
            f.result("r2", 5, "k2", "Two.", run=run), f.result("r1", 6, "k1", "One.", run=run)]


def laid_out(body: dict[str, Any]) -> list[list[str]]:
    """Each turn's blocks named by what they carry: a call or result by its id, a text by the
    item its envelope names or else by its first word, a mark where cache_control is."""
    def name(b: dict[str, Any]) -> str:
        if b["type"] in ("tool_use", "tool_result"):
            out = f"{b['type']}:{b.get('id') or b['tool_use_id']}"
        else:
            found = re.search(r' id="([^"]+)"', b.get("text", ""))
            out = f"text:{found.group(1) if found else b['text'].split()[0]}"
        return out + (" +mark" if "cache_control" in b else "")
    return [[name(b) for b in t["content"]] for t in body["messages"]]


def test_the_run_marker_closes_the_conversation_as_the_body_lays_it_out() -> None:
    r = built(user_between_calls())
    assert [(b.name, b.through_item) for b in r.cache_breakpoints][2:] == [("run", "r1")]
    body = p.anthropic_messages(r)
    # the k2 result is the last block the next step repeats; r1's sits before u2
    assert laid_out(body) == [
        ["text:u1"], ["tool_use:k1"], ["tool_result:k1", "text:u2"], ["tool_use:k2"],
        ["tool_result:k2 +mark", "text:Runtime:"]]
    assert p.validate_anthropic(body) == []


def test_the_carried_marker_closes_the_carried_history_as_the_body_lays_it_out() -> None:
    r = built([*user_between_calls("run-0"), f.user("u3", "Next.", 7),
               assistant("a3", "On it.", 8)])
    assert [(b.name, b.through_item) for b in r.cache_breakpoints][2:] == [
        ("carried_history", "r1"), ("run", "a3")]
    body = p.anthropic_messages(r)
    assert laid_out(body) == [
        ["text:u1"], ["tool_use:k1"], ["tool_result:k1", "text:u2"], ["tool_use:k2"],
        ["tool_result:k2 +mark", "text:u3"], ["text:On +mark"], ["text:Runtime:"]]
    assert p.validate_anthropic(body) == []


def test_a_marker_never_lands_on_thinking_nor_past_its_item() -> None:
    r = built(two_runs())
    # a hand-made marker through the thinking block falls back to the block before it
    r = replace(r, cache_breakpoints=(
        CacheBreakpoint(name="run", ttl="5m", through_item="th1"),
        CacheBreakpoint(name="carried_history", ttl="5m", through_item="missing")))
    body = p.anthropic_messages(r)
    assert [w for w, _ in marked(body)] == ["messages[4].content[0]"]  # u1's text
    assert "cache_control" not in body["messages"][5]["content"][0]
    assert p.validate_anthropic(body) == []


def test_at_most_four_breakpoints_and_never_longer_after_shorter() -> None:
    r = built(two_runs(), kind=SessionKind.SCHEDULED)
    extra = (*r.cache_breakpoints,
             CacheBreakpoint(name="extra", ttl="5m", through_item="r2"),
             CacheBreakpoint(name="run", ttl="1h", through_item="c1"))
    body = p.anthropic_messages(replace(r, cache_breakpoints=extra))
    found = marked(body)
    assert len(found) == 4
    assert [cc.get("ttl", "5m") for _, cc in found] == ["1h", "1h", "5m", "5m"]
    assert p.validate_anthropic(body) == []


def test_without_tools_after_tools_has_no_block() -> None:
    r = built([f.user("u1", "Hi.", 1)], catalog=())
    body = p.anthropic_messages(r)
    assert "tools" not in body
    assert [w for w, _ in marked(body)] == [f"system[{len(body['system']) - 1}]"]


# ----------------------------------------------------------------------------- OpenAI

def test_openai_body() -> None:
    r = built(two_runs(), model_id="gpt-5")
    body = p.openai_responses(r)
    assert body["model"] == "gpt-5"
    assert body["instructions"] == "\n\n".join(b.text for b in r.request.prefix_blocks)
    assert body["prompt_cache_key"] == r.session_key
    assert body["max_output_tokens"] == r.output_reserve
    assert body["store"] is False and body["include"] == ["reasoning.encrypted_content"]
    assert body["tools"] == [
        {"type": "function", "name": "clock_now", "description": "The current time.",
         "parameters": f.SCHEMA, "strict": False},
        {"type": "function", "name": "web__fetch",
         "description": "Does web.fetch. More detail here.", "parameters": f.SCHEMA,
         "strict": False}]
    kinds = [(i["type"], i.get("role") or i.get("call_id")) for i in body["input"]]
    assert kinds == [
        ("message", "user"), ("function_call", "k0"), ("function_call_output", "k0"),
        ("message", "assistant"), ("message", "user"), ("reasoning", None),
        ("function_call", "k1"), ("function_call", "k2"),
        ("function_call_output", "k1"), ("function_call_output", "k2"),
        ("message", "user")]
    assert body["input"][3]["content"] == [
        {"type": "output_text", "text": "It is sunny.", "annotations": []}]
    assert body["input"][0]["content"][0]["type"] == "input_text"
    assert body["input"][5] == OPENAI_REASONING  # verbatim; the Anthropic block is omitted
    calls = {c.call_id: c for m in r.request.messages for c in m.tool_calls}
    for item in body["input"]:
        if item["type"] == "function_call":
            assert item["arguments"] == calls[item["call_id"]].arguments_json  # verbatim
            assert item["name"] == "web__fetch"
    assert "cache_control" not in json.dumps(body)
    assert p.validate_openai(body) == []


# Which OpenAI models reason, written out by hand from OpenAI's model pages rather than derived
# from the rule under test: a model that does not reason answers a request asking for its
# encrypted reasoning with 400 "Encrypted content is not supported with this model."
REASONS = {"gpt-5": True, "gpt-5-mini": True, "gpt-5.1": True, "gpt-5-codex": True,
           "o1": True, "o1-mini": True, "o3": True, "o3-mini": True, "o3-pro": True,
           "o4-mini": True,
           "gpt-5-chat-latest": False, "gpt-4o": False, "gpt-4o-mini": False,
           "gpt-4.1": False, "gpt-4.1-mini": False, "gpt-4.5-preview": False,
           "gpt-4-turbo": False, "gpt-4": False, "gpt-3.5-turbo": False}


@pytest.mark.parametrize("model_id", sorted(REASONS))
def test_openai_asks_only_a_model_that_reasons_for_its_reasoning(model_id: str) -> None:
    body = p.openai_responses(built(two_runs(), model_id=model_id))
    assert ("include" in body) is REASONS[model_id]
    if REASONS[model_id]:
        assert body["include"] == ["reasoning.encrypted_content"]
    assert p.validate_openai(body) == []
    asked = {**body, "include": ["reasoning.encrypted_content"]}
    assert (p.validate_openai(asked) == []) is REASONS[model_id]


def test_openai_pointer_results() -> None:
    pointer = replace(f.result("r1", 3, "k1", "y" * 4000), elided=True)
    body = p.openai_responses(built([f.user("u1", "Fetch.", 1), f.call("c1", 2, "k1"),
                                     pointer], model_id="gpt-5"))
    out = body["input"][2]
    assert out["type"] == "function_call_output" and out["call_id"] == "k1"
    assert "[elided] tool.result r1" in out["output"]
    assert p.validate_openai(body) == []


# ----------------------------------------------------------------------------- tool names

def test_tool_names_map_dots_deterministically() -> None:
    assert p.provider_tool_name("browser.navigate") == "browser__navigate"
    assert p.provider_tool_names(["a.b", "c-d", "a.b"]) == {"a.b": "a__b", "c-d": "c-d"}


def test_colliding_tool_names_are_rejected_clearly() -> None:
    r = built([f.user("u1", "Hi.", 1)], catalog=(f.tool("a.b"), f.tool("a__b")))
    for render in (p.anthropic_messages, p.openai_responses):
        with pytest.raises(p.ProviderFormatError) as err:
            render(r)
        assert "'a.b', 'a__b'" in str(err.value) and "'a__b'" in str(err.value)
        assert err.value.violations[0].field == "provider_format"
        # the usual cause named: a call stored under the provider's form of a defined name
        assert "'a__b' is already the provider's form of 'a.b'" in str(err.value)
    with pytest.raises(p.ProviderFormatError) as err:
        p.provider_tool_names(["a.b", "a..b"], mapping=lambda n: "x")
    assert "already" not in str(err.value)  # neither is the provider's form of the other


def test_a_replayed_call_colliding_with_a_definition_is_rejected() -> None:
    r = built([f.user("u1", "Hi.", 1), f.call("c1", 2, "k1", name="web__fetch"),
               f.result("r1", 3, "k1", "page", name="web__fetch")])
    with pytest.raises(p.ProviderFormatError) as err:
        p.openai_responses(r)
    assert "'web.fetch', 'web__fetch'" in str(err.value)


def test_a_name_too_long_once_mapped_is_rejected() -> None:
    name = "a." * 31 + "b"  # 63 characters; 94 once mapped
    with pytest.raises(p.ProviderFormatError, match="1-64 characters"):
        p.provider_tool_names([name])


# ----------------------------------------------------------------------------- validators

def anthropic_valid() -> dict[str, Any]:
    body = p.anthropic_messages(built(two_runs(), kind=SessionKind.SCHEDULED))
    assert p.validate_anthropic(body) == []
    return body


def openai_valid() -> dict[str, Any]:
    body = p.openai_responses(built(two_runs(), model_id="gpt-5"))
    assert p.validate_openai(body) == []
    return body


def test_validator_counts_breakpoints() -> None:
    body = anthropic_valid()
    body["messages"][0]["content"][0]["cache_control"] = {"type": "ephemeral"}
    assert any("5 cache_control breakpoints" in e for e in p.validate_anthropic(body))


def test_validator_checks_ttl_order() -> None:
    body = anthropic_valid()
    body["messages"][4]["content"][0]["cache_control"] = {"type": "ephemeral", "ttl": "1h"}
    assert any("longer TTLs must come first" in e for e in p.validate_anthropic(body))


def test_validator_rejects_cache_control_on_thinking() -> None:
    body = anthropic_valid()
    body["messages"][5]["content"][0]["cache_control"] = {"type": "ephemeral"}
    assert any("'thinking' block" in e for e in p.validate_anthropic(body))


def test_validator_catches_an_unanswered_tool_use() -> None:
    body = anthropic_valid()
    del body["messages"][-1]["content"][1]  # k2's result
    errors = p.validate_anthropic(body)
    assert any("'k2' has no tool_result" in e for e in errors)


def test_validator_catches_a_result_outside_the_next_turn() -> None:
    body = anthropic_valid()
    moved = body["messages"][-1]["content"].pop(0)
    body["messages"][0]["content"].insert(0, moved)
    errors = p.validate_anthropic(body)
    assert any("'k1' has no tool_result" in e for e in errors)
    assert any("tool_result 'k1' answers no tool_use" in e for e in errors)


def test_validator_wants_results_before_other_content() -> None:
    body = anthropic_valid()
    last = body["messages"][-1]["content"]
    last.append(last.pop(0))
    assert any("must come before" in e for e in p.validate_anthropic(body))


def test_validator_checks_roles() -> None:
    body = anthropic_valid()
    first = body["messages"].pop(0)
    errors = p.validate_anthropic(body)
    assert any("first message must have the user role" in e for e in errors)
    body["messages"].insert(0, first)
    body["messages"].insert(0, copy.deepcopy(first))
    assert any("two user turns in a row" in e for e in p.validate_anthropic(body))


def test_validator_checks_tool_names() -> None:
    body = anthropic_valid()
    body["tools"][1]["name"] = "web.fetch"
    body["messages"][-2]["content"][1]["name"] = "web.fetch"
    errors = p.validate_anthropic(body)
    assert any(e.startswith("tools[1].name") for e in errors)
    assert any(".name: 'web.fetch' is not a valid tool name" in e for e in errors)
    body["tools"][1]["name"] = "clock_now"
    assert any("duplicate 'clock_now'" in e for e in p.validate_anthropic(body))


def test_openai_validator_pairs_calls_and_outputs() -> None:
    body = openai_valid()
    items = body["input"]
    out = items.pop(9)  # k2's output
    assert any("'k2' has no function_call_output" in e for e in p.validate_openai(body))
    items.insert(1, out)  # now before its call
    errors = p.validate_openai(body)
    assert any("output for 'k2' without an earlier function_call" in e for e in errors)


def test_openai_validator_checks_names_arguments_and_content() -> None:
    body = openai_valid()
    body["tools"][0]["name"] = "clock.now"
    body["input"][1]["arguments"] = "not json"
    body["input"][3]["content"][0]["type"] = "input_text"  # an assistant never sends input
    errors = p.validate_openai(body)
    assert any(e.startswith("tools[0].name") for e in errors)
    assert any("arguments: must be JSON object text" in e for e in errors)
    assert any("'input_text' part is not allowed in a assistant message" in e for e in errors)


def test_render_validates_and_rejects_unknown_formats() -> None:
    r = built(two_runs())
    assert p.render(r, p.ANTHROPIC_MESSAGES) == p.anthropic_messages(r)
    assert p.render(r, p.OPENAI_RESPONSES) == p.openai_responses(r)
    with pytest.raises(InvalidInput):
        p.render(r, "gemini")
    broken = replace(r, model_id="")
    with pytest.raises(AssemblyError, match="model"):
        p.render(broken, p.OPENAI_RESPONSES)


def test_build_pb_returns_the_canonical_body_of_the_asked_or_default_format() -> None:
    r = built(two_runs())
    assert mapping.build_pb(r).provider_body_json == ""  # "": NONE was asked
    default = mapping.build_pb(r, mapping.MODEL_DEFAULT_FORMAT)  # UNSPECIFIED: the model's
    assert default.provider_body_json == mapping.build_pb(r, p.ANTHROPIC_MESSAGES) \
        .provider_body_json
    text = mapping.build_pb(r, p.ANTHROPIC_MESSAGES).provider_body_json
    assert json.loads(text) == p.anthropic_messages(r)
    assert text == json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"),
                              ensure_ascii=False)


# ----------------------------------------------------------------------------- tool schemas

def _sent_schema(body: dict[str, Any], fmt: str) -> Any:
    if fmt == p.ANTHROPIC_MESSAGES:
        return body["tools"][0]["input_schema"]
    if fmt == p.OPENAI_RESPONSES:
        return body["tools"][0]["parameters"]
    if fmt == p.OPENAI_CHAT_COMPLETIONS:
        return body["tools"][0]["function"]["parameters"]
    if fmt == p.GEMINI_GENERATE_CONTENT:
        return body["tools"][0]["functionDeclarations"][0]["parametersJsonSchema"]
    return body["toolConfig"]["tools"][0]["toolSpec"]["inputSchema"]["json"]


@pytest.mark.parametrize(("model_id", "fmt"), [
    ("claude-sonnet-4-5", p.ANTHROPIC_MESSAGES), ("gpt-5", p.OPENAI_RESPONSES),
    ("gpt-5", p.OPENAI_CHAT_COMPLETIONS), ("gemini-2.5-pro", p.GEMINI_GENERATE_CONTENT),
    ("claude-sonnet-4-5", p.BEDROCK_CONVERSE)])
def test_every_body_omits_generated_titles_and_empty_defaults(model_id: str, fmt: str) -> None:
    """Every generated title (a property's or definition's repeating its name, the root's
    class name) and every empty default goes, at any depth; a title a person wrote stays, as do
    properties and definitions named title or default, data holding a title, and 0 / false /
    non-empty defaults. A plan pinned before builder@9 keeps its bodies dropping every title,
    as they were served (``keeps_schema_titles``). The request's own definition keeps the full
    schema (pinned identity, measured by the cap)."""
    catalog = (f.tool("web.search", schema=copy.deepcopy(tool_schemas.GENERATED)),)
    r = built(two_runs(), catalog=catalog, model_id=model_id)
    assert r.keeps_schema_titles
    (definition,) = r.request.tools
    assert json.loads(definition.input_schema_json) == tool_schemas.GENERATED
    assert _sent_schema(p.render(r, fmt), fmt) == tool_schemas.PROVIDER_FORM  # validated
    before = replace(r, keeps_schema_titles=False)
    assert _sent_schema(p.render(before, fmt), fmt) == tool_schemas.ALL_TITLES_DROPPED


def test_provider_schema_leaves_its_input_alone_and_changes_nothing_else() -> None:
    schema = copy.deepcopy(tool_schemas.GENERATED)
    assert p.provider_schema(schema) == tool_schemas.PROVIDER_FORM
    assert p.provider_schema(schema, keep_titles=False) == tool_schemas.ALL_TITLES_DROPPED
    assert schema == tool_schemas.GENERATED  # not mutated
    plain = {"type": "object", "properties": {"q": {"type": "string", "default": "x"}},
             "required": ["q"]}
    assert p.provider_schema(plain) == plain


def test_a_pydantic_schema_reaches_providers_without_titles_or_null_defaults() -> None:
    """An independent oracle: a pydantic model without a field named title generates titles
    everywhere; none of its text may reach a provider, while its validation keywords do."""
    from pydantic import BaseModel, Field

    class Window(BaseModel):
        start: str = Field(pattern=r"^\d{4}-\d{2}-\d{2}$")
        end: str | None = None

    class Args(BaseModel):
        query: str = Field(min_length=1, max_length=200)
        window: Window | None = None
        tags: list[str] = []
        limit: int = Field(default=5, ge=1, le=50)

    generated = Args.model_json_schema()
    assert '"title"' in json.dumps(generated) and '"default": null' in json.dumps(generated)
    sent = p.provider_schema(generated)
    text = json.dumps(sent)
    assert '"title"' not in text and '"default": null' not in text and '"default": []' not in text
    for keyword in ('"pattern"', '"minLength": 1', '"maxLength": 200', '"maximum": 50',
                    '"minimum": 1', '"default": 5', '"$ref"', '"required": ["query"]'):
        assert keyword in text, keyword


@pytest.mark.parametrize(("title", "name", "generated"), [
    ("User Id", "user_id", True),  # pydantic's title of a field
    ("userId", "user_id", True),
    ("USER-ID", "user_id", True),
    ("Größe", "größe", True),  # lower-cased by the service's own tables, not only in ASCII
    ("Recipient e-mail address (never a name)", "to", False),
    ("User", "user_id", False),
    ("Id of the user", "user_id", False),
    ("", "x", False),
    (5, "x", False),  # not text: not a generator's
    ("SearchArgs", None, True),  # the root's: a class name
    ("search_args_2", None, True),
    ("Search arguments", None, False),
    ("Page[int]", None, False),
    ("", None, False),
])
def test_a_title_is_generated_only_when_it_repeats_its_place(title: Any, name: str | None,
                                                             generated: bool) -> None:
    assert p.generated_title(title, name) is generated


def test_titles_are_judged_by_their_place_in_the_schema() -> None:
    """A property's title against its own name, a definition's against its key, the root's
    as a class name; everywhere else (items, alternatives, a map's values, patternProperties)
    a title is a person's and stays. A property named title is a name, never an annotation."""
    schema = {
        "title": "Send", "type": "object",
        "properties": {
            "title": {"title": "Title", "type": "string"},
            "to": {"title": "Recipient e-mail address (never a name)", "type": "string"},
            "when": {"title": "When", "anyOf": [{"title": "When", "type": "string"}]},
            "cc": {"type": "array", "items": {"title": "Cc", "type": "string"}},
        },
        "patternProperties": {"^x-": {"title": "X-", "type": "string"}},
        "definitions": {"Addr": {"title": "Addr", "type": "string"},
                        "Other": {"title": "Addr", "type": "string"}},
    }
    assert p.provider_schema(schema) == {
        "type": "object",
        "properties": {
            "title": {"type": "string"},
            "to": {"title": "Recipient e-mail address (never a name)", "type": "string"},
            "when": {"anyOf": [{"title": "When", "type": "string"}]},
            "cc": {"type": "array", "items": {"title": "Cc", "type": "string"}},
        },
        "patternProperties": {"^x-": {"title": "X-", "type": "string"}},
        "definitions": {"Addr": {"type": "string"},
                        "Other": {"title": "Addr", "type": "string"}},
    }
    # a root title of several words is a person's
    assert p.provider_schema({"title": "Send a mail", "type": "object"}) == {
        "title": "Send a mail", "type": "object"}


def test_provider_schema_survives_the_deepest_schema_the_parser_admits() -> None:
    """Build renders schemas a caller sent: the walk is iterative, so the deepest schema the
    JSON parser admits (found from this very stack) also passes a few frames further down,
    where a recursive walk of one frame per level would run out of stack."""
    from context_engine.domain.canonical import parse_json_object

    def nested(depth: int) -> str:
        return '{"type":"array","title":"t","items":' * depth + '{"title":"leaf"}' + "}" * depth

    low, high = 1, 4_000  # the parser admits ``low`` levels and refuses ``high``
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if parse_json_object(nested(mid)) is not None else (low, mid)
    depth = low
    schema = parse_json_object(nested(depth))
    assert schema is not None and depth > 500

    def deeper(frames: int) -> dict[str, Any]:
        return deeper(frames - 1) if frames else p.provider_schema(schema)

    node = deeper(30)
    for level in range(depth):  # the root's class-name title goes, an item's stays
        assert node.get("title") == (None if level == 0 else "t")
        node = node["items"]
    assert node == {"title": "leaf"}


def _sent_tool_names(body: dict[str, Any], fmt: str) -> list[str]:
    """The tool names a body defines, in its order, read from each provider's own shape."""
    if fmt == "gemini_generate_content":
        return [d["name"] for t in body.get("tools", []) for d in t["functionDeclarations"]]
    if fmt == "bedrock_converse":
        return [t["toolSpec"]["name"] for t in body.get("toolConfig", {}).get("tools", [])
                if "toolSpec" in t]  # a cachePoint entry defines nothing
    if fmt == "openai_chat_completions":
        return [t["function"]["name"] for t in body.get("tools", [])]
    return [t["name"] for t in body.get("tools", [])]


@pytest.mark.parametrize("fmt", sorted(p.RENDERERS))
def test_a_body_defines_the_requests_tools_in_their_order(fmt: str) -> None:
    """What the README tells a runtime to map the model's calls back with: the body's tool
    names paired with the request's, in order. A plan name holding "__" itself comes back as
    it is, which replacing "__" with "." would not give."""
    catalog = (f.tool("web.fetch"), f.tool("mcp__github__search"), f.tool("a_.b"),
               f.tool("clock_now"))
    result = built([f.user("u1", "Hi.", 1)], catalog=catalog, model_id="gpt-5")
    body = p.render(result, fmt)
    sent = _sent_tool_names(body, fmt)
    ours = [t.name for t in result.request.tools]
    assert len(sent) == len(ours) and {"web.fetch", "mcp__github__search", "a_.b"} <= set(ours)
    back = dict(zip(sent, ours, strict=True))
    assert back[sent[ours.index("mcp__github__search")]] == "mcp__github__search"
    if fmt != "gemini_generate_content":
        assert sent[ours.index("web.fetch")] == "web__fetch"
        assert sent[ours.index("a_.b")] == "a___b"


@pytest.mark.parametrize(("model_id", "reasons"), [
    ("codex-mini-latest", True), ("ft:o4-mini-2025-04-16:acme::abc123", True),
    ("ft:gpt-4o-mini-2024-07-18:acme::abc123", False), ("ft:gpt-4.1-2025-04-14:acme::x", False)])
def test_models_the_catalog_does_not_size_are_judged_by_their_base(model_id: str,
                                                                   reasons: bool) -> None:
    """A fine-tuned model reasons as its base does; codex-mini is an o4-mini."""
    assert p.openai_reasons(model_id) is reasons


def test_only_claude_on_bedrock_is_held_to_claudes_schema_rule() -> None:
    from context_engine.domain.provider_common import top_level_refusal

    union = {"type": "object", "anyOf": [{"required": ["a"]}, {"required": ["b"]}]}
    assert top_level_refusal("t", union, "bedrock_converse",
                             "us.anthropic.claude-sonnet-4-5-20250929-v1:0") is not None
    assert top_level_refusal("t", union, "anthropic_messages", "claude-sonnet-4-5") is not None
    # Bedrock serves other models, whose rules are theirs
    assert top_level_refusal("t", union, "bedrock_converse", "amazon.nova-pro-v1:0") is None
    assert top_level_refusal("t", union, "openai_responses", "gpt-5") is None
    assert top_level_refusal("t", {"type": "object"}, "anthropic_messages",
                             "claude-sonnet-4-5") is None
