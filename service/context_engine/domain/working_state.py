"""Working state as typed transitions (spec: "Working state" through "Working state is
bounded").

The model writes working state only through the ``context.update_working_state`` control tool
(``Update``); the runtime writes only what it observes (``ToolOutcome``, ``AskUser``,
``UserAnswer``, ``UserObjective``) and what the user does (``RemoveConstraint``: constraints are
append-only for the model, and no tool input removes one). ``apply_update`` applies one
transition with the caps and eviction order; ``carry`` computes the next run's state from the
session log by the per-field carry rules. Both are pure: no clock, no randomness, the token
measure is an explicit input.

Provenance: every task, fact and open question carries the event sequence that wrote it (its
age) and its run. An entry from an earlier run is *stale*. Eviction takes completed tasks
first, then stale entries, then current ones, oldest first within each; constraints never
evict.

Trust (spec: "The working-state block carries per-entry trust"): every text entry keeps the
label of the transition that wrote it — the model's control-tool call or the user message the
runtime observed, USER unless the runtime says lower — and the block renders each entry inside
an envelope carrying it. Restating an entry keeps the lowest label it was ever written with: an
entry can be corroborated, never laundered into a higher trust.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from context_engine.domain.budget import WORKING_STATE_TOKENS
from context_engine.domain.errors import (
    BudgetExceeded,
    ConstraintCapReached,
    FieldViolation,
    InvalidInput,
)
from context_engine.domain.items import (
    EntryOrigin,
    WorkingFact,
    WorkingState,
    WorkingTask,
    labels,
)
from context_engine.domain.trust import TrustLevel, lowest

MAX_CONSTRAINTS = 20
MAX_OPEN_TASKS = 30  # bounds every task entry: completed ones are evicted first
MAX_FACTS = 40
MAX_OPEN_QUESTIONS = 20
MAX_SUPERSEDED_OBJECTIVES = 5
MAX_REMOVED_CONSTRAINTS = 2 * MAX_CONSTRAINTS  # the most recent removals are remembered
TASK_STATES = ("open", "in_progress", "blocked", "completed")
OUTCOME_STATES = {"started": "in_progress", "succeeded": "completed", "failed": "blocked"}

Measure = Callable[[WorkingState], int]


def state_violations(state: WorkingState, field: str) -> list[FieldViolation]:
    """What is wrong with a working state a caller holds (a checkpoint's, UpdateWorkingState's
    current one): over a cap of the spec, as no state the service writes is (it would render
    more than a working state holds, and make every later transition fail for a reason the
    transition did not cause), or a task id twice."""
    found = [FieldViolation(f"{field}.{name}", f"holds {count}, over the cap of {cap}")
             for name, count, cap in (
                 ("constraints", len(state.constraints), MAX_CONSTRAINTS),
                 ("tasks", sum(t.state != "completed" for t in state.tasks), MAX_OPEN_TASKS),
                 ("facts", len(state.facts), MAX_FACTS),
                 ("open_questions", len(state.open_questions), MAX_OPEN_QUESTIONS))
             if count > cap]
    seen: set[str] = set()
    for i, t in enumerate(state.tasks):
        if t.id in seen:
            found.append(FieldViolation(f"{field}.tasks[{i}]", f"duplicate task id {t.id!r}"))
        seen.add(t.id)
    return found


# ---------------------------------------------------------------- transitions

@dataclass(frozen=True, kw_only=True, slots=True)
class Update:
    """One ``context.update_working_state`` tool input. ``None`` leaves a field as it is."""

    objective: str | None = None
    add_constraints: tuple[str, ...] = ()
    upsert_tasks: tuple[WorkingTask, ...] = ()
    add_facts: tuple[WorkingFact, ...] = ()
    resolve_questions: tuple[str, ...] = ()
    next_action: str | None = None
    # the label of the model output that carried the call (at most USER)
    trust: TrustLevel = TrustLevel.USER


@dataclass(frozen=True, kw_only=True, slots=True)
class ToolOutcome:
    """Runtime: the tool call serving ``task_id`` started, succeeded or failed."""

    task_id: str
    outcome: str  # one of OUTCOME_STATES


@dataclass(frozen=True, kw_only=True, slots=True)
class AskUser:
    """Runtime: ``conversation.ask_user`` fired; the question is open until answered."""

    question: str
    trust: TrustLevel = TrustLevel.USER  # of the model output that asked it


@dataclass(frozen=True, kw_only=True, slots=True)
class UserAnswer:
    """Runtime: the user answered the open question with this exact text."""

    question: str


@dataclass(frozen=True, kw_only=True, slots=True)
class UserObjective:
    """Runtime: a user message stated an objective; a different one supersedes the current."""

    objective: str
    trust: TrustLevel = TrustLevel.USER  # of the user message that stated it


@dataclass(frozen=True, kw_only=True, slots=True)
class RemoveConstraint:
    """Runtime: the user removed a constraint (by its exact text) at session event
    ``user_event_id``. Only the user can: no ``Update`` field removes one."""

    constraint: str
    user_event_id: int


@dataclass(frozen=True, kw_only=True, slots=True)
class RefusedCall:
    """A logged control-tool call whose arguments were refused when it was made: it changed
    nothing then, so applying it raises (``replay`` counts it as skipped)."""

    violations: tuple[FieldViolation, ...]


Transition = (Update | ToolOutcome | AskUser | UserAnswer | UserObjective | RemoveConstraint
              | RefusedCall)

TRANSITION_NAMES: dict[type, str] = {
    Update: "update", ToolOutcome: "tool_outcome", AskUser: "ask_user", UserAnswer: "answer",
    UserObjective: "user_objective", RemoveConstraint: "remove_constraint",
    RefusedCall: "refused_call"}


@dataclass(frozen=True, kw_only=True, slots=True)
class Changes:
    """What one transition changed: counts and ids, never text."""

    transition: str
    objective_changed: bool = False
    objective_superseded: bool = False
    constraints_added: int = 0
    constraints_removed: int = 0
    user_event_id: int = 0  # the user's event that removed a constraint
    tasks_upserted: tuple[str, ...] = ()
    tasks_evicted: tuple[str, ...] = ()
    facts_added: int = 0
    facts_evicted: int = 0
    questions_added: int = 0
    questions_resolved: int = 0
    questions_evicted: int = 0
    next_action_changed: bool = False
    tokens: int = 0

    def summary(self) -> dict[str, Any]:
        """The ``context.working_state.updated`` payload fields (no statement, no title)."""
        return {
            "transition": self.transition, "objective_changed": self.objective_changed,
            "objective_superseded": self.objective_superseded,
            "constraints_added": self.constraints_added,
            "constraints_removed": self.constraints_removed,
            **({"user_event_id": self.user_event_id} if self.user_event_id else {}),
            "tasks_upserted": list(self.tasks_upserted),
            "tasks_evicted": list(self.tasks_evicted), "facts_added": self.facts_added,
            "facts_evicted": self.facts_evicted, "questions_added": self.questions_added,
            "questions_resolved": self.questions_resolved,
            "questions_evicted": self.questions_evicted,
            "next_action_changed": self.next_action_changed, "tokens": self.tokens,
        }


@dataclass(kw_only=True, slots=True)
class _Draft:
    """The mutable copy one transition works on (local to ``apply_update``)."""

    objective: str
    objective_trust: TrustLevel
    superseded: list[tuple[str, TrustLevel]]
    constraints: list[tuple[str, TrustLevel]]
    tasks: list[WorkingTask]
    facts: list[WorkingFact]
    questions: list[tuple[str, EntryOrigin]]
    next_action: str
    next_action_trust: TrustLevel
    removed: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    upserted: list[str] = field(default_factory=list)
    evicted_tasks: list[str] = field(default_factory=list)
    flags: set[str] = field(default_factory=set)

    @classmethod
    def of(cls, s: WorkingState) -> _Draft:
        origins = (list(s.question_origins) if len(s.question_origins) == len(s.open_questions)
                   else [EntryOrigin() for _ in s.open_questions])
        return cls(objective=s.objective, objective_trust=s.objective_trust,
                   superseded=list(zip(s.superseded_objectives,
                                       labels(s.superseded_objectives, s.superseded_trust),
                                       strict=True)),
                   constraints=list(zip(s.constraints, labels(s.constraints,
                                                              s.constraint_trust),
                                        strict=True)),
                   tasks=list(s.tasks), facts=list(s.facts),
                   questions=list(zip(s.open_questions, origins, strict=True)),
                   next_action=s.next_action, next_action_trust=s.next_action_trust,
                   removed=list(s.removed_constraints))

    def state(self) -> WorkingState:
        return WorkingState(
            objective=self.objective, constraints=tuple(c for c, _ in self.constraints),
            tasks=tuple(self.tasks), facts=tuple(self.facts),
            open_questions=tuple(q for q, _ in self.questions), next_action=self.next_action,
            superseded_objectives=tuple(o for o, _ in self.superseded),
            question_origins=tuple(o for _, o in self.questions),
            objective_trust=self.objective_trust if self.objective else TrustLevel.USER,
            constraint_trust=tuple(t for _, t in self.constraints),
            next_action_trust=self.next_action_trust if self.next_action else TrustLevel.USER,
            superseded_trust=tuple(t for _, t in self.superseded),
            removed_constraints=tuple(self.removed))

    def bump(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    # ---------------------------------------------------------------- field rules

    def set_objective(self, objective: str, trust: TrustLevel) -> None:
        """Superseded, not silently replaced: the previous objective is kept on record."""
        if not objective:
            return
        if objective == self.objective:
            self.objective_trust = lowest([self.objective_trust, trust], trust)
            return
        # one superseded before and restated: current again, at no higher label than it had
        # (a call after untrusted content's objective, set aside by the user's, must not come
        # back at the user's label by being restated), and no longer also superseded; read
        # before the current one joins the list, which may push the oldest out
        earlier = [t for o, t in self.superseded if o == objective]
        self.superseded = [o for o in self.superseded if o[0] != objective]
        if self.objective:
            self.superseded = [o for o in self.superseded if o[0] != self.objective]
            self.superseded.append((self.objective, self.objective_trust))
            del self.superseded[:-MAX_SUPERSEDED_OBJECTIVES]
            self.flags.add("objective_superseded")
        self.objective = objective
        self.objective_trust = lowest([*earlier, trust], trust)
        self.flags.add("objective_changed")

    def add_constraints(self, constraints: Sequence[str], trust: TrustLevel) -> None:
        """Append-only; at the cap the whole call fails, nothing is dropped. A constraint
        restated keeps the label it was added with: never raised (no laundering) and never
        lowered (a call after untrusted content cannot weaken, in effect remove, a constraint
        the user set)."""
        known = {c for c, _ in self.constraints}
        new: list[str] = []
        for c in constraints:
            if c in known:
                continue
            if c and c not in new:
                new.append(c)
        if len(self.constraints) + len(new) > MAX_CONSTRAINTS:
            raise ConstraintCapReached(len(self.constraints), len(new), MAX_CONSTRAINTS)
        self.constraints += [(c, trust) for c in new]
        self.removed = [r for r in self.removed if r not in new]  # set again: no longer removed
        self.bump("constraints_added", len(new))

    def remove_constraint(self, constraint: str) -> None:
        """The user's removal; removing a constraint the state does not hold is an error (the
        runtime names one it showed the user, by its exact text)."""
        kept = [(c, t) for c, t in self.constraints if c != constraint]
        if len(kept) == len(self.constraints):
            raise InvalidInput.one("transition.remove_constraint.constraint",
                                   "no such constraint in the working state (by exact text)")
        self.constraints = kept
        if constraint not in self.removed:  # a summary that retained it stops showing it
            self.removed.append(constraint)
            del self.removed[:-MAX_REMOVED_CONSTRAINTS]
        self.bump("constraints_removed")

    def upsert_task(self, task: WorkingTask, index: int, run_id: str, sequence: int,
                    trust: TrustLevel) -> None:
        if task.state not in TASK_STATES:
            raise InvalidInput.one(f"transition.update.upsert_tasks[{index}].state",
                                   f"unknown task state {task.state!r}")
        for i, t in enumerate(self.tasks):
            if t.id == task.id:
                # written again (its title, or its state alone: a claim of the writer's too,
                # a task marked done or blocked after untrusted content say), the entry takes
                # the writer's label where lower and never rises above it: its id is the first
                # writer's text. The runtime's tool outcome writes at the entry's own label.
                label = lowest([t.trust, trust], trust)
                self.tasks[i] = WorkingTask(id=t.id, title=task.title or t.title,
                                            state=task.state, sequence=sequence, run_id=run_id,
                                            trust=label)
                break
        else:
            if not task.title:
                raise InvalidInput.one(f"transition.update.upsert_tasks[{index}].title",
                                       "a new task needs a title")  # (the id: its path)
            self.tasks.append(WorkingTask(id=task.id, title=task.title, state=task.state,
                                          sequence=sequence, run_id=run_id, trust=trust))
        if task.id not in self.upserted:
            self.upserted.append(task.id)

    def add_fact(self, fact: WorkingFact, run_id: str, sequence: int) -> None:
        """One entry per statement. Restating it unions its sources and keeps the lowest
        trust: a fact can be corroborated, never laundered into a higher trust."""
        ids = tuple(sorted(set(fact.source_event_ids)))
        for i, f in enumerate(self.facts):
            if f.statement == fact.statement:
                merged = replace(f, source_event_ids=tuple(sorted(set(f.source_event_ids)
                                                                  | set(ids))),
                                 trust=lowest([f.trust, fact.trust], f.trust))
                if merged != f:
                    self.facts[i] = merged
                    self.bump("facts_added")
                return
        self.facts.append(WorkingFact(statement=fact.statement, source_event_ids=ids,
                                      trust=fact.trust, sequence=sequence, run_id=run_id))
        self.bump("facts_added")

    def open_question(self, question: str, run_id: str, sequence: int,
                      trust: TrustLevel) -> None:
        if not question:
            return
        for i, (q, o) in enumerate(self.questions):
            if q == question:
                self.questions[i] = (q, replace(o, trust=lowest([o.trust, trust], trust)))
                return
        self.questions.append((question, EntryOrigin(sequence=sequence, run_id=run_id,
                                                     trust=trust)))
        self.bump("questions_added")

    def resolve_question(self, question: str) -> None:
        kept = [(q, o) for q, o in self.questions if q != question]
        self.bump("questions_resolved", len(self.questions) - len(kept))
        self.questions = kept

    def set_next_action(self, next_action: str, trust: TrustLevel) -> None:
        if next_action != self.next_action:
            self.next_action = next_action
            self.next_action_trust = trust
            self.flags.add("next_action_changed")
        else:
            self.next_action_trust = lowest([self.next_action_trust, trust], trust)

    # ---------------------------------------------------------------- bounds

    def _candidates(self, run_id: str) -> list[tuple[tuple[int, int, int, int], str, int]]:
        """Evictable entries with their eviction key: completed tasks, then stale entries,
        then current ones; oldest first; ties by kind and position."""
        out: list[tuple[tuple[int, int, int, int], str, int]] = []
        for i, t in enumerate(self.tasks):
            rank = 0 if t.state == "completed" else (1 if t.run_id != run_id else 2)
            out.append(((rank, t.sequence, 0, i), "task", i))
        for i, f in enumerate(self.facts):
            out.append(((1 if f.run_id != run_id else 2, f.sequence, 1, i), "fact", i))
        for i, (_, o) in enumerate(self.questions):
            out.append(((1 if o.run_id != run_id else 2, o.sequence, 2, i), "question", i))
        return out

    def _evict(self, kind: str, index: int) -> None:
        if kind == "task":
            self.evicted_tasks.append(self.tasks.pop(index).id)
        elif kind == "fact":
            del self.facts[index]
            self.bump("facts_evicted")
        else:
            del self.questions[index]
            self.bump("questions_evicted")

    def _evict_first(self, run_id: str, kind: str | None = None) -> bool:
        candidates = [c for c in self._candidates(run_id) if kind is None or c[1] == kind]
        if not candidates:
            return False
        _, which, index = min(candidates)
        self._evict(which, index)
        return True

    def bound(self, run_id: str, measure: Measure | None, token_cap: int) -> int:
        """Apply the entry caps, then the token ceiling; returns the block's tokens."""
        while len(self.tasks) > MAX_OPEN_TASKS:
            self._evict_first(run_id, "task")
        while len(self.facts) > MAX_FACTS:
            self._evict_first(run_id, "fact")
        while len(self.questions) > MAX_OPEN_QUESTIONS:
            self._evict_first(run_id, "question")
        if measure is None:
            return 0
        tokens = measure(self.state())
        while tokens > token_cap:
            if not self._evict_first(run_id):
                # objective, constraints and next action alone are over the ceiling
                raise BudgetExceeded("working_state", tokens, token_cap)
            tokens = measure(self.state())
        return tokens


# (the tool result's line, at most MAX_ERROR_LINE_BYTES, holds it whole)
UNSOURCED_FACT = "must list the events it rests on: a fact below user is a claim attributed to them"


def unsourced_facts(update: Update) -> list[FieldViolation]:
    """The facts of an update that would enter the state below USER (their own label or the
    update's: read off a tool result, page, email, file or memory, or written by a call after
    one) without a source event id (spec: "The working-state block carries per-entry trust":
    such a fact "enters established_facts only as an attributed claim ... with its source
    event id — never as a bare assertion"). Build renders it as "A source (events ...)
    states: ...", which without an id names no source at all."""
    return [FieldViolation(f"transition.update.add_facts[{i}].source_event_ids", UNSOURCED_FACT)
            for i, fact in enumerate(update.add_facts)
            if not fact.source_event_ids
            and lowest([fact.trust, update.trust], update.trust).rank < TrustLevel.USER.rank]


def apply_update(state: WorkingState, transition: Transition, *, run_id: str, sequence: int,
                 measure: Measure | None = None,
                 token_cap: int = WORKING_STATE_TOKENS) -> tuple[WorkingState, Changes]:
    """Apply one transition, written at event ``sequence`` by run ``run_id``. ``measure``
    estimates the rendered block's tokens (the plan's estimator); without it only the entry
    caps apply. Raises ConstraintCapReached, InvalidInput (a new task without a title, an
    unknown task, outcome or constraint, a refused call, a fact below USER without a source
    event id) or BudgetExceeded; a failed transition changes nothing."""
    if isinstance(transition, RefusedCall):
        raise InvalidInput(list(transition.violations))
    if isinstance(transition, Update):
        unsourced = unsourced_facts(transition)
        if unsourced:
            raise InvalidInput(unsourced)
    d = _Draft.of(state)
    if isinstance(transition, Update):
        label = transition.trust
        if transition.objective is not None:
            d.set_objective(transition.objective, label)
        d.add_constraints(transition.add_constraints, label)
        for i, task in enumerate(transition.upsert_tasks):
            # a task's own label (a typed update's) can only lower the call's, as a fact's
            d.upsert_task(task, i, run_id, sequence, lowest([task.trust, label], label))
        for fact in transition.add_facts:
            # a fact is written by the call too: never above the call's own label
            d.add_fact(replace(fact, trust=lowest([fact.trust, label], label)), run_id,
                       sequence)
        for question in transition.resolve_questions:
            d.resolve_question(question)
        if transition.next_action is not None:
            d.set_next_action(transition.next_action, label)
    elif isinstance(transition, ToolOutcome):
        target = OUTCOME_STATES.get(transition.outcome)
        if target is None:
            raise InvalidInput.one("transition.tool_outcome.outcome",
                                   f"unknown outcome {transition.outcome!r}")
        current = next((t for t in d.tasks if t.id == transition.task_id), None)
        if current is None:
            raise InvalidInput.one("transition.tool_outcome.task_id",
                                   f"no task {transition.task_id!r} in the working state")
        d.upsert_task(WorkingTask(id=current.id, title="", state=target), 0, run_id, sequence,
                      current.trust)
    elif isinstance(transition, AskUser):
        d.open_question(transition.question, run_id, sequence, transition.trust)
    elif isinstance(transition, UserAnswer):
        d.resolve_question(transition.question)
    elif isinstance(transition, RemoveConstraint):
        d.remove_constraint(transition.constraint)
    else:
        d.set_objective(transition.objective, transition.trust)
    tokens = d.bound(run_id, measure, token_cap)
    changes = Changes(
        transition=TRANSITION_NAMES[type(transition)],
        objective_changed="objective_changed" in d.flags,
        objective_superseded="objective_superseded" in d.flags,
        constraints_added=d.counts.get("constraints_added", 0),
        constraints_removed=d.counts.get("constraints_removed", 0),
        user_event_id=(transition.user_event_id if isinstance(transition, RemoveConstraint)
                       else 0),
        tasks_upserted=tuple(d.upserted), tasks_evicted=tuple(d.evicted_tasks),
        facts_added=d.counts.get("facts_added", 0),
        facts_evicted=d.counts.get("facts_evicted", 0),
        questions_added=d.counts.get("questions_added", 0),
        questions_resolved=d.counts.get("questions_resolved", 0),
        questions_evicted=d.counts.get("questions_evicted", 0),
        next_action_changed="next_action_changed" in d.flags, tokens=tokens)
    return d.state(), changes


# ---------------------------------------------------------------- carry


@dataclass(frozen=True, kw_only=True, slots=True)
class LogEvent:
    """One session log event relevant to working state."""

    sequence: int
    run_id: str
    transition: Transition


@dataclass(frozen=True, kw_only=True, slots=True)
class Carried:
    state: WorkingState
    applied: int
    skipped: int
    tokens: int


def turn_boundary(state: WorkingState) -> WorkingState:
    """The carry rules at a turn boundary: completed tasks drop (they stay in the log),
    next_action resets; objective (with its superseded record), constraints, facts with their
    provenance and unanswered questions carry."""
    return replace(state, tasks=tuple(t for t in state.tasks if t.state != "completed"),
                   next_action="", next_action_trust=TrustLevel.USER)


def replay(events: Sequence[LogEvent], seed_event_sequence: int, *,
           measure: Measure | None = None, token_cap: int = WORKING_STATE_TOKENS) -> Carried:
    """``carry`` with its counts: events applied, and events skipped because their transition
    failed when made (a failed call changed nothing then, so it changes nothing now).

    Every run seeded from the carry rules, so they apply at every turn boundary of the log,
    not only at the last: before the first event of each run after the first (a run starts
    where its id first appears; a later event of an earlier run starts nothing). Each run's
    events then meet the state that run held, as UpdateWorkingState applied them: a completed
    task of an earlier run is not there to be upserted again, and an earlier run's next action
    weighs on no later run's ceiling."""
    state = WorkingState()
    applied = skipped = 0
    ordered = sorted((e for e in events if e.sequence < seed_event_sequence),
                     key=lambda e: e.sequence)
    runs: set[str] = set()
    for e in ordered:
        if e.run_id not in runs:
            if runs:
                state = turn_boundary(state)
            runs.add(e.run_id)
        try:
            state, _ = apply_update(state, e.transition, run_id=e.run_id, sequence=e.sequence,
                                    measure=measure, token_cap=token_cap)
        except (ConstraintCapReached, InvalidInput, BudgetExceeded):
            skipped += 1
            continue
        applied += 1
    state = turn_boundary(state)  # the new run's own
    tokens = measure(state) if measure is not None and not state.empty else 0
    return Carried(state=state, applied=applied, skipped=skipped, tokens=tokens)


def carry(events: Sequence[LogEvent], seed_event_sequence: int, *,
          measure: Measure | None = None, token_cap: int = WORKING_STATE_TOKENS) -> WorkingState:
    """The next run's working state, computed from the session's log events strictly below
    the run's seed event sequence (never copied from the previous checkpoint)."""
    return replay(events, seed_event_sequence, measure=measure, token_cap=token_cap).state
