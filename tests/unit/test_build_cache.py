"""The bases of incremental Builds: only their own tenant and session reach them, the cache
stays within its bytes and its per-session bound (least recently used out first, by either), and an
erasure takes a session's bases with it."""

from __future__ import annotations

from dataclasses import replace

from context_engine.build_cache import BuildBase, BuildCache, CacheStats


def base(tenant: str, session: str, build_id: str, size: int) -> BuildBase:
    return BuildBase(tenant_id=tenant, session_id=session, incarnation=1, build_id=build_id,
                     items=(), item_bytes=(0, size), messages=(), message_entries=(),
                     prefix=((), ()), prefix_bytes=0, texts=(b"", b"", b""), response_bytes=0)


def test_only_its_own_tenant_and_session_reach_a_base() -> None:
    cache = BuildCache(10_000)
    cache.put("b1", base("t", "s", "b1", 100))
    assert cache.get("t", "s", "b1") is not None
    assert cache.get("t", "other", "b1") is None
    assert cache.get("other", "s", "b1") is None
    assert cache.get("t", "s", "nope") is None


def test_bytes_bound_evicts_the_least_recently_used() -> None:
    cache = BuildCache(1_000)
    cache.put("a", base("t", "a", "a", 400))
    cache.put("b", base("t", "b", "b", 400))
    assert cache.get("t", "a", "a") is not None  # a is now the most recently used
    cache.put("c", base("t", "c", "c", 400))
    assert cache.get("t", "b", "b") is None
    assert cache.get("t", "a", "a") is not None and cache.get("t", "c", "c") is not None
    stats = cache.stats()
    assert stats.entries == 2 and stats.bytes == 800 and stats.evictions == 1
    cache.put("huge", base("t", "h", "huge", 5_000))  # larger than the cache: kept nowhere
    assert cache.get("t", "h", "huge") is None and cache.stats().entries == 2


def test_put_hands_back_what_it_pushed_out() -> None:
    """The bases a put evicts come back to the caller (who decides when their memory goes),
    by either bound; a put that evicts nothing hands back nothing."""
    cache = BuildCache(1_000, per_session=2)
    first, second = base("t", "s", "s0", 100), base("t", "s", "s1", 100)
    assert cache.put("s0", first) == [] and cache.put("s1", second) == []
    third = base("t", "s", "s2", 100)
    out = cache.put("s2", third)
    assert len(out) == 1 and out[0] is first and cache.get("t", "s", "s0") is None
    big = base("t", "o", "o", 950)  # over 1,000 bytes with either of s1 and s2: both go
    out = cache.put("o", big)
    assert [b.build_id for b in out] == ["s1", "s2"] and out[0] is second
    assert cache.stats().entries == 1 and cache.stats().bytes == 950
    assert cache.put("huge", base("t", "h", "huge", 5_000)) == []  # kept nowhere, none out
    assert cache.get("t", "o", "o") is big


def test_per_session_bound_and_forget() -> None:
    cache = BuildCache(1_000_000, per_session=2)
    for i in range(3):
        cache.put(f"s{i}", base("t", "s", f"s{i}", 10))
    cache.put("o", base("t", "o", "o", 10))
    assert cache.get("t", "s", "s0") is None
    assert cache.get("t", "s", "s1") is not None and cache.get("t", "s", "s2") is not None
    cache.forget("t", "s")
    assert cache.get("t", "s", "s1") is None and cache.get("t", "s", "s2") is None
    assert cache.get("t", "o", "o") is not None
    assert cache.stats().bytes == 10


def test_forget_before_an_incarnation_keeps_the_newer_ones() -> None:
    """A session erased and planned again: the erased incarnation's bases go, the new one's
    stay, and other sessions are untouched."""
    cache = BuildCache(1_000_000)
    cache.put("old", replace(base("t", "s", "old", 10), incarnation=1))
    cache.put("new", replace(base("t", "s", "new", 10), incarnation=2))
    cache.put("other", replace(base("t", "o", "other", 10), incarnation=1))
    cache.forget("t", "s", before=2)
    assert cache.get("t", "s", "old") is None
    assert cache.get("t", "s", "new") is not None
    assert cache.get("t", "o", "other") is not None
    assert cache.stats().entries == 2 and cache.stats().bytes == 20
    cache.forget("t", "s")
    assert cache.get("t", "s", "new") is None and cache.stats().entries == 1


def test_per_session_bound_drops_the_least_recently_used_not_the_oldest() -> None:
    """A base a Build was just served from is its session's most recently used: a newer base
    pushes out the one no Build used since, although it was kept later."""
    cache = BuildCache(1_000_000, per_session=2)
    cache.put("a", base("t", "s", "a", 10))
    cache.put("b", base("t", "s", "b", 10))
    assert cache.get("t", "s", "a") is not None  # a Build is served from a
    out = cache.put("c", base("t", "s", "c", 10))
    assert [x.build_id for x in out] == ["b"]
    assert cache.get("t", "s", "a") is not None and cache.get("t", "s", "c") is not None
    assert cache.get("t", "s", "b") is None
    # an id of another session changes nothing of this one's order
    assert cache.get("t", "other", "c") is None
    out = cache.put("d", base("t", "s", "d", 10))
    assert [x.build_id for x in out] == ["a"]


def test_fits_says_what_put_keeps() -> None:
    cache = BuildCache(1_000)
    assert cache.fits(base("t", "s", "b", 1_000)) and not cache.fits(base("t", "s", "b", 1_001))
    assert cache.put("b", base("t", "s", "b", 1_001)) == [] and cache.get("t", "s", "b") is None
    none = BuildCache(0)
    assert not none.fits(base("t", "s", "z", 1))


def test_a_base_exactly_as_large_as_the_cache_is_kept() -> None:
    """``fits`` says a base of exactly ``max_bytes`` is kept: ``put`` keeps it (pushing out the
    others) and names it, rather than evicting it at once and leaving its build_id naming
    nothing."""
    cache = BuildCache(1_000)
    cache.put("a", base("t", "a", "a", 10))
    whole = base("t", "s", "w", 1_000)
    assert cache.fits(whole)
    out = cache.put("w", whole)
    assert [b.build_id for b in out] == ["a"]
    assert cache.get("t", "s", "w") is whole
    assert cache.stats() == CacheStats(entries=1, bytes=1_000, evictions=1)


def test_oldest_incarnation_is_the_oldest_held() -> None:
    """What a read naming a later incarnation compares against: the oldest incarnation of the
    session any base is held of, whatever order the bases were kept in."""
    cache = BuildCache(1_000_000)
    assert cache.oldest_incarnation("t", "s") is None
    cache.put("new", replace(base("t", "s", "new", 10), incarnation=3))
    cache.put("old", replace(base("t", "s", "old", 10), incarnation=2))
    cache.put("newer", replace(base("t", "s", "newer", 10), incarnation=4))
    cache.put("other", replace(base("t", "o", "other", 10), incarnation=1))
    assert cache.oldest_incarnation("t", "s") == 2
    cache.forget("t", "s", before=3)
    assert cache.oldest_incarnation("t", "s") == 3
