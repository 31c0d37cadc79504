"""The Build hot path remembers work, never answers: what it keeps (each checkpoint item's
mapping, each rendered message's wire form, each result's typed pointer, in the engine's render
memo; renderings, costs and pointers by object identity in the session's identity map, costs
per factor) changes how long a Build takes and nothing it returns, and goes with the session's
erasure.

Each Build here runs the served path twice, with the engine's memo kept across Builds and
sessions, and with no memo at all, and the serialized responses must be the same bytes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys
from dataclasses import replace
from typing import Any

import pytest
from context_engine.api import mapping
from context_engine.domain import canonical
from context_engine.domain.budget import elided
from context_engine.domain.builder import (
    IDENTITY,
    build,
    checkpoint_violations,
    in_row_order,
    rows_around,
)
from context_engine.domain.canonical import parse_json_object, session_key
from context_engine.domain.errors import AssemblyError
from context_engine.domain.items import (
    AssistantMessageItem,
    ContextItem,
    CorrectionItem,
    HistorySummary,
    KnowledgeItem,
    KnowledgePassage,
    MemoryLine,
    PlatformPolicy,
    RecallItem,
    RuntimeMetadataItem,
    SkillBodyItem,
    ToolResultItem,
    TrailingUserInput,
    UserMessageItem,
    assemble,
)
from context_engine.domain.trust import Region, TrustLevel
from context_engine.engine import BoundedMemo, Engine
from context_engine.render_memo import memo_weight
from context_engine.v1 import context_engine_pb2 as pb
from google.protobuf.message import Message as ProtoMessage

from tests import factories as f

TENANT = "tenant-hot"
WORDS = ("alpha", "beta", "gamma", 'say "hi"', "back\\slash", "naïve", "日本", "<untrusted",
         "line\nbreak", "tab\tstop", "{\"k\": [1, 2]}", "</user:00>", "emoji 🙂")


def text(rnd: random.Random, marker: str, words: int) -> str:
    return marker + " " + " ".join(rnd.choice(WORDS) for _ in range(words))


def conversation(turns: int, marker: str, seed: int = 7) -> list[pb.ConversationItem]:
    """Runs of a user message, one or two parallel tool calls with their results (some
    untrusted, one over the inline maximum, one with a persisted excerpt) and a closing
    assistant message; the last run stops after its results."""
    rnd = random.Random(seed)
    out: list[pb.ConversationItem] = []
    seq = 0

    def add(**kw: Any) -> None:
        nonlocal seq
        seq += 1
        out.append(pb.ConversationItem(sequence=seq, **kw))

    for t in range(turns):
        run = f"run-{t}"
        add(id=f"u{t}", run_id=run, trust=pb.TRUST_LEVEL_USER,
            user=pb.UserMessage(text=text(rnd, marker, rnd.randint(100, 800))))
        calls = [f"c{t}-{j}" for j in range(1 + t % 2)]
        add(id=f"t{t}", run_id=run, trust=pb.TRUST_LEVEL_USER, tool_calls=pb.ToolCalls(calls=[
            pb.ToolCall(call_id=c, name="web.fetch", arguments_json=f'{{"q": "{c}"}}')
            for c in calls]))
        for j, c in enumerate(calls):
            big = t == 3 and j == 0
            add(id=f"r{t}-{j}", run_id=run,
                trust=pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED if j else pb.TRUST_LEVEL_USER,
                tool_result=pb.ToolResult(
                    call_id=c, tool_name="web.fetch", event_id=100 + seq,
                    content=text(rnd, marker, 9_000 if big else rnd.randint(50, 1_500)),
                    context_content=text(rnd, marker, 30) if t == 5 else ""))
        if t < turns - 1:
            add(id=f"a{t}", run_id=run, trust=pb.TRUST_LEVEL_USER,
                assistant=pb.AssistantMessage(text=text(rnd, marker, 300)))
    return out


def checkpoint_pb(items: list[pb.ConversationItem]) -> pb.Checkpoint:
    return pb.Checkpoint(
        active_run_id=items[-1].run_id, items=items,
        runtime=pb.RuntimeMetadata(current_date="2026-11-29"),
        recall=[pb.RecallLine(id="m1", text="recalled line")],
        knowledge=[pb.KnowledgePassage(id=f"k{i}", source="kb", text="passage " * 300,
                                       rank=i, trust=pb.TRUST_LEVEL_MEMORY) for i in range(4)])


def loaded(session: str) -> Any:
    model = f.CATALOG.resolve("hot-path-model", context_window=20_000, output_reserve=2_000,
                              breakpoint_budget=None)
    # the tool its calls name is defined: Anthropic and Bedrock refuse calls without tools
    return f.loaded(f.inputs(tenant_id=TENANT, session_id=session, model_profile=model,
                             enabled=("web.fetch",), catalog=(f.tool("web.fetch"),)))


def served(lp: Any, cp_pb: pb.Checkpoint, memo: BoundedMemo | None, *, factor: float = 1.0,
           fmt: str = "", messages: slice | None = None, prefix: bool = True) -> bytes:
    """The servicer's Build: map, validate, build, map back; with the engine's memo or none."""
    v = mapping.Violations()
    if memo is None:
        cp = mapping.checkpoint(v, cp_pb)
    else:
        cp = mapping.checkpoint(v, cp_pb, memo=memo, session_key=lp.session_key)
    v.items.extend(checkpoint_violations(cp))
    v.raise_if_any()
    result = build(lp, cp, estimator=f.estimator(lp.plan.spec.model), factor=factor,
                   memo=memo, validated=True)
    sent = None if messages is None else result.request.messages[messages]
    out = mapping.build_pb(result, fmt, catalog=f.CATALOG, messages=sent, prefix=prefix,
                           memo=memo)
    return out.SerializeToString()


def test_builds_with_the_memo_are_the_builds_without_it() -> None:
    """Two sessions with the same items (ids and content) interleaved on one memo, growing turn
    by turn, an item rewritten in place, factors moving: byte for byte the memo-less path."""
    memo = BoundedMemo(64 << 20)
    sessions = [loaded("same-a"), loaded("same-b")]
    items = conversation(12, "MARK")
    factors = (1.0, 1.7, 0.6)
    yielded = set()
    for turn in range(3, len(items) + 1, 3):
        sent = list(items[:turn])
        while sent[-1].WhichOneof("kind") == "tool_calls":
            sent.pop()
        if turn > 20:  # a runtime rewrites an earlier result: same id, other content
            i = next(i for i, it in enumerate(sent) if it.id == "r1-0")
            sent[i] = pb.ConversationItem()
            sent[i].CopyFrom(items[i])
            sent[i].tool_result.content = f"rewritten at {turn}"
        cp = checkpoint_pb(sent)
        for lp in sessions:
            factor = factors[(turn // 3) % 3]  # turn steps by 3: each factor in turn
            for fmt in ("", "anthropic_messages", "gemini_generate_content"):
                want = served(lp, cp, None, factor=factor, fmt=fmt)
                assert served(lp, cp, memo, factor=factor, fmt=fmt) == want, (turn, fmt)
                assert served(lp, cp, memo, factor=factor, fmt=fmt) == want, (turn, fmt)
            response = pb.BuildResponse.FromString(want)
            yielded |= {s.step for s in response.pressure.steps}
            # what an incremental response carries: some messages, no prefix
            assert served(lp, cp, memo, messages=slice(1, None, 2), prefix=False) == \
                served(lp, cp, None, messages=slice(1, None, 2), prefix=False)
    # the runs above went down the ladder: pointers and a history cut were memoized too
    assert {"knowledge", "tool_results", "history"} <= yielded
    # what the memo counts is what its entries weigh now: none grew after it was weighed (the
    # identity maps, filled in during a build, are written again at its end)
    assert memo.bytes == sum(map(memo_weight, memo.values())) > 0


def test_a_memo_that_drops_the_session_mid_build_keeps_no_identity_map_of_it() -> None:
    """A memo too small for the session drops it during its Builds (half the capacity): an
    identity map it holds points only at renderings it also holds (else the map alone keeps
    them alive, counted at a fraction of their size)."""
    # 600,000 bytes: the session outgrows half of it in the later Builds, and what those
    # Builds render after the drop still fits (at 200,000 every Build dropped it again once
    # more, map and all, and the check below read no map at all)
    memo = BoundedMemo(600_000)
    dropped: list[str] = []
    drop = memo.drop

    def counted(session: str) -> None:
        dropped.append(session)
        drop(session)

    memo.drop = counted  # type: ignore[method-assign]
    lp = loaded("small-memo")
    items = conversation(12, "SMALL")
    for turn in range(6, len(items) + 1, 6):
        sent = list(items[:turn])
        while sent[-1].WhichOneof("kind") == "tool_calls":
            sent.pop()
        served(lp, checkpoint_pb(sent), memo)
        assert not dropped or dropped[-1] == lp.session_key
        for key, seen in list(memo.items()):
            if key[1] == IDENTITY:
                for hit in seen.values():
                    assert memo.get((key[0], key[2], hit[0])) is hit[1], turn
    assert dropped  # the memo did drop the session during a Build


def test_one_checkpoint_object_built_for_two_sessions_and_factors() -> None:
    """The pure build() handed the very same item objects for two sessions and at several
    factors, on one memo (its identity map of renderings and costs): each result is the
    memo-less one, byte for byte (a session's envelope nonces are its own; a cost is the
    factor's)."""
    memo = BoundedMemo(64 << 20)
    v = mapping.Violations()
    sent = conversation(12, "SHARED")[:27]
    while sent[-1].WhichOneof("kind") == "tool_calls":
        sent.pop()
    cp = mapping.checkpoint(v, checkpoint_pb(sent))
    v.raise_if_any()
    for factor in (1.0, 1.0, 1.9, 0.6, 1.0):
        for session in ("shared-a", "shared-b"):
            lp = loaded(session)
            est = f.estimator(lp.plan.spec.model)
            want = build(lp, cp, estimator=est, factor=factor)
            got = build(lp, cp, estimator=est, factor=factor, memo=memo)
            assert got == want, (factor, session)
            assert mapping.build_pb(got, "", catalog=f.CATALOG).SerializeToString() == \
                mapping.build_pb(want, "", catalog=f.CATALOG).SerializeToString()


def violations_of(cp: pb.Checkpoint, memo: BoundedMemo | None,
                  key: str = "") -> tuple[list[tuple[str, str]], tuple[Any, ...]]:
    v = mapping.Violations()
    if memo is None:
        mapped = mapping.checkpoint(v, cp)
    else:
        mapped = mapping.checkpoint(v, cp, memo=memo, session_key=key)
    return [(x.field, x.description) for x in v.items], mapped.items


def test_a_remembered_item_keeps_its_violations_at_its_new_index() -> None:
    bad = [
        pb.ConversationItem(id="x\x01", sequence=1, run_id="r" * 300,
                            trust=pb.TRUST_LEVEL_PLATFORM, user=pb.UserMessage(
                                text="hi", attachments=[pb.Attachment(kind=9)])),
        pb.ConversationItem(id="t", sequence=2, run_id="r", trust=pb.TRUST_LEVEL_USER,
                            tool_calls=pb.ToolCalls(calls=[pb.ToolCall(
                                call_id="c\n", name="bad name!", arguments_json="{}")])),
        pb.ConversationItem(id="res", sequence=3, run_id="r", trust=99,
                            tool_result=pb.ToolResult(call_id="c", artifact_ref="a\x7f" * 200,
                                                      event_id=-4, content="x")),
        pb.ConversationItem(id="cfg", sequence=4, run_id="r",
                            trust=pb.TRUST_LEVEL_TRUSTED_CONFIGURATION,
                            tool_result=pb.ToolResult(call_id="c", content="data")),
        pb.ConversationItem(id="none", sequence=5, run_id="r"),
        # NEL (a C1 control: a line break to some readers) and a line separator in ids
        pb.ConversationItem(id="naïve\x85", sequence=6, run_id="rün\u2028",
                            trust=pb.TRUST_LEVEL_USER, user=pb.UserMessage(text="ok")),
        # no control, format or separator character: valid
        pb.ConversationItem(id="naïve", sequence=7, run_id="rün", trust=pb.TRUST_LEVEL_USER,
                            user=pb.UserMessage(text="ok")),
    ]
    memo = BoundedMemo(64 << 20)
    first = pb.Checkpoint(active_run_id="r", items=bad)
    found, mapped = violations_of(first, memo, "s")
    want, plain = violations_of(first, None)
    reference = ("must be at most 256 characters on one line, without control, format or "
                 "separator characters")
    assert want == [
        ("checkpoint.items[0].trust", "platform is not accepted here; at most "
                                      "trusted_configuration"),
        ("checkpoint.items[0].id", reference),
        ("checkpoint.items[0].run_id", reference),
        ("checkpoint.items[0].user.attachments[0].kind", "unknown attachment kind 9"),
        ("checkpoint.items[0].user.attachments[0].name", "must not be empty"),
        ("checkpoint.items[1].tool_calls.calls[0].name",
         "must match [A-Za-z0-9_.-]{1,64} (what providers accept)"),
        ("checkpoint.items[1].tool_calls.calls[0].call_id", reference),
        ("checkpoint.items[2].trust", "unknown trust level 99"),
        ("checkpoint.items[2].tool_result.artifact_ref", reference),
        ("checkpoint.items[2].tool_result.event_id", "must not be negative"),
        ("checkpoint.items[3].trust", "trusted_configuration is not accepted here; at most "
                                      "user"),
        ("checkpoint.items[4].trust", "unknown trust level 0 (unspecified)"),
        ("checkpoint.items[4].kind", "no item kind is set"),
        ("checkpoint.items[5].id", reference),
        ("checkpoint.items[5].run_id", reference)]
    assert found == want
    assert mapped == plain
    assert plain[2].item_trust is TrustLevel.EXTERNAL_UNTRUSTED  # unknown: the lowest
    moved = pb.Checkpoint(active_run_id="r", items=conversation(1, "lead")[:2] + bad)
    again, remapped = violations_of(moved, memo, "s")
    assert again == violations_of(moved, None)[0]
    assert again[0][0] == "checkpoint.items[2].trust"
    # the same objects: their strings are hashed already when the render memo looks them up
    assert all(a is b for a, b in zip(mapped, remapped[2:], strict=True))


@pytest.mark.parametrize("memo", [None, BoundedMemo(64 << 20)], ids=["plain", "memo"])
def test_an_item_without_a_kind_keeps_its_place_and_the_items_after_it_theirs(
        memo: BoundedMemo | None) -> None:
    """A kindless item is refused in its place, and checked like any item (its id, sequence
    and run): the items after it are named by their own positions, as the whole checkpoint
    numbers them."""
    def user(item_id: str, seq: int, **fields: Any) -> pb.ConversationItem:
        return pb.ConversationItem(id=item_id, sequence=seq, run_id="r",
                                   trust=pb.TRUST_LEVEL_USER,
                                   user=pb.UserMessage(text="x"), **fields)
    cp = pb.Checkpoint(active_run_id="r", items=[
        user("a", 1),
        pb.ConversationItem(id="k", sequence=2, run_id="r", trust=pb.TRUST_LEVEL_USER),
        user("a", 3),  # a duplicate id, the third item
        pb.ConversationItem(id="a", sequence=1, run_id="r", trust=pb.TRUST_LEVEL_USER),
    ])
    v = mapping.Violations()
    if memo is None:
        mapped = mapping.checkpoint(v, cp)
    else:
        mapped = mapping.checkpoint(v, cp, memo=memo, session_key="s")
    assert len(mapped.items) == 4
    found = [(x.field, x.description) for x in v.items + checkpoint_violations(mapped)]
    assert found == [
        ("checkpoint.items[1].kind", "no item kind is set"),
        ("checkpoint.items[3].kind", "no item kind is set"),
        ("checkpoint.items[2].id", "duplicate item id 'a'"),
        ("checkpoint.items[3].id", "duplicate item id 'a'"),
        ("checkpoint.items[3].sequence",
         "1 is below the previous item's 3: items are ordered oldest first")]


def test_an_item_sent_again_with_other_content_is_mapped_again() -> None:
    memo = BoundedMemo(64 << 20)
    items = conversation(2, "first")
    _, before = violations_of(pb.Checkpoint(items=items), memo, "s")
    changed = [pb.ConversationItem() for _ in items]
    for c, it in zip(changed, items, strict=True):
        c.CopyFrom(it)
    changed[0].user.text = "second"
    changed[2].trust = pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED
    found, after = violations_of(pb.Checkpoint(items=changed), memo, "s")
    assert (found, after) == violations_of(pb.Checkpoint(items=changed), None)
    assert isinstance(after[0], UserMessageItem) and after[0].text == "second"
    assert after[2].item_trust is TrustLevel.EXTERNAL_UNTRUSTED
    assert after[1] is before[1]  # unchanged: remembered


def test_a_memo_needs_the_session() -> None:
    with pytest.raises(ValueError):
        mapping.checkpoint(mapping.Violations(), pb.Checkpoint(), memo={})


def holds(value: Any, marker: str) -> bool:
    """Whether ``value`` (memo keys and values: tuples, text, bytes, domain values, protobuf
    messages) holds ``marker`` anywhere."""
    if isinstance(value, str):
        return marker in value
    if isinstance(value, bytes):
        return marker.encode() in value
    if isinstance(value, (tuple, list)):
        return any(holds(x, marker) for x in value)
    if isinstance(value, dict):
        return any(holds(x, marker) for x in value.values())
    if isinstance(value, ProtoMessage):
        return marker.encode() in value.SerializeToString()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return any(holds(getattr(value, fl.name), marker) for fl in dataclasses.fields(value))
    return False


def test_what_a_session_left_in_the_memo_goes_with_its_erasure() -> None:
    engine = Engine(store=None, events=None, calibrations=None,  # type: ignore[arg-type]
                    catalog=f.CATALOG, tokenizers=f.REGISTRY, assets=f.ASSETS,
                    control_tools=f.CONTROL_TOOLS, metrics=None)  # type: ignore[arg-type]
    memo = engine.render_memo
    for session, marker in (("erased", "GONE-0001"), ("kept", "STAYS-0002")):
        lp = loaded(session)
        assert lp.session_key == session_key(TENANT, session)
        cp = checkpoint_pb(conversation(10, marker))
        served(lp, cp, memo)
        served(lp, cp, memo, fmt="openai_responses")
    kinds = {k[1] for k in memo if isinstance(k[1], str)}
    assert {"mapping:item", "mapping:wire", "builder:pointer", "builder:identity"} <= kinds
    assert any(holds((k, v), "GONE-0001") for k, v in memo.items())
    engine.forget_session(TENANT, "erased")
    assert not any(holds((k, v), "GONE-0001") for k, v in memo.items())
    assert any(holds((k, v), "STAYS-0002") for k, v in memo.items())


def region_b_items() -> list[ContextItem]:
    """One item of each type the assembly orders in region B but a summary and a result: a
    user message, the trailing input, an assistant message, then the rows after history."""
    user = UserMessageItem(id="u", sequence=1, run_id="r", item_trust=TrustLevel.USER,
                           text="hi")
    return [
        user, TrailingUserInput(message=user),
        AssistantMessageItem(id="a", sequence=2, run_id="r", item_trust=TrustLevel.USER,
                             text="ok"),
        SkillBodyItem(name="s", body="b", skill_trust=TrustLevel.USER),
        KnowledgeItem(passages=(KnowledgePassage(id="k", source="s", text="t", rank=1,
                                                 trust=TrustLevel.MEMORY),)),
        RecallItem(lines=(MemoryLine(id="m", text="t"),)),
        CorrectionItem(lines=(MemoryLine(id="c", text="t"),)),
        RuntimeMetadataItem(current_date="d", principal_scopes=(), surface="",
                            browser_origins=())]


def test_rows_are_ordered_as_assemble_orders_them() -> None:
    rnd = random.Random(3)
    kinds = region_b_items()
    for _ in range(50):
        body = [rnd.choice(kinds) for _ in range(rnd.randint(0, 30))]
        assert in_row_order(body) == assemble(body, Region.B)

    @dataclasses.dataclass(frozen=True)
    class Undeclared(ContextItem):
        pass

    for odd in (Undeclared(), PlatformPolicy(text="p")):
        body = [kinds[0], odd, kinds[3], odd]
        with pytest.raises(AssemblyError) as want:
            assemble(body, Region.B)
        with pytest.raises(AssemblyError) as got:
            in_row_order(body)
        assert str(got.value) == str(want.value)


def test_rows_around_a_block_of_one_row_are_the_rows_of_it_all() -> None:
    """``rows_around(head, block, tail)``, the block kept whole between what it gives (or
    ``in_row_order`` of it all where it gives None), is ``in_row_order`` of the three
    together, order and error: over heads, blocks and tails drawn from every row around the
    history's (a summary's below it, the same row in the head and in the tail, higher ones),
    blocks of one type, of several and of none, blocks holding a type of another row, of
    region A or declaring no row."""
    rnd = random.Random(5)

    @dataclasses.dataclass(frozen=True)
    class Undeclared(ContextItem):
        pass

    user, trailing, said, *after_history = region_b_items()
    result = ToolResultItem(id="t", sequence=3, run_id="r", item_trust=TrustLevel.USER,
                            call_id="c", tool_name="x", content="y")
    conversation: list[ContextItem] = [user, said, result]
    others: list[ContextItem] = [
        HistorySummary(text="s", replaced_through_sequence=1), *conversation, trailing,
        *after_history]
    odd: list[ContextItem] = [Undeclared(), PlatformPolicy(text="p"), others[5]]

    def around_or_all(head: list[ContextItem], block: list[ContextItem],
                      tail: list[ContextItem]) -> list[ContextItem]:
        around = rows_around(head, block, tail)
        if around is None:
            return in_row_order([*head, *block, *tail])
        return [*around[0], *block, *around[1]]

    def outcome(order: Any, *parts: list[ContextItem]) -> Any:
        try:
            return [id(item) for item in order(*parts)]
        except AssemblyError as exc:
            return str(exc)

    seen_errors = 0
    for case in range(600):
        head = [rnd.choice(others) for _ in range(rnd.randint(0, 2))]
        block = [rnd.choice(conversation) for _ in range(rnd.randint(0, 6))]
        if case % 4 == 0 and block:  # a type of another row, another region or none
            block[rnd.randrange(len(block))] = rnd.choice(odd)
        tail = [rnd.choice(others + odd[:1] * (case % 7 == 0))
                for _ in range(rnd.randint(0, 6))]
        want = outcome(lambda *p: in_row_order([*p[0], *p[1], *p[2]]), head, block, tail)
        assert outcome(around_or_all, head, block, tail) == want, (head, block, tail)
        seen_errors += isinstance(want, str)
    assert 30 < seen_errors < 400


def reference_parse(text: Any) -> Any:
    """``parse_json_object`` as json.loads with the same hooks (a new decoder every call)."""
    def constant(name: str) -> Any:
        raise ValueError(name)

    def finite(literal: str) -> float:
        value = float(literal)
        if value in (float("inf"), float("-inf")):
            raise ValueError(literal)
        return value

    def bounded(literal: str) -> int:  # 4,300 digits at most, whatever the interpreter's limit
        if len(literal.lstrip("-")) > 4_300:
            raise ValueError(literal[:10])
        return int(literal)

    try:
        value = json.loads(text, parse_constant=constant, parse_float=finite, parse_int=bounded)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict):
        return None
    # a lone surrogate (an unpaired \\ud800-\\udfff escape) is no Unicode character: refused
    strings, stack = [], [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            strings.append(node)
        elif isinstance(node, dict):
            stack += [*node.keys(), *node.values()]
        elif isinstance(node, list):
            stack += node
    if any(0xD800 <= ord(c) <= 0xDFFF for t in strings for c in t):
        return None
    return value


def reference_strict(text: Any) -> Any:
    """``is_json_object``'s answer, written apart from it: ``reference_parse``'s, and no name
    twice in one object, nor objects and arrays nested more than 100 levels."""
    value = reference_parse(text)
    if value is None:
        return None
    twice: list[str] = []

    def pairs(found: list[tuple[str, Any]]) -> dict[str, Any]:
        names = [k for k, _ in found]
        twice.extend(k for k in set(names) if names.count(k) > 1)
        return dict(found)

    json.loads(text, object_pairs_hook=pairs)

    def depth(node: Any) -> int:
        children = node.values() if isinstance(node, dict) else node
        return 1 + max((depth(c) for c in children if isinstance(c, (dict, list))), default=0)

    return None if twice or depth(value) > 100 else value


SURROGATE_TEXTS = [
    '{"\\ud800": 1}', '{"a": "\\udc00"}', '{"a": ["x", {"b": "\\uDBFF"}]}',
    '{"a": "\\ud83d\\ude00"}', '{"a": "\\ud83d"}', '{"a": "\\ude00\\ud83d"}',
    '{"a": "\\\\ud800"}', '{"a": "\\u00e9\\ud800x"}',
    b'{"a": "\\ud800"}', b'{"a": "\\ud83d\\ude00"}',
    '{"a": "\\uD83D\\uDE00", "b": "\\uDFFF"}', '{"a": "\\uD7FF\\uE000"}']


# Integers about the 4,300-digit rule: at it, past it, signed, nested, in a string, as a float.
LONG_INTEGERS = [
    '{"a": ' + "9" * 4_300 + "}", '{"a": -' + "9" * 4_300 + "}", '{"a": ' + "9" * 4_301 + "}",
    '{"a": [-' + "1" * 4_301 + "]}", '{"a": {"b": ' + "7" * 5_000 + "}}",
    '{"a": "' + "9" * 5_000 + '"}', '{"a": ' + "1" * 4_301 + ".5}",
    '{"a": ' + "1" * 5_000 + "e-4990}", b'{"a": ' + b"9" * 4_301 + b"}"]


def test_json_objects_parse_as_json_loads_parses_them() -> None:
    deep = '{"a":' * 80 + "1" + "}" * 80
    texts: list[Any] = [
        "{}", "[]", '{"a": 1}', "{", "1", "null", '{"a": NaN}', '{"a": 1e400}', '{"a": -1e400}',
        '{"a": Infinity}', " {} ", '{"a": "' + "x" * 5_000 + '"}', deep, deep[:-1],
        "{}garbage", '{"a": 1, "a": 2}', "\ufeff{}", '{"a": 1.5e3, "b": [1, 2.0]}',
        b'{"bytes": 1}', bytearray(b"{}"), "{\n}", "", " ", *SURROGATE_TEXTS, *LONG_INTEGERS]
    rnd = random.Random(5)
    alphabet = '{}[]":,.-+eE0123456789 \n\tabcnultrfsNIa\\'
    texts += ["".join(rnd.choice(alphabet) for _ in range(rnd.randint(0, 12)))
              for _ in range(2_000)]
    for t in texts:
        assert parse_json_object(t) == reference_parse(t), t
    with pytest.raises(TypeError):  # as json.loads: not text at all
        parse_json_object(12)  # type: ignore[arg-type]


def test_the_identity_map_stays_bounded_when_every_build_brings_new_objects() -> None:
    """Every Build brings new item objects (mapped without the memo, each conversation its own
    words, so no earlier object equals them): the session's identity map is begun again instead
    of growing past twice a build's items (and its slack)."""
    from context_engine.domain.builder import IDENTITY, IDENTITY_SLACK
    memo = BoundedMemo(64 << 20)
    lp = loaded("bounded")
    est = f.estimator(lp.plan.spec.model)
    key = (lp.session_key, IDENTITY, est.encoding)
    sizes = []
    for n in range(40):
        sent = conversation(12, f"BOUND{n}")[:27]
        while sent[-1].WhichOneof("kind") == "tool_calls":
            sent.pop()
        v = mapping.Violations()
        cp = mapping.checkpoint(v, checkpoint_pb(sent))  # new objects every time
        build(lp, cp, estimator=est, memo=memo)
        sizes.append(len(memo[key]))
    per_build = sizes[0]  # what one Build's objects take
    assert 40 * per_build > 2 * len(sent) + IDENTITY_SLACK + per_build  # growth would show
    assert max(sizes) <= 2 * len(sent) + IDENTITY_SLACK + per_build
    assert min(sizes[1:]) <= per_build  # it was begun again


def test_a_lone_surrogate_is_named_as_such() -> None:
    assert canonical.json_object_problem('{"a": "\\ud800"}') == canonical.LONE_SURROGATE
    assert canonical.json_object_problem('{"a": "\\ud83d\\ude00"}') is None
    assert canonical.json_object_problem("[]") == canonical.NOT_AN_OBJECT
    assert sum(reference_parse(t) is None for t in SURROGATE_TEXTS) == 8


def test_an_integer_of_more_than_4300_digits_is_named_as_such() -> None:
    """Refused for its length, as 1e400 is for its range, in words of its own (it is a JSON
    object); one of 4,300 digits parses to its exact value and writes back canonically."""
    nines = "9" * 4_301
    said = "of more than 4,300 digits: a body that sends it parsed cannot carry it as written"
    problem = canonical.json_object_problem('{"a": [1, ' + nines + "]}")
    assert problem is not None and problem.startswith(
        "holds the integer " + "9" * 40 + "... (4,301 digits), " + said)
    assert canonical.json_object_problem('{"a": -' + nines + "}", quote=False) == (
        "holds an integer " + said + "; refused in every format alike")
    assert canonical.json_object_problem(('{"a": ' + nines + "}").encode()) == (
        canonical.json_object_problem('{"a": ' + nines + "}"))  # bytes: the same words
    assert parse_json_object('{"a": ' + nines + "}") is None
    assert not canonical.is_json_object('{"a": ' + nines + "}")
    assert canonical.sent_object_json('{"a": ' + nines + "}") == "{}"
    for sign in ("", "-"):
        text = '{"a":' + sign + "8" * 4_300 + "}"
        assert canonical.json_object_problem(text) is None
        value = parse_json_object(text)
        assert value is not None and value["a"] == int(sign + "8" * 4_300)
        assert canonical.canonical_json(value) == text
    assert canonical.json_object_problem('{"a": "' + "9" * 5_000 + '"}') is None  # a string


DIGITS_PROBE = """
import json
from context_engine.api import working_state_tool as wst
from context_engine.domain import canonical
from context_engine.domain.trust import TrustLevel
texts = [{texts}]
out = []
for t in texts:
    value = canonical.parse_json_object(t)
    call = wst.parse_arguments(t, trust=TrustLevel.USER, field="f")
    out.append([canonical.json_object_problem(t), canonical.is_json_object(t),
                None if value is None else canonical.canonical_sha256(value),
                canonical.sent_object_json(t)[:50],
                call if isinstance(call, str) else repr(call)[:300]])
print(json.dumps(out))
"""


@pytest.mark.parametrize("limit", ["0", "100000"])
def test_the_integer_rule_does_not_depend_on_the_interpreters_digit_limit(limit: str) -> None:
    """A replica started with PYTHONINTMAXSTRDIGITS (or -X int_max_str_digits) set otherwise
    gives every verdict, message and hash the default interpreter gives: the rule is the
    text's (4,300 digits), not the interpreter's."""
    texts = [*(t for t in LONG_INTEGERS if isinstance(t, str)),
             '{"add_facts": [{"statement": "s", "source_event_ids": [' + "9" * 5_000 + "]}]}",
             '{"objective": ' + "9" * 4_301 + "}", '{"objective": ' + "9" * 700 + "}"]
    code = DIGITS_PROBE.replace("{texts}", ", ".join(map(repr, texts)))
    results = {}
    for env_limit in (None, limit):
        env = {k: v for k, v in os.environ.items() if k != "PYTHONINTMAXSTRDIGITS"}
        env["PYTHONPATH"] = os.pathsep.join(sys.path)
        if env_limit is not None:
            env["PYTHONINTMAXSTRDIGITS"] = env_limit
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2_000:]
        results[env_limit] = json.loads(done.stdout)
    assert results[limit] == results[None]
    verdicts = [r[0] for r in results[None]]
    assert verdicts[:2] == [None, None]  # 4,300 digits, signed or not
    assert all("of more than 4,300 digits" in (v or "") for v in verdicts[2:5]), verdicts
    assert verdicts[5] is None  # digits in a string
    assert "beyond the range of a 64-bit float" in verdicts[6]  # a float: its range, not digits
    assert verdicts[7] is None  # a float of 5,000 digits within range
    assert "of more than 4,300 digits" in results[None][8][4]  # the working-state tool too
    assert "of more than 4,300 digits" in results[None][9][4]
    assert "Input should be a valid string" in results[None][10][4]


def test_known_json_objects_are_what_json_loads_says_every_time() -> None:
    """The remembered answer of ``is_json_object`` is json.loads' answer, asked again and again
    (first and remembered calls alike), for objects and for what is not one; long texts and a
    full table included."""
    rnd = random.Random(9)
    alphabet = '{}[]":,.-+eE0123456789 \n\tabcnultrfsNIa\\'
    long = "x" * (canonical.KNOWN_OBJECT_CHARS + 10)
    texts = ["{}", "[]", '{"a": 1}', "{", '{"a": NaN}', '{"a": 1e400}', "\ufeff{}", "",
             '{"a": "' + long + '"}', '{"a": "' + long + '"', '{"a": 1, "a": "' + long + '"}',
             '{"a": 1, "b": {"a": 2, "a": 3}}', '{"a": ' + "[" * 100 + "]" * 100 + "}",
             '{"a": ' + "[" * 99 + "]" * 99 + ', "b": [[], {}]}',
             *(t for t in SURROGATE_TEXTS if isinstance(t, str)),
             *(t for t in LONG_INTEGERS if isinstance(t, str))]
    texts += ['{"k": ' + str(i) + "}" for i in range(canonical.KNOWN_OBJECTS_ENTRIES + 50)]
    texts += ["".join(rnd.choice(alphabet) for _ in range(rnd.randint(0, 12)))
              for _ in range(2_000)]
    for _ in range(2):
        for t in texts:
            assert canonical.is_json_object(t) is (reference_strict(t) is not None), t[:80]
    assert len(canonical._known_objects) <= canonical.KNOWN_OBJECTS_ENTRIES
    # short texts kept as they are (objects only), longer ones by a 16-byte digest
    assert all(len(k) == 16 if isinstance(k, bytes) else
               reference_strict(k) is not None and len(k) <= canonical.KNOWN_OBJECT_CHARS
               for k in canonical._known_objects)


def test_long_json_objects_are_remembered_by_their_digest(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Arguments over KNOWN_OBJECT_CHARS are remembered too (a whole Build checks every call's
    on every turn; a strict parse of 12 KB takes some hundred microseconds), by a 16-byte
    digest rather than the text itself; one that is not an object never is."""
    monkeypatch.setattr(canonical, "_known_objects", {})
    text = '{"a": "' + "x" * (canonical.KNOWN_OBJECT_CHARS * 10) + '"}'
    assert canonical.is_json_object(text)
    assert canonical.is_json_object(text[:-1]) is False
    (key,) = canonical._known_objects
    assert isinstance(key, bytes) and len(key) == 16
    monkeypatch.setattr(canonical, "json_object_problem", lambda *_, **__: "parsed again")
    assert canonical.is_json_object(text)  # remembered: not parsed again


def test_a_pointer_is_the_result_elided() -> None:
    item = ToolResultItem(id="r", sequence=3, run_id="run", item_trust=TrustLevel.USER,
                          call_id="c", tool_name="t", content="body", artifact_ref="art",
                          event_id=9, context_content="short", byte_length=77)
    pointed = elided(item)
    assert pointed == replace(item, elided=True) and pointed.elided and not item.elided
