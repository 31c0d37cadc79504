"""Tool selection at plan time (spec: "Authorization changes do not rewrite the prefix" and the
tool paragraphs of "Only history scales with the window", ADR-0105/0123/0124/0130/0134)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from context_engine.domain.envelope import FOLD_8
from context_engine.domain.errors import PrefixClassOverCap, RequiredToolUnavailable
from context_engine.domain.items import index_entry
from context_engine.domain.model import (
    PlanInputs,
    SessionKind,
    SideEffect,
    SkillCatalogEntry,
    ToolSpec,
)
from context_engine.domain.tools import (
    INDEX_ITEM_CAP,
    INDEX_TOKEN_CAP,
    TOOL_ITEM_CAP,
    TOOL_TOKEN_CAP,
    select_tools,
)
from context_engine.domain.trust import TrustLevel

from tests import factories as f
from tests.unit import helpers as h

W = SideEffect.NETWORK_WRITE
SKILLS = (SkillCatalogEntry(name="triage", description="Sorts mail.",
                            trust=TrustLevel.TRUSTED_CONFIGURATION),)


def all_names(spec: object) -> set[str]:
    s = spec
    return (set(s.tool_names) | set(s.deferred_tool_names)  # type: ignore[attr-defined]
            | set(s.skipped_tool_names))  # type: ignore[attr-defined]


def test_caps_are_the_spec_numbers() -> None:
    assert (TOOL_ITEM_CAP, TOOL_TOKEN_CAP, INDEX_ITEM_CAP, INDEX_TOKEN_CAP) == (
        30, 9_000, 40, 2_000)


# ----------------------------------------------------------------------------- filtering

def test_tool_needing_scopes_not_held_is_not_advertised() -> None:
    cat = (f.tool("mail.send", scopes=("mail.send", "mail.read")), f.tool("mail.read",
           scopes=("mail.read",)), f.tool("clock.now"))
    spec = h.spec_of(f.inputs(catalog=cat, scopes=("mail.read",), enabled=("mail.send",),
                              tool_call=True, deferred=("mail.send",)))
    assert spec.tool_names == ("clock.now", "mail.read")
    assert "mail.send" not in all_names(spec)
    assert spec.filtered_tool_names == ("mail.send",)


def test_all_required_scopes_held_advertises() -> None:
    cat = (f.tool("mail.send", scopes=("mail.send", "mail.read")),)
    spec = h.spec_of(f.inputs(catalog=cat, scopes=("mail.read", "mail.send", "other")))
    assert spec.tool_names == ("mail.send",)
    assert spec.filtered_tool_names == ()


def test_model_invisible_tool_is_excluded_even_if_enabled() -> None:
    cat = (f.tool("hidden.op", model_visible=False), f.tool("shown.op"))
    spec = h.spec_of(f.inputs(catalog=cat, enabled=("hidden.op", "shown.op")))
    assert spec.tool_names == ("shown.op",)
    assert "hidden.op" not in all_names(spec)
    assert spec.filtered_tool_names == ("hidden.op",)


def test_session_bound_tools_absent_without_binding() -> None:
    cat = (*h.browser_tools(), f.tool("cal.book", session_binding="calendar"),
           f.tool("clock.now"))
    spec = h.spec_of(f.inputs(catalog=cat, enabled=("browser.navigate", "cal.book")))
    assert spec.tool_names == ("clock.now",)
    assert spec.filtered_tool_names == ("browser.act", "browser.navigate", "browser.observe",
                                        "cal.book")


def test_unknown_binding_is_absent_even_with_a_website() -> None:
    cat = (*h.browser_tools(), f.tool("cal.book", session_binding="calendar"))
    spec = h.spec_of(f.inputs(catalog=cat, website="profile-1"))
    assert "cal.book" not in all_names(spec)
    assert "cal.book" in spec.filtered_tool_names


def test_filtering_does_not_change_the_prefix_when_nothing_was_advertised() -> None:
    base = f.draft(f.inputs(catalog=(f.tool("clock.now"),)))
    more = f.draft(f.inputs(catalog=(f.tool("clock.now"), f.tool("x", model_visible=False),
                                     f.tool("y", scopes=("s",)))))
    assert [t.name for t in more.rendered.tools] == ["clock.now"]
    # filtered names are recorded on the plan, never rendered
    assert more.spec.filtered_tool_names == ("x", "y")
    assert [b.text for b in more.rendered.blocks] == [b.text for b in base.rendered.blocks]


# ----------------------------------------------------------------------------- ranking

def test_defined_set_is_sorted_by_name() -> None:
    cat = (f.tool("zeta"), f.tool("alpha", side_effect=W), f.tool("mid", server="s"))
    d = f.draft(f.inputs(catalog=cat, enabled=("zeta", "mid")))
    assert d.spec.tool_names == ("alpha", "mid", "zeta")
    assert [t.name for t in d.rendered.tools] == ["alpha", "mid", "zeta"]


def test_enabled_tools_first_in_first_occurrence_order_with_dedup() -> None:
    enabled = [f"en.{c}" for c in "qwertyuiopasdfghjklzxcvbnm12345"]  # 31 names, not sorted
    assert len(enabled) == 31
    listed = (*enabled[:5], enabled[0], enabled[3], *enabled[5:])  # duplicates take no slot
    discovered = h.tools("aaa.read", 5)  # reads that sort before every enabled name
    cat = (*discovered, *(f.tool(n) for n in enabled))
    spec = h.spec_of(f.inputs(catalog=cat, enabled=listed))
    assert set(spec.tool_names) == set(enabled[:30])
    # the 31st enabled tool and every discovered one are cut, in rank order
    assert spec.skipped_tool_names == (enabled[30], *h.names(discovered))


def test_enabled_tools_are_not_evicted_by_discovered_tools_that_sort_earlier() -> None:
    enabled = ("web.fetch", "clock.now", "workspace.read")
    cat = (*h.tools("a.mcp.", 40, server="acct"),
           *(f.tool(n, side_effect=W) for n in enabled))
    spec = h.spec_of(f.inputs(catalog=cat, enabled=enabled))
    assert set(enabled) <= set(spec.tool_names)
    assert len(spec.tool_names) == 30
    assert len(spec.skipped_tool_names) == 13


def test_discovered_tools_reads_first_then_server_then_name() -> None:
    enabled = tuple(f"en.{i:02d}" for i in range(30))
    discovered = [
        f.tool("a.write", side_effect=SideEffect.WORKSPACE_WRITE),
        f.tool("z.none", side_effect=SideEffect.NONE, server="s2"),
        f.tool("b.netwrite", side_effect=SideEffect.NETWORK_WRITE, server="s0"),
        f.tool("y.wsread", side_effect=SideEffect.WORKSPACE_READ, server="s1"),
        f.tool("c.ext", side_effect=SideEffect.EXTERNAL_ACTION),
        f.tool("x.netread", side_effect=SideEffect.NETWORK_READ, server="s1"),
        f.tool("w.wswrite", side_effect=SideEffect.WORKSPACE_WRITE, server="s1"),
        f.tool("b.none", side_effect=SideEffect.NONE, server="s2"),
    ]
    cat = (*discovered, *(f.tool(n) for n in enabled))
    expected_rank = ["x.netread", "y.wsread", "b.none", "z.none",  # reads by (server, name)
                     "a.write", "c.ext", "b.netwrite", "w.wswrite"]  # then the rest
    # without tool.call, the cut is recorded in rank order
    spec = h.spec_of(f.inputs(catalog=cat, enabled=enabled))
    assert spec.skipped_tool_names == tuple(expected_rank)
    # with tool.call it takes a slot; the displaced enabled tool leads the overflow
    spec = h.spec_of(f.inputs(catalog=cat, enabled=enabled, tool_call=True))
    assert spec.deferred_tool_names == (enabled[29], *expected_rank)
    assert "tool.call" in spec.tool_names and len(spec.tool_names) == 30
    assert spec.skipped_tool_names == ()


def test_reads_keep_their_definitions_when_the_item_cap_binds() -> None:
    reads = (*h.tools("z.read", 4, side_effect=SideEffect.NONE, server="zz"),
             *h.tools("y.wsread", 3, side_effect=SideEffect.WORKSPACE_READ),
             *h.tools("x.netread", 3, side_effect=SideEffect.NETWORK_READ, server="b"))
    writes = h.tools("a.write", 25, side_effect=W)
    spec = h.spec_of(f.inputs(catalog=(*writes, *reads)))
    assert set(h.names(reads)) <= set(spec.tool_names)
    assert len(spec.tool_names) == 30
    assert spec.skipped_tool_names == tuple(h.names(writes[20:]))


def test_item_cap_thirty_without_tool_call_records_skips() -> None:
    cat = h.tools("t.", 35)
    spec = h.spec_of(f.inputs(catalog=cat))
    assert spec.tool_names == tuple(h.names(cat[:30]))
    assert spec.skipped_tool_names == tuple(h.names(cat[30:]))
    assert spec.deferred_tool_names == ()
    assert all_names(spec) == set(h.names(cat))  # nothing leaves silently


# ----------------------------------------------------------------------------- token cap

def test_discovered_tool_over_the_token_cap_is_skipped() -> None:
    big_enabled = h.sized_tool("en.big", 8_800)
    big_disc = h.sized_tool("a.disc.big", 500)
    small_disc = f.tool("b.disc.small")
    assert h.cost_of(big_enabled) + h.cost_of(small_disc) <= TOOL_TOKEN_CAP
    assert h.cost_of(big_enabled) + h.cost_of(big_disc) > TOOL_TOKEN_CAP
    spec = h.spec_of(f.inputs(catalog=(big_enabled, big_disc, small_disc),
                              enabled=("en.big",)))
    assert spec.tool_names == ("b.disc.small", "en.big")
    assert spec.skipped_tool_names == ("a.disc.big",)
    d = f.draft(f.inputs(catalog=(big_enabled, big_disc, small_disc), enabled=("en.big",)))
    usage = {c.class_name: c for c in d.classes}["tool_definitions"]
    assert usage.tokens <= TOOL_TOKEN_CAP


def test_discovered_over_token_cap_goes_to_index_with_tool_call() -> None:
    big_enabled = h.sized_tool("en.big", 8_700)
    big_disc = h.sized_tool("a.disc.big", 800)
    spec = h.spec_of(f.inputs(catalog=(big_enabled, big_disc), enabled=("en.big",),
                              tool_call=True))
    assert spec.tool_names == ("en.big", "tool.call")
    assert spec.deferred_tool_names == ("a.disc.big",)


def test_explicitly_enabled_over_token_cap_fails_at_plan_time() -> None:
    cat = tuple(h.sized_tool(f"en.{i}", 3_200) for i in range(3))
    with pytest.raises(PrefixClassOverCap) as exc:
        h.spec_of(f.inputs(catalog=cat, enabled=tuple(t.name for t in cat)))
    e = exc.value
    assert e.metadata()["class"] == "tool_definitions"
    assert e.metadata()["cap"] == "9000"
    assert e.unit == "tokens" and e.tokens > 9_000
    assert int(e.metadata()["tokens"]) == e.tokens


def test_explicitly_enabled_over_token_cap_fails_even_if_the_agent_could_defer() -> None:
    cat = tuple(h.sized_tool(f"en.{i}", 3_200) for i in range(3))
    with pytest.raises(PrefixClassOverCap, match="tool_definitions"):
        f.draft(f.inputs(catalog=cat, enabled=tuple(t.name for t in cat), tool_call=True))


def test_enabled_within_the_token_cap_is_accepted() -> None:
    cat = tuple(h.sized_tool(f"en.{i}", 2_900) for i in range(3))
    d = f.draft(f.inputs(catalog=cat, enabled=tuple(t.name for t in cat)))
    assert d.spec.tool_names == ("en.0", "en.1", "en.2")


# ----------------------------------------------------------------------------- website binding

def test_website_session_defines_browser_tools_ahead_of_everything() -> None:
    enabled = tuple(f"en.{i:02d}" for i in range(30))
    cat = (*(f.tool(n) for n in enabled), *h.browser_tools())
    spec = h.spec_of(f.inputs(catalog=cat, enabled=enabled, website="profile-1",
                              tool_call=True, deferred=("browser.act", "browser.observe")))
    assert {"browser.navigate", "browser.observe", "browser.act"} <= set(spec.tool_names)
    assert not {"browser.navigate", "browser.observe", "browser.act"} & set(
        spec.deferred_tool_names)
    assert "tool.call" in spec.tool_names and len(spec.tool_names) == 30
    # what the required tools and tool.call displaced moves to the index in rank order
    assert spec.deferred_tool_names == enabled[26:]


def test_website_session_without_tool_call_records_displaced_as_skipped() -> None:
    enabled = tuple(f"en.{i:02d}" for i in range(30))
    cat = (*(f.tool(n) for n in enabled), *h.browser_tools(side_effect=W))
    spec = h.spec_of(f.inputs(catalog=cat, enabled=enabled, website="profile-1"))
    assert {"browser.navigate", "browser.observe", "browser.act"} <= set(spec.tool_names)
    assert spec.skipped_tool_names == enabled[27:]


@pytest.mark.parametrize("missing", ["browser.navigate", "browser.observe", "browser.act"])
def test_website_session_missing_a_browser_tool_fails(missing: str) -> None:
    cat = tuple(t for t in h.browser_tools() if t.name != missing)
    with pytest.raises(RequiredToolUnavailable) as exc:
        h.spec_of(f.inputs(catalog=cat, website="profile-1"))
    assert exc.value.tool_name == missing
    assert exc.value.metadata()["tool"] == missing


def test_website_session_with_unauthorized_browser_tool_fails() -> None:
    cat = h.browser_tools(scopes=("browser",))
    with pytest.raises(RequiredToolUnavailable) as exc:
        h.spec_of(f.inputs(catalog=cat, website="profile-1"))
    assert "filtered" in exc.value.why


def test_browser_tools_never_deferred_even_when_the_agent_defers_them() -> None:
    cat = (*h.browser_tools(), f.tool("other"))
    spec = h.spec_of(f.inputs(catalog=cat, website="p", tool_call=True,
                              deferred=("browser.navigate", "browser.observe", "browser.act",
                                        "other")))
    assert spec.tool_names == ("browser.act", "browser.navigate", "browser.observe",
                               "tool.call")
    assert spec.deferred_tool_names == ("other",)


# ----------------------------------------------------------------------------- tool.call & index

def test_tool_call_not_defined_when_nothing_is_deferred() -> None:
    spec = h.spec_of(f.inputs(catalog=h.tools("t.", 5), tool_call=True))
    assert "tool.call" not in spec.tool_names
    assert spec.deferred_tool_names == ()


def test_tool_call_defined_when_configured_deferrals_exist() -> None:
    cat = h.tools("t.", 5)
    spec = h.spec_of(f.inputs(catalog=cat, tool_call=True, deferred=("t.03", "t.01")))
    assert spec.tool_names == ("t.00", "t.02", "t.04", "tool.call")
    assert spec.deferred_tool_names == ("t.03", "t.01")  # configured order


def test_configured_deferrals_precede_overflow_in_the_index() -> None:
    cat = h.tools("t.", 40)
    spec = h.spec_of(f.inputs(catalog=cat, tool_call=True, deferred=("t.39", "t.00", "t.39")))
    assert len(spec.tool_names) == 30 and "tool.call" in spec.tool_names
    assert spec.tool_names[:29] == tuple(f"t.{i:02d}" for i in range(1, 30))
    assert spec.deferred_tool_names == ("t.39", "t.00", *(f"t.{i:02d}" for i in range(30, 39)))


def _tool_call_only(i: PlanInputs) -> PlanInputs:
    """The inputs with tool.call as the only control tool: the slot arithmetic below is the
    issue's (other control tools would take slots of their own)."""
    return replace(i, control_tools={"tool.call": f.CONTROL_TOOLS["tool.call"]})


def _unindexable(name: str) -> ToolSpec:
    """A write tool whose index entry alone is over the index cap (its first sentence runs
    past 2,000 tokens), and whose definition costs ~2,100 tokens."""
    return f.tool(name, side_effect=W, description=f"Writes {name} "
                  + " ".join(["alpha"] * 2_100) + ". More.")


def test_tool_call_is_not_advertised_with_an_empty_index_its_slot_goes_to_a_real_tool() -> None:
    """The issue's repro: 29 small reads, 2 large writes, tool.call enabled. With tool.call in
    slot 30 both writes overflow, and neither entry fits the index: tool.call would be
    advertised with nothing to call while w0 fits the definitions without it."""
    reads = h.tools("r.", 29)
    w0, w1 = _unindexable("w0"), _unindexable("w1")
    est = f.estimator(f.model())
    assert sum(h.cost_of(t) for t in (*reads, w0)) <= TOOL_TOKEN_CAP
    assert est.text(index_entry(w0)) > INDEX_TOKEN_CAP  # fits no index
    d = f.draft(_tool_call_only(f.inputs(catalog=(*reads, w0, w1), tool_call=True)))
    assert "tool.call" not in d.spec.tool_names
    assert d.spec.tool_names == (*h.names(reads), "w0")
    assert d.spec.deferred_tool_names == ()
    assert d.spec.skipped_tool_names == ("w1",)
    assert [t.name for t in d.rendered.tools] == [*h.names(reads), "w0"]
    assert not any(b.row == 6 for b in d.rendered.blocks)  # no index block either
    # the same selection as an agent without tool.call
    assert d.spec.tools == h.spec_of(_tool_call_only(f.inputs(catalog=(*reads, w0, w1)))).tools


def test_tool_call_stays_when_one_entry_fits_the_index() -> None:
    reads = h.tools("r.", 29)
    w0, small = _unindexable("w0"), f.tool("w1", side_effect=W)
    spec = h.spec_of(_tool_call_only(f.inputs(catalog=(*reads, w0, small), tool_call=True)))
    assert spec.tool_names == (*h.names(reads), "tool.call")
    assert spec.deferred_tool_names == ("w1",)
    assert spec.skipped_tool_names == ("w0",)


def test_a_configured_deferral_that_fits_no_index_is_skipped_not_defined() -> None:
    """Without an index tool.call goes, and the agent's configured deferral keeps no
    definition (its configuration says so): it is recorded as skipped."""
    cat = (*h.tools("t.", 3), _unindexable("w0"))
    spec = h.spec_of(_tool_call_only(f.inputs(catalog=cat, tool_call=True, deferred=("w0",))))
    assert spec.tool_names == ("t.00", "t.01", "t.02")
    assert spec.deferred_tool_names == ()
    assert spec.skipped_tool_names == ("w0",)


def test_an_index_trimmed_to_nothing_when_rendered_drops_tool_call() -> None:
    """Admission sums per-entry estimates; the rendered block is what the class measures. If
    trimming it to the cap leaves no entry, tool.call is not advertised either."""
    cat = h.tools("t.", 31)
    i = _tool_call_only(f.inputs(catalog=cat, tool_call=True))

    def measure(entries: tuple[ToolSpec, ...]) -> int:
        return INDEX_TOKEN_CAP + 1  # every rendered index is over the cap

    kept = select_tools(i, tool_cost=lambda t: 10, index_cost=lambda t: 10)
    assert "tool.call" in {t.name for t in kept.defined} and len(kept.deferred) == 2
    sel = select_tools(i, tool_cost=lambda t: 10, index_cost=lambda t: 10,
                       index_measure=measure)
    assert [t.name for t in sel.defined] == h.names(cat[:30])
    assert sel.deferred == () and sel.index_tokens == 0
    assert sel.skipped_tool_names == ("t.30",)


def test_deferred_but_explicitly_enabled_tool_is_still_deferred() -> None:
    cat = h.tools("t.", 3)
    spec = h.spec_of(f.inputs(catalog=cat, enabled=("t.01", "t.02"), tool_call=True,
                              deferred=("t.01",)))
    assert spec.deferred_tool_names == ("t.01",)
    assert spec.tool_names == ("t.00", "t.02", "tool.call")


def test_agent_without_tool_call_defers_nothing() -> None:
    cat = h.tools("t.", 3)
    spec = h.spec_of(f.inputs(catalog=cat, deferred=("t.01",)))
    assert spec.deferred_tool_names == ()
    assert spec.tool_names == ("t.00", "t.01", "t.02")
    assert "tool.call" not in spec.tool_names


def test_agent_without_tool_call_records_overflow_as_skipped() -> None:
    cat = h.tools("t.", 33)
    spec = h.spec_of(f.inputs(catalog=cat, deferred=("t.00",)))
    assert spec.deferred_tool_names == ()
    assert spec.skipped_tool_names == ("t.30", "t.31", "t.32")
    assert all_names(spec) == set(h.names(cat))


def _enabled_short_of_the_cap_by_less_than_tool_call() -> tuple[ToolSpec, ...]:
    """Explicitly enabled tools that fit the token cap on their own, with less room left than
    tool.call's definition costs (8,939 of 9,000, tool.call 123)."""
    call = h.cost_of(f.CONTROL_TOOLS["tool.call"])
    head = tuple(h.sized_tool(f"web.t{i}", 1_000) for i in range(4))
    last = h.sized_tool("web.zz", TOOL_TOKEN_CAP - call // 2 - sum(map(h.cost_of, head)))
    enabled = (*head, last)
    used = sum(map(h.cost_of, enabled))
    assert used <= TOOL_TOKEN_CAP < used + call
    return enabled


MCP = f.tool("mcp.acct.list_calls", server="acct", side_effect=SideEffect.NETWORK_READ)


def test_a_discovered_tool_that_fits_nowhere_never_fails_a_plan_that_opens() -> None:
    """Spec: adding an MCP account must not evict an explicitly enabled capability. One
    discovered tool too large for the room left would bring tool.call in, and tool.call's
    definition would take the enabled tools past the cap: the selection without tool.call
    stands and the discovered tool is skipped, as the plan without it opened."""
    enabled = _enabled_short_of_the_cap_by_less_than_tool_call()
    names = tuple(h.names(enabled))
    alone = f.draft(f.inputs(catalog=enabled, enabled=names, tool_call=True))
    assert alone.spec.tool_names == names
    d = f.draft(f.inputs(catalog=(*enabled, MCP), enabled=names, tool_call=True))
    assert d.spec.tool_names == names  # tool.call is not defined
    assert d.spec.deferred_tool_names == ()
    assert d.spec.skipped_tool_names == ("mcp.acct.list_calls",)
    usage = {c.class_name: c for c in d.classes}["tool_definitions"]
    assert usage.tokens <= TOOL_TOKEN_CAP
    # the same selection as an agent without tool.call
    assert d.spec.tools == h.spec_of(f.inputs(catalog=(*enabled, MCP), enabled=names)).tools


def test_configured_deferrals_still_fail_when_tool_call_does_not_fit_beside_enabled() -> None:
    """The agent's own configuration needs tool.call: with it the enabled tools exceed the
    cap, and the plan fails at plan time, discovered tool or not."""
    enabled = _enabled_short_of_the_cap_by_less_than_tool_call()
    names = tuple(h.names(enabled))
    for catalog in ((*enabled, MCP), (*enabled, MCP, f.tool("x.small"))):
        with pytest.raises(PrefixClassOverCap, match="tool_definitions"):
            h.spec_of(f.inputs(catalog=catalog, enabled=names, tool_call=True,
                               deferred=("mcp.acct.list_calls",)))


def test_index_capped_at_forty_entries_rest_skipped() -> None:
    cat = h.tools("t.", 75)
    d = f.draft(f.inputs(catalog=cat, tool_call=True))
    assert len(d.spec.tool_names) == 30
    assert d.spec.deferred_tool_names == tuple(h.names(cat[29:69]))
    assert d.spec.skipped_tool_names == tuple(h.names(cat[69:]))
    assert all_names(d.spec) == set(h.names(cat)) | {"tool.call"}
    usage = {c.class_name: c for c in d.classes}["deferred_tool_index"]
    assert usage.items == 40


def test_index_capped_at_two_thousand_tokens_rest_skipped() -> None:
    long = " ".join(["wordy"] * 140) + "."
    cat = tuple(f.tool(f"t.{i:02d}", description=long) for i in range(25))
    spec = h.spec_of(f.inputs(catalog=cat, tool_call=True, deferred=tuple(h.names(cat))))
    assert 0 < len(spec.deferred_tool_names) < 25
    assert spec.deferred_tool_names == tuple(h.names(cat[:len(spec.deferred_tool_names)]))
    assert spec.skipped_tool_names == tuple(h.names(cat[len(spec.deferred_tool_names):]))
    est = f.estimator(f.model())
    total = sum(est.text("- " + index_entry(t)) for t in spec.deferred)
    assert total <= INDEX_TOKEN_CAP
    assert total + est.text("- " + index_entry(cat[len(spec.deferred)])) > INDEX_TOKEN_CAP


def test_index_of_server_tools_is_capped_not_failed() -> None:
    cat = tuple(f.tool(f"mcp.srv.t{i:02d}", server="srv", side_effect=W) for i in range(45))
    d = f.draft(f.inputs(catalog=cat, tool_call=True, deferred=tuple(h.names(cat))))
    usage = {c.class_name: c for c in d.classes}["deferred_tool_index"]
    assert usage.tokens <= INDEX_TOKEN_CAP
    assert all_names(d.spec) == set(h.names(cat)) | {"tool.call"}


def test_index_of_builtin_tools_filled_to_the_cap_is_not_failed_by_its_header() -> None:
    est = f.estimator(f.model())
    for n in (100, 130, 160, 190):
        long = " ".join(["wordy"] * n) + "."
        cat = tuple(f.tool(f"t.{i:02d}", description=long) for i in range(40))
        d = f.draft(f.inputs(catalog=cat, tool_call=True, deferred=tuple(h.names(cat))))
        usage = {c.class_name: c for c in d.classes}["deferred_tool_index"]
        assert usage.tokens <= INDEX_TOKEN_CAP
        assert d.spec.skipped_tool_names, "the roster overflows the index"
        assert set(d.spec.deferred_tool_names) | set(d.spec.skipped_tool_names) == set(
            h.names(cat))
        # the index is full: the first skipped entry would not have fitted
        header_and_entries = usage.tokens + est.text("- " + index_entry(
            next(t for t in cat if t.name == d.spec.skipped_tool_names[0])))
        assert header_and_entries > INDEX_TOKEN_CAP - 2


def test_configured_deferrals_never_vanish_silently() -> None:
    cat = h.tools("t.", 3)
    i = replace(f.inputs(catalog=cat, tool_call=True, deferred=("t.01",)), control_tools={})
    spec = h.spec_of(i)
    assert all_names(spec) == {"t.00", "t.01", "t.02"}


def test_nothing_leaves_the_roster_silently() -> None:
    reads = h.tools("r.", 20)
    writes = h.tools("w.", 60, side_effect=W, server="srv")
    hidden = (f.tool("h.1", model_visible=False), f.tool("h.2", scopes=("nope",)))
    cat = (*reads, *writes, *hidden)
    spec = h.spec_of(f.inputs(catalog=cat, tool_call=True, deferred=("r.03",),
                              enabled=("w.59",)))
    advertised = [*spec.tool_names, *spec.deferred_tool_names]
    assert len(advertised) == len(set(advertised))
    assert not set(advertised) & set(spec.skipped_tool_names)
    assert all_names(spec) | set(spec.filtered_tool_names) == set(h.names(cat)) | {"tool.call"}


# ----------------------------------------------------------------------------- control tools

def test_skill_load_only_with_a_non_empty_skill_catalog() -> None:
    without = h.spec_of(f.inputs(catalog=(f.tool("x"),)))
    assert "skill.load" not in without.tool_names
    with_skills = h.spec_of(f.inputs(catalog=(f.tool("x"),), skills=SKILLS))
    assert with_skills.tool_names == ("skill.load", "x")
    assert with_skills.tools[0] == f.CONTROL_TOOLS["skill.load"]


def test_skill_load_takes_a_slot_ahead_of_enabled_tools() -> None:
    enabled = tuple(f"en.{i:02d}" for i in range(30))
    spec = h.spec_of(f.inputs(catalog=tuple(f.tool(n) for n in enabled), enabled=enabled,
                              skills=SKILLS))
    assert "skill.load" in spec.tool_names and len(spec.tool_names) == 30
    assert spec.skipped_tool_names == ("en.29",)


def test_email_session_pins_no_tools() -> None:
    cat = (*h.tools("t.", 5), f.tool("mail.send"))
    d = f.draft(f.inputs(catalog=cat, enabled=("mail.send",), tool_call=True,
                         deferred=("t.00",), kind=SessionKind.EMAIL, skills=SKILLS))
    assert d.spec.tools == () and d.spec.deferred == ()
    assert d.rendered.tools == ()
    assert not any(b.row == 6 for b in d.rendered.blocks)
    assert d.spec.skipped_tool_names == ()


# ----------------------------------------------------------------------------- index entries

def test_index_entry_format() -> None:
    schema = {"type": "object",
              "properties": {"query": {"type": "string"}, "limit": {"type": "integer"},
                             "after": {"type": "string"}, "cursor": {"type": "string"},
                             "zone": {"type": "string"}},
              "required": ["zone", "query"]}
    t = f.tool("mcp.srv.search", schema=schema, server="srv",
               description="Searches the  index\nfor documents. Returns at most 20. Slow!")
    assert index_entry(t) == ("mcp.srv.search(zone, query, after?, cursor?, limit?): "
                              "Searches the index for documents.")


def test_index_entry_ignores_property_key_order() -> None:
    props_a: dict[str, object] = {"b": {}, "a": {}, "c": {}, "d": {}}
    props_b: dict[str, object] = {"d": {}, "c": {}, "a": {}, "b": {}}
    a = f.tool("x", schema={"type": "object", "properties": props_a, "required": ["c", "a"]})
    b = f.tool("x", schema={"type": "object", "properties": props_b, "required": ["c", "a"]})
    assert index_entry(a) == index_entry(b) == "x(c, a, b?, d?): Does x."


@pytest.mark.parametrize(("description", "sentence"), [
    ("One sentence only", "One sentence only"),
    ("Ends here! Then more.", "Ends here!"),
    ("Really? Yes.", "Really?"),
    ("Version 1.5 is used. Next.", "Version 1.5 is used."),
])
def test_index_entry_uses_the_first_sentence(description: str, sentence: str) -> None:
    t = f.tool("x", schema={"type": "object"}, description=description)
    assert index_entry(t) == f"x(): {sentence}"


@pytest.mark.parametrize(("description", "sentence", "before_builder9"), [
    ("Search the web, e.g. news sites. Returns links.", "Search the web, e.g. news sites.",
     "Search the web, e.g."),
    ("Calls Dr. Smith's API. More.", "Calls Dr. Smith's API.", "Calls Dr."),
    ("Lists files in the workspace (i.e. the repo). Paginated.",
     "Lists files in the workspace (i.e. the repo).", "Lists files in the workspace (i.e."),
    ("Reads files, logs etc. Then stops.", "Reads files, logs etc. Then stops.",
     "Reads files, logs etc."),  # "etc." may end a sentence too: kept whole, never cut short
    ("Asks J. Doe. Done.", "Asks J. Doe.", "Asks J."),
    ("Ranks Alpha vs. Beta. Done.", "Ranks Alpha vs. Beta.", "Ranks Alpha vs."),
    ("Grows to size N. Then stops.", "Grows to size N. Then stops.", "Grows to size N."),
    ("Sorts (asc. or desc.) rows. Done.", "Sorts (asc. or desc.) rows.", "Sorts (asc."),
    ("Finds it [see docs. Then retry.] now. Done.", "Finds it [see docs. Then retry.] now.",
     "Finds it [see docs."),
    ("Is it up? checks the host. Done.", "Is it up?", "Is it up?"),
    # lower case is no sign of a sentence going on: MCP servers often write descriptions so
    ("list the files of a directory. returns names and sizes.",
     "list the files of a directory.", "list the files of a directory."),
    ("Sort by date. then by name.", "Sort by date.", "Sort by date."),
    ("Fetch a web page. e.g. for docs. Returns text.", "Fetch a web page.", "Fetch a web page."),
    ("Does x. More detail here.", "Does x.", "Does x."),
    ("Opens (never closed. Then more.", "Opens (never closed.", "Opens (never closed."),
    ("Version 1.5 is used. Next.", "Version 1.5 is used.", "Version 1.5 is used."),
])
def test_index_entry_ends_its_sentence_where_a_sentence_ends(description: str, sentence: str,
                                                             before_builder9: str) -> None:
    """Not after an abbreviation or an initial, nor inside brackets the text closes later,
    whatever the case of the next word; a plan builder@8 pinned keeps its cut
    (``FOLD_8``)."""
    t = f.tool("x", schema={"type": "object"}, description=description)
    assert index_entry(t) == f"x(): {sentence}"
    assert index_entry(t, FOLD_8) == f"x(): {before_builder9}"


def test_index_entry_is_rendered_in_the_prefix() -> None:
    schema = {"type": "object", "properties": {"b": {}, "a": {}}, "required": ["b"]}
    t = f.tool("lookup", schema=schema, description="Looks up. More.")
    d = f.draft(f.inputs(catalog=(t,), tool_call=True, deferred=("lookup",)))
    block = next(b for b in d.rendered.blocks if b.row == 6)
    assert "- lookup(b, a?): Looks up." in block.text.splitlines()


def test_deferred_spec_is_part_of_prefix_identity() -> None:
    t1 = f.tool("lookup", description="Looks up. More.")
    t2 = replace(t1, side_effect=W)  # not rendered in the entry, but pinned
    a = f.draft(f.inputs(catalog=(t1,), tool_call=True, deferred=("lookup",)))
    b = f.draft(f.inputs(catalog=(t2,), tool_call=True, deferred=("lookup",)))
    assert [x.text for x in a.rendered.blocks] == [x.text for x in b.rendered.blocks]
    assert a.rendered.prefix_sha256 != b.rendered.prefix_sha256


def test_tool_definitions_render_canonical_schema() -> None:
    schema = {"type": "object", "required": ["q"], "properties": {"q": {"type": "string"}}}
    d = f.draft(f.inputs(catalog=(f.tool("x", schema=schema),)))
    (td,) = d.rendered.tools
    assert td.input_schema_json == ('{"properties":{"q":{"type":"string"}},'
                                    '"required":["q"],"type":"object"}')
    assert td.description == "Does x. More detail here."


def test_tool_spec_fields_beyond_the_model_contract_still_change_the_hash() -> None:
    a = f.draft(f.inputs(catalog=(f.tool("x"),)))
    b = f.draft(f.inputs(catalog=(f.tool("x", side_effect=W),)))
    assert a.rendered.tools == b.rendered.tools
    assert a.rendered.prefix_sha256 != b.rendered.prefix_sha256


def _scoped(scopes: tuple[str, ...]) -> ToolSpec:
    return ToolSpec(name="s", description="S.", input_schema=f.SCHEMA, required_scopes=scopes)


def test_selection_is_independent_of_scope_order() -> None:
    a = h.spec_of(f.inputs(catalog=(_scoped(("b", "a")),), scopes=("a", "b")))
    b = h.spec_of(f.inputs(catalog=(_scoped(("a", "b")),), scopes=("b", "a")))
    assert a.canonical_json() == b.canonical_json()
