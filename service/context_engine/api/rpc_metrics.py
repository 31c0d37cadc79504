"""Standard per-method gRPC server metrics, under the names grpc-ecosystem/go-grpc-prometheus
gives them (so the usual gRPC dashboards and alerts work unchanged), and the build the process
serves:

* ``grpc_server_started_total{grpc_type, grpc_service, grpc_method}``: calls started;
* ``grpc_server_handled_total{grpc_type, grpc_service, grpc_method, grpc_code}``: calls
  finished, by the status code the caller got;
* ``grpc_server_msg_received_total`` and ``grpc_server_msg_sent_total`` (same labels as
  started): messages read from the stream and handed to gRPC to write on it (one each way for a
  unary call that ends ``OK``; none sent when it ends with an error);
* ``grpc_server_handling_seconds{grpc_type, grpc_service, grpc_method}``: from the start of a
  call to its status, whatever the code;
* ``context_engine_build_info{version, contract, policy, builder}``: 1, the values that
  ``context-engine --version`` prints (the contract's descriptor hash cut to 12 hex digits).

The interceptor is the outermost one, so calls refused by the credentials check or the limits
are counted with their codes like any other. Calls gRPC refuses before any handler runs (an
unknown method, a message over ``grpc.max_receive_message_length``) are not counted: no
handler sees them. Every method of the served services starts with its series at zero, for
every status code, so ``rate()`` and ``increase()`` count a series' first calls.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as installed_version
from typing import Any

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from context_engine import __version__
from context_engine.adapters.assets import load_platform_assets
from context_engine.clock import Clock
from context_engine.config import Config
from context_engine.domain.plan import BUILDER_VERSION
from context_engine.telemetry.metrics import Metrics
from context_engine.v1 import context_engine_pb2 as pb

DISTRIBUTION = "context-engine"  # the installed package, as ``context-engine --version`` reads it
CONTRACT_HASH_DIGITS = 12
# Every status code a call can end with (the series of each exist before the first call).
GRPC_CODES = tuple(code.name for code in grpc.StatusCode)
# The services this server registers (server.start): the contract, health and reflection.
SERVED_SERVICES: tuple[ServiceDescriptor, ...] = (
    pb.DESCRIPTOR.services_by_name["ContextEngine"],
    health_pb2.DESCRIPTOR.services_by_name["Health"],
    reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"],
)


def grpc_type(request_streaming: bool, response_streaming: bool) -> str:
    if request_streaming:
        return "bidi_stream" if response_streaming else "client_stream"
    return "server_stream" if response_streaming else "unary"


def served_methods() -> list[tuple[str, str, str]]:
    """(grpc_type, grpc_service, grpc_method) of every method of ``SERVED_SERVICES``."""
    return [(grpc_type(m.client_streaming, m.server_streaming), service.full_name, m.name)
            for service in SERVED_SERVICES for m in service.methods]


def build_labels(config: Config) -> dict[str, str]:
    """``context_engine_build_info``'s labels: the service's version, the contract (proto
    package and the SHA-256 of its compiled descriptor, cut to 12 hex digits), the policy
    version ``Plan`` pins (the assets of ``CE_ASSETS_DIR``, else the packaged ones) and the
    request builder's version: what ``context-engine --version`` prints."""
    try:
        service = installed_version(DISTRIBUTION)
    except PackageNotFoundError:  # imported from a source tree that was never installed
        service = __version__
    digest = hashlib.sha256(pb.DESCRIPTOR.serialized_pb).hexdigest()[:CONTRACT_HASH_DIGITS]
    return {"version": service,
            "contract": f"{pb.DESCRIPTOR.package} sha256:{digest}",
            "policy": load_platform_assets(config.assets_dir).version,
            "builder": BUILDER_VERSION}


@dataclass(frozen=True)
class _Call:
    """The label values of one method, and the metrics it moves."""

    metrics: Metrics
    labels: tuple[str, str, str]

    def started(self) -> None:
        self.metrics.grpc_server_started.labels(*self.labels).inc()

    def received(self) -> None:
        self.metrics.grpc_server_msg_received.labels(*self.labels).inc()

    def sent(self) -> None:
        self.metrics.grpc_server_msg_sent.labels(*self.labels).inc()

    def handled(self, code: grpc.StatusCode, seconds: float) -> None:
        self.metrics.grpc_server_handled.labels(*self.labels, code.name).inc()
        self.metrics.grpc_server_handling_seconds.labels(*self.labels).observe(seconds)


def _ended_with(context: grpc.aio.ServicerContext[Any, Any],
                error: BaseException | None) -> grpc.StatusCode:
    """The status a call ended with: the code set on its context (``abort`` sets it before it
    raises; a handler may also set one and return), OK for a plain return, CANCELLED or
    DEADLINE_EXCEEDED when the call was cancelled under the handler (or a stream was closed
    before its end), and UNKNOWN for any other exception (what gRPC answers for one)."""
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code
    if error is None:
        return grpc.StatusCode.OK
    if isinstance(error, (asyncio.CancelledError, GeneratorExit)):
        return cancelled_code(context)
    return grpc.StatusCode.UNKNOWN


# A caller's deadline passes on its side first: the server's copy of it (sent as a timeout)
# starts a network latency later. A call cancelled this close to its deadline is counted as
# its deadline passing, not as the caller's own cancellation.
DEADLINE_SLACK_SECONDS = 0.25


def cancelled_code(context: grpc.aio.ServicerContext[Any, Any]) -> grpc.StatusCode:
    """The status of a call cancelled under its handler: DEADLINE_EXCEEDED when its deadline
    has passed (or is within ``DEADLINE_SLACK_SECONDS``: the caller's copy of it has), else
    CANCELLED (the caller gave up, or the server is stopping)."""
    remaining = context.time_remaining()
    if remaining is not None and remaining <= DEADLINE_SLACK_SECONDS:
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.CANCELLED


class _CountingContext:
    """A servicer context that counts the messages a streaming handler reads and writes through
    it (``context.read()``, ``context.write()``); everything else goes to the real one."""

    def __init__(self, context: grpc.aio.ServicerContext[Any, Any], call: _Call) -> None:
        self._context = context
        self._call = call

    async def read(self) -> Any:
        message = await self._context.read()
        if message is not grpc.aio.EOF:
            self._call.received()
        return message

    async def write(self, message: Any) -> None:
        # Counted when handed to gRPC, as a response an async generator yields is: a caller that
        # reads the message and cancels can cancel this task before the awaited write resumes.
        self._call.sent()
        await self._context.write(message)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


class RpcMetricsInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, metrics: Metrics, clock: Clock) -> None:
        self._metrics = metrics
        self._clock = clock

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails],
                                     Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        if handler is None:  # unknown method: gRPC answers UNIMPLEMENTED, no handler runs
            return handler
        service, _, method = handler_call_details.method.lstrip("/").rpartition("/")
        kind = grpc_type(handler.request_streaming, handler.response_streaming)
        call = _Call(self._metrics, (kind, service, method))
        clock = self._clock
        options = {"request_deserializer": handler.request_deserializer,
                   "response_serializer": handler.response_serializer}

        def finish(context: grpc.aio.ServicerContext[Any, Any], started: float,
                   error: BaseException | None) -> grpc.StatusCode:
            code = _ended_with(context, error)
            call.handled(code, clock.monotonic() - started)
            return code

        def counted(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
            async def each() -> AsyncIterator[Any]:
                async for message in requests:
                    call.received()
                    yield message
            return each()

        if handler.unary_unary is not None:
            unary_unary: Callable[..., Awaitable[Any]] = handler.unary_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                started = clock.monotonic()
                call.started()
                call.received()
                try:
                    response = await unary_unary(request, context)
                except BaseException as error:
                    finish(context, started, error)
                    raise
                if finish(context, started, None) is grpc.StatusCode.OK:
                    call.sent()
                return response

            return grpc.unary_unary_rpc_method_handler(unary, **options)

        if handler.unary_stream is not None:
            unary_stream: Callable[..., Any] = handler.unary_stream

            async def server_stream(request: Any,
                                    context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                started = clock.monotonic()
                call.started()
                call.received()
                error: BaseException | None = None
                try:
                    result = unary_stream(request, _CountingContext(context, call))
                    if hasattr(result, "__aiter__"):  # an async generator of responses
                        async for response in result:
                            call.sent()
                            yield response
                    else:  # a coroutine writing through context.write()
                        await result
                except BaseException as caught:
                    error = caught
                    raise
                finally:
                    finish(context, started, error)

            return grpc.unary_stream_rpc_method_handler(server_stream, **options)

        if handler.stream_unary is not None:
            stream_unary: Callable[..., Awaitable[Any]] = handler.stream_unary

            async def client_stream(requests: AsyncIterator[Any],
                                    context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                started = clock.monotonic()
                call.started()
                try:
                    response = await stream_unary(counted(requests),
                                                  _CountingContext(context, call))
                except BaseException as error:
                    finish(context, started, error)
                    raise
                if finish(context, started, None) is grpc.StatusCode.OK:
                    call.sent()
                return response

            return grpc.stream_unary_rpc_method_handler(client_stream, **options)

        if handler.stream_stream is not None:
            stream_stream: Callable[..., Any] = handler.stream_stream

            async def bidi_stream(requests: AsyncIterator[Any],
                                  context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                started = clock.monotonic()
                call.started()
                error: BaseException | None = None
                try:
                    result = stream_stream(counted(requests), _CountingContext(context, call))
                    if hasattr(result, "__aiter__"):
                        async for response in result:
                            call.sent()
                            yield response
                    else:
                        await result
                except BaseException as caught:
                    error = caught
                    raise
                finally:
                    finish(context, started, error)

            return grpc.stream_stream_rpc_method_handler(bidi_stream, **options)

        return handler


def rpc_metrics_interceptor(metrics: Metrics, config: Config,
                            clock: Clock) -> RpcMetricsInterceptor:
    """The interceptor, with every method's series at zero (``Metrics.initialise_grpc``) and
    ``context_engine_build_info`` set: register it first, so it sees every other
    interceptor's refusals."""
    metrics.initialise_grpc(served_methods(), GRPC_CODES)
    metrics.build_info.labels(**build_labels(config)).set(1)
    return RpcMetricsInterceptor(metrics, clock)
