"""Server processes on embedded PostgreSQL (`serve` without DATABASE_URL, data under
CE_DATA_DIR): its data reused across runs, SIGINT and SIGTERM while it starts, a start after a
supervisor killed outright, two started together on one address. Apart from
``test_processes.py`` (servers on the suite's database) so that pytest-xdist's loadfile can run
the two on different workers: each is among the suite's longest files."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import pytest
from context_engine.v1 import context_engine_pb2 as pb
from context_engine.v1 import context_engine_pb2_grpc as pb_grpc

from tests.integration.processes import ServerProcess
from tests.integration.requests import plan_request

pytestmark = pytest.mark.integration


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


@pytest.mark.parametrize(("after", "sig", "code", "said"), [
    (0.0, signal.SIGTERM, 143, "terminated"), (0.3, signal.SIGTERM, 143, "terminated"),
    (0.3, signal.SIGHUP, 129, "hung up")])
def test_sigterm_while_the_server_starts_stops_the_embedded_database(after, sig, code, said):
    """SIGTERM while the embedded database starts or the migrations run (before the server
    installs its own handling) killed the process outright: the embedded PostgreSQL stayed up,
    and its handle list kept the dead pid, so no later clean stop stopped it again. SIGHUP
    (the terminal closed) alike."""
    data_dir = Path(tempfile.mkdtemp(prefix="ce-data-"))
    proc = _embedded_serve(data_dir)
    try:
        # once the embedded database runs ("after" seconds later), before the server serves
        deadline = time.monotonic() + 60
        while not (data_dir / "pg" / "postmaster.pid").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.02)
        time.sleep(after)
        proc.send_signal(sig)
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
    # terminated while starting (143; 129 for a hangup), or stopped as a server stops
    assert proc.returncode in (0, code), (proc.returncode, err)
    if proc.returncode == code:
        assert err.strip().endswith(f"context-engine: {said}"), err
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


def test_a_pid_file_naming_another_process_is_taken_off_and_that_process_left_alone():
    """After a hard kill of the server and its PostgreSQL, the file's pid may be another
    program's by the next start (a reboot, a container's restart): pgserver took it for the
    postmaster, every start failed, and each stopped that program (pg_ctl, then a kill)."""
    data_dir = Path(tempfile.mkdtemp(prefix="ce-data-"))
    env = {"DATABASE_URL": "", "CE_DATA_DIR": str(data_dir), "CE_WORKERS": "1"}
    bystander = subprocess.Popen(["sleep", "120"])
    try:
        first = ServerProcess(env)
        stub = pb_grpc.ContextEngineStub(grpc.insecure_channel(first.address))
        plan = stub.Plan(plan_request("t", "s"), timeout=30).plan
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(30)
        import psutil

        for line in _postgres_of(data_dir):  # its PostgreSQL killed outright too, with all
            postmaster = psutil.Process(int(line.split()[0]))  # its backends (they hold its
            killed = [*postmaster.children(recursive=True), postmaster]  # shared memory)
            for process in killed:
                with contextlib.suppress(psutil.NoSuchProcess):  # one may be ending already
                    process.kill()
            psutil.wait_procs(killed, timeout=10)
        pid_file = data_dir / "pg" / "postmaster.pid"
        lines = pid_file.read_text(encoding="utf-8").splitlines()
        pid_file.write_text("\n".join([str(bystander.pid), *lines[1:]]) + "\n",
                            encoding="utf-8")

        second = ServerProcess(env)
        stub = pb_grpc.ContextEngineStub(grpc.insecure_channel(second.address))
        assert stub.GetPlan(pb.GetPlanRequest(tenant_id="t", session_id="s"),
                            timeout=30).plan == plan  # the same data, its own PostgreSQL
        assert second.terminate() == 0
        assert bystander.poll() is None  # never stopped
    finally:
        bystander.kill()
        bystander.wait()
        for line in _postgres_of(data_dir):
            os.kill(int(line.split()[0]), signal.SIGQUIT)
        shutil.rmtree(data_dir, ignore_errors=True)
    stale = [r for r in second.log if r.get("event") == "embedded_database_stale_pid"]
    assert [r["pid"] for r in stale] == [bystander.pid], second.log


def test_a_first_start_killed_while_it_made_the_database_is_named_with_what_to_do():
    """A first start killed during initdb leaves PG_VERSION and initdb's bootstrap pid file
    (its pid negated): every later command failed on an AssertionError of pgserver's, naming
    a log that did not exist."""
    data_dir = Path(tempfile.mkdtemp(prefix="ce-data-"))
    pg = data_dir / "pg"
    pg.mkdir()
    (pg / "PG_VERSION").write_text("16\n", encoding="utf-8")
    ended = subprocess.Popen(["sleep", "0"])
    ended.wait()
    (pg / "postmaster.pid").write_text(f"-{ended.pid}\n{pg}\n1765000000\n",
                                       encoding="utf-8")
    try:
        proc = _embedded_serve(data_dir)
        out, err = proc.communicate(timeout=60)
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
    assert proc.returncode == 1 and "Traceback" not in err + out, err
    assert err.strip() == (
        f"context-engine: the first start of this embedded PostgreSQL was interrupted while "
        f"it made the database (its postmaster.pid names initdb's bootstrap, pid "
        f"-{ended.pid}, which no longer runs), so the cluster is half made: remove {pg} and "
        "start again (it held no data yet)"), err


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
