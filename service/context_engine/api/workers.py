"""Several serving processes on one port (``serve --workers N``).

One Python process uses one core, so the supervisor starts N worker processes that each run
the whole server (``serve --workers 1``) bound to the same port with ``SO_REUSEPORT``; the
kernel spreads connections over them. The supervisor itself serves no RPC. It:

* resolves the database (starting the embedded PostgreSQL when ``DATABASE_URL`` is unset) and
  applies migrations once, before any worker starts;
* reserves the port (a port of 0 is resolved here, so every worker binds the same one);
* waits until every worker has said it serves (a file in a directory of its own, so this
  works whatever credentials or TLS the port requires);
* serves ``/metrics`` for all workers from prometheus_client's multiprocess directory;
* restarts a worker that dies, and on SIGTERM/SIGINT forwards SIGTERM to every worker, each
  of which drains (health NOT_SERVING first) and finishes its in-flight RPCs within the grace
  period, then stops the embedded database.

Its two directories (the metrics and the ready one) are removed when it stops; when it is
killed outright, by the last of its workers to stop, or else by the next start on the machine
(``remove_abandoned_directories``): each holds a lock file its supervisor and workers hold
while they live.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from context_engine.config import Config, split_addr
from context_engine.telemetry.logs import log

WORKER_ENV = "CE_WORKER_ID"
READY_ENV = "CE_WORKER_READY_DIR"  # a serving worker creates "<id>.<pid>" here
SUPERVISOR_ENV = "CE_WORKER_SUPERVISOR_PID"
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def stop_signals() -> tuple[signal.Signals, ...]:
    """The signals that stop a server gracefully: SIGTERM, SIGINT (Ctrl-C), and SIGHUP (the
    terminal a foreground server ran in closed, an ssh session dropped) unless the process
    was started ignoring it (``nohup``), which keeps it serving."""
    if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
        return (signal.SIGTERM, signal.SIGINT)
    return (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def die_with_supervisor(environ: Mapping[str, str] = os.environ) -> bool:
    """In a worker, on Linux: have the kernel send it SIGTERM when its supervisor dies (a
    SIGKILL included), so no worker serves on without the process that restarts it and
    exports its metrics. A supervisor already gone by then is found by the parent pid.
    True when the request was made."""
    supervisor = environ.get(SUPERVISOR_ENV)
    if supervisor is None or not sys.platform.startswith("linux"):
        return False
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        return False
    if os.getppid() != int(supervisor):  # it died before the request: stop now
        os.kill(os.getpid(), signal.SIGTERM)
    return True
RESTART_BACKOFF_SECONDS = 1.0
DIRECTORY_PREFIXES = ("context-engine-metrics-", "context-engine-ready-")
OWNERS_LOCK = ".owners.lock"  # in each of them: shared-locked by its supervisor and workers
_OWNED: list[int] = []  # this process's shared locks on them


def own_directory(directory: Path, *, create: bool) -> bool:
    """Holds a shared lock on ``directory``'s owners lock until ``leave_directories`` or this
    process exits (the kernel lets go of it at any death, a SIGKILL included, whatever pid
    comes next): while the supervisor or one of its workers lives, no ``remove_abandoned``
    takes the directory. The supervisor makes the file (``create``) and writes its pid into
    it once it holds the lock: an empty file is one whose maker may not hold it yet."""
    flags = os.O_RDWR | os.O_CREAT if create else os.O_RDONLY
    try:
        fd = os.open(directory / OWNERS_LOCK, flags, 0o600)
    except OSError:
        return False
    fcntl.flock(fd, fcntl.LOCK_SH)  # a removal holds it only while it removes
    if create:
        os.write(fd, f"{os.getpid()}\n".encode())
    _OWNED.append(fd)
    return True


def worker_directories(environ: Mapping[str, str] = os.environ) -> list[Path]:
    """A worker's directories of its supervisor's (none outside a worker)."""
    if WORKER_ENV not in environ:
        return []
    return [Path(environ[name]) for name in ("PROMETHEUS_MULTIPROC_DIR", READY_ENV)
            if environ.get(name)]


def leave_directories() -> None:
    """Lets go of this process's shared locks (a worker that has stopped)."""
    while _OWNED:
        os.close(_OWNED.pop())


def remove_abandoned(directory: Path) -> bool:
    """Removes ``directory`` when no process holds its owners lock: its supervisor and every
    worker of it are gone. A directory without the lock file (one made before it existed) is
    left alone: nothing tells whether its processes live; so is another user's (anyone may
    make one under the temporary directory), and one whose lock is no regular file (a FIFO
    there blocked the open, and the start, for good)."""
    try:
        if os.lstat(directory).st_uid != os.geteuid():
            return False
        fd = os.open(directory / OWNERS_LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its supervisor or a worker of it still runs
            return False
        if os.fstat(fd).st_size == 0:  # its maker has not locked it yet
            return False
        shutil.rmtree(directory, ignore_errors=True)
        return not directory.exists()
    finally:
        os.close(fd)


def remove_abandoned_directories(
        directories: list[Path] | None = None) -> list[str]:
    """Removes what supervisors killed outright left (their workers' metrics files and ready
    directory): ``directories``, or every such directory under the temporary directory.
    Logged at warning with the directories removed."""
    if directories is None:
        try:
            directories = [p for p in Path(tempfile.gettempdir()).iterdir()
                           if p.name.startswith(DIRECTORY_PREFIXES) and p.is_dir()
                           and not p.is_symlink()]
        except OSError:
            return []
    removed = sorted(str(d) for d in directories if remove_abandoned(d))
    if removed:
        log("abandoned_files_removed", logging.WARNING, directories=removed)
    return removed


def port_taken(host: str, port: int) -> OSError | None:
    """Why ``host:port`` cannot be bound by a new server, or None (port 0: only its host).

    Every serving socket sets ``SO_REUSEPORT`` (the workers share their port with it), so a
    second server started on a busy port would bind beside the first and silently take half
    its connections, whatever its version or settings. A bind without ``SO_REUSEPORT`` fails
    while any socket holds the port; ``SO_REUSEADDR`` lets a restart bind past connections of
    the last run still in TIME_WAIT."""
    # port 0 is never busy, but its host may still be one this machine cannot bind
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:  # an address family this machine lacks is as much a refusal as a busy port
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except OSError as exc:
        return exc
    return None


_HELD: list[int] = []  # the lock files' descriptors, held until the process exits


def hold_address(host: str, port: int) -> OSError | None:
    """An exclusive lock on ``host:port`` among this machine's servers, held until the server
    stops (``release_addresses``) or its process exits (its workers do not inherit it), or why
    not: another server holds it (EADDRINUSE).

    ``port_taken`` sees a port only once a server listens on it, seconds into its start-up
    (the embedded database, the migrations): two servers started together both found it free
    and both bound it, sharing its connections with ``SO_REUSEPORT``. Port 0 takes a port of
    its own and is not locked; nor is anything where the lock file cannot be made (another
    user's directory): the bind check still stands."""
    if port == 0:
        return None
    directory = Path(tempfile.gettempdir()) / "context-engine-addresses"
    name = "".join(c if c.isalnum() or c in ".-" else "_" for c in host) or "any"
    try:
        directory.mkdir(mode=0o1777, exist_ok=True)
        fd = os.open(directory / f"{name}-{port}.lock", os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return OSError(errno.EADDRINUSE, os.strerror(errno.EADDRINUSE))
    _HELD.append(fd)
    return None


def release_addresses() -> None:
    """Lets go of every address ``hold_address`` holds (a server that has stopped)."""
    while _HELD:
        os.close(_HELD.pop())


def reserve_port(host: str, port: int) -> socket.socket:
    """A bound (not listening) SO_REUSEPORT socket holding the port for the workers."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


@dataclass
class Worker:
    index: int
    proc: subprocess.Popen[bytes]
    started: float = field(default_factory=time.monotonic)


class Supervisor:
    def __init__(self, config: Config, *, count: int, database_url: str,
                 extra_args: list[str]) -> None:
        self.config = config
        self.count = count
        self.database_url = database_url
        self.extra_args = extra_args
        self.host, port = split_addr(config.grpc_addr)
        self.socket = reserve_port(self.host, port)
        self.port = int(self.socket.getsockname()[1])
        self.metrics_dir = Path(tempfile.mkdtemp(prefix="context-engine-metrics-"))
        self.ready_dir = Path(tempfile.mkdtemp(prefix="context-engine-ready-"))
        for directory in (self.metrics_dir, self.ready_dir):
            own_directory(directory, create=True)
        self.workers: dict[int, Worker] = {}
        self.stopping = False

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def _spawn(self, index: int) -> Worker:
        env = {
            **os.environ,
            WORKER_ENV: str(index),
            "DATABASE_URL": self.database_url,
            "CE_GRPC_ADDR": self.address,
            "CE_METRICS_ADDR": "",
            "CE_WORKERS": "1",
            "PROMETHEUS_MULTIPROC_DIR": str(self.metrics_dir),
            READY_ENV: str(self.ready_dir),
            SUPERVISOR_ENV: str(os.getpid()),
        }
        if not self.config.metrics_addr:
            # metrics off: no worker writes metrics files, which nothing would read or fold
            # (a worker that died left its files behind, 1.3 MB a restart)
            del env["PROMETHEUS_MULTIPROC_DIR"]
        proc = subprocess.Popen(
            [sys.executable, "-m", "context_engine", "serve", "--workers", "1",
             *self.extra_args], env=env)
        return Worker(index=index, proc=proc)

    def start_metrics(self) -> Any:
        if not self.config.metrics_addr:
            return None
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(self.metrics_dir)
        from prometheus_client import CollectorRegistry

        from context_engine.telemetry.endpoint import serve_metrics
        from context_engine.telemetry.multiprocess import FoldingCollector

        registry = CollectorRegistry()
        FoldingCollector(registry, path=str(self.metrics_dir))  # type: ignore[no-untyped-call]
        host, port = split_addr(self.config.metrics_addr)
        return serve_metrics(host, port, registry)

    async def wait_serving(self, timeout: float, stop: asyncio.Event | None = None) -> bool:
        """True once every worker reports that it serves (a file in the ready directory:
        this works whatever credentials or TLS the port requires); False if one exits, the
        time runs out or ``stop`` is set (a stop asked for while they start)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if stop is not None and stop.is_set():
                return False
            if any(w.proc.poll() is not None for w in self.workers.values()):
                return False
            if all((self.ready_dir / f"{w.index}.{w.proc.pid}").exists()
                   for w in self.workers.values()):
                return True
            await asyncio.sleep(0.05)
        return False

    async def run(self, *, embedded: bool) -> int:
        metrics_http = self.start_metrics()
        for index in range(self.count):
            self.workers[index] = self._spawn(index)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in stop_signals():
            loop.add_signal_handler(sig, stop.set)
        try:
            if not await self.wait_serving(timeout=120.0, stop=stop):
                if stop.is_set():  # stopped while starting: no worker failed
                    log("stopping", workers=self.count, while_starting=True)
                    await self._stop_workers()
                    log("stopped")
                    return 0
                log("workers_failed_to_start", logging.ERROR, workers=self.count)
                await self._stop_workers()
                return 1
            metrics_port = (int(metrics_http.server_port) if metrics_http is not None
                            else None)
            log("serving", grpc=self.address,
                metrics=(f"{split_addr(self.config.metrics_addr)[0]}:{metrics_port}"
                         if metrics_port is not None else None),
                workers=self.count, pids=[w.proc.pid for w in self.workers.values()],
                database="embedded" if embedded else "external",
                data_dir=str(self.config.data_dir) if embedded else None)
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=0.5)
                await self._restart_dead()
            log("stopping", workers=self.count, drain_seconds=self.config.drain_seconds,
                grace_seconds=self.config.grace_seconds)
            failed = await self._stop_workers()
            if failed:  # the supervisor's code says whether every worker stopped cleanly
                log("stopped", logging.WARNING, workers_failed=failed)
                return 1
            log("stopped")
            return 0
        finally:
            if metrics_http is not None:
                metrics_http.shutdown()
            self.socket.close()
            shutil.rmtree(self.metrics_dir, ignore_errors=True)
            shutil.rmtree(self.ready_dir, ignore_errors=True)
            leave_directories()

    async def _restart_dead(self) -> None:
        for index, worker in list(self.workers.items()):
            code = worker.proc.poll()
            if code is None or self.stopping:
                continue
            self._mark_dead(worker)
            log("worker_exited", logging.WARNING, worker=index, pid=worker.proc.pid, code=code)
            if time.monotonic() - worker.started < RESTART_BACKOFF_SECONDS:
                await asyncio.sleep(RESTART_BACKOFF_SECONDS)
            self.workers[index] = self._spawn(index)

    def _mark_dead(self, worker: Worker) -> None:
        """The dead worker's metrics files folded into the archives (its counters' totals
        kept, the directory no larger for the restart)."""
        if self.config.metrics_addr:
            from context_engine.telemetry.multiprocess import fold_dead

            fold_dead(str(self.metrics_dir), worker.proc.pid)

    async def _stop_workers(self) -> list[int]:
        """SIGTERM to every worker, each waited for until the drain, the grace and ten seconds
        more have passed, then SIGKILLed; the workers that did not exit 0 (killed, or exited
        otherwise), each logged."""
        self.stopping = True
        for worker in self.workers.values():
            if worker.proc.poll() is None:
                worker.proc.send_signal(signal.SIGTERM)
        limit = time.monotonic() + self.config.drain_seconds + self.config.grace_seconds + 10
        while time.monotonic() < limit and any(
                w.proc.poll() is None for w in self.workers.values()):
            await asyncio.sleep(0.1)
        failed = []
        for worker in self.workers.values():
            if worker.proc.poll() is None:
                log("worker_killed", logging.WARNING, worker=worker.index, pid=worker.proc.pid)
                worker.proc.kill()
                worker.proc.wait()
                failed.append(worker.index)
            elif worker.proc.returncode != 0:
                log("worker_exited", logging.WARNING, worker=worker.index, pid=worker.proc.pid,
                    code=worker.proc.returncode)
                failed.append(worker.index)
        return failed


async def supervise(config: Config, count: int, extra_args: list[str]) -> int:
    from context_engine.adapters.postgres.migrate import migrate
    from context_engine.api.server import embedded_database_url

    database_url = config.database_url
    embedded = database_url is None
    if database_url is None:
        database_url = await asyncio.to_thread(embedded_database_url, config.data_dir,
                                               announce=True)
    applied = await migrate(database_url, config.migrations_dir,
                            connect_timeout=config.db_timeout_seconds)
    if applied:
        log("migrated", applied=applied)
    supervisor = Supervisor(config, count=count, database_url=database_url,
                            extra_args=extra_args)
    return await supervisor.run(embedded=embedded)
