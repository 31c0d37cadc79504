"""The pointers a replaced message's attachments become are ones a summary sent back may hold
(a label at most USER, a reference that is one line of at most 256 characters), and Compact
counts the attachments a replaced message carried as Build charged them."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from context_engine.api import mapping as m
from context_engine.domain.builder import attachment_costs
from context_engine.domain.compaction import CompactionResult, StructuredSummarizer, Target, compact
from context_engine.domain.estimator import attachment_tokens
from context_engine.domain.items import AssistantMessageItem, RenderContext, WorkingState
from context_engine.domain.request import Attachment, AttachmentKind
from context_engine.domain.trust import TrustLevel
from context_engine.v1 import context_engine_pb2 as pb

from tests import factories as f


def compacted(ref: str, trust: int) -> CompactionResult:
    req = pb.CompactRequest(tenant_id="t", session_id="s", idempotency_key="k", reason="r",
                            tokens_to_free=10_000)
    cp = req.checkpoint
    cp.active_run_id = "run-1"
    it = cp.items.add(id="u1", sequence=1, run_id="run-0", trust=trust)
    it.user.text = "Review the contract"
    it.user.attachments.add(kind=pb.ATTACHMENT_KIND_PDF, name="c.pdf", ref=ref, pages=3)
    cp.items.add(id="a1", sequence=2, run_id="run-0", trust=pb.TRUST_LEVEL_USER,
                 assistant=pb.AssistantMessage(text="Done."))
    cp.items.add(id="u2", sequence=3, run_id="run-1", trust=pb.TRUST_LEVEL_USER,
                 user=pb.UserMessage(text="next"))
    cmd = m.compact_command(req)
    return asyncio.run(compact(
        cmd.checkpoint.items, None, active_run_id="run-1", target=Target(tokens_to_free=10_000),
        reason="r", summarizer=StructuredSummarizer(),
        measure=lambda ms: sum(len(x.text) // 4 + 4 for x in ms),
        ctx=RenderContext(session_key="sk"), state=WorkingState()))


def sent_back(r: CompactionResult) -> None:
    v = m.Violations()
    m.history_summary(v, "checkpoint.summary", m.summary_pb(r))
    v.raise_if_any()


@pytest.mark.parametrize("ref", ["artifact:" + "x" * 300, "artifact:a\u202e/77",
                                 "artifact:a\u2028evil", "https://files.example/c.pdf?sig=" +
                                 "a" * 400])
def test_a_reference_no_pointer_can_hold_is_left_to_the_event(ref: str) -> None:
    r = compacted(ref, pb.TRUST_LEVEL_USER)
    (span,) = [s for s in r.elided if s.kind.startswith("attachment")]
    assert span.artifact_ref is None and span.event_id == 1
    line = span.pointer()
    assert ref not in line and "\u202e" not in line and "\u2028" not in line
    assert line.endswith("-> event:1"), line
    sent_back(r)  # the summary Compact answered is one the next Build takes


def test_a_reference_a_pointer_can_hold_is_kept() -> None:
    r = compacted("artifact:a/77", pb.TRUST_LEVEL_USER)
    (span,) = [s for s in r.elided if s.kind.startswith("attachment")]
    assert span.artifact_ref == "artifact:a/77" and "artifact:a/77" in span.pointer()
    sent_back(r)


def test_an_attachment_pointer_is_at_most_user() -> None:
    """A user message the runtime labelled trusted configuration (the API takes it): its
    attachment's pointer stands for data, and a summary sent back holds none above USER."""
    r = compacted("artifact:rb", pb.TRUST_LEVEL_TRUSTED_CONFIGURATION)
    (span,) = [s for s in r.elided if s.kind.startswith("attachment")]
    assert span.trust_level is TrustLevel.USER
    assert "(user, 3 pages)" in span.pointer()
    sent_back(r)


def test_compact_counts_a_replaced_messages_attachments_as_build_charged_them() -> None:
    """A 12-page PDF Build charged about 82,000 tokens for: Compact counted its message at a
    few tokens, so tokens_to_free=5,000 replaced everything up to the active run."""
    model = f.model("gpt-4o")
    est = f.estimator(model)
    pdf = Attachment(kind=AttachmentKind.PDF, name="c.pdf", ref="artifact:a/1", pages=12)
    items = [replace(f.user("u1", "Review the attached contract", 1, run="run-0"),
                     attachments=(pdf,)),
             AssistantMessageItem(id="a1", sequence=2, run_id="run-0",
                                  item_trust=TrustLevel.USER, text="Done."),
             f.user("u2", "thanks", 3, run="run-0"),
             AssistantMessageItem(id="a2", sequence=4, run_id="run-0",
                                  item_trust=TrustLevel.USER, text="ok " * 2000),
             f.user("u3", "next", 5, run="run-1")]
    loaded = f.loaded(f.inputs(model_profile=model))
    charged = (f.run_build(loaded, f.checkpoint(items)).estimated_input_tokens
               - f.run_build(loaded, f.checkpoint([replace(items[0], attachments=()),
                                                   *items[1:]])).estimated_input_tokens)
    assert charged >= attachment_tokens(pdf, est.base_factor, 1.0, est.image_tokens) > 5_000
    r = asyncio.run(compact(
        items, None, active_run_id="run-1", target=Target(tokens_to_free=5_000),
        reason="budget_pressure", summarizer=StructuredSummarizer(),
        measure=lambda ms: est.messages(list(ms), 1.0), ctx=RenderContext(session_key="sk"),
        state=WorkingState(), attachment_charges=lambda sendable: attachment_costs(
            sendable, est.base_factor, 1.0, est.image_tokens)))
    assert r.replaced_item_ids[:1] == ("u1",) and "a2" not in r.replaced_item_ids
    assert r.tokens_before >= charged

