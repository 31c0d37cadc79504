"""Incremental Build is identical by proof: long generated sessions, each step built three ways
against real servers, whose responses must be byte-identical:

* whole: the raw stub, the whole checkpoint, no base (the reference);
* the Python client (context_engine_client.Client, incremental on);
* the TypeScript client (clients/typescript, incremental on), driven step by step through a
  Node program reading JSON lines.

The sessions hold what changes a request between two steps: appended tool rounds and runs,
tool results the runtime rewrote in place (a pointer or a correction: the items change from that
position), compactions (Compact's summary written into the checkpoint, its items dropped or
kept), epoch rotations, a model window small enough that tool results yield to pointers and
history is cut, a replica switch (the clients go to another server, which does not hold their
base, and later back to the first, which holds an older one), and cache evictions on the server.
The step's build_id is the only field allowed to differ. Every kind of event must have happened
(counted and asserted), so a generator that stopped producing one fails the test.
"""

from __future__ import annotations

import base64
import contextlib
import json
import random
import subprocess
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from context_engine.v1 import context_engine_pb2 as pb
from context_engine.v1 import context_engine_pb2_grpc as pb_grpc
from context_engine_client import Client
from context_engine_client._pb.context_engine.v1 import context_engine_pb2 as cpb

from tests.clients.test_typescript_client import PACKAGE, build_package
from tests.conftest import ServerThread
from tests.conftest import test_config as base_config
from tests.integration.requests import failure, item, plan_request

pytestmark = pytest.mark.integration

TENANT = "t-differential"
STEPS = 70
FORMATS = (pb.PROVIDER_FORMAT_UNSPECIFIED,  # the model's default: Anthropic Messages
           pb.PROVIDER_FORMAT_GEMINI_GENERATE_CONTENT,
           pb.PROVIDER_FORMAT_OPENAI_RESPONSES)
WORDS = ("alpha", "beta", "gamma", "delta", "ünïcødé", "日本語", "✓", "naïve", "Ω", "lorem")


@pytest.fixture(scope="module")
def replicas(database_url: str) -> Iterator[tuple[ServerThread, ServerThread]]:
    a = ServerThread(base_config(), database_url)
    b = ServerThread(base_config(), database_url)
    yield a, b
    a.stop()
    b.stop()


class Driver:
    """The TypeScript client, one Node process answering one JSON line per request."""

    def __init__(self) -> None:
        build_package()
        script = PACKAGE / "dist" / "test-driver" / "incremental_driver.js"
        self.proc = subprocess.Popen(["node", str(script)], cwd=PACKAGE, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)

    def ask(self, message: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, "the TypeScript driver exited"
        answer: dict[str, Any] = json.loads(line)
        return answer

    def build(self, target: str, request: pb.BuildRequest) -> dict[str, Any]:
        return self.ask({"op": "build", "target": target,
                         "request_b64": base64.b64encode(request.SerializeToString()).decode()})

    def close(self) -> None:
        with contextlib.suppress(AssertionError, BrokenPipeError):
            self.ask({"op": "quit"})
        self.proc.wait(10)


@dataclass
class Session:
    """A runtime's checkpoint, changed step by step by a seeded generator."""

    rng: random.Random
    session_id: str
    fmt: int
    items: list[pb.ConversationItem] = field(default_factory=list)
    summary: pb.Summary | None = None
    run: int = 1
    seq: int = 0
    calls: int = 0
    events: Counter[str] = field(default_factory=Counter)

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def text(self, low: int, high: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(low, high)))

    def new_run(self) -> None:
        self.run += 1
        self.items.append(item(f"u{self.seq + 1}", self.next_seq(), run=f"run-{self.run}",
                               user=pb.UserMessage(text=self.text(3, 30))))

    def tool_round(self) -> None:
        self.calls += 1
        call_id = f"call-{self.calls}"
        run = f"run-{self.run}"
        self.items.append(item(f"c{self.calls}", self.next_seq(), run=run,
                               tool_calls=pb.ToolCalls(calls=[pb.ToolCall(
                                   call_id=call_id, name="web.fetch",
                                   arguments_json=json.dumps({"url": f"https://ex.com/{self.calls}"}))])))
        self.items.append(item(f"r{self.calls}", self.next_seq(),
                               trust=pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED, run=run,
                               tool_result=pb.ToolResult(call_id=call_id, tool_name="web.fetch",
                                                         content=self.text(50, 900))))
        if self.rng.random() < 0.7:
            self.items.append(item(f"a{self.calls}", self.next_seq(), run=run,
                                   assistant=pb.AssistantMessage(text=self.text(40, 700))))

    def rewrite_result(self) -> bool:
        """A tool result rewritten in place (a pointer the runtime wrote, or a correction)."""
        results = [i for i, it in enumerate(self.items) if it.WhichOneof("kind") == "tool_result"]
        if not results:
            return False
        i = self.rng.choice(results)
        self.items[i].tool_result.content = "[rewritten] " + self.text(2, 20)
        return True

    def request(self) -> pb.BuildRequest:
        cp = pb.Checkpoint(active_run_id=f"run-{self.run}", items=self.items,
                           runtime=pb.RuntimeMetadata(current_date="2026-12-01"))
        if self.summary is not None:
            cp.summary.CopyFrom(self.summary)
        return pb.BuildRequest(tenant_id=TENANT, session_id=self.session_id, checkpoint=cp,
                               estimator_factor=1.0, provider_format=self.fmt)  # type: ignore[arg-type]


def normalized(data: bytes) -> bytes:
    r = pb.BuildResponse.FromString(data)
    r.ClearField("build_id")
    return r.SerializeToString(deterministic=True)


def client_build(client: Client, request: pb.BuildRequest) -> bytes | str:
    try:
        got = client.build(request=cpb.BuildRequest.FromString(request.SerializeToString()))
    except Exception as err:  # the same refusal as the whole Build is also an agreement
        return getattr(err, "reason", repr(err))
    assert not got.HasField("delta")
    return bytes(got.SerializeToString())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_incremental_builds_equal_whole_builds(replicas: tuple[ServerThread, ServerThread],
                                               seed: int) -> None:
    a, b = replicas
    rng = random.Random(seed)
    s = Session(rng=rng, session_id=f"diff-{seed}", fmt=FORMATS[seed % len(FORMATS)])
    plan = plan_request(TENANT, s.session_id, model=pb.ModelSpec(
        model_id="claude-sonnet-4-5",
        capabilities=pb.ModelCapabilities(context_window=26_000, output_reserve=4_096)))
    channel = grpc.insecure_channel(a.address)
    stub = pb_grpc.ContextEngineStub(channel)
    prefix = stub.Plan(plan, timeout=30).plan.prefix_sha256
    clients = {a.address: Client(target=a.address), b.address: Client(target=b.address)}
    driver = Driver()
    here, other = a, b
    compared = 0
    try:
        s.items.append(item("u0", s.next_seq(), run="run-1",
                            user=pb.UserMessage(text="Work through the pages.")))
        for step in range(STEPS):
            roll = rng.random()
            if step and step % 23 == 0:  # a replica switch, and later back
                here, other = other, here
                s.events["replica_switch"] += 1
            if step and step % 17 == 0:
                here.running.engine.builds.clear()
                s.events["eviction"] += 1
            if roll < 0.08 and step > 5:
                # the first revokes a tool (a new prefix), later ones keep the prefix
                first = not s.events["rotation"]
                rotated = stub.Rotate(pb.RotateRequest(
                    tenant_id=TENANT, session_id=s.session_id,
                    reason=(pb.ROTATION_REASON_SECURITY_REVOCATION if first
                            else pb.ROTATION_REASON_OPERATOR),
                    drop_tools=["mail.send"] if first else [],
                    idempotency_key=f"rot-{seed}-{step}"), timeout=30)
                s.events["rotation"] += 1
                if rotated.plan.prefix_sha256 != prefix:
                    s.events["new_prefix"] += 1
                prefix = rotated.plan.prefix_sha256
            elif roll < 0.18 and s.rewrite_result():
                s.events["rewritten_result"] += 1
            elif roll < 0.28 and step > 8:
                if compact(stub, s, step):
                    s.events["compaction"] += 1
            elif roll < 0.40:
                s.new_run()
                s.events["new_run"] += 1
            s.tool_round()
            request = s.request()
            whole = build_whole(stub, request)
            py = client_build(clients[here.address], request)
            ts = driver.build(here.address, request)
            if isinstance(whole, str):  # refused: every path must refuse alike
                assert py == whole, f"step {step}: python {py!r} vs whole {whole!r}"
                assert ts.get("reason") == whole, f"step {step}: ts {ts} vs whole {whole!r}"
                s.events["refused"] += 1
                continue
            assert isinstance(py, bytes), f"step {step}: python failed: {py}"
            assert "response_b64" in ts, f"step {step}: ts failed: {ts}"
            want = normalized(whole)
            assert normalized(py) == want, f"step {step}: the Python client's response differs"
            assert normalized(base64.b64decode(ts["response_b64"])) == want, \
                f"step {step}: the TypeScript client's response differs"
            compared += 1
            full = pb.BuildResponse.FromString(whole)
            for y in full.pressure.steps:
                s.events[f"yield_{y.step}"] += 1
        py_stats = [c.build_stats for c in clients.values()]
        ts_stats = driver.ask({"op": "stats"})
    finally:
        driver.close()
        for c in clients.values():
            c.close()
        channel.close()
    assert compared >= STEPS * 0.8
    for kind in ("replica_switch", "eviction", "rotation", "new_prefix", "rewritten_result",
                 "compaction",
                 "new_run", "yield_tool_results", "yield_history"):
        assert s.events[kind] > 0, f"the session never had a {kind}: {dict(s.events)}"
    incremental = sum(x.incremental for x in py_stats)
    resends = sum(x.full_resends for x in py_stats)
    assert incremental >= STEPS // 2 and resends >= 2, py_stats
    assert sum(x.bytes_saved for x in py_stats) > 0
    assert ts_stats["incremental"] >= STEPS // 2 and ts_stats["fullResends"] >= 2, ts_stats
    # the two clients count the same Builds by the same rule (those that returned, every
    # attempt's bytes): the same figures, to the byte
    names = {"builds": "builds", "incremental": "incremental", "full_resends": "fullResends",
             "request_bytes": "requestBytes", "response_bytes": "responseBytes",
             "full_request_bytes": "fullRequestBytes", "full_response_bytes": "fullResponseBytes"}
    summed = {ts: sum(getattr(x, py) for x in py_stats) for py, ts in names.items()}
    assert summed == {ts: ts_stats[ts] for ts in names.values()}, (summed, ts_stats)


def build_whole(stub: pb_grpc.ContextEngineStub, request: pb.BuildRequest) -> bytes | str:
    try:
        return bytes(stub.Build(request, timeout=30).SerializeToString())
    except grpc.RpcError as err:
        return failure(err).reason


def compact(stub: pb_grpc.ContextEngineStub, s: Session, step: int) -> bool:
    """Compact the oldest carried history; write the summary, and (every other time) drop the
    items it replaced from the checkpoint."""
    cp = s.request().checkpoint
    try:
        done = stub.Compact(pb.CompactRequest(
            tenant_id=TENANT, session_id=s.session_id, checkpoint=cp, tokens_to_free=2_000,
            reason="budget_pressure", idempotency_key=f"cmp-{s.session_id}-{step}",
            estimator_factor=1.0), timeout=30)
    except grpc.RpcError as err:
        if failure(err).reason in ("NOTHING_TO_COMPACT", "COMPACTION_DEPTH_EXCEEDED"):
            return False
        raise
    s.summary = done.summary
    if s.rng.random() < 0.5:
        gone = set(done.replaced_item_ids)
        s.items = [it for it in s.items if it.id not in gone]
    return True
