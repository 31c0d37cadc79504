"""Incremental Build, the client's half: what a client keeps of each session's last Build so that
the next one sends only the checkpoint items that changed and reads back a response relative to
the last one (``BuildRequest.base_build_id``, ``BuildResponse.delta``).

:class:`IncrementalBuilds` does not depend on which generated module the messages come from (it
builds messages with ``type(message)()`` and reads field numbers from their descriptors), so the
client's and the service's own generated classes both work. One Build goes::

    tally = Tally(keep_base=request.keep_base)  # what this Build moves, counted if it returns
    wire, base = builds.prepare(request, tally)  # the request to send, and what it is based on
    try:
        response = stub.Build(wire)
    except grpc.RpcError as err:
        if base is None or not base_unknown(err):
            builds.forget(request.tenant_id, request.session_id)
            raise
        tally.refused(wire)
        wire, base = builds.fallback(wire, base, tally), None  # the same Build whole, once
        response = stub.Build(wire)
    full = builds.absorb(wire, response, base, tally)  # DeltaMismatch: fallback, as above

``absorb`` takes the request that was sent (``wire``), never the caller's: a whole Build holds
the items of that request, which is the client's own copy, so a caller that changes its items
while the Build is in flight does not change what the client believes the service holds. A
session forgotten (``forget``: deleted, or forgotten by the caller) while one of its Builds is
in flight is not held again when that Build returns: the tally marks when it was prepared.

A whole Build (the session's first, or a resend) asks the service to keep it as a base
(``keep_base``); a Build naming a base is kept anyway. What is held per session (least recently
used first out, ``max_sessions`` of them): copies of the last Build's checkpoint items (never
the caller's objects, which a caller may change and send again), its ``build_id``, and its full
response's request and JSON bodies; so about the size of one checkpoint and one response per
session. A request is never changed; a response handed back is the caller's own.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, fields
from itertools import accumulate, chain
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message

from context_engine_client.errors import ContextEngineError, Internal, from_rpc_error

BASE_UNKNOWN = "BUILD_BASE_UNKNOWN"
DEFAULT_MAX_SESSIONS = 1024
FORGOTTEN_KEPT = 4096  # the sessions forgotten most recently whose turn is remembered

Req = TypeVar("Req", bound=Message)
Resp = TypeVar("Resp", bound=Message)


@dataclass(frozen=True, kw_only=True)
class BuildStats:
    """What the Builds of one client moved, counted for each Build that returned a response
    (a Build that fails counts nothing). ``builds``: Builds answered; ``incremental``: of those,
    the ones served from a base (their response was a delta); ``full_resends``: Builds sent
    again whole after ``BUILD_BASE_UNKNOWN`` (or after a delta that did not read back).
    ``request_bytes`` and ``response_bytes``: serialized sizes of what went on the wire, every
    attempt of the Build included (a refused request, a delta that did not read back);
    ``full_request_bytes`` and ``full_response_bytes``: what the same Builds would have moved
    whole (the request as the caller gave it, the response as the service answers it whole)."""

    builds: int = 0
    incremental: int = 0
    full_resends: int = 0
    request_bytes: int = 0
    response_bytes: int = 0
    full_request_bytes: int = 0
    full_response_bytes: int = 0

    @property
    def bytes_saved(self) -> int:
        return (self.full_request_bytes + self.full_response_bytes
                - self.request_bytes - self.response_bytes)

    def __repr__(self) -> str:  # printed, it shows the figure the counts are kept for
        counts = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self))
        return f"BuildStats({counts}, bytes_saved={self.bytes_saved})"


@dataclass
class Tally:
    """One Build's attempts, added to the counts when it returns (:meth:`IncrementalBuilds.absorb`)
    and dropped when it fails. ``keep_base``: the caller's request itself asked to be kept (its
    size whole then counts the flag, which the client adds otherwise). ``mark``: set by
    :meth:`IncrementalBuilds.prepare`, when the Build began (a session forgotten since is not
    held again by its answer)."""

    keep_base: bool = False
    mark: int | None = None
    request_bytes: int = 0
    response_bytes: int = 0
    full_resends: int = 0

    def refused(self, wire: Message) -> None:
        """A request that was sent and refused (``BUILD_BASE_UNKNOWN``)."""
        self.request_bytes += wire.ByteSize()


class DeltaMismatch(Exception):
    """A response that does not read back against the base it names (a span out of range, a
    size that does not check out, bytes that are not UTF-8): send the Build whole
    (:meth:`IncrementalBuilds.fallback`)."""


def base_unknown(err: BaseException) -> bool:
    """Whether a failed Build was refused because its replica does not hold the base: a
    :class:`~context_engine_client.ContextEngineError` or a ``grpc.RpcError`` of a call."""
    if isinstance(err, grpc.RpcError):
        err = from_rpc_error(err)
    return (isinstance(err, ContextEngineError)
            and err.code == grpc.StatusCode.FAILED_PRECONDITION and err.reason == BASE_UNKNOWN)


# ------------------------------------------------------------------------------ wire sizes

def _varint_len(n: int) -> int:
    return max(1, (n.bit_length() + 6) // 7)


def _len_field(number: int, size: int) -> int:
    """Serialized size of a length-delimited field (tag, length, payload) of ``size`` bytes."""
    return _varint_len(number << 3) + _varint_len(size) + size


def _string_field(number: int, size: int) -> int:
    """The same for a proto3 string, which is not sent when empty."""
    return _len_field(number, size) if size else 0


def _number(message: Any, name: str) -> int:
    return int(message.DESCRIPTOR.fields_by_name[name].number)


def _copy_except(src: Any, dst: Any, skip: str) -> None:
    """Copies every set field of ``src`` but ``skip`` into the empty ``dst``."""
    for fd, value in src.ListFields():
        if fd.name == skip:
            continue
        if fd.is_repeated:  # lists and maps
            getattr(dst, fd.name).MergeFrom(value)
        elif fd.message_type is not None:  # present even when empty, as in src
            sub = getattr(dst, fd.name)
            sub.SetInParent()
            sub.MergeFrom(value)
        else:
            setattr(dst, fd.name, value)


# ------------------------------------------------------------------------------ the state

@dataclass(frozen=True, slots=True, eq=False)
class _Answer:
    """What is held of a full response: its request's entries (our own messages, never handed
    out: a response given to the caller holds copies), what each adds to the serialized
    ModelRequest, and the UTF-8 of its three JSON bodies."""

    prefix_blocks: tuple[Any, ...]
    tools: tuple[Any, ...]
    prefix_bytes: int  # what prefix_blocks and tools add to the ModelRequest
    messages: tuple[Any, ...]
    message_bytes: tuple[int, ...]  # what each message adds to the ModelRequest
    texts: tuple[bytes, bytes, bytes]


@dataclass(frozen=True, slots=True, eq=False)
class _Held:
    """One session's last Build. Immutable: a Build in flight keeps the state it started from
    while another Build of the session replaces it."""

    build_id: str
    items: tuple[Any, ...]  # copies of the whole checkpoint's items
    item_bytes: tuple[int, ...]  # item_bytes[i]: what items[:i] add to the Checkpoint
    answer: _Answer


@dataclass(frozen=True, slots=True, eq=False)
class Base:
    """What :meth:`IncrementalBuilds.prepare` based a request on, for :meth:`absorb`."""

    held: _Held
    kept: int  # base_items_kept
    new_items: tuple[Any, ...]  # copies of the request's items from ``kept`` on
    new_item_bytes: tuple[int, ...]
    full_request_bytes: int

    @property
    def build_id(self) -> str:
        return self.held.build_id


def _items_bytes(items: Any, number: int) -> list[int]:
    return [_len_field(number, item.ByteSize()) for item in items]


def _copies(messages: Any) -> tuple[Any, ...]:
    out = []
    for m in messages:
        copy = type(m)()
        copy.CopyFrom(m)
        out.append(copy)
    return tuple(out)


def _common_prefix(held: tuple[Any, ...], items: Any) -> int:
    k = 0
    for a, b in zip(held, items, strict=False):
        if a != b:  # value equality: the caller may have changed an item it sent before
            break
        k += 1
    return k


class IncrementalBuilds:
    """Per (tenant_id, session_id), the last Build: see the module's docstring. Thread-safe."""

    def __init__(self, max_sessions: int = DEFAULT_MAX_SESSIONS) -> None:
        if max_sessions < 1:
            # named as the clients take it (Client(incremental_sessions=...))
            raise ValueError(f"incremental_sessions must be at least 1, not {max_sessions}")
        self.max_sessions = max_sessions
        self._held: OrderedDict[tuple[str, str], _Held] = OrderedDict()
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(BuildStats.__dataclass_fields__, 0)
        # forgets counted, and when each session (of the last FORGOTTEN_KEPT) and all of them
        # (``clear``) last were: a Build in flight across one holds nothing of its answer
        self._forgets = 0
        self._forgotten: OrderedDict[tuple[str, str], int] = OrderedDict()
        self._cleared = 0

    # -------------------------------------------------------------------------- public

    @property
    def stats(self) -> BuildStats:
        with self._lock:
            return BuildStats(**self._counts)

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def forget(self, tenant_id: str, session_id: str) -> None:
        """Drops what is held of one session: its next Build goes whole. A Build of the
        session in flight holds nothing of its answer either (it was based on what is
        forgotten, or on a session deleted since)."""
        key = (tenant_id, session_id)
        with self._lock:
            self._held.pop(key, None)
            self._forgets += 1
            self._forgotten[key] = self._forgets
            self._forgotten.move_to_end(key)
            while len(self._forgotten) > FORGOTTEN_KEPT:
                self._forgotten.popitem(last=False)

    def clear(self) -> None:
        """``forget`` of every session."""
        with self._lock:
            self._held.clear()
            self._forgets += 1
            self._cleared = self._forgets

    def prepare(self, request: Req, tally: Tally | None = None) -> tuple[Req, Base | None]:
        """The request to send for ``request`` (a BuildRequest with the whole checkpoint, which
        is not changed) and the base it names; with nothing held of the session, a copy of
        ``request`` that sets ``keep_base``, and None. ``tally``: the Build's, marked with
        when it began (:meth:`absorb` then holds nothing of a session forgotten since)."""
        r: Any = request
        if r.base_build_id or r.base_items_kept:
            raise ValueError("the request names a base already; prepare takes whole Builds")
        with self._lock:
            if tally is not None:
                tally.mark = self._forgets
            key = (r.tenant_id, r.session_id)
            held = self._held.get(key)
            if held is not None:
                self._held.move_to_end(key)
        if held is None:
            return self._whole(r), None
        items = r.checkpoint.items
        k = _common_prefix(held.items, items)
        wire: Any = type(r)()
        _copy_except(r, wire, "checkpoint")
        if r.HasField("checkpoint"):
            wire.checkpoint.SetInParent()
            _copy_except(r.checkpoint, wire.checkpoint, "items")
        # the held items' sizes make the whole request's size without serializing it
        shell = wire.checkpoint.ByteSize()
        new = tuple(items[k:])
        item_number = _number(r.checkpoint, "items")
        new_bytes = tuple(_items_bytes(new, item_number))
        whole_cp = shell + held.item_bytes[k] + sum(new_bytes)
        cp_number = _number(r, "checkpoint")
        wire_shell = wire.ByteSize()
        if r.HasField("checkpoint"):
            full_request_bytes = wire_shell - _len_field(cp_number, shell) + _len_field(
                cp_number, whole_cp)
        else:  # no checkpoint: no items either
            full_request_bytes = wire_shell
        if new:
            wire.checkpoint.items.extend(new)
        wire.base_build_id = held.build_id
        wire.base_items_kept = k
        # our own copies: the caller may change its items once this returns
        return wire, Base(held=held, kept=k, new_items=_copies(new), new_item_bytes=new_bytes,
                          full_request_bytes=full_request_bytes)

    def fallback(self, sent: Req, base: Base | None, tally: Tally | None = None) -> Req:
        """After ``BUILD_BASE_UNKNOWN`` (or :class:`DeltaMismatch`) for ``sent``, the request
        :meth:`prepare` returned with ``base``: forgets the session and returns the request to
        send again, whole: the Build ``sent`` was (the base's kept items and those sent; the
        caller's request is not read again, since the caller may have changed it meanwhile),
        asking to be kept. Absorb its answer with base None."""
        r: Any = sent
        if base is None or r.base_build_id != base.build_id:
            raise ValueError(f"the request sent names base {r.base_build_id!r}, not "
                             f"{base.build_id if base else None!r}: fallback resends what "
                             "prepare returned with a base")
        with self._lock:  # the Build's own doing: not a forget that Builds in flight heed
            self._held.pop((r.tenant_id, r.session_id), None)
        if tally is not None:
            tally.full_resends += 1
        wire: Any = type(r)()
        wire.CopyFrom(r)
        wire.ClearField("base_build_id")
        wire.ClearField("base_items_kept")
        if r.HasField("checkpoint"):
            del wire.checkpoint.items[:]
            wire.checkpoint.items.extend(base.held.items[:base.kept] + base.new_items)
        wire.keep_base = True
        return wire  # type: ignore[no-any-return]

    def absorb(self, sent: Message, response: Resp, base: Base | None,
               tally: Tally | None = None) -> Resp:
        """The full response from ``response``, the answer to ``sent`` (the request
        :meth:`prepare` or :meth:`fallback` returned, as it went on the wire; ``base``: what
        prepare returned with it, None for a whole request); and holds it as the session's
        base. A response without a delta to a whole request is returned as it is. Raises
        :class:`DeltaMismatch` (holding and counting nothing; ``tally`` has this attempt's
        bytes) when the delta does not read back, or when a request naming a base is answered
        without one (a server that ignores bases built the items sent alone): then send the
        request whole (:meth:`fallback`); and
        :class:`~context_engine_client.Internal` for a delta answering a whole request. A
        response without a ``build_id`` (the service kept nothing) leaves what is held as it
        was, and so does a session forgotten since ``tally``'s mark (:meth:`prepare`). The
        Build, with the earlier attempts ``tally`` holds, is added to :attr:`stats`."""
        r: Any = sent
        resp: Any = response
        if base is None and not r.keep_base:
            raise ValueError("absorb takes the request prepare or fallback returned (a whole "
                             "one asks to be kept), not the caller's")
        if base is not None and r.base_build_id != base.build_id:
            raise ValueError(f"the request sent names base {r.base_build_id!r}, not "
                             f"{base.build_id!r}: absorb takes what prepare returned with it")
        t = tally if tally is not None else Tally()
        sent_bytes = r.ByteSize()
        wire_bytes = resp.ByteSize()
        t.request_bytes += sent_bytes
        t.response_bytes += wire_bytes
        keep = bool(resp.build_id)
        answer: _Answer | None = None
        if resp.HasField("delta"):
            if base is None:  # a faulty answer, not one a resend would mend
                raise Internal("Build answered a whole request with a delta (relative to "
                               f"{resp.delta.base_build_id!r})")
            if resp.delta.base_build_id != base.build_id:
                raise DeltaMismatch(f"the response is relative to {resp.delta.base_build_id!r},"
                                    f" not to {base.build_id!r}")
            full, answer, full_bytes = _reconstruct(resp, base.held.answer, wire_bytes)
        else:
            if base is not None:  # a server that ignores base_build_id built the items sent
                raise DeltaMismatch("the server answered a Build naming a base without a "
                                    "delta: it built the items sent alone")
            full, full_bytes = resp, wire_bytes
            if keep:
                answer = _whole_answer(resp)
        held = None
        if base is not None:
            full_request_bytes = base.full_request_bytes
            if answer is not None and keep:
                kept, sizes = base.kept, base.held.item_bytes
                held = _Held(
                    build_id=resp.build_id, items=base.held.items[:kept] + base.new_items,
                    item_bytes=sizes[:kept + 1] + tuple(
                        accumulate(base.new_item_bytes, initial=sizes[kept]))[1:],
                    answer=answer)
        else:
            # the request as the caller gave it: without the keep_base flag the client added
            full_request_bytes = sent_bytes - (
                0 if t.keep_base else _varint_len(_number(r, "keep_base") << 3) + 1)
            if answer is not None and keep:
                # the items that were sent: the client's own copy (``_whole``), which the
                # caller never sees, so they are held as they are
                items = tuple(r.checkpoint.items)
                held = _Held(
                    build_id=resp.build_id, items=items,
                    item_bytes=tuple(accumulate(
                        _items_bytes(items, _number(r.checkpoint, "items")), initial=0)),
                    answer=answer)
        with self._lock:
            key = (r.tenant_id, r.session_id)
            if held is not None and self._forgotten_since(key, t.mark):
                held = None  # forgotten while in flight: the answer is the caller's only
            if held is not None:  # else the service kept nothing: what is held stays
                self._held[key] = held
                self._held.move_to_end(key)
                while len(self._held) > self.max_sessions:
                    self._held.popitem(last=False)
            c = self._counts
            c["builds"] += 1
            c["incremental"] += 1 if full is not resp else 0
            c["full_resends"] += t.full_resends
            c["request_bytes"] += t.request_bytes
            c["response_bytes"] += t.response_bytes
            c["full_request_bytes"] += full_request_bytes
            c["full_response_bytes"] += full_bytes
        return full  # type: ignore[no-any-return]

    # -------------------------------------------------------------------------- internals

    def _forgotten_since(self, key: tuple[str, str], mark: int | None) -> bool:
        """Whether the session was forgotten after ``mark`` (None: not known, so not); also
        true when more were forgotten since than are remembered. Under the lock."""
        if mark is None or self._forgets == mark:
            return False
        if self._cleared > mark or self._forgets - mark > FORGOTTEN_KEPT:
            return True
        return self._forgotten.get(key, 0) > mark

    def _whole(self, request: Any) -> Any:
        """A copy of the whole request that asks the service to keep it as a base."""
        wire = type(request)()
        wire.CopyFrom(request)
        wire.keep_base = True
        return wire


def _whole_answer(resp: Any) -> _Answer:
    """What to hold of a whole response (which goes to the caller as it is): copies."""
    req = type(resp.request)()
    req.CopyFrom(resp.request)
    messages = tuple(req.messages)
    number = _number(req, "messages")
    gem = resp.gemini_cached_content
    return _Answer(
        prefix_blocks=tuple(req.prefix_blocks), tools=tuple(req.tools),
        prefix_bytes=_prefix_bytes(req), messages=messages,
        message_bytes=tuple(_len_field(number, m.ByteSize()) for m in messages),
        texts=(resp.provider_body_json.encode(), gem.create_body_json.encode(),
               gem.cached_body_json.encode()))


def _prefix_bytes(req: Any) -> int:
    blocks, tools = _number(req, "prefix_blocks"), _number(req, "tools")
    return (sum(_len_field(blocks, b.ByteSize()) for b in req.prefix_blocks)
            + sum(_len_field(tools, t.ByteSize()) for t in req.tools))


def _splice(spans: Any, base: Any, new: Any, what: str) -> list[Any]:
    """The entries the spans take, in order, from ``base`` and from ``new`` (consumed whole)."""
    out: list[Any] = []
    pos = 0
    for span in spans:
        start, count, fresh = span.base_start, span.base_count, span.new_count
        if start + count > len(base) or pos + fresh > len(new):
            raise DeltaMismatch(f"a span of {what} is out of range ({start}+{count} of "
                                f"{len(base)} base, {pos}+{fresh} of {len(new)} sent)")
        out.append(base[start:start + count])
        out.append(new[pos:pos + fresh])
        pos += fresh
    if pos != len(new):
        raise DeltaMismatch(f"the spans of {what} leave {len(new) - pos} sent entries unread")
    return out


def _text(spans: Any, base: bytes, sent: str, what: str) -> tuple[str, bytes]:
    joined = b"".join(_splice(spans, base, sent.encode(), what))
    try:
        return joined.decode(), joined
    except UnicodeDecodeError as err:
        raise DeltaMismatch(f"{what} does not read back as UTF-8: {err}") from None


def _reconstruct(resp: Any, held: _Answer, wire_bytes: int) -> tuple[Any, _Answer, int]:
    """The full response from a delta, what to hold of it, and its serialized size (from the
    held sizes: serializing a large response again would cost what the delta saved)."""
    delta = resp.delta
    full = type(resp)()
    full.CopyFrom(resp)
    full.ClearField("delta")
    size = wire_bytes - _len_field(_number(resp, "delta"), delta.ByteSize())
    req_number = _number(resp, "request")
    had_request = resp.HasField("request")
    req = full.request
    req_bytes = req.ByteSize()
    if had_request:
        size -= _len_field(req_number, req_bytes)
    if delta.prefix_from_base:
        req_bytes += held.prefix_bytes - _prefix_bytes(req)
        req.ClearField("prefix_blocks")
        req.ClearField("tools")
        req.prefix_blocks.extend(held.prefix_blocks)
        req.tools.extend(held.tools)
        blocks, tools, prefix_bytes = held.prefix_blocks, held.tools, held.prefix_bytes
    else:
        blocks, tools = _copies(req.prefix_blocks), _copies(req.tools)
        prefix_bytes = _prefix_bytes(req)
    number = _number(req, "messages")
    sent_messages = _copies(resp.request.messages)
    sent_bytes = tuple(_len_field(number, m.ByteSize()) for m in sent_messages)
    if delta.message_spans:
        messages = tuple(chain.from_iterable(_splice(
            delta.message_spans, held.messages, sent_messages, "request.messages")))
        message_bytes = tuple(chain.from_iterable(_splice(
            delta.message_spans, held.message_bytes, sent_bytes, "request.messages")))
        req.ClearField("messages")
        req.messages.extend(messages)
        req_bytes += sum(message_bytes) - sum(sent_bytes)
    else:
        messages, message_bytes = sent_messages, sent_bytes
    if had_request or req_bytes:
        size += _len_field(req_number, req_bytes)

    body = resp.provider_body_json.encode()
    if delta.provider_body_spans:
        sent = len(body)
        full.provider_body_json, body = _text(delta.provider_body_spans, held.texts[0],
                                              resp.provider_body_json, "provider_body_json")
        body_number = _number(resp, "provider_body_json")
        size += _string_field(body_number, len(body)) - _string_field(body_number, sent)
    if len(body) != delta.provider_body_bytes:
        raise DeltaMismatch(f"provider_body_json reads back as {len(body)} bytes, not "
                            f"{delta.provider_body_bytes}")

    gem = resp.gemini_cached_content
    create, cached = gem.create_body_json.encode(), gem.cached_body_json.encode()
    if delta.gemini_create_body_spans or delta.gemini_cached_body_spans:
        gem_number = _number(resp, "gemini_cached_content")
        create_number = _number(gem, "create_body_json")
        cached_number = _number(gem, "cached_body_json")
        gem_bytes = gem.ByteSize()
        if resp.HasField("gemini_cached_content"):
            size -= _len_field(gem_number, gem_bytes)
        if delta.gemini_create_body_spans:
            sent = len(create)
            full.gemini_cached_content.create_body_json, create = _text(
                delta.gemini_create_body_spans, held.texts[1], gem.create_body_json,
                "gemini_cached_content.create_body_json")
            gem_bytes += _string_field(create_number, len(create)) - _string_field(
                create_number, sent)
        if delta.gemini_cached_body_spans:
            sent = len(cached)
            full.gemini_cached_content.cached_body_json, cached = _text(
                delta.gemini_cached_body_spans, held.texts[2], gem.cached_body_json,
                "gemini_cached_content.cached_body_json")
            gem_bytes += _string_field(cached_number, len(cached)) - _string_field(
                cached_number, sent)
        size += _len_field(gem_number, gem_bytes)

    if size != delta.full_response_bytes:
        raise DeltaMismatch(f"the response reads back as {size} bytes, not "
                            f"{delta.full_response_bytes}")
    return full, _Answer(prefix_blocks=blocks, tools=tools, prefix_bytes=prefix_bytes,
                         messages=messages, message_bytes=message_bytes,
                         texts=(body, create, cached)), size
