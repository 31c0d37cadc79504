"""build(): Region A from the pinned plan, Region B from the caller's checkpoint. Pure.

spec: "Two regions and one rule" (assembly order and the active-run rule), "Pressure is
resolved by a write, never inline". No clock, no randomness, no I/O: the same plan, checkpoint
and factor always give the same bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from context_engine.domain.canonical import parse_json_object, session_key
from context_engine.domain.errors import (
    BudgetExceeded,
    FieldViolation,
    InvalidInput,
    PrefixHashMismatch,
)
from context_engine.domain.estimator import TokenEstimator
from context_engine.domain.items import (
    ContextItem,
    ConversationItem,
    CorrectionItem,
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
)
from context_engine.domain.plan import ContextPlan, RenderedPrefix, render_prefix
from context_engine.domain.request import Message, ModelRequest
from context_engine.domain.trust import Region, TrustLevel


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


@dataclass(frozen=True, kw_only=True, slots=True)
class LoadedPlan:
    """A plan whose prefix was re-rendered and verified against its stored hash."""

    plan: ContextPlan
    rendered: RenderedPrefix
    session_key: str


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


def validate_checkpoint(cp: Checkpoint, field: str = "checkpoint") -> None:
    """Reject malformed checkpoints with one violation per problem; an orphaned tool call or
    result is a malformed request, never a smaller one."""
    violations = checkpoint_violations(cp, field)
    if violations:
        raise InvalidInput(violations)


def checkpoint_violations(cp: Checkpoint, field: str = "checkpoint") -> list[FieldViolation]:
    violations: list[FieldViolation] = []
    seen_ids: set[str] = set()
    open_calls: dict[str, int] = {}
    answered: set[str] = set()
    last_sequence: int | None = None
    for i, item in enumerate(cp.items):
        path = f"{field}.items[{i}]"
        if not item.id:
            violations.append(FieldViolation(f"{path}.id", "must not be empty"))
        elif item.id in seen_ids:
            violations.append(FieldViolation(f"{path}.id", f"duplicate item id {item.id!r}"))
        seen_ids.add(item.id)
        if last_sequence is not None and item.sequence < last_sequence:
            violations.append(FieldViolation(
                f"{path}.sequence", f"{item.sequence} is below the previous item's "
                f"{last_sequence}: items are ordered oldest first"))
        last_sequence = item.sequence
        if isinstance(item, ToolCallItem):
            if not item.calls:
                violations.append(FieldViolation(f"{path}.tool_calls", "has no calls"))
            for j, call in enumerate(item.calls):
                cpath = f"{path}.tool_calls.calls[{j}]"
                if not call.call_id:
                    violations.append(FieldViolation(f"{cpath}.call_id", "must not be empty"))
                elif call.call_id in open_calls or call.call_id in answered:
                    violations.append(FieldViolation(f"{cpath}.call_id",
                                                     f"duplicate call id {call.call_id!r}"))
                else:
                    open_calls[call.call_id] = i
                if not call.name:
                    violations.append(FieldViolation(f"{cpath}.name", "must not be empty"))
                if parse_json_object(call.arguments_json) is None:
                    violations.append(FieldViolation(f"{cpath}.arguments_json",
                                                     "is not a JSON object"))
        elif isinstance(item, ToolResultItem):
            if item.call_id in answered:
                violations.append(FieldViolation(
                    f"{path}.tool_result.call_id", f"call {item.call_id!r} already has a result"))
            elif item.call_id not in open_calls:
                violations.append(FieldViolation(
                    f"{path}.tool_result.call_id",
                    f"no earlier tool call has id {item.call_id!r}: a result without its call "
                    "is an orphan"))
            else:
                del open_calls[item.call_id]
                answered.add(item.call_id)
    for call_id, index in sorted(open_calls.items(), key=lambda kv: kv[1]):
        violations.append(FieldViolation(
            f"{field}.items[{index}].tool_calls",
            f"call {call_id!r} has no result: a call without its result is an orphan"))
    for i, skill in enumerate(cp.loaded_skills):
        if not skill.name:
            violations.append(FieldViolation(f"{field}.loaded_skills[{i}].name",
                                             "must not be empty"))
    return violations


def split_trailing(items: Sequence[ConversationItem]) -> tuple[list[ConversationItem],
                                                               list[UserMessageItem]]:
    """Unanswered trailing user messages (including supplemental input on resume) stay last."""
    cut = len(items)
    while cut > 0 and isinstance(items[cut - 1], UserMessageItem):
        cut -= 1
    trailing = [i for i in items[cut:] if isinstance(i, UserMessageItem)]
    return list(items[:cut]), trailing


def body_items(loaded: LoadedPlan, cp: Checkpoint) -> list[ContextItem]:
    """Region B items before ordering. Reasoning items never cross a run boundary: only the
    active run's are replayed."""
    history, trailing = split_trailing(cp.items)
    items: list[ContextItem] = [
        i for i in history
        if not (isinstance(i, ReasoningItem) and i.run_id != cp.active_run_id)
    ]
    items += [SkillBodyItem(name=s.name, body=s.body, skill_trust=s.trust)
              for s in cp.loaded_skills]
    if not cp.working_state.empty:
        items.append(WorkingStateItem(state=cp.working_state))
    if cp.knowledge:
        items.append(KnowledgeItem(passages=tuple(sorted(cp.knowledge,
                                                         key=lambda p: (p.rank, p.id)))))
    if cp.recall:
        items.append(RecallItem(lines=cp.recall))
    if cp.corrections:
        items.append(CorrectionItem(lines=cp.corrections))
    rt = cp.runtime
    offers_navigate = "browser.navigate" in loaded.plan.spec.tool_names or \
        "browser.navigate" in loaded.plan.spec.deferred_tool_names
    origins = rt.browser_origins if offers_navigate else ()
    if rt.current_date or rt.principal_scopes or rt.surface or origins:
        items.append(RuntimeMetadataItem(current_date=rt.current_date,
                                         principal_scopes=rt.principal_scopes,
                                         surface=rt.surface, browser_origins=origins))
    items += [TrailingUserInput(message=m) for m in trailing]
    return items


def render_body(loaded: LoadedPlan, cp: Checkpoint) -> tuple[Message, ...]:
    ctx = RenderContext(session_key=loaded.session_key)
    messages: list[Message] = []
    for item in assemble(body_items(loaded, cp), Region.B):
        messages.extend(item.messages(ctx))  # type: ignore[attr-defined]
    return tuple(messages)


def build(loaded: LoadedPlan, cp: Checkpoint, *, estimator: TokenEstimator,
          factor: float = 1.0) -> BuildResult:
    """Assemble one model request. Pure: no clock, randomness or I/O."""
    validate_checkpoint(cp)
    messages = render_body(loaded, cp)
    plan = loaded.plan
    model = plan.spec.model
    body_tokens = estimator.messages(messages, factor)
    total = plan.prefix_tokens + body_tokens
    available = model.context_window - model.output_reserve
    if total > available:
        # Whole-window check: the output reserve is never spent on input.
        raise BudgetExceeded("window", total, available)
    return BuildResult(
        request=ModelRequest(prefix_blocks=loaded.rendered.blocks, tools=loaded.rendered.tools,
                             messages=messages),
        prefix_sha256=loaded.rendered.prefix_sha256, epoch=plan.epoch, model_id=model.model_id,
        session_key=loaded.session_key, prefix_tokens=plan.prefix_tokens,
        body_tokens=body_tokens, estimated_input_tokens=total,
        context_window=model.context_window, output_reserve=model.output_reserve,
        estimator_factor=factor, tokenizer=estimator.tokenizer,
    )


def load_plan(plan: ContextPlan) -> LoadedPlan:
    """Re-render a stored plan's prefix and verify it against the hash it was pinned with."""
    key = session_key(plan.tenant_id, plan.session_id)
    rendered = render_prefix(plan.spec, key)
    if rendered.prefix_sha256 != plan.prefix_sha256:
        raise PrefixHashMismatch(plan.prefix_sha256, rendered.prefix_sha256, plan.epoch)
    return LoadedPlan(plan=plan, rendered=rendered, session_key=key)
