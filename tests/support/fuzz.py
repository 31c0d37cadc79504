"""Hypothesis strategies for fuzzing the ContextEngine gRPC API with malformed and boundary
requests.

Every strategy yields ``Case`` values: an RPC name, the exact bytes put on the wire and whether
the request is certainly malformed (it must never be answered OK). Three families:

* wire level: random bytes, truncated or bit-flipped encodings, string fields holding invalid
  UTF-8, fields sent with the wrong wire type, unknown fields, deeply nested groups;
* descriptor driven: any field of any request message set to a boundary value of its type
  (empty and huge strings, control characters, extreme integers, NaN and infinities, raw enum
  numbers the contract does not name, long repeated fields);
* semantic: a valid request with one field made invalid for certain (unpaired or duplicated
  tool items, negative windows, unknown enum values, absent targets, provenance the service
  sets), so the answer must be an error.

Seeds: each run draws a fresh seed (:func:`run_seed`), unless ``CE_FUZZ_SEED`` fixes it; the
same seed generates the same cases again. :func:`build_answer_problems` checks a successful
Build answer with validators that share no code with the service (tool pairing in
``tests.support.tool_pairs``, envelopes in ``tests.support.envelope_parser``).
"""

from __future__ import annotations

import functools
import math
import os
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from context_engine.v1 import context_engine_pb2 as pb
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message
from hypothesis import strategies as st

from tests.integration.requests import build_request, conversation, item, plan_request
from tests.support import envelope_parser, tool_pairs

SERVICE = pb.DESCRIPTOR.services_by_name["ContextEngine"]
METHODS: dict[str, tuple[type[Message], type[Message]]] = {
    m.name: (getattr(pb, m.input_type.name), getattr(pb, m.output_type.name))
    for m in SERVICE.methods
}
RPCS = tuple(sorted(METHODS))


def path(rpc: str) -> str:
    return f"/{SERVICE.full_name}/{rpc}"


# ------------------------------------------------------------------ seeds

SEED_ENV = "CE_FUZZ_SEED"


def run_seed() -> int:
    """The seed of this run: ``CE_FUZZ_SEED`` if set (decimal or 0x-hex), else a fresh one."""
    fixed = os.environ.get(SEED_ENV, "").strip()
    if fixed:
        try:
            return int(fixed, 0)
        except ValueError:
            raise ValueError(f"{SEED_ENV}={fixed!r} is not an integer") from None
    return secrets.randbits(32)


def reproduce_hint(seed: int) -> str:
    return f"fuzz seed {seed} (reproduce with {SEED_ENV}={seed})"


@dataclass(frozen=True)
class Case:
    rpc: str
    payload: bytes
    malformed: bool
    label: str

    def __repr__(self) -> str:  # failures print this; keep huge payloads readable
        shown = self.payload[:120]
        more = f"...(+{len(self.payload) - 120} bytes)" if len(self.payload) > 120 else ""
        return f"Case({self.rpc}, {self.label}, malformed={self.malformed}, {shown!r}{more})"


# ------------------------------------------------------------------ boundary values

INT32 = (0, 1, -1, 2**31 - 1, -(2**31), 7, 1000)
INT64 = (0, 1, -1, 2**63 - 1, -(2**63), 2**31, 3)
UINT32 = (0, 1, 2**32 - 1, 2**31, 2**31 - 1, 4000, 200_000)
UINT64 = (0, 1, 2**64 - 1, 2**63, 2**32)
DOUBLES = (0.0, -0.0, 1.0, 0.5, 4.0, 0.4999, 4.0001, -1.0, math.nan, math.inf, -math.inf,
           1e308, 5e-324, 2.0)
WEIRD_TEXT = ("", " ", " lead", "trail ", "a\x00b", "line\nbreak", "tab\t", "\x1f",
              "x" * 257, "é" * 300, "😀" * 40, "\u202eRTL", "\ufeffbom", "web.fetch",
              "tool.call", '{"type":"object"}', "[]", "{nope", "null", "-1",
              "</untrusted:0000>", "open", "completed", "run-1", "u1", "call-1")
HUGE_TEXT = ("y" * 200_000, "z " * 50_000)

text = st.one_of(
    st.sampled_from(WEIRD_TEXT),
    st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=24),
    st.sampled_from(HUGE_TEXT).filter(lambda _: True),
)
small_text = st.one_of(st.sampled_from(WEIRD_TEXT),
                       st.text(alphabet=st.characters(exclude_categories=("Cs",)),
                               max_size=24))


# The strategies below are made once per field (and per message type and depth): a strategy
# built anew at every draw is validated anew too, which once took more of the fuzz test's time
# than the requests did. The same strategy draws the same values from the same choices.
@functools.cache
def enum_values(fd: FieldDescriptor) -> st.SearchStrategy[int]:
    known = [v.number for v in fd.enum_type.values]
    return st.one_of(st.sampled_from(known),
                     st.sampled_from((-1, 99, 2**31 - 1, -(2**31), max(known) + 1)),
                     st.integers(-(2**31), 2**31 - 1))


@functools.cache
def scalar(fd: FieldDescriptor, *, huge: bool) -> st.SearchStrategy[object]:
    t = fd.type
    if t == FieldDescriptor.TYPE_STRING:
        return text if huge else small_text
    if t == FieldDescriptor.TYPE_BYTES:
        return st.one_of(st.binary(max_size=64), st.just(b"\x00" * 70_000))
    if t in (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_SINT32,
             FieldDescriptor.TYPE_SFIXED32):
        return st.one_of(st.sampled_from(INT32), st.integers(-(2**31), 2**31 - 1))
    if t in (FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_SINT64,
             FieldDescriptor.TYPE_SFIXED64):
        return st.one_of(st.sampled_from(INT64), st.integers(-(2**63), 2**63 - 1))
    if t in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32):
        return st.one_of(st.sampled_from(UINT32), st.integers(0, 2**32 - 1))
    if t in (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64):
        return st.one_of(st.sampled_from(UINT64), st.integers(0, 2**64 - 1))
    if t in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return st.one_of(st.sampled_from(DOUBLES), st.floats(allow_nan=True))
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t == FieldDescriptor.TYPE_ENUM:
        return enum_values(fd)
    raise AssertionError(f"no strategy for field type {t}")


def _set(msg: Message, fd: FieldDescriptor, value: object) -> None:
    if fd.type == FieldDescriptor.TYPE_FLOAT and isinstance(value, float) and math.isfinite(
            value) and abs(value) > 3.4e38:
        value = math.inf
    if fd.is_repeated:
        getattr(msg, fd.name).append(value)
    else:
        setattr(msg, fd.name, value)


@functools.cache
def fill(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[Message]:
    """A message of ``descriptor``'s type with any subset of its fields set to boundary values,
    nested messages filled the same way (three levels deep at most)."""
    return _fill(descriptor, depth)


@st.composite
def _fill(draw: st.DrawFn, descriptor: Descriptor, depth: int) -> Message:
    msg: Message = getattr(pb, descriptor.name)() if descriptor.file is pb.DESCRIPTOR else (
        _well_known(descriptor))
    for fd in descriptor.fields:
        if not draw(st.booleans()):
            continue
        count = 1
        if fd.is_repeated:
            count = draw(st.sampled_from((0, 1, 2, 3, 3, 40)))
        for _ in range(count):
            if fd.type == FieldDescriptor.TYPE_MESSAGE:
                if depth >= 3:
                    break
                sub = draw(fill(fd.message_type, depth + 1))
                if fd.is_repeated:
                    getattr(msg, fd.name).add().CopyFrom(sub)
                else:
                    getattr(msg, fd.name).CopyFrom(sub)
            else:
                _set(msg, fd, draw(scalar(fd, huge=count == 1 and depth < 2)))
    return msg


def _well_known(descriptor: Descriptor) -> Message:
    from google.protobuf import symbol_database

    return symbol_database.Default().GetSymbol(descriptor.full_name)()  # type: ignore[no-any-return]


# ------------------------------------------------------------------ wire encoding


def varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def tag(number: int, wire: int) -> bytes:
    return varint((number << 3) | wire)


def length_delimited(number: int, body: bytes) -> bytes:
    return tag(number, 2) + varint(len(body)) + body


def nested_groups(depth: int, number: int = 900) -> bytes:
    """``depth`` groups inside each other in an unknown field: a parser that recurses blows
    its stack or its depth limit."""
    return tag(number, 3) * depth + tag(number, 4) * depth


def nested_messages(depth: int, number: int = 901) -> bytes:
    body = b""
    for _ in range(depth):
        body = length_delimited(number, body)
    return body


INVALID_UTF8 = (b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"a\x80b",
                b"\xe2\x82", b"\xf0\x9f\x98")


def string_field_numbers(cls: type[Message]) -> list[int]:
    return [fd.number for fd in cls.DESCRIPTOR.fields
            if fd.type == FieldDescriptor.TYPE_STRING]


@st.composite
def wire_mutation(draw: st.DrawFn, rpc: str, base: bytes) -> Case:
    """A valid encoding of ``rpc``'s request, then broken (or extended) at the wire level."""
    cls = METHODS[rpc][0]
    how = draw(st.sampled_from(("truncate", "flip", "bad_utf8", "wrong_wire_type", "unknown",
                                "groups", "nested", "overlong_length", "append_garbage")))
    data = bytearray(base)
    if how == "truncate" and data:
        data = data[:draw(st.integers(0, len(data) - 1))]
    elif how == "flip" and data:
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= 1 << draw(st.integers(0, 7))
    elif how == "bad_utf8":
        numbers = string_field_numbers(cls)
        number = draw(st.sampled_from(numbers))
        data += length_delimited(number, draw(st.sampled_from(INVALID_UTF8)))
    elif how == "wrong_wire_type":
        fd = draw(st.sampled_from(list(cls.DESCRIPTOR.fields)))
        wire = draw(st.sampled_from((0, 1, 2, 5)))
        payload = {0: varint(draw(st.integers(0, 2**64 - 1))), 1: b"\x01" * 8,
                   2: varint(3) + b"abc", 5: b"\x01" * 4}[wire]
        data += tag(fd.number, wire) + payload
    elif how == "unknown":
        number = draw(st.integers(100, 2**29 - 1))
        wire = draw(st.sampled_from((0, 1, 2, 5)))
        payload = {0: varint(draw(st.integers(0, 2**64 - 1))), 1: b"\x02" * 8,
                   2: varint(4) + b"\xff\x00\xfe\x01", 5: b"\x03" * 4}[wire]
        data += tag(number, wire) + payload
    elif how == "groups":
        data += nested_groups(draw(st.sampled_from((1, 50, 99, 100, 101, 5000))))
    elif how == "nested":
        data += nested_messages(draw(st.sampled_from((1, 64, 100, 101, 2000))))
    elif how == "overlong_length":
        data += tag(1, 2) + varint(draw(st.sampled_from((2**31, 2**32 + 5, 2**63)))) + b"x"
    else:
        data += draw(st.binary(min_size=1, max_size=32))
    # only the cases that cannot decode, or decode to the request we know to be invalid, are
    # certainly malformed; an unknown field or a flip may leave a valid request
    return Case(rpc, bytes(data), malformed=False, label=f"wire:{how}")


def random_bytes(rpc: str) -> st.SearchStrategy[Case]:
    return st.binary(max_size=600).map(lambda b: Case(rpc, b, malformed=False,
                                                      label="random_bytes"))


def generated(rpc: str) -> st.SearchStrategy[Case]:
    """Any request message of ``rpc`` with boundary values in any fields."""
    cls = METHODS[rpc][0]
    return fill(cls.DESCRIPTOR).map(
        lambda m: Case(rpc, m.SerializeToString(), malformed=False, label="generated"))


# ------------------------------------------------------------------ semantic bases


def _tool_calls(call_id: str = "k1") -> pb.ToolCalls:
    return pb.ToolCalls(calls=[pb.ToolCall(call_id=call_id, name="web.fetch",
                                           arguments_json='{"url":"u"}')])


def _tool_result(call_id: str = "k1") -> pb.ToolResult:
    return pb.ToolResult(call_id=call_id, tool_name="web.fetch", content="ok")


UT = pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED


def unpaired_items() -> list[list[pb.ConversationItem]]:
    """Tool items no provider accepts: each list is certainly invalid."""
    return [
        [item("c", 1, tool_calls=_tool_calls())],                               # call only
        [item("r", 1, UT, tool_result=_tool_result())],                         # result only
        [item("r", 1, UT, tool_result=_tool_result()), item("c", 2, tool_calls=_tool_calls())],
        [item("c", 1, tool_calls=_tool_calls()), item("r", 2, UT, tool_result=_tool_result()),
         item("r2", 3, UT, tool_result=_tool_result())],                        # result twice
        [item("c", 1, tool_calls=pb.ToolCalls(calls=[
            pb.ToolCall(call_id="k1", name="web.fetch", arguments_json="{}"),
            pb.ToolCall(call_id="k1", name="web.fetch", arguments_json="{}")])),
         item("r", 2, UT, tool_result=_tool_result())],                         # call id twice
        [item("c", 1, tool_calls=_tool_calls()), item("c2", 2, tool_calls=_tool_calls()),
         item("r", 3, UT, tool_result=_tool_result())],                         # two calls, one id
        [item("a", 1, user=pb.UserMessage(text="x")), item("a", 2, user=pb.UserMessage(text="y"))],
        [item("c", 1, tool_calls=pb.ToolCalls(calls=[pb.ToolCall(
            call_id="", name="web.fetch", arguments_json="{}")])),
         item("r", 2, UT, tool_result=_tool_result(""))],                       # empty call id
        [item("c", 1, tool_calls=_tool_calls()), item("r", 2, UT, tool_result=_tool_result()),
         item("r", 3, UT, tool_result=_tool_result("k2"))],                     # dup item id
        [item("c", 1, tool_calls=pb.ToolCalls())],                              # no calls at all
        [item("u", 1, trust=0, user=pb.UserMessage(text="x"))],
        [item("u", 1, trust=77, user=pb.UserMessage(text="x"))],
        [item("r", 1, trust=pb.TRUST_LEVEL_PLATFORM, tool_result=_tool_result())],
        [pb.ConversationItem(id="k", sequence=1, trust=pb.TRUST_LEVEL_USER)],
        [item("a", 5, user=pb.UserMessage(text="x")), item("b", -4, user=pb.UserMessage(text="y"))],
    ]


# Each mutator makes a violation that is certain on any session, planned or not, after any
# noise: a catalog's names that collide once sent (``a.b``, ``a__b``) are not one, since a
# re-Plan that has no reason to rotate resolves no tools (tests/integration/test_bad_input.py
# holds that case). test_fuzz.py sends every mutator on its plain base request too.
Mutator = Callable[[Message], None]


def _plan_violations() -> list[Mutator]:
    def tool(**kw: object) -> pb.ToolSpec:
        base: dict[str, object] = {"name": "x.tool", "description": "d",
                                   "input_schema_json": '{"type":"object"}',
                                   "side_effect": pb.SIDE_EFFECT_NONE}
        base.update(kw)
        return pb.ToolSpec(**base)  # type: ignore[arg-type]

    def add_tools(*tools: pb.ToolSpec) -> Mutator:
        return lambda m: m.tool_catalog.extend(tools)  # type: ignore[attr-defined]

    def set_(attr: str, value: object) -> Mutator:
        def mut(m: Message) -> None:
            *parents, last = attr.split(".")
            target = m
            for p in parents:
                target = getattr(target, p)
            setattr(target, last, value)
        return mut

    return [
        set_("agent.version", ""), set_("tenant_id", ""), set_("session_id", "\x00"),
        set_("session.kind", 17), set_("session.kind", -3), set_("model.model_id", ""),
        set_("model.capabilities.context_window", -5),
        set_("model.capabilities.context_window", -(2**31)),
        set_("model.capabilities.output_reserve", 0),
        set_("model.capabilities.breakpoint_budget", -1),
        set_("memory_snapshot.watermark", -1), set_("agent.agent_id", " padded"),
        set_("tenant_id", "t" * 300), set_("persona.revision", "\x00"),
        add_tools(tool(side_effect=0)), add_tools(tool(side_effect=123456)),
        add_tools(tool(input_schema_json="[1]")), add_tools(tool(input_schema_json="{")),
        add_tools(tool(name="tool.call")), add_tools(tool(), tool()),
        add_tools(tool(name="x" * 65)), add_tools(tool(name="has space")),
        lambda m: m.skill_catalog.add(name="s", description="d", trust=42),  # type: ignore[attr-defined]
        lambda m: m.skill_catalog.add(name="s", description="d",  # type: ignore[attr-defined]
                                      trust=pb.TRUST_LEVEL_PLATFORM),
        lambda m: m.memory_snapshot.items.extend(  # type: ignore[attr-defined]
            [pb.MemoryItem(id="m", text="a"), pb.MemoryItem(id="m", text="b")]),
        lambda m: m.principal_scopes.append(""),  # type: ignore[attr-defined]
        lambda m: m.agent.enabled_tools.append(""),  # type: ignore[attr-defined]
        lambda m: m.run.CopyFrom(pb.RunAdmission(run_id="")),  # type: ignore[attr-defined]
        lambda m: m.persona.CopyFrom(pb.Persona(  # type: ignore[attr-defined]
            entries=[pb.PersonaEntry(key="k", text="t")])),
    ]


def _ckpt_items(items: list[pb.ConversationItem]) -> Mutator:
    def mut(m: Message) -> None:
        cp = m.checkpoint  # type: ignore[attr-defined]
        del cp.items[:]
        cp.items.extend(items)
    return mut


def _build_violations() -> list[Mutator]:
    def factor(value: float) -> Mutator:
        return lambda m: setattr(m, "estimator_factor", value)

    out: list[Mutator] = [_ckpt_items(items) for items in unpaired_items()]
    out += [factor(v) for v in (0.0, -1.0, math.nan, math.inf, 4.5, 1e308)]
    out += [
        lambda m: setattr(m, "provider_format", 9),
        lambda m: setattr(m, "provider_format", -1),
        lambda m: setattr(m, "epoch", 2**32 - 1),
        lambda m: setattr(m, "session_id", ""),
        lambda m: m.checkpoint.summary.CopyFrom(pb.Summary(depth=7)),  # type: ignore[attr-defined]
        lambda m: m.checkpoint.knowledge.extend(  # type: ignore[attr-defined]
            [pb.KnowledgePassage(id="p", text="x", trust=pb.TRUST_LEVEL_USER)] * 2),
        lambda m: m.checkpoint.working_state.tasks.add(  # type: ignore[attr-defined]
            id="t", title="x", state="sleeping"),
        lambda m: m.checkpoint.loaded_skills.add(name="s", body="b", trust=55),  # type: ignore[attr-defined]
        lambda m: setattr(m.checkpoint, "active_run_id", "x\n"),  # type: ignore[attr-defined]
        lambda m: m.checkpoint.items.add(  # type: ignore[attr-defined]
            id="att", sequence=10**6, trust=pb.TRUST_LEVEL_USER,
            user=pb.UserMessage(text="x", attachments=[pb.Attachment(kind=42, name="f")])),
    ]
    return out


def _compact_violations() -> list[Mutator]:
    out = [_ckpt_items(items) for items in unpaired_items()]
    out += [
        lambda m: m.ClearField("target"),
        lambda m: setattr(m, "tokens_to_free", 0),
        lambda m: setattr(m, "replace_through_sequence", -(2**63)),
        lambda m: setattr(m, "replace_through_sequence", 0),
        lambda m: setattr(m, "idempotency_key", ""),
        lambda m: setattr(m, "reason", ""),
        lambda m: setattr(m, "max_summary_tokens", 0),
        lambda m: setattr(m, "max_summary_tokens", 2**32 - 1),
        lambda m: setattr(m, "estimator_factor", math.nan),
        lambda m: m.checkpoint.summary.CopyFrom(pb.Summary(  # type: ignore[attr-defined]
            text="s", depth=0, replaced_through_sequence=1)),
        lambda m: m.checkpoint.summary.CopyFrom(pb.Summary(  # type: ignore[attr-defined]
            text="s", depth=1, replaced_through_sequence=-5)),
        lambda m: m.checkpoint.summary.elided.add(  # type: ignore[attr-defined]
            item_id="x", trust_level=pb.TRUST_LEVEL_TRUSTED_CONFIGURATION, kind="tool.result"),
        lambda m: m.checkpoint.summary.elided.add(  # type: ignore[attr-defined]
            item_id="x", trust_level=UT, kind="banana"),
    ]
    return out


def _rotate_violations() -> list[Mutator]:
    return [
        lambda m: setattr(m, "reason", 0),
        lambda m: setattr(m, "reason", 999),
        lambda m: setattr(m, "reason", -7),
        lambda m: setattr(m, "idempotency_key", ""),
        lambda m: setattr(m, "idempotency_key", "k" * 1000),
        lambda m: (setattr(m, "reason", pb.ROTATION_REASON_SECURITY_REVOCATION),
                   m.ClearField("drop_tools")),
        lambda m: (setattr(m, "reason", pb.ROTATION_REASON_SECURITY_REVOCATION),
                   m.drop_tools.extend(["web.fetch", "web.fetch"])),  # type: ignore[attr-defined]
        lambda m: (setattr(m, "reason", pb.ROTATION_REASON_OPERATOR),
                   m.drop_tools.append("web.fetch")),  # type: ignore[attr-defined]
        lambda m: (setattr(m, "reason", pb.ROTATION_REASON_MODEL_ROUTED),
                   m.model.capabilities.CopyFrom(  # type: ignore[attr-defined]
                       pb.ModelCapabilities(context_window=-1))),
        lambda m: (setattr(m, "reason", pb.ROTATION_REASON_OPERATOR),
                   m.model.CopyFrom(pb.ModelSpec(model_id="gpt-4o"))),  # type: ignore[attr-defined]
        lambda m: (setattr(m, "reason", pb.ROTATION_REASON_OPERATOR),
                   m.memory_snapshot.CopyFrom(pb.MemorySnapshot())),  # type: ignore[attr-defined]
        lambda m: setattr(m, "tenant_id", "a\x00"),
    ]


def _usage_violations() -> list[Mutator]:
    return [
        lambda m: setattr(m, "input_tokens", 0),
        lambda m: setattr(m, "estimated_input_tokens", 0),
        lambda m: (setattr(m, "input_tokens", 10), setattr(m, "cached_tokens", 11)),
        lambda m: setattr(m, "estimator_factor", 0.0),
        lambda m: setattr(m, "estimator_factor", math.nan),
        lambda m: setattr(m, "estimator_factor", -math.inf),
        lambda m: setattr(m, "idempotency_key", ""),
        lambda m: setattr(m, "epoch", 2**32 - 1),
        lambda m: setattr(m, "input_tokens", 2**32 - 1),
        lambda m: setattr(m, "estimated_input_tokens", 2**32 - 1),
    ]


def _update_violations() -> list[Mutator]:
    def transition(t: pb.WorkingStateTransition) -> Mutator:
        return lambda m: m.transition.CopyFrom(t)  # type: ignore[attr-defined]

    U = pb.WorkingStateUpdate
    return [
        lambda m: setattr(m, "sequence", 0),
        lambda m: setattr(m, "sequence", -(2**63)),
        lambda m: setattr(m, "run_id", ""),
        lambda m: m.ClearField("transition"),
        transition(pb.WorkingStateTransition(update=U(objective=" "))),
        transition(pb.WorkingStateTransition(update=U(add_constraints=[""]))),
        transition(pb.WorkingStateTransition(update=U(upsert_tasks=[
            pb.WorkingTask(id="t", title="x", state="zzz")]))),
        transition(pb.WorkingStateTransition(update=U(upsert_tasks=[
            pb.WorkingTask(id="t", title="x", state="open", sequence=5)]))),
        transition(pb.WorkingStateTransition(update=U(upsert_tasks=[
            pb.WorkingTask(id="t", title="x", state="open"),
            pb.WorkingTask(id="t", title="y", state="open")]))),
        transition(pb.WorkingStateTransition(update=U(add_facts=[
            pb.WorkingFact(statement="f", trust=pb.TRUST_LEVEL_TRUSTED_CONFIGURATION)]))),
        transition(pb.WorkingStateTransition(update=U(add_facts=[
            pb.WorkingFact(statement="f", trust=pb.TRUST_LEVEL_USER,
                           source_event_ids=[-1])]))),
        transition(pb.WorkingStateTransition(tool_outcome=pb.ToolOutcome(task_id="t",
                                                                         outcome=77))),
        transition(pb.WorkingStateTransition(tool_outcome=pb.ToolOutcome(task_id="",
                                                                         outcome=1))),
        transition(pb.WorkingStateTransition(ask_user=pb.AskUser(question=""))),
        transition(pb.WorkingStateTransition(answer=pb.UserAnswer(question=" "))),
        lambda m: m.current.constraints.extend(["c"] * 21),  # type: ignore[attr-defined]
        lambda m: m.current.open_questions.extend(["q"] * 21),  # type: ignore[attr-defined]
        lambda m: m.current.CopyFrom(pb.WorkingState(  # type: ignore[attr-defined]
            open_questions=["q"], question_origins=[pb.EntryOrigin(sequence=1)] * 2)),
        lambda m: m.current.facts.add(statement="f", trust=99),  # type: ignore[attr-defined]
        lambda m: m.current.tasks.extend(  # type: ignore[attr-defined]
            [pb.WorkingTask(id="t", title="a", state="open")] * 2),
        lambda m: setattr(m, "estimator_factor", math.inf),
    ]


def _carry_violations() -> list[Mutator]:
    ok = pb.WorkingStateTransition(ask_user=pb.AskUser(question="why?"))
    return [
        lambda m: setattr(m, "seed_event_sequence", 0),
        lambda m: setattr(m, "seed_event_sequence", -(2**63)),
        lambda m: m.events.add(sequence=0, run_id="r", transition=ok),  # type: ignore[attr-defined]
        lambda m: m.events.add(sequence=5, run_id="", transition=ok),  # type: ignore[attr-defined]
        lambda m: m.events.add(sequence=5, run_id="r"),  # type: ignore[attr-defined]
        lambda m: m.events.extend([pb.WorkingStateEvent(  # type: ignore[attr-defined]
            sequence=3, run_id="r", transition=ok)] * 2),
        lambda m: m.events.add(  # type: ignore[attr-defined]
            sequence=4, run_id="r", transition=pb.WorkingStateTransition(
                tool_outcome=pb.ToolOutcome(task_id="t", outcome=-2))),
        lambda m: setattr(m, "estimator_factor", -0.0),
    ]


def _getplan_violations() -> list[Mutator]:
    return [
        lambda m: setattr(m, "epoch", 2**32 - 1),
        lambda m: setattr(m, "epoch", 2**31),
        lambda m: setattr(m, "tenant_id", ""),
        lambda m: setattr(m, "session_id", "s" * 257),
        lambda m: setattr(m, "session_id", "tab\there"),
    ]


def _delete_violations() -> list[Mutator]:
    return [
        lambda m: setattr(m, "tenant_id", ""),
        lambda m: setattr(m, "session_id", ""),
        lambda m: setattr(m, "session_id", "s" * 257),
        lambda m: setattr(m, "session_id", "nul\x00here"),
        lambda m: setattr(m, "tenant_id", " padded"),
    ]


VIOLATIONS: dict[str, list[Mutator]] = {
    "Plan": _plan_violations(), "Build": _build_violations(),
    "Compact": _compact_violations(), "Rotate": _rotate_violations(),
    "ReportUsage": _usage_violations(), "UpdateWorkingState": _update_violations(),
    "CarryWorkingState": _carry_violations(), "GetPlan": _getplan_violations(),
    "DeleteSession": _delete_violations(),
}


def base_request(rpc: str, tenant: str, session: str) -> Message:
    """A valid request of ``rpc`` for ``tenant``'s ``session``."""
    if rpc == "Plan":
        return plan_request(tenant, session)
    if rpc == "GetPlan":
        return pb.GetPlanRequest(tenant_id=tenant, session_id=session)
    if rpc == "DeleteSession":
        return pb.DeleteSessionRequest(tenant_id=tenant, session_id=session)
    if rpc == "Build":
        return build_request(tenant, session)
    if rpc == "Rotate":
        return pb.RotateRequest(tenant_id=tenant, session_id=session,
                                reason=pb.ROTATION_REASON_OPERATOR, idempotency_key="k-1")
    if rpc == "ReportUsage":
        return pb.ReportUsageRequest(tenant_id=tenant, session_id=session,
                                     estimated_input_tokens=3000, estimator_factor=1.0,
                                     input_tokens=3100, cached_tokens=2000, output_tokens=50,
                                     idempotency_key="u-1")
    if rpc == "UpdateWorkingState":
        return pb.UpdateWorkingStateRequest(
            tenant_id=tenant, session_id=session, run_id="run-1", sequence=4,
            transition=pb.WorkingStateTransition(update=pb.WorkingStateUpdate(
                objective="Ship it", add_constraints=["no force pushes"])))
    if rpc == "CarryWorkingState":
        return pb.CarryWorkingStateRequest(
            tenant_id=tenant, session_id=session, seed_event_sequence=10,
            events=[pb.WorkingStateEvent(sequence=2, run_id="run-0",
                                         transition=pb.WorkingStateTransition(
                                             ask_user=pb.AskUser(question="Which repo?")))])
    if rpc == "Compact":
        cp = pb.Checkpoint(active_run_id="run-2", items=[
            item("u0", 1, run="run-0", user=pb.UserMessage(text="Earlier question")),
            item("a0", 2, run="run-0", assistant=pb.AssistantMessage(text="Earlier answer")),
            *[item(i.id, i.sequence + 2, trust=i.trust, run="run-2", **{
                i.WhichOneof("kind"): getattr(i, i.WhichOneof("kind"))})  # type: ignore[arg-type]
              for i in conversation()]])
        return pb.CompactRequest(tenant_id=tenant, session_id=session, checkpoint=cp,
                                 replace_through_sequence=2, reason="budget_pressure",
                                 idempotency_key="c-1")
    raise AssertionError(rpc)


@st.composite
def noise(draw: st.DrawFn, rpc: str, msg: Message, *, keep: tuple[str, ...]) -> Message:
    """Overwrite a few top-level fields of ``msg`` (never those in ``keep``) with generated
    boundary values."""
    out = type(msg)()
    out.CopyFrom(msg)
    fields = [fd for fd in out.DESCRIPTOR.fields if fd.name not in keep]
    if not fields:  # nothing but the ids (DeleteSession)
        return out
    chosen = draw(st.lists(st.sampled_from(fields), max_size=2, unique_by=lambda f: f.name))
    for fd in chosen:
        out.ClearField(fd.name)
        if fd.type == FieldDescriptor.TYPE_MESSAGE:
            sub = draw(fill(fd.message_type, 1))
            if fd.is_repeated:
                getattr(out, fd.name).add().CopyFrom(sub)
            else:
                getattr(out, fd.name).CopyFrom(sub)
        else:
            for _ in range(draw(st.integers(1, 3)) if fd.is_repeated else 1):
                _set(out, fd, draw(scalar(fd, huge=False)))
    return out


@st.composite
def malformed(draw: st.DrawFn, rpc: str, tenant: str, session: str) -> Case:
    """A request of ``rpc`` with boundary noise and then one violation that is certain."""
    base = base_request(rpc, tenant, session)
    msg = draw(noise(rpc, base, keep=("tenant_id", "session_id", "idempotency_key")))
    violations = VIOLATIONS[rpc]
    index = draw(st.integers(0, len(violations) - 1))
    violations[index](msg)
    return Case(rpc, msg.SerializeToString(), malformed=True, label=f"violation:{rpc}#{index}")


@st.composite
def boundary(draw: st.DrawFn, rpc: str, tenant: str, session: str) -> Case:
    """A valid request of ``rpc`` with boundary noise: it may well be valid."""
    base = base_request(rpc, tenant, session)
    msg = draw(noise(rpc, base, keep=("tenant_id", "session_id")))
    return Case(rpc, msg.SerializeToString(), malformed=False, label=f"boundary:{rpc}")


# ------------------------------------------------------------------ answer checks


def request_texts(request: pb.ModelRequest) -> Iterator[tuple[str, str]]:
    """Every text of an assembled request that the service composes, with where it is. The
    assistant's messages are left out: they replay the model's own earlier output untouched
    (``AssistantMessageItem``), envelope-like text included, and carry no envelope."""
    for i, block in enumerate(request.prefix_blocks):
        yield f"prefix_blocks[{i}] (row {block.row})", block.text
    for i, message in enumerate(request.messages):
        if message.role != pb.ROLE_ASSISTANT:
            yield f"messages[{i}] ({pb.Role.Name(message.role)})", message.text


def build_answer_problems(payload: bytes, response: pb.BuildResponse) -> list[str]:
    """What is wrong with a successful Build answer to the request ``payload``, read by
    validators independent of the service: every tool call has exactly one later result and
    every result an earlier call (in the request and in the provider body, in the format the
    response says it rendered: the asked one, or the model's default when none was asked);
    every envelope is closed exactly once and no envelope body reads as containing a tag."""
    problems = [f"pairing: {p}" for p in tool_pairs.request_problems(response.request)]
    for where, text in request_texts(response.request):
        try:
            envelope_parser.check_text(text, [])
        except envelope_parser.EnvelopeError as exc:
            problems.append(f"envelope in {where}: {exc}")
    try:
        asked = pb.BuildRequest.FromString(payload).provider_format
    except DecodeError:  # answered OK, so it decoded; keep the check total anyway
        asked = pb.PROVIDER_FORMAT_UNSPECIFIED
    rendered = response.provider_format
    if asked not in (pb.PROVIDER_FORMAT_UNSPECIFIED, pb.PROVIDER_FORMAT_NONE) \
            and rendered != asked:
        problems.append(f"asked for format {asked}, the response says {rendered}")
    if asked == pb.PROVIDER_FORMAT_NONE and (rendered or response.provider_body_json):
        problems.append("asked for no provider body, got one")
    if response.provider_body_json:
        if rendered == pb.PROVIDER_FORMAT_UNSPECIFIED:
            problems.append("a provider body without its format")
        name = pb.ProviderFormat.Name(rendered) if rendered in pb.ProviderFormat.values() \
            else str(rendered)
        problems += [f"provider body {name}: {p}" for p in
                     tool_pairs.body_problems(response.provider_body_json, rendered)]
    elif rendered != pb.PROVIDER_FORMAT_UNSPECIFIED:
        problems.append(f"no provider body for format {rendered}")
    return problems
