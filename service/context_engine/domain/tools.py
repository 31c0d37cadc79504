"""Tool selection at plan time (spec: "Only history scales with the window", tool paragraphs).

Authorization and environment filtering first, then definitions by rank — required browser tools
of a website-bound session, control tools, explicitly enabled tools in first-occurrence order,
then discovered tools reads first, by server, by name — under 30 tools / 9,000 tokens; what is
deferred or overflows becomes a deferred index entry (40 entries / 2,000 tokens) when the agent
enables ``tool.call``, and what fits in neither is recorded as skipped. Nothing leaves silently.
``tool.call`` is defined only while the final index is non-empty: when no entry fits, selection
re-runs without it, so its definition slot goes back to a real tool (ADR-0123). Likewise when
only discovered tools overflowed and ``tool.call``'s own definition would take the required,
control and enabled tools past the token cap: the selection without it stands and the overflow
is skipped, so adding a discovered tool never makes a plan fail over the tool cap (its
definition, where it fits, still counts in the prefix that Plan holds to history's floor:
engine.py). An agent that configures
deferrals needs ``tool.call`` itself, and fails at plan time if it does not fit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from context_engine.domain.canonical import sha256_hex
from context_engine.domain.errors import PrefixClassOverCap, RequiredToolUnavailable
from context_engine.domain.model import PlanInputs, SessionKind, ToolSpec

TOOL_ITEM_CAP = 30
TOOL_TOKEN_CAP = 9_000
INDEX_ITEM_CAP = 40
INDEX_TOKEN_CAP = 2_000

TOOL_CALL = "tool.call"
SKILL_LOAD = "skill.load"
UPDATE_WORKING_STATE = "context.update_working_state"
CONTROL_TOOLS = (TOOL_CALL, SKILL_LOAD, UPDATE_WORKING_STATE)
BROWSER_REQUIRED = ("browser.navigate", "browser.observe", "browser.act")
WEBSITE_BINDING = "website"


@dataclass(frozen=True, kw_only=True, slots=True)
class ToolSelection:
    defined: tuple[ToolSpec, ...]  # sorted by name
    deferred: tuple[ToolSpec, ...]  # index order
    skipped_tool_names: tuple[str, ...]  # in rank order
    filtered_tool_names: tuple[str, ...]  # removed by visibility/authorization/environment, sorted
    defined_tokens: int
    index_tokens: int


def authority_scope_hashes(scopes: Iterable[str]) -> tuple[str, ...]:
    """Sorted SHA-256 hashes of the principal's scopes: stored outside the prompt."""
    return tuple(sorted(sha256_hex(s) for s in set(scopes)))


def _dedup(names: Iterable[str]) -> list[str]:
    seen: set[str] = set()
    out: list[str] = []
    for n in names:
        if n not in seen:
            seen.add(n)
            out.append(n)
    return out


def _bound(binding: str, inputs: PlanInputs) -> bool:
    if binding == WEBSITE_BINDING:
        return bool(inputs.website_profile_id)
    return False  # trusted session metadata carries no other binding


def select_tools(inputs: PlanInputs, *, tool_cost: Callable[[ToolSpec], int],
                 index_cost: Callable[[ToolSpec], int],
                 index_overhead: int = 0,
                 index_measure: Callable[[tuple[ToolSpec, ...]], int] | None = None,
                 ) -> ToolSelection:
    """``index_cost`` is an entry's cost as rendered; ``index_overhead`` what the index costs
    beyond its entries (its header), reserved before any entry is admitted; ``index_measure``,
    when given, counts the rendered index block of some entries (the class is measured on
    it)."""
    if inputs.session_kind is SessionKind.EMAIL:
        # An operational Email session pins no tools at all (its typed tasks send none).
        return ToolSelection(defined=(), deferred=(), skipped_tool_names=(),
                             filtered_tool_names=tuple(sorted(t.name for t in inputs.tool_catalog)),
                             defined_tokens=0, index_tokens=0)

    scopes = set(inputs.principal_scopes)
    candidates: dict[str, ToolSpec] = {}
    filtered: list[str] = []
    for tool in inputs.tool_catalog:
        if (not tool.model_visible or not set(tool.required_scopes) <= scopes
                or (tool.session_binding and not _bound(tool.session_binding, inputs))):
            filtered.append(tool.name)
        else:
            candidates[tool.name] = tool

    required: list[str] = []
    if inputs.website_profile_id:
        for name in BROWSER_REQUIRED:
            if name not in candidates:
                known = {t.name for t in inputs.tool_catalog}
                why = ("not in the tool catalog" if name not in known
                       else "filtered out by visibility, scopes or session binding")
                raise RequiredToolUnavailable(name, why)
            required.append(name)

    agent = inputs.agent
    can_defer = agent.enables_tool_call and TOOL_CALL in inputs.control_tools
    configured_deferred = (
        [n for n in _dedup(agent.deferred_tools) if n in candidates and n not in required]
        if can_defer else [])  # an agent without tool.call defers nothing
    taken = set(required) | set(configured_deferred)
    enabled = [n for n in _dedup(agent.enabled_tools) if n in candidates and n not in taken]
    taken |= set(enabled)
    discovered = sorted((n for n in candidates if n not in taken),
                        key=lambda n: (not candidates[n].side_effect.is_read,
                                       candidates[n].server, n))

    controls: list[ToolSpec] = []
    if inputs.skill_catalog and SKILL_LOAD in inputs.control_tools:
        controls.append(inputs.control_tools[SKILL_LOAD])
    # the model writes working state only through this tool: every plan pins it (counted
    # against the caps like any definition) unless the agent opts out
    if not agent.omits_working_state_tool and UPDATE_WORKING_STATE in inputs.control_tools:
        controls.append(inputs.control_tools[UPDATE_WORKING_STATE])

    def attempt(with_tool_call: bool) -> tuple[list[ToolSpec], list[str], int]:
        defined: list[ToolSpec] = []
        used = 0
        fixed = [candidates[n] for n in required] + controls
        if with_tool_call:
            fixed.append(inputs.control_tools[TOOL_CALL])
        for tool in fixed:
            used += tool_cost(tool)
            defined.append(tool)
            if used > TOOL_TOKEN_CAP:
                raise PrefixClassOverCap("tool_definitions", used, TOOL_TOKEN_CAP)
        if len(defined) > TOOL_ITEM_CAP:
            raise PrefixClassOverCap("tool_definitions", len(defined), TOOL_ITEM_CAP,
                                     unit="items", measured_tokens=used,
                                     token_cap=TOOL_TOKEN_CAP)
        overflow: list[str] = []
        for name in enabled:
            if len(defined) >= TOOL_ITEM_CAP:
                overflow.append(name)
                continue
            cost = tool_cost(candidates[name])
            if used + cost > TOOL_TOKEN_CAP:
                # explicitly enabled capabilities fail at plan time over the token cap
                raise PrefixClassOverCap("tool_definitions", used + cost, TOOL_TOKEN_CAP)
            used += cost
            defined.append(candidates[name])
        for name in discovered:
            cost = tool_cost(candidates[name])
            if len(defined) < TOOL_ITEM_CAP and used + cost <= TOOL_TOKEN_CAP:
                used += cost
                defined.append(candidates[name])
            else:
                overflow.append(name)
        return defined, overflow, used

    defined, overflow, used = attempt(False)
    deferred: list[ToolSpec] = []
    skipped = list(overflow)  # without tool.call nothing is deferred
    index_tokens = 0
    if can_defer and (configured_deferred or overflow):
        # tool.call takes a definition slot, and every candidate without a definition becomes
        # an index entry: the configured deferrals first, then the overflow in rank order.
        try:
            with_call, overflow_with_call, used_with_call = attempt(True)
        except PrefixClassOverCap:
            if configured_deferred:
                raise  # the agent's own configuration needs tool.call, and it does not fit
            # Only discovered tools overflowed, and tool.call's definition would take the
            # enabled tools past the cap: the selection without tool.call stands and the
            # overflow is skipped, so adding a discovered tool never fails a plan that opens
            # over the tool cap
            # (nothing to index: the branch below keeps the first attempt).
            with_call, overflow_with_call, used_with_call = [], [], 0
        entries, unindexed, tokens = _admit_to_index(
            [candidates[n] for n in configured_deferred + overflow_with_call],
            index_cost=index_cost, index_overhead=index_overhead, index_measure=index_measure)
        if entries:
            defined, used, deferred, index_tokens = with_call, used_with_call, entries, tokens
            skipped = unindexed
        else:
            # tool.call is advertised only while the index is non-empty: selection re-runs
            # without it (the first attempt), so its slot goes back to a real tool. The
            # configured deferrals keep no definition; with no index they are skipped.
            skipped = configured_deferred + overflow

    return ToolSelection(defined=tuple(sorted(defined, key=lambda t: t.name)),
                         deferred=tuple(deferred), skipped_tool_names=tuple(skipped),
                         filtered_tool_names=tuple(sorted(filtered)),
                         defined_tokens=used, index_tokens=index_tokens)


def _admit_to_index(ranked: list[ToolSpec], *, index_cost: Callable[[ToolSpec], int],
                    index_overhead: int,
                    index_measure: Callable[[tuple[ToolSpec, ...]], int] | None,
                    ) -> tuple[list[ToolSpec], list[str], int]:
    """Index entries in rank order under 40 entries / 2,000 tokens: (entries, the names that
    fit in neither, tokens). Admission sums per-entry estimates; when ``index_measure`` counts
    the rendered block, entries are then trimmed from the end until it fits (token merges
    across lines can make the sum differ a little) rather than failing the plan."""
    entries: list[ToolSpec] = []
    skipped: list[str] = []
    tokens = index_overhead
    for tool in ranked:
        cost = index_cost(tool)
        if len(entries) < INDEX_ITEM_CAP and tokens + cost <= INDEX_TOKEN_CAP:
            tokens += cost
            entries.append(tool)
        else:
            skipped.append(tool.name)
    if index_measure is not None:
        tokens = index_measure(tuple(entries)) if entries else 0
        while entries and tokens > INDEX_TOKEN_CAP:
            skipped.insert(0, entries.pop().name)  # rank order: entries precede the skipped
            tokens = index_measure(tuple(entries)) if entries else 0
    return entries, skipped, tokens if entries else 0
