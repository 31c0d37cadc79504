"""Several real server processes on the suite's database: concurrent Plan, restarts, busy and
unbindable addresses, graceful stop on SIGTERM (those on embedded PostgreSQL are in
``test_processes_embedded.py``)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import grpc
import pytest
from context_engine.v1 import context_engine_pb2 as pb
from context_engine.v1 import context_engine_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.integration.processes import ServerProcess
from tests.integration.requests import build_request, plan_request

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def two_servers(database_url):
    servers = [ServerProcess({"DATABASE_URL": database_url}) for _ in range(2)]
    yield servers
    for s in servers:
        assert s.terminate() == 0


def test_concurrent_plans_from_two_processes_create_exactly_one_epoch(two_servers, db):
    stubs = [pb_grpc.ContextEngineStub(grpc.insecure_channel(s.address)) for s in two_servers]
    tenant = f"tenant-{uuid.uuid4().hex[:10]}"
    sessions = [f"race-{i}" for i in range(8)]
    results: list[tuple[str, pb.PlanResponse]] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(16)

    def call(stub, session):
        try:
            barrier.wait(10)
            results.append((session, stub.Plan(plan_request(tenant, session), timeout=30)))
        except BaseException as exc:  # collected and asserted below
            errors.append(exc)

    for session in sessions:
        threads = [threading.Thread(target=call, args=(stubs[i % 2], session))
                   for i in range(16)]
        barrier.reset()
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert not errors, errors
    assert len(results) == 16 * len(sessions)
    for session in sessions:
        answers = [r for s, r in results if s == session]
        assert sum(r.created for r in answers) == 1
        assert {r.plan.epoch for r in answers} == {1}
        assert len({r.plan.prefix_sha256 for r in answers}) == 1
    rows = db.fetch("SELECT session_id, count(*) AS n FROM plans WHERE tenant_id=$1 "
                    "GROUP BY session_id", tenant)
    assert {r["session_id"]: r["n"] for r in rows} == dict.fromkeys(sessions, 1)
    events = db.val("SELECT count(*) FROM context_events WHERE tenant_id=$1", tenant)
    assert events == len(sessions)


def test_concurrent_rotations_from_two_processes_never_skip_or_duplicate(two_servers, db):
    stubs = [pb_grpc.ContextEngineStub(grpc.insecure_channel(s.address)) for s in two_servers]
    tenant = f"tenant-{uuid.uuid4().hex[:10]}"
    stubs[0].Plan(plan_request(tenant, "rotating"))
    errors: list[BaseException] = []
    barrier = threading.Barrier(12)

    def go(i: int) -> None:
        try:
            barrier.wait(10)
            stubs[i % 2].Rotate(pb.RotateRequest(
                tenant_id=tenant, session_id="rotating", reason=pb.ROTATION_REASON_OPERATOR,
                idempotency_key=f"key-{i % 4}"), timeout=30)
        except BaseException as exc:  # asserted below
            errors.append(exc)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    epochs = [r["epoch"] for r in db.fetch(
        "SELECT epoch FROM plans WHERE tenant_id=$1 ORDER BY epoch", tenant)]
    assert epochs == [1, 2, 3, 4, 5]  # one per distinct key, none skipped or repeated
    assert db.val("SELECT count(*) FROM context_events WHERE tenant_id=$1 AND "
                  "type='context.epoch.rotated'", tenant) == 4


def test_plans_survive_a_restart_and_build_identically(database_url):
    tenant, session = f"tenant-{uuid.uuid4().hex[:10]}", "restart"
    first = ServerProcess({"DATABASE_URL": database_url})
    stub = pb_grpc.ContextEngineStub(grpc.insecure_channel(first.address))
    plan = stub.Plan(plan_request(tenant, session)).plan
    built = stub.Build(build_request(tenant, session))
    assert first.terminate() == 0

    second = ServerProcess({"DATABASE_URL": database_url})
    try:
        stub = pb_grpc.ContextEngineStub(grpc.insecure_channel(second.address))
        assert stub.GetPlan(pb.GetPlanRequest(tenant_id=tenant, session_id=session)).plan == plan
        assert stub.Build(build_request(tenant, session)) == built
        assert not stub.Plan(plan_request(tenant, session)).created
    finally:
        assert second.terminate() == 0


def serve_on(database_url: str, grpc_addr: str, metrics_addr: str = "127.0.0.1:0", *,
             as_flags: bool = True, **env: str) -> subprocess.CompletedProcess[str]:
    """``serve`` on given addresses (flags, or with ``as_flags`` false the variables),
    expected to refuse: killed after 30 s if it serves."""
    addresses = {"CE_GRPC_ADDR": grpc_addr, "CE_METRICS_ADDR": metrics_addr}
    flags = ["--grpc-addr", grpc_addr, "--metrics-addr", metrics_addr] if as_flags else []
    try:
        return subprocess.run(
            [sys.executable, "-m", "context_engine", "serve", *flags], capture_output=True,
            text=True, timeout=30, env={**os.environ, "DATABASE_URL": database_url,
                                        **({} if as_flags else addresses), **env})
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"serve on a busy address is serving: {exc.stdout!r}") from None


def test_a_second_server_on_a_busy_port_refuses_to_start(two_servers, database_url):
    """Serving sockets set SO_REUSEPORT (workers share theirs): a second server on a port a
    running one holds would bind beside it and silently take part of its connections. It
    exits 2 naming the address instead, whether it would serve alone or with workers, and for
    the metrics port alike; the running server is untouched."""
    running = two_servers[0]
    for workers in ("1", "2"):
        done = serve_on(database_url, running.address, CE_WORKERS=workers)
        assert done.returncode == 2, (done.stdout, done.stderr)
        assert (f"cannot serve on {running.address} (--grpc-addr): Address already in use; "
                "is a server already running there?") in done.stderr, done.stderr
    # named as the operator gave it: the flag above, the variable here
    done = serve_on(database_url, running.address, as_flags=False)
    assert done.returncode == 2 and f"cannot serve on {running.address} (CE_GRPC_ADDR)" \
        in done.stderr, done.stderr
    done = serve_on(database_url, "127.0.0.1:0", running.metrics)
    assert done.returncode == 2 and f"cannot serve on {running.metrics} (--metrics-addr)" \
        in done.stderr, done.stderr
    stub = pb_grpc.ContextEngineStub(grpc.insecure_channel(running.address))
    tenant = f"tenant-{uuid.uuid4().hex[:10]}"
    assert stub.Plan(plan_request(tenant, "still-serving"), timeout=30).created


def test_an_address_this_machine_cannot_bind_is_refused_for_what_it_is(database_url):
    """An address no interface here has (TEST-NET-1) is refused with exit 2 and the system's own
    reason, not taken for a server already running there. With credentials: dev mode binds
    loopback addresses only, and refuses this one for that before it tries."""
    tokens = {"CE_DEV_MODE": "0", "CE_AUTH_DB_TOKENS": "1"}
    done = serve_on(database_url, "127.0.0.1:0", "192.0.2.1:9464", **tokens)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert ("cannot serve on 192.0.2.1:9464 (--metrics-addr): Cannot assign requested address; "
            "choose an address this machine can bind") in done.stderr, done.stderr
    assert "already running" not in done.stderr and "Traceback" not in done.stderr
    # an ephemeral port is never busy, but its host is tested all the same
    done = serve_on(database_url, "127.0.0.1:0", "192.0.2.1:0", **tokens)
    assert done.returncode == 2 and ("cannot serve on 192.0.2.1:0 (--metrics-addr): Cannot "
                                     "assign requested address") in done.stderr, done.stderr


def test_a_restart_binds_the_port_its_last_run_held(database_url):
    """The busy-port check does not refuse a restart on the same port (connections of the last
    run may still be in TIME_WAIT)."""
    # the connection below never sends a request: the stopping server waits its grace for it
    # before it closes it (1 s, not the fixture's 5)
    first = ServerProcess({"DATABASE_URL": database_url, "CE_GRACE_SECONDS": "1"})
    address = first.address
    stub = pb_grpc.ContextEngineStub(grpc.insecure_channel(address))
    stub.Plan(plan_request(f"tenant-{uuid.uuid4().hex[:10]}", "restart"), timeout=30)
    # a connection the server's side closes first: its end of it stays in TIME_WAIT
    host, port = address.rsplit(":", 1)
    peer = socket.create_connection((host, int(port)), timeout=10)
    assert first.terminate() == 0
    while peer.recv(65536):  # read what the server sent, up to its close: a close with data
        pass                 # unread would answer a reset, and leave no TIME_WAIT
    peer.close()
    states = subprocess.run(["ss", "-tanH", f"sport = :{port}"], capture_output=True,
                            text=True).stdout
    assert "TIME-WAIT" in states, states
    second = ServerProcess({"DATABASE_URL": database_url}, grpc_addr=address)
    try:
        assert second.address == address
    finally:
        assert second.terminate() == 0


def test_sigterm_drains_then_stops_gracefully(database_url):
    server = ServerProcess({"DATABASE_URL": database_url, "CE_DRAIN_SECONDS": "2"})
    channel = grpc.insecure_channel(server.address)
    health = health_pb2_grpc.HealthStub(channel)
    stub = pb_grpc.ContextEngineStub(channel)
    assert health.Check(health_pb2.HealthCheckRequest()).status == \
        health_pb2.HealthCheckResponse.SERVING
    stub.Plan(plan_request("t-sig", "s"))
    server.proc.send_signal(15)
    # a server says it is stopping once its health says NOT_SERVING; with several workers (one
    # per CPU), the supervisor's line, naming them, comes before it signals them, and a call
    # may reach any of them
    first = server.wait_for("stopping", 10)
    for _ in range(first.get("workers", 0)):
        server.wait_for("stopping", 10, where=lambda record: "workers" not in record)
    # during the drain, health says NOT_SERVING and RPCs are still answered
    assert health.Check(health_pb2.HealthCheckRequest()).status == \
        health_pb2.HealthCheckResponse.NOT_SERVING
    assert stub.Build(build_request("t-sig", "s")).epoch == 1
    assert server.terminate() == 0
    events = [r["event"] for r in server.log]
    assert events.index("stopping") < events.index("stopped")


def test_a_hangup_stops_the_server_as_sigterm_does_unless_started_ignoring_it(database_url):
    """Closing the terminal a foreground server ran in (SIGHUP, an ssh session dropped) killed
    it with no drain and left its embedded PostgreSQL running; now it stops as on SIGTERM.
    Started under ``nohup`` (SIGHUP ignored), a hangup leaves it serving."""
    server = ServerProcess({"DATABASE_URL": database_url, "CE_WORKERS": "2"})
    server.proc.send_signal(signal.SIGHUP)
    server.wait_for("stopping", 10)
    assert server.terminate() == 0
    events = [r["event"] for r in server.log]
    assert events.index("stopping") < events.index("stopped")

    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # inherited, as nohup does
    try:
        kept = ServerProcess({"DATABASE_URL": database_url, "CE_WORKERS": "2"})
    finally:
        signal.signal(signal.SIGHUP, previous)
    try:
        kept.proc.send_signal(signal.SIGHUP)
        time.sleep(1.0)
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(kept.address))
        assert kept.proc.poll() is None
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING
    finally:
        assert kept.terminate() == 0
