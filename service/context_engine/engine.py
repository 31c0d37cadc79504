"""The application service: orchestrates the pure domain, the stores and the metrics."""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import orjson
from opentelemetry.trace import NoOpTracer, Tracer

from context_engine.build_cache import BuildCache
from context_engine.clock import SYSTEM_CLOCK, Clock, time_ns
from context_engine.domain.budget import (
    BudgetPolicy,
    Pressure,
    YieldStep,
    compute_budget,
    prefix_cost,
    require_history_floor,
)
from context_engine.domain.builder import (
    DEFAULT_POLICY,
    BuildResult,
    Checkpoint,
    LoadedPlan,
    attachment_costs,
    build_steps,
    charged_prefix,
    finish,
    load_plan,
    prefix_exact,
    working_state_tokens,
)
from context_engine.domain.calibration import Calibration, Reconciled, least_factor, reconcile
from context_engine.domain.canonical import canonical_sha256, session_key
from context_engine.domain.compaction import (
    DEFAULT_SUMMARY_TOKENS,
    CompactionResult,
    StructuredSummarizer,
    Summarizer,
    Target,
    compact,
)
from context_engine.domain.errors import (
    BudgetExceeded,
    CountUnsettled,
    FieldViolation,
    InvalidInput,
    PrefixHashMismatch,
    SessionNotFound,
    StoreUnavailable,
    TokenizerUnavailable,
)
from context_engine.domain.estimator import (
    ModelCatalog,
    TokenEstimator,
    TokenizerRegistry,
)
from context_engine.domain.items import (
    HistorySummary,
    RenderContext,
    WorkingState,
)
from context_engine.domain.model import (
    AgentSpec,
    MemorySnapshot,
    ModelProfile,
    Persona,
    PlanInputs,
    PlatformAssets,
    SessionKind,
    SkillCatalogEntry,
    ToolSpec,
)
from context_engine.domain.plan import (
    BUILDER_VERSION,
    SESSION_OPENED,
    ContextPlan,
    PlanDraft,
    PlanSpec,
    RenderedPrefix,
    admission_reason,
    capability_conflict,
    draft_pinned,
    draft_plan,
    is_older,
    keeping_state_measure,
    redraft,
    render_prefix,
    rotation_reason_for,
    uncounted_framing,
)
from context_engine.domain.ports import (
    CalibrationStore,
    CompactionStore,
    ContextEvent,
    EpochUsage,
    Erased,
    EventLog,
    IncarnationChanged,
    InMemoryCompactionStore,
    PlanStore,
    Rotation,
    SessionEraser,
    check_stored,
)
from context_engine.domain.providers import unsendable_definitions
from context_engine.domain.working_state import (
    Carried,
    Changes,
    LogEvent,
    Measure,
    Transition,
    apply_update,
    replay,
)
from context_engine.render_memo import BoundedMemo
from context_engine.telemetry.logs import log
from context_engine.telemetry.metrics import Metrics
from context_engine.telemetry.tracing import child

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelRequestSpec:
    model_id: str
    context_window: int | None = None
    output_reserve: int | None = None
    breakpoint_budget: int | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanCommand:
    tenant_id: str
    session_id: str
    agent: AgentSpec
    persona: Persona
    tool_catalog: tuple[ToolSpec, ...]
    principal_scopes: tuple[str, ...]
    model: ModelRequestSpec
    session_kind: SessionKind
    website_profile_id: str
    skill_catalog: tuple[SkillCatalogEntry, ...]
    memory_snapshot: MemorySnapshot
    # the run being admitted: None, or (run_id, tools_pinned or has pending calls)
    run_id: str = ""
    run_pinned: bool = True
    invalidated_trace_ids: tuple[str, ...] = ()

    def reason_to_rotate(self, current: PlanSpec, assets: PlatformAssets) -> str | None:
        reason = rotation_reason_for(
            current, agent=self.agent, persona=self.persona, model_id=self.model.model_id,
            assets=assets, builder_version=BUILDER_VERSION) or admission_reason(
            current, unpinned=bool(self.run_id) and not self.run_pinned,
            principal_scopes=self.principal_scopes,
            website_profile_id=self.website_profile_id,
            invalidated_trace_ids=self.invalidated_trace_ids)
        if reason is None:  # kept: a capability declared otherwise would be ignored silently
            capability_conflict(current.model, self.model.model_id,
                                context_window=self.model.context_window,
                                output_reserve=self.model.output_reserve,
                                breakpoint_budget=self.model.breakpoint_budget)
        return reason


@dataclass(frozen=True, kw_only=True, slots=True)
class RotateCommand:
    tenant_id: str
    session_id: str
    reason: str  # one of plan.ROTATION_REASONS
    idempotency_key: str
    drop_tools: tuple[str, ...] = ()
    model: ModelRequestSpec | None = None
    snapshot: MemorySnapshot | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class UsageReport:
    tenant_id: str
    session_id: str
    epoch: int | None
    estimated_input_tokens: int
    estimator_factor: float
    input_tokens: int
    cached_tokens: int
    output_tokens: int
    idempotency_key: str
    # of estimated_input_tokens, the attachments' upper bounds (Build's
    # estimated_attachment_tokens; 0: none, or not known)
    estimated_attachment_tokens: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class UsageOutcome:
    model_id: str
    reconciled: Reconciled
    counted: bool
    epoch: int  # the plan the report counted against (its log line and span name it)
    prefix_sha256: str


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkingStateCommand:
    tenant_id: str
    session_id: str
    run_id: str
    current: WorkingState
    sequence: int
    transition: Transition
    factor: float | None = None
    call_id: str = ""  # the model's call, when the transition came as its raw tool call


@dataclass(frozen=True, kw_only=True, slots=True)
class CarryCommand:
    tenant_id: str
    session_id: str
    seed_event_sequence: int
    events: tuple[LogEvent, ...]
    factor: float | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class CompactCommand:
    tenant_id: str
    session_id: str
    checkpoint: Checkpoint
    current: HistorySummary | None
    target: Target
    reason: str
    idempotency_key: str
    fingerprint: str
    max_summary_tokens: int = DEFAULT_SUMMARY_TOKENS
    factor: float | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class CompactOutcome:
    result: CompactionResult
    compacted: bool
    epoch: int
    prefix_sha256: str


PlanKey = tuple[str, str, int, int]  # tenant, session, incarnation, epoch


class PlanCache:
    """Verified plans by (tenant, session, incarnation, epoch), least recently used first.
    Plans are immutable per epoch, so a hit can change only how long a call takes, never what
    it returns, as long as the session still exists: each entry keeps when the database last
    confirmed it (the injected clock's monotonic seconds), and a lookup that does not read the
    database itself (a Build naming its epoch) trusts it for ``ttl`` seconds only. The
    incarnation keeps a session erased and planned again (epoch 1 again) from ever being
    served the erased session's plan."""

    def __init__(self, capacity: int, ttl: float = 60.0) -> None:
        self._capacity = capacity
        self.ttl = ttl
        self._entries: OrderedDict[PlanKey, tuple[LoadedPlan, float]] = OrderedDict()
        # each session that has entries: its latest incarnation cached and its entry count
        self._sessions: dict[tuple[str, str], tuple[int, int]] = {}

    def get(self, key: PlanKey, *, verified_at: float | None = None) -> LoadedPlan | None:
        """The entry of ``key``, whatever its age; ``verified_at``: the database has just
        confirmed the session's incarnation and epoch (the entry's age starts again)."""
        hit = self._entries.get(key)
        if hit is None:
            return None
        if verified_at is not None:
            self._entries[key] = (hit[0], verified_at)
        self._entries.move_to_end(key)
        return hit[0]

    def newest(self, tenant_id: str, session_id: str,
               epoch: int) -> tuple[PlanKey, LoadedPlan, float] | None:
        """The epoch's entry of the latest incarnation cached, with when it was verified."""
        known = self._sessions.get((tenant_id, session_id))
        if known is None:
            return None
        key = (tenant_id, session_id, known[0], epoch)
        hit = self._entries.get(key)
        if hit is None:
            return None
        self._entries.move_to_end(key)
        return key, hit[0], hit[1]

    def put(self, key: PlanKey, value: LoadedPlan, *, verified_at: float) -> None:
        tenant_id, session_id, incarnation, _ = key
        known = self._sessions.get((tenant_id, session_id))
        if known is not None and incarnation < known[0]:
            return  # an erased incarnation's plan, read before the erasure: never cached
        if known is not None and incarnation > known[0]:  # the session was erased meanwhile
            self.forget(tenant_id, session_id)
            known = None
        if key not in self._entries:
            latest, count = known or (incarnation, 0)
            self._sessions[(tenant_id, session_id)] = (max(latest, incarnation), count + 1)
        self._entries[key] = (value, verified_at)
        self._entries.move_to_end(key)
        while len(self._entries) > self._capacity:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: PlanKey) -> None:
        del self._entries[key]
        session = (key[0], key[1])
        latest, count = self._sessions[session]
        if count == 1:
            del self._sessions[session]
        else:
            self._sessions[session] = (latest, count - 1)

    def incarnation(self, tenant_id: str, session_id: str) -> int | None:
        """The incarnation of the session its entries are of (None: none cached): a put of a
        later one drops them, an older one is never put."""
        known = self._sessions.get((tenant_id, session_id))
        return None if known is None else known[0]

    def forget(self, tenant_id: str, session_id: str) -> None:
        """Drop every entry of the session: it was erased, here or on another replica."""
        if (tenant_id, session_id) not in self._sessions:
            return  # nothing of it is cached
        for key in [k for k in self._entries if k[0] == tenant_id and k[1] == session_id]:
            self._drop(key)

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self._sessions.clear()


def derived_spans(tracer: Tracer, pressure: Pressure, at: int,
                  history: tuple[int, int] | None) -> None:
    """History selection and the yield ladder run inside the pure build, which keeps no clock:
    their spans are recorded from its result as zero-length children at ``at`` (ns) carrying
    what was decided. ``history``: (tokens, items) the history class kept, when known."""
    attrs: dict[str, Any] = {
        "context_engine.derived": True,
        "context_engine.history.cut_index": pressure.cut_index,
        "context_engine.history.floor_index": pressure.floor_index,
        "context_engine.history.left_out_items": pressure.left_out_items,
        "context_engine.history.left_out_tokens": pressure.left_out_tokens,
        "context_engine.history.compact_through_sequence": pressure.compact_through_sequence,
        "context_engine.compaction_needed": pressure.compaction_needed}
    if history is not None:
        attrs["context_engine.history.tokens"], attrs["context_engine.history.items"] = history
    tracer.start_span("context_engine.history_selection", start_time=at,
                      attributes=attrs).end(end_time=at)
    for step in pressure.steps:
        tracer.start_span("context_engine.yield", start_time=at, attributes={
            "context_engine.derived": True, "context_engine.yield.step": step.step,
            "context_engine.yield.units": step.units,
            "context_engine.yield.tokens_before": step.tokens_before,
            "context_engine.yield.tokens_after": step.tokens_after,
            "context_engine.yield.fits": pressure.fits}).end(end_time=at)


# A yield step naming more item ids than this is recorded in its pressure event by their count,
# first and last id and digest, not id by id (the response names every one of them).
EVENT_STEP_IDS = 64


def step_record(step: YieldStep) -> dict[str, Any]:
    """One yield step as its pressure event records it: its ids themselves up to
    ``EVENT_STEP_IDS`` of them, else their count, the first and the last, and the SHA-256 of
    all of them as a canonical JSON array (``item_ids_sha256``: JSON.stringify's text, no
    ASCII or HTML escapes, in UTF-8), which a runtime holding the response's ids can check.
    A long session's history cut and pointered tool results name thousands of ids on every
    Build; written id by id they made the event grow with the session (27 KB at 3,000 items)
    and its write the largest part of an incremental Build that did."""
    ids = step.ids
    out: dict[str, Any] = {"step": step.step, "units": step.units, "item_count": len(ids),
                           "tokens_before": step.tokens_before,
                           "tokens_after": step.tokens_after}
    if len(ids) <= EVENT_STEP_IDS:
        out["item_ids"] = list(ids)
    else:
        out["first_item_id"], out["last_item_id"] = ids[0], ids[-1]
        # the canonical array's bytes (for a list of strings orjson writes the standard
        # library's canonical text) in a tenth of canonical_json's time over 1,400 ids
        out["item_ids_sha256"] = hashlib.sha256(orjson.dumps(ids)).hexdigest()
    return out


def pressure_payload(p: Pressure, epoch: int) -> dict[str, Any]:
    """What a pressure event records: steps, sizes and ids (``step_record``), never
    content."""
    return {
        "epoch": epoch, "fits": p.fits, "tokens_before": p.tokens_before,
        "tokens_after": p.tokens_after, "body_budget": p.body_budget,
        "steps": [step_record(s) for s in p.steps],
        "compaction_needed": p.compaction_needed, "left_out_items": p.left_out_items,
        "left_out_tokens": p.left_out_tokens, "history_cut_index": p.cut_index,
        "summary_floor_index": p.floor_index,
        "legacy_tool_excerpts": p.legacy_tool_excerpts,
        "history_floor_shortfall": p.history_floor_shortfall,
        "prefix_floor_shortfall": p.prefix_floor_shortfall,
        "compact_through_sequence": p.compact_through_sequence,
    }


def snapshot_fence_key(session_id: str, epoch: int, run_id: str) -> str:
    """The idempotency key of a run's ``context.snapshot.used``: ``<session>:<epoch>:<run>``
    where that is unambiguous (no ``:`` in the session id) and short (a key is part of a
    B-tree index's row); otherwise ``sha256:`` and the hash of the three, so that two sessions
    of a tenant never share a key ("a", run "2:r" and "a:1", run "r" did) and long ids never
    fail the insert. Keys written before keep their form: a bound run is not bound again."""
    key = f"{session_id}:{epoch}:{run_id}"
    if ":" not in session_id and len(key.encode()) <= 512:
        return key
    return "sha256:" + canonical_sha256([session_id, epoch, run_id])


def factor_floor(spec: PlanSpec) -> float:
    """The plan's ``least_factor``: an approximation of the model's own count (Claude's and
    Gemini's cl100k_base x 1.3) never below the encoding's own count; a fallback encoding
    (another model's tokenizer standing in, times ``FALLBACK_FACTOR``), which the model's own
    may count well below, keeps the general floor."""
    own = spec.encoding == spec.model.encoding
    return least_factor(prefix_exact(spec), spec.estimator_factor if own else None)


def _epoch_of(plan: ContextPlan | None) -> tuple[int, int] | None:
    """Which epoch of which incarnation ``plan`` is (None: no session)."""
    return None if plan is None else (plan.epoch, plan.incarnation)


class _ErasedMeanwhile(Exception):
    """The session was erased between reading its plan and locking it (raised under the lock,
    so nothing is written)."""


class _FactorUnread(Exception):
    """A draft held to history's floor is of a model and encoding whose correction factor this
    call has not read (which, only the draft says: a rotation that keeps the model drafts
    under the session's lock, where nothing is awaited): raised before anything is written;
    the factor is read and the call tried again (``Engine._reading_factors``)."""

    def __init__(self, spec: PlanSpec) -> None:
        super().__init__(spec.model.model_id, spec.encoding)
        self.spec = spec


# The tenant's reconciled correction factors a Plan or Rotate has read, by (model id, encoding).
Factors = dict[tuple[str, str], float]


FORGOTTEN_KEPT = 4_096  # the sessions forgotten most recently whose turn is remembered
RUNS_KEPT = 65_536  # the runs bound to their snapshot most recently that are remembered
NAMED_KEPT = 16_384  # the sessions read most recently whose latest incarnation is remembered
# the (tenant, model id) pairs whose correction factor was read most recently (a model id is the
# caller's: without a bound, distinct ids grew the map for the life of the process)
FACTORS_KEPT = 65_536


class Engine:
    def __init__(self, *, store: PlanStore, events: EventLog, calibrations: CalibrationStore,
                 catalog: ModelCatalog, tokenizers: TokenizerRegistry, assets: PlatformAssets,
                 control_tools: dict[str, ToolSpec], metrics: Metrics,
                 policy: BudgetPolicy = DEFAULT_POLICY, plan_cache_size: int = 4096,
                 plan_cache_ttl: float = 60.0,
                 calibration_ttl: float = 5.0, render_memo_bytes: int = 256 * 1024 * 1024,
                 build_cache_bytes: int = 256 * 1024 * 1024,
                 clock: Clock = SYSTEM_CLOCK,
                 compactions: CompactionStore | None = None,
                 summarizer: Summarizer | None = None,
                 erasure: SessionEraser | None = None,
                 tracer: Tracer | None = None) -> None:
        self._tracer: Tracer = tracer or NoOpTracer()
        self._store = store
        self._compactions: CompactionStore = compactions or InMemoryCompactionStore()
        self._summarizer: Summarizer = summarizer or StructuredSummarizer()
        self._events = events
        self._calibrations = calibrations
        self._catalog = catalog
        self._tokenizers = tokenizers
        self._assets = assets
        self._control_tools = control_tools
        self._metrics = metrics
        self.policy = policy
        self.cache = PlanCache(plan_cache_size, plan_cache_ttl)
        self._erasure = erasure
        self._factors: OrderedDict[tuple[str, str], tuple[float, float]] = OrderedDict()
        # runs bound to their snapshot: (tenant, session, incarnation, epoch, run id)
        self._snapshot_runs: OrderedDict[tuple[str, str, int, int, str], None] = OrderedDict()
        self._run_counts: dict[tuple[str, str], int] = {}  # how many of those per session
        # sessions forgotten (erased), counted, and per session when it last was, the latest
        # incarnation a forget found it planned again as (-1: none) and when it was last erased
        # (0: not since remembered): a Build that ran meanwhile forgets again what it kept of
        # one (``forgotten_since``)
        self.forgets = 0
        self._forgotten: OrderedDict[tuple[str, str], tuple[int, int, int]] = OrderedDict()
        # per session read most recently: the latest incarnation a read named (or a forget
        # found): a Build that ran on an older one ran on an erased session (``forgotten_since``)
        self._newest: OrderedDict[tuple[str, str], int] = OrderedDict()
        self.render_memo = BoundedMemo(render_memo_bytes)
        # the bases of incremental Builds (BuildRequest.base_build_id), per process
        self.builds = BuildCache(build_cache_bytes)
        self._calibration_ttl = calibration_ttl
        self._clock = clock

    @property
    def catalog(self) -> ModelCatalog:
        """The model catalog this engine sizes models by: also where a Build's default
        provider format and a Plan's ``default_provider_format`` come from."""
        return self._catalog

    # ------------------------------------------------------------------ estimators

    def estimator_for(self, model: ModelProfile) -> TokenEstimator:
        """At Plan time: the model's encoding, or a conservative fallback (recorded)."""
        counter, extra = self._tokenizers.counter_for(model.encoding)
        return TokenEstimator(counter, round(model.base_factor * extra, 6))

    def _exact(self, encoding: str, base_factor: float, *args: Any) -> TokenEstimator:
        """An estimator on exactly ``encoding`` (TokenizerUnavailable where this replica has
        it not)."""
        counter = self._tokenizers.exact(encoding)
        if counter is None:
            raise TokenizerUnavailable(encoding)
        return TokenEstimator(counter, base_factor, *args)

    def plan_estimator(self, spec: PlanSpec) -> TokenEstimator:
        """At Build time: exactly what the plan pinned, on every replica."""
        # the model's image figure from the catalog, looked up only if an attachment is counted
        return self._exact(spec.encoding, spec.estimator_factor, spec.tokenizer,
                           partial(self._catalog.image_tokens, spec.model.model_id))

    def state_estimator(self, spec: PlanSpec) -> TokenEstimator:
        """What the working state's 1,000-token ceiling is measured with: the session's first
        epoch's encoding and factor, which a rotation to another model keeps
        (``PlanSpec.state_measure``), so a state accepted before it is accepted after it."""
        if spec.state_measure is None:
            return self.plan_estimator(spec)
        return self._exact(*spec.state_measure)

    # ------------------------------------------------------------------ Plan

    async def plan(self, cmd: PlanCommand, *,
                   then: Callable[[LoadedPlan], object] | None = None
                   ) -> tuple[ContextPlan, bool]:
        """``then``: the caller's work on an epoch this call writes (its response), given the
        plan as it will be served, before the write commits: what it raises writes nothing
        (no epoch, event, cached plan or metric). Not called when nothing is written."""
        current = await self._store.get(cmd.tenant_id, cmd.session_id)
        # served with an older builder's escaping or index whatever its label says (a replica
        # of that release rotated it): drafted anew, as a builder change
        escaped_before = False
        if current is not None and cmd.reason_to_rotate(current.spec, self._assets) is None:
            # Pinned: tools, scopes and snapshot are not even re-resolved (a revocation is
            # enforced at call time, never by rewriting the prefix).
            try:
                loaded = await self.loaded(cmd.tenant_id, cmd.session_id, current.epoch,
                                           incarnation=current.incarnation)
            except SessionNotFound:
                loaded = None  # erased since it was read: opened anew below
            # (planned again meanwhile: the response reads that plan)
            if loaded is None:
                current = None
            elif loaded.legacy_fold:
                escaped_before = True
            elif loaded.legacy:
                try:
                    return await self._canonicalize(loaded, then)
                except _ErasedMeanwhile:
                    current = None  # opened anew below
            else:
                await self._counted(current)  # written, its writer's COMMIT answer lost
                return current, False

        key = session_key(cmd.tenant_id, cmd.session_id)

        def profile_for(base: ContextPlan | None) -> ModelProfile:
            """The request's model, sized over ``base``: of the pinned model id, a capability
            the request leaves out keeps the pinned value (one it declares is taken), so a
            rotation for another reason never resizes the model behind the caller's back."""
            model = cmd.model
            pinned = (base.spec.model if base is not None
                      and base.spec.model.model_id == model.model_id else None)

            def kept(declared: int | None, name: str) -> int | None:
                return declared if declared is not None or pinned is None else int(
                    getattr(pinned, name))
            return self._catalog.resolve(
                model.model_id,
                context_window=kept(model.context_window, "context_window"),
                output_reserve=kept(model.output_reserve, "output_reserve"),
                breakpoint_budget=kept(model.breakpoint_budget, "breakpoint_budget"))

        # the tenant's correction factors read for this call (a draft's floor is held at them)
        factors: Factors = {}
        # each base's draft, made once: a draft tried again once its factor is read is only
        # checked again
        made: dict[tuple[int, int] | None, tuple[PlanDraft, TokenEstimator, bool]] = {}

        def draft_for(base: ContextPlan | None) -> PlanDraft:
            """The next epoch over ``base`` (None: a session opened). Pure, and may fail
            (caps, required tools): then nothing is written."""
            if _epoch_of(base) not in made:
                made[_epoch_of(base)] = drafted(base)
            draft, estimator, pinned = made[_epoch_of(base)]
            model_id = draft.spec.model.model_id
            # A prefix that leaves no body can never build, and a body that cannot hold
            # history's floor can never keep it: refuse both now, not on every Build, with
            # the prefix costed as a Build of it would cost it now.
            self._held_to_floor(draft, estimator, factors)
            # a definition the model's own format cannot send: refused now, not every Build
            # (a run's pinned tools are the pinned plan's, not this catalog's: the model is
            # what cannot send them)
            unsendable = unsendable_definitions(
                draft.spec, self._catalog.default_format(model_id),
                () if pinned else cmd.tool_catalog, model_id)
            if unsendable and pinned:
                unsendable = [FieldViolation("model.model_id", "the run's pinned tools cannot "
                                             f"all be sent in its own format: {v.description}")
                              for v in unsendable]
            if unsendable:
                raise InvalidInput(unsendable)
            return draft

        def drafted(base: ContextPlan | None) -> tuple[PlanDraft, TokenEstimator, bool]:
            """``draft_for``'s draft, the estimator it was measured with and whether it
            keeps a pinned run's advertisement; may fail on caps."""
            profile = profile_for(base)
            estimator = self.estimator_for(profile)
            inputs = PlanInputs(
                tenant_id=cmd.tenant_id, session_id=cmd.session_id, agent=cmd.agent,
                persona=cmd.persona, tool_catalog=cmd.tool_catalog,
                principal_scopes=cmd.principal_scopes, model=profile,
                session_kind=cmd.session_kind, website_profile_id=cmd.website_profile_id,
                skill_catalog=cmd.skill_catalog, memory_snapshot=cmd.memory_snapshot,
                assets=self._newest_assets(base), control_tools=self._control_tools)
            with child(self._tracer, "context_engine.plan.render",
                       attributes={"context_engine.render.source": "draft"}):
                # A run with tool pins or pending calls keeps what the plan advertises and the
                # authority it was resolved under, whatever else rotates (without a run
                # named, the request's catalog and scopes are resolved, as at an opening).
                pinned = base is not None and bool(cmd.run_id) and cmd.run_pinned
                draft = (draft_pinned(inputs, base.spec, key, estimator) if base is not None
                         and pinned else draft_plan(inputs, key, estimator))
            if base is not None:  # the working state's ceiling is measured as it was
                draft = keeping_state_measure(draft, base.spec)
            return draft, estimator, pinned

        async def first() -> list[PlanDraft]:
            return [draft_for(current)]
        drafts = await self._reading_factors(cmd.tenant_id, factors, first)

        def decide(locked: ContextPlan | None) -> Rotation | None:
            reason = (SESSION_OPENED if locked is None
                      else cmd.reason_to_rotate(locked.spec, self._assets)
                      or ("builder_changed" if escaped_before
                          and _epoch_of(locked) == _epoch_of(current) else None))
            if reason is None:
                return None
            # Moved on since it was read (rotated by another replica, erased, or erased and
            # planned again): drafted again over the plan under the lock, whose policy may be
            # newer and whose advertisement a pinned run keeps.
            if _epoch_of(locked) != _epoch_of(current):
                drafts.append(draft_for(locked))
            return Rotation(reason=reason, draft=drafts[-1])

        served = self._served(then, lambda: drafts[-1].rendered, key)
        mark = self.forgets

        async def pin() -> tuple[ContextPlan, bool]:
            return await self._store.pin(cmd.tenant_id, cmd.session_id, decide, then=served)
        plan, created = await self._reading_factors(cmd.tenant_id, factors, pin)
        if created:
            self._pinned(plan, drafts[-1].rendered, key, mark)
        await self._counted(plan)
        return plan, created

    def _held_to_floor(self, draft: PlanDraft, estimator: TokenEstimator,
                       factors: Factors) -> None:
        """Refuses ``draft`` where a Build of it could not hold the prefix and history's floor:
        BudgetExceeded (class ``prefix``) where the prefix leaves no body, HistoryFloorUnreachable
        where the body cannot hold 8,000 tokens of history with every other class empty. The
        prefix is costed as Build costs it (``charged_prefix``), at the correction factor a
        Build of it would read now (``correction_factor``: the tenant's reconciled factor in
        ``factors``, never below the plan's least): a factor ReportUsage raised for the model
        scales an estimated prefix at Plan as at every Build. A factor raised after the plan
        was pinned is not held to it (Build then reports the shortfall). _FactorUnread where
        ``factors`` has no factor for the draft's model and encoding."""
        spec = draft.spec
        model = spec.model
        read = factors.get((model.model_id, spec.encoding))
        if read is None:
            raise _FactorUnread(spec)
        factor = max(read, factor_floor(spec))
        charged = charged_prefix(spec, draft.prefix_tokens, estimator, factor)
        budget = compute_budget(window=model.context_window,
                                output_reserve=model.output_reserve,
                                prefix_tokens=charged, policy=self.policy)
        require_history_floor(budget, model_id=model.model_id, window=model.context_window,
                              prefix_tokens=charged, policy=self.policy,
                              measured_prefix_tokens=draft.prefix_tokens, factor=factor)

    async def _reading_factors(self, tenant_id: str, factors: Factors,
                               attempt: Callable[[], Awaitable[T]]) -> T:
        """``attempt()``, tried again after reading each correction factor it finds unread
        (``_FactorUnread``: nothing was written) into ``factors`` as a Build reads it
        (``_reconciled_factor``, of the draft's model and encoding). A call drafts for one
        model, read once; another only where the session moved meanwhile."""
        while True:
            try:
                return await attempt()
            except _FactorUnread as unread:
                spec = unread.spec
                key = (spec.model.model_id, spec.encoding)
                if key in factors:  # read already: a check that cannot find it
                    raise AssertionError(f"factor {key} unread once read") from None
                factors[key] = await self._reconciled_factor(tenant_id, spec)

    @staticmethod
    def _served(then: Callable[[LoadedPlan], object] | None,
                rendered: Callable[[], RenderedPrefix],
                key: str) -> Callable[[ContextPlan], object] | None:
        """The store's ``then`` of a pin: the epoch written, as ``_pinned`` caches it (with
        the prefix ``rendered`` gives once decided), handed to the caller's ``then``."""
        if then is None:
            return None
        return lambda plan: then(LoadedPlan(plan=plan, rendered=rendered(), session_key=key))

    def _newest_assets(self, current: ContextPlan | None) -> PlatformAssets:
        """The platform policy a new epoch pins: this replica's, unless the session's plan
        holds a newer revision (a rolling deploy: a newer replica pinned it), which a rotation
        for any other reason keeps, so it never takes a session's policy back."""
        if current is not None and is_older(self._assets.version, current.spec.assets.version):
            return current.spec.assets
        return self._assets

    def _pinned(self, plan: ContextPlan, rendered: RenderedPrefix, key: str,
                mark: int) -> None:
        """A new epoch was written from ``rendered``: cache it (nothing to re-verify, it was
        rendered just now), unless this process erased the session (or found it erased) since
        ``mark``, taken before the write: the epoch may be of the erased incarnation, and
        nothing of that is kept. It is counted by ``_counted``."""
        if self._erased_since(plan.tenant_id, plan.session_id, mark):
            return
        self.cache.put((plan.tenant_id, plan.session_id, plan.incarnation, plan.epoch),
                       LoadedPlan(plan=plan, rendered=rendered, session_key=key),
                       verified_at=self._clock.monotonic())

    async def _counted(self, plan: ContextPlan) -> None:
        """Counts ``plan``'s epoch (``context_engine_epochs_total``, and
        ``context_engine_sessions_opened_total`` for an epoch 1) if it is stored uncounted and
        this call claims it: the epoch's writer, once its COMMIT answered, or, when that answer
        was lost (the call failed UNAVAILABLE though the epoch committed), the first Plan or
        retried Rotate key to read it, on whichever replica. Once across replicas and retries.
        A claim the database cannot take now rolled back: it is left to the next call that
        reads the epoch (or a maintenance cycle); one whose COMMIT went unanswered is counted
        by the process's next maintenance cycle if it committed. Either way the call itself
        succeeds (its epoch is written)."""
        if plan.counted:
            return
        try:
            claimed = await self._store.claim_count(plan)
        except CountUnsettled:
            log("epoch_count_unsettled", logging.WARNING, tenant=plan.tenant_id,
                epoch=plan.epoch, reason=plan.reason)
            return
        except StoreUnavailable:
            log("epoch_count_deferred", logging.WARNING, tenant=plan.tenant_id,
                epoch=plan.epoch, reason=plan.reason)
            return
        if claimed:
            self._metrics.epoch_counted(plan.epoch, plan.reason, plan.prefix_tokens)

    async def _canonicalize(self, loaded: LoadedPlan,
                            then: Callable[[LoadedPlan], object] | None = None
                            ) -> tuple[ContextPlan, bool]:
        """prefix_hash_canonicalized: the same plan appended as a new epoch under its canonical
        hash. Nothing is rebuilt (a run may be parked on an approval) and the provider gets
        the same bytes, so nothing is re-cached."""
        stale = loaded.plan
        with child(self._tracer, "context_engine.plan.render",
                   attributes={"context_engine.render.source": "canonicalize"}):
            # the bytes as served: with the fold they were escaped with
            rendered = render_prefix(stale.spec, loaded.session_key,
                                     fold=loaded.fold)

        def decide(locked: ContextPlan | None) -> Rotation | None:
            if locked is None:  # erased since it was read: Plan opens it anew
                raise _ErasedMeanwhile
            if locked.epoch != stale.epoch:
                return None  # another replica already moved the session on
            draft = PlanDraft(spec=locked.spec, rendered=rendered, classes=locked.classes)
            return Rotation(reason="prefix_hash_canonicalized", draft=draft)

        mark = self.forgets
        plan, created = await self._store.pin(stale.tenant_id, stale.session_id, decide,
                                              then=self._served(then, lambda: rendered,
                                                                loaded.session_key))
        if created:
            self._pinned(plan, rendered, loaded.session_key, mark)
        await self._counted(plan)
        return plan, created

    async def rotate(self, cmd: RotateCommand, *,
                     then: Callable[[LoadedPlan], object] | None = None
                     ) -> tuple[ContextPlan, bool]:
        """An explicit rotation: always a new epoch (once per idempotency key), built from the
        plan current under the session's lock, so concurrent rotations compose. ``then``: as
        for ``plan`` (a retried key writes nothing and calls nothing)."""
        profile = None
        if cmd.model is not None:
            profile = self._catalog.resolve(
                cmd.model.model_id, context_window=cmd.model.context_window,
                output_reserve=cmd.model.output_reserve,
                breakpoint_budget=cmd.model.breakpoint_budget)
        key = session_key(cmd.tenant_id, cmd.session_id)
        drafts: list[PlanDraft] = []
        factors: Factors = {}

        def decide(locked: ContextPlan | None) -> Rotation:
            if locked is None:
                raise SessionNotFound(cmd.tenant_id, cmd.session_id)
            estimator = (self.estimator_for(profile) if profile is not None
                         else self.plan_estimator(locked.spec))
            with child(self._tracer, "context_engine.plan.render",
                       attributes={"context_engine.render.source": "redraft"}):
                draft = keeping_state_measure(
                    redraft(locked.spec, key, estimator, drop_tools=cmd.drop_tools,
                            model=profile, snapshot=cmd.snapshot), locked.spec)
            model = draft.spec.model
            if profile is not None or (cmd.snapshot is not None
                                       and draft.prefix_tokens > locked.prefix_tokens):
                # routed to another model, or a larger snapshot: as Plan, refuse a body that
                # cannot hold history's floor, the prefix costed as Build costs it (the other
                # reasons keep the model and take content out, and a revocation must never
                # fail, whatever the factor has become)
                self._held_to_floor(draft, estimator, factors)
            else:  # whatever the reason, a prefix that leaves no body is refused (it raises)
                compute_budget(window=model.context_window,
                               output_reserve=model.output_reserve,
                               prefix_tokens=draft.prefix_tokens, policy=self.policy)
            if profile is not None:
                # and one whose own format cannot send a tool the plan defines
                unsendable = unsendable_definitions(
                    draft.spec, self._catalog.default_format(model.model_id), (),
                    model.model_id)
                if unsendable:
                    raise InvalidInput([FieldViolation(
                        "model.model_id", f"the plan defines a tool {model.model_id} cannot be "
                        f"sent in its own format: {v.description}") for v in unsendable])
            drafts.append(draft)
            return Rotation(reason=cmd.reason, draft=draft)

        served = self._served(then, lambda: drafts[-1].rendered, key)
        fingerprint = canonical_sha256([
            cmd.session_id, cmd.reason, sorted(cmd.drop_tools),
            None if cmd.model is None else [cmd.model.model_id, cmd.model.context_window,
                                            cmd.model.output_reserve,
                                            cmd.model.breakpoint_budget],
            None if cmd.snapshot is None else cmd.snapshot.canonical()])
        mark = self.forgets

        async def pin() -> tuple[ContextPlan, bool]:
            # the model a floor is held for is the locked plan's or the routed one: its
            # factor is read once it is known, and the rotation tried again
            return await self._store.pin(cmd.tenant_id, cmd.session_id, decide,
                                         idempotency_key=cmd.idempotency_key,
                                         fingerprint=fingerprint, then=served)
        plan, created = await self._reading_factors(cmd.tenant_id, factors, pin)
        if created:
            self._pinned(plan, drafts[-1].rendered, key, mark)
        await self._counted(plan)  # a retried key's epoch too, if its first call never was
        return plan, created

    async def get_plan(self, tenant_id: str, session_id: str, epoch: int | None) -> ContextPlan:
        plan = await self._store.get(tenant_id, session_id, epoch)
        if plan is None:
            raise SessionNotFound(tenant_id, session_id, epoch)
        return plan

    async def read_plan(self, tenant_id: str, session_id: str, epoch: int | None) -> LoadedPlan:
        """GetPlan's lookup: the database confirms the session (and the epoch) on every call,
        so an erased session is NOT_FOUND at once on every replica; the verified plan itself
        may come from the cache."""
        if epoch is None:
            return await self.loaded(tenant_id, session_id, None)
        found = await self._store.incarnation(tenant_id, session_id, epoch)
        if found is None:
            await self._found_missing(tenant_id, session_id)
            raise SessionNotFound(tenant_id, session_id, epoch)
        return await self.loaded(tenant_id, session_id, epoch, incarnation=found)

    async def _found_missing(self, tenant_id: str, session_id: str) -> None:
        """A read naming an epoch found none: if the session itself is gone (erased, maybe
        through another replica), what this process keeps of it is forgotten, as a read
        naming no epoch forgets it."""
        try:
            current = await self._store.current(tenant_id, session_id)
        except StoreUnavailable:
            return  # not known either way: the next read that reaches the database tells
        if current is None:
            self._forget_erased(tenant_id, session_id, None)

    def _forget_erased(self, tenant_id: str, session_id: str, found: int | None) -> None:
        """A session found erased (by any replica), and planned again as incarnation ``found``
        if not None: its cached plans, its bases of older incarnations and its renderings (the
        render memo keeps no incarnation; a new one's are made again) leave this process, and
        so does what a Build of the session running meanwhile keeps of it (``forgotten_since``):
        the erasure may have come through another replica while that Build ran here."""
        if found is not None:
            self._note_newest(tenant_id, session_id, found)
        else:  # erased: a Build that began knowing an incarnation of it ran on an erased one
            self._newest.pop((tenant_id, session_id), None)
        if found is None or self.cache.incarnation(tenant_id, session_id) != found:
            self.cache.forget(tenant_id, session_id)  # (the new incarnation's plans stay)
        self.builds.forget(tenant_id, session_id, before=found)
        self.render_memo.drop(session_key(tenant_id, session_id))
        self._forget_runs(tenant_id, session_id, None if found is None else found - 1)
        self._count_forgotten(tenant_id, session_id, found)

    def _named(self, tenant_id: str, session_id: str, incarnation: int) -> None:
        """A plan read named ``incarnation`` the session's: what this process keeps of an
        older one (cached plans, bases, renderings of ended Builds) was erased, perhaps
        through another replica, and is forgotten (``_forget_erased``); a Build of the older
        one still running forgets what it keeps when it ends (``forgotten_since``)."""
        self._note_newest(tenant_id, session_id, incarnation)
        held = (self.cache.incarnation(tenant_id, session_id),
                self.builds.oldest_incarnation(tenant_id, session_id),
                self.render_memo.incarnation(session_key(tenant_id, session_id)))
        if any(h is not None and h < incarnation for h in held):
            self._forget_erased(tenant_id, session_id, incarnation)

    def latest_incarnation(self, tenant_id: str, session_id: str) -> int | None:
        """The latest incarnation of the session a read here named (or a forget found), if
        the session is among those whose latest is remembered."""
        return self._newest.get((tenant_id, session_id))

    def _note_newest(self, tenant_id: str, session_id: str, incarnation: int) -> None:
        key = (tenant_id, session_id)
        if incarnation > self._newest.get(key, -1):
            self._newest[key] = incarnation
        self._newest.move_to_end(key)
        while len(self._newest) > NAMED_KEPT:
            self._newest.popitem(last=False)

    async def loaded(self, tenant_id: str, session_id: str, epoch: int | None, *,
                     incarnation: int | None = None) -> LoadedPlan:
        """The verified plan of the session's current epoch (``epoch`` None), or of ``epoch``
        (see ``_loaded``). Its incarnation, later than one this process keeps something of,
        makes it forget what it keeps of the older one (``_named``)."""
        mark = self.forgets
        loaded = await self._loaded(tenant_id, session_id, epoch, incarnation=incarnation)
        if self._erased_since(tenant_id, session_id, mark):
            # erased here while the read ran: what it read may be the erased incarnation; it
            # is answered, and kept nowhere (the caller's Build forgets what it makes of it)
            self.cache.forget(tenant_id, session_id)
            self._newest.pop((tenant_id, session_id), None)
            return loaded
        self._named(tenant_id, session_id, loaded.plan.incarnation)
        return loaded

    def _erased_since(self, tenant_id: str, session_id: str, mark: int) -> bool:
        """Whether the session was erased (here, or found erased) after ``mark``, or more
        sessions were forgotten since than are remembered."""
        if self.forgets == mark:
            return False
        if self.forgets - mark > FORGOTTEN_KEPT:
            return True
        return self._forgotten.get((tenant_id, session_id), (0, -1, 0))[2] > mark

    async def _loaded(self, tenant_id: str, session_id: str, epoch: int | None, *,
                      incarnation: int | None = None) -> LoadedPlan:
        """The verified plan of the session's current epoch (``epoch`` None), or of ``epoch``.

        Without an epoch, the database names the session's incarnation and current epoch on
        every call, so an erased session is NOT_FOUND at once. With an epoch and the
        incarnation it was just read with (``incarnation``), the cached plan serves. With an
        epoch alone, a cached plan serves without a query while it was confirmed less than
        the plan-cache TTL ago, and is confirmed again after that (an erased session is then
        NOT_FOUND); while the database is away it keeps serving."""
        if epoch is None:
            current = await self._store.current(tenant_id, session_id)
            if current is None:
                # erased, maybe by another replica
                self._forget_erased(tenant_id, session_id, None)
                raise SessionNotFound(tenant_id, session_id)
            hit = self.cache.get((tenant_id, session_id, current.incarnation, current.epoch),
                                 verified_at=self._clock.monotonic())
            return hit if hit is not None else await self._load(tenant_id, session_id,
                                                                current.epoch)
        if incarnation is not None:
            hit = self.cache.get((tenant_id, session_id, incarnation, epoch))
            return hit if hit is not None else await self._load(tenant_id, session_id, epoch)
        cached = self.cache.newest(tenant_id, session_id, epoch)
        if cached is not None:
            key, hit, verified_at = cached
            now = self._clock.monotonic()
            if now - verified_at < self.cache.ttl:
                return hit
            try:
                found = await self._store.incarnation(tenant_id, session_id, epoch)
            except StoreUnavailable:
                return hit  # the database is away: the cached plan keeps serving
            if found == hit.plan.incarnation:
                self.cache.get(key, verified_at=now)
                return hit
            self._forget_erased(tenant_id, session_id, found)  # (and maybe planned again)
            if found is None:
                raise SessionNotFound(tenant_id, session_id, epoch)
        return await self._load(tenant_id, session_id, epoch)

    async def _load(self, tenant_id: str, session_id: str, epoch: int) -> LoadedPlan:
        """The epoch's plan read from the database, re-rendered and verified against its hash
        (unless this incarnation's epoch is cached already), and cached."""
        try:
            plan = await self.get_plan(tenant_id, session_id, epoch)
        except SessionNotFound:
            await self._found_missing(tenant_id, session_id)
            raise
        key = (tenant_id, session_id, plan.incarnation, plan.epoch)
        now = self._clock.monotonic()
        hit = self.cache.get(key, verified_at=now)
        if hit is not None:
            return hit
        try:
            with child(self._tracer, "context_engine.plan.render",
                       attributes={"context_engine.render.source": "verify",
                                   "context_engine.epoch": plan.epoch}):
                loaded = load_plan(plan)
        except PrefixHashMismatch:
            self._metrics.prefix_hash_mismatch.inc()
            raise
        self.cache.put(key, loaded, verified_at=now)
        return loaded

    # ------------------------------------------------------------------ Build

    async def correction_factor(self, tenant_id: str, spec: PlanSpec) -> float:
        """The model's reconciled factor, never below the plan's ``least_factor`` (a factor
        stored lower, or reconciled for a plan counted another way, is raised to it)."""
        return max(await self._reconciled_factor(tenant_id, spec),
                   factor_floor(spec))

    async def _reconciled_factor(self, tenant_id: str, spec: PlanSpec) -> float:
        """The model's reconciled factor (shared in PostgreSQL), cached for a few seconds;
        1.0 for a new model or one whose encoding changed. While PostgreSQL cannot be read:
        the last factor this process read or reconciled for the model (1.0 if none)."""
        key = (tenant_id, spec.model.model_id)
        now = self._clock.monotonic()
        cached = self._factors.get(key)
        if cached is not None and cached[1] > now:
            self._factors.move_to_end(key)  # read most recently: evicted last
            return cached[0]
        try:
            row = await self._calibrations.calibration(tenant_id, spec.model.model_id)
        except StoreUnavailable:
            return cached[0] if cached is not None else 1.0
        factor = row.factor if row is not None and row.encoding == spec.encoding else 1.0
        self._keep_factor(key, factor, now + self._calibration_ttl)
        return factor

    def _keep_factor(self, key: tuple[str, str], factor: float, expires: float) -> None:
        """``factor`` kept for ``key`` until ``expires`` (the clock's monotonic time; read
        after it only while PostgreSQL cannot be), the least recently used forgotten past
        ``FACTORS_KEPT``."""
        self._factors[key] = (factor, expires)
        self._factors.move_to_end(key)
        while len(self._factors) > FACTORS_KEPT:
            self._factors.popitem(last=False)

    @staticmethod
    def pinned_factor(factor: float, spec: PlanSpec) -> float:
        """A caller's ``estimator_factor`` (within [0.5, 4.0], checked with the request), or
        InvalidInput below the plan's ``least_factor``: for a model counted with its own
        tokenizer, a factor under 1 could send a request over the window; for one counted
        with another encoding times a base factor, one under its inverse counts less than
        that encoding does."""
        exact = prefix_exact(spec)
        floor = factor_floor(spec)
        if factor < floor:
            why = ("whose own tokenizer counts the request" if exact else
                   f"counted as {spec.encoding} x {spec.estimator_factor:g}, which a lower "
                   f"factor would take below {spec.encoding}'s own count")
            raise InvalidInput.one(
                "estimator_factor",
                f"{factor} is below {round(floor, 4)}, the least for {spec.model.model_id}, {why}: "
                "a lower factor could send the request over the window")
        return factor

    def observe_assembly(self, assembled: list[float]) -> None:
        """One Build call's assembly time in ``context_engine_build_seconds``: every attempt
        of it that assembled a request (``build``'s ``assembled``), summed into one
        observation; a call that assembled none is not observed."""
        if assembled:
            self._metrics.build_seconds.observe(sum(assembled))

    async def build(self, tenant_id: str, session_id: str, epoch: int | None,
                    checkpoint: Checkpoint, factor: float | None, *,
                    validated: bool = False, incarnation: int | None = None,
                    then: Callable[[BuildResult], object] | None = None,
                    assembled: list[float] | None = None) -> BuildResult:
        """``incarnation``: the session's, when the caller has just resolved the plan.
        ``then``: the caller's work on the result (its response), run before the run's
        snapshot binding and the pressure event are written, so a response it refuses writes
        neither; the Build returns only once they are written (or the event's loss counted),
        so the event is still emitted before the request leaves.
        ``assembled``: the caller's list of the seconds its call has spent assembling, one
        entry per attempt (a Build made again by ``once_more_if_replanned`` assembles twice):
        the caller observes them once, summed, with ``observe_assembly``; without it the
        assembly is observed here."""
        loaded = await self.loaded(tenant_id, session_id, epoch, incarnation=incarnation)
        spec = loaded.plan.spec
        estimator = self.plan_estimator(spec)
        if factor is None:
            factor = await self.correction_factor(tenant_id, spec)
        else:
            factor = self.pinned_factor(factor, spec)
        started = time.perf_counter()
        steps = build_steps(loaded, checkpoint, estimator=estimator, factor=factor,
                            policy=self.policy, memo=self.render_memo, validated=validated,
                            state_estimator=None if spec.state_measure is None
                            else self.state_estimator(spec))
        try:
            with child(self._tracer, "context_engine.build",
                       attributes={"context_engine.epoch": loaded.plan.epoch,
                                   "context_engine.estimator_factor": factor}) as span:
                try:
                    pressure = next(steps)  # allocated: what a pressure event records
                except BudgetExceeded as exc:
                    if span.is_recording():
                        span.set_attribute("context_engine.budget_exceeded.class",
                                           exc.class_name)
                        if isinstance(exc.pressure, Pressure):
                            derived_spans(self._tracer, exc.pressure,
                                          time_ns(self._clock), None)
                    raise
                result = finish(steps)
                if span.is_recording():
                    span.set_attribute("context_engine.yield_steps",
                                       [s.step for s in result.pressure.steps])
                    history = next(((c.used, c.items) for c in result.budget.classes
                                    if c.class_name == "history"), None)
                    derived_spans(self._tracer, result.pressure, time_ns(self._clock),
                                  history)
        except BudgetExceeded as exc:
            payload: dict[str, Any] = {"epoch": loaded.plan.epoch, **exc.metadata()}
            # A pressure event records that a yield step ran (spec): an overflow that
            # yielded nothing is recorded by the exceeded event alone.
            ran = (exc.pressure if isinstance(exc.pressure, Pressure) and exc.pressure.yielded
                   else None)
            if ran is not None:
                await self._record(loaded.plan, "context.budget.pressure",
                                   pressure_payload(ran, loaded.plan.epoch))
            await self._record(loaded.plan, "context.budget.exceeded", payload)
            # counted once its events are written (or their loss logged): a Build cancelled
            # while it writes them is answered CANCELLED, and its retry counts
            self._metrics.budget_exceeded.labels(**{"class": exc.class_name}).inc()
            if ran is not None:
                self._count_pressure(ran)
            raise
        took = time.perf_counter() - started
        if assembled is None:
            self._metrics.build_seconds.observe(took)
        else:  # one call, one observation: its caller's, once its last attempt has ended
            assembled.append(took)
        # The caller's response is made before anything is written: a Build it refuses (a
        # format that cannot carry an item, a response over the size limit) changes nothing.
        # Then the run's snapshot binding (the fence), then the pressure event: both are in
        # the database before the request is handed back (spec: emitted before it leaves).
        if then is not None:
            then(result)
        await self._snapshot_used(loaded, checkpoint.active_run_id)
        if pressure.yielded:  # a request that fits without yielding emits nothing
            await self._record(loaded.plan, "context.budget.pressure",
                               pressure_payload(pressure, loaded.plan.epoch))
            # counted once the event is written (or its loss logged), as the Build is served:
            # one cancelled while it writes the event counts nothing, and its retry counts once
            self._count_pressure(pressure)
        return result

    async def _snapshot_used(self, loaded: LoadedPlan, run_id: str) -> None:
        """The first Build of a run on a plan with a non-empty snapshot binds the run to the
        snapshot's recall trace and epoch (``context.snapshot.used``), once across replicas.
        It is a fence (spec: "before provider egress"): the request holding the snapshot is
        returned only once the binding is in the database. If it cannot be written now, the
        Build fails UNAVAILABLE (STORE_UNAVAILABLE); a run this process has already bound
        keeps building from the plan cache."""
        plan = loaded.plan
        snapshot = plan.spec.memory_snapshot
        if not snapshot.items or not run_id:
            return
        key = (plan.tenant_id, plan.session_id, plan.incarnation, plan.epoch, run_id)
        if key in self._snapshot_runs:
            return
        event = ContextEvent(tenant_id=plan.tenant_id, session_id=plan.session_id,
                             epoch=plan.epoch, type="context.snapshot.used",
                             payload={"run_id": run_id, "epoch": plan.epoch,
                                      "recall_trace_id": snapshot.recall_trace_id,
                                      "snapshot_id": snapshot.snapshot_id})
        # bound only while the session is still this plan's incarnation (else
        # IncarnationChanged: see ``once_more_if_replanned``)
        await self._events.append_once_durably(
            event, snapshot_fence_key(plan.session_id, plan.epoch, run_id),
            incarnation=plan.incarnation)
        self._remember_run(key)

    def _remember_run(self, key: tuple[str, str, int, int, str]) -> None:
        """A run bound to its snapshot: remembered, the least recent forgotten past
        ``RUNS_KEPT``."""
        self._snapshot_runs[key] = None
        self._run_counts[key[:2]] = self._run_counts.get(key[:2], 0) + 1
        while len(self._snapshot_runs) > RUNS_KEPT:
            self._run_gone(self._snapshot_runs.popitem(last=False)[0])

    def _forget_runs(self, tenant_id: str, session_id: str, up_to: int | None) -> None:
        """The runs bound to the session's snapshot that this process remembers, of
        incarnation ``up_to`` or older (None: all); nothing is walked for a session with none
        (a read that finds a session never planned here costs no scan)."""
        if not self._run_counts.get((tenant_id, session_id)):
            return
        for key in [k for k in self._snapshot_runs if k[0] == tenant_id and k[1] == session_id
                    and (up_to is None or k[2] <= up_to)]:
            del self._snapshot_runs[key]
            self._run_gone(key)

    def _run_gone(self, key: tuple[str, str, int, int, str]) -> None:
        left = self._run_counts[key[:2]] - 1
        if left:
            self._run_counts[key[:2]] = left
        else:
            del self._run_counts[key[:2]]

    def _count_pressure(self, pressure: Pressure) -> None:
        fits = "true" if pressure.fits else "false"
        for step in pressure.steps:
            self._metrics.budget_pressure.labels(step=step.step, fits=fits).inc()
        # history below its floor, by what put it there: never-yield items (the shortfall
        # past the body budget's own), the body budget itself (the prefix as this Build costs
        # it); a Build may count both
        if pressure.history_floor_shortfall > pressure.prefix_floor_shortfall:
            self._metrics.budget_pressure.labels(step="history_floor", fits=fits).inc()
        if pressure.prefix_floor_shortfall:
            self._metrics.budget_pressure.labels(step="history_floor_prefix", fits=fits).inc()

    async def _record(self, plan: ContextPlan, kind: str, payload: dict[str, Any]) -> None:
        """Outbox writes from Build never fail the request they describe: if the database
        is away the request is still served, and the loss is logged and counted. Written for
        the plan's incarnation of the session only: once that one is erased (planned again or
        not), the event is discarded, though it waited in the queue for the database."""
        try:
            await self._events.append(ContextEvent(
                tenant_id=plan.tenant_id, session_id=plan.session_id, epoch=plan.epoch,
                type=kind, payload=payload, incarnation=plan.incarnation))
        except StoreUnavailable:
            log("event_not_recorded", logging.WARNING, type=kind, tenant=plan.tenant_id,
                epoch=plan.epoch)

    # ------------------------------------------------------------------ ReportUsage

    async def once_more_if_replanned(self, tenant_id: str, session_id: str,
                                     epoch: int | None,
                                     attempt: Callable[[], Awaitable[T]]) -> T:
        """``attempt()``, made again once if a write of it found the session erased and planned
        again since its plan was read (a plan this replica cached, named by its epoch within
        the plan-cache TTL; nothing was written): the erased incarnation's plans and bases are
        forgotten first, so the attempt reads the plan again. Found so twice: SessionNotFound."""
        for _ in range(2):
            try:
                return await attempt()
            except IncarnationChanged as changed:
                self._forget_erased(tenant_id, session_id, changed.found)
        raise SessionNotFound(tenant_id, session_id, epoch)

    async def report_usage(self, report: UsageReport, *,
                           then: Callable[[UsageOutcome], object] | None = None
                           ) -> UsageOutcome:
        """Counted against the session's incarnation the plan was read for, checked when the
        report is written: a plan cached from before the session was erased and planned again
        is read again, and the report counts against the new session's epoch. ``then``: the
        caller's work on the outcome of a report counted now (its response), done in the
        store's transaction before the report is written: what it raises writes and counts
        nothing (a retried key, which writes nothing, does not call it)."""
        async def attempt() -> UsageOutcome:
            loaded = await self.loaded(report.tenant_id, report.session_id, report.epoch)
            return await self._report_usage(report, loaded, then)
        return await self.once_more_if_replanned(report.tenant_id, report.session_id,
                                                 report.epoch, attempt)

    async def _report_usage(self, report: UsageReport, loaded: LoadedPlan,
                            then: Callable[[UsageOutcome], object] | None = None
                            ) -> UsageOutcome:
        spec = loaded.plan.spec
        model = spec.model
        # No request of this plan can hold more than the model's window: a report that says so
        # is not usage of it, and one such outlier would throw the shared factor to its cap.
        # Refused once the report is written for this plan's incarnation (``apply`` runs in
        # the store's transaction, after that check), so a plan cached from before the session
        # was erased and planned again never refuses a report the new plan's model takes.
        too_big = [FieldViolation(name, f"{value} is over the model's window of "
                                        f"{model.context_window}")
                   for name, value in (("input_tokens", report.input_tokens),
                                       ("estimated_input_tokens",
                                        report.estimated_input_tokens))
                   if value > model.context_window]
        # Nor can a Build of it estimate less than its prefix alone, at the factor it used:
        # a smaller estimate is no Build's, and reconciled it would throw the factor to its
        # cap for every session of the tenant on the model. Checked where the report names
        # the plan its Build ran on: its epoch, or epoch 0 ("current") of a session that has
        # had no other (after a rotation, the Build may have run on an earlier epoch's prefix).
        least = prefix_cost(loaded.plan.prefix_tokens, report.estimator_factor,
                            exact=prefix_exact(spec))
        if (report.epoch or loaded.plan.epoch == 1) and report.estimated_input_tokens < least:
            too_big.append(FieldViolation(
                "estimated_input_tokens",
                f"{report.estimated_input_tokens} is below the {least} tokens of epoch "
                f"{loaded.plan.epoch}'s prefix alone at factor {report.estimator_factor:g}: "
                "no Build of this plan estimates less (report the Build's "
                "estimated_input_tokens and estimator_factor as it answered them, under the "
                "epoch it answered)"))

        # An exact prefix count (the model's own tokenizer) is not scaled and carries no error:
        # the body absorbs all of it. An approximate one was scaled with the body, so the
        # factor comes from the observed ratio over the whole estimate.
        fixed = 0
        if prefix_exact(spec):
            fixed = loaded.plan.prefix_tokens
            if not spec.counts_leading_turn:  # the framing the Build counted beside the
                # stored count; the tokenizer is asked for only then
                fixed += uncounted_framing(spec, self.plan_estimator(spec))

        def apply(current: Calibration | None) -> Reconciled:
            if too_big:  # raised in the transaction: nothing is written
                raise InvalidInput(too_big)
            outcome = reconcile(current, model_id=model.model_id, encoding=spec.encoding,
                                estimated=report.estimated_input_tokens,
                                actual=report.input_tokens,
                                factor_used=report.estimator_factor, fixed=fixed,
                                bounded=report.estimated_attachment_tokens,
                                floor=factor_floor(spec))
            if then is not None:  # the report's answer, as counted (raised: nothing written)
                then(UsageOutcome(model_id=outcome.calibration.model_id, reconciled=outcome,
                                  counted=True, epoch=loaded.plan.epoch,
                                  prefix_sha256=loaded.plan.prefix_sha256))
            return outcome

        # The request as sent (epoch 0 is "current"), not the epoch it resolved to: a retry
        # after a rotation repeats the same request and must get the first answer back.
        fingerprint = canonical_sha256([
            report.session_id, report.epoch or 0, report.estimated_input_tokens,
            report.estimator_factor, report.input_tokens, report.cached_tokens,
            report.output_tokens,
            # named only when sent, so a report without it keeps the fingerprint it had
            *([report.estimated_attachment_tokens] if report.estimated_attachment_tokens
              else [])])
        outcome, earlier = await self._calibrations.reconcile(
            report.tenant_id, model.model_id, report.idempotency_key, apply, fingerprint,
            usage=EpochUsage(session_id=report.session_id, epoch=loaded.plan.epoch,
                             input_tokens=report.input_tokens,
                             incarnation=loaded.plan.incarnation))
        counted = earlier is not None
        if earlier is not None:  # a retried key observes nothing (its stored factor is old)
            self._metrics.estimator_error_ratio.labels(model=model.family).observe(
                outcome.error_ratio)
            self._metrics.estimator_correction_factor.labels(model=model.family).set(
                outcome.calibration.factor)
            # An epoch's first request writes its prefix to the provider's cache: a necessary
            # miss, not a leak, so only the later ones measure the prefix ratio.
            # A request holds no more prefix than its whole input: the plan's count is an
            # upper bound (tools framed conservatively), so a request cached whole reads 1.
            # Where the count is itself an estimate (Claude, Gemini: cl100k_base x 1.3), it is
            # taken to the provider's tokens by this report's own ratio of actual to estimated
            # input: unscaled, a prefix read whole from the cache read about 1 / 1.3, under the
            # alert's 0.9, in every session whose history the cache did not hold.
            # That ratio is the whole request's: attachments estimated at their upper bound
            # (an image Claude counts at 1,600 is estimated at 4,784) pull it far under the
            # text's, and a prefix half read from the cache read 1.0. The prefix is never taken
            # below its count at the plan's floor (cl100k_base's own count for Claude and
            # Gemini, which their tokenizers do not count under).
            prefix = float(loaded.plan.prefix_tokens)
            if not prefix_exact(spec) and report.estimated_input_tokens:
                prefix = max(least * report.input_tokens / report.estimated_input_tokens,
                             loaded.plan.prefix_tokens * factor_floor(spec))
            prefix = min(prefix, report.input_tokens)
            if earlier.reports_before and prefix:
                self._metrics.cached_prefix_ratio.observe(
                    min(report.cached_tokens / prefix, 1.0))
            # History reuse: what was cached against the preceding call's full input.
            if earlier.previous_input_tokens:
                self._metrics.cached_input_ratio.observe(
                    min(report.cached_tokens / earlier.previous_input_tokens, 1.0))
        key = (report.tenant_id, model.model_id)
        if counted:
            # What PostgreSQL now holds, kept expired: the next Build reads it again (a report
            # of another replica may follow), but one that cannot (the database away, a cached
            # plan serving) uses it rather than 1.0, which would under-count the request this
            # report showed was under-counted.
            self._keep_factor(key, outcome.calibration.factor, self._clock.monotonic())
        else:
            self._factors.pop(key, None)
        # a retry answers what was counted, under the model it was counted for (a rotation to
        # another model since then does not relabel it)
        return UsageOutcome(model_id=outcome.calibration.model_id, reconciled=outcome,
                            counted=counted, epoch=loaded.plan.epoch,
                            prefix_sha256=loaded.plan.prefix_sha256)

    # ------------------------------------------------------------------ working state

    def _working_state_measure(self, loaded: LoadedPlan) -> Measure:
        """The block's tokens exactly as Build checks them against its 1,000-token ceiling: the
        plan's estimator and the session key's envelopes, without the correction factor, so a
        state accepted now never fails Build after ReportUsage moves the factor (a pinned
        ``estimator_factor`` on the request is validated and has no effect on the ceiling)."""
        estimator = self.state_estimator(loaded.plan.spec)
        ctx = RenderContext(session_key=loaded.session_key)

        def measure(state: WorkingState) -> int:
            return working_state_tokens(estimator, ctx, state)
        return measure

    async def update_working_state(self, cmd: WorkingStateCommand, *,
                                   seen: Callable[[ContextPlan], object] | None = None,
                                   then: Callable[[WorkingState, Changes], object] | None = None
                                   ) -> tuple[WorkingState, Changes]:
        """One typed transition (pure), then ``context.working_state.updated`` — best effort,
        like Build's events: the transition is the caller's to checkpoint. ``seen`` is told
        the plan it runs on once that is read (the call's log line and span name its epoch
        and prefix, also when the transition is then refused). ``then``: the caller's work on
        the new state (its response), before the event is written: what it raises records
        nothing."""
        loaded = await self.loaded(cmd.tenant_id, cmd.session_id, None)
        if seen is not None:
            seen(loaded.plan)
        measure = self._working_state_measure(loaded)
        state, changes = apply_update(cmd.current, cmd.transition, run_id=cmd.run_id,
                                      sequence=cmd.sequence, measure=measure)
        if then is not None:
            then(state, changes)
        await self._record(loaded.plan, "context.working_state.updated",
                           {"run_id": cmd.run_id, "sequence": cmd.sequence,
                            "epoch": loaded.plan.epoch, **changes.summary(),
                            **({"call_id": cmd.call_id} if cmd.call_id else {})})
        return state, changes

    async def carry_working_state(self, cmd: CarryCommand, *,
                                  seen: Callable[[ContextPlan], object] | None = None
                                  ) -> Carried:
        """The events replayed over the seed (pure); ``seen`` as for ``update_working_state``."""
        loaded = await self.loaded(cmd.tenant_id, cmd.session_id, None)
        if seen is not None:
            seen(loaded.plan)
        measure = self._working_state_measure(loaded)
        return replay(cmd.events, cmd.seed_event_sequence, measure=measure)

    # ------------------------------------------------------------------ Compact

    async def compact(self, cmd: CompactCommand, *,
                      then: Callable[[CompactOutcome], object] | None = None
                      ) -> CompactOutcome:
        """A write, never part of Build: a retried key returns its stored result before any
        summarizer call; a summarizer failure raises before anything is stored. ``then``: the
        caller's work on the outcome it stores (its response), before it is stored: what it
        raises stores and counts nothing (not called for a stored result returned)."""
        loaded = await self.loaded(cmd.tenant_id, cmd.session_id, None)
        epoch = loaded.plan.epoch
        seen = await self._compactions.stored(cmd.tenant_id, cmd.idempotency_key)
        if seen is not None:
            return CompactOutcome(result=check_stored(seen, cmd.session_id, cmd.fingerprint),
                                  compacted=False, epoch=epoch,
                                  prefix_sha256=loaded.plan.prefix_sha256)
        estimator = self.plan_estimator(loaded.plan.spec)
        factor = cmd.factor
        if factor is None:
            factor = await self.correction_factor(cmd.tenant_id, loaded.plan.spec)
        else:
            factor = self.pinned_factor(factor, loaded.plan.spec)
        used = factor

        def measure(messages: Any) -> int:
            return estimator.messages(list(messages), used)

        result = await compact(
            cmd.checkpoint.items, cmd.current, active_run_id=cmd.checkpoint.active_run_id,
            target=cmd.target, reason=cmd.reason, summarizer=self._summarizer,
            measure=measure, ctx=RenderContext(session_key=loaded.session_key),
            state=cmd.checkpoint.working_state, max_summary_tokens=cmd.max_summary_tokens,
            attachment_charges=lambda sendable: attachment_costs(
                sendable, estimator.base_factor, used, estimator.image_tokens),
            inline_maximum_bytes=self.policy.inline_maximum_bytes)
        previous = len(cmd.current.elided) if cmd.current is not None else 0
        event = ContextEvent(
            tenant_id=cmd.tenant_id, session_id=cmd.session_id, epoch=epoch,
            type="context.compacted",
            payload={"epoch": epoch, "reason": cmd.reason, "depth": result.depth,
                     "replaced_through_sequence": result.replaced_through_sequence,
                     "source_event_ids": list(result.source_event_ids),
                     "replaced_items": len(result.replaced_item_ids),
                     "elided": [s.item_id for s in result.elided],
                     "constraints": len(result.constraints),
                     "tokens_before": result.tokens_before,
                     "tokens_after": result.tokens_after,
                     "compactor_version": result.compactor_version,
                     "summarizer_version": result.summarizer_version})
        if then is not None:  # exactly what a save storing it answers
            then(CompactOutcome(result=result, compacted=True, epoch=epoch,
                                prefix_sha256=loaded.plan.prefix_sha256))
        try:
            stored, created = await self._compactions.save(
                cmd.tenant_id, cmd.session_id, cmd.idempotency_key, cmd.fingerprint, result,
                event, incarnation=loaded.plan.incarnation)
        except IncarnationChanged as changed:
            # erased (and planned again) while it compacted: the erased conversation's
            # compaction is no compaction of the new session, so nothing was stored
            self._forget_erased(cmd.tenant_id, cmd.session_id, changed.found)
            raise SessionNotFound(cmd.tenant_id, cmd.session_id) from changed
        if created:
            self._metrics.compactions.labels(depth=str(stored.depth)).inc()
            self._metrics.elided_spans.inc(max(0, len(stored.elided) - previous))
        return CompactOutcome(result=stored, compacted=created, epoch=epoch,
                              prefix_sha256=loaded.plan.prefix_sha256)

    # ------------------------------------------------------------------ DeleteSession

    async def delete_session(self, tenant_id: str, session_id: str, *,
                             requested_by: str) -> Erased:
        """Erases the session (one transaction, audited when anything was removed; see
        ``SessionEraser``) and forgets what this process holds of it. Other replicas stop
        serving it from their plan caches within ``cache.ttl`` seconds."""
        if self._erasure is None:
            raise RuntimeError("this engine was built without an erasure store")
        erased = await self._erasure.erase_session(tenant_id, session_id,
                                                   requested_by=requested_by,
                                                   at=self._clock.now())
        self.forget_session(tenant_id, session_id)
        return erased

    def forget_session(self, tenant_id: str, session_id: str, *, counted: bool = True,
                       incarnation: int | None = None) -> None:
        """Drop what this process keeps of one session: its cached plans, the bases of its
        incremental Builds, the runs whose snapshot binding it remembers, and the rendered
        items of its render memo. ``counted`` False: a Build that ran across an erasure
        dropping what it kept, which is no erasure of its own (else every Build of the session
        still running would drop the session's memo again when it ends, and so on while the
        session's Builds overlap). ``incarnation``: the one that Build ran on; what this process
        keeps of a later one (the session planned anew meanwhile: its plans, bases and runs)
        stays."""
        cached = self.cache.incarnation(tenant_id, session_id)
        if incarnation is None or cached is None or cached <= incarnation:
            self.cache.forget(tenant_id, session_id)
        self.builds.forget(tenant_id, session_id,
                           before=None if incarnation is None else incarnation + 1)
        self._forget_runs(tenant_id, session_id, incarnation)
        self.render_memo.drop(session_key(tenant_id, session_id))
        if counted:  # erased here: no incarnation of it is known any more
            self._newest.pop((tenant_id, session_id), None)
            self._count_forgotten(tenant_id, session_id)

    def _count_forgotten(self, tenant_id: str, session_id: str,
                         found: int | None = None) -> None:
        """``found``: the incarnation the session was found planned again as (None: erased).
        Remembered per session: when it was last forgotten, the latest incarnation any of its
        forgets found, and when it was last erased (a forget that found it planned again,
        read before an erasure here and ended after it, does not hide the erasure)."""
        self.forgets += 1
        key = (tenant_id, session_id)
        _, latest, erased = self._forgotten.get(key, (0, -1, 0))
        self._forgotten[key] = ((self.forgets, max(latest, found), erased) if found is not None
                                else (self.forgets, latest, self.forgets))
        self._forgotten.move_to_end((tenant_id, session_id))
        while len(self._forgotten) > FORGOTTEN_KEPT:
            self._forgotten.popitem(last=False)

    def forgotten_since(self, tenant_id: str, session_id: str, mark: int,
                        incarnation: int | None = None) -> bool:
        """Whether this process forgot the session after ``mark`` (``forgets`` when a call
        began): what the call keeps of it afterwards is to be forgotten too. Not when the call
        ran on ``incarnation``, the session was not erased since and no forget found it planned
        again as a later one (what was forgotten is older than what the call ran on: a Build
        that found the session planned anew keeps what it made of the new one). True as well
        when more sessions were forgotten since than are remembered (forgetting again is
        harmless), and when the call ran on an incarnation older than the latest one read here
        (or the session is no longer among those whose latest is remembered): it ran on a
        session erased since, whether or not a forget was counted for it."""
        if incarnation is not None and incarnation < self._newest.get((tenant_id, session_id),
                                                                      incarnation + 1):
            return True
        if self._erased_since(tenant_id, session_id, mark):
            return True
        when, latest, _ = self._forgotten.get((tenant_id, session_id), (0, -1, 0))
        return when > mark and (incarnation is None or latest > incarnation)
