"""Shared fixtures: a throwaway PostgreSQL (embedded, unless CE_TEST_DATABASE_URL is set) behind
a real PgBouncer in transaction pooling mode, and a real gRPC server on ephemeral ports, run in a
background thread with its own event loop.

``database_url`` is the pooler's URL: every test that uses it, and every server the suite
starts (in process or as ``context-engine serve`` processes, all with
``CE_DB_POOLER=transaction``), goes through PgBouncer as a deployment behind one does.
``direct_database_url`` is PostgreSQL itself, for what must see the server as it is."""

from __future__ import annotations

import asyncio
import compileall
import concurrent.futures
import contextlib
import fnmatch
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import pytest
from context_engine.adapters.postgres.migrate import migrate
from context_engine.api.server import Running, start
from context_engine.clock import SYSTEM_CLOCK, Clock
from context_engine.config import Config, Pooler
from context_engine.v1 import context_engine_pb2_grpc as pb_grpc
from hypothesis import HealthCheck, settings
from prometheus_client import CollectorRegistry

from tests.support.pgbouncer import PgBouncer

# A test run started in the background of a shell without job control inherits SIGINT ignored,
# and so would every process it starts: the Ctrl-C tests would then check nothing of the
# program's own handling. Handled here, each process the tests start gets the default again.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

REPO = Path(__file__).resolve().parents[1]

# Servers the suite starts as processes (`context-engine serve` on loopback) run in dev mode,
# like the in-process fixture below; a test that checks credentials sets CE_DEV_MODE itself.
os.environ.setdefault("CE_DEV_MODE", "1")
# ... and, like every server the suite starts, behind the transaction pooler of `database_url`.
os.environ.setdefault("CE_DB_POOLER", "transaction")
# No hypothesis example has a time limit (its default is 200 ms), nor is slow data generation
# an error: how long a test takes is not what it checks, and the suite runs in parallel
# processes on a busy machine. Performance is measured by `make bench`.
# derandomized, without an example database: every run and every machine draws the same
# examples, so a failure comes back on a re-run
settings.register_profile("suite", deadline=None, derandomize=True, database=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("suite")
# Server connections PgBouncer opens to PostgreSQL for the whole suite: few, so that clients'
# transactions really share them.
SUITE_POOL_SIZE = 10


def pytest_configure(config: pytest.Config) -> None:
    """The service's bytecode, compiled once per run before anything else starts (in the only
    process, or in xdist's controller before its workers): the suite starts hundreds of Python
    processes that import the service (its workers, every ``context-engine serve`` and its
    worker processes, the command-line tests), and where no bytecode is kept
    (``PYTHONDONTWRITEBYTECODE``, as on a machine that sets it for everything) each compiled
    every module it imports again, about 0.35 s a process. Sources newer than their bytecode
    (an edit, a mutant's copy) are compiled again here, as an import would."""
    if not hasattr(config, "workerinput"):
        compileall.compile_dir(REPO / "service" / "context_engine", quiet=1)
        if (getattr(config.option, "numprocesses", None) or 0) > 0:
            _rewrite_before_workers(config)


# The run's configuration, for the processes of ``_rewrite_before_workers`` (forked: they
# inherit it rather than pickle it).
_REWRITING: list[pytest.Config] = []


def _rewritten(path: str) -> None:
    """One test module's asserts rewritten as an import of it by pytest rewrites them, and kept
    where that import looks first (its ``__pycache__``, pytest's own file name and format)."""
    from _pytest.assertion import rewrite

    module = Path(path)
    cache = rewrite.get_cache_dir(module)
    pyc = cache / (module.name[:-3] + rewrite.PYC_TAIL)
    if rewrite._read_pyc(module, pyc) is not None or not rewrite.try_makedirs(cache):
        return
    source_hash, code = rewrite._rewrite_test(module, _REWRITING[0])
    temporary = pyc.with_name(f"{pyc.name}.{os.getpid()}")
    with open(temporary, "wb") as out:
        rewrite._write_pyc_fp(out, source_hash, code)
    os.replace(temporary, pyc)


def _rewrite_before_workers(config: pytest.Config) -> None:
    """Each test module's rewritten bytecode, made once in xdist's controller before its workers
    start, in a process per core. Every worker collects the whole suite, and pytest rewrites the
    asserts of each test module it imports (a parse, a rewrite and a compile: 19 s of CPU a
    worker, against 13 s for the rest of its collection), keeping the result only where bytecode
    may be written; the workers read it here whatever ``PYTHONDONTWRITEBYTECODE`` says. The
    modules under the run's paths only; one that fails to parse is left to the worker's import,
    which reports it. Modules other than tests and conftests get ordinary bytecode."""
    patterns = [*config.getini("python_files"), "conftest.py"]
    paths = [Path(arg.split("::")[0]) for arg in config.args] or [REPO / "tests"]
    modules: set[Path] = set()
    for path in (p if p.is_absolute() else Path(config.invocation_params.dir) / p
                 for p in paths):
        found = path.rglob("*.py") if path.is_dir() else [path] if path.suffix == ".py" else []
        for module in found:
            if any(fnmatch.fnmatch(module.name, pattern) for pattern in patterns):
                modules.add(module.resolve())
            else:
                compileall.compile_file(module, quiet=1)
    _REWRITING[:] = [config]
    try:
        with concurrent.futures.ProcessPoolExecutor(
                os.cpu_count() or 1, mp_context=multiprocessing.get_context("fork")) as pool:
            for done in [pool.submit(_rewritten, str(m)) for m in sorted(modules)]:
                with contextlib.suppress(SyntaxError):
                    done.result()
    finally:
        _REWRITING.clear()


# The whole suite as this run collected it, before -k, -m or anything else deselected part of
# it; set only when the run collected every test file under ``tests/`` (none left out by its
# paths, ``--ignore`` or ``--lf``): what ``tests/unit/test_mutants_catalog.py`` matches the
# mutants' selections against instead of collecting the suite again in a process of its own
# (about 20 s of CPU).
WHOLE_SUITE = pytest.StashKey[list[pytest.Item]]()


# The files that take longest, in seconds summed over their tests (a run of the whole suite
# under three workers, pytest's junit times), heaviest first. `make test` runs one file per
# worker at a time (``--dist loadfile``), in the order of the collection
# (``--no-loadscope-reorder``; xdist's own order, most tests first, started the 955 quick
# catalog checks first and the 5 tests of the fuzz file among the last): a worker's last file
# is what the others wait for, so the longest go first and the short ones fill in after them.
# A file's figure going stale costs a little wall time, never a test.
LONGEST_FIRST = {
    "tests/integration/test_fuzz.py": 98,
    "tests/integration/test_workers.py": 94,
    "tests/integration/test_processes.py": 79,
    "tests/integration/test_processes_embedded.py": 75,
    "tests/unit/test_validation_resume.py": 65,
    "tests/integration/test_build_cache_memory.py": 55,
    "tests/property/test_gate_region.py": 45,
    "tests/clients/test_typescript_client.py": 41,
    "tests/integration/test_migrations.py": 40,
    "tests/integration/test_epoch_counts.py": 38,
    "tests/integration/test_erasure.py": 34,
    "tests/clients/test_python_package.py": 32,
    "tests/integration/test_summarizer_sdk.py": 31,
    "tests/integration/test_health_saturated_pool.py": 30,
    "tests/unit/test_mutants_catalog.py": 30,
    "tests/property/test_gate_determinism.py": 27,
    "tests/unit/test_budget.py": 26,
    "tests/unit/test_observability_assets.py": 24,
    "tests/integration/test_incremental_differential.py": 24,
    "tests/clients/test_python_client.py": 23,
    "tests/integration/test_lifecycle.py": 22,
    "tests/unit/test_cli.py": 22,
    "tests/integration/test_supervisor_leftovers.py": 22,
    "tests/property/test_gate_trust_labels.py": 22,
    "tests/integration/test_prometheus.py": 21,
    "tests/property/test_gate_budget.py": 20,
    "tests/integration/test_auth.py": 19,
    "tests/integration/test_compact_rpc.py": 19,
    "tests/bench/test_bench_smoke.py": 18,
    "tests/integration/test_tracing.py": 18,
}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
    suite = REPO / "tests"
    collected = {Path(item.path).resolve() for item in items}
    if collected == {p.resolve() for p in suite.rglob("test_*.py")}:
        config.stash[WHOLE_SUITE] = list(items)
    if hasattr(config, "workerinput"):  # an xdist worker: its collection orders the files
        items.sort(key=lambda item: -LONGEST_FIRST.get(
            Path(item.path).resolve().relative_to(REPO).as_posix(), 0))


def run(coro: Any) -> Any:
    return asyncio.run(coro)


@pytest.fixture(scope="session")
def direct_database_url() -> Iterator[str]:
    """PostgreSQL itself, migrated (not the pooler)."""
    external = os.environ.get("CE_TEST_DATABASE_URL")
    if external:
        run(migrate(external, REPO / "migrations"))
        yield external
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from pgserver import get_server
    tmp = Path(tempfile.mkdtemp(prefix="ce-test-pg-"))
    server = get_server(tmp / "pg", cleanup_mode="stop")
    url = str(server.get_uri())
    run(migrate(url, REPO / "migrations"))
    yield url
    server.cleanup()
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def pgbouncer(direct_database_url: str) -> Iterator[PgBouncer]:
    """The suite's PgBouncer (transaction pooling) in front of ``direct_database_url``."""
    with PgBouncer(direct_database_url, pool_mode="transaction",
                   default_pool_size=SUITE_POOL_SIZE) as pooler:
        yield pooler


@pytest.fixture(scope="session")
def database_url(pgbouncer: PgBouncer) -> str:
    """The database as the service sees it in the suite: through the transaction pooler."""
    return pgbouncer.url


class ServerThread:
    """A real server (the same ``start`` the CLI uses) on its own loop in a thread."""

    def __init__(self, config: Config, database_url: str, *, clock: Clock | None = None) -> None:
        self.registry = CollectorRegistry()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.running: Running = self.call(start(config, database_url=database_url,
                                                registry=self.registry,
                                                clock=clock or SYSTEM_CLOCK))
        self.address = f"127.0.0.1:{self.running.grpc_port}"

    def call(self, coro: Any, timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, grace: float = 1.0, drain: float = 0.0) -> None:
        self.call(self.running.stop(grace, drain=drain))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def test_config() -> Config:
    """Dev mode (no credentials) on loopback, behind the transaction pooler; auth tests start
    their own non-dev server."""
    return Config().replace(grpc_addr="127.0.0.1:0", metrics_addr="127.0.0.1:0",
                   grace_seconds=1.0, dev_mode=True, db_pooler=Pooler.TRANSACTION,
                   # servers on clocks of their own share this database: nothing ages out of
                   # it (the data lifecycle's tests use databases of their own)
                   events_retention_days=3650, idempotency_key_ttl_hours=87_600)


@pytest.fixture(scope="module")
def secured(database_url: str, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[ServerThread, str, str]]:
    """A server that requires credentials; its one token may call every RPC of one tenant:
    (server, tenant, token)."""
    import json

    from context_engine.api.auth import token_sha256

    tenant, token = f"tenant-{uuid.uuid4().hex[:10]}", f"token-{uuid.uuid4().hex}"
    path = tmp_path_factory.mktemp("tokens") / "tokens.json"
    path.write_text(json.dumps([{"sha256": token_sha256(token), "tenant_id": tenant,
                                 "rpcs": ["*"]}]))
    server = ServerThread(test_config().replace(dev_mode=False, auth_tokens_file=path),
                          database_url)
    yield server, tenant, token
    server.stop()


@pytest.fixture(scope="session")
def server(database_url: str) -> Iterator[ServerThread]:
    srv = ServerThread(test_config(), database_url)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def channel(server: ServerThread) -> Iterator[grpc.Channel]:
    ch = grpc.insecure_channel(server.address)
    yield ch
    ch.close()


@pytest.fixture
def stub(channel: grpc.Channel) -> pb_grpc.ContextEngineStub:
    return pb_grpc.ContextEngineStub(channel)


@pytest.fixture
def ids() -> tuple[str, str]:
    """A fresh tenant and session per test, so tests never see each other's rows."""
    return f"tenant-{uuid.uuid4().hex[:12]}", f"session-{uuid.uuid4().hex[:12]}"


class Db:
    """Synchronous read/write helpers for assertions on the real database."""

    def __init__(self, url: str) -> None:
        self.url = url

    async def _fetch(self, sql: str, *args: Any) -> list[asyncpg.Record]:
        # no statement cache: behind the pooler a named statement would stay on a server
        # connection another client gets next
        conn = await asyncpg.connect(self.url, statement_cache_size=0)
        try:
            return list(await conn.fetch(sql, *args))
        finally:
            await conn.close()

    def fetch(self, sql: str, *args: Any) -> list[asyncpg.Record]:
        return list(run(self._fetch(sql, *args)))

    def val(self, sql: str, *args: Any) -> Any:
        rows = self.fetch(sql, *args)
        return rows[0][0] if rows else None

    def counts(self, tenant_id: str) -> dict[str, int]:
        return {t: int(self.val(f"SELECT count(*) FROM {t} WHERE tenant_id = $1", tenant_id))
                for t in ("sessions", "plans", "context_events")}


@pytest.fixture(scope="session")
def db(database_url: str) -> Db:
    return Db(database_url)
