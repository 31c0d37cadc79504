"""Hard gate: prefix stability (spec: "Enforcement is a test, not a convention", "Prefix
epochs", "The history cache window").

The spec's scripted fifty-turn session, end to end against a real server and PostgreSQL: a
runtime-like driver (tests/support/runtime.py) runs 50 turns with tool loops (parallel calls
included) while the clock crosses midnight on New Year's Eve (a day, a month and a year) within
the cache TTL, a tool's scope is revoked mid-run, memory is written and corrected, a fetched page
tries to close its envelope and a forced compaction by the server's own ``Compact`` replaces the
oldest turns with a summary. The server runs on the session's clock (``ServerClock``): its wall
time crosses midnight when the session's does, so a server that wrote its own date into the
prefix would show it here (``tests/unit/test_clock.py`` keeps every module but the clock off the
system's wall clock). Every model step is a Build whose Anthropic body goes to the fake provider
(tests/support/cache_sim.py).

Asserted: exactly one distinct prefix_sha256 and epoch 1 throughout; afterwards a Plan with
another model rotates exactly once (epoch 2, model_changed). Under the simulator the cached
prefix ratio is at least 0.99 and the cached share of all input tokens after turn 1 at least
0.80; both figures are printed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from context_engine.v1 import context_engine_pb2 as pb
from context_engine.v1 import context_engine_pb2_grpc as pb_grpc

from tests.conftest import ServerThread
from tests.conftest import test_config as base_config
from tests.support.cache_sim import canonical
from tests.support.runtime import (
    ANTHROPIC,
    OTHER_MODEL,
    SCOPES,
    Clock,
    Runtime,
    ServerClock,
    SessionScript,
    figures,
    plan_request,
)

pytestmark = [pytest.mark.gate_prefix_stability, pytest.mark.integration]

PREFIX_RATIO_FLOOR = 0.99
CACHED_SHARE_FLOOR = 0.80
TTL_SECONDS = 300


def provider_prefix(body: dict[str, Any]) -> str:
    """What the provider caches as Region A: the tools and the system blocks, markers aside."""
    def strip(block: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in block.items() if k != "cache_control"}
    return canonical([[strip(t) for t in body.get("tools", [])],
                      [strip(b) for b in body["system"]]])


def blocks_of(body: dict[str, Any]) -> list[dict[str, Any]]:
    return [b for m in body["messages"] for b in m["content"]]


@pytest.fixture
def session_clock() -> Clock:
    return Clock(SessionScript().start)


@pytest.fixture
def clocked_stub(database_url: str,
                 session_clock: Clock) -> Iterator[tuple[pb_grpc.ContextEngineStub, ServerClock]]:
    """A real server of its own whose wall clock is the session's."""
    server_clock = ServerClock(session_clock)
    srv = ServerThread(base_config(), database_url, clock=server_clock)
    ch = grpc.insecure_channel(srv.address)
    try:
        yield pb_grpc.ContextEngineStub(ch), server_clock
    finally:
        ch.close()
        srv.stop()


def test_fifty_turns_keep_one_prefix_and_a_warm_cache(clocked_stub, session_clock, ids, db,
                                                      capsys):
    stub, server_clock = clocked_stub
    tenant, session = ids
    script = SessionScript()
    started = time.monotonic()
    runtime = Runtime(stub, tenant=tenant, session=session, script=script,
                      clock=session_clock)
    out = runtime.run()
    records = out.records
    elapsed = time.monotonic() - started
    bodies = {r.index: r.body() for r in records}
    fig = figures(records)
    sources = sorted({r.body_source for r in records})
    with capsys.disabled():  # the figures are part of the gate's output, not only on failure
        print(f"\ngate_prefix_stability: {len(records)} requests in {elapsed:.1f} s "
              f"(provider body: {', '.join(sources)}); {fig.line()}")

    # Every body is the server's own provider_body_json, not the driver's local fallback.
    assert sources == ["server"], sources

    # The session was what the spec asks for.
    assert len({r.turn for r in records}) == script.turns == 50
    assert any(sum(b["type"] == "tool_use" for b in m["content"]) > 1
               for m in bodies[records[-1].index]["messages"]), "no parallel tool calls"
    days = sorted({r.date for r in records})
    assert days == ["2026-12-31", "2027-01-01"], days  # a day, a month and a year
    assert server_clock.now().date().isoformat() == days[-1]  # the server's clock crossed too
    crossing = next(i for i, r in enumerate(records) if r.date == days[1])
    gap = (records[crossing].at - records[crossing - 1].at).total_seconds()
    assert gap < TTL_SECONDS, f"midnight was crossed outside the cache TTL ({gap:.0f} s)"
    # inside one run: the date in the runtime row changes between two steps of a tool loop
    assert records[crossing].run_id == records[crossing - 1].run_id
    assert out.denied_calls, "the revoked tool was never called (and denied) after revocation"
    assert runtime.scopes == tuple(s for s in SCOPES if s != "mail.send")

    # Exactly one prefix and one epoch, whatever happened in Region B.
    assert {r.prefix_sha256 for r in records} == {records[0].prefix_sha256}
    assert {r.epoch for r in records} == {1}
    assert [p.what for p in out.plans if p.created] == ["session_open"]
    assert {(p.epoch, p.prefix_sha256) for p in out.plans} == {(1, records[0].prefix_sha256)}
    revocation = next(p for p in out.plans if p.what == "revocation")
    assert not revocation.created and revocation.reason == "session_opened"
    # ... and one provider-side Region A: tools and system byte-identical on every request.
    assert len({provider_prefix(body) for body in bodies.values()}) == 1

    # Recall and correction lines changed mid-session (Region B), the prefix did not.
    recall_texts = {b["text"] for body in bodies.values() for b in blocks_of(body)
                    if b["type"] == "text" and b["text"].startswith("Recalled for this step")}
    assert any("180 EUR" in t for t in recall_texts) and any("180 EUR" not in t
                                                             for t in recall_texts)
    assert any("Corrections to the memory" in b.get("text", "")
               for b in blocks_of(bodies[records[-1].index]))
    assert not any("Corrections to the memory" in b.get("text", "")
                   for b in blocks_of(bodies[0]))

    # The envelope-closing attack stayed inside its envelope.
    attacked = next(r for r in records if out.attack_item_id in r.message_item_ids)
    result = next(b for b in blocks_of(bodies[attacked.index]) if b["type"] == "tool_result"
                  and "SYSTEM OVERRIDE" in json.dumps(b))
    content = result["content"] if isinstance(result["content"], str) else \
        "".join(part.get("text", "") for part in result["content"])
    assert "\n</untrusted:0000000000000000>" not in content
    assert "&lt;/untrusted:0000000000000000>" in content
    closing = [line for line in content.splitlines() if line.startswith("</untrusted:")]
    assert len(closing) == 1 and content.rstrip().endswith(closing[0])

    # The forced compaction: a summary stands for the replaced items, which are never sent.
    after = [r for r in records if r.turn >= script.compaction_turn]
    before = [r for r in records if r.turn < script.compaction_turn]
    assert all(r.summary_rendered for r in after) and not any(r.summary_rendered
                                                               for r in before)
    replaced = set(out.compacted_item_ids)
    assert replaced and all(not (replaced & set(r.message_item_ids)) for r in after)
    assert db.val("SELECT count(*) FROM context_events WHERE tenant_id=$1 AND "
                  "type='context.compacted'", tenant) == 1  # the server's own Compact
    # compaction re-caches the history window once and keeps the prefix (spec: "Compaction
    # only ever touches Region B"); the next step reads the new window again
    assert after[0].usage.read_region == "system"
    assert after[0].usage.prefix_read_tokens == after[0].usage.prefix_tokens
    assert after[1].usage.read_region == "messages"

    # Under the simulator: Region A served from the cache, most input served from the cache.
    first_misses = [(r.turn, r.step, r.usage.read_through) for r in records[1:]
                    if r.usage.prefix_read_tokens < r.usage.prefix_tokens]
    assert fig.cached_prefix_ratio >= PREFIX_RATIO_FLOOR, first_misses[:5]
    assert fig.cached_share >= CACHED_SHARE_FLOOR, fig

    # Afterwards a model change rotates exactly once, with its reason.
    run = pb.RunAdmission(run_id="run-51", tools_pinned=False)
    scopes = runtime.scopes
    rotated = stub.Plan(plan_request(tenant, session, scopes=scopes, model=OTHER_MODEL,
                                     run=run))
    assert rotated.created
    assert (rotated.plan.epoch, rotated.plan.reason) == (2, "model_changed")
    assert rotated.plan.prefix_sha256 != records[0].prefix_sha256
    again = stub.Plan(plan_request(tenant, session, scopes=scopes, model=OTHER_MODEL,
                                   run=run))
    assert not again.created and again.plan.epoch == 2
    reasons = [row["reason"] for row in db.fetch(
        "SELECT reason FROM plans WHERE tenant_id=$1 AND session_id=$2 ORDER BY epoch",
        tenant, session)]
    assert reasons == ["session_opened", "model_changed"]
    assert db.val("SELECT count(*) FROM context_events WHERE tenant_id=$1 AND session_id=$2 "
                  "AND type='context.epoch.rotated'", tenant, session) == 1
    built = stub.Build(pb.BuildRequest(tenant_id=tenant, session_id=session,
                                       checkpoint=runtime.checkpoint("run-50", 50),
                                       provider_format=ANTHROPIC))
    assert built.epoch == 2 and built.model_id == OTHER_MODEL
