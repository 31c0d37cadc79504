"""Compact over gRPC counts a replaced message's attachments as Build charged them."""

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
