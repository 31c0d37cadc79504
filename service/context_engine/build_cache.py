"""The bases of incremental Builds: what this process keeps of each recent Build so that a later
Build of the same session may send only what changed (BuildRequest.base_build_id).

A base holds the Build's whole checkpoint items (domain values, shared with the render memo's
keys, never copied), the messages of its response (the same objects the render memo returned,
so a later response finds them again by identity) and the UTF-8 bytes of its JSON bodies. The
cache is bounded by an estimate of the bytes it holds (each base counts its checkpoint's and its
response's serialized sizes in full, although bases of one session share most of their items,
plus what their non-ASCII texts hold beyond a byte per character (``render_memo.wide_bytes``)
and their attachments and calls as objects (``render_memo.item_held_bytes``), the objects that
hold them at ``ITEM_OVERHEAD_BYTES`` per item and ``MESSAGE_OVERHEAD_BYTES``
per message, and its checkpoint's scan state at ``SCAN_ID_BYTES`` per id held; a base that is
the only holder of its objects counts at least what freeing it frees)
and keeps at most ``per_session`` bases of one session; the least recently used go first (a base a
Build just succeeded on is the most recently used of its session: ``touch``; a refused one
only ``peek``-ed it). A base larger than the
whole cache is kept nowhere, and the response that made it names none (``fits``).
Nothing here is durable: a restart, another replica or an eviction answers BUILD_BASE_UNKNOWN
and the client sends the Build in full.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import cast

from context_engine.domain.builder import ItemScan
from context_engine.domain.items import ConversationItem
from context_engine.domain.request import Message

# the three JSON bodies a response may carry, in ResponseDelta's order
TEXTS = ("provider_body_json", "gemini_create_body_json", "gemini_cached_body_json")
SCAN_ID_BYTES = 100  # what one id a base's scan state holds is counted for (roughly)
# What a base holds beside the serialized sizes: per item its domain value, per message its
# Message, their strings and their entries in the base's tuples (measured with tracemalloc at
# 320-355 bytes per item and message together; tests/integration/test_build_cache_memory.py)
ITEM_OVERHEAD_BYTES = 300
MESSAGE_OVERHEAD_BYTES = 200


@dataclass(frozen=True, slots=True, eq=False, weakref_slot=True)
class BuildBase:
    tenant_id: str
    session_id: str
    incarnation: int
    build_id: str
    items: tuple[ConversationItem, ...]
    # cumulative sizes counted for the items: item_bytes[i] is items[:i]'s serialized size plus
    # what they hold in memory beyond it counted a byte per character (render_memo's
    # item_held_bytes: non-ASCII texts, the objects of attachments and calls)
    item_bytes: tuple[int, ...]
    messages: tuple[Message, ...]
    # what each message adds to the serialized ModelRequest (its field's tag, length and bytes)
    message_entries: tuple[int, ...]
    prefix: tuple[object, object]  # the request's prefix blocks and tools
    prefix_bytes: int  # what they add to the serialized ModelRequest
    texts: tuple[bytes, bytes, bytes]  # UTF-8 of the JSON bodies, in TEXTS order
    response_bytes: int  # the whole response, serialized
    # id(message) -> its index in messages (the objects are alive as long as the base is);
    # None until a response is matched against a base that holds an object twice (``where``)
    positions: dict[int, int] | None = None
    # the validation's scan state after all of items (a Build that appends to them resumes
    # it: only the items it adds are scanned); never scanned on, only forked
    scan: ItemScan | None = None
    # each message's text's wide_bytes (in the order of messages); None: every text is ASCII
    message_wide: tuple[int, ...] | None = None

    @property
    def size(self) -> int:
        held = self.scan.held if self.scan is not None else 0
        wide = sum(self.message_wide) if self.message_wide is not None else 0
        return (self.item_bytes[-1] + self.response_bytes + wide + SCAN_ID_BYTES * held
                + ITEM_OVERHEAD_BYTES * len(self.items)
                + MESSAGE_OVERHEAD_BYTES * len(self.messages))

    @staticmethod
    def index(messages: tuple[Message, ...]) -> dict[int, int]:
        """id(message) -> its index (the last, for an object held twice)."""
        return dict(zip(map(id, messages), range(len(messages)), strict=True))

    def where(self) -> dict[int, int]:
        """The messages' ``index``, built on first use and kept with the base."""
        if self.positions is None:
            object.__setattr__(self, "positions", self.index(self.messages))
        return cast(dict[int, int], self.positions)


@dataclass(frozen=True, slots=True)
class CacheStats:
    entries: int
    bytes: int
    evictions: int


class BuildCache:
    """LRU over bases, bounded by ``max_bytes`` (estimated) and ``per_session`` bases of one
    session. Thread-safe (the servicer runs on one event loop; tests read it from others)."""

    def __init__(self, max_bytes: int, per_session: int = 4) -> None:
        self.max_bytes = max_bytes
        self.per_session = per_session
        self._bases: OrderedDict[str, BuildBase] = OrderedDict()
        self._by_session: dict[tuple[str, str], list[str]] = {}
        self._bytes = 0
        self._evictions = 0
        self._lock = threading.Lock()

    def peek(self, tenant_id: str, session_id: str, build_id: str) -> BuildBase | None:
        """The base, only to its own tenant and session (another's id is unknown here), left
        where it is in the eviction order: a Build refused after its lookup refreshes nothing."""
        with self._lock:
            base = self._bases.get(build_id)
            if base is None or base.tenant_id != tenant_id or base.session_id != session_id:
                return None
            return base

    def touch(self, build_id: str) -> None:
        """The base (if still held) becomes the most recently used, in the whole cache and in
        its session's own order: a Build made on it succeeded."""
        with self._lock:
            base = self._bases.get(build_id)
            if base is None:
                return
            self._bases.move_to_end(build_id)
            ids = self._by_session[(base.tenant_id, base.session_id)]
            if ids[-1] != build_id:
                ids.remove(build_id)
                ids.append(build_id)

    def get(self, tenant_id: str, session_id: str, build_id: str) -> BuildBase | None:
        """``peek`` and ``touch``: the base, refreshed in the eviction order."""
        base = self.peek(tenant_id, session_id, build_id)
        if base is not None:
            self.touch(build_id)
        return base

    def fits(self, base: BuildBase) -> bool:
        """Whether ``put`` would keep ``base`` (no larger than the whole cache; with a cache of
        0 bytes, none is)."""
        return base.size <= self.max_bytes

    def put(self, build_id: str, base: BuildBase) -> list[BuildBase]:
        """Keep ``base``; the bases it pushed out (no longer held: ``get`` finds none of them).
        The caller holding the list decides when their memory is given back: a base of a long
        session frees tens of thousands of objects, which the servicer leaves until its
        response is on its way."""
        if not self.fits(base):
            return []  # larger than the whole cache: kept nowhere (its build_id names nothing)
        out: list[BuildBase] = []
        with self._lock:
            key = (base.tenant_id, base.session_id)
            ids = self._by_session.setdefault(key, [])
            ids.append(build_id)
            self._bases[build_id] = base
            self._bytes += base.size
            while len(ids) > self.per_session:
                out.append(self._drop(ids[0]))
            while self._bytes > self.max_bytes and self._bases:
                out.append(self._drop(next(iter(self._bases))))
                self._evictions += 1
        return out

    def forget(self, tenant_id: str, session_id: str, *, before: int | None = None) -> None:
        """Drop every base of one session (its erasure), or with ``before`` only those of its
        incarnations older than that one (the session was erased and planned again, perhaps
        through another replica: the new incarnation's bases stay)."""
        with self._lock:
            for build_id in list(self._by_session.get((tenant_id, session_id), ())):
                if before is None or self._bases[build_id].incarnation < before:
                    self._drop(build_id)

    def oldest_incarnation(self, tenant_id: str, session_id: str) -> int | None:
        """The oldest incarnation of the session a base is held of (None: no base)."""
        with self._lock:
            ids = self._by_session.get((tenant_id, session_id))
            return min(self._bases[i].incarnation for i in ids) if ids else None

    def evict(self, build_id: str) -> bool:
        with self._lock:
            if build_id not in self._bases:
                return False
            self._drop(build_id)
            self._evictions += 1
            return True

    def clear(self) -> None:
        with self._lock:
            for build_id in list(self._bases):
                self._drop(build_id)

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(entries=len(self._bases), bytes=self._bytes,
                              evictions=self._evictions)

    def _drop(self, build_id: str) -> BuildBase:
        base = self._bases.pop(build_id)
        self._bytes -= base.size
        key = (base.tenant_id, base.session_id)
        ids = self._by_session[key]
        ids.remove(build_id)
        if not ids:
            del self._by_session[key]
        return base
