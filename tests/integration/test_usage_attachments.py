"""ReportUsage of a request with attachments, through the real server: Build states the part of
its estimate that is attachments' upper bounds (``estimated_attachment_tokens``), and a report
that sends it back is reconciled around them, so files that cost the provider less than their
bound do not pull down the factor a later request of text alone is estimated with."""

from __future__ import annotations

import grpc
import pytest
from context_engine.v1 import context_engine_pb2 as pb

from tests.integration.requests import build_request, failure, plan_request
from tests.integration.test_compact_attachments_rpc import image_history

pytestmark = pytest.mark.integration

CLAUDE_IMAGE = 4_784  # README: Claude's image, Opus 4.7's 2,576-pixel tier
UNKNOWN_IMAGE = 48_169  # README: a model the catalog does not know, the largest figure


def without_attachments(items: list[pb.ConversationItem]) -> list[pb.ConversationItem]:
    out = [pb.ConversationItem() for _ in items]
    for copy, original in zip(out, items, strict=True):
        copy.CopyFrom(original)
        if copy.HasField("user"):
            del copy.user.attachments[:]
    return out


def report(tenant: str, session: str, built: pb.BuildResponse, actual: int, key: str,
           attachments: int | None = None) -> pb.ReportUsageRequest:
    return pb.ReportUsageRequest(
        tenant_id=tenant, session_id=session, estimated_input_tokens=built.estimated_input_tokens,
        estimator_factor=built.estimator_factor, input_tokens=actual, output_tokens=10,
        idempotency_key=key,
        estimated_attachment_tokens=(built.estimated_attachment_tokens if attachments is None
                                     else attachments))


def test_build_states_what_its_attachments_add(stub, ids):
    tenant, session = ids
    stub.Plan(plan_request(tenant, session, model=pb.ModelSpec(model_id="claude-sonnet-4-5")))
    built = stub.Build(build_request(tenant, session, items=image_history(3)))
    plain = stub.Build(build_request(tenant, session, items=without_attachments(image_history(3))))
    assert built.estimated_attachment_tokens == 3 * CLAUDE_IMAGE
    # and the attachments' labels in the messages' text (counted as text, not part of it).
    # The text's difference is not the labels' alone: each envelope's nonce hashes its
    # message's content, so the two Builds' nonces differ and tokenize to other counts
    # (the labels added 8 to 49 tokens over 150 sessions, and once -1): bounded, far under
    # one image, so an image counted twice or not at all still fails
    added = built.estimated_input_tokens - plain.estimated_input_tokens
    assert abs(added - 3 * CLAUDE_IMAGE) <= 150
    assert plain.estimated_attachment_tokens == 0


def test_build_states_the_share_of_the_attachment_budget_it_charged(stub, ids):
    """Three images on a model the catalog does not know: 48,169 + 48,169 + the 3,662 the
    100,000-token request-wide budget leaves the oldest."""
    tenant, session = ids
    stub.Plan(plan_request(tenant, session, model=pb.ModelSpec(
        model_id="acme-vision-1", capabilities=pb.ModelCapabilities(context_window=1_000_000))))
    built = stub.Build(build_request(tenant, session, items=image_history(3)))
    assert built.estimated_attachment_tokens == 100_000 == 2 * UNKNOWN_IMAGE + 3_662


def test_images_cheaper_than_their_bound_leave_the_factor_where_text_needs_it(stub, ids):
    """The provider counts the text as estimated and each image at 1,600. Reported without the
    attachments' part, the factor falls (toward 1 / 1.3 for Claude) and a later request of
    text alone is estimated below the provider's count; reported with it, nothing proves the
    text over-counted and the factor stays 1.0."""
    tenant, session = ids
    other = f"{tenant}-blind"
    for t in (tenant, other):
        stub.Plan(plan_request(t, session, model=pb.ModelSpec(model_id="claude-sonnet-4-5")))
    built = stub.Build(build_request(tenant, session, items=image_history(3)))
    text = built.estimated_input_tokens - 3 * CLAUDE_IMAGE
    actual = text + 3 * 1_600
    told = stub.ReportUsage(report(tenant, session, built, actual, "k1"))
    blind = stub.ReportUsage(report(other, session, built, actual, "k1", attachments=0))
    assert told.counted and blind.counted
    assert told.correction_factor == 1.0
    assert blind.correction_factor < 0.97
    # the next Build of text alone is estimated at the factor the report left
    plain = without_attachments(image_history(3))
    assert stub.Build(build_request(tenant, session, items=plain)).estimator_factor == 1.0
    assert stub.Build(build_request(other, session, items=plain)).estimator_factor < 0.97


def test_a_text_under_count_is_still_corrected_at_once_beside_attachments(stub, ids):
    tenant, session = ids
    stub.Plan(plan_request(tenant, session, model=pb.ModelSpec(model_id="claude-sonnet-4-5")))
    built = stub.Build(build_request(tenant, session, items=image_history(2)))
    text = built.estimated_input_tokens - 2 * CLAUDE_IMAGE
    # even with both images at their whole bound, the text took 1.5 times its estimate
    up = stub.ReportUsage(report(tenant, session, built, round(text * 1.5) + 2 * CLAUDE_IMAGE,
                                 "k1"))
    assert up.correction_factor == pytest.approx(1.5, rel=1e-3)


def test_an_attachment_part_over_the_estimate_is_refused_and_counts_nothing(stub, ids, db):
    tenant, session = ids
    stub.Plan(plan_request(tenant, session, model=pb.ModelSpec(model_id="claude-sonnet-4-5")))
    built = stub.Build(build_request(tenant, session, items=image_history(1)))
    with pytest.raises(grpc.RpcError) as err:
        stub.ReportUsage(report(tenant, session, built, 9_000, "k1",
                                attachments=built.estimated_input_tokens + 1))
    f = failure(err.value)
    assert f.code is grpc.StatusCode.INVALID_ARGUMENT
    assert f.fields == ("estimated_attachment_tokens",)
    assert db.val("SELECT count(*) FROM estimator_calibration WHERE tenant_id=$1 "
                  "AND reports > 0", tenant) == 0
    # the same key, sent right, is counted: the refusal claimed nothing
    assert stub.ReportUsage(report(tenant, session, built, 9_000, "k1")).counted


def test_only_the_attachments_the_request_sends_are_stated(stub, ids):
    """A window that holds some of eight image messages: the history cut leaves the oldest out,
    and the part stated is the images of the messages the request carries."""
    tenant, session = ids
    stub.Plan(plan_request(tenant, session, model=pb.ModelSpec(
        model_id="claude-sonnet-4-5",
        capabilities=pb.ModelCapabilities(context_window=30_000, output_reserve=2_000))))
    built = stub.Build(build_request(tenant, session, items=image_history(8)))
    sent = sum(len(m.attachments) for m in built.request.messages)
    assert 0 < sent < 8, sent  # the cut took some, not all
    assert built.estimated_attachment_tokens == sent * CLAUDE_IMAGE


@pytest.mark.parametrize("images", [1, 3])
def test_a_prefix_half_read_beside_images_reads_under_the_alert(stub, ids, server, images):
    """The provider counts the text as estimated (factor 1.0) and each image at 1,600 of its
    4,784 (README); the prefix's own tokens are its estimate. Taken to the provider's tokens by
    the whole request's ratio of input to estimate, which the images' bound pulls down, the
    prefix was counted at a fraction of itself: half of it read from the cache read 0.96 with
    one image and 1.0 with three, and the alert (below 0.9) could not fire."""
    tenant, session = ids
    stub.Plan(plan_request(tenant, session, model=pb.ModelSpec(model_id="claude-sonnet-4-5")))
    registry = server.registry

    def observed() -> tuple[float, float]:
        return (registry.get_sample_value("context_engine_cached_prefix_ratio_sum") or 0.0,
                registry.get_sample_value("context_engine_cached_prefix_ratio_count") or 0.0)

    built = stub.Build(build_request(tenant, session, items=image_history(images)))
    assert built.estimator_factor == 1.0
    assert built.estimated_attachment_tokens == images * CLAUDE_IMAGE
    actual = built.estimated_input_tokens - images * (CLAUDE_IMAGE - 1_600)
    prefix = built.budget.prefix_tokens  # the provider's tokens of the prefix (factor 1.0)
    read = []
    for key, cached in (("first", 0), ("whole", prefix), ("half", prefix // 2)):
        before = observed()
        stub.ReportUsage(pb.ReportUsageRequest(
            tenant_id=tenant, session_id=session,
            estimated_input_tokens=built.estimated_input_tokens,
            estimator_factor=built.estimator_factor, input_tokens=actual, cached_tokens=cached,
            output_tokens=10, idempotency_key=key,
            estimated_attachment_tokens=built.estimated_attachment_tokens))
        after = observed()
        read.append((after[1] - before[1], after[0] - before[0]))
    assert read[0] == (0, 0)  # the epoch's first report writes the cache
    assert read[1] == (1, pytest.approx(1.0))  # read whole: whole
    truth = (prefix // 2) / prefix
    # never under the truth (the prefix is not counted over the provider's own tokens), and
    # under the alert's 0.9: at most 1.3 times the truth, the prefix's floor of cl100k_base
    assert read[2][0] == 1 and truth <= read[2][1] <= 1.3 * truth + 1e-3 < 0.9
