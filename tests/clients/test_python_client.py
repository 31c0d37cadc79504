"""The Python client (clients/python): every RPC through the sync and the asyncio client
against the real server, typed errors, deadlines, the retry policy and bearer metadata (the
last two against a small local gRPC server that fails on purpose and records what it got)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import math
import re
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import context_engine_client
import grpc
import pytest
from context_engine_client import (
    DEFAULT_COMPACT_TIMEOUT,
    DEFAULT_TIMEOUT,
    FORMAT_NAMES,
    AsyncClient,
    Cancelled,
    Client,
    ClientClosed,
    ContextEngineError,
    DeadlineExceeded,
    FieldViolation,
    GeminiCachedContentBodies,
    Internal,
    InvalidArgument,
    NotFound,
    ProviderBodyError,
    ProviderFormat,
    Unavailable,
    formats,
    gemini_cached_content,
    parse_provider_format,
    pb,
    provider_body,
    provider_format_name,
)
from context_engine_client._channel import (
    is_loopback,
    keyed_service_config,
    retry_policy,
    unkeyed_service_config,
)
from google.protobuf.message import Message
from google.rpc import code_pb2, error_details_pb2, status_pb2

REPO = Path(__file__).resolve().parents[2]
SERVICE = "context_engine.v1.ContextEngine"
MODEL = "claude-sonnet-4-5"


# ------------------------------------------------------------------------------ the package

def test_public_names_are_pinned():
    assert context_engine_client.__all__ == [
        "DEFAULT_COMPACT_TIMEOUT", "DEFAULT_TIMEOUT", "FORMAT_NAMES", "Aborted", "AlreadyExists",
        "AnthropicMessagesBody",
        "AsyncClient", "BedrockConverseBody", "BuildStats", "Cancelled", "ChatCompletionsBody",
        "Client", "ClientClosed",
        "ContextEngineError", "DataLoss", "DeadlineExceeded", "FailedPrecondition",
        "FieldViolation", "GeminiCachedContentBodies", "GeminiGenerateContentBody", "Internal",
        "InvalidArgument", "NotFound", "OpenAIResponsesBody", "OutOfRange", "PermissionDenied",
        "ProviderBodyError", "ProviderFormat", "ResourceExhausted", "RetryPolicy",
        "Unauthenticated", "Unavailable", "Unimplemented", "Unknown",
        "anthropic_messages_body", "bedrock_converse_body", "chat_completions_body",
        "gemini_body", "gemini_cached_content", "openai_responses_body",
        "parse_provider_format", "pb", "provider_body", "provider_format_name",
    ]
    # the provider-body helpers are context_engine_client.formats's, all exported
    for name in context_engine_client.formats.__all__:
        assert getattr(context_engine_client, name) is getattr(context_engine_client.formats,
                                                               name), name
    for name in context_engine_client.__all__:
        assert getattr(context_engine_client, name) is not None
    errors = [getattr(context_engine_client, n) for n in context_engine_client.__all__
              if isinstance(getattr(context_engine_client, n), type)
              and issubclass(getattr(context_engine_client, n), ContextEngineError)]
    # one class per non-OK status code, each under the root; ClientClosed is a Cancelled
    assert sorted(e.code.name for e in errors if e not in (ContextEngineError, ClientClosed)
                  ) == sorted(c.name for c in grpc.StatusCode if c is not grpc.StatusCode.OK)
    assert ClientClosed.__mro__[1] is Cancelled


def test_a_reason_that_is_the_codes_own_name_is_said_once():
    """Malformed input's reason is INVALID_ARGUMENT: the message does not repeat it."""
    err = InvalidArgument("checkpoint.items[0].trust: unknown", reason="INVALID_ARGUMENT")
    assert str(err) == "INVALID_ARGUMENT: checkpoint.items[0].trust: unknown"
    assert err.reason == "INVALID_ARGUMENT"
    assert str(NotFound("no such session", reason="SESSION_NOT_FOUND")) == (
        "NOT_FOUND SESSION_NOT_FOUND: no such session")


def test_the_packaged_retry_policy_is_the_documented_one():
    documented = (REPO / "clients" / "retry_service_config.json").read_bytes()
    packaged = (resources.files("context_engine_client") / "retry_service_config.json")
    assert packaged.read_bytes() == documented
    config = json.loads(documented)
    (method,) = config["methodConfig"]
    assert sorted(n["method"] for n in method["name"]) == sorted(
        ["Plan", "GetPlan", "Build", "UpdateWorkingState", "CarryWorkingState",
         "DeleteSession"])
    assert {n["service"] for n in method["name"]} == {SERVICE}
    assert method["retryPolicy"]["retryableStatusCodes"] == ["UNAVAILABLE"]


def test_service_and_client_messages_share_one_descriptor_in_a_process():
    """Both generated modules register context_engine/v1/context_engine.proto in protobuf's
    default pool; identical files share one descriptor, in either import order."""
    for first, second in (("context_engine.v1", "context_engine_client._pb.context_engine.v1"),
                          ("context_engine_client._pb.context_engine.v1", "context_engine.v1")):
        code = (f"from {first} import context_engine_pb2 as a\n"
                f"from {second} import context_engine_pb2 as b\n"
                "assert a.DESCRIPTOR is b.DESCRIPTOR and a.PlanRequest is b.PlanRequest\n"
                "m = b.BuildRequest(tenant_id='t')\n"
                "assert a.BuildRequest.FromString(m.SerializeToString()) == m\n"
                "print('ok')\n")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=60, cwd=REPO)
        assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_construction_checks_its_arguments():
    # an infinite timeout is no deadline to gRPC, and one of 9e9 s overflows into a passed one
    for timeout in (0, -1.0, math.nan, math.inf, 9e9, 1e9 + 1):
        with pytest.raises(ValueError, match="timeout must be positive, finite seconds"):
            Client(target="127.0.0.1:1", timeout=timeout)
    Client(target="127.0.0.1:1", timeout=1e9).close()  # the longest is taken
    with pytest.raises(ValueError, match="go together"):
        Client(target="127.0.0.1:1", client_certificate_chain=b"pem")
    # one non-empty line of printable ASCII: a header value gRPC sends (a non-ASCII token
    # passed construction and failed every call inside gRPC, INTERNAL or untyped)
    for token in ("a\nb", "a\rb", "", "s3cr\u00e9t", "\ufeffs3cret", "s3\tcret", "s3\x00cret"):
        with pytest.raises(ValueError, match="token must be one non-empty line"):
            Client(target="127.0.0.1:1", token=token)
    with pytest.raises(TypeError):
        Client("127.0.0.1:1")  # type: ignore[misc]  # keyword-only
    with Client(target="127.0.0.1:1") as client, pytest.raises(TypeError, match="PlanRequest"):
        client.plan(request=pb.GetPlanRequest())


def test_call_metadata_gRPC_cannot_send_is_refused_before_anything_is_sent(fake):
    """A call's metadata is checked as gRPC would send it: a key of letters, digits, "_", "."
    and "-" (not "grpc-"), a value of printable ASCII unless the key ends in "-bin". Such a
    value went into gRPC and failed there: INTERNAL from the blocking client, an exception
    that is no ContextEngineError from the asyncio one; the server saw no call."""
    state, target = fake
    bad: list[tuple[str, str | bytes]] = [("baggage", "user=Jos\u00e9"), ("x-id", "a\tb"),
                                          ("x id", "1"), ("grpc-timeout", "1S"),
                                          ("x-id", b"r\xe9w"), (":authority", "x")]
    request = pb.GetPlanRequest(tenant_id="t")
    with Client(target=target) as engine:
        for entry in bad:
            with pytest.raises(ValueError, match="call metadata"):
                engine.get_plan(request=request, metadata=[entry])
        engine.get_plan(request=request, metadata=[("X-Request-Id", "r-1"),
                                                   ("trace-bin", b"\x00\xff"),
                                                   ("x-raw", b"raw")])

    async def scenario() -> None:
        async with AsyncClient(target=target) as engine:
            for entry in bad:
                with pytest.raises(ValueError, match="call metadata"):
                    await engine.get_plan(request=request, metadata=[entry])
            await engine.get_plan(request=request, metadata=[("x-request-id", "r-2")])

    asyncio.run(scenario())
    assert state.calls == {"GetPlan": 2}
    assert [m.get("x-request-id") for m in state.metadata] == ["r-1", "r-2"]


# ------------------------------------------------------------------------------ requests

def plan_request(tenant: str, session: str) -> pb.PlanRequest:
    return pb.PlanRequest(
        tenant_id=tenant, session_id=session,
        agent=pb.AgentSpec(agent_id="researcher", version="1", enabled_tools=["web.fetch"],
                           instructions="You research questions and cite your sources."),
        tool_catalog=[pb.ToolSpec(
            name="web.fetch", description="Fetch a web page. Returns its text.",
            input_schema_json='{"type":"object","properties":{"url":{"type":"string"}}}',
            side_effect=pb.SIDE_EFFECT_NETWORK_READ)],
        model=pb.ModelSpec(model_id=MODEL),
        session=pb.SessionSpec(kind=pb.SESSION_KIND_INTERACTIVE))


def items() -> list[pb.ConversationItem]:
    def item(item_id: str, seq: int, run: str, trust: int = pb.TRUST_LEVEL_USER,
             **kind: Any) -> pb.ConversationItem:
        return pb.ConversationItem(id=item_id, sequence=seq, run_id=run, trust=trust, **kind)
    return [
        item("u1", 1, "run-0", user=pb.UserMessage(text="What is example.com?")),
        item("c1", 2, "run-0", tool_calls=pb.ToolCalls(calls=[pb.ToolCall(
            call_id="call-1", name="web.fetch", arguments_json='{"url":"https://example.com"}')])),
        item("r1", 3, "run-0", pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED, tool_result=pb.ToolResult(
            call_id="call-1", tool_name="web.fetch", content="Example Domain. " * 40,
            event_id=3)),
        item("a1", 4, "run-0", assistant=pb.AssistantMessage(text="A demo domain.")),
        item("u2", 5, "run-1", user=pb.UserMessage(text="And example.org?")),
    ]


def checkpoint() -> pb.Checkpoint:
    return pb.Checkpoint(active_run_id="run-1", items=items(),
                         runtime=pb.RuntimeMetadata(current_date="2026-11-29"))


@dataclass
class Results:
    plan: pb.PlanResponse | None = None
    again: pb.PlanResponse | None = None
    got: pb.GetPlanResponse | None = None
    built: pb.BuildResponse | None = None
    usage: pb.ReportUsageResponse | None = None
    updated: pb.UpdateWorkingStateResponse | None = None
    carried: pb.CarryWorkingStateResponse | None = None
    compacted: pb.CompactResponse | None = None
    compacted_again: pb.CompactResponse | None = None
    rotated: pb.RotateResponse | None = None
    rotated_again: pb.RotateResponse | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Requests:
    plan: pb.PlanRequest
    get_plan: pb.GetPlanRequest
    build: pb.BuildRequest
    update: pb.UpdateWorkingStateRequest
    carry: pb.CarryWorkingStateRequest
    compact: pb.CompactRequest
    rotate: pb.RotateRequest


def requests(tenant: str, session: str) -> Requests:
    def objective(seq: int, run: str, text: str) -> pb.WorkingStateEvent:
        return pb.WorkingStateEvent(sequence=seq, run_id=run, transition=pb.WorkingStateTransition(
            user_objective=pb.UserObjective(objective=text)))

    return Requests(
        plan=plan_request(tenant, session),
        get_plan=pb.GetPlanRequest(tenant_id=tenant, session_id=session),
        build=pb.BuildRequest(tenant_id=tenant, session_id=session, checkpoint=checkpoint()),
        # the model's context.update_working_state call, as the provider returned it
        update=pb.UpdateWorkingStateRequest(
            tenant_id=tenant, session_id=session, run_id="run-1", sequence=5,
            transition=pb.WorkingStateTransition(tool_call=pb.WorkingStateToolCall(
                call_id="toolu_01", name="context__update_working_state",
                arguments_json=json.dumps({"objective": "Compare the two domains",
                                           "add_constraints": ["Cite sources"]})))),
        carry=pb.CarryWorkingStateRequest(  # the event at 12 is above the seed: not carried
            tenant_id=tenant, session_id=session, seed_event_sequence=10,
            events=[objective(2, "run-0", "Explain"), objective(12, "run-1", "Later")]),
        compact=pb.CompactRequest(tenant_id=tenant, session_id=session, checkpoint=checkpoint(),
                                  replace_through_sequence=4, reason="budget_pressure",
                                  idempotency_key="compact-1"),
        rotate=pb.RotateRequest(tenant_id=tenant, session_id=session,
                                reason=pb.ROTATION_REASON_OPERATOR, idempotency_key="rotate-1"))


def usage_request(tenant: str, session: str, built: pb.BuildResponse) -> pb.ReportUsageRequest:
    return pb.ReportUsageRequest(
        tenant_id=tenant, session_id=session, epoch=built.epoch,
        estimated_input_tokens=built.estimated_input_tokens,
        estimator_factor=built.estimator_factor, input_tokens=built.estimated_input_tokens,
        cached_tokens=built.prefix_tokens, output_tokens=50, idempotency_key="usage-1")


def check(r: Results, session: str) -> None:
    assert r.plan is not None and r.again is not None and r.got is not None
    assert r.plan.created and r.plan.plan.epoch == 1 and r.plan.plan.session_id == session
    assert not r.again.created and r.again.plan.prefix_sha256 == r.plan.plan.prefix_sha256
    assert r.got.plan.prefix_sha256 == r.plan.plan.prefix_sha256
    assert [b.row for b in r.got.plan.prefix_blocks]  # the rendered prefix comes back
    b = r.built
    assert b is not None and b.prefix_sha256 == r.plan.plan.prefix_sha256 and b.epoch == 1
    assert [m.item_id for m in b.request.messages if m.item_id][-1] == "u2"
    assert {c.class_name for c in b.budget.classes} >= {"history", "tool_results"}
    assert [m.name for m in b.cache_breakpoints][:2] == ["after_system", "after_tools"]
    assert r.usage is not None and r.usage.counted and r.usage.reports >= 1
    assert r.extra["usage_again"].counted is False  # the same key is counted once
    assert r.updated is not None and r.updated.state.objective == "Compare the two domains"
    assert list(r.updated.state.constraints) == ["Cite sources"]
    assert r.updated.change.objective_changed and r.updated.change.constraints_added == 1
    assert r.updated.tool_result.startswith(
        "Working state updated: objective set; 1 constraint added.")
    assert r.carried is not None and r.carried.state.objective == "Explain"
    assert r.carried.events_applied == 1
    c = r.compacted
    assert c is not None and c.compacted and c.summary.replaced_through_sequence == 4
    assert list(c.replaced_item_ids) == ["u1", "c1", "r1", "a1"]
    assert r.compacted_again is not None and not r.compacted_again.compacted
    assert r.compacted_again.summary == c.summary
    assert r.rotated is not None and r.rotated.rotated and r.rotated.plan.epoch == 2
    assert r.rotated.plan.reason == "operator"
    assert r.rotated_again is not None and not r.rotated_again.rotated
    assert r.rotated_again.plan.epoch == 2



@pytest.mark.integration
def test_sync_client_calls_every_rpc(server, ids):
    tenant, session = ids
    req = requests(tenant, session)
    r = Results()
    with Client(target=server.address) as engine:
        r.plan = engine.plan(request=req.plan)
        r.again = engine.plan(request=req.plan, timeout=5)
        r.got = engine.get_plan(request=req.get_plan)
        r.built = engine.build(request=req.build)
        r.usage = engine.report_usage(request=usage_request(tenant, session, r.built))
        r.extra["usage_again"] = engine.report_usage(
            request=usage_request(tenant, session, r.built))
        r.updated = engine.update_working_state(request=req.update)
        r.carried = engine.carry_working_state(request=req.carry)
        r.compacted = engine.compact(request=req.compact)
        r.compacted_again = engine.compact(request=req.compact)
        r.rotated = engine.rotate(request=req.rotate)
        r.rotated_again = engine.rotate(request=req.rotate)
    check(r, session)


@pytest.mark.integration
def test_async_client_calls_every_rpc(server, ids):
    tenant, session = ids
    req = requests(tenant, session)

    async def scenario() -> Results:
        r = Results()
        async with AsyncClient(target=server.address) as engine:
            r.plan = await engine.plan(request=req.plan)
            r.again = await engine.plan(request=req.plan, timeout=5)
            r.got = await engine.get_plan(request=req.get_plan)
            r.built = await engine.build(request=req.build)
            r.usage = await engine.report_usage(request=usage_request(tenant, session, r.built))
            r.extra["usage_again"] = await engine.report_usage(
                request=usage_request(tenant, session, r.built))
            r.updated = await engine.update_working_state(
                request=req.update)
            r.carried = await engine.carry_working_state(
                request=req.carry)
            r.compacted = await engine.compact(request=req.compact)
            r.compacted_again = await engine.compact(
                request=req.compact)
            r.rotated = await engine.rotate(request=req.rotate)
            r.rotated_again = await engine.rotate(request=req.rotate)
        return r

    check(asyncio.run(scenario()), session)


# ------------------------------------------------------------------------------ typed errors

@pytest.mark.integration
def test_unknown_session_is_not_found_with_its_error_info(server, ids):
    tenant, session = ids
    request = pb.GetPlanRequest(tenant_id=tenant, session_id=session)
    with Client(target=server.address) as engine, pytest.raises(NotFound) as sync_err:
        engine.get_plan(request=request)

    async def scenario() -> None:
        async with AsyncClient(target=server.address) as engine:
            await engine.build(request=pb.BuildRequest(tenant_id=tenant, session_id=session,
                                                       checkpoint=checkpoint()))

    with pytest.raises(NotFound) as async_err:
        asyncio.run(scenario())
    for err in (sync_err.value, async_err.value):
        assert isinstance(err, ContextEngineError) and err.code is grpc.StatusCode.NOT_FOUND
        assert err.reason == "SESSION_NOT_FOUND" and err.domain == "context-engine"
        assert err.metadata["session_id"] == session
        assert isinstance(err.__cause__, grpc.RpcError)  # the driver error is chained


def _picklable_in_a_worker(tenant: str) -> None:
    """Raises, in a pool's worker process, an error as the client makes one."""
    raise NotFound("no such session", reason="SESSION_NOT_FOUND", domain="context-engine",
                   metadata={"tenant_id": tenant},
                   field_violations=[FieldViolation(field="session_id", description="x")])


def test_an_error_is_pickled_and_copied_whole() -> None:
    """A process pool hands a worker's error back pickled: it was a TypeError (the metadata's
    read-only view cannot be pickled), its code, reason and metadata lost."""
    import copy
    import pickle

    errors = [NotFound("no such session", reason="SESSION_NOT_FOUND", domain="context-engine",
                       metadata={"session_id": "s-1"},
                       field_violations=[FieldViolation(field="session_id", description="x")],
                       tool_result="try again"),
              ClientClosed(), ContextEngineError("odd", code=grpc.StatusCode.DATA_LOSS)]
    for err in errors:
        for again in (pickle.loads(pickle.dumps(err)), copy.deepcopy(err)):
            assert type(again) is type(err) and repr(again) == repr(err)
            assert (again.code, again.reason, again.domain, dict(again.metadata),
                    again.field_violations, again.tool_result, again.args, str(again)) == (
                err.code, err.reason, err.domain, dict(err.metadata), err.field_violations,
                err.tool_result, err.args, str(err))
            with pytest.raises(TypeError):  # read-only still
                again.metadata["x"] = "y"  # type: ignore[index]
    with futures.ProcessPoolExecutor(1) as pool, pytest.raises(NotFound) as raised:
        pool.submit(_picklable_in_a_worker, "acme").result(60)
    assert (raised.value.reason, dict(raised.value.metadata)) == ("SESSION_NOT_FOUND",
                                                                  {"tenant_id": "acme"})


@pytest.mark.integration
def test_malformed_input_is_invalid_argument_with_every_field_violation(server, ids):
    tenant, _ = ids
    bad = pb.PlanRequest(tenant_id=tenant, agent=pb.AgentSpec(agent_id="a", version="1"),
                         model=pb.ModelSpec(model_id=MODEL))
    with Client(target=server.address) as engine, pytest.raises(InvalidArgument) as err:
        engine.plan(request=bad)
    assert err.value.reason == "INVALID_ARGUMENT"
    assert FieldViolation(field="session_id", description="must not be empty") in (
        err.value.field_violations)


@pytest.mark.integration
def test_a_request_naming_base_items_kept_alone_is_sent_as_it_is(server, ids):
    """A request that names a base itself goes to the service unchanged, even one that sets
    base_items_kept without base_build_id: the service's own refusal comes back, not a local
    ValueError of the incremental machinery."""
    tenant, session = ids
    request = pb.BuildRequest(tenant_id=tenant, session_id=session, checkpoint=checkpoint(),
                              base_items_kept=2)
    with Client(target=server.address) as engine:
        engine.plan(request=plan_request(tenant, session))
        with pytest.raises(InvalidArgument) as sync_err:
            engine.build(request=request)
    assert engine.build_stats.builds == 0

    async def scenario() -> None:
        async with AsyncClient(target=server.address) as engine:
            await engine.build(request=request)

    with pytest.raises(InvalidArgument) as async_err:
        asyncio.run(scenario())
    for err in (sync_err, async_err):
        assert err.value.field_violations == (FieldViolation(
            field="base_items_kept", description="is set without base_build_id"),)


@pytest.mark.integration
def test_max_message_bytes_bounds_what_the_client_receives(server, ids):
    """``max_message_bytes`` is the limit of both directions: a response over it is refused
    by the client's channel (RESOURCE_EXHAUSTED), one under it is read."""
    tenant, session = ids
    request = pb.GetPlanRequest(tenant_id=tenant, session_id=session)
    with Client(target=server.address) as engine:
        engine.plan(request=plan_request(tenant, session))
        got = engine.get_plan(request=request)
    size = got.ByteSize()  # protobuf's own serialized size of the response
    assert request.ByteSize() < 200 < size
    with Client(target=server.address, max_message_bytes=size - 1) as engine, pytest.raises(
            context_engine_client.ResourceExhausted) as err:
        engine.get_plan(request=request)
    assert err.value.reason == ""  # the channel's refusal, not the service's
    with Client(target=server.address, max_message_bytes=size + 64) as engine:
        assert engine.get_plan(request=request) == got


@pytest.mark.integration
def test_a_refused_tool_call_carries_the_tool_result_for_the_model(server, ids):
    tenant, session = ids
    request = pb.UpdateWorkingStateRequest(
        tenant_id=tenant, session_id=session, run_id="run-1", sequence=5,
        transition=pb.WorkingStateTransition(tool_call=pb.WorkingStateToolCall(
            call_id="toolu_02", name="context.update_working_state",
            arguments_json='{"remove_constraints": ["Cite sources"]}')))

    async def scenario() -> None:
        async with AsyncClient(target=server.address) as engine:
            await engine.update_working_state(request=request)

    with Client(target=server.address) as engine:
        engine.plan(request=plan_request(tenant, session))
        with pytest.raises(InvalidArgument) as sync_err:
            engine.update_working_state(request=request)
    with pytest.raises(InvalidArgument) as async_err:
        asyncio.run(scenario())
    for err in (sync_err.value, async_err.value):
        assert err.field_violations == (FieldViolation(
            field="transition.tool_call.arguments_json",
            description="holds an argument that is not a field of this tool"),)
        head, schema = err.tool_result.rsplit("\n", 1)
        # the name the model wrote is not repeated to it: the schema names the fields
        assert "- arguments: holds an argument that is not a field of this tool" in head
        assert "remove_constraints" not in head
        assert json.loads(schema)["additionalProperties"] is False
    # any other failure carries none
    with Client(target=server.address) as engine, pytest.raises(NotFound) as missing:
        engine.get_plan(request=pb.GetPlanRequest(tenant_id=tenant, session_id="no-such"))
    assert missing.value.tool_result == ""


# ------------------------------------------------------------------------------ deadlines

def big_checkpoint() -> pb.Checkpoint:
    """Fresh content (nothing cached) large enough that no Build answers within 5 ms."""
    salt = uuid.uuid4().hex
    conversation = []
    for i in range(150):
        conversation.append(pb.ConversationItem(
            id=f"u{i}", sequence=i + 1, run_id="run-0", trust=pb.TRUST_LEVEL_USER,
            user=pb.UserMessage(text=f"{salt} question {i} " + "lorem ipsum dolor " * 400)))
    conversation.append(pb.ConversationItem(id="now", sequence=1000, run_id="run-1",
                                            trust=pb.TRUST_LEVEL_USER,
                                            user=pb.UserMessage(text="and now?")))
    return pb.Checkpoint(active_run_id="run-1", items=conversation,
                         runtime=pb.RuntimeMetadata(current_date="2026-11-29"))


@pytest.mark.integration
def test_a_tiny_timeout_is_deadline_exceeded(server, ids):
    tenant, session = ids
    request = pb.BuildRequest(tenant_id=tenant, session_id=session, checkpoint=big_checkpoint())
    with Client(target=server.address, timeout=30) as engine:
        engine.plan(request=plan_request(tenant, session))
        with pytest.raises(DeadlineExceeded) as err:
            engine.build(request=request, timeout=0.005)
        assert err.value.code is grpc.StatusCode.DEADLINE_EXCEEDED and err.value.reason == ""

    async def scenario() -> None:
        async with AsyncClient(target=server.address, timeout=0.005) as engine:
            request.checkpoint.CopyFrom(big_checkpoint())
            await engine.build(request=request)

    with pytest.raises(DeadlineExceeded):
        asyncio.run(scenario())


# ------------------------------------------------------------------------------ a local server

@dataclass
class Fake:
    """A ContextEngine that fails the first ``failures`` calls of every method with ``code``
    (and a rich status), or sleeps ``delay`` seconds; it records each call's metadata."""

    failures: int = 0
    code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE
    delay: float = 0.0
    calls: dict[str, int] = field(default_factory=dict)
    metadata: list[dict[str, str]] = field(default_factory=list)
    remaining: dict[str, float | None] = field(default_factory=dict)  # last call's time left
    lock: threading.Lock = field(default_factory=threading.Lock)
    trailer: bytes | None = None  # sent as grpc-status-details-bin in place of a rich status


RESPONSES: dict[str, tuple[type[Message], Callable[[], Message]]] = {
    "Plan": (pb.PlanRequest, lambda: pb.PlanResponse(plan=pb.ContextPlan(epoch=1))),
    "GetPlan": (pb.GetPlanRequest, lambda: pb.GetPlanResponse(plan=pb.ContextPlan(epoch=1))),
    "Build": (pb.BuildRequest, lambda: pb.BuildResponse(epoch=1)),
    "Rotate": (pb.RotateRequest, lambda: pb.RotateResponse(rotated=True)),
    "ReportUsage": (pb.ReportUsageRequest, lambda: pb.ReportUsageResponse(counted=True)),
    "UpdateWorkingState": (pb.UpdateWorkingStateRequest, pb.UpdateWorkingStateResponse),
    "CarryWorkingState": (pb.CarryWorkingStateRequest, pb.CarryWorkingStateResponse),
    "Compact": (pb.CompactRequest, lambda: pb.CompactResponse(compacted=True)),
    "DeleteSession": (pb.DeleteSessionRequest, lambda: pb.DeleteSessionResponse(deleted=True)),
}


@dataclass(frozen=True)
class RichStatus(grpc.Status):
    code: grpc.StatusCode
    details: str
    trailing_metadata: tuple[tuple[str, bytes], ...]


def rich_status(code: grpc.StatusCode, reason: str) -> grpc.Status:
    info = error_details_pb2.ErrorInfo(reason=reason, domain="context-engine",
                                       metadata={"attempt": "failed"})
    status = status_pb2.Status(code=getattr(code_pb2, code.name), message=f"{reason} (fake)")
    status.details.add().Pack(info)
    return RichStatus(code=code, details=status.message,
                   trailing_metadata=(("grpc-status-details-bin", status.SerializeToString()),))


OWN_MESSAGE = "the call's own message"


def handler(fake: Fake, name: str) -> grpc.RpcMethodHandler[Any, Any]:
    request_type, response = RESPONSES[name]

    def behaviour(request: Message, context: grpc.ServicerContext) -> Message:
        with fake.lock:
            fake.calls[name] = fake.calls.get(name, 0) + 1
            n = fake.calls[name]
            fake.metadata.append({k: str(v) for k, v in context.invocation_metadata()})
            fake.remaining[name] = context.time_remaining()
        if fake.delay:
            time.sleep(fake.delay)
        if n <= fake.failures:
            if fake.trailer is not None:
                context.set_trailing_metadata((("grpc-status-details-bin", fake.trailer),))
                context.abort(fake.code, OWN_MESSAGE)
            context.abort_with_status(rich_status(fake.code, "STORE_UNAVAILABLE"))
        return response()

    return grpc.unary_unary_rpc_method_handler(
        behaviour, request_deserializer=request_type.FromString,
        response_serializer=lambda m: m.SerializeToString())


@pytest.fixture
def fake() -> Iterator[tuple[Fake, str]]:
    state = Fake()
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    srv.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        SERVICE, {name: handler(state, name) for name in RESPONSES})])
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    yield state, f"127.0.0.1:{port}"
    srv.stop(0).wait(5)


IDEMPOTENT = {
    "Plan": lambda c: c.plan(request=pb.PlanRequest(tenant_id="t")),
    "GetPlan": lambda c: c.get_plan(request=pb.GetPlanRequest(tenant_id="t")),
    "Build": lambda c: c.build(request=pb.BuildRequest(tenant_id="t")),
    "UpdateWorkingState": lambda c: c.update_working_state(
        request=pb.UpdateWorkingStateRequest(tenant_id="t")),
    "CarryWorkingState": lambda c: c.carry_working_state(
        request=pb.CarryWorkingStateRequest(tenant_id="t")),
    "DeleteSession": lambda c: c.delete_session(
        request=pb.DeleteSessionRequest(tenant_id="t", session_id="s")),
}
KEYED = {
    "Rotate": lambda c, key: c.rotate(request=pb.RotateRequest(tenant_id="t",
                                                               idempotency_key=key)),
    "Compact": lambda c, key: c.compact(request=pb.CompactRequest(tenant_id="t",
                                                                  idempotency_key=key)),
    "ReportUsage": lambda c, key: c.report_usage(request=pb.ReportUsageRequest(
        tenant_id="t", idempotency_key=key)),
}


# Each non-OK status code's class, written out here (not read from the client's table).
CLASS_OF_CODE = {
    "CANCELLED": "Cancelled", "UNKNOWN": "Unknown", "INVALID_ARGUMENT": "InvalidArgument",
    "DEADLINE_EXCEEDED": "DeadlineExceeded", "NOT_FOUND": "NotFound",
    "ALREADY_EXISTS": "AlreadyExists", "PERMISSION_DENIED": "PermissionDenied",
    "RESOURCE_EXHAUSTED": "ResourceExhausted", "FAILED_PRECONDITION": "FailedPrecondition",
    "ABORTED": "Aborted", "OUT_OF_RANGE": "OutOfRange", "UNIMPLEMENTED": "Unimplemented",
    "INTERNAL": "Internal", "UNAVAILABLE": "Unavailable", "DATA_LOSS": "DataLoss",
    "UNAUTHENTICATED": "Unauthenticated",
}


@pytest.mark.parametrize("code", sorted(CLASS_OF_CODE))
def test_each_status_code_raises_its_own_class(fake, code):
    state, target = fake
    state.failures, state.code = 100, grpc.StatusCode[code]  # every attempt fails
    with Client(target=target) as engine, pytest.raises(ContextEngineError) as err:
        engine.get_plan(request=pb.GetPlanRequest(tenant_id="t"))
    assert type(err.value).__name__ == CLASS_OF_CODE[code]
    assert err.value.code is grpc.StatusCode[code]
    assert err.value.reason == "STORE_UNAVAILABLE"  # the fake's rich status, read


@pytest.mark.parametrize("name", sorted(IDEMPOTENT))
def test_idempotent_calls_retry_unavailable(fake, name):
    state, target = fake
    state.failures = 2
    with Client(target=target) as engine:
        IDEMPOTENT[name](engine)
    assert state.calls[name] == 3


@pytest.mark.parametrize("name", sorted(KEYED))
def test_keyed_calls_retry_unavailable_only_with_a_key(fake, name):
    state, target = fake
    state.failures = 1
    with Client(target=target) as engine:
        with pytest.raises(Unavailable) as err:
            KEYED[name](engine, "")
        assert state.calls[name] == 1  # no key: a retry could apply the write twice
        assert err.value.reason == "STORE_UNAVAILABLE" and err.value.metadata == {
            "attempt": "failed"}
        state.calls.clear()
        state.failures = 2
        KEYED[name](engine, "key-1")
    assert state.calls[name] == 3


def test_retries_are_bounded_and_only_for_unavailable(fake):
    state, target = fake
    state.failures = 100
    with Client(target=target) as engine:
        with pytest.raises(Unavailable):
            engine.plan(request=pb.PlanRequest())
        assert state.calls["Plan"] == 4  # maxAttempts of the policy
        with pytest.raises(Unavailable):
            engine.rotate(request=pb.RotateRequest(idempotency_key="k"))
        assert state.calls["Rotate"] == 4
        state.code = grpc.StatusCode.INTERNAL
        with pytest.raises(Internal):
            engine.build(request=pb.BuildRequest())
        assert state.calls["Build"] == 1


def test_async_client_retries_like_the_sync_one(fake):
    state, target = fake
    state.failures = 2

    async def scenario() -> None:
        async with AsyncClient(target=target) as engine:
            await engine.get_plan(request=pb.GetPlanRequest())
            assert (await engine.delete_session(request=pb.DeleteSessionRequest())).deleted
            await engine.compact(request=pb.CompactRequest(idempotency_key="k"))
            with pytest.raises(Unavailable):
                await engine.rotate(request=pb.RotateRequest())

    asyncio.run(scenario())
    assert state.calls == {"GetPlan": 3, "DeleteSession": 3, "Compact": 3, "Rotate": 1}


def status_trailer(code: int, *details: tuple[str, bytes]) -> bytes:
    """A google.rpc.Status with the call's own message and these (type, bytes) details."""
    status = status_pb2.Status(code=code, message=OWN_MESSAGE)
    for name, value in details:
        status.details.add(type_url=f"type.googleapis.com/google.rpc.{name}", value=value)
    return status.SerializeToString()


INFO = error_details_pb2.ErrorInfo(reason="PREFIX_CLASS_OVER_CAP", domain="context-engine",
                                   metadata={"cap": "800"}).SerializeToString()
CORRUPT = b"\xff\xff\xff"  # a field number 0 and a truncated varint: no message reads it
UNREADABLE_TRAILERS = {
    "not a Status": CORRUPT,
    "an ErrorInfo that does not decode": status_trailer(code_pb2.NOT_FOUND,
                                                        ("ErrorInfo", CORRUPT)),
    "a BadRequest that does not decode": status_trailer(
        code_pb2.NOT_FOUND, ("ErrorInfo", INFO), ("BadRequest", CORRUPT)),
    "a LocalizedMessage that does not decode": status_trailer(
        code_pb2.NOT_FOUND, ("ErrorInfo", INFO), ("LocalizedMessage", CORRUPT)),
    "another code's status": status_trailer(code_pb2.FAILED_PRECONDITION, ("ErrorInfo", INFO)),
}


@pytest.mark.parametrize("kind", list(UNREADABLE_TRAILERS))
def test_a_status_trailer_that_cannot_be_read_leaves_the_calls_code_and_message(fake, kind):
    """A grpc-status-details-bin trailer that does not decode (in whole or in one detail), or
    whose code is not the call's, is not read: both clients raise the call's own code as its
    typed error, with the call's message and no reason. A DecodeError escaped the client."""
    state, target = fake
    state.failures, state.code = 100, grpc.StatusCode.NOT_FOUND
    state.trailer = UNREADABLE_TRAILERS[kind]

    def check(err: ContextEngineError) -> None:
        assert type(err) is NotFound and err.code is grpc.StatusCode.NOT_FOUND
        assert (err.message, err.reason, err.domain, dict(err.metadata), err.field_violations,
                err.tool_result) == (OWN_MESSAGE, "", "", {}, (), "")
        assert isinstance(err.__cause__, grpc.RpcError)

    with Client(target=target) as engine:
        with pytest.raises(NotFound) as raised:
            engine.get_plan(request=pb.GetPlanRequest(tenant_id="t"))
        check(raised.value)
        with pytest.raises(NotFound) as raised:  # the incremental path reads the error too
            engine.build(request=pb.BuildRequest(tenant_id="t", session_id="s"))
        check(raised.value)

    async def scenario() -> None:
        async with AsyncClient(target=target) as engine:
            with pytest.raises(NotFound) as raised:
                await engine.get_plan(request=pb.GetPlanRequest(tenant_id="t"))
            check(raised.value)
            with pytest.raises(NotFound) as raised:
                await engine.build(request=pb.BuildRequest(tenant_id="t", session_id="s"))
            check(raised.value)

    asyncio.run(scenario())
    assert state.calls == {"GetPlan": 2, "Build": 2}  # NOT_FOUND is never retried


@pytest.mark.parametrize("info", [
    error_details_pb2.ErrorInfo(reason="A_REASON_NOT_YET_KNOWN", domain="context-engine",
                                metadata={"k": "v"}),
    None])
def test_a_status_with_a_new_reason_or_no_error_info_is_read_as_sent(fake, info):
    """A reason the client does not know is the caller's to read, as it came; a status with
    no ErrorInfo has an empty reason; either way the call's typed error."""
    state, target = fake
    state.failures, state.code = 100, grpc.StatusCode.FAILED_PRECONDITION
    bad = error_details_pb2.BadRequest()
    bad.field_violations.add(field="checkpoint", description="why")
    details = [("BadRequest", bad.SerializeToString())]
    if info is not None:
        details.insert(0, ("ErrorInfo", info.SerializeToString()))
    state.trailer = status_trailer(code_pb2.FAILED_PRECONDITION, *details)
    with Client(target=target) as engine, pytest.raises(
            context_engine_client.FailedPrecondition) as raised:
        engine.get_plan(request=pb.GetPlanRequest(tenant_id="t"))
    err = raised.value
    assert (err.message, err.reason, err.domain, dict(err.metadata)) == (
        (OWN_MESSAGE, "A_REASON_NOT_YET_KNOWN", "context-engine", {"k": "v"}) if info
        else (OWN_MESSAGE, "", "", {}))
    assert err.field_violations == (FieldViolation(field="checkpoint", description="why"),)


def packaged_config() -> dict[str, Any]:
    return json.loads((REPO / "clients" / "retry_service_config.json").read_text())


def test_a_service_config_may_set_a_keyed_write_of_its_own(fake):
    """An entry naming Rotate (here its deadline) keeps its settings on the keyed channel, and
    takes the retry policy there: gRPC refuses a config naming a method twice, which once
    failed every keyed Rotate before it was sent."""
    state, target = fake
    config = packaged_config()
    config["methodConfig"].append({"name": [{"service": SERVICE, "method": "Rotate"}],
                                   "timeout": "30s"})
    state.failures = 2
    with Client(target=target, service_config=json.dumps(config)) as engine:
        engine.rotate(request=pb.RotateRequest(tenant_id="t", idempotency_key="k"))
        assert state.calls["Rotate"] == 3  # sent, and retried under the policy
        state.calls.clear()
        state.failures = 1
        with pytest.raises(Unavailable):  # without a key: not retried
            engine.rotate(request=pb.RotateRequest(tenant_id="t"))
        assert state.calls["Rotate"] == 1
    keyed = json.loads(keyed_service_config(json.dumps(config)))
    named = [n["method"] for m in keyed["methodConfig"] for n in m["name"]]
    assert sorted(named) == sorted(set(named))  # each method named once
    (rotate,) = [m for m in keyed["methodConfig"] if {"service": SERVICE, "method": "Rotate"}
                 in m["name"]]
    assert rotate["timeout"] == "30s" and rotate["retryPolicy"] == (
        config["methodConfig"][0]["retryPolicy"])
    # one named with a hedging policy keeps it alone (gRPC refuses an entry holding both)
    hedging = {"maxAttempts": 2, "hedgingDelay": "0s", "nonFatalStatusCodes": []}
    hedged = packaged_config()
    hedged["methodConfig"].append({"name": [{"service": SERVICE, "method": "Rotate"}],
                                   "hedgingPolicy": hedging})
    (rotate,) = [m for m in json.loads(keyed_service_config(json.dumps(hedged)))["methodConfig"]
                 if {"service": SERVICE, "method": "Rotate"} in m["name"]]
    assert rotate == {"name": [{"service": SERVICE, "method": "Rotate"}],
                      "hedgingPolicy": hedging}
    state.calls.clear()
    state.failures = 0
    with Client(target=target, service_config=json.dumps(hedged)) as engine:
        engine.rotate(request=pb.RotateRequest(tenant_id="t", idempotency_key="k"))
    assert state.calls["Rotate"] >= 1


@pytest.mark.parametrize("name", [{"service": SERVICE}, {}, {"service": ""}])
def test_a_service_wide_retry_policy_never_retries_a_write_without_its_key(fake, name):
    """A config whose retry policy names the whole service (or every service) covers Rotate,
    Compact and ReportUsage too: sent without a key they were retried (4 attempts of one
    Rotate), against "a request without a key is sent once". With its key, a write is still
    retried on the keyed channel."""
    state, target = fake
    policy = packaged_config()["methodConfig"][0]["retryPolicy"]
    config = {"methodConfig": [{"name": [name], "retryPolicy": policy, "timeout": "20s"}]}
    state.failures = 2
    with Client(target=target, service_config=json.dumps(config)) as engine:
        with pytest.raises(Unavailable):
            engine.rotate(request=pb.RotateRequest(tenant_id="t"))
        assert state.calls["Rotate"] == 1
        state.calls.clear()
        state.failures = 2
        engine.rotate(request=pb.RotateRequest(tenant_id="t", idempotency_key="k"))
        assert state.calls["Rotate"] == 3
        state.calls.clear()
        state.failures = 2
        engine.plan(request=pb.PlanRequest(tenant_id="t"))  # everything else: as configured
        assert state.calls["Plan"] == 3
    unkeyed = json.loads(unkeyed_service_config(json.dumps(config)))
    (writes,) = [m for m in unkeyed["methodConfig"] if m["name"][0].get("method")]
    assert writes == {"name": [{"service": SERVICE, "method": m}
                               for m in ("Compact", "ReportUsage", "Rotate")],
                      "timeout": "20s"}  # its other settings kept
    # and on the keyed channel too, under the policy (they were named there with the policy
    # alone: a keyed write lost the entry's deadline, size limits and waitForReady)
    keyed = json.loads(keyed_service_config(json.dumps(config)))
    (writes,) = [m for m in keyed["methodConfig"] if m["name"][0].get("method")]
    assert writes == {"name": [{"service": SERVICE, "method": m}
                               for m in ("Compact", "ReportUsage", "Rotate")],
                      "timeout": "20s", "retryPolicy": policy}
    # a keyed write named with a policy of its own is not retried there either
    named = {"methodConfig": [{"name": [{"service": SERVICE, "method": "Rotate"}],
                               "retryPolicy": policy}]}
    assert json.loads(unkeyed_service_config(json.dumps(named)))["methodConfig"] == [
        {"name": [{"service": SERVICE, "method": "Rotate"}]}]
    assert json.loads(unkeyed_service_config(json.dumps(packaged_config()))) == \
        packaged_config()  # the packaged config names no keyed write
    # nor hedged (grpc-js hedges; the C core here does not, so only the config can tell)
    hedging = {"maxAttempts": 3, "hedgingDelay": "0s", "nonFatalStatusCodes": ["UNAVAILABLE"]}
    hedged = {"methodConfig": [{"name": [name], "hedgingPolicy": hedging}]}
    (writes,) = [m for m in json.loads(unkeyed_service_config(json.dumps(hedged)))[
        "methodConfig"] if m["name"][0].get("method")]
    assert "hedgingPolicy" not in writes


def test_a_service_config_may_retry_nothing(fake):
    state, target = fake
    config = {"methodConfig": [{"name": [{"service": SERVICE}], "timeout": "5s"}]}
    state.failures = 1
    with Client(target=target, service_config=json.dumps(config)) as engine:
        with pytest.raises(Unavailable):
            engine.plan(request=pb.PlanRequest(tenant_id="t"))
        with pytest.raises(Unavailable):
            engine.rotate(request=pb.RotateRequest(tenant_id="t", idempotency_key="k"))
    assert state.calls == {"Plan": 1, "Rotate": 1}
    assert retry_policy(json.dumps(config)) is None
    two = packaged_config()
    two["methodConfig"].append({**two["methodConfig"][0], "name": [
        {"service": SERVICE, "method": "Rotate"}]})
    with pytest.raises(ValueError, match="at most one retryPolicy"):
        Client(target=target, service_config=json.dumps(two))


def test_no_call_reaches_the_server_after_close(fake):
    """Every call after close(), a keyed write and a Build included, raises the client's own
    typed error (a Cancelled) and opens no channel; nothing reaches the server."""
    state, target = fake
    engine = Client(target=target)
    engine.build(request=pb.BuildRequest(tenant_id="t", session_id="s"))
    state.calls.clear()
    stats = engine.build_stats
    engine.close()
    for name, call in [*IDEMPOTENT.items(), *((n, lambda c, k=k: k(c, "key"))
                                              for n, k in KEYED.items())]:
        with pytest.raises(ClientClosed, match="the client is closed") as raised:
            call(engine)
        assert isinstance(raised.value, Cancelled), name
        assert raised.value.code is grpc.StatusCode.CANCELLED and raised.value.reason == ""
    with pytest.raises(ClientClosed):  # the closed client first, as for every call
        engine.build(request=pb.BuildRequest(tenant_id="t", session_id="s"), timeout=-1)
    with pytest.raises(ClientClosed):
        engine.get_plan(request=pb.GetPlanRequest(tenant_id="t"), timeout=-1)
    assert state.calls == {} and engine._keyed is None
    assert engine.build_stats == stats, "a refused Build moved nothing"

    async def scenario() -> None:
        engine = AsyncClient(target=target)
        await engine.close()
        for _name, call in [*IDEMPOTENT.items(), *((n, lambda c, k=k: k(c, "key"))
                                                  for n, k in KEYED.items())]:
            with pytest.raises(ClientClosed):
                await call(engine)
        assert engine._keyed is None
        with pytest.raises(ClientClosed):
            await engine.build(request=pb.BuildRequest(tenant_id="t", session_id="s"),
                               timeout=-1)

    asyncio.run(scenario())
    assert state.calls == {}


def test_a_client_closed_by_another_thread_as_a_call_is_made_raises_the_same_error(fake,
                                                                                  monkeypatch):
    """close() from another thread after the client's own check: grpc's error (ValueError)
    is raised as ClientClosed, and a keyed write opens no channel. (AsyncClient awaits
    nothing between its check and the call, so close() cannot come between them.)"""
    state, target = fake
    for call in (lambda c: c.get_plan(request=pb.GetPlanRequest(tenant_id="t")),
                 lambda c: c.rotate(request=pb.RotateRequest(tenant_id="t",
                                                             idempotency_key="k"))):
        engine = Client(target=target)
        stub = engine._stub

        def closing(method: str, request: Message, engine: Client = engine,
                    stub: Any = stub) -> Any:
            engine.close()
            return stub(method, request)

        monkeypatch.setattr(engine, "_stub", closing)
        with pytest.raises(ClientClosed, match="nothing was sent"):
            call(engine)
        assert state.calls == {} and engine._keyed is None


def test_an_async_close_cancels_both_channels_calls_after_one_grace(fake):
    """close(grace) cancels what is still in flight after ``grace`` seconds, on the keyed
    channel as on the other: closed one after the other, a keyed write in flight was
    cancelled a grace later, and close() took twice its grace."""
    state, target = fake
    state.delay = 4.0

    async def scenario() -> tuple[float, list[tuple[str, float]]]:
        engine = AsyncClient(target=target, timeout=30)
        began = time.monotonic()
        ended: list[tuple[str, float]] = []

        async def run(name: str, call: Awaitable[Any]) -> None:
            with pytest.raises(ClientClosed):
                await call
            ended.append((name, time.monotonic() - began))

        tasks = [asyncio.ensure_future(run("Plan", engine.plan(request=pb.PlanRequest(
                     tenant_id="t")))),
                 asyncio.ensure_future(run("Rotate", engine.rotate(request=pb.RotateRequest(
                     tenant_id="t", idempotency_key="k"))))]
        while sum(state.calls.values()) < 2:
            await asyncio.sleep(0.01)
        closing = time.monotonic()
        await engine.close(grace=1.0)
        took = time.monotonic() - closing
        await asyncio.gather(*tasks)
        return took, ended

    took, ended = asyncio.run(scenario())
    assert sorted(name for name, _ in ended) == ["Plan", "Rotate"]
    assert 0.9 < took < 1.8, took  # one grace, not two
    assert all(at < 3.0 for _, at in ended), ended


def test_a_call_in_flight_when_the_client_closes_raises_client_closed(fake):
    """close() cancels the calls in flight: each raises ClientClosed saying it may have
    reached the service (not grpc's CANCELLED, and on AsyncClient not the caller's own
    asyncio.CancelledError); a task its caller cancels is still cancelled."""
    state, target = fake
    state.delay = 1.0
    engine = Client(target=target)
    raised: list[BaseException] = []

    def call() -> None:
        try:
            engine.get_plan(request=pb.GetPlanRequest(tenant_id="t"))
        except BaseException as err:
            raised.append(err)

    def started(name: str) -> None:
        limit = time.monotonic() + 5
        while not state.calls.get(name) and time.monotonic() < limit:
            time.sleep(0.01)
        assert state.calls.get(name), "the call never reached the server"

    thread = threading.Thread(target=call)
    thread.start()
    started("GetPlan")
    engine.close()
    thread.join(5)
    assert len(raised) == 1 and type(raised[0]) is ClientClosed, raised
    assert "during the call" in str(raised[0])

    async def scenario() -> None:
        engine = AsyncClient(target=target)
        task = asyncio.ensure_future(engine.plan(request=pb.PlanRequest(tenant_id="t")))
        while not state.calls.get("Plan"):
            await asyncio.sleep(0.01)
        await engine.close()
        with pytest.raises(ClientClosed, match="during the call"):
            await task

        engine = AsyncClient(target=target)
        mine = asyncio.ensure_future(engine.build(request=pb.BuildRequest(tenant_id="t")))
        while not state.calls.get("Build"):
            await asyncio.sleep(0.01)
        mine.cancel()
        await engine.close()
        with pytest.raises(asyncio.CancelledError):
            await mine

    asyncio.run(scenario())


def test_compact_waits_on_a_summarizer_so_its_default_deadline_is_longer(fake):
    """Compact's default deadline (60 s) outlasts the service's default summarizer deadline
    (20 s), so a slow summarizer answers SUMMARIZER_UNAVAILABLE, not DEADLINE_EXCEEDED; every
    other call keeps the client's timeout, and a call's own timeout wins."""
    state, target = fake
    with Client(target=target) as engine:
        engine.compact(request=pb.CompactRequest())
        engine.build(request=pb.BuildRequest())
        # the server's view of a deadline (grpc-timeout) may be rounded up by a little
        assert 55 < state.remaining["Compact"] < 61 and DEFAULT_COMPACT_TIMEOUT == 60
        assert 5 < state.remaining["Build"] < 11 and DEFAULT_TIMEOUT == 10
        engine.compact(request=pb.CompactRequest(), timeout=5)
        assert state.remaining["Compact"] < 6
    with Client(target=target, timeout=90, compact_timeout=120) as engine:
        engine.compact(request=pb.CompactRequest())
        assert 115 < state.remaining["Compact"] < 121
    with pytest.raises(ValueError, match="timeout"):
        Client(target=target, compact_timeout=0)

    async def scenario() -> None:
        async with AsyncClient(target=target, compact_timeout=30) as engine:
            await engine.compact(request=pb.CompactRequest())

    asyncio.run(scenario())
    assert 25 < state.remaining["Compact"] < 31


def test_a_slow_answer_is_deadline_exceeded(fake):
    state, target = fake
    state.delay = 0.5
    with Client(target=target, timeout=0.05) as engine, pytest.raises(DeadlineExceeded):
        engine.plan(request=pb.PlanRequest())

    async def scenario(call: Callable[[AsyncClient], Awaitable[Any]]) -> None:
        async with AsyncClient(target=target) as engine:
            await call(engine)

    with pytest.raises(DeadlineExceeded):
        asyncio.run(scenario(lambda e: e.build(request=pb.BuildRequest(), timeout=0.05)))


@pytest.mark.parametrize(("target", "local"), [
    ("127.0.0.1:50051", True), ("127.8.9.10:1", True), ("localhost:50051", True),
    ("LOCALHOST:1", True), ("[::1]:50051", True), ("dns:///localhost:50051", True),
    ("dns:127.0.0.1:1", True), ("ipv4:127.0.0.1:1,127.0.0.2:2", True), ("ipv6:[::1]:5", True),
    ("ipv6:::1", True), ("unix:/tmp/ce.sock", True), ("unix-abstract:ce", True),
    ("127.0.0.1", True),
    ("10.0.0.5:50051", False), ("0.0.0.0:50051", False), ("example.com:443", False),
    ("dns:///example.com:443", False), ("localhost.example.com:1", False),
    ("ipv4:127.0.0.1:1,10.0.0.1:2", False), ("[2001:db8::1]:443", False), ("dns:///", False),
    ("128.0.0.1:1", False), ("[::ffff:10.0.0.1]:1", False)])
def test_which_targets_are_on_this_machine(target, local):
    assert is_loopback(target) is local


def test_a_token_leaves_the_machine_in_plaintext_only_when_tls_false_says_so():
    """Unset tls: plaintext, and a token to a target off this machine is refused before any
    channel is made; tls=True or a certificate encrypts it; tls=False sends it as asked."""
    with pytest.raises(ValueError, match=r"the token would travel in plaintext to "
                                         r"10\.0\.0\.5:50051.*tls=True.*tls=False"):
        Client(target="10.0.0.5:50051", token="s3cret")
    for ok in ({"token": "s3cret", "tls": False}, {"token": "s3cret", "tls": True},
               {"token": "s3cret", "root_certificates": b"-----BEGIN CERTIFICATE-----"},
               {}, {"tls": False}):
        Client(target="10.0.0.5:50051", **ok).close()
    Client(target="127.0.0.1:50051", token="s3cret").close()
    Client(target="unix:/tmp/ce.sock", token="s3cret").close()

    async def scenario() -> None:
        with pytest.raises(ValueError, match="the token would travel in plaintext"):
            AsyncClient(target="example.com:443", token="s3cret")
        await AsyncClient(target="example.com:443", token="s3cret", tls=False).close()
        await AsyncClient(target="[::1]:50051", token="s3cret").close()

    asyncio.run(scenario())


@pytest.mark.parametrize("variable", ["http_proxy", "https_proxy", "grpc_proxy",
                                      "GRPC_ADDRESS_HTTP_PROXY"])
def test_a_token_to_this_machine_goes_straight_not_through_a_proxy(fake, monkeypatch, capfd,
                                                                   variable):
    """A proxy named by the environment would carry the plaintext token off the machine:
    a channel carrying a token in plaintext to a loopback target takes no proxy, with tls
    unset and with tls=False alike. Without a token grpc's proxy handling is left as it is."""
    state, target = fake
    proxy = socket.socket()
    proxy.bind(("127.0.0.1", 0))
    proxy.listen(8)
    proxy.settimeout(0.5)
    if variable == "GRPC_ADDRESS_HTTP_PROXY":  # grpc's address-level proxy: host:port
        monkeypatch.setenv(variable, f"127.0.0.1:{proxy.getsockname()[1]}")
        monkeypatch.setenv("GRPC_ADDRESS_HTTP_PROXY_ENABLED_ADDRESSES", "127.0.0.0/8")
    else:
        monkeypatch.setenv(variable, f"http://127.0.0.1:{proxy.getsockname()[1]}")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)

    def proxied() -> bool:
        try:
            conn, _ = proxy.accept()
        except TimeoutError:
            return False
        conn.close()
        return True

    try:
        with Client(target=target, token="s3cret", timeout=5) as engine:
            engine.get_plan(request=pb.GetPlanRequest(tenant_id="t"))
            engine.rotate(request=pb.RotateRequest(tenant_id="t", idempotency_key="k"))
        assert not proxied(), "the token went through the proxy"

        async def scenario() -> None:
            async with AsyncClient(target=target, token="s3cret", timeout=5) as engine:
                await engine.get_plan(request=pb.GetPlanRequest(tenant_id="t"))
                await engine.rotate(request=pb.RotateRequest(tenant_id="t",
                                                             idempotency_key="k2"))

        asyncio.run(scenario())
        assert not proxied(), "the asyncio client's token went through the proxy"
        # and grpc logged nothing about it (an empty proxy address is logged as unparsable)
        assert "http_proxy_mapper" not in capfd.readouterr().err
        assert state.calls == {"GetPlan": 2, "Rotate": 2}
        with Client(target=target, token="s3cret", tls=False, timeout=5) as engine:
            engine.get_plan(request=pb.GetPlanRequest(tenant_id="t"))
        assert not proxied(), "tls=False: the token went through the proxy"
        # without a token, the same channel does take the proxy: the test can fail
        with (Client(target=target, tls=False, timeout=1) as engine,
              pytest.raises(ContextEngineError)):
            engine.get_plan(request=pb.GetPlanRequest(tenant_id="t"))
        assert proxied(), "no token: grpc's own proxy handling"
    finally:
        proxy.close()


def test_the_bearer_token_is_sent_on_every_call(fake):
    state, target = fake
    with Client(target=target, token="s3cret-token") as engine:
        engine.plan(request=pb.PlanRequest())
        engine.rotate(request=pb.RotateRequest())

    async def scenario() -> None:
        async with AsyncClient(target=target, token="async-token") as engine:
            await engine.build(request=pb.BuildRequest())
        async with AsyncClient(target=target) as engine:
            await engine.build(request=pb.BuildRequest())

    asyncio.run(scenario())
    assert [m.get("authorization") for m in state.metadata] == [
        "Bearer s3cret-token", "Bearer s3cret-token", "Bearer async-token", None]


def test_per_call_metadata_reaches_the_server_beside_the_token(fake):
    """Trace context and request ids go per call; the client's token stays the only
    credentials (a call cannot replace it)."""
    state, target = fake
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    with Client(target=target, token="secret-1") as engine:
        engine.build(request=pb.BuildRequest(tenant_id="t"),
                     metadata=[("traceparent", traceparent), ("X-Request-Id", "req-7")])
        engine.rotate(request=pb.RotateRequest(tenant_id="t", idempotency_key="k"),
                      metadata=(("x-request-id", "req-8"),))
        with pytest.raises(ValueError, match="token"):
            engine.plan(request=pb.PlanRequest(), metadata=[("Authorization", "Bearer x")])
    build_md, rotate_md = state.metadata
    assert build_md["traceparent"] == traceparent and build_md["x-request-id"] == "req-7"
    assert build_md["authorization"] == "Bearer secret-1"
    assert rotate_md["x-request-id"] == "req-8"  # the keyed channel carries it too
    assert rotate_md["authorization"] == "Bearer secret-1"
    assert state.calls == {"Build": 1, "Rotate": 1}

    async def scenario() -> None:
        async with AsyncClient(target=target) as engine:
            await engine.get_plan(request=pb.GetPlanRequest(),
                                  metadata=[("x-request-id", "req-9")])

    asyncio.run(scenario())
    assert state.metadata[-1]["x-request-id"] == "req-9"
    assert "authorization" not in state.metadata[-1]


def test_a_request_of_the_wrong_type_is_refused_before_sending(fake):
    state, target = fake
    with Client(target=target) as engine, pytest.raises(TypeError, match="BuildRequest"):
        engine.build(request=pb.PlanRequest())  # type: ignore[arg-type]
    assert state.calls == {}


# ------------------------------------------------------------------------------ provider bodies

BODY_ACCESSORS: dict[str, Callable[[pb.BuildResponse], Any]] = {
    "anthropic_messages": formats.anthropic_messages_body,
    "openai_responses": formats.openai_responses_body,
    "openai_chat_completions": formats.chat_completions_body,
    "gemini_generate_content": formats.gemini_body,
    "bedrock_converse": formats.bedrock_converse_body,
}
# The top-level keys each format's body has for this module's requests (tools, a system
# prompt and a tool call with its result in the history).
BODY_KEYS = {
    "anthropic_messages": {"model", "max_tokens", "system", "messages", "tools"},
    "openai_responses": {"model", "instructions", "input", "prompt_cache_key", "tools"},
    "openai_chat_completions": {"model", "messages", "tools"},
    "gemini_generate_content": {"contents", "systemInstruction", "tools", "generationConfig"},
    "bedrock_converse": {"modelId", "system", "messages", "toolConfig", "inferenceConfig"},
}


def test_format_names_and_values_map_both_ways():
    assert list(FORMAT_NAMES) == list(BODY_ACCESSORS)
    assert ProviderFormat is pb.ProviderFormat
    for name, value in FORMAT_NAMES.items():
        enum_name = "PROVIDER_FORMAT_" + name.upper()
        assert value == ProviderFormat.Value(enum_name)
        assert provider_format_name(value) == name
        for spelling in (name, enum_name, enum_name.lower(), f" {name.upper()} ", int(value)):
            assert parse_provider_format(spelling) == value
    assert parse_provider_format("none") == pb.PROVIDER_FORMAT_NONE
    assert provider_format_name(pb.PROVIDER_FORMAT_UNSPECIFIED) == "unspecified"
    assert provider_format_name(99) == "99"  # a value newer than this build
    for bad in ("gemini", "", "PROVIDER_FORMAT_", 99):
        with pytest.raises(ValueError, match="unknown provider format") as err:
            parse_provider_format(bad)
        assert "openai_chat_completions" in str(err.value)  # it lists the names


def response(fmt: int, body: Any = None, **fields: Any) -> pb.BuildResponse:
    text = body if isinstance(body, str) else json.dumps(body) if body is not None else ""
    return pb.BuildResponse(provider_format=fmt, provider_body_json=text, **fields)


def test_each_accessor_returns_its_format_and_refuses_the_others_without_a_server():
    for name, value in FORMAT_NAMES.items():
        resp = response(value, {"marker": name})
        assert provider_body(resp) == {"marker": name}
        assert BODY_ACCESSORS[name](resp) == {"marker": name}
        assert BODY_ACCESSORS[name](resp) is not BODY_ACCESSORS[name](resp)  # a new dict
        for other, accessor in BODY_ACCESSORS.items():
            if other == name:
                continue
            with pytest.raises(ProviderBodyError) as err:
                accessor(resp)
            assert isinstance(err.value, ValueError)
            assert err.value.expected == FORMAT_NAMES[other] and err.value.actual == value
            message = str(err.value)
            # both formats are named, the expected one first
            assert f"{other} (PROVIDER_FORMAT_{other.upper()})" in message
            assert f"{name} (PROVIDER_FORMAT_{name.upper()})" in message
            assert message.index(other) < message.index(f"(PROVIDER_FORMAT_{name.upper()})")


def test_a_response_without_a_body_is_a_clear_error():
    for resp in (pb.BuildResponse(), response(pb.PROVIDER_FORMAT_NONE)):
        with pytest.raises(ProviderBodyError, match="holds no provider body") as err:
            provider_body(resp)
        assert err.value.expected is None and err.value.actual == resp.provider_format
        assert "BuildRequest.provider_format" in str(err.value)
        with pytest.raises(ProviderBodyError, match="holds no provider body") as err:
            formats.chat_completions_body(resp)
        assert "PROVIDER_FORMAT_OPENAI_CHAT_COMPLETIONS" in str(err.value)
    # a format's value with an empty body is no body either
    with pytest.raises(ProviderBodyError, match="no provider body"):
        formats.gemini_body(response(pb.PROVIDER_FORMAT_GEMINI_GENERATE_CONTENT))
    for broken in ("[1, 2]", "{not json"):
        with pytest.raises(ProviderBodyError, match="provider_body_json is not"):
            formats.bedrock_converse_body(response(pb.PROVIDER_FORMAT_BEDROCK_CONVERSE, broken))


def test_gemini_cached_content_is_parsed_without_a_server():
    cached = pb.GeminiCachedContent(
        display_name="ce-0123456789abcdef-e1", ttl="300s",
        create_body_json=json.dumps({"model": "models/gemini-2.5-pro", "ttl": "300s",
                                     "displayName": "ce-0123456789abcdef-e1",
                                     "systemInstruction": {"parts": [{"text": "Be brief."}]}}),
        cached_body_json=json.dumps({"contents": [{"role": "user",
                                                   "parts": [{"text": "Hi"}]}]}),
        holds=["systemInstruction"], estimated_tokens=5000, min_cacheable_tokens=4096)
    whole = {"systemInstruction": {"parts": [{"text": "Be brief."}]},
             "contents": [{"role": "user", "parts": [{"text": "Hi"}]}]}
    resp = response(pb.PROVIDER_FORMAT_GEMINI_GENERATE_CONTENT, whole,
                    gemini_cached_content=cached)
    got = gemini_cached_content(resp)
    assert isinstance(got, GeminiCachedContentBodies)
    assert (got.display_name, got.ttl, got.holds) == ("ce-0123456789abcdef-e1", "300s",
                                                      ("systemInstruction",))
    assert got.create_body["displayName"] == got.display_name and got.cacheable
    assert "cachedContent" not in got.cached_body
    used = got.cached_body_for("cachedContents/abc123")
    assert used == {**got.cached_body, "cachedContent": "cachedContents/abc123"}
    used["contents"].clear()  # a copy: the parsed body is untouched
    assert got.cached_body["contents"]
    with pytest.raises(ValueError, match="cached_content_name"):
        got.cached_body_for("")
    small = pb.GeminiCachedContent()
    small.CopyFrom(cached)
    small.estimated_tokens = 100
    assert not gemini_cached_content(response(
        pb.PROVIDER_FORMAT_GEMINI_GENERATE_CONTENT, whole, gemini_cached_content=small)).cacheable
    # another format, or a Gemini body without the caching plan
    with pytest.raises(ProviderBodyError, match="bedrock_converse"):
        gemini_cached_content(response(pb.PROVIDER_FORMAT_BEDROCK_CONVERSE, {},
                                       gemini_cached_content=cached))
    with pytest.raises(ProviderBodyError, match="no gemini_cached_content"):
        gemini_cached_content(response(pb.PROVIDER_FORMAT_GEMINI_GENERATE_CONTENT, whole))


def build_in(engine: Client, tenant: str, session: str,
             fmt: int) -> pb.BuildResponse:
    return engine.build(request=pb.BuildRequest(tenant_id=tenant, session_id=session,
                                                 checkpoint=checkpoint(), provider_format=fmt))


def check_format_body(name: str, body: dict[str, Any], built: pb.BuildResponse) -> None:
    """What a body of each format holds for this module's checkpoint (a tool call and its
    result in the history): the format's top-level keys and its call/result pairing."""
    assert BODY_KEYS[name] <= set(body), (name, sorted(body))
    text = json.dumps(body)
    if name == "anthropic_messages":
        assert body["model"] == built.model_id
        assert '"tool_use"' in text and '"tool_result"' in text
    elif name == "openai_responses":
        assert body["prompt_cache_key"] == built.session_key
        assert '"function_call"' in text and '"function_call_output"' in text
    elif name == "openai_chat_completions":
        assert body["model"] == built.model_id
        roles = [m["role"] for m in body["messages"]]
        assert roles[0] in ("system", "developer") and "tool" in roles
        calls = [c for m in body["messages"] if m["role"] == "assistant"
                 for c in m.get("tool_calls") or []]
        answered = {m["tool_call_id"] for m in body["messages"] if m["role"] == "tool"}
        assert {c["id"] for c in calls} == answered == {"call-1"}
        assert {c["function"]["name"] for c in calls} == {"web__fetch"}
    elif name == "gemini_generate_content":
        assert body["contents"] and {c["role"] for c in body["contents"]} <= {"user", "model"}
        assert '"functionCall"' in text and '"functionResponse"' in text
        # google-genai's types read it (they forbid unknown fields)
        from google.genai import types as genai

        for content in body["contents"]:
            genai.Content.model_validate_json(json.dumps(content))
        for tool in body["tools"]:
            genai.Tool.model_validate_json(json.dumps(tool))
    elif name == "bedrock_converse":
        assert body["modelId"] == built.model_id
        assert '"toolUse"' in text and '"toolResult"' in text
        # the keyword arguments of boto3's bedrock-runtime converse(), as botocore checks them
        import botocore.session
        from botocore.validate import ParamValidator

        shape = botocore.session.get_session().get_service_model(
            "bedrock-runtime").operation_model("Converse").input_shape
        report = ParamValidator().validate(body, shape)
        assert not report.has_errors(), report.generate_report()


@pytest.mark.integration
@pytest.mark.parametrize("name", list(BODY_ACCESSORS))
def test_every_format_comes_back_typed_from_the_real_server(server, ids, name):
    tenant, session = ids
    value = FORMAT_NAMES[name]
    with Client(target=server.address) as engine:
        engine.plan(request=plan_request(tenant, session))
        built = build_in(engine, tenant, session, value)
    assert built.provider_format == value, provider_format_name(built.provider_format)
    body = BODY_ACCESSORS[name](built)
    assert body == provider_body(built) == json.loads(built.provider_body_json)
    check_format_body(name, body, built)
    for other, accessor in BODY_ACCESSORS.items():  # the mismatch error names both
        if other != name:
            with pytest.raises(ProviderBodyError, match=rf"{other} .*{name} \(") as err:
                accessor(built)
            assert (err.value.expected, err.value.actual) == (FORMAT_NAMES[other], value)
    if name != "gemini_generate_content":
        assert not built.HasField("gemini_cached_content")
        with pytest.raises(ProviderBodyError):
            gemini_cached_content(built)
        return
    cached = gemini_cached_content(built)
    tag = hashlib.sha256(f"{built.session_key}:{built.prefix_sha256}".encode()).hexdigest()
    assert cached.display_name == f"ce-{tag[:16]}-e{built.epoch}"
    assert re.fullmatch(r"\d+s", cached.ttl), cached.ttl
    assert cached.holds and set(cached.holds) <= {"systemInstruction", "tools", "toolConfig"}
    assert cached.create_body["displayName"] == cached.display_name
    assert cached.create_body["ttl"] == cached.ttl and cached.create_body["model"]
    assert set(cached.holds) <= set(cached.create_body)
    assert not set(cached.holds) & set(cached.cached_body)  # what the cache holds is not resent
    assert cached.cached_body["contents"] == body["contents"]
    assert cached.estimated_tokens > 0 and cached.min_cacheable_tokens > 0
    assert cached.cached_body_for("cachedContents/x1")["cachedContent"] == "cachedContents/x1"


@pytest.mark.integration
def test_the_default_format_and_none_from_the_real_server(server, ids):
    """No format named: the model's default (the plan says which); NONE: no body, and the
    helpers say so."""
    tenant, session = ids
    with Client(target=server.address) as engine:
        plan = engine.plan(request=plan_request(tenant, session)).plan
        default = build_in(engine, tenant, session, pb.PROVIDER_FORMAT_UNSPECIFIED)
        none = build_in(engine, tenant, session, pb.PROVIDER_FORMAT_NONE)
    assert plan.default_provider_format in FORMAT_NAMES.values(), plan.default_provider_format
    assert default.provider_format == plan.default_provider_format
    name = provider_format_name(default.provider_format)
    check_format_body(name, BODY_ACCESSORS[name](default), default)
    assert none.provider_body_json == "" and none.provider_format in (
        pb.PROVIDER_FORMAT_UNSPECIFIED, pb.PROVIDER_FORMAT_NONE)
    with pytest.raises(ProviderBodyError, match="holds no provider body"):
        provider_body(none)
    with pytest.raises(ProviderBodyError, match="no provider body"):
        formats.anthropic_messages_body(none)


@pytest.mark.integration
def test_the_async_client_gets_the_same_bodies(server, ids):
    tenant, session = ids

    async def scenario() -> list[pb.BuildResponse]:
        async with AsyncClient(target=server.address) as engine:
            await engine.plan(request=plan_request(tenant, session))
            return [await engine.build(request=pb.BuildRequest(
                tenant_id=tenant, session_id=session, checkpoint=checkpoint(),
                provider_format=value)) for value in FORMAT_NAMES.values()]

    for (name, value), built in zip(FORMAT_NAMES.items(), asyncio.run(scenario()), strict=True):
        assert built.provider_format == value
        check_format_body(name, BODY_ACCESSORS[name](built), built)


def test_bedrock_body_is_ready_for_boto3_with_blobs_as_bytes():
    """JSON carries a replayed redactedContent blob as base64 text; boto3 wants bytes (botocore
    encodes blobs itself, so text would go out encoded twice)."""
    from context_engine_client import bedrock_converse_body

    blob = b"\x00redacted\xff"
    body = {"modelId": "anthropic.claude-sonnet-4-5", "messages": [
        {"role": "user", "content": [{"text": "hi"}]},
        {"role": "assistant", "content": [
            {"reasoningContent": {"redactedContent": base64.b64encode(blob).decode()}},
            {"text": "ok"}]}]}
    response = pb.BuildResponse(provider_body_json=json.dumps(body),
                                provider_format=pb.PROVIDER_FORMAT_BEDROCK_CONVERSE)
    ready = bedrock_converse_body(response)
    block = ready["messages"][1]["content"][0]
    assert block == {"reasoningContent": {"redactedContent": blob}}
    assert ready["messages"][0] == body["messages"][0]


def test_bedrock_body_decodes_no_redacted_content_but_a_reasoning_blob():
    """Only ``messages[*].content[*].reasoningContent.redactedContent`` is a blob: a key of that
    name in a tool call's input (the model's arguments) or in a tool's schema is text, kept as
    it is, whether or not it reads as base64."""
    from context_engine_client import bedrock_converse_body

    blob = b"\x00redacted\xff"
    schema = {"type": "object", "properties": {"redactedContent": {"type": "string"}},
              "examples": [{"redactedContent": "abcd"}, {"redactedContent": "Name: Jane"}]}
    body = {"modelId": "anthropic.claude-sonnet-4-5", "messages": [
        {"role": "user", "content": [{"text": "Redact it."}]},
        {"role": "assistant", "content": [
            {"reasoningContent": {"redactedContent": base64.b64encode(blob).decode()}},
            {"toolUse": {"toolUseId": "k1", "name": "redact",
                         "input": {"redactedContent": "Name: Jane Doe"}}},
            {"toolUse": {"toolUseId": "k2", "name": "redact",
                         "input": {"redactedContent": "abcd",
                                   "nested": [{"redactedContent": "cmVkYWN0ZWQ="}]}}}]},
        {"role": "user", "content": [
            {"toolResult": {"toolUseId": "k1", "content": [{"json": {"redactedContent": "abcd"}}]}},
            {"toolResult": {"toolUseId": "k2", "content": [{"text": "done"}]}}]}],
        "toolConfig": {"tools": [{"toolSpec": {"name": "redact",
                                               "inputSchema": {"json": schema}}}]}}
    text = json.dumps(body)
    response = pb.BuildResponse(provider_body_json=text,
                                provider_format=pb.PROVIDER_FORMAT_BEDROCK_CONVERSE)
    ready = bedrock_converse_body(response)
    expected = json.loads(text)  # what JSON holds, with only the reasoning blob as bytes
    expected["messages"][1]["content"][0]["reasoningContent"]["redactedContent"] = blob
    assert ready == expected
