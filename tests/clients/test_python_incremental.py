"""Incremental Build in the Python client (context_engine_client._incremental): the request it
sends (only the items after the common prefix with the last Build, the caller's request never
changed, an item changed in place noticed), the full response it reads back from a delta built
by hand here (message spans over the base, UTF-8 byte spans, the prefix taken from the base,
the sizes checked), and, against real servers, that every Build it answers equals a whole
Build of the same request, with BUILD_BASE_UNKNOWN from another replica answered by one whole
resend."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from typing import Any

import grpc
import pytest
from context_engine.v1 import context_engine_pb2 as spb
from context_engine.v1 import context_engine_pb2_grpc as pb_grpc
from context_engine_client import (
    AsyncClient,
    BuildStats,
    Client,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    ResourceExhausted,
    pb,
)
from context_engine_client._channel import service_config_text, time_left
from context_engine_client._incremental import (
    BASE_UNKNOWN,
    DeltaMismatch,
    IncrementalBuilds,
    Tally,
    base_unknown,
)
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from tests.conftest import ServerThread
from tests.conftest import test_config as base_config

MODEL = "claude-sonnet-4-5"

# ------------------------------------------------------------------------------ hand-built deltas

Span = tuple[int, int, int]  # base_start, base_count, new_count


def _take(spans: Sequence[Span], base: Sequence[Any], full: Sequence[Any]) -> list[Any]:
    """What a response relative to ``base`` sends of ``full`` for these spans (each span's base
    part must be what ``full`` holds there)."""
    sent: list[Any] = []
    q = 0
    for start, count, fresh in spans:
        assert list(full[q:q + count]) == list(base[start:start + count]), "not the base's"
        q += count
        sent.extend(full[q:q + fresh])
        q += fresh
    assert q == len(full), "the spans do not cover the full response"
    return sent


def delta_of(base: pb.BuildResponse, full: pb.BuildResponse, *,
             message_spans: Sequence[Span] = (), body_spans: Sequence[Span] = (),
             create_spans: Sequence[Span] = (), cached_spans: Sequence[Span] = (),
             prefix_from_base: bool = False) -> pb.BuildResponse:
    """The response relative to ``base`` that reads back as ``full`` (its build_id included),
    as the protocol says the service sends it."""
    wire = pb.BuildResponse()
    wire.CopyFrom(full)
    d = wire.delta
    d.base_build_id = base.build_id
    d.full_response_bytes = full.ByteSize()
    d.provider_body_bytes = len(full.provider_body_json.encode())
    if prefix_from_base:
        assert full.request.prefix_blocks == base.request.prefix_blocks
        assert full.request.tools == base.request.tools
        d.prefix_from_base = True
        wire.request.ClearField("prefix_blocks")
        wire.request.ClearField("tools")
    if message_spans:
        sent = _take(message_spans, base.request.messages, full.request.messages)
        wire.request.ClearField("messages")
        wire.request.messages.extend(sent)
        d.message_spans.extend(pb.Span(base_start=s, base_count=c, new_count=n)
                               for s, c, n in message_spans)
    for spans, field, get in (
            (body_spans, d.provider_body_spans, lambda r: r.provider_body_json),
            (create_spans, d.gemini_create_body_spans,
             lambda r: r.gemini_cached_content.create_body_json),
            (cached_spans, d.gemini_cached_body_spans,
             lambda r: r.gemini_cached_content.cached_body_json)):
        if not spans:
            continue
        sent_bytes = bytes(_take(spans, get(base).encode(), get(full).encode()))
        text = sent_bytes.decode()
        if field is d.provider_body_spans:
            wire.provider_body_json = text
        elif field is d.gemini_create_body_spans:
            wire.gemini_cached_content.create_body_json = text
        else:
            wire.gemini_cached_content.cached_body_json = text
        field.extend(pb.Span(base_start=s, base_count=c, new_count=n) for s, c, n in spans)
    return wire


def item(n: int, text: str | None = None) -> pb.ConversationItem:
    return pb.ConversationItem(id=f"i{n}", sequence=n, run_id="run-1", trust=pb.TRUST_LEVEL_USER,
                               user=pb.UserMessage(text=text or f"message {n} " * 5))


def request(items: Sequence[pb.ConversationItem], *, tenant: str = "t", session: str = "s",
            ) -> pb.BuildRequest:
    return pb.BuildRequest(
        tenant_id=tenant, session_id=session, epoch=2, estimator_factor=1.0,
        provider_format=pb.PROVIDER_FORMAT_ANTHROPIC_MESSAGES,
        checkpoint=pb.Checkpoint(
            active_run_id="run-1", items=items,
            working_state=pb.WorkingState(objective="Compare", constraints=["Cite"]),
            runtime=pb.RuntimeMetadata(current_date="2026-11-29")))


def message(n: int, text: str = "") -> pb.Message:
    return pb.Message(row=10, role=pb.ROLE_USER, trust=pb.TRUST_LEVEL_USER, item_id=f"i{n}",
                      text=text or f"message {n} " * 5)


def response(build_id: str, messages: Sequence[pb.Message], body: str = "",
             gemini: tuple[str, str] | None = None) -> pb.BuildResponse:
    r = pb.BuildResponse(
        build_id=build_id, prefix_sha256="ab" * 32, epoch=2, model_id=MODEL, body_tokens=99,
        request=pb.ModelRequest(
            prefix_blocks=[pb.PrefixBlock(row=1, trust=pb.TRUST_LEVEL_TRUSTED_CONFIGURATION,
                                          text="You research questions. " * 20)],
            tools=[pb.ToolDefinition(name="web.fetch", description="Fetch a page.",
                                     input_schema_json='{"type":"object"}')],
            messages=messages),
        provider_body_json=body)
    if gemini is not None:
        r.gemini_cached_content.display_name = "ce-x-e2"
        r.gemini_cached_content.create_body_json, r.gemini_cached_content.cached_body_json = gemini
    return r


def held(builds: IncrementalBuilds, req: pb.BuildRequest, resp: pb.BuildResponse
         ) -> pb.BuildResponse:
    """Builds holds ``resp`` as the answer to ``req`` (a whole Build)."""
    wire, base = builds.prepare(req)
    assert base is None and serialized(wire) == serialized(keeping(req))
    return builds.absorb(wire, resp, base)


def relative(base: Any, full: pb.BuildResponse) -> pb.BuildResponse:
    """``full`` as the answer to a Build naming ``base`` (what prepare returned): a delta that
    sends everything whole."""
    return delta_of(pb.BuildResponse(build_id=base.build_id), full)


def keeping(req: pb.BuildRequest) -> pb.BuildRequest:
    """The whole request, asking the service to keep it as a base."""
    out = pb.BuildRequest()
    out.CopyFrom(req)
    out.keep_base = True
    return out


def serialized(m: Any) -> bytes:
    return bytes(m.SerializeToString(deterministic=True))


# ------------------------------------------------------------------------------ reconstruction

def test_message_spans_read_back_the_full_response_skipping_base_messages():
    builds = IncrementalBuilds()
    base_req = request([item(n) for n in range(6)])
    base = response("b1", [message(n) for n in range(6)])
    held(builds, base_req, base)
    # the first two base messages are gone (history cut), one replaced, two new ones
    full = response("b2", [message(2), message(3), message(4), message(90, "new"),
                           message(5), message(91, "new too")])
    spans = [(2, 3, 1), (5, 1, 1)]
    next_req = request([item(n) for n in range(8)])
    wire_req, b = builds.prepare(next_req)
    assert b is not None and wire_req.base_build_id == "b1"
    wire = delta_of(base, full, message_spans=spans)
    assert [m.item_id for m in wire.request.messages] == ["i90", "i91"]
    got = builds.absorb(wire_req, wire, b)
    assert not got.HasField("delta") and got.build_id == "b2"
    assert serialized(got) == serialized(full)
    s = builds.stats
    assert (s.builds, s.incremental, s.full_resends) == (2, 1, 0)
    assert s.full_response_bytes == base.ByteSize() + full.ByteSize()
    assert s.response_bytes == base.ByteSize() + wire.ByteSize()
    assert s.bytes_saved > 0


def test_a_span_may_take_base_messages_in_any_order_and_more_than_once():
    builds = IncrementalBuilds()
    base = response("b1", [message(n) for n in range(4)])
    held(builds, request([item(0)]), base)
    full = response("b2", [message(3), message(0), message(1), message(3), message(9, "x")])
    wire = delta_of(base, full, message_spans=[(3, 1, 0), (0, 2, 0), (3, 1, 1)])
    sent, b = builds.prepare(request([item(0), item(1)]))
    assert serialized(builds.absorb(sent, wire, b)) == serialized(full)


def test_text_spans_count_utf8_bytes_with_multibyte_characters_at_the_edges():
    builds = IncrementalBuilds()
    base_body = '{"system":"héllo wörld","messages":["ünïcödé 🙂","€ sign"]}'
    body = '{"system":"héllo wörld","messages":["ünïcödé 🙂","new 🙃 ñ","€ sign"]}'
    create = '{"displayName":"ce-ü","contents":["🙂"]}'
    cached = '{"cachedContent":"x","contents":["ç","ß"]}'
    base = response("b1", [message(0)], base_body, gemini=(create, cached))
    held(builds, request([item(0)]), base)
    full = response("b2", [message(0)], body, gemini=(create, cached + " ∑"))
    raw_base, raw_full = base_body.encode(), body.encode()
    cut = raw_base.index("🙂".encode()) + 6  # after '🙂",' : a 4-byte character just before
    assert raw_full[:cut] == raw_base[:cut]
    inserted = len('"new 🙃 ñ",'.encode())  # ends with a 2-byte character and a comma
    rest = len(raw_base) - cut
    assert len(raw_base[:cut].decode()) < cut  # characters are not bytes here
    cached_len = len(cached.encode())
    wire = delta_of(base, full, body_spans=[(0, cut, inserted), (cut, rest, 0)],
                    create_spans=[(0, len(create.encode()), 0)],
                    cached_spans=[(0, cached_len, len(" ∑".encode()))])
    assert wire.provider_body_json == '"new 🙃 ñ",'
    assert wire.gemini_cached_content.create_body_json == ""
    sent, b = builds.prepare(request([item(0), item(1)]))
    got = builds.absorb(sent, wire, b)
    assert got.provider_body_json == body
    assert got.gemini_cached_content.create_body_json == create
    assert got.gemini_cached_content.cached_body_json == cached + " ∑"
    assert serialized(got) == serialized(full)


def test_the_prefix_comes_from_the_base():
    builds = IncrementalBuilds()
    base = response("b1", [message(0)])
    held(builds, request([item(0)]), base)
    full = response("b2", [message(0), message(1)])
    wire = delta_of(base, full, prefix_from_base=True, message_spans=[(0, 1, 1)])
    assert not wire.request.prefix_blocks and not wire.request.tools
    sent, b = builds.prepare(request([item(0), item(1)]))
    got = builds.absorb(sent, wire, b)
    assert got.request.prefix_blocks == base.request.prefix_blocks
    assert got.request.tools == base.request.tools
    assert serialized(got) == serialized(full)


def test_a_delta_without_spans_is_sent_whole_and_a_chain_of_deltas_reads_back():
    builds = IncrementalBuilds()
    prev = response("b0", [message(0)], '{"m":[0]}')
    held(builds, request([item(0)]), prev)
    for n in range(1, 6):
        full = response(f"b{n}", [message(k) for k in range(n + 1)],
                        '{"m":[' + ",".join(str(k) for k in range(n + 1)) + "]}")
        if n % 2:
            wire = delta_of(prev, full, prefix_from_base=True, message_spans=[(0, n, 1)],
                            body_spans=[(0, len(prev.provider_body_json) - 2, 4), (0, 0, 0)])
            # the base's body up to before "]}", then ",N]}"
            assert wire.provider_body_json == f",{n}]}}"
        else:  # messages and body whole, only the prefix from the base
            wire = delta_of(prev, full, prefix_from_base=True)
        req = request([item(k) for k in range(n + 1)])
        sent, b = builds.prepare(req)
        got = builds.absorb(sent, wire, b)
        assert serialized(got) == serialized(full)
        prev = full
    assert builds.stats.incremental == 5


def test_the_response_handed_back_is_the_callers_own():
    builds = IncrementalBuilds()
    base = response("b1", [message(0), message(1)], "body")
    sent = pb.BuildResponse()
    sent.CopyFrom(base)
    got_base = held(builds, request([item(0)]), sent)
    assert got_base is sent  # a whole response is handed back as it came
    got_base.request.messages[0].text = "changed by the caller"
    got_base.request.prefix_blocks[0].text = "changed too"
    full = response("b2", [message(0), message(1), message(2)], "body")
    wire = delta_of(base, full, prefix_from_base=True, message_spans=[(0, 2, 1)],
                    body_spans=[(0, 4, 0)])
    sent, b = builds.prepare(request([item(0), item(1)]))
    got = builds.absorb(sent, wire, b)
    assert serialized(got) == serialized(full)


def _mismatch(wire_change: Any, *, base_id: str = "b1") -> None:
    builds = IncrementalBuilds()
    base = response(base_id, [message(0), message(1)], "héllo")
    held(builds, request([item(0)]), base)
    full = response("b2", [message(0), message(1), message(2)], "héllo!")
    wire = delta_of(base, full, message_spans=[(0, 2, 1)], body_spans=[(0, 6, 1)])
    wire_change(wire)
    sent, b = builds.prepare(request([item(0), item(1)]))
    before = len(builds), builds.stats
    with pytest.raises(DeltaMismatch):
        builds.absorb(sent, wire, b)
    assert (len(builds), builds.stats) == before  # nothing held, nothing counted


@pytest.mark.parametrize("change", [
    "other base", "base span out of range", "sent messages left unread", "too few sent",
    "full size", "body size", "body not utf-8"])
def test_a_delta_that_does_not_read_back_is_refused(change: str):
    def apply(w: pb.BuildResponse) -> None:
        d = w.delta
        if change == "other base":
            d.base_build_id = "b0"
        elif change == "base span out of range":
            d.message_spans[0].base_start = 1
        elif change == "sent messages left unread":
            w.request.messages.add().CopyFrom(message(7))
        elif change == "too few sent":
            del w.request.messages[:]
        elif change == "full size":
            d.full_response_bytes += 1
        elif change == "body size":
            d.provider_body_bytes -= 1
        else:  # cuts "é" (2 bytes) in half
            d.provider_body_spans[0].base_count = 2
            d.provider_body_spans.add(base_start=3, base_count=3, new_count=0)
    _mismatch(apply)


def test_a_build_naming_a_base_answered_without_a_delta_is_refused():
    """A server that ignores base_build_id builds the items sent alone and answers whole: that
    answer is not the Build's, and is refused (the client then sends the Build whole)."""
    def apply(w: pb.BuildResponse) -> None:
        w.ClearField("delta")
    _mismatch(apply)


def test_a_delta_with_nothing_held_is_refused():
    builds = IncrementalBuilds()
    wire = response("b2", [message(0)])
    wire.delta.base_build_id = "b1"
    with pytest.raises(Internal, match="whole request with a delta"):
        builds.absorb(keeping(request([item(0)])), wire, None)
    assert builds.stats == BuildStats() and len(builds) == 0


# ------------------------------------------------------------------------------ prepare

def whole(wire: pb.BuildRequest, kept: Sequence[pb.ConversationItem]) -> pb.BuildRequest:
    """The Build the server serves for ``wire``: the base's first items and the sent ones."""
    out = pb.BuildRequest()
    out.CopyFrom(wire)
    out.ClearField("base_build_id")
    out.ClearField("base_items_kept")
    del out.checkpoint.items[:]
    out.checkpoint.items.extend(list(kept) + list(wire.checkpoint.items))
    return out


def test_nothing_held_sends_the_whole_request_asking_to_keep_it():
    builds = IncrementalBuilds()
    req = request([item(0)])
    before = serialized(req)
    wire, base = builds.prepare(req)
    assert base is None and wire is not req and wire.keep_base and not req.keep_base
    assert serialized(wire) == serialized(keeping(req)) and serialized(req) == before
    assert builds.stats.request_bytes == 0  # counted when the Build returns
    builds.absorb(wire, response("b1", [message(0)]), None)
    s = builds.stats
    assert (s.builds, s.request_bytes, s.full_request_bytes) == (
        1, wire.ByteSize(), req.ByteSize())


def test_a_response_the_service_did_not_keep_leaves_what_is_held():
    """A service that predates keep_base answers without a build_id: nothing to base on."""
    builds = IncrementalBuilds()
    req = request([item(0)])
    got = held(builds, req, response("", [message(0)]))
    assert got.build_id == "" and len(builds) == 0 and builds.stats.builds == 1
    held(builds, req, response("b1", [message(0)]))
    sent, base = builds.prepare(req)
    assert base is not None
    # kept nothing (a replica whose cache cannot hold it): b1 is still the base
    builds.absorb(sent, relative(base, response("", [message(0)])), base)
    assert builds.prepare(req)[0].base_build_id == "b1"
    # a server that predates bases answers a Build naming one whole: refused, b1 still held
    sent, base = builds.prepare(req)
    with pytest.raises(DeltaMismatch, match="without a delta"):
        builds.absorb(sent, response("", [message(0)]), base)
    assert builds.prepare(req)[0].base_build_id == "b1"


def three_held_five_asked() -> tuple[IncrementalBuilds, pb.BuildRequest, pb.BuildRequest]:
    """A client that holds a Build of items 0-2 of a session, and a request of items 0-4."""
    builds = IncrementalBuilds()
    first = request([item(n) for n in range(3)])
    held(builds, first, response("b1", [message(0)]))
    return builds, first, request([item(n) for n in range(5)])


def test_appended_items_are_sent_alone_and_the_rest_of_the_request_whole():
    builds, first, req = three_held_five_asked()
    before = serialized(req)
    wire, base = builds.prepare(req)
    assert base is not None and base.kept == 3
    assert (wire.base_build_id, wire.base_items_kept) == ("b1", 3)
    assert [i.id for i in wire.checkpoint.items] == ["i3", "i4"]
    assert serialized(whole(wire, first.checkpoint.items[:3])) == before
    assert serialized(req) == before and not req.base_build_id  # the caller's is unchanged
    assert req.HasField("estimator_factor") and wire.HasField("estimator_factor")
    assert builds.stats.request_bytes == keeping(first).ByteSize()  # this one not yet
    assert not wire.keep_base  # a Build naming a base is kept anyway
    builds.absorb(wire, relative(base, response("b2", [message(0)])), base)
    assert builds.stats.request_bytes == keeping(first).ByteSize() + wire.ByteSize()
    assert builds.stats.full_request_bytes == first.ByteSize() + req.ByteSize()


def test_items_replaced_from_a_position_are_sent_from_there():
    builds = IncrementalBuilds()
    first = request([item(n) for n in range(5)])
    held(builds, first, response("b1", [message(0)]))
    req = request([item(0), item(1), item(70, "a summary took their place"), item(5)])
    wire, base = builds.prepare(req)
    assert base is not None and wire.base_items_kept == 2
    assert [i.id for i in wire.checkpoint.items] == ["i70", "i5"]
    assert serialized(whole(wire, first.checkpoint.items[:2])) == serialized(req)
    # fewer items than held, all of them a prefix: nothing sent, the first two kept
    wire, base = builds.prepare(request([item(0), item(1)]))
    assert wire.base_items_kept == 2 and not wire.checkpoint.items


def test_an_item_the_caller_changed_in_place_is_sent_again():
    """The held items are copies: the caller's own message, changed after it was sent and sent
    again in the same list, differs from what the base holds."""
    builds = IncrementalBuilds()
    req = request([item(n) for n in range(4)])
    held(builds, req, response("b1", [message(0)]))
    req.checkpoint.items[1].user.text = "edited after it was sent"
    req.checkpoint.items.append(item(4))
    wire, base = builds.prepare(req)
    assert base is not None and wire.base_items_kept == 1
    assert [i.id for i in wire.checkpoint.items] == ["i1", "i2", "i3", "i4"]
    assert wire.checkpoint.items[0].user.text == "edited after it was sent"
    # and once absorbed, the held copy is the edited one
    builds.absorb(wire, relative(base, response("b2", [message(0)])), base)
    req.checkpoint.items.append(item(5))
    wire, base = builds.prepare(req)
    assert wire.base_items_kept == 5 and [i.id for i in wire.checkpoint.items] == ["i5"]
    # an item first sent relative to a base (copied then), changed in place afterwards
    builds.absorb(wire, relative(base, response("b3", [message(0)])), base)
    req.checkpoint.items[5].user.text = "edited too"
    wire, base = builds.prepare(req)
    assert wire.base_items_kept == 5 and wire.checkpoint.items[0].user.text == "edited too"


def test_a_request_without_a_checkpoint_or_of_another_session():
    builds = IncrementalBuilds()
    bare = pb.BuildRequest(tenant_id="t", session_id="s")
    held(builds, bare, response("b1", []))
    wire, base = builds.prepare(bare)
    assert base is not None and not wire.HasField("checkpoint") and wire.base_build_id == "b1"
    other, base = builds.prepare(pb.BuildRequest(tenant_id="t", session_id="s2"))
    assert base is None and not other.base_build_id
    with pytest.raises(ValueError, match="names a base"):
        builds.prepare(wire)


def test_sessions_are_bounded_least_recently_used_first():
    builds = IncrementalBuilds(max_sessions=2)
    for s in ("a", "b", "c"):
        held(builds, request([item(0)], session=s), response(f"b-{s}", []))
    assert len(builds) == 2
    assert builds.prepare(request([item(0)], session="a"))[1] is None
    assert builds.prepare(request([item(0)], session="b"))[1] is not None
    held(builds, request([item(0)], session="d"), response("b-d", []))  # "c" is older now
    assert builds.prepare(request([item(0)], session="c"))[1] is None
    assert builds.prepare(request([item(0)], session="b"))[1] is not None
    builds.forget("t", "b")
    assert builds.prepare(request([item(0)], session="b"))[1] is None
    with pytest.raises(ValueError):
        IncrementalBuilds(max_sessions=0)


@pytest.mark.parametrize("between", ["forget", "clear", "forget another"])
def test_a_session_forgotten_while_a_build_is_in_flight_is_not_held_again(between: str):
    """A session forgotten (deleted, or by the caller) while Builds of it are in flight: their
    answers go to their callers, and none is held again (the next Build of a session of that
    id, a new one after a delete, would name a base of the deleted one). A Build prepared
    after the forget holds its answer; a resend after BUILD_BASE_UNKNOWN is no forget."""
    builds = IncrementalBuilds()
    held(builds, request([item(0)]), response("b1", [message(0)]))
    delta_tally, whole_tally = Tally(), Tally()
    wire, base = builds.prepare(request([item(0), item(1)]), delta_tally)
    assert base is not None
    # a whole Build of another session, in flight as well
    whole, none = builds.prepare(request([item(0)], session="s2"), whole_tally)
    assert none is None
    if between == "forget":
        builds.forget("t", "s")
        builds.forget("t", "s2")
    elif between == "clear":
        builds.clear()
    else:
        builds.forget("t", "elsewhere")
    answer = response("b2", [message(0), message(1)])
    assert builds.absorb(wire, relative(base, answer), base, delta_tally) == answer
    builds.absorb(whole, response("b3", []), None, whole_tally)
    named = [builds.prepare(request([item(0), item(1)]))[0].base_build_id,
             builds.prepare(request([item(0)], session="s2"))[0].base_build_id]
    assert named == (["", ""] if between != "forget another" else ["b2", "b3"])
    assert builds.stats.builds == 3  # answered and counted all the same
    # prepared after the forget: held
    builds.forget("t", "s")
    after = Tally()
    again, _ = builds.prepare(request([item(0)]), after)
    builds.absorb(again, response("b4", []), None, after)
    assert builds.prepare(request([item(0)]))[0].base_build_id == "b4"
    # a resend whole after BUILD_BASE_UNKNOWN drops the base without forgetting the session
    resend_tally = Tally()
    wire, base = builds.prepare(request([item(0), item(1)]), resend_tally)
    assert base is not None
    resend_tally.refused(wire)
    resent = builds.fallback(wire, base, resend_tally)
    builds.absorb(resent, response("b5", []), None, resend_tally)
    assert builds.prepare(request([item(0), item(1)]))[0].base_build_id == "b5"
    # ... and one forgotten during its first attempt is not held after the resend either
    late = Tally()
    wire, base = builds.prepare(request([item(0), item(1)]), late)
    assert base is not None
    builds.forget("t", "s")
    late.refused(wire)
    resent = builds.fallback(wire, base, late)
    builds.absorb(resent, response("b6", []), None, late)
    assert builds.prepare(request([item(0), item(1)]))[0].base_build_id == ""


def test_fallback_forgets_and_counts_a_whole_resend():
    """A Build refused for its base and sent again whole counts both requests, the whole one's
    answer, and one resend, once it returns."""
    builds = IncrementalBuilds()
    first = request([item(0)])
    held(builds, first, response("b1", []))
    req = request([item(0), item(1)])
    tally = Tally()
    wire, base = builds.prepare(req)
    assert base is not None
    tally.refused(wire)
    again = builds.fallback(wire, base, tally)
    assert serialized(again) == serialized(keeping(req))
    assert builds.prepare(req)[1] is None
    before = builds.stats
    assert before.full_resends == 0 and before.builds == 1  # not returned yet
    answer = response("b2", [message(0)])
    builds.absorb(again, answer, None, tally)
    s = builds.stats
    assert (s.builds, s.full_resends, s.incremental) == (2, 1, 0)
    assert s.request_bytes == (keeping(first).ByteSize() + wire.ByteSize()
                               + keeping(req).ByteSize())
    assert s.response_bytes - before.response_bytes == answer.ByteSize()
    assert s.full_response_bytes - before.full_response_bytes == answer.ByteSize()
    assert s.full_request_bytes == first.ByteSize() + req.ByteSize()
    assert BuildStats(full_request_bytes=10, full_response_bytes=5, request_bytes=3,
                      response_bytes=4).bytes_saved == 8


def test_a_delta_that_did_not_read_back_is_counted_with_the_build_that_returns():
    """The bytes of a delta that did not read back went on the wire: the Build that is then
    sent whole and returns counts them; a Build that never returns counts nothing."""
    builds = IncrementalBuilds()
    first = request([item(0)])
    base = response("b1", [message(0)])
    held(builds, first, base)
    req = request([item(0), item(1)])
    bad = delta_of(base, response("b2", [message(0), message(1)]), message_spans=[(0, 1, 1)])
    bad.delta.full_response_bytes += 1
    tally = Tally()
    wire, b = builds.prepare(req)
    with pytest.raises(DeltaMismatch):
        builds.absorb(wire, bad, b, tally)
    assert (tally.request_bytes, tally.response_bytes) == (wire.ByteSize(), bad.ByteSize())
    before = builds.stats
    again = builds.fallback(wire, b, tally)
    whole_answer = response("b3", [message(0), message(1)])
    builds.absorb(again, whole_answer, None, tally)
    s = builds.stats
    assert s.builds == before.builds + 1 and s.full_resends == 1
    assert s.request_bytes - before.request_bytes == wire.ByteSize() + again.ByteSize()
    assert s.response_bytes - before.response_bytes == bad.ByteSize() + whole_answer.ByteSize()
    # a Build whose resend fails: nothing of it is counted
    failing = Tally()
    wire, b = builds.prepare(request([item(0), item(1), item(2)]))
    assert b is not None
    failing.refused(wire)
    builds.fallback(wire, b, failing)
    assert builds.stats == s


def test_a_whole_build_holds_the_items_it_sent_not_the_callers_changed_in_flight():
    """What the client holds of a whole Build is what went on the wire: the caller's item,
    changed while the Build was in flight, is sent again on the next Build (the service's
    base holds the item as it was sent)."""
    builds = IncrementalBuilds()
    req = request([item(n) for n in range(3)])
    wire, base = builds.prepare(req)
    req.checkpoint.items[1].user.text = "changed while the Build was in flight"
    builds.absorb(wire, response("b1", [message(0)]), base)
    again, base = builds.prepare(req)
    assert base is not None and again.base_items_kept == 1
    assert [i.user.text for i in again.checkpoint.items] == [
        "changed while the Build was in flight", item(2).user.text]


def test_absorb_takes_the_request_that_was_sent():
    builds = IncrementalBuilds()
    req = request([item(0)])
    wire, base = builds.prepare(req)
    with pytest.raises(ValueError, match="not the caller's"):
        builds.absorb(req, response("b1", []), base)
    builds.absorb(wire, response("b1", []), base)
    wire, base = builds.prepare(request([item(0), item(1)]))
    other = pb.BuildRequest()
    other.CopyFrom(wire)
    other.base_build_id = "b0"
    with pytest.raises(ValueError, match="names base"):
        builds.absorb(other, response("b2", []), base)


def test_the_core_takes_the_services_own_generated_classes():
    builds = IncrementalBuilds()
    items = [spb.ConversationItem(id=f"i{n}", user=spb.UserMessage(text="x")) for n in range(3)]
    req = spb.BuildRequest(tenant_id="t", session_id="s", checkpoint=spb.Checkpoint(items=items))
    held(builds, req, spb.BuildResponse(build_id="b1"))
    req.checkpoint.items.add(id="i3")
    wire, base = builds.prepare(req)
    assert base is not None and type(wire) is spb.BuildRequest and wire.base_items_kept == 3


def test_base_unknown_reads_the_error_info():
    assert base_unknown(FailedPrecondition("x", reason=BASE_UNKNOWN))
    assert not base_unknown(FailedPrecondition("x", reason="BUDGET_EXCEEDED"))
    assert not base_unknown(InvalidArgument("x", reason=BASE_UNKNOWN))
    assert not base_unknown(ValueError())


# ------------------------------------------------------------------------------ real servers

TOOL_SCHEMA = '{"type":"object","properties":{"url":{"type":"string"}}}'
# every few steps another format, so each kind of body (and Gemini's cached content) is read
# back from spans over the last Build's, whichever format that was
FORMATS = [pb.PROVIDER_FORMAT_UNSPECIFIED] * 4 + [
    pb.PROVIDER_FORMAT_GEMINI_GENERATE_CONTENT, pb.PROVIDER_FORMAT_GEMINI_GENERATE_CONTENT,
    pb.PROVIDER_FORMAT_OPENAI_RESPONSES, pb.PROVIDER_FORMAT_NONE,
    pb.PROVIDER_FORMAT_OPENAI_CHAT_COMPLETIONS]


@pytest.fixture(scope="module")
def replica(database_url: str) -> Iterator[ServerThread]:
    server = ServerThread(base_config(), database_url)
    yield server
    server.stop()


@pytest.fixture
def session() -> tuple[str, str]:
    return f"tenant-{uuid.uuid4().hex[:12]}", f"session-{uuid.uuid4().hex[:12]}"


def plan(tenant: str, session_id: str) -> pb.PlanRequest:
    return pb.PlanRequest(
        tenant_id=tenant, session_id=session_id,
        agent=pb.AgentSpec(agent_id="researcher", version="1", enabled_tools=["web.fetch"],
                           instructions="You research questions and cite your sources."),
        tool_catalog=[pb.ToolSpec(name="web.fetch", description="Fetch a web page.",
                                  input_schema_json=TOOL_SCHEMA,
                                  side_effect=pb.SIDE_EFFECT_NETWORK_READ)],
        model=pb.ModelSpec(model_id=MODEL),
        session=pb.SessionSpec(kind=pb.SESSION_KIND_INTERACTIVE))


def step(n: int) -> list[pb.ConversationItem]:
    """The items step n of a session appends: a user turn, a tool round (call and its
    untrusted result) or an answer, in turn, with multi-byte text."""
    s = 10 * n
    if n % 3 == 0:
        return [pb.ConversationItem(id=f"u{n}", sequence=s, run_id="run-1",
                                    trust=pb.TRUST_LEVEL_USER,
                                    user=pb.UserMessage(text=f"Question {n}: and then? ✓"))]
    if n % 3 == 1:
        return [
            pb.ConversationItem(id=f"c{n}", sequence=s, run_id="run-1",
                                trust=pb.TRUST_LEVEL_USER, tool_calls=pb.ToolCalls(calls=[
                                    pb.ToolCall(call_id=f"call-{n}", name="web.fetch",
                                                arguments_json=f'{{"url":"https://x/{n}"}}')])),
            pb.ConversationItem(id=f"r{n}", sequence=s + 1, run_id="run-1",
                                trust=pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED,
                                tool_result=pb.ToolResult(
                                    call_id=f"call-{n}", tool_name="web.fetch", event_id=s + 1,
                                    content=f"page {n} ünïcødé 日本語 " + "lorem ipsum " * 30)),
        ]
    return [pb.ConversationItem(id=f"a{n}", sequence=s, run_id="run-1",
                                trust=pb.TRUST_LEVEL_USER,
                                assistant=pb.AssistantMessage(text=f"Noted page {n}. ✓"))]


def build_request(tenant: str, session_id: str, n: int = 0) -> pb.BuildRequest:
    return pb.BuildRequest(
        tenant_id=tenant, session_id=session_id, estimator_factor=1.0,
        checkpoint=pb.Checkpoint(active_run_id="run-1", items=[i for k in range(n + 1)
                                                                for i in step(k)],
                                 runtime=pb.RuntimeMetadata(current_date="2026-11-29")))


def without_build_id(resp: pb.BuildResponse) -> bytes:
    out = pb.BuildResponse()
    out.CopyFrom(resp)
    out.ClearField("build_id")
    return serialized(out)


def check_same(got: pb.BuildResponse, stub: Any, req: pb.BuildRequest, what: str) -> int:
    """``got`` is whole and equals the answer to a whole Build of ``req`` (no base, not kept),
    apart from build_id. Returns the sizes of ``req`` and ``got``."""
    want = stub.Build(req, timeout=30)
    assert not want.build_id  # a whole Build that asked nothing kept
    assert got.build_id and not got.HasField("delta"), what
    assert without_build_id(got) == without_build_id(want), f"{what}: not the whole Build's"
    return int(req.ByteSize() + got.ByteSize())


@pytest.mark.integration
def test_a_session_of_thirty_steps_reads_back_every_whole_build(server, session):
    tenant, sid = session
    channel = grpc.insecure_channel(server.address)
    stub = pb_grpc.ContextEngineStub(channel)
    with Client(target=server.address) as engine:
        engine.plan(request=plan(tenant, sid))
        req = build_request(tenant, sid)
        whole_bytes = check_same(engine.build(request=req), stub, req, "step 0")
        for n in range(1, 31):
            # the runtime's own request object, changed in place step after step
            req.checkpoint.items.extend(step(n))
            req.provider_format = FORMATS[n % len(FORMATS)]  # type: ignore[assignment]
            if n == 12:  # a correction of an earlier item, in place: sent again from there
                req.checkpoint.items[2].tool_result.content = "corrected ✓ " * 10
            if n == 20:  # the last items replaced: base_items_kept goes back
                last = req.checkpoint.items.pop()
                last.assistant.text = "Rewritten answer ✓"
                req.checkpoint.items.append(last)
            whole_bytes += check_same(engine.build(request=req), stub, req, f"step {n}")
        stats = engine.build_stats
    channel.close()
    assert (stats.builds, stats.incremental, stats.full_resends) == (31, 30, 0)
    # the whole sizes are counted from the held sizes, without serializing: exactly
    assert stats.full_request_bytes + stats.full_response_bytes == whole_bytes
    # the requests sent a step's items, not the conversation; the responses its new messages
    assert stats.request_bytes * 4 < stats.full_request_bytes
    assert stats.response_bytes * 2 < stats.full_response_bytes
    assert stats.bytes_saved > 0


@pytest.mark.integration
def test_the_async_client_reads_back_the_same(server, session):
    tenant, sid = session
    channel = grpc.insecure_channel(server.address)
    stub = pb_grpc.ContextEngineStub(channel)
    got: list[tuple[pb.BuildRequest, pb.BuildResponse]] = []

    async def scenario() -> BuildStats:
        async with AsyncClient(target=server.address) as engine:
            await engine.plan(request=plan(tenant, sid))
            for n in range(8):
                req = build_request(tenant, sid, n)
                req.provider_format = FORMATS[(n + 4) % len(FORMATS)]  # type: ignore[assignment]
                got.append((req, await engine.build(request=req)))
            return engine.build_stats

    stats = asyncio.run(scenario())
    for n, (req, resp) in enumerate(got):
        check_same(resp, stub, req, f"step {n}")
    channel.close()
    assert (stats.builds, stats.incremental, stats.full_resends) == (8, 7, 0)


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["sync", "asyncio"])
def test_a_replica_that_does_not_hold_the_base_gets_the_whole_build_once(
        database_url, replica, session, kind):
    """The client's target is two replicas (pick_first): the first answers until it stops,
    then the second, which never saw the base, refuses it; the client sends the whole Build
    again, once, and carries on incrementally against the second."""
    tenant, sid = session
    first = ServerThread(base_config(), database_url)
    stopped = False
    channel = grpc.insecure_channel(replica.address)
    stub = pb_grpc.ContextEngineStub(channel)
    # the packaged policy balances round robin: here the first replica takes every call
    config = json.loads(service_config_text())
    config["loadBalancingConfig"] = [{"pick_first": {}}]
    target, service_config = f"ipv4:{first.address},{replica.address}", json.dumps(config)
    got: list[tuple[int, pb.BuildResponse]] = []
    req = build_request(tenant, sid)

    def stop_first() -> None:
        nonlocal stopped
        first.stop()
        stopped = True

    def sync() -> BuildStats:
        with Client(target=target, service_config=service_config) as engine:
            engine.plan(request=plan(tenant, sid))
            for n in range(1, 9):
                if n == 5:
                    assert engine.build_stats.incremental == 3
                    stop_first()
                req.checkpoint.items.extend(step(n))
                got.append((n, engine.build(request=req)))
                if n >= 5:
                    check_same(got[-1][1], stub, req, f"step {n}")
            return engine.build_stats

    async def asyncio_() -> BuildStats:
        async with AsyncClient(target=target, service_config=service_config) as engine:
            await engine.plan(request=plan(tenant, sid))
            for n in range(1, 9):
                if n == 5:
                    assert engine.build_stats.incremental == 3
                    await asyncio.to_thread(stop_first)
                req.checkpoint.items.extend(step(n))
                got.append((n, await engine.build(request=req)))
                if n >= 5:
                    check_same(got[-1][1], stub, req, f"step {n}")
            return engine.build_stats

    try:
        stats = sync() if kind == "sync" else asyncio.run(asyncio_())
    finally:
        if not stopped:
            first.stop()
        channel.close()
    assert (stats.builds, stats.full_resends, stats.incremental) == (8, 1, 6)


def base_lookups(builds: Any, tenant: str, monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each lookup of a base of ``tenant`` found it held, as the server's base cache
    ``builds`` answers them from now on (its ``peek`` spied on for the rest of the test)."""
    peek = builds.peek
    looked: list[bool] = []

    def spied(tenant_id: str, session_id: str, build_id: str) -> Any:
        found = peek(tenant_id, session_id, build_id)
        if tenant_id == tenant:
            looked.append(found is not None)
        return found

    monkeypatch.setattr(builds, "peek", spied)
    return looked


def whole_refusal(stub: Any, req: pb.BuildRequest) -> list[tuple[str, str]]:
    """The field violations, in order, of ``req`` refused as a whole Build (no base)."""
    with pytest.raises(grpc.RpcError) as err:
        stub.Build(req, timeout=30)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    status = rpc_status.from_call(err.value)
    assert status is not None
    out: list[tuple[str, str]] = []
    for detail in status.details:
        bad = error_details_pb2.BadRequest()
        if detail.Unpack(bad):
            out += [(v.field, v.description) for v in bad.field_violations]
    return out


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["sync", "asyncio"])
def test_a_refusal_names_every_violation_of_the_whole_build_whether_the_base_is_held(
        server, session, kind, monkeypatch):
    """A Build refused for a field of its own (a factor out of range) and for an item it sends
    (the first item's id and sequence again) raises InvalidArgument whose field_violations are
    the whole Build's, in order, whether the replica still holds the base (the Build is sent
    relative to it) or not (evicted: BUILD_BASE_UNKNOWN, and the Build sent again whole)."""
    tenant, sid = session
    channel = grpc.insecure_channel(server.address)
    stub = pb_grpc.ContextEngineStub(channel)
    good = build_request(tenant, sid, 2)
    bad = build_request(tenant, sid, 3)
    bad.estimator_factor = 0.1
    bad.checkpoint.items.append(bad.checkpoint.items[0])
    want = whole_refusal(stub, bad)
    assert [f for f, _ in want] == [
        "estimator_factor", f"checkpoint.items[{len(bad.checkpoint.items) - 1}].id",
        f"checkpoint.items[{len(bad.checkpoint.items) - 1}].sequence"], want
    builds = server.running.engine.builds
    looked = base_lookups(builds, tenant, monkeypatch)
    loop = asyncio.new_event_loop()
    engine: Any = (Client(target=server.address) if kind == "sync"
                   else loop.run_until_complete(_async_client(server.address)))

    def call(method: str, req: Any) -> Any:
        done = getattr(engine, method)(request=req)
        return done if kind == "sync" else loop.run_until_complete(done)

    try:
        call("plan", plan(tenant, sid))
        for held in (True, False):
            call("build", good)  # the base (again: a refusal drops what the client held)
            if not held:  # the replica no longer holds it (an eviction, a restart)
                builds.forget(tenant, sid)
            looked.clear()
            with pytest.raises(InvalidArgument) as err:
                call("build", bad)
            got = [(v.field, v.description) for v in err.value.field_violations]
            assert got == want, (held, got)
            # sent relative to the base (and then whole where it was not held)
            assert looked and set(looked) == {held}, (held, looked)
    finally:
        if kind == "sync":
            engine.close()
        else:
            loop.run_until_complete(engine.close())
        loop.close()
        channel.close()


async def _async_client(target: str) -> AsyncClient:
    return AsyncClient(target=target)


@pytest.mark.integration
def test_errors_deletion_and_forgetting_drop_the_sessions_base(server, session):
    tenant, sid = session
    with Client(target=server.address) as engine:
        engine.plan(request=plan(tenant, sid))
        req = build_request(tenant, sid, 2)
        engine.build(request=req)
        # another error than BUILD_BASE_UNKNOWN: raised as it is, the base dropped
        bad = pb.BuildRequest()
        bad.CopyFrom(req)
        bad.checkpoint.items.extend(step(3))
        bad.checkpoint.items[-1].id = bad.checkpoint.items[0].id  # a duplicate item id
        with pytest.raises(InvalidArgument):
            engine.build(request=bad)
        before = engine.build_stats
        engine.build(request=req)  # whole, not relative to a base the client dropped
        after = engine.build_stats
        assert after.incremental == before.incremental and after.full_resends == 0
        engine.build(request=req)
        assert engine.build_stats.incremental == before.incremental + 1
        # forget_session: the next Build goes whole, and nothing was refused
        engine.forget_session(tenant, sid)
        engine.build(request=req)
        assert engine.build_stats.incremental == before.incremental + 1
        # delete_session forgets too: the session planned again is built whole at once (a
        # base of the erased session would be refused, and resent)
        engine.delete_session(request=pb.DeleteSessionRequest(tenant_id=tenant, session_id=sid))
        engine.plan(request=plan(tenant, sid))
        engine.build(request=req)
        stats = engine.build_stats
        assert stats.incremental == before.incremental + 1 and stats.full_resends == 0


def nothing_held_after(held: int, stats: BuildStats, *, incremental: int) -> None:
    """The client held nothing of the session once the erasure (or forget) returned, and the
    three Builds of the scenario named no base of the erased session."""
    assert held == 0, "the session's Build in flight is held after the erasure returned"
    assert stats.full_resends == 0  # no Build named a base of the erased session
    assert (stats.builds, stats.incremental) == (3, incremental)


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("how", ["delete_session", "forget_session"])
def test_a_build_in_flight_across_the_sessions_deletion_is_not_held_again(replica, session,
                                                                          kind, how):
    """A Build of the session is in flight (held at the replica) while the same client
    deletes or forgets the session: its answer goes to its caller, and the client holds
    nothing of the session after it, so the session planned again is built whole at once
    (naming the deleted session's base would be refused, and sent again)."""
    import threading

    tenant, sid = session
    engine_ = replica.running.engine
    entered, release = threading.Event(), threading.Event()
    used = engine_._snapshot_used

    async def held_up(loaded: Any, run_id: str) -> None:
        if loaded.plan.tenant_id == tenant and run_id == "run-1" and not release.is_set():
            entered.set()
            await asyncio.to_thread(release.wait, 30)
        await used(loaded, run_id)

    def erase(client: Any) -> Any:
        if how == "forget_session":
            client.forget_session(tenant, sid)
            return None
        return client.delete_session(request=pb.DeleteSessionRequest(tenant_id=tenant,
                                                                      session_id=sid))

    first, second = build_request(tenant, sid, 1), build_request(tenant, sid, 2)
    try:
        if kind == "sync":
            with Client(target=replica.address) as client:
                client.plan(request=plan(tenant, sid))
                client.build(request=first)
                engine_._snapshot_used = held_up  # type: ignore[method-assign]
                with futures.ThreadPoolExecutor(1) as pool:
                    flight = pool.submit(client.build, request=second)
                    assert entered.wait(30)
                    erase(client)
                    release.set()
                    assert flight.result(30).build_id
                held_after = len(client._incremental or ())
                if how == "delete_session":
                    client.plan(request=plan(tenant, sid))
                client.build(request=second)
                stats = client.build_stats
        else:
            async def scenario() -> tuple[int, BuildStats]:
                async with AsyncClient(target=replica.address) as client:
                    await client.plan(request=plan(tenant, sid))
                    await client.build(request=first)
                    engine_._snapshot_used = held_up  # type: ignore[method-assign]
                    flight = asyncio.ensure_future(client.build(request=second))
                    assert await asyncio.to_thread(entered.wait, 30)
                    done = erase(client)
                    if done is not None:
                        await done
                    release.set()
                    assert (await flight).build_id
                    held = len(client._incremental or ())
                    if how == "delete_session":
                        await client.plan(request=plan(tenant, sid))
                    await client.build(request=second)
                    return held, client.build_stats
            held_after, stats = asyncio.run(scenario())
    finally:
        release.set()
        del engine_._snapshot_used
    nothing_held_after(held_after, stats, incremental=1)  # the last one whole


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_build_answered_while_delete_session_runs_is_not_held_after_it(replica, session,
                                                                         kind):
    """delete_session forgets the session, and the erasure takes a while at the replica: a
    Build of the session the client sends meanwhile is answered (the session is not erased
    yet), and what it holds of that answer goes once delete_session returns: the session
    planned again is built whole (naming the erased session's base would be refused)."""
    import threading

    tenant, sid = session
    engine_ = replica.running.engine
    entered, release = threading.Event(), threading.Event()
    erase = engine_.delete_session

    async def held_up(tenant_id: str, session_id: str, *, requested_by: str) -> Any:
        if tenant_id == tenant:
            entered.set()
            await asyncio.to_thread(release.wait, 30)
        return await erase(tenant_id, session_id, requested_by=requested_by)

    deleting = pb.DeleteSessionRequest(tenant_id=tenant, session_id=sid)
    first, second = build_request(tenant, sid, 1), build_request(tenant, sid, 2)
    engine_.delete_session = held_up  # type: ignore[method-assign]
    try:
        if kind == "sync":
            with Client(target=replica.address) as client:
                client.plan(request=plan(tenant, sid))
                client.build(request=first)
                with futures.ThreadPoolExecutor(1) as pool:
                    deleted = pool.submit(client.delete_session, request=deleting)
                    assert entered.wait(30)  # forgotten by the client; the erasure runs
                    assert client.build(request=second).build_id  # answered meanwhile
                    release.set()
                    assert deleted.result(30).deleted
                held_after = len(client._incremental or ())
                client.plan(request=plan(tenant, sid))
                client.build(request=second)
                stats = client.build_stats
        else:
            async def scenario() -> tuple[int, BuildStats]:
                async with AsyncClient(target=replica.address) as client:
                    await client.plan(request=plan(tenant, sid))
                    await client.build(request=first)
                    deleted = asyncio.ensure_future(client.delete_session(request=deleting))
                    assert await asyncio.to_thread(entered.wait, 30)
                    assert (await client.build(request=second)).build_id
                    release.set()
                    assert (await deleted).deleted
                    held = len(client._incremental or ())
                    await client.plan(request=plan(tenant, sid))
                    await client.build(request=second)
                    return held, client.build_stats
            held_after, stats = asyncio.run(scenario())
    finally:
        release.set()
        del engine_.delete_session
    nothing_held_after(held_after, stats, incremental=0)


@pytest.mark.integration
def test_an_item_too_large_for_a_replica_without_the_base_is_named_by_its_place(
        database_url, session):
    """A replica that does not hold the base is sent the Build whole, and refuses an item
    too large by its place in the whole checkpoint, as it would the Build sent whole at once:
    never by its place among the items an incremental Build sent."""
    tenant, sid = session
    srv = ServerThread(base_config().replace(max_item_bytes=4096), database_url)
    try:
        with Client(target=srv.address) as engine:
            engine.plan(request=plan(tenant, sid))
            req = build_request(tenant, sid, 2)
            engine.build(request=req)
            engine.build(request=req)
            assert engine.build_stats.incremental == 1
            srv.running.engine.builds.clear()  # evicted: the base is held nowhere now
            at = len(req.checkpoint.items)
            req.checkpoint.items.append(pb.ConversationItem(
                id="big", sequence=1_000, run_id="run-1", trust=pb.TRUST_LEVEL_USER,
                assistant=pb.AssistantMessage(text="y" * 5_000)))
            with pytest.raises(ResourceExhausted) as err:
                engine.build(request=req)
            assert err.value.reason == "ITEM_TOO_LARGE"
            assert err.value.metadata["field"] == f"checkpoint.items[{at}]"
    finally:
        srv.stop()


@pytest.mark.integration
def test_without_incremental_build_is_as_before(server, session):
    tenant, sid = session
    channel = grpc.insecure_channel(server.address)
    stub = pb_grpc.ContextEngineStub(channel)
    with Client(target=server.address, incremental=False) as engine:
        engine.plan(request=plan(tenant, sid))
        for n in range(3):
            req = build_request(tenant, sid, n)
            got = engine.build(request=req)
            assert not got.build_id  # nothing asked to be kept
            assert serialized(got) == serialized(stub.Build(req, timeout=30))
        assert engine.build_stats == BuildStats()
        engine.forget_session(tenant, sid)  # nothing held: nothing to do
    channel.close()


@pytest.mark.integration
def test_an_item_changed_while_a_build_is_in_flight_is_sent_again(server, session):
    """The async caller changes an item of its request while the Build it sent is in flight:
    the next Build's answer is the whole Build's of the request as it is then (the client held
    the items it sent, not the caller's changed ones)."""
    tenant, sid = session
    channel = grpc.insecure_channel(server.address)
    stub = pb_grpc.ContextEngineStub(channel)
    corrected = "CORRECTED RESULT ✓"

    async def scenario() -> tuple[pb.BuildRequest, pb.BuildResponse, pb.BuildResponse]:
        async with AsyncClient(target=server.address) as engine:
            await engine.plan(request=plan(tenant, sid))
            req = build_request(tenant, sid, 3)
            first = asyncio.ensure_future(engine.build(request=req))
            await asyncio.sleep(0)  # the Build is on its way, a copy of req sent
            req.checkpoint.items[2].tool_result.content = corrected
            was = await first
            req.checkpoint.items.extend(step(4))
            return req, was, await engine.build(request=req)

    req, was, got = asyncio.run(scenario())
    assert not any(corrected in m.text for m in was.request.messages)  # sent before the change
    check_same(got, stub, req, "the Build after the change")
    assert any(corrected in m.text for m in got.request.messages)
    channel.close()


@pytest.mark.integration
@pytest.mark.parametrize("cache_mb", [0, 1])
def test_a_replica_that_keeps_no_base_is_sent_each_build_once(database_url, session, cache_mb):
    """A replica that keeps no base (a cache of 0 bytes, or a base larger than its cache) names
    none: the client sends every Build whole, once, and counts no resend."""
    tenant, sid = session
    srv = ServerThread(base_config().replace(build_cache_mb=cache_mb), database_url)
    channel = grpc.insecure_channel(srv.address)
    stub = pb_grpc.ContextEngineStub(channel)
    try:
        with Client(target=srv.address) as engine:
            engine.plan(request=plan(tenant, sid))
            req = build_request(tenant, sid, 1)
            if cache_mb:  # over 1 MiB
                req.checkpoint.items[-1].tool_result.content = "x" * 1_200_000
            for n in range(2, 6):
                got = engine.build(request=req)
                assert not got.build_id
                want = stub.Build(req, timeout=30)
                assert serialized(got) == serialized(want)
                req.checkpoint.items.extend(step(n))
            stats = engine.build_stats
    finally:
        channel.close()
        srv.stop()
    assert (stats.builds, stats.incremental, stats.full_resends) == (4, 0, 0)
    assert stats.bytes_saved == -4 * 2  # each Build asked to be kept: its flag, two bytes


class _SlowReplica(pb_grpc.ContextEngineServicer):
    """Answers a session's first Build at once and keeps it; any later Build after ``delay``
    seconds, refusing the ones naming a base (it does not hold them)."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.calls: list[str] = []

    def Build(self, request: Any, context: Any) -> Any:
        self.calls.append(request.base_build_id)
        if len(self.calls) > 1:
            time.sleep(self.delay)
        if request.base_build_id:
            detail = any_pb2.Any()
            detail.Pack(error_details_pb2.ErrorInfo(reason=BASE_UNKNOWN,
                                                    domain="context-engine"))
            context.abort_with_status(rpc_status.to_status(status_pb2.Status(
                code=code_pb2.FAILED_PRECONDITION, message="unknown base",
                details=[detail])))
        return spb.BuildResponse(build_id=f"b{len(self.calls)}", epoch=1)


def _second_build_past_its_deadline(kind: str, replica: _SlowReplica,
                                    before: Callable[[], None] = lambda: None) -> float:
    """Seconds a session's second Build (one item appended, a 1 s timeout) took to fail
    DEADLINE_EXCEEDED against ``replica``, through the sync or the asyncio client; ``before``
    runs just before it is sent."""
    srv = grpc.server(futures.ThreadPoolExecutor(4))
    pb_grpc.add_ContextEngineServicer_to_server(replica, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    req = build_request("t", "s", 0)
    target = f"127.0.0.1:{port}"

    def sync() -> float:
        with Client(target=target) as engine:
            engine.build(request=req)
            req.checkpoint.items.extend(step(1))
            before()
            started = time.monotonic()
            with pytest.raises(DeadlineExceeded):
                engine.build(request=req, timeout=1.0)
            return time.monotonic() - started

    async def asyncio_() -> float:
        async with AsyncClient(target=target) as engine:
            await engine.build(request=req)
            req.checkpoint.items.extend(step(1))
            before()
            started = time.monotonic()
            with pytest.raises(DeadlineExceeded):
                await engine.build(request=req, timeout=1.0)
            return time.monotonic() - started

    try:
        return sync() if kind == "sync" else asyncio.run(asyncio_())
    finally:
        srv.stop(0)


@pytest.mark.parametrize("kind", ["sync", "asyncio"])
def test_a_resend_after_an_unknown_base_keeps_the_builds_deadline(kind):
    """``timeout`` is the deadline of the whole Build: the whole resend gets what the refused
    attempt left of it, not a new one."""
    replica = _SlowReplica(delay=0.6)
    took = _second_build_past_its_deadline(kind, replica)
    assert replica.calls[1] and not replica.calls[2]  # refused for its base, then sent whole
    assert took < 1.15, f"the Build took {took:.2f} s for a timeout of 1 s"


@pytest.mark.parametrize("kind", ["sync", "asyncio"])
def test_the_first_attempt_gets_what_preparing_it_left_of_the_deadline(kind, monkeypatch):
    """The incremental attempt was sent with a whole ``timeout`` of its own, taken after the
    request was prepared: a Build could last its timeout plus the preparation. Preparing is
    slowed to 0.8 s of a 1 s timeout here, and the replica answers after 0.6 s."""
    prepare = IncrementalBuilds.prepare

    def slow_prepare(self: IncrementalBuilds, *args: Any, **kwargs: Any) -> Any:
        time.sleep(0.8)
        return prepare(self, *args, **kwargs)

    took = _second_build_past_its_deadline(
        kind, _SlowReplica(delay=0.6),
        before=lambda: monkeypatch.setattr(IncrementalBuilds, "prepare", slow_prepare))
    assert took < 1.2, f"the Build took {took:.2f} s for a timeout of 1 s"


def test_the_whole_resend_is_the_build_as_it_was_called():
    """The caller changes its request while an incremental Build is in flight; the Build is
    refused for its base: the resend is the same Build whole (the base's kept items and those
    sent), not the caller's request as it is by then."""
    builds, _, req = three_held_five_asked()
    as_called = keeping(req)
    wire, base = builds.prepare(req)
    assert base is not None and wire.base_items_kept == 3
    req.checkpoint.items[1].user.text = "changed while the Build was in flight"
    req.checkpoint.items.append(item(5))
    again = builds.fallback(wire, base)
    assert serialized(again) == serialized(as_called)
    assert builds.prepare(req)[1] is None  # the session is forgotten
    with pytest.raises(ValueError, match="names base"):
        builds.fallback(again, base)


@pytest.mark.parametrize("asked", [False, True])
def test_a_whole_build_counts_the_request_as_the_caller_gave_it(asked: bool):
    """Whole, a Build's request is counted as the caller gave it: the keep_base flag the
    client adds is not counted, one the caller set is."""
    builds = IncrementalBuilds()
    req = request([item(0), item(1)])
    req.keep_base = asked
    wire, base = builds.prepare(req)
    builds.absorb(wire, response("b1", [message(0)]), base, Tally(keep_base=asked))
    assert builds.stats.full_request_bytes == req.ByteSize()
    assert builds.stats.request_bytes == wire.ByteSize()
    assert builds.stats.bytes_saved == req.ByteSize() - wire.ByteSize()


def test_a_deadline_that_has_passed_sends_nothing():
    assert 0 < time_left(time.monotonic() + 5) <= 5
    with pytest.raises(DeadlineExceeded):
        time_left(time.monotonic())
    with pytest.raises(DeadlineExceeded):
        time_left(time.monotonic() - 1)


class _DeltaForAWholeBuild(pb_grpc.ContextEngineServicer):
    """A faulty replica: answers a whole Build with a delta."""

    def __init__(self) -> None:
        self.calls = 0

    def Build(self, request: Any, context: Any) -> Any:
        self.calls += 1
        answer = spb.BuildResponse(build_id="b1", epoch=1)
        answer.delta.base_build_id = "b0"
        return answer


class _IgnoresBases(pb_grpc.ContextEngineServicer):
    """A replica that does not know base_build_id: it keeps every Build and answers each with
    one message per item it was sent, whole."""

    def __init__(self) -> None:
        self.sent: list[int] = []

    def Build(self, request: Any, context: Any) -> Any:
        self.sent.append(len(request.checkpoint.items))
        answer = spb.BuildResponse(build_id=f"b{len(self.sent)}", epoch=1)
        answer.request.messages.extend(spb.Message(item_id=i.id)
                                       for i in request.checkpoint.items)
        return answer


@pytest.mark.parametrize("kind", ["sync", "asyncio"])
def test_a_replica_that_ignores_bases_gets_each_build_whole(kind):
    """Its answer to a Build naming a base covers the items sent alone: the client sends that
    Build again whole, once, and returns the whole Build's answer."""
    replica = _IgnoresBases()
    srv = grpc.server(futures.ThreadPoolExecutor(2))
    pb_grpc.add_ContextEngineServicer_to_server(replica, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    target = f"127.0.0.1:{port}"
    reqs = [build_request("t", "s", n) for n in range(3)]

    def sync() -> tuple[list[Any], BuildStats]:
        with Client(target=target) as engine:
            return [engine.build(request=r) for r in reqs], engine.build_stats

    async def asyncio_() -> tuple[list[Any], BuildStats]:
        async with AsyncClient(target=target) as engine:
            return [await engine.build(request=r) for r in reqs], engine.build_stats

    try:
        got, stats = sync() if kind == "sync" else asyncio.run(asyncio_())
    finally:
        srv.stop(0)
    for r, resp in zip(reqs, got, strict=True):
        assert [m.item_id for m in resp.request.messages] == [i.id for i in r.checkpoint.items]
    # the first whole; then each Build names the last as its base, and goes again whole
    assert replica.sent == [1, 2, 3, 1, 4] and stats.full_resends == 2, replica.sent


@pytest.mark.parametrize("kind", ["sync", "asyncio"])
def test_a_delta_answering_a_whole_build_is_an_error_not_a_resend(kind):
    replica = _DeltaForAWholeBuild()
    srv = grpc.server(futures.ThreadPoolExecutor(2))
    pb_grpc.add_ContextEngineServicer_to_server(replica, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    target = f"127.0.0.1:{port}"

    def sync() -> BuildStats:
        with Client(target=target) as engine:
            with pytest.raises(Internal, match="whole request with a delta"):
                engine.build(request=build_request("t", "s", 0))
            return engine.build_stats

    async def asyncio_() -> BuildStats:
        async with AsyncClient(target=target) as engine:
            with pytest.raises(Internal, match="whole request with a delta"):
                await engine.build(request=build_request("t", "s", 0))
            return engine.build_stats

    try:
        stats = sync() if kind == "sync" else asyncio.run(asyncio_())
    finally:
        srv.stop(0)
    assert replica.calls == 1 and stats == BuildStats()


def test_build_stats_print_the_bytes_saved():
    from context_engine_client import BuildStats

    stats = BuildStats(builds=2, incremental=1, request_bytes=100, response_bytes=50,
                       full_request_bytes=1_000, full_response_bytes=550)
    assert stats.bytes_saved == 1_400
    assert repr(stats) == ("BuildStats(builds=2, incremental=1, full_resends=0, "
                           "request_bytes=100, response_bytes=50, full_request_bytes=1000, "
                           "full_response_bytes=550, bytes_saved=1400)")
