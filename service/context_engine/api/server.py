"""The entrypoint's server: gRPC (ContextEngine, health, reflection), metrics, graceful stop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import time
import warnings
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import asyncpg
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry import trace
from prometheus_client import REGISTRY, CollectorRegistry

from context_engine import __version__
from context_engine.adapters.assets import (
    load_control_tools,
    load_model_catalog,
    load_platform_assets,
)
from context_engine.adapters.postgres.erasure import PostgresErasure
from context_engine.adapters.postgres.errors import OUT_OF_STEP, UNAVAILABLE, RefusedConnection
from context_engine.adapters.postgres.maintenance import Maintenance, Policy
from context_engine.adapters.postgres.migrate import migrate
from context_engine.adapters.postgres.pool import connect as connect_one
from context_engine.adapters.postgres.pool import create_pool
from context_engine.adapters.postgres.store import (
    PostgresCalibrationStore,
    PostgresCompactionStore,
    PostgresEventLog,
    PostgresPlanStore,
)
from context_engine.adapters.resilience import BufferedEventLog, LastKnownEpochs
from context_engine.adapters.summarizer import OpenAISummarizer, load_prompt
from context_engine.adapters.tokenizers import TiktokenRegistry
from context_engine.api.auth import RPC_NAMES, auth_interceptor, server_credentials
from context_engine.api.limits import Limits, LimitsInterceptor
from context_engine.api.rpc_metrics import rpc_metrics_interceptor
from context_engine.api.servicer import ContextEngineServicer, add_to_server
from context_engine.api.status import CODES
from context_engine.api.workers import (
    READY_ENV,
    WORKER_ENV,
    die_with_supervisor,
    leave_directories,
    own_directory,
    remove_abandoned_directories,
    stop_signals,
    worker_directories,
)
from context_engine.clock import SYSTEM_CLOCK, Clock
from context_engine.config import Config, split_addr
from context_engine.domain.compaction import StructuredSummarizer, Summarizer
from context_engine.domain.errors import StoreUnavailable
from context_engine.domain.estimator import ModelCatalog
from context_engine.engine import Engine
from context_engine.telemetry.endpoint import serve_metrics
from context_engine.telemetry.logs import log
from context_engine.telemetry.metrics import Metrics
from context_engine.telemetry.tracing import (
    configured_provider,
    instrument_database,
    shut_down,
    tracer_for,
    uninstrument_database,
    untraced,
)
from context_engine.v1 import context_engine_pb2 as pb

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ContextEngine"].full_name


def described(exc: BaseException) -> str:
    """An exception in one line, for a command's one-line error: its type and the first line
    of its message (a driver's may run to several: a DETAIL, a HINT, a whole log)."""
    if isinstance(exc, subprocess.CalledProcessError):  # its message is the whole command
        command = [str(part) for part in exc.cmd]
        return (f"{type(exc).__name__}: {Path(command[0]).name} {command[-1]} exited "
                f"{exc.returncode}")
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


class EmbeddedDatabaseFailed(Exception):
    """The embedded PostgreSQL could not be started (or its directory made): a data directory
    of another PostgreSQL version, a read-only file system, a cluster left half made."""

    def __init__(self, data_dir: Path, cause: BaseException) -> None:
        log_file = data_dir / "pg" / "log"
        where = (f"its log is in {log_file}; " if log_file.is_file() else "")
        super().__init__(
            f"cannot start the embedded PostgreSQL under {data_dir / 'pg'}: {described(cause)} "
            f"({where}or point DATABASE_URL at another database)")


class FirstStartInterrupted(EmbeddedDatabaseFailed):
    """The embedded cluster was left half made: its first start (initdb) was killed."""

    def __init__(self, pg_dir: Path, pid: int) -> None:  # its own message, no cause
        Exception.__init__(
            self,
            f"the first start of this embedded PostgreSQL was interrupted while it made the "
            f"database (its postmaster.pid names initdb's bootstrap, pid {pid}, which no longer "
            f"runs), so the cluster is half made: remove {pg_dir} and start again (it held no "
            "data yet)")


def embedded_exists(data_dir: Path) -> bool:
    """Whether ``data_dir`` holds an embedded cluster (its ``PG_VERSION``), not merely its
    directory: a first start that failed or was interrupted, or an empty volume mounted there,
    leaves ``pg/`` without one, and a command that only reads must not make one."""
    return (data_dir / "pg" / "PG_VERSION").is_file()


def embedded_database_url(data_dir: Path, *, announce: bool = False) -> str:
    # pgserver logs its commands, and on a failure the server's whole log, to stderr: the
    # failure is one line here, naming that log (and stays in it)
    quiet = logging.getLogger("pgserver")
    level, quiet.level = quiet.level, logging.CRITICAL + 1
    try:
        return _embedded_database_url(data_dir, announce=announce)
    except EmbeddedDatabaseFailed:
        raise
    except Exception as exc:  # pgserver's and pg_ctl's failures take many types
        raise EmbeddedDatabaseFailed(data_dir, exc) from exc
    finally:
        quiet.level = level


def _embedded_database_url(data_dir: Path, *, announce: bool = False) -> str:
    """Start (or reuse) the embedded PostgreSQL under ``data_dir``; it survives restarts.

    pgserver stops the database when the last process holding it exits, by a list of the
    holders' pids kept beside the data (``pg/.handle_pids.json``). A holder killed outright
    (SIGKILL, an OOM kill) never took its pid off that list: the next start reused the running
    database, as it should, but at its own clean stop found another holder listed and left the
    database running, and so did every start after it. The pids of processes that no longer
    run are taken off first (under pgserver's lock), so the last live holder stops it again;
    ``announce`` (serve): logs them, as ``embedded_database_holders_gone`` (the other commands
    keep their standard output to what they print)."""
    with warnings.catch_warnings():  # platformdirs warns about XDG_RUNTIME_DIR on import
        warnings.simplefilter("ignore")
        # imported lazily: only the embedded mode needs it
        from pgserver import get_server  # type: ignore[attr-defined]

    pg_dir = data_dir / "pg"
    pg_dir.mkdir(parents=True, exist_ok=True)
    stale = clear_stale_postmaster_pid(pg_dir)
    if stale is not None and announce:
        log("embedded_database_stale_pid", logging.WARNING, pid=stale, data_dir=str(data_dir),
            note="postmaster.pid named a process that is not this directory's PostgreSQL "
                 "(a pid reused since a kill or reboot, or a data directory copied from "
                 "another): taken off, and the database started here")
    gone = forget_dead_holders(pg_dir)
    if gone and announce:
        log("embedded_database_holders_gone", logging.WARNING, pids=gone,
            data_dir=str(data_dir),
            note="a process that used this embedded PostgreSQL ended without releasing it "
                 "(killed); the database is reused and stopped with the last live holder")
    server = get_server(pg_dir, cleanup_mode="stop")
    return str(server.get_uri())


def _postmaster_of(pid: int, pg_dir: Path) -> bool:
    """Whether ``pid`` is a PostgreSQL process of ``pg_dir``: a ``postgres`` (or
    ``postmaster``) program working in that directory, where every PostgreSQL process moves
    (its command line may name it relative to where it was started, or not at all when the
    server read PGDATA; initdb's backend names no directory). A process the machine does not
    let us read is taken to be one (its file is never removed under it)."""
    import psutil  # type: ignore[import-untyped]

    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        command = process.cmdline()
        where = Path(process.cwd()).resolve()
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True
    named = Path(command[0]).name if command else process.name()
    return named in ("postgres", "postmaster") and where == pg_dir.resolve()


def clear_stale_postmaster_pid(pg_dir: Path) -> int | None:
    """Removes ``pg_dir``'s ``postmaster.pid`` when it names no PostgreSQL of this directory;
    the pid it named, else None. pgserver takes any live pid in the file for this cluster's
    postmaster: once that pid was another process's (reused after a kill or a reboot), every
    start failed and stopped that process; in a copy of a data directory, it named the
    original's postmaster, and the copy's commands worked on the original database. Under
    pgserver's lock, so a start in progress elsewhere writes its file unseen by this check.
    A file left by a backend outside the postmaster (its pid negated) whose process is gone,
    in a cluster no server ever started (no ``log``, which pgserver's ``pg_ctl -l`` writes),
    means the first start was killed during initdb: ``FirstStartInterrupted``; in one that
    has run, it is stale like any other (a killed ``postgres --single``)."""
    from pgserver.postgres_server import PostgresServer

    pid_file = pg_dir / "postmaster.pid"
    with PostgresServer._lock:
        try:
            lines = pid_file.read_text(encoding="utf-8", errors="replace").splitlines()
        except FileNotFoundError:
            return None
        try:
            pid = int(lines[0])
        except (IndexError, ValueError):
            pid = 0
        named = Path(lines[1]).resolve() if len(lines) > 1 and lines[1] else None
        if pid and named == pg_dir.resolve() and _postmaster_of(abs(pid), pg_dir):
            return None  # its own PostgreSQL runs
        if pid < 0 and named == pg_dir.resolve() and not (pg_dir / "log").exists():
            raise FirstStartInterrupted(pg_dir, pid)
        pid_file.unlink(missing_ok=True)
        return pid


def _process_runs(pid: int) -> bool:
    import psutil

    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:  # another user's process: it runs
        return True


def forget_dead_holders(pg_dir: Path) -> list[int]:
    """Takes the pids of processes that no longer run (or are zombies) off pgserver's list of
    the embedded database's holders under ``pg_dir``; the pids it took off."""
    from pgserver.postgres_server import PostgresServer
    from pgserver.utils import DiskList

    with PostgresServer._lock:
        holders = DiskList(pg_dir / ".handle_pids.json")
        pids = holders.get()
        gone = [pid for pid in pids if not _process_runs(pid)]
        if gone:
            holders.put([pid for pid in pids if pid not in gone])
    return gone


@dataclass
class Running:
    server: grpc.aio.Server
    health: health.aio.HealthServicer
    pool: asyncpg.Pool
    engine: Engine
    grpc_port: int
    metrics_port: int | None
    metrics_http: Any
    events: BufferedEventLog
    watch: asyncio.Task[None] | None = None
    # where this server's spans went (asyncpg instrumented with it), flushed at stop
    tracing: trace.TracerProvider | None = None
    limits: LimitsInterceptor | None = None
    summarizer: Summarizer | None = None
    maintenance: Maintenance | None = None  # the data lifecycle's cycles
    # the health watch's connection outside the pool, for when every pooled one is busy
    probe: Probe | None = None

    async def stop(self, grace: float, *, drain: float = 0.0) -> None:
        """Health goes NOT_SERVING first and stays so for ``drain`` seconds while RPCs are
        still served (load balancers notice); then new RPCs are refused ``UNAVAILABLE``
        (``SHUTTING_DOWN``) and the running ones get ``grace`` seconds to finish."""
        if self.watch is not None:
            self.watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.watch
        await self.health.enter_graceful_shutdown()
        if drain > 0:
            await asyncio.sleep(drain)
        left = grace
        if self.limits is not None:
            left = await self.limits.quiesce(grace)
            await asyncio.sleep(0.05)  # calls already on the wire are answered, not cancelled
        await self.server.stop(left)
        if self.maintenance is not None:
            await self.maintenance.close()
        await self.events.close()
        await close_pool(self.pool)
        if self.metrics_http is not None:
            self.metrics_http.shutdown()
        if isinstance(self.summarizer, OpenAISummarizer):
            await self.summarizer.aclose()
        if self.tracing is not None:
            uninstrument_database()
            # exports what is still batched, for at most FLUSH_SECONDS: a collector down or
            # hung held the stop 7-10 s past its drain and grace (the exporter retries until
            # its own deadline), towards the supervisor's SIGKILL
            if not await asyncio.to_thread(shut_down, self.tracing, FLUSH_SECONDS):
                log("trace_export_unfinished", logging.WARNING, seconds=FLUSH_SECONDS)


def summarizer_for(config: Config) -> Summarizer:
    """The LLM summarizer when CE_SUMMARIZER_URL is set; the deterministic one otherwise."""
    if config.summarizer_url:
        return OpenAISummarizer(url=config.summarizer_url, model=config.summarizer_model,
                                api_key=config.summarizer_api_key,
                                timeout=config.summarizer_timeout_seconds,
                                max_retries=config.summarizer_max_retries,
                                prompt=load_prompt(config.assets_dir))
    return StructuredSummarizer()


def server_options(config: Config) -> list[tuple[str, int]]:
    """Message limits, and keepalive as gRPC's keepalive guide recommends: the server pings
    idle connections (dead peers and half-open NAT entries are noticed), tolerates client
    pings every 10 s even without calls, and recycles connections after a maximum age so
    clients re-resolve and spread over replicas (with a grace for in-flight calls)."""
    ms = 1000
    return [
        # gRPC's own cap is a backstop at twice the limit; up to it, a request over the
        # limit gets the service's REQUEST_TOO_LARGE status (size, limit) before parsing
        ("grpc.max_receive_message_length", min(2 * config.max_receive_bytes, 2**31 - 1)),
        # likewise a backstop: a response over the limit is answered RESPONSE_TOO_LARGE
        ("grpc.max_send_message_length", min(2 * config.max_send_bytes, 2**31 - 1)),
        ("grpc.keepalive_time_ms", int(config.keepalive_time_seconds * ms)),
        ("grpc.keepalive_timeout_ms", int(config.keepalive_timeout_seconds * ms)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 10 * ms),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.max_connection_age_ms", int(config.max_connection_age_seconds * ms)),
        ("grpc.max_connection_age_grace_ms", int(config.grace_seconds * ms) + 5 * ms),
        ("grpc.so_reuseport", 1),
    ]


# Every status code a call can end with: OK, the domain errors' (status.CODES), INTERNAL (a
# defect), the interceptors' (credentials, limits, shutdown), and a call cancelled under its
# handler (rpc_metrics.cancelled_code: its deadline passed, or its caller gave up).
ANSWERED_CODES = tuple(sorted({"OK", "INTERNAL", "UNAUTHENTICATED", "PERMISSION_DENIED",
                               "RESOURCE_EXHAUSTED", "UNAVAILABLE", "DEADLINE_EXCEEDED",
                               "CANCELLED", *(code.name for _, code in CODES)}))


async def initialise_metrics(metrics: Metrics, calibrations: PostgresCalibrationStore,
                             catalog: ModelCatalog) -> None:
    """Every labelled series at zero before the first call (``Metrics.initialise``), and the
    correction factor of each model family as PostgreSQL last reconciled it."""
    factors: dict[str, float] | None
    try:
        latest = await calibrations.latest_factors()
    except StoreUnavailable:
        factors = None  # unset beats a stale value that the merge would take as the latest
        log("metrics_factors_unread", logging.WARNING)
    else:  # oldest first: each family keeps the factor reconciled last
        factors = {catalog.family(model_id): factor for model_id, factor in latest}
    metrics.initialise(families=catalog.families(), methods=sorted(RPC_NAMES),
                       codes=ANSWERED_CODES, factors=factors)


def tokenizer_loaded(encoding: str, counter: str, seconds: float) -> None:
    log("tokenizer_loaded", encoding=encoding, counter=counter, seconds=round(seconds, 3))


async def warm_tokenizers(tokenizers: TiktokenRegistry, encodings: tuple[str, ...]) -> None:
    started = time.perf_counter()
    await asyncio.to_thread(tokenizers.warm, encodings)
    log("tokenizers_warm", encodings=list(encodings),
        seconds=round(time.perf_counter() - started, 3))


async def start(config: Config, *, database_url: str,
                registry: CollectorRegistry = REGISTRY,
                tracer_provider: trace.TracerProvider | None = None,
                clock: Clock = SYSTEM_CLOCK) -> Running:
    """``tracer_provider``: where spans go; without one, the provider the SDK configures
    from the ``OTEL_*`` variables when they ask for trace export (``Config.trace_export``),
    else nowhere (a no-op tracer, no SDK loaded). With a provider, asyncpg is instrumented
    (after the start-up queries) so statements are spans under the RPC's. ``clock``: the
    server's clock (tests run a real server across midnight with one of their own)."""
    # Every tokenizer the catalog names loads beside the migrations, and before anything is
    # opened or served: no call waits for a load (0.7-0.9 s for the catalog's, here).
    catalog = load_model_catalog(config.model_catalog)
    tokenizers = TiktokenRegistry(on_load=tokenizer_loaded)
    warming = asyncio.ensure_future(warm_tokenizers(tokenizers, catalog.encodings()))
    try:
        applied = await migrate(database_url, config.migrations_dir,
                                connect_timeout=config.db_timeout_seconds)
    except BaseException:
        await settled(warming)
        raise
    await joined(warming)
    return await _start(config, database_url=database_url, registry=registry,
                        tracer_provider=tracer_provider, clock=clock, catalog=catalog,
                        tokenizers=tokenizers, applied=applied)


async def joined(task: asyncio.Future[None]) -> None:
    """``await task``, except that cancelling the caller does not cancel the task (a thread
    cannot be stopped): the caller's cancellation is raised once the task has ended."""
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        if not task.done():
            await settled(task)
        raise


async def settled(task: asyncio.Future[None]) -> None:
    """Waits for ``task`` to end, whatever the caller is unwinding from; a failure of its own
    is logged, not lost."""
    await asyncio.wait([task])
    if not task.cancelled() and task.exception() is not None:
        log("tokenizers_failed", logging.ERROR, error=repr(task.exception()))


async def _start(config: Config, *, database_url: str, registry: CollectorRegistry,
                 tracer_provider: trace.TracerProvider | None, clock: Clock,
                 catalog: ModelCatalog, tokenizers: TiktokenRegistry,
                 applied: list[str]) -> Running:
    if applied:
        log("migrated", applied=applied)
    pool = await create_pool(database_url, pooler=config.db_pooler,
                             max_size=config.db_pool_size, timeout=config.db_timeout_seconds)
    metrics = Metrics(registry)
    # The data lifecycle: a cycle now (today's partitions exist before the first call), then
    # one every CE_MAINTENANCE_INTERVAL_SECONDS; every replica runs them, one at a time works.
    # A cycle counts the epochs it claims (left uncounted) as their writers count theirs.
    maintenance = Maintenance(pool=pool, clock=clock, policy=maintenance_policy(config),
                              interval_seconds=config.maintenance_interval_seconds,
                              count_epoch=metrics.epoch_counted)
    # one try at the partitions: start-up does not wait out a reader of the events (the
    # partitions ahead cover the days until the next cycle); no epochs counted before the
    # metrics are first scraped, whose increase() would never show them
    await maintenance.attempt(ddl_tries=1, epochs=False)
    provider = tracer_provider
    if provider is None and config.trace_export:
        provider = configured_provider(__version__)
    tracer = tracer_for(provider)
    summarizer = summarizer_for(config)
    timeout = config.db_timeout_seconds
    # Context events take their identity and time from the server's clock.
    events = BufferedEventLog(PostgresEventLog(pool, command_timeout=timeout, tracer=tracer,
                                               clock=clock), clock=clock)
    key_ttl = timedelta(hours=config.idempotency_key_ttl_hours)
    calibrations = PostgresCalibrationStore(pool, command_timeout=timeout, tracer=tracer,
                                            key_ttl=key_ttl)
    await initialise_metrics(metrics, calibrations, catalog)
    engine = Engine(
        # a claim of an epoch's count whose COMMIT goes unanswered: settled by the cycles
        store=LastKnownEpochs(PostgresPlanStore(pool, command_timeout=timeout, tracer=tracer,
                                                clock=clock, key_ttl=key_ttl,
                                                unsettled=maintenance.keep)),
        events=events,
        calibrations=calibrations,
        policy=config.budget_policy(), calibration_ttl=config.calibration_ttl_seconds,
        catalog=catalog,
        tokenizers=tokenizers,
        assets=load_platform_assets(config.assets_dir),
        control_tools=load_control_tools(config.assets_dir),
        metrics=metrics, plan_cache_size=config.plan_cache_size,
        plan_cache_ttl=config.plan_cache_ttl_seconds,
        build_cache_bytes=config.build_cache_mb * 1024 * 1024,
        render_memo_bytes=config.render_memo_mb * 1024 * 1024,
        erasure=PostgresErasure(pool, command_timeout=timeout, tracer=tracer),
        compactions=PostgresCompactionStore(pool, command_timeout=timeout, tracer=tracer,
                                            clock=clock, key_ttl=key_ttl),
        summarizer=summarizer, tracer=tracer, clock=clock)
    if provider is not None:
        instrument_database(provider)  # after the start-up queries, which are no RPC's

    def base_items(tenant_id: str, session_id: str, build_id: str) -> int | None:
        base = engine.builds.peek(tenant_id, session_id, build_id)
        return None if base is None else len(base.items)

    limits = LimitsInterceptor(Limits(max_concurrent=config.max_concurrent_rpcs,
                                      max_items=config.max_items_per_request,
                                      max_item_bytes=config.max_item_bytes), metrics,
                               base_items=base_items, tracer=tracer)
    # Credentials first: an unauthenticated caller takes no concurrency slot. None in dev mode.
    auth = auth_interceptor(config, pool, metrics, tracer)
    # gRPC server metrics outermost: they count the calls the others refuse, with their codes.
    observed = rpc_metrics_interceptor(metrics, config, clock)
    server = grpc.aio.server(interceptors=[observed, *([auth] if auth else []), limits],
                             options=server_options(config))
    add_to_server(ContextEngineServicer(engine, metrics, tracer), server,
                  max_request_bytes=config.max_receive_bytes,
                  max_response_bytes=config.max_send_bytes)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME), server)
    credentials = server_credentials(config)  # None: plaintext
    grpc_port = (server.add_insecure_port(config.grpc_addr) if credentials is None
                 else server.add_secure_port(config.grpc_addr, credentials))
    if grpc_port == 0:
        raise RuntimeError(f"could not bind gRPC to {config.grpc_addr}")

    metrics_http = None
    metrics_port = None
    if config.metrics_addr:
        host, port = split_addr(config.metrics_addr)
        metrics_http = serve_metrics(host, port, registry)
        metrics_port = int(metrics_http.server_port)

    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    events.start()
    maintenance.start()
    probe_timeout = min(1.0, config.db_timeout_seconds)

    def probe() -> Awaitable[asyncpg.Connection]:
        return connect_one(database_url, pooler=config.db_pooler, timeout=probe_timeout)

    watch = asyncio.get_running_loop().create_task(
        watch_health(health_servicer, pool, engine, interval=HEALTH_INTERVAL_SECONDS,
                     timeout=probe_timeout, outside=probe))
    return Running(server=server, health=health_servicer, pool=pool, engine=engine,
                   grpc_port=grpc_port, metrics_port=metrics_port, metrics_http=metrics_http,
                   events=events, watch=watch, tracing=provider, limits=limits,
                   summarizer=summarizer, maintenance=maintenance, probe=probe)


def maintenance_policy(config: Config) -> Policy:
    """What the maintenance cycles keep, from the CE_* settings."""
    return Policy(retention_days=config.events_retention_days,
                  ahead_days=config.event_partitions_ahead_days,
                  key_ttl=timedelta(hours=config.idempotency_key_ttl_hours),
                  lock_timeout_seconds=config.db_timeout_seconds)


HEALTH_INTERVAL_SECONDS = 1.0
# The most a stop waits for the spans still batched to be exported
FLUSH_SECONDS = 1.0
# The most a stop waits for the database to answer its pooled connections' goodbyes
POOL_CLOSE_SECONDS = 2.0


async def close_pool(pool: asyncpg.Pool) -> None:
    """Closes the pool's connections, for at most ``POOL_CLOSE_SECONDS``: a database that
    does not answer (hung, or gone) has them ended without its answer, logged, and the stop
    goes on (it raised, and the stop ended there in a traceback and exit 1, its metrics
    endpoint, summarizer and traces left as they were)."""
    try:
        async with asyncio.timeout(POOL_CLOSE_SECONDS):
            await pool.close()
    except UNAVAILABLE as exc:
        pool.terminate()
        log("pool_close_failed", logging.WARNING, error=described(exc),
            note="the database did not answer; its connections were ended without it")


# opens a connection to the database outside the pool (the health watch's, when the pool is busy)
Probe = Callable[[], Awaitable[asyncpg.Connection]]


async def database_reachable(pool: asyncpg.Pool, timeout: float,
                             outside: Probe | None = None) -> bool | None:
    """Whether the database answers ``SELECT 1``, each step bounded by ``timeout`` seconds: on
    a connection of the pool when one frees within ``timeout``; else (every pooled connection
    busy serving, or the pool's new connection slow to open) on one of its own, opened by
    ``outside`` for the probe and closed after it. A pool busy serving is not a database away,
    and waiting for it to free would leave health unchanged while it is: the connection outside
    it tells them apart. A pooled connection whose ``SELECT 1`` answers late is asked about the
    same way: late is how a busy database answers (behind a pooler whose server connections are
    all taken, the query waits in its queue) and how a hung one does, and only a connection
    outside the pool tells them apart. False: the database is away (a connection error, or no
    connection within ``timeout``). None: busy, not away (the database let the probe in but did
    not answer within ``timeout``, as a pooler answers while its server connections are all
    taken, or refused it, or the pool's new connection, for too many connections; or the pool
    was busy, or its connection answered late, and there is no ``outside``): the caller keeps
    the state it had."""
    try:
        with untraced():  # a probe every second, not a trace of its own
            try:
                connection = await pool.acquire(timeout=timeout)
            except TimeoutError:
                return None if outside is None else await probe_outside(outside, timeout)
            except RefusedConnection as exc:  # the pool's new connection, refused
                if isinstance(exc.cause, asyncpg.TooManyConnectionsError):
                    return None  # the server answered: full, not away
                raise
            late = False
            try:
                await connection.fetchval("SELECT 1", timeout=timeout)
            except TimeoutError:
                late = True
            finally:
                if late:  # its cancel may go unanswered (a pooler's queue): the pool ends it
                    with contextlib.suppress(*UNAVAILABLE):
                        await pool.release(connection, timeout=timeout)
                else:
                    await pool.release(connection, timeout=timeout)
            if late:
                return None if outside is None else await probe_outside(outside, timeout)
    except (*UNAVAILABLE, asyncpg.PostgresError):
        return False
    except asyncpg.InternalClientError as exc:
        # a pooled connection the server ended, handed out before asyncpg saw the end: the
        # database going away, not a defect; raised, it ended the health watch for good
        if str(exc).startswith(OUT_OF_STEP):
            return False
        raise
    return True


async def probe_outside(outside: Probe, timeout: float) -> bool | None:
    """``database_reachable`` on a connection outside the pool (see there)."""
    try:
        # asyncio.timeout, not wait_for: this Python's wait_for returns a connection made just
        # as its caller is cancelled and drops the cancel (the health watch then outlived stop,
        # which waited on it for good)
        async with asyncio.timeout(timeout):
            connection = await outside()
    except asyncpg.TooManyConnectionsError:
        return None  # the server answered: full, not away
    except (*UNAVAILABLE, asyncpg.PostgresError):
        return False
    try:
        await connection.fetchval("SELECT 1", timeout=timeout)
    except TimeoutError:
        return None  # let in, too busy to answer within the bound
    except (*UNAVAILABLE, asyncpg.PostgresError):
        return False
    finally:
        with contextlib.suppress(Exception):  # closing aborts the connection if it must
            await connection.close(timeout=timeout)
    return True


async def watch_health(servicer: health.aio.HealthServicer, pool: asyncpg.Pool, engine: Engine,
                       *, interval: float, timeout: float, outside: Probe | None = None) -> None:
    """Health is NOT_SERVING only when this process can serve nothing: the database is away
    and no plan is cached (with plans cached, Build keeps serving those sessions). It returns
    to SERVING by itself when the database does; the pool reconnects on its own. A pool busy
    serving (every connection taken), or a pooled ``SELECT 1`` answering late, is not the
    database away: the probe then asks on a connection of its own (``outside``), and a database
    that is busy, not away, keeps the state as it was, so health neither waits for the pool nor
    changes under load."""
    serving = was_reachable = True
    while True:
        await asyncio.sleep(interval)
        answer = await database_reachable(pool, timeout, outside)
        reachable = was_reachable if answer is None else answer
        can_serve = reachable or len(engine.cache) > 0
        if reachable != was_reachable:
            was_reachable = reachable
            log("database", logging.INFO if reachable else logging.WARNING,
                reachable=reachable, cached_plans=len(engine.cache))
        if can_serve != serving:
            serving = can_serve
            status = (health_pb2.HealthCheckResponse.SERVING if serving
                      else health_pb2.HealthCheckResponse.NOT_SERVING)
            for name in ("", SERVICE_NAME):
                await servicer.set(name, status)
            log("health", logging.INFO if serving else logging.WARNING, serving=serving)


async def serve(config: Config) -> None:
    die_with_supervisor()  # a worker: stopped when its supervisor dies
    directories = worker_directories()
    for directory in directories:  # a worker: its supervisor's, held while it lives
        own_directory(directory, create=False)
    try:
        await _serve(config)
    finally:  # the last process of a supervisor killed outright removes what it left
        leave_directories()
        remove_abandoned_directories(directories)


async def _serve(config: Config) -> None:
    database_url = config.database_url
    embedded = database_url is None
    if database_url is None:
        database_url = await asyncio.to_thread(embedded_database_url, config.data_dir,
                                               announce=True)
    running = await start(config, database_url=database_url)
    host, _ = split_addr(config.grpc_addr)
    worker = os.environ.get(WORKER_ENV)
    if worker is None:
        log("serving", grpc=f"{host}:{running.grpc_port}",
            metrics=(f"{split_addr(config.metrics_addr)[0]}:{running.metrics_port}"
                     if running.metrics_port is not None else None),
            database="embedded" if embedded else "external",
            data_dir=str(config.data_dir) if embedded else None)
    else:  # the supervisor's line says where the metrics and the database are
        log("worker_serving", grpc=f"{host}:{running.grpc_port}", worker=worker,
            pid=os.getpid())
    ready = os.environ.get(READY_ENV)
    if worker is not None and ready:  # tells the supervisor this worker serves
        (Path(ready) / f"{worker}.{os.getpid()}").touch()

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in stop_signals():
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    # health says NOT_SERVING before the line says so (a probe that read the line then asks)
    await running.health.enter_graceful_shutdown()
    log("stopping", drain_seconds=config.drain_seconds, grace_seconds=config.grace_seconds)
    await running.stop(config.grace_seconds, drain=config.drain_seconds)
    log("stopped")
