"""The limits interceptor's drain (``LimitsInterceptor.quiesce``), which the server's stop runs
before the transport's shutdown: once it begins, a new call is refused UNAVAILABLE
(``SHUTTING_DOWN``, which the clients retry on another replica) without reaching its handler,
and the drain hands back the time it left of its grace, none when a call outlived it."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import grpc
from context_engine.api.limits import Limits, LimitsInterceptor
from context_engine.telemetry.metrics import Metrics
from context_engine.v1 import context_engine_pb2 as pb
from google.rpc import error_details_pb2, status_pb2
from prometheus_client import CollectorRegistry

LIMITS = Limits(max_concurrent=10, max_items=100, max_item_bytes=10_000)


class Aborted(Exception):
    pass


class Context:
    """A servicer context that records the abort it is given."""

    def __init__(self) -> None:
        self.aborted: list[tuple[grpc.StatusCode, str, dict[str, Any]]] = []

    async def abort(self, code: grpc.StatusCode, details: str,
                    trailing_metadata: Any = ()) -> None:
        self.aborted.append((code, details, dict(trailing_metadata)))
        raise Aborted

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


class Details:
    method = "/context_engine.v1.ContextEngine/GetPlan"


async def limited(interceptor: LimitsInterceptor, inner: Any) -> Any:
    async def continuation(details: Any) -> grpc.RpcMethodHandler[Any, Any]:
        return grpc.unary_unary_rpc_method_handler(
            inner, request_deserializer=pb.GetPlanRequest.FromString)
    handler = await interceptor.intercept_service(continuation, Details())
    assert handler is not None and handler.unary_unary is not None
    return handler.unary_unary


def reason(trailers: dict[str, Any]) -> str:
    status = status_pb2.Status.FromString(trailers["grpc-status-details-bin"])
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    return info.reason


def test_a_draining_server_refuses_new_calls_unavailable() -> None:
    served: list[str] = []

    async def inner(request: Any, context: Any) -> pb.GetPlanResponse:
        served.append(request.tenant_id)
        return pb.GetPlanResponse()

    async def scenario() -> Context:
        interceptor = LimitsInterceptor(LIMITS, Metrics(CollectorRegistry()))
        call = await limited(interceptor, inner)
        await call(pb.GetPlanRequest(tenant_id="before"), Context())
        await interceptor.quiesce(1.0)
        context = Context()
        with contextlib.suppress(Aborted):
            await call(pb.GetPlanRequest(tenant_id="after"), context)
        return context

    context = asyncio.run(scenario())
    assert served == ["before"]
    [(code, details, trailers)] = context.aborted
    assert code is grpc.StatusCode.UNAVAILABLE
    assert details == "this server process is shutting down; retry"
    assert reason(trailers) == "SHUTTING_DOWN"


def test_the_drain_hands_back_the_time_it_left() -> None:
    async def scenario() -> tuple[float, float]:
        release = asyncio.Event()

        async def inner(request: Any, context: Any) -> pb.GetPlanResponse:
            await release.wait()
            return pb.GetPlanResponse()

        interceptor = LimitsInterceptor(LIMITS, Metrics(CollectorRegistry()))
        call = await limited(interceptor, inner)
        running = asyncio.ensure_future(call(pb.GetPlanRequest(tenant_id="t"), Context()))
        await asyncio.sleep(0.01)
        assert interceptor.in_flight == 1
        outlived = await interceptor.quiesce(0.1)  # the call outlives the whole grace
        release.set()
        await running
        idle = await interceptor.quiesce(30.0)  # nothing in flight: all of it left
        return outlived, idle

    outlived, idle = asyncio.run(scenario())
    assert outlived == 0.0
    assert 29.0 < idle <= 30.0
