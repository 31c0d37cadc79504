"""build(): Region A from the pinned plan, Region B from the caller's checkpoint. Pure.

spec: "Two regions and one rule" (assembly order and the active-run rule), "Pressure is
resolved by a write, never inline". No clock, no randomness, no I/O: the same plan, checkpoint
and factor always give the same bytes.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Generator, Iterable, MutableMapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import chain, compress, repeat
from operator import attrgetter, is_, itemgetter, not_
from typing import Any, cast

from context_engine.domain.breakpoints import CacheBreakpoint, history_breakpoints, select
from context_engine.domain.budget import (
    SKILL_BODY_ITEMS,
    SKILL_BODY_TOKENS,
    WORKING_STATE_TOKENS,
    BudgetPolicy,
    BudgetReport,
    KeptSteps,
    Pointed,
    Pressure,
    allocate,
    compute_budget,
    elided,
    prefix_cost,
)
from context_engine.domain.canonical import (
    NOT_AN_OBJECT,
    is_json_object,
    json_object_problem,
    session_key,
)
from context_engine.domain.compaction import merge_keeps
from context_engine.domain.envelope import FOLD, FOLDS
from context_engine.domain.errors import (
    AssemblyError,
    BudgetExceeded,
    FieldViolation,
    InvalidInput,
    PrefixHashMismatch,
)
from context_engine.domain.estimator import (
    ATTACHMENT_BUDGET_TOKENS,
    WORST_IMAGE_TOKENS,
    TokenEstimator,
    attachment_tokens,
)
from context_engine.domain.excerpts import normalize_tool_result
from context_engine.domain.history import Units, floor_index, trailing_start, units_of
from context_engine.domain.items import (
    ONE_LINE_RULE,
    ContextItem,
    ConversationItem,
    CorrectionItem,
    HistorySummary,
    KnowledgeItem,
    KnowledgePassage,
    MemoryLine,
    ReasoningItem,
    RecallItem,
    RenderContext,
    RuntimeMetadataItem,
    SkillBodyItem,
    ToolCallItem,
    ToolResultItem,
    TrailingUserInput,
    UserMessageItem,
    WorkingState,
    WorkingStateItem,
    assemble,
    declaration,
    splits_line,
)
from context_engine.domain.model import SkillCatalogEntry
from context_engine.domain.pairs import Paired, orphans, orphans_since
from context_engine.domain.plan import (
    ContextPlan,
    PlanSpec,
    RenderedPrefix,
    render_prefix,
    uncounted_framing,
)
from context_engine.domain.prefixes import shared_prefix
from context_engine.domain.request import Message, ModelRequest
from context_engine.domain.trust import Region, TrustLevel
from context_engine.domain.working_state import state_violations

DEFAULT_POLICY = BudgetPolicy()
POINTER = "builder:pointer"  # memo keys (session key, POINTER, result): the result's typed pointer
IDENTITY = "builder:identity"  # memo key (session key, IDENTITY, encoding): the identity map
IDENTITY_SLACK = 1_024  # entries an identity map may hold beyond twice a build's items
UNITS = "builder:units"  # memo key (session key, UNITS): the units of the last build's history
NORMALIZED = "builder:normalized"  # memo key (session key, NORMALIZED): the last build's items
COSTS = "builder:costs"  # memo key (session key, COSTS, encoding): the last build's item costs
PAIRED = "builder:paired"  # memo key (session key, PAIRED): the last request found well paired


@dataclass(frozen=True, slots=True)
class _KeptItems:
    """The memo's NORMALIZED entry: a build's items, at what inline maximum, as normalized,
    and the positions (ascending) of those excerpted, of its reasoning items and of its user
    messages with attachments: facts of each prefix of the items (``Normalized``)."""

    inline_maximum_bytes: int
    items: tuple[ConversationItem, ...]
    normalized: tuple[ConversationItem, ...]
    excerpted: tuple[int, ...]
    reasoning: tuple[int, ...]
    attaching: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Normalized:
    """The checkpoint's items with their tool results normalized, with where (ascending
    positions) its reasoning items and its user messages with attachments are: few, so a Build
    asks of them without reading every item."""

    items: tuple[ConversationItem, ...]
    legacy: int  # the results excerpted here (legacy tool excerpts)
    reasoning: tuple[int, ...]
    attaching: tuple[int, ...]


@dataclass(slots=True)
class _KeptCosts:
    """The memo's COSTS entry: a build's candidates, at what pricing (base factor, factor),
    their costs, each result's pointer and its cost where a pointer step found them (the list
    is filled in by later allocations of the same candidates), and each candidate as an
    assembly last sent it (``shown``: the candidate, or the pointer in its place) with that
    item's messages; and what its allocation found over the history candidates
    (``KeptSteps``; None until it has allocated)."""

    pricing: tuple[float, float]
    candidates: tuple[ContextItem, ...]
    costs: list[int]
    pointers: list[Pointed | None]
    messages: list[tuple[Message, ...]]  # the rendering of shown[i]
    shown: list[ContextItem]
    steps: KeptSteps | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class SkillBody:
    name: str
    body: str
    trust: TrustLevel


@dataclass(frozen=True, kw_only=True, slots=True)
class RuntimeMetadata:
    current_date: str = ""
    principal_scopes: tuple[str, ...] = ()
    surface: str = ""
    browser_origins: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class Checkpoint:
    active_run_id: str
    items: tuple[ConversationItem, ...]
    loaded_skills: tuple[SkillBody, ...] = ()
    working_state: WorkingState = field(default_factory=WorkingState)
    recall: tuple[MemoryLine, ...] = ()
    corrections: tuple[MemoryLine, ...] = ()
    knowledge: tuple[KnowledgePassage, ...] = ()
    runtime: RuntimeMetadata = field(default_factory=RuntimeMetadata)
    summary: HistorySummary | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class LoadedPlan:
    """A plan whose prefix was re-rendered and verified against its stored hash."""

    plan: ContextPlan
    rendered: RenderedPrefix
    session_key: str
    legacy: bool = False  # verified under its recorded (non-canonical) hash
    # the fold it was rendered with (``envelope.FOLDS``): its envelopes' escaping and, before
    # fold 9, its index entries' first sentences
    fold: int = FOLD

    @property
    def legacy_fold(self) -> bool:
        """Escaped with an older builder's fold: served as pinned, rotated by the next Plan."""
        return self.fold != FOLD


@dataclass(frozen=True, kw_only=True, slots=True)
class BuildResult:
    request: ModelRequest
    prefix_sha256: str
    epoch: int
    model_id: str
    session_key: str
    prefix_tokens: int
    body_tokens: int
    estimated_input_tokens: int
    context_window: int
    output_reserve: int
    estimator_factor: float
    tokenizer: str
    budget: BudgetReport
    pressure: Pressure
    # the plan's cache TTL, whatever markers its model's budget keeps (Gemini's cached
    # content lives this long with none)
    cache_ttl: str
    cache_breakpoints: tuple[CacheBreakpoint, ...] = ()
    # Of estimated_input_tokens, the attachments' content the request sends: upper bounds (an
    # image at its model's largest cost), not counts, which a usage report is reconciled
    # around (``calibration.reconcile``'s ``bounded``).
    attachment_tokens: int = 0
    # Provider bodies send the tool schemas' titles but the generated ones; False for a plan
    # pinned before builder@9, whose bodies drop every title (``PlanSpec.keeps_schema_titles``)
    keeps_schema_titles: bool = True


def validate_checkpoint(cp: Checkpoint, field: str = "checkpoint") -> None:
    """Reject malformed checkpoints with one violation per problem; an orphaned tool call or
    result is a malformed request, never a smaller one."""
    violations = checkpoint_violations(cp, field)
    if violations:
        raise InvalidInput(violations)


class ItemScan:
    """The state of the per-item checks after the first ``count`` items of a checkpoint (ids
    seen, calls open and answered, the last sequence): scanning continues from it, so the
    items a Build appends to a base already scanned are checked alone, with the violations and
    indexes the whole scan gives them. ``fork`` copies it; a state a base holds is never
    scanned on, only forked."""

    __slots__ = ("answered", "calls_by_id", "count", "interrupted", "last_sequence",
                 "open_calls", "pending", "runs_by_call", "seen_ids")

    def __init__(self) -> None:
        self.calls_by_id: dict[str, str] = {}  # open call id -> its tool name
        self.runs_by_call: dict[str, str] = {}  # open call id -> its run
        self.seen_ids: set[str] = set()
        self.open_calls: dict[str, int] = {}  # call id -> index of its item, until answered
        self.answered: set[str] = set()
        self.last_sequence: int | None = None
        self.interrupted: set[str] = set()  # open calls another run's item already sat after
        # the open calls no other run's item has sat after yet, in the order they were made:
        # all of one run, the last item's (an item of another run interrupts them all), so an
        # item is checked against them in one look, not against every open call
        self.pending: dict[str, None] = {}
        self.count = 0  # items scanned

    def fork(self) -> ItemScan:
        """A copy to scan on, sharing no mutable state with this one."""
        other = ItemScan.__new__(ItemScan)
        other.calls_by_id = self.calls_by_id.copy()
        other.runs_by_call = self.runs_by_call.copy()
        other.seen_ids = self.seen_ids.copy()
        other.open_calls = self.open_calls.copy()
        other.answered = self.answered.copy()
        other.last_sequence = self.last_sequence
        other.interrupted = self.interrupted.copy()
        other.pending = self.pending.copy()
        other.count = self.count
        return other

    @property
    def held(self) -> int:
        """How many ids the state holds (its size, roughly)."""
        return (len(self.seen_ids) + len(self.calls_by_id) + len(self.runs_by_call)
                + len(self.open_calls) + len(self.answered) + len(self.interrupted)
                + len(self.pending))

    def scan(self, items: Sequence[ConversationItem], violations: list[FieldViolation],
             field: str = "checkpoint") -> None:
        """Scan ``items[self.count:]`` (``items`` continue those already scanned), appending
        their violations (indexes into ``items``)."""
        calls_by_id, runs_by_call = self.calls_by_id, self.runs_by_call
        seen_ids, open_calls, answered = self.seen_ids, self.open_calls, self.answered
        interrupted, pending, last_sequence = self.interrupted, self.pending, self.last_sequence
        start = self.count
        if len(items) < start:
            raise ValueError(f"{start} items were scanned, these are {len(items)}")
        for i, item in enumerate(items[start:] if start else items, start):
            run_id = item.run_id  # paths are written only for a violation: a valid item builds none
            # a tool pair never spans two runs: nor may another run's item sit inside one (the
            # history cut and compaction see the two runs apart, and would split the pair)
            if pending:
                pending_run = runs_by_call[next(iter(pending))]
                if pending_run != run_id:
                    inside = list(pending)
                    pending.clear()
                    interrupted.update(inside)
                    violations.append(FieldViolation(
                        f"{field}.items[{i}].run_id",
                        f"run {run_id!r} sits between call(s) {', '.join(map(repr, inside))} "
                        f"of run {pending_run!r} and their results: a tool pair "
                        "never spans two runs"))
            item_id = item.id
            if not item_id:
                violations.append(FieldViolation(f"{field}.items[{i}].id", "must not be empty"))
            elif item_id in seen_ids:
                violations.append(FieldViolation(f"{field}.items[{i}].id",
                                                 f"duplicate item id {item_id!r}"))
            seen_ids.add(item_id)
            sequence = item.sequence
            if last_sequence is None:
                if sequence < 0:  # (a later item below it is below the first one too)
                    violations.append(FieldViolation(
                        f"{field}.items[{i}].sequence", f"{sequence} is negative: an item's "
                        "sequence is the session event sequence it was built from, and a "
                        "summary's floor (0 or more) would cover it unsummarized"))
            elif sequence < last_sequence:
                violations.append(FieldViolation(
                    f"{field}.items[{i}].sequence", f"{sequence} is below the previous item's "
                    f"{last_sequence}: items are ordered oldest first"))
            last_sequence = sequence
            if isinstance(item, ToolCallItem):
                if not item.calls:
                    violations.append(FieldViolation(f"{field}.items[{i}].tool_calls",
                                                     "has no calls"))
                for j, call in enumerate(item.calls):
                    cpath = f"{field}.items[{i}].tool_calls.calls[{j}]"
                    if not call.call_id:
                        violations.append(FieldViolation(f"{cpath}.call_id",
                                                         "must not be empty"))
                    elif call.call_id in open_calls or call.call_id in answered:
                        violations.append(FieldViolation(f"{cpath}.call_id",
                                                         f"duplicate call id {call.call_id!r}"))
                    else:
                        open_calls[call.call_id] = i
                        pending[call.call_id] = None
                        calls_by_id[call.call_id] = call.name
                        runs_by_call[call.call_id] = run_id
                    if not call.name:
                        violations.append(FieldViolation(f"{cpath}.name", "must not be empty"))
                    if not is_json_object(call.arguments_json):
                        violations.append(FieldViolation(
                            f"{cpath}.arguments_json",
                            json_object_problem(call.arguments_json) or NOT_AN_OBJECT))
            elif isinstance(item, ToolResultItem):
                path = f"{field}.items[{i}]"
                if item.call_id in answered:
                    violations.append(FieldViolation(
                        f"{path}.tool_result.call_id",
                        f"call {item.call_id!r} already has a result"))
                elif item.call_id not in open_calls:
                    violations.append(FieldViolation(
                        f"{path}.tool_result.call_id",
                        f"no earlier tool call has id {item.call_id!r}: a result without its "
                        "call is an orphan"))
                else:
                    # an answered call's name and run are read here for the last time (a
                    # later result for it is refused on ``answered``): the state keeps those
                    # of open calls only, so a base's state stays small to fork
                    del open_calls[item.call_id]
                    pending.pop(item.call_id, None)
                    answered.add(item.call_id)
                    call_run = runs_by_call.pop(item.call_id)
                    if call_run != run_id:
                        violations.append(FieldViolation(
                            f"{path}.run_id",
                            f"the result of call {item.call_id!r} belongs to run {run_id!r} "
                            f"but its call to run {call_run!r}: a tool pair "
                            "never spans two runs"))
                    called = calls_by_id.pop(item.call_id)
                    if item.tool_name and called and item.tool_name != called:
                        violations.append(FieldViolation(
                            f"{path}.tool_result.tool_name",
                            f"{item.tool_name!r} does not match the call's tool "
                            f"{called!r}"))
        self.last_sequence = last_sequence
        self.count = len(items)


def checkpoint_violations(cp: Checkpoint, field: str = "checkpoint", *,
                          resume: ItemScan | None = None) -> list[FieldViolation]:
    """Every violation of ``cp``, in order. ``resume``: the scan state after ``cp``'s first
    ``resume.count`` items, scanned without a violation (an incremental Build's base): only
    the items after them are scanned, the state itself left as it was. The list is the whole
    scan's either way (see :func:`checkpoint_scan`)."""
    return checkpoint_scan(cp, field, resume=resume)[0]


def checkpoint_scan(cp: Checkpoint, field: str = "checkpoint", *,
                    resume: ItemScan | None = None) -> tuple[list[FieldViolation], ItemScan]:
    """(violations, the scan state after all of ``cp.items``): ``checkpoint_violations`` and
    what a later Build appending to these items may resume from. The checks of the whole
    checkpoint (active run, summary, calls left open, skills) always run on all of it."""
    violations = _active_run_violations(cp.active_run_id, bool(cp.items),
                                        cp.items[-1] if cp.items else None, field)
    if cp.summary is not None and cp.items and cp.active_run_id:
        first_active = next((item for item in cp.items if item.run_id == cp.active_run_id),
                            None)
        if first_active is not None and \
                cp.summary.replaced_through_sequence >= first_active.sequence:
            violations.append(FieldViolation(
                f"{field}.summary.replaced_through_sequence",
                f"{cp.summary.replaced_through_sequence} covers items of the active run "
                f"(from sequence {first_active.sequence}); compaction replaces only what came "
                "before it"))
    scan = ItemScan() if resume is None else resume.fork()
    scan.scan(cp.items, violations, field)
    for call_id, index in sorted(scan.open_calls.items(), key=lambda kv: kv[1]):
        violations.append(FieldViolation(
            f"{field}.items[{index}].tool_calls",
            f"call {call_id!r} has no result: a call without its result is an orphan"))
    violations += _unitemized_violations(cp, field)
    return violations, scan


def _active_run_violations(active_run_id: str, has_items: bool,
                           last: ConversationItem | None, field: str) -> list[FieldViolation]:
    """A checkpoint with items names its active run, and the last item is that run's
    (``last``: None where it is not known)."""
    if has_items and not active_run_id:
        return [FieldViolation(f"{field}.active_run_id", "must name the run being stepped")]
    if last is not None and last.run_id != active_run_id:
        return [FieldViolation(
            f"{field}.active_run_id",
            f"the last item belongs to run {last.run_id!r}, not the active run "
            f"{active_run_id!r}: the active run's items come last")]
    return []


def _unitemized_violations(cp: Checkpoint, field: str) -> list[FieldViolation]:
    """The checks of fields the items do not bear on: the loaded skills' names, the working
    state, the knowledge passages' envelope attributes (row 12)."""
    violations = [FieldViolation(f"{field}.loaded_skills[{i}].name", "must not be empty")
                  for i, skill in enumerate(cp.loaded_skills) if not skill.name]
    violations += state_violations(cp.working_state, f"{field}.working_state")
    for i, passage in enumerate(cp.knowledge):
        for name in ("id", "source"):
            if splits_line(getattr(passage, name)):
                violations.append(FieldViolation(f"{field}.knowledge[{i}].{name}",
                                                 ONE_LINE_RULE))
    return violations


def split_trailing(items: Sequence[ConversationItem], active_run_id: str = ""
                   ) -> tuple[list[ConversationItem], list[UserMessageItem]]:
    """The items before the current input, and the current input (``trailing_start``)."""
    cut = trailing_start(items, active_run_id)
    trailing = [i for i in items[cut:] if isinstance(i, UserMessageItem)]
    return list(items[:cut]), trailing


def active_start(history: Sequence[ConversationItem], active_run_id: str) -> int:
    """Index of the active run's first item: its items are the suffix of the history."""
    k = len(history)
    while k > 0 and history[k - 1].run_id == active_run_id:
        k -= 1
    return k if active_run_id else len(history)


def fresh_rows(loaded: LoadedPlan, cp: Checkpoint) -> dict[str, ContextItem]:
    """Rows 11-14 that never yield (skills, working state, corrections, runtime metadata),
    by class name. Knowledge and recall are allocated separately: they yield."""
    rows: dict[str, ContextItem] = {}
    rt = cp.runtime
    offers_navigate = "browser.navigate" in loaded.plan.spec.tool_names or \
        "browser.navigate" in loaded.plan.spec.deferred_tool_names
    origins = rt.browser_origins if offers_navigate else ()
    if not cp.working_state.empty:
        rows["working_state"] = WorkingStateItem(state=cp.working_state)
    if cp.corrections:
        rows["corrections"] = CorrectionItem(lines=cp.corrections)
    if rt.current_date or rt.principal_scopes or rt.surface or origins:
        rows["runtime_metadata"] = RuntimeMetadataItem(
            current_date=rt.current_date, principal_scopes=rt.principal_scopes,
            surface=rt.surface, browser_origins=origins)
    return rows


def prefix_exact(spec: PlanSpec) -> bool:
    """The plan's prefix was counted with the model's own tokenizer (no base factor, as
    Claude's and Gemini's cl100k_base x 1.3, and no fallback encoding): its count is exact, so
    the correction factor never scales it and reconciliation charges the whole error to the
    body."""
    return spec.estimator_factor == 1.0 and spec.encoding == spec.model.encoding


def charged_prefix(spec: PlanSpec, prefix_tokens: int, estimator: TokenEstimator,
                   factor: float) -> int:
    """What a Build of a plan of ``spec`` whose prefix measured ``prefix_tokens`` charges the
    prefix in its budget at correction ``factor``: with the framing the stored count leaves
    out, scaled by the factor where the count is an estimate (``prefix_cost``). Plan and Rotate
    hold a draft to history's floor with it, at the factor a Build would read then."""
    return prefix_cost(prefix_tokens + uncounted_framing(spec, estimator), factor,
                       exact=prefix_exact(spec))


def working_state_tokens(estimator: TokenEstimator, ctx: RenderContext,
                         state: WorkingState) -> int:
    """The working-state block measured against its 1,000-token ceiling: the plan's estimator
    (the one of the session's first epoch, ``Engine.state_estimator``, after a rotation to
    another model) without the correction factor. The ceiling is a property of the state,
    checked the same way when UpdateWorkingState or CarryWorkingState accepts it and when
    Build renders it, so a state the service accepted never fails Build because ReportUsage
    moved the factor or the session was routed to another model (the factor and the model's
    own estimator still scale what the block costs in the body budget)."""
    return estimator.messages(WorkingStateItem(state=state).messages(ctx), 1.0)


_ATTACHMENTS = attrgetter("attachments")


def attachment_owner(item: ContextItem) -> str | None:
    """Whose attachments a cost adds (a user message's, per build): the item id, or None."""
    if isinstance(item, UserMessageItem):
        return item.id
    if isinstance(item, TrailingUserInput):
        return item.message.id
    return None


def attachment_costs(items: Sequence[ConversationItem], base_factor: float = 1.0,
                     factor: float = 1.0,
                     image_tokens: int = WORST_IMAGE_TOKENS) -> dict[str, int]:
    """Per user message: its attachments' content estimate (an image at the model's figure, a
    text file's scaled by the base and correction factors, as other text:
    ``attachment_tokens``), under one request-wide budget
    consumed newest first — what history keeps is a suffix, so a kept attachment is never
    counted at less than its estimate because an older one spent the budget (labels are
    counted in the message text itself)."""
    remaining = ATTACHMENT_BUDGET_TOKENS
    out: dict[str, int] = {}
    # the user messages with attachments, newest first (found at C speed: they are few)
    users = cast(Iterable[UserMessageItem],
                 compress(items, map(isinstance, items, repeat(UserMessageItem))))
    for item in reversed(list(filter(_ATTACHMENTS, users))):
        want = sum(attachment_tokens(a, base_factor, factor, image_tokens)
                   for a in item.attachments)
        out[item.id] = min(want, remaining)
        remaining -= out[item.id]
    return out


Rendered = tuple[tuple[Message, ...], tuple[int, ...]]


def build(loaded: LoadedPlan, cp: Checkpoint, *, estimator: TokenEstimator,
          factor: float = 1.0, policy: BudgetPolicy = DEFAULT_POLICY,
          memo: MutableMapping[Any, Rendered] | None = None,
          validated: bool = False,
          state_estimator: TokenEstimator | None = None) -> BuildResult:
    """Assemble one model request under the budget. Pure: no clock, randomness or I/O.
    ``validated``: the caller already ran ``checkpoint_violations`` on this checkpoint.
    ``state_estimator``: what the working state's ceiling is measured with, when the plan
    keeps an earlier epoch's measure (``PlanSpec.state_measure``); ``estimator`` otherwise."""
    steps = build_steps(loaded, cp, estimator=estimator, factor=factor, policy=policy,
                        memo=memo, validated=validated, state_estimator=state_estimator)
    next(steps)
    return finish(steps)


def finish(steps: Generator[Pressure, None, BuildResult]) -> BuildResult:
    """The result of ``build_steps`` once its allocation has been taken."""
    try:
        next(steps)
    except StopIteration as done:
        return cast(BuildResult, done.value)
    raise AssertionError("build_steps yields once")


def skill_violations(catalog: Sequence[SkillCatalogEntry],
                     loaded_skills: Sequence[SkillBody]) -> list[FieldViolation]:
    """What is wrong with a checkpoint's loaded skills against the plan's pinned catalog.

    A loaded skill is one of the catalog (skill.load takes no other name): its name is rendered
    in the platform's line before the envelope, so a name the catalog does not pin would put
    caller text in the platform's voice. Its body may carry no more trust than the catalog pins
    for it: the pin says where the skill comes from, and a body claiming more would leave its
    envelope (less is kept: it only envelopes more)."""
    pins = {e.name: e.trust for e in catalog}
    found = []
    loaded: dict[str, int] = {}
    for i, s in enumerate(loaded_skills):
        pinned = pins.get(s.name)
        first = loaded.setdefault(s.name, i)
        if first != i:  # two bodies under one name, each rendered as the skill's
            found.append(FieldViolation(
                f"checkpoint.loaded_skills[{i}].name",
                f"{s.name!r} is loaded already (loaded_skills[{first}]): a skill is loaded "
                "once and stays"))
        elif pinned is None:
            found.append(FieldViolation(f"checkpoint.loaded_skills[{i}].name",
                                        f"{s.name!r} is not a skill of the plan's catalog"))
        elif s.trust.rank > pinned.rank:
            found.append(FieldViolation(
                f"checkpoint.loaded_skills[{i}].trust",
                f"{s.trust.value} is above the {pinned.value} the plan's catalog pins for "
                f"skill {s.name!r}"))
    return found


def build_steps(loaded: LoadedPlan, cp: Checkpoint, *, estimator: TokenEstimator,
                factor: float = 1.0, policy: BudgetPolicy = DEFAULT_POLICY,
                memo: MutableMapping[Any, Rendered] | None = None,
                validated: bool = False,
                state_estimator: TokenEstimator | None = None
                ) -> Generator[Pressure, None, BuildResult]:
    """``build`` in two steps: it yields the allocation's pressure (what a pressure event
    records) before it assembles the request, and returns the result (``finish``). Pure like
    ``build``: the caller may start writing the event while the request is assembled."""
    if not validated:
        validate_checkpoint(cp)
    plan = loaded.plan
    model = plan.spec.model
    ctx = RenderContext(session_key=loaded.session_key)
    # an approximate prefix count is scaled like the body (reconciliation measures the whole
    # estimate for such models); an exact one never is
    prefix_tokens = charged_prefix(plan.spec, plan.prefix_tokens, estimator, factor)
    budget = compute_budget(window=model.context_window, output_reserve=model.output_reserve,
                            prefix_tokens=prefix_tokens, policy=policy)
    found_items = normalized(cp.items, policy.inline_maximum_bytes, memo,
                             (loaded.session_key, NORMALIZED))
    items, legacy = found_items.items, found_items.legacy

    # Items are frozen values: (session key, encoding, item) determines the rendered messages
    # and their raw token counts. ``memo`` (a bounded mapping the caller may keep across
    # builds) only saves the work; without it each item still renders once per build.
    renders: MutableMapping[Any, Rendered] = {} if memo is None else memo
    session, encoding, scaled = loaded.session_key, estimator.encoding, estimator.scaled
    # Each item object is looked up by identity: ``seen`` maps id(item) to an entry holding
    # the object itself (so no other object can take its id while the entry lives), its
    # rendering, its cost for one (base factor, factor) and its typed pointer. With a memo the
    # map is the session's and outlives the build (the memo hands out the same item objects
    # again, so a long session's items are not hashed again on every Build); it is dropped and
    # begun again when it holds far more than this build's items. A cost never counts an
    # attachment: that share depends on the build (what can be sent) and is added per call.
    seen: dict[int, list[Any]]
    if memo is None:
        seen = {}
    else:
        seen_key = (session, IDENTITY, encoding)
        seen = cast(dict[int, list[Any]], memo.get(seen_key))
        if seen is None or len(seen) > 2 * len(cp.items) + IDENTITY_SLACK:
            seen = {}
            cast(MutableMapping[Any, Any], memo)[seen_key] = seen
    pricing = (estimator.base_factor, factor)

    def entry(item: ContextItem) -> list[Any]:
        hit = seen.get(id(item))
        if hit is not None and hit[0] is item:
            return hit
        key = (session, encoding, item)
        found = renders.get(key)
        if found is None:
            messages = tuple(item.messages(ctx))  # type: ignore[attr-defined]
            found = (messages, tuple(estimator.raw(m) for m in messages))
            renders[key] = found
        hit = seen[id(item)] = [item, found, None, 0, None, attachment_owner(item)]
        return hit

    seen_get = seen.get

    def ceiling_raws(item: ContextItem) -> tuple[int, ...]:
        """The item's raw counts by ``state_estimator``'s encoding, kept in the memo as
        ``entry`` keeps them by the plan's (the same rendering; the counts depend on the
        encoding alone)."""
        assert state_estimator is not None
        key = (session, state_estimator.encoding, item)
        found = renders.get(key)
        if found is None:
            messages = entry(item)[1][0]
            found = (messages, tuple(state_estimator.raw(m) for m in messages))
            renders[key] = found
        return found[1]

    def cost(item: ContextItem) -> int:
        hit = seen_get(id(item))
        if hit is None or hit[0] is not item:
            hit = entry(item)
        if hit[2] != pricing:
            raws = hit[1][1]
            hit[3] = (scaled(raws[0], factor) if len(raws) == 1
                      else sum(scaled(raw, factor) for raw in raws))
            hit[2] = pricing
        owner = hit[5]
        return cast(int, hit[3] if owner is None else hit[3] + attach.get(owner, 0))

    def said_by(item: ContextItem) -> tuple[Message, ...]:
        """The item's messages, from its identity entry."""
        return cast(tuple[Message, ...], entry(item)[1][0])

    # A result's typed pointer is a value of the result: kept in the memo beside renderings,
    # and in the result's identity entry.
    pointers = cast(MutableMapping[Any, ToolResultItem], renders)

    def pointer(item: ToolResultItem) -> ToolResultItem:
        hit = entry(item)
        if hit[4] is not None:
            return cast(ToolResultItem, hit[4])
        key = (session, POINTER, item)
        found = pointers.get(key)
        if found is None:
            found = pointers[key] = elided(item)
        hit[4] = found
        return found

    history, trailing = split_trailing(items, cp.active_run_id)
    # Reasoning items never cross a run boundary: only those inside the active run's trailing
    # stretch of items are replayed, verbatim; every other one is dropped by type.
    first_active = active_start(history, cp.active_run_id)
    kept: Sequence[int]  # where each item kept was in ``history``
    reasoning = found_items.reasoning
    if reasoning and reasoning[0] < first_active:  # one before the active run (history is
        # a prefix of the items, where they are)
        kept = [i for i, item in enumerate(history)
                if not (isinstance(item, ReasoningItem) and i < first_active)]
        history = [history[i] for i in kept]
    else:  # none to drop
        kept = range(len(history))
    k = active_start(history, cp.active_run_id)
    carried, active = history[:k], history[k:]
    positions = kept[:k]
    # The units of the carried history, found from the last build's where this one's begins
    # with the same items (an append touches only the units it answers).
    if memo is None:
        found_units = units_of(carried)
    else:
        units_key = (session, UNITS)
        found_units = units_of(carried, cast(Units | None, memo.get(units_key)))
        cast(MutableMapping[Any, Any], memo)[units_key] = found_units
    floor = (floor_index(carried, cp.summary.replaced_through_sequence, found_units.spans)
             if cp.summary else 0)
    spans = (found_units.spans if floor == 0
             else [(begin - floor, end - floor) for begin, end in found_units.spans
                   if begin >= floor])

    def position(i: int) -> int:
        """An index into ``carried`` as an index into the checkpoint's items."""
        if i < len(positions):
            return positions[i]
        return kept[k] if k < len(kept) else len(items) - len(trailing)

    # only what can be sent spends the attachment budget (not what the summary replaced): the
    # user messages with attachments of carried[floor:], active and trailing, which are those
    # of the items from carried[floor]'s position on (what else is there, reasoning dropped,
    # is not a user message)
    sendable = position(floor)
    attaching = found_items.attaching[bisect_left(found_items.attaching, sendable):]
    # the model's image figure is looked up only where an attachment can be sent
    attach = attachment_costs(list(map(items.__getitem__, attaching)), estimator.base_factor,
                              factor, estimator.image_tokens) if attaching else {}

    unknown = skill_violations(loaded.plan.spec.skill_catalog, cp.loaded_skills)
    if unknown:
        raise InvalidInput(unknown)
    skills = [SkillBodyItem(name=s.name, body=s.body, skill_trust=s.trust)
              for s in cp.loaded_skills]
    if len(skills) > SKILL_BODY_ITEMS:  # a third load fails rather than evicting
        raise BudgetExceeded("skill_bodies", len(skills), SKILL_BODY_ITEMS, unit="items")
    rows = fresh_rows(loaded, cp)
    fixed = {name: cost(item) for name, item in rows.items()}
    fixed["skill_bodies"] = sum(cost(s) for s in skills)
    inputs = [TrailingUserInput(message=m) for m in trailing]
    fixed["current_user_message"] = sum(cost(i) for i in inputs)
    summary = cp.summary.as_of(cp.working_state) if cp.summary is not None else None
    if summary is not None:
        fixed["summary"] = cost(summary)
    # classes that never yield fail instead. Their ceilings are properties of what was loaded
    # or accepted, measured without the correction factor (the working state's as
    # UpdateWorkingState measured it) and with the session's first epoch's tokenizer, which a
    # rotation to another model keeps (``state_estimator``): skills loaded within the cap
    # never fail a later Build because ReportUsage moved the factor or the session was routed
    # to a model whose tokenizer counts more (the factor and the model still scale what they
    # cost in the body)
    if state_estimator is None:
        skill_tokens = sum(scaled(raw, 1.0) for s in skills for raw in entry(s)[1][1])
    else:
        skill_tokens = sum(state_estimator.scaled(raw, 1.0) for s in skills
                           for raw in ceiling_raws(s))
    if skill_tokens > SKILL_BODY_TOKENS:
        raise BudgetExceeded("skill_bodies", skill_tokens, SKILL_BODY_TOKENS)
    if "working_state" in rows:
        state_tokens = working_state_tokens(state_estimator or estimator, ctx, cp.working_state)
        if state_tokens > WORKING_STATE_TOKENS:
            raise BudgetExceeded("working_state", state_tokens, WORKING_STATE_TOKENS)

    # Each candidate's cost, found from the last build's where this one's candidates begin with
    # the same items at the same pricing; never where an attachment is sent (its share of its
    # owner's cost depends on the whole request).
    # The same for each candidate's pointer and its cost, where a pointer step of an earlier
    # build found them (the allocation fills in what it needs).
    candidates = (*carried[floor:], *active)
    pointed: list[Pointed | None] | None
    kept_costs: _KeptCosts | None = None
    kept_steps: KeptSteps | None = None
    if memo is None or attach:
        costs = pointed = None
    else:
        costs_key = (session, COSTS, encoding)
        known_costs = cast(_KeptCosts | None, memo.get(costs_key))
        held = (shared_prefix(known_costs.candidates, candidates)
                if known_costs is not None and known_costs.pricing == pricing else 0)
        if known_costs is not None and held:
            costs = [*known_costs.costs[:held], *map(cost, candidates[held:])]
            said = [*known_costs.messages[:held], *map(said_by, candidates[held:])]
            shown = [*known_costs.shown[:held], *candidates[held:]]
            pointed = [*known_costs.pointers[:held], *repeat(None, len(candidates) - held)]
            # what its allocation found over the candidates both begin with
            if known_costs.steps is not None:
                kept_steps = known_costs.steps.truncated(held)
        else:
            costs = list(map(cost, candidates))
            said = list(map(said_by, candidates))
            shown = list(candidates)
            pointed = [None] * len(candidates)
        kept_costs = _KeptCosts(pricing, candidates, costs, pointed, said, shown)
    alloc = allocate(budget=budget, prefix_tokens=prefix_tokens, factor=factor,
                     policy=policy, summary=summary, carried=carried, floor=floor,
                     active=active, fixed=fixed, knowledge=list(cp.knowledge),
                     recall=list(cp.recall), cost=cost, legacy_tool_excerpts=legacy,
                     position=position, pointer=pointer, spans=spans, costs=costs,
                     pointers=pointed, kept=kept_steps,
                     tiling=((found_units.begins, found_units.ends)
                             if floor == 0 and found_units.tiles else None),
                     # made only where a refusal asks whether a merge can fit
                     merged=(partial(merge_keeps, cp.summary, cp.working_state)
                             if cp.summary is not None else None))
    if kept_costs is not None:  # kept once complete: weighed with what the allocation found
        kept_costs.steps = alloc.kept
        cast(MutableMapping[Any, Any], memo)[costs_key] = kept_costs
    yield alloc.pressure

    head: list[ContextItem] = [alloc.summary] if alloc.summary is not None else []
    tail: list[ContextItem] = [*skills, *rows.values()]
    if alloc.knowledge:
        tail.append(KnowledgeItem(passages=alloc.knowledge))
    if alloc.recall:
        tail.append(RecallItem(lines=alloc.recall))
    tail += inputs
    # Each item's messages, from its identity entry (every item costed above has one) at C
    # speed; an item without one (a knowledge or recall block built here) is entered now.
    def messages_of(ordered: list[ContextItem]) -> Iterable[tuple[Message, ...]]:
        hits: list[Any] = list(map(seen_get, map(id, ordered)))
        if None in hits or not all(map(is_, map(itemgetter(0), hits), ordered)):
            hits = list(map(entry, ordered))
        return map(itemgetter(0), map(itemgetter(1), hits))

    block: list[ContextItem] = [*alloc.history, *alloc.active]
    around = rows_around(head, block, tail)
    if around is None:
        parts = messages_of(in_row_order([*head, *block, *tail]))
    else:
        before, after = around
        parts = chain(messages_of(before),
                      history_messages(alloc.history, len(alloc.active), kept_costs,
                                       messages_of),
                      messages_of(list(alloc.active)), messages_of(after))
    messages = tuple(chain.from_iterable(parts))
    request = ModelRequest(prefix_blocks=loaded.rendered.blocks, tools=loaded.rendered.tools,
                           messages=messages)
    if memo is None:
        assert_paired(request)
    else:
        assert_paired_since(request, cast(MutableMapping[Any, Any], memo), (session, PAIRED))
        # written again, so that a memo that weighs its entries sees what the map now holds;
        # not when the memo dropped the session meanwhile (the renderings the map points to
        # went with it: written back, it alone would hold them, weighed as if it did not)
        identity_key = (session, IDENTITY, encoding)
        if cast(MutableMapping[Any, Any], memo).get(identity_key) is seen:
            cast(MutableMapping[Any, Any], memo)[identity_key] = seen
    ttl = plan.spec.cache_ttl
    marks = [CacheBreakpoint(name="after_system", ttl=ttl),
             CacheBreakpoint(name="after_tools", ttl=ttl),
             *history_breakpoints(carried=alloc.history, has_summary=alloc.summary is not None,
                                  active=alloc.active)]
    report = alloc.report
    # what the kept user messages' attachments added to their costs (``cost``)
    attachment_tokens = 0
    if attach:
        owners = filter(None, map(attachment_owner, chain(block, inputs)))
        attachment_tokens = sum(map(attach.get, owners, repeat(0)))
    return BuildResult(
        request=request, prefix_sha256=loaded.rendered.prefix_sha256, epoch=plan.epoch,
        model_id=model.model_id, session_key=loaded.session_key,
        # the prefix as measured at Plan time (Region A's own figure); the budget report holds
        # it as the budget counts it (scaled by the factor where the count is approximate)
        prefix_tokens=plan.prefix_tokens, body_tokens=report.body_tokens,
        estimated_input_tokens=report.estimated_total, context_window=model.context_window,
        output_reserve=model.output_reserve, estimator_factor=factor,
        tokenizer=estimator.tokenizer, budget=report, pressure=alloc.pressure, cache_ttl=ttl,
        cache_breakpoints=select(marks, model.breakpoint_budget),
        attachment_tokens=attachment_tokens, keeps_schema_titles=plan.spec.keeps_schema_titles)


def normalized(items: tuple[ConversationItem, ...], inline_maximum_bytes: int,
               memo: MutableMapping[Any, Any] | None, key: tuple[str, str]) -> Normalized:
    """``normalize_tool_results`` and where the reasoning items and the user messages with
    attachments are; with ``memo``, found from the last build's where the items begin with the
    same ones at the same inline maximum (its output objects reused: an excerpted result keeps
    its identity from Build to Build; its positions kept up to there)."""
    items = tuple(items)  # kept: a list the caller changes later must not be what is kept
    known = cast(_KeptItems | None, memo.get(key)) if memo is not None else None
    held = (shared_prefix(known.items, items)
            if known is not None and known.inline_maximum_bytes == inline_maximum_bytes else 0)
    head: tuple[ConversationItem, ...] = ()
    excerpted: list[int] = []
    reasoning: list[int] = []
    attaching: list[int] = []
    if known is not None and held:
        head = known.normalized[:held]
        excerpted = list(known.excerpted[:bisect_left(known.excerpted, held)])
        reasoning = list(known.reasoning[:bisect_left(known.reasoning, held)])
        attaching = list(known.attaching[:bisect_left(known.attaching, held)])
    tail: list[ConversationItem] = []
    for i, item in enumerate(items[held:], held):
        one, was_excerpted = normalize_tool_result(item, inline_maximum_bytes)
        tail.append(one)
        if was_excerpted:
            excerpted.append(i)
        elif isinstance(one, ReasoningItem):
            reasoning.append(i)
        elif isinstance(one, UserMessageItem) and one.attachments:
            attaching.append(i)
    found = Normalized(head + tuple(tail), len(excerpted), tuple(reasoning), tuple(attaching))
    if memo is not None:
        memo[key] = _KeptItems(inline_maximum_bytes, items, found.items, tuple(excerpted),
                               found.reasoning, found.attaching)
    return found


def in_row_order(body: list[ContextItem]) -> list[ContextItem]:
    """``assemble(body, Region.B)`` reading each type's declaration once: the same order (by
    row, stable within a row) and, for a type that declares no row or another region, the same
    error (assemble fails on the first such type in the body's order, and names only the type:
    one item of each type, the types in the order they first appear, is all it needs)."""
    return list(map(body.__getitem__, row_order(body)[0]))


def row_order(body: list[ContextItem]) -> tuple[list[int], list[int]]:
    """(the positions of ``body`` in ``in_row_order``'s order, each item's row), with its
    checks."""
    kinds = list(map(type, body))
    one_of_each = dict(zip(kinds, body, strict=True))  # keys in first-appearance order
    assemble(list(one_of_each.values()), Region.B)
    rows = list(map({kind: declaration(kind)[0] for kind in one_of_each}.__getitem__, kinds))
    return sorted(range(len(body)), key=rows.__getitem__), rows


def history_messages(history: tuple[ConversationItem, ...], active: int,
                     kept: _KeptCosts | None,
                     messages_of: Callable[[list[ContextItem]], Iterable[tuple[Message, ...]]]
                     ) -> Iterable[tuple[Message, ...]]:
    """The messages of each item of ``history`` (what the allocation kept of the history
    candidates: the last of them, before the ``active`` run's), read from the kept renderings
    where the item is what an assembly last sent at its place (the candidate, or the same
    pointer: found at C speed), and from ``messages_of`` elsewhere (a pointer taking a
    candidate's place anew; with nothing kept, every item), which are kept for the next."""
    if kept is None:
        return messages_of(list(history))
    end = len(kept.candidates) - active  # the history candidates end where the run begins
    start = end - len(history)
    said = kept.messages[start:end]
    same = list(map(is_, history, kept.shown[start:end]))
    if False in same:
        at = list(compress(range(len(same)), map(not_, same)))
        for k, messages in zip(at, messages_of(list(map(history.__getitem__, at))),
                               strict=True):
            said[k] = kept.messages[start + k] = messages
            kept.shown[start + k] = history[k]
    return said


def rows_around(head: list[ContextItem], block: list[ContextItem], tail: list[ContextItem]
                ) -> tuple[list[ContextItem], list[ContextItem]] | None:
    """Where every type in ``block`` (the history and the active run: few types, found at C
    speed) declares the same row of region B, ``in_row_order([*head, *block, *tail])`` keeps
    the block whole: (what comes before it, what comes after it), which are what sorts before
    its row or at its row in ``head``, and the rest, each in ``in_row_order``'s order (and an
    item that would make ``in_row_order`` fail makes this fail alike: no type of the block
    can). None where the block's types declare another row, region or none."""
    try:
        declared = {declaration(kind)[:2] for kind in set(map(type, block))}
    except AssemblyError:
        return None
    if len(declared) != 1:
        return None
    ((row, region),) = declared
    if region is not Region.B:
        return None
    parts = [*head, *tail]
    # in_row_order's order by position (and what it raises, as for it all: the block's types
    # are declared)
    order, rows = row_order(parts)
    split = sum(1 for i in order if rows[i] < row or (rows[i] == row and i < len(head)))
    return list(map(parts.__getitem__, order[:split])), list(map(parts.__getitem__, order[split:]))


def assert_paired(request: ModelRequest) -> None:
    """The validator: an assembled request never holds an orphaned tool call or result."""
    found = orphans(request.messages)
    if found:
        raise AssemblyError(f"assembled request holds unpaired tool items: {found}")


def assert_paired_since(request: ModelRequest, memo: MutableMapping[Any, Any],
                        key: tuple[str, str]) -> None:
    """``assert_paired``, resumed where the last request the memo holds under ``key`` (well
    paired) and this one begin with the same messages (``pairs.orphans_since``); this request
    is held there in its place when it is well paired, and nothing when it is not."""
    found, paired = orphans_since(request.messages, cast(Paired | None, memo.pop(key, None)))
    if found:
        raise AssemblyError(f"assembled request holds unpaired tool items: {found}")
    memo[key] = paired


def load_plan(plan: ContextPlan) -> LoadedPlan:
    """Re-render a stored plan's prefix and verify it against the hash it was pinned with.

    A legacy plan whose hash covered its tool specifications as recorded (scope sets in the
    writer's hash-seed order) renders the same bytes: it is served under its recorded hash
    and marked ``legacy``, and the next Plan canonicalizes it (prefix_hash_canonicalized).

    A plan an older builder pinned, or a replica of an older release rotated whatever its
    label says, may hold envelope content escaped with that builder's fold, or (before fold 9)
    index entries cut at its first sentence mark: re-rendered with that fold (newest first),
    it is served as it was pinned (the provider's cache holds those
    bytes) until a rotation renders it anew (``legacy_fold``: the next Plan rotates it,
    builder_changed)."""
    key = session_key(plan.tenant_id, plan.session_id)
    rendered = render_prefix(plan.spec, key)
    if rendered.prefix_sha256 == plan.prefix_sha256:
        return LoadedPlan(plan=plan, rendered=rendered, session_key=key)
    for fold in FOLDS:
        for recorded in ((None, plan.recorded) if plan.recorded is not None else (None,)):
            if recorded is None and fold == FOLD:
                continue  # rendered above
            legacy = render_prefix(plan.spec, key, recorded=recorded, fold=fold)
            if legacy.prefix_sha256 == plan.prefix_sha256:
                return LoadedPlan(plan=plan, rendered=legacy, session_key=key,
                                  legacy=recorded is not None, fold=fold)
    raise PrefixHashMismatch(plan.prefix_sha256, rendered.prefix_sha256, plan.epoch)
