"""The Gemini generateContent body (``gemini_generate_content``) and its explicit cached
content: the shape, pairing and order of calls and responses, names, schemas, thought
signatures, the validator, the estimate covering Gemini's framing, and google-genai reading
the body into its own types and sending the same REST JSON, offline (an injected ``httpx2``
client on a mock transport; nothing leaves the process)."""

from __future__ import annotations

import copy
import hashlib
import json
import re
from dataclasses import replace
from typing import Any

import httpx2
import pytest
from context_engine.domain import providers as p
from context_engine.domain.items import ConversationItem, HistorySummary
from context_engine.domain.model import SessionKind
from context_engine.domain.provider_gemini import (
    DEFAULT_MIN_CACHEABLE_TOKENS,
    gemini_tool_name,
)
from context_engine.domain.request import Message, Role
from context_engine.domain.trust import TrustLevel
from google import genai
from google.genai import types as gt

from tests import factories as f
from tests.support import tool_schemas
from tests.unit.test_interleaved_provider_bodies import interleaved
from tests.unit.test_providers import (
    CATALOG,
    OPENAI_REASONING,
    THINKING,
    assistant,
    built,
    reasoning,
    two_runs,
)

FMT = p.GEMINI_GENERATE_CONTENT
MODEL = "gemini-2.5-pro"


def rest(value: Any) -> Any:
    """Field names in camelCase (the REST API takes both; google-genai sends
    ``parameters_json_schema`` as it is): how the SDK's JSON and ours compare. The schemas,
    arguments and responses are the caller's JSON and stay as they are."""
    if isinstance(value, list):
        return [rest(v) for v in value]
    if not isinstance(value, dict):
        return value
    out: dict[str, Any] = {}
    for key, inner in value.items():
        camel = re.sub(r"_([a-z])", lambda m: m.group(1).upper(), key)
        free = camel in ("args", "response", "parametersJsonSchema")
        out[camel] = inner if free else rest(inner)
    return out


class Capture:
    def __init__(self, reply: dict[str, Any]) -> None:
        self.reply = reply
        self.requests: list[httpx2.Request] = []

    def __call__(self, request: httpx2.Request) -> httpx2.Response:
        self.requests.append(request)
        return httpx2.Response(200, json=self.reply)


def genai_sent(body: dict[str, Any], model: str = MODEL) -> Any:
    """The body read into google-genai's types (unknown fields are refused) and sent by
    ``models.generate_content``; what the SDK sent, parsed."""
    contents = [gt.Content.model_validate_json(json.dumps(c)) for c in body["contents"]]
    config = dict(body.get("generationConfig", {}))
    config.update({k: body[k] for k in ("systemInstruction", "tools", "toolConfig",
                                        "cachedContent") if k in body})
    capture = Capture({"candidates": [{"content": {"role": "model", "parts": [{"text": "ok"}]},
                                       "finishReason": "STOP"}]})
    with httpx2.Client(transport=httpx2.MockTransport(capture)) as http:
        client = genai.Client(api_key="test-key", http_options=gt.HttpOptions(httpx_client=http))
        reply = client.models.generate_content(
            model=model, contents=contents,
            config=gt.GenerateContentConfig.model_validate_json(json.dumps(config)))
    assert reply.text == "ok"
    assert len(capture.requests) == 1
    assert capture.requests[0].url.path.endswith(f"/models/{model}:generateContent")
    return json.loads(capture.requests[0].content)


def genai_cache_sent(create: dict[str, Any]) -> Any:
    """``caches.create`` with the create body read as ``CreateCachedContentConfig``."""
    config = gt.CreateCachedContentConfig.model_validate_json(json.dumps(
        {k: v for k, v in create.items() if k != "model"}))
    capture = Capture({"name": "cachedContents/c1", "model": create["model"]})
    with httpx2.Client(transport=httpx2.MockTransport(capture)) as http:
        client = genai.Client(api_key="test-key", http_options=gt.HttpOptions(httpx_client=http))
        created = client.caches.create(model=create["model"], config=config)
    assert created.name == "cachedContents/c1"
    assert capture.requests[0].url.path.endswith("/cachedContents")
    return json.loads(capture.requests[0].content)


def parts(body: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [part[kind] for c in body["contents"] for part in c["parts"] if kind in part]


def shape(body: dict[str, Any]) -> list[tuple[str, list[str]]]:
    out = []
    for c in body["contents"]:
        kinds = []
        for part in c["parts"]:
            if "functionCall" in part:
                kinds.append("call:" + part["functionCall"]["id"])
            elif "functionResponse" in part:
                kinds.append("response:" + part["functionResponse"]["id"])
            else:
                kinds.append("text")
        out.append((c["role"], kinds))
    return out


# ----------------------------------------------------------------------------- the body

def test_gemini_body() -> None:
    r = built(two_runs(), model_id=MODEL)
    body = p.render(r, FMT)
    assert set(body) == {"systemInstruction", "tools", "contents", "generationConfig"}
    assert "model" not in body  # the model is the URL's
    assert body["systemInstruction"] == {"parts": [
        {"text": "\n\n".join(b.text for b in r.request.prefix_blocks)}]}
    assert body["generationConfig"] == {"maxOutputTokens": r.output_reserve}
    assert body["tools"] == [{"functionDeclarations": [
        {"name": "clock_now", "description": "The current time.",
         "parametersJsonSchema": f.SCHEMA},
        {"name": "web.fetch", "description": "Does web.fetch. More detail here.",
         "parametersJsonSchema": f.SCHEMA}]}]  # Gemini takes dots: no "__"
    assert shape(body) == [
        ("user", ["text"]), ("model", ["call:k0"]), ("user", ["response:k0"]),
        ("model", ["text"]), ("user", ["text"]), ("model", ["call:k1", "call:k2"]),
        ("user", ["response:k1", "response:k2", "text"])]
    calls = parts(body, "functionCall")
    assert calls[1] == {"id": "k1", "name": "web.fetch", "args": {"q": "k1"}}
    responses = parts(body, "functionResponse")
    sent = {m.call_id: m.text for m in r.request.messages if m.call_id}
    for response in responses:
        assert response["name"] == "web.fetch"
        assert response["response"] == {"output": sent[response["id"]]}  # as the request has it
    text = json.dumps(body)
    assert THINKING["thinking"] not in text and "encrypted_content" not in text
    assert p.validate_gemini(body) == []
    assert rest(genai_sent(body)) == body


def test_responses_go_in_the_order_of_their_calls() -> None:
    body = p.render(f.run_build(f.loaded(), f.checkpoint(interleaved())), FMT)
    assert shape(body) == [
        ("user", ["text"]),
        ("model", ["call:a", "call:b", "call:c"]),
        ("user", ["response:a", "response:b", "response:c", "text"]),  # arrived b, c, a
        ("model", ["call:d", "call:e", "text", "call:g"]),
        ("user", ["response:d", "response:e", "response:g"]),  # arrived e, g, d
        ("model", ["call:h", "call:i"]),
        ("user", ["response:h", "response:i"]),
        ("model", ["call:j"]),
        ("user", ["response:j", "text"])]
    assert p.validate_gemini(body) == []
    assert rest(genai_sent(body)) == body


def test_a_history_that_opens_with_the_models_turn_gets_the_leading_user_line() -> None:
    body = p.render(built([assistant("a0", "Earlier answer.", 1, run="run-0"),
                           f.user("u1", "Next.", 2)]), FMT)
    assert body["contents"][0] == {"role": "user", "parts": [{"text": p.LEADING_USER_TEXT}]}
    assert [c["role"] for c in body["contents"]] == ["user", "model", "user"]
    assert p.validate_gemini(body) == []


def test_a_summary_and_pointers_render_as_text_and_responses() -> None:
    pointer = replace(f.result("r1", 3, "k1", "x" * 5000), elided=True,
                      artifact_ref="artifact://results/r1")
    r = built([f.user("u0", "Old.", 1, run="run-0"), f.user("u1", "Fetch.", 2),
               f.call("c1", 3, "k1"), pointer],
              summary=HistorySummary(text="We talked.", replaced_through_sequence=1))
    body = p.render(r, FMT)
    assert body["contents"][0]["parts"][0]["text"].startswith("Summary of the earlier")
    (response,) = parts(body, "functionResponse")
    assert "[elided] tool.result r1" in response["response"]["output"]
    assert p.validate_gemini(body) == []


# ----------------------------------------------------------------------------- names, schemas

def test_names_go_as_they_are_unless_gemini_needs_a_leading_underscore() -> None:
    assert gemini_tool_name("web.fetch") == "web.fetch"
    assert gemini_tool_name("_x") == "_x"
    assert gemini_tool_name("3d.render") == "_3d.render"
    assert gemini_tool_name("-x") == "_-x"
    r = built([f.user("u1", "Hi.", 1), f.call("c1", 2, "k1", name="3d.render"),
               f.result("r1", 3, "k1", "ok", name="3d.render")],
              catalog=(f.tool("3d.render"),))
    body = p.render(r, FMT)
    assert [d["name"] for d in body["tools"][0]["functionDeclarations"]] == ["_3d.render"]
    assert parts(body, "functionCall")[0]["name"] == "_3d.render"
    assert parts(body, "functionResponse")[0]["name"] == "_3d.render"


def test_names_that_collide_or_grow_too_long_fail_the_render() -> None:
    r = built([f.user("u1", "Hi.", 1)], catalog=(f.tool("3d"), f.tool("_3d")))
    with pytest.raises(p.ProviderFormatError) as err:
        p.render(r, FMT)
    assert "'3d', '_3d'" in str(err.value) and err.value.provider_format == FMT
    r = built([f.user("u1", "Hi.", 1)], catalog=(f.tool("9" * 64),))
    with pytest.raises(p.ProviderFormatError, match="a letter or an underscore"):
        p.render(r, FMT)


def test_schemas_keep_every_json_schema_keyword() -> None:
    """``parametersJsonSchema`` takes JSON Schema: nothing is translated or dropped beyond what
    every provider body drops (generated titles, empty defaults)."""
    schema = {"type": "object", "$defs": {"Pt": {"type": "object", "title": "Pt",
                                                 "properties": {"x": {"type": "number"}},
                                                 "additionalProperties": False}},
              "properties": {"at": {"$ref": "#/$defs/Pt"},
                             "kind": {"anyOf": [{"const": "a"}, {"type": "null"}],
                                      "default": None}},
              "additionalProperties": False, "required": ["at"]}
    for s in (schema, copy.deepcopy(tool_schemas.GENERATED)):
        r = built([f.user("u1", "Hi.", 1)], catalog=(f.tool("web.search", schema=s),))
        body = p.render(r, FMT)
        (declaration,) = body["tools"][0]["functionDeclarations"]
        assert declaration["parametersJsonSchema"] == p.provider_schema(s)
        assert "parameters" not in declaration
        assert rest(genai_sent(body)) == body
    sent = json.dumps(p.render(built([f.user("u1", "Hi.", 1)], catalog=(
        f.tool("web.search", schema=schema),)), FMT))
    for keyword in ('"$ref"', '"$defs"', '"additionalProperties": false', '"anyOf"',
                    '"const"'):
        assert keyword in sent, keyword


# ----------------------------------------------------------------------------- reasoning

SIGNATURE = "Q2lnbmF0dXJlIG9mIHRoZSB0aG91Z2h0"


def test_a_thought_signature_goes_back_on_the_part_it_came_with() -> None:
    items: list[ConversationItem] = [
        f.user("u1", "Compare two pages.", 1),
        reasoning("th1", 2, "anthropic", THINKING),
        reasoning("sg1", 3, "google", {"thoughtSignature": SIGNATURE}),
        reasoning("rs1", 4, "openai", OPENAI_REASONING),
        f.call("c1", 5, "k1", "k2"),
        f.result("r1", 6, "k1", "One."), f.result("r2", 7, "k2", "Two.")]
    body = p.render(built(items, model_id="gemini-3-pro-preview"), FMT)
    model_turn = body["contents"][1]
    assert model_turn["role"] == "model"
    assert model_turn["parts"][0] == {"functionCall": {"id": "k1", "name": "web.fetch",
                                                       "args": {"q": "k1"}},
                                      "thoughtSignature": SIGNATURE}
    assert "thoughtSignature" not in model_turn["parts"][1]  # only the first part of the step
    text = json.dumps(body)
    assert THINKING["thinking"] not in text and "encrypted_content" not in text
    assert p.validate_gemini(body) == []
    assert rest(genai_sent(body, "gemini-3-pro-preview")) == body


@pytest.mark.parametrize("payload", [
    b"\xff not json", b'"a string"', json.dumps({"thoughtSignature": ""}).encode(),
    json.dumps({"thoughtSignature": "not base64 at all!"}).encode(),
    json.dumps({"thoughtSignature": SIGNATURE, "functionCall": {"name": "x"}}).encode(),
])
def test_an_unreplayable_thought_signature_is_a_clear_error(payload: bytes) -> None:
    items: list[ConversationItem] = [f.user("u1", "Go.", 1), reasoning("sg1", 2, "google",
                                                                        payload),
                                     f.call("c1", 3, "k1"), f.result("r1", 4, "k1", "ok")]
    with pytest.raises(p.ProviderFormatError) as err:
        p.render(built(items), FMT)
    assert "'sg1'" in str(err.value) and "thoughtSignature" in str(err.value)
    assert err.value.metadata()["provider_format"] == FMT


# ----------------------------------------------------------------------------- cached content

def display_name(session_key: str, prefix_sha256: str, epoch: int) -> str:
    """The README's form: ``ce-<first 16 hex of SHA-256 of "<session_key>:<prefix_sha256>">
    -e<epoch>``."""
    tag = hashlib.sha256(f"{session_key}:{prefix_sha256}".encode()).hexdigest()[:16]
    return f"ce-{tag}-e{epoch}"


def cached_name(tenant_id: str, session_id: str, model_id: str = MODEL,
                text: str = "hi") -> tuple[str, str, str]:
    """The session key, prefix hash and cached content's display name of a session's Build."""
    i = f.inputs(tenant_id=tenant_id, session_id=session_id,
                 enabled=("web.fetch", "clock_now"), catalog=CATALOG,
                 model_profile=f.model(model_id))
    r = f.run_build(f.loaded(i), f.checkpoint([f.user("u1", text, 1)]))
    cached = p.gemini_cached_content(r, p.render(r, FMT))
    assert cached.create_body["displayName"] == cached.display_name
    return r.session_key, r.prefix_sha256, cached.display_name


def test_the_cached_content_is_one_sessions_own() -> None:
    """A runtime finds the cached content by its display name: two tenants, or two sessions of
    one tenant, with the same prefix never find (patch, make again) each other's. One session
    finds its own on every Build of the epoch."""
    acme = cached_name("acme", "s1")
    other_tenant, other_session = cached_name("globex", "s1"), cached_name("acme", "s2")
    assert acme[1] == other_tenant[1] == other_session[1]  # the same prefix
    assert len({acme[2], other_tenant[2], other_session[2]}) == 3
    assert cached_name("acme", "s1", text="later") == acme  # the same on the next Build
    assert cached_name("acme", "s1", model_id="gemini-2.5-flash")[2] != acme[2]
    for key, prefix, name in (acme, other_tenant, other_session):
        assert name == display_name(key, prefix, 1)
        assert len(name) <= 128  # Gemini's limit of a display name
    # the longest epoch a plan has (uint32) still fits, far below the limit
    assert len(display_name(acme[0], acme[1], 2**32 - 1)) == 31


@pytest.mark.parametrize("budget", [None, 1, 0])
def test_the_cached_content_holds_the_prefix_for_the_plans_ttl(budget: int | None) -> None:
    """For the plan's TTL, whatever cache markers the model's breakpoint budget keeps (Gemini
    sends none: a budget of 0 keeps none, and the cached content still lives an hour for a
    scheduled session)."""
    for kind, ttl in ((SessionKind.INTERACTIVE, "300s"), (SessionKind.SCHEDULED, "3600s")):
        r = built(two_runs(), model_id=MODEL, kind=kind, budget=budget)
        assert len(r.cache_breakpoints) <= (4 if budget is None else budget)
        body = p.render(r, FMT)
        cached = p.gemini_cached_content(r, body, min_cacheable_tokens=4096)
        assert cached.display_name == display_name(r.session_key, r.prefix_sha256, r.epoch)
        assert cached.ttl == ttl
        assert cached.holds == ("systemInstruction", "tools")
        assert cached.create_body == {
            "model": f"models/{MODEL}", "displayName": cached.display_name, "ttl": ttl,
            "systemInstruction": body["systemInstruction"], "tools": body["tools"]}
        assert cached.cached_body == {"contents": body["contents"],
                                      "generationConfig": body["generationConfig"]}
        assert {**cached.cached_body, **{k: body[k] for k in cached.holds}} == body
        assert cached.estimated_tokens == r.prefix_tokens > 0
        assert cached.min_cacheable_tokens == 4096
        named = {**cached.cached_body, "cachedContent": "cachedContents/c1"}
        assert p.validate_gemini(named) == []
        assert rest(genai_sent(named)) == named
        assert rest(genai_cache_sent(cached.create_body)) == cached.create_body


def test_a_cached_content_without_tools_holds_the_system_instruction_only() -> None:
    r = replace(built([f.user("u1", "Hi.", 1)], catalog=(), model_id="gemini-2.5-flash"),
                model_id="models/gemini-2.5-flash")  # a runtime's id may carry the prefix
    body = p.render(r, FMT)
    cached = p.gemini_cached_content(r, body)
    assert cached.holds == ("systemInstruction",)
    assert cached.create_body["model"] == "models/gemini-2.5-flash"  # not doubled
    assert cached.min_cacheable_tokens == DEFAULT_MIN_CACHEABLE_TOKENS  # none given


# ----------------------------------------------------------------------------- the estimate

def test_a_tool_result_is_estimated_at_least_as_gemini_frames_it() -> None:
    """A functionResponse sends the result as the JSON value {"output": text} (quotes and line
    breaks escaped) and names its function: the estimate covers both, the name with the call."""
    e = f.estimator(f.model("gpt-4o"))
    counter = f.REGISTRY.counter_for("o200k_base")[0]
    text = '<untrusted source="tool:web.fetch" id="r1">\n{"a": "b", "c": "\\d"}\n</untrusted>'
    result = Message(row=10, role=Role.TOOL, trust=TrustLevel.USER, text=text, call_id="k1")
    wrapped = json.dumps({"output": text}, ensure_ascii=False, separators=(",", ":"))
    assert counter.count(wrapped) > counter.count(text)
    assert e.raw(result) == counter.count(wrapped) + counter.count("k1")
    plain = Message(row=10, role=Role.TOOL, trust=TrustLevel.USER, text="ok", call_id="k1")
    assert e.raw(plain) >= counter.count("ok") + counter.count("k1")


# ----------------------------------------------------------------------------- validator

def valid() -> dict[str, Any]:
    body = p.render(built(two_runs(), model_id=MODEL), FMT)
    assert p.validate_gemini(body) == []
    return copy.deepcopy(body)


def test_validator_wants_responses_in_the_next_turn_in_the_order_of_the_calls() -> None:
    body = valid()
    last = body["contents"][-1]["parts"]
    last[0], last[1] = last[1], last[0]
    assert any("not in the order of the calls" in e for e in p.validate_gemini(body))
    body = valid()
    del body["contents"][-1]["parts"][1]  # k2's response
    assert any("'k2' has no result" in e for e in p.validate_gemini(body))
    body = valid()
    body["contents"][2]["parts"][0]["functionResponse"]["name"] = "clock_now"
    assert any("names 'clock_now', its call 'web.fetch'" in e
               for e in p.validate_gemini(body))


def test_validator_checks_roles_parts_names_and_cached_content() -> None:
    body = valid()
    body["contents"][0]["role"] = "model"
    body["contents"][1]["parts"][0]["text"] = "also text"  # two data fields in one part
    body["tools"][0]["functionDeclarations"][0]["name"] = "1bad"
    errors = p.validate_gemini(body)
    assert any("first content must have the user role" in e for e in errors)
    assert any("two model turns in a row" in e for e in errors)
    assert any("exactly one of" in e for e in errors)
    assert any("'1bad' is not a valid Gemini function name" in e for e in errors)
    body = valid()
    body["cachedContent"] = "cachedContents/c1"
    errors = p.validate_gemini(body)
    assert any(e.startswith("systemInstruction: not allowed beside cachedContent")
               for e in errors)
    assert any(e.startswith("tools: not allowed beside cachedContent") for e in errors)
    assert p.validate(body, FMT) == errors
