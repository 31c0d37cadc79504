"""Proto <-> domain mapping, field by field, against literal values: what a caller sends
reaches the domain whole, what the domain answers reaches the wire whole, and each bound
refuses past it and no earlier."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from context_engine.api import mapping
from context_engine.domain.errors import InvalidInput
from context_engine.domain.ports import Erased
from context_engine.domain.request import Attachment, AttachmentKind, Message, Role
from context_engine.domain.trust import TrustLevel
from context_engine.domain.working_state import Changes
from context_engine.v1 import context_engine_pb2 as pb

USER = pb.TRUST_LEVEL_USER


def test_every_field_of_a_checkpoint_reaches_the_domain() -> None:
    cp = pb.Checkpoint(
        items=[pb.ConversationItem(id="u1", sequence=1, trust=USER, user=pb.UserMessage(
            text="see", attachments=[pb.Attachment(kind=pb.ATTACHMENT_KIND_PDF, name="a.pdf",
                                                   ref="r1", pages=7, text_chars=900,
                                                   text_bytes=1_800)]))],
        knowledge=[pb.KnowledgePassage(id="k1", source="kb", text="t", rank=3, trust=USER)],
        runtime=pb.RuntimeMetadata(current_date="2026-01-02", surface="web",
                                   principal_scopes=["s1"], browser_origins=["https://a.test"]),
        working_state=pb.WorkingState(facts=[pb.WorkingFact(
            statement="f", source_event_ids=[4], trust=USER, sequence=9, run_id="r")]))
    v = mapping.Violations()
    out = mapping.checkpoint(v, cp)
    assert v.items == []
    (a,) = out.items[0].attachments  # type: ignore[attr-defined]
    assert (a.kind, a.name, a.ref, a.pages, a.text_chars, a.text_bytes) == (
        AttachmentKind.PDF, "a.pdf", "r1", 7, 900, 1_800)
    assert (out.knowledge[0].id, out.knowledge[0].rank) == ("k1", 3)
    assert out.runtime.browser_origins == ("https://a.test",)
    assert out.runtime.principal_scopes == ("s1",)
    fact = out.working_state.facts[0]
    assert (fact.sequence, fact.run_id, fact.source_event_ids) == (9, "r", (4,))


def test_a_message_reaches_the_wire_whole() -> None:
    m = Message(row=8, role=Role.ASSISTANT, trust=TrustLevel.USER, item_id="i",
                reasoning_provider="anthropic", reasoning_opaque=b"\x00sig",
                attachments=(Attachment(kind=AttachmentKind.IMAGE, name="p.png", ref="r2",
                                        pages=0, text_chars=0),
                             Attachment(kind=AttachmentKind.PDF, name="d.pdf", ref="r3",
                                        pages=12, text_chars=3400, text_bytes=3401)))
    expected = pb.Message(row=8, role=pb.ROLE_ASSISTANT, trust=USER, item_id="i",
                          reasoning_provider="anthropic", reasoning_opaque=b"\x00sig",
                          attachments=[pb.Attachment(kind=pb.ATTACHMENT_KIND_IMAGE,
                                                     name="p.png", ref="r2"),
                                       pb.Attachment(kind=pb.ATTACHMENT_KIND_PDF, name="d.pdf",
                                                     ref="r3", pages=12, text_chars=3400,
                                                     text_bytes=3401)])
    assert mapping.message_pb(m).SerializeToString(deterministic=True) == \
        expected.SerializeToString(deterministic=True)


@pytest.mark.parametrize(("chars", "size", "why"), [
    (0, 1, "is given without text_chars: state both"),
    (10, 9, "9 is fewer bytes than text_chars 10: a character takes a byte at least"),
    (10, 41, "41 is more bytes than 4 x text_chars 10: a character takes 4 bytes at most"),
])
def test_a_text_files_bytes_are_refused_where_no_text_could_have_them(chars: int, size: int,
                                                                       why: str) -> None:
    v = mapping.Violations()
    mapping.checkpoint(v, pb.Checkpoint(items=[pb.ConversationItem(
        id="u1", sequence=1, trust=USER, user=pb.UserMessage(text="see", attachments=[
            pb.Attachment(kind=pb.ATTACHMENT_KIND_TEXT, name="n.txt", ref="r",
                          text_chars=chars, text_bytes=size)]))]))
    assert [(x.field, x.description) for x in v.items] == [
        ("checkpoint.items[0].user.attachments[0].text_bytes", why)]
    for chars, size in ((10, 10), (10, 40), (10, 0), (0, 0)):  # the bounds themselves pass
        ok = mapping.Violations()
        mapping.checkpoint(ok, pb.Checkpoint(items=[pb.ConversationItem(
            id="u1", sequence=1, trust=USER, user=pb.UserMessage(text="see", attachments=[
                pb.Attachment(kind=pb.ATTACHMENT_KIND_TEXT, name="n.txt", ref="r",
                              text_chars=chars, text_bytes=size)]))]))
        assert ok.items == [], (chars, size)


def test_a_change_reaches_the_wire_whole() -> None:
    out = mapping.change_pb(Changes(transition="remove_constraint", constraints_removed=1,
                                    user_event_id=41, tokens=12))
    assert (out.transition, out.constraints_removed, out.user_event_id, out.tokens) == (
        "remove_constraint", 1, 41, 12)


def test_the_plan_cache_ttl_is_rounded_up_to_whole_seconds() -> None:
    at = datetime(2026, 1, 1, tzinfo=UTC)
    assert mapping.delete_session_pb(Erased(sessions=1, erased_at=at), 2.5).plan_cache_seconds == 3
    assert mapping.delete_session_pb(Erased(sessions=1, erased_at=at), 3.0).plan_cache_seconds == 3


def test_bounds_refuse_past_them_and_not_at_them() -> None:
    v = mapping.Violations()
    assert mapping.epoch(v, 2**31 - 1) == 2**31 - 1 and v.items == []
    assert mapping.epoch(v, 2**31) is None and [x.field for x in v.items] == ["epoch"]

    def usage(cached: int) -> pb.ReportUsageRequest:
        return pb.ReportUsageRequest(tenant_id="t", session_id="s", idempotency_key="k",
                                     estimated_input_tokens=100, estimator_factor=1.0,
                                     input_tokens=90, cached_tokens=cached)

    assert mapping.usage_report(usage(90)).cached_tokens == 90  # every input token cached
    with pytest.raises(InvalidInput) as err:
        mapping.usage_report(usage(91))
    assert [x.field for x in err.value.violations] == ["cached_tokens"]


def _update_request(**update: object) -> pb.UpdateWorkingStateRequest:
    return pb.UpdateWorkingStateRequest(
        tenant_id="t", session_id="s", run_id="r", sequence=5,
        transition=pb.WorkingStateTransition(update=pb.WorkingStateUpdate(trust=USER, **update)))


def test_an_update_s_fact_names_positive_event_ids() -> None:
    fact = pb.WorkingFact(statement="f", trust=USER, source_event_ids=[0])
    with pytest.raises(InvalidInput) as err:
        mapping.update_working_state_command(_update_request(add_facts=[fact]))
    assert [x.field for x in err.value.violations] == [
        "transition.update.add_facts[0].source_event_ids[0]"]


def test_carried_events_name_each_sequence_once() -> None:
    event = pb.WorkingStateEvent(sequence=3, run_id="r", transition=pb.WorkingStateTransition(
        answer=pb.UserAnswer(question="q?")))
    req = pb.CarryWorkingStateRequest(tenant_id="t", session_id="s", seed_event_sequence=1,
                                      events=[event, event])
    with pytest.raises(InvalidInput) as err:
        mapping.carry_command(req)
    assert [x.field for x in err.value.violations] == ["events[1]"]


def test_an_empty_call_name_is_left_to_the_scan_s_one_violation() -> None:
    """The checkpoint scan refuses an empty call name ("must not be empty"); the mapping
    holds a name it was given to the providers' rule, and adds no second line for an empty
    one. A name that breaks the rule is refused here."""
    def calls(name: str) -> pb.Checkpoint:
        return pb.Checkpoint(items=[pb.ConversationItem(
            id="c1", sequence=1, trust=USER, tool_calls=pb.ToolCalls(
                calls=[pb.ToolCall(call_id="k1", name=name, arguments_json="{}")]))])
    v = mapping.Violations()
    mapping.checkpoint(v, calls(""))
    assert v.items == []
    mapping.checkpoint(v, calls("a b"))
    assert [x.field for x in v.items] == ["checkpoint.items[0].tool_calls.calls[0].name"]


def test_question_origins_are_one_per_open_question_or_none() -> None:
    origin = pb.EntryOrigin(sequence=2, run_id="r", trust=USER)
    v = mapping.Violations()
    mapping.working_state(v, "current", pb.WorkingState(open_questions=["a?", "b?"],
                                                        question_origins=[origin]))
    assert [x.field for x in v.items] == ["current.question_origins"]
    v = mapping.Violations()
    mapping.working_state(v, "current", pb.WorkingState(open_questions=["a?", "b?"]))
    assert v.items == []


def test_a_summary_cap_is_taken_from_1_to_32000_tokens() -> None:
    """``max_summary_tokens`` is refused outside [1, 32,000] (the README's Compact row, the
    proto's comment), and taken at both ends: literal bounds, not the module's constant."""
    def compact(cap: int) -> pb.CompactRequest:
        return pb.CompactRequest(tenant_id="t", session_id="s", idempotency_key="k",
                                 reason="r", tokens_to_free=100, max_summary_tokens=cap)

    assert mapping.compact_command(compact(1)).max_summary_tokens == 1
    assert mapping.compact_command(compact(32_000)).max_summary_tokens == 32_000
    for cap in (0, 32_001):
        with pytest.raises(InvalidInput) as err:
            mapping.compact_command(compact(cap))
        assert [x.field for x in err.value.violations] == ["max_summary_tokens"], cap


@pytest.mark.parametrize(("name", "taken"), [
    ("triage", True), ("triage-2.v1_b", True), ("\u0939\u093f\u0902\u0926\u0940", True),  # marks
    ("\u0663\u0664", True), ("\u2460", True), ("\u00bd", True), ("x\u00b2", True),  # Nd, No
    ("\u216b", True),  # Nl: a Roman numeral
    ("a b", False), ("a/b", False), ("a<b", False), ("a\u2028b", False), ("a\u200bb", False),
    ("", False), ("x" * 65, False), ("x" * 64, True),
])
def test_a_skill_name_is_letters_numbers_or_marks_of_any_script(name: str, taken: bool) -> None:
    """README and the contract: 1 to 64 letters, numbers or marks of any script, '_', '.' or
    '-' (every number category: digits, numerals and other numbers alike)."""
    assert mapping.skill_name(name) is taken
