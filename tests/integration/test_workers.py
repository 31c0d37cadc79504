"""``serve --workers N``: several processes on one port, one metrics endpoint for all of them,
a dead worker replaced, and a graceful stop under load (with every acknowledged plan looked up
in PostgreSQL afterwards, a check shown here to fail on a lost plan)."""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from context_engine.api.auth import token_sha256
from context_engine.v1 import context_engine_pb2 as pb
from context_engine.v1 import context_engine_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.integration.processes import ServerProcess
from tests.integration.requests import build_request, plan_request
from tests.load import run as load
from tests.load.runtime import AckedPlan
from tests.support.certs import make_pki

pytestmark = pytest.mark.integration


def scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        return str(response.read().decode())


def plan_count(text: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("context_engine_rpc_seconds_count{")
               and 'method="Plan"' in line and 'code="OK"' in line)


def channel(address: str) -> grpc.Channel:
    # a connection of its own, as separate runtimes have
    return grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


def test_workers_share_one_port_and_one_metrics_endpoint(database_url):
    server = ServerProcess({"DATABASE_URL": database_url, "CE_WORKERS": "2",
                            "CE_DEV_MODE": "1", "CE_DRAIN_SECOND": "0.5"})
    try:
        serving = server.log[-1]
        assert serving["event"] == "serving" and serving["workers"] == 2
        pids = serving["pids"]
        assert len(set(pids)) == 2 and server.proc.pid not in pids
        # the supervisor's warnings are said once, not again by each worker it starts
        events = [r.get("event") for r in server.log]
        assert events.count("dev_mode") == 1 and events[0] == "dev_mode"  # its first line
        misspelt = [r["problem"] for r in server.log if r.get("event") == "unknown_variable"
                    and r["problem"].startswith("CE_DRAIN_SECOND ")]
        assert misspelt == ["CE_DRAIN_SECOND is not a setting and is ignored "
                            "(did you mean CE_DRAIN_SECONDS?)"]
        starting = [r for r in server.log if r.get("event") == "worker_starting"]
        assert sorted(r["worker"] for r in starting) == ["0", "1"]
        assert sorted(r["pid"] for r in starting) == sorted(pids)
        workers = [r for r in server.log if r.get("event") == "worker_serving"]
        assert sorted(r["worker"] for r in workers) == ["0", "1"]
        assert {r["grpc"] for r in workers} == {server.address}
        # a worker's line says nothing the supervisor's says (its database, its metrics)
        # that would be wrong of the worker: the database it was handed, no endpoint of its own
        assert sorted(r["pid"] for r in workers) == sorted(pids)
        assert not {"database", "metrics", "data_dir"} & {k for r in workers for k in r}

        tenant = f"tenant-{uuid.uuid4().hex[:8]}"
        before = plan_count(scrape(server.metrics))
        channels = [channel(server.address) for _ in range(24)]
        for i, ch in enumerate(channels):
            pb_grpc.ContextEngineStub(ch).Plan(plan_request(tenant, f"s-{i}"), timeout=30)
        # one endpoint counts what every worker served
        assert plan_count(scrape(server.metrics)) - before == 24
        for ch in channels:
            ch.close()

        # a worker that dies is replaced; the port keeps answering meanwhile
        os.kill(pids[0], signal.SIGKILL)
        exited = server.wait_for("worker_exited", 30)
        assert exited["pid"] == pids[0] and exited["code"] == -signal.SIGKILL
        assert exited["level"] == "warning"  # nothing asked it to stop: an operator looks
        server.wait_for("worker_serving", 60)
        stub = pb_grpc.ContextEngineStub(channel(server.address))
        for i in range(6):
            assert stub.GetPlan(pb.GetPlanRequest(tenant_id=tenant, session_id=f"s-{i}"),
                                timeout=30).plan.epoch == 1
        health = health_pb2_grpc.HealthStub(channel(server.address))
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING
    finally:
        assert server.terminate() == 0
    stopped = [r["event"] for r in server.log if r.get("event") in ("stopping", "stopped")]
    assert stopped.count("stopped") == 3  # both workers, then the supervisor


def test_workers_start_behind_tls_and_credentials(database_url, tmp_path):
    """The supervisor learns that its workers serve without calling the port, so a port that
    requires TLS and a token starts like any other."""
    pki = make_pki(tmp_path, ca_name="workers-test-ca", server_alt_names="IP:127.0.0.1")
    token = "workers-test-token"
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps([{"sha256": token_sha256(token), "tenant_id": "tls-tenant",
                                   "rpcs": ["*"]}]))
    server = ServerProcess({"DATABASE_URL": database_url, "CE_WORKERS": "2",
                            "CE_DEV_MODE": "0", "CE_AUTH_TOKENS_FILE": str(tokens),
                            "CE_TLS_CERT_FILE": str(pki.server_cert),
                            "CE_TLS_KEY_FILE": str(pki.server_key)}, timeout=60)
    try:
        assert server.log[-1]["event"] == "serving" and server.log[-1]["workers"] == 2
        credentials = grpc.ssl_channel_credentials(root_certificates=pki.ca.read_bytes())
        channel = grpc.secure_channel(server.address, credentials)
        stub = pb_grpc.ContextEngineStub(channel)
        plan = stub.Plan(plan_request("tls-tenant", "s-1"), timeout=30,
                         metadata=(("authorization", f"Bearer {token}"),))
        assert plan.plan.epoch == 1
        with pytest.raises(grpc.RpcError) as info:
            stub.Plan(plan_request("tls-tenant", "s-2"), timeout=30)
        assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED
        channel.close()
    finally:
        assert server.terminate() == 0


def test_sigterm_under_load_finishes_in_flight_calls_and_breaks_none(capsys):
    started = time.monotonic()
    code = load.main(["--runtimes", "30", "--turns", "50", "--workers", "2",
                      "--sigterm-after", "3", "--drain", "1", "--grace", "10",
                      "--time-limit", "240"])
    out = capsys.readouterr()
    assert code == 0, out.out + out.err
    shutdown = json.loads(out.out.split("shutdown: ", 1)[1].splitlines()[0])
    assert shutdown["exit_code"] == 0 and shutdown["broken"] == 0
    assert shutdown["in_flight_at_sigterm"] > 0 and shutdown["in_flight_failed"] == 0
    assert shutdown["not_serving_after_ms"] is not None
    assert shutdown["not_serving_after_ms"] < 1000  # before the listener closed
    assert shutdown["exit_seconds"] < 1 + 10 + 5
    assert "epochs per session 1.0" in out.out
    # every plan acknowledged before and while the server drained was found in PostgreSQL
    # after the restart
    found = re.search(r"lost plans (\d+) of (\d+) acknowledged \((\d+) Plan calls", out.out)
    assert found, out.out
    lost, distinct, answered = map(int, found.groups())
    assert lost == 0 and 0 < distinct <= 30 and answered >= distinct, found.group(0)
    assert time.monotonic() - started < 240


def empty_report() -> load.Report:
    return load.Report(runtimes=1, turns=1, workers=1, wall_seconds=1.0, calls=[],
                       turns_done=0)


def test_the_lost_plan_check_fails_on_a_plan_that_is_not_stored(stub, database_url,
                                                                 monkeypatch, capsys):
    """The load runs' check of acknowledged plans, against the real database: it passes on
    plans that are stored, and fails on one never stored, an epoch never written, and a plan
    stored with another prefix than the one acknowledged."""
    tenant = f"tenant-{uuid.uuid4().hex[:8]}"
    acked = []
    for i in range(3):
        plan = stub.Plan(plan_request(tenant, f"s-{i}"), timeout=30).plan
        acked.append(AckedPlan(tenant, f"s-{i}", plan.epoch, plan.prefix_sha256))
    report = empty_report()
    load.check_acknowledged(report, acked * 2, database_url)  # every Plan answered twice
    assert report.failures == []
    assert (report.plans_acknowledged, report.plans_checked, report.lost_plans) == (6, 3, 0)

    never = AckedPlan(tenant, "s-never-stored", 1, acked[0].prefix_sha256)
    later = replace(acked[1], epoch=acked[1].epoch + 1)
    other = replace(acked[2], prefix_sha256="0" * 64)
    report = empty_report()
    load.check_acknowledged(report, [*acked, never, later, other], database_url)
    assert report.lost_plans == 3 and report.plans_checked == 6
    (failure,) = report.failures
    assert failure.startswith("3 of 6 acknowledged plans are not in PostgreSQL"), failure
    assert f"{tenant}/s-never-stored epoch 1 (missing)" in failure
    assert f"{tenant}/s-1 epoch {later.epoch} (missing)" in failure
    assert f"{tenant}/s-2 epoch {other.epoch} (differs)" in failure
    # and the load run exits non-zero on it
    monkeypatch.setattr(load, "run", lambda args: report)
    assert load.main(["--runtimes", "1", "--turns", "1"]) == 1
    out = capsys.readouterr()
    assert "lost plans 3 of 6 acknowledged" in out.out
    assert f"FAILED: {failure}" in out.err
    monkeypatch.undo()

    report = empty_report()
    load.check_acknowledged(report, [], database_url)  # nothing acknowledged: nothing proven
    assert report.failures == ["no Plan was acknowledged: there is nothing to check"]


def test_every_worker_loads_the_catalogs_tokenizers_before_it_serves(database_url):
    """A first load takes seconds (a worker's first Plan waited 2.4-2.6 s for it): each
    worker loads every encoding the catalog names before health says SERVING, so Plans and
    Builds of a model of each encoding, on both workers, load none."""
    catalog = json.loads((Path(__file__).parents[2] / "service" / "context_engine" / "data"
                          / "models.json").read_text())
    models = {m["encoding"]: m["prefix"] + "x" for m in catalog["models"]}
    encodings = set(models) | {"cl100k_base"}
    server = ServerProcess({"DATABASE_URL": database_url, "CE_WORKERS": "2"}, timeout=120)
    tenant = f"warm-{uuid.uuid4().hex[:8]}"
    try:
        serving_at = len(server.log)
        assert server.log[-1]["event"] == "serving"
        loaded = collections.Counter(r["encoding"] for r in server.log
                                     if r.get("event") == "tokenizer_loaded")
        assert loaded == {encoding: 2 for encoding in encodings}  # once in each worker
        for n in range(12):  # channels of their own: connections spread over both workers
            channel = grpc.insecure_channel(server.address, options=[
                ("grpc.use_local_subchannel_pool", 1)])
            stub = pb_grpc.ContextEngineStub(channel)
            for encoding, model in sorted(models.items()):
                session = f"s-{n}-{encoding}"
                plan = stub.Plan(plan_request(tenant, session,
                                              model=pb.ModelSpec(model_id=model)), timeout=30)
                assert encoding in plan.plan.tokenizer, (model, plan.plan.tokenizer)
                stub.Build(build_request(tenant, session), timeout=30)
            channel.close()
    finally:
        assert server.terminate() == 0
    late = [r for r in server.log[serving_at:] if r.get("event") == "tokenizer_loaded"]
    assert late == []


def test_a_stop_while_the_workers_start_is_not_held_until_they_serve(database_url):
    """SIGTERM while the workers start stopped them only once all of them served (7.9 s for
    two, measured); the supervisor now stops them at once and exits 0."""
    env = {**os.environ, "DATABASE_URL": database_url, "CE_WORKERS": "2",
           "CE_GRACE_SECONDS": "5", "CE_DRAIN_SECONDS": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "context_engine", "serve", "--dev",
                             "--grpc-addr", "127.0.0.1:0", "--metrics-addr", ""],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # a worker's first line: spawned, and some way from serving
            if '"worker_starting"' in line:
                break
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        took = time.monotonic() - started
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    assert "Traceback" not in out and '"serving"' not in out.split('"stopping"')[0], out
    assert '"while_starting": true' in out and took < 5, (took, out)


def test_workers_stop_when_their_supervisor_is_killed(database_url):
    """SIGKILL of the supervisor (an OOM kill, say) left both workers serving, re-parented to
    init, with no metrics endpoint and no one to restart them, and a new serve refused their
    port. The kernel now stops each (SIGTERM, as a stop does) when its supervisor dies."""
    env = {**os.environ, "DATABASE_URL": database_url, "CE_WORKERS": "2",
           "CE_GRACE_SECONDS": "2", "CE_DRAIN_SECONDS": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "context_engine", "serve", "--dev",
                             "--grpc-addr", "127.0.0.1:0", "--metrics-addr", ""],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    pids: list[int] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if '"event": "serving"' in line:
                pids = json.loads(line)["pids"]
                break
        assert len(pids) == 2
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        alive = pids
        while alive and time.monotonic() < deadline:
            alive = [p for p in pids if _running(p)]
            time.sleep(0.2)
        assert alive == [], alive
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.kill()


def _running(pid: int) -> bool:
    """Alive and not a zombie (a worker re-parented to init is reaped by it)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_worker_that_does_not_stop_cleanly_fails_the_supervisor(database_url):
    """The supervisor exited 0 whatever its workers did during the stop (a worker dead in the
    drain, one it had to SIGKILL): `make load`'s check of the server's exit code, the one a
    deployment sees, could not see them. It exits 1 now, naming them; a clean stop stays 0."""
    server = ServerProcess({"DATABASE_URL": database_url, "CE_WORKERS": "2",
                            "CE_DEV_MODE": "1", "CE_DRAIN_SECONDS": "2"})
    pids = server.log[-1]["pids"]
    server.proc.send_signal(signal.SIGTERM)
    server.wait_for("stopping", 30)
    os.kill(pids[1], signal.SIGKILL)  # dies in the drain: stopping, it is not restarted
    assert server.terminate() == 1, server.log
    # every worker the supervisor saw end otherwise than cleanly, from its start: only the
    # one killed (the whole log on failure: a second would be a worker that crashed, or
    # did not stop cleanly on SIGTERM)
    failed = [(r["event"], r["pid"], r.get("code")) for r in server.log
              if r.get("event") in ("worker_exited", "worker_killed")]
    assert failed == [("worker_exited", pids[1], -signal.SIGKILL)], server.log
    stopped = [r for r in server.log if r.get("event") == "stopped"]
    assert stopped[-1]["level"] == "warning" and stopped[-1]["workers_failed"] == [1], \
        server.log


def test_with_metrics_off_a_worker_restarted_writes_no_metrics_files(database_url, tmp_path):
    """Metrics off: the workers were still handed the supervisor's metrics directory, wrote
    their files there, and a worker that died left its files (1.3 MB a restart) that nothing
    folds, since only a served endpoint reads them. Now no worker writes any."""
    server = ServerProcess({"DATABASE_URL": database_url, "CE_WORKERS": "2",
                            "CE_DEV_MODE": "1", "TMPDIR": str(tmp_path)}, metrics_addr="")
    try:
        assert server.metrics is None
        pids = server.log[-1]["pids"]
        os.kill(pids[0], signal.SIGKILL)
        assert server.wait_for("worker_exited", 30)["pid"] == pids[0]
        started = server.wait_for("worker_serving", 60)
        for pid in (started["pid"], pids[1]):
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            assert not [v for v in environ if v.startswith(b"PROMETHEUS_MULTIPROC_DIR=")]
        ch = channel(server.address)
        pb_grpc.ContextEngineStub(ch).Plan(plan_request(f"t-{uuid.uuid4().hex[:8]}", "s"),
                                           timeout=30)
        ch.close()
        assert sorted(p.name for p in tmp_path.rglob("*.db")) == []
    finally:
        assert server.terminate() == 0


def test_a_worker_killed_again_and_again_keeps_its_counts_and_no_files(database_url):
    """Each SIGKILL of a worker used to leave its metrics files (1.1-1.4 MB) for the endpoint
    to keep summing, so a worker restarted in a loop filled its temporary directory. Its files
    are now folded into one archive per kind: after three kills the directory holds as many
    files as after none (two live workers' and the archives), the Plans counted are the ones
    made (counted here, not read from the service), and no scrape during the kills ever read a
    count lower than one before it (which Prometheus would take for a counter reset)."""
    server = ServerProcess({"DATABASE_URL": database_url, "CE_WORKERS": "2",
                            "CE_DEV_MODE": "1"})
    made = 0
    seen: list[float] = []
    stop = threading.Event()

    def scrape_all_along() -> None:
        while not stop.is_set():
            seen.append(plan_count(scrape(server.metrics)))

    try:
        pids = server.log[-1]["pids"]
        environ = Path(f"/proc/{pids[0]}/environ").read_bytes().split(b"\0")
        metrics_dir = Path(next(v.split(b"=", 1)[1] for v in environ
                                if v.startswith(b"PROMETHEUS_MULTIPROC_DIR=")).decode())
        tenant = f"tenant-{uuid.uuid4().hex[:8]}"
        base = plan_count(scrape(server.metrics))

        def plans(count: int) -> None:
            nonlocal made
            for _ in range(count):
                ch = channel(server.address)  # a connection each: both workers get some
                pb_grpc.ContextEngineStub(ch).Plan(
                    plan_request(tenant, f"s-{made}"), timeout=30)
                ch.close()
                made += 1

        plans(8)
        files = {p.name for p in metrics_dir.glob("*.db")}
        scraper = threading.Thread(target=scrape_all_along, daemon=True)
        scraper.start()
        for _ in range(3):
            victim = pids[0]
            os.kill(victim, signal.SIGKILL)
            exited = server.wait_for("worker_exited", 30)
            assert exited["pid"] == victim
            started = server.wait_for("worker_serving", 60)
            pids = [started["pid"] if p == victim else p for p in pids]
            plans(6)
        stop.set()
        scraper.join(30)
        after = {p.name for p in metrics_dir.glob("*.db")}
        assert plan_count(scrape(server.metrics)) - base == made == 26
        assert len(seen) > 3 and all(b >= a for a, b in itertools.pairwise(seen)), seen
        # the live workers' files, and archives in place of every dead worker's
        assert len(after) <= len(files) + len({n.rsplit("_", 1)[0] for n in files})
        assert not [n for n in after if n.rsplit("_", 1)[1][:-3] not in
                    {str(p) for p in pids} | {"archived"}], sorted(after)
    finally:
        stop.set()
        assert server.terminate() == 0
