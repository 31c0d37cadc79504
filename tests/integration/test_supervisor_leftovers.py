"""What a supervisor killed outright (SIGKILL, an OOM kill) leaves under the temporary directory:
its workers' prometheus multiprocess files (``context-engine-metrics-*``, 1.1-1.4 MB a
directory) and its ready directory (``context-engine-ready-*``). Each run here has a TMPDIR of
its own, so it never sees or touches another run's files; the oracle is the directory listing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import urllib.request
import uuid
from pathlib import Path

import grpc
import pytest
from context_engine.v1 import context_engine_pb2_grpc as pb_grpc

from tests.integration.processes import ServerProcess
from tests.integration.requests import plan_request

pytestmark = pytest.mark.integration

PREFIXES = ("context-engine-metrics-", "context-engine-ready-")


def leftovers(tmp: Path) -> list[Path]:
    return sorted(p for p in tmp.iterdir() if p.is_dir() and p.name.startswith(PREFIXES))


def start(tmp: Path, database_url: str) -> ServerProcess:
    return ServerProcess({"DATABASE_URL": database_url, "CE_WORKERS": "2", "CE_DEV_MODE": "1",
                          "TMPDIR": str(tmp), "CE_DRAIN_SECONDS": "0.5",
                          "CE_GRACE_SECONDS": "2"})


def plans_served(metrics: str) -> float:
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("context_engine_rpc_seconds_count{")
               and 'method="Plan"' in line and 'code="OK"' in line)


def plan_once(address: str) -> None:
    with grpc.insecure_channel(address) as channel:
        pb_grpc.ContextEngineStub(channel).Plan(
            plan_request("acme", f"s-{uuid.uuid4()}"), timeout=30)


def running(pid: int) -> bool:
    """Alive and not a zombie (a worker re-parented to init is reaped by it)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids: list[int], timeout: float) -> float:
    started = time.monotonic()
    while any(running(p) for p in pids):
        assert time.monotonic() - started < timeout, [p for p in pids if running(p)]
        time.sleep(0.05)
    return time.monotonic() - started


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_the_workers_of_a_killed_supervisor_stop_and_remove_its_files(database_url, tmp_path):
    """Each SIGKILL of a supervisor left both directories behind, the workers' metrics files
    in them, and nothing ever removed them. Its workers, stopped by the kernel when it dies,
    now remove them as the last of them stops."""
    server = start(tmp_path, database_url)
    pids = server.log[-1]["pids"]
    try:
        plan_once(server.address)
        assert plans_served(server.metrics) == 1
        made = leftovers(tmp_path)
        assert len(made) == 2 and any(made[0].glob("*.db")), made
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(10)
        # drain (0.5 s) and grace (2 s) bound it; 2.7 s measured under a loaded machine
        took = wait_gone(pids, timeout=15)
        assert took < 10, took
        print("workers_gone_after", round(took, 2))
        with pytest.raises(OSError):  # no one serves the dead directory's metrics
            plans_served(server.metrics)
        assert leftovers(tmp_path) == []
    finally:
        kill_all(pids)


def test_a_later_start_removes_what_a_killed_supervisor_and_its_workers_left(
        database_url, tmp_path):
    """The whole group killed at once (a container's OOM kill): nothing of it could clean up,
    so the next start on the machine removes its directories, and serves its own metrics."""
    first = start(tmp_path, database_url)
    pids = first.log[-1]["pids"]
    second = None
    try:
        plan_once(first.address)
        for pid in pids:  # stopped, so none of them can act on their supervisor's death
            os.kill(pid, signal.SIGSTOP)
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(10)
        kill_all(pids)
        wait_gone(pids, timeout=10)
        dead = leftovers(tmp_path)
        assert len(dead) == 2, dead
        second = start(tmp_path, database_url)
        mine = leftovers(tmp_path)
        assert len(mine) == 2 and not set(mine) & set(dead), (dead, mine)
        removed = [r for r in second.log if r.get("event") == "abandoned_files_removed"]
        assert len(removed) == 1 and sorted(removed[0]["directories"]) == [str(d) for d in dead]
        assert plans_served(second.metrics) == 0  # nothing of the dead directory is served
        plan_once(second.address)
        assert plans_served(second.metrics) == 1
        assert second.terminate() == 0
        assert leftovers(tmp_path) == []
    finally:
        kill_all(pids)
        if second is not None:
            second.kill()


def test_a_start_leaves_a_running_supervisors_files_alone(database_url, tmp_path):
    """Two supervisors on one machine, on two ports: the second's start removes nothing of
    the first, whose workers' metrics go on being served."""
    first = start(tmp_path, database_url)
    second = None
    try:
        plan_once(first.address)
        theirs = leftovers(tmp_path)
        files = sorted(f.name for d in theirs for f in d.iterdir())
        second = start(tmp_path, database_url)
        assert not any(r.get("event") == "abandoned_files_removed" for r in second.log)
        assert set(theirs) < set(leftovers(tmp_path))
        assert sorted(f.name for d in theirs for f in d.iterdir()) == files
        assert plans_served(first.metrics) == 1
        assert second.terminate() == 0
        assert leftovers(tmp_path) == theirs  # its own stop removed only its own
        assert first.terminate() == 0
        assert leftovers(tmp_path) == []
    finally:
        first.kill()
        if second is not None:
            second.kill()
