"""Compaction (spec: "Compaction" through "Summaries are bounded and monotone").

``compact`` replaces the oldest end of a checkpoint's Region B history with a summary. It is a
write the runtime asks for (the Compact RPC), never part of Build. The rules, each enforced here:

* Only carried history is replaced: never an item of the active run, never the unanswered
  trailing user messages (Build's current input), never a unit that the range would split
  (a tool call and all its results are one unit), never an item at or below the current
  summary floor (already represented by the summary), and never a boundary inside a run of
  equal event sequences (the floor is a sequence: an equal item left in place would vanish).
* What the summarizer may read is decided by type and trust, never by content:
  - user and assistant text with trust USER or higher is trusted (USER-authored text is the
    principal's own words; assistant text is the model's output replayed in its role);
  - a tool call contributes its tool name only (arguments may quote untrusted data);
  - a tool result is data and never reaches the summarizer, whatever its trust: it becomes an
    ``ElidedSpan`` rendered as the typed pointer
    ``[elided] tool.result <id> (<trust>, <bytes> bytes) -> <artifact or event ref>``;
  - user or assistant text below USER (MEMORY, EXTERNAL_UNTRUSTED) is elided the same way;
  - opaque reasoning is excluded by type: neither summarized nor pointed to.
* Constraints never pass through the summarizer either: the caller passes them (the working
  state's constraints; ``Summary.constraints`` of the current summary carries those retained
  by earlier compactions) and the summary text states them verbatim. A merge takes the union.
  If the constraints (and pointers) alone do not fit the summary's token cap, the call fails:
  a constraint is never dropped to make room.
* Depth is at most 2: raw items -> a summary (depth 1); a depth-1 summary merges once with
  newer items (depth 2); a third compaction fails with ``CompactionDepthExceeded``.
* Provenance: ``source_event_ids`` is the union of the current summary's ids and the event
  sequences of the replaced items the summary represents (reasoning excluded).

The summarizer is a port (``Summarizer``): the deterministic structured one lives here; the
LLM one is an adapter. Everything else in this module is pure.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from context_engine.domain.errors import (
    BudgetExceeded,
    CompactionDepthExceeded,
    InvalidInput,
    NothingToCompact,
)
from context_engine.domain.history import floor_index, units
from context_engine.domain.items import (
    AssistantMessageItem,
    ConversationItem,
    HistorySummary,
    ReasoningItem,
    RenderContext,
    ToolCallItem,
    ToolResultItem,
    UserMessageItem,
    one_line,
)
from context_engine.domain.request import Message
from context_engine.domain.trust import TrustLevel

COMPACTOR_VERSION = "ce-compactor/1"
MAX_DEPTH = 2
DEFAULT_SUMMARY_TOKENS = 4_000
_LINE_CHARS = 240

# Fixed section markers of the summary text: the narrative of a depth-1 summary is read back
# from between them when it merges.
NARRATIVE_HEADER = "Narrative (trusted content only):"
CONSTRAINTS_HEADER = "Constraints (verbatim, never merged away):"
ELIDED_HEADER = ("Elided (untrusted or tool data, never summarized; re-fetch by reference, it "
                 "returns inside its envelope):")
SOURCES_HEADER = "Source event ids:"


@dataclass(frozen=True, kw_only=True, slots=True)
class ElidedSpan:
    """An untrusted (or tool-data) span the summary points to instead of paraphrasing."""

    item_id: str
    trust_level: TrustLevel
    byte_length: int
    artifact_ref: str | None
    event_id: int
    kind: str = "tool.result"  # tool.result, user.message or assistant.message

    def pointer(self) -> str:
        event = f"event:{self.event_id}" if self.event_id else ""
        if self.artifact_ref:
            ref = f"{self.artifact_ref} ({event})" if event else self.artifact_ref
        else:
            ref = event or f"item:{self.item_id}"
        return one_line(f"[elided] {self.kind} {self.item_id} ({self.trust_level.value}, "
                        f"{self.byte_length:,} bytes) -> {ref}")


@dataclass(frozen=True, kw_only=True, slots=True)
class CurrentSummary:
    """The checkpoint's summary as the runtime holds it (proto ``Summary``)."""

    text: str
    replaced_through_sequence: int
    source_event_ids: tuple[int, ...] = ()
    depth: int = 1
    constraints: tuple[str, ...] = ()
    elided: tuple[ElidedSpan, ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class TrustedLine:
    """One piece of trusted content the summarizer may read."""

    item_id: str
    sequence: int
    role: str  # user, assistant or tool_call
    text: str


@dataclass(frozen=True, kw_only=True, slots=True)
class SummaryInput:
    """Everything a summarizer sees. Nothing in it came from a span below USER."""

    reason: str
    goal: str
    constraints: tuple[str, ...]
    open_questions: tuple[str, ...]
    lines: tuple[TrustedLine, ...]
    pointers: tuple[str, ...]  # already-typed pointers, for reference only
    prior_narrative: str  # the narrative of the summary being merged (platform-written)
    source_event_ids: tuple[int, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class Summarized:
    narrative: str
    version: str


class Summarizer(Protocol):
    """Writes the narrative of a summary from trusted content only."""

    @property
    def version(self) -> str: ...

    async def summarize(self, data: SummaryInput, max_chars: int) -> Summarized: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class CompactionResult:
    summary: str
    source_event_ids: tuple[int, ...]
    elided: tuple[ElidedSpan, ...]
    replaced_through_sequence: int
    depth: int
    tokens_before: int
    tokens_after: int
    compactor_version: str
    constraints: tuple[str, ...] = ()
    summarizer_version: str = ""
    replaced_item_ids: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class Target:
    """What to replace: ``tokens_to_free`` (the oldest whole units until at least that much
    is freed) or ``replace_through`` (every whole unit at or below that event sequence)."""

    tokens_to_free: int = 0
    replace_through: int | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Selection:
    replaced: tuple[ConversationItem, ...]
    replaced_through_sequence: int
    depth: int
    data: SummaryInput
    elided: tuple[ElidedSpan, ...]
    constraints: tuple[str, ...]
    source_event_ids: tuple[int, ...]
    tokens_before: int = 0
    extra: dict[str, int] = field(default_factory=dict)


Measure = Callable[[Sequence[Message]], int]


def _unique(values: Sequence[str]) -> tuple[str, ...]:
    seen: dict[str, None] = {}
    for v in values:
        if v not in seen:
            seen[v] = None
    return tuple(seen)


def _line(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= _LINE_CHARS else flat[:_LINE_CHARS - 1] + "\u2026"


def trusted(item: ConversationItem) -> bool:
    return item.item_trust.rank >= TrustLevel.USER.rank


def elided_span(item: ConversationItem) -> ElidedSpan | None:
    """The pointer an item becomes, or None when the summarizer may read it (or, for
    reasoning, when it is excluded by type)."""
    if isinstance(item, ToolResultItem):
        return ElidedSpan(item_id=item.id, trust_level=item.item_trust, byte_length=item.bytes,
                          artifact_ref=item.artifact_ref or None,
                          event_id=item.event_id or item.sequence)
    if isinstance(item, UserMessageItem | AssistantMessageItem) and not trusted(item):
        kind = "user.message" if isinstance(item, UserMessageItem) else "assistant.message"
        return ElidedSpan(item_id=item.id, trust_level=item.item_trust,
                          byte_length=len(item.text.encode("utf-8")), artifact_ref=None,
                          event_id=item.sequence, kind=kind)
    return None


def _trusted_line(item: ConversationItem) -> TrustedLine | None:
    if not trusted(item):
        return None
    if isinstance(item, UserMessageItem):
        return TrustedLine(item_id=item.id, sequence=item.sequence, role="user", text=item.text)
    if isinstance(item, AssistantMessageItem):
        return TrustedLine(item_id=item.id, sequence=item.sequence, role="assistant",
                           text=item.text)
    if isinstance(item, ToolCallItem):
        names = ", ".join(c.name for c in item.calls)
        return TrustedLine(item_id=item.id, sequence=item.sequence, role="tool_call",
                           text=names)
    return None


def narrative_of(text: str) -> str:
    """The narrative section of a summary this module wrote; the whole text otherwise."""
    start = text.find(NARRATIVE_HEADER)
    if start < 0:
        return text.strip()
    body = text[start + len(NARRATIVE_HEADER):]
    ends = [i for i in (body.find("\n" + h) for h in (CONSTRAINTS_HEADER, ELIDED_HEADER,
                                                      SOURCES_HEADER)) if i >= 0]
    return (body[:min(ends)] if ends else body).strip()


def select(items: Sequence[ConversationItem], current: CurrentSummary | None, *,
           active_run_id: str, target: Target, reason: str, constraints: Sequence[str] = (),
           goal: str = "", open_questions: Sequence[str] = (),
           cost: Callable[[ConversationItem], int]) -> Selection:
    """Which items a compaction replaces and what the summarizer may see (pure)."""
    depth = 1 if current is None else max(current.depth, 1) + 1
    if depth > MAX_DEPTH:
        raise CompactionDepthExceeded(current.depth if current else 0)
    if target.tokens_to_free <= 0 and target.replace_through is None:
        raise InvalidInput.one("target", "name tokens_to_free or replace_through_sequence")
    floor = current.replaced_through_sequence if current is not None else 0
    start = floor_index(items, floor) if current is not None else 0
    # Unanswered trailing user messages are Build's current input (they never yield): not
    # history, never compacted.
    limit = len(items)
    while limit > 0 and isinstance(items[limit - 1], UserMessageItem):
        limit -= 1
    chosen: list[tuple[int, int]] = []
    freed = 0
    for begin, stop in units(items):
        if begin < start:
            continue
        if stop > limit:
            break
        unit = items[begin:stop]
        if any(active_run_id and it.run_id == active_run_id for it in unit):
            break  # the active run's items are never compacted (nor anything after them)
        if target.replace_through is not None:
            if any(it.sequence > target.replace_through for it in unit):
                break  # rounded down to a whole unit: a tool pair is never split
        elif freed >= target.tokens_to_free:
            break
        freed += sum(cost(it) for it in unit)
        chosen.append((begin, stop))
    # The floor is an event sequence: an item left in place that shares the last replaced
    # sequence would fall under the floor too and vanish unsummarized. Back off to a boundary
    # where the sequence strictly rises.
    while chosen and chosen[-1][1] < len(items) and (
            items[chosen[-1][1]].sequence <= max(it.sequence for it in
                                                 items[start:chosen[-1][1]])):
        begin, stop = chosen.pop()
        freed -= sum(cost(it) for it in items[begin:stop])
    end = chosen[-1][1] if chosen else start
    replaced = tuple(items[start:end])
    if not replaced:
        raise NothingToCompact(floor)
    elided = tuple(s for s in (elided_span(it) for it in replaced) if s is not None)
    lines = tuple(ln for ln in (_trusted_line(it) for it in replaced) if ln is not None)
    new_ids = [it.sequence for it in replaced if not isinstance(it, ReasoningItem)]
    previous_ids = list(current.source_event_ids) if current is not None else []
    source_ids = tuple(sorted(set(previous_ids) | set(new_ids)))
    kept = _unique([*(current.constraints if current else ()), *constraints])
    all_elided = (*(current.elided if current else ()), *elided)
    data = SummaryInput(
        reason=reason, goal=goal, constraints=kept, open_questions=tuple(open_questions),
        lines=lines, pointers=tuple(s.pointer() for s in all_elided),
        prior_narrative=narrative_of(current.text) if current is not None else "",
        source_event_ids=source_ids)
    return Selection(replaced=replaced, replaced_through_sequence=max(
        floor, max(it.sequence for it in replaced)), depth=depth, data=data,
        elided=all_elided, constraints=kept, source_event_ids=source_ids,
        tokens_before=freed)


def render_summary(*, depth: int, replaced_through: int, narrative: str,
                   constraints: Sequence[str], elided: Sequence[ElidedSpan],
                   source_event_ids: Sequence[int]) -> str:
    """The summary text: the narrative, then what never passes through a summarizer —
    constraints verbatim, typed pointers with their trust labels, and provenance."""
    parts = [f"Compacted history (depth {depth}), replacing events through "
             f"{replaced_through}.", NARRATIVE_HEADER, narrative.strip() or "(none)"]
    if constraints:
        parts.append(CONSTRAINTS_HEADER)
        parts.extend(f"- {c}" for c in constraints)
    if elided:
        parts.append(ELIDED_HEADER)
        parts.extend(s.pointer() for s in elided)
    parts.append(SOURCES_HEADER + " " + ", ".join(str(i) for i in source_event_ids))
    return "\n".join(parts)


def _summary_tokens(text: str, replaced_through: int, measure: Measure,
                    ctx: RenderContext) -> int:
    return measure(HistorySummary(text=text, replaced_through_sequence=replaced_through)
                   .messages(ctx))


async def compact(items: Sequence[ConversationItem], current: CurrentSummary | None, *,
                  active_run_id: str, target: Target, reason: str, summarizer: Summarizer,
                  measure: Measure, ctx: RenderContext, constraints: Sequence[str] = (),
                  goal: str = "", open_questions: Sequence[str] = (),
                  max_summary_tokens: int = DEFAULT_SUMMARY_TOKENS) -> CompactionResult:
    """One compaction. The only impure step is the summarizer's call; a summarizer failure
    propagates and nothing is produced."""

    def cost(item: ConversationItem) -> int:
        return measure(item.messages(ctx))  # type: ignore[attr-defined]

    sel = select(items, current, active_run_id=active_run_id, target=target, reason=reason,
                 constraints=constraints, goal=goal, open_questions=open_questions, cost=cost)
    before = sel.tokens_before
    if current is not None:
        before += _summary_tokens(current.text, current.replaced_through_sequence, measure, ctx)

    def text_with(narrative: str) -> str:
        return render_summary(depth=sel.depth, replaced_through=sel.replaced_through_sequence,
                              narrative=narrative, constraints=sel.constraints,
                              elided=sel.elided, source_event_ids=sel.source_event_ids)

    bare = _summary_tokens(text_with(""), sel.replaced_through_sequence, measure, ctx)
    if bare > max_summary_tokens:  # constraints alone do not fit: fail, never drop one
        raise BudgetExceeded("summary_constraints", bare, max_summary_tokens)
    # a conservative character allowance for the narrative (an estimator token is >= 1 char)
    allowance = max(0, (max_summary_tokens - bare)) * 3
    summarized = await summarizer.summarize(sel.data, allowance)
    narrative = summarized.narrative
    text = text_with(narrative)
    after = _summary_tokens(text, sel.replaced_through_sequence, measure, ctx)
    while after > max_summary_tokens and narrative:  # trim the narrative, never a constraint
        narrative = narrative[:len(narrative) * 3 // 4].rstrip()
        text = text_with(narrative + "\u2026" if narrative else "")
        after = _summary_tokens(text, sel.replaced_through_sequence, measure, ctx)
    return CompactionResult(
        summary=text, source_event_ids=sel.source_event_ids, elided=sel.elided,
        replaced_through_sequence=sel.replaced_through_sequence, depth=sel.depth,
        tokens_before=before, tokens_after=after, compactor_version=COMPACTOR_VERSION,
        constraints=sel.constraints, summarizer_version=summarized.version,
        replaced_item_ids=tuple(it.id for it in sel.replaced))


class StructuredSummarizer:
    """The default: deterministic, no model. Current goal, decisions taken, unresolved
    questions, tool results needed downstream (as pointers); the constraints and source ids
    are stated by the compactor around it."""

    version = "structured/1"

    async def summarize(self, data: SummaryInput, max_chars: int) -> Summarized:
        return Summarized(narrative=structured_narrative(data, max_chars), version=self.version)


def structured_narrative(data: SummaryInput, max_chars: int) -> str:
    goal = data.goal
    if not goal:
        users = [ln for ln in data.lines if ln.role == "user"]
        goal = users[-1].text if users else ""
    out: list[str] = []
    if data.prior_narrative:
        out += ["Earlier:", data.prior_narrative]
    out.append(f"Current goal: {_line(goal) if goal else '(not stated)'}")
    decisions = [f"- [{ln.sequence}] " + (f"called {ln.text}" if ln.role == "tool_call"
                                          else f"{ln.role}: {_line(ln.text)}")
                 for ln in data.lines if ln.role != "user" or ln.text != goal]
    if decisions:
        out.append("Decisions taken:")
        out += decisions
    questions = list(data.open_questions) or [
        _line(ln.text) for ln in data.lines[-1:] if ln.role == "user"
        and ln.text.rstrip().endswith("?")]
    if questions:
        out.append("Unresolved questions:")
        out += [f"- {q}" for q in questions]
    if data.pointers:
        out.append(f"Tool results needed downstream: {len(data.pointers)} pointer(s) below.")
    text = "\n".join(out)
    if len(text) > max_chars:  # keep the newest: drop from the oldest end of the narrative
        text = "\u2026" + text[len(text) - max_chars + 1:] if max_chars > 1 else ""
    return text


def result_document(r: CompactionResult) -> dict[str, object]:
    """The stored form of a result (JSON-safe)."""
    return {
        "summary": r.summary, "source_event_ids": list(r.source_event_ids),
        "elided": [{"item_id": s.item_id, "trust_level": s.trust_level.value,
                    "byte_length": s.byte_length, "artifact_ref": s.artifact_ref,
                    "event_id": s.event_id, "kind": s.kind} for s in r.elided],
        "replaced_through_sequence": r.replaced_through_sequence, "depth": r.depth,
        "tokens_before": r.tokens_before, "tokens_after": r.tokens_after,
        "compactor_version": r.compactor_version, "constraints": list(r.constraints),
        "summarizer_version": r.summarizer_version,
        "replaced_item_ids": list(r.replaced_item_ids),
    }


def result_from_document(d: dict[str, object]) -> CompactionResult:
    elided = d["elided"]
    assert isinstance(elided, list)
    return CompactionResult(
        summary=str(d["summary"]),
        source_event_ids=tuple(int(i) for i in d["source_event_ids"]),  # type: ignore[attr-defined]
        elided=tuple(ElidedSpan(item_id=s["item_id"], trust_level=TrustLevel(s["trust_level"]),
                                byte_length=int(s["byte_length"]),
                                artifact_ref=s["artifact_ref"], event_id=int(s["event_id"]),
                                kind=s["kind"]) for s in elided),
        replaced_through_sequence=int(d["replaced_through_sequence"]),  # type: ignore[call-overload]
        depth=int(d["depth"]),  # type: ignore[call-overload]
        tokens_before=int(d["tokens_before"]),  # type: ignore[call-overload]
        tokens_after=int(d["tokens_after"]),  # type: ignore[call-overload]
        compactor_version=str(d["compactor_version"]),
        constraints=tuple(str(c) for c in d["constraints"]),  # type: ignore[attr-defined]
        summarizer_version=str(d["summarizer_version"]),
        replaced_item_ids=tuple(str(i) for i in d["replaced_item_ids"]),  # type: ignore[attr-defined]
    )
