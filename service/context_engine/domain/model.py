"""Frozen input values of the domain: what a caller pins at Plan and sends at Build."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from context_engine.domain.canonical import canonical_sha256
from context_engine.domain.trust import TrustLevel


class SessionKind(enum.Enum):
    INTERACTIVE = "interactive"
    SCHEDULED = "scheduled"
    CHILD = "child"
    EMAIL = "email"


class SideEffect(enum.Enum):
    NONE = "none"
    WORKSPACE_READ = "workspace_read"
    NETWORK_READ = "network_read"
    WORKSPACE_WRITE = "workspace_write"
    NETWORK_WRITE = "network_write"
    EXTERNAL_ACTION = "external_action"

    @property
    def is_read(self) -> bool:
        return self in (SideEffect.NONE, SideEffect.WORKSPACE_READ, SideEffect.NETWORK_READ)


@dataclass(frozen=True, kw_only=True, slots=True)
class ToolSpec:
    name: str
    description: str
    input_schema: dict[str, Any]
    side_effect: SideEffect = SideEffect.NONE
    server: str = ""
    required_scopes: tuple[str, ...] = ()  # kept sorted: a set in hash order is a cache thrash
    model_visible: bool = True
    session_binding: str = ""

    def canonical(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "input_schema": self.input_schema,
            "side_effect": self.side_effect.value,
            "server": self.server,
            "required_scopes": sorted(self.required_scopes),
            "model_visible": self.model_visible,
            "session_binding": self.session_binding,
        }

    @classmethod
    def from_canonical(cls, d: dict[str, Any]) -> ToolSpec:
        return cls(
            name=d["name"], description=d["description"], input_schema=d["input_schema"],
            side_effect=SideEffect(d["side_effect"]), server=d["server"],
            required_scopes=tuple(sorted(d["required_scopes"])),
            model_visible=d["model_visible"], session_binding=d["session_binding"],
        )

    @property
    def builtin(self) -> bool:
        return not self.server


@dataclass(frozen=True, kw_only=True, slots=True)
class AgentSpec:
    agent_id: str
    version: str
    instructions: str
    enabled_tools: tuple[str, ...] = ()
    deferred_tools: tuple[str, ...] = ()
    enables_tool_call: bool = False
    # the agent opts out of the context.update_working_state control tool (pinned otherwise)
    omits_working_state_tool: bool = False

    def canonical(self) -> dict[str, Any]:
        return {
            "agent_id": self.agent_id, "version": self.version,
            "instructions": self.instructions, "enabled_tools": list(self.enabled_tools),
            "deferred_tools": list(self.deferred_tools),
            "enables_tool_call": self.enables_tool_call,
            "omits_working_state_tool": self.omits_working_state_tool,
        }

    @classmethod
    def from_canonical(cls, d: dict[str, Any]) -> AgentSpec:
        return cls(agent_id=d["agent_id"], version=d["version"], instructions=d["instructions"],
                   enabled_tools=tuple(d["enabled_tools"]),
                   deferred_tools=tuple(d["deferred_tools"]),
                   enables_tool_call=d["enables_tool_call"],
                   # absent from plans pinned before the control tool existed: they had none,
                   # and a policy_changed rotation re-selects their tools with it
                   omits_working_state_tool=d.get("omits_working_state_tool", False))


@dataclass(frozen=True, kw_only=True, slots=True)
class PersonaEntry:
    key: str
    text: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Persona:
    revision: str = ""
    entries: tuple[PersonaEntry, ...] = ()

    def canonical(self) -> dict[str, Any]:
        return {"revision": self.revision,
                "entries": [[e.key, e.text] for e in self.entries]}

    @classmethod
    def from_canonical(cls, d: dict[str, Any]) -> Persona:
        return cls(revision=d["revision"],
                   entries=tuple(PersonaEntry(key=k, text=t) for k, t in d["entries"]))


@dataclass(frozen=True, kw_only=True, slots=True)
class SkillCatalogEntry:
    name: str
    description: str
    trust: TrustLevel

    def canonical(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "trust": self.trust.value}

    @property
    def sha256(self) -> str:
        """The entry's pin (``ContextPlan.skill_pins``): SHA-256 of its canonical JSON, so a
        runtime can tell whether the skill changed since the plan pinned it."""
        return canonical_sha256(self.canonical())


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryItem:
    id: str
    text: str


@dataclass(frozen=True, kw_only=True, slots=True)
class MemorySnapshot:
    snapshot_id: str = ""
    recall_trace_id: str = ""
    watermark: int = 0
    items: tuple[MemoryItem, ...] = ()

    def canonical(self) -> dict[str, Any]:
        return {"snapshot_id": self.snapshot_id, "recall_trace_id": self.recall_trace_id,
                "watermark": self.watermark, "items": [[i.id, i.text] for i in self.items]}

    @classmethod
    def from_canonical(cls, d: dict[str, Any]) -> MemorySnapshot:
        return cls(snapshot_id=d["snapshot_id"], recall_trace_id=d["recall_trace_id"],
                   watermark=d["watermark"],
                   items=tuple(MemoryItem(id=i, text=t) for i, t in d["items"]))


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelProfile:
    """A model's sizing, resolved from the request and the catalog at Plan time."""

    model_id: str
    provider: str
    encoding: str
    context_window: int
    output_reserve: int
    breakpoint_budget: int
    base_factor: float
    family: str = "unknown"  # the catalog prefix that matched: a bounded metric label

    def canonical(self) -> dict[str, Any]:
        return {"model_id": self.model_id, "provider": self.provider, "encoding": self.encoding,
                "context_window": self.context_window, "output_reserve": self.output_reserve,
                "breakpoint_budget": self.breakpoint_budget, "base_factor": self.base_factor,
                "family": self.family}

    @classmethod
    def from_canonical(cls, d: dict[str, Any]) -> ModelProfile:
        return cls(**d)


@dataclass(frozen=True, kw_only=True, slots=True)
class PlatformAssets:
    """Row 1 and row 2 texts, shipped with the service and versioned together."""

    version: str
    policy: str
    framing: str


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanInputs:
    tenant_id: str
    session_id: str
    agent: AgentSpec
    persona: Persona
    tool_catalog: tuple[ToolSpec, ...]
    principal_scopes: tuple[str, ...]
    model: ModelProfile
    session_kind: SessionKind
    website_profile_id: str
    skill_catalog: tuple[SkillCatalogEntry, ...]
    memory_snapshot: MemorySnapshot
    assets: PlatformAssets
    control_tools: dict[str, ToolSpec] = field(default_factory=dict)
