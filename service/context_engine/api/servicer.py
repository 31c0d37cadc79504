"""The ContextEngine servicer: proto in, domain call, proto out. Nothing else lives here."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar, cast

import grpc
from google.protobuf.message import DecodeError
from google.protobuf.message import Message as ProtoMessage
from grpc_status import rpc_status
from opentelemetry.trace import NoOpTracer, Tracer

from context_engine.api import incremental, mapping, working_state_tool
from context_engine.api.rpc_metrics import cancelled_code
from context_engine.api.status import SERVICE, call_started, internal_status, status_for
from context_engine.domain.budget import Pressure
from context_engine.domain.builder import (
    BuildResult,
    LoadedPlan,
    checkpoint_scan,
    skill_violations,
)
from context_engine.domain.canonical import session_key
from context_engine.domain.errors import (
    BudgetExceeded,
    BuildBaseUnknown,
    ContextEngineError,
    FieldViolation,
    InvalidInput,
    PrefixHashMismatch,
    RequestTooLarge,
    ResponseTooLarge,
    SessionNotFound,
)
from context_engine.domain.items import ConversationItem
from context_engine.domain.plan import ContextPlan
from context_engine.domain.provider_common import ProviderFormatError
from context_engine.engine import Engine
from context_engine.telemetry.logs import log
from context_engine.telemetry.metrics import Metrics
from context_engine.telemetry.tracing import child, failed, server_span
from context_engine.v1 import context_engine_pb2 as pb
from context_engine.v1 import context_engine_pb2_grpc as pb_grpc

Req = TypeVar("Req")
Resp = TypeVar("Resp")
# Who is calling, as an erasure records it: set by the credentials interceptor for each call
# ("token:" and the first 12 hex of the token's SHA-256); "dev" when no credentials are checked.
CALLER: ContextVar[str] = ContextVar("context_engine_caller", default="dev")


@dataclass
class CallRecord:
    """What one RPC reports to its log line (never content)."""

    tenant: str = ""
    epoch: int = 0
    prefix_sha256: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    session_key: str = ""  # hashed: spans carry it instead of tenant and session ids
    span: dict[str, Any] = field(default_factory=dict)  # span-only attributes (sizes)

    def session(self, tenant_id: str, session_id: str) -> None:
        self.tenant = tenant_id
        if tenant_id and session_id:
            self.session_key = session_key(tenant_id, session_id)

    def ran_on(self, plan: ContextPlan) -> None:
        """The plan the call runs on: its epoch and prefix go on the log line and the span."""
        self.epoch, self.prefix_sha256 = plan.epoch, plan.prefix_sha256


def _unplaced(violations: Sequence[FieldViolation]) -> list[FieldViolation]:
    """``violations`` but those of the items of a checkpoint whose items have no known place
    (an incremental Build keeping more items than its base holds): any position would be
    wrong, and the Build is refused on its kept count anyway."""
    return [f for f in violations if not f.field.startswith("checkpoint.items[")]


def _outcome_read(future: asyncio.Future[Any]) -> None:
    """A plan lookup's outcome is read even when nothing awaits it (the request was refused
    meanwhile), so a failed one is not reported as never retrieved."""
    if not future.cancelled():
        future.exception()


class ContextEngineServicer(pb_grpc.ContextEngineServicer):
    def __init__(self, engine: Engine, metrics: Metrics, tracer: Tracer | None = None, *,
                 new_id: Callable[[], str] = lambda: secrets.token_hex(16)) -> None:
        """``new_id``: where Build ids come from (random; injected by tests)."""
        self._engine = engine
        self._new_id = new_id
        self._metrics = metrics
        self._tracer: Tracer = tracer or NoOpTracer()
        # Set by add_to_server: every response is then serialized here, within the call, so one
        # over the limit is answered RESPONSE_TOO_LARGE (size, limit) like any other error;
        # gRPC's own send limit (twice it) would end the call RESOURCE_EXHAUSTED with no
        # details. None (a servicer called directly): responses are returned as messages.
        self.max_response_bytes: int | None = None

    async def _run(self, method: str, context: grpc.aio.ServicerContext[Any, Any],
                   call: Callable[[CallRecord], Awaitable[Resp]]) -> Resp:
        started = call_started()  # when an interceptor first saw the call
        record = CallRecord()
        code = grpc.StatusCode.OK
        # The RPC span continues the caller's trace (W3C traceparent in the metadata).
        with server_span(self._tracer, SERVICE, method,
                         context.invocation_metadata()) as span:
            try:
                response = await call(record)
                if self.max_response_bytes is None or isinstance(response, bytes):
                    return response  # a message, or bytes a call has already sized
                return cast(Resp, self._sized(response))
            except ContextEngineError as exc:
                code, status = status_for(exc)
                record.extra["reason"] = exc.reason
                if isinstance(exc, PrefixHashMismatch):  # which epoch, pinned and rendered how
                    record.epoch, record.prefix_sha256 = exc.epoch, exc.stored
                    record.extra["rendered_sha256"] = exc.rendered
            except asyncio.CancelledError:
                # the caller's deadline passed or it gave up (or the server is stopping): no
                # answer is sent, but the call is counted and logged with the code it ends on
                code = cancelled_code(context)
                record.extra["reason"] = code.name
                raise
            except Exception:  # an unexpected defect: logged with its type, answered INTERNAL
                logging.getLogger("context_engine").exception("unhandled error in %s", method)
                code, status = internal_status()
                record.extra["reason"] = "INTERNAL"
            finally:
                elapsed = time.perf_counter() - started
                self._metrics.rpc_seconds.labels(method=method, code=code.name).observe(elapsed)
                log("rpc", logging.INFO if code is grpc.StatusCode.OK else logging.WARNING,
                    method=method, code=code.name, duration_ms=round(elapsed * 1000, 3),
                    tenant=record.tenant, epoch=record.epoch,
                    prefix_sha256=record.prefix_sha256, **record.extra)
                if span.is_recording():
                    span.set_attribute("rpc.grpc.status_code", code.value[0])
                    span.set_attribute("context_engine.status_code", code.name)
                    if record.session_key:
                        span.set_attribute("context_engine.session_key", record.session_key)
                    if record.epoch:
                        span.set_attribute("context_engine.epoch", record.epoch)
                    if record.prefix_sha256:
                        span.set_attribute("context_engine.prefix_sha256", record.prefix_sha256)
                    for key, value in record.span.items():
                        span.set_attribute(key, value)
                    if code is not grpc.StatusCode.OK:
                        failed(span, str(record.extra["reason"]))
        # Only reached on error: abort with the rich status (ErrorInfo, BadRequest).
        await context.abort(code, status.message,
                            rpc_status.to_status(status).trailing_metadata)
        raise AssertionError("unreachable: abort raises")

    async def Plan(self, request: pb.PlanRequest,
                   context: grpc.aio.ServicerContext[Any, Any]) -> pb.PlanResponse:
        async def call(record: CallRecord) -> pb.PlanResponse:
            record.session(request.tenant_id, request.session_id)
            cmd = mapping.plan_command(request)
            # the response to an epoch it writes, made and sized before the write commits
            made: list[pb.PlanResponse] = []
            respond = self._writing(made, lambda loaded: pb.PlanResponse(
                plan=mapping.plan_pb(loaded, catalog=self._engine.catalog), created=True))
            plan, created = await self._engine.plan(cmd, then=respond)
            try:
                loaded = await self._engine.loaded(plan.tenant_id, plan.session_id, plan.epoch,
                                                   incarnation=plan.incarnation)
            except SessionNotFound:
                # erased between its pin and this read (a DeleteSession racing it): planned
                # again, once, it opens the session anew (a second erasure in that time is
                # answered NOT_FOUND)
                plan, created = await self._engine.plan(cmd, then=respond)
                loaded = await self._engine.loaded(plan.tenant_id, plan.session_id, plan.epoch,
                                                   incarnation=plan.incarnation)
            record.epoch, record.prefix_sha256 = plan.epoch, plan.prefix_sha256
            record.extra["created"] = created
            if created:
                return made[-1]
            return pb.PlanResponse(plan=mapping.plan_pb(loaded, catalog=self._engine.catalog),
                                   created=created)
        return await self._run("Plan", context, call)

    async def GetPlan(self, request: pb.GetPlanRequest,
                      context: grpc.aio.ServicerContext[Any, Any]) -> pb.GetPlanResponse:
        async def call(record: CallRecord) -> pb.GetPlanResponse:
            record.session(request.tenant_id, request.session_id)
            v = mapping.Violations()
            mapping.session_ids(v, request.tenant_id, request.session_id)
            epoch = mapping.epoch(v, request.epoch)
            v.raise_if_any()
            loaded = await self._engine.read_plan(request.tenant_id, request.session_id, epoch)
            record.epoch, record.prefix_sha256 = loaded.plan.epoch, loaded.plan.prefix_sha256
            return pb.GetPlanResponse(plan=mapping.plan_pb(loaded, catalog=self._engine.catalog))
        return await self._run("GetPlan", context, call)

    def _writing(self, made: list[Resp], respond: Callable[..., Resp]
                 ) -> Callable[..., None]:
        """The ``then`` of a write: its response made from what is written and, under a send
        limit, sized (as ``_run`` would after the call) and appended to ``made``, before the
        write commits, so a response refused RESPONSE_TOO_LARGE writes nothing (DESIGN 2: a
        failed call changes nothing). ``_run`` passes the bytes made here through."""
        def then(*written: Any) -> None:
            response = respond(*written)
            made.append(response if self.max_response_bytes is None
                        else cast(Resp, self._sized(response)))
        return then

    def _sized(self, response: Any) -> bytes:
        """``response`` serialized, refused RESPONSE_TOO_LARGE over ``max_response_bytes``
        (the handler's serializer passes bytes through)."""
        data: bytes = response.SerializeToString()
        if self.max_response_bytes is not None and len(data) > self.max_response_bytes:
            raise ResponseTooLarge(len(data), self.max_response_bytes)
        return data

    async def Build(self, request: pb.BuildRequest,
                    context: grpc.aio.ServicerContext[Any, Any]) -> pb.BuildResponse:
        ran_on: list[int] = []  # the incarnation each attempt read the plan of
        # per attempt that began reading its plan (and rendering): the latest incarnation of
        # the session known here then (None: none)
        reading: list[int | None] = []
        # seconds each attempt spent assembling the request: observed once, as the call's
        assembled: list[float] = []

        async def call(record: CallRecord) -> pb.BuildResponse:
            record.session(request.tenant_id, request.session_id)
            base = None
            if request.base_build_id:
                # an incremental Build: its base is looked for before anything of the request
                # is judged. One not held here is BUILD_BASE_UNKNOWN whatever else is wrong
                # with the request (the clients answer it by sending the Build whole, whose
                # refusal names every bad field, the items' included: a refusal of this one
                # could name none of its items, whose place is unknown). The base reference
                # itself has nothing to refuse before its base is found (any string is an id
                # no base has; a kept count is judged against the base's items), and the
                # lookup needs no valid id: a base is kept only by a Build whose ids were
                # valid. Looked up without refreshing it: only a Build that succeeds on it
                # does.
                base = self._engine.builds.peek(request.tenant_id, request.session_id,
                                                request.base_build_id)
                if base is None:
                    raise BuildBaseUnknown(request.base_build_id, "unknown here or evicted")
            v = mapping.Violations()
            mapping.session_ids(v, request.tenant_id, request.session_id)
            epoch = mapping.epoch(v, request.epoch)
            # the plan can be read once the session and the epoch are valid (a refused
            # base_items_kept does not stop it: the loaded skills are checked against it)
            readable = not v.items
            factor = None
            if request.HasField("estimator_factor"):
                factor = request.estimator_factor
                if not 0.5 <= factor <= 4.0:
                    v.add("estimator_factor", f"{factor} is outside [0.5, 4.0]")
            provider_format = mapping.requested_provider_format(v, request.provider_format)
            kept = request.base_items_kept
            placed = True  # whether the items sent have a place in the whole checkpoint
            if base is not None:
                # the base's first items, then the ones sent
                if kept > len(base.items):
                    v.add("base_items_kept", f"{kept} is more than the base's "
                          f"{len(base.items)} items")
                    kept, placed = len(base.items), False
            elif kept:
                v.add("base_items_kept", "is set without base_build_id")
            # The plan is read (a query without an epoch) while the checkpoint is mapped and
            # scanned; its outcome is used only once the request is known to be valid. A
            # refused request waits for its lookup to end before it answers (nothing of it
            # outlives its answer, and the concurrency limit still counts it): cancelling a
            # query would cost asyncpg a connection of its own. A cancelled call cancels it.
            lookup: asyncio.Future[LoadedPlan] | None = None
            if readable:
                reading.append(self._engine.latest_incarnation(request.tenant_id,
                                                               request.session_id))
                lookup = asyncio.ensure_future(
                    self._engine.loaded(request.tenant_id, request.session_id, epoch))
                lookup.add_done_callback(_outcome_read)
                await asyncio.sleep(0)  # the query goes out before the CPU work below
            try:
                # the render memo keeps each item's mapping for the session's next Build; not
                # for a request refused before its plan is read (nothing would find the
                # session erased and drop what it kept)
                memo = self._engine.render_memo if record.session_key and readable else None
                # an item is named by its position in the whole checkpoint (the base's first
                # items, then those sent): a refusal is the whole Build's, field for field
                wides: list[int] = []  # what a kept base counts the items for beyond bytes
                # items with no place (a kept count over the base's items) are not judged,
                # as the limits judge none of them: a violation would name a wrong place
                mapped = mapping.Violations()
                checkpoint = mapping.checkpoint(mapped, request.checkpoint, memo=memo,
                                                session_key=record.session_key,
                                                first_index=kept if base is not None else 0,
                                                wides=wides)
                v.items.extend(mapped.items if placed else _unplaced(mapped.items))
                if base is not None:
                    checkpoint = replace(checkpoint,
                                         items=base.items[:kept] + checkpoint.items)
                # appended to all of the base's items (scanned clean when it was built): only
                # the new items are scanned, on from the base's scan state; a Build that
                # replaces the base's items from a position (kept < all of them) is scanned
                # whole
                resume = base.scan if base is not None and kept == len(base.items) else None
                violations, scan = checkpoint_scan(checkpoint, resume=resume)
                v.items.extend(violations if placed else _unplaced(violations))
                if v.items and lookup is not None and checkpoint.loaded_skills:
                    # a refusal is the whole Build's: what the build would refuse of the
                    # loaded skills against the plan's catalog is reported with the rest
                    await asyncio.wait([lookup])
                    if not lookup.cancelled() and lookup.exception() is None:
                        # a field already refused (an empty name, a level not accepted) is
                        # not refused again
                        seen = {f.field for f in v.items}
                        v.items.extend(f for f in skill_violations(
                            lookup.result().plan.spec.skill_catalog, checkpoint.loaded_skills)
                            if f.field not in seen)
                v.raise_if_any()
            except asyncio.CancelledError:
                if lookup is not None:
                    lookup.cancel()
                raise
            except BaseException:
                if lookup is not None:
                    try:
                        await asyncio.wait([lookup])  # its outcome is read, never raised here
                    except asyncio.CancelledError:  # cancelled while it waits: so is the lookup
                        lookup.cancel()
                        raise
                    if not lookup.cancelled() and lookup.exception() is None:
                        ran_on.append(lookup.result().plan.incarnation)  # what it rendered
                raise
            # Resolved first so a failed build still logs the epoch and prefix it ran on;
            # the build's own lookup is then a plan-cache hit.
            assert lookup is not None  # no violations: the lookup was started
            loaded = await lookup
            ran_on.append(loaded.plan.incarnation)
            record.epoch, record.prefix_sha256 = loaded.plan.epoch, loaded.plan.prefix_sha256
            if base is not None and base.incarnation != loaded.plan.incarnation:
                # erased (perhaps through another replica) and planned again: the erased
                # incarnation's bases are dropped here, not only refused
                self._engine.builds.forget(request.tenant_id, request.session_id,
                                           before=loaded.plan.incarnation)
                raise BuildBaseUnknown(request.base_build_id, "the session was erased since")
            builds = self._engine.builds
            answer = None  # an incremental Build's answer, and the base it leaves
            response = pb.BuildResponse()
            rendered = ""
            sized: bytes | None = None

            def respond(result: BuildResult) -> None:
                """The response, made and sized before the Build writes its snapshot binding
                or pressure event, so a refusal here (a format that cannot carry an item, a
                response over the size limit) writes nothing (what the call's log line and
                span say of the Build is recorded first, so a failure to render still carries
                it)."""
                nonlocal answer, response, rendered, sized
                record.epoch, record.prefix_sha256 = result.epoch, result.prefix_sha256
                record.extra["estimated_input_tokens"] = result.estimated_input_tokens
                record.extra["yield_steps"] = [s.step for s in result.pressure.steps]
                record.span["context_engine.prefix_tokens"] = result.prefix_tokens
                record.span["context_engine.body_tokens"] = result.body_tokens
                record.span["context_engine.estimated_input_tokens"] = \
                    result.estimated_input_tokens
                for c in result.budget.classes:
                    record.span[f"context_engine.tokens.{c.class_name}"] = c.used
                record.span["context_engine.yield_steps"] = record.extra["yield_steps"]
                with child(self._tracer, "context_engine.render") as render_span, \
                        _located(checkpoint.items):
                    if base is not None or request.keep_base:
                        answer = incremental.respond(
                            result, provider_format, self._engine.catalog,
                            build_id=self._new_id(), tenant_id=request.tenant_id,
                            session_id=request.session_id,
                            incarnation=loaded.plan.incarnation, items=checkpoint.items,
                            scan=scan,
                            sizes=incremental.item_bytes(request.checkpoint.items, wides,
                                                         base, kept),
                            base=base, memo=self._engine.render_memo, keeps=builds.fits)
                        response = answer.response
                    else:  # nothing kept: no build_id, the same bytes as any whole Build
                        response = mapping.build_pb(result, provider_format,
                                                    catalog=self._engine.catalog,
                                                    memo=self._engine.render_memo)
                    rendered = mapping.FORMAT_FROM_PB.get(response.provider_format, "")
                    if render_span.is_recording():
                        render_span.set_attribute("context_engine.provider_format", rendered)
                if rendered:  # the format rendered: the asked one or the model's default
                    record.extra["provider_format"] = rendered
                if base is not None and answer is not None:
                    record.extra["base_items_kept"] = kept
                    record.extra["messages_sent"] = answer.sent_messages
                # sized before its base is kept: a response never handed over keeps nothing
                # (nor evicts a base the session's next Build names)
                if self.max_response_bytes is not None:
                    sized = self._sized(response)

            try:
                await self._engine.build(request.tenant_id, request.session_id,
                                         loaded.plan.epoch, checkpoint, factor, validated=True,
                                         incarnation=loaded.plan.incarnation, then=respond,
                                         assembled=assembled)
            except BudgetExceeded as exc:
                # the steps that ran before it failed (its pressure event and the metric
                # count them, with fits false): the line and span say so too
                ran = exc.pressure.steps if isinstance(exc.pressure, Pressure) else ()
                record.extra["yield_steps"] = [s.step for s in ran]
                record.span["context_engine.yield_steps"] = record.extra["yield_steps"]
                raise
            if base is not None:  # used: the most recent in its session's order too
                builds.touch(request.base_build_id)
            if answer is not None and answer.base is not None:  # else kept nowhere
                evicted = builds.put(response.build_id, answer.base)
                if evicted:  # their memory is given back once the response is handed over
                    asyncio.get_running_loop().call_soon(evicted.clear)
            return response if sized is None else cast(pb.BuildResponse, sized)

        async def read_again_if_replanned(record: CallRecord) -> pb.BuildResponse:
            # a run's snapshot binding may find the session erased and planned again since
            # this replica cached the plan the Build named: made again on the plan read now
            mark = self._engine.forgets

            def attempt() -> Awaitable[pb.BuildResponse]:
                # marked when the attempt begins: one made again after the erased session's
                # plans were forgotten runs on the plan read then, and keeps what it makes
                nonlocal mark
                mark = self._engine.forgets
                return call(record)
            try:
                return await self._engine.once_more_if_replanned(
                    request.tenant_id, request.session_id, request.epoch or None, attempt)
            finally:
                self._engine.observe_assembly(assembled)
                # a session erased while this Build ran (it waits on the database), here or
                # through another replica this one has heard of since (a forget, or a read
                # naming a later incarnation than the Build's), loses what the Build kept of
                # it after the erasure dropped it: its renderings in the memo, the base it
                # kept (a session planned anew meanwhile keeps its own bases). A Build that never
                # read its plan (the database away, its deadline passed) rendered for the latest
                # incarnation known when it began, or a later one: taken for that one, it is
                # judged as a Build of it (an older one is dropped sooner)
                ran = ran_on[-1] if ran_on else reading[-1] if reading else None
                key = session_key(request.tenant_id, request.session_id)
                if self._engine.forgotten_since(request.tenant_id, request.session_id, mark,
                                                ran):
                    self._engine.forget_session(request.tenant_id, request.session_id,
                                                counted=False, incarnation=ran)
                elif ran is not None:  # what it rendered is of the incarnation it ran on
                    self._engine.render_memo.settle(key, ran)
                elif reading:  # it rendered knowing no incarnation of the session: what it
                    # rendered is of none known (the session may have been erased meanwhile)
                    self._engine.render_memo.drop(key)
        return await self._run("Build", context, read_again_if_replanned)

    async def ReportUsage(self, request: pb.ReportUsageRequest,
                          context: grpc.aio.ServicerContext[Any, Any]
                          ) -> pb.ReportUsageResponse:
        async def call(record: CallRecord) -> pb.ReportUsageResponse:
            record.session(request.tenant_id, request.session_id)
            # the response names the model: an id of 256 four-byte characters takes it past
            # the least send limit, so it too is sized before the report is written
            made: list[pb.ReportUsageResponse] = []
            outcome = await self._engine.report_usage(mapping.usage_report(request),
                                                      then=self._writing(made, mapping.usage_pb))
            record.epoch, record.prefix_sha256 = outcome.epoch, outcome.prefix_sha256
            record.extra["counted"] = outcome.counted
            record.span["context_engine.input_tokens"] = request.input_tokens
            record.span["context_engine.cached_tokens"] = request.cached_tokens
            if outcome.counted:
                return made[-1]
            return mapping.usage_pb(outcome)
        return await self._run("ReportUsage", context, call)

    async def Rotate(self, request: pb.RotateRequest,
                     context: grpc.aio.ServicerContext[Any, Any]) -> pb.RotateResponse:
        async def call(record: CallRecord) -> pb.RotateResponse:
            record.session(request.tenant_id, request.session_id)
            made: list[pb.RotateResponse] = []  # as Plan's
            respond = self._writing(made, lambda loaded: pb.RotateResponse(
                plan=mapping.plan_pb(loaded, catalog=self._engine.catalog), rotated=True))
            plan, rotated = await self._engine.rotate(mapping.rotate_command(request),
                                                      then=respond)
            record.epoch, record.prefix_sha256 = plan.epoch, plan.prefix_sha256
            record.extra["rotated"] = rotated
            loaded = await self._engine.loaded(plan.tenant_id, plan.session_id, plan.epoch,
                                               incarnation=plan.incarnation)
            if rotated:
                return made[-1]
            return pb.RotateResponse(plan=mapping.plan_pb(loaded, catalog=self._engine.catalog),
                                     rotated=rotated)
        return await self._run("Rotate", context, call)

    async def UpdateWorkingState(self, request: pb.UpdateWorkingStateRequest,
                                 context: grpc.aio.ServicerContext[Any, Any]
                                 ) -> pb.UpdateWorkingStateResponse:
        async def call(record: CallRecord) -> pb.UpdateWorkingStateResponse:
            record.session(request.tenant_id, request.session_id)
            cmd = mapping.update_working_state_command(request)
            made: list[pb.UpdateWorkingStateResponse] = []  # sized before its event
            respond = self._writing(made, lambda state, changes: pb.UpdateWorkingStateResponse(
                state=mapping.working_state_pb(state), change=mapping.change_pb(changes),
                tool_result=working_state_tool.applied(changes) if cmd.call_id else ""))
            try:
                _, changes = await self._engine.update_working_state(
                    cmd, seen=record.ran_on, then=respond)
            except ContextEngineError as exc:
                if not cmd.call_id:
                    raise
                raise working_state_tool.for_the_model(exc, "transition.tool_call") from None
            record.extra["transition"] = changes.transition
            record.extra["working_state_tokens"] = changes.tokens
            return made[-1]
        return await self._run("UpdateWorkingState", context, call)

    async def CarryWorkingState(self, request: pb.CarryWorkingStateRequest,
                                context: grpc.aio.ServicerContext[Any, Any]
                                ) -> pb.CarryWorkingStateResponse:
        async def call(record: CallRecord) -> pb.CarryWorkingStateResponse:
            record.session(request.tenant_id, request.session_id)
            carried = await self._engine.carry_working_state(mapping.carry_command(request),
                                                             seen=record.ran_on)
            record.extra["events_applied"] = carried.applied
            record.extra["events_skipped"] = carried.skipped
            return pb.CarryWorkingStateResponse(
                state=mapping.working_state_pb(carried.state), events_applied=carried.applied,
                events_skipped=carried.skipped, tokens=carried.tokens)
        return await self._run("CarryWorkingState", context, call)

    async def Compact(self, request: pb.CompactRequest,
                      context: grpc.aio.ServicerContext[Any, Any]) -> pb.CompactResponse:
        async def call(record: CallRecord) -> pb.CompactResponse:
            record.session(request.tenant_id, request.session_id)
            made: list[pb.CompactResponse] = []  # sized before it is stored
            outcome = await self._engine.compact(mapping.compact_command(request),
                                                 then=self._writing(made, mapping.compact_pb))
            record.epoch, record.prefix_sha256 = outcome.epoch, outcome.prefix_sha256
            record.extra["compacted"] = outcome.compacted
            record.extra["depth"] = outcome.result.depth
            record.extra["elided"] = len(outcome.result.elided)
            if outcome.compacted:
                return made[-1]
            return mapping.compact_pb(outcome)
        return await self._run("Compact", context, call)

    async def DeleteSession(self, request: pb.DeleteSessionRequest,
                            context: grpc.aio.ServicerContext[Any, Any]
                            ) -> pb.DeleteSessionResponse:
        async def call(record: CallRecord) -> pb.DeleteSessionResponse:
            record.session(request.tenant_id, request.session_id)
            tenant_id, session_id = mapping.delete_session_ids(request)
            erased = await self._engine.delete_session(tenant_id, session_id,
                                                       requested_by=CALLER.get())
            record.extra["deleted"] = erased.deleted
            record.extra["rows"] = sum((erased.plans, erased.events, erased.compactions,
                                        erased.idempotency_keys, erased.usage_rows,
                                        erased.sessions))
            return mapping.delete_session_pb(erased, self._engine.cache.ttl)
        return await self._run("DeleteSession", context, call)


@dataclass(frozen=True)
class Undecodable:
    """A request whose bytes are no valid encoding of its message (corrupt wire format,
    invalid UTF-8 in a string field, nesting past the parser's limit)."""

    message_type: str
    why: str


@dataclass(frozen=True)
class TooLarge(Undecodable):
    """A request over the service's receive limit, refused before it is parsed."""

    size: int = 0
    limit: int = 0


def _decoder(cls: type[ProtoMessage], limit: int | None
             ) -> Callable[[bytes], ProtoMessage | Undecodable]:
    def decode(data: bytes) -> ProtoMessage | Undecodable:
        if limit is not None and len(data) > limit:
            return TooLarge(cls.DESCRIPTOR.full_name, "over the receive limit",
                            size=len(data), limit=limit)
        try:
            return cls.FromString(data)
        except DecodeError as exc:
            return Undecodable(cls.DESCRIPTOR.full_name, str(exc))
    return decode


def _refusing_undecodable(servicer: ContextEngineServicer, method: str
                          ) -> Callable[[Any, grpc.aio.ServicerContext[Any, Any]],
                                        Awaitable[Any]]:
    inner = getattr(servicer, method)

    async def handle(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        if not isinstance(request, Undecodable):
            return await inner(request, context)
        bad = request

        async def refuse(record: CallRecord) -> Any:
            if isinstance(bad, TooLarge):
                raise RequestTooLarge(bad.size, bad.limit)
            raise InvalidInput.one("request", f"is not a valid {bad.message_type}: {bad.why}")
        return await servicer._run(method, context, refuse)
    return handle


@contextlib.contextmanager
def _located(items: Sequence[ConversationItem]) -> Iterator[None]:
    """A render's refusal of an item at the item's position in the whole checkpoint."""
    try:
        yield
    except ProviderFormatError as exc:
        raise exc.located({it.id: i for i, it in enumerate(items)}) from None


def _serialize(response: Any) -> bytes:
    """Bytes as ``_run`` serialized them; a message (a servicer without a limit) serialized."""
    return response if isinstance(response, bytes) else bytes(response.SerializeToString())


def add_to_server(servicer: ContextEngineServicer, server: grpc.aio.Server, *,
                  max_request_bytes: int | None = None,
                  max_response_bytes: int | None = None) -> None:
    """Registers ``servicer`` as the generated ``add_ContextEngineServicer_to_server`` does,
    except that a request that does not decode is answered INVALID_ARGUMENT with the rich
    status of every other malformed request (gRPC itself answers UNKNOWN, naming the parser's
    exception, with no details), and one over ``max_request_bytes`` RESOURCE_EXHAUSTED
    (``REQUEST_TOO_LARGE``, with its size and the limit) before it is parsed; a response over
    ``max_response_bytes`` is likewise answered RESOURCE_EXHAUSTED (``RESPONSE_TOO_LARGE``)."""
    servicer.max_response_bytes = max_response_bytes
    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name["ContextEngine"].methods:
        request_type = getattr(pb, method.input_type.name)
        handlers[method.name] = grpc.unary_unary_rpc_method_handler(
            _refusing_undecodable(servicer, method.name),
            request_deserializer=_decoder(request_type, max_request_bytes),
            response_serializer=_serialize)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)
