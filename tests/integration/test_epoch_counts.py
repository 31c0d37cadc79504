"""context_engine_epochs_total and context_engine_sessions_opened_total against the epochs
PostgreSQL holds, across two replicas of one database: each stored epoch is counted once, by
one replica, whether its writer learnt that its COMMIT succeeded or not."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, closing, contextmanager
from dataclasses import replace
from typing import Any

import asyncpg
import grpc
import pytest
from context_engine.adapters.postgres.maintenance import CLAIM_UNCOUNTED, XACT_STATUS, Outcome
from context_engine.adapters.postgres.migrate import migrate
from context_engine.adapters.postgres.queries import CLAIM_EPOCH_COUNT
from context_engine.adapters.postgres.store import ClaimedEpoch
from context_engine.v1 import context_engine_pb2 as pb
from context_engine.v1 import context_engine_pb2_grpc as pb_grpc

from tests.conftest import REPO, Db, ServerThread, run
from tests.conftest import test_config as base_config
from tests.integration.requests import plan_request
from tests.support.commit_drop import CommitDropProxy
from tests.support.databases import create_database, drop_database, with_database

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def proxy(database_url: str) -> Iterator[CommitDropProxy]:
    with closing(CommitDropProxy(database_url)) as p:
        yield p


@pytest.fixture(scope="module")
def replicas(database_url: str, proxy: CommitDropProxy) -> Iterator[list[ServerThread]]:
    """Two replicas of one database: the first reaches it through the proxy that can lose a
    COMMIT's answer."""
    servers = settled_by_cycles([ServerThread(base_config(), proxy.url),
                                 ServerThread(base_config(), database_url)])
    yield servers
    for s in servers:
        s.stop()


def settled_by_cycles(servers: list[ServerThread]) -> list[ServerThread]:
    """``servers``, whose kept claims wait for a cycle (or the stop) to settle them rather than
    for a pass a few seconds after each was kept: the tests of settling run the cycles."""
    for s in servers:
        s.running.maintenance.settle_after_seconds = 3600.0
    return servers


def stubs_of(servers: list[ServerThread]) -> Iterator[list[pb_grpc.ContextEngineStub]]:
    """A stub on a channel of its own for each server; the channels closed after."""
    channels = [grpc.insecure_channel(s.address) for s in servers]
    yield [pb_grpc.ContextEngineStub(ch) for ch in channels]
    for ch in channels:
        ch.close()


@pytest.fixture(scope="module")
def stubs(replicas: list[ServerThread]) -> Iterator[list[pb_grpc.ContextEngineStub]]:
    yield from stubs_of(replicas)


def counted(replicas: list[ServerThread]) -> dict[str, float]:
    """Both replicas' counters, summed: 'opened' and each epoch reason."""
    total: dict[str, float] = {}
    for s in replicas:
        total["opened"] = total.get("opened", 0.0) + (
            s.registry.get_sample_value("context_engine_sessions_opened_total") or 0.0)
        for metric in s.registry.collect():
            if metric.name == "context_engine_epochs":
                for sample in metric.samples:
                    if sample.name.endswith("_total"):
                        reason = sample.labels["reason"]
                        total[reason] = total.get(reason, 0.0) + sample.value
    return total


def growth(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def stored(db, tenant: str) -> dict[str, float]:
    """The oracle: the epochs PostgreSQL holds, by reason, and the sessions opened."""
    rows = db.fetch("SELECT reason, count(*) AS n FROM plans WHERE tenant_id = $1 "
                    "GROUP BY reason", tenant)
    found = {r["reason"]: float(r["n"]) for r in rows}
    opened = db.val("SELECT count(*) FROM plans WHERE tenant_id = $1 AND epoch = 1", tenant)
    return {**found, "opened": float(opened)} if found else {}


def test_an_epoch_whose_commit_answer_was_lost_is_counted_once(replicas, stubs, proxy, ids, db):
    """A Plan whose COMMIT reached PostgreSQL but whose answer was lost fails UNAVAILABLE with
    the session opened; its retry (here through the other replica) found the plan current and
    counted nothing, so the session and its epoch were never counted anywhere: epochs per
    session under-read. Now the retry that reads the uncounted epoch counts it, once; a keyed
    Rotate retried after the same loss likewise."""
    tenant, session = ids
    before = counted(replicas)
    proxy.arm()
    with pytest.raises(grpc.RpcError) as err:
        stubs[0].Plan(plan_request(tenant, session))
    assert err.value.code() is grpc.StatusCode.UNAVAILABLE
    assert proxy.dropped == 1 and stored(db, tenant) == {"session_opened": 1.0, "opened": 1.0}
    again = stubs[1].Plan(plan_request(tenant, session))
    assert not again.created and again.plan.epoch == 1
    for stub in stubs:  # read again anywhere: counted already
        assert not stub.Plan(plan_request(tenant, session)).created
    assert growth(before, counted(replicas)) == stored(db, tenant)

    rotate = pb.RotateRequest(tenant_id=tenant, session_id=session,
                              reason=pb.ROTATION_REASON_OPERATOR, idempotency_key="lost")
    proxy.arm()
    with pytest.raises(grpc.RpcError) as err:
        stubs[0].Rotate(rotate)
    assert err.value.code() is grpc.StatusCode.UNAVAILABLE and proxy.dropped == 2
    retried = stubs[1].Rotate(rotate)
    assert not retried.rotated and retried.plan.epoch == 2
    assert not stubs[0].Rotate(rotate).rotated
    for stub in stubs:
        assert not stub.Plan(plan_request(tenant, session)).created
    assert stored(db, tenant) == {"session_opened": 1.0, "operator": 1.0, "opened": 1.0}
    assert growth(before, counted(replicas)) == stored(db, tenant)


def test_replicas_racing_count_each_stored_epoch_once(replicas, stubs, ids, db):
    """Twelve Plans opening one session, twelve rotating it for one reason and twelve Rotates
    of one key, each half through either replica: the counters of both, summed, move by
    exactly the epochs stored."""
    tenant, session = ids
    before = counted(replicas)
    bumped = plan_request(tenant, session)
    bumped.agent.version = "8"
    rotate = pb.RotateRequest(tenant_id=tenant, session_id=session,
                              reason=pb.ROTATION_REASON_OPERATOR, idempotency_key="race")
    errors: list[BaseException] = []

    def race(call) -> None:
        def go(i: int) -> None:
            try:
                call(stubs[i % 2])
            except BaseException as exc:  # asserted below
                errors.append(exc)
        threads = [threading.Thread(target=go, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)

    race(lambda s: s.Plan(plan_request(tenant, session), timeout=30))
    race(lambda s: s.Plan(bumped, timeout=30))
    race(lambda s: s.Rotate(rotate, timeout=30))
    assert not errors
    assert stored(db, tenant) == {"session_opened": 1.0, "agent_version_changed": 1.0,
                                  "operator": 1.0, "opened": 1.0}
    assert growth(before, counted(replicas)) == stored(db, tenant)


# --- Epochs no later call reads: counted by the maintenance cycles -------------------------
# On a database of their own: a cycle claims every old uncounted epoch of its database, which on
# the suite's shared one would be other tests' too.

SWEEP_INTERVAL = 0.5  # the second replica's maintenance cycles (the first keeps the hour's)


@contextmanager
def migrated_database(direct_database_url: str, database_url: str,
                      prefix: str) -> Iterator[str]:
    """A migrated database of the module's own, through the suite's pooler, dropped after."""
    name = run(create_database(direct_database_url, prefix))
    run(migrate(with_database(direct_database_url, name), REPO / "migrations"))
    try:
        yield with_database(database_url, name)
    finally:
        run(drop_database(direct_database_url, name))


@pytest.fixture(scope="module")
def own_url(direct_database_url: str, database_url: str) -> Iterator[str]:
    with migrated_database(direct_database_url, database_url, "ce_epoch_sweep") as url:
        yield url


@pytest.fixture(scope="module")
def own_proxy(own_url: str) -> Iterator[CommitDropProxy]:
    with closing(CommitDropProxy(own_url)) as p:
        yield p


@pytest.fixture(scope="module")
def swept(own_url: str, own_proxy: CommitDropProxy) -> Iterator[list[ServerThread]]:
    """Two replicas of the module's database: the first through the proxy, its maintenance
    cycles hourly (none sends a COMMIT the armed proxy would take for the call's); the
    second's every SWEEP_INTERVAL seconds, in its own background task."""
    servers = [ServerThread(base_config(), own_proxy.url),
               ServerThread(base_config().replace(maintenance_interval_seconds=SWEEP_INTERVAL),
                            own_url)]
    yield servers
    for s in servers:
        s.stop()


@pytest.fixture(scope="module")
def swept_stubs(swept: list[ServerThread]) -> Iterator[list[pb_grpc.ContextEngineStub]]:
    yield from stubs_of(swept)


def cycle(replicas: list[ServerThread]) -> list[Outcome]:
    """A maintenance cycle on each replica, one after the other (beside their timers')."""
    return [s.call(s.running.maintenance.run_once()) for s in replicas]


def aged(db: Db, tenant: str, interval: str = "1 hour") -> None:
    """The tenant's epochs written ``interval`` earlier (PostgreSQL's clock judges their age)."""
    db.fetch(f"UPDATE plans SET created_at = created_at - interval '{interval}' "
             "WHERE tenant_id = $1", tenant)


def uncounted(db: Db, tenant: str) -> int:
    return int(db.val("SELECT count(*) FROM plans WHERE tenant_id = $1 AND NOT counted", tenant))


def lost(stub: pb_grpc.ContextEngineStub, proxy: CommitDropProxy, call: str,
         request: object) -> None:
    """``call`` through the proxy, its COMMIT's answer lost: UNAVAILABLE, the epoch written."""
    dropped = proxy.dropped
    proxy.arm()
    with pytest.raises(grpc.RpcError) as err:
        getattr(stub, call)(request, timeout=30)
    assert err.value.code() is grpc.StatusCode.UNAVAILABLE and proxy.dropped == dropped + 1


def awaited(replicas: list[ServerThread], before: dict[str, float], want: dict[str, float],
            seconds: float = 15.0) -> dict[str, float]:
    """The counters' growth once it is ``want`` (or ``seconds`` have passed)."""
    deadline = time.monotonic() + seconds
    while (grown := growth(before, counted(replicas))) != want and time.monotonic() < deadline:
        time.sleep(0.1)
    return grown


def test_an_uncounted_epoch_no_call_reads_again_is_counted_by_a_cycle(swept, swept_stubs,
                                                                      own_proxy, own_url, ids):
    """A Plan whose COMMIT answer was lost and that nobody retries, then a keyed Rotate
    likewise: both epochs stay written and uncounted. A later Plan of the session counted only
    the epoch it reads, the current one, so the session's opening was never counted, and without
    a Plan neither was: sessions opened and epochs per session under-read for good. Now a
    maintenance cycle claims and counts each uncounted epoch older than its bound, once; one
    younger is left to its writer's retry."""
    tenant, session = ids
    db = Db(own_url)
    before = counted(swept)
    lost(swept_stubs[0], own_proxy, "Plan", plan_request(tenant, session))
    lost(swept_stubs[0], own_proxy, "Rotate", pb.RotateRequest(
        tenant_id=tenant, session_id=session, reason=pb.ROTATION_REASON_OPERATOR,
        idempotency_key="never-retried"))
    truth = {"session_opened": 1.0, "operator": 1.0, "opened": 1.0}
    assert stored(db, tenant) == truth and uncounted(db, tenant) == 2
    time.sleep(3 * SWEEP_INTERVAL)
    cycle(swept)
    assert growth(before, counted(swept)) == {}  # younger than the bound: left to a retry
    assert uncounted(db, tenant) == 2
    aged(db, tenant)
    assert awaited(swept, before, truth) == truth  # the second replica's own cycles
    assert uncounted(db, tenant) == 0
    time.sleep(3 * SWEEP_INTERVAL)
    cycle(swept)  # counted once: later cycles, Plans and the Rotate's retry count nothing
    for stub in swept_stubs:
        assert not stub.Plan(plan_request(tenant, session)).created
        assert not stub.Rotate(pb.RotateRequest(
            tenant_id=tenant, session_id=session, reason=pb.ROTATION_REASON_OPERATOR,
            idempotency_key="never-retried")).rotated
    assert growth(before, counted(swept)) == truth


def test_cycles_racing_plans_count_each_uncounted_epoch_once(swept, swept_stubs, own_proxy,
                                                             own_url):
    """Eight sessions whose opening Plan lost its COMMIT answer, an hour old: each is Planned
    again through both replicas while both run cycles (the second also on its timer), all at
    once. Whichever claim turns an epoch counts it: the counters of both, summed, move by
    exactly the epochs stored."""
    tenant = f"tenant-{uuid.uuid4().hex[:12]}"
    sessions = [f"session-{uuid.uuid4().hex[:12]}" for _ in range(8)]
    db = Db(own_url)
    for session in sessions:
        lost(swept_stubs[0], own_proxy, "Plan", plan_request(tenant, session))
    aged(db, tenant)
    before = counted(swept)
    start = threading.Barrier(2 * len(sessions) + 4)
    errors: list[BaseException] = []
    outcomes: list[Outcome] = []

    def go(work: Callable[[], object]) -> None:
        try:
            start.wait(30)
            work()
        except BaseException as exc:  # asserted below
            errors.append(exc)

    def cycles(server: ServerThread) -> None:
        for _ in range(3):
            outcomes.append(server.call(server.running.maintenance.run_once()))

    jobs: list[Callable[[], object]] = [
        *(lambda s=session, stub=stub: stub.Plan(plan_request(tenant, s), timeout=30)
          for session in sessions for stub in swept_stubs),
        *(lambda server=server: cycles(server) for server in swept for _ in range(2))]
    threads = [threading.Thread(target=go, args=(job,)) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    truth = {"session_opened": 8.0, "opened": 8.0}
    assert stored(db, tenant) == truth and uncounted(db, tenant) == 0
    time.sleep(3 * SWEEP_INTERVAL)  # the timer's cycles too
    assert growth(before, counted(swept)) == truth
    by_cycles = sum(o.epochs_counted for o in outcomes)
    assert 0 <= by_cycles <= 8


def test_a_cycle_meeting_a_claim_under_way_counts_nothing_of_it(swept, swept_stubs, own_proxy,
                                                               own_url, ids):
    """An uncounted epoch, an hour old, whose row is held (a transaction of the test's) while a
    Plan's claim waits on it and a cycle runs: the cycle leaves it to that claim, which was
    first; it does not wait for it and count the epoch again after it. Counted once."""
    tenant, _ = ids
    db = Db(own_url)

    async def hold(session: str) -> tuple[asyncpg.Connection, asyncpg.transaction.Transaction]:
        conn = await asyncpg.connect(own_url, statement_cache_size=0)
        tx = conn.transaction()
        await tx.start()
        await conn.execute("SELECT 1 FROM plans WHERE tenant_id = $1 AND session_id = $2 "
                           "FOR UPDATE", tenant, session)
        return conn, tx

    loop = asyncio.new_event_loop()
    try:
        for attempt in range(5):
            # the second replica's cycles (every SWEEP_INTERVAL) can claim the aged epoch
            # before the test holds its row: the setup is then made again, on a new session
            session = f"held-{attempt}"
            lost(swept_stubs[0], own_proxy, "Plan", plan_request(tenant, session))
            aged(db, tenant)
            before = counted(swept)
            conn, tx = loop.run_until_complete(hold(session))
            if uncounted(db, tenant) == 1:
                break
            loop.run_until_complete(tx.rollback())
            loop.run_until_complete(conn.close())
        else:
            pytest.fail("the cycles claimed the aged epoch before the test held it, 5 times")
        with ThreadPoolExecutor(2) as pool:
            plan = pool.submit(swept_stubs[1].Plan, plan_request(tenant, session), timeout=30)
            assert waiting(db, 1)  # the Plan's claim, queued on the row
            sweep = pool.submit(swept[0].call, swept[0].running.maintenance.run_once())
            waiting(db, 2, seconds=2 * SWEEP_INTERVAL + 1)  # a cycle that would wait its turn
            loop.run_until_complete(tx.commit())
            assert not plan.result(30).created
            sweep.result(30)
        loop.run_until_complete(conn.close())
    finally:
        loop.close()
    time.sleep(3 * SWEEP_INTERVAL)
    assert growth(before, counted(swept)) == {"session_opened": 1.0, "opened": 1.0}
    assert uncounted(db, tenant) == 0


def waiting(db: Db, n: int, seconds: float = 10.0) -> bool:
    """Whether ``n`` statements of the database come to wait on a lock within ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if int(db.val("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                      "AND wait_event_type = 'Lock'")) >= n:
            return True
        time.sleep(0.05)
    return False


# --- A cycle's own COMMIT answer lost ---------------------------------------------------------
# On a database of their own, both replicas' cycles hourly: only the test's cycles claim.

CLAIM = CLAIM_UNCOUNTED.encode()  # the statement of a cycle's batch, as the proxy sees it


@pytest.fixture(scope="module")
def cut_url(direct_database_url: str, database_url: str) -> Iterator[str]:
    with migrated_database(direct_database_url, database_url, "ce_epoch_cut") as url:
        yield url


@pytest.fixture(scope="module")
def cut_proxy(cut_url: str) -> Iterator[CommitDropProxy]:
    with closing(CommitDropProxy(cut_url)) as p:
        yield p


@pytest.fixture(scope="module")
def cut(cut_url: str, cut_proxy: CommitDropProxy) -> Iterator[list[ServerThread]]:
    """Two replicas of the module's second database, the first through the proxy."""
    servers = settled_by_cycles([ServerThread(base_config(), cut_proxy.url),
                                 ServerThread(base_config(), cut_url)])
    yield servers
    for s in servers:
        s.stop()


@pytest.fixture(scope="module")
def cut_stubs(cut: list[ServerThread]) -> Iterator[list[pb_grpc.ContextEngineStub]]:
    yield from stubs_of(cut)


def left_uncounted(cut: list[ServerThread], stubs: list[pb_grpc.ContextEngineStub],
                   proxy: CommitDropProxy, db: Db, n: int) -> tuple[str, dict[str, float]]:
    """A tenant of ``n`` sessions whose opening Plan lost its COMMIT answer, an hour old; the
    counters before any cycle claims them."""
    tenant = f"tenant-{uuid.uuid4().hex[:12]}"
    for _ in range(n):
        lost(stubs[0], proxy, "Plan", plan_request(tenant, f"session-{uuid.uuid4().hex[:12]}"))
    aged(db, tenant)
    assert uncounted(db, tenant) == n
    return tenant, counted(cut)


def until(check: Callable[[], bool], seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not check() and time.monotonic() < deadline:
        time.sleep(0.05)
    return check()


def test_a_batch_whose_commit_answer_was_lost_is_counted_by_the_next_cycle(cut, cut_stubs,
                                                                          cut_proxy, cut_url):
    """A cycle's batch whose COMMIT committed but whose answer was lost: the epochs were claimed
    in the database and counted in no replica's metrics, by no later cycle or Plan either
    (sessions opened short for good). Now the replica that claimed them counts them at its
    next cycle, having asked PostgreSQL whether that transaction committed; once."""
    db = Db(cut_url)
    tenant, before = left_uncounted(cut, cut_stubs, cut_proxy, db, 3)
    dropped = cut_proxy.dropped
    cut_proxy.arm(after=CLAIM)
    assert cut[0].call(cut[0].running.maintenance.attempt()) is None  # failed, logged
    assert cut_proxy.dropped == dropped + 1
    assert uncounted(db, tenant) == 0  # committed: claimed
    truth = {"session_opened": 3.0, "opened": 3.0}
    assert stored(db, tenant) == truth
    assert growth(before, counted(cut)) == {}  # not known to have committed yet
    assert cut[0].running.maintenance.unsettled == 3
    # four cycles of the replica at once (and the other's): one of them counts the batch
    first = cut[0].running.maintenance
    runs = [asyncio.run_coroutine_threadsafe(first.run_once(), cut[0].loop) for _ in range(4)]
    other = cut[1].call(cut[1].running.maintenance.run_once())
    outcomes = [r.result(60) for r in runs]
    assert sum(o.epochs_counted for o in outcomes) == 3 and other.epochs_counted == 0
    assert first.unsettled == 0
    assert growth(before, counted(cut)) == truth
    cycle(cut)  # counted once: later cycles and Plans count nothing
    for stub in cut_stubs:
        for session in db.fetch("SELECT session_id FROM plans WHERE tenant_id = $1", tenant):
            assert not stub.Plan(plan_request(tenant, session["session_id"])).created
    assert growth(before, counted(cut)) == truth


def test_a_batch_whose_commit_never_arrived_is_claimed_again(cut, cut_stubs, cut_proxy, cut_url):
    """A cycle's batch whose connection was cut before its COMMIT reached PostgreSQL: rolled
    back, so the replica that lost it counts nothing of it; the next cycle claims those epochs
    again and counts them, once."""
    db = Db(cut_url)
    tenant, before = left_uncounted(cut, cut_stubs, cut_proxy, db, 3)
    cut_proxy.arm(after=CLAIM, deliver=False)
    assert cut[0].call(cut[0].running.maintenance.attempt()) is None
    assert until(lambda: uncounted(db, tenant) == 3)  # rolled back once the server saw it go
    assert growth(before, counted(cut)) == {}
    outcomes = cycle(cut)
    assert sum(o.epochs_counted for o in outcomes) == 3
    truth = {"session_opened": 3.0, "opened": 3.0}
    assert growth(before, counted(cut)) == truth and uncounted(db, tenant) == 0
    cycle(cut)
    assert growth(before, counted(cut)) == truth


def test_a_cycle_failing_in_its_epoch_step_logs_what_it_counted(cut, cut_stubs, cut_proxy,
                                                               cut_url, caplog):
    """Batches of one epoch, the second's COMMIT answer lost: the cycle fails after counting
    the first. Its count was in no log line (the cycle's summary was skipped); now the cycle's
    ``maintenance`` line, at warning, says what it counted and what it left unsettled, and the
    next cycle's line what it counted then."""
    caplog.set_level(logging.INFO, logger="context_engine")
    db = Db(cut_url)
    tenant, before = left_uncounted(cut, cut_stubs, cut_proxy, db, 3)
    maintenance = cut[0].running.maintenance
    small = replace(maintenance, policy=replace(maintenance.policy, batch_size=1))
    cut_proxy.arm(after=CLAIM, skip=1)
    assert cut[0].call(small.attempt()) is None
    assert growth(before, counted(cut)) == {"session_opened": 1.0, "opened": 1.0}

    def lines() -> list[dict[str, object]]:
        """The first replica's maintenance lines (its loop's thread: other servers of the
        module, in this process, run cycles on their timers)."""
        found = [r for r in caplog.records
                 if r.getMessage() == "maintenance" and r.thread == cut[0].thread.ident]
        caplog.clear()
        return [dict(getattr(r, "fields", {}), level=r.levelname) for r in found]

    (failed,) = lines()
    assert failed["level"] == "WARNING" and failed["complete"] is False
    assert failed["epochs_counted"] == 1 and failed["epochs_unsettled"] == 1
    assert failed["error"] in {"ConnectionDoesNotExistError", "ConnectionResetError"}
    assert cut[0].call(small.run_once()).epochs_counted == 2  # the lost batch, then the third
    (then,) = lines()
    assert then["epochs_counted"] == 2 and then["epochs_unsettled"] == 0
    assert growth(before, counted(cut)) == {"session_opened": 3.0, "opened": 3.0}
    assert uncounted(db, tenant) == 0


# --- The writer's own claim: its answer or its COMMIT's lost ------------------------------------
# On the second database, its replicas' cycles hourly: only the test's cycles claim and settle.

WRITER_CLAIM = CLAIM_EPOCH_COUNT.encode()  # the claim of an epoch's writer, or a later Plan's


def opened(stub: pb_grpc.ContextEngineStub, proxy: CommitDropProxy, *, statement: bool = False,
           deliver: bool = True) -> tuple[str, str]:
    """A session opened through ``proxy``, whose claim of the epoch's count lost its answer
    (``statement``: the UPDATE's; otherwise its COMMIT's, delivered or not): the Plan
    answered OK all the same. Its tenant and session."""
    tenant, session = f"tenant-{uuid.uuid4().hex[:12]}", f"session-{uuid.uuid4().hex[:12]}"
    dropped = proxy.dropped
    proxy.arm(after=WRITER_CLAIM, statement=statement, deliver=deliver)
    try:
        assert stub.Plan(plan_request(tenant, session), timeout=30).created
    finally:
        proxy.disarm()
    assert proxy.dropped == dropped + 1
    return tenant, session


def test_a_writer_claim_whose_answer_was_lost_leaves_its_epoch_to_be_claimed(
        cut, cut_stubs, cut_proxy, cut_url):
    """The writer's claim ran as one autocommitted statement: PostgreSQL ran it and its answer
    was lost, so the epoch was claimed in the database and counted in no replica's metrics,
    by no later Plan or cycle either (sessions opened short for good), while the writer logged
    it deferred to them. Now the claim runs in a transaction of its own, which the lost
    connection rolls back: the epoch is uncounted still, and the next Plan to read it counts
    it (here, one session), or a cycle (the other, rotated since: a Plan reads the current
    epoch), once."""
    db = Db(cut_url)
    first = cut[0].running.maintenance
    before = counted(cut)
    read, swept = (opened(cut_stubs[0], cut_proxy, statement=True) for _ in range(2))
    for tenant, _ in (read, swept):
        assert stored(db, tenant) == {"session_opened": 1.0, "opened": 1.0}
        assert uncounted(db, tenant) == 1  # rolled back: not claimed
    assert growth(before, counted(cut)) == {} and first.unsettled == 0
    assert not cut_stubs[1].Plan(plan_request(*read), timeout=30).created
    assert growth(before, counted(cut)) == {"session_opened": 1.0, "opened": 1.0}
    assert cut_stubs[1].Rotate(pb.RotateRequest(
        tenant_id=swept[0], session_id=swept[1], reason=pb.ROTATION_REASON_OPERATOR,
        idempotency_key="after-the-lost-claim"), timeout=30).rotated
    for stub in cut_stubs:
        assert not stub.Plan(plan_request(*swept), timeout=30).created
    assert uncounted(db, swept[0]) == 1  # the opening: no call reads it again
    aged(db, swept[0])
    assert sum(o.epochs_counted for o in cycle(cut)) == 1
    cycle(cut)
    assert growth(before, counted(cut)) == {"session_opened": 2.0, "opened": 2.0,
                                            "operator": 1.0}
    assert uncounted(db, read[0]) == 0 and uncounted(db, swept[0]) == 0


def test_a_writer_claim_whose_commit_answer_was_lost_is_counted_by_the_next_cycle(
        cut, cut_stubs, cut_proxy, cut_url, caplog):
    """The writer's claim committed and its COMMIT's answer was lost: the epoch is claimed, so
    no later Plan or cycle claims it, and its writer does not know whether it counts it. The
    writer's process keeps the claim's transaction id: its next cycle asks PostgreSQL whether
    it committed and counts the epoch, once, whichever cycles run at once."""
    caplog.set_level(logging.INFO, logger="context_engine")
    db = Db(cut_url)
    first = cut[0].running.maintenance
    before = counted(cut)
    tenant, session = opened(cut_stubs[0], cut_proxy)
    assert uncounted(db, tenant) == 0  # committed: claimed
    assert [getattr(r, "fields", {}).get("tenant") for r in caplog.records
            if r.getMessage() == "epoch_count_unsettled"] == [tenant]
    assert first.unsettled == 1 and growth(before, counted(cut)) == {}
    for stub in cut_stubs:  # claimed: a later Plan counts nothing
        assert not stub.Plan(plan_request(tenant, session), timeout=30).created
    assert growth(before, counted(cut)) == {}
    runs = [asyncio.run_coroutine_threadsafe(first.run_once(), cut[0].loop) for _ in range(4)]
    other = cut[1].call(cut[1].running.maintenance.run_once())
    assert sum(r.result(60).epochs_counted for r in runs) == 1 and other.epochs_counted == 0
    truth = {"session_opened": 1.0, "opened": 1.0}
    assert first.unsettled == 0 and growth(before, counted(cut)) == truth
    cycle(cut)
    for stub in cut_stubs:
        assert not stub.Plan(plan_request(tenant, session), timeout=30).created
    assert growth(before, counted(cut)) == truth == stored(db, tenant)


def test_a_writer_claim_whose_commit_never_arrived_is_claimed_again(cut, cut_stubs, cut_proxy,
                                                                   cut_url):
    """The writer's claim whose COMMIT never reached PostgreSQL: rolled back, the epoch
    uncounted. The next Plan to read it counts it; the cycle that settles the lost claim
    counts nothing of it."""
    db = Db(cut_url)
    first = cut[0].running.maintenance
    before = counted(cut)
    tenant, session = opened(cut_stubs[0], cut_proxy, deliver=False)
    assert until(lambda: uncounted(db, tenant) == 1)  # rolled back once the server saw it go
    assert first.unsettled == 1
    assert not cut_stubs[1].Plan(plan_request(tenant, session), timeout=30).created
    truth = {"session_opened": 1.0, "opened": 1.0}
    assert growth(before, counted(cut)) == truth
    assert sum(o.epochs_counted for o in cycle(cut)) == 0
    assert first.unsettled == 0
    cycle(cut)
    assert growth(before, counted(cut)) == truth == stored(db, tenant)


def _logged(caplog: pytest.LogCaptureFixture, message: str) -> list[dict[str, object]]:
    """The fields of the lines logged as ``message``, which are then forgotten."""
    found = [dict(getattr(r, "fields", {})) for r in caplog.records if r.getMessage() == message]
    caplog.clear()
    return found


async def _away() -> None:
    raise ConnectionResetError("the database went away")


@pytest.mark.parametrize("first_pass", ["answered", "away"])
def test_a_writer_claim_whose_commit_answer_was_lost_is_counted_seconds_later(
        cut_url, cut_proxy, caplog, first_pass):
    """The writer's claim committed and its COMMIT answer was lost: its replica settles it by
    a pass of its own a few seconds (``settle_after_seconds``) after it was kept, counting the
    epoch once, without waiting for the next maintenance cycle (an hour by default). A pass
    that finds the database away (logged ``epoch_count_settle_failed``) is tried again, twice
    as late, and the epoch is counted once all the same."""
    caplog.set_level(logging.INFO, logger="context_engine")
    db = Db(cut_url)
    server = ServerThread(base_config(), cut_proxy.url)
    try:
        maintenance = server.running.maintenance
        maintenance.settle_after_seconds = 0.2
        cycles = maintenance.cycles
        if first_pass == "away":
            maintenance.pool = _BeforeStatus(maintenance.pool, _away)
        (stub,) = next(stubs_gen := stubs_of([server]))
        before = counted([server])
        tenant, _ = opened(stub, cut_proxy)
        truth = {"session_opened": 1.0, "opened": 1.0}
        assert until(lambda: growth(before, counted([server])) == truth, 3.0)
        assert maintenance.unsettled == 0 and maintenance.cycles == cycles  # no cycle ran
        settled = ("epoch_count_settled", {"epochs_counted": 1, "epochs_unsettled": 0})
        failed = ("epoch_count_settle_failed", {"error": "ConnectionResetError",
                                                "epochs_counted": 0, "epochs_unsettled": 1})
        assert [(r.getMessage(), dict(getattr(r, "fields", {}))) for r in caplog.records
                if r.getMessage().startswith("epoch_count_settle")] == (
            [settled] if first_pass == "answered" else [failed, settled])
        caplog.clear()
        assert stored(db, tenant) == truth
        time.sleep(0.4)  # nothing counted twice by a later pass
        assert growth(before, counted([server])) == truth
        next(stubs_gen, None)
    finally:
        server.stop()
    assert growth(before, counted([server])) == truth and _logged(caplog, "epoch_count_lost") == []


def test_a_claim_kept_while_another_waits_in_progress_is_settled_seconds_later_too(
        cut_url, cut_proxy, caplog):
    """A claim still in progress is asked about again by passes each twice as late as the one
    before; a claim kept meanwhile keeps its own pass, ``settle_after_seconds`` after it, not
    the next of that one's, however late that has grown."""
    caplog.set_level(logging.INFO, logger="context_engine")
    db = Db(cut_url)
    server = ServerThread(base_config(), cut_proxy.url)
    loop = asyncio.new_event_loop()
    try:
        maintenance = server.running.maintenance
        maintenance.settle_after_seconds = 0.1
        conn = loop.run_until_complete(asyncpg.connect(cut_url, statement_cache_size=0))
        tx = conn.transaction()
        loop.run_until_complete(tx.start())
        xid = loop.run_until_complete(conn.fetchval("SELECT pg_current_xact_id()::text"))
        maintenance.keep(str(xid), str(uuid.uuid4()), (
            ClaimedEpoch(f"tenant-{uuid.uuid4().hex[:12]}", "session", 1, "operator", 100),))

        def passes() -> int:
            return sum(r.getMessage() == "epoch_count_settled" for r in caplog.records)

        # passes 0.1 s after the keep, then 0.2, 0.4, 0.8 and 1.6 s apart: the next 3.2 s on
        assert until(lambda: passes() >= 5, 10.0)
        (stub,) = next(stubs_gen := stubs_of([server]))
        before = counted([server])
        tenant, _ = opened(stub, cut_proxy)
        truth = {"session_opened": 1.0, "opened": 1.0}
        assert until(lambda: growth(before, counted([server])) == truth, 1.5)
        assert maintenance.unsettled == 1 and stored(db, tenant) == truth  # the first, waiting
        next(stubs_gen, None)
        loop.run_until_complete(tx.rollback())
        loop.run_until_complete(conn.close())
    finally:
        loop.close()
        server.stop()


def test_a_stop_settles_the_claims_it_holds_and_logs_lost_only_what_it_cannot(
        cut_url, cut_proxy, caplog):
    """A replica stopped before any pass or cycle settled its writer's claim whose COMMIT
    answer was lost settles it as it stops: the epoch is counted, nothing logged lost. A claim
    whose transaction is still in progress at the stop, or whose settling does not answer
    within ``stop_settle_seconds`` (the stop waits no longer), is logged lost, as is one handed
    over once its cycles have stopped (a call finishing as the server stops)."""
    caplog.set_level(logging.INFO, logger="context_engine")
    db = Db(cut_url)
    server = settled_by_cycles([ServerThread(base_config(), cut_proxy.url)])[0]
    try:
        (stub,) = next(stubs_gen := stubs_of([server]))
        before = counted([server])
        tenant, _ = opened(stub, cut_proxy)
        assert server.running.maintenance.unsettled == 1
        next(stubs_gen, None)
    finally:
        server.stop()
    truth = {"session_opened": 1.0, "opened": 1.0}
    assert growth(before, counted([server])) == truth == stored(db, tenant)
    assert _logged(caplog, "epoch_count_lost") == []

    # in progress at the stop: kept, so lost
    server = settled_by_cycles([ServerThread(base_config(), cut_url)])[0]
    loop = asyncio.new_event_loop()
    try:
        conn = loop.run_until_complete(asyncpg.connect(cut_url, statement_cache_size=0))
        tx = conn.transaction()
        loop.run_until_complete(tx.start())
        xid = loop.run_until_complete(conn.fetchval("SELECT pg_current_xact_id()::text"))
        server.running.maintenance.keep(str(xid), str(uuid.uuid4()), (
            ClaimedEpoch(tenant, "session", 2, "operator", 100),))
        server.stop()
        loop.run_until_complete(tx.rollback())
        loop.run_until_complete(conn.close())
    finally:
        loop.close()
    assert _logged(caplog, "epoch_count_lost") == [{"epochs": 1, "reason": "process_stopped"}]
    server.running.maintenance.keep("7", str(uuid.uuid4()),
                                    (ClaimedEpoch("tenant", "session", 2, "operator", 100),))
    assert _logged(caplog, "epoch_count_lost") == [
        {"epochs": 1, "reason": "process_stopped", "xid": "7"}]

    # its settling unanswered: the stop waits stop_settle_seconds for it, then logs it lost
    server = settled_by_cycles([ServerThread(base_config(), cut_url)])[0]
    maintenance = server.running.maintenance
    maintenance.stop_settle_seconds = 0.5
    maintenance.pool = _BeforeStatus(maintenance.pool, lambda: asyncio.sleep(30))
    maintenance.keep("8", str(uuid.uuid4()), (ClaimedEpoch(tenant, "session", 3, "operator", 100),))
    started = time.monotonic()
    server.stop()
    assert time.monotonic() - started < 5.0
    assert maintenance.pool.ran
    assert _logged(caplog, "epoch_count_lost") == [{"epochs": 1, "reason": "process_stopped"}]

    # its settling fails with what no database outage raises (a defect): logged, and the
    # stop goes on to close what follows (its buffered events written)
    server = settled_by_cycles([ServerThread(base_config(), cut_url)])[0]
    maintenance = server.running.maintenance

    async def defect() -> None:
        raise asyncpg.InternalClientError("cannot switch to state 11")

    maintenance.pool = _BeforeStatus(maintenance.pool, defect)
    maintenance.keep("9", str(uuid.uuid4()), (ClaimedEpoch(tenant, "session", 4, "operator", 100),))
    server.stop()
    assert maintenance.pool.ran and server.running.pool.is_closing()
    assert _logged(caplog, "maintenance_failed") == [{"error": "InternalClientError"}]


def claimed_in_a_transaction(run: Callable[[Any], Any], url: str, tenant: str, session: str,
                             claim: str) -> tuple[Any, Any, str]:
    """The session's first epoch claimed (counted, ``claim`` written in its row) by a
    transaction left open on a connection of its own, each step awaited by ``run``: (the
    connection, the transaction, its id)."""
    conn = run(asyncpg.connect(url, statement_cache_size=0))
    tx = conn.transaction()
    run(tx.start())
    xid = run(conn.fetchval(
        "UPDATE plans SET counted = true, count_claim = $3::uuid WHERE tenant_id = $1 "
        "AND session_id = $2 AND epoch = 1 RETURNING pg_current_xact_id()::text",
        tenant, session, claim))
    return conn, tx, str(xid)


def test_a_claim_still_in_progress_is_settled_once_it_has_ended(cut, cut_stubs, cut_proxy,
                                                                cut_url):
    """A claim whose COMMIT answer was lost is settled by its rows, which read as before it
    while its transaction runs: a cycle meeting it in progress keeps it, and the cycle after
    its COMMIT counts its epoch, once (taken for lost while it ran, it was never counted)."""
    db = Db(cut_url)
    first = cut[0].running.maintenance
    tenant, session = f"tenant-{uuid.uuid4().hex[:12]}", f"session-{uuid.uuid4().hex[:12]}"
    lost(cut_stubs[0], cut_proxy, "Plan", plan_request(tenant, session))
    before = counted(cut)
    prefix = int(db.val("SELECT prefix_tokens FROM plans WHERE tenant_id = $1", tenant))
    claim = str(uuid.uuid4())
    loop = asyncio.new_event_loop()
    try:
        conn, tx, xid = claimed_in_a_transaction(loop.run_until_complete, cut_url, tenant,
                                                 session, claim)
        first.keep(xid, claim, (ClaimedEpoch(tenant, session, 1, "session_opened", prefix),))
        assert sum(o.epochs_counted for o in cycle(cut)) == 0
        assert first.unsettled == 1 and growth(before, counted(cut)) == {}
        loop.run_until_complete(tx.commit())
        loop.run_until_complete(conn.close())
    finally:
        loop.close()
    assert sum(o.epochs_counted for o in cycle(cut)) == 1
    truth = {"session_opened": 1.0, "opened": 1.0}
    assert first.unsettled == 0 and growth(before, counted(cut)) == truth
    cycle(cut)
    assert growth(before, counted(cut)) == truth == stored(db, tenant)


class _BeforeStatus:
    """The maintenance pool, but for one thing: just before a connection of it asks
    PostgreSQL for a transaction's status (XACT_STATUS), ``before`` is awaited, once (a
    commit of the claim's transaction, or a wait that outlasts the stop)."""

    def __init__(self, pool: Any, before: Callable[[], Any]) -> None:
        self._pool, self._before, self.ran = pool, before, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)

    @asynccontextmanager
    async def acquire(self) -> AsyncIterator[Any]:
        async with self._pool.acquire() as conn:
            yield _StatusHooked(conn, self)


class _StatusHooked:
    def __init__(self, conn: Any, pool: _BeforeStatus) -> None:
        self._conn, self._pool = conn, pool

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)

    async def fetchval(self, query: str, *args: Any) -> Any:
        if query == XACT_STATUS and not self._pool.ran:
            self._pool.ran = True
            await self._pool._before()
        return await self._conn.fetchval(query, *args)


def test_a_claim_committing_as_it_is_settled_is_counted_once(cut, cut_stubs, cut_proxy,
                                                             cut_url):
    """A claim whose COMMIT answer was lost commits while a cycle settles it, just before the
    cycle asks its status: the status says committed, and its rows, read after the status,
    show the claim: its epoch is counted, once. (Its rows read before the status would show
    no claim yet, and the epoch, claimed by a committed transaction, would never be counted.)"""
    db = Db(cut_url)
    first_server = cut[0]
    first = first_server.running.maintenance
    tenant, session = f"tenant-{uuid.uuid4().hex[:12]}", f"session-{uuid.uuid4().hex[:12]}"
    lost(cut_stubs[0], cut_proxy, "Plan", plan_request(tenant, session))
    before = counted(cut)
    prefix = int(db.val("SELECT prefix_tokens FROM plans WHERE tenant_id = $1", tenant))
    claim = str(uuid.uuid4())
    # the claim's connection on the replica's own loop, where its cycle will commit it
    conn, tx, xid = claimed_in_a_transaction(first_server.call, cut_url, tenant, session, claim)
    first.keep(xid, claim, (ClaimedEpoch(tenant, session, 1, "session_opened", prefix),))
    pool = first.pool
    hooked = _BeforeStatus(pool, tx.commit)
    first.pool = hooked
    try:
        outcomes = cycle(cut)
    finally:
        first.pool = pool
        first_server.call(conn.close())
    assert hooked.ran  # committed by the cycle, just before it asked the status
    assert db.val("SELECT count_claim::text FROM plans WHERE tenant_id = $1", tenant) == claim
    assert sum(o.epochs_counted for o in outcomes) == 1
    truth = {"session_opened": 1.0, "opened": 1.0}
    assert first.unsettled == 0 and growth(before, counted(cut)) == truth
    cycle(cut)
    assert growth(before, counted(cut)) == truth == stored(db, tenant)


def test_a_claim_whose_session_was_erased_since_is_counted_if_it_committed(
        cut, cut_stubs, cut_proxy, cut_url):
    """The writer's claim committed and its COMMIT answer was lost, then its session was
    erased: no row shows the claim any more, and the transaction's status decides. It
    committed: the epoch is counted, once."""
    first = cut[0].running.maintenance
    before = counted(cut)
    tenant, session = opened(cut_stubs[0], cut_proxy)
    assert first.unsettled == 1
    assert cut_stubs[1].DeleteSession(pb.DeleteSessionRequest(
        tenant_id=tenant, session_id=session), timeout=30).deleted
    assert sum(o.epochs_counted for o in cycle(cut)) == 1
    truth = {"session_opened": 1.0, "opened": 1.0}
    assert first.unsettled == 0 and growth(before, counted(cut)) == truth
    cycle(cut)
    assert growth(before, counted(cut)) == truth
