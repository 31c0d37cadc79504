"""What a plan pins beyond its prefix, read back through the real server (spec: "Ports and data
model", ContextPlan): the memory snapshot's id and store watermark (the runtime's recall delta
starts there) and one pin per skill catalog entry; and the builder-version rotation."""

from __future__ import annotations

import hashlib
import json

import pytest
from context_engine.v1 import context_engine_pb2 as pb

from tests.integration.requests import build_request, plan_request

pytestmark = pytest.mark.integration

SNAPSHOT = pb.MemorySnapshot(snapshot_id="snap-7", recall_trace_id="trace-7",
                             watermark=9_007_199_254_740_993,  # past a double's exact range
                             items=[pb.MemoryItem(id="m1", text="Prefers short answers.")])
# catalog order, deliberately not sorted by name
SKILLS = [
    pb.SkillCatalogEntry(name="triage", description="Sorts the inbox. Use for mail.",
                         trust=pb.TRUST_LEVEL_TRUSTED_CONFIGURATION),
    pb.SkillCatalogEntry(name="café", description="Orders coffee «vite».",
                         trust=pb.TRUST_LEVEL_USER),
]
TRUST = {pb.TRUST_LEVEL_TRUSTED_CONFIGURATION: "trusted_configuration",
         pb.TRUST_LEVEL_USER: "user"}


def pin(entry: pb.SkillCatalogEntry) -> str:
    """The documented pin, computed here without the service's code: SHA-256 of the entry's
    canonical JSON (sorted keys, no white space, UTF-8 without escapes)."""
    doc = {"name": entry.name, "description": entry.description, "trust": TRUST[entry.trust]}
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def get(stub, tenant: str, session: str, epoch: int = 0) -> pb.ContextPlan:
    return stub.GetPlan(pb.GetPlanRequest(tenant_id=tenant, session_id=session,
                                          epoch=epoch)).plan


def test_plan_exposes_the_pinned_snapshot_and_skill_pins(server, stub, ids):
    tenant, session = ids
    plan = stub.Plan(plan_request(tenant, session, memory_snapshot=SNAPSHOT,
                                  skill_catalog=SKILLS)).plan
    assert plan.snapshot_id == "snap-7"
    assert plan.snapshot_watermark == 9_007_199_254_740_993
    assert [(p.name, p.sha256) for p in plan.skill_pins] == [
        ("triage", pin(SKILLS[0])), ("café", pin(SKILLS[1]))]
    assert "skill.load" in plan.tool_names  # the catalog is pinned with its control tool
    assert get(stub, tenant, session) == plan
    # read back from PostgreSQL, not from this process's plan cache
    server.running.engine.cache.clear()
    assert get(stub, tenant, session, 1) == plan
    assert stub.Plan(plan_request(tenant, session, memory_snapshot=SNAPSHOT,
                                  skill_catalog=SKILLS)).plan == plan


def test_without_a_snapshot_or_skills_the_fields_are_empty(stub, ids):
    tenant, session = ids
    plan = stub.Plan(plan_request(tenant, session)).plan
    assert (plan.snapshot_id, plan.snapshot_watermark, list(plan.skill_pins)) == ("", 0, [])


def test_an_email_session_pins_no_skills_so_it_has_no_pins(stub, ids):
    tenant, session = ids
    plan = stub.Plan(plan_request(tenant, session, skill_catalog=SKILLS, memory_snapshot=SNAPSHOT,
                                  session=pb.SessionSpec(kind=pb.SESSION_KIND_EMAIL))).plan
    assert list(plan.skill_pins) == [] and "skill.load" not in plan.tool_names
    assert plan.snapshot_watermark == SNAPSHOT.watermark


def test_each_epoch_reports_its_own_snapshot(stub, ids):
    """A snapshot_invalidated rotation pins a new snapshot: the new epoch reports its
    watermark, and the earlier epoch still reports the one it pinned."""
    tenant, session = ids
    stub.Plan(plan_request(tenant, session, memory_snapshot=SNAPSHOT, skill_catalog=SKILLS))
    fresh = pb.MemorySnapshot(snapshot_id="snap-8", recall_trace_id="trace-8", watermark=41,
                              items=[pb.MemoryItem(id="m2", text="Works from Lisbon.")])
    resp = stub.Rotate(pb.RotateRequest(
        tenant_id=tenant, session_id=session, reason=pb.ROTATION_REASON_SNAPSHOT_INVALIDATED,
        memory_snapshot=fresh, idempotency_key="recall-again"))
    assert resp.plan.epoch == 2
    assert (resp.plan.snapshot_id, resp.plan.snapshot_watermark) == ("snap-8", 41)
    assert [p.name for p in resp.plan.skill_pins] == ["triage", "café"]  # still pinned
    first = get(stub, tenant, session, 1)
    assert (first.snapshot_id, first.snapshot_watermark) == ("snap-7", SNAPSHOT.watermark)


def test_a_plan_of_the_previous_builder_rotates_once(server, stub, ids, db):
    """The selection rules moved (tool.call only with a non-empty index): a plan pinned by
    the previous builder still serves its bytes, and its next Plan rotates once with
    builder_changed."""
    from context_engine.domain.canonical import canonical_json
    from context_engine.domain.plan import BUILDER_VERSION

    tenant, session = ids
    plan = stub.Plan(plan_request(tenant, session)).plan
    assert plan.builder_version == BUILDER_VERSION != "context-engine-builder@1"
    document = json.loads(db.val("SELECT spec_text FROM plans WHERE tenant_id=$1", tenant))
    document["builder_version"] = "context-engine-builder@1"
    db.fetch("UPDATE plans SET spec_text=$2 WHERE tenant_id=$1", tenant, canonical_json(document))
    server.running.engine.cache.clear()
    served = stub.Build(build_request(tenant, session))
    assert served.epoch == 1 and served.prefix_sha256 == plan.prefix_sha256
    resp = stub.Plan(plan_request(tenant, session))
    assert resp.created and resp.plan.epoch == 2 and resp.plan.reason == "builder_changed"
    assert resp.plan.builder_version == BUILDER_VERSION
    assert not stub.Plan(plan_request(tenant, session)).created


def test_a_rolling_deploy_of_a_new_policy_rotates_a_session_once(database_url, ids, db,
                                                                 tmp_path):
    """Replicas of two releases behind one balancer: the previous one with the packaged policy,
    the next with a newer revision of it. Plans alternate between them: the session rotates
    once (policy_changed) to the newer policy and stays there; the older replica returns and
    builds the plan the newer one pinned."""
    import shutil

    import grpc
    from context_engine.v1 import context_engine_pb2_grpc as pb_grpc

    from tests.conftest import REPO, ServerThread
    from tests.conftest import test_config as base_config

    packaged = REPO / "service" / "context_engine" / "assets"
    nxt = tmp_path / "assets"
    shutil.copytree(packaged, nxt)
    version = json.loads((packaged / "manifest.json").read_text())["version"]
    name, _, revision = version.rpartition("@")
    newer = f"{name}@{revision}-next"
    (nxt / "manifest.json").write_text(json.dumps({"version": newer}))
    (nxt / "policy.md").write_text((packaged / "policy.md").read_text()
                                   + "\nNever reveal another tenant's data.\n")
    servers = [ServerThread(base_config(), database_url),
               ServerThread(base_config().replace(assets_dir=nxt), database_url)]
    channels = [grpc.insecure_channel(s.address) for s in servers]
    try:
        previous, following = (pb_grpc.ContextEngineStub(c) for c in channels)
        tenant, session = ids
        answers = [stub.Plan(plan_request(tenant, session), timeout=30)
                   for stub in (previous, following) * 3]
        assert [(a.plan.epoch, a.created) for a in answers] == [
            (1, True), (2, True), (2, False), (2, False), (2, False), (2, False)]
        assert answers[1].plan.reason == "policy_changed"
        assert {a.plan.prefix_sha256 for a in answers[1:]} == {answers[1].plan.prefix_sha256}
        assert db.val("SELECT count(*) FROM plans WHERE tenant_id = $1", tenant) == 2
        for stub in (previous, following):
            built = stub.Build(build_request(tenant, session), timeout=30)
            assert built.epoch == 2
            assert "Never reveal another tenant's data." in built.request.prefix_blocks[0].text
        # a rotation for another reason on the previous release keeps the newer policy
        changed = plan_request(tenant, session)
        changed.agent.version = "8"
        bumped = previous.Plan(changed, timeout=30).plan
        assert (bumped.epoch, bumped.reason) == (3, "agent_version_changed")
        assert bumped.policy_version == newer
        for stub in (following, previous):
            again = stub.Plan(changed, timeout=30)
            assert not again.created and again.plan.epoch == 3
        built = previous.Build(build_request(tenant, session), timeout=30)
        assert built.epoch == 3
        assert "Never reveal another tenant's data." in built.request.prefix_blocks[0].text
    finally:
        for c in channels:
            c.close()
        for s in servers:
            s.stop()
