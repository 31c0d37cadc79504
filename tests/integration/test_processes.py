"""Several real server processes: concurrent Plan, restarts, embedded PostgreSQL reuse,
graceful stop on SIGTERM."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

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
    reason, not taken for a server already running there."""
    done = serve_on(database_url, "127.0.0.1:0", "192.0.2.1:9464")
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert ("cannot serve on 192.0.2.1:9464 (--metrics-addr): Cannot assign requested address; "
            "choose an address this machine can bind") in done.stderr, done.stderr
    assert "already running" not in done.stderr and "Traceback" not in done.stderr
    # an ephemeral port is never busy, but its host is tested all the same
    done = serve_on(database_url, "127.0.0.1:0", "192.0.2.1:0")
    assert done.returncode == 2 and ("cannot serve on 192.0.2.1:0 (--metrics-addr): Cannot "
                                     "assign requested address") in done.stderr, done.stderr


def test_a_restart_binds_the_port_its_last_run_held(database_url):
    """The busy-port check does not refuse a restart on the same port (connections of the last
    run may still be in TIME_WAIT)."""
    first = ServerProcess({"DATABASE_URL": database_url})
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


def test_embedded_postgres_data_is_reused_across_runs():
    """What `make run` does twice: no DATABASE_URL, data under CE_DATA_DIR."""
    data_dir = Path(tempfile.mkdtemp(prefix="ce-data-"))
    env = {"DATABASE_URL": "", "CE_DATA_DIR": str(data_dir)}
    first = ServerProcess(env)
    serving = first.log[-1]
    assert serving["database"] == "embedded" and serving["data_dir"] == str(data_dir)
    stub = pb_grpc.ContextEngineStub(grpc.insecure_channel(first.address))
    plan = stub.Plan(plan_request("t", "s")).plan
    assert first.terminate() == 0

    second = ServerProcess(env)
    try:
        stub = pb_grpc.ContextEngineStub(grpc.insecure_channel(second.address))
        assert stub.GetPlan(pb.GetPlanRequest(tenant_id="t", session_id="s")).plan == plan
        assert not any(r.get("event") == "migrated" for r in second.log), "migrated twice"
    finally:
        assert second.terminate() == 0
        shutil.rmtree(data_dir, ignore_errors=True)


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


def _embedded_serve(data_dir: Path, grpc_addr: str = "127.0.0.1:0") -> subprocess.Popen[str]:
    """``serve --dev``, one process, on its own embedded database under ``data_dir``."""
    env = {**os.environ, "DATABASE_URL": "", "CE_DATA_DIR": str(data_dir), "CE_WORKERS": "1"}
    return subprocess.Popen([sys.executable, "-m", "context_engine", "serve", "--dev",
                             "--grpc-addr", grpc_addr, "--metrics-addr", ""],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)


@pytest.mark.parametrize("after", [0.3, 1.0, 2.0])
def test_ctrl_c_while_the_server_starts_prints_no_traceback(after):
    """SIGINT while the embedded database starts or the migrations run (before the server
    installs its own handling) printed a KeyboardInterrupt traceback of 35-52 lines."""
    data_dir = Path(tempfile.mkdtemp(prefix="ce-data-"))
    proc = _embedded_serve(data_dir)
    try:
        time.sleep(after)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        shutil.rmtree(data_dir, ignore_errors=True)
    assert "Traceback" not in err + out, err
    # interrupted while starting (130, or ended by the signal itself, which a shell also
    # reports as 130), or stopped as a server stops
    assert proc.returncode in (0, 130, -signal.SIGINT), (proc.returncode, err)
    if proc.returncode != 0:
        assert err.strip().endswith("context-engine: interrupted"), err


def _postgres_of(data_dir: Path) -> list[str]:
    found = subprocess.run(["pgrep", "-af", f"postgres -D {data_dir}"], capture_output=True,
                           text=True).stdout.split("\n")
    return [line for line in found if line.strip() and "pgrep" not in line]


@pytest.mark.parametrize("after", [0.0, 0.3])
def test_sigterm_while_the_server_starts_stops_the_embedded_database(after):
    """SIGTERM while the embedded database starts or the migrations run (before the server
    installs its own handling) killed the process outright: the embedded PostgreSQL stayed up,
    and its handle list kept the dead pid, so no later clean stop stopped it again."""
    data_dir = Path(tempfile.mkdtemp(prefix="ce-data-"))
    proc = _embedded_serve(data_dir)
    try:
        # once the embedded database runs ("after" seconds later), before the server serves
        deadline = time.monotonic() + 60
        while not (data_dir / "pg" / "postmaster.pid").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.02)
        time.sleep(after)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        deadline = time.monotonic() + 10
        while _postgres_of(data_dir) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = _postgres_of(data_dir)
    finally:
        proc.kill()
        for line in _postgres_of(data_dir):  # never leave one behind, whatever failed
            os.kill(int(line.split()[0]), signal.SIGQUIT)
        shutil.rmtree(data_dir, ignore_errors=True)
    assert "Traceback" not in err + out, err
    # terminated while starting (143), or stopped as a server stops
    assert proc.returncode in (0, 143), (proc.returncode, err)
    if proc.returncode == 143:
        assert err.strip().endswith("context-engine: terminated"), err
    assert not left, left


def test_a_start_after_a_killed_supervisor_reuses_its_database_and_stops_it():
    """A supervisor killed outright (SIGKILL, an OOM kill) leaves its embedded PostgreSQL
    running, and its pid on pgserver's list of the database's holders. The next start reused
    the database (as it should), but its clean stop found the dead pid listed as another
    holder and left the database running, as did every start after it."""
    data_dir = Path(tempfile.mkdtemp(prefix="ce-data-"))
    env = {"DATABASE_URL": "", "CE_DATA_DIR": str(data_dir)}
    try:
        first = ServerProcess({**env, "CE_WORKERS": "2"})
        stub = pb_grpc.ContextEngineStub(grpc.insecure_channel(first.address))
        plan = stub.Plan(plan_request("t", "s"), timeout=30).plan
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(30)
        assert _postgres_of(data_dir)  # nothing stopped it: the next start finds it up

        second = ServerProcess({**env, "CE_WORKERS": "1"})
        stub = pb_grpc.ContextEngineStub(grpc.insecure_channel(second.address))
        assert stub.GetPlan(pb.GetPlanRequest(tenant_id="t", session_id="s"),
                            timeout=30).plan == plan  # the same database, reused
        assert second.terminate() == 0
        deadline = time.monotonic() + 10
        while _postgres_of(data_dir) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = _postgres_of(data_dir)
    finally:
        for line in _postgres_of(data_dir):  # never leave one behind, whatever failed
            os.kill(int(line.split()[0]), signal.SIGQUIT)
        shutil.rmtree(data_dir, ignore_errors=True)
    assert not left, left
    gone = [r for r in second.log if r.get("event") == "embedded_database_holders_gone"]
    assert [r["pids"] for r in gone] == [[first.proc.pid]], second.log


def test_two_servers_started_together_on_one_address_are_never_both_served():
    """Each checked the port before its seconds of start-up (the embedded database, the
    migrations): both found it free, both bound it with SO_REUSEPORT, and the kernel spread
    the connections over two servers with two databases (3 of 10 calls found the plan)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dirs = [Path(tempfile.mkdtemp(prefix="ce-data-")) for _ in range(2)]
    procs = [_embedded_serve(d, f"127.0.0.1:{port}") for d in dirs]
    try:
        deadline = time.monotonic() + 60
        while all(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # the other, had it been refused too, has said so by now
        refused = [p for p in procs if p.poll() is not None]
        assert len(refused) == 1, [p.poll() for p in procs]
        (loser,) = refused
        (winner,) = [p for p in procs if p is not loser]
        _, err = loser.communicate(timeout=10)
        assert loser.returncode == 2, err
        assert f"cannot serve on 127.0.0.1:{port} (--grpc-addr)" in err, err
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            grpc.channel_ready_future(channel).result(timeout=60)
        winner.send_signal(signal.SIGTERM)
        winner.communicate(timeout=60)
        assert winner.returncode == 0
    finally:
        for p in procs:
            p.kill()
        for d in dirs:
            for line in _postgres_of(d):
                os.kill(int(line.split()[0]), signal.SIGQUIT)
            shutil.rmtree(d, ignore_errors=True)

