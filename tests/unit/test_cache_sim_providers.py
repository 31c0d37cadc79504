"""The fake OpenAI, Gemini and Bedrock prompt caches (tests/support/cache_sim.py): one test per
published rule, and the per-format session helpers the gate and the bench use."""

from __future__ import annotations

import copy
import json
from datetime import UTC, datetime
from typing import Any

import pytest
from context_engine.v1 import context_engine_pb2 as pb

from tests.support.cache_sim import (
    ANTHROPIC_MESSAGES,
    BEDROCK_CONVERSE,
    FORMATS,
    GEMINI_GENERATE_CONTENT,
    OPENAI_CHAT_COMPLETIONS,
    OPENAI_RESPONSES,
    AnthropicCacheSimulator,
    BedrockCacheSimulator,
    BuiltBody,
    CacheRequestError,
    FanOutStub,
    GeminiCacheSimulator,
    OpenAICacheSimulator,
    bedrock_min_tokens,
    cached_prefix_ratio,
    flatten_bedrock,
    format_name,
    format_value,
    gemini_min_tokens,
    gemini_segments,
    openai_segments,
    prefix_part,
    simulate,
    simulate_gemini_explicit,
    simulator_for,
    tokens_of,
)

WORDS = ("amber", "basalt", "cobalt", "delta", "ember", "fjord", "granite", "harbor", "indigo",
         "juniper", "kelp", "lagoon", "meadow", "nickel", "onyx", "prairie")


def prose(tokens: int, seed: int = 0) -> str:
    """Text of ``tokens`` cl100k tokens, give or take a word's."""
    words = [f"{WORDS[(seed + k) % len(WORDS)]}{k % 7}" for k in range(tokens)]
    lo, hi = 1, len(words)
    while lo < hi:  # the fewest words that reach ``tokens``
        mid = (lo + hi) // 2
        if len(tokens_of(" ".join(words[:mid]))) >= tokens:
            hi = mid
        else:
            lo = mid + 1
    return " ".join(words[:lo])


# ------------------------------------------------------------------------------ OpenAI

def responses(instructions: str, *turns: str, key: str = "session-1",
              tools: list[dict[str, Any]] | None = None, **extra: Any) -> dict[str, Any]:
    items = [{"type": "message", "role": "user" if i % 2 == 0 else "assistant",
              "content": [{"type": "input_text" if i % 2 == 0 else "output_text", "text": t}]}
             for i, t in enumerate(turns)]
    body: dict[str, Any] = {"model": "gpt-5", "instructions": instructions, "input": items,
                            "prompt_cache_key": key, "store": False, **extra}
    if tools is not None:
        body["tools"] = tools
    return body


def function(name: str) -> dict[str, Any]:
    return {"type": "function", "name": name, "description": f"The {name} tool.",
            "parameters": {"type": "object", "properties": {}}, "strict": False}


def prompt_tokens(body: dict[str, Any], api: str = OPENAI_RESPONSES) -> int:
    return sum(len(s.tokens) for s in openai_segments(body, api))


def test_openai_below_1024_tokens_nothing_is_cached() -> None:
    sim = OpenAICacheSimulator()
    small = responses(prose(600), "hello")
    assert prompt_tokens(small) < 1_024
    for at in (0, 10):
        u = sim.request(small, at)
        assert u.cache_read_input_tokens == 0 and u.input_tokens == prompt_tokens(small)
        assert u.usage() == {"input_tokens": prompt_tokens(small),
                             "input_tokens_details": {"cached_tokens": 0}}


def test_openai_hits_count_in_128_token_steps_from_1024() -> None:
    sim = OpenAICacheSimulator()
    assert [sim.cached_tokens(n) for n in (1_023, 1_024, 1_151, 1_152, 1_300, 5_000)] == [
        0, 1_024, 1_024, 1_152, 1_280, 4_992]
    for size in (1_100, 1_500, 3_333):
        sim = OpenAICacheSimulator()
        body = responses(prose(size), "question")
        total = prompt_tokens(body)
        sim.request(body, 0)
        u = sim.request(body, 5)
        assert u.cache_read_input_tokens == 1_024 + (total - 1_024) // 128 * 128, size
        assert u.cache_read_input_tokens % 128 == 0 and total - 128 < u.cache_read_input_tokens
        assert u.cache_creation_input_tokens == 0  # writes are neither reported nor charged
        assert u.total_input_tokens == total


def test_openai_a_changed_byte_misses_from_there_on() -> None:
    head = prose(3_000)
    first = responses(head, "turn one " + prose(900, 3), "answer " + prose(900, 5))
    sim = OpenAICacheSimulator()
    sim.request(first, 0)
    # a byte changed late: the cache reads up to it, in whole 128-token steps
    late = copy.deepcopy(first)
    late["input"][1]["content"][0]["text"] = late["input"][1]["content"][0]["text"][:-3] + "zz."
    u = sim.request(late, 5)
    common = prompt_tokens(first) - 10
    assert sim.cached_tokens(common - 128) <= u.cache_read_input_tokens <= common
    assert u.diverged_at == "input[1]"
    # a byte changed at the start of the instructions: another machine, nothing is read
    early = copy.deepcopy(first)
    early["instructions"] = "X" + early["instructions"]
    assert sim.request(early, 6).cache_read_input_tokens == 0
    # ... and in the middle of the instructions (past the routing tokens): read up to it
    middle = copy.deepcopy(first)
    middle["instructions"] = head[:len(head) // 2] + "!" + head[len(head) // 2:]
    read = sim.request(middle, 7).cache_read_input_tokens
    assert 1_024 <= read <= len(tokens_of(head)) // 2 + 8


def test_openai_tools_follow_the_instructions_and_count_as_the_head() -> None:
    body = responses(prose(1_500), "q", tools=[function("a"), function("b")])
    segments = openai_segments(body, OPENAI_RESPONSES)
    assert [s.label for s in segments] == ["instructions", "tools[0]", "tools[1]", "input[0]"]
    sim = OpenAICacheSimulator()
    sim.request(body, 0)
    changed = copy.deepcopy(body)
    changed["tools"][1]["description"] += " Changed."
    u = sim.request(changed, 5)
    instructions = len(segments[0].tokens)
    assert sim.cached_tokens(instructions) <= u.cache_read_input_tokens < u.prefix_tokens


def test_openai_prompt_cache_key_routes_to_another_machine() -> None:
    body = responses(prose(1_500), "q")
    sim = OpenAICacheSimulator()
    sim.request(body, 0)
    assert sim.request({**body, "prompt_cache_key": "session-2"}, 1).cache_read_input_tokens == 0
    assert sim.request(body, 2).cache_read_input_tokens > 0


def test_openai_cached_prefixes_expire_after_five_idle_minutes() -> None:
    body = responses(prose(1_500), "q")
    sim = OpenAICacheSimulator()
    sim.request(body, 0)
    assert sim.request(body, 299).cache_read_input_tokens > 0  # refreshed until 599
    assert sim.request(body, 598).cache_read_input_tokens > 0
    assert sim.request(body, 898).cache_read_input_tokens == 0  # idle for 300 s
    kept = responses(prose(1_500), "q", prompt_cache_retention="24h")
    sim = OpenAICacheSimulator()
    sim.request(kept, 0)
    assert sim.request(kept, 20 * 3_600).cache_read_input_tokens > 0


def test_openai_past_15_requests_a_minute_a_prefix_overflows() -> None:
    body = responses(prose(1_500), "q")
    sim = OpenAICacheSimulator()
    reads = [sim.request(body, 2 * i).cache_read_input_tokens for i in range(17)]
    assert reads[0] == 0 and all(r > 0 for r in reads[1:15])
    assert reads[15] == reads[16] == 0 and sim.overflowed == 2
    assert sim.request(body, 60 + 32).cache_read_input_tokens > 0  # the minute has passed
    relaxed = OpenAICacheSimulator(overflow_per_minute=None)
    reads = [relaxed.request(body, i).cache_read_input_tokens for i in range(20)]
    assert reads[0] == 0 and all(r > 0 for r in reads[1:])


def test_chat_completions_head_is_the_leading_system_messages_and_the_tools() -> None:
    body = {"model": "gpt-4.1", "prompt_cache_key": "k",
            "messages": [{"role": "system", "content": prose(800)},
                         {"role": "system", "content": prose(400, 2)},
                         {"role": "user", "content": "hello " + prose(300, 4)},
                         {"role": "system", "content": "a later system message is not head"}],
            "tools": [{"type": "function", "function": {"name": "a", "parameters": {}}}]}
    segments = openai_segments(body, OPENAI_CHAT_COMPLETIONS)
    assert [(s.region, s.label) for s in segments] == [
        ("head", "messages[0]"), ("head", "messages[1]"), ("head", "tools[0]"),
        ("conversation", "messages[2]"), ("conversation", "messages[3]")]
    sim = simulator_for(OPENAI_CHAT_COMPLETIONS)
    sim.request(body, 0)
    u = sim.request(body, 1)
    assert u.prefix_tokens == sum(len(s.tokens) for s in segments[:3])
    assert u.prefix_read_tokens == u.prefix_tokens  # the 128-token step ends past the head
    assert u.usage() == {"prompt_tokens": u.total_input_tokens,
                         "prompt_tokens_details": {"cached_tokens": u.cache_read_input_tokens}}


# ------------------------------------------------------------------------------ Gemini

def gemini(system: str, *turns: str, tools: int = 2) -> dict[str, Any]:
    return {"systemInstruction": {"parts": [{"text": system}]},
            "tools": [{"functionDeclarations": [
                {"name": f"fn_{i}", "description": f"Function {i}.",
                 "parameters": {"type": "object", "properties": {}}} for i in range(tools)]}],
            "contents": [{"role": "user" if i % 2 == 0 else "model", "parts": [{"text": t}]}
                         for i, t in enumerate(turns)]}


def create_body(body: dict[str, Any], ttl: str = "300s",
                model: str = "models/gemini-2.5-flash") -> dict[str, Any]:
    return {"model": model, "displayName": "ce-0123456789abcdef-e1", "ttl": ttl,
            **{k: body[k] for k in ("systemInstruction", "tools") if k in body}}


def cached_body(body: dict[str, Any], name: str) -> dict[str, Any]:
    return {"contents": body["contents"], "cachedContent": name}


def test_gemini_minimum_depends_on_the_model() -> None:
    assert gemini_min_tokens("gemini-2.5-flash") == gemini_min_tokens("gemini-3-flash") == 1_024
    assert gemini_min_tokens("gemini-2.5-pro") == 4_096


def test_gemini_implicit_caching_reads_a_repeated_prefix_above_the_minimum() -> None:
    body = gemini(prose(1_500), "question", "answer")
    sim = GeminiCacheSimulator()
    first = sim.request(body, 0, model="gemini-2.5-flash")
    assert first.cache_read_input_tokens == 0
    longer = gemini(prose(1_500), "question", "answer", "next question")
    u = sim.request(longer, 10, model="gemini-2.5-flash")
    total = sum(len(s.tokens) for s in gemini_segments(body))
    assert u.cache_read_input_tokens == total  # token-exact: no step is published
    assert u.prefix_read_tokens == u.prefix_tokens
    assert u.usage() == {"promptTokenCount": u.total_input_tokens,
                         "cachedContentTokenCount": total}
    # the same prefix under a Pro model's 4,096-token minimum is not cached
    pro = GeminiCacheSimulator()
    pro.request(body, 0, model="gemini-2.5-pro")
    assert pro.request(longer, 10, model="gemini-2.5-pro").cache_read_input_tokens == 0


def test_gemini_implicit_a_changed_byte_in_the_system_instruction_misses() -> None:
    body = gemini(prose(1_500), "question")
    sim = GeminiCacheSimulator()
    sim.request(body, 0, model="gemini-2.5-flash")
    changed = copy.deepcopy(body)
    changed["systemInstruction"]["parts"][0]["text"] = "Today is 2027-01-01. " + prose(1_500)
    u = sim.request(changed, 5, model="gemini-2.5-flash")
    assert u.cache_read_input_tokens == 0 and u.diverged_at == "systemInstruction.parts[0]"


def test_gemini_explicit_cached_content_below_the_minimum_is_refused() -> None:
    sim = GeminiCacheSimulator()
    with pytest.raises(CacheRequestError, match="Cached content is too small"):
        sim.create_cached_content(create_body(gemini(prose(500), "q")), 0)


def test_gemini_explicit_cached_content_is_read_whole_then_expires_after_its_ttl() -> None:
    body = gemini(prose(1_500), "question")
    sim = GeminiCacheSimulator()
    content = sim.create_cached_content(create_body(body, ttl="300s"), 0)
    assert content.tokens == content.prefix_tokens >= 1_024
    first = sim.request(cached_body(body, content.name), 1)
    # the creation is charged to the first use, which reads what was written for it
    assert first.cache_read_input_tokens == first.cache_creation_input_tokens == content.tokens
    assert first.prefix_read_tokens == 0
    second = sim.request(cached_body(body, content.name), 299)
    assert second.cache_read_input_tokens == content.tokens
    assert second.cache_creation_input_tokens == 0
    assert second.prefix_read_tokens == second.prefix_tokens
    assert second.input_tokens == sum(len(s.tokens) for s in gemini_segments(
        {"contents": body["contents"]}))
    # use does not extend the expiry: at 300 s it is gone
    with pytest.raises(CacheRequestError, match="NOT_FOUND"):
        sim.request(cached_body(body, content.name), 300)


def test_gemini_explicit_cached_content_lives_on_when_its_ttl_is_patched() -> None:
    body = gemini(prose(1_500), "question")
    sim = GeminiCacheSimulator()
    content = sim.create_cached_content(create_body(body, ttl="300s"), 0)
    sim.update_cached_content(content.name, 250, ttl="300s")
    assert sim.request(cached_body(body, content.name), 540).cache_read_input_tokens > 0
    with pytest.raises(CacheRequestError, match="NOT_FOUND"):
        sim.update_cached_content(content.name, 551, ttl="300s")
    default = sim.create_cached_content({k: v for k, v in create_body(body).items()
                                         if k != "ttl"}, 600)
    assert default.expires_at == 600 + 3_600  # no ttl: one hour


def test_gemini_explicit_request_must_not_repeat_what_the_content_holds() -> None:
    body = gemini(prose(1_500), "question")
    sim = GeminiCacheSimulator()
    content = sim.create_cached_content(create_body(body), 0)
    with pytest.raises(CacheRequestError, match="system_instruction, tools or tool_config"):
        sim.request({**body, "cachedContent": content.name}, 1)
    with pytest.raises(CacheRequestError, match="does not match"):
        sim.request(cached_body(body, content.name), 2, model="gemini-2.5-pro")


# ------------------------------------------------------------------------------ Bedrock

POINT = {"cachePoint": {"type": "default"}}


def converse(system: str, *turns: str, points: set[int] | None = None,
             model: str = "anthropic.claude-sonnet-4-5-20250929-v1:0") -> dict[str, Any]:
    messages = []
    for i, t in enumerate(turns):
        content: list[dict[str, Any]] = [{"text": t}]
        if points and i in points:
            content.append(POINT)
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": content})
    return {"modelId": model, "system": [{"text": system}, POINT],
            "toolConfig": {"tools": [{"toolSpec": {"name": "a", "description": "The a tool.",
                                                   "inputSchema": {"json": {"type": "object"}}}},
                                     POINT]},
            "messages": messages, "inferenceConfig": {"maxTokens": 1024}}


def test_bedrock_blocks_follow_claudes_order_and_checkpoints_mark_the_block_before() -> None:
    blocks = flatten_bedrock(converse("s", "q", "a", points={1}))
    assert [(b.label, b.breakpoint_ttl) for b in blocks] == [
        ("toolConfig.tools[0]", "5m"), ("system[0]", "5m"), ("messages[0].content[0]", None),
        ("messages[1].content[0]", "5m")]


def test_bedrock_minimum_tokens_per_checkpoint() -> None:
    assert bedrock_min_tokens("anthropic.claude-sonnet-4-5-20250929-v1:0") == 1_024
    assert bedrock_min_tokens("us.anthropic.claude-haiku-4-5-20251001-v1:0") == 4_096
    small = converse("short system", "q", "a", points={1})
    sim = BedrockCacheSimulator()
    for at in (0, 5):
        u = sim.request(small, at)
        assert u.cache_read_input_tokens == u.cache_creation_input_tokens == 0
        assert {o.status for o in u.breakpoints} == {"below_minimum"}
    big = converse(prose(1_500), "q", "a", points={1})
    haiku = BedrockCacheSimulator()
    haiku_body = {**big, "modelId": "anthropic.claude-haiku-4-5-20251001-v1:0"}
    haiku.request(haiku_body, 0)
    assert haiku.request(haiku_body, 5).cache_read_input_tokens == 0
    sonnet = BedrockCacheSimulator()
    sonnet.request(big, 0)
    u = sonnet.request(big, 5)
    assert u.cache_read_input_tokens == u.total_input_tokens
    assert u.usage() == {"inputTokens": 0, "cacheReadInputTokens": u.cache_read_input_tokens,
                         "cacheWriteInputTokens": 0}


def test_bedrock_a_changed_byte_before_a_checkpoint_misses_from_there() -> None:
    body = converse(prose(1_500), "q", "a", points={1})
    sim = BedrockCacheSimulator(min_cacheable_tokens=1)
    sim.request(body, 0)
    changed = copy.deepcopy(body)
    changed["system"][0]["text"] = "Today is 2027-01-01. " + changed["system"][0]["text"]
    u = sim.request(changed, 5)
    assert u.read_through == "toolConfig.tools[0]"  # the tools checkpoint still reads
    assert u.diverged_at == "system[0]"
    assert [o.status for o in u.breakpoints] == ["read", "written", "written"]
    assert u.prefix_read_tokens < u.prefix_tokens


def test_bedrock_a_fifth_checkpoint_is_refused() -> None:
    four = converse(prose(100), "q", "a", "q2", "a2", points={1, 3})
    assert len(BedrockCacheSimulator().request(four, 0).breakpoints) == 4
    five = converse(prose(100), "q", "a", "q2", "a2", points={0, 1, 3})
    with pytest.raises(CacheRequestError, match="at most 4 cachePoint"):
        BedrockCacheSimulator().request(five, 0)
    lead = converse("s", "q")
    lead["system"] = [POINT, {"text": "s"}]
    with pytest.raises(CacheRequestError, match="must follow a content block"):
        BedrockCacheSimulator().request(lead, 0)
    twice = converse("s", "q")
    twice["system"] = [{"text": "s"}, POINT, POINT]
    with pytest.raises(CacheRequestError, match="two cachePoints in a row"):
        BedrockCacheSimulator().request(twice, 0)
    other = converse("s", "q")
    other["system"][1] = {"cachePoint": {"type": "custom"}}
    with pytest.raises(CacheRequestError, match="type must be 'default'"):
        BedrockCacheSimulator().request(other, 0)


def test_bedrock_ttl_is_five_minutes_refreshed_on_hit() -> None:
    body = converse(prose(1_500), "q", "a", points={1})
    sim = BedrockCacheSimulator()
    sim.request(body, 0)
    assert sim.request(body, 299).cache_read_input_tokens > 0  # refreshed until 599
    assert sim.request(body, 598).cache_read_input_tokens > 0
    assert sim.request(body, 898).cache_read_input_tokens == 0


# ------------------------------------------------------------------------------ per format

def built(index: int, at: float, fmt: str, body: dict[str, Any],
          gemini_spec: dict[str, Any] | None = None) -> BuiltBody:
    return BuiltBody(index=index, at=at, provider_format=fmt, prefix_sha256="p", epoch=1,
                     body_json=json.dumps(body), same_request=True, gemini=gemini_spec)


def gemini_session(times: list[float], ttl: str = "300s") -> list[BuiltBody]:
    out = []
    for i, at in enumerate(times):
        body = gemini(prose(1_500), *[f"turn {k}" for k in range(i + 1)])
        spec = {"create_body_json": json.dumps(create_body(body, ttl=ttl)),
                "cached_body_json": json.dumps({"contents": body["contents"]})}
        out.append(built(i, at, GEMINI_GENERATE_CONTENT, body, spec))
    return out


def test_the_explicit_runtime_creates_once_and_keeps_the_content_alive() -> None:
    session = gemini_session([0, 200, 400, 600, 800])
    run = simulate_gemini_explicit(session)
    assert len(run.created) == 1 and run.fallbacks == 0 and run.updates == 5
    assert cached_prefix_ratio(run.usages[1:]) == 1.0
    # without keeping it alive it expires, and is created again (a Region A write)
    lapsed = simulate_gemini_explicit(session, keep_alive=False)
    assert len(lapsed.created) == 3
    assert cached_prefix_ratio(lapsed.usages[1:]) < 1.0
    # a create body that changes (a naive date in the system instruction) creates again
    def dated(b: BuiltBody, create: dict[str, Any]) -> dict[str, Any]:
        create["systemInstruction"]["parts"][0]["text"] += f" minute {b.index}"
        return create
    assert len(simulate_gemini_explicit(session, transform_create=dated).created) == 5
    # and a content too small to create is sent whole
    small = [built(0, 0, GEMINI_GENERATE_CONTENT, gemini("tiny", "q"),
                   {"create_body_json": json.dumps(create_body(gemini("tiny", "q"))),
                    "cached_body_json": "{}"})]
    assert simulate_gemini_explicit(small).fallbacks == 1


def test_prefix_part_is_region_a_of_each_format() -> None:
    anthropic = {"tools": [{"name": "a", "cache_control": {"type": "ephemeral"}}],
                 "system": [{"type": "text", "text": "s"}], "messages": [{"role": "user"}]}
    assert prefix_part(ANTHROPIC_MESSAGES, anthropic) == \
        '[[{"name":"a"}],[{"type":"text","text":"s"}]]'
    chat = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
            "tools": [{"type": "function"}]}
    assert prefix_part(OPENAI_CHAT_COMPLETIONS, chat) == \
        '[[{"role":"system","content":"s"}],[{"type":"function"}]]'
    assert "u" not in prefix_part(OPENAI_RESPONSES, {"instructions": "s", "input": [
        {"type": "message", "role": "user", "content": "u"}]})
    assert "turn" not in prefix_part(GEMINI_GENERATE_CONTENT, gemini("s", "turn"))
    assert prefix_part(BEDROCK_CONVERSE, converse("s", "turn")).count("cachePoint") == 2
    # key order is part of the bytes
    assert prefix_part(OPENAI_CHAT_COMPLETIONS, {"messages": [{"content": "s",
                                                               "role": "system"}]}) != \
        prefix_part(OPENAI_CHAT_COMPLETIONS, {"messages": [{"role": "system", "content": "s"}]})


def test_simulate_feeds_each_format_to_its_own_simulator() -> None:
    assert {type(simulator_for(f)).__name__ for f in FORMATS} == {
        "AnthropicCacheSimulator", "OpenAICacheSimulator", "GeminiCacheSimulator",
        "BedrockCacheSimulator"}
    assert isinstance(simulator_for(ANTHROPIC_MESSAGES), AnthropicCacheSimulator)
    body = converse(prose(1_500), "q", "a", points={1})
    usages = simulate(BEDROCK_CONVERSE, [built(0, 0, BEDROCK_CONVERSE, body),
                                         built(1, 9, BEDROCK_CONVERSE, body)])
    assert [u.provider for u in usages] == [BEDROCK_CONVERSE] * 2
    assert usages[1].cache_read_input_tokens == usages[1].total_input_tokens
    with pytest.raises(ValueError, match="no cache simulator"):
        simulator_for("provider_format_none")


class _Clock:
    now = datetime(2026, 12, 31, 23, 59, tzinfo=UTC)


class _FakeStub:
    def __init__(self) -> None:
        self.calls: list[pb.BuildRequest] = []

    def Build(self, request: pb.BuildRequest,
              timeout: float | None = None) -> pb.BuildResponse:
        self.calls.append(request)
        resp = pb.BuildResponse(prefix_sha256="abc", epoch=1, estimator_factor=1.25,
                                provider_format=request.provider_format,
                                provider_body_json=json.dumps({"format": request.provider_format}))
        if request.provider_format == pb.PROVIDER_FORMAT_GEMINI_GENERATE_CONTENT:
            resp.gemini_cached_content.display_name = "ce-abc-e1"
            resp.gemini_cached_content.create_body_json = "{}"
        return resp

    def Plan(self, request: Any) -> str:
        return "planned"


def test_the_fan_out_stub_builds_every_format_from_the_lead_request() -> None:
    assert [format_name(format_value(f)) for f in FORMATS] == list(FORMATS)
    fake = _FakeStub()
    stub = FanOutStub(fake, _Clock())
    request = pb.BuildRequest(tenant_id="t", session_id="s",
                              provider_format=pb.PROVIDER_FORMAT_ANTHROPIC_MESSAGES)
    resp = stub.Build(request, timeout=3)
    assert resp.provider_format == pb.PROVIDER_FORMAT_ANTHROPIC_MESSAGES
    assert [format_name(c.provider_format) for c in fake.calls] == list(FORMATS)
    assert all(c.estimator_factor == 1.25 for c in fake.calls[1:])  # pinned to the lead's
    assert not fake.calls[0].HasField("estimator_factor")
    assert {f: len(b) for f, b in stub.built.items()} == dict.fromkeys(FORMATS, 1)
    assert stub.built[GEMINI_GENERATE_CONTENT][0].gemini["display_name"] == "ce-abc-e1"
    assert stub.built[BEDROCK_CONVERSE][0].at == _Clock.now
    # other formats and other calls pass through
    stub.Build(pb.BuildRequest(provider_format=pb.PROVIDER_FORMAT_OPENAI_RESPONSES))
    assert len(fake.calls) == 6 and stub.requests == 1
    assert stub.Plan(None) == "planned"
