"""Build's render memo: what a session's next Build finds again instead of mapping, rendering,
counting and serializing it anew (speed only: an entry missing is made again).

Every key begins with the key of the session it belongs to, and the memo is kept per session:
a session's entries hold each other's objects (its identity map holds the items and renderings
its other entries hold), so only dropping all of them frees the memory. The session written
least recently goes first, whole, while the entries weigh more than the capacity in all; a
session that alone weighs more than half of it is begun again (the entries of items it no
longer sends would otherwise pile up for as long as it lives). An entry's weight
(:func:`memo_weight`) is roughly the bytes it keeps alive: the text and bytes it holds, and a
fixed overhead per object. Hand-written: the weight and the eviction by session are what no
bounded mapping of the standard library or PyPI offers.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import fields, is_dataclass
from typing import Any

from google.protobuf.message import Message as ProtoMessage

from context_engine.domain.budget import KeptSteps
from context_engine.domain.items import (
    AssistantMessageItem,
    ConversationItem,
    ToolCallItem,
    ToolResultItem,
    UserMessageItem,
)
from context_engine.domain.request import Message

OBJECT_BYTES = 200  # an object and its slots, roughly
REFERENCE_BYTES = 8
IDENTITY_ENTRY_BYTES = 150  # one item's entry in a session's identity map (a list of six)
SEQUENCE_ELEMENT_BYTES = 40  # an element of a sequence a session entry holds (a reference, an int)
SHORT_SEQUENCE = 16  # an item's rendered messages, its counts: weighed element by element
# a str of non-ASCII text: this, then its characters and a terminating 0 (1, 2 or 4 bytes each)
_NON_ASCII_HEADER = sys.getsizeof("\u00e9") - 2


def wide_bytes(text: str) -> int:
    """What ``text`` holds in memory beyond one byte per character: 0 for ASCII. A str of
    other text takes 1, 2 or 4 bytes per character, as its widest character needs (one emoji
    makes an English text four bytes a character), and once it has been put in a protobuf
    message, a copy of its UTF-8 too: both are counted, the copy whether made yet or not, so
    the count is the same before and after (the width read from a fresh str, which has none).
    A count of one byte per character (its UTF-8 size, or its length) plus this is at least
    what the str holds."""
    if text.isascii():
        return 0
    width = (sys.getsizeof(text + "\x00") - _NON_ASCII_HEADER) // (len(text) + 2)
    return (_NON_ASCII_HEADER + width * (len(text) + 1) - len(text)
            + len(text.encode("utf-8", "surrogatepass")) + 1)


def held_wide_bytes(text: str) -> int:
    """What ``text`` holds in memory now beyond one byte per character: 0 for ASCII, else its
    size less its length, the UTF-8 copy included once made (for a text a protobuf message has
    been given, as a response's messages have: then what :func:`wide_bytes` counts, read at
    once instead of copying and encoding the text)."""
    return 0 if text.isascii() else sys.getsizeof(text) - len(text)


def item_wide_bytes(item: ConversationItem | None) -> int:
    """:func:`wide_bytes` of the texts of a conversation item (its serialized size counts them
    one byte per character at least)."""
    if isinstance(item, ToolResultItem):
        return wide_bytes(item.content) + wide_bytes(item.context_content)
    if isinstance(item, (UserMessageItem, AssistantMessageItem)):
        return wide_bytes(item.text)
    if isinstance(item, ToolCallItem):
        return sum(wide_bytes(c.arguments_json) for c in item.calls)
    return 0


# What an attachment and a tool call hold as objects of their own beyond their few wire bytes
# (measured with tracemalloc at about 125 bytes an attachment, its object and name shared by
# the item and its message, and 160 a call with its id, the message's objects included;
# tests/integration/test_build_cache_memory.py)
ATTACHMENT_BYTES = 160
CALL_BYTES = 250


def item_held_bytes(item: ConversationItem | None) -> int:
    """What a mapped conversation item holds in memory beyond its serialized size counted a
    byte per character: its texts' :func:`item_wide_bytes`, and the objects of its attachments
    and calls (each an object of its own, and its message's, for a few bytes on the wire)."""
    if isinstance(item, ToolCallItem):
        return item_wide_bytes(item) + CALL_BYTES * len(item.calls)
    if isinstance(item, UserMessageItem):
        return item_wide_bytes(item) + ATTACHMENT_BYTES * len(item.attachments)
    return item_wide_bytes(item)


def _text_weight(value: str | bytes) -> int:
    if isinstance(value, bytes):
        return len(value) + 33
    # an ASCII str: its header (49 bytes) and a byte per character; any other: wide_bytes
    # counts its header
    return len(value) + (wide_bytes(value) or 49)


def _message_weight(m: Message) -> int:
    return (OBJECT_BYTES + _text_weight(m.text) + len(m.reasoning_opaque)
            + sum(OBJECT_BYTES + _text_weight(c.arguments_json) for c in m.tool_calls))


def _part_weight(value: Any) -> int:
    if isinstance(value, (str, bytes)):
        return _text_weight(value)
    if isinstance(value, ConversationItem):  # mapped from the wire, beside a copy of it (whose
        # weight counts the item's objects and texts at one byte per character)
        return item_held_bytes(value)
    if isinstance(value, ProtoMessage):  # a copy of what was sent, and the item mapped from it
        return 2 * value.ByteSize() + 3 * OBJECT_BYTES
    if isinstance(value, Message):
        return _message_weight(value)
    if isinstance(value, (tuple, list)):
        if len(value) > SHORT_SEQUENCE:  # the items' ids a pressure step names, and the like:
            # references to what the items hold (walking them cost a warm Build 0.6 ms)
            return 60 + REFERENCE_BYTES * len(value)
        return 60 + sum(_message_weight(v) if isinstance(v, Message)
                        else _text_weight(v) if isinstance(v, (str, bytes))
                        else REFERENCE_BYTES for v in value)
    return REFERENCE_BYTES  # held by another entry, or small


def memo_weight(value: Any) -> int:
    """Roughly the bytes a render-memo entry keeps alive. An item mapped from the wire (a copy
    of it and the domain item), a rendering (its messages), a message's wire form, a pointer: the
    text and bytes in them. A session's identity map (written empty, written again at every
    Build): its entries. A session's record of its last Build (normalized items, costs, units,
    the request found well paired, what its allocation found): its sequences, element by
    element, whose objects other entries hold; written once the allocation has found them, so
    weighed with them."""
    if isinstance(value, tuple):
        return 100 + sum(map(_part_weight, value))
    if isinstance(value, dict):
        return 100 + IDENTITY_ENTRY_BYTES * len(value)
    if isinstance(value, (str, bytes, ProtoMessage, Message)):
        return _part_weight(value)
    if is_dataclass(value):
        weight = OBJECT_BYTES
        # a record of normalized items: the excerpts it made are new text (few, and found by
        # their positions); its other items are the checkpoint's, held by their own entries
        normalized, excerpted = (getattr(value, "normalized", None),
                                 getattr(value, "excerpted", None))
        if isinstance(normalized, tuple) and isinstance(excerpted, tuple):
            weight += sum(_text_weight(getattr(normalized[i], "content", "")) + OBJECT_BYTES
                          for i in excerpted)
        return weight + _fields_weight(value)
    return OBJECT_BYTES


def _fields_weight(value: Any) -> int:
    """A record's fields: its texts, its sequences element by element, and those of what an
    allocation found over its candidates (``KeptSteps``: its own sequences, as long as the
    history); anything else a reference."""
    weight = 0
    for f in fields(value):
        v = getattr(value, f.name)
        if isinstance(v, (str, bytes)):
            weight += _text_weight(v)
        elif isinstance(v, (tuple, list, dict, set, frozenset)):
            weight += 60 + SEQUENCE_ELEMENT_BYTES * len(v)
        elif isinstance(v, KeptSteps):
            weight += OBJECT_BYTES + _fields_weight(v)
        else:
            weight += REFERENCE_BYTES
    return weight


class BoundedMemo(MutableMapping[Any, Any]):
    """The render memo, bounded by the estimated bytes its entries keep alive (see the module's
    doc). Keys are tuples whose first element is the session's key."""

    def __init__(self, capacity_bytes: int,
                 weigh: Callable[[Any], int] = memo_weight) -> None:
        self.capacity_bytes = capacity_bytes
        self._weigh = weigh
        self._data: dict[Any, Any] = {}
        # per session, least recently written first: its keys with their weights, and their sum
        self._sessions: OrderedDict[Any, dict[Any, int]] = OrderedDict()
        self._session_bytes: dict[Any, int] = {}
        # per session that has entries: the incarnation of the session the Builds that made
        # them ran on, once they ended (the memo's keys name none: a session erased and
        # planned again through another replica is found out by a read naming a later one,
        # and its entries are then dropped). Entries a Build still running makes are of none
        # yet: that Build judges them when it ends (``settle``, or they are dropped).
        self._incarnations: dict[Any, int] = {}
        self.bytes = 0
        # looked up on every Build for every item and message: at C speed
        self.get = self._data.get  # type: ignore[method-assign]

    def __getitem__(self, key: Any) -> Any:
        return self._data[key]

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def __iter__(self) -> Iterator[Any]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __setitem__(self, key: Any, value: Any) -> None:
        session = key[0]
        weight = self._weigh(value)
        keys = self._sessions.get(session)
        if keys is None:
            keys = self._sessions[session] = {}
            self._session_bytes[session] = 0
        else:
            self._sessions.move_to_end(session)
        delta = weight - keys.get(key, 0)
        keys[key] = weight
        self._data[key] = value
        self._session_bytes[session] += delta
        self.bytes += delta
        if self._session_bytes[session] > self.capacity_bytes // 2:
            self.drop(session)  # begun again: this Build still holds what it uses
        while self.bytes > self.capacity_bytes and self._sessions:
            self.drop(next(iter(self._sessions)))

    def __delitem__(self, key: Any) -> None:
        del self._data[key]
        session = key[0]
        keys = self._sessions[session]
        weight = keys.pop(key)
        self._session_bytes[session] -= weight
        self.bytes -= weight
        if not keys:
            del self._sessions[session]
            del self._session_bytes[session]
            self._incarnations.pop(session, None)

    def drop(self, session: Any) -> None:
        """Every entry of ``session`` (its key, the first element of each of its keys)."""
        keys = self._sessions.pop(session, None)
        if keys is None:
            return
        for key in keys:
            del self._data[key]
        self.bytes -= self._session_bytes.pop(session)
        self._incarnations.pop(session, None)

    def incarnation(self, session: Any) -> int | None:
        """The oldest incarnation of ``session`` a Build that made its entries ran on (None:
        no entries, or none made by a Build that has ended)."""
        return self._incarnations.get(session)

    def settle(self, session: Any, incarnation: int) -> None:
        """A Build of ``session`` that ran on ``incarnation`` ended and keeps what it made:
        the session's entries are of it (or of an older one some were already of)."""
        if session in self._sessions:
            held = self._incarnations.get(session)
            self._incarnations[session] = incarnation if held is None else min(held, incarnation)

    def sessions(self) -> int:
        return len(self._sessions)

    def clear(self) -> None:
        self._data.clear()
        self._sessions.clear()
        self._session_bytes.clear()
        self._incarnations.clear()
        self.bytes = 0
