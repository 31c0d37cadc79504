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
  by earlier compactions) and the summary states them verbatim. A merge takes the union.
  If the constraints (and pointers) alone do not fit the summary's token cap, the call fails:
  a constraint is never dropped to make room.
* Labels survive (spec: "The label survives every transformation"): the narrative is written
  from the user's and the model's words, so it carries the lowest label of everything the
  summarizer was given (never above USER) and renders in an envelope with it (row 9, see
  ``HistorySummary``); each constraint keeps its own label. Only headings, the range, pointer
  lines and provenance are platform text.
* Depth is at most 2: raw items -> a summary (depth 1); a depth-1 summary merges once with
  newer items (depth 2); a third compaction fails with ``CompactionDepthExceeded``.
* Provenance: ``source_event_ids`` is the union of the current summary's ids and the event
  sequences of the replaced items the summary represents (reasoning excluded).

The summarizer is a port (``Summarizer``): the deterministic structured one lives here; the
LLM one is an adapter. Everything else in this module is pure.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol, cast

from context_engine.domain.budget import elided as as_pointer
from context_engine.domain.errors import (
    BudgetExceeded,
    CompactionDepthExceeded,
    InvalidInput,
    NothingToCompact,
)
from context_engine.domain.excerpts import DEFAULT_INLINE_MAXIMUM_BYTES, normalize_tool_result
from context_engine.domain.history import floor_index, trailing_start, units
from context_engine.domain.items import (
    MAX_DEPTH,
    NARRATIVE_FLOOR,
    SUMMARY_CONSTRAINTS_HEADER,
    SUMMARY_ELIDED_HEADER,
    SUMMARY_SOURCES_HEADER,
    AssistantMessageItem,
    ConversationItem,
    ElidedSpan,
    HistorySummary,
    ReasoningItem,
    RenderContext,
    ToolCallItem,
    ToolResultItem,
    UserMessageItem,
    WorkingState,
    attachment_pointer_kind,
    attachment_size,
    bad_reference,
    labels,
)
from context_engine.domain.request import Message
from context_engine.domain.trust import TrustLevel, lowest

COMPACTOR_VERSION = "ce-compactor/1"
DEFAULT_SUMMARY_TOKENS = 4_000
_LINE_CHARS = 240
EARLIER = "Earlier:"  # the line before a merge's earlier narrative

# The section markers of summaries written before the narrative was kept apart from the rest:
# a legacy summary's narrative is read back from between them when it merges.
NARRATIVE_HEADER = "Narrative (trusted content only):"
CONSTRAINTS_HEADER = SUMMARY_CONSTRAINTS_HEADER
ELIDED_HEADER = SUMMARY_ELIDED_HEADER
SOURCES_HEADER = SUMMARY_SOURCES_HEADER

# The checkpoint's summary as the runtime holds it (proto ``Summary``) is row 9's item.
CurrentSummary = HistorySummary
__all__ = ["CurrentSummary", "ElidedSpan"]


@dataclass(frozen=True, kw_only=True, slots=True)
class TrustedLine:
    """One piece of trusted content the summarizer may read, with its item's label."""

    item_id: str
    sequence: int
    role: str  # user, assistant or tool_call
    text: str
    trust: TrustLevel = TrustLevel.USER


@dataclass(frozen=True, kw_only=True, slots=True)
class SummaryInput:
    """Everything a summarizer sees, each piece with its label: nothing below USER (spec: "the
    summarizer runs on trusted content only"). Spans below USER are pointers; the working
    state's objective, open questions and constraints below USER are left out (the state
    keeps them, at their labels, and the summary its constraints verbatim); an earlier
    narrative below USER is carried verbatim by the compactor (``Selection.carried``)."""

    reason: str
    goal: str
    constraints: tuple[str, ...]
    open_questions: tuple[str, ...]
    lines: tuple[TrustedLine, ...]
    pointers: tuple[str, ...]  # already-typed pointers, for reference only
    prior_narrative: str  # the narrative of the summary being merged
    source_event_ids: tuple[int, ...]
    goal_trust: TrustLevel = TrustLevel.USER
    constraint_trust: tuple[TrustLevel, ...] = ()
    question_trust: tuple[TrustLevel, ...] = ()
    prior_trust: TrustLevel = TrustLevel.USER

    def narrative_trust(self) -> TrustLevel:
        """The label of anything written from this input: the lowest of its sources, and never
        above USER (a narrative is written from the user's and the model's words). Pointers
        are platform text and lower nothing; constraints are stated beside the narrative, each
        at its own label."""
        found = [TrustLevel.USER, *(ln.trust for ln in self.lines),
                 *labels(self.open_questions, self.question_trust)]
        if self.goal:
            found.append(self.goal_trust)
        if self.prior_narrative:
            found.append(self.prior_trust)
        return lowest(found, TrustLevel.USER)


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
    narrative_trust: TrustLevel = TrustLevel.USER
    constraint_trust: tuple[TrustLevel, ...] = ()  # one per constraint

    def history_summary(self) -> HistorySummary:
        """The summary as row 9 renders it (what the runtime writes into its checkpoint)."""
        return HistorySummary(
            text=self.summary, replaced_through_sequence=self.replaced_through_sequence,
            narrative_trust=self.narrative_trust, source_event_ids=self.source_event_ids,
            depth=self.depth, constraints=self.constraints,
            constraint_trust=labels(self.constraints, self.constraint_trust),
            elided=self.elided)


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
    constraint_trust: tuple[TrustLevel, ...]
    source_event_ids: tuple[int, ...]
    tokens_before: int = 0
    extra: dict[str, int] = field(default_factory=dict)
    # an earlier narrative below USER: never given to the summarizer, carried verbatim ahead
    # of what it writes (cut in its middle to fit), lowering the narrative's label to its own
    carried: str = ""
    carried_trust: TrustLevel = TrustLevel.USER


Measure = Callable[[Sequence[Message]], int]


def _union(*groups: tuple[Sequence[str], Sequence[TrustLevel]]) -> dict[str, TrustLevel]:
    """Constraints in first-seen order, each with the lowest label it was given."""
    seen: dict[str, TrustLevel] = {}
    for values, given in groups:
        for v, t in zip(values, labels(values, given), strict=True):
            seen[v] = lowest([seen[v], t], t) if v in seen else t
    return seen


def merged_constraints(current: HistorySummary | None,
                       state: WorkingState) -> dict[str, TrustLevel]:
    """The constraints a compaction writes into its summary, verbatim, each at its label: the
    current summary's (which it merges) and the working state's, less those the user removed
    (never merged back in)."""
    kept = _union((current.constraints, current.constraint_trust) if current else ((), ()),
                  (state.constraints, state.constraint_trust))
    for removed in state.removed_constraints:
        kept.pop(removed, None)
    return kept


def merge_keeps(current: HistorySummary, state: WorkingState) -> HistorySummary:
    """What a compaction merging ``current`` keeps of it whatever its cap: all but its
    narrative, with the working state's constraints added (``merged_constraints``); a merged
    summary costs at least this (and a token more, the sources it adds)."""
    kept = merged_constraints(current, state)
    return replace(current, text="", constraints=tuple(kept),
                   constraint_trust=tuple(kept.values()))


def _line(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= _LINE_CHARS else flat[:_LINE_CHARS - 1] + "\u2026"


def trusted_label(label: TrustLevel) -> bool:
    return label.rank >= TrustLevel.USER.rank


def trusted(item: ConversationItem) -> bool:
    return trusted_label(item.item_trust)


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
    if isinstance(item, ToolCallItem) and not trusted(item):
        # a call made after untrusted content: its tool's name would carry the call's label
        # into the narrative, so it is pointed to like the other spans below USER
        return ElidedSpan(item_id=item.id, trust_level=item.item_trust,
                          byte_length=sum(len(c.arguments_json.encode("utf-8"))
                                          for c in item.calls),
                          artifact_ref=None, event_id=item.sequence, kind="tool.call")
    return None


def attachment_spans(item: ConversationItem) -> tuple[ElidedSpan, ...]:
    """The pointers a replaced user message's attachments become, whatever its label: the
    summary holds no file, so each is pointed to (its kind, size and reference, at the
    message's id, event and label) rather than dropped unsaid."""
    if not isinstance(item, UserMessageItem):
        return ()
    # a pointer stands for data: its label is at most USER, as a summary line's (and as a
    # summary sent back must hold); a reference that could not be sent back as a pointer's
    # (over 256 characters, or holding a character that breaks or hides part of the line) is
    # left out: the pointer names the message's event, which holds it
    label = lowest([item.item_trust, TrustLevel.USER], TrustLevel.USER)
    return tuple(ElidedSpan(item_id=item.id, trust_level=label,
                            byte_length=attachment_size(a),
                            artifact_ref=a.ref if a.ref and not bad_reference(a.ref) else None,
                            event_id=item.sequence, kind=attachment_pointer_kind(a))
                 for a in item.attachments)


def _trusted_line(item: ConversationItem) -> TrustedLine | None:
    if not trusted(item):
        return None
    label = lowest([item.item_trust, TrustLevel.USER], TrustLevel.USER)
    if isinstance(item, UserMessageItem):
        return TrustedLine(item_id=item.id, sequence=item.sequence, role="user", text=item.text,
                           trust=label)
    if isinstance(item, AssistantMessageItem):
        return TrustedLine(item_id=item.id, sequence=item.sequence, role="assistant",
                           text=item.text, trust=label)
    if isinstance(item, ToolCallItem):
        # the tool's names only: arguments may quote untrusted data
        names = ", ".join(c.name for c in item.calls)
        return TrustedLine(item_id=item.id, sequence=item.sequence, role="tool_call",
                           text=names, trust=label)
    return None


# A legacy summary's rendering began with this line, then the narrative header on its own line.
_LEGACY_OPENING = re.compile(r"Compacted history \(depth \d+\), replacing events through "
                             r"-?\d+\.\n" + re.escape(NARRATIVE_HEADER) + r"\n")


def narrative_of(text: str) -> str:
    """The narrative of a summary: its text, or for a legacy summary (which held the whole
    rendering, and began with its own opening line) the narrative section of it. A narrative
    that merely quotes the legacy header is a narrative like any other."""
    legacy = _LEGACY_OPENING.match(text)
    if legacy is None:
        return text.strip()
    body = text[legacy.end():]
    ends = [i for i in (body.find("\n" + h) for h in (CONSTRAINTS_HEADER, ELIDED_HEADER,
                                                      SOURCES_HEADER)) if i >= 0]
    return (body[:min(ends)] if ends else body).strip()


def select(items: Sequence[ConversationItem], current: HistorySummary | None, *,
           active_run_id: str, target: Target, reason: str,
           state: WorkingState | None = None,
           cost: Callable[[ConversationItem], int]) -> Selection:
    """Which items a compaction replaces and what the summarizer may see (pure). ``state``:
    the checkpoint's working state, whose objective (the goal), constraints and open questions
    the summary retains, each with its label."""
    state = state if state is not None else WorkingState()
    # a summary without a narrative (depth 0: the runtime's own carrier of constraints or of
    # a floor) holds nothing a merge would summarize again: compacting over it is the first
    depth = (1 if current is None or (current.depth == 0 and not narrative_of(current.text))
             else max(current.depth, 1) + 1)
    if depth > MAX_DEPTH:
        raise CompactionDepthExceeded(current.depth if current else 0)
    if target.tokens_to_free <= 0 and target.replace_through is None:
        raise InvalidInput.one("target", "name tokens_to_free or replace_through_sequence")
    floor = current.replaced_through_sequence if current is not None else 0
    start = floor_index(items, floor) if current is not None else 0
    # The current input (the active run's unanswered trailing user messages) is Build's: it
    # never yields, and is not history, never compacted.
    limit = trailing_start(items, active_run_id)
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
        elif freed >= target.tokens_to_free and items[begin].sequence > items[begin - 1].sequence:
            # freed enough, at a boundary a floor can mark (one inside a sequence would be
            # backed off below, freeing less than asked): rounded up to it, "at least"
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
    elided = tuple(s for it in replaced for s in (elided_span(it), *attachment_spans(it))
                   if s is not None)
    lines = tuple(ln for ln in (_trusted_line(it) for it in replaced) if ln is not None)
    new_ids = [it.sequence for it in replaced if not isinstance(it, ReasoningItem)]
    if not new_ids:  # opaque reasoning alone is dropped by type, never summarized
        raise NothingToCompact(floor)
    previous_ids = list(current.source_event_ids) if current is not None else []
    source_ids = tuple(sorted(set(previous_ids) | set(new_ids)))
    kept = merged_constraints(current, state)
    all_elided = (*(current.elided if current else ()), *elided)
    # the summarizer runs on trusted content only: what the state holds below USER stays in
    # the state (and the constraints in the summary, verbatim), an earlier narrative below
    # USER is carried verbatim
    questions = [(q, t) for q, t in zip(state.open_questions, state.question_labels(),
                                        strict=True) if trusted_label(t)]
    told = {c: t for c, t in kept.items() if trusted_label(t)}
    prior = narrative_of(current.text) if current is not None else ""
    prior_trust = current.narrative_trust if current is not None else TrustLevel.USER
    carried = "" if trusted_label(prior_trust) else prior
    data = SummaryInput(
        reason=reason, goal=state.objective if trusted_label(state.objective_trust) else "",
        constraints=tuple(told), open_questions=tuple(q for q, _ in questions), lines=lines,
        pointers=tuple(s.pointer() for s in all_elided),
        prior_narrative="" if carried else prior, source_event_ids=source_ids,
        goal_trust=state.objective_trust, constraint_trust=tuple(told.values()),
        question_trust=tuple(t for _, t in questions),
        prior_trust=prior_trust)  # (read only with the prior narrative given)
    return Selection(replaced=replaced, replaced_through_sequence=max(
        floor, max(it.sequence for it in replaced)), depth=depth, data=data,
        elided=all_elided, constraints=tuple(kept), constraint_trust=tuple(kept.values()),
        source_event_ids=source_ids, tokens_before=freed, carried=carried,
        carried_trust=prior_trust)


def _summary_tokens(summary: HistorySummary, measure: Measure, ctx: RenderContext) -> int:
    return measure(summary.messages(ctx))


async def compact(items: Sequence[ConversationItem], current: HistorySummary | None, *,
                  active_run_id: str, target: Target, reason: str, summarizer: Summarizer,
                  measure: Measure, ctx: RenderContext, state: WorkingState | None = None,
                  max_summary_tokens: int = DEFAULT_SUMMARY_TOKENS,
                  attachment_charges: Callable[[Sequence[ConversationItem]],
                                               Mapping[str, int]] | None = None,
                  inline_maximum_bytes: int = DEFAULT_INLINE_MAXIMUM_BYTES,
                  ) -> CompactionResult:
    """One compaction. The only impure step is the summarizer's call; a summarizer failure
    propagates and nothing is produced. ``attachment_charges``: what Build charges each user
    message of the items it can send (those from the summary's floor on) for its attachments,
    by message id (``builder.attachment_costs``), counted with the message: a PDF's pages free
    what the Build charged for them, and an older message's images no more than the
    request-wide attachment budget, spent newest first, left them. A tool result is counted
    as Build charges it once history has to be cut: its content as Build sends it (the
    persisted excerpt, or the head/tail excerpt past ``inline_maximum_bytes``), or its typed
    pointer where that is smaller (Build cuts history only once every such result is one), so
    Build's ``left_out_tokens`` as ``tokens_to_free`` replaces what that Build left out, not
    only the unit of a result whose canonical content Build never sent."""
    charged: Mapping[str, int] = {}
    if attachment_charges is not None:
        charged = attachment_charges(
            items[floor_index(items, current.replaced_through_sequence):]
            if current is not None else items)

    def cost(item: ConversationItem) -> int:
        if isinstance(item, ReasoningItem):  # of a run before the active one: Build drops it
            return 0  # and charges it nothing, so replacing it frees nothing
        if isinstance(item, ToolResultItem):
            shown = cast(ToolResultItem, normalize_tool_result(item, inline_maximum_bytes)[0])
            sent: int = measure(shown.messages(ctx))
            return sent if shown.elided else min(sent, measure(as_pointer(shown).messages(ctx)))
        tokens: int = measure(item.messages(ctx))  # type: ignore[attr-defined]
        if charged and isinstance(item, UserMessageItem):
            tokens += charged.get(item.id, 0)
        return tokens

    sel = select(items, current, active_run_id=active_run_id, target=target, reason=reason,
                 state=state, cost=cost)
    before = sel.tokens_before
    if current is not None:
        before += _summary_tokens(current, measure, ctx)
    label = sel.data.narrative_trust()
    if sel.carried:  # carried as it is, its label with it
        label = lowest([label, sel.carried_trust], sel.carried_trust)

    def summary_with(narrative: str) -> HistorySummary:
        return HistorySummary(
            text=narrative.strip(), replaced_through_sequence=sel.replaced_through_sequence,
            narrative_trust=label, source_event_ids=sel.source_event_ids, depth=sel.depth,
            constraints=sel.constraints, constraint_trust=sel.constraint_trust,
            elided=sel.elided)

    # What the summary never cuts: its constraints, pointers and source ids, and, where there
    # is anything to narrate (the goal, questions, decisions, an earlier narrative), the least
    # narrative (NARRATIVE_FLOOR's room beside its envelope): a summary that replaced a
    # conversation with no word of it would lose its goal and questions unseen
    data = sel.data
    narrates = bool(data.goal or data.open_questions or data.lines or data.prior_narrative
                    or sel.carried)
    least = summary_with(NARRATIVE_FLOOR if narrates else "")
    kept = _summary_tokens(least, measure, ctx)
    if kept > max_summary_tokens:  # fail, never drop a constraint, a pointer or a source id
        # named for what does not fit: the constraints alone, or with them the pointers and
        # source ids of what would be replaced (and of the summary merged), which a smaller
        # target or a larger cap fits and no change to the constraints would
        alone = _summary_tokens(replace(least, elided=(), source_event_ids=()), measure, ctx)
        raise BudgetExceeded("summary_constraints" if alone > max_summary_tokens
                             else "summary_pointers", kept, max_summary_tokens)
    # a character allowance for the narrative: what the cap leaves beside the rest and the
    # narrative's envelope (a one-character narrative: the envelope and about a token), three
    # characters a token, which dense text (numbers, code, most scripts but Latin) does not
    # reach
    enveloped = _summary_tokens(summary_with("."), measure, ctx)
    room = max(0, max_summary_tokens - enveloped)
    allowance = room * 3
    # an earlier narrative below USER, as it is, up to half of the allowance (cut in its
    # middle), before what the summarizer writes from trusted content
    earlier = cut_middle(sel.carried, allowance // 2) if sel.carried else ""

    def narrative_of_written(written: str) -> str:
        return f"{EARLIER}\n{earlier}\n{written}".strip() if earlier else written

    held = len(narrative_of_written("")) + 1 if earlier else 0

    async def written(allowance: int) -> tuple[Summarized, str]:
        asked = max(0, allowance - held)
        summarized = await summarizer.summarize(sel.data, asked)
        # an answer far over what was asked is cut in its middle before it is measured:
        # measured whole, pass after pass, a misbehaving summarizer's megabytes would hold
        # the event loop for seconds (the cut keeps its opening and its open questions)
        text = cut_middle(summarized.narrative.strip(), 4 * max(asked, 64))
        return summarized, narrative_of_written(text)

    summarized, narrative = await written(allowance)
    after = _summary_tokens(summary_with(narrative), measure, ctx)
    if after > max_summary_tokens and narrative:
        # asked once more, within the allowance the text measured shows (a summarizer fits
        # its own text by what matters; a cut of ours would not know)
        allowance = int(len(narrative) * room / max(after - enveloped, 1) * 0.9)
        summarized, narrative = await written(allowance)
        after = _summary_tokens(summary_with(narrative), measure, ctx)
    while after > max_summary_tokens and narrative:  # cut the narrative, never a constraint
        narrative = cut_middle(narrative, len(narrative) * 3 // 4)
        after = _summary_tokens(summary_with(narrative), measure, ctx)
    return CompactionResult(
        summary=summary_with(narrative).text, source_event_ids=sel.source_event_ids,
        elided=sel.elided, replaced_through_sequence=sel.replaced_through_sequence,
        depth=sel.depth, tokens_before=before, tokens_after=after,
        compactor_version=COMPACTOR_VERSION, constraints=sel.constraints,
        summarizer_version=summarized.version,
        replaced_item_ids=tuple(it.id for it in sel.replaced), narrative_trust=label,
        constraint_trust=sel.constraint_trust)


class StructuredSummarizer:
    """The default: deterministic, no model. Current goal, decisions taken, unresolved
    questions, tool results needed downstream (as pointers); the constraints and source ids
    are stated by the compactor around it."""

    version = "structured/1"

    async def summarize(self, data: SummaryInput, max_chars: int) -> Summarized:
        return Summarized(narrative=structured_narrative(data, max_chars), version=self.version)


def cut_middle(text: str, max_chars: int) -> str:
    """``text`` within ``max_chars`` characters, cut in its middle: a summary opens with what
    it is about (its goal, the earlier narrative's) and ends with what is still open (the
    unresolved questions, the pointers), so what goes first is what lies between."""
    if len(text) <= max_chars:
        return text
    if max_chars < 3:
        return ""
    head = (max_chars - 1) // 3
    return text[:head].rstrip() + "\u2026" + text[len(text) - (max_chars - 1 - head):].lstrip()


def structured_narrative(data: SummaryInput, max_chars: int) -> str:
    """Within ``max_chars`` by priority: the current goal, the unresolved questions and the
    pointer line always (cut in their middle only if they alone are over); then the earlier
    narrative of a merge, up to half of what is left (cut in its middle); then the newest
    decisions that fit, the older ones counted as omitted."""
    goal = data.goal
    if not goal:
        users = [ln for ln in data.lines if ln.role == "user"]
        goal = users[-1].text if users else ""
    goal_line = f"Current goal: {_line(goal) if goal else '(not stated)'}"
    decisions = [f"- [{ln.sequence}] " + (f"called {ln.text}" if ln.role == "tool_call"
                                          else f"{ln.role}: {_line(ln.text)}")
                 for ln in data.lines if ln.role != "user" or ln.text != goal]
    questions = list(data.open_questions) or [
        _line(ln.text) for ln in data.lines[-1:] if ln.role == "user"
        and ln.text.rstrip().endswith("?")]
    tail: list[str] = []
    if questions:
        tail.append("Unresolved questions:")
        tail += [f"- {q}" for q in questions]
    if data.pointers:
        tail.append(f"Tool results needed downstream: {len(data.pointers)} pointer(s) below.")

    def joined(earlier: str, kept: list[str], omitted: int) -> str:
        out = [EARLIER, earlier] if earlier else []
        out.append(goal_line)
        if kept or omitted:
            out.append("Decisions taken:")
            if omitted:
                out.append(f"- \u2026 {omitted} earlier decision(s) omitted")
            out += kept
        return "\n".join(out + tail)

    essential = len(joined("", [], 0))
    if essential > max_chars:
        return cut_middle(joined("", [], 0), max_chars)
    earlier = data.prior_narrative
    if earlier:
        share = (max_chars - essential - len("Earlier:\n\n")) // 2
        earlier = cut_middle(earlier, share) if share > 0 else ""
    # the newest k decisions: each line adds its length and a line break, the heading and
    # the omission line (while one is left out) theirs; the most that fit are kept
    n, base = len(decisions), len(joined(earlier, [], 0))
    best, lines = 0, 0
    for k in range(1, n + 1):
        lines += len(decisions[n - k]) + 1
        omission = len(f"- \u2026 {n - k} earlier decision(s) omitted") + 1 if k < n else 0
        if base + len("Decisions taken:") + 1 + omission + lines <= max_chars:
            best = k
    if best == 0 and n and base + len("Decisions taken:") + 1 + len(
            f"- \u2026 {n} earlier decision(s) omitted") + 1 > max_chars:
        n = 0  # not even the count of them fits
    text = joined(earlier, decisions[n - best:] if n else [], n - best)
    assert len(text) <= max_chars  # every part above was counted
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
        "narrative_trust": r.narrative_trust.value,
        "constraint_trust": [t.value for t in r.constraint_trust],
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
        # results stored before labels were kept: USER, the ceiling of a narrative's label
        narrative_trust=TrustLevel(str(d.get("narrative_trust", TrustLevel.USER.value))),
        constraint_trust=tuple(TrustLevel(str(t))
                               for t in d.get("constraint_trust", ())),  # type: ignore[attr-defined]
    )
