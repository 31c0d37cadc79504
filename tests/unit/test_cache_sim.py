"""The fake Anthropic prompt cache (tests/support/cache_sim.py): one test per rule."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.support.cache_sim import (
    LOOKBACK_BLOCKS,
    AnthropicCacheSimulator,
    CacheRequestError,
    CacheUsage,
    cached_prefix_ratio,
    cached_share,
    count_tokens,
    flatten,
)

EPHEMERAL = {"type": "ephemeral"}
HOUR = {"type": "ephemeral", "ttl": "1h"}
WORDS = ("amber", "basalt", "cobalt", "delta", "ember", "fjord", "granite", "harbor", "indigo",
         "juniper", "kelp", "lagoon", "meadow", "nickel", "onyx", "prairie")


def prose(tokens: int, seed: int = 0) -> str:
    """Text of at least ``tokens`` cl100k tokens."""
    words: list[str] = []
    i = seed
    while count_tokens(" ".join(words)) < tokens:
        words.extend(f"{WORDS[(i + k) % len(WORDS)]}{k % 7}" for k in range(32))
        i += 1
    return " ".join(words)


def tool(name: str, cc: dict[str, Any] | None = None) -> dict[str, Any]:
    t: dict[str, Any] = {"name": name, "description": f"The {name} tool.",
                         "input_schema": {"type": "object", "properties": {}}}
    if cc:
        t["cache_control"] = cc
    return t


def text(value: str, cc: dict[str, Any] | None = None) -> dict[str, Any]:
    block: dict[str, Any] = {"type": "text", "text": value}
    if cc:
        block["cache_control"] = cc
    return block


def turns(n: int, cc_at: set[int] | None = None) -> list[dict[str, Any]]:
    """``n`` alternating messages of one text block; a breakpoint on the listed indexes."""
    return [{"role": "user" if i % 2 == 0 else "assistant",
             "content": [text(f"message {i}: " + WORDS[i % len(WORDS)],
                              EPHEMERAL if cc_at and i in cc_at else None)]}
            for i in range(n)]


def body(*, tools: list[dict[str, Any]] | None = None, system: list[dict[str, Any]] | None = None,
         messages: list[dict[str, Any]] | None = None, **extra: Any) -> dict[str, Any]:
    return {"model": "claude-sonnet-4-5", "max_tokens": 1024,
            "tools": tools if tools is not None else [tool("a"), tool("b", EPHEMERAL)],
            "system": system if system is not None else [text("policy " + prose(40)),
                                                         text("instructions " + prose(40),
                                                              EPHEMERAL)],
            "messages": messages if messages is not None else turns(3, {2}), **extra}


def tokens_through(b: dict[str, Any], label: str) -> int:
    blocks = flatten(b)
    end = next(x.index for x in blocks if x.label == label)
    return sum(x.tokens for x in blocks[:end + 1])


def total_tokens(b: dict[str, Any]) -> int:
    return sum(x.tokens for x in flatten(b))


def sim(**kw: Any) -> AnthropicCacheSimulator:
    kw.setdefault("min_cacheable_tokens", 1)
    return AnthropicCacheSimulator(**kw)


def test_blocks_follow_the_prefix_order_tools_system_messages() -> None:
    b = body(system=[text("s0"), text("s1")], messages=[
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": [text("a"), {"type": "tool_use", "id": "t1",
                                                      "name": "a", "input": {}}]}])
    b["system"] = "one system string"  # a string system is one block
    labels = [(x.region, x.label) for x in flatten(b)]
    assert labels == [("tools", "tools[0]"), ("tools", "tools[1]"), ("system", "system[0]"),
                      ("messages", "messages[0].content[0]"),
                      ("messages", "messages[1].content[0]"),
                      ("messages", "messages[1].content[1]")]


def test_a_repeated_request_reads_its_whole_breakpoint_prefix() -> None:
    s, b = sim(), body()
    first = s.request(b, 0)
    through = tokens_through(b, "messages[2].content[0]")
    assert (first.cache_read_input_tokens, first.cache_creation_input_tokens) == (0, through)
    second = s.request(b, 10)
    assert second.cache_read_input_tokens == through
    assert second.cache_creation_input_tokens == 0
    assert second.input_tokens == total_tokens(b) - through == 0
    assert second.read_region == "messages" and second.read_through == "messages[2].content[0]"
    assert [o.status for o in second.breakpoints] == ["refreshed", "refreshed", "read"]


def test_usage_adds_up_and_input_is_what_follows_the_last_breakpoint() -> None:
    s = sim()
    b = body(messages=turns(5, {1}))
    u = s.request(b, 0)
    assert u.total_input_tokens == total_tokens(b)
    assert u.input_tokens == total_tokens(b) - tokens_through(b, "messages[1].content[0]")
    assert u.usage() == {"input_tokens": u.input_tokens,
                         "cache_creation_input_tokens": u.cache_creation_input_tokens,
                         "cache_read_input_tokens": 0}


def test_a_changed_byte_in_system_invalidates_everything_after_it() -> None:
    s, b = sim(), body()
    s.request(b, 0)
    changed = copy.deepcopy(b)
    changed["system"][1]["text"] = changed["system"][1]["text"].replace("instructions",
                                                                        "instructionz", 1)
    u = s.request(changed, 5)
    # only the tools entry (after_tools) survives; system and every message are written again
    assert u.cache_read_input_tokens == tokens_through(b, "tools[1]")
    assert u.read_region == "tools" and u.read_through == "tools[1]"
    assert u.diverged_at == "system[1]"
    assert u.cache_creation_input_tokens == total_tokens(changed) - u.cache_read_input_tokens
    assert [o.status for o in u.breakpoints] == ["read", "written", "written"]


def test_a_changed_tool_definition_invalidates_everything() -> None:
    s, b = sim(), body()
    s.request(b, 0)
    changed = copy.deepcopy(b)
    changed["tools"][0]["description"] += " "
    u = s.request(changed, 5)
    assert u.cache_read_input_tokens == 0 and u.read_blocks == 0 and u.read_region == ""
    assert u.diverged_at == "tools[0]"


def test_a_changed_model_is_another_cache() -> None:
    s, b = sim(), body()
    s.request(b, 0)
    other = {**b, "model": "claude-opus-4-1"}
    assert s.request(other, 5).cache_read_input_tokens == 0


def test_cache_control_is_not_part_of_the_cached_bytes() -> None:
    s = sim()
    s.request(body(messages=turns(6, {2})), 0)
    moved = body(messages=turns(6, {5}))  # the marker moved on; the earlier entry is found
    u = s.request(moved, 5)
    assert u.cache_read_input_tokens == tokens_through(moved, "messages[2].content[0]")
    assert u.cache_creation_input_tokens == total_tokens(moved) - u.cache_read_input_tokens


def test_merging_two_messages_changes_the_prefix() -> None:
    s = sim()
    split = body(messages=[{"role": "user", "content": [text("first")]},
                           {"role": "user", "content": [text("second", EPHEMERAL)]}])
    merged = body(messages=[{"role": "user", "content": [text("first"),
                                                          text("second", EPHEMERAL)]}])
    s.request(split, 0)
    u = s.request(merged, 1)
    assert u.read_through == "system[1]" and u.diverged_at == "messages[0].content[1]"


def test_a_breakpoint_caches_the_exact_prefix_through_its_block_only() -> None:
    s = sim()
    s.request(body(messages=turns(4, {1})), 0)
    # the same first two messages, then other ones: the entry through message 1 is read
    other = body(messages=[*turns(2), {"role": "user", "content": [text("different")]},
                           {"role": "assistant", "content": [text("x", EPHEMERAL)]}])
    u = s.request(other, 1)
    assert u.read_through == "messages[1].content[0]"
    # but a prefix that ends one block later than any entry is not a hit by itself
    s2 = sim()
    s2.request(body(messages=turns(4, {1})), 0)
    shorter = body(messages=turns(1, {0}))
    assert s2.request(shorter, 1).read_through == "system[1]"


def test_the_lookback_reaches_exactly_twenty_blocks_before_a_breakpoint() -> None:
    base = 4  # tools[0], tools[1], system[0], system[1]
    for extra, hit in ((LOOKBACK_BLOCKS, True), (LOOKBACK_BLOCKS + 1, False)):
        s = sim()
        s.request(body(messages=turns(2, {1})), 0)  # entry through messages[1]
        longer = body(messages=turns(2 + extra, {1 + extra}))
        u = s.request(longer, 1)
        if hit:
            assert u.read_through == "messages[1].content[0]", extra
            assert u.read_blocks == base + 2
        else:  # 21 blocks back: the message entry is out of reach; system's is found
            assert u.read_through == "system[1]", extra


def test_a_closer_breakpoint_rescues_an_entry_beyond_the_lookback() -> None:
    s = sim()
    s.request(body(messages=turns(2, {1})), 0)
    longer = body(messages=turns(40, {10, 39}))
    u = s.request(longer, 1)
    assert u.read_through == "messages[1].content[0]"


def test_entries_expire_after_their_ttl() -> None:
    b = body()
    s = sim()
    s.request(b, 0)
    assert s.request(b, 299).read_region == "messages"
    s = sim()
    s.request(b, 0)
    late = s.request(b, 300)
    assert late.cache_read_input_tokens == 0 and late.read_region == ""
    assert all(o.status == "written" for o in late.breakpoints)


def test_a_hit_refreshes_the_entry_for_another_ttl() -> None:
    b = body()
    s = sim()
    s.request(b, 0)
    assert s.request(b, 200).read_region == "messages"  # refreshed until 500
    assert s.request(b, 450).read_region == "messages"  # past the first write's 300
    assert s.request(b, 751).cache_read_input_tokens == 0  # 450 + 300 has passed


def test_the_one_hour_ttl_lives_an_hour() -> None:
    b = body(tools=[tool("a"), tool("b", HOUR)], system=[text(prose(40), HOUR)],
             messages=turns(2))
    s = sim()
    s.request(b, 0)
    u = s.request(b, 3_599)
    assert u.read_through == "system[0]"
    assert s.request(b, 3_599 + 3_600).cache_read_input_tokens == 0


def test_longer_ttls_must_come_first() -> None:
    ok = body(tools=[tool("a"), tool("b", HOUR)], system=[text("s", HOUR)],
              messages=turns(2, {1}))
    sim().request(ok, 0)
    bad = body(tools=[tool("a"), tool("b", EPHEMERAL)], system=[text("s", HOUR)])
    with pytest.raises(CacheRequestError, match="longer TTLs come first"):
        sim().request(bad, 0)


def test_at_most_four_breakpoints() -> None:
    four = body(messages=turns(4, {1, 3}))
    assert len(sim().request(four, 0).breakpoints) == 4
    with pytest.raises(CacheRequestError, match="maximum of 4"):
        sim().request(body(messages=turns(4, {0, 1, 3})), 0)
    # the automatic top-level breakpoint takes a slot
    with pytest.raises(CacheRequestError, match="maximum of 4"):
        sim().request(body(messages=turns(4, {1, 2}), cache_control=EPHEMERAL), 0)
    auto = sim().request(body(messages=turns(4, {1}), cache_control=EPHEMERAL), 0)
    assert [o.label for o in auto.breakpoints][-1] == "messages[3].content[0]"


def test_cache_control_is_refused_on_thinking_and_empty_text_blocks() -> None:
    thinking = {"type": "thinking", "thinking": "...", "signature": "sig",
                "cache_control": EPHEMERAL}
    with pytest.raises(CacheRequestError, match="not allowed"):
        sim().request(body(messages=[{"role": "user", "content": [text("q")]},
                                     {"role": "assistant", "content": [thinking]}]), 0)
    with pytest.raises(CacheRequestError, match="not allowed"):
        sim().request(body(messages=[{"role": "user", "content": [text("", EPHEMERAL)]}]), 0)
    with pytest.raises(CacheRequestError, match="unknown cache TTL"):
        sim().request(body(system=[text("s", {"type": "ephemeral", "ttl": "10m"})]), 0)


def test_below_the_minimum_prefix_nothing_is_cached_and_nothing_fails() -> None:
    small = body(tools=[tool("a", EPHEMERAL)], system=[text("short", EPHEMERAL)],
                 messages=turns(2, {1}))
    assert total_tokens(small) < 1_024
    s = AnthropicCacheSimulator()  # the real minimum: 1,024 tokens
    for at in (0, 10):
        u = s.request(small, at)
        assert u.cache_read_input_tokens == u.cache_creation_input_tokens == 0
        assert u.input_tokens == total_tokens(small)
        assert {o.status for o in u.breakpoints} == {"below_minimum"}


def test_only_breakpoints_at_or_above_the_minimum_are_cached() -> None:
    big = body(tools=[tool("a", EPHEMERAL)],
               system=[text(prose(1_100)), text("tail", EPHEMERAL)], messages=turns(2, {1}))
    assert tokens_through(big, "tools[0]") < 1_024 <= tokens_through(big, "system[1]")
    s = AnthropicCacheSimulator()
    first = s.request(big, 0)
    assert [o.status for o in first.breakpoints] == ["below_minimum", "written", "written"]
    assert first.cache_creation_input_tokens == total_tokens(big)
    second = s.request(big, 1)
    assert second.cache_read_input_tokens == total_tokens(big)
    assert [o.status for o in second.breakpoints] == ["below_minimum", "refreshed", "read"]


def test_requests_must_come_in_time_order() -> None:
    s = sim()
    s.request(body(), 10)
    with pytest.raises(ValueError, match="time order"):
        s.request(body(), 9)


def usage(read: int, created: int, uncached: int, prefix: int) -> CacheUsage:
    return CacheUsage(at=0, cache_read_input_tokens=read, cache_creation_input_tokens=created,
                      input_tokens=uncached, prefix_tokens=prefix, blocks=0, read_blocks=0,
                      read_region="", read_through="", diverged_at="", breakpoints=())


def test_the_two_figures() -> None:
    usages = [usage(0, 900, 100, 500), usage(500, 0, 100, 500), usage(300, 200, 100, 500)]
    assert cached_prefix_ratio(usages[1:]) == pytest.approx(800 / 1000)
    assert cached_share(usages[1:]) == pytest.approx(800 / 1200)
    assert cached_prefix_ratio([]) == cached_share([]) == 0.0
