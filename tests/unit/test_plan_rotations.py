"""Plan's rotations against the plan under the session's lock: a run with tool pins or pending
calls keeps its advertised tools and authority through any rotation; a rotation drafted
before another replica moved the session on is drafted again over what it moved on to (never
taking the session's policy back); a session erased while a legacy plan is canonicalized is
opened anew."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from context_engine.domain.builder import LoadedPlan
from context_engine.domain.canonical import session_key
from context_engine.domain.model import MemoryItem, MemorySnapshot
from context_engine.domain.plan import PlatformAssets
from context_engine.domain.ports import (
    InMemoryCalibrationStore,
    InMemoryEventLog,
    InMemoryPlanStore,
)
from context_engine.engine import Engine, ModelRequestSpec, PlanCommand
from context_engine.telemetry.metrics import Metrics
from prometheus_client import CollectorRegistry

from tests import factories as f

TOOLS = (f.tool("a.read", scopes=("scope.a",)), f.tool("b.read", scopes=("scope.b",)))


def snapshot(n: int) -> MemorySnapshot:
    return MemorySnapshot(snapshot_id=f"s{n}", recall_trace_id=f"t{n}", watermark=n,
                          items=(MemoryItem(id=f"m{n}", text=f"remembered {n}"),))


def engine(store: InMemoryPlanStore, assets: PlatformAssets = f.ASSETS) -> Engine:
    return Engine(store=store, events=InMemoryEventLog(),
                  calibrations=InMemoryCalibrationStore(), catalog=f.CATALOG,
                  tokenizers=f.REGISTRY, assets=assets, control_tools=f.CONTROL_TOOLS,
                  metrics=Metrics(CollectorRegistry()))


def command(scopes: tuple[str, ...] = ("scope.a",), *, snap: int = 1, pinned: bool = False,
            run_id: str = "run-2", invalidated: tuple[str, ...] = (),
            agent_version: str = "1", model_id: str | None = None) -> PlanCommand:
    i = f.inputs(agent_version=agent_version)
    return PlanCommand(tenant_id=i.tenant_id, session_id=i.session_id, agent=i.agent,
                       persona=i.persona, tool_catalog=TOOLS, principal_scopes=scopes,
                       model=ModelRequestSpec(model_id=model_id or i.model.model_id),
                       session_kind=i.session_kind, website_profile_id="", skill_catalog=(),
                       memory_snapshot=snapshot(snap), run_id=run_id, run_pinned=pinned,
                       invalidated_trace_ids=invalidated)


def test_a_pinned_run_keeps_its_tools_through_a_snapshot_rotation():
    """Spec ("Prefix epochs"): pinned runs and pending calls must not refresh authority or
    rewrite their advertised tools. A snapshot invalidated under a run parked with a pending
    b.read call, after scope.b was revoked, rotated to a plan without b.read; one after a new
    grant advertised a tool the pinned run was never resolved with."""
    async def go() -> None:
        revoked = engine(InMemoryPlanStore())
        first, _ = await revoked.plan(command(("scope.a", "scope.b")))
        assert first.spec.tool_names[:2] == ("a.read", "b.read")
        second, created = await revoked.plan(command(("scope.a",), snap=2, pinned=True,
                                                     invalidated=("t1",)))
        assert created and second.reason == "snapshot_invalidated"
        assert second.spec.memory_snapshot == snapshot(2)
        assert second.spec.tool_names == first.spec.tool_names
        assert second.spec.authority_scope_hashes == first.spec.authority_scope_hashes

        granted = engine(InMemoryPlanStore())
        first, _ = await granted.plan(command(("scope.a",)))
        assert "b.read" not in first.spec.tool_names
        second, _ = await granted.plan(command(("scope.a", "scope.b"), snap=2, pinned=True,
                                               invalidated=("t1",)))
        assert second.reason == "snapshot_invalidated"
        assert second.spec.tool_names == first.spec.tool_names
        assert second.spec.authority_scope_hashes == first.spec.authority_scope_hashes
        # at the next unpinned admission the new grant rebuilds the plan (ADR-0094)
        third, _ = await granted.plan(command(("scope.a", "scope.b"), snap=2))
        assert third.reason == "run_authority_changed" and "b.read" in third.spec.tool_names
    asyncio.run(go())


def test_a_pinned_run_keeps_its_tools_through_a_model_change():
    async def go() -> None:
        e = engine(InMemoryPlanStore())
        first, _ = await e.plan(command(("scope.a", "scope.b")))
        second, created = await e.plan(command(("scope.a",), pinned=True,
                                               model_id="gpt-4o"))
        assert created and second.reason == "model_changed"
        assert second.spec.model.model_id == "gpt-4o"
        assert second.spec.tool_names == first.spec.tool_names
        assert second.spec.authority_scope_hashes == first.spec.authority_scope_hashes
        # unpinned, the same change re-resolves against the request's scopes
        e = engine(InMemoryPlanStore())
        await e.plan(command(("scope.a", "scope.b")))
        moved, _ = await e.plan(command(("scope.a",), model_id="gpt-4o"))
        assert "b.read" not in moved.spec.tool_names
    asyncio.run(go())


class Interleaving(InMemoryPlanStore):
    """Runs ``hook`` (another replica's call) once, after the plan was read and before the
    session is locked."""

    hook: Callable[[], Awaitable[Any]] | None = None

    async def pin(self, *args: Any, **kwargs: Any) -> Any:
        if self.hook is not None:
            hook, self.hook = self.hook, None
            await hook()
        return await super().pin(*args, **kwargs)


def test_a_rotation_drafted_before_a_newer_replica_rotated_keeps_the_newer_policy():
    """An older replica began a rotation (agent 2) while a newer one moved the session to its
    policy: the older one pinned its own older policy under the lock, and the newer replica's
    next Plan rotated again (policy_changed)."""
    async def go() -> None:
        store = Interleaving()
        name, _, revision = f.ASSETS.version.rpartition("@")
        newer = replace(f.ASSETS, version=f"{name}@{revision}-next",
                        policy=f.ASSETS.policy + "\nOne more rule.\n")
        old, new = engine(store, f.ASSETS), engine(store, newer)
        first, _ = await old.plan(command())
        store.hook = lambda: new.plan(command())
        third, _ = await old.plan(command(agent_version="2"))
        reasons = [(p.reason, p.spec.assets.version)
                   for p in store.plans[(first.tenant_id, first.session_id)]]
        assert reasons == [("session_opened", f.ASSETS.version),
                           ("policy_changed", newer.version),
                           ("agent_version_changed", newer.version)]
        assert third.spec.agent.version == "2"
        assert not (await new.plan(command(agent_version="2")))[1]  # no churn after it
    asyncio.run(go())


class ErasedBeforeTheLock(InMemoryPlanStore):
    """Erases the session after its plan was read, before the next pin locks it."""

    erase = False

    async def pin(self, tenant_id: str, session_id: str, *args: Any, **kwargs: Any) -> Any:
        if self.erase:
            self.erase = False
            self.plans.pop((tenant_id, session_id), None)
        return await super().pin(tenant_id, session_id, *args, **kwargs)


def test_a_session_erased_while_its_legacy_plan_is_canonicalized_is_opened_anew(monkeypatch):
    """The canonicalizing decision found no plan under the lock and returned no rotation: the
    store's ``assert current is not None`` failed and Plan answered INTERNAL."""
    async def go() -> None:
        store = ErasedBeforeTheLock()
        e = engine(store)
        first, _ = await e.plan(command())
        real = e.loaded

        async def legacy(*args: Any, **kwargs: Any) -> LoadedPlan:
            loaded = await real(*args, **kwargs)
            return replace(loaded, legacy=True)
        monkeypatch.setattr(e, "loaded", legacy)
        store.erase = True
        again, created = await e.plan(command())
        assert created and again.reason == "session_opened" and again.epoch == 1
        assert again.spec == first.spec
        assert session_key(again.tenant_id, again.session_id)
    asyncio.run(go())


async def pinned_over_the_tool_cap(e: Engine, store: InMemoryPlanStore,
                                   builder: str | None = None) -> tuple[Any, Any]:
    """A session opened, then its plan's first tool given a description over the tool cap as
    counted now (as an older builder, counting lower, could have pinned it): (plan, tool)."""
    first, _ = await e.plan(command(("scope.a", "scope.b")))
    wordy = replace(first.spec.tools[0],
                    description=" ".join(f"word{i}" for i in range(3_400)))
    spec = replace(first.spec, tools=(wordy, *first.spec.tools[1:]))
    if builder is not None:
        spec = replace(spec, builder_version=builder)
    store.plans[(first.tenant_id, first.session_id)][-1] = replace(first, spec=spec)
    return first, wordy


def test_a_pinned_run_rotates_a_plan_an_older_builder_counted_lower():
    """The kept tools are held, as an explicit rotation holds them: a tool an older builder
    counted within the cap, over it as counted now, never fails a pinned run's rotation (its
    Plan would fail on every retry); a run named as unpinned resolves the request's catalog."""
    async def go() -> None:
        store = InMemoryPlanStore()
        e = engine(store)
        _, wordy = await pinned_over_the_tool_cap(e, store, "context-engine-builder@2")
        second, created = await e.plan(command(("scope.a", "scope.b"), pinned=True))
        assert created and second.reason == "builder_changed"
        assert second.spec.tools[0] == wordy
        tools = next(c for c in second.classes if c.class_name == "tool_definitions")
        assert tools.tokens > tools.cap
    asyncio.run(go())


def test_without_a_run_a_rotation_resolves_the_request_again():
    async def go() -> None:
        e = engine(InMemoryPlanStore())
        await e.plan(command(("scope.a", "scope.b")))
        moved, _ = await e.plan(command(("scope.a",), run_id="", pinned=True,
                                        model_id="gpt-4o"))
        assert moved.reason == "model_changed" and "b.read" not in moved.spec.tool_names
    asyncio.run(go())


def test_a_pinned_run_moved_to_another_model_counts_its_tools_afresh():
    """Held only while the model is kept: on another tokenizer the kept tools are counted
    again and a cap fails (as Rotate's model_routed does), never truncated."""
    from context_engine.domain.errors import PrefixClassOverCap

    async def go() -> None:
        store = InMemoryPlanStore()
        e = engine(store)
        first, _ = await pinned_over_the_tool_cap(e, store)
        try:
            await e.plan(command(("scope.a", "scope.b"), pinned=True, model_id="gpt-4o"))
        except PrefixClassOverCap as over:
            assert over.class_name == "tool_definitions"
        else:
            raise AssertionError("a cap held the kept tools on another model")
        assert len(store.plans[(first.tenant_id, first.session_id)]) == 1  # nothing written
    asyncio.run(go())
