"""Simulated agent runtimes for the load run: each one a session of tool-using turns.

A turn is what a runtime does on every model step: ``Plan`` at the run's admission (returns
the pinned plan), ``Build`` for the user's message, the fake model calls a tool, ``Build``
again with the call and its result, then ``ReportUsage`` for what was sent. Every call is
timed and its status kept. By default nothing is retried, so every failure shows; with a
``Retry`` (the documented client policy, ``documented_retry()``) the runtime itself sends the
same request again after ``UNAVAILABLE`` -- the idempotent RPCs always, a keyed write only with
its idempotency key, as the Python client does -- and every attempt is recorded, so retries can
be counted. Every plan the server acknowledged (``Plan`` answered OK) and every usage report it
acknowledged (by idempotency key) is recorded, so the run can check afterwards that each one is
stored, once.

With ``incremental=True`` a runtime Builds as the Python client does, through the client's own
incremental core (``context_engine_client._incremental.IncrementalBuilds``, one per runtime, as
one per runtime process): every Build after the first names the previous one as its base and
sends only the items appended since; a ``BUILD_BASE_UNKNOWN`` refusal (another worker, a
restart, an eviction) is a fallback: the same Build is sent again whole, and the refused attempt
is recorded as one (``Call.fallback``), not as an error. In both modes the bytes of every Build
request sent and every Build response received (``ByteSize``) are counted.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from context_engine.v1 import context_engine_pb2 as pb
from context_engine.v1 import context_engine_pb2_grpc as pb_grpc
from context_engine_client._channel import (
    KEYED,
    has_idempotency_key,
    retry_policy,
    service_config_text,
)
from context_engine_client._incremental import DeltaMismatch, IncrementalBuilds, base_unknown

SCHEMA = json.dumps({"type": "object", "properties": {"url": {"type": "string"}},
                     "required": ["url"]})
CATALOG = [
    pb.ToolSpec(name="web.fetch", description="Fetch a web page. Returns its text.",
                input_schema_json=SCHEMA, side_effect=pb.SIDE_EFFECT_NETWORK_READ,
                required_scopes=["web"]),
    pb.ToolSpec(name="notes.search", description="Search the team's notes.",
                input_schema_json='{"type":"object","properties":{"q":{"type":"string"}}}',
                side_effect=pb.SIDE_EFFECT_NONE),
]
BACKOFF_SECONDS = 0.1  # clients/retry_service_config.json: initialBackoff
WORDS = ["alpha", "beta", "gamma", "delta", "latency", "budget", "cache", "prefix", "token",
         "window", "tool", "result", "schema", "region", "epoch", "pointer", "summary",
         "envelope"]


@dataclass
class Call:
    """One attempt of an RPC."""

    method: str
    started: float
    seconds: float
    code: str
    attempt: int = 1  # 2 and more: the same request sent again
    retried: bool = False  # this attempt failed and the request was sent again
    fallback: bool = False  # a Build refused BUILD_BASE_UNKNOWN, then sent again whole
    details: str = ""  # a failed attempt's status details


@dataclass(frozen=True)
class Retry:
    """A retry policy the runtime applies itself (so every attempt is timed and counted):
    ``max_attempts`` in all, the n-th retry after a random wait of up to
    ``min(initial_backoff * multiplier ** (n - 1), max_backoff)`` (gRPC's full jitter)."""

    max_attempts: int
    initial_backoff: float
    max_backoff: float
    multiplier: float
    codes: frozenset[str]
    idempotent: frozenset[str]  # retried always; the KEYED writes only with their key

    def retries(self, method: str, request: object, code: str, attempt: int) -> bool:
        if code not in self.codes or attempt >= self.max_attempts:
            return False
        return method in self.idempotent or (
            method in KEYED and has_idempotency_key(request))  # type: ignore[arg-type]

    def backoff(self, attempt: int, rng: random.Random) -> float:
        ceiling = min(self.initial_backoff * self.multiplier ** (attempt - 1), self.max_backoff)
        return rng.uniform(0, ceiling)


def documented_retry() -> Retry:
    """The clients' retry policy (clients/retry_service_config.json, as packaged with the
    Python client): its attempts, backoff, codes and the RPCs it names."""
    text = service_config_text()
    policy = retry_policy(text)
    names = frozenset(name["method"] for method in json.loads(text)["methodConfig"]
                      if "retryPolicy" in method for name in method["name"])
    return Retry(max_attempts=policy.max_attempts, initial_backoff=policy.initial_backoff,
                 max_backoff=policy.max_backoff, multiplier=policy.backoff_multiplier,
                 codes=frozenset(code.name for code in policy.retryable_codes),
                 idempotent=names - KEYED)


@dataclass(frozen=True, order=True)
class AckedPlan:
    """A plan the server acknowledged: a ``Plan`` answered OK with this plan."""

    tenant: str
    session: str
    epoch: int
    prefix_sha256: str


@dataclass
class Outcome:
    calls: list[Call] = field(default_factory=list)
    sessions: list[str] = field(default_factory=list)
    plans: list[AckedPlan] = field(default_factory=list)  # one per OK Plan answer
    usage_keys: list[str] = field(default_factory=list)  # one per OK ReportUsage answer
    turns: int = 0
    # the turns each session completed
    turns_by_session: dict[str, int] = field(default_factory=dict)
    builds: int = 0  # Build calls answered OK
    build_request_bytes: int = 0  # every Build request sent (each attempt), serialized
    build_response_bytes: int = 0  # every Build response received, serialized
    incremental_builds: int = 0  # answered relative to a base (a delta)
    fallbacks: int = 0  # BUILD_BASE_UNKNOWN, sent again whole
    mismatches: int = 0  # deltas that did not read back (sent again whole)


def plan_request(tenant: str, session: str) -> pb.PlanRequest:
    return pb.PlanRequest(
        tenant_id=tenant, session_id=session,
        agent=pb.AgentSpec(agent_id="load-agent", version="1",
                           instructions="You are a research agent. Cite your sources.",
                           enabled_tools=["web.fetch", "notes.search"], enables_tool_call=True),
        tool_catalog=CATALOG, principal_scopes=["web"],
        model=pb.ModelSpec(model_id="claude-sonnet-4-5"),
        session=pb.SessionSpec(kind=pb.SESSION_KIND_INTERACTIVE))


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


class Runtime:
    def __init__(self, stub: pb_grpc.ContextEngineStub, tenant: str, index: int,
                 turns: int, outcome: Outcome, stop: asyncio.Event,
                 retry: Retry | None = None, incremental: bool = False) -> None:
        self.stub = stub
        self.retry = retry
        self.builds = IncrementalBuilds() if incremental else None
        self.last_call: Call | None = None
        self.last_error: grpc.aio.AioRpcError | None = None
        self.jitter = random.Random(-1 - index)  # apart from the content's generator
        self.tenant = tenant
        self.session = f"load-{index:04d}"
        self.turns = turns
        self.outcome = outcome
        self.stop = stop
        self.rng = random.Random(index)
        self.items: list[pb.ConversationItem] = []
        self.seq = 0

    def _item(self, run: str, trust: int = pb.TRUST_LEVEL_USER,
              **kind: object) -> pb.ConversationItem:
        self.seq += 1
        item = pb.ConversationItem(id=f"i{self.seq}", sequence=self.seq, run_id=run,
                                   trust=trust, **kind)  # type: ignore[arg-type]
        self.items.append(item)
        return item

    async def _call(self, method: str, request: object) -> object | None:
        attempt = 0
        while True:
            attempt += 1
            started = time.perf_counter()
            code = "OK"
            response = None
            self.last_error = None
            try:
                response = await getattr(self.stub, method)(request, timeout=30)
            except grpc.aio.AioRpcError as err:
                code = err.code().name
                self.last_error = err
            seconds = time.perf_counter() - started
            again = self.retry is not None and self.retry.retries(method, request, code,
                                                                  attempt)
            self.last_call = Call(method, started, seconds, code, attempt, again,
                                  details=self.last_error.details() or ""
                                  if self.last_error is not None else "")
            self.outcome.calls.append(self.last_call)
            if method == "Build":
                self.outcome.build_request_bytes += request.ByteSize()  # type: ignore[attr-defined]
                if response is not None:
                    self.outcome.builds += 1
                    self.outcome.build_response_bytes += response.ByteSize()
            if again:
                assert self.retry is not None
                await asyncio.sleep(self.retry.backoff(attempt, self.jitter))
                continue  # the same request: a keyed write keeps its idempotency key
            if code == "UNAVAILABLE" and self.retry is None:
                await asyncio.sleep(BACKOFF_SECONDS)  # as the documented policy would wait
            return response

    def _build(self, run: str) -> pb.BuildRequest:
        return pb.BuildRequest(tenant_id=self.tenant, session_id=self.session,
                               checkpoint=pb.Checkpoint(
                                   active_run_id=run, items=self.items,
                                   runtime=pb.RuntimeMetadata(current_date="2026-11-30")))

    async def _send_build(self, request: pb.BuildRequest) -> pb.BuildResponse | None:
        """The full response to ``request`` (a whole Build), or None when it failed; with the
        incremental core, sent relative to the session's last Build (see the module's
        docstring)."""
        builds = self.builds
        if builds is None:
            return await self._call("Build", request)  # type: ignore[return-value]
        wire, base = builds.prepare(request)
        response = await self._call("Build", wire)
        if response is None and base is not None and self.last_error is not None \
                and base_unknown(self.last_error):
            assert self.last_call is not None
            self.last_call.fallback = True
            self.outcome.fallbacks += 1
            wire, base = builds.fallback(wire, base), None
            response = await self._call("Build", wire)
        if not isinstance(response, pb.BuildResponse):
            builds.forget(self.tenant, self.session)  # the next Build goes whole
            return None
        try:
            full = builds.absorb(wire, response, base)
        except DeltaMismatch:
            self.outcome.mismatches += 1
            whole = builds.fallback(wire, base)
            response = await self._call("Build", whole)
            if not isinstance(response, pb.BuildResponse):
                return None
            return builds.absorb(whole, response, None)
        if response.HasField("delta"):
            self.outcome.incremental_builds += 1
        return full

    async def run(self) -> None:
        self.outcome.sessions.append(self.session)
        self.outcome.turns_by_session[self.session] = 0
        for turn in range(self.turns):
            if self.stop.is_set():
                return
            run = f"run-{turn}"
            plan = await self._call("Plan", plan_request(self.tenant, self.session))
            if not isinstance(plan, pb.PlanResponse):
                continue
            self.outcome.plans.append(AckedPlan(self.tenant, self.session, plan.plan.epoch,
                                                plan.plan.prefix_sha256))
            self._item(run, user=pb.UserMessage(text=text(self.rng, 20)))
            first = await self._send_build(self._build(run))
            call_id = f"c{turn}"
            self._item(run, tool_calls=pb.ToolCalls(calls=[pb.ToolCall(
                call_id=call_id, name="web.fetch",
                arguments_json=json.dumps({"url": f"https://example.com/{turn}"}))]))
            self._item(run, pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED, tool_result=pb.ToolResult(
                call_id=call_id, tool_name="web.fetch",
                content=text(self.rng, self.rng.randint(40, 400)), event_id=turn + 1))
            second = await self._send_build(self._build(run))
            self._item(run, assistant=pb.AssistantMessage(text=text(self.rng, 60)))
            sent = second or first
            if isinstance(sent, pb.BuildResponse):
                key = f"{self.session}:{turn}"
                usage = await self._call("ReportUsage", pb.ReportUsageRequest(
                    tenant_id=self.tenant, session_id=self.session, epoch=sent.epoch,
                    estimated_input_tokens=sent.estimated_input_tokens,
                    estimator_factor=sent.estimator_factor,
                    input_tokens=sent.estimated_input_tokens,
                    cached_tokens=sent.prefix_tokens, output_tokens=80,
                    idempotency_key=key))
                if isinstance(usage, pb.ReportUsageResponse):
                    self.outcome.usage_keys.append(key)
            self.outcome.turns += 1
            self.outcome.turns_by_session[self.session] += 1


async def run_runtimes(target: str, options: Sequence[tuple[str, Any]], *, tenant: str,
                       runtimes: int, turns: int, outcome: Outcome, stop: asyncio.Event,
                       retry: Retry | None = None,
                       incremental: bool = False) -> tuple[float, float]:
    """Every runtime at once, each on a channel (and connections) of its own to ``target``, as
    separate runtime processes would be: (when they started, seconds until the last ended).
    ``incremental``: Build through the client's incremental core (whole Builds otherwise)."""
    channels = [grpc.aio.insecure_channel(target, options=options) for _ in range(runtimes)]
    try:
        tasks = [Runtime(pb_grpc.ContextEngineStub(ch), tenant, i, turns, outcome, stop,
                         retry, incremental).run() for i, ch in enumerate(channels)]
        started = time.perf_counter()
        await asyncio.gather(*tasks)
        return started, time.perf_counter() - started
    finally:
        for ch in channels:
            await ch.close()
