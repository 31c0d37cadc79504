"""Hard gate: compaction fidelity (spec: "Summaries are bounded and monotone").

How constraints reach the compactor: the caller passes its working state's constraints (the
Compact RPC reads ``checkpoint.working_state.constraints``), and a summary carries the ones it
retained (``Summary.constraints``), so a merge sees both. Over generated conversations:

* after a compaction and after a depth-2 merge, every constraint set before it is present, in
  the result and verbatim in the summary as Build renders it (row 9);
* every summary's source ids are exactly the union of the event sequences of the items it
  replaced so far (opaque reasoning excluded by type), and never empty;
* depth is capped: a summary is depth 1, a merge depth 2, and a third compaction fails with
  ``CompactionDepthExceeded`` (escalate to a child run);
* each elided pointer keeps the trust label of the item it stands for, every replaced tool
  result and span below USER has its pointer in row 9 as Build sends it (judged from the
  items, not from the result's own list or rendering), and no untrusted text reaches it;
* Build on the checkpoint carrying the summary never renders a replaced item.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from dataclasses import replace

import pytest
from context_engine.domain.builder import Checkpoint, RuntimeMetadata
from context_engine.domain.compaction import (
    MAX_DEPTH,
    CompactionResult,
    StructuredSummarizer,
    SummaryInput,
    Target,
    TrustedLine,
    compact,
    structured_narrative,
)
from context_engine.domain.errors import CompactionDepthExceeded, NothingToCompact
from context_engine.domain.items import (
    AssistantMessageItem,
    ConversationItem,
    HistorySummary,
    ReasoningItem,
    RenderContext,
    ToolCallItem,
    ToolResultItem,
    UserMessageItem,
    WorkingState,
)
from context_engine.domain.request import Message
from context_engine.domain.trust import TrustLevel
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tests import factories as f
from tests.property.strategies import conversation

pytestmark = pytest.mark.gate_compaction_fidelity

LOADED = f.loaded()
ESTIMATOR = f.estimator(LOADED.plan.spec.model)
CTX = RenderContext(session_key=LOADED.session_key)
MARK = "UNTRUSTED-MARK-"

# Constraints as users write them: up to a few hundred characters of any script, punctuation
# and symbols ("<", "&"), runs of spaces inside (a constraint is kept verbatim, never cut)
constraint_text = st.one_of(
    st.text(alphabet="abcdefghij -", min_size=1, max_size=30),
    st.text(alphabet=st.characters(categories=("L", "M", "N", "P", "S", "Zs")), min_size=1,
            max_size=60),
    st.text(alphabet=st.characters(categories=("L", "M", "N", "P", "S", "Zs")), min_size=120,
            max_size=400),
).map(lambda c: c.strip() or "c")
constraint_sets = st.lists(constraint_text, max_size=5)


def measure(messages: Sequence[Message]) -> int:
    return ESTIMATOR.messages(list(messages), 1.0)


def marked(items: Sequence[ConversationItem]) -> tuple[ConversationItem, ...]:
    """Tag every tool result and every span below USER with a unique marker."""
    out: list[ConversationItem] = []
    for it in items:
        if isinstance(it, ToolResultItem):
            it = replace(it, content=f"{MARK}{it.id} {it.content}")
        elif isinstance(it, UserMessageItem | AssistantMessageItem) and (
                it.item_trust.rank < TrustLevel.USER.rank):
            it = replace(it, text=f"{MARK}{it.id} {it.text}")
        out.append(it)
    return tuple(out)


def run_compact(items: Sequence[ConversationItem], active: str,
                current: HistorySummary | None, constraints: Sequence[str],
                target: Target) -> CompactionResult:
    return asyncio.run(compact(items, current, active_run_id=active, target=target,
                               reason="gate", summarizer=StructuredSummarizer(),
                               measure=measure, ctx=CTX,
                               state=WorkingState(constraints=tuple(constraints))))


def pointed_kind(item: ConversationItem) -> str | None:
    """The pointer kind a replaced item must leave in the summary, by the spec's rule (a tool
    result always; text and calls below USER), or None when it may be summarized."""
    if isinstance(item, ToolResultItem):
        return "tool.result"
    if item.item_trust.rank >= TrustLevel.USER.rank:
        return None
    return {UserMessageItem: "user.message", AssistantMessageItem: "assistant.message",
            ToolCallItem: "tool.call"}.get(type(item))


def check(r: CompactionResult, items: Sequence[ConversationItem], replaced_so_far: set[str],
          constraints_before: set[str], active: str) -> None:
    by_id = {it.id: it for it in items}
    assert constraints_before <= set(r.constraints)
    # provenance is the union of what was replaced (reasoning is excluded by type), never empty
    provenance = {by_id[i].sequence for i in replaced_so_far
                  if not isinstance(by_id[i], ReasoningItem)}
    assert provenance and set(r.source_event_ids) == provenance
    assert list(r.source_event_ids) == sorted(set(r.source_event_ids))
    assert 1 <= r.depth <= MAX_DEPTH == 2
    for span in r.elided:
        assert span.trust_level is by_id[span.item_id].item_trust
    cp = Checkpoint(active_run_id=active, items=tuple(items),
                    runtime=RuntimeMetadata(current_date="2026-11-29"),
                    summary=r.history_summary())
    built = f.run_build(LOADED, cp)
    # row 9 as Build sends it (not the result's own rendering of itself): every constraint
    # verbatim, a pointer at its item's label for every replaced span the spec elides (judged
    # from the items, not from the result's list), and no untrusted text
    (row9,) = [m.text for m in built.request.messages if m.row == 9]
    for c in constraints_before:
        assert f"- {c}" in row9
    lines = row9.splitlines()
    for i in replaced_so_far:
        kind = pointed_kind(by_id[i])
        if kind is not None:
            head = f"[elided] {kind} {i} ({by_id[i].item_trust.value}, "
            assert any(ln.startswith(head) for ln in lines), f"no pointer {head!r}"
    assert MARK not in row9
    rendered = {m.item_id for m in built.request.messages if m.item_id}
    assert not rendered & replaced_so_far
    assert all(by_id[i].run_id != active for i in replaced_so_far)


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(conv=conversation(), first=constraint_sets, second=constraint_sets,
       split=st.integers(0, 40), tokens=st.integers(1, 400))
def test_compaction_and_merge_keep_constraints_provenance_and_labels(
        conv, first, second, split, tokens):
    active, raw = conv
    items = marked(raw)
    carried = [it for it in items if it.run_id != active]
    assume(carried)
    through = carried[min(split, len(carried) - 1)].sequence
    try:
        one = run_compact(items, active, None, first, Target(replace_through=through))
    except NothingToCompact:
        return
    replaced = set(one.replaced_item_ids)
    assert one.depth == 1
    check(one, items, replaced, set(first), active)
    try:
        two = run_compact(items, active, one.history_summary(), second,
                          Target(tokens_to_free=tokens))
    except NothingToCompact:
        two = None
    if two is not None:
        assert two.depth == 2
        assert not replaced & set(two.replaced_item_ids)
        replaced |= set(two.replaced_item_ids)
        check(two, items, replaced, set(first) | set(second), active)
        assert set(one.source_event_ids) <= set(two.source_event_ids)
        assert {s.item_id for s in one.elided} <= {s.item_id for s in two.elided}
    # a third compaction of the same history always fails: the run should escalate
    deepest = two or one
    for current in ([deepest.history_summary()] if two is not None else []) + [
            replace(one.history_summary(), depth=2)]:
        with pytest.raises(CompactionDepthExceeded):
            run_compact(items, active, current, (), Target(tokens_to_free=1))


line_texts = st.text(alphabet="abc xyz?.:-\u00e9\u6771", min_size=1, max_size=40).map(
    lambda t: t.strip() or "x")


@st.composite
def summary_inputs(draw: st.DrawFn) -> SummaryInput:
    roles = draw(st.lists(st.sampled_from(["assistant", "tool_call", "user"]), max_size=40))
    lines = tuple(TrustedLine(item_id=f"i{n}", sequence=n + 1, role=role,
                              text=draw(line_texts)) for n, role in enumerate(roles))
    return SummaryInput(reason="gate", goal=draw(st.sampled_from(["", "Book Lisbon"])),
                        constraints=(), open_questions=tuple(draw(st.lists(line_texts,
                                                                           max_size=3))),
                        lines=lines, pointers=tuple(f"p{n}" for n in range(draw(
                            st.integers(0, 2)))),
                        prior_narrative=draw(st.sampled_from(
                            ["", "Current goal: flights\nDecisions taken:\n- booked XK42",
                             "Earlier part. " * 30])),
                        source_event_ids=())


DECISION = re.compile(r"^- \[\d+\] .*$", re.M)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(data=summary_inputs(), max_chars=st.integers(0, 2_500), more=st.integers(1, 400))
def test_the_structured_narrative_keeps_by_priority_within_its_allowance(data, max_chars, more):
    """Within the allowance always; the goal, the open questions and the pointer line whenever
    they fit alone; the earlier narrative whole when there is room for twice it; of the
    decisions, the newest, the others counted; a larger allowance never keeps fewer."""
    out = structured_narrative(data, max_chars)
    assert len(out) <= max_chars
    whole = structured_narrative(data, 10**9)  # nothing left out
    everything = DECISION.findall(whole)
    kept = DECISION.findall(out)
    assert kept == everything[len(everything) - len(kept):]  # the newest, in order
    found = re.search(r"^- \u2026 (\d+) earlier decision\(s\) omitted$", out, re.M)
    if found:
        assert int(found.group(1)) == len(everything) - len(kept)
    # what must stay, by the lines ``whole`` holds (independent of the selection)
    stated = data.goal or next((ln.text for ln in reversed(data.lines) if ln.role == "user"),
                               "")
    goal = f"Current goal: {' '.join(stated.split()) if stated else '(not stated)'}"
    tail = whole[whole.index("Unresolved questions:"):] if data.open_questions else ""
    pointer = next((ln for ln in whole.splitlines() if ln.startswith("Tool results")), "")
    if len(goal) + len(tail) + len(pointer) + 2 <= max_chars:
        assert goal in out.splitlines()
        assert not tail or out.endswith(tail)
        assert not pointer or pointer in out.splitlines()
    if data.prior_narrative and 2 * (len(data.prior_narrative) + 20) + len(goal) + len(
            tail) + len(pointer) <= max_chars:
        assert out.startswith(f"Earlier:\n{data.prior_narrative}\n")
    if out.startswith("Earlier:\n"):  # cut, if at all, in its middle: its opening and its end
        earlier = out[len("Earlier:\n"):out.rindex(f"\n{goal}")]
        prior = data.prior_narrative
        assert earlier == prior or len(earlier) < 13 or (
            earlier[:4] == prior[:4] and earlier[-4:] == prior[-4:])
    assert len(DECISION.findall(structured_narrative(data, max_chars + more))) >= len(kept)
