"""Several ``serve`` processes behind one PgBouncer (transaction pooling), one of them SIGKILLed
under load while keyed writes are in flight on it: a small run of ``make load-replicas``'s last
phase, so the claim stays tested."""

from __future__ import annotations

import signal

import pytest

from tests.load import replicas

pytestmark = pytest.mark.integration

RUNTIMES, TURNS = 18, 12  # with 18, some call is almost surely in flight on the killed process;
# 12 turns (about 2 s of load) leave the kill several holds of the calibration row: with 4, a
# run whose first holds found the pooler full of the other processes' reports ended first
POOL_SIZE = 4


def test_a_replica_sigkilled_under_load_loses_nothing(direct_database_url):
    (phase,) = replicas.run(["kill"], runtimes=RUNTIMES, turns=TURNS, kill_at=0.3,
                            pool_size=POOL_SIZE, db_pool_size=4,
                            database_url=direct_database_url)
    report = phase.report
    assert report.failures == []
    # the kill happened mid-load, while ReportUsage calls of the killed process waited in
    # PostgreSQL with their idempotency keys claimed; the calls in flight on it failed and were
    # sent again through the others
    assert phase.killed["exit_code"] == -signal.SIGKILL
    assert phase.killed["keyed_writes_in_flight"] >= 1
    assert 0 < phase.killed["rpcs_done_before"] < RUNTIMES * TURNS * replicas.RPCS_PER_TURN
    assert phase.killed["failed_attempts"] == report.retried() > 0
    assert phase.killed["codes"] == ["UNAVAILABLE"]
    # every runtime did every turn, and no call failed for good
    assert report.turns_done == RUNTIMES * TURNS and report.errors() == 0
    assert sum(1 for c in report.calls if c.code == "OK") == RUNTIMES * TURNS * 4
    # nothing lost, nothing doubled: one epoch per session, every acknowledged plan stored as
    # acknowledged, every usage report counted once (retries kept their idempotency key)
    assert report.epochs_per_session == 1.0
    assert (report.lost_plans, report.plans_checked) == (0, RUNTIMES)
    assert phase.usage_acknowledged == phase.usage_counted == RUNTIMES * TURNS
    # every process served calls (the killed one until it was killed), each through the
    # pooler: three processes' connections on at most POOL_SIZE of PostgreSQL's
    assert len(phase.served) == 3 and min(phase.served) > 0
    assert phase.pooler_clients >= 2 and 0 < phase.pooler_servers <= POOL_SIZE
