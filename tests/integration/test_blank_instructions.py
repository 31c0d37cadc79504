"""Agent instructions of white space alone, through the real server and PostgreSQL.

``Plan`` took " " and rendered it as prefix row 3: when row 3 ended the prefix, the Anthropic
body carried ``cache_control`` on ``{"type": "text", "text": " "}`` (a text block Anthropic
refuses, a marker on empty text) and every Bedrock Build of the epoch failed INTERNAL
(``ASSEMBLY_ERROR``: a cachePoint after a blank block); mid-prefix, the blank block still went to
Claude as a system block. Now ``Plan`` refuses it at ``agent.instructions`` and writes nothing,
and a plan stored before that refusal (its pinned bytes, which ``prefix_sha256`` covers, stay as
they are) builds a valid body in every format, the same bytes Build after Build: Claude's bodies
leave the blank block out and mark the last block they send. The body logic in isolation:
tests/unit/test_blank_system_blocks.py."""

from __future__ import annotations

import json

import grpc
import pytest
from context_engine.domain import providers
from context_engine.domain.canonical import canonical_json, session_key
from context_engine.domain.plan import PlanSpec, render_prefix
from context_engine.v1 import context_engine_pb2 as pb

from tests.integration.requests import build_request, failure, plan_request
from tests.integration.test_provider_bodies import FORMATS, MODELS, items, through_sdk
from tests.support import tool_pairs

pytestmark = pytest.mark.integration

CLAUDE = (pb.PROVIDER_FORMAT_ANTHROPIC_MESSAGES, pb.PROVIDER_FORMAT_BEDROCK_CONVERSE)


@pytest.mark.parametrize("blank", [" ", "\n", "\t \n"])
def test_plan_refuses_instructions_of_white_space_alone_and_writes_nothing(stub, ids, db,
                                                                           blank):
    tenant, session = ids
    req = plan_request(tenant, session)
    req.agent.instructions = blank
    with pytest.raises(grpc.RpcError) as err:
        stub.Plan(req)
    f = failure(err.value)
    assert f.code is grpc.StatusCode.INVALID_ARGUMENT and f.reason == "INVALID_ARGUMENT"
    assert f.violations == {
        "agent.instructions": "is white space alone: send it empty for no instructions"}
    assert db.counts(tenant) == {"sessions": 0, "plans": 0, "context_events": 0}
    req.agent.instructions = ""  # no instructions: taken, and row 3 renders nothing
    plan = stub.Plan(req).plan
    assert 3 not in [b.row for b in plan.prefix_blocks]


def _stored_with_blank_instructions(server, stub, db, tenant: str, session: str, fmt: int, *,
                                    last: bool) -> str:
    """A session whose plan pins instructions of white space alone, as a Plan before the
    refusal stored it: planned with none, then its row rewritten to hold " " with the hash of
    what it renders (as test_epochs.py simulates older plans). ``last``: no deferred tool, so
    row 3 ends the prefix; otherwise the deferred index (row 6) follows it. The hash."""
    model = pb.ModelSpec(model_id=MODELS[fmt])
    if fmt == pb.PROVIDER_FORMAT_BEDROCK_CONVERSE:
        model.capabilities.context_window = 200_000
        model.capabilities.output_reserve = 8_192
    req = plan_request(tenant, session, model=model)
    req.agent.instructions = ""
    if last:
        del req.agent.deferred_tools[:]
    stub.Plan(req)
    document = json.loads(db.val("SELECT spec_text FROM plans WHERE tenant_id=$1", tenant))
    assert document["agent"]["instructions"] == ""
    document["agent"]["instructions"] = " "
    rendered = render_prefix(PlanSpec.from_canonical(document), session_key(tenant, session))
    assert [b.row for b in rendered.blocks][-1 if last else -2] == 3
    text = canonical_json(document)
    db.fetch("UPDATE plans SET spec_text=$2::text, spec=$2::text::jsonb, prefix_sha256=$3 "
             "WHERE tenant_id=$1", tenant, text, rendered.prefix_sha256)
    server.running.engine.cache.clear()
    return rendered.prefix_sha256


@pytest.mark.parametrize("last", [True, False], ids=["row 3 last", "row 3 mid-prefix"])
@pytest.mark.parametrize("fmt", list(FORMATS), ids=list(FORMATS.values()))
def test_a_plan_stored_with_blank_instructions_builds_a_valid_body(server, stub, ids, db, fmt,
                                                                    last):
    tenant, session = ids
    name = FORMATS[fmt]
    digest = _stored_with_blank_instructions(server, stub, db, tenant, session, fmt, last=last)
    req = build_request(tenant, session, items())
    req.provider_format = fmt  # type: ignore[assignment]
    first, again = stub.Build(req), stub.Build(req)
    for resp in (first, again):
        # the pinned bytes as they were: row 3 holds the blank, under the stored hash
        assert resp.prefix_sha256 == digest and resp.epoch == 1
        assert [(b.row, b.text) for b in resp.request.prefix_blocks if b.row == 3] == [(3, " ")]
    assert again.provider_body_json == first.provider_body_json  # the same bytes each Build
    body = json.loads(first.provider_body_json)
    assert providers.validate(body, name) == []
    assert tool_pairs.body_problems(first.provider_body_json, fmt) == []
    through_sdk(body, name, MODELS[fmt])
    if fmt not in CLAUDE:
        return
    system = body["system"]
    texts = [b["text"] for b in system if "text" in b]
    assert texts == [b.text for b in first.request.prefix_blocks if b.row != 3]
    if fmt == pb.PROVIDER_FORMAT_ANTHROPIC_MESSAGES:
        marked = [b for b in system if "cache_control" in b]
        assert marked == [system[-1]] and system[-1]["text"].strip()
    else:
        assert [i for i, b in enumerate(system) if "cachePoint" in b] == [len(system) - 1]
        assert system[-2]["text"].strip()
