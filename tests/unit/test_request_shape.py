"""The request-shape check measures each element as protobuf serializes it, not by the bytes
that arrived: those can be fewer than an element measures (a negative enum sent in five bytes is
measured at ten), so no size of the received request may stand in for the elements'."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from context_engine.api.limits import Limits, LimitsInterceptor
from context_engine.telemetry.metrics import Metrics
from context_engine.v1 import context_engine_pb2 as pb
from prometheus_client import CollectorRegistry


def varint(n: int) -> bytes:
    out = b""
    while True:
        low, n = n & 0x7F, n >> 7
        if not n:
            return out + bytes([low])
        out += bytes([low | 0x80])


def length_delimited(number: int, data: bytes) -> bytes:
    return varint(number << 3 | 2) + varint(len(data)) + data


def test_an_element_measured_over_the_limit_is_refused_whatever_arrived():
    fields = pb.ConversationItem.DESCRIPTOR.fields_by_name
    attachments = pb.UserMessage.DESCRIPTOR.fields_by_name["attachments"].number
    kind = pb.Attachment.DESCRIPTOR.fields_by_name["kind"].number
    # Attachment.kind = -1 in its five-byte form: valid on the wire, measured at ten bytes
    attachment = varint(kind << 3) + b"\xff\xff\xff\xff\x0f"
    user = b"".join(length_delimited(attachments, attachment) for _ in range(120))
    item = length_delimited(fields["user"].number, user)
    checkpoint = length_delimited(
        pb.Checkpoint.DESCRIPTOR.fields_by_name["items"].number, item)
    data = length_delimited(pb.BuildRequest.DESCRIPTOR.fields_by_name["checkpoint"].number,
                            checkpoint)
    limits = Limits(max_concurrent=10, max_items=10_000, max_item_bytes=1024)
    decoded = pb.BuildRequest.FromString(data)
    assert len(data) < 1024 < decoded.checkpoint.items[0].ByteSize()

    refused: list[tuple[Any, ...]] = []

    class Context:
        async def abort(self, code: grpc.StatusCode, details: str,
                        trailing_metadata: Any = ()) -> None:
            refused.append((code, details, dict(trailing_metadata)))
            raise RuntimeError("aborted")

        def __getattr__(self, name: str) -> Any:
            return lambda *args, **kwargs: None

    async def inner(request: Any, context: Any) -> str:
        return "answered"

    async def continuation(details: Any) -> grpc.RpcMethodHandler[Any, Any]:
        return grpc.unary_unary_rpc_method_handler(
            inner, request_deserializer=pb.BuildRequest.FromString)

    class Details:
        method = "/context_engine.v1.ContextEngine/Build"

    async def scenario() -> str:
        interceptor = LimitsInterceptor(limits, Metrics(CollectorRegistry()))
        handler = await interceptor.intercept_service(continuation, Details())
        assert handler is not None and handler.request_deserializer is not None
        try:
            return str(await handler.unary_unary(handler.request_deserializer(data), Context()))
        except RuntimeError as exc:
            return str(exc)

    assert asyncio.run(scenario()) == "aborted"
    assert refused and refused[0][0] is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "checkpoint.items[0]" in refused[0][1], refused
    assert "ITEM_TOO_LARGE" in repr(refused[0][2])
