"""The request-shape check measures elements one by one only where the request could hold one
over ``max_item_bytes``: its size comes from the bytes gRPC decoded, taken only beside the very
request they decoded to."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from context_engine.api import limits as limits_module
from context_engine.api.limits import Limits, LimitsInterceptor, shape_violation
from context_engine.telemetry.metrics import Metrics
from context_engine.v1 import context_engine_pb2 as pb
from prometheus_client import CollectorRegistry

from tests.integration.requests import build_request, item

LIMITS = Limits(max_concurrent=10, max_items=50, max_item_bytes=4096)


def request_with(text_bytes: int) -> pb.BuildRequest:
    items = [item(f"u{i}", i + 1, user=pb.UserMessage(text="x" * 10)) for i in range(3)]
    items[1] = item("big", 2, user=pb.UserMessage(text="y" * text_bytes))
    return build_request("t", "s", items=items)


def test_an_element_over_the_limit_is_found_unless_the_whole_request_is_within_it():
    big = request_with(5000)
    found = shape_violation(big, LIMITS)
    assert found is not None and found.field == "checkpoint.items[1]"
    assert shape_violation(big, LIMITS, size=big.ByteSize()) == found
    # the size is the caller's word: at most the limit, no element is measured
    assert shape_violation(big, LIMITS, size=4096) is None
    assert shape_violation(request_with(100), LIMITS) is None
    # counts are checked whatever the size
    many = build_request("t", "s", items=[item(f"u{i}", i + 1, user=pb.UserMessage(text="x"))
                                          for i in range(51)])
    found = shape_violation(many, LIMITS, size=10)
    assert found is not None and found.reason == "TOO_MANY_ITEMS"


def test_the_handler_takes_the_size_of_the_request_it_got_and_of_no_other(monkeypatch):
    seen: list[int | None] = []

    def recording(message: Any, limits: Limits, path: str = "", depth: int = 0,
                  size: int | None = None) -> None:
        seen.append(size)
        return None

    monkeypatch.setattr(limits_module, "shape_violation", recording)

    async def inner(request: Any, context: Any) -> str:
        return "answered"

    async def continuation(details: Any) -> grpc.RpcMethodHandler[Any, Any]:
        return grpc.unary_unary_rpc_method_handler(
            inner, request_deserializer=pb.BuildRequest.FromString)

    class Details:
        method = "/context_engine.v1.ContextEngine/Build"

    async def scenario() -> list[str]:
        interceptor = LimitsInterceptor(LIMITS, Metrics(CollectorRegistry()))
        handler = await interceptor.intercept_service(continuation, Details())
        assert handler is not None and handler.request_deserializer is not None
        data = request_with(100).SerializeToString()
        answers = []
        decoded = handler.request_deserializer(data)
        answers.append(await handler.unary_unary(decoded, None))
        # the size was taken once: a later call in the same context does not read it again
        answers.append(await handler.unary_unary(decoded, None))
        handler.request_deserializer(data)
        # another request than the one decoded: its size is not known
        answers.append(await handler.unary_unary(request_with(100), None))
        return answers

    assert asyncio.run(scenario()) == ["answered"] * 3
    assert seen == [len(request_with(100).SerializeToString()), None, None]
