"""PostgreSQL goes away mid-load and comes back, under a real server and a real database.

While it is away: Build keeps serving sessions whose plans are cached (their pressure events
wait in the outbox), the writing RPCs answer UNAVAILABLE quickly, a process with nothing cached
reports NOT_SERVING. When it returns: the pool recovers without a restart, the outbox drains,
callers retry with their idempotency keys, and every acknowledged write is present exactly
once: no epoch lost or duplicated.

Every Build names its call in its first item's id (``<tag>.u0``), an item that is always cut
from the history under the small window, so the call's ``context.budget.pressure`` event names
it (in its step's ids, or as the first of a step of more than 64): each acknowledged Build,
and above all each one acknowledged while the database was away (its event waited in the
outbox), is matched to its event in ``context_events`` afterwards, exactly once, with the same
steps the caller was told; no event names a call that was not acknowledged.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import statistics
import tempfile
import threading
import time
import uuid
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import psutil
import pytest
from context_engine.adapters.postgres.migrate import migrate
from context_engine.v1 import context_engine_pb2 as pb
from context_engine.v1 import context_engine_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.conftest import Db, ServerThread, run
from tests.conftest import test_config as base_config
from tests.integration.requests import build_request, plan_request
from tests.integration.test_budget_rpc import SMALL, long_history

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration


class Database:
    """An embedded PostgreSQL of its own that the test can crash and restart."""

    def __init__(self) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from pgserver import get_server
        self.tmp = Path(tempfile.mkdtemp(prefix="ce-fault-pg-"))
        self.server = get_server(self.tmp / "pg", cleanup_mode="stop")
        self.url = str(self.server.get_uri())
        run(migrate(self.url, REPO / "migrations"))

    def crash(self) -> None:
        """Immediate shutdown (SIGQUIT to the postmaster, what ``pg_ctl -m immediate`` sends):
        every backend exits at once and every connection is cut, like a crash."""
        pid = self.server.get_pid()
        assert pid is not None
        os.kill(pid, signal.SIGQUIT)
        deadline = time.monotonic() + 30
        while _alive(pid):
            assert time.monotonic() < deadline, "PostgreSQL did not stop"
            time.sleep(0.05)

    def restart(self) -> None:
        with self.server._lock:
            self.server.ensure_postgres_running()
        assert str(self.server.get_uri()) == self.url

    def close(self) -> None:
        self.server.cleanup()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(scope="module")
def database() -> Iterator[Database]:
    db = Database()
    yield db
    db.close()


@dataclass(frozen=True)
class AckedBuild:
    """A Build the server answered OK: which call, when (monotonic seconds), and the pressure
    steps it reported."""

    tag: str
    session: str
    epoch: int
    started: float
    answered: float
    during_outage: bool  # sent after the crash and answered before the restart began
    steps: tuple[tuple[str, tuple[str, ...]], ...]  # (step, item ids)


def tagged_build(base: pb.BuildRequest, session: str, tag: str) -> pb.BuildRequest:
    """``base`` for ``session``, its first item's id naming the call."""
    req = pb.BuildRequest()
    req.CopyFrom(base)
    req.session_id = session
    first = req.checkpoint.items[0]
    first.id = f"{tag}.{first.id}"
    return req


def call_tag(item_ids: list[str]) -> str | None:
    """The call a pressure event (or answer) belongs to, from its tagged item id."""
    tags = {i.split(".", 1)[0] for i in item_ids if "." in i}
    assert len(tags) <= 1, tags
    return next(iter(tags), None)


def as_recorded(ids: tuple[str, ...]) -> tuple[object, ...]:
    """A step's ids as its pressure event records them: listed up to 64, else their count,
    ends and the SHA-256 of the JSON array (computed here, not by the service's code)."""
    if len(ids) <= 64:
        return ids
    text = json.dumps(list(ids), separators=(",", ":"), ensure_ascii=False)
    return (len(ids), ids[0], ids[-1], hashlib.sha256(text.encode()).hexdigest())


def recorded_ids(step: dict[str, object]) -> tuple[object, ...]:
    if "item_ids" in step:
        return tuple(step["item_ids"])  # type: ignore[arg-type]
    return (step["item_count"], step["first_item_id"], step["last_item_id"],
            step["item_ids_sha256"])


@dataclass
class Ledger:
    """What callers were told, and what they still have to retry."""

    epochs: dict[str, list[int]] = field(default_factory=dict)  # session -> acked epochs
    rotate_keys: dict[str, tuple[str, int]] = field(default_factory=dict)  # key -> (session, epoch)
    report_keys: set[str] = field(default_factory=set)
    retry_rotates: list[tuple[str, str]] = field(default_factory=list)  # (session, key)
    retry_reports: list[tuple[str, str]] = field(default_factory=list)
    codes: Counter[str] = field(default_factory=Counter)
    unavailable_seconds: list[float] = field(default_factory=list)
    outage_builds: int = 0
    outage_pressure_builds: int = 0
    builds: dict[str, AckedBuild] = field(default_factory=dict)  # tag -> acknowledged Build
    failed_builds: set[str] = field(default_factory=set)  # tags answered with an error
    crashed_at: float = float("inf")  # monotonic
    lock: threading.Lock = field(default_factory=threading.Lock)


def report(tenant: str, session: str, key: str) -> pb.ReportUsageRequest:
    return pb.ReportUsageRequest(tenant_id=tenant, session_id=session,
                                 estimated_input_tokens=5000, estimator_factor=1.0,
                                 input_tokens=5000, cached_tokens=500, output_tokens=10,
                                 idempotency_key=key)


def rotate(tenant: str, session: str, key: str) -> pb.RotateRequest:
    return pb.RotateRequest(tenant_id=tenant, session_id=session,
                            reason=pb.ROTATION_REASON_OPERATOR, idempotency_key=key)


def test_database_outage_mid_load(database: Database) -> None:
    config = base_config()
    srv = ServerThread(config, database.url)
    cold = ServerThread(config, database.url)  # caches nothing: it cannot serve while down
    db = Db(database.url)
    tenant = f"tenant-{uuid.uuid4().hex[:8]}"
    channel = grpc.insecure_channel(srv.address)
    stub = pb_grpc.ContextEngineStub(channel)
    health = health_pb2_grpc.HealthStub(channel)
    cold_health = health_pb2_grpc.HealthStub(grpc.insecure_channel(cold.address))
    ledger = Ledger()
    down = threading.Event()
    stop = threading.Event()
    try:
        # sessions whose plans this process has cached (Plan caches what it pins)
        cached = [f"s-{i}" for i in range(6)]
        for session in cached:
            plan = stub.Plan(plan_request(tenant, session, model=SMALL)).plan
            ledger.epochs[session] = [plan.epoch]
        pressure_req = build_request(tenant, "", items=long_history(40))
        pressure_req.checkpoint.active_run_id = "run-1"

        def worker(index: int) -> None:
            n = 0
            while not stop.is_set():
                n += 1
                session = cached[(index + n) % len(cached)]
                op = n % 4
                started = time.perf_counter()
                try:
                    if op == 0:
                        fresh = f"new-{index}-{n}"
                        plan = stub.Plan(plan_request(tenant, fresh, model=SMALL), timeout=10).plan
                        with ledger.lock:
                            ledger.epochs[fresh] = [plan.epoch]
                    elif op == 1:
                        key = f"rot-{index}-{n}"
                        try:
                            resp = stub.Rotate(rotate(tenant, session, key), timeout=10)
                        except grpc.RpcError:
                            with ledger.lock:
                                ledger.retry_rotates.append((session, key))
                            raise
                        with ledger.lock:
                            ledger.rotate_keys[key] = (session, resp.plan.epoch)
                            ledger.epochs[session].append(resp.plan.epoch)
                    elif op == 2:
                        key = f"use-{index}-{n}"
                        try:
                            stub.ReportUsage(report(tenant, session, key), timeout=10)
                        except grpc.RpcError:
                            with ledger.lock:
                                ledger.retry_reports.append((session, key))
                            raise
                        with ledger.lock:
                            ledger.report_keys.add(key)
                    else:
                        tag = f"b{index}-{n}"
                        req = tagged_build(pressure_req, session, tag)
                        was_down = down.is_set()
                        sent = time.monotonic()
                        try:
                            resp = stub.Build(req, timeout=10)
                        except grpc.RpcError:
                            with ledger.lock:
                                ledger.failed_builds.add(tag)
                            raise
                        during = was_down and down.is_set()
                        acked = AckedBuild(
                            tag=tag, session=session, epoch=resp.epoch,
                            started=sent, answered=time.monotonic(),
                            during_outage=during,
                            steps=tuple((s.step, tuple(s.item_ids))
                                        for s in resp.pressure.steps))
                        with ledger.lock:
                            ledger.builds[tag] = acked
                            if during:
                                ledger.outage_builds += 1
                                ledger.outage_pressure_builds += bool(resp.pressure.steps)
                    with ledger.lock:
                        ledger.codes["OK"] += 1
                except grpc.RpcError as err:
                    code = err.code().name
                    with ledger.lock:
                        ledger.codes[code] += 1
                        if code == "UNAVAILABLE":
                            ledger.unavailable_seconds.append(time.perf_counter() - started)
                    if code != "UNAVAILABLE":
                        raise
                    time.sleep(0.05)

        errors: list[BaseException] = []

        def guarded(index: int) -> None:
            try:
                worker(index)
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=guarded, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        time.sleep(2.0)
        ok_before = ledger.codes["OK"]
        ledger.crashed_at = time.monotonic()
        database.crash()
        down.set()
        time.sleep(4.0)  # health watchers run every second
        during_ok_cold = cold_health.Check(health_pb2.HealthCheckRequest(), timeout=2).status
        during_ok = health.Check(health_pb2.HealthCheckRequest(), timeout=2).status
        down.clear()
        database.restart()
        recovered_at = time.monotonic()
        # the pool recovers by itself: the next Plan of a new session succeeds soon
        while True:
            try:
                stub.Plan(plan_request(tenant, "after-restart", model=SMALL), timeout=5)
                break
            except grpc.RpcError as err:
                assert err.code() is grpc.StatusCode.UNAVAILABLE
                assert time.monotonic() - recovered_at < 30, "the pool never recovered"
                time.sleep(0.2)
        recovery_seconds = time.monotonic() - recovered_at
        time.sleep(2.0)  # load continues on the recovered database
        stop.set()
        for t in threads:
            t.join(30)
        assert not errors, errors
        assert ok_before > 0 and ledger.codes["OK"] > ok_before

        # while it was away
        assert ledger.outage_builds > 0, "no Build was served from the plan cache"
        assert ledger.outage_pressure_builds > 0
        assert ledger.codes["UNAVAILABLE"] > 0
        assert max(ledger.unavailable_seconds) < 2.0, max(ledger.unavailable_seconds)
        assert statistics.median(ledger.unavailable_seconds) < 0.5
        assert during_ok == health_pb2.HealthCheckResponse.SERVING
        assert during_ok_cold == health_pb2.HealthCheckResponse.NOT_SERVING
        assert recovery_seconds < 30
        deadline = time.monotonic() + 10
        while (cold_health.Check(health_pb2.HealthCheckRequest(), timeout=2).status
               != health_pb2.HealthCheckResponse.SERVING):
            assert time.monotonic() < deadline, "the cold process never came back to SERVING"
            time.sleep(0.2)

        # callers retry what failed, with the same keys
        for session, key in ledger.retry_rotates:
            try:
                resp = stub.Rotate(rotate(tenant, session, key), timeout=10)
            except grpc.RpcError as err:
                stored = db.fetch("SELECT rpc, response::text FROM idempotency_keys "
                                  "WHERE tenant_id=$1 AND key=$2", tenant, key)
                raise AssertionError(f"retry of {key} on {session} failed: {err.code()} "
                                     f"{err.details()}; stored: {stored}") from err
            ledger.rotate_keys[key] = (session, resp.plan.epoch)
            ledger.epochs[session].append(resp.plan.epoch)
        for session, key in ledger.retry_reports:
            stub.ReportUsage(report(tenant, session, key), timeout=10)
            ledger.report_keys.add(key)
        # the outbox drains within a few retry intervals
        deadline = time.monotonic() + 10
        while srv.running.events.pending:
            assert time.monotonic() < deadline, "buffered events were never written"
            time.sleep(0.2)

        # every acknowledged write is present, exactly once
        rows = db.fetch("SELECT session_id, epoch, prefix_sha256 FROM plans "
                        "WHERE tenant_id=$1", tenant)
        stored: dict[str, list[int]] = {}
        for row in rows:
            stored.setdefault(row["session_id"], []).append(row["epoch"])
        for session, acked in ledger.epochs.items():
            epochs = sorted(stored[session])
            assert epochs == list(range(1, len(epochs) + 1)), (session, epochs)
            assert set(acked) <= set(epochs), (session, acked, epochs)
            rotations = sum(1 for s, _ in ledger.rotate_keys.values() if s == session)
            assert len(epochs) == 1 + rotations, (session, epochs, rotations)
        assert len({e for e in ledger.rotate_keys.values()}) == len(ledger.rotate_keys)
        claimed = {r["key"] for r in db.fetch(
            "SELECT key FROM idempotency_keys WHERE tenant_id=$1 AND rpc='ReportUsage'",
            tenant)}
        assert ledger.report_keys <= claimed
        reports = db.val("SELECT sum(reports) FROM estimator_calibration WHERE tenant_id=$1",
                         tenant)
        assert reports == len(claimed)
        assert srv.running.events.dropped == 0
        # every acknowledged Build's pressure event is stored exactly once, as the caller was
        # told it; none is stored for a call that was not acknowledged
        events: dict[str | None, list[dict[str, object]]] = {}
        for row in db.fetch("SELECT session_id, epoch, payload::text AS payload "
                            "FROM context_events WHERE tenant_id=$1 AND "
                            "type='context.budget.pressure'", tenant):
            payload = json.loads(row["payload"])
            ids = [i for step in payload["steps"]
                   for i in step.get("item_ids", [step.get("first_item_id")])]
            events.setdefault(call_tag(ids), []).append(
                {"session": row["session_id"], "epoch": row["epoch"],
                 "steps": tuple((st["step"], recorded_ids(st)) for st in payload["steps"])})
        outage = [b for b in ledger.builds.values() if b.during_outage]
        assert outage, "no Build was acknowledged while the database was away"
        assert all(b.steps for b in outage), "a Build served while down reported no pressure"
        expected = {tag: b for tag, b in ledger.builds.items() if b.steps}
        for tag, build in expected.items():
            named = call_tag([i for _, ids in build.steps for i in ids])
            assert named == tag, f"the answer to {tag} names {named!r}: {build.steps}"
        missing = sorted(t for t in expected if not events.get(t))
        doubled = sorted(t for t in expected if len(events.get(t, [])) > 1)
        invented = sorted(str(t) for t in events if t not in expected)
        lost_in_outage = [t for t in missing if expected[t].during_outage]
        assert not missing, (
            f"{len(missing)} of {len(expected)} acknowledged Builds have no pressure event "
            f"({len(lost_in_outage)} of the {len(outage)} acknowledged during the outage): "
            + ", ".join(f"{t} (answered {expected[t].answered - ledger.crashed_at:+.2f} s "
                        "from the crash)" for t in missing[:10]))
        assert not doubled, f"pressure events stored twice: {doubled[:10]}"
        assert not invented, (f"pressure events for calls not acknowledged: {invented[:10]} "
                              f"(failed Builds: {sorted(ledger.failed_builds)[:10]})")
        for tag, build in expected.items():
            (stored,) = events[tag]
            assert stored == {"session": build.session, "epoch": build.epoch,
                              "steps": tuple((step, as_recorded(ids))
                                             for step, ids in build.steps)}, (tag, stored,
                                                                              build)
        print(f"\noutage: {dict(ledger.codes)}; builds served while down "
              f"{ledger.outage_builds}, each of their pressure events found once (of "
              f"{len(expected)} acknowledged Builds, all found once); UNAVAILABLE answered in max "
              f"{max(ledger.unavailable_seconds) * 1000:.0f} ms (median "
              f"{statistics.median(ledger.unavailable_seconds) * 1000:.0f} ms); pool recovered "
              f"{recovery_seconds:.1f} s after restart; {len(ledger.rotate_keys)} rotations, "
              f"{len(ledger.retry_rotates)} retried after the outage")
    finally:
        stop.set()
        channel.close()
        srv.stop()
        cold.stop()

