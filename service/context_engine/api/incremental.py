"""Incremental Build on the wire: a request's items on top of a held base, and a response
relative to the base's response (ResponseDelta).

The response is built from the same BuildResult as a whole one; only what travels differs:
messages the base's response already holds are named by spans instead of being sent (they are
found by identity: the render memo hands out the same message objects for the same items, and
a message the memo rendered again is matched by value against the base message the previous
span continues with), the prefix is left out when it is the base's, and each JSON body sends
only what lies between the longest head and tail it shares with the base's (in UTF-8 bytes, cut
on character boundaries). The full response's size is computed, not serialized: the sizes of
the parts not sent are kept with the base.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass
from itertools import accumulate, compress, repeat
from itertools import count as count_from
from operator import add, attrgetter, is_, is_not
from typing import Any

from context_engine.api import mapping
from context_engine.build_cache import BuildBase
from context_engine.domain.builder import BuildResult, ItemScan
from context_engine.domain.estimator import ModelCatalog
from context_engine.domain.items import ConversationItem
from context_engine.domain.request import Message
from context_engine.render_memo import held_wide_bytes
from context_engine.v1 import context_engine_pb2 as pb

CHUNK = 1 << 16
# BuildResponse.build_id's tag (field 19, length-delimited): two bytes
BUILD_ID_TAG_BYTES = len(pb.BuildResponse(build_id="x").SerializeToString()) - 2


@dataclass(frozen=True, slots=True)
class Answer:
    response: pb.BuildResponse
    # what a later Build may name as its base; None when it is kept nowhere (the response then
    # has no build_id)
    base: BuildBase | None
    sent_messages: int  # messages the response carries (the others are the base's)


def item_bytes(items: Sequence[pb.ConversationItem], wides: Sequence[int],
               base: BuildBase | None = None, kept: int = 0) -> tuple[int, ...]:
    """Cumulative sizes a base counts its items for (entry i: the first i items'), each item's
    serialized size plus its domain value's ``item_held_bytes`` (``wides``, in order): the base's
    first ``kept`` items, then ``items``."""
    if len(wides) != len(items):
        raise ValueError(f"{len(wides)} wide sizes for {len(items)} items")
    start = base.item_bytes[:kept + 1] if base is not None else (0,)
    return (*start[:-1], *accumulate(map(add, (it.ByteSize() for it in items), wides),
                                     initial=start[-1]))


_TEXT = attrgetter("text")


def message_wide(messages: Sequence[Message]) -> tuple[int, ...] | None:
    """Each message's text's ``held_wide_bytes`` (the messages of a response: each has been
    put in a protobuf message, so its UTF-8 copy is made); None when every text is ASCII."""
    texts = list(map(_TEXT, messages))
    if all(map(str.isascii, texts)):
        return None
    return tuple(map(held_wide_bytes, texts))


def message_spans(base: BuildBase, messages: Sequence[Message]
                  ) -> tuple[list[tuple[int, int, int]], list[int]]:
    """(spans, indexes of the messages to send): each span is (base_start, base_count,
    new_count). No spans when nothing is taken from the base.

    A message is copied when it is the very base message after the one copied just before it,
    or one of the base's (its last position there), or, being neither, equals the base message
    after the one copied just before it (a message the memo rendered again); copies of
    consecutive base messages extend one span, and messages sent are counted in the span
    before them. The usual response is a few runs of the base's own objects in order (the
    history from where the cut now starts, the rows after it): each run is walked comparing
    object pointers at C speed, and only the message that begins a run, or is sent, is looked
    for in the base (``BaseLookup``): no index of every message is built."""
    n = len(messages)
    held = base.messages
    size = len(held)
    find = BaseLookup(base)
    spans: list[tuple[int, int, int]] = []
    sent: list[int] = []
    start = count = new = 0
    open_span = False
    copied = 0
    expect = -1  # the base message a copy would continue with
    after = 0  # where the last copied run ended (where a lookup starts)
    j = 0
    while j < n:
        m = messages[j]
        i: int | None
        if 0 <= expect < size and held[expect] is m:
            i = expect
        else:
            i = find(m, after)
            if i is None and 0 <= expect < size and held[expect] == m:
                i = expect
        if i is None:  # sent: it continues no run
            if not open_span:
                start, count, new, open_span = 0, 0, 0, True
            new += 1
            sent.append(j)
            expect = -1
            j += 1
            continue
        # copied, with the base's objects that follow it in both
        run = 1 + next(compress(count_from(), map(is_not, held[i + 1:], messages[j + 1:])),
                       min(size - i - 1, n - j - 1))
        if open_span and new == 0 and i == start + count:
            count += run
        else:
            if open_span:
                spans.append((start, count, new))
            start, count, new, open_span = i, run, 0, True
        copied += run
        expect = after = i + run
        j += run
    if open_span:
        spans.append((start, count, new))
    if copied == 0:
        return [], list(range(n))
    return spans, sent


class BaseLookup:
    """A message's last position among the base's, by identity. Where the base holds each
    object once (known from the set of its objects' ids, made on the first lookup), a message
    whose id is not in the set is not held, and one whose id is has one position, found by
    scanning the base's pointers at C speed from ``hint`` on (where the last copied run ended:
    the usual next copy lies there), then before it. Where the base holds an object twice, its
    index (``BuildBase.where``, built once and kept with the base) names the last."""

    def __init__(self, base: BuildBase) -> None:
        self.held = base.messages
        self.ids: set[int] | None = None
        self.index = base.positions  # used where the base holds an object twice
        self.base = base

    def __call__(self, message: Message, hint: int = 0) -> int | None:
        if self.index is not None:
            return self.index.get(id(message))
        if self.ids is None:
            self.ids = set(map(id, self.held))
            if len(self.ids) != len(self.held):
                self.index = self.base.where()
                return self.index.get(id(message))
        if id(message) not in self.ids:
            return None
        # held: an id in the set is one of the base's objects (both are alive, so no other
        # object has its id)
        held = self.held
        found = next(compress(count_from(hint), map(is_, held[hint:], repeat(message))), None)
        if found is None:
            found = next(compress(count_from(), map(is_, held[:hint], repeat(message))))
        return found


def _common_prefix(a: bytes, b: bytes, limit: int) -> int:
    """Length of the longest common prefix of a and b, at most ``limit``: whole chunks compared
    at C speed, then a binary search inside the first chunk that differs."""
    i = 0
    while i < limit:
        j = min(i + CHUNK, limit)
        if a[i:j] == b[i:j]:
            i = j
            continue
        lo, hi = i, j  # a[:lo] == b[:lo]; a[:hi] != b[:hi]
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if a[lo:mid] == b[lo:mid]:
                lo = mid
            else:
                hi = mid
        return lo
    return limit


def text_spans(base: bytes, new: bytes) -> tuple[list[tuple[int, int, int]], str]:
    """(spans, the text to send) for ``new`` relative to ``base``: their common head and tail
    are the base's, the middle is sent. No spans (and the whole text) when they share
    nothing."""
    limit = min(len(base), len(new))
    head = _common_prefix(base, new, limit)
    while head > 0 and head < len(new) and (new[head] & 0xC0) == 0x80:
        head -= 1  # the sent middle starts on a character
    tail = _common_prefix(base[::-1], new[::-1], limit - head)
    while tail > 0 and (new[len(new) - tail] & 0xC0) == 0x80:
        tail -= 1  # and ends before one
    if head == 0 and tail == 0:
        return [], new.decode()
    middle = new[head:len(new) - tail]
    spans = [(0, head, len(middle))]
    if tail:
        spans.append((len(base) - tail, tail, 0))
    return spans, middle.decode()


def _varint(n: int) -> int:
    size = 1
    while n >= 0x80:
        n >>= 7
        size += 1
    return size


def _entry(tag: int, length: int) -> int:
    """Bytes of one length-delimited field: its tag, its length and its payload."""
    return tag + _varint(length) + length


def _texts(response: pb.BuildResponse) -> tuple[bytes, bytes, bytes]:
    g = response.gemini_cached_content
    return (response.provider_body_json.encode(), g.create_body_json.encode(),
            g.cached_body_json.encode())


def _along(spans: list[tuple[int, int, int]], of_base: Sequence[int],
           of_sent: Sequence[int]) -> tuple[int, ...]:
    """A value per message of the response, in its order: the base's for the messages each
    span copies, then the sent ones' (``of_sent``, in order, all of them)."""
    parts: list[int] = []
    taken = 0
    for s, c, n in spans:
        parts += of_base[s:s + c]
        parts += of_sent[taken:taken + n]
        taken += n
    if taken != len(of_sent):
        raise AssertionError(f"spans count {taken} messages sent, the response holds "
                             f"{len(of_sent)}")
    return tuple(parts)


def _spans_pb(spans: list[tuple[int, int, int]]) -> list[pb.Span]:
    return [pb.Span(base_start=s, base_count=c, new_count=n) for s, c, n in spans]


def respond(result: BuildResult, provider_format: str, catalog: ModelCatalog, *,
            build_id: str, tenant_id: str, session_id: str, incarnation: int,
            items: tuple[ConversationItem, ...], sizes: tuple[int, ...],
            base: BuildBase | None, scan: ItemScan | None = None,
            memo: MutableMapping[Any, Any] | None = None,
            keeps: Callable[[BuildBase], bool] | None = None) -> Answer:
    """The response to send (whole without a base, relative to ``base`` with one) and the base
    this Build leaves for the next. ``scan``: the validation's scan state after all of
    ``items`` (which found no violation), kept with the base for the next Build to resume.
    ``keeps``: whether the cache will keep a base (``BuildCache.fits``); one it will not is
    named by no build_id, or a caller would name it and be refused on every Build after."""
    messages = result.request.messages
    prefix = (result.request.prefix_blocks, result.request.tools)
    if base is None:
        out = mapping.build_pb(result, provider_format, catalog=catalog, memo=memo)
        out.build_id = build_id
        message_entries = tuple(_entry(1, m.ByteSize()) for m in out.request.messages)
        wide = message_wide(messages)
        prefix_bytes = out.request.ByteSize() - sum(message_entries)
        full_bytes = out.ByteSize()
        texts = _texts(out)
        sent = len(messages)
    else:
        prefix_from_base = base.prefix == prefix
        spans, send = message_spans(base, messages)
        out = mapping.build_pb(result, provider_format, catalog=catalog,
                               messages=[messages[j] for j in send], prefix=not prefix_from_base,
                               memo=memo)
        out.build_id = build_id
        sent_entries = [_entry(1, m.ByteSize()) for m in out.request.messages]
        sent_wide = message_wide([messages[j] for j in send])
        if spans:
            message_entries = _along(spans, base.message_entries, sent_entries)
            if base.message_wide is None and sent_wide is None:
                wide = None
            else:  # in the order of message_entries
                wide = _along(spans, base.message_wide or (0,) * len(base.message_entries),
                              sent_wide or (0,) * len(sent_entries))
        else:
            message_entries = tuple(sent_entries)
            wide = sent_wide
        sent_request = out.request.ByteSize()
        prefix_bytes = (base.prefix_bytes if prefix_from_base
                        else sent_request - sum(sent_entries))
        full_request = prefix_bytes + sum(message_entries)
        full_bytes = out.ByteSize() - _entry(1, sent_request) + _entry(1, full_request)
        texts = _texts(out)
        delta = pb.ResponseDelta(base_build_id=base.build_id, prefix_from_base=prefix_from_base,
                                 message_spans=_spans_pb(spans), full_response_bytes=full_bytes,
                                 provider_body_bytes=len(texts[0]))
        if texts[0] and base.texts[0]:
            body_spans, body = text_spans(base.texts[0], texts[0])
            if body_spans:
                delta.provider_body_spans.extend(_spans_pb(body_spans))
                out.provider_body_json = body
        if out.HasField("gemini_cached_content"):
            g = out.gemini_cached_content
            for i, name, target in ((1, "create_body_json", delta.gemini_create_body_spans),
                                    (2, "cached_body_json", delta.gemini_cached_body_spans)):
                if texts[i] and base.texts[i]:
                    found, text = text_spans(base.texts[i], texts[i])
                    if found:
                        target.extend(_spans_pb(found))
                        setattr(g, name, text)
        out.delta.CopyFrom(delta)
        sent = len(send)
    kept = BuildBase(tenant_id=tenant_id, session_id=session_id, incarnation=incarnation,
                     build_id=build_id, items=items, item_bytes=sizes, messages=messages,
                     message_entries=message_entries, message_wide=wide,
                     prefix=prefix, prefix_bytes=prefix_bytes,
                     texts=texts, response_bytes=full_bytes, scan=scan)
    if keeps is not None and not keeps(kept):
        out.ClearField("build_id")
        if out.HasField("delta"):
            out.delta.full_response_bytes = full_bytes - _entry(
                BUILD_ID_TAG_BYTES, len(build_id.encode()))
        return Answer(response=out, base=None, sent_messages=sent)
    return Answer(response=out, base=kept, sent_messages=sent)
