"""Region A: rendering, byte stability, the persona row and the class caps (spec: "Two regions
and one rule", "The persona row", "Authorization changes do not rewrite the prefix",
"Only history scales with the window")."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from context_engine.domain.canonical import session_key
from context_engine.domain.errors import PinnedVersionConflict, PrefixClassOverCap
from context_engine.domain.items import (
    AgentInstructions,
    PersonaRow,
    RenderContext,
    ToolDefinitions,
    assemble,
)
from context_engine.domain.model import (
    MemoryItem,
    MemorySnapshot,
    Persona,
    PersonaEntry,
    SkillCatalogEntry,
    ToolSpec,
)
from context_engine.domain.plan import (
    PREFIX_CEILING,
    PlanSpec,
    PrefixClass,
    is_older,
    measure_prefix,
    prefix_items,
    redraft,
    render_prefix,
    rotation_reason,
    tool_cost,
)
from context_engine.domain.trust import Region, TrustLevel

from tests import factories as f
from tests.unit import helpers as h

CONF = TrustLevel.TRUSTED_CONFIGURATION


def persona(n: int = 2, text: str = "short", revision: str = "r1") -> Persona:
    return Persona(revision=revision,
                   entries=tuple(PersonaEntry(key=f"k{i}", text=text) for i in range(n)))


def skills(n: int, description: str = "Helps.",
           trust: TrustLevel = CONF) -> tuple[SkillCatalogEntry, ...]:
    return tuple(SkillCatalogEntry(name=f"skill-{i}", description=description, trust=trust)
                 for i in range(n))


def snapshot(n: int, text: str = "likes tea") -> MemorySnapshot:
    return MemorySnapshot(snapshot_id="snap-1", watermark=3,
                          items=tuple(MemoryItem(id=f"m{i}", text=text) for i in range(n)))


def words(n: int) -> str:
    return " ".join(f"word{i}" for i in range(n))


def rows(d: object) -> list[int]:
    return [b.row for b in d.rendered.blocks]  # type: ignore[attr-defined]


# ----------------------------------------------------------------------------- rendering

def test_minimal_prefix_is_the_three_instruction_rows() -> None:
    d = f.draft(f.inputs())
    assert rows(d) == [1, 2, 3]
    assert [b.trust for b in d.rendered.blocks] == [
        TrustLevel.PLATFORM, TrustLevel.PLATFORM, CONF]
    assert d.rendered.blocks[0].text == f.ASSETS.policy
    assert d.rendered.blocks[1].text == f.ASSETS.framing
    assert d.rendered.blocks[2].text == "You are a careful assistant."
    assert d.rendered.tools == ()


@pytest.mark.parametrize("empty", [
    {"persona": Persona()},
    {"persona": Persona(revision="rev-7")},
    {"skills": ()},
    {"snapshot": MemorySnapshot()},
    {"snapshot": MemorySnapshot(snapshot_id="snap-9", recall_trace_id="t", watermark=5)},
    # tool.call enabled but nothing deferred: no index, and no tool.call definition
    {"tool_call": True},
])
def test_empty_optional_rows_render_no_bytes(empty: dict[str, object]) -> None:
    base = f.draft(f.inputs())
    d = f.draft(f.inputs(**empty))  # type: ignore[arg-type]
    assert rows(d) == [1, 2, 3]
    assert not any(b.row in (4, 6, 7, 8) for b in d.rendered.blocks)
    assert d.rendered.blocks == base.rendered.blocks
    assert d.rendered.prefix_sha256 == base.rendered.prefix_sha256


def test_empty_persona_leaves_prefix_hash_byte_identical() -> None:
    without = f.plan(f.inputs())
    with_empty = f.plan(f.inputs(persona=Persona(revision="persona-rev-3")))
    assert with_empty.prefix_sha256 == without.prefix_sha256
    assert with_empty.prefix_tokens == without.prefix_tokens
    usage = {c.class_name: c for c in with_empty.classes}
    assert usage["persona"].tokens == 0 and usage["persona"].items == 0


def test_empty_rows_render_empty_strings() -> None:
    ctx = RenderContext(session_key=session_key("t", "s"))
    spec = h.spec_of(f.inputs())
    rendered = {type(i).row: i.render(ctx) for i in prefix_items(spec)}  # type: ignore[attr-defined]
    assert rendered[4] == rendered[6] == rendered[7] == rendered[8] == ""
    assert rendered[5] == ""  # definitions travel as tools, never as text


def test_persona_renders_at_row_four_between_instructions_and_tools() -> None:
    cat = (f.tool("a.read"), f.tool("mcp.srv.x", server="srv"))
    d = f.draft(f.inputs(persona=persona(2), catalog=cat, tool_call=True,
                         deferred=("mcp.srv.x",), skills=skills(1), snapshot=snapshot(1)))
    assert rows(d) == [1, 2, 3, 4, 6, 7, 8]
    block = d.rendered.blocks[3]
    assert block.row == 4 and block.trust is CONF
    assert block.text == "Persona:\n- k0: short\n- k1: short"
    # trusted configuration: not enveloped
    assert "<user" not in block.text and "<untrusted" not in block.text
    # in assembly order the persona item sits between the instructions and the definitions
    ordered = [type(i) for i in assemble(prefix_items(d.spec), Region.A)]
    assert ordered.index(PersonaRow) == ordered.index(AgentInstructions) + 1
    assert ordered.index(ToolDefinitions) == ordered.index(PersonaRow) + 1
    assert [t.name for t in d.rendered.tools] == ["a.read", "skill.load", "tool.call"]


def test_non_empty_persona_changes_the_prefix() -> None:
    assert f.draft(f.inputs(persona=persona(1))).rendered.prefix_sha256 != \
        f.draft(f.inputs()).rendered.prefix_sha256


def test_changing_instructions_changes_prefix_hash() -> None:
    a = f.draft(f.inputs(instructions="Be brief."))
    b = f.draft(f.inputs(instructions="Be brief!"))
    assert a.rendered.prefix_sha256 != b.rendered.prefix_sha256
    assert a.rendered.blocks[:2] == b.rendered.blocks[:2]


def test_prefix_is_deterministic_and_session_keyed() -> None:
    i = f.inputs(snapshot=snapshot(2))
    assert f.draft(i).rendered == f.draft(i).rendered
    spec = f.draft(i).spec
    assert render_prefix(spec, "k1") == render_prefix(spec, "k1")
    # the memory envelope's nonce is derived from the session key
    assert render_prefix(spec, "k1").prefix_sha256 != render_prefix(spec, "k2").prefix_sha256


def test_memory_snapshot_row_is_enveloped_as_memory() -> None:
    d = f.draft(f.inputs(snapshot=snapshot(2)))
    block = d.rendered.blocks[-1]
    assert block.row == 8 and block.trust is TrustLevel.MEMORY
    env = h.only_envelope(block.text)
    assert (env.tag, env.source, env.item_id) == ("memory", "memory:snapshot", "snap-1")
    assert env.body == "\n- [m0] likes tea\n- [m1] likes tea\n"


def test_skill_catalog_entries_carry_their_own_trust() -> None:
    entries = (SkillCatalogEntry(name="ours", description="Built in.", trust=CONF),
               SkillCatalogEntry(name="theirs", description="Installed.",
                                 trust=TrustLevel.EXTERNAL_UNTRUSTED))
    d = f.draft(f.inputs(skills=entries))
    block = next(b for b in d.rendered.blocks if b.row == 7)
    assert block.trust is TrustLevel.EXTERNAL_UNTRUSTED  # the lowest entry's trust
    assert "- ours: Built in." in block.text.splitlines()
    env = h.only_envelope(block.text)
    assert (env.tag, env.item_id) == ("untrusted", "theirs")
    assert env.body == "\ntheirs: Installed.\n"


def test_deferred_index_builtin_entries_are_trusted_and_server_entries_untrusted() -> None:
    cat = (f.tool("clock.now", description="Tells the time. Always UTC."),
           f.tool("mcp.srv.search", server="srv", description="Searches. Slowly."))
    d = f.draft(f.inputs(catalog=cat, tool_call=True, deferred=("clock.now", "mcp.srv.search")))
    block = next(b for b in d.rendered.blocks if b.row == 6)
    assert block.trust is TrustLevel.EXTERNAL_UNTRUSTED
    lines = block.text.splitlines()
    assert "- clock.now(q): Tells the time." in lines
    env = h.only_envelope(block.text)
    assert (env.tag, env.source, env.item_id) == ("untrusted", "tool-index:srv",
                                                  "mcp.srv.search")
    assert env.body == "\nmcp.srv.search(q): Searches.\n"


def test_only_builtin_index_entries_give_a_trusted_block() -> None:
    d = f.draft(f.inputs(catalog=(f.tool("clock.now"),), tool_call=True,
                         deferred=("clock.now",)))
    block = next(b for b in d.rendered.blocks if b.row == 6)
    assert block.trust is CONF
    assert h.parse_envelopes(block.text) == []


# ----------------------------------------------------------------------------- scopes & hashes

def _scoped(order: tuple[str, ...], name: str = "mail.send") -> ToolSpec:
    # Built directly, bypassing the factory's sorting, to mimic a set in hash-seed order.
    return ToolSpec(name=name, description="Sends mail. Carefully.", input_schema=f.SCHEMA,
                    required_scopes=order)


def test_required_scopes_serialize_sorted() -> None:
    assert _scoped(("mail.write", "mail.admin", "mail.read")).canonical()["required_scopes"] \
        == ["mail.admin", "mail.read", "mail.write"]


@pytest.mark.parametrize("deferred", [False, True])
def test_scope_order_does_not_change_the_prefix_hash(deferred: bool) -> None:
    scopes = ("mail.read", "mail.admin", "mail.write")
    kw = {"tool_call": True, "deferred": ("mail.send",)} if deferred else {}
    prefix_hashes, schema_hashes = set(), set()
    for order in (scopes, tuple(reversed(scopes)), tuple(sorted(scopes))):
        d = f.draft(f.inputs(catalog=(_scoped(order),), scopes=scopes, **kw))  # type: ignore[arg-type]
        assert (d.spec.deferred_tool_names if deferred else d.spec.tool_names) == ("mail.send",)
        prefix_hashes.add(d.rendered.prefix_sha256)
        schema_hashes.add(d.rendered.tool_schema_sha256)
    assert len(prefix_hashes) == 1
    assert len(schema_hashes) == 1


def test_scopes_are_part_of_prefix_identity() -> None:
    a = f.draft(f.inputs(catalog=(_scoped(("x",)),), scopes=("x", "y")))
    b = f.draft(f.inputs(catalog=(_scoped(("x", "y")),), scopes=("x", "y")))
    assert a.rendered.tools == b.rendered.tools
    assert a.rendered.prefix_sha256 != b.rendered.prefix_sha256


def test_pinned_spec_round_trips_to_the_same_prefix() -> None:
    i = f.inputs(catalog=(_scoped(("b", "a")), f.tool("x.read")), scopes=("a", "b"),
                 persona=persona(2), skills=skills(2), snapshot=snapshot(2))
    d = f.draft(i)
    doc = json.loads(d.spec.canonical_json())
    again = PlanSpec.from_canonical(doc)
    key = session_key(i.tenant_id, i.session_id)
    assert render_prefix(again, key).prefix_sha256 == d.rendered.prefix_sha256


def test_authority_scope_hashes_are_sorted_and_outside_the_prompt() -> None:
    a = f.draft(f.inputs(scopes=("z", "a", "m")))
    b = f.draft(f.inputs(scopes=("m", "z", "a", "a")))
    assert a.spec.authority_scope_hashes == b.spec.authority_scope_hashes
    assert list(a.spec.authority_scope_hashes) == sorted(a.spec.authority_scope_hashes)
    assert a.rendered.prefix_sha256 == f.draft(f.inputs()).rendered.prefix_sha256


def test_scope_revocation_does_not_rotate_the_epoch() -> None:
    cat = (f.tool("mail.send", scopes=("mail",)), f.tool("x.read"))
    current = f.draft(f.inputs(catalog=cat, scopes=("mail",))).spec
    revoked = f.draft(f.inputs(catalog=cat, scopes=())).spec
    assert "mail.send" in current.tool_names and "mail.send" not in revoked.tool_names
    assert rotation_reason(current, revoked) is None


def test_instruction_change_under_a_new_version_rotates() -> None:
    current = f.draft(f.inputs()).spec
    new = f.draft(f.inputs(instructions="Different.", agent_version="2")).spec
    assert rotation_reason(current, new) == "agent_version_changed"
    persona_edit = f.draft(f.inputs(persona=persona(1, revision="r2"))).spec
    assert rotation_reason(current, persona_edit) == "persona_changed"


@pytest.mark.parametrize(("older", "newer"), [
    ("platform-policy@2026-11-30.9", "platform-policy@2026-12-01.2"),
    ("platform-policy@2026-12-01.2", "platform-policy@2026-12-01.10"),
    ("platform-policy@2026-12-01.2", "platform-policy@2026-12-01.2-next"),
    ("context-engine-builder@2", "context-engine-builder@10"),
    ("context-engine-builder@9", "context-engine-builder@10"),
    ("p@1.0", "p@1.0.1"),
    ("p@beta", "p@beta2"),
    ("p@1a", "p@2"),
    ("p@1.0", "p@1.00"),  # alike as numbers: then by the text, never unordered
    ("p@01", "p@1"),
])
def test_revisions_of_one_name_are_ordered(older: str, newer: str) -> None:
    assert is_older(older, newer) and not is_older(newer, older)
    assert not is_older(older, older) and not is_older(newer, newer)


def test_versions_of_different_names_are_not_ordered() -> None:
    for a, b in (("acme-policy@1", "platform-policy@2"), ("x@1", "y@1"), ("2", "p@1"),
                 ("policy-2", "p@1"), ("policy-2", "policy-10"),
                 ("acme-policy", "tenant-policy"),  # no @: a name without a revision
                 ("p", "p@1")):
        assert not is_older(a, b) and not is_older(b, a)


def test_policy_and_builder_rotate_forward_only() -> None:
    """A replica of the previous release (older policy or builder than the pinned plan) keeps
    the plan a newer replica pinned: a rolling deploy rotates a session once, not back and
    forth. Versions of another name rotate both ways (not ordered)."""
    def spec(version: str, builder: str, policy: str = "Policy.") -> PlanSpec:
        base = f.draft(f.inputs()).spec
        return replace(base, assets=replace(base.assets, version=version, policy=policy),
                       builder_version=builder)

    old = spec("platform-policy@2026-12-01.2", "context-engine-builder@2")
    new_policy = spec("platform-policy@2026-12-01.10", "context-engine-builder@2", "New.")
    new_builder = spec("platform-policy@2026-12-01.2", "context-engine-builder@3")
    assert rotation_reason(old, new_policy) == "policy_changed"
    assert rotation_reason(new_policy, old) is None
    assert rotation_reason(old, new_builder) == "builder_changed"
    assert rotation_reason(new_builder, old) is None
    # newer policy pinned, newer builder here: the builder still rotates it forward
    both = spec("platform-policy@2026-12-01.10", "context-engine-builder@3", "New.")
    assert rotation_reason(new_policy, replace(old, builder_version="context-engine-builder@3")
                           ) == "builder_changed"
    assert rotation_reason(both, old) is None
    own = spec("acme-policy@1", "context-engine-builder@2", "Ours.")
    assert rotation_reason(old, own) == rotation_reason(own, old) == "policy_changed"
    # the same version with other content is still a conflict
    with pytest.raises(PinnedVersionConflict):
        rotation_reason(old, spec("platform-policy@2026-12-01.2", "context-engine-builder@2",
                                  "Edited."))
    # builder@5 renders what builder@4 pinned as @4 did, wherever it holds no look-alike only
    # @5 escapes (that one is found by its hash, not here): a @4 plan is current, not rotated
    at4 = spec("platform-policy@2026-12-01.2", "context-engine-builder@4")
    at5 = spec("platform-policy@2026-12-01.2", "context-engine-builder@5")
    assert rotation_reason(at4, at5) is None and rotation_reason(at5, at4) is None
    # and builder@6 what @5 (or @4) pinned, wherever it holds no marker in tag characters
    at6 = spec("platform-policy@2026-12-01.2", "context-engine-builder@6")
    for older in (at4, at5):
        assert rotation_reason(older, at6) is None and rotation_reason(at6, older) is None
    # and builder@7 what @6 (or @5, @4) pinned, wherever it holds no confusable of a string
    # and no look-alike in an attribute
    at7 = spec("platform-policy@2026-12-01.2", "context-engine-builder@7")
    for older in (at4, at5, at6):
        assert rotation_reason(older, at7) is None and rotation_reason(at7, older) is None
    # and builder@8 what @7 (or older) pinned, wherever it holds no letter named after a tag
    # letter, right-to-left confusable or combining letter after a "<"
    at8 = spec("platform-policy@2026-12-01.2", "context-engine-builder@8")
    for older in (at4, at5, at6, at7):
        assert rotation_reason(older, at8) is None and rotation_reason(at8, older) is None
    # and builder@9 what @8 (or older) pinned, wherever it holds no index entry @9 cuts
    # otherwise; builder@10 what @9 (or older) pinned, wherever it holds no symbol named after
    # a tag letter, "<" or "/" after a "<"
    at9 = spec("platform-policy@2026-12-01.2", "context-engine-builder@9")
    at10 = spec("platform-policy@2026-12-01.2", "context-engine-builder@10")
    for newer, olders in ((at9, (at4, at5, at6, at7, at8)), (at10, (at4, at5, at6, at7, at8, at9))):
        for older in olders:
            assert rotation_reason(older, newer) is None and rotation_reason(newer, older) is None


def test_same_version_other_content_conflicts_whatever_else_rotates() -> None:
    """A pinned version pins its content however the Plan rotates: the same agent version with
    other instructions beside a new model, the same persona revision with other entries beside
    a new agent version, the same policy version with other text beside either, are each a
    conflict, never folded into the other rotation."""
    persona = Persona(revision="r1", entries=(PersonaEntry(key="tone", text="Brief."),))
    base = f.draft(f.inputs(persona=persona)).spec
    other_model = replace(base.model, model_id="gpt-4o-2024-08-06")
    assert rotation_reason(base, replace(base, model=other_model)) == "model_changed"
    with pytest.raises(PinnedVersionConflict) as e:
        rotation_reason(base, replace(base, model=other_model,
                                      agent=replace(base.agent, instructions="Other.")))
    assert e.value.metadata() == {"what": "agent", "version": "1"}
    reworded = Persona(revision="r1", entries=(PersonaEntry(key="tone", text="Long."),))
    with pytest.raises(PinnedVersionConflict) as e:
        rotation_reason(base, replace(base, agent=replace(base.agent, version="2"),
                                      persona=reworded))
    assert e.value.metadata() == {"what": "persona", "version": "r1"}
    with pytest.raises(PinnedVersionConflict) as e:
        rotation_reason(base, replace(base, model=other_model,
                                      assets=replace(base.assets, policy="Edited.")))
    assert e.value.metadata()["what"] == "policy"


# ----------------------------------------------------------------------------- class caps

def _over(exc: pytest.ExceptionInfo[PrefixClassOverCap], cls: str, unit: str,
          cap: int) -> int:
    e = exc.value
    meta = e.metadata()
    assert meta["class"] == cls
    assert meta["cap"] == str(cap)
    assert meta["unit"] == unit
    assert e.class_name == cls and e.unit == unit and e.cap == cap
    assert int(meta[unit]) == e.tokens > cap
    assert cls in str(e)
    return e.tokens


def test_class_caps_sum_to_the_prefix_ceiling() -> None:
    caps = {c.class_name: (c.token_cap, c.item_cap) for c in PrefixClass}
    assert caps == {
        "platform_policy": (2_000, None), "agent_instructions": (4_000, None),
        "persona": (2_000, 30), "tool_definitions": (9_000, 30),
        "deferred_tool_index": (2_000, 40), "skill_catalog": (1_500, 20),
        "memory_snapshot": (1_500, 40)}
    assert PREFIX_CEILING == 22_000


def test_persona_at_its_item_cap_is_accepted() -> None:
    d = f.draft(f.inputs(persona=persona(30)))
    assert {c.class_name: c.items for c in d.classes}["persona"] == 30


def test_persona_over_thirty_entries_fails() -> None:
    with pytest.raises(PrefixClassOverCap) as exc:
        f.draft(f.inputs(persona=persona(31)))
    assert _over(exc, "persona", "items", 30) == 31


def test_persona_over_two_thousand_tokens_fails() -> None:
    with pytest.raises(PrefixClassOverCap) as exc:
        f.draft(f.inputs(persona=persona(5, text=words(400))))
    assert _over(exc, "persona", "tokens", 2_000) > 2_000


def test_agent_instructions_over_four_thousand_tokens_fail_not_truncate() -> None:
    with pytest.raises(PrefixClassOverCap) as exc:
        f.draft(f.inputs(instructions=words(1_600)))
    _over(exc, "agent_instructions", "tokens", 4_000)


def test_agent_instructions_under_the_cap_render_verbatim() -> None:
    text = words(1_000)
    d = f.draft(f.inputs(instructions=text))
    assert d.rendered.blocks[2].text == text
    usage = {c.class_name: c for c in d.classes}["agent_instructions"]
    assert 0 < usage.tokens <= 4_000


def test_skill_catalog_at_twenty_is_accepted_and_over_twenty_fails() -> None:
    f.draft(f.inputs(skills=skills(20)))
    with pytest.raises(PrefixClassOverCap) as exc:
        f.draft(f.inputs(skills=skills(21)))
    assert _over(exc, "skill_catalog", "items", 20) == 21


def test_skill_catalog_over_fifteen_hundred_tokens_fails() -> None:
    with pytest.raises(PrefixClassOverCap) as exc:
        f.draft(f.inputs(skills=skills(10, description=words(150))))
    _over(exc, "skill_catalog", "tokens", 1_500)


def test_memory_snapshot_at_forty_is_accepted_and_over_forty_fails() -> None:
    f.draft(f.inputs(snapshot=snapshot(40, text="x")))
    with pytest.raises(PrefixClassOverCap) as exc:
        f.draft(f.inputs(snapshot=snapshot(41, text="x")))
    assert _over(exc, "memory_snapshot", "items", 40) == 41


def test_memory_snapshot_over_fifteen_hundred_tokens_fails() -> None:
    with pytest.raises(PrefixClassOverCap) as exc:
        f.draft(f.inputs(snapshot=snapshot(10, text=words(150))))
    _over(exc, "memory_snapshot", "tokens", 1_500)


def test_usage_reports_every_class_within_its_cap() -> None:
    d = f.draft(f.inputs(persona=persona(3), skills=skills(3), snapshot=snapshot(3),
                         catalog=(f.tool("a.read"),)))
    usage = {c.class_name: c for c in d.classes}
    assert set(usage) == {c.class_name for c in PrefixClass}
    for c in d.classes:
        assert c.tokens <= c.cap
    assert usage["persona"].items == 3 and usage["persona"].tokens > 0
    # a.read plus skill.load, which a non-empty skill catalog brings along
    assert usage["tool_definitions"].items == 2
    assert usage["tool_definitions"].tokens == h.cost_of(f.tool("a.read")) + h.cost_of(
        f.CONTROL_TOOLS["skill.load"])
    assert d.prefix_tokens == sum(c.tokens for c in d.classes)


def test_persona_revision_is_not_prompt_identity_but_content_is() -> None:
    a = f.draft(f.inputs(persona=persona(2, revision="r1")))
    b = f.draft(f.inputs(persona=replace(persona(2), revision="r2")))
    assert a.rendered.prefix_sha256 == b.rendered.prefix_sha256
    c = f.draft(f.inputs(persona=persona(2, text="other")))
    assert c.rendered.prefix_sha256 != a.rendered.prefix_sha256


# ----------------------------------------------------------------------------- rotations

def _legacy_spec_over_the_tool_cap() -> tuple[PlanSpec, str]:
    """A pinned spec whose tools count over their cap with this builder (as one an older
    builder counted lower can: BUILDER_VERSION), with a small tool a revocation drops."""
    heavy = tuple(f.tool(f"heavy_{i}", description=words(900)) for i in range(4))
    small = f.tool("small")
    d = f.draft(f.inputs(enabled=("heavy_0", "heavy_1", "heavy_2", "small"),
                         catalog=(*heavy, small)))
    spec = replace(d.spec, tools=(*d.spec.tools, heavy[3]))
    return spec, session_key("tenant-a", "session-1")


def test_a_rotation_that_keeps_the_model_never_fails_a_cap_the_pinned_plan_held() -> None:
    spec, key = _legacy_spec_over_the_tool_cap()
    est = f.estimator(spec.model)
    with pytest.raises(PrefixClassOverCap):  # counted now, the pinned tools are over the cap
        measure_prefix(spec, render_prefix(spec, key), est)
    # a security revocation of the small tool rotates: the rest is counted as it measures now
    d = redraft(spec, key, est, drop_tools=("small",))
    assert "small" not in d.spec.tool_names
    tools = {c.class_name: c for c in d.classes}["tool_definitions"]
    assert tools.tokens == sum(tool_cost(t, est) for t in d.spec.tools) > tools.cap == 9_000
    assert d.prefix_tokens == sum(c.tokens for c in d.classes)
    assert redraft(spec, key, est).spec.tools == spec.tools  # operator: the same tools
    # another model counts everything afresh: the cap fails, nothing is truncated
    with pytest.raises(PrefixClassOverCap) as exc:
        redraft(spec, key, est, drop_tools=("small",), model=spec.model)
    _over(exc, "tool_definitions", "tokens", 9_000)
    # a new snapshot is new content: its cap is held against it
    with pytest.raises(PrefixClassOverCap) as exc:
        redraft(spec, key, est, snapshot=snapshot(10, text=words(150)))
    _over(exc, "memory_snapshot", "tokens", 1_500)
    assert redraft(spec, key, est, snapshot=snapshot(2)).spec.memory_snapshot == snapshot(2)


def test_the_prefix_ceiling_grants_only_what_held_classes_are_over(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The ceiling guard (unreachable while the caps sum to it) lets a held class's overshoot
    through, and nothing more: a ceiling lowered to test it."""
    import context_engine.domain.plan as plan_module
    spec, key = _legacy_spec_over_the_tool_cap()
    est = f.estimator(spec.model)
    d = redraft(spec, key, est, drop_tools=("small",))
    over = {c.class_name: c for c in d.classes}["tool_definitions"].tokens - 9_000
    monkeypatch.setattr(plan_module, "PREFIX_CEILING", d.prefix_tokens - over)
    assert redraft(spec, key, est, drop_tools=("small",)).classes == d.classes
    monkeypatch.setattr(plan_module, "PREFIX_CEILING", d.prefix_tokens - over - 1)
    with pytest.raises(PrefixClassOverCap) as exc:
        redraft(spec, key, est, drop_tools=("small",))
    assert exc.value.class_name == "prefix" and exc.value.tokens == d.prefix_tokens


def test_a_plans_document_says_whether_its_count_holds_the_leading_turn() -> None:
    """A plan measured before the leading user turn was counted has no word of it in its
    document (the row a release before wrote, ``builder3_plan.json``): read back, it does not
    count the turn, and its Builds count it beside (``uncounted_framing``). A plan drafted now
    says it does, and keeps saying so through its document."""
    import json
    from pathlib import Path

    from context_engine.domain.plan import PlanSpec, uncounted_framing

    row = json.loads((Path(__file__).parents[1] / "integration" / "builder3_plan.json")
                     .read_text("utf-8"))
    before = PlanSpec.from_canonical(json.loads(row["spec_text"]))
    estimator = f.estimator(before.model)
    assert not before.counts_leading_turn and uncounted_framing(before, estimator) > 0
    now = f.draft(f.inputs()).spec
    assert now.counts_leading_turn and uncounted_framing(now, estimator) == 0
    assert PlanSpec.from_canonical(json.loads(now.canonical_json())).counts_leading_turn
