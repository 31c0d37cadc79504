"""One item type per assembly row (spec: "Two regions and one rule").

Each type declares its ``row``, ``region`` and ``trust`` as class attributes; ``trust = None``
declares that the trust is carried per item or per entry. The base class declares none of them,
so a type that forgets its declaration fails at assembly (``assemble``), never by default.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import ClassVar

from context_engine.domain import ucd
from context_engine.domain.canonical import canonical_json
from context_engine.domain.envelope import FOLD, FOLD_9, envelope, escape_content
from context_engine.domain.errors import AssemblyError
from context_engine.domain.identifiers import MAX_ID_LENGTH
from context_engine.domain.model import (
    MemorySnapshot,
    Persona,
    SkillCatalogEntry,
    ToolSpec,
)
from context_engine.domain.request import Attachment, Message, Role, ToolCall, ToolDefinition
from context_engine.domain.trust import Region, TrustLevel, lowest

_UNDECLARED = object()
# every character str.splitlines() breaks at, and the other C0 and C1 controls
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


# categories of the characters that break or hide part of a line: controls (C0, DEL, C1 such
# as NEL), format characters (bidi controls, zero-width ones), line and paragraph separators;
# what ids may not hold
_NOT_ONE_LINE = frozenset(("Cc", "Cf", "Zl", "Zp"))

ONE_LINE_RULE = ("must be one line, without control characters (a tab aside), line or "
                 "paragraph separators, bidi embedding, override or isolate controls, tag "
                 "characters or annotation marks: it is an envelope's attribute")
# what an envelope's attribute may not hold, fewer than an id: what breaks its line or
# reorders it (controls but the tab, separators, bidi embeddings, overrides and isolates) and
# what carries text unseen (tag characters, which a model may read, and the interlinear
# annotation marks); joiners, marks and soft hyphens are text (Persian needs the zero-width
# non-joiner, an emoji family the joiner)
_SPLITS = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069"
                     "\ufff9-\ufffb\U000e0000-\U000e007f]")


def splits_line(text: str) -> bool:
    """Whether ``text``, an envelope's attribute, holds a character that breaks its line or
    reorders it (:data:`ONE_LINE_RULE`)."""
    return _SPLITS.search(text) is not None


def breaks_line(text: str) -> bool:
    """Whether ``text`` holds a character that breaks or hides part of a line (printable ASCII
    holds none, so only other text is searched)."""
    return not (text.isascii() and text.isprintable()) and any(
        ucd.category(c) in _NOT_ONE_LINE for c in text)


def bad_reference(value: str) -> bool:
    """Whether ``value`` cannot be an id or reference a pointer line prints as the platform's
    own words: too long, or a character that breaks or hides part of a line (a control
    character, C0, DEL or C1 such as NEL; a format character, bidi controls and zero-width
    ones; a line or paragraph separator). The API refuses such ids and references, and a
    summary that would hold one leaves it out."""
    return len(value) > MAX_ID_LENGTH or breaks_line(value)


# What a pointer line prints as it is: one token of the characters ids and references are
# usually made of. Anything else (white space, parentheses, quotes, brackets, "<" or ">", any
# non-ASCII character) is printed as a JSON string with its delimiter syntax escaped, so that
# an id cannot write a trust label, a size, an arrow or an envelope tag into a line the
# platform speaks.
_PLAIN_TOKEN = re.compile(r"[A-Za-z0-9._:/@#=+?&%~,;!*$'-]+")


def pointer_token(value: str) -> str:
    """``value`` as a pointer line prints it (``_PLAIN_TOKEN``)."""
    if _PLAIN_TOKEN.fullmatch(value):
        return value
    return escape_content(json.dumps(value, ensure_ascii=False))


# What an attachment pointer's size counts, by its kind (``ElidedSpan.byte_length`` holds the
# size the message gave the attachment in: a PDF's pages, a text file's characters; an image
# is sized by none).
ATTACHMENT_KINDS = {"attachment.image": "", "attachment.pdf": "page",
                    "attachment.text": "character"}


def attachment_pointer_kind(attachment: Attachment) -> str:
    return f"attachment.{attachment.kind.value}"


def attachment_size(attachment: Attachment) -> int:
    """The size an attachment pointer states, in its kind's unit (``ATTACHMENT_KINDS``)."""
    unit = ATTACHMENT_KINDS[attachment_pointer_kind(attachment)]
    return attachment.pages if unit == "page" else attachment.text_chars if unit else 0


def _size(kind: str, size: int) -> str:
    unit = ATTACHMENT_KINDS.get(kind)
    if unit is None:
        return f"{size:,} bytes"
    if not unit:
        return kind.removeprefix("attachment.")
    return f"{size:,} {unit}{'' if size == 1 else 's'}"


def pointer_line(kind: str, item_id: str, trust: TrustLevel, size: int, artifact_ref: str,
                 event_id: int) -> str:
    """``[elided] <kind> <id> (<trust>, <size> bytes) -> <ref>``: where the whole content
    lives (its artifact and its event, when known), every caller-supplied part a
    ``pointer_token``. An attachment's pointer (kind ``attachment.<pdf|text|image>``, at its
    message's id and label) states its size in pages or characters, an image's none."""
    event = f"event:{event_id}" if event_id else ""
    if artifact_ref:
        ref = pointer_token(artifact_ref) + (f" ({event})" if event else "")
    else:
        ref = event or f"item:{pointer_token(item_id)}"
    return one_line(f"[elided] {kind} {pointer_token(item_id)} ({trust.value}, "
                    f"{_size(kind, size)}) -> {ref}")


def one_line(text: str) -> str:
    """Platform text built from caller-supplied ids stays on one line (a backstop: ids with
    control characters are rejected at the boundary)."""
    return _CONTROL.sub(" ", text)


@dataclass(frozen=True, kw_only=True, slots=True)
class RenderContext:
    """What rendering may depend on besides the item: the session key, for envelope nonces,
    and for Region A re-rendered from a plan an older builder pinned, that builder's fold
    (``envelope.FOLDS``): its fold of look-alikes (``envelope._opens_delimiter``) and, before
    @9, its cut of an index entry's first sentence (:func:`first_sentence`)."""

    session_key: str
    fold: int = FOLD


@dataclass(frozen=True, kw_only=True, slots=True)
class ContextItem:
    """Base of every assembled item. Declares no row, region or trust on purpose."""

    row: ClassVar[int]
    region: ClassVar[Region]
    trust: ClassVar[TrustLevel | None]


def declaration(cls: type) -> tuple[int, Region, TrustLevel | None]:
    """The (row, region, trust) a type declares, or AssemblyError naming what is missing."""
    row = getattr(cls, "row", _UNDECLARED)
    region = getattr(cls, "region", _UNDECLARED)
    trust = getattr(cls, "trust", _UNDECLARED)
    missing = [n for n, v in (("row", row), ("region", region), ("trust", trust))
               if v is _UNDECLARED]
    if missing:
        raise AssemblyError(f"{cls.__name__} declares no {', '.join(missing)}")
    if not isinstance(region, Region) or not isinstance(row, int) or not 1 <= row <= 15:
        raise AssemblyError(f"{cls.__name__} declares an invalid row or region")
    if (row <= 8) != (region is Region.A):
        raise AssemblyError(f"{cls.__name__}: row {row} is not in region {region.value}")
    assert trust is None or isinstance(trust, TrustLevel)
    return row, region, trust


def assemble(items: list[ContextItem], region: Region) -> list[ContextItem]:
    """Order ``items`` by their declared row (stable within a row); every item must declare
    its row and region, and belong to ``region``."""
    keyed: list[tuple[int, int, ContextItem]] = []
    for position, item in enumerate(items):
        row, item_region, _ = declaration(type(item))
        if item_region is not region:
            raise AssemblyError(
                f"{type(item).__name__} belongs to region {item_region.value}, "
                f"not {region.value}")
        keyed.append((row, position, item))
    keyed.sort(key=lambda k: (k[0], k[1]))
    return [k[2] for k in keyed]


# ---------------------------------------------------------------- Region A (rows 1-8)

@dataclass(frozen=True, kw_only=True, slots=True)
class PlatformPolicy(ContextItem):
    row: ClassVar[int] = 1
    region: ClassVar[Region] = Region.A
    trust: ClassVar[TrustLevel | None] = TrustLevel.PLATFORM
    text: str

    def render(self, ctx: RenderContext) -> str:
        return self.text


@dataclass(frozen=True, kw_only=True, slots=True)
class Framing(ContextItem):
    row: ClassVar[int] = 2
    region: ClassVar[Region] = Region.A
    trust: ClassVar[TrustLevel | None] = TrustLevel.PLATFORM
    text: str

    def render(self, ctx: RenderContext) -> str:
        return self.text


@dataclass(frozen=True, kw_only=True, slots=True)
class AgentInstructions(ContextItem):
    row: ClassVar[int] = 3
    region: ClassVar[Region] = Region.A
    trust: ClassVar[TrustLevel | None] = TrustLevel.TRUSTED_CONFIGURATION
    text: str

    def render(self, ctx: RenderContext) -> str:
        return self.text


@dataclass(frozen=True, kw_only=True, slots=True)
class PersonaRow(ContextItem):
    row: ClassVar[int] = 4
    region: ClassVar[Region] = Region.A
    trust: ClassVar[TrustLevel | None] = TrustLevel.TRUSTED_CONFIGURATION
    persona: Persona

    def render(self, ctx: RenderContext) -> str:
        if not self.persona.entries:
            return ""  # an empty persona renders no bytes
        lines = ["Persona:"] + [f"- {e.key}: {e.text}" for e in self.persona.entries]
        return "\n".join(lines)


def model_visible_schema(schema: dict[str, object]) -> str:
    return canonical_json(schema)


@dataclass(frozen=True, kw_only=True, slots=True)
class ToolDefinitions(ContextItem):
    """Row 5 renders as the request's tool definitions, not as text."""

    row: ClassVar[int] = 5
    region: ClassVar[Region] = Region.A
    trust: ClassVar[TrustLevel | None] = TrustLevel.TRUSTED_CONFIGURATION
    tools: tuple[ToolSpec, ...]  # sorted by name

    def definitions(self) -> tuple[ToolDefinition, ...]:
        return tuple(ToolDefinition(name=t.name, description=t.description,
                                    input_schema_json=model_visible_schema(t.input_schema))
                     for t in self.tools)

    def render(self, ctx: RenderContext) -> str:
        return ""


# Words a "." after which ends no sentence (compared lower-cased, without their final "."):
# besides these, a capital alone (an initial: "J.") and single letters joined by dots
# ("e.g.", "i.e.", "U.S.") are abbreviations too.
ABBREVIATIONS = frozenset({"etc", "vs", "cf", "dr", "mr", "mrs", "ms", "st", "no", "approx",
                           "incl", "esp"})
_OPENING = {")": "(", "]": "[", "}": "{"}
# what may stand before an abbreviation in its word ("(e.g." "[cf.")
_LEADING = "([{\"'\u201c\u2018"


def _abbreviation(word: str) -> bool:
    """Whether ``word``, the text before a "." back to the last space, is an abbreviation."""
    word = word.lstrip(_LEADING)
    if len(word) == 1:
        return ucd.category(word) == "Lu"
    parts = word.split(".")
    return ucd.lower(word) in ABBREVIATIONS or (len(parts) > 1 and all(
        len(p) == 1 and ucd.category(p)[0] == "L" for p in parts))


def _enclosed(flat: str) -> list[bool]:
    """For each position of ``flat``: whether it lies between a bracket, parenthesis or brace
    and the one that closes it later. A close matches the nearest open of its kind still open
    (those opened after it are left open); one that matches none, and an open never closed,
    enclose nothing."""
    opened: list[tuple[str, int]] = []
    depth = [0] * (len(flat) + 1)  # +1 where an enclosed stretch starts, -1 after it ends
    for i, ch in enumerate(flat):
        if ch in "([{":
            opened.append((ch, i))
        elif ch in _OPENING:
            at = next((k for k in range(len(opened) - 1, -1, -1)
                       if opened[k][0] == _OPENING[ch]), None)
            if at is not None:
                depth[opened[at][1]] += 1
                depth[i + 1] -= 1
                del opened[at:]
    inside, level = [], 0
    for step in depth[:-1]:
        level += step
        inside.append(level > 0)
    return inside


def first_sentence(text: str, fold: int = FOLD) -> str:
    """The description's first sentence, its white space flattened to single spaces.

    From builder@9 (``fold`` ``FOLD_9``; an index pinned before it is re-rendered with the rule
    before, ``builder.load_plan``) a sentence ends at a ".", "!" or "?" followed by a space
    (or at the end of the text) unless: it is a "." after an abbreviation (``ABBREVIATIONS``,
    an initial: "J.", or single letters joined by dots: "e.g.", "i.e."); or it lies inside
    parentheses, brackets or braces the text closes later. The case of the next word does not
    matter (descriptions written in lower case are common: "list the files. returns names."
    is cut after "files."). Deterministic, and no more: a sentence that ends after a capital
    alone ("of size N. Then") runs on, and one ending in an abbreviation not listed ("fig.")
    ends there. Before @9 a sentence ended at any ".", "!" or "?" followed by a space."""
    flat = " ".join(text.split())
    if fold < FOLD_9:
        for i, ch in enumerate(flat):
            if ch in ".!?" and (i + 1 == len(flat) or flat[i + 1] == " "):
                return flat[:i + 1]
        return flat
    inside: list[bool] | None = None
    for i, ch in enumerate(flat):
        if ch not in ".!?" or i + 1 == len(flat) or flat[i + 1] != " ":
            continue
        if ch == "." and _abbreviation(flat[flat.rfind(" ", 0, i) + 1:i]):
            continue
        if inside is None:
            inside = _enclosed(flat)
        if inside[i]:
            continue
        return flat[:i + 1]
    return flat


def index_entry(tool: ToolSpec, fold: int = FOLD) -> str:
    """``name(required..., optional?...): first sentence`` — required parameters in the order of
    the schema's ``required`` array, optional ones by name (jsonb keeps no key order); the
    sentence as ``fold``'s builder cut it (:func:`first_sentence`)."""
    props = tool.input_schema.get("properties")
    names = sorted(props) if isinstance(props, dict) else []
    req = tool.input_schema.get("required")
    required = [r for r in req if isinstance(r, str)] if isinstance(req, list) else []
    optional = [n for n in names if n not in required]
    params = ", ".join(required + [f"{n}?" for n in optional])
    return f"{tool.name}({params}): {first_sentence(tool.description, fold)}"


def entry_trust(tool: ToolSpec) -> TrustLevel:
    """Builtin index entries are configuration; a server's description is external text."""
    return TrustLevel.TRUSTED_CONFIGURATION if tool.builtin else TrustLevel.EXTERNAL_UNTRUSTED


INDEX_HEADER = "Deferred tools (call them through tool.call with name and arguments):"


def index_line(tool: ToolSpec, ctx: RenderContext) -> str:
    """One rendered index entry; external entries in their own envelope."""
    return "- " + envelope(trust=entry_trust(tool), source=f"tool-index:{tool.server}",
                           item_id=tool.name, content=index_entry(tool, ctx.fold),
                           session_key=ctx.session_key,
                           fold=ctx.fold)


@dataclass(frozen=True, kw_only=True, slots=True)
class DeferredToolIndex(ContextItem):
    row: ClassVar[int] = 6
    region: ClassVar[Region] = Region.A
    trust: ClassVar[TrustLevel | None] = None  # per entry
    tools: tuple[ToolSpec, ...]  # index order

    def block_trust(self) -> TrustLevel:
        return lowest([entry_trust(t) for t in self.tools], TrustLevel.TRUSTED_CONFIGURATION)

    def render(self, ctx: RenderContext) -> str:
        if not self.tools:
            return ""  # an empty index renders no bytes
        return "\n".join([INDEX_HEADER] + [index_line(t, ctx) for t in self.tools])


@dataclass(frozen=True, kw_only=True, slots=True)
class SkillCatalogRow(ContextItem):
    row: ClassVar[int] = 7
    region: ClassVar[Region] = Region.A
    trust: ClassVar[TrustLevel | None] = None  # per entry
    entries: tuple[SkillCatalogEntry, ...]

    def block_trust(self) -> TrustLevel:
        return lowest([e.trust for e in self.entries], TrustLevel.TRUSTED_CONFIGURATION)

    def render(self, ctx: RenderContext) -> str:
        if not self.entries:
            return ""  # an empty catalog renders no bytes
        lines = ["Skills (load one with skill.load):"]
        for e in self.entries:
            lines.append("- " + envelope(trust=e.trust, source="skill-catalog", item_id=e.name,
                                         content=f"{e.name}: {e.description}",
                                         session_key=ctx.session_key,
                                         fold=ctx.fold))
        return "\n".join(lines)


@dataclass(frozen=True, kw_only=True, slots=True)
class MemorySnapshotRow(ContextItem):
    row: ClassVar[int] = 8
    region: ClassVar[Region] = Region.A
    trust: ClassVar[TrustLevel | None] = TrustLevel.MEMORY
    snapshot: MemorySnapshot

    def render(self, ctx: RenderContext) -> str:
        if not self.snapshot.items:
            return ""
        body = "\n".join(f"- [{i.id}] {i.text}" for i in self.snapshot.items)
        return "Memory at session open:\n" + envelope(
            trust=TrustLevel.MEMORY, source="memory:snapshot",
            item_id=self.snapshot.snapshot_id or "snapshot", content=body,
            session_key=ctx.session_key,
            fold=ctx.fold)


RegionAItem = (PlatformPolicy | Framing | AgentInstructions | PersonaRow | ToolDefinitions
               | DeferredToolIndex | SkillCatalogRow | MemorySnapshotRow)


# ---------------------------------------------------------------- Region B (rows 9-15)

def labelled_envelopes(entries: Sequence[tuple[str, TrustLevel]], *, source: str,
                       item_id: str, ctx: RenderContext) -> list[str]:
    """Lines of text derived from content below TRUSTED_CONFIGURATION, each pair (line, label)
    in order: consecutive lines with one label share one envelope carrying that label, so
    nothing is re-ordered and no line is rendered above its own label."""
    out: list[str] = []
    i = 0
    while i < len(entries):
        j = i
        while j < len(entries) and entries[j][1] is entries[i][1]:
            j += 1
        out.append(envelope(trust=entries[i][1], source=source,
                            item_id=f"{item_id}:{i}" if len(entries) > 1 else item_id,
                            content="\n".join(line for line, _ in entries[i:j]),
                            session_key=ctx.session_key))
        i = j
    return out


def labels(values: Sequence[object], given: Sequence[TrustLevel]) -> tuple[TrustLevel, ...]:
    """One label per value: ``given`` when it has one per value, USER for each otherwise (the
    label of the user's and the model's own words, the highest any such entry may carry)."""
    if len(given) == len(values):
        return tuple(given)
    return tuple(TrustLevel.USER for _ in values)


@dataclass(frozen=True, kw_only=True, slots=True)
class ElidedSpan:
    """An untrusted (or tool-data) span a summary points to instead of paraphrasing."""

    item_id: str
    trust_level: TrustLevel
    byte_length: int
    artifact_ref: str | None
    event_id: int
    # tool.result, user.message, assistant.message, tool.call, or an attachment of a replaced
    # user message: attachment.pdf, attachment.text or attachment.image (``ATTACHMENT_KINDS``;
    # its ``byte_length`` is then its pages, its characters or 0)
    kind: str = "tool.result"

    def pointer(self) -> str:
        return pointer_line(self.kind, self.item_id, self.trust_level, self.byte_length,
                            self.artifact_ref or "", self.event_id)


SUMMARY_CONSTRAINTS_HEADER = "Constraints (verbatim, never merged away):"
SUMMARY_ELIDED_HEADER = ("Elided (untrusted or tool data, never summarized; re-fetch by "
                         "reference, it returns inside its envelope):")
SUMMARY_SOURCES_HEADER = "Source event ids:"
# A summary's depth cap: a summary merges earlier summaries at most this deep (a compaction
# that would go deeper fails; the runtime escalates instead)
MAX_DEPTH = 2
# The largest cap a compaction's summary may be asked to fit (``max_summary_tokens``)
MAX_SUMMARY_TOKENS = 32_000
# The least a summary's narrative is given room for, beside its envelope, where there is
# anything to narrate (a goal, questions, decisions, an earlier narrative): measured as this
# text, sixteen one-token words, about fifty characters of prose. A compaction that cannot
# give it that is refused, and a Build does not call for one that could not
NARRATIVE_FLOOR = " ".join(["word"] * 16)


@dataclass(frozen=True, kw_only=True, slots=True)
class HistorySummary(ContextItem):
    """Row 9: the compacted history summary, as a compaction wrote it. The platform authors
    only its headings, depth, range, pointer lines and provenance; the narrative (written from
    the replaced conversation) and the constraints (set by the user or the model) are data and
    render inside envelopes carrying their own labels: a summary never launders the words it
    was written from into the platform's voice."""

    row: ClassVar[int] = 9
    region: ClassVar[Region] = Region.B
    trust: ClassVar[TrustLevel | None] = None  # per part
    text: str  # the narrative
    replaced_through_sequence: int
    narrative_trust: TrustLevel = TrustLevel.USER  # the lowest label of its sources
    source_event_ids: tuple[int, ...] = ()
    depth: int = 1
    constraints: tuple[str, ...] = ()
    constraint_trust: tuple[TrustLevel, ...] = ()  # one per constraint, or none: USER
    elided: tuple[ElidedSpan, ...] = ()

    def as_of(self, state: WorkingState) -> HistorySummary:
        """The summary's constraints as the working state now has them: without those the user
        has removed since it was written, and each one the state holds too at no higher label
        than the state's (a constraint the user removed and a call after untrusted content set
        again is that call's now, not the user's: the summary's copy does not say otherwise).
        The summary itself where nothing changes."""
        if not self.constraints:
            return self
        removed = set(state.removed_constraints)
        live = dict(zip(state.constraints, labels(state.constraints, state.constraint_trust),
                        strict=True))
        pairs = list(zip(self.constraints, labels(self.constraints, self.constraint_trust),
                         strict=True))
        kept = [(c, t if c not in live or t.rank <= live[c].rank else live[c])
                for c, t in pairs if c not in removed]
        if kept == pairs:
            return self
        return replace(self, constraints=tuple(c for c, _ in kept),
                       constraint_trust=tuple(t for _, t in kept))

    def part_labels(self) -> list[TrustLevel]:
        found = list(labels(self.constraints, self.constraint_trust))
        if self.text:
            found.append(self.narrative_trust)
        return found

    def messages(self, ctx: RenderContext) -> list[Message]:
        depth = f"depth {self.depth}; " if self.depth else ""
        lines = [f"Summary of the earlier conversation ({depth}it replaces events through "
                 f"{self.replaced_through_sequence}):"]
        if self.text:
            lines.append(envelope(trust=self.narrative_trust, source="summary",
                                  item_id="summary", content=self.text,
                                  session_key=ctx.session_key))
        if self.constraints:
            lines.append(SUMMARY_CONSTRAINTS_HEADER)
            lines += labelled_envelopes(
                [(f"- {c}", t) for c, t in zip(self.constraints, labels(
                    self.constraints, self.constraint_trust), strict=True)],
                source="summary", item_id="summary:constraints", ctx=ctx)
        if self.elided:
            lines.append(SUMMARY_ELIDED_HEADER)
            lines += [s.pointer() for s in self.elided]
        if self.source_event_ids:
            lines.append(SUMMARY_SOURCES_HEADER + " "
                         + ", ".join(str(i) for i in self.source_event_ids))
        return [Message(row=9, role=Role.USER,
                        trust=lowest(self.part_labels(), TrustLevel.PLATFORM),
                        text="\n".join(lines))]


@dataclass(frozen=True, kw_only=True, slots=True)
class ConversationItem(ContextItem):
    """Row 10: retained conversation items and completed active exchanges, oldest first."""

    row: ClassVar[int] = 10
    region: ClassVar[Region] = Region.B
    trust: ClassVar[TrustLevel | None] = None  # per item
    id: str
    sequence: int
    run_id: str
    item_trust: TrustLevel


@dataclass(frozen=True, kw_only=True, slots=True)
class UserMessageItem(ConversationItem):
    text: str
    attachments: tuple[Attachment, ...] = ()

    def messages(self, ctx: RenderContext) -> list[Message]:
        # an attachment's label (its name is the sender's) is part of the message: inside its
        # envelope, escaped with it; labels are counted for every reference (ADR-0120)
        content = self.text + "".join(f"\n{a.label()}" for a in self.attachments)
        text = envelope(trust=self.item_trust, source="user", item_id=self.id,
                        content=content, session_key=ctx.session_key)
        return [Message(row=self.row, role=Role.USER, trust=self.item_trust, item_id=self.id,
                        text=text, attachments=self.attachments)]


@dataclass(frozen=True, kw_only=True, slots=True)
class AssistantMessageItem(ConversationItem):
    """The model's own earlier output, replayed untouched in the assistant role (providers
    require replayed continuations verbatim); envelopes mark data handed to the model."""

    text: str

    def messages(self, ctx: RenderContext) -> list[Message]:
        return [Message(row=self.row, role=Role.ASSISTANT, trust=self.item_trust,
                        item_id=self.id, text=self.text)]


@dataclass(frozen=True, kw_only=True, slots=True)
class ToolCallItem(ConversationItem):
    """One assistant step's tool calls; parallel calls share the item."""

    calls: tuple[ToolCall, ...]

    def messages(self, ctx: RenderContext) -> list[Message]:
        return [Message(row=self.row, role=Role.ASSISTANT, trust=self.item_trust,
                        item_id=self.id, tool_calls=self.calls)]


@dataclass(frozen=True, kw_only=True, slots=True)
class ToolResultItem(ConversationItem):
    """A tool result. ``content`` is what is rendered: the canonical content, its persisted
    ``context_content`` excerpt, or a deterministic head/tail excerpt (see excerpts.py).
    ``elided`` renders a typed pointer instead, inside the same envelope with the same trust."""

    call_id: str
    tool_name: str
    content: str
    artifact_ref: str = ""
    event_id: int = 0
    context_content: str = ""
    byte_length: int = 0  # of the canonical content; 0: len(content) in UTF-8
    elided: bool = False

    @property
    def bytes(self) -> int:
        return self.byte_length or len(self.content.encode("utf-8"))

    def pointer(self) -> str:
        """spec: "Untrusted content is elided, never paraphrased" — the pointer states that
        content existed, what it was, how large, where it lives, and its trust."""
        return pointer_line("tool.result", self.id, self.item_trust, self.bytes,
                            self.artifact_ref, self.event_id)

    def messages(self, ctx: RenderContext) -> list[Message]:
        content = self.pointer() if self.elided else self.content
        return [Message(row=self.row, role=Role.TOOL, trust=self.item_trust, item_id=self.id,
                        call_id=self.call_id,
                        text=envelope(trust=self.item_trust, source=f"tool:{self.tool_name}",
                                      item_id=self.id, content=content,
                                      session_key=ctx.session_key))]


@dataclass(frozen=True, kw_only=True, slots=True)
class ReasoningItem(ConversationItem):
    """Provider-opaque reasoning: replayed verbatim within its run, never rendered into text,
    summarized or logged (its repr hides the payload)."""

    provider: str
    opaque: bytes

    def __repr__(self) -> str:
        return f"ReasoningItem(id={self.id!r}, run_id={self.run_id!r}, bytes={len(self.opaque)})"

    def messages(self, ctx: RenderContext) -> list[Message]:
        return [Message(row=self.row, role=Role.ASSISTANT, trust=self.item_trust,
                        item_id=self.id, reasoning_provider=self.provider,
                        reasoning_opaque=self.opaque)]


@dataclass(frozen=True, kw_only=True, slots=True)
class SkillBodyItem(ContextItem):
    row: ClassVar[int] = 11
    region: ClassVar[Region] = Region.B
    trust: ClassVar[TrustLevel | None] = None  # per skill
    name: str
    body: str
    skill_trust: TrustLevel

    def messages(self, ctx: RenderContext) -> list[Message]:
        text = f"Loaded skill {self.name}:\n" + envelope(
            trust=self.skill_trust, source=f"skill:{self.name}", item_id=f"skill:{self.name}",
            content=self.body, session_key=ctx.session_key)
        return [Message(row=11, role=Role.USER, trust=self.skill_trust, text=text)]


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkingTask:
    id: str
    title: str
    state: str
    # provenance (working_state.py): the sequence of its last transition and the run of it
    sequence: int = 0
    run_id: str = ""
    trust: TrustLevel = TrustLevel.USER  # of its title: the transition that wrote it


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkingFact:
    statement: str
    source_event_ids: tuple[int, ...]
    trust: TrustLevel
    # provenance (working_state.py): the sequence it was established at and the run of it
    sequence: int = 0
    run_id: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class EntryOrigin:
    """Where a working-state entry came from: its event sequence (its age), run and label."""

    sequence: int = 0
    run_id: str = ""
    trust: TrustLevel = TrustLevel.USER


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkingState:
    objective: str = ""
    constraints: tuple[str, ...] = ()
    tasks: tuple[WorkingTask, ...] = ()
    facts: tuple[WorkingFact, ...] = ()
    open_questions: tuple[str, ...] = ()
    next_action: str = ""
    # earlier objectives, oldest first: an objective is superseded, never silently replaced
    superseded_objectives: tuple[str, ...] = ()
    # one per open question, same order; empty for a state written without provenance
    question_origins: tuple[EntryOrigin, ...] = ()
    # Labels of the text entries (the transition that wrote each): one per constraint and per
    # superseded objective, or none (USER for each).
    objective_trust: TrustLevel = TrustLevel.USER
    constraint_trust: tuple[TrustLevel, ...] = ()
    next_action_trust: TrustLevel = TrustLevel.USER
    superseded_trust: tuple[TrustLevel, ...] = ()
    # constraints the user removed this session: a summary that retained one stops showing it
    removed_constraints: tuple[str, ...] = ()

    def question_labels(self) -> tuple[TrustLevel, ...]:
        if len(self.question_origins) == len(self.open_questions):
            return tuple(o.trust for o in self.question_origins)
        return tuple(TrustLevel.USER for _ in self.open_questions)

    @property
    def empty(self) -> bool:
        return not (self.objective or self.constraints or self.tasks or self.facts
                    or self.open_questions or self.next_action)


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkingStateItem(ContextItem):
    """Row 12: platform-rendered, with per-entry trust: a fact derived from content below
    TRUSTED_CONFIGURATION renders as an attributed claim with its source event ids; a USER
    fact resting on no event renders in its envelope alone, as the other entries do."""

    row: ClassVar[int] = 12
    region: ClassVar[Region] = Region.B
    trust: ClassVar[TrustLevel | None] = None  # per entry
    state: WorkingState

    def messages(self, ctx: RenderContext) -> list[Message]:
        s = self.state
        lines = ["Working state:"]
        used: list[TrustLevel] = []

        def block(heading: str, entries: list[tuple[str, TrustLevel]], name: str) -> None:
            if entries:
                lines.append(heading)
                lines.extend(labelled_envelopes(entries, source="working-state",
                                                item_id=name, ctx=ctx))
                used.extend(t for _, t in entries)

        if s.objective:
            block("Objective:", [(s.objective, s.objective_trust)], "objective")
        if s.superseded_objectives:
            last = labels(s.superseded_objectives, s.superseded_trust)[-1]
            block("Superseded objective:", [(s.superseded_objectives[-1], last)],
                  "superseded-objective")
        block("Constraints:", [(f"- {c}", t) for c, t in zip(
            s.constraints, labels(s.constraints, s.constraint_trust), strict=True)],
            "constraints")
        block("Open tasks:", [(f"- [{t.id}] ({t.state}) {t.title}", t.trust)
                              for t in s.tasks if t.state != "completed"], "tasks")
        if s.facts:
            lines.append("Established facts:")
            for i, f in enumerate(s.facts):
                sources = ", ".join(str(e) for e in f.source_event_ids) or "none"
                if f.trust is TrustLevel.USER and not f.source_event_ids:
                    # the session's own conclusion at the user's trust, resting on no event:
                    # an entry at its label, as the objective and the constraints are, not a
                    # claim attributed to a source it does not have ("A source (events none)")
                    lines.append("- " + envelope(trust=f.trust, source="working-state",
                                                 item_id=f"fact-{i}", content=f.statement,
                                                 session_key=ctx.session_key))
                elif f.trust.enveloped:
                    claim = envelope(trust=f.trust, source=f"events:{sources}",
                                     item_id=f"fact-{i}", content=f.statement,
                                     session_key=ctx.session_key)
                    lines.append(f"- A source (events {sources}) states: {claim}")
                else:
                    lines.append(f"- {f.statement} (events {sources})")
                used.append(f.trust)
        block("Open questions:", [(f"- {q}", t) for q, t in zip(
            s.open_questions, s.question_labels(), strict=True)], "questions")
        if s.next_action:
            block("Next action:", [(s.next_action, s.next_action_trust)], "next-action")
        return [Message(row=12, role=Role.USER, trust=lowest(used, TrustLevel.PLATFORM),
                        text="\n".join(lines))]


@dataclass(frozen=True, kw_only=True, slots=True)
class KnowledgePassage:
    id: str
    source: str
    text: str
    rank: int
    trust: TrustLevel


@dataclass(frozen=True, kw_only=True, slots=True)
class KnowledgeItem(ContextItem):
    """Row 13: verbatim knowledge passages, each in its own envelope; never truncated."""

    row: ClassVar[int] = 13
    region: ClassVar[Region] = Region.B
    trust: ClassVar[TrustLevel | None] = None  # per passage
    passages: tuple[KnowledgePassage, ...]

    def messages(self, ctx: RenderContext) -> list[Message]:
        parts = ["Knowledge passages (verbatim; cite by id):"]
        for p in self.passages:
            parts.append(envelope(trust=p.trust, source=f"knowledge:{p.source}", item_id=p.id,
                                  content=p.text, session_key=ctx.session_key))
        trust = lowest([p.trust for p in self.passages], TrustLevel.MEMORY)
        return [Message(row=13, role=Role.USER, trust=trust, text="\n".join(parts))]


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryLine:
    id: str
    text: str


@dataclass(frozen=True, kw_only=True, slots=True)
class RecallItem(ContextItem):
    """Row 13: in-turn recall, recomputed per step, in its memory envelope."""

    row: ClassVar[int] = 13
    region: ClassVar[Region] = Region.B
    trust: ClassVar[TrustLevel | None] = TrustLevel.MEMORY
    lines: tuple[MemoryLine, ...]

    def messages(self, ctx: RenderContext) -> list[Message]:
        body = "\n".join(f"- [{ln.id}] {ln.text}" for ln in self.lines)
        return [Message(row=13, role=Role.USER, trust=TrustLevel.MEMORY,
                        text="Recalled for this step:\n" + envelope(
                            trust=TrustLevel.MEMORY, source="memory:recall", item_id="recall",
                            content=body, session_key=ctx.session_key))]


@dataclass(frozen=True, kw_only=True, slots=True)
class CorrectionItem(ContextItem):
    """Row 13: correction lines that override the frozen snapshot. Never yield."""

    row: ClassVar[int] = 13
    region: ClassVar[Region] = Region.B
    trust: ClassVar[TrustLevel | None] = TrustLevel.MEMORY
    lines: tuple[MemoryLine, ...]

    def messages(self, ctx: RenderContext) -> list[Message]:
        body = "\n".join(f"- [{ln.id}] {ln.text}" for ln in self.lines)
        return [Message(row=13, role=Role.USER, trust=TrustLevel.MEMORY,
                        text="Corrections to the memory at session open (these override it):\n"
                        + envelope(trust=TrustLevel.MEMORY, source="memory:corrections",
                                   item_id="corrections", content=body,
                                   session_key=ctx.session_key))]


@dataclass(frozen=True, kw_only=True, slots=True)
class RuntimeMetadataItem(ContextItem):
    row: ClassVar[int] = 14
    region: ClassVar[Region] = Region.B
    trust: ClassVar[TrustLevel | None] = TrustLevel.PLATFORM
    current_date: str
    principal_scopes: tuple[str, ...]
    surface: str
    browser_origins: tuple[str, ...]  # only when the plan offers browser.navigate

    def messages(self, ctx: RenderContext) -> list[Message]:
        lines = ["Runtime:"]
        if self.current_date:
            lines.append(f"Current date: {self.current_date}")
        if self.principal_scopes:
            lines.append("Principal scopes: " + ", ".join(sorted(self.principal_scopes)))
        if self.surface:
            lines.append(f"Surface: {self.surface}")
        if self.browser_origins:
            lines.append("browser.navigate accepts these origins: "
                         + ", ".join(self.browser_origins))
        # each value on its line (a backstop: line breaks are refused at the boundary)
        return [Message(row=14, role=Role.USER, trust=TrustLevel.PLATFORM,
                        text="\n".join(one_line(line) for line in lines))]


@dataclass(frozen=True, kw_only=True, slots=True)
class TrailingUserInput(ContextItem):
    """Row 15: an unanswered trailing user message (including supplemental input on resume)."""

    row: ClassVar[int] = 15
    region: ClassVar[Region] = Region.B
    trust: ClassVar[TrustLevel | None] = TrustLevel.USER
    message: UserMessageItem

    def messages(self, ctx: RenderContext) -> list[Message]:
        return [Message(row=15, role=m.role, trust=m.trust, item_id=m.item_id, text=m.text,
                        attachments=m.attachments)
                for m in self.message.messages(ctx)]


RegionBItem = (HistorySummary | UserMessageItem | AssistantMessageItem | ToolCallItem
               | ToolResultItem | ReasoningItem | SkillBodyItem | WorkingStateItem
               | KnowledgeItem | RecallItem | CorrectionItem | RuntimeMetadataItem
               | TrailingUserInput)
