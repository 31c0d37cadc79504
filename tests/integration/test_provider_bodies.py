"""Provider-ready bodies through the real server, handed to the official SDKs, offline.

Build returns ``provider_body_json``; the parsed body goes, unchanged, to its provider's SDK:

- Anthropic Messages: ``anthropic``'s ``messages.create``; OpenAI Responses and Chat
  Completions: ``openai``'s ``responses.create`` and ``chat.completions.create``, the Chat body
  also walked strictly against the SDK's own typed params
  (``CompletionCreateParamsNonStreaming``: every key known, every value of its type). Those
  SDKs send through ``httpx2``: a mock transport captures the request and answers with a
  minimal valid response, so nothing leaves the process; the SDK sends exactly the body.
- Gemini generateContent: read into ``google.genai.types`` (``Content`` for each of
  ``contents``, ``GenerateContentConfig`` for ``systemInstruction``, ``tools``, ``toolConfig``
  and the generation settings; the types forbid unknown fields), then sent by
  ``genai.Client.models.generate_content`` over an injected mock client: the SDK's own REST
  JSON is the body's. ``gemini_cached_content``: its create body through ``caches.create``
  (``CreateCachedContentConfig``), its cached body as a generateContent body naming a cached
  content, without what the cached content holds.
- Bedrock Converse: botocore's ``validate_parameters`` against the ``bedrock-runtime``
  ``Converse`` operation model, the model's further constraints (lengths, patterns, enums,
  unions), then ``converse(**body)`` on a botocore client with fake credentials whose
  ``before-send`` hook answers: botocore serializes the body and sends nothing.

Every body also passes our structural validator (``providers.validate``), the independent
pairing check (``tests/support/tool_pairs.py``) and the envelope reading (every envelope of the
request reads the same in the body), over the conversations below: a carried tool
pair, a parallel batch after reasoning of two providers, interleaved call items with results
out of order, results turned into pointers under a small window with the history cut, and a
summary.

What stays unverifiable offline: whether the provider's model accepts what its schema admits
(Gemini 3's thought signatures on the current turn's calls, Bedrock's per-model cache-point
minimums, OpenAI's server-side ordering checks beyond the documented ones, which the pairing
check states), and token counts (``tests/support/provider_tokens.py`` bounds them).
"""

from __future__ import annotations

import base64
import collections.abc
import hashlib
import json
import re
import types
import typing
import urllib.parse
import warnings
from collections.abc import Iterator
from typing import Any

import anthropic
import botocore.exceptions
import botocore.session
import grpc
import httpx2
import openai
import pytest
import typing_extensions
from botocore.awsrequest import AWSResponse
from botocore.validate import validate_parameters
from context_engine.domain import providers
from context_engine.v1 import context_engine_pb2 as pb
from google import genai
from google.genai import types as genai_types
from openai.types.chat import completion_create_params

from tests.integration.requests import build_request, catalog, failure, item, plan_request
from tests.property.test_gate_tool_pairs import envelopes, json_strings
from tests.support import tool_pairs, tool_schemas

pytestmark = pytest.mark.integration

THINKING = {"type": "thinking", "thinking": "Both pages are needed.", "signature": "c2ln"}
REASONING = {"type": "reasoning", "id": "rs_1", "summary": [],
             "encrypted_content": "gAAAAB-opaque"}


def items() -> list[pb.ConversationItem]:
    """A carried run with one call, then the active run: reasoning of both providers before a
    parallel batch of two calls, and their results."""
    untrusted = pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED
    return [
        item("u0", 1, run="run-0", user=pb.UserMessage(text="Summarize example.com")),
        item("c0", 2, run="run-0", tool_calls=pb.ToolCalls(calls=[pb.ToolCall(
            call_id="call-0", name="web.fetch", arguments_json='{"url":"https://example.com"}')])),
        item("r0", 3, trust=untrusted, run="run-0", tool_result=pb.ToolResult(
            call_id="call-0", tool_name="web.fetch", content="Example Domain.")),
        item("a0", 4, run="run-0", assistant=pb.AssistantMessage(text="It is a placeholder.")),
        item("u1", 5, user=pb.UserMessage(text="Compare two pages and the time.")),
        item("th1", 6, reasoning=pb.ReasoningItem(provider="anthropic",
                                                  opaque=json.dumps(THINKING).encode())),
        item("rs1", 7, reasoning=pb.ReasoningItem(provider="openai",
                                                  opaque=json.dumps(REASONING).encode())),
        item("c1", 8, tool_calls=pb.ToolCalls(calls=[
            pb.ToolCall(call_id="call-1", name="web.fetch",
                        arguments_json='{"url":"https://a.example"}'),
            pb.ToolCall(call_id="call-2", name="clock.now", arguments_json="{}")])),
        item("r1", 9, trust=untrusted, tool_result=pb.ToolResult(
            call_id="call-1", tool_name="web.fetch", content="Page A.")),
        item("r2", 10, trust=untrusted, tool_result=pb.ToolResult(
            call_id="call-2", tool_name="clock.now", content="12:00")),
    ]


def build(tenant: str, session: str, entries: list[pb.ConversationItem],
          fmt: int) -> pb.BuildRequest:
    req = build_request(tenant, session, entries)
    req.provider_format = fmt  # type: ignore[assignment]
    return req


class Capture:
    """A mock transport handler: records each request and answers with ``response``."""

    def __init__(self, response: dict[str, Any]) -> None:
        self.response = response
        self.requests: list[httpx2.Request] = []

    def __call__(self, request: httpx2.Request) -> httpx2.Response:
        self.requests.append(request)
        return httpx2.Response(200, json=self.response)

    @property
    def sent(self) -> Any:
        assert len(self.requests) == 1
        return json.loads(self.requests[0].content)


# --------------------------------------------------------------------------- the SDK gates
# Each body goes to its provider's official SDK, offline: anthropic and openai through a mock
# httpx2 transport, google-genai through an injected httpx2 client on a mock transport,
# botocore through a client whose ``before-send`` hook answers (fake credentials: the request
# is signed locally and never sent). The SDK's own request building accepts the body and sends
# what it says.

GEMINI_MODEL = "gemini-2.5-pro"
BEDROCK_MODEL = "anthropic.claude-sonnet-4-5-20250929-v1:0"
# The generateContent request body (REST; the model is in the URL): these keys and no other.
# (``labels`` is Vertex AI's only: the Gemini API refuses it.)
GEMINI_TOP = {"contents", "systemInstruction", "tools", "toolConfig", "generationConfig",
              "safetySettings", "cachedContent"}
# The cachedContents.create body (the CachedContent resource, without what the server sets).
GEMINI_CACHE_TOP = {"model", "displayName", "ttl", "expireTime", "contents",
                    "systemInstruction", "tools", "toolConfig"}
# Gemini refuses a generateContent request that names a cachedContent and sets any of these.
GEMINI_CACHE_EXCLUSIVE = {"systemInstruction", "tools", "toolConfig"}
# Values that are the caller's own JSON (arguments, results, schemas): compared verbatim.
GEMINI_FREE_FORM = {"args", "response", "parameters", "parametersJsonSchema",
                    "responseJsonSchema", "responseSchema", "labels"}
BEDROCK_MAX_CACHE_POINTS = 4  # Bedrock's prompt caching: at most four checkpoints a request
# OpenAI's own length limits, which its SDK types do not state ("Invalid
# 'messages[2].tool_calls[0].id': string too long. Expected a string with maximum length 40";
# "Invalid 'input[95].call_id': ... maximum length 64"; "Invalid 'prompt_cache_key': ...
# maximum length 64").
CHAT_CALL_ID_MAX = 40
RESPONSES_CALL_ID_MAX = 64
PROMPT_CACHE_KEY_MAX = 64
FORMATS = {pb.PROVIDER_FORMAT_ANTHROPIC_MESSAGES: "anthropic_messages",
           pb.PROVIDER_FORMAT_OPENAI_RESPONSES: "openai_responses",
           pb.PROVIDER_FORMAT_OPENAI_CHAT_COMPLETIONS: "openai_chat_completions",
           pb.PROVIDER_FORMAT_GEMINI_GENERATE_CONTENT: "gemini_generate_content",
           pb.PROVIDER_FORMAT_BEDROCK_CONVERSE: "bedrock_converse"}
MODELS = {pb.PROVIDER_FORMAT_ANTHROPIC_MESSAGES: "claude-sonnet-4-5",
          pb.PROVIDER_FORMAT_OPENAI_RESPONSES: "gpt-5",
          pb.PROVIDER_FORMAT_OPENAI_CHAT_COMPLETIONS: "gpt-4o",
          pb.PROVIDER_FORMAT_GEMINI_GENERATE_CONTENT: GEMINI_MODEL,
          pb.PROVIDER_FORMAT_BEDROCK_CONVERSE: BEDROCK_MODEL}


def typed_problems(value: Any, tp: Any, where: str = "body") -> list[str]:
    """``value`` against a type of the SDK's params (TypedDicts, unions, literals, iterables):
    every key known, every required key present, every value of its type. The SDK itself does
    not check its TypedDicts at run time, and pydantic ignores unknown TypedDict keys: this walk
    is strict."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp in (Any, object):
        return []
    if origin in (typing.Annotated, typing.Required, typing.NotRequired):
        return typed_problems(value, args[0], where)
    if origin in (typing.Union, types.UnionType):
        found = [typed_problems(value, member, where) for member in args]
        return [] if any(not p for p in found) else min(found, key=len)
    if origin is typing.Literal:
        return [] if value in args else [f"{where}: {value!r} is not one of {list(args)}"]
    if tp is type(None):
        return [] if value is None else [f"{where}: {value!r} is not null"]
    if tp is bool:
        return [] if isinstance(value, bool) else [f"{where}: {value!r} is not a boolean"]
    if tp in (int, float):
        ok = isinstance(value, (int, float) if tp is float else int)
        return [] if ok and not isinstance(value, bool) else [f"{where}: {value!r} is not {tp}"]
    if tp is str:
        return [] if isinstance(value, str) else [f"{where}: {value!r} is not a string"]
    if typing_extensions.is_typeddict(tp):
        if not isinstance(value, dict):
            return [f"{where}: not an object ({tp.__name__})"]
        hints = typing.get_type_hints(tp, include_extras=True)
        problems = [f"{where}.{key}: not a field of {tp.__name__}" for key in value
                    if key not in hints]
        for key, hint in hints.items():
            required = (typing.get_origin(hint) is typing.Required
                        or (tp.__total__ and typing.get_origin(hint) is not typing.NotRequired))
            if key in value:
                problems += typed_problems(value[key], hint, f"{where}.{key}")
            elif required:
                problems.append(f"{where}.{key}: required by {tp.__name__}")
        return problems
    if origin in (list, collections.abc.Iterable, collections.abc.Sequence):
        if not isinstance(value, list):
            return [f"{where}: not a list"]
        return [p for k, v in enumerate(value) for p in typed_problems(v, args[0], f"{where}[{k}]")]
    if origin in (dict, collections.abc.Mapping):
        if not isinstance(value, dict):
            return [f"{where}: not an object"]
        return [p for k, v in value.items()
                for p in typed_problems(v, args[1], f"{where}.{k}")]
    return [f"{where}: the check does not know the type {tp!r}"]


def chat_typed_problems(body: dict[str, Any]) -> list[str]:
    """The body against the openai SDK's own ``CompletionCreateParamsNonStreaming``, and
    OpenAI's length limits."""
    problems = typed_problems(body, completion_create_params.CompletionCreateParamsNonStreaming)
    ids = [(f"messages[{i}].tool_calls[{k}].id", c.get("id"))
           for i, m in enumerate(body.get("messages", []))
           for k, c in enumerate(m.get("tool_calls") or [])]
    ids += [(f"messages[{i}].tool_call_id", m.get("tool_call_id"))
            for i, m in enumerate(body.get("messages", [])) if "tool_call_id" in m]
    problems += [f"{where}: {len(v)} characters, at most {CHAT_CALL_ID_MAX}"
                 for where, v in ids if isinstance(v, str) and len(v) > CHAT_CALL_ID_MAX]
    return problems + _cache_key_problems(body)


def responses_limit_problems(body: dict[str, Any]) -> list[str]:
    """OpenAI's length limits on a Responses body (its SDK types do not state them)."""
    problems = [f"input[{i}].call_id: {len(item['call_id'])} characters, at most "
                f"{RESPONSES_CALL_ID_MAX}" for i, item in enumerate(body.get("input", []))
                if isinstance(item, dict) and isinstance(item.get("call_id"), str)
                and len(item["call_id"]) > RESPONSES_CALL_ID_MAX]
    return problems + _cache_key_problems(body)


def _cache_key_problems(body: dict[str, Any]) -> list[str]:
    key = body.get("prompt_cache_key")
    if isinstance(key, str) and len(key) > PROMPT_CACHE_KEY_MAX:
        return [f"prompt_cache_key: {len(key)} characters, at most {PROMPT_CACHE_KEY_MAX}"]
    return []


def gemini_typed(body: dict[str, Any]) -> tuple[list[genai_types.Content],
                                                genai_types.GenerateContentConfig]:
    """A generateContent body as google-genai's types, read from its JSON (camelCase aliases;
    bytes as base64, as the REST form carries them). The types forbid unknown fields
    (``extra="forbid"``), so a misspelled key anywhere fails here; the top-level keys are
    checked against the request's own."""
    unknown = set(body) - GEMINI_TOP
    assert not unknown, f"not fields of a generateContent request: {sorted(unknown)}"
    contents = [genai_types.Content.model_validate_json(json.dumps(c)) for c in body["contents"]]
    config = dict(body.get("generationConfig", {}))
    config.update({k: body[k] for k in GEMINI_TOP - {"contents", "generationConfig"}
                   if k in body})
    return contents, genai_types.GenerateContentConfig.model_validate_json(json.dumps(config))


def rest_form(value: Any) -> Any:
    """A Gemini REST JSON with every field name in camelCase (the REST API takes both; the SDK
    sends a few in snake_case): how two bodies are compared. The caller's own JSON (arguments,
    results, schemas) is kept as it is."""
    if isinstance(value, list):
        return [rest_form(v) for v in value]
    if not isinstance(value, dict):
        return value
    out = {}
    for key, inner in value.items():
        camel = re.sub(r"_([a-z])", lambda m: m.group(1).upper(), key)
        out[camel] = inner if camel in GEMINI_FREE_FORM else rest_form(inner)
    return out


def bedrock_shape_problems(value: Any, shape: Any, where: str = "body") -> list[str]:
    """The constraints of the Converse operation model that botocore's own validator leaves to
    the service (``max`` lengths, ``pattern`` (matched whole, as the service does), ``enum``,
    one member of a union); botocore checks types, required members, ``min`` and unknown
    members."""
    problems: list[str] = []
    meta = shape.metadata
    kind = shape.type_name
    if kind == "structure" and isinstance(value, dict):
        if meta.get("union") and len(value) != 1:
            problems.append(f"{where}: a union with {len(value)} members set")
        for key, inner in value.items():
            if key in shape.members:
                problems += bedrock_shape_problems(inner, shape.members[key], f"{where}.{key}")
    elif kind == "list" and isinstance(value, list):
        if "max" in meta and len(value) > meta["max"]:
            problems.append(f"{where}: {len(value)} entries, at most {meta['max']}")
        for k, inner in enumerate(value):
            problems += bedrock_shape_problems(inner, shape.member, f"{where}[{k}]")
    elif kind == "map" and isinstance(value, dict):
        for key, inner in value.items():
            problems += bedrock_shape_problems(inner, shape.value, f"{where}.{key}")
    elif kind == "string" and isinstance(value, str):
        if "max" in meta and len(value) > meta["max"]:
            problems.append(f"{where}: {len(value)} characters, at most {meta['max']}")
        if "pattern" in meta and re.fullmatch(meta["pattern"], value) is None:
            problems.append(f"{where}: {value!r} does not match {meta['pattern']}")
        if "enum" in meta and value not in meta["enum"]:
            problems.append(f"{where}: {value!r} is not one of {meta['enum']}")
    return problems


def converse_operation() -> Any:
    return botocore.session.get_session().get_service_model(
        "bedrock-runtime").operation_model("Converse")


def bedrock_problems(body: dict[str, Any]) -> list[str]:
    """botocore's parameter validation against the Converse operation model, the model's
    further constraints, and the limits the service states: no blank text block ("The text
    field in the ContentBlock object ... is blank"), at most four cache points."""
    shape = converse_operation().input_shape
    problems: list[str] = []
    try:
        validate_parameters(body, shape)
    except botocore.exceptions.ParamValidationError as err:
        problems.append(str(err))
    problems += bedrock_shape_problems(body, shape)
    blocks = [*body.get("system", []),
              *(b for m in body.get("messages", []) for b in m.get("content", []))]
    problems += [f"a blank text block: {b!r}" for b in blocks
                 if "text" in b and not str(b["text"]).strip()]
    points = sum("cachePoint" in b for b in
                 [*blocks, *body.get("toolConfig", {}).get("tools", [])])
    if points > BEDROCK_MAX_CACHE_POINTS:
        problems.append(f"{points} cache points; at most {BEDROCK_MAX_CACHE_POINTS}")
    return problems


class _Raw:
    """A botocore raw response body."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def stream(self, **_: Any) -> Iterator[bytes]:
        yield self.data

    def read(self) -> bytes:
        return self.data


def _sdk_reply(provider_format: str, model: str) -> dict[str, Any]:
    return {
        "anthropic_messages": {
            "id": "msg_1", "type": "message", "role": "assistant", "model": model,
            "content": [{"type": "text", "text": "ok"}], "stop_reason": "end_turn",
            "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1}},
        "openai_responses": {
            "id": "resp_1", "object": "response", "created_at": 0, "model": model,
            "status": "completed", "output": [], "parallel_tool_calls": True,
            "tool_choice": "auto", "tools": []},
        "openai_chat_completions": {
            "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": model,
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "ok"}}]},
        "gemini_generate_content": {
            "candidates": [{"content": {"role": "model", "parts": [{"text": "ok"}]},
                            "finishReason": "STOP"}]},
    }[provider_format]


def through_sdk(body: dict[str, Any], provider_format: str, model: str = "") -> None:
    """Hand ``body`` to its provider's official SDK (see above): the SDK accepts it and sends
    exactly it (Gemini: the same REST JSON, field names aside; Bedrock: all but ``modelId``,
    which goes into the URL)."""
    if provider_format == "bedrock_converse":
        _through_botocore(body)
        return
    model = model or str(body.get("model", ""))
    capture = Capture(_sdk_reply(provider_format, model))
    with httpx2.Client(transport=httpx2.MockTransport(capture)) as http:
        if provider_format == "anthropic_messages":
            client = anthropic.Anthropic(api_key="test-key", http_client=http, max_retries=0)
            with warnings.catch_warnings():  # the SDK's notice about a model's end of life
                warnings.simplefilter("ignore", DeprecationWarning)
                client.messages.create(**body)
            assert capture.requests[0].url.path == "/v1/messages"
        elif provider_format == "openai_responses":
            assert responses_limit_problems(body) == []
            openai.OpenAI(api_key="test-key", http_client=http,
                          max_retries=0).responses.create(**body)
            assert capture.requests[0].url.path == "/v1/responses"
        elif provider_format == "openai_chat_completions":
            assert chat_typed_problems(body) == []
            reply = openai.OpenAI(api_key="test-key", http_client=http,
                                  max_retries=0).chat.completions.create(**body)
            assert reply.choices[0].message.content == "ok"
            assert capture.requests[0].url.path == "/v1/chat/completions"
        elif provider_format == "gemini_generate_content":
            contents, config = gemini_typed(body)
            client = genai.Client(api_key="test-key",
                                  http_options=genai_types.HttpOptions(httpx_client=http))
            reply = client.models.generate_content(model=model, contents=contents,
                                                   config=config)
            assert reply.text == "ok"
            assert capture.requests[0].url.path.endswith(f"/models/{model}:generateContent")
            assert rest_form(capture.sent) == rest_form(body)
            return
        else:
            raise AssertionError(f"no SDK for {provider_format!r}")
    assert capture.sent == body


def _through_botocore(body: dict[str, Any]) -> None:
    assert bedrock_problems(body) == []
    session = botocore.session.get_session()
    client = session.create_client("bedrock-runtime", region_name="us-east-1",
                                   aws_access_key_id="AKIDEXAMPLE",
                                   aws_secret_access_key="not-a-secret")
    sent: list[Any] = []
    reply = json.dumps({
        "output": {"message": {"role": "assistant", "content": [{"text": "ok"}]}},
        "stopReason": "end_turn", "metrics": {"latencyMs": 1},
        "usage": {"inputTokens": 1, "outputTokens": 1, "totalTokens": 2}}).encode()

    def answer(request: Any, **_: Any) -> AWSResponse:
        sent.append(request)
        return AWSResponse(request.url, 200, {"content-type": "application/json"}, _Raw(reply))

    client.meta.events.register("before-send.bedrock-runtime.Converse", answer)
    try:
        out = client.converse(**with_blobs_as_bytes(body))
    finally:
        client.close()
    assert out["output"]["message"]["content"] == [{"text": "ok"}]
    assert len(sent) == 1
    path = urllib.parse.urlsplit(sent[0].url).path
    assert urllib.parse.unquote(path) == f"/model/{body['modelId']}/converse"
    assert json.loads(sent[0].body) == {k: v for k, v in body.items() if k != "modelId"}


def with_blobs_as_bytes(body: dict[str, Any]) -> dict[str, Any]:
    """What a boto3 caller does with the JSON body: a Converse blob (a replayed
    ``redactedContent`` of a reasoning block, the body's one blob) travels as base64 text, which
    botocore would encode again; decoded to bytes, botocore sends the same base64 back."""
    result: dict[str, Any] = json.loads(json.dumps(body))  # a deep copy
    for message in result.get("messages", []):
        for block in message.get("content", []):
            reasoning = block.get("reasoningContent")
            if isinstance(reasoning, dict) and isinstance(reasoning.get("redactedContent"), str):
                reasoning["redactedContent"] = base64.b64decode(reasoning["redactedContent"],
                                                                validate=True)
    return result


def gemini_cache_create_through_sdk(create_body: dict[str, Any]) -> None:
    """``cachedContents.create`` through google-genai: the body reads as
    ``CreateCachedContentConfig`` (unknown fields forbidden) with its model, and the SDK sends
    the same REST JSON."""
    unknown = set(create_body) - GEMINI_CACHE_TOP
    assert not unknown, f"not fields of a cachedContents.create body: {sorted(unknown)}"
    model = create_body["model"]
    config = genai_types.CreateCachedContentConfig.model_validate_json(json.dumps(
        {k: v for k, v in create_body.items() if k != "model"}))
    capture = Capture({"name": "cachedContents/c1", "model": model,
                       "displayName": create_body.get("displayName", "")})
    with httpx2.Client(transport=httpx2.MockTransport(capture)) as http:
        client = genai.Client(api_key="test-key",
                              http_options=genai_types.HttpOptions(httpx_client=http))
        created = client.caches.create(model=model, config=config)
    assert created.name == "cachedContents/c1"
    assert capture.requests[0].url.path.endswith("/cachedContents")
    assert rest_form(capture.sent) == rest_form(create_body)


def built(stub: Any, tenant: str, session: str, fmt: int, model: str,
          kind: int = pb.SESSION_KIND_INTERACTIVE) -> tuple[pb.BuildResponse, dict[str, Any]]:
    stub.Plan(plan_request(tenant, session, model=pb.ModelSpec(model_id=model),
                           session=pb.SessionSpec(kind=kind)))
    resp = stub.Build(build(tenant, session, items(), fmt))
    assert resp.provider_body_json
    return resp, json.loads(resp.provider_body_json)


def test_anthropic_body_through_the_official_sdk(stub, ids):
    tenant, session = ids
    resp, body = built(stub, tenant, session, pb.PROVIDER_FORMAT_ANTHROPIC_MESSAGES,
                       "claude-sonnet-4-5", pb.SESSION_KIND_SCHEDULED)
    assert providers.validate_anthropic(body) == []
    assert body["model"] == resp.model_id and body["max_tokens"] == resp.output_reserve
    assert [t["name"] for t in body["tools"]] == [
        "clock__now", "context__update_working_state", "tool__call", "web__fetch"]
    # after_tools and after_system at the plan's 1h, then the two history markers at 5m
    ttls = [b["cache_control"].get("ttl", "5m")
            for b in [*body["tools"], *body["system"],
                      *(c for m in body["messages"] for c in m["content"])]
            if "cache_control" in b]
    assert ttls == ["1h", "1h", "5m", "5m"]
    assert [b.name for b in resp.cache_breakpoints] == [
        "after_system", "after_tools", "carried_history", "run"]
    turn = body["messages"][-2]["content"]
    assert turn[0] == THINKING and [b["type"] for b in turn[1:]] == ["tool_use", "tool_use"]
    assert "encrypted_content" not in resp.provider_body_json
    through_sdk(body, "anthropic_messages")


def test_openai_body_through_the_official_sdk(stub, ids):
    tenant, session = ids
    resp, body = built(stub, tenant, session, pb.PROVIDER_FORMAT_OPENAI_RESPONSES, "gpt-5")
    assert providers.validate_openai(body) == []
    assert body["prompt_cache_key"] == resp.session_key
    assert body["max_output_tokens"] == resp.output_reserve
    assert body["instructions"] == "\n\n".join(b.text for b in resp.request.prefix_blocks)
    kinds = [i["type"] for i in body["input"]]
    assert kinds.count("function_call") == kinds.count("function_call_output") == 3
    assert [i for i in body["input"] if i["type"] == "reasoning"] == [REASONING]
    assert "Both pages are needed." not in resp.provider_body_json  # Anthropic's is omitted
    through_sdk(body, "openai_responses")


def test_without_a_format_the_models_default_is_rendered_and_none_renders_nothing(stub, ids):
    tenant, session = ids
    plan = stub.Plan(plan_request(tenant, session)).plan
    assert plan.default_provider_format == pb.PROVIDER_FORMAT_ANTHROPIC_MESSAGES
    default = stub.Build(build_request(tenant, session, items()))
    assert default.provider_format == plan.default_provider_format
    assert providers.validate(json.loads(default.provider_body_json),
                              FORMATS[default.provider_format]) == []
    none = stub.Build(build(tenant, session, items(), pb.PROVIDER_FORMAT_NONE))
    assert none.provider_body_json == ""
    assert none.provider_format == pb.PROVIDER_FORMAT_UNSPECIFIED
    assert not none.HasField("gemini_cached_content")


def test_an_unknown_format_is_a_field_violation(stub, ids):
    tenant, session = ids
    stub.Plan(plan_request(tenant, session))
    with pytest.raises(grpc.RpcError) as err:
        stub.Build(build(tenant, session, items(), 7))
    f = failure(err.value)
    assert f.code is grpc.StatusCode.INVALID_ARGUMENT and "provider_format" in f.violations


def test_colliding_tool_names_are_refused_at_plan(stub, ids, db):
    tenant, session = ids
    schema = '{"type":"object","properties":{}}'
    with pytest.raises(grpc.RpcError) as err:
        stub.Plan(plan_request(tenant, session, tool_catalog=[
            pb.ToolSpec(name="clock.now", description="Now.", input_schema_json=schema,
                        side_effect=pb.SIDE_EFFECT_NONE),
            pb.ToolSpec(name="clock__now", description="Now too.", input_schema_json=schema,
                        side_effect=pb.SIDE_EFFECT_NONE)]))
    f = failure(err.value)
    assert f.code is grpc.StatusCode.INVALID_ARGUMENT
    assert "'clock__now' and 'clock.now'" in f.violations["tool_catalog[1].name"]
    assert db.counts(tenant) == {"sessions": 0, "plans": 0, "context_events": 0}


def schema_sent(body: dict[str, Any], name: str, tool: str) -> Any:
    """The input schema a body sends for ``tool`` (its provider name)."""
    if name == "anthropic_messages":
        return next(t["input_schema"] for t in body["tools"] if t["name"] == tool)
    if name == "openai_responses":
        return next(t["parameters"] for t in body["tools"] if t["name"] == tool)
    if name == "openai_chat_completions":
        return next(t["function"]["parameters"] for t in body["tools"]
                    if t["function"]["name"] == tool)
    if name == "gemini_generate_content":
        found = next(d for t in body["tools"] for d in t["functionDeclarations"]
                     if d["name"] == tool)
        return found.get("parametersJsonSchema", found.get("parameters"))
    return next(t["toolSpec"]["inputSchema"]["json"] for t in body["toolConfig"]["tools"]
                if "toolSpec" in t and t["toolSpec"]["name"] == tool)


@pytest.mark.parametrize("fmt", list(FORMATS), ids=list(FORMATS.values()))
def test_tool_schemas_reach_every_sdk_without_generated_titles_or_empty_defaults(stub, ids, fmt):
    """A pydantic-shaped schema with titles a person wrote: the bodies carry it without its
    generated title annotations and empty defaults (and with everything else, the titles a
    person wrote included), every SDK sends exactly that, and the request's own tool
    definition keeps the full schema the plan pinned."""
    search = pb.ToolSpec(name="web.search", description="Search the web.",
                         input_schema_json=json.dumps(tool_schemas.GENERATED),
                         side_effect=pb.SIDE_EFFECT_NETWORK_READ)
    tenant, session = ids
    name = FORMATS[fmt]
    model = pb.ModelSpec(model_id=MODELS[fmt])
    if fmt == pb.PROVIDER_FORMAT_BEDROCK_CONVERSE:
        model.capabilities.context_window = 200_000
    stub.Plan(plan_request(tenant, session, model=model, tool_catalog=[*catalog(), search]))
    resp = stub.Build(build(tenant, session, items(), fmt))
    definition = next(t for t in resp.request.tools if t.name == "web.search")
    assert json.loads(definition.input_schema_json) == tool_schemas.GENERATED
    body = json.loads(resp.provider_body_json)
    sent_name = "web.search" if name == "gemini_generate_content" else "web__search"
    assert schema_sent(body, name, sent_name) == tool_schemas.PROVIDER_FORM
    assert providers.validate(body, name) == []
    through_sdk(body, name, model=resp.model_id)


# --------------------------------------------------------------------------- every format

def test_the_formats_here_are_every_format_of_the_contract():
    assert set(FORMATS) == set(pb.ProviderFormat.values()) - {
        pb.PROVIDER_FORMAT_UNSPECIFIED, pb.PROVIDER_FORMAT_NONE}
    assert set(FORMATS.values()) == set(providers.FORMATS)


def interleaved_items() -> list[pb.ConversationItem]:
    """A carried run: c0 (a, b), then c0x (c) before any result, answered b, c, a. The active
    run: reasoning, c1 (d, e), a message, c1x (g), answered e, g, d; then c2 (h, i) whose h
    arrives before c2x (j), and i last."""
    untrusted = pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED

    def calls(item_id: str, seq: int, *call_ids: str, run: str = "run-1") -> pb.ConversationItem:
        return item(item_id, seq, run=run, tool_calls=pb.ToolCalls(calls=[
            pb.ToolCall(call_id=c, name="web.fetch" if c < "f" else "clock.now",
                        arguments_json=json.dumps({"url": f"https://{c}.example"}
                                                  if c < "f" else {}))
            for c in call_ids]))

    def result(item_id: str, seq: int, call_id: str, run: str = "run-1") -> pb.ConversationItem:
        return item(item_id, seq, trust=untrusted, run=run, tool_result=pb.ToolResult(
            call_id=call_id, tool_name="web.fetch" if call_id < "f" else "clock.now",
            content=f"Result {call_id.upper()}."))

    return [
        item("u0", 1, run="run-0", user=pb.UserMessage(text="Compare three pages.")),
        calls("c0", 2, "a", "b", run="run-0"), calls("c0x", 3, "c", run="run-0"),
        result("rb", 4, "b", run="run-0"), result("rc", 5, "c", run="run-0"),
        result("ra", 6, "a", run="run-0"),
        item("u1", 7, user=pb.UserMessage(text="And now two more, and the time.")),
        item("th1", 8, reasoning=pb.ReasoningItem(provider="anthropic",
                                                  opaque=json.dumps(THINKING).encode())),
        item("rs1", 8, reasoning=pb.ReasoningItem(provider="openai",
                                                  opaque=json.dumps(REASONING).encode())),
        calls("c1", 9, "d", "e"),
        item("a1", 10, assistant=pb.AssistantMessage(text="And the clock.")),
        calls("c1x", 11, "g"),
        result("re", 12, "e"), result("rg", 13, "g"), result("rd", 14, "d"),
        calls("c2", 15, "h", "i"), result("rh", 16, "h"), calls("c2x", 17, "j"),
        result("rj", 18, "j"), result("ri", 19, "i"),
    ]


def pointer_items() -> list[pb.ConversationItem]:
    """Six carried runs of a parallel batch of two (answered out of order) with large results
    and a long answer, then the question: under a 16k window results become pointers and the
    oldest history is left out."""
    untrusted = pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED
    page = " ".join(f"word{k % 97} <td>{k}</td>" for k in range(900))
    out: list[pb.ConversationItem] = []
    seq = 1
    for r in range(6):
        run = f"run-{r}"
        out.append(item(f"u{r}", seq, run=run, user=pb.UserMessage(text=f"Fetch batch {r}.")))
        out.append(item(f"c{r}", seq + 1, run=run, tool_calls=pb.ToolCalls(calls=[
            pb.ToolCall(call_id=f"call-{r}-{k}", name="web.fetch",
                        arguments_json=json.dumps({"url": f"https://example.com/{r}/{k}"}))
            for k in range(2)])))
        for k in (1, 0):
            out.append(item(f"r{r}{k}", seq + 2 + (1 - k), trust=untrusted, run=run,
                            tool_result=pb.ToolResult(
                                call_id=f"call-{r}-{k}", tool_name="web.fetch",
                                content=f"Page {r}/{k}: {page}", event_id=100 + seq,
                                artifact_ref=f"artifact:pages/{r}-{k}")))
        out.append(item(f"a{r}", seq + 4, run=run, assistant=pb.AssistantMessage(
            text=f"Batch {r} read: " + " ".join(f"note{k % 89}" for k in range(1_200)))))
        seq += 5
    out.append(item("u9", seq, run="run-9", user=pb.UserMessage(text="Which is newest?")))
    return out


CASES = ("tool pairs and reasoning", "interleaved calls", "pointers and a cut", "summary")


def case_request(case: str, tenant: str, session: str, fmt: int) -> pb.BuildRequest:
    if case == "interleaved calls":
        req = build(tenant, session, interleaved_items(), fmt)
    elif case == "pointers and a cut":
        req = build(tenant, session, pointer_items(), fmt)
        req.checkpoint.active_run_id = "run-9"
    else:
        req = build(tenant, session, items(), fmt)
    if case == "summary":  # the carried run (sequences 1-4) is the summary's now
        req.checkpoint.summary.CopyFrom(pb.Summary(
            text="The user asked about example.com; it is a placeholder page.",
            replaced_through_sequence=4, depth=1, constraints=["Cite every page you use."]))
    return req


def call_ids(body: dict[str, Any], name: str) -> list[str | None]:
    """The ids of the calls a body makes (None for a Gemini call without one)."""
    if name == "anthropic_messages":
        return [b["id"] for m in body["messages"] for b in m["content"]
                if b.get("type") == "tool_use"]
    if name == "openai_responses":
        return [i["call_id"] for i in body["input"] if i.get("type") == "function_call"]
    if name == "openai_chat_completions":
        return [c["id"] for m in body["messages"] for c in m.get("tool_calls") or []]
    if name == "gemini_generate_content":
        return [p["functionCall"].get("id") for c in body["contents"] for p in c["parts"]
                if "functionCall" in p]
    return [b["toolUse"]["toolUseId"] for m in body["messages"] for b in m["content"]
            if "toolUse" in b]


def plan_for(stub: Any, tenant: str, session: str, fmt: int, *, window: int = 0,
             kind: int = pb.SESSION_KIND_INTERACTIVE) -> pb.ContextPlan:
    model = pb.ModelSpec(model_id=MODELS[fmt])
    if window or fmt == pb.PROVIDER_FORMAT_BEDROCK_CONVERSE:
        model.capabilities.context_window = window or 200_000
        model.capabilities.output_reserve = 2_000 if window else 8_192
    return stub.Plan(plan_request(tenant, session, model=model,
                                  session=pb.SessionSpec(kind=kind))).plan


@pytest.mark.parametrize("fmt", list(FORMATS), ids=list(FORMATS.values()))
@pytest.mark.parametrize("case", CASES)
def test_every_body_passes_its_sdk_our_validator_and_the_independent_pairing(
        stub, ids, case, fmt):
    tenant, session = ids
    name = FORMATS[fmt]
    plan_for(stub, tenant, session, fmt, window=16_000 if case == "pointers and a cut" else 0)
    resp = stub.Build(case_request(case, tenant, session, fmt))
    assert resp.provider_format == fmt
    body = json.loads(resp.provider_body_json)
    assert providers.validate(body, name) == []
    assert tool_pairs.request_problems(resp.request) == []
    assert tool_pairs.body_problems(resp.provider_body_json, fmt) == []
    made = [c.call_id for m in resp.request.messages for c in m.tool_calls]
    sent = call_ids(body, name)
    if None in sent:  # a Gemini call without an id pairs by name, in order
        assert len(sent) == len(made)
    else:
        assert sorted(sent) == sorted(made)
    # every envelope of the request reads the same in the body (tag, source, id, nonce, body)
    assert envelopes(json_strings(body)) == envelopes(
        [*(b.text for b in resp.request.prefix_blocks), *(m.text for m in resp.request.messages)])
    if case == "pointers and a cut":
        steps = {s.step for s in resp.pressure.steps}
        assert {"tool_results", "history"} <= steps, steps
        assert "[elided]" in resp.provider_body_json
    through_sdk(body, name, model=resp.model_id)
    if name == "gemini_generate_content":
        check_gemini_cached_content(resp, body)


def check_gemini_cached_content(resp: pb.BuildResponse, body: dict[str, Any]) -> None:
    """The explicit-caching plan: its create body through the SDK; its cached body, naming a
    cached content, through the SDK too, without any field a cached content excludes; the
    cached body plus what the cached content holds is the whole body again."""
    assert resp.HasField("gemini_cached_content")
    cached = resp.gemini_cached_content
    create = json.loads(cached.create_body_json)
    cached_body = json.loads(cached.cached_body_json)
    # the session's own: derived from the session key, the prefix and the epoch
    tag = hashlib.sha256(f"{resp.session_key}:{resp.prefix_sha256}".encode()).hexdigest()[:16]
    epoch_tag = f"ce-{tag}-e{resp.epoch}"
    assert cached.display_name == epoch_tag == create["displayName"]
    assert re.fullmatch(r"[0-9]+s", cached.ttl) and create["ttl"] == cached.ttl
    assert set(cached.holds) <= GEMINI_CACHE_EXCLUSIVE | {"contents"}
    assert "systemInstruction" in cached.holds
    for field in cached.holds:
        assert create[field] == body[field], field
    assert not GEMINI_CACHE_EXCLUSIVE & set(cached_body), sorted(cached_body)
    assert "cachedContent" not in cached_body or not cached_body["cachedContent"]
    assert {**cached_body, **{f: body[f] for f in cached.holds}} == body
    assert cached.min_cacheable_tokens > 0 and cached.estimated_tokens > 0
    gemini_cache_create_through_sdk(create)
    named = {**cached_body, "cachedContent": "cachedContents/c1"}
    assert tool_pairs.gemini_problems(named) == []
    through_sdk(named, "gemini_generate_content", model=resp.model_id)


def test_chat_completions_body_through_the_official_sdk(stub, ids):
    tenant, session = ids
    fmt = pb.PROVIDER_FORMAT_OPENAI_CHAT_COMPLETIONS
    plan_for(stub, tenant, session, fmt)
    resp = stub.Build(build(tenant, session, items(), fmt))
    body = json.loads(resp.provider_body_json)
    assert body["model"] == resp.model_id == "gpt-4o"
    assert body["prompt_cache_key"] == resp.session_key
    messages = body["messages"]
    system = [m for m in messages if m["role"] == "system"]
    assert messages[:len(system)] == system, "system messages lead"
    texts = [m["content"] if isinstance(m["content"], str)
             else "".join(p["text"] for p in m["content"]) for m in system]
    assert "\n\n".join(texts) == "\n\n".join(b.text for b in resp.request.prefix_blocks)
    assert [t["function"]["name"] for t in body["tools"]] == [
        "clock__now", "context__update_working_state", "tool__call", "web__fetch"]
    calls = [c for m in messages for c in m.get("tool_calls") or []]
    assert [c["function"]["name"] for c in calls] == ["web__fetch", "web__fetch", "clock__now"]
    assert [m["tool_call_id"] for m in messages if m["role"] == "tool"] == [
        "call-0", "call-1", "call-2"]
    # neither provider's reasoning means anything to Chat Completions
    assert "Both pages are needed." not in resp.provider_body_json
    assert "gAAAAB-opaque" not in resp.provider_body_json
    through_sdk(body, "openai_chat_completions")


def test_gemini_body_through_the_official_sdk(stub, ids):
    tenant, session = ids
    fmt = pb.PROVIDER_FORMAT_GEMINI_GENERATE_CONTENT
    plan_for(stub, tenant, session, fmt, kind=pb.SESSION_KIND_SCHEDULED)
    resp = stub.Build(build(tenant, session, items(), fmt))
    body = json.loads(resp.provider_body_json)
    texts = [p["text"] for p in body["systemInstruction"]["parts"]]
    assert "\n\n".join(texts) == "\n\n".join(b.text for b in resp.request.prefix_blocks)
    # Gemini takes dots in function names: ours go as they are
    assert [d["name"] for t in body["tools"] for d in t["functionDeclarations"]] == [
        "clock.now", "context.update_working_state", "tool.call", "web.fetch"]
    roles = [c["role"] for c in body["contents"]]
    assert roles[0] == "user" and set(roles) == {"user", "model"}
    calls = [p["functionCall"] for c in body["contents"] for p in c["parts"]
             if "functionCall" in p]
    responses = [p["functionResponse"] for c in body["contents"] for p in c["parts"]
                 if "functionResponse" in p]
    assert [c["name"] for c in calls] == [r["name"] for r in responses] == [
        "web.fetch", "web.fetch", "clock.now"]
    assert [c["id"] for c in calls] == [r["id"] for r in responses] == [
        "call-0", "call-1", "call-2"]
    assert "Both pages are needed." not in resp.provider_body_json
    assert "gAAAAB-opaque" not in resp.provider_body_json
    assert resp.gemini_cached_content.ttl == "3600s"  # a scheduled session: the plan's 1h
    through_sdk(body, "gemini_generate_content", model=resp.model_id)
    check_gemini_cached_content(resp, body)


def test_bedrock_body_through_botocore(stub, ids):
    tenant, session = ids
    fmt = pb.PROVIDER_FORMAT_BEDROCK_CONVERSE
    plan_for(stub, tenant, session, fmt)
    resp = stub.Build(build(tenant, session, items(), fmt))
    body = json.loads(resp.provider_body_json)
    assert body["modelId"] == resp.model_id == BEDROCK_MODEL
    texts = [b["text"] for b in body["system"] if "text" in b]
    assert "\n\n".join(texts) == "\n\n".join(b.text for b in resp.request.prefix_blocks)
    specs = [t["toolSpec"] for t in body["toolConfig"]["tools"] if "toolSpec" in t]
    assert [t["name"] for t in specs] == [
        "clock__now", "context__update_working_state", "tool__call", "web__fetch"]
    blocks = [*body["system"], *body["toolConfig"]["tools"],
              *(b for m in body["messages"] for b in m["content"])]
    points = sum("cachePoint" in b for b in blocks)
    assert 1 <= points <= BEDROCK_MAX_CACHE_POINTS
    # Anthropic's thinking is not Bedrock's reasoningContent; OpenAI's means nothing here
    assert "gAAAAB-opaque" not in resp.provider_body_json
    through_sdk(body, "bedrock_converse")


CALL_ID_LIMITS = {"openai_responses": RESPONSES_CALL_ID_MAX,
                  "openai_chat_completions": CHAT_CALL_ID_MAX, "bedrock_converse": 64}


@pytest.mark.parametrize("fmt", list(FORMATS), ids=list(FORMATS.values()))
@pytest.mark.parametrize("length", [40, 48, 70])
def test_a_call_id_its_provider_refuses_never_reaches_a_body(stub, ids, fmt, length):
    """Checkpoints take call ids up to 256 characters; providers take fewer (Chat Completions
    40, Responses and Bedrock 64). Build either refuses the format (INVALID_ARGUMENT naming
    the provider format) or sends ids the provider takes, still paired."""
    tenant, session = ids
    name = FORMATS[fmt]
    call_id = ("call_" + "AbC123xyz9" * 7)[:length]
    entries = [item("u1", 1, user=pb.UserMessage(text="Fetch it.")),
               item("c1", 2, tool_calls=pb.ToolCalls(calls=[pb.ToolCall(
                   call_id=call_id, name="web.fetch",
                   arguments_json='{"url":"https://example.com"}')])),
               item("r1", 3, trust=pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED, tool_result=pb.ToolResult(
                   call_id=call_id, tool_name="web.fetch", content="Example Domain."))]
    plan_for(stub, tenant, session, fmt)
    try:
        resp = stub.Build(build(tenant, session, entries, fmt))
    except grpc.RpcError as err:
        f = failure(err)
        assert f.code is grpc.StatusCode.INVALID_ARGUMENT, f
        assert f.reason == "PROVIDER_FORMAT_UNRENDERABLE" and f.metadata["provider_format"] == name
        assert length > CALL_ID_LIMITS.get(name, 256), f"{name} refused a {length}-character id"
        # the call and its result, each at its own field
        assert list(f.violations) == ["checkpoint.items[1].tool_calls.calls[0].call_id",
                                      "checkpoint.items[2].tool_result.call_id"], f.violations
        return
    body = json.loads(resp.provider_body_json)
    assert tool_pairs.body_problems(resp.provider_body_json, fmt) == []
    sent = call_ids(body, name)
    assert len(sent) == 1
    assert sent[0] is None or len(sent[0]) <= CALL_ID_LIMITS.get(name, 256), (
        f"{name} sends a {len(sent[0])}-character call id; the provider takes at most "
        f"{CALL_ID_LIMITS[name]}")
    through_sdk(body, name, model=resp.model_id)


REPLAYS = {
    "gemini signature": (pb.PROVIDER_FORMAT_GEMINI_GENERATE_CONTENT, "google",
                         {"thoughtSignature": "c2lnbmF0dXJlLWJ5dGVz"}, True),
    "gemini signature not base64": (pb.PROVIDER_FORMAT_GEMINI_GENERATE_CONTENT, "google",
                                    {"thoughtSignature": "not base64 at all!"}, False),
    "bedrock reasoning text": (pb.PROVIDER_FORMAT_BEDROCK_CONVERSE, "bedrock",
                               {"reasoningContent": {"reasoningText": {
                                   "text": "Both pages.", "signature": "c2ln"}}}, True),
    "bedrock redacted reasoning": (pb.PROVIDER_FORMAT_BEDROCK_CONVERSE, "bedrock",
                                   {"reasoningContent": {"redactedContent": "cmVkYWN0ZWQ="}},
                                   True),
    "bedrock reasoning of unknown shape": (pb.PROVIDER_FORMAT_BEDROCK_CONVERSE, "bedrock",
                                           {"reasoningContent": {"thinking": "x"}}, False),
    "anthropic block that is not thinking": (pb.PROVIDER_FORMAT_ANTHROPIC_MESSAGES, "anthropic",
                                             {"type": "text", "text": "x"}, False),
    "anthropic thinking": (pb.PROVIDER_FORMAT_ANTHROPIC_MESSAGES, "anthropic",
                           {"type": "thinking", "thinking": "Both pages.", "signature": "c2ln"},
                           True),
    "anthropic redacted thinking": (pb.PROVIDER_FORMAT_ANTHROPIC_MESSAGES, "anthropic",
                                    {"type": "redacted_thinking", "data": "cmVkYWN0ZWQ="}, True),
    # Anthropic refuses cache_control on a thinking block, and any key it never returns
    "anthropic thinking with cache_control": (
        pb.PROVIDER_FORMAT_ANTHROPIC_MESSAGES, "anthropic",
        {"type": "thinking", "thinking": "x", "signature": "c2ln",
         "cache_control": {"type": "ephemeral"}}, False),
    "anthropic redacted thinking with a key of its own": (
        pb.PROVIDER_FORMAT_ANTHROPIC_MESSAGES, "anthropic",
        {"type": "redacted_thinking", "data": "cmVkYWN0ZWQ=", "note": "x"}, False),
    "openai item that is not reasoning": (pb.PROVIDER_FORMAT_OPENAI_RESPONSES, "openai",
                                          {"type": "message", "content": []}, False),
}


@pytest.mark.parametrize("case", list(REPLAYS))
def test_replayed_reasoning_reaches_its_sdk_as_the_model_gave_it(stub, ids, case):
    """A reasoning item of the format's own provider goes back before the calls it led to.
    Build refuses a payload the provider would refuse (INVALID_ARGUMENT naming the format and
    the item's field), and sends any other in a body whose SDK sends the payload's bytes
    unchanged (an SDK passes a key it does not know, so a refusal is Build's): a Gemini thought
    signature is base64 bytes, a Bedrock ``redactedContent`` a blob that boto3 encodes
    itself."""
    fmt, provider, payload, valid = REPLAYS[case]
    tenant, session = ids
    name = FORMATS[fmt]
    entries = [item("u1", 1, user=pb.UserMessage(text="Fetch it.")),
               item("g1", 2, reasoning=pb.ReasoningItem(provider=provider,
                                                        opaque=json.dumps(payload).encode())),
               item("c1", 3, tool_calls=pb.ToolCalls(calls=[
                   pb.ToolCall(call_id="call-1", name="web.fetch", arguments_json="{}"),
                   pb.ToolCall(call_id="call-2", name="web.fetch", arguments_json="{}")])),
               item("r2", 4, trust=pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED, tool_result=pb.ToolResult(
                   call_id="call-2", tool_name="web.fetch", content="B.")),
               item("r1", 5, trust=pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED, tool_result=pb.ToolResult(
                   call_id="call-1", tool_name="web.fetch", content="A."))]
    plan_for(stub, tenant, session, fmt)
    try:
        resp = stub.Build(build(tenant, session, entries, fmt))
    except grpc.RpcError as err:
        f = failure(err)
        assert not valid, f"{case}: refused: {f.message}"
        assert f.code is grpc.StatusCode.INVALID_ARGUMENT
        assert f.reason == "PROVIDER_FORMAT_UNRENDERABLE" and f.metadata["provider_format"] == name
        # the item's own field, at its position in the checkpoint
        assert list(f.violations) == ["checkpoint.items[1].reasoning.opaque"], f.violations
        return
    assert valid, f"{case}: rendered, but the provider would refuse it"
    body = json.loads(resp.provider_body_json)
    if name == "bedrock_converse":  # verbatim, ahead of the calls it led to
        turn = next(m["content"] for m in body["messages"] if m["role"] == "assistant")
        assert turn[0] == payload and "toolUse" in turn[1], turn
    elif name == "anthropic_messages":  # verbatim, ahead of the calls it led to
        turn = next(m["content"] for m in body["messages"] if m["role"] == "assistant")
        assert turn[0] == payload and turn[1]["type"] == "tool_use", turn
    else:  # the signature goes back on the first call it led to
        turn = next(c["parts"] for c in body["contents"] if c["role"] == "model")
        assert turn[0]["thoughtSignature"] == payload["thoughtSignature"], turn
        assert "functionCall" in turn[0] and "thoughtSignature" not in turn[1], turn
    assert tool_pairs.body_problems(resp.provider_body_json, fmt) == []
    through_sdk(body, name, model=resp.model_id)


def test_the_sdk_gates_refuse_what_the_providers_refuse():
    """The strict checks are not vacuous: a misspelled field, a wrong type, a missing required
    field and a bad name are each refused."""
    chat = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}
    assert chat_typed_problems(chat) == []
    assert chat_typed_problems({**chat, "prompt_cache_keys": "k"})
    assert chat_typed_problems({**chat, "messages": [{"role": "user", "contents": "hi"}]})
    assert chat_typed_problems({**chat, "messages": [
        {"role": "tool", "content": "x"}]}), "a tool message needs its tool_call_id"
    assert chat_typed_problems({**chat, "max_completion_tokens": "9"})
    assert chat_typed_problems({**chat, "prompt_cache_key": "k" * 65})
    assert chat_typed_problems({**chat, "messages": [
        {"role": "assistant", "tool_calls": [{"id": "c" * 41, "type": "function",
                                              "function": {"name": "f", "arguments": "{}"}}]}]})
    assert responses_limit_problems({"input": [{"type": "function_call", "call_id": "c" * 65}]})
    gemini = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}],
              "systemInstruction": {"parts": [{"text": "Be brief."}]}}
    gemini_typed(gemini)
    for bad in ({**gemini, "system_instructions": {}},
                {**gemini, "contents": [{"role": "user", "parts": [{"txt": "hi"}]}]},
                {**gemini, "generationConfig": {"maxOutputToken": 5}}):
        with pytest.raises((AssertionError, ValueError)):
            gemini_typed(bad)
    bedrock = {"modelId": BEDROCK_MODEL,
               "messages": [{"role": "user", "content": [{"text": "hi"}]}]}
    assert bedrock_problems(bedrock) == []
    assert bedrock_problems({**bedrock, "toolConfig": {"tools": [{"toolSpec": {
        "name": "web.fetch", "inputSchema": {"json": {"type": "object"}}}}]}})
    assert bedrock_problems({**bedrock, "messages": [{"role": "user", "content": [
        {"text": "hi", "cachePoint": {"type": "default"}}]}]})
    assert bedrock_problems({**bedrock, "system": [{"text": " "}]})
    assert bedrock_problems({**bedrock, "sytem": []})


def unrenderable(stub: Any, request: pb.BuildRequest) -> dict[str, str]:
    """The field violations of a Build refused PROVIDER_FORMAT_UNRENDERABLE in the format it
    asked."""
    with pytest.raises(grpc.RpcError) as err:
        stub.Build(request)
    f = failure(err.value)
    assert f.code is grpc.StatusCode.INVALID_ARGUMENT
    assert f.reason == "PROVIDER_FORMAT_UNRENDERABLE"
    assert f.metadata["provider_format"] == FORMATS[request.provider_format]
    return f.violations


def test_a_call_id_anthropic_refuses_is_refused_at_build(stub, ids):
    """Anthropic answers 400 to a tool_use id outside ^[a-zA-Z0-9_-]+$, which a session routed
    from another provider carries ("functions.web_fetch:0"); the body was sent as it was.
    The refusal names the call and its result, each at its own field in the checkpoint."""
    tenant, session = ids
    entries = [item("u1", 1, user=pb.UserMessage(text="Fetch it.")),
               item("c1", 2, tool_calls=pb.ToolCalls(calls=[
                   pb.ToolCall(call_id="call-0", name="web.fetch", arguments_json="{}"),
                   pb.ToolCall(call_id="functions.web_fetch:0", name="web.fetch",
                               arguments_json="{}")])),
               item("r0", 3, trust=pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED, tool_result=pb.ToolResult(
                   call_id="call-0", tool_name="web.fetch", content="A.")),
               item("r1", 4, trust=pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED, tool_result=pb.ToolResult(
                   call_id="functions.web_fetch:0", tool_name="web.fetch", content="B."))]
    plan_for(stub, tenant, session, pb.PROVIDER_FORMAT_ANTHROPIC_MESSAGES)
    violations = unrenderable(stub, build(tenant, session, entries,
                                          pb.PROVIDER_FORMAT_ANTHROPIC_MESSAGES))
    assert list(violations) == ["checkpoint.items[1].tool_calls.calls[1].call_id",
                                "checkpoint.items[3].tool_result.call_id"], violations
    assert all("'functions.web_fetch:0'" in v for v in violations.values()), violations
    # Bedrock takes it, and the neutral request is always there
    for fmt in (pb.PROVIDER_FORMAT_BEDROCK_CONVERSE, pb.PROVIDER_FORMAT_NONE):
        stub.Build(build(tenant, session, entries, fmt))


@pytest.mark.parametrize("fmt", [pb.PROVIDER_FORMAT_ANTHROPIC_MESSAGES,
                                 pb.PROVIDER_FORMAT_BEDROCK_CONVERSE])
def test_white_space_the_model_wrote_is_no_text_block_and_markers_stay(stub, ids, fmt):
    """An assistant message of white space only ("\\n\\n" before a call) became a text block
    Anthropic refuses (with the history marker on it) and failed Bedrock's Build INTERNAL; an
    item that renders nothing took the run marker out of the body."""
    tenant, session = ids
    entries = [item("u0", 1, run="run-0", user=pb.UserMessage(text="Hi.")),
               item("a0", 2, run="run-0", assistant=pb.AssistantMessage(text="\n\n")),
               item("u1", 3, user=pb.UserMessage(text="Fetch it.")),
               item("c1", 4, tool_calls=pb.ToolCalls(calls=[pb.ToolCall(
                   call_id="call-1", name="web.fetch", arguments_json="{}")])),
               item("r1", 5, trust=pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED, tool_result=pb.ToolResult(
                   call_id="call-1", tool_name="web.fetch", content="A.")),
               item("a1", 6, assistant=pb.AssistantMessage(text=" ")),
               item("u2", 7, user=pb.UserMessage(text="And?"))]
    plan_for(stub, tenant, session, fmt)
    resp = stub.Build(build(tenant, session, entries, fmt))
    body = json.loads(resp.provider_body_json)
    texts = [b.get("text") for m in body["messages"] for b in m["content"] if "text" in b]
    assert all(t.strip() for t in texts), texts
    assert tool_pairs.body_problems(resp.provider_body_json, fmt) == []
    history = [b for b in resp.cache_breakpoints if b.through_item]
    marks = sum(1 for m in body["messages"] for b in m["content"]
                if "cache_control" in b or "cachePoint" in b)
    assert marks == len(history) >= 1, (marks, [b.through_item for b in history])


# MCP servers and zod write a union as alternatives at the schema's top level; Claude answers
# 400 "input_schema does not support oneOf, allOf, or anyOf at the top level" to every request
# that defines such a tool, through Anthropic's API and Bedrock's alike.
UNION_SCHEMA = {"type": "object", "properties": {"id": {"type": "string"},
                                                  "path": {"type": "string"}}}


def _union_catalog(keyword: str) -> list[pb.ToolSpec]:
    tools = catalog()
    schema = {**UNION_SCHEMA, keyword: [{"required": ["id"]}, {"required": ["path"]}]}
    tools[0].input_schema_json = json.dumps(schema)
    return tools


@pytest.mark.parametrize("keyword", ["anyOf", "oneOf", "allOf"])
def test_a_schema_with_alternatives_at_its_top_level_never_reaches_claude(stub, ids, db,
                                                                          keyword):
    tenant, session = ids
    # planned for a Claude model: refused at Plan, at the tool's schema, and nothing written
    for fmt in (pb.PROVIDER_FORMAT_ANTHROPIC_MESSAGES, pb.PROVIDER_FORMAT_BEDROCK_CONVERSE):
        model = pb.ModelSpec(model_id=MODELS[fmt])
        if fmt == pb.PROVIDER_FORMAT_BEDROCK_CONVERSE:
            model.capabilities.context_window = 200_000
            model.capabilities.output_reserve = 8_192
        with pytest.raises(grpc.RpcError) as err:
            stub.Plan(plan_request(tenant, session, model=model,
                                   tool_catalog=_union_catalog(keyword)))
        f = failure(err.value)
        assert f.code is grpc.StatusCode.INVALID_ARGUMENT and f.reason == "INVALID_ARGUMENT"
        why = f.violations["tool_catalog[0].input_schema_json"]
        assert "'web.fetch'" in why and keyword in why and FORMATS[fmt] in why
        assert db.counts(tenant) == {"sessions": 0, "plans": 0, "context_events": 0}
    # planned for OpenAI: the plan stands, and a Build asking Anthropic's format is refused
    stub.Plan(plan_request(tenant, session, model=pb.ModelSpec(model_id="gpt-5"),
                           tool_catalog=_union_catalog(keyword)))
    entries = items()
    violations = unrenderable(stub, build(tenant, session, entries,
                                          pb.PROVIDER_FORMAT_ANTHROPIC_MESSAGES))
    assert "'web.fetch'" in violations["provider_format"]
    # the other formats send the schema as it is (Bedrock's too: the model is no Claude)
    for fmt in (pb.PROVIDER_FORMAT_OPENAI_RESPONSES, pb.PROVIDER_FORMAT_OPENAI_CHAT_COMPLETIONS,
                pb.PROVIDER_FORMAT_GEMINI_GENERATE_CONTENT, pb.PROVIDER_FORMAT_BEDROCK_CONVERSE):
        body = stub.Build(build(tenant, session, entries, fmt)).provider_body_json
        assert f'"{keyword}":[{{"required":["id"]}}' in body, fmt
    # a schema holding alternatives under a property is Claude's to take
    nested = catalog()
    nested[0].input_schema_json = json.dumps({"type": "object", "properties": {
        "target": {keyword: [{"type": "string"}, {"type": "integer"}]}}})
    other = session + "-nested"
    stub.Plan(plan_request(tenant, other, tool_catalog=nested))
    stub.Build(build(tenant, other, entries, pb.PROVIDER_FORMAT_ANTHROPIC_MESSAGES))
