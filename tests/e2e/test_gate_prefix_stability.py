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
(tests/support/cache_sim.py); the same step is also built in every other provider format
(OpenAI Responses and Chat Completions, Gemini generateContent, Bedrock Converse: one Build per
format from the same checkpoint, the estimator factor pinned to the Anthropic Build's, through
``FanOutStub``), and each body goes to its own provider's fake at the same time. Gemini is run
twice: whole bodies under implicit caching, and as a runtime using the explicit cached content
``gemini_cached_content`` describes (created once per epoch, kept alive by patching its TTL,
since use does not extend an explicit cached content's expiry). The session's model is a Claude
model: the Gemini fake applies its own minimum for a model it does not know (1,024, Flash's),
not the response's ``min_cacheable_tokens`` (the service's conservative 4,096 for a model the
catalog gives no Gemini minimum), which the gate prints.

Asserted: exactly one distinct prefix_sha256 and epoch 1 throughout, in every format, each
format's neutral request equal to the Anthropic Build's; the part of each body that holds
Region A (Anthropic tools and system; Responses instructions and tools; Chat Completions the
system message and tools; Gemini systemInstruction and tools, which the one cached content of
the epoch holds exactly; Bedrock system and toolConfig) byte-identical on every request; under
each provider's fake, Region A read from the cache on every request after the first as far as
the provider's granularity lets a read reach: all of it (cached prefix ratio 1.0) for the
token-exact providers, and for OpenAI's 128-token steps all but the tokens past Region A's last
full step where the conversation changes right after it (ratio at least 0.99); the cached share
of all input tokens after turn 1 at least 0.80 where the provider caches the history
(everything but Gemini's explicit cache, which holds Region A only). Afterwards a Plan with
another model rotates exactly once (epoch 2, model_changed). Every figure is printed.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from context_engine.domain.canonical import session_key
from context_engine.v1 import context_engine_pb2 as pb
from context_engine.v1 import context_engine_pb2_grpc as pb_grpc

from tests.conftest import ServerThread
from tests.conftest import test_config as base_config
from tests.support.cache_sim import (
    ANTHROPIC_MESSAGES,
    FORMATS,
    GEMINI_GENERATE_CONTENT,
    GEMINI_HELD_FIELDS,
    OPENAI_CHAT_COMPLETIONS,
    OPENAI_INCREMENT,
    OPENAI_RESPONSES,
    CacheUsage,
    FanOutStub,
    cacheable_prefix_ratio,
    cached_prefix_ratio,
    cached_share,
    prefix_part,
    simulate,
    simulate_gemini_explicit,
)
from tests.support.runtime import (
    ANTHROPIC,
    OTHER_MODEL,
    SCOPES,
    Clock,
    RequestRecord,
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

GEMINI_EXPLICIT = "gemini_generate_content (explicit cache)"
# Floors of the cached share of input after turn 1: every provider that caches the history
# (markers or automatic prefix caching); Gemini's explicit cached content holds Region A only.
SHARE_FLOORS = {**dict.fromkeys(FORMATS, CACHED_SHARE_FLOOR), GEMINI_EXPLICIT: 0.0}


def later(records: list[RequestRecord], usages: list[CacheUsage]) -> list[CacheUsage]:
    return [u for r, u in zip(records, usages, strict=True) if r.turn > 1]


def blocks_of(body: dict[str, Any]) -> list[dict[str, Any]]:
    return [b for m in body["messages"] for b in m["content"]]


def per_format_usages(records: list[RequestRecord],
                      fan: FanOutStub) -> tuple[dict[str, list[CacheUsage]], dict[str, Any]]:
    """Each format's bodies through its provider's simulator (Anthropic's are the runtime's
    own, already simulated), and Gemini through its explicit cached content."""
    usages = {ANTHROPIC_MESSAGES: [r.usage for r in records]}
    for name in FORMATS[1:]:
        usages[name] = simulate(name, fan.built[name])
    explicit = simulate_gemini_explicit(fan.built[GEMINI_GENERATE_CONTENT])
    usages[GEMINI_EXPLICIT] = explicit.usages
    advice = {(b.gemini["estimated_tokens"], b.gemini["min_cacheable_tokens"])
              for b in fan.built[GEMINI_GENERATE_CONTENT] if b.gemini}
    return usages, {"created": [c.display_name for c in explicit.created],
                    "tokens": [c.tokens for c in explicit.created],
                    "fallbacks": explicit.fallbacks, "updates": explicit.updates,
                    "estimated_tokens, min_cacheable_tokens": sorted(advice)}


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
    fan = FanOutStub(stub, session_clock)  # every step also built in every other format
    runtime = Runtime(fan, tenant=tenant, session=session, script=script,
                      clock=session_clock)
    out = runtime.run()
    records = out.records
    elapsed = time.monotonic() - started
    bodies = {r.index: r.body() for r in records}
    fig = figures(records)
    sources = sorted({r.body_source for r in records})
    usages, gemini_explicit = per_format_usages(records, fan)
    ratios = {name: cached_prefix_ratio(u[1:]) for name, u in usages.items()}
    granular = {name: cacheable_prefix_ratio(u[1:]) for name, u in usages.items()}
    shares = {name: cached_share(later(records, u)) for name, u in usages.items()}
    table = "\n".join(f"  {name:<42} cached prefix ratio {ratios[name]:.4f} (to the provider's "
                      f"granularity {granular[name]:.4f}), cached share of input after turn 1 "
                      f"{shares[name]:.4f}" for name in usages)
    with capsys.disabled():  # the figures are part of the gate's output, not only on failure
        print(f"\ngate_prefix_stability: {len(records)} requests x {len(FORMATS)} formats in "
              f"{elapsed:.1f} s (provider body: {', '.join(sources)}); {fig.line()}\n{table}\n"
              f"  gemini explicit cached contents: {gemini_explicit}")

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
    assert len({prefix_part(ANTHROPIC_MESSAGES, body) for body in bodies.values()}) == 1

    # Every other format, built from the same checkpoints: the same request, one prefix, one
    # epoch, and its Region A part byte-identical on every request.
    for name in FORMATS:
        built = fan.built[name]
        assert [b.index for b in built] == [r.index for r in records], name
        assert all(b.provider_format == name and b.body_json for b in built), name
        assert all(b.same_request for b in built), \
            (name, [b.index for b in built if not b.same_request][:5])
        assert {(b.prefix_sha256, b.epoch) for b in built} == {(records[0].prefix_sha256, 1)}, \
            name
        parts = {prefix_part(name, b.body()) for b in built}
        assert len(parts) == 1, (name, len(parts))
    gemini = fan.built[GEMINI_GENERATE_CONTENT]
    assert all(b.gemini for b in gemini)
    specs = {(b.gemini["display_name"], b.gemini["ttl"], b.gemini["create_body_json"])
             for b in gemini if b.gemini}
    assert len(specs) == 1, len(specs)  # one cached content per epoch, byte-identical
    ((display_name, ttl, create_json),) = specs
    tag = hashlib.sha256(f"{session_key(tenant, session)}:{records[0].prefix_sha256}".encode())
    assert display_name == f"ce-{tag.hexdigest()[:16]}-e1" and ttl == "300s"  # the session's
    create = json.loads(create_json)
    holds = [k for k in GEMINI_HELD_FIELDS if k in create]
    assert holds and all(list(b.gemini["holds"]) == holds for b in gemini if b.gemini)
    assert all(not set(GEMINI_HELD_FIELDS) & set(json.loads(b.gemini["cached_body_json"]))
               for b in gemini if b.gemini)
    assert prefix_part(GEMINI_GENERATE_CONTENT, create) == prefix_part(
        GEMINI_GENERATE_CONTENT, gemini[0].body())  # it holds exactly the body's Region A

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

    # ... and under every provider's rules: Region A read from the cache on every request
    # after the first, as far as the provider's granularity lets a read reach (ratio 1.0):
    # all of it where the provider caches token-exact prefixes (Anthropic, Bedrock, Gemini);
    # for OpenAI's 128-token steps, all but the few tokens of Region A past its last full step
    # when the conversation changes right after Region A (the first step's user message moving
    # into the history, the compaction). The share of input served from the cache, per format.
    figures_line = ", ".join(f"{name}: ratio {ratios[name]:.4f} (granular "
                             f"{granular[name]:.4f}) share {shares[name]:.4f}"
                             for name in usages)
    for name, used in usages.items():
        misses = [(r.turn, r.step, u.prefix_read_tokens, u.prefix_cacheable_tokens,
                   u.prefix_tokens, u.read_through)
                  for r, u in zip(records[1:], used[1:], strict=True)
                  if u.prefix_read_tokens < u.prefix_cacheable_tokens]
        assert not misses and granular[name] == 1.0, (name, misses[:5], figures_line)
        if name in (OPENAI_RESPONSES, OPENAI_CHAT_COMPLETIONS):
            assert all(u.prefix_tokens - u.prefix_read_tokens < OPENAI_INCREMENT
                       for u in used[1:]), (name, figures_line)
            assert ratios[name] >= PREFIX_RATIO_FLOOR, (name, figures_line)
        else:
            assert ratios[name] == 1.0, (name, figures_line)
        assert shares[name] >= SHARE_FLOORS[name], (name, figures_line)
    assert len(gemini_explicit["created"]) == 1 and gemini_explicit["fallbacks"] == 0, \
        gemini_explicit  # created once for the epoch, used by every request
    explicit = usages[GEMINI_EXPLICIT]
    assert all(u.cache_read_input_tokens == u.prefix_tokens == explicit[0].prefix_tokens
               for u in explicit)

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
