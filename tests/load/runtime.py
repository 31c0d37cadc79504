"""Simulated agent runtimes for the load run: each one a session of tool-using turns.

A turn is what a runtime does on every model step: ``Plan`` at the run's admission (returns
the pinned plan), ``Build`` for the user's message, the fake model calls a tool, ``Build``
again with the call and its result, then ``ReportUsage`` for what was sent. Every call is
timed and its status kept; nothing is retried, so every failure shows. Every plan the server
acknowledged (``Plan`` answered OK) is recorded, so the run can check afterwards that each one
is stored.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import grpc
from context_engine.v1 import context_engine_pb2 as pb
from context_engine.v1 import context_engine_pb2_grpc as pb_grpc

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
    method: str
    started: float
    seconds: float
    code: str


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
    turns: int = 0


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
                 turns: int, outcome: Outcome, stop: asyncio.Event) -> None:
        self.stub = stub
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
        started = time.perf_counter()
        code = "OK"
        response = None
        try:
            response = await getattr(self.stub, method)(request, timeout=30)
        except grpc.aio.AioRpcError as err:
            code = err.code().name
        self.outcome.calls.append(Call(method, started, time.perf_counter() - started, code))
        if code == "UNAVAILABLE":  # back off as the documented retry policy does
            await asyncio.sleep(BACKOFF_SECONDS)
        return response

    def _build(self, run: str) -> pb.BuildRequest:
        return pb.BuildRequest(tenant_id=self.tenant, session_id=self.session,
                               checkpoint=pb.Checkpoint(
                                   active_run_id=run, items=self.items,
                                   runtime=pb.RuntimeMetadata(current_date="2026-11-30")))

    async def run(self) -> None:
        self.outcome.sessions.append(self.session)
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
            first = await self._call("Build", self._build(run))
            call_id = f"c{turn}"
            self._item(run, tool_calls=pb.ToolCalls(calls=[pb.ToolCall(
                call_id=call_id, name="web.fetch",
                arguments_json=json.dumps({"url": f"https://example.com/{turn}"}))]))
            self._item(run, pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED, tool_result=pb.ToolResult(
                call_id=call_id, tool_name="web.fetch",
                content=text(self.rng, self.rng.randint(40, 400)), event_id=turn + 1))
            second = await self._call("Build", self._build(run))
            self._item(run, assistant=pb.AssistantMessage(text=text(self.rng, 60)))
            sent = second or first
            if isinstance(sent, pb.BuildResponse):
                await self._call("ReportUsage", pb.ReportUsageRequest(
                    tenant_id=self.tenant, session_id=self.session, epoch=sent.epoch,
                    estimated_input_tokens=sent.estimated_input_tokens,
                    estimator_factor=sent.estimator_factor,
                    input_tokens=sent.estimated_input_tokens,
                    cached_tokens=sent.prefix_tokens, output_tokens=80,
                    idempotency_key=f"{self.session}:{turn}"))
            self.outcome.turns += 1
