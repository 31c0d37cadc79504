"""A claim of epochs' counts whose COMMIT answer was lost, and a failover that loses that COMMIT.

With asynchronous replication a new primary may lack transactions the old one committed, and
it hands out transaction ids again from its own counter: the lost claim's id is given to
another transaction, which commits there. Asked whether the claim's transaction committed
(``pg_xact_status``), PostgreSQL then answers for that other one. Here the new primary is the
database's own data directory as it was before the claim (copied with the server stopped, put
back after the claim committed), and its transactions are run until the claim's id is reused.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
import uuid
import warnings
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import asyncpg
import pytest
from context_engine.adapters.postgres.migrate import migrate

from tests.conftest import REPO, Db, ServerThread, run
from tests.conftest import test_config as base_config
from tests.integration.requests import plan_request
from tests.integration.test_epoch_counts import (
    CLAIM,
    WRITER_CLAIM,
    aged,
    counted,
    cycle,
    growth,
    lost,
    settled_by_cycles,
    stored,
    stubs_of,
    uncounted,
)
from tests.support.commit_drop import CommitDropProxy
from tests.support.pgbouncer import PgBouncer

pytestmark = pytest.mark.integration


class Primary:
    """An embedded PostgreSQL of the test's own, stopped and started on the same socket, whose
    data directory can be saved and put back: a failover to a replica that lacks every
    transaction committed since the save."""

    def __init__(self) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from pgserver import get_server
        self.tmp = Path(tempfile.mkdtemp(prefix="ce-failover-pg-"))
        self.data = self.tmp / "pg"
        self.saved = self.tmp / "replica"
        self.server = get_server(self.data, cleanup_mode="stop")
        self.url = str(self.server.get_uri())
        run(migrate(self.url, REPO / "migrations"))

    def _stop(self) -> None:
        from pgserver._commands import pg_ctl
        pg_ctl(["-w", "-m", "fast", "stop"], pgdata=self.data, user=self.server.system_user)

    def _start(self) -> None:
        with self.server._lock:
            self.server.ensure_postgres_running()
        assert str(self.server.get_uri()) == self.url

    def save(self) -> None:
        """The replica: the data directory as it is now (every transaction so far)."""
        self._stop()
        subprocess.run(["cp", "-a", str(self.data), str(self.saved)], check=True)
        self._start()

    def fail_over(self) -> None:
        """The replica promoted: what was committed since ``save`` is gone."""
        self._stop()
        shutil.rmtree(self.data)
        subprocess.run(["cp", "-a", str(self.saved), str(self.data)], check=True)
        self._start()

    def close(self) -> None:
        self.server.cleanup()
        shutil.rmtree(self.tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def primary() -> Iterator[Primary]:
    p = Primary()
    yield p
    p.close()


@pytest.fixture(scope="module")
def pooled(primary: Primary) -> Iterator[str]:
    # a login tried while the database restarts holds the pooler back for server_login_retry:
    # 1 s, not PgBouncer's 15
    with PgBouncer(primary.url, pool_mode="transaction", default_pool_size=4,
                   server_login_retry=1) as pooler:
        yield pooler.url


def reconnected(db: Db, servers: list[ServerThread], seconds: float = 60.0) -> None:
    """Once the pooler reaches the restarted database (a login it tried while the database was
    down holds it back for server_login_retry), each server's pooled connections, cut by the
    restart, replaced at their next use."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            db.val("SELECT 1")
            break
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
            assert time.monotonic() < deadline, "the pooler did not reach the database again"
            time.sleep(0.5)
    for s in servers:
        s.call(s.running.pool.expire_connections())


def reuse(db: Db, xids: list[int]) -> None:
    """Transactions of the new primary, each committed, until every id of ``xids`` is one of
    theirs."""
    for _ in range(10_000):
        got = int(db.val("SELECT pg_current_xact_id()::text::bigint"))
        if got >= max(xids):
            return
    raise AssertionError(f"the ids {xids} were not reached")


def test_a_lost_claim_whose_id_a_new_primary_reused_is_not_counted(primary, pooled):
    """A writer's claim and a cycle's batch, each whose COMMIT committed and whose answer was
    lost; then a failover to a replica without those commits, which gives their transaction
    ids to transactions of its own, committed. Their process asked PostgreSQL whether the
    claims' transactions committed, was told yes, and counted their epochs, while the epochs
    were uncounted on the new primary, so a cycle claimed and counted them again: counted
    twice. Now a claim is settled as committed only where its epochs' rows show it: here they
    do not, so it counts nothing, and the epochs are counted once, by the cycle that claims
    them on the new primary."""
    db = Db(pooled)
    with closing(CommitDropProxy(pooled)) as proxy:
        servers = settled_by_cycles([ServerThread(base_config(), proxy.url),
                                     ServerThread(base_config(), pooled)])
        try:
            stubs_gen = stubs_of(servers)
            stubs = next(stubs_gen)
            written, swept = ((f"tenant-{uuid.uuid4().hex[:12]}",
                               f"session-{uuid.uuid4().hex[:12]}") for _ in range(2))
            before = counted(servers)
            for tenant, session in (written, swept):  # written and uncounted, no claim yet
                lost(stubs[0], proxy, "Plan", plan_request(tenant, session))
            aged(db, swept[0])  # old enough for a cycle to claim
            primary.save()
            reconnected(db, servers)
            # a cycle's batch, its COMMIT answer lost
            proxy.arm(after=CLAIM)
            assert servers[0].call(servers[0].running.maintenance.attempt()) is None
            # the writer's claim (a Plan reading its uncounted epoch), its COMMIT answer lost
            proxy.arm(after=WRITER_CLAIM)
            try:
                assert not stubs[0].Plan(plan_request(*written), timeout=30).created
            finally:
                proxy.disarm()
            assert proxy.dropped == 4  # both claims committed
            assert uncounted(db, written[0]) == 0 and uncounted(db, swept[0]) == 0
            maintenance = servers[0].running.maintenance
            assert maintenance.unsettled == 2
            xids = [int(batch.xid) for batch in maintenance._unsettled]
            assert growth(before, counted(servers)) == {}
            primary.fail_over()
            reconnected(db, servers)
            assert uncounted(db, written[0]) == 1 and uncounted(db, swept[0]) == 1  # gone
            aged(db, written[0])
            reuse(db, xids)
            statuses = [db.val("SELECT pg_xact_status($1::text::xid8)", str(x)) for x in xids]
            assert statuses == ["committed", "committed"]  # another transaction's answer
            cycle(servers)  # the first settles its claims, and each cycle sweeps
            cycle(servers)
            truth = {"session_opened": 2.0, "opened": 2.0}
            for tenant, _ in (written, swept):
                assert stored(db, tenant) == {"session_opened": 1.0, "opened": 1.0}
                assert uncounted(db, tenant) == 0
            assert maintenance.unsettled == 0
            assert growth(before, counted(servers)) == truth
            for stub in stubs:  # counted once: a later Plan counts nothing
                for tenant, session in (written, swept):
                    assert not stub.Plan(plan_request(tenant, session), timeout=30).created
            assert growth(before, counted(servers)) == truth
            next(stubs_gen, None)
        finally:
            for s in servers:
                s.stop()
