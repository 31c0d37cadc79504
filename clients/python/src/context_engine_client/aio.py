"""The asyncio client (grpc.aio)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Self, TypeVar

import grpc
from google.protobuf.message import Message

from context_engine_client._channel import (
    DEFAULT_COMPACT_TIMEOUT,
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_TIMEOUT,
    KEYED,
    Metadata,
    check_request,
    check_timeout,
    has_idempotency_key,
    merge_metadata,
    time_left,
)
from context_engine_client._incremental import (
    DEFAULT_MAX_SESSIONS,
    BuildStats,
    DeltaMismatch,
    IncrementalBuilds,
    Tally,
    base_unknown,
)
from context_engine_client._pb.context_engine.v1 import context_engine_pb2 as pb
from context_engine_client._pb.context_engine.v1 import context_engine_pb2_grpc as pb_grpc
from context_engine_client._settings import settings
from context_engine_client.errors import (
    CLOSED_DURING,
    ClientClosed,
    FailedPrecondition,
    from_rpc_error,
)

Resp = TypeVar("Resp", bound=Message)


class AsyncClient:
    """An asyncio client of one context-engine endpoint (create it inside the event loop
    that uses it).

    Every call has a deadline (``timeout`` seconds, overridable per call; Compact's is
    ``compact_timeout``, 60 s by default, since it waits on an LLM summarizer) that covers its
    retries, sends ``authorization: Bearer <token>`` when a token is given, and raises a
    :class:`~context_engine_client.ContextEngineError` subclass on failure. ``UNAVAILABLE`` is
    retried for the idempotent RPCs (Plan, GetPlan, Build, UpdateWorkingState,
    CarryWorkingState, DeleteSession) and, only when the request carries an idempotency key,
    for Rotate, Compact and ReportUsage.

    Its arguments are :class:`~context_engine_client.Client`'s, TLS and the token's
    plaintext rule included.

    ``incremental`` (on by default): :meth:`build` sends only the checkpoint items that changed
    since the session's last Build and reads the response back from its delta (see
    :attr:`build_stats`); what it holds is bounded by ``incremental_sessions`` sessions.
    """

    def __init__(self, *, target: str, token: str | None = None, tls: bool | None = None,
                 root_certificates: bytes | None = None,
                 client_certificate_chain: bytes | None = None,
                 client_private_key: bytes | None = None, server_name: str | None = None,
                 timeout: float = DEFAULT_TIMEOUT,
                 compact_timeout: float = DEFAULT_COMPACT_TIMEOUT,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 service_config: str | None = None,
                 channel_options: Sequence[tuple[str, Any]] = (),
                 incremental: bool = True,
                 incremental_sessions: int = DEFAULT_MAX_SESSIONS) -> None:
        self._settings = settings(
            target=target, token=token, tls=tls, root_certificates=root_certificates,
            client_certificate_chain=client_certificate_chain,
            client_private_key=client_private_key, server_name=server_name, timeout=timeout,
            compact_timeout=compact_timeout,
            max_message_bytes=max_message_bytes, service_config=service_config,
            channel_options_extra=channel_options)
        self._incremental = IncrementalBuilds(incremental_sessions) if incremental else None
        s = self._settings
        if s.credentials is None:
            self._channel = grpc.aio.insecure_channel(s.target, options=s.options)
        else:
            self._channel = grpc.aio.secure_channel(s.target, s.credentials, options=s.options)
        self._stubs = pb_grpc.ContextEngineStub(self._channel)
        self._keyed: tuple[grpc.aio.Channel, pb_grpc.ContextEngineAsyncStub] | None = None
        self._closed = False  # a keyed channel is never opened after close()

    @property
    def target(self) -> str:
        return self._settings.target

    @property
    def build_stats(self) -> BuildStats:
        """What this client's Builds moved, incremental or whole (all zero with
        ``incremental=False``)."""
        return BuildStats() if self._incremental is None else self._incremental.stats

    def forget_session(self, tenant_id: str, session_id: str) -> None:
        """Drops what the client holds of a session's last Build: its next Build goes whole."""
        if self._incremental is not None:
            self._incremental.forget(tenant_id, session_id)

    async def close(self, grace: float | None = None) -> None:
        """Closes the channel; calls still in flight after ``grace`` seconds are cancelled."""
        self._closed = True
        # both channels at once: one after the other took up to twice ``grace``
        await asyncio.gather(self._channel.close(grace),
                             *([] if self._keyed is None else [self._keyed[0].close(grace)]))

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    # ------------------------------------------------------------------------------ the RPCs

    async def plan(self, *, request: pb.PlanRequest,
                   timeout: float | None = None,
                   metadata: Metadata | None = None) -> pb.PlanResponse:
        """Returns the session's current plan, creating epoch 1 or rotating when a pinned input
        changed. Idempotent."""
        return await self._invoke("Plan", request, pb.PlanResponse, timeout, metadata)

    async def get_plan(self, *, request: pb.GetPlanRequest,
                       timeout: float | None = None,
                       metadata: Metadata | None = None) -> pb.GetPlanResponse:
        """The current (``epoch`` 0) or a given epoch's plan. Read-only."""
        return await self._invoke("GetPlan", request, pb.GetPlanResponse, timeout, metadata)

    async def build(self, *, request: pb.BuildRequest,
                    timeout: float | None = None,
                    metadata: Metadata | None = None) -> pb.BuildResponse:
        """One model request under the budget, with its budget report, pressure and cache
        markers. Pure. Incremental (unless the client was made with ``incremental=False``):
        only the checkpoint items that changed since the session's last Build through this
        client are sent, naming that Build as the base, and the response is read back whole
        (``delta`` unset, its ``build_id`` kept), equal to the answer to the whole request. A
        replica that does not hold the base (``BUILD_BASE_UNKNOWN``) is sent the whole request
        once more; any other error drops what the client held of the session. A request that
        names a base itself is sent as it is."""
        builds = self._incremental
        if builds is None:
            return await self._invoke("Build", request, pb.BuildResponse, timeout, metadata)
        check_request("Build", request)
        if self._closed:  # before its deadline is read, as every call after close()
            raise ClientClosed
        if request.base_build_id or request.base_items_kept:
            return await self._invoke("Build", request, pb.BuildResponse, timeout, metadata)
        # one deadline for the Build, its resend included
        deadline = time.monotonic() + (
            self._settings.timeout if timeout is None else check_timeout(timeout))
        try:
            tally = Tally(keep_base=request.keep_base)
            wire, base = builds.prepare(request, tally)
            try:
                return builds.absorb(wire, await self._invoke(
                    "Build", wire, pb.BuildResponse, time_left(deadline), metadata), base, tally)
            except FailedPrecondition as err:
                if base is None or not base_unknown(err):
                    raise
                tally.refused(wire)
            except DeltaMismatch:
                pass  # its bytes are in the tally
            # the same Build (not the caller's request as it may be now), whole, once, in
            # what is left of the deadline; the session is forgotten
            whole = builds.fallback(wire, base, tally)
            return builds.absorb(whole, await self._invoke(
                "Build", whole, pb.BuildResponse, time_left(deadline), metadata), None, tally)
        except BaseException:
            builds.forget(request.tenant_id, request.session_id)
            raise

    async def rotate(self, *, request: pb.RotateRequest,
                     timeout: float | None = None,
                     metadata: Metadata | None = None) -> pb.RotateResponse:
        """A new epoch for a stated reason; a retried idempotency key rotates once."""
        return await self._invoke("Rotate", request, pb.RotateResponse, timeout, metadata)

    async def report_usage(self, *, request: pb.ReportUsageRequest,
                           timeout: float | None = None,
                           metadata: Metadata | None = None) -> pb.ReportUsageResponse:
        """The provider's actual usage of a sent request; counted once per idempotency key."""
        return await self._invoke("ReportUsage", request, pb.ReportUsageResponse, timeout, metadata)

    async def update_working_state(self, *, request: pb.UpdateWorkingStateRequest,
                                   timeout: float | None = None,
                                   metadata: Metadata | None = None,
                                   ) -> pb.UpdateWorkingStateResponse:
        """Applies one working-state transition. Pure. Send the model's
        ``context.update_working_state`` call as the provider returned it
        (``transition.tool_call``: call id, name, arguments JSON) and return the response's
        ``tool_result`` to the model; when its arguments are invalid this raises
        :class:`InvalidArgument` whose ``tool_result`` names the errors and carries the tool's
        input schema, for the model as well."""
        return await self._invoke(
            "UpdateWorkingState", request, pb.UpdateWorkingStateResponse, timeout, metadata)

    async def carry_working_state(self, *, request: pb.CarryWorkingStateRequest,
                                  timeout: float | None = None,
                                  metadata: Metadata | None = None) -> pb.CarryWorkingStateResponse:
        """The next run's working state, from the session's log events. Pure."""
        return await self._invoke(
            "CarryWorkingState", request, pb.CarryWorkingStateResponse, timeout, metadata)

    async def compact(self, *, request: pb.CompactRequest,
                      timeout: float | None = None,
                      metadata: Metadata | None = None) -> pb.CompactResponse:
        """Compacts the oldest carried history into a summary (a write); a retried idempotency
        key returns the stored result."""
        return await self._invoke("Compact", request, pb.CompactResponse,
                                  self._settings.compact_timeout if timeout is None
                                  else timeout, metadata)

    async def delete_session(self, *, request: pb.DeleteSessionRequest,
                             timeout: float | None = None,
                             metadata: Metadata | None = None) -> pb.DeleteSessionResponse:
        """Erases a session: its plans, events, compactions, usage rows and idempotency keys
        (audited, no content kept). Idempotent (``deleted`` is false when there was nothing to
        erase), so it is retried on ``UNAVAILABLE``. Replicas stop serving it from their plan
        caches within the response's ``plan_cache_seconds``. The client forgets what it held
        of the session's last Build, and of a Build of the session answered while the erasure
        runs."""
        check_request("DeleteSession", request)
        self.forget_session(request.tenant_id, request.session_id)
        try:
            return await self._invoke("DeleteSession", request, pb.DeleteSessionResponse,
                                      timeout, metadata)
        finally:  # a Build answered meanwhile ran on what is being erased
            self.forget_session(request.tenant_id, request.session_id)

    # ------------------------------------------------------------------------------ internals

    def _stub(self, method: str, request: Message) -> pb_grpc.ContextEngineAsyncStub:
        if method in KEYED and has_idempotency_key(request):
            if self._keyed is None:  # opened on first use: most runtimes never need it
                s = self._settings
                if s.credentials is None:
                    channel = grpc.aio.insecure_channel(s.target, options=s.keyed_options)
                else:
                    channel = grpc.aio.secure_channel(s.target, s.credentials,
                                                      options=s.keyed_options)
                self._keyed = (channel, pb_grpc.ContextEngineStub(channel))
            return self._keyed[1]
        return self._stubs

    async def _invoke(self, method: str, request: Message, response: type[Resp],
                      timeout: float | None, metadata: Metadata | None) -> Resp:
        check_request(method, request)
        if self._closed:  # nothing awaits from here to the call: close() cannot come between
            raise ClientClosed
        s = self._settings
        call: grpc.aio.UnaryUnaryMultiCallable[Message, Resp] = getattr(
            self._stub(method, request), method)
        try:
            return await call(request,
                              timeout=s.timeout if timeout is None else check_timeout(timeout),
                              metadata=merge_metadata(s.metadata, metadata))
        except grpc.RpcError as err:
            raise from_rpc_error(err) from err
        except asyncio.CancelledError:
            # close() cancels the calls in flight, which grpc raises as the caller's own
            # cancellation; one that was not the caller's is the client's error
            task = asyncio.current_task()
            if self._closed and (task is None or not task.cancelling()):
                raise ClientClosed(CLOSED_DURING) from None
            raise
