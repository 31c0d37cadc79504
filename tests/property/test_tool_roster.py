"""Tool selection over generated rosters (spec: "Only history scales with the window", the tool
paragraphs; "Authorization changes do not rewrite the prefix": tool.call is advertised only
while the plan defers something).

Three properties, each over rosters of reads and writes, large and small definitions, entries
that fit the deferred index and entries that cannot, configured deferrals, explicitly enabled
tools, filtered tools and agents with and without ``tool.call``:

- ``tool.call`` is defined exactly when the final index is non-empty;
- nothing leaves the roster silently: every catalog tool is defined, deferred, skipped or
  filtered, exactly once, and a skipped tool fitted neither the final definitions nor the
  final index (no slot is held back from a tool that would have fitted);
- adding a discovered tool to a catalog whose plan opens never makes the plan fail (only the
  agent's own enabled tools and deferrals fail at plan time over the token cap).

The first and the third run ``select_tools`` with drawn costs (fast, so many rosters); the
second runs the planner itself, with the real tokenizer and the index as rendered.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from context_engine.domain.errors import PrefixClassOverCap
from context_engine.domain.model import PlanInputs, SideEffect, SkillCatalogEntry, ToolSpec
from context_engine.domain.tools import (
    INDEX_ITEM_CAP,
    INDEX_TOKEN_CAP,
    TOOL_CALL,
    TOOL_ITEM_CAP,
    TOOL_TOKEN_CAP,
    ToolSelection,
    select_tools,
)
from context_engine.domain.trust import TrustLevel
from hypothesis import HealthCheck, Phase, event, given, reject, settings
from hypothesis import strategies as st

from tests import factories as f
from tests.unit import helpers as h

SETTINGS = settings(max_examples=400, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow],
                    phases=(Phase.explicit, Phase.generate, Phase.shrink))
# A failing roster is reported as drawn: shrinking a 60-tool roster whose failure needs more
# than 30 tools takes minutes, and the assertion already names the defined and deferred tools.
UNSHRUNK = settings(SETTINGS, phases=(Phase.explicit, Phase.generate))
SKILLS = (SkillCatalogEntry(name="triage", description="Sorts mail.",
                            trust=TrustLevel.TRUSTED_CONFIGURATION),)
HELD = "held"


@dataclass(frozen=True)
class Roster:
    inputs: PlanInputs
    cost: dict[str, int]  # a definition's tokens
    entry: dict[str, int]  # an index entry's tokens
    overhead: int  # the index header


@st.composite
def rosters(draw: st.DrawFn) -> Roster:
    n = draw(st.integers(0, 60))
    # some rosters' writes fit no index at all (the case where tool.call must not stay)
    unindexable_writes = draw(st.booleans())
    tools: list[ToolSpec] = []
    cost: dict[str, int] = {}
    entry: dict[str, int] = {}
    for i in range(n):
        write = draw(st.booleans())
        name = f"{'w' if write else 'r'}.{i:02d}"
        kind = draw(st.integers(0, 19))  # 1 in 20 invisible, 1 in 20 without its scope
        tools.append(f.tool(name, side_effect=SideEffect.NETWORK_WRITE if write
                            else SideEffect.NONE, server=draw(st.sampled_from(("", "a", "b"))),
                            model_visible=kind != 0, scopes=("missing",) if kind == 1
                            else (HELD,)))
        cost[name] = draw(st.one_of(st.integers(20, 150), st.integers(1_000, 3_000)))
        entry[name] = draw(st.integers(2_001, 2_500) if write and unindexable_writes
                           else st.one_of(st.integers(10, 80), st.integers(1_500, 2_500)))
    names = [t.name for t in tools]
    some = st.lists(st.sampled_from(names), max_size=6) if names else st.just([])
    inputs = f.inputs(catalog=tuple(tools), scopes=(HELD,), enabled=tuple(draw(some)),
                      deferred=tuple(draw(some)), tool_call=draw(st.booleans()),
                      skills=SKILLS if draw(st.booleans()) else ())
    for control in inputs.control_tools:
        cost[control] = draw(st.integers(50, 300))
    return Roster(inputs=inputs, cost=cost, entry=entry, overhead=draw(st.integers(0, 40)))


def check(inputs: PlanInputs, sel: ToolSelection, cost: dict[str, int],
          entry: dict[str, int], overhead: int) -> None:
    defined = [t.name for t in sel.defined]
    deferred = [t.name for t in sel.deferred]
    catalog = [t.name for t in inputs.tool_catalog]
    controls = [n for n in defined if n in inputs.control_tools]

    # tool.call is defined exactly when the final index is non-empty
    assert (TOOL_CALL in defined) == bool(deferred), (defined, deferred)
    if deferred:
        assert inputs.agent.enables_tool_call

    # nothing leaves silently: each catalog tool lands in exactly one place
    placed = [*(n for n in defined if n not in controls), *deferred,
              *sel.skipped_tool_names, *sel.filtered_tool_names]
    assert sorted(placed) == sorted(catalog)

    # the caps hold
    assert len(defined) <= TOOL_ITEM_CAP
    assert sel.defined_tokens == sum(cost[n] for n in defined) <= TOOL_TOKEN_CAP
    assert len(deferred) <= INDEX_ITEM_CAP
    assert sel.index_tokens == (overhead + sum(entry[n] for n in deferred) if deferred else 0)
    assert sel.index_tokens <= INDEX_TOKEN_CAP

    # a skipped tool fitted neither what was finally defined nor the final index
    configured = set(inputs.agent.deferred_tools) if inputs.agent.enables_tool_call else set()
    for name in sel.skipped_tool_names:
        if name not in configured:  # a configured deferral never takes a definition
            assert (len(defined) >= TOOL_ITEM_CAP
                    or sel.defined_tokens + cost[name] > TOOL_TOKEN_CAP), name
        if deferred:
            assert (len(deferred) >= INDEX_ITEM_CAP
                    or sel.index_tokens + entry[name] > INDEX_TOKEN_CAP), name


@UNSHRUNK
@given(rosters())
def test_tool_call_iff_a_non_empty_index_and_nothing_leaves_silently(r: Roster) -> None:
    try:
        sel = select_tools(r.inputs, tool_cost=lambda t: r.cost[t.name],
                           index_cost=lambda t: r.entry[t.name], index_overhead=r.overhead)
    except PrefixClassOverCap:
        reject()  # explicitly enabled tools over the token cap fail at plan time (unit-tested)
    event(f"tool.call defined: {any(t.name == TOOL_CALL for t in sel.defined)}")
    fell_back = (r.inputs.agent.enables_tool_call and not sel.deferred
                 and bool(sel.skipped_tool_names))
    event(f"tool.call enabled, index empty, something skipped: {fell_back}")
    check(r.inputs, sel, r.cost, r.entry, r.overhead)


def _select(r: Roster) -> ToolSelection:
    return select_tools(r.inputs, tool_cost=lambda t: r.cost[t.name],
                        index_cost=lambda t: r.entry[t.name], index_overhead=r.overhead)


@st.composite
def grown_rosters(draw: st.DrawFn) -> tuple[Roster, Roster]:
    """A roster, and the same roster with one more discovered tool. Half the rosters first gain
    an enabled tool that fills the token cap to less than tool.call's definition short of it
    (the case where tool.call cannot join the enabled tools)."""
    r = draw(rosters())
    i, cost, entry = r.inputs, dict(r.cost), dict(r.entry)
    catalog, enabled = list(i.tool_catalog), tuple(i.agent.enabled_tools)
    deferred = tuple(i.agent.deferred_tools)
    if draw(st.booleans()):
        fixed = [t for t in catalog if t.name in enabled]
        if draw(st.booleans()):  # nothing else: the new tool alone is what overflows
            catalog, deferred = fixed, ()
        base = select_tools(f.inputs(catalog=tuple(fixed), scopes=(HELD,), enabled=enabled,
                                     skills=i.skill_catalog),
                            tool_cost=lambda t: cost[t.name], index_cost=lambda t: 0)
        room = (TOOL_TOKEN_CAP - base.defined_tokens
                - draw(st.integers(0, cost[TOOL_CALL] - 1)))
        if room > 0 and len(base.defined) < TOOL_ITEM_CAP:
            catalog.append(f.tool("en.fill", scopes=(HELD,)))
            cost["en.fill"], entry["en.fill"] = room, 30
            enabled += ("en.fill",)
    write = draw(st.booleans())
    catalog_grown = [*catalog, f.tool("x.new", side_effect=SideEffect.NETWORK_WRITE if write
                                      else SideEffect.NETWORK_READ, scopes=(HELD,),
                                      server=draw(st.sampled_from(("", "a", "z"))))]
    cost["x.new"] = draw(st.one_of(st.integers(20, 150), st.integers(1_000, 9_500)))
    entry["x.new"] = draw(st.one_of(st.integers(10, 80), st.integers(1_500, 2_500)))
    agent = replace(i.agent, enabled_tools=enabled, deferred_tools=deferred)
    before = Roster(inputs=replace(i, agent=agent, tool_catalog=tuple(catalog)), cost=cost,
                    entry=entry, overhead=r.overhead)
    after = Roster(inputs=replace(before.inputs, tool_catalog=tuple(catalog_grown)), cost=cost,
                   entry=entry, overhead=r.overhead)
    return before, after


@UNSHRUNK
@given(grown_rosters())
def test_adding_a_discovered_tool_never_makes_a_plan_fail(rs: tuple[Roster, Roster]) -> None:
    """Spec: adding an MCP account must not evict an explicitly enabled capability; only the
    agent's own configuration fails at plan time."""
    before, after = rs
    try:
        _select(before)
    except PrefixClassOverCap:
        reject()  # the plan did not open without the discovered tool either
    sel = _select(after)  # never raises
    place = ("defined" if "x.new" in {t.name for t in sel.defined}
             else "deferred" if "x.new" in {t.name for t in sel.deferred} else "skipped")
    event(f"the discovered tool: {place}")
    squeezed = (after.inputs.agent.enables_tool_call and place == "skipped"
                and sel.defined_tokens + after.cost[TOOL_CALL] > TOOL_TOKEN_CAP)
    event(f"tool.call enabled, no room for its definition: {squeezed}")
    check(after.inputs, sel, after.cost, after.entry, after.overhead)


@st.composite
def planned_rosters(draw: st.DrawFn) -> PlanInputs:
    """Fewer, real tools: descriptions whose first sentence fits the index or cannot."""
    n = draw(st.integers(0, 36))
    tools = []
    for i in range(n):
        write = draw(st.booleans())
        name = f"{'w' if write else 'r'}.{i:02d}"
        words = draw(st.one_of(st.integers(1, 30), st.integers(2_050, 2_400)))
        tools.append(f.tool(name, side_effect=SideEffect.NETWORK_WRITE if write
                            else SideEffect.NONE,
                            description=f"Does {name} " + " ".join(["alpha"] * words) + "."))
    names = [t.name for t in tools]
    return f.inputs(catalog=tuple(tools), tool_call=draw(st.booleans()),
                    deferred=tuple(draw(st.lists(st.sampled_from(names), max_size=4)))
                    if names else ())


@settings(SETTINGS, max_examples=40)
@given(planned_rosters())
def test_the_planner_never_pins_tool_call_with_an_empty_index(i: PlanInputs) -> None:
    spec = h.spec_of(i)
    assert (TOOL_CALL in spec.tool_names) == bool(spec.deferred_tool_names)
    assert sorted([*(n for n in spec.tool_names if n not in i.control_tools),
                   *spec.deferred_tool_names,
                   *spec.skipped_tool_names, *spec.filtered_tool_names]) == sorted(
        t.name for t in i.tool_catalog)
