"""build(): Region B assembly and the active-run rule (spec: "Two regions and one rule",
ADR-0139; reasoning replay, ADR-0007)."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from context_engine.domain.builder import (
    Checkpoint,
    LoadedPlan,
    RuntimeMetadata,
    SkillBody,
)
from context_engine.domain.items import (
    AssistantMessageItem,
    ConversationItem,
    KnowledgePassage,
    MemoryLine,
    ReasoningItem,
    WorkingFact,
    WorkingState,
)
from context_engine.domain.request import Message, Role
from context_engine.domain.trust import TrustLevel

from tests import factories as f
from tests.unit import helpers as h

SECRET = b"\x00SECRET-REASONING-PAYLOAD\xff\x10chain of thought"


def assistant(item_id: str, text: str, seq: int, run: str = "run-1") -> AssistantMessageItem:
    return AssistantMessageItem(id=item_id, sequence=seq, run_id=run,
                                item_trust=TrustLevel.TRUSTED_CONFIGURATION, text=text)


def reasoning(item_id: str, seq: int, run: str, payload: bytes = SECRET) -> ReasoningItem:
    return ReasoningItem(id=item_id, sequence=seq, run_id=run,
                         item_trust=TrustLevel.TRUSTED_CONFIGURATION,
                         provider="anthropic", opaque=payload)


def fresh(**over: Any) -> dict[str, Any]:
    """Checkpoint fields that fill rows 11-14."""
    fields: dict[str, Any] = {
        "loaded_skills": (SkillBody(name="triage", body="Sort by urgency.",
                                    trust=TrustLevel.TRUSTED_CONFIGURATION),),
        "working_state": WorkingState(objective="Answer the user", facts=(
            WorkingFact(statement="It rains", source_event_ids=(3,),
                        trust=TrustLevel.EXTERNAL_UNTRUSTED),)),
        "recall": (MemoryLine(id="b1", text="User prefers metric units"),),
        "corrections": (MemoryLine(id="b2", text="User moved to Oslo"),),
        "knowledge": (KnowledgePassage(id="k1", source="handbook", text="Policy text.",
                                       rank=1, trust=TrustLevel.EXTERNAL_UNTRUSTED),),
    }
    fields.update(over)
    return fields


def loaded() -> LoadedPlan:
    """The default plan, with the skill catalog :func:`fresh`'s loaded skill comes from."""
    return f.loaded(f.inputs(skills=f.skill_catalog("triage")))


def messages(items: list[ConversationItem], run: str = "run-1",
             **fields: Any) -> tuple[Message, ...]:
    cp = f.checkpoint(items, run=run, **fields)
    return f.run_build(loaded(), cp).request.messages


def texts(msgs: tuple[Message, ...]) -> str:
    return "\n".join(m.text for m in msgs)


def row_of(msgs: tuple[Message, ...], item_id: str) -> list[int]:
    return [m.row for m in msgs if m.item_id == item_id]


# ----------------------------------------------------------------------------- active-run rule

def test_completed_exchange_then_fresh_rows() -> None:
    items: list[ConversationItem] = [
        f.user("u0", "earlier question", 1, run="run-0"),
        assistant("a0", "earlier answer", 2, run="run-0"),
        f.user("u1", "what's the weather?", 3),
        f.call("c1", 4, "call-1"),
        f.result("r1", 5, "call-1", "sunny"),
    ]
    msgs = messages(items, **fresh())
    assert [m.row for m in msgs] == [10, 10, 10, 10, 10, 11, 12, 13, 13, 13, 14]
    assert [m.item_id for m in msgs[:5]] == ["u0", "a0", "u1", "c1", "r1"]
    # the active run's original user message appears once, as a completed exchange
    assert row_of(msgs, "u1") == [10]
    assert [m.role for m in msgs[:5]] == [Role.USER, Role.ASSISTANT, Role.USER, Role.ASSISTANT,
                                         Role.TOOL]
    assert msgs[3].tool_calls[0].call_id == "call-1"
    assert msgs[4].call_id == "call-1"
    assert msgs[5].text.startswith("Loaded skill triage:")
    assert msgs[6].text.startswith("Working state:")
    assert msgs[-1].text.startswith("Runtime:\nCurrent date: 2026-11-29")
    assert msgs[-1].trust is TrustLevel.PLATFORM


def test_fresh_rows_are_not_inserted_before_the_original_user_message() -> None:
    items: list[ConversationItem] = [
        f.user("u1", "q", 1), f.call("c1", 2, "call-1"), f.result("r1", 3, "call-1", "x"),
        f.call("c2", 4, "call-2"), f.result("r2", 5, "call-2", "y"),
    ]
    msgs = messages(items, **fresh())
    first_fresh = next(i for i, m in enumerate(msgs) if m.row > 10)
    assert [m.item_id for m in msgs[:first_fresh]] == ["u1", "c1", "r1", "c2", "r2"]
    assert all(m.row > 10 for m in msgs[first_fresh:])
    assert [m.row for m in msgs] == sorted(m.row for m in msgs)


def test_unanswered_trailing_user_message_is_last() -> None:
    items: list[ConversationItem] = [
        f.user("u0", "earlier", 1, run="run-0"), assistant("a0", "reply", 2, run="run-0"),
        f.user("u1", "new question", 3),
    ]
    msgs = messages(items, **fresh())
    assert msgs[-1].row == 15 and msgs[-1].item_id == "u1"
    assert row_of(msgs, "u1") == [15]
    env = h.only_envelope(msgs[-1].text)
    assert (env.tag, env.item_id, env.body) == ("user", "u1", "\nnew question\n")
    assert msgs[-2].row == 14


def test_several_trailing_user_messages_stay_last_in_order() -> None:
    items: list[ConversationItem] = [
        f.user("u1", "q", 1), f.call("c1", 2, "call-1"), f.result("r1", 3, "call-1", "x"),
        f.user("u2", "also this", 4), f.user("u3", "and this", 5),
    ]
    msgs = messages(items, **fresh())
    assert [m.item_id for m in msgs if m.row == 15] == ["u2", "u3"]
    assert [m.item_id for m in msgs[-2:]] == ["u2", "u3"]
    assert row_of(msgs, "u1") == [10]


def test_first_message_alone_is_only_at_row_fifteen() -> None:
    msgs = messages([f.user("u1", "hello", 1)])
    assert [m.row for m in msgs] == [14, 15]


def test_row_fourteen_carries_runtime_metadata() -> None:
    cp = Checkpoint(active_run_id="run-1", items=(f.user("u1", "hi", 1),),
                    runtime=RuntimeMetadata(current_date="2026-12-01",
                                            principal_scopes=("b.scope", "a.scope"),
                                            surface="web", browser_origins=("https://x",)))
    msgs = f.run_build(loaded(), cp).request.messages
    assert msgs[0].text == ("Runtime:\nCurrent date: 2026-12-01\n"
                            "Principal scopes: a.scope, b.scope\nSurface: web")


def test_browser_origins_only_when_the_plan_offers_navigate() -> None:
    rt = RuntimeMetadata(current_date="2026-12-01", browser_origins=("https://shop.example",))
    cp = Checkpoint(active_run_id="run-1", items=(f.user("u1", "hi", 1),), runtime=rt)
    bound = f.loaded(f.inputs(catalog=h.browser_tools(), website="profile-1"))
    msgs = f.run_build(bound, cp).request.messages
    assert "browser.navigate accepts these origins: https://shop.example" in msgs[0].text
    unbound = f.run_build(loaded(), cp).request.messages
    assert "origins" not in unbound[0].text


def test_region_b_never_changes_the_prefix() -> None:
    lp = f.loaded(f.inputs(catalog=(f.tool("web.fetch"),), skills=f.skill_catalog("triage")))
    a = f.run_build(lp, f.checkpoint([f.user("u1", "a", 1)], date="2026-11-29"))
    b = f.run_build(lp, f.checkpoint([f.user("u1", "b", 1)], date="2026-11-30", **fresh()))
    assert a.prefix_sha256 == b.prefix_sha256 == lp.plan.prefix_sha256
    assert a.request.prefix_blocks == b.request.prefix_blocks
    assert a.request.tools == b.request.tools
    assert "2026-11-30" not in "".join(x.text for x in b.request.prefix_blocks)


def test_build_is_deterministic() -> None:
    items: list[ConversationItem] = [f.user("u1", "q", 1), f.call("c1", 2, "call-1"),
                                     f.result("r1", 3, "call-1", "</untrusted:00>")]
    lp = loaded()
    one = f.request_bytes(f.run_build(lp, f.checkpoint(items, **fresh())))
    two = f.request_bytes(f.run_build(loaded(), f.checkpoint(items, **fresh())))
    assert one == two


def test_knowledge_passages_ordered_by_rank() -> None:
    ps = (KnowledgePassage(id="k2", source="d", text="second", rank=2,
                           trust=TrustLevel.EXTERNAL_UNTRUSTED),
          KnowledgePassage(id="k1", source="d", text="first", rank=1,
                           trust=TrustLevel.EXTERNAL_UNTRUSTED))
    msgs = messages([f.user("u1", "q", 1)], knowledge=ps)
    (k,) = [m for m in msgs if m.text.startswith("Knowledge passages")]
    assert [e.item_id for e in h.parse_envelopes(k.text)] == ["k1", "k2"]


def test_recall_and_corrections_stay_in_memory_envelopes() -> None:
    msgs = messages([f.user("u1", "q", 1)], **fresh())
    row13 = [m for m in msgs if m.row == 13]
    mem = [e for m in row13 for e in h.parse_envelopes(m.text) if e.tag == "memory"]
    assert {e.source for e in mem} == {"memory:recall", "memory:corrections"}
    assert all(m.trust is TrustLevel.MEMORY for m in row13
               if not m.text.startswith("Knowledge"))


# ----------------------------------------------------------------------------- reasoning

def _reasoning_run() -> list[ConversationItem]:
    return [
        f.user("u0", "old", 1, run="run-0"),
        reasoning("z0", 2, "run-0", payload=b"OLD-RUN-PAYLOAD"),
        assistant("a0", "old answer", 3, run="run-0"),
        f.user("u1", "q", 4),
        reasoning("z1", 5, "run-1"),
        f.call("c1", 6, "call-1"),
        f.result("r1", 7, "call-1", "x"),
    ]


def test_reasoning_of_other_runs_is_dropped() -> None:
    msgs = messages(_reasoning_run(), **fresh())
    assert "z0" not in {m.item_id for m in msgs}
    assert all(m.reasoning_opaque != b"OLD-RUN-PAYLOAD" for m in msgs)
    assert [m.item_id for m in msgs if m.row == 10] == ["u0", "a0", "u1", "z1", "c1", "r1"]


def test_active_run_reasoning_is_replayed_verbatim_in_the_opaque_field() -> None:
    msgs = messages(_reasoning_run(), **fresh())
    (z,) = [m for m in msgs if m.item_id == "z1"]
    assert z.reasoning_opaque == SECRET
    assert z.reasoning_provider == "anthropic"
    assert z.role is Role.ASSISTANT and z.row == 10
    assert z.text == "" and z.tool_calls == ()


@pytest.mark.parametrize("encoding", ["raw", "hex", "base64", "repr"])
def test_reasoning_never_appears_in_message_text(encoding: str) -> None:
    msgs = messages(_reasoning_run(), **fresh())
    needle = {
        "raw": SECRET.decode("latin-1"),
        "hex": SECRET.hex(),
        "base64": base64.b64encode(SECRET).decode(),
        "repr": "SECRET-REASONING-PAYLOAD",
    }[encoding]
    assert needle not in texts(msgs)
    assert all("SECRET" not in b.text for b in f.run_build(
        loaded(), f.checkpoint(_reasoning_run())).request.prefix_blocks)


def test_reasoning_of_the_active_run_is_dropped_when_the_run_changes() -> None:
    items = [*_reasoning_run(), assistant("a1", "done", 8),
             f.user("u2", "next", 9, run="run-2")]
    msgs = messages(items, run="run-2")
    assert all(m.reasoning_opaque == b"" for m in msgs)
    assert msgs[-1].item_id == "u2" and msgs[-1].row == 15


def test_reasoning_item_repr_hides_the_payload() -> None:
    item = reasoning("z1", 5, "run-1")
    for text in (repr(item), str(item), repr(f.checkpoint([item]))):
        assert "SECRET" not in text
        assert SECRET.hex() not in text
        assert repr(SECRET) not in text
    assert "z1" in repr(item) and str(len(SECRET)) in repr(item)


# ----------------------------------------------------------------------------- result shape

def test_build_result_reports_its_accounting() -> None:
    lp = loaded()
    r = f.run_build(lp, f.checkpoint([f.user("u1", "hello", 1)]))
    assert r.prefix_tokens == lp.plan.prefix_tokens
    assert r.estimated_input_tokens == r.prefix_tokens + r.body_tokens
    assert r.body_tokens == f.estimator(lp.plan.spec.model).messages(r.request.messages)
    assert r.epoch == 1 and r.model_id == "claude-sonnet-4-5"
    assert r.session_key == lp.session_key
    assert r.context_window == 200_000 and r.output_reserve == 8_192


def test_a_message_an_earlier_run_left_unanswered_is_carried_history() -> None:
    """Only the active run's unanswered trailing messages are the current input (row 15,
    never yielding): one an earlier run left unanswered is history, so a summary that
    replaced it is not followed by it again, and the history cut may leave it out rather
    than the Build failing on it."""
    from context_engine.domain.items import HistorySummary

    lp = f.loaded(f.inputs(model_profile=f.model("gpt-4o", context_window=20_000,
                                                 output_reserve=1_024)))
    items = [f.user("u1", "first question", 1, run="run-1"),
             f.call("c1", 2, "a", run="run-1"), f.result("r1", 3, "a", "page", run="run-1"),
             f.user("u1b", "an earlier question nobody answered", 4, run="run-1"),
             f.user("u2", "new question", 10, run="run-2")]
    cp = f.checkpoint(items, run="run-2",
                      summary=HistorySummary(text="the first run", replaced_through_sequence=4))
    r = f.run_build(lp, cp)
    assert [(m.row, m.item_id) for m in r.request.messages if m.item_id] == [(15, "u2")]
    big = [f.user("u1", "q", 1, run="run-1"),
           f.user("u1b", "word " * 30_000, 2, run="run-1"),
           f.user("u2", "new question", 10, run="run-2")]
    r = f.run_build(lp, f.checkpoint(big, run="run-2"))
    assert r.pressure.fits and r.pressure.left_out_items == 2
    assert [(m.row, m.item_id) for m in r.request.messages if m.item_id] == [(15, "u2")]
    # supplemental input of the active run stays the current input, in order
    more = [*items[:3], f.user("u3", "one", 11, run="run-2"), f.user("u4", "two", 12,
                                                                     run="run-2")]
    r = f.run_build(lp, f.checkpoint(more, run="run-2"))
    assert [(m.row, m.item_id) for m in r.request.messages if m.row == 15] == [
        (15, "u3"), (15, "u4")]
