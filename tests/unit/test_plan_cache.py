"""The plan cache's per-session bookkeeping: forgetting one erased session leaves every other
session's entries findable and evictable."""

from __future__ import annotations

from typing import Any, cast

from context_engine.domain.builder import LoadedPlan
from context_engine.engine import PlanCache


def plan(name: str) -> LoadedPlan:
    return cast(LoadedPlan, name)  # the cache never looks inside what it holds


def test_forgetting_one_session_keeps_the_others() -> None:
    cache = PlanCache(capacity=3, ttl=60.0)
    cache.put(("t", "a", 1, 1), plan("a1"), verified_at=0.0)
    cache.put(("t", "b", 1, 1), plan("b1"), verified_at=0.0)
    cache.put(("t", "b", 1, 2), plan("b2"), verified_at=0.0)
    cache.forget("t", "a")
    assert cache.get(("t", "a", 1, 1)) is None
    found: Any = cache.newest("t", "b", 2)
    assert found is not None and found[1] == "b2"
    # filling the cache evicts b's oldest entry, then b's others, without losing track
    for i in range(4):
        cache.put(("t", "c", 1, i + 1), plan(f"c{i + 1}"), verified_at=1.0)
    assert cache.newest("t", "b", 1) is None and cache.newest("t", "b", 2) is None
    newest: Any = cache.newest("t", "c", 4)
    assert newest is not None and newest[1] == "c4"
    cache.forget("t", "c")
    assert all(cache.get(("t", "c", 1, i + 1)) is None for i in range(4))


def test_a_new_incarnation_replaces_the_old_one() -> None:
    cache = PlanCache(capacity=8, ttl=60.0)
    cache.put(("t", "s", 1, 1), plan("old"), verified_at=0.0)
    cache.put(("t", "s", 2, 1), plan("new"), verified_at=0.0)
    assert cache.get(("t", "s", 1, 1)) is None
    cache.put(("t", "s", 1, 2), plan("stale"), verified_at=0.0)  # read before the erasure
    assert cache.get(("t", "s", 1, 2)) is None
    found: Any = cache.newest("t", "s", 1)
    assert found is not None and found[1] == "new"


def test_the_cache_holds_its_capacity_and_evicts_the_least_recently_used() -> None:
    cache = PlanCache(capacity=3, ttl=60.0)
    for epoch in (1, 2, 3):
        cache.put(("t", "s", 1, epoch), plan(f"e{epoch}"), verified_at=0.0)
    assert len(cache) == 3
    assert [cache.get(("t", "s", 1, e)) for e in (1, 2, 3)] == ["e1", "e2", "e3"]
    cache.get(("t", "s", 1, 1))  # used last: epoch 2 is now the least recently used
    cache.put(("t", "s", 1, 4), plan("e4"), verified_at=0.0)
    assert len(cache) == 3
    assert [cache.get(("t", "s", 1, e)) for e in (1, 2, 3, 4)] == ["e1", None, "e3", "e4"]
