"""Compact over gRPC counts what it replaces as Build charged it: a user message with its
attachments, a tool result as its excerpt or typed pointer."""

from __future__ import annotations

import pytest
from context_engine.v1 import context_engine_pb2 as pb

from tests.integration.requests import build_request, item, plan_request

pytestmark = pytest.mark.integration


def history() -> list[pb.ConversationItem]:
    pdf = pb.Attachment(kind=pb.ATTACHMENT_KIND_PDF, name="c.pdf", ref="artifact:a/1", pages=12)
    return [item("u1", 1, run="run-0", user=pb.UserMessage(text="Review the contract",
                                                           attachments=[pdf])),
            item("a1", 2, run="run-0", assistant=pb.AssistantMessage(text="Done.")),
            item("u2", 3, run="run-0", user=pb.UserMessage(text="thanks")),
            item("a2", 4, run="run-0", assistant=pb.AssistantMessage(text="ok " * 2000)),
            item("u3", 5, run="run-1", user=pb.UserMessage(text="next"))]


def test_compact_frees_what_build_charged_for_an_attachment(stub, ids):
    tenant, session = ids
    stub.Plan(plan_request(tenant, session, model=pb.ModelSpec(model_id="gpt-4o")))
    with_pdf = stub.Build(build_request(tenant, session, items=history()))
    plain = history()
    del plain[0].user.attachments[:]
    charged = (with_pdf.estimated_input_tokens
               - stub.Build(build_request(tenant, session, items=plain)).estimated_input_tokens)
    # twelve pages, each 3,000 tokens of text and gpt-4o's largest image (85 + 8 tiles x 170),
    # as Build states it; the difference of the two estimates also counts the attachment's
    # label in the message text, whose tokens merge with the envelope's (a session's random
    # nonce) by a token or two either way
    assert with_pdf.estimated_attachment_tokens == 12 * (3_000 + 85 + 8 * 170) > 50_000
    assert abs(charged - with_pdf.estimated_attachment_tokens) <= 40
    req = pb.CompactRequest(tenant_id=tenant, session_id=session, reason="budget_pressure",
                            idempotency_key="k", tokens_to_free=5_000,
                            checkpoint=pb.Checkpoint(active_run_id="run-1", items=history()))
    resp = stub.Compact(req)
    assert resp.compacted and list(resp.replaced_item_ids)[:1] == ["u1"]
    assert "a2" not in resp.replaced_item_ids  # the PDF alone frees the 5,000 asked
    assert resp.tokens_before >= charged
    kinds = [e.kind for e in resp.summary.elided]
    assert kinds == ["attachment.pdf"]


def image_history(count: int = 3) -> list[pb.ConversationItem]:
    """``count`` user messages of an image each, answered, then the active run's message."""
    image = pb.Attachment(kind=pb.ATTACHMENT_KIND_IMAGE, name="p.png", ref="artifact:a/2")
    out = []
    for n in range(count):
        out.append(item(f"u{n}", 2 * n + 1, run="run-0",
                        user=pb.UserMessage(text=f"look {n}", attachments=[image])))
        out.append(item(f"a{n}", 2 * n + 2, run="run-0",
                        assistant=pb.AssistantMessage(text=f"seen {n}")))
    out.append(item("u9", 2 * count + 3, run="run-1", user=pb.UserMessage(text="next")))
    return out


def test_compact_credits_a_message_with_what_the_attachment_budget_left_it(stub, ids):
    """Build spends the request-wide attachment budget (100,000 tokens) newest first: on a
    model the catalog does not know an image is 48,169, so of three the oldest is charged the
    3,662 the newer two left. Compact credited it with the full 48,169, so tokens_to_free
    20,000 replaced that message alone, which freed under 4,000 tokens of what Build charged."""
    tenant, session = ids
    stub.Plan(plan_request(tenant, session, model=pb.ModelSpec(
        model_id="acme-vision-1", capabilities=pb.ModelCapabilities(context_window=1_000_000))))
    whole = stub.Build(build_request(tenant, session, items=image_history())
                       ).estimated_input_tokens
    resp = stub.Compact(pb.CompactRequest(
        tenant_id=tenant, session_id=session, reason="budget_pressure", idempotency_key="k",
        tokens_to_free=20_000, checkpoint=pb.Checkpoint(active_run_id="run-1",
                                                        items=image_history())))
    assert resp.compacted and list(resp.replaced_item_ids)[:1] == ["u0"]
    left = [i for i in image_history() if i.id not in set(resp.replaced_item_ids)]
    freed = whole - stub.Build(build_request(tenant, session, items=left)
                               ).estimated_input_tokens
    assert freed >= 20_000  # what it was asked to free, of what Build charged
    assert resp.tokens_before <= freed  # and it credits no more than Build charged


def fetch_history(excerpt: bool) -> list[pb.ConversationItem]:
    """Twelve fetches of a 200 KB page (persisted excerpt, or none: Build cuts the head/tail
    excerpt past the inline maximum), each answered, then the active run's message."""
    out = []
    for n in range(12):
        s = 4 * n
        out += [item(f"u{n}", s + 1, run="run-0", user=pb.UserMessage(text=f"fetch page {n}")),
                item(f"c{n}", s + 2, run="run-0", tool_calls=pb.ToolCalls(calls=[pb.ToolCall(
                    call_id=f"call-{n}", name="web.fetch",
                    arguments_json=f'{{"url":"https://e.com/{n}"}}')])),
                item(f"r{n}", s + 3, run="run-0", trust=pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED,
                     tool_result=pb.ToolResult(
                         call_id=f"call-{n}", tool_name="web.fetch", event_id=1_000 + n,
                         content="page text " * 20_000,
                         context_content=f"excerpt {n} " * 60 if excerpt else "")),
                item(f"a{n}", s + 4, run="run-0",
                     assistant=pb.AssistantMessage(text=f"noted {n} " * 300))]
    return [*out, item("u99", 49, run="run-1", user=pb.UserMessage(text="and now?"))]


@pytest.mark.parametrize("excerpt", [True, False], ids=["persisted", "head_tail"])
def test_compact_by_builds_left_out_tokens_replaces_what_build_left_out(stub, ids, excerpt):
    """Build charges a tool result as it sends it (its excerpt; once history is cut, its typed
    pointer). Compact credited the canonical page (40,131 tokens), so tokens_to_free = the
    Build's left_out_tokens (1,059) replaced u0, c0 and r0 and not the answer a0 that Build
    had also left out: the next Build still cut it, and a second compaction was needed."""
    tenant, session = ids
    stub.Plan(plan_request(tenant, session, model=pb.ModelSpec(
        model_id="gpt-4o",
        capabilities=pb.ModelCapabilities(context_window=16_000, output_reserve=2_000))))
    first = stub.Build(pb.BuildRequest(tenant_id=tenant, session_id=session,
                                       checkpoint=pb.Checkpoint(
        active_run_id="run-1", items=fetch_history(excerpt),
        runtime=pb.RuntimeMetadata(current_date="2026-11-29")))).pressure
    left = next(s.item_ids for s in first.steps if s.step == "history")
    assert first.compaction_needed and len(left) >= 4
    resp = stub.Compact(pb.CompactRequest(
        tenant_id=tenant, session_id=session, reason="budget_pressure", idempotency_key="k",
        tokens_to_free=first.left_out_tokens,
        checkpoint=pb.Checkpoint(active_run_id="run-1", items=fetch_history(excerpt))))
    assert list(resp.replaced_item_ids) == list(left)
    assert resp.tokens_before == first.left_out_tokens
