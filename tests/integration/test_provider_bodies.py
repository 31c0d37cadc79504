"""Provider-ready bodies through the real server, handed to the official SDKs.

Build returns ``provider_body_json``; the parsed body goes to ``anthropic``'s
``messages.create`` and ``openai``'s ``responses.create`` unchanged. Those SDK versions send
through ``httpx2``: a mock transport captures the request and answers with a minimal valid
response, so nothing leaves the process. The SDKs accept the body (no TypeError or validation
error for an unknown or missing parameter) and send exactly the body's JSON; our structural
validator accepts it too.
"""

from __future__ import annotations

import json
import warnings
from typing import Any

import anthropic
import grpc
import httpx2
import openai
import pytest
from context_engine.domain import providers
from context_engine.v1 import context_engine_pb2 as pb

from tests.integration.requests import build_request, catalog, failure, item, plan_request
from tests.support import tool_schemas

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

    capture = Capture({"id": "msg_1", "type": "message", "role": "assistant",
                       "model": body["model"], "content": [{"type": "text", "text": "ok"}],
                       "stop_reason": "end_turn", "stop_sequence": None,
                       "usage": {"input_tokens": 1, "output_tokens": 1}})
    with httpx2.Client(transport=httpx2.MockTransport(capture)) as http:
        client = anthropic.Anthropic(api_key="test-key", http_client=http, max_retries=0)
        with warnings.catch_warnings():  # the SDK's notice about the model's end of life
            warnings.simplefilter("ignore", DeprecationWarning)
            message = client.messages.create(**body)
    assert message.content[0].text == "ok"
    assert capture.requests[0].url.path == "/v1/messages"
    assert capture.sent == body


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

    capture = Capture({"id": "resp_1", "object": "response", "created_at": 0,
                       "model": body["model"], "status": "completed", "output": [],
                       "parallel_tool_calls": True, "tool_choice": "auto", "tools": []})
    with httpx2.Client(transport=httpx2.MockTransport(capture)) as http:
        client = openai.OpenAI(api_key="test-key", http_client=http, max_retries=0)
        response = client.responses.create(**body)
    assert response.id == "resp_1"
    assert capture.requests[0].url.path == "/v1/responses"
    assert capture.sent == body


def test_without_a_format_no_body_is_rendered(stub, ids):
    tenant, session = ids
    stub.Plan(plan_request(tenant, session))
    assert stub.Build(build_request(tenant, session, items())).provider_body_json == ""


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


def test_tool_schemas_reach_both_sdks_without_titles_or_empty_defaults(stub, ids):
    """A pydantic-shaped schema: the bodies carry it without title annotations and empty
    defaults (and with everything else), both SDKs send exactly that, and the request's own
    tool definition keeps the full schema the plan pinned."""
    search = pb.ToolSpec(name="web.search", description="Search the web.",
                         input_schema_json=json.dumps(tool_schemas.GENERATED),
                         side_effect=pb.SIDE_EFFECT_NETWORK_READ)
    responses = {
        pb.PROVIDER_FORMAT_ANTHROPIC_MESSAGES: {
            "id": "msg_1", "type": "message", "role": "assistant", "model": "m",
            "content": [{"type": "text", "text": "ok"}], "stop_reason": "end_turn",
            "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1}},
        pb.PROVIDER_FORMAT_OPENAI_RESPONSES: {
            "id": "resp_1", "object": "response", "created_at": 0, "model": "m",
            "status": "completed", "output": [], "parallel_tool_calls": True,
            "tool_choice": "auto", "tools": []},
    }
    for n, (fmt, model, key) in enumerate((
            (pb.PROVIDER_FORMAT_ANTHROPIC_MESSAGES, "claude-sonnet-4-5", "input_schema"),
            (pb.PROVIDER_FORMAT_OPENAI_RESPONSES, "gpt-5", "parameters"))):
        tenant, session = ids[0], f"{ids[1]}-{n}"
        stub.Plan(plan_request(tenant, session, model=pb.ModelSpec(model_id=model),
                               tool_catalog=[*catalog(), search]))
        resp = stub.Build(build(tenant, session, items(), fmt))
        definition = next(t for t in resp.request.tools if t.name == "web.search")
        assert json.loads(definition.input_schema_json) == tool_schemas.GENERATED
        body = json.loads(resp.provider_body_json)
        sent = next(t for t in body["tools"] if t["name"] == "web__search")
        assert sent[key] == tool_schemas.PROVIDER_FORM
        capture = Capture(responses[fmt])
        with httpx2.Client(transport=httpx2.MockTransport(capture)) as http:
            if fmt == pb.PROVIDER_FORMAT_ANTHROPIC_MESSAGES:
                assert providers.validate_anthropic(body) == []
                client = anthropic.Anthropic(api_key="k", http_client=http, max_retries=0)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", DeprecationWarning)
                    client.messages.create(**body)
            else:
                assert providers.validate_openai(body) == []
                openai.OpenAI(api_key="k", http_client=http, max_retries=0).responses.create(
                    **body)
        assert capture.sent == body
