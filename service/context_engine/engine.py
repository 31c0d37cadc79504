"""The application service: orchestrates the pure domain, the plan store and the metrics."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from context_engine.domain.builder import BuildResult, Checkpoint, LoadedPlan, build, load_plan
from context_engine.domain.canonical import session_key
from context_engine.domain.errors import BudgetExceeded, PrefixHashMismatch, SessionNotFound
from context_engine.domain.estimator import ModelCatalog, TokenEstimator, TokenizerRegistry
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
from context_engine.domain.plan import SESSION_OPENED, ContextPlan, draft_plan, rotation_reason
from context_engine.domain.ports import PlanStore, Rotation
from context_engine.telemetry.metrics import Metrics


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


class PlanCache:
    """Verified plans by (tenant, session, epoch). Plans are immutable per epoch, so a hit can
    change only how long a call takes, never what it returns."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._entries: OrderedDict[tuple[str, str, int], LoadedPlan] = OrderedDict()

    def get(self, key: tuple[str, str, int]) -> LoadedPlan | None:
        hit = self._entries.get(key)
        if hit is not None:
            self._entries.move_to_end(key)
        return hit

    def put(self, key: tuple[str, str, int], value: LoadedPlan) -> None:
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > self._capacity:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()


class Engine:
    def __init__(self, *, store: PlanStore, catalog: ModelCatalog, tokenizers: TokenizerRegistry,
                 assets: PlatformAssets, control_tools: dict[str, ToolSpec], metrics: Metrics,
                 plan_cache_size: int = 4096) -> None:
        self._store = store
        self._catalog = catalog
        self._tokenizers = tokenizers
        self._assets = assets
        self._control_tools = control_tools
        self._metrics = metrics
        self.cache = PlanCache(plan_cache_size)

    def estimator_for(self, model: ModelProfile) -> TokenEstimator:
        counter, extra = self._tokenizers.counter_for(model.encoding)
        return TokenEstimator(counter, round(model.base_factor * extra, 6))

    async def plan(self, cmd: PlanCommand) -> tuple[ContextPlan, bool]:
        profile = self._catalog.resolve(
            cmd.model.model_id, context_window=cmd.model.context_window,
            output_reserve=cmd.model.output_reserve,
            breakpoint_budget=cmd.model.breakpoint_budget)
        inputs = PlanInputs(
            tenant_id=cmd.tenant_id, session_id=cmd.session_id, agent=cmd.agent,
            persona=cmd.persona, tool_catalog=cmd.tool_catalog,
            principal_scopes=cmd.principal_scopes, model=profile,
            session_kind=cmd.session_kind, website_profile_id=cmd.website_profile_id,
            skill_catalog=cmd.skill_catalog, memory_snapshot=cmd.memory_snapshot,
            assets=self._assets, control_tools=self._control_tools)
        key = session_key(cmd.tenant_id, cmd.session_id)
        # Drafting is pure and may fail (caps, required tools): then nothing is written.
        draft = draft_plan(inputs, key, self.estimator_for(profile))

        def decide(current: ContextPlan | None) -> Rotation | None:
            if current is None:
                return Rotation(reason=SESSION_OPENED, draft=draft)
            reason = rotation_reason(current.spec, draft.spec)
            return None if reason is None else Rotation(reason=reason, draft=draft)

        plan, created = await self._store.pin(cmd.tenant_id, cmd.session_id, decide)
        if created:
            # Written just now from this very rendering: nothing to re-verify.
            self.cache.put((plan.tenant_id, plan.session_id, plan.epoch),
                           LoadedPlan(plan=plan, rendered=draft.rendered, session_key=key))
            if plan.epoch == 1:
                self._metrics.sessions_opened.inc()
            self._metrics.epochs.labels(reason=plan.reason).inc()
            self._metrics.prefix_tokens.observe(plan.prefix_tokens)
        return plan, created

    async def get_plan(self, tenant_id: str, session_id: str, epoch: int | None) -> ContextPlan:
        plan = await self._store.get(tenant_id, session_id, epoch)
        if plan is None:
            raise SessionNotFound(tenant_id, session_id, epoch)
        return plan

    async def loaded(self, tenant_id: str, session_id: str, epoch: int | None) -> LoadedPlan:
        if epoch is None:
            epoch = await self._store.current_epoch(tenant_id, session_id)
            if epoch is None:
                raise SessionNotFound(tenant_id, session_id)
        key = (tenant_id, session_id, epoch)
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        plan = await self.get_plan(tenant_id, session_id, epoch)
        try:
            loaded = load_plan(plan)
        except PrefixHashMismatch:
            self._metrics.prefix_hash_mismatch.inc()
            raise
        self.cache.put(key, loaded)
        return loaded

    async def build(self, tenant_id: str, session_id: str, epoch: int | None,
                    checkpoint: Checkpoint, factor: float | None) -> BuildResult:
        loaded = await self.loaded(tenant_id, session_id, epoch)
        estimator = self.estimator_for(loaded.plan.spec.model)
        started = time.perf_counter()
        try:
            result = build(loaded, checkpoint, estimator=estimator,
                           factor=1.0 if factor is None else factor)
        except BudgetExceeded as exc:
            self._metrics.budget_exceeded.labels(**{"class": exc.class_name}).inc()
            raise
        self._metrics.build_seconds.observe(time.perf_counter() - started)
        return result
