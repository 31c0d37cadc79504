"""The synchronous client."""

from __future__ import annotations

import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Self, cast

import grpc

from context_engine_client import _channel as rpcs
from context_engine_client._channel import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_TIMEOUT,
    Req,
    Resp,
    Rpc,
    check_timeout,
    has_idempotency_key,
)
from context_engine_client._pb.context_engine.v1 import context_engine_pb2 as pb
from context_engine_client._settings import settings
from context_engine_client.errors import from_rpc_error


class Client:
    """A blocking client of one context-engine endpoint.

    Every call has a deadline (``timeout`` seconds, overridable per call) that covers its
    retries, sends ``authorization: Bearer <token>`` when a token is given, and raises a
    :class:`~context_engine_client.ContextEngineError` subclass on failure. ``UNAVAILABLE`` is
    retried for the idempotent RPCs (Plan, GetPlan, Build, UpdateWorkingState,
    CarryWorkingState) and, only when the request carries an idempotency key, for Rotate,
    Compact and ReportUsage.

    ``tls`` (or any certificate) turns TLS on: ``root_certificates`` to trust (PEM; the system
    roots when absent), ``client_certificate_chain`` and ``client_private_key`` for mutual TLS,
    ``server_name`` to check the server's certificate against another name. ``service_config``
    replaces the packaged retry policy (gRPC service config JSON).
    """

    def __init__(self, *, target: str, token: str | None = None, tls: bool = False,
                 root_certificates: bytes | None = None,
                 client_certificate_chain: bytes | None = None,
                 client_private_key: bytes | None = None, server_name: str | None = None,
                 timeout: float = DEFAULT_TIMEOUT,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 service_config: str | None = None,
                 channel_options: Sequence[tuple[str, Any]] = ()) -> None:
        self._settings = settings(
            target=target, token=token, tls=tls, root_certificates=root_certificates,
            client_certificate_chain=client_certificate_chain,
            client_private_key=client_private_key, server_name=server_name, timeout=timeout,
            max_message_bytes=max_message_bytes, service_config=service_config,
            channel_options_extra=channel_options)
        s = self._settings
        if s.credentials is None:
            self._channel = grpc.insecure_channel(s.target, options=s.options)
        else:
            self._channel = grpc.secure_channel(s.target, s.credentials, options=s.options)
        self._callables: dict[str, grpc.UnaryUnaryMultiCallable[Any, Any]] = {}

    @property
    def target(self) -> str:
        return self._settings.target

    def close(self) -> None:
        """Closes the channel; calls in flight are cancelled."""
        self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # ------------------------------------------------------------------------------ the RPCs

    def plan(self, *, request: pb.PlanRequest, timeout: float | None = None) -> pb.PlanResponse:
        """Returns the session's current plan, creating epoch 1 or rotating when a pinned input
        changed. Idempotent."""
        return self._invoke(rpcs.PLAN, request, timeout)

    def get_plan(self, *, request: pb.GetPlanRequest,
                 timeout: float | None = None) -> pb.GetPlanResponse:
        """The current (``epoch`` 0) or a given epoch's plan. Read-only."""
        return self._invoke(rpcs.GET_PLAN, request, timeout)

    def build(self, *, request: pb.BuildRequest,
              timeout: float | None = None) -> pb.BuildResponse:
        """One model request under the budget, with its budget report, pressure and cache
        markers. Pure."""
        return self._invoke(rpcs.BUILD, request, timeout)

    def rotate(self, *, request: pb.RotateRequest,
               timeout: float | None = None) -> pb.RotateResponse:
        """A new epoch for a stated reason; a retried idempotency key rotates once."""
        return self._invoke(rpcs.ROTATE, request, timeout)

    def report_usage(self, *, request: pb.ReportUsageRequest,
                     timeout: float | None = None) -> pb.ReportUsageResponse:
        """The provider's actual usage of a sent request; counted once per idempotency key."""
        return self._invoke(rpcs.REPORT_USAGE, request, timeout)

    def update_working_state(self, *, request: pb.UpdateWorkingStateRequest,
                             timeout: float | None = None) -> pb.UpdateWorkingStateResponse:
        """Applies one working-state transition. Pure. Send the model's
        ``context.update_working_state`` call as the provider returned it
        (``transition.tool_call``: call id, name, arguments JSON) and return the response's
        ``tool_result`` to the model; when its arguments are invalid this raises
        :class:`InvalidArgument` whose ``tool_result`` names the errors and carries the tool's
        input schema, for the model as well."""
        return self._invoke(rpcs.UPDATE_WORKING_STATE, request, timeout)

    def carry_working_state(self, *, request: pb.CarryWorkingStateRequest,
                            timeout: float | None = None) -> pb.CarryWorkingStateResponse:
        """The next run's working state, from the session's log events. Pure."""
        return self._invoke(rpcs.CARRY_WORKING_STATE, request, timeout)

    def compact(self, *, request: pb.CompactRequest,
                timeout: float | None = None) -> pb.CompactResponse:
        """Compacts the oldest carried history into a summary (a write); a retried idempotency
        key returns the stored result."""
        return self._invoke(rpcs.COMPACT, request, timeout)

    # ------------------------------------------------------------------------------ internals

    def _callable(self, rpc: Rpc[Req, Resp]) -> grpc.UnaryUnaryMultiCallable[Req, Resp]:
        found = self._callables.get(rpc.name)
        if found is None:
            found = self._callables[rpc.name] = self._channel.unary_unary(
                rpc.path, request_serializer=rpc.serialize,
                response_deserializer=rpc.deserialize)
        return cast("grpc.UnaryUnaryMultiCallable[Req, Resp]", found)

    def _invoke(self, rpc: Rpc[Req, Resp], request: Req, timeout: float | None) -> Resp:
        if not isinstance(request, rpc.request):
            raise TypeError(f"{rpc.name} takes a {rpc.request.__name__}, "
                            f"not a {type(request).__name__}")
        s = self._settings
        deadline = time.monotonic() + (s.timeout if timeout is None else check_timeout(timeout))
        # The channel's service config retries the idempotent RPCs; the keyed ones are retried
        # here, because whether they may be depends on the request.
        attempts = s.policy.max_attempts if rpc.keyed and has_idempotency_key(request) else 1
        call = self._callable(rpc)
        attempt = 1
        while True:
            try:
                return call(request, timeout=max(deadline - time.monotonic(), 0.0),
                            metadata=s.metadata)
            except grpc.RpcError as err:
                error = from_rpc_error(err)
                if attempt < attempts and error.code in s.policy.retryable_codes:
                    pause = s.policy.backoff(attempt)
                    if time.monotonic() + pause < deadline:
                        time.sleep(pause)
                        attempt += 1
                        continue
                raise error from err
