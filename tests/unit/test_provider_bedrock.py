"""The Amazon Bedrock Converse body (``bedrock_converse``): its shape, the cache points at the
plan's breakpoints within Bedrock's limits, what cannot be rendered, the validator, and
botocore taking the body: ``validate_parameters`` against the ``bedrock-runtime`` Converse
operation model, then ``converse(**body)`` on a client with fake credentials whose
``before-send`` hook answers (botocore serializes and signs locally; nothing is sent)."""

from __future__ import annotations

import copy
import json
import urllib.parse
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import botocore.session
import pytest
from botocore.awsrequest import AWSResponse
from botocore.validate import validate_parameters
from context_engine.api import mapping
from context_engine.domain import providers as p
from context_engine.domain.breakpoints import CacheBreakpoint
from context_engine.domain.items import ConversationItem
from context_engine.domain.model import SessionKind
from context_engine.v1 import context_engine_pb2 as pb

from tests import factories as f
from tests.unit.test_interleaved_provider_bodies import interleaved
from tests.unit.test_providers import (
    OPENAI_REASONING,
    THINKING,
    assistant,
    built,
    reasoning,
    two_runs,
    user_between_calls,
)

FMT = p.BEDROCK_CONVERSE
MODEL = "us.anthropic.claude-sonnet-4-5-20250929-v1:0"
REASONING = {"reasoningContent": {"reasoningText": {"text": "Both are needed.",
                                                    "signature": "c2ln"}}}


class _Raw:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def stream(self, **_: Any) -> Iterator[bytes]:
        yield self.data

    def read(self) -> bytes:
        return self.data


def botocore_sent(body: dict[str, Any]) -> Any:
    """``body`` validated against the Converse input shape and sent by ``client.converse``;
    the JSON botocore serialized (``modelId`` goes into the URL)."""
    session = botocore.session.get_session()
    operation = session.get_service_model("bedrock-runtime").operation_model("Converse")
    validate_parameters(body, operation.input_shape)  # raises ParamValidationError
    client = session.create_client("bedrock-runtime", region_name="us-east-1",
                                   aws_access_key_id="AKIDEXAMPLE",
                                   aws_secret_access_key="not-a-secret")
    sent: list[Any] = []
    reply = json.dumps({"output": {"message": {"role": "assistant", "content": [{"text": "ok"}]}},
                        "stopReason": "end_turn", "metrics": {"latencyMs": 1},
                        "usage": {"inputTokens": 1, "outputTokens": 1,
                                  "totalTokens": 2}}).encode()

    def answer(request: Any, **_: Any) -> AWSResponse:
        sent.append(request)
        return AWSResponse(request.url, 200, {"content-type": "application/json"}, _Raw(reply))

    client.meta.events.register("before-send.bedrock-runtime.Converse", answer)
    try:
        out = client.converse(**body)
    finally:
        client.close()
    assert out["output"]["message"]["content"] == [{"text": "ok"}]
    assert len(sent) == 1
    path = urllib.parse.unquote(urllib.parse.urlsplit(sent[0].url).path)
    assert path == f"/model/{body['modelId']}/converse"
    return json.loads(sent[0].body)


def without_model(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != "modelId"}


def points(body: dict[str, Any]) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(where, the cachePoint, the block it follows) for every cache point, in request order."""
    out = []
    tools = body.get("toolConfig", {}).get("tools", [])
    out += [(f"tools[{i}]", b["cachePoint"], tools[i - 1]) for i, b in enumerate(tools)
            if "cachePoint" in b]
    out += [(f"system[{i}]", b["cachePoint"], body["system"][i - 1])
            for i, b in enumerate(body["system"]) if "cachePoint" in b]
    for i, m in enumerate(body["messages"]):
        out += [(f"messages[{i}].content[{j}]", b["cachePoint"], m["content"][j - 1])
                for j, b in enumerate(m["content"]) if "cachePoint" in b]
    return out


def shape(body: dict[str, Any]) -> list[tuple[str, list[str]]]:
    def kind(b: dict[str, Any]) -> str:
        if "toolUse" in b:
            return "use:" + b["toolUse"]["toolUseId"]
        if "toolResult" in b:
            return "result:" + b["toolResult"]["toolUseId"]
        return next(iter(b))
    return [(m["role"], [kind(b) for b in m["content"]]) for m in body["messages"]]


# ----------------------------------------------------------------------------- the body

def test_bedrock_body() -> None:
    r = built(two_runs(), model_id=MODEL)
    body = p.render(r, FMT)
    assert body["modelId"] == MODEL
    assert body["inferenceConfig"] == {"maxTokens": r.output_reserve}
    texts = [b["text"] for b in body["system"] if "text" in b]
    assert texts == [b.text for b in r.request.prefix_blocks]
    specs = [t["toolSpec"] for t in body["toolConfig"]["tools"] if "toolSpec" in t]
    assert specs == [
        {"name": "clock_now", "description": "The current time.",
         "inputSchema": {"json": f.SCHEMA}},
        {"name": "web__fetch", "description": "Does web.fetch. More detail here.",
         "inputSchema": {"json": f.SCHEMA}}]
    assert shape(body) == [
        ("user", ["text"]), ("assistant", ["use:k0"]), ("user", ["result:k0"]),
        ("assistant", ["text", "cachePoint"]), ("user", ["text", "cachePoint"]),
        ("assistant", ["use:k1", "use:k2"]),
        ("user", ["result:k1", "result:k2", "text"])]
    use = body["messages"][5]["content"][0]["toolUse"]
    assert use == {"toolUseId": "k1", "name": "web__fetch", "input": {"q": "k1"}}
    result = body["messages"][6]["content"][0]["toolResult"]
    sent = next(m.text for m in r.request.messages if m.call_id == "k1")
    assert result == {"toolUseId": "k1", "content": [{"text": sent}]}  # no status: unknown
    text = json.dumps(body)
    assert THINKING["thinking"] not in text and "encrypted_content" not in text
    assert p.validate_bedrock(body) == []
    assert botocore_sent(body) == without_model(body)


def test_cache_points_sit_where_the_anthropic_body_puts_cache_control() -> None:
    """The same plan breakpoints: after the last tool and the last system block with the plan's
    hour, after the carried history and the run's last completed block with the default."""
    r = built(two_runs(), model_id=MODEL, kind=SessionKind.SCHEDULED, budget=4)
    body = p.render(r, FMT, long_ttl=True)  # Sonnet 4.5 takes the hour
    found = points(body)
    assert [(w, cp) for w, cp, _ in found] == [
        ("tools[2]", {"type": "default", "ttl": "1h"}),
        (f"system[{len(body['system']) - 1}]", {"type": "default", "ttl": "1h"}),
        ("messages[3].content[1]", {"type": "default"}),  # a0: the carried history
        ("messages[4].content[1]", {"type": "default"})]  # u1: the run, before reasoning
    assert found[0][2]["toolSpec"]["name"] == "web__fetch"
    assert found[2][2] == {"text": "It is sunny."}
    anthropic = p.render(r, p.ANTHROPIC_MESSAGES)
    marked = [b for m in anthropic["messages"] for b in m["content"] if "cache_control" in b]
    assert [b["text"] for b in marked] == [found[2][2]["text"], found[3][2]["text"]]
    assert p.validate_bedrock(body) == []
    assert botocore_sent(body) == without_model(body)


@pytest.mark.parametrize(("items", "through"), [
    (user_between_calls(), ["k2"]),
    # the same layout carried, then a new run: the carried marker, then the run's
    ([*user_between_calls("run-0"), f.user("u3", "Next.", 7), assistant("a3", "On it.", 8)],
     ["k2", "On it."]),
])
def test_a_history_point_follows_the_conversation_as_the_body_lays_it_out(
        items: list[ConversationItem], through: list[str]) -> None:
    """u2 arrived while k1 ran and k2 was answered before k1: r1 opens the turn after k1's, so
    the conversation through r1 ends at the k2 result, where the point goes (not after r1)."""
    body = p.render(built(items, model_id=MODEL), FMT)
    history = [b for w, _, b in points(body) if w.startswith("messages")]
    assert [b["toolResult"]["toolUseId"] if "toolResult" in b else b["text"]
            for b in history] == through
    assert shape(body)[2:4] == [("user", ["result:k1", "text"]), ("assistant", ["use:k2"])]
    assert shape(body)[4][1][:3] == ["result:k2", "cachePoint", "text"]
    assert p.validate_bedrock(body) == []
    assert botocore_sent(body) == without_model(body)


@pytest.mark.parametrize(("budget", "count"), [(3, 3), (2, 2), (1, 1), (0, 0)])
def test_smaller_budgets_drop_the_run_marker_first(budget: int, count: int) -> None:
    r = built(two_runs(), model_id=MODEL, budget=budget)
    body = p.render(r, FMT)
    assert len(points(body)) == count
    assert all("ttl" not in cp for _, cp, _ in points(body))  # an interactive plan: 5 minutes
    assert p.validate_bedrock(body) == []


def test_at_most_four_points_never_after_reasoning_and_never_longer_after_shorter() -> None:
    items = [*two_runs()]
    items.insert(5, reasoning("br1", 6, "bedrock", REASONING))
    r = built(items, model_id=MODEL, kind=SessionKind.SCHEDULED)
    extra = (*r.cache_breakpoints,
             CacheBreakpoint(name="extra", ttl="5m", through_item="r2"),
             CacheBreakpoint(name="run", ttl="1h", through_item="br1"))
    body = p.render(replace(r, cache_breakpoints=extra), FMT, long_ttl=True)
    found = points(body)
    assert len(found) == 4
    assert [cp.get("ttl", "5m") for _, cp, _ in found] == ["1h", "1h", "5m", "5m"]
    assert all("reasoningContent" not in before for _, _, before in found)
    assert p.validate_bedrock(body) == []
    assert botocore_sent(body) == without_model(body)


# ----------------------------------------------------------------------------- by model
# Bedrock's prompt caching, from AWS's "Prompt caching for faster model inference" page: which
# Claude models take a cachePoint (Bedrock refuses one on another: "You invoked an unsupported
# model, or your request did not allow prompt caching"; Claude 3.5 Sonnet v2 only for preview
# customers, so none), and which take ``ttl: "1h"`` (AWS, January 2026: Sonnet 4.5, Haiku 4.5,
# Opus 4.5 and later; an older model answers 400 "Extra inputs are not permitted").
CACHES_NOT = ("anthropic.claude-3-haiku-20240307-v1:0", "anthropic.claude-3-sonnet-20240229-v1:0",
              "anthropic.claude-3-opus-20240229-v1:0",
              "anthropic.claude-3-5-sonnet-20240620-v1:0",
              "anthropic.claude-3-5-sonnet-20241022-v2:0")
FIVE_MINUTES_ONLY = ("anthropic.claude-3-7-sonnet-20250219-v1:0",
                     "anthropic.claude-3-5-haiku-20241022-v1:0",
                     "anthropic.claude-sonnet-4-20250514-v1:0",
                     "anthropic.claude-opus-4-20250514-v1:0",
                     "anthropic.claude-opus-4-1-20250805-v1:0")
ONE_HOUR = ("anthropic.claude-sonnet-4-5-20250929-v1:0", "anthropic.claude-haiku-4-5-20251001-v1:0",
            "anthropic.claude-opus-4-5-20251101-v1:0", "anthropic.claude-opus-4-6-v1",
            "anthropic.claude-sonnet-4-6")
PROFILES = ("", "us.", "eu.", "apac.", "global.")


def build_body(model_id: str, kind: SessionKind) -> dict[str, Any]:
    """The body Build answers for ``model_id`` in its default format: sized by the packaged
    catalog at Plan, rendered with the catalog's entry at Build."""
    r = built(two_runs(), model_id=model_id, kind=kind)
    out = mapping.build_pb(r, mapping.MODEL_DEFAULT_FORMAT)
    assert out.provider_format == pb.PROVIDER_FORMAT_BEDROCK_CONVERSE
    body: dict[str, Any] = json.loads(out.provider_body_json)
    assert p.validate_bedrock(body) == []
    return body


@pytest.mark.parametrize("model_id", [r + m for m in CACHES_NOT for r in PROFILES])
def test_a_model_bedrock_caches_not_gets_no_cache_point(model_id: str) -> None:
    for kind in (SessionKind.INTERACTIVE, SessionKind.SCHEDULED):
        assert points(build_body(model_id, kind)) == []


@pytest.mark.parametrize("model_id", [r + m for m in FIVE_MINUTES_ONLY for r in PROFILES])
def test_a_model_without_the_hour_gets_the_default_ttl_when_the_plan_asks_one(
        model_id: str) -> None:
    body = build_body(model_id, SessionKind.SCHEDULED)
    assert len(points(body)) == 4
    assert all(cp == {"type": "default"} for _, cp, _ in points(body))
    assert botocore_sent(body) == without_model(body)


@pytest.mark.parametrize("model_id", [r + m for m in ONE_HOUR for r in PROFILES])
def test_a_model_that_takes_the_hour_gets_it(model_id: str) -> None:
    found = points(build_body(model_id, SessionKind.SCHEDULED))
    assert [cp.get("ttl", "5m") for _, cp, _ in found] == ["1h", "1h", "5m", "5m"]
    interactive = points(build_body(model_id, SessionKind.INTERACTIVE))
    assert len(interactive) == 4 and all("ttl" not in cp for _, cp, _ in interactive)


def test_bedrock_reasoning_is_replayed_verbatim_and_other_providers_are_omitted() -> None:
    items: list[ConversationItem] = [
        f.user("u1", "Compare two pages.", 1),
        reasoning("th1", 2, "anthropic", THINKING),
        reasoning("br1", 3, "bedrock", REASONING),
        reasoning("rs1", 4, "openai", OPENAI_REASONING),
        f.call("c1", 5, "k1", "k2"), f.result("r1", 6, "k1", "One."),
        f.result("r2", 7, "k2", "Two.")]
    body = p.render(built(items, model_id=MODEL), FMT)
    turn = body["messages"][1]["content"]
    assert turn[0] == REASONING and [next(iter(b)) for b in turn[1:]] == ["toolUse", "toolUse"]
    text = json.dumps(body)
    assert THINKING["thinking"] not in text and "encrypted_content" not in text
    assert botocore_sent(body) == without_model(body)


@pytest.mark.parametrize("payload", [
    b"not json", json.dumps({"type": "thinking"}).encode(),
    json.dumps({"reasoningContent": {}, "toolUse": {}}).encode(),
    json.dumps({"reasoningContent": {"thinking": "x"}}).encode(),
    json.dumps({"reasoningContent": {"redactedContent": "not base64!"}}).encode(),
])
def test_an_unreplayable_reasoning_payload_is_a_clear_error(payload: bytes) -> None:
    items: list[ConversationItem] = [f.user("u1", "Go.", 1), reasoning("br1", 2, "bedrock",
                                                                        payload),
                                     f.call("c1", 3, "k1"), f.result("r1", 4, "k1", "ok")]
    with pytest.raises(p.ProviderFormatError) as err:
        p.render(built(items, model_id=MODEL), FMT)
    assert "'br1'" in str(err.value) and "reasoningContent" in str(err.value)


def test_redacted_reasoning_goes_back_as_base64_text() -> None:
    """JSON has no bytes: the blob stays the base64 text the payload holds (botocore would
    encode a str once more, so a boto3 caller decodes it first)."""
    redacted = {"reasoningContent": {"redactedContent": "cmVkYWN0ZWQ="}}
    items: list[ConversationItem] = [f.user("u1", "Go.", 1),
                                     reasoning("br1", 2, "bedrock", redacted),
                                     f.call("c1", 3, "k1"), f.result("r1", 4, "k1", "ok")]
    body = p.render(built(items, model_id=MODEL), FMT)
    assert body["messages"][1]["content"][0] == redacted
    decoded = copy.deepcopy(body)
    decoded["messages"][1]["content"][0]["reasoningContent"]["redactedContent"] = b"redacted"
    assert botocore_sent(decoded) == without_model(body)


def test_results_open_the_user_turn_after_their_calls_turn() -> None:
    body = p.render(f.run_build(f.loaded(f.inputs(catalog=(f.tool("web.fetch"),),
                                                  enabled=("web.fetch",))),
                                f.checkpoint(interleaved())), FMT)
    assert shape(body) == [
        ("user", ["text"]),
        ("assistant", ["use:a", "use:b", "use:c"]),
        # ra closes the carried history, u1 the run's repeated prefix (reasoning follows)
        ("user", ["result:b", "result:c", "result:a", "cachePoint", "text", "cachePoint"]),
        ("assistant", ["use:d", "use:e", "text", "use:g"]),
        ("user", ["result:e", "result:g", "result:d"]),
        ("assistant", ["use:h", "use:i"]),
        ("user", ["result:h", "result:i"]),
        ("assistant", ["use:j"]),
        ("user", ["result:j", "text"])]
    assert p.validate_bedrock(body) == []
    assert botocore_sent(body) == without_model(body)


def test_a_history_that_opens_with_the_models_turn_gets_the_leading_user_line() -> None:
    body = p.render(built([assistant("a0", "Earlier answer.", 1, run="run-0"),
                           f.user("u1", "Next.", 2)], model_id=MODEL), FMT)
    assert body["messages"][0] == {"role": "user", "content": [{"text": p.LEADING_USER_TEXT}]}
    assert p.validate_bedrock(body) == []


# ----------------------------------------------------------------------------- refusals

def test_calls_without_tool_definitions_cannot_be_rendered() -> None:
    """Bedrock refuses toolUse and toolResult blocks in a request without a toolConfig."""
    r = built([f.user("u1", "Go.", 1), f.call("c1", 2, "k1"), f.result("r1", 3, "k1", "ok")],
              catalog=(), model_id=MODEL)
    with pytest.raises(p.ProviderFormatError, match="defines tools") as err:
        p.render(r, FMT)
    assert err.value.provider_format == FMT
    body = p.render(built([f.user("u1", "Hi.", 1)], catalog=(), model_id=MODEL), FMT)
    assert "toolConfig" not in body and botocore_sent(body) == without_model(body)


def test_a_call_id_bedrock_does_not_take_cannot_be_rendered() -> None:
    r = built([f.user("u1", "Go.", 1), f.call("c1", 2, "call 1/x"),
               f.result("r1", 3, "call 1/x", "ok")], model_id=MODEL)
    with pytest.raises(p.ProviderFormatError, match="toolUseId") as err:
        p.render(r, FMT)
    assert "'call 1/x'" in str(err.value)


# ----------------------------------------------------------------------------- validator

def valid() -> dict[str, Any]:
    body = p.render(built(two_runs(), model_id=MODEL, kind=SessionKind.SCHEDULED), FMT)
    assert p.validate_bedrock(body) == []
    return copy.deepcopy(body)


def test_validator_counts_and_places_cache_points() -> None:
    body = valid()
    body["messages"][0]["content"].append({"cachePoint": {"type": "default"}})
    assert any("5 cachePoint blocks; at most 4" in e for e in p.validate_bedrock(body))
    body = valid()
    body["messages"][4]["content"][1]["cachePoint"]["ttl"] = "1h"
    assert any("longer TTLs must come first" in e for e in p.validate_bedrock(body))
    body = valid()
    body["messages"][5]["content"].insert(0, {"cachePoint": {"type": "default"}})
    assert any("must follow a cacheable block" in e for e in p.validate_bedrock(body))


def test_validator_checks_pairs_roles_and_tool_config() -> None:
    body = valid()
    del body["messages"][-1]["content"][1]  # k2's result
    assert any("'k2' has no result" in e for e in p.validate_bedrock(body))
    body = valid()
    last = body["messages"][-1]["content"]
    last.append(last.pop(0))
    assert any("toolResult blocks must come before" in e for e in p.validate_bedrock(body))
    body = valid()
    body["messages"].insert(0, copy.deepcopy(body["messages"][0]))
    assert any("two user turns in a row" in e for e in p.validate_bedrock(body))
    body = valid()
    del body["toolConfig"]
    assert any("toolConfig: must be defined" in e for e in p.validate_bedrock(body))
    body = valid()
    body["toolConfig"]["tools"][1]["toolSpec"]["name"] = "web.fetch"
    body["messages"][0]["content"][0]["text"] = " "
    errors = p.validate_bedrock(body)
    assert any("'web.fetch' is not 1-64 characters" in e for e in errors)
    assert any("must not be blank" in e for e in errors)
    assert p.validate(body, FMT) == errors
