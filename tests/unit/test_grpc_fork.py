"""The suite turns gRPC's fork handlers off before anything imports gRPC (``tests/__init__.py``):
pgserver starts ``pg_ctl`` as its system user, a plain ``fork`` then ``exec``, from processes
whose gRPC threads are busy, and gRPC's handlers (meant for a child that goes on using gRPC)
once crashed such a child before its ``exec`` (``pg_ctl`` "died" of SIGSEGV)."""

from __future__ import annotations

import os
import subprocess
import sys

# Forks (as ``subprocess`` does for a child run as a given user) while three threads keep
# calling into gRPC; with its fork handlers on, gRPC logs that it skips them when a fork finds
# threads inside it. Stops at the first such line, or after ``forks``.
CHILDREN = r"""
import os, subprocess, sys, threading
from concurrent import futures
import grpc
server = grpc.server(futures.ThreadPoolExecutor(2))
port = server.add_insecure_port("127.0.0.1:0")
server.start()
channel = grpc.insecure_channel(f"127.0.0.1:{port}")
stop = threading.Event()
def calls():
    while not stop.is_set():
        try:
            channel.unary_unary("/x/y")(b"", timeout=0.05)
        except grpc.RpcError:
            pass
threads = [threading.Thread(target=calls) for _ in range(3)]
for t in threads:
    t.start()
for _ in range(int(sys.argv[1])):
    subprocess.run(["true"], user=os.getuid(), check=True)
stop.set()
for t in threads:
    t.join()
server.stop(None)
"""


def forks(setting: str, count: int, timeout: float) -> tuple[str, bool]:
    """What the forking process logged, and whether it hung (killed after ``timeout``)."""
    env = {**os.environ, "GRPC_ENABLE_FORK_SUPPORT": setting}
    with subprocess.Popen([sys.executable, "-c", CHILDREN, str(count)], env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) as proc:
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            return err, True
    assert proc.returncode == 0, err
    return err, False


def test_the_suite_runs_with_grpcs_fork_handlers_off() -> None:
    assert os.environ.get("GRPC_ENABLE_FORK_SUPPORT") == "0"
    err, hung = forks(os.environ["GRPC_ENABLE_FORK_SUPPORT"], 100, timeout=60)
    assert not hung and "skipping fork() handlers" not in err


def test_with_the_handlers_on_a_fork_meets_them() -> None:
    """The check above can fail: the same forks with the handlers on log the line, or hang
    (a fork that finds a gRPC thread holding a lock its handler then waits for)."""
    err, hung = forks("1", 100, timeout=10)
    assert hung or "skipping fork() handlers" in err
