"""Backpressure and request-shape limits, enforced before a request reaches the servicer.

* Concurrency: at most ``max_concurrent`` ContextEngine RPCs run in one process; the next one is
  answered ``RESOURCE_EXHAUSTED`` (reason ``TOO_MANY_CONCURRENT_RPCS``) at once instead of
  queueing without bound, so a client's retry or another replica takes it.
* Shape: no repeated field of a request (at the top level, inside its singular messages, e.g.
  ``checkpoint.items``, or inside an element of a repeated one, e.g.
  ``checkpoint.items[3].tool_calls.calls``) may hold more than ``max_items`` elements, and no
  element of one may serialize to more than ``max_item_bytes`` (reasons ``TOO_MANY_ITEMS``,
  ``ITEM_TOO_LARGE``).
  An incremental Build's checkpoint counts its base's kept items too, and its items are named
  by their place in the whole checkpoint: it is refused exactly when the same Build sent whole
  would be. Items that cannot be placed so are not judged here, for the servicer refuses their
  Build as such: a base not held here, ``BUILD_BASE_UNKNOWN`` before it reads them (which the
  clients answer by sending the Build whole, judged then); a kept count over what the base
  holds, ``INVALID_ARGUMENT`` on ``base_items_kept``.
* Shutting down: after the drain, new RPCs get ``UNAVAILABLE`` (``SHUTTING_DOWN``) while the
  running ones finish (:meth:`LimitsInterceptor.quiesce`).
* The whole message is capped by gRPC itself (``grpc.max_receive_message_length``), which
  answers ``RESOURCE_EXHAUSTED`` before any handler runs.

Health and reflection are never limited: probes must get through a saturated server.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from opentelemetry.trace import Tracer

from context_engine.api.status import refuse, timed_call
from context_engine.domain.identifiers import MAX_ID_LENGTH
from context_engine.telemetry.metrics import Metrics

SERVICE_PREFIX = "/context_engine.v1.ContextEngine/"
# how deep messages are searched: the deepest repeated field of a request is
# CarryWorkingStateRequest.events[i].transition.update.add_facts[j].source_event_ids, four
# messages below the request (tests/unit/test_limits_nested.py checks each is within reach)
_MAX_DEPTH = 4
BUILD_REQUEST = "context_engine.v1.BuildRequest"


@dataclass(frozen=True)
class Limits:
    max_concurrent: int
    max_items: int
    max_item_bytes: int


@dataclass(frozen=True)
class Violation:
    reason: str
    field: str
    size: int
    limit: int

    def message(self) -> str:
        if self.reason == "TOO_MANY_ITEMS":
            return f"{self.field} holds {self.size} elements, over the limit of {self.limit}"
        return f"{self.field} is {self.size} bytes, over the per-item limit of {self.limit}"


# (tenant_id, session_id, build_id) -> how many items that base holds, None if not held here
BaseItems = Callable[[str, str, str], "int | None"]


def ahead_of(message: Message, base_items: BaseItems | None = None) -> dict[str, int | None]:
    """Per repeated field, the elements that precede the ones ``message`` sends: an incremental
    Build's ``checkpoint.items`` follow its base's first ``base_items_kept`` items. The limits
    hold for the whole checkpoint, as they would for the same Build sent whole, and name its
    items by their place in it.

    With ``base_items``, items whose place is unknown (a kept count that names items its base
    does not hold, or a base not held here) are None, not judged: the servicer refuses that
    Build as such (INVALID_ARGUMENT on ``base_items_kept``, or BUILD_BASE_UNKNOWN), not as a
    request of that many items nor with an item named by a place it would not have in the
    checkpoint sent whole."""
    build: Any = message
    if message.DESCRIPTOR.full_name == BUILD_REQUEST and build.base_build_id:
        kept = int(build.base_items_kept)
        if base_items is not None:
            held = base_items(build.tenant_id, build.session_id, build.base_build_id)
            if held is None or kept > held:
                return {"checkpoint.items": None}
        return {"checkpoint.items": kept}
    return {}


def shape_violation(message: Message, limits: Limits, path: str = "",
                    depth: int = 0, ahead: dict[str, int | None] | None = None,
                    base_items: BaseItems | None = None) -> Violation | None:
    """The first repeated field over ``max_items`` or element over ``max_item_bytes``;
    ``ahead``: see :func:`ahead_of` (at the top level, found from ``message`` and
    ``base_items``)."""
    if ahead is None:
        # A base never holds more than max_items items: a kept count past that names items no
        # base has, for the servicer to refuse as such (BUILD_BASE_UNKNOWN, or base_items_kept
        # over the base's items), not a request of that many items.
        ahead = {k: n if n is not None and n <= limits.max_items else None
                 for k, n in ahead_of(message, base_items).items()}
    for field, value in message.ListFields():
        name = f"{path}{field.name}"
        if field.is_repeated:
            first = ahead.get(name, 0)
            if first is None:  # elements of unknown place: the servicer refuses their request
                continue
            if first + len(value) > limits.max_items:
                return Violation("TOO_MANY_ITEMS", name, first + len(value), limits.max_items)
            if field.type == FieldDescriptor.TYPE_MESSAGE:
                for index, element in enumerate(value, first):
                    size = element.ByteSize()
                    if size > limits.max_item_bytes:
                        return Violation("ITEM_TOO_LARGE", f"{name}[{index}]", size,
                                         limits.max_item_bytes)
                    # The repeated fields inside an element (checkpoint.items[i].tool_calls
                    # .calls, tool_catalog[i].required_scopes) are held to the same limits.
                    # Each of their elements takes at least one byte on the wire, so an
                    # element of at most max_items bytes cannot hold a field over the limit:
                    # only larger ones are searched, which keeps the common request's cost
                    # at the size already measured.
                    if size > limits.max_items and depth < _MAX_DEPTH:
                        found = shape_violation(element, limits, f"{name}[{index}].",
                                                depth + 1, ahead)
                        if found is not None:
                            return found
            elif field.type in (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES):
                for index, element in enumerate(value, first):
                    size = len(element.encode()) if isinstance(element, str) else len(element)
                    if size > limits.max_item_bytes:
                        return Violation("ITEM_TOO_LARGE", f"{name}[{index}]", size,
                                         limits.max_item_bytes)
        elif field.type == FieldDescriptor.TYPE_MESSAGE and depth < _MAX_DEPTH:
            found = shape_violation(value, limits, f"{name}.", depth + 1, ahead)
            if found is not None:
                return found
    return None


class LimitsInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, limits: Limits, metrics: Metrics,
                 base_items: BaseItems | None = None, tracer: Tracer | None = None) -> None:
        self._limits = limits
        self._metrics = metrics
        self._tracer = tracer
        self._base_items = base_items
        self.in_flight = 0
        self.refusing = False

    async def quiesce(self, timeout: float) -> float:
        """Stop starting RPCs (each new one is answered ``UNAVAILABLE``, reason
        ``SHUTTING_DOWN``, which clients retry elsewhere) and wait up to ``timeout`` seconds
        for the running ones to finish. Returns the time left.

        Refusing at this level, before the transport is shut down, keeps the server taking
        calls off the wire: gRPC's own shutdown cancels calls that arrived but were not yet
        handed to the application (the client sees ``CANCELLED``, which no retry policy
        retries), so the window in which that can happen shrinks to the last moment."""
        self.refusing = True
        deadline = time.monotonic() + timeout
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return max(0.0, deadline - time.monotonic())

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails],
                                     Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if (handler is None or handler.unary_unary is None
                or not method.startswith(SERVICE_PREFIX)):
            return handler
        inner: Callable[..., Awaitable[Any]] = handler.unary_unary
        name = method[len(SERVICE_PREFIX):]

        async def limited(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            with timed_call():  # started here unless the credentials check saw it first
                return await admitted(request, context)

        async def admitted(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            # the tenant the request names, for the refusal's log line (not yet validated:
            # cut to an id's length), as the servicer's own refusals log it
            tenant = logged_tenant(request)
            if self.refusing:
                await self._reject(context, name, "SHUTTING_DOWN",
                                   "this server process is shutting down; retry",
                                   {}, tenant, code=grpc.StatusCode.UNAVAILABLE)
            if self.in_flight >= self._limits.max_concurrent:
                await self._reject(context, name, "TOO_MANY_CONCURRENT_RPCS",
                                   f"{self.in_flight} RPCs in flight, the limit of this "
                                   "process; retry with backoff",
                                   {"limit": str(self._limits.max_concurrent)}, tenant)
            if isinstance(request, Message):
                found = shape_violation(request, self._limits, base_items=self._base_items)
                if found is not None:
                    await self._reject(context, name, found.reason, found.message(),
                                       {"field": found.field, "size": str(found.size),
                                        "limit": str(found.limit)}, tenant)
            self.in_flight += 1
            try:
                return await inner(request, context)
            finally:
                self.in_flight -= 1

        return grpc.unary_unary_rpc_method_handler(
            limited, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)

    async def _reject(self, context: grpc.aio.ServicerContext[Any, Any], method: str,
                      reason: str, message: str, metadata: dict[str, str], tenant: str, *,
                      code: grpc.StatusCode = grpc.StatusCode.RESOURCE_EXHAUSTED) -> None:
        await refuse(context, self._metrics, method=method, code=code, reason=reason,
                     message=message, metadata=metadata, tenant=tenant, tracer=self._tracer)


def logged_tenant(request: Any) -> str:
    """The tenant id a request names, cut to an id's longest (256 characters)."""
    tenant = getattr(request, "tenant_id", "") if isinstance(request, Message) else ""
    return tenant[:MAX_ID_LENGTH] if isinstance(tenant, str) else ""
