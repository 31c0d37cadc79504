"""Builders of domain inputs for tests: small, explicit, deterministic."""

from __future__ import annotations

import json
from typing import Any

from context_engine.adapters.assets import (
    load_control_tools,
    load_model_catalog,
    load_platform_assets,
)
from context_engine.adapters.tokenizers import TiktokenRegistry
from context_engine.domain.builder import (
    BuildResult,
    Checkpoint,
    LoadedPlan,
    RuntimeMetadata,
    build,
    load_plan,
)
from context_engine.domain.canonical import session_key
from context_engine.domain.estimator import TokenEstimator
from context_engine.domain.items import (
    ConversationItem,
    ToolCallItem,
    ToolResultItem,
    UserMessageItem,
)
from context_engine.domain.model import (
    AgentSpec,
    MemorySnapshot,
    ModelProfile,
    Persona,
    PlanInputs,
    SessionKind,
    SideEffect,
    SkillCatalogEntry,
    ToolSpec,
)
from context_engine.domain.plan import SESSION_OPENED, ContextPlan, PlanDraft, draft_plan
from context_engine.domain.request import ToolCall
from context_engine.domain.trust import TrustLevel

REGISTRY = TiktokenRegistry()
CATALOG = load_model_catalog()
ASSETS = load_platform_assets()
CONTROL_TOOLS = load_control_tools()
SCHEMA: dict[str, Any] = {"type": "object", "properties": {"q": {"type": "string"}},
                          "required": ["q"]}


def estimator(model: ModelProfile) -> TokenEstimator:
    counter, extra = REGISTRY.counter_for(model.encoding)
    # as the engine's plan estimator: the model's image figure from the catalog
    return TokenEstimator(counter, round(model.base_factor * extra, 6),
                          image_tokens=CATALOG.image_tokens(model.model_id))


def model(model_id: str = "claude-sonnet-4-5", **caps: int) -> ModelProfile:
    return CATALOG.resolve(model_id, context_window=caps.get("context_window"),
                           output_reserve=caps.get("output_reserve"),
                           breakpoint_budget=caps.get("breakpoint_budget"))


def tool(name: str, *, side_effect: SideEffect = SideEffect.NONE, server: str = "",
         description: str | None = None, schema: dict[str, Any] | None = None,
         scopes: tuple[str, ...] = (), model_visible: bool = True,
         session_binding: str = "") -> ToolSpec:
    return ToolSpec(name=name, description=description or f"Does {name}. More detail here.",
                    input_schema=schema if schema is not None else SCHEMA,
                    side_effect=side_effect, server=server, required_scopes=tuple(sorted(scopes)),
                    model_visible=model_visible, session_binding=session_binding)


def inputs(*, tenant_id: str = "tenant-a", session_id: str = "session-1",
           instructions: str = "You are a careful assistant.",
           agent_version: str = "1", enabled: tuple[str, ...] = (),
           deferred: tuple[str, ...] = (), tool_call: bool = False,
           working_state_tool: bool = False,
           catalog: tuple[ToolSpec, ...] = (), scopes: tuple[str, ...] = (),
           persona: Persona | None = None, model_profile: ModelProfile | None = None,
           kind: SessionKind = SessionKind.INTERACTIVE, website: str = "",
           skills: tuple[SkillCatalogEntry, ...] = (),
           snapshot: MemorySnapshot | None = None) -> PlanInputs:
    return PlanInputs(
        tenant_id=tenant_id, session_id=session_id,
        agent=AgentSpec(agent_id="agent", version=agent_version, instructions=instructions,
                        enabled_tools=enabled, deferred_tools=deferred,
                        enables_tool_call=tool_call,
                        # like tool.call, the working-state control tool only when a test asks
                        # (production agents get it unless they opt out): each test's tool set
                        # is what it names
                        omits_working_state_tool=not working_state_tool),
        persona=persona or Persona(), tool_catalog=catalog,
        principal_scopes=tuple(sorted(set(scopes))), model=model_profile or model(),
        session_kind=kind, website_profile_id=website, skill_catalog=skills,
        memory_snapshot=snapshot or MemorySnapshot(), assets=ASSETS,
        control_tools=CONTROL_TOOLS)


def skill_catalog(*names: str) -> tuple[SkillCatalogEntry, ...]:
    """A plan's skill catalog of ``names`` (a checkpoint loads skills only from it)."""
    return tuple(SkillCatalogEntry(name=n, description=f"The {n} skill.",
                                   trust=TrustLevel.TRUSTED_CONFIGURATION) for n in names)


def draft(i: PlanInputs) -> PlanDraft:
    return draft_plan(i, session_key(i.tenant_id, i.session_id), estimator(i.model))


def plan(i: PlanInputs, *, epoch: int = 1, reason: str = SESSION_OPENED) -> ContextPlan:
    d = draft(i)
    return ContextPlan(tenant_id=i.tenant_id, session_id=i.session_id, epoch=epoch,
                       reason=reason, spec=d.spec, prefix_sha256=d.rendered.prefix_sha256,
                       prefix_tokens=d.prefix_tokens, classes=d.classes)


def loaded(i: PlanInputs | None = None) -> LoadedPlan:
    return load_plan(plan(i or inputs()))


def run_build(lp: LoadedPlan, cp: Checkpoint, factor: float = 1.0) -> BuildResult:
    return build(lp, cp, estimator=estimator(lp.plan.spec.model), factor=factor)


def user(item_id: str, text: str, seq: int, run: str = "run-1",
         trust: TrustLevel = TrustLevel.USER) -> UserMessageItem:
    return UserMessageItem(id=item_id, sequence=seq, run_id=run, item_trust=trust, text=text)


def call(item_id: str, seq: int, *call_ids: str, run: str = "run-1",
         name: str = "web.fetch") -> ToolCallItem:
    return ToolCallItem(id=item_id, sequence=seq, run_id=run, item_trust=TrustLevel.USER,
                        calls=tuple(ToolCall(call_id=c, name=name,
                                             arguments_json=json.dumps({"q": c}))
                                    for c in call_ids))


def result(item_id: str, seq: int, call_id: str, content: str, run: str = "run-1",
           trust: TrustLevel = TrustLevel.EXTERNAL_UNTRUSTED,
           name: str = "web.fetch") -> ToolResultItem:
    return ToolResultItem(id=item_id, sequence=seq, run_id=run, item_trust=trust,
                          call_id=call_id, tool_name=name, content=content)


def checkpoint(items: list[ConversationItem], *, run: str = "run-1",
               date: str = "2026-11-29", **fields: Any) -> Checkpoint:
    return Checkpoint(active_run_id=run, items=tuple(items),
                      runtime=RuntimeMetadata(current_date=date), **fields)


def request_bytes(r: BuildResult) -> str:
    """Everything the model would receive, as one canonical string."""
    req = r.request
    return json.dumps({
        "blocks": [[b.row, b.trust.value, b.text] for b in req.prefix_blocks],
        "tools": [[t.name, t.description, t.input_schema_json] for t in req.tools],
        "messages": [m.digest_parts() for m in req.messages],
        "prefix_sha256": r.prefix_sha256,
    }, sort_keys=True, ensure_ascii=False)
