"""The idempotency key that binds a run to its snapshot once (``context.snapshot.used``):
unambiguous across the sessions of a tenant, and within the index's row size for the longest
ids the contract accepts."""

from __future__ import annotations

import random
import uuid

import pytest
from context_engine.engine import snapshot_fence_key
from context_engine.v1 import context_engine_pb2 as pb

from tests.integration.requests import build_request, plan_request

pytestmark = pytest.mark.integration

SNAPSHOT = pb.MemorySnapshot(snapshot_id="snap-1", recall_trace_id="trace-1", watermark=1,
                             items=[pb.MemoryItem(id="m1", text="Prefers metric units.")])


def build_run(stub, tenant: str, session: str, run: str) -> pb.BuildResponse:
    req = build_request(tenant, session)
    req.checkpoint.active_run_id = run
    for it in req.checkpoint.items:
        it.run_id = run
    return stub.Build(req, timeout=30)


def fenced(db, tenant: str, session: str) -> int:
    return int(db.val("SELECT count(*) FROM context_events WHERE tenant_id=$1 AND "
                      "session_id=$2 AND type='context.snapshot.used'", tenant, session))


def test_two_sessions_never_share_a_runs_binding(stub, db):
    """Session "a" (epoch 1, run "2:r") and session "a:1" (epoch 2, run "r") both keyed
    "a:1:2:r": the second run was never bound to its snapshot."""
    tenant = f"tenant-{uuid.uuid4().hex[:10]}"
    stub.Plan(plan_request(tenant, "a", memory_snapshot=SNAPSHOT), timeout=30)
    build_run(stub, tenant, "a", "2:r")
    stub.Plan(plan_request(tenant, "a:1", memory_snapshot=SNAPSHOT), timeout=30)
    stub.Rotate(pb.RotateRequest(tenant_id=tenant, session_id="a:1",
                                 reason=pb.ROTATION_REASON_OPERATOR, idempotency_key="op"),
                timeout=30)
    assert build_run(stub, tenant, "a:1", "r").epoch == 2
    assert (fenced(db, tenant, "a"), fenced(db, tenant, "a:1")) == (1, 1)
    # the form keys were written in before stays where it was unambiguous
    assert snapshot_fence_key("a", 1, "2:r") == "a:1:2:r"
    assert snapshot_fence_key("a:1", 2, "r").startswith("sha256:")


def test_a_key_of_512_bytes_keeps_the_form_it_was_written_in():
    """Keys up to 512 bytes were written plain before the hashed form existed (longer ones
    failed the insert): a run bound under one is not bound again under another key."""
    run = "r" * 508  # "s:1:" and the run: 512 bytes
    assert snapshot_fence_key("s", 1, run) == "s:1:" + "r" * 508
    assert snapshot_fence_key("s", 1, run + "r").startswith("sha256:")


def test_the_longest_ids_bind_their_run(stub, db):
    """Ids of 256 four-byte characters each made a key past PostgreSQL's B-tree row size:
    every Build of the run failed INTERNAL."""
    rnd = random.Random(7)

    def wide() -> str:
        return "".join(chr(rnd.randrange(0xF0000, 0xFFFFD)) for _ in range(256))
    tenant, session, run = wide(), wide(), wide()
    stub.Plan(plan_request(tenant, session, memory_snapshot=SNAPSHOT), timeout=30)
    assert build_run(stub, tenant, session, run).epoch == 1
    assert build_run(stub, tenant, session, run).epoch == 1
    assert fenced(db, tenant, session) == 1
