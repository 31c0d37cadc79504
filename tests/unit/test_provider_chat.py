"""The OpenAI Chat Completions body (``openai_chat_completions``): its shape, where results go,
its validator, and the official ``openai`` SDK sending exactly the body, offline (a mock
``httpx2`` transport; nothing leaves the process)."""

from __future__ import annotations

import copy
import json
from typing import Any

import httpx2
import openai
import pytest
from context_engine.domain import providers as p
from context_engine.domain.items import ConversationItem

from tests import factories as f
from tests.unit.test_interleaved_provider_bodies import interleaved
from tests.unit.test_providers import CATALOG, THINKING, assistant, built, reasoning, two_runs

FMT = p.OPENAI_CHAT_COMPLETIONS


def chat_sent(body: dict[str, Any]) -> Any:
    """``body`` handed to ``chat.completions.create``; what the SDK sent, parsed."""
    requests: list[httpx2.Request] = []

    def handler(request: httpx2.Request) -> httpx2.Response:
        requests.append(request)
        return httpx2.Response(200, json={
            "id": "chatcmpl-1", "object": "chat.completion", "created": 0,
            "model": body["model"], "choices": [{"index": 0, "finish_reason": "stop",
                                                 "message": {"role": "assistant",
                                                             "content": "ok"}}]})

    with httpx2.Client(transport=httpx2.MockTransport(handler)) as http:
        reply = openai.OpenAI(api_key="test-key", http_client=http,
                              max_retries=0).chat.completions.create(**body)
    assert reply.choices[0].message.content == "ok"
    assert len(requests) == 1 and requests[0].url.path == "/v1/chat/completions"
    return json.loads(requests[0].content)


def shape(body: dict[str, Any]) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for m in body["messages"]:
        if m["role"] == "tool":
            out.append(("tool", m["tool_call_id"]))
        elif m.get("tool_calls"):
            out.append(("assistant", [c["id"] for c in m["tool_calls"]]))
        else:
            out.append((m["role"], None))
    return out


def test_chat_body() -> None:
    r = built(two_runs(), model_id="gpt-4o")
    body = p.render(r, FMT)
    assert body["model"] == "gpt-4o"
    assert body["prompt_cache_key"] == r.session_key
    assert body["max_completion_tokens"] == r.output_reserve
    assert set(body) == {"model", "messages", "prompt_cache_key", "max_completion_tokens",
                         "tools"}  # no store, no include: nothing to opt out of or ask back
    system = body["messages"][0]
    assert system == {"role": "system",
                      "content": "\n\n".join(b.text for b in r.request.prefix_blocks)}
    assert shape(body) == [
        ("system", None), ("user", None), ("assistant", ["k0"]), ("tool", "k0"),
        ("assistant", None), ("user", None), ("assistant", ["k1", "k2"]), ("tool", "k1"),
        ("tool", "k2"), ("user", None)]
    assert body["messages"][4] == {"role": "assistant", "content": "It is sunny."}
    assert body["tools"] == [
        {"type": "function", "function": {"name": "clock_now", "description":
                                          "The current time.", "parameters": f.SCHEMA}},
        {"type": "function", "function": {"name": "web__fetch", "description":
                                          "Does web.fetch. More detail here.",
                                          "parameters": f.SCHEMA}}]
    calls = {c.call_id: c for m in r.request.messages for c in m.tool_calls}
    for m in body["messages"]:
        for c in m.get("tool_calls", []):
            assert c["type"] == "function" and c["function"]["name"] == "web__fetch"
            assert c["function"]["arguments"] == calls[c["id"]].arguments_json  # verbatim
        if m["role"] == "tool":
            sent = next(x for x in r.request.messages if x.call_id == m["tool_call_id"])
            assert m["content"] == sent.text  # the enveloped text, as the request has it
    text = json.dumps(body)
    assert THINKING["thinking"] not in text and "encrypted_content" not in text
    assert "cache_control" not in text
    assert p.validate_chat(body) == []
    assert chat_sent(body) == body


def test_a_result_follows_its_calls_message_before_what_arrived_meanwhile() -> None:
    items: list[ConversationItem] = [
        f.user("u1", "Go.", 1), f.call("c1", 2, "k1"),
        f.user("u2", "Also check the other one.", 3),  # arrived while k1 ran
        f.call("c2", 4, "k2"), f.result("r1", 5, "k1", "One."), f.result("r2", 6, "k2", "Two.")]
    body = p.render(built(items), FMT)
    assert shape(body)[1:] == [("user", None), ("assistant", ["k1"]), ("tool", "k1"),
                               ("user", None), ("assistant", ["k2"]), ("tool", "k2"),
                               ("user", None)]
    assert "Also check" in body["messages"][4]["content"]
    assert chat_sent(body) == body


def test_interleaved_calls_pair_with_the_message_that_made_them() -> None:
    body = p.render(f.run_build(f.loaded(), f.checkpoint(interleaved())), FMT)
    assert [s for s in shape(body) if s[0] in ("assistant", "tool")] == [
        ("assistant", ["a", "b"]), ("tool", "b"), ("tool", "a"),  # in the order they arrived
        ("assistant", ["c"]), ("tool", "c"),
        ("assistant", ["d", "e"]), ("tool", "e"), ("tool", "d"),
        ("assistant", None), ("assistant", ["g"]), ("tool", "g"),
        ("assistant", ["h", "i"]), ("tool", "h"), ("tool", "i"),
        ("assistant", ["j"]), ("tool", "j")]
    assert p.validate_chat(body) == []
    assert chat_sent(body) == body


def test_no_reasoning_reaches_chat_completions() -> None:
    items: list[ConversationItem] = [f.user("u1", "Go.", 1),
                                     reasoning("th1", 2, "anthropic", THINKING),
                                     reasoning("rs1", 3, "openai", {"type": "reasoning",
                                                                    "id": "rs_1",
                                                                    "summary": []}),
                                     f.call("c1", 4, "k1"), f.result("r1", 5, "k1", "ok")]
    body = p.render(built(items), FMT)
    assert all(m["role"] != "reasoning" for m in body["messages"])
    assert "rs_1" not in json.dumps(body) and "signature" not in json.dumps(body)


def test_a_history_may_open_with_the_models_turn() -> None:
    body = p.render(built([assistant("a0", "Earlier answer.", 1, run="run-0"),
                           f.user("u1", "Next.", 2)]), FMT)
    assert [m["role"] for m in body["messages"]] == ["system", "assistant", "user", "user"]
    assert p.LEADING_USER_TEXT not in json.dumps(body)  # Chat Completions needs no lead


def test_without_tools_there_is_no_tools_key() -> None:
    body = p.render(built([f.user("u1", "Hi.", 1)], catalog=()), FMT)
    assert "tools" not in body
    assert chat_sent(body) == body


def test_colliding_names_fail_as_for_the_other_openai_body() -> None:
    r = built([f.user("u1", "Hi.", 1)], catalog=(*CATALOG, f.tool("web__fetch")))
    with pytest.raises(p.ProviderFormatError) as err:
        p.render(r, FMT)
    assert err.value.provider_format == FMT


@pytest.mark.parametrize(("fmt", "limit"), [(FMT, 40), (p.OPENAI_RESPONSES, 64)])
def test_a_call_id_longer_than_openai_takes_fails_the_render(fmt: str, limit: int) -> None:
    def items(call_id: str) -> list[ConversationItem]:
        return [f.user("u1", "Go.", 1), f.call("c1", 2, call_id),
                f.result("r1", 3, call_id, "ok")]
    at_limit = "c" * limit
    body = p.render(built(items(at_limit), model_id="gpt-4o"), fmt)
    assert at_limit in json.dumps(body)
    with pytest.raises(p.ProviderFormatError, match=f"at most {limit} characters") as err:
        p.render(built(items(at_limit + "x"), model_id="gpt-4o"), fmt)
    assert err.value.metadata()["provider_format"] == fmt


# ----------------------------------------------------------------------------- validator

def valid() -> dict[str, Any]:
    body = p.render(built(two_runs(), model_id="gpt-4o"), FMT)
    assert p.validate_chat(body) == []
    return copy.deepcopy(body)


def test_validator_wants_each_call_answered_right_after_its_message() -> None:
    body = valid()
    moved = body["messages"].pop(3)  # k0's tool message
    body["messages"].insert(5, moved)  # after the next assistant and user messages
    errors = p.validate_chat(body)
    assert any("'k0' has no tool message right after it" in e for e in errors)
    assert any("tool message for 'k0' does not answer" in e for e in errors)


def test_validator_catches_an_unanswered_call_and_a_stray_result() -> None:
    body = valid()
    del body["messages"][8]  # k2's tool message
    assert any("'k2' has no tool message" in e for e in p.validate_chat(body))
    body = valid()
    body["messages"][3]["tool_call_id"] = "nope"
    errors = p.validate_chat(body)
    assert any("'nope' does not answer" in e for e in errors)


def test_validator_checks_ids_names_arguments_and_roles() -> None:
    body = valid()
    body["messages"][6]["tool_calls"][1]["id"] = "k1"
    body["messages"][6]["tool_calls"][0]["function"]["name"] = "web.fetch"
    body["messages"][6]["tool_calls"][0]["function"]["arguments"] = "not json"
    body["messages"][1]["role"] = "human"
    body["tools"][0]["function"]["name"] = "web__fetch"
    errors = p.validate_chat(body)
    assert any("'k1' called twice" in e for e in errors)
    assert any("'web.fetch' is not a valid tool name" in e for e in errors)
    assert any("arguments: must be JSON object text" in e for e in errors)
    assert any(e.startswith("messages[1]: must be an object with role") for e in errors)
    assert any("duplicate 'web__fetch'" in e for e in errors)
    assert p.validate(body, FMT) == errors
