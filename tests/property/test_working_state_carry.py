"""Carry across several turn boundaries (spec: "Carry rules across the turn boundary", "Working
state is bounded").

A runtime seeds each run from ``CarryWorkingState`` and then applies the run's transitions
one by one through ``UpdateWorkingState`` (a refused one changes nothing). Carrying the whole
log to the next run must give what that live path held at the end of the last run, with the
carry table applied: the log is authoritative, so it reproduces every earlier seed too.

The oracle is the live path, written here: per run, the spec's table at its boundary (completed
tasks drop, next_action resets, every other field carries), then each event through
``apply_update`` as UpdateWorkingState applies it. Generated logs span several runs and mix
every transition kind, tasks completed in one run and named again in the next without a title,
long next actions and a ceiling low enough that the block evicts.
"""

from __future__ import annotations

from dataclasses import replace

from context_engine.domain.errors import BudgetExceeded, ConstraintCapReached, InvalidInput
from context_engine.domain.items import (
    RenderContext,
    WorkingFact,
    WorkingState,
    WorkingStateItem,
    WorkingTask,
)
from context_engine.domain.trust import TrustLevel
from context_engine.domain.working_state import (
    AskUser,
    LogEvent,
    RemoveConstraint,
    ToolOutcome,
    Transition,
    Update,
    UserAnswer,
    UserObjective,
    apply_update,
    replay,
)
from hypothesis import given
from hypothesis import strategies as st

CTX = RenderContext(session_key="k" * 16)
CAP = 120  # words: low enough that generated blocks evict


def words(state: WorkingState) -> int:
    (msg,) = WorkingStateItem(state=state).messages(CTX)
    return len(msg.text.split())


TASK_IDS = st.sampled_from(["t1", "t2", "t3"])
TEXTS = st.sampled_from(["a", "b", "c"])


@st.composite
def transitions(draw: st.DrawFn) -> Transition:
    kind = draw(st.sampled_from(["update", "outcome", "ask", "answer", "objective", "remove"]))
    if kind == "outcome":
        return ToolOutcome(task_id=draw(TASK_IDS),
                           outcome=draw(st.sampled_from(["started", "succeeded", "failed"])))
    if kind == "ask":
        return AskUser(question=f"question {draw(TEXTS)}?")
    if kind == "answer":
        return UserAnswer(question=f"question {draw(TEXTS)}?")
    if kind == "objective":
        return UserObjective(objective=f"objective {draw(TEXTS)}")
    if kind == "remove":
        return RemoveConstraint(constraint=f"constraint {draw(TEXTS)}", user_event_id=1)
    tasks = draw(st.lists(st.builds(
        WorkingTask, id=TASK_IDS, title=st.sampled_from(["", "find fares", "book it"]),
        state=st.sampled_from(["open", "in_progress", "blocked", "completed"])),
        max_size=2, unique_by=lambda t: t.id))
    facts = draw(st.lists(st.builds(
        WorkingFact, statement=st.sampled_from([f"fact {i} holds here" for i in range(8)]),
        source_event_ids=st.just((1,)), trust=st.just(TrustLevel.USER)), max_size=3))
    return Update(
        objective=draw(st.none() | st.sampled_from(["objective a", "objective b"])),
        add_constraints=tuple(draw(st.lists(TEXTS.map(lambda t: f"constraint {t}"),
                                            max_size=2))),
        upsert_tasks=tuple(tasks), add_facts=tuple(facts),
        resolve_questions=tuple(draw(st.lists(TEXTS.map(lambda t: f"question {t}?"),
                                              max_size=1))),
        next_action=draw(st.none() | st.sampled_from(["next", " ".join(["step"] * 30)])))


@st.composite
def logs(draw: st.DrawFn) -> list[list[Transition]]:
    return draw(st.lists(st.lists(transitions(), min_size=1, max_size=8), min_size=1,
                         max_size=4))


def boundary(state: WorkingState) -> WorkingState:
    """The spec's carry table: completed tasks drop from context, next_action always resets,
    objective, constraints, facts and open questions carry."""
    return replace(state, tasks=tuple(t for t in state.tasks if t.state != "completed"),
                   next_action="", next_action_trust=TrustLevel.USER)


@given(logs())
def test_carrying_the_log_reproduces_the_runs_as_they_were_applied(runs):
    events: list[LogEvent] = []
    live, applied, skipped = WorkingState(), 0, 0
    sequence = 0
    for r, transitions_of_run in enumerate(runs):
        live = boundary(live)  # the run's seed
        for transition in transitions_of_run:
            sequence += 1
            events.append(LogEvent(sequence=sequence, run_id=f"r{r}", transition=transition))
            try:
                live, _ = apply_update(live, transition, run_id=f"r{r}", sequence=sequence,
                                       measure=words, token_cap=CAP)
            except (ConstraintCapReached, InvalidInput, BudgetExceeded):
                skipped += 1  # refused live: it changed nothing
            else:
                applied += 1
        sequence += 1  # the next run's seed event
    carried = replay(events, sequence + 1, measure=words, token_cap=CAP)
    assert carried.state == boundary(live)
    assert (carried.applied, carried.skipped) == (applied, skipped)
    # the log in any order is the same log
    assert replay(list(reversed(events)), sequence + 1, measure=words,
                  token_cap=CAP) == carried


def test_a_late_event_of_an_earlier_run_starts_no_turn():
    """A tool outcome of run r1 logged while r2 runs is applied to r2's state as it stood:
    r2's next action and the task it completed are not reset or dropped mid-run."""
    events = [
        LogEvent(sequence=1, run_id="r1", transition=Update(
            upsert_tasks=(WorkingTask(id="t1", title="fetch", state="in_progress"),))),
        LogEvent(sequence=3, run_id="r2", transition=Update(
            upsert_tasks=(WorkingTask(id="t2", title="book", state="completed"),),
            next_action="confirm")),
        LogEvent(sequence=4, run_id="r1", transition=ToolOutcome(task_id="t1",
                                                                 outcome="succeeded")),
        LogEvent(sequence=5, run_id="r2", transition=Update(
            upsert_tasks=(WorkingTask(id="t2", title="", state="open"),))),
    ]
    carried = replay(events, 6)
    assert (carried.applied, carried.skipped) == (4, 0)  # t2 still held when reopened
    assert [(t.id, t.state) for t in carried.state.tasks] == [("t2", "open")]
