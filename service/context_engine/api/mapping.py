"""Proto <-> domain. Every malformed field becomes a BadRequest field violation; nothing is
defaulted silently except what the contract documents (absent model_visible is true, an
unspecified session kind is interactive)."""

from __future__ import annotations

import functools
import hashlib
import math
import re
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from datetime import datetime
from typing import Any, cast

from google.protobuf.message import Message as Message_
from google.protobuf.timestamp_pb2 import Timestamp

from context_engine.adapters.assets import load_model_catalog
from context_engine.api import working_state_tool
from context_engine.domain import providers, ucd
from context_engine.domain import working_state as ws_rules
from context_engine.domain.budget import BudgetReport, Pressure
from context_engine.domain.builder import (
    BuildResult,
    Checkpoint,
    LoadedPlan,
    RuntimeMetadata,
    SkillBody,
    checkpoint_violations,
)
from context_engine.domain.canonical import (
    NOT_AN_OBJECT,
    canonical_json,
    json_object_problem,
    parse_json_object,
)
from context_engine.domain.compaction import (
    DEFAULT_SUMMARY_TOKENS,
    CompactionResult,
    ElidedSpan,
    Target,
)
from context_engine.domain.envelope import plain_name
from context_engine.domain.errors import FieldViolation, InvalidInput
from context_engine.domain.estimator import ModelCatalog
from context_engine.domain.identifiers import (
    MAX_ID_LENGTH,
    erasable_identifier_problem,
    identifier_problem,
)
from context_engine.domain.items import (
    ATTACHMENT_KINDS,
    MAX_DEPTH,
    MAX_SUMMARY_TOKENS,
    ONE_LINE_RULE,
    AssistantMessageItem,
    ConversationItem,
    EntryOrigin,
    HistorySummary,
    KnowledgePassage,
    MemoryLine,
    ReasoningItem,
    ToolCallItem,
    ToolResultItem,
    UserMessageItem,
    WorkingFact,
    WorkingState,
    WorkingTask,
    bad_reference,
    labels,
    splits_line,
)
from context_engine.domain.model import (
    AgentSpec,
    MemoryItem,
    MemorySnapshot,
    Persona,
    PersonaEntry,
    SessionKind,
    SideEffect,
    SkillCatalogEntry,
    ToolSpec,
)
from context_engine.domain.ports import Erased
from context_engine.domain.request import (
    Attachment,
    AttachmentKind,
    Message,
    PrefixBlock,
    Role,
    ToolCall,
    ToolDefinition,
)
from context_engine.domain.tools import CONTROL_TOOLS
from context_engine.domain.trust import TrustLevel
from context_engine.domain.working_state import (
    MAX_CONSTRAINTS,
    MAX_FACTS,
    MAX_OPEN_QUESTIONS,
    MAX_OPEN_TASKS,
    AskUser,
    Changes,
    LogEvent,
    RefusedCall,
    RemoveConstraint,
    ToolOutcome,
    Transition,
    Update,
    UserAnswer,
    UserObjective,
)
from context_engine.engine import (
    CarryCommand,
    CompactCommand,
    CompactOutcome,
    ModelRequestSpec,
    PlanCommand,
    RotateCommand,
    UsageOutcome,
    UsageReport,
    WorkingStateCommand,
)
from context_engine.render_memo import item_held_bytes
from context_engine.v1 import context_engine_pb2 as pb

MAX_EPOCH = 2**31 - 1
TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
TASK_STATES = ("open", "in_progress", "blocked", "completed")


def skill_name(name: str) -> bool:
    """A skill's name: 1 to 64 letters, numbers or marks of any script, '_', '.' or '-', none
    of them a letter that reads as "<" or "/" where a tag could begin, nor a blank one."""
    return 0 < len(name) <= 64 and all(
        c in "_.-" or ucd.category(c)[0] in "LMN" for c in name) and plain_name(name)


TRUST_FROM_PB: dict[pb.TrustLevel.ValueType, TrustLevel] = {
    pb.TRUST_LEVEL_PLATFORM: TrustLevel.PLATFORM,
    pb.TRUST_LEVEL_TRUSTED_CONFIGURATION: TrustLevel.TRUSTED_CONFIGURATION,
    pb.TRUST_LEVEL_USER: TrustLevel.USER,
    pb.TRUST_LEVEL_MEMORY: TrustLevel.MEMORY,
    pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED: TrustLevel.EXTERNAL_UNTRUSTED,
}
TRUST_TO_PB: dict[TrustLevel, pb.TrustLevel.ValueType] = {
    v: k for k, v in TRUST_FROM_PB.items()}
SIDE_EFFECT_FROM_PB: dict[pb.SideEffect.ValueType, SideEffect] = {
    pb.SIDE_EFFECT_NONE: SideEffect.NONE,
    pb.SIDE_EFFECT_WORKSPACE_READ: SideEffect.WORKSPACE_READ,
    pb.SIDE_EFFECT_NETWORK_READ: SideEffect.NETWORK_READ,
    pb.SIDE_EFFECT_WORKSPACE_WRITE: SideEffect.WORKSPACE_WRITE,
    pb.SIDE_EFFECT_NETWORK_WRITE: SideEffect.NETWORK_WRITE,
    pb.SIDE_EFFECT_EXTERNAL_ACTION: SideEffect.EXTERNAL_ACTION,
}
SESSION_KIND_FROM_PB: dict[pb.SessionKind.ValueType, SessionKind] = {
    pb.SESSION_KIND_UNSPECIFIED: SessionKind.INTERACTIVE,
    pb.SESSION_KIND_INTERACTIVE: SessionKind.INTERACTIVE,
    pb.SESSION_KIND_SCHEDULED: SessionKind.SCHEDULED,
    pb.SESSION_KIND_CHILD: SessionKind.CHILD,
    pb.SESSION_KIND_EMAIL: SessionKind.EMAIL,
}
SESSION_KIND_TO_PB: dict[SessionKind, pb.SessionKind.ValueType] = {
    v: k for k, v in SESSION_KIND_FROM_PB.items() if k != pb.SESSION_KIND_UNSPECIFIED}
ROLE_TO_PB = {Role.USER: pb.ROLE_USER, Role.ASSISTANT: pb.ROLE_ASSISTANT, Role.TOOL: pb.ROLE_TOOL}


class Violations:
    """Collects field violations; ``raise_if_any`` raises one InvalidInput with all of them."""

    def __init__(self) -> None:
        self.items: list[FieldViolation] = []

    def add(self, field: str, description: str) -> None:
        self.items.append(FieldViolation(field, description))

    def raise_if_any(self) -> None:
        if self.items:
            raise InvalidInput(self.items)

    def platform_line(self, field: str, value: str) -> None:
        """Text the platform renders as its own words (the runtime metadata of row 14): at
        most MAX_ID_LENGTH characters on one line, no control, format or separator
        characters (a line break there would read as a line of the platform's)."""
        if len(value) > MAX_ID_LENGTH:
            self.add(field, f"is {len(value)} characters; at most {MAX_ID_LENGTH}")
        elif any(ucd.category(c) in ("Cc", "Cf", "Zl", "Zp") for c in value):
            self.add(field, "must be one line without control, format or separator characters "
                     "(it is rendered as the platform's own text)")

    def identifier(self, field: str, value: str) -> None:
        problem = identifier_problem(value)
        if problem is not None:
            self.add(field, problem)

    def trust(self, field: str, value: pb.TrustLevel.ValueType, *,
              at_most: TrustLevel = TrustLevel.TRUSTED_CONFIGURATION) -> TrustLevel:
        """PLATFORM is the service's own text: a caller can never supply it, and data such as
        a tool result can never claim to be configuration."""
        found = TRUST_FROM_PB.get(value)
        if found is None:
            self.add(field, f"unknown trust level {value}"
                     + (" (unspecified)" if value == 0 else ""))
            return TrustLevel.EXTERNAL_UNTRUSTED
        if found.rank > at_most.rank:
            self.add(field, f"{found.value} is not accepted here; at most {at_most.value}")
        return found

    def label(self, field: str, value: pb.TrustLevel.ValueType) -> TrustLevel:
        """The label of text written from the user's or the model's words (a narrative, a
        working-state entry): at most USER, and unset means USER."""
        if value == pb.TRUST_LEVEL_UNSPECIFIED:
            return TrustLevel.USER
        return self.trust(field, value, at_most=TrustLevel.USER)

    def labels(self, field: str, values: Sequence[pb.TrustLevel.ValueType],
               entries: int, what: str) -> tuple[TrustLevel, ...]:
        """One label per entry, or none (USER for each)."""
        if values and len(values) != entries:
            self.add(field, f"has {len(values)} labels for {entries} {what}; one per entry "
                     "or none")
            return ()
        return tuple(self.label(f"{field}[{i}]", t) for i, t in enumerate(values))

    def unique(self, field: str, values: Iterable[str], what: str) -> None:
        seen: set[str] = set()
        for i, v in enumerate(values):
            if v in seen:
                self.add(f"{field}[{i}]", f"duplicate {what} {v!r}")
            seen.add(v)


def _tool(v: Violations, field: str, t: pb.ToolSpec) -> ToolSpec:
    v.identifier(f"{field}.name", t.name)
    if t.name and not TOOL_NAME.fullmatch(t.name):
        v.add(f"{field}.name", "must match [A-Za-z0-9_.-]{1,64} (what providers accept)")
    if t.name in CONTROL_TOOLS:
        v.add(f"{field}.name", f"{t.name!r} is a control tool the service defines itself")
    problem = json_object_problem(t.input_schema_json)
    schema = None if problem is not None else parse_json_object(t.input_schema_json)
    if schema is None:
        v.add(f"{field}.input_schema_json", problem or NOT_AN_OBJECT)
    elif _holds_nul(schema):
        v.add(f"{field}.input_schema_json",
              "must not contain NUL characters (a \\u0000 escape): the plan is stored as "
              "PostgreSQL jsonb, which cannot hold them")
    elif schema.get("type") != "object":
        v.add(f"{field}.input_schema_json",
              'must describe an object ("type": "object"): providers take tool input as one')
    if splits_line(t.server):  # an envelope's attribute in the tool index (row 6)
        v.add(f"{field}.server", ONE_LINE_RULE)
    effect = SIDE_EFFECT_FROM_PB.get(t.side_effect)
    if effect is None:
        v.add(f"{field}.side_effect", f"unknown side effect {t.side_effect}"
              + (" (unspecified)" if t.side_effect == 0 else ""))
    v.unique(f"{field}.required_scopes", t.required_scopes, "scope")
    return ToolSpec(name=t.name, description=t.description, input_schema=schema or {},
                    side_effect=effect or SideEffect.NONE, server=t.server,
                    required_scopes=tuple(sorted(set(t.required_scopes))),
                    model_visible=t.model_visible if t.HasField("model_visible") else True,
                    session_binding=t.session_binding)


def _positive(v: Violations, field: str, msg: pb.ModelCapabilities, name: str) -> int | None:
    if not msg.HasField(name):  # type: ignore[arg-type]
        return None
    value = int(getattr(msg, name))
    if value <= 0:
        v.add(f"{field}.{name}", f"must be positive, got {value}")
        return None
    return value


def _holds_nul(value: object) -> bool:
    """Whether a parsed JSON value has NUL in any string, key or value, at any depth."""
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            if "\x00" in node:
                return True
        elif isinstance(node, dict):
            stack.extend(node)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return False


def _nul_fields(msg: Message_, path: str, v: Violations) -> None:
    """PostgreSQL text and jsonb cannot hold NUL: reject it in any string before storage."""
    for fd, value in msg.ListFields():
        name = f"{path}.{fd.name}" if path else fd.name
        repeated = fd.is_repeated
        values = list(value) if repeated else [value]
        for i, one in enumerate(values):
            where = f"{name}[{i}]" if repeated else name
            if isinstance(one, str) and "\x00" in one:
                v.add(where, "must not contain NUL characters")
            elif isinstance(one, Message_):
                _nul_fields(one, where, v)


def plan_command(req: pb.PlanRequest) -> PlanCommand:
    v = Violations()
    _nul_fields(req, "", v)
    v.identifier("tenant_id", req.tenant_id)
    v.identifier("session_id", req.session_id)
    a = req.agent
    v.identifier("agent.agent_id", a.agent_id)
    v.identifier("agent.version", a.version)
    if a.instructions and not a.instructions.strip():
        # row 3 would be a system block carrying nothing, which Claude refuses (a text block
        # of white space only); empty instructions render no block
        v.add("agent.instructions", "is white space alone: send it empty for no instructions")
    for i, name in enumerate(a.enabled_tools):
        if not name:
            v.add(f"agent.enabled_tools[{i}]", "must not be empty")
    for i, name in enumerate(a.deferred_tools):
        if not name:
            v.add(f"agent.deferred_tools[{i}]", "must not be empty")
    if req.persona.entries and not req.persona.revision:
        v.add("persona.revision", "a persona with entries needs a revision")
    v.unique("persona.entries", (e.key for e in req.persona.entries), "persona key")
    tools = tuple(_tool(v, f"tool_catalog[{i}]", t) for i, t in enumerate(req.tool_catalog))
    v.unique("tool_catalog", (t.name for t in req.tool_catalog), "tool name")
    # (names as providers take them, two mapped to one among them: what the plan defines is
    # checked in its model's own format once drafted, ``providers.sent_name_violations``)
    for i, scope in enumerate(req.principal_scopes):
        if not scope:
            v.add(f"principal_scopes[{i}]", "must not be empty")
    v.identifier("model.model_id", req.model.model_id)
    caps = req.model.capabilities
    window = _positive(v, "model.capabilities", caps, "context_window")
    reserve = _positive(v, "model.capabilities", caps, "output_reserve")
    breakpoints = _breakpoint_budget(v, "model.capabilities", caps)
    kind = SESSION_KIND_FROM_PB.get(req.session.kind)
    if kind is None:
        v.add("session.kind", f"unknown session kind {req.session.kind}")
    skills = []
    for i, s in enumerate(req.skill_catalog):
        # a skill's name is rendered in the platform's own line before its body's envelope
        # ("Loaded skill <name>:"), whatever the entry's trust: a name, not text
        if not skill_name(s.name):
            v.add(f"skill_catalog[{i}].name", "must be 1 to 64 letters, digits, marks, '_', "
                  "'.' or '-' (a skill's name is rendered in the platform's own line, so it "
                  "holds no white space, punctuation or control characters)")
        skills.append(SkillCatalogEntry(name=s.name, description=s.description,
                                        trust=v.trust(f"skill_catalog[{i}].trust", s.trust)))
    v.unique("skill_catalog", (s.name for s in req.skill_catalog), "skill name")
    snap = req.memory_snapshot
    snapshot = _snapshot(v, "memory_snapshot", snap)
    if snap.recall_trace_id and snap.recall_trace_id in req.invalidated_recall_trace_ids:
        # contradicts itself: the snapshot would be planned and found invalid on every Plan
        v.add("memory_snapshot.recall_trace_id", "is listed in invalidated_recall_trace_ids")
    if req.HasField("run"):
        v.identifier("run.run_id", req.run.run_id)
    v.raise_if_any()
    return PlanCommand(
        tenant_id=req.tenant_id, session_id=req.session_id,
        agent=AgentSpec(agent_id=a.agent_id, version=a.version, instructions=a.instructions,
                        enabled_tools=tuple(a.enabled_tools),
                        deferred_tools=tuple(a.deferred_tools),
                        enables_tool_call=a.enables_tool_call,
                        omits_working_state_tool=a.omits_working_state_tool),
        persona=Persona(revision=req.persona.revision,
                        entries=tuple(PersonaEntry(key=e.key, text=e.text)
                                      for e in req.persona.entries)),
        tool_catalog=tools,
        principal_scopes=tuple(sorted(set(req.principal_scopes))),
        model=ModelRequestSpec(model_id=req.model.model_id, context_window=window,
                               output_reserve=reserve, breakpoint_budget=breakpoints),
        session_kind=kind or SessionKind.INTERACTIVE,
        website_profile_id=req.session.website_profile_id,
        skill_catalog=tuple(skills),
        memory_snapshot=snapshot,
        run_id=req.run.run_id if req.HasField("run") else "",
        run_pinned=(req.run.tools_pinned or req.run.has_pending_calls) if req.HasField("run")
        else True,
        invalidated_trace_ids=tuple(req.invalidated_recall_trace_ids),
    )


def _breakpoint_budget(v: Violations, field: str, caps: pb.ModelCapabilities) -> int | None:
    """A model's breakpoint budget where the caller sets one (Plan and a model_routed Rotate
    alike: a negative one stored would fail every later read of the plan)."""
    if not caps.HasField("breakpoint_budget"):
        return None
    if caps.breakpoint_budget < 0:
        v.add(f"{field}.breakpoint_budget", "must not be negative")
        return None
    return caps.breakpoint_budget


def _snapshot(v: Violations, field: str, snap: pb.MemorySnapshot) -> MemorySnapshot:
    """A memory snapshot, checked alike for Plan and a snapshot_invalidated Rotate."""
    for i, item in enumerate(snap.items):
        v.identifier(f"{field}.items[{i}].id", item.id)
    v.unique(f"{field}.items", (i.id for i in snap.items), "memory item id")
    if snap.watermark < 0:
        v.add(f"{field}.watermark", "must not be negative")
    if splits_line(snap.snapshot_id):  # the snapshot envelope's id (row 8)
        v.add(f"{field}.snapshot_id", ONE_LINE_RULE)
    return MemorySnapshot(snapshot_id=snap.snapshot_id, recall_trace_id=snap.recall_trace_id,
                          watermark=snap.watermark,
                          items=tuple(MemoryItem(id=i.id, text=i.text) for i in snap.items))


def session_ids(v: Violations, tenant_id: str, session_id: str) -> None:
    v.identifier("tenant_id", tenant_id)
    v.identifier("session_id", session_id)


def epoch(v: Violations, value: int) -> int | None:
    """0 means the current epoch."""
    if value > MAX_EPOCH:
        v.add("epoch", f"{value} is not an epoch (at most {MAX_EPOCH})")
        return None
    return value or None


ATTACHMENT_KIND_FROM_PB: dict[pb.AttachmentKind.ValueType, AttachmentKind] = {
    pb.ATTACHMENT_KIND_IMAGE: AttachmentKind.IMAGE,
    pb.ATTACHMENT_KIND_PDF: AttachmentKind.PDF,
    pb.ATTACHMENT_KIND_TEXT: AttachmentKind.TEXT,
}
ATTACHMENT_KIND_TO_PB = {v: k for k, v in ATTACHMENT_KIND_FROM_PB.items()}


def _attachment(v: Violations, field: str, a: pb.Attachment) -> Attachment:
    kind = ATTACHMENT_KIND_FROM_PB.get(a.kind)
    if kind is None:
        v.add(f"{field}.kind", f"unknown attachment kind {a.kind}")
    if not a.name:
        v.add(f"{field}.name", "must not be empty")
    if a.text_bytes and not a.text_chars:
        v.add(f"{field}.text_bytes", "is given without text_chars: state both")
    elif a.text_bytes and a.text_bytes < a.text_chars:
        v.add(f"{field}.text_bytes", f"{a.text_bytes} is fewer bytes than text_chars "
              f"{a.text_chars}: a character takes a byte at least")
    elif a.text_bytes > 4 * a.text_chars:
        v.add(f"{field}.text_bytes", f"{a.text_bytes} is more bytes than 4 x text_chars "
              f"{a.text_chars}: a character takes 4 bytes at most")
    return Attachment(kind=kind or AttachmentKind.TEXT, name=a.name, ref=a.ref, pages=a.pages,
                      text_chars=a.text_chars, text_bytes=a.text_bytes)


def attachments_pb(items: Iterable[Attachment]) -> list[pb.Attachment]:
    return [pb.Attachment(kind=ATTACHMENT_KIND_TO_PB[a.kind], name=a.name, ref=a.ref,
                          pages=a.pages, text_chars=a.text_chars, text_bytes=a.text_bytes)
            for a in items]


_REFERENCE_RULE = (f"must be at most {MAX_ID_LENGTH} characters on one line, without control, "
                   "format or separator characters")
_NAME_RULE = "must match [A-Za-z0-9_.-]{1,64} (what providers accept)"
# the trust levels an item may carry without a violation, by kind: a tool result is data and
# can never claim to be configuration
_ITEM_TRUST = {ceiling: {value: level for value, level in TRUST_FROM_PB.items()
                         if level.rank <= ceiling.rank}
               for ceiling in (TrustLevel.USER, TrustLevel.TRUSTED_CONFIGURATION)}


# What ``_reference`` refuses (checkpoint items are checked with it inline): the domain's rule,
# which a summary's pointers keep to as well.
_bad_reference = bad_reference


def _item(v: Violations, field: str, it: pb.ConversationItem) -> ConversationItem:
    kind = it.WhichOneof("kind")
    # a tool result is data: it can never claim to be configuration
    ceiling = TrustLevel.USER if kind == "tool_result" else TrustLevel.TRUSTED_CONFIGURATION
    trust = _ITEM_TRUST[ceiling].get(it.trust)
    if trust is None:  # unknown or above the ceiling: the violation, and what trust() answers
        trust = v.trust(f"{field}.trust", it.trust, at_most=ceiling)
    item_id, sequence, run_id = it.id, it.sequence, it.run_id
    if _bad_reference(item_id):
        v.add(f"{field}.id", _REFERENCE_RULE)
    if _bad_reference(run_id):
        v.add(f"{field}.run_id", _REFERENCE_RULE)
    if kind == "tool_result":
        r = it.tool_result
        artifact_ref, call_id = r.artifact_ref, r.call_id
        if _bad_reference(artifact_ref):
            v.add(f"{field}.tool_result.artifact_ref", _REFERENCE_RULE)
        if _bad_reference(call_id):
            v.add(f"{field}.tool_result.call_id", _REFERENCE_RULE)
        event_id = r.event_id
        if event_id < 0:
            v.add(f"{field}.tool_result.event_id", "must not be negative")
        return ToolResultItem(id=item_id, sequence=sequence, run_id=run_id, item_trust=trust,
                              call_id=call_id, tool_name=r.tool_name, content=r.content,
                              artifact_ref=artifact_ref, event_id=event_id,
                              context_content=r.context_content)
    if kind == "tool_calls":
        calls = []
        for j, c in enumerate(it.tool_calls.calls):
            name, call_id = c.name, c.call_id
            if name and not TOOL_NAME.fullmatch(name):
                v.add(f"{field}.tool_calls.calls[{j}].name", _NAME_RULE)
            if _bad_reference(call_id):
                v.add(f"{field}.tool_calls.calls[{j}].call_id", _REFERENCE_RULE)
            calls.append(ToolCall(call_id=call_id, name=name, arguments_json=c.arguments_json))
        return ToolCallItem(id=item_id, sequence=sequence, run_id=run_id, item_trust=trust,
                            calls=tuple(calls))
    if kind == "user":
        user = it.user
        attachments = tuple(_attachment(v, f"{field}.user.attachments[{i}]", a)
                            for i, a in enumerate(user.attachments))
        return UserMessageItem(id=item_id, sequence=sequence, run_id=run_id, item_trust=trust,
                               text=user.text, attachments=attachments)
    if kind == "assistant":
        return AssistantMessageItem(id=item_id, sequence=sequence, run_id=run_id,
                                    item_trust=trust, text=it.assistant.text)
    if kind == "reasoning":
        return ReasoningItem(id=item_id, sequence=sequence, run_id=run_id, item_trust=trust,
                             provider=it.reasoning.provider, opaque=it.reasoning.opaque)
    v.add(f"{field}.kind", "no item kind is set")
    # refused, but still in its place: the checks of every item (its id, sequence and run)
    # name it and the items after it by their own positions
    return AssistantMessageItem(id=item_id, sequence=sequence, run_id=run_id, item_trust=trust,
                                text="")


_ITEM = "mapping:item"  # render-memo keys (session key, _ITEM, item id)


def _memo_item(v: Violations, index: int, it: pb.ConversationItem,
               memo: MutableMapping[Any, Any], session_key: str,
               wides: list[int] | None) -> ConversationItem:
    """``_item(v, f"checkpoint.items[{index}]", it)``, remembered in ``memo`` under (session
    key, _ITEM, item id) with a copy of ``it``: an item equal to the copy maps to the same
    domain item (the same object, whose strings are hashed already) and the same violations,
    under its index in this checkpoint. Its ``item_held_bytes`` is appended to ``wides``."""
    key = (session_key, _ITEM, it.id)
    found = memo.get(key)
    if found is None or found[0] != it:
        own = Violations()
        held = pb.ConversationItem()
        held.CopyFrom(it)
        mapped = _item(own, "", it)
        found = (held, mapped, tuple((x.field, x.description) for x in own.items),
                 item_held_bytes(mapped))
        memo[key] = found
    if found[2]:
        field = f"checkpoint.items[{index}]"
        for suffix, description in found[2]:
            v.add(field + suffix, description)
    if wides is not None:
        wides.append(found[3])
    item: ConversationItem = found[1]
    return item


def checkpoint(v: Violations, cp: pb.Checkpoint, *, memo: MutableMapping[Any, Any] | None = None,
               session_key: str = "", first_index: int = 0,
               wides: list[int] | None = None) -> Checkpoint:
    """The checkpoint as the domain's, its violations added to ``v``. With ``memo`` (the
    engine's render memo) and the session's key, each item's mapping is kept for the next Build
    of the session, which sends the same items again (see :func:`_memo_item`); the session's
    erasure drops them with its renderings. ``first_index``: the position of ``cp.items[0]``
    in the whole checkpoint (an incremental Build's: the base items it keeps), which names the
    items in violations. ``wides``: each item's ``item_held_bytes`` is appended to it (what a
    kept base counts its items for beyond their serialized sizes)."""
    if _bad_reference(cp.active_run_id):
        v.add("checkpoint.active_run_id", _REFERENCE_RULE)
    if memo is None:
        items = [_item(v, f"checkpoint.items[{i}]", it)
                 for i, it in enumerate(cp.items, first_index)]
        if wides is not None:
            wides.extend(map(item_held_bytes, items))
    else:
        if not session_key:
            raise ValueError("a memo of item mappings is kept per session: name its key")
        items = [_memo_item(v, i, it, memo, session_key, wides)
                 for i, it in enumerate(cp.items, first_index)]
    skills = tuple(SkillBody(name=s.name, body=s.body,
                             trust=v.trust(f"checkpoint.loaded_skills[{i}].trust", s.trust))
                   for i, s in enumerate(cp.loaded_skills))
    state = working_state(v, "checkpoint.working_state", cp.working_state)
    knowledge = tuple(KnowledgePassage(
        id=p.id, source=p.source, text=p.text, rank=p.rank,
        trust=v.trust(f"checkpoint.knowledge[{i}].trust", p.trust))
        for i, p in enumerate(cp.knowledge))
    v.unique("checkpoint.knowledge", (p.id for p in cp.knowledge), "passage id")
    summary = history_summary(v, "checkpoint.summary", cp.summary) if cp.HasField(
        "summary") else None
    runtime = cp.runtime
    v.platform_line("checkpoint.runtime.current_date", runtime.current_date)
    v.platform_line("checkpoint.runtime.surface", runtime.surface)
    for name in ("principal_scopes", "browser_origins"):
        for i, value in enumerate(getattr(runtime, name)):
            v.platform_line(f"checkpoint.runtime.{name}[{i}]", value)
    # memory items' ids, held to the id rule as a snapshot's are: a pressure event names the
    # recall lines it trimmed (PostgreSQL's jsonb holds no NUL), and each is printed in its line
    for i, recalled in enumerate(cp.recall):
        v.identifier(f"checkpoint.recall[{i}].id", recalled.id)
    for i, correction in enumerate(cp.corrections):
        v.identifier(f"checkpoint.corrections[{i}].id", correction.id)
    return Checkpoint(
        summary=summary,
        active_run_id=cp.active_run_id,
        items=tuple(items),
        loaded_skills=skills,
        working_state=state,
        recall=tuple(MemoryLine(id=r.id, text=r.text) for r in cp.recall),
        corrections=tuple(MemoryLine(id=c.id, text=c.text) for c in cp.corrections),
        knowledge=knowledge,
        runtime=RuntimeMetadata(current_date=cp.runtime.current_date,
                                principal_scopes=tuple(cp.runtime.principal_scopes),
                                surface=cp.runtime.surface,
                                browser_origins=tuple(cp.runtime.browser_origins)),
    )


def working_state(v: Violations, field: str, ws: pb.WorkingState) -> WorkingState:
    """A caller's working state (a checkpoint's, or the current one of UpdateWorkingState)."""
    for i, t in enumerate(ws.tasks):
        v.identifier(f"{field}.tasks[{i}].id", t.id)  # rendered in row 12, as an update's
        if t.state not in TASK_STATES:
            v.add(f"{field}.tasks[{i}].state",
                  f"unknown task state {t.state!r}; one of {', '.join(TASK_STATES)}")
    for i, f in enumerate(ws.facts):
        for k, e in enumerate(f.source_event_ids):
            if e <= 0:  # row 12 prints them as the platform's provenance; no update writes one
                v.add(f"{field}.facts[{i}].source_event_ids[{k}]", f"{e} is not an event id")
    facts = tuple(WorkingFact(statement=f.statement, source_event_ids=tuple(f.source_event_ids),
                              # data derived from its source events, as in an update: a
                              # label is required, at most USER (above it, it renders bare)
                              trust=v.trust(f"{field}.facts[{i}].trust", f.trust,
                                            at_most=TrustLevel.USER),
                              sequence=f.sequence, run_id=f.run_id)
                  for i, f in enumerate(ws.facts))
    if len(ws.removed_constraints) > ws_rules.MAX_REMOVED_CONSTRAINTS:
        v.add(f"{field}.removed_constraints", f"holds {len(ws.removed_constraints)}, over the "
              f"{ws_rules.MAX_REMOVED_CONSTRAINTS} the service keeps")
    for i, c in enumerate(ws.constraints):  # as an update's, and as a summary carries them:
        _text(v, f"{field}.constraints[{i}]", c)  # a compaction writes them into its summary
    live = set(ws.constraints)
    for i, removed in enumerate(ws.removed_constraints):
        if removed in live:  # the service never makes one: a constraint added again leaves it
            v.add(f"{field}.removed_constraints[{i}]", "is also among the constraints: a "
                  "state holds a constraint or its removal, not both (a compaction would drop "
                  "the live constraint)")
    if ws.question_origins and len(ws.question_origins) != len(ws.open_questions):
        v.add(f"{field}.question_origins", f"has {len(ws.question_origins)} entries for "
              f"{len(ws.open_questions)} open questions; one per question or none")
    return WorkingState(
        objective=ws.objective, constraints=tuple(ws.constraints),
        tasks=tuple(WorkingTask(id=t.id, title=t.title, state=t.state, sequence=t.sequence,
                                run_id=t.run_id, trust=v.label(f"{field}.tasks[{i}].trust",
                                                               t.trust))
                    for i, t in enumerate(ws.tasks)),
        facts=facts, open_questions=tuple(ws.open_questions), next_action=ws.next_action,
        superseded_objectives=tuple(ws.superseded_objectives),
        question_origins=tuple(
            EntryOrigin(sequence=o.sequence, run_id=o.run_id,
                        trust=v.label(f"{field}.question_origins[{i}].trust", o.trust))
            for i, o in enumerate(ws.question_origins)),
        objective_trust=v.label(f"{field}.objective_trust", ws.objective_trust),
        constraint_trust=v.labels(f"{field}.constraint_trust", ws.constraint_trust,
                                  len(ws.constraints), "constraints"),
        next_action_trust=v.label(f"{field}.next_action_trust", ws.next_action_trust),
        superseded_trust=v.labels(f"{field}.superseded_trust", ws.superseded_trust,
                                  len(ws.superseded_objectives), "superseded objectives"),
        removed_constraints=tuple(ws.removed_constraints))


def _labels_pb(values: Sequence[object],
               given: Sequence[TrustLevel]) -> list[pb.TrustLevel.ValueType]:
    return [TRUST_TO_PB[t] for t in labels(values, given)]


def working_state_pb(s: WorkingState) -> pb.WorkingState:
    return pb.WorkingState(
        objective=s.objective, constraints=list(s.constraints),
        tasks=[pb.WorkingTask(id=t.id, title=t.title, state=t.state, sequence=t.sequence,
                              run_id=t.run_id, trust=TRUST_TO_PB[t.trust]) for t in s.tasks],
        facts=[pb.WorkingFact(statement=f.statement, source_event_ids=list(f.source_event_ids),
                              trust=TRUST_TO_PB[f.trust], sequence=f.sequence,
                              run_id=f.run_id) for f in s.facts],
        open_questions=list(s.open_questions), next_action=s.next_action,
        superseded_objectives=list(s.superseded_objectives),
        question_origins=[pb.EntryOrigin(sequence=o.sequence, run_id=o.run_id,
                                         trust=TRUST_TO_PB[o.trust])
                          for o in s.question_origins],
        objective_trust=TRUST_TO_PB[s.objective_trust] if s.objective
        else pb.TRUST_LEVEL_UNSPECIFIED,
        constraint_trust=_labels_pb(s.constraints, s.constraint_trust),
        next_action_trust=TRUST_TO_PB[s.next_action_trust] if s.next_action
        else pb.TRUST_LEVEL_UNSPECIFIED,
        superseded_trust=_labels_pb(s.superseded_objectives, s.superseded_trust),
        removed_constraints=list(s.removed_constraints))


OUTCOME_FROM_PB: dict[pb.ToolOutcomeKind.ValueType, str] = {
    pb.TOOL_OUTCOME_KIND_STARTED: "started",
    pb.TOOL_OUTCOME_KIND_SUCCEEDED: "succeeded",
    pb.TOOL_OUTCOME_KIND_FAILED: "failed",
}


def _text(v: Violations, field: str, value: str) -> None:
    if not value.strip():
        v.add(field, "must not be empty")


def _update(v: Violations, field: str, u: pb.WorkingStateUpdate) -> Update:
    # One update lists no more than the working state holds (the control tool's own bounds):
    # longer lists could never apply, and applying them costs the square of their length.
    for name, listed, most in (("add_constraints", u.add_constraints, MAX_CONSTRAINTS),
                               ("upsert_tasks", u.upsert_tasks, MAX_OPEN_TASKS),
                               ("add_facts", u.add_facts, MAX_FACTS),
                               ("resolve_questions", u.resolve_questions, MAX_OPEN_QUESTIONS)):
        if len(listed) > most:
            v.add(f"{field}.{name}", f"lists {len(listed)} entries; an update lists at most "
                                     f"{most}, as many as the working state holds")
    if u.HasField("objective"):
        _text(v, f"{field}.objective", u.objective)
    for i, c in enumerate(u.add_constraints):
        _text(v, f"{field}.add_constraints[{i}]", c)
    tasks = []
    for i, t in enumerate(u.upsert_tasks):
        where = f"{field}.upsert_tasks[{i}]"
        v.identifier(f"{where}.id", t.id)
        if t.state not in TASK_STATES:
            v.add(f"{where}.state",
                  f"unknown task state {t.state!r}; one of {', '.join(TASK_STATES)}")
        if t.sequence or t.run_id:
            v.add(where, "sequence and run_id are provenance the service sets; leave them unset")
        if t.title and not t.title.strip():  # as the tool's: empty keeps the task's title
            v.add(f"{where}.title", "must not be blank (leave it empty to keep the task's)")
        # a title derived from content below the update's label keeps the lower label (at
        # most USER, unset means USER): as a fact's, it can only lower the update's
        tasks.append(WorkingTask(id=t.id, title=t.title, state=t.state,
                                 trust=v.label(f"{where}.trust", t.trust)))
    v.unique(f"{field}.upsert_tasks", (t.id for t in u.upsert_tasks), "task id")
    facts = []
    for i, f in enumerate(u.add_facts):
        where = f"{field}.add_facts[{i}]"
        _text(v, f"{where}.statement", f.statement)
        # a fact is data derived from its source events: never configuration
        trust = v.trust(f"{where}.trust", f.trust, at_most=TrustLevel.USER)
        for k, e in enumerate(f.source_event_ids):
            if e <= 0:
                v.add(f"{where}.source_event_ids[{k}]", f"{e} is not an event id")
        if f.sequence or f.run_id:
            v.add(where, "sequence and run_id are provenance the service sets; leave them unset")
        facts.append(WorkingFact(statement=f.statement,
                                 source_event_ids=tuple(f.source_event_ids), trust=trust))
    for i, q in enumerate(u.resolve_questions):
        _text(v, f"{field}.resolve_questions[{i}]", q)
    if u.next_action and not u.next_action.strip():  # as the tool's; empty clears it
        v.add(f"{field}.next_action", "must not be blank (set it empty to clear it)")
    return Update(objective=u.objective if u.HasField("objective") else None,
                  add_constraints=tuple(u.add_constraints), upsert_tasks=tuple(tasks),
                  add_facts=tuple(facts), resolve_questions=tuple(u.resolve_questions),
                  next_action=u.next_action if u.HasField("next_action") else None,
                  trust=v.label(f"{field}.trust", u.trust))


def _tool_call(v: Violations, field: str, c: pb.WorkingStateToolCall) -> Update | RefusedCall:
    """The model's raw call. What the runtime states about it (call id, name, label) is checked
    here; the arguments are the model's, and invalid ones are a refused call: violations with
    a tool result in UpdateWorkingState, a skipped event when carried."""
    v.identifier(f"{field}.call_id", c.call_id)
    if c.name not in working_state_tool.NAMES:
        v.add(f"{field}.name", f"{c.name[:80]!r} is not {' or '.join(working_state_tool.NAMES)}")
    trust = v.label(f"{field}.trust", c.trust)
    parsed = working_state_tool.parse_arguments(c.arguments_json, trust=trust, field=field)
    return parsed if isinstance(parsed, Update) else RefusedCall(violations=tuple(parsed))


def transition(v: Violations, field: str, t: pb.WorkingStateTransition) -> Transition | None:
    kind = t.WhichOneof("kind")
    if kind == "update":
        return _update(v, f"{field}.update", t.update)
    if kind == "tool_call":
        return _tool_call(v, f"{field}.tool_call", t.tool_call)
    if kind == "remove_constraint":
        r = t.remove_constraint
        _text(v, f"{field}.remove_constraint.constraint", r.constraint)
        if r.user_event_id <= 0:
            v.add(f"{field}.remove_constraint.user_event_id",
                  "must be the positive session event id of the user's message or action")
        return RemoveConstraint(constraint=r.constraint, user_event_id=r.user_event_id)
    if kind == "tool_outcome":
        v.identifier(f"{field}.tool_outcome.task_id", t.tool_outcome.task_id)
        outcome = OUTCOME_FROM_PB.get(t.tool_outcome.outcome)
        if outcome is None:
            v.add(f"{field}.tool_outcome.outcome",
                  f"unknown tool outcome {t.tool_outcome.outcome}"
                  + (" (unspecified)" if t.tool_outcome.outcome == 0 else ""))
            return None
        return ToolOutcome(task_id=t.tool_outcome.task_id, outcome=outcome)
    if kind == "ask_user":
        _text(v, f"{field}.ask_user.question", t.ask_user.question)
        return AskUser(question=t.ask_user.question,
                       trust=v.label(f"{field}.ask_user.trust", t.ask_user.trust))
    if kind == "answer":
        _text(v, f"{field}.answer.question", t.answer.question)
        return UserAnswer(question=t.answer.question)
    if kind == "user_objective":
        _text(v, f"{field}.user_objective.objective", t.user_objective.objective)
        return UserObjective(objective=t.user_objective.objective,
                             trust=v.label(f"{field}.user_objective.trust",
                                           t.user_objective.trust))
    v.add(f"{field}.kind", "no transition kind is set")
    return None


def _factor(v: Violations, present: bool, factor: float) -> float | None:
    if not present:
        return None
    if not 0.5 <= factor <= 4.0:
        v.add("estimator_factor", f"{factor} is outside [0.5, 4.0]")
    return factor


def update_working_state_command(req: pb.UpdateWorkingStateRequest) -> WorkingStateCommand:
    v = Violations()
    _nul_fields(req, "", v)
    session_ids(v, req.tenant_id, req.session_id)
    v.identifier("run_id", req.run_id)
    if req.sequence <= 0:
        v.add("sequence", "must be the positive session event sequence of the transition")
    current = working_state(v, "current", req.current)
    v.items.extend(ws_rules.state_violations(current, "current"))  # (a checkpoint's: the scan)
    found = transition(v, "transition", req.transition)
    if isinstance(found, RefusedCall):
        v.items.extend(found.violations)
    factor = _factor(v, req.HasField("estimator_factor"), req.estimator_factor)
    if v.items:
        error = InvalidInput(v.items)
        if isinstance(found, RefusedCall):  # the model's arguments: it reads what was wrong
            error.tool_result = working_state_tool.refused(found.violations,
                                                           "transition.tool_call")
        raise error
    assert found is not None and not isinstance(found, RefusedCall)
    return WorkingStateCommand(tenant_id=req.tenant_id, session_id=req.session_id,
                               run_id=req.run_id, current=current, sequence=req.sequence,
                               transition=found, factor=factor,
                               call_id=(req.transition.tool_call.call_id
                                        if req.transition.HasField("tool_call") else ""))


def carry_command(req: pb.CarryWorkingStateRequest) -> CarryCommand:
    v = Violations()
    _nul_fields(req, "", v)
    session_ids(v, req.tenant_id, req.session_id)
    if req.seed_event_sequence <= 0:
        v.add("seed_event_sequence", "must be the positive sequence of the run's seed event")
    events: list[LogEvent] = []
    for i, e in enumerate(req.events):
        where = f"events[{i}]"
        if e.sequence <= 0:
            v.add(f"{where}.sequence", "must be a positive session event sequence")
        v.identifier(f"{where}.run_id", e.run_id)
        found = transition(v, f"{where}.transition", e.transition)
        if found is not None:
            events.append(LogEvent(sequence=e.sequence, run_id=e.run_id, transition=found))
    v.unique("events", (str(e.sequence) for e in req.events), "event sequence")
    factor = _factor(v, req.HasField("estimator_factor"), req.estimator_factor)
    v.raise_if_any()
    return CarryCommand(tenant_id=req.tenant_id, session_id=req.session_id,
                        seed_event_sequence=req.seed_event_sequence, events=tuple(events),
                        factor=factor)


def change_pb(c: Changes) -> pb.WorkingStateChange:
    return pb.WorkingStateChange(
        transition=c.transition, objective_changed=c.objective_changed,
        objective_superseded=c.objective_superseded, constraints_added=c.constraints_added,
        tasks_upserted=list(c.tasks_upserted), tasks_evicted=list(c.tasks_evicted),
        facts_added=c.facts_added, facts_evicted=c.facts_evicted,
        questions_added=c.questions_added, questions_resolved=c.questions_resolved,
        questions_evicted=c.questions_evicted, next_action_changed=c.next_action_changed,
        tokens=c.tokens, constraints_removed=c.constraints_removed,
        user_event_id=c.user_event_id)


def _timestamp(value: datetime | None) -> Timestamp | None:
    if value is None:
        return None
    ts = Timestamp()
    ts.FromDatetime(value)
    return ts


def blocks_pb(blocks: Iterable[PrefixBlock]) -> list[pb.PrefixBlock]:
    return [pb.PrefixBlock(row=b.row, trust=TRUST_TO_PB[b.trust], text=b.text) for b in blocks]


def tools_pb(tools: Iterable[ToolDefinition]) -> list[pb.ToolDefinition]:
    return [pb.ToolDefinition(name=t.name, description=t.description,
                              input_schema_json=t.input_schema_json) for t in tools]


def plan_pb(loaded: LoadedPlan, *, catalog: ModelCatalog | None = None) -> pb.ContextPlan:
    """``catalog`` gives the model's default provider format (the packaged one when None)."""
    plan, rendered, key = loaded.plan, loaded.rendered, loaded.session_key
    spec = plan.spec
    out = pb.ContextPlan(
        tenant_id=plan.tenant_id, session_id=plan.session_id, epoch=plan.epoch,
        prefix_sha256=plan.prefix_sha256, prefix_tokens=plan.prefix_tokens,
        prefix_classes=[pb.ClassTokens(class_name=c.class_name, tokens=c.tokens, cap=c.cap,
                                       items=c.items, item_cap=c.item_cap)
                        for c in plan.classes],
        model_id=spec.model.model_id, tokenizer=f"{spec.tokenizer} x{spec.model.base_factor:g}",
        context_window=spec.model.context_window, output_reserve=spec.model.output_reserve,
        breakpoint_budget=spec.model.breakpoint_budget,
        tool_names=list(spec.tool_names), deferred_tool_names=list(spec.deferred_tool_names),
        skipped_tool_names=list(spec.skipped_tool_names),
        authority_scope_hashes=list(spec.authority_scope_hashes or ()),
        policy_version=spec.assets.version, builder_version=spec.builder_version,
        cache_ttl=spec.cache_ttl, reason=plan.reason, session_key=key,
        agent_id=spec.agent.agent_id, agent_version=spec.agent.version,
        persona_revision=spec.persona.revision,
        session_kind=SESSION_KIND_TO_PB[spec.session_kind],
        # the snapshot pinned at session open (or by a snapshot_invalidated rotation) and the
        # store watermark it was recalled at: the runtime's recall delta starts there
        snapshot_id=spec.memory_snapshot.snapshot_id,
        snapshot_watermark=spec.memory_snapshot.watermark,
        skill_pins=[pb.SkillPin(name=e.name, sha256=e.sha256) for e in spec.skill_catalog],
        default_provider_format=FORMAT_TO_PB.get(
            default_provider_format(spec.model.model_id, catalog),
            pb.PROVIDER_FORMAT_UNSPECIFIED),
    )
    created = _timestamp(plan.created_at)
    if created is not None:
        out.created_at.CopyFrom(created)
    out.tool_schema_sha256 = rendered.tool_schema_sha256
    out.prefix_blocks.extend(blocks_pb(rendered.blocks))
    out.tools.extend(tools_pb(rendered.tools))
    return out


_WIRE = "mapping:wire"  # render-memo keys (session key, _WIRE, id of a message)
_MESSAGES_TAG = b"\x1a"  # ModelRequest.messages: field 3, length-delimited


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def messages_wire(messages: Sequence[Message], session_key: str,
                  memo: MutableMapping[Any, Any]) -> bytes:
    """``messages`` as the ``messages`` fields of a serialized ModelRequest: what
    ``message_pb`` gives, each message's wire form kept in ``memo`` under (session key, _WIRE,
    its id) beside the message itself. The render memo hands a warm Build the same message
    objects again, so each is serialized once; the entry holds the message, so no other
    object takes its id while it is kept, and the session's erasure drops it with the
    session's renderings (its key starts with the session key)."""
    parts: list[bytes] = []
    for m in messages:
        key = (session_key, _WIRE, id(m))
        found = memo.get(key)
        if found is None or found[0] is not m:
            data = message_pb(m).SerializeToString()
            found = (m, _MESSAGES_TAG + _varint(len(data)) + data)
            memo[key] = found
        parts.append(found[1])
    return b"".join(parts)


def message_pb(m: Message) -> pb.Message:
    return _message_fields(pb.Message(row=m.row, role=ROLE_TO_PB[m.role],
                                      trust=TRUST_TO_PB[m.trust]), m)


def _message_fields(out: pb.Message, m: Message) -> pb.Message:
    """The rest of ``m``'s fields on ``out``: only those not at their default (setting a
    default is a no-op on the wire, and costs a field lookup)."""
    if m.item_id:
        out.item_id = m.item_id
    if m.text:
        out.text = m.text
    for c in m.tool_calls:
        out.tool_calls.add(call_id=c.call_id, name=c.name, arguments_json=c.arguments_json)
    if m.call_id:
        out.call_id = m.call_id
    if m.reasoning_provider:
        out.reasoning_provider = m.reasoning_provider
    if m.reasoning_opaque:
        out.reasoning_opaque = m.reasoning_opaque
    if m.attachments:  # passed through for the runtime's own provider adapter
        out.attachments.extend(attachments_pb(m.attachments))
    return out


# The proto's provider formats; NONE and UNSPECIFIED are requests, not formats.
FORMAT_FROM_PB: dict[pb.ProviderFormat.ValueType, str] = {
    pb.PROVIDER_FORMAT_ANTHROPIC_MESSAGES: providers.ANTHROPIC_MESSAGES,
    pb.PROVIDER_FORMAT_OPENAI_RESPONSES: providers.OPENAI_RESPONSES,
    pb.PROVIDER_FORMAT_OPENAI_CHAT_COMPLETIONS: providers.OPENAI_CHAT_COMPLETIONS,
    pb.PROVIDER_FORMAT_GEMINI_GENERATE_CONTENT: providers.GEMINI_GENERATE_CONTENT,
    pb.PROVIDER_FORMAT_BEDROCK_CONVERSE: providers.BEDROCK_CONVERSE,
}
FORMAT_TO_PB: dict[str, pb.ProviderFormat.ValueType] = {v: k for k, v in FORMAT_FROM_PB.items()}
# What requested_provider_format answers for UNSPECIFIED: the model's default format, which
# build_pb resolves from the model catalog ("" is NONE: no body).
MODEL_DEFAULT_FORMAT = "model_default"


@functools.cache
def packaged_catalog() -> ModelCatalog:
    """The model catalog the service ships (``data/models.json``), for callers that pass none:
    the default formats of a server started with another ``CE_MODEL_CATALOG`` come from that
    one only when its catalog is passed in."""
    return load_model_catalog()


def requested_provider_format(v: Violations, value: pb.ProviderFormat.ValueType) -> str:
    """The provider body Build was asked for: a ``providers`` format name,
    :data:`MODEL_DEFAULT_FORMAT` (UNSPECIFIED: the model's default, resolved by
    :func:`build_pb`) or "" (NONE: no body)."""
    if value == pb.PROVIDER_FORMAT_UNSPECIFIED:
        return MODEL_DEFAULT_FORMAT
    if value == pb.PROVIDER_FORMAT_NONE:
        return ""
    found = FORMAT_FROM_PB.get(value)
    if found is None:
        v.add("provider_format", f"unknown provider format {value}")
        return ""
    return found


def default_provider_format(model_id: str, catalog: ModelCatalog | None = None) -> str:
    """The format Build renders for ``model_id`` when asked for none: the catalog entry's
    (not the pinned plan's: a stored plan never changes with the catalog); "" for a model the
    catalog does not know or gives none."""
    return (catalog or packaged_catalog()).default_format(model_id)


def build_pb(result: BuildResult, provider_format: str = "", *,
             catalog: ModelCatalog | None = None, messages: Sequence[Message] | None = None,
             prefix: bool = True, memo: MutableMapping[Any, Any] | None = None
             ) -> pb.BuildResponse:
    """``provider_format`` ("" for none, :data:`MODEL_DEFAULT_FORMAT` for the model's default
    from ``catalog``, the packaged one when None) also renders the request as that provider's
    body, and a Gemini body its explicit cached content. ``messages`` (default: all of the
    request's) and ``prefix`` (prefix blocks and tools, default sent) choose what of the request
    the response carries; the provider bodies are always of the whole request. ``memo`` (the
    engine's render memo) keeps each message's wire form: see :func:`messages_wire`."""
    req = result.request
    catalog = catalog or packaged_catalog()
    entry = catalog.lookup(result.model_id)
    fmt = provider_format
    if fmt == MODEL_DEFAULT_FORMAT:
        fmt = entry.provider_format if entry else ""
    # a model the catalog does not know: the five-minute TTL every caching model takes
    body = providers.render(result, fmt, long_ttl=entry is not None and entry.long_ttl) \
        if fmt else None
    sent = req.messages if messages is None else messages
    out = pb.BuildResponse(
        prefix_sha256=result.prefix_sha256, epoch=result.epoch, model_id=result.model_id,
        session_key=result.session_key, prefix_tokens=result.prefix_tokens,
        body_tokens=result.body_tokens, estimated_input_tokens=result.estimated_input_tokens,
        context_window=result.context_window, output_reserve=result.output_reserve,
        estimator_factor=result.estimator_factor, tokenizer=result.tokenizer,
        budget=budget_pb(result.budget),
        estimated_attachment_tokens=result.attachment_tokens,
        cache_breakpoints=[pb.CacheBreakpoint(name=b.name, ttl=b.ttl, through_item=b.through_item,
                                              through_input_item=b.through_input_item)
                           for b in result.cache_breakpoints],
        provider_body_json=canonical_json(body) if body is not None else "",
        provider_format=FORMAT_TO_PB[fmt] if body is not None else pb.PROVIDER_FORMAT_UNSPECIFIED)
    pressure_into(out.pressure, result.pressure, memo, result.session_key)  # in place, too
    request = out.request  # filled in place: no copy of the whole request
    request.SetInParent()  # present even when it carries nothing (an incremental response)
    if prefix:
        request.prefix_blocks.extend(blocks_pb(req.prefix_blocks))
        request.tools.extend(tools_pb(req.tools))
    if memo is None:
        add = request.messages.add
        for m in sent:
            _message_fields(add(row=m.row, role=ROLE_TO_PB[m.role], trust=TRUST_TO_PB[m.trust]),
                            m)
    else:  # the messages come after the prefix: field 3 of the request
        request.MergeFromString(messages_wire(sent, result.session_key, memo))
    if body is not None and fmt == providers.GEMINI_GENERATE_CONTENT:
        out.gemini_cached_content.CopyFrom(gemini_cached_content_pb(
            result, body, entry.min_cacheable_tokens if entry else 0))
    return out


def gemini_cached_content_pb(result: BuildResult, body: Mapping[str, Any],
                             min_cacheable_tokens: int) -> pb.GeminiCachedContent:
    cached = providers.gemini_cached_content(result, body,
                                             min_cacheable_tokens=min_cacheable_tokens)
    return pb.GeminiCachedContent(
        display_name=cached.display_name, ttl=cached.ttl,
        create_body_json=canonical_json(cached.create_body),
        cached_body_json=canonical_json(cached.cached_body), holds=list(cached.holds),
        estimated_tokens=cached.estimated_tokens,
        min_cacheable_tokens=cached.min_cacheable_tokens)


def budget_pb(b: BudgetReport) -> pb.BudgetReport:
    return pb.BudgetReport(
        total_tokens=b.total_tokens, output_reserve=b.output_reserve,
        safety_margin_ratio=b.safety_margin_ratio, margin_tokens=b.margin_tokens,
        prefix_tokens=b.prefix_tokens, body_budget=b.body_budget, body_tokens=b.body_tokens,
        estimated_total=b.estimated_total, estimator_factor=b.estimator_factor,
        history_floor=b.history_floor,
        classes=[pb.ClassBudget(class_name=c.class_name, cap=c.cap, used=c.used, items=c.items,
                                yielded=c.yielded) for c in b.classes])


_STEP_IDS = "mapping:step-ids"  # render-memo keys (session key, _STEP_IDS, step name)
STEP_IDS_KEPT = 256  # a step naming at least this many ids keeps them on the wire (memo)


def pressure_pb(p: Pressure, memo: MutableMapping[Any, Any] | None = None,
                session_key: str = "") -> pb.Pressure:
    """``memo`` (the engine's render memo): a step naming many ids (STEP_IDS_KEPT) is copied
    from the ids its session's last response named at that step, kept in protobuf form, once
    they are brought up to these (see :func:`step_ids`): a long session's yielded ids move on
    by a few per turn, and copying them inside protobuf does not read each id's string
    again."""
    out = pb.Pressure()
    pressure_into(out, p, memo, session_key)
    return out


def pressure_into(out: pb.Pressure, p: Pressure, memo: MutableMapping[Any, Any] | None = None,
                  session_key: str = "") -> None:
    """``pressure_pb`` written into ``out`` (an empty Pressure, such as a response's own: a
    long session's yielded ids are not copied once more into the response), present even
    where every field is its default."""
    out.SetInParent()
    out.compact_through_sequence = p.compact_through_sequence
    out.fits, out.tokens_before, out.tokens_after = p.fits, p.tokens_before, p.tokens_after
    out.compaction_needed, out.left_out_items = p.compaction_needed, p.left_out_items
    out.left_out_tokens, out.history_cut_index = p.left_out_tokens, p.cut_index
    out.summary_floor_index, out.legacy_tool_excerpts = p.floor_index, p.legacy_tool_excerpts
    out.history_floor_shortfall = p.history_floor_shortfall
    for s in p.steps:
        step = out.steps.add(step=s.step, units=s.units, tokens_before=s.tokens_before,
                             tokens_after=s.tokens_after)
        if memo is None or len(s.ids) < STEP_IDS_KEPT:
            step.item_ids.extend(s.ids)
        else:
            step.MergeFrom(step_ids(s.ids, memo, (session_key, _STEP_IDS, s.step)))


def step_ids(ids: tuple[str, ...], memo: MutableMapping[Any, Any],
             key: tuple[str, str, str]) -> pb.YieldStep:
    """A YieldStep holding ``ids`` alone, kept in ``memo`` under ``key`` with the ids it
    holds. Where the kept ids, less a few at their start, begin ``ids`` (the usual turn: the
    cut moved on, what it leaves out or what is a pointer named anew at the end), the kept
    message is brought up to ``ids`` in place; otherwise it is built anew."""
    found = memo.get(key)
    if found is not None and ids:
        held, kept = cast(tuple[tuple[str, ...], pb.YieldStep], found)
        if held == ids:
            return kept
        try:
            start = held.index(ids[0])
        except ValueError:
            start = -1
        if start >= 0 and held[start:] == ids[:len(held) - start]:
            del kept.item_ids[:start]
            kept.item_ids.extend(ids[len(held) - start:])
            memo[key] = (ids, kept)
            return kept
    kept = pb.YieldStep(item_ids=ids)
    memo[key] = (ids, kept)
    return kept


def usage_report(req: pb.ReportUsageRequest) -> UsageReport:
    v = Violations()
    session_ids(v, req.tenant_id, req.session_id)
    ep = epoch(v, req.epoch)
    v.identifier("idempotency_key", req.idempotency_key)
    if req.estimated_input_tokens <= 0:
        v.add("estimated_input_tokens", "must be positive")
    if req.input_tokens <= 0:
        v.add("input_tokens", "must be positive")
    if req.cached_tokens > req.input_tokens:
        v.add("cached_tokens", "cannot exceed input_tokens (which counts cached tokens too)")
    if not 0.5 <= req.estimator_factor <= 4.0:
        v.add("estimator_factor", f"{req.estimator_factor} is outside [0.5, 4.0]: pass the "
              "factor Build echoed for this request")
    if req.estimated_attachment_tokens > req.estimated_input_tokens:
        v.add("estimated_attachment_tokens",
              f"{req.estimated_attachment_tokens} is over estimated_input_tokens "
              f"({req.estimated_input_tokens}), of which it is a part: pass the "
              "estimated_attachment_tokens Build answered for this request")
    v.raise_if_any()
    return UsageReport(tenant_id=req.tenant_id, session_id=req.session_id, epoch=ep,
                       estimated_input_tokens=req.estimated_input_tokens,
                       estimator_factor=req.estimator_factor, input_tokens=req.input_tokens,
                       cached_tokens=req.cached_tokens, output_tokens=req.output_tokens,
                       idempotency_key=req.idempotency_key,
                       estimated_attachment_tokens=req.estimated_attachment_tokens)


def usage_pb(outcome: UsageOutcome) -> pb.ReportUsageResponse:
    r = outcome.reconciled
    return pb.ReportUsageResponse(
        model_id=outcome.model_id, previous_factor=r.previous_factor,
        correction_factor=r.calibration.factor, error_ratio=r.error_ratio,
        counted=outcome.counted, reports=r.calibration.reports)



ROTATION_REASON_FROM_PB: dict[pb.RotationReason.ValueType, str] = {
    pb.ROTATION_REASON_SECURITY_REVOCATION: "security_revocation",
    pb.ROTATION_REASON_MODEL_ROUTED: "model_routed",
    pb.ROTATION_REASON_SNAPSHOT_INVALIDATED: "snapshot_invalidated",
    pb.ROTATION_REASON_OPERATOR: "operator",
}


def rotate_command(req: pb.RotateRequest) -> RotateCommand:
    v = Violations()
    session_ids(v, req.tenant_id, req.session_id)
    v.identifier("idempotency_key", req.idempotency_key)
    reason = ROTATION_REASON_FROM_PB.get(req.reason)
    if reason is None:
        v.add("reason", f"unknown rotation reason {req.reason}"
              + (" (unspecified)" if req.reason == 0 else ""))
    if reason == "security_revocation" and not req.drop_tools:
        v.add("drop_tools", "a security revocation names the tools to drop")
    if reason != "security_revocation" and req.drop_tools:
        v.add("drop_tools", "only a security revocation drops tools")
    v.unique("drop_tools", req.drop_tools, "tool")
    model = None
    if reason == "model_routed":
        v.identifier("model.model_id", req.model.model_id)
        caps = req.model.capabilities
        model = ModelRequestSpec(
            model_id=req.model.model_id,
            context_window=_positive(v, "model.capabilities", caps, "context_window"),
            output_reserve=_positive(v, "model.capabilities", caps, "output_reserve"),
            breakpoint_budget=_breakpoint_budget(v, "model.capabilities", caps))
    elif req.HasField("model"):
        v.add("model", "only a model_routed rotation takes a model")
    snapshot = None
    if reason == "snapshot_invalidated":
        snapshot = _snapshot(v, "memory_snapshot", req.memory_snapshot)
    elif req.HasField("memory_snapshot"):
        v.add("memory_snapshot", "only a snapshot_invalidated rotation takes a snapshot")
    _nul_fields(req, "", v)
    v.raise_if_any()
    assert reason is not None
    return RotateCommand(tenant_id=req.tenant_id, session_id=req.session_id, reason=reason,
                         idempotency_key=req.idempotency_key, drop_tools=tuple(req.drop_tools),
                         model=model, snapshot=snapshot)


ELIDED_KINDS = ("tool.result", "user.message", "assistant.message", "tool.call",
                *ATTACHMENT_KINDS)


def _reference(v: Violations, field: str, value: str) -> None:
    """Ids and references are rendered into platform text (pointers, summaries): one line,
    bounded, no control characters."""
    if _bad_reference(value):
        v.add(field, _REFERENCE_RULE)


def _elided(v: Violations, field: str, e: pb.ElidedSpan) -> ElidedSpan:
    _reference(v, f"{field}.item_id", e.item_id)
    _reference(v, f"{field}.artifact_ref", e.artifact_ref)
    # a pointer stands for data: its label can never claim configuration
    trust = v.trust(f"{field}.trust_level", e.trust_level, at_most=TrustLevel.USER)
    if e.kind not in ELIDED_KINDS:
        v.add(f"{field}.kind", f"{e.kind!r} is not one of {', '.join(ELIDED_KINDS)}")
    if e.event_id < 0:  # 0: no event (the pointer names its item); row 9 prints the rest
        v.add(f"{field}.event_id", "must not be negative")
    return ElidedSpan(item_id=e.item_id, trust_level=trust, byte_length=e.byte_length,
                      artifact_ref=e.artifact_ref or None, event_id=e.event_id, kind=e.kind)


def history_summary(v: Violations, field: str, s: pb.Summary) -> HistorySummary | None:
    """A checkpoint's summary, as row 9 renders it; None for an empty message (a runtime that
    always sets the field)."""
    if not (s.text or s.source_event_ids or s.depth or s.constraints or s.elided
            or s.replaced_through_sequence):
        return None
    if s.replaced_through_sequence < 0:
        v.add(f"{field}.replaced_through_sequence", "must not be negative")
    if s.depth > MAX_DEPTH:
        v.add(f"{field}.depth", f"{s.depth} is over the cap of {MAX_DEPTH}")
    for i, c in enumerate(s.constraints):
        _text(v, f"{field}.constraints[{i}]", c)
    for i, e in enumerate(s.source_event_ids):  # event sequences, 0 or more, as Compact wrote
        if e < 0:
            v.add(f"{field}.source_event_ids[{i}]", f"{e} is not an event id")
    return HistorySummary(
        text=s.text, replaced_through_sequence=s.replaced_through_sequence,
        narrative_trust=v.label(f"{field}.trust", s.trust),
        source_event_ids=tuple(s.source_event_ids), depth=s.depth,
        constraints=tuple(s.constraints),
        constraint_trust=v.labels(f"{field}.constraint_trust", s.constraint_trust,
                                  len(s.constraints), "constraints"),
        elided=tuple(_elided(v, f"{field}.elided[{i}]", e) for i, e in enumerate(s.elided)))


def fingerprint(req: pb.CompactRequest) -> str:
    """The request without its key, byte-exact: a retry must repeat its request exactly."""
    copy = pb.CompactRequest()
    copy.CopyFrom(req)
    copy.idempotency_key = ""
    return hashlib.sha256(copy.SerializeToString(deterministic=True)).hexdigest()


def compact_command(req: pb.CompactRequest) -> CompactCommand:
    v = Violations()
    _nul_fields(req, "", v)
    session_ids(v, req.tenant_id, req.session_id)
    v.identifier("idempotency_key", req.idempotency_key)
    v.identifier("reason", req.reason)
    cp = checkpoint(v, req.checkpoint)
    v.items.extend(checkpoint_violations(cp))
    current = cp.summary
    if current is not None and current.depth == 0 and (current.text
                                                        or current.source_event_ids):
        v.add("checkpoint.summary.depth", "a summary written by Compact has depth 1 or 2")
    which = req.WhichOneof("target")
    target = Target()
    if which is None:
        v.add("target", "name tokens_to_free or replace_through_sequence")
    elif which == "tokens_to_free":
        if req.tokens_to_free == 0:
            v.add("tokens_to_free", "must be positive")
        target = Target(tokens_to_free=req.tokens_to_free)
    else:
        if req.replace_through_sequence <= 0:
            v.add("replace_through_sequence", "must be a positive event sequence")
        target = Target(replace_through=req.replace_through_sequence)
    cap = DEFAULT_SUMMARY_TOKENS
    if req.HasField("max_summary_tokens"):
        cap = req.max_summary_tokens
        if not 1 <= cap <= MAX_SUMMARY_TOKENS:
            v.add("max_summary_tokens", f"{cap} is outside [1, {MAX_SUMMARY_TOKENS}]")
    factor = _factor(v, req.HasField("estimator_factor"), req.estimator_factor)
    v.raise_if_any()
    return CompactCommand(tenant_id=req.tenant_id, session_id=req.session_id, checkpoint=cp,
                          current=current, target=target, reason=req.reason,
                          idempotency_key=req.idempotency_key, fingerprint=fingerprint(req),
                          max_summary_tokens=cap, factor=factor)


def summary_pb(r: CompactionResult) -> pb.Summary:
    return pb.Summary(
        text=r.summary, replaced_through_sequence=r.replaced_through_sequence,
        source_event_ids=list(r.source_event_ids), depth=r.depth,
        constraints=list(r.constraints),
        elided=[pb.ElidedSpan(item_id=s.item_id, trust_level=TRUST_TO_PB[s.trust_level],
                              byte_length=s.byte_length, artifact_ref=s.artifact_ref or "",
                              event_id=s.event_id, kind=s.kind) for s in r.elided],
        trust=TRUST_TO_PB[r.narrative_trust],
        constraint_trust=_labels_pb(r.constraints, r.constraint_trust))


def compact_pb(outcome: CompactOutcome) -> pb.CompactResponse:
    r = outcome.result
    return pb.CompactResponse(
        summary=summary_pb(r), tokens_before=r.tokens_before, tokens_after=r.tokens_after,
        compactor_version=r.compactor_version, summarizer_version=r.summarizer_version,
        replaced_item_ids=list(r.replaced_item_ids), compacted=outcome.compacted)


def delete_session_ids(req: pb.DeleteSessionRequest) -> tuple[str, str]:
    """The ids are held to the earlier rule (``erasable_identifier_problem``): a session stored
    under an id a release before this one accepted can still be erased."""
    v = Violations()
    for field, value in (("tenant_id", req.tenant_id), ("session_id", req.session_id)):
        problem = erasable_identifier_problem(value)
        if problem is not None:
            v.add(field, problem)
    v.raise_if_any()
    return req.tenant_id, req.session_id


def delete_session_pb(erased: Erased, plan_cache_seconds: float) -> pb.DeleteSessionResponse:
    """``plan_cache_seconds``: the plan-cache TTL, rounded up to whole seconds."""
    return pb.DeleteSessionResponse(
        deleted=erased.deleted, plans=erased.plans, events=erased.events,
        compactions=erased.compactions, idempotency_keys=erased.idempotency_keys,
        usage_rows=erased.usage_rows, deleted_at=_timestamp(erased.erased_at),
        plan_cache_seconds=min(math.ceil(plan_cache_seconds), 2**32 - 1))
