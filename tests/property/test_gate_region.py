"""Hard gate: Region B inputs never change prefix_sha256 (spec: "Two regions and one rule").

If it can differ between two requests in the same session, it is in Region B: the date, recall,
corrections, working state, knowledge, loaded skills, conversation items and trailing user
input. None of them may move a byte of Region A; the agent instructions (Region A) must.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from context_engine.domain.builder import BuildResult, Checkpoint, LoadedPlan
from context_engine.domain.items import ConversationItem, UserMessageItem
from context_engine.domain.trust import TrustLevel
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tests import factories as f
from tests.property import strategies as S

pytestmark = pytest.mark.gate_region

GATE_SETTINGS = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                         suppress_health_check=[HealthCheck.too_slow,
                                                HealthCheck.data_too_large])

# Each name is one Region B input a caller may change between two requests of a session.
REGION_B_INPUTS = ("items", "trailing_user_input", "loaded_skills", "working_state", "recall",
                   "corrections", "knowledge", "current_date", "runtime")

date_texts = st.one_of(
    S.dates,
    st.datetimes().map(lambda d: d.strftime("%A, %d %B %Y")),
    st.datetimes().map(lambda d: d.isoformat(timespec="seconds") + "Z"),
)


def prefix_bytes(r: BuildResult) -> str:
    """Region A as the model receives it: prefix blocks and tool definitions."""
    return json.dumps({
        "blocks": [[b.row, b.trust.value, b.text] for b in r.request.prefix_blocks],
        "tools": [[t.name, t.description, t.input_schema_json] for t in r.request.tools],
    }, sort_keys=True, ensure_ascii=False)


def region_a_text(r: BuildResult) -> str:
    return "\n".join([b.text for b in r.request.prefix_blocks]
                     + [f"{t.name}\n{t.description}\n{t.input_schema_json}"
                        for t in r.request.tools])


def _vary(base: Checkpoint, other: Checkpoint, fields: frozenset[str]) -> Checkpoint:
    """``base`` with the chosen Region B inputs taken from ``other``; still a valid
    checkpoint, since every input is swapped whole."""
    changes: dict[str, Any] = {}
    items, active = base.items, base.active_run_id
    if "items" in fields:
        items, active = other.items, other.active_run_id
    if "trailing_user_input" in fields:
        last = items[-1].sequence if items else 0
        items = (*items, UserMessageItem(id="trailing-extra", sequence=last + 1,
                                         run_id=active, item_trust=TrustLevel.USER,
                                         text="And one more thing: 2031-01-01?"))
    changes["items"], changes["active_run_id"] = items, active
    for name in ("loaded_skills", "working_state", "recall", "corrections", "knowledge"):
        if name in fields:
            changes[name] = getattr(other, name)
    runtime = other.runtime if "runtime" in fields else base.runtime
    if "current_date" in fields:
        runtime = dataclasses.replace(runtime, current_date=other.runtime.current_date)
    elif "runtime" in fields:
        runtime = dataclasses.replace(runtime, current_date=base.runtime.current_date)
    changes["runtime"] = runtime
    return dataclasses.replace(base, **changes)


def _assert_same_region_a(loaded: LoadedPlan, a: BuildResult, b: BuildResult) -> None:
    assert a.prefix_sha256 == b.prefix_sha256 == loaded.plan.prefix_sha256
    assert prefix_bytes(a) == prefix_bytes(b)
    assert a.request.prefix_blocks == b.request.prefix_blocks
    assert a.request.tools == b.request.tools
    assert a.prefix_tokens == b.prefix_tokens == loaded.plan.prefix_tokens


@GATE_SETTINGS
@given(data=st.data())
def test_two_checkpoints_of_one_plan_share_region_a(data: st.DataObject) -> None:
    i = data.draw(S.plan_inputs(), label="inputs")
    loaded = S.make_loaded(i)
    names = [t.name for t in i.tool_catalog]
    one = data.draw(S.checkpoints(names, S.skills(loaded.plan)), label="checkpoint one")
    two = data.draw(S.checkpoints(names, S.skills(loaded.plan)), label="checkpoint two")
    a = S.build(loaded, one, data.draw(S.factors, label="factor one"))
    b = S.build(loaded, two, data.draw(S.factors, label="factor two"))
    _assert_same_region_a(loaded, a, b)


@GATE_SETTINGS
@given(data=st.data())
def test_each_region_b_input_alone_leaves_region_a_unchanged(data: st.DataObject) -> None:
    i = data.draw(S.plan_inputs(), label="inputs")
    loaded = S.make_loaded(i)
    names = [t.name for t in i.tool_catalog]
    base = data.draw(S.checkpoints(names, S.skills(loaded.plan)), label="base")
    other = data.draw(S.checkpoints(names, S.skills(loaded.plan)), label="other")
    fields = data.draw(st.frozensets(st.sampled_from(REGION_B_INPUTS), min_size=1,
                                     max_size=3), label="varied inputs")
    varied = _vary(base, other, fields)
    a = S.build(loaded, base)
    b = S.build(loaded, varied)
    _assert_same_region_a(loaded, a, b)
    if "trailing_user_input" in fields:  # the variation reached the body
        assert a.request.messages != b.request.messages


@GATE_SETTINGS
@given(data=st.data())
def test_agent_instructions_change_the_prefix(data: st.DataObject) -> None:
    i = data.draw(S.plan_inputs(), label="inputs")
    other_text = data.draw(S.texts(max_parts=4), label="other instructions")
    assume(other_text != i.agent.instructions)
    one = S.make_loaded(i)
    two = S.make_loaded(S.with_instructions(i, other_text))
    assert one.plan.prefix_sha256 != two.plan.prefix_sha256

    cp = data.draw(S.checkpoints([t.name for t in i.tool_catalog],
                                  S.skills(one.plan)), label="checkpoint")
    a, b = S.build(one, cp), S.build(two, cp)
    assert a.prefix_sha256 != b.prefix_sha256
    # Only row 3 moved: every other Region A byte and the whole body are unchanged.
    assert [x for x in a.request.prefix_blocks if x.row != 3] == \
        [x for x in b.request.prefix_blocks if x.row != 3]
    assert a.request.tools == b.request.tools
    assert a.request.messages == b.request.messages


def _caller_text(loaded: LoadedPlan) -> str:
    """Everything a caller put into Region A, plus the platform's own texts."""
    doc = loaded.plan.spec.canonical()
    own = {k: doc[k] for k in ("agent", "persona", "tools", "deferred", "skill_catalog",
                               "memory_snapshot")}
    return "\n".join([json.dumps(own, ensure_ascii=False), str(doc["assets"]["policy"]),
                      str(doc["assets"]["framing"]), loaded.session_key])


@GATE_SETTINGS
@given(data=st.data())
def test_region_a_never_contains_the_checkpoint_date(data: st.DataObject) -> None:
    i = data.draw(S.plan_inputs(), label="inputs")
    loaded = S.make_loaded(i)
    date = data.draw(date_texts, label="date")
    # A date the caller itself wrote into the instructions may of course appear there.
    assume(date not in _caller_text(loaded))
    cp = data.draw(S.checkpoints([t.name for t in i.tool_catalog],
                                  S.skills(loaded.plan)), label="checkpoint")
    cp = dataclasses.replace(cp, runtime=dataclasses.replace(cp.runtime, current_date=date))
    r = S.build(loaded, cp)
    assert date not in region_a_text(r)
    assert date not in prefix_bytes(r)
    runtime = [m for m in r.request.messages if m.row == 14]
    assert len(runtime) == 1 and f"Current date: {date}" in runtime[0].text


def test_crossing_midnight_keeps_the_prefix() -> None:
    """The canonical trap: the date feels like configuration. The asset version even carries
    a date (platform-policy@YYYY-MM-DD.N); the rendered prefix must not."""
    loaded = f.loaded(f.inputs(catalog=(f.tool("web.fetch"),), enabled=("web.fetch",)))
    items: list[ConversationItem] = [f.user("u1", "What day is it?", 1)]
    before = S.build(loaded, f.checkpoint(items, date="2026-11-29"))
    after = S.build(loaded, f.checkpoint(items, date="2026-11-30"))
    _assert_same_region_a(loaded, before, after)
    for r, date in ((before, "2026-11-29"), (after, "2026-11-30")):
        assert date not in region_a_text(r)
        assert any(f"Current date: {date}" in m.text for m in r.request.messages)
    assert before.request.messages != after.request.messages
