"""``make load-replicas``: separate ``serve`` processes sharing one PostgreSQL through PgBouncer.

    python -m tests.load.replicas [--runtimes 100] [--turns 25] [--phases 1,3,kill]
                                  [--kill-at 0.4] [--results FILE]

Starts an embedded PostgreSQL in a temporary directory, migrates it, puts a real PgBouncer in
transaction pooling mode in front of it (``tests.support.pgbouncer``), and starts three
``context-engine serve`` processes (``--workers 1`` each, dev mode, ``CE_DB_POOLER=transaction``,
their own loopback ports), every one connected to PostgreSQL only through the pooler. Then, with
the simulated runtimes of ``make load`` (``tests.load.runtime``), each on a channel of its own:

- phase ``1``: the load against the first process alone (the other two idle);
- phase ``3``: the same load balanced over the three: each runtime's channel targets the static
  list ``ipv4:127.0.0.1:p1,127.0.0.1:p2,127.0.0.1:p3`` with ``round_robin``, so its calls rotate
  over the processes; the calls each process served (its ``/metrics``) show the spread;
- phase ``kill``: the same again, and one process SIGKILLed once ``--kill-at`` of the run's
  RPCs had ended, at a moment when keyed writes are in flight on it: the run holds the tenant's
  calibration row (as a slow report would) until some of that process's ``ReportUsage`` calls
  wait on it in PostgreSQL, their idempotency keys claimed in open transactions, kills the
  process, and lets the row go (``hold_then_kill``). The runtimes apply the clients' retry
  policy themselves
  (``clients/retry_service_config.json``: ``UNAVAILABLE`` retried, a keyed write with the same
  idempotency key), so the calls the killed process dropped are sent again through the others;
  every retry is counted, and so is how long after the kill the last retried call was answered,
  and the longest pause in answers.

Every phase has a tenant of its own and must end with every runtime's turns done, zero calls
failed for good, exactly one epoch per session (the ``plans`` rows of each session, read from
PostgreSQL directly), zero lost plans (each acknowledged plan found in PostgreSQL as
acknowledged, as ``make load`` checks) and every acknowledged usage report counted exactly once
(the ``ReportUsage`` idempotency keys stored, and the reports counted per epoch). Throughput is
the OK answers per second; three processes on the machine's cores against one is what those
cores allow, not scale-out. The table is printed and, with ``--results``, written as Markdown.
Bounded: it stops by itself (``--time-limit``, default 600 s) and exits non-zero on any failure
of its checks.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import itertools
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import grpc
from context_engine.adapters.postgres.migrate import migrate

from tests.bench.common import deadline
from tests.integration.processes import ServerProcess
from tests.load.run import CHANNEL_OPTIONS, Report, check_acknowledged, metric, scrape
from tests.load.runtime import Outcome, Retry, documented_retry, run_runtimes
from tests.support.pgbouncer import PGBOUNCER, PgBouncer

REPO = Path(__file__).resolve().parents[2]
PHASES = ("1", "3", "kill")
TITLES = {"1": "1 replica", "3": "3 replicas", "kill": "3 replicas, one SIGKILLed"}
RPCS_PER_TURN = 4  # Plan, Build, Build, ReportUsage
# Holding the calibration row before the kill: at most this long each time (under the service's
# database timeout, CE_DB_TIMEOUT_SECONDS, 5 s by default), at most this many times.
HOLD_SECONDS, HOLD_ATTEMPTS = 3.0, 10
KILLED = 1  # which of the three processes the kill phase SIGKILLs
SERVED = "context_engine_rpc_seconds_count"  # every RPC a process answered, any code


@dataclass
class Phase:
    name: str
    replicas: int
    tenant: str
    report: Report
    served: list[float]  # RPCs each targeted process answered during the phase
    killed: dict[str, Any] = field(default_factory=dict)
    retried_answered_within: float = 0.0  # seconds after the kill: every retried call answered
    longest_pause: float = 0.0  # between two consecutive OK answers, over all runtimes
    usage_acknowledged: int = 0
    usage_counted: int = 0
    # PgBouncer at the end: the processes' connections to it, and its own to PostgreSQL
    pooler_clients: int = 0
    pooler_servers: int = 0

    @property
    def ok(self) -> int:
        return sum(1 for c in self.report.calls if c.code == "OK")

    @property
    def answers_per_second(self) -> float:
        return self.ok / self.report.wall_seconds if self.report.wall_seconds else 0.0

    def summary(self) -> dict[str, Any]:
        return {**self.report.summary(), "phase": self.name, "replicas": self.replicas,
                "tenant": self.tenant, "ok_answers": self.ok,
                "answers_per_second": round(self.answers_per_second, 1),
                "retried": self.report.retried(), "served": self.served,
                "killed": self.killed,
                "retried_answered_within_ms": round(self.retried_answered_within * 1000, 1),
                "longest_pause_ms": round(self.longest_pause * 1000, 1),
                "usage_acknowledged": self.usage_acknowledged,
                "usage_counted": self.usage_counted, "pooler_clients": self.pooler_clients,
                "pooler_servers": self.pooler_servers}


# ------------------------------------------------------------------------------ the stack


@contextlib.contextmanager
def embedded_postgres() -> Iterator[str]:
    """A migrated embedded PostgreSQL in a temporary directory, stopped and removed after."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from pgserver import get_server  # type: ignore[attr-defined]
    tmp = Path(tempfile.mkdtemp(prefix="ce-replicas-pg-"))
    pg = get_server(tmp / "pg", cleanup_mode="stop")
    try:
        url = str(pg.get_uri())
        asyncio.run(migrate(url, REPO / "migrations"))
        yield url
    finally:
        pg.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)


def application_name(index: int) -> str:
    """What process ``index`` names itself to PostgreSQL (PgBouncer passes it on to whichever
    server connection runs its transaction), so its backends can be told apart."""
    return f"context-engine-{index + 1}"


def start_replicas(count: int, pooler_url: str, db_pool_size: int) -> list[ServerProcess]:
    """``count`` separate ``serve`` processes (not ``--workers``: a process and a port each),
    started at the same time, every one on PostgreSQL through the pooler only."""
    def env(index: int) -> dict[str, str]:
        url = (f"{pooler_url}{'&' if '?' in pooler_url else '?'}"
               f"application_name={application_name(index)}")
        return {"DATABASE_URL": url, "CE_DB_POOLER": "transaction", "CE_WORKERS": "1",
                "CE_DEV_MODE": "1", "CE_MAX_CONCURRENT_RPCS": "1024",
                "CE_DB_POOL_SIZE": str(db_pool_size)}

    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        futures = [pool.submit(ServerProcess, env(i), timeout=120) for i in range(count)]
        started: list[ServerProcess] = []
        problems: list[BaseException] = []
        for future in futures:
            try:
                started.append(future.result())
            except Exception as exc:  # stop the ones that did start, then raise
                problems.append(exc)
    if problems:
        for server in started:
            server.kill()
        raise problems[0]
    return started


def warm_up(servers: Sequence[ServerProcess]) -> None:
    """One turn on each process first, so no phase pays for another's first calls (loading
    the tokenizer, the first connections)."""
    async def one(server: ServerProcess) -> None:
        outcome = Outcome()
        await run_runtimes(server.address, CHANNEL_OPTIONS, tenant=f"warm-{uuid.uuid4().hex[:8]}",
                           runtimes=1, turns=1, outcome=outcome, stop=asyncio.Event())
        failed = [c for c in outcome.calls if c.code != "OK"]
        if failed:
            raise RuntimeError(f"warm-up on {server.address} failed: {failed}")

    async def every() -> None:
        await asyncio.gather(*(one(s) for s in servers))

    asyncio.run(every())


def pooler_connections(pooler: PgBouncer) -> tuple[int, int]:
    """(client connections to PgBouncer, its server connections to PostgreSQL) right now."""
    clients = servers = 0
    for row in pooler.pools():
        clients += sum(int(row.get(k) or 0) for k in ("cl_active", "cl_waiting", "cl_idle"))
        servers += sum(int(row.get(k) or 0) for k in ("sv_active", "sv_idle", "sv_used",
                                                       "sv_tested", "sv_login"))
    return clients, servers


def target(servers: Sequence[ServerProcess]) -> str:
    """The static address list gRPC's round_robin balances over (loopback only)."""
    return "ipv4:" + ",".join(s.address for s in servers)


# ------------------------------------------------------------------------------ one phase


async def writes_waiting(watch: asyncpg.Connection, victim: str) -> tuple[int, int]:
    """(backends waiting for a lock in a statement on ``estimator_calibration``, those of them
    running a transaction of process ``victim``). ``watch`` must not be in a transaction: a
    transaction reads pg_stat_activity once and keeps that snapshot."""
    row = await watch.fetchrow(
        "SELECT count(*) AS every, count(*) FILTER (WHERE application_name = $1) AS victim "
        "FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
        "AND query LIKE '%estimator_calibration%' AND pid <> pg_backend_pid()", victim)
    return int(row["every"]), int(row["victim"])


async def hold_then_kill(server: ServerProcess, victim: str, *, database_url: str,
                         tenant: str, pool_size: int, killed: dict[str, Any]) -> None:
    """SIGKILL ``server`` while keyed writes are in flight on it, their keys claimed in open
    transactions. Every ReportUsage claims its idempotency key and then locks the tenant's
    calibration row, so while this holds that row (as a slow report would) the reports wait
    on it with their keys claimed; once one of ``victim``'s does, the process is killed and
    the row let go. When the pooler's server connections all fill with other processes'
    reports first (``victim``'s then wait in PgBouncer's queue, with nothing claimed), the
    row is let go and held again a moment later."""
    conn = await asyncpg.connect(database_url)
    watch = await asyncpg.connect(database_url)
    try:
        for attempt in range(1, HOLD_ATTEMPTS + 1):
            held = time.perf_counter()
            async with conn.transaction():
                if not await conn.fetch("SELECT 1 FROM estimator_calibration "
                                        "WHERE tenant_id = $1 FOR UPDATE", tenant):
                    raise RuntimeError("no usage report was counted before the kill")
                while time.perf_counter() - held < HOLD_SECONDS:
                    every, theirs = await writes_waiting(watch, victim)
                    if theirs or every >= pool_size:
                        break
                    await asyncio.sleep(0.005)
                if theirs:
                    # synchronous on purpose: nothing else happens between the count read from
                    # its /metrics (nothing can be read after) and the kill
                    killed["served_before_kill"] = metric(scrape(server.metrics), SERVED)
                    killed["at"] = time.perf_counter()
                    os.kill(server.proc.pid, signal.SIGKILL)
                    killed.update(keyed_writes_in_flight=theirs, hold_attempts=attempt,
                                  held_ms=round((killed["at"] - held) * 1000, 1))
                    return  # the row is let go as the transaction ends
            await asyncio.sleep(0.2)
    finally:
        await watch.close()
        await conn.close()
    raise RuntimeError(f"no ReportUsage of {victim} reached PostgreSQL in {HOLD_ATTEMPTS} "
                       "holds of the calibration row")


async def drive(address: str, *, tenant: str, runtimes: int, turns: int, retry: Retry,
                victim: tuple[ServerProcess, str] | None = None, kill_at: float = 0.0,
                database_url: str = "", pool_size: int = 0
                ) -> tuple[Outcome, float, dict[str, Any]]:
    """The runtimes against ``address``; with a ``victim`` (the process and its application
    name), SIGKILL it once ``kill_at`` of the run's RPCs had ended, with keyed writes in flight
    on it (``hold_then_kill``)."""
    outcome = Outcome()
    stop = asyncio.Event()  # never set: every runtime runs all its turns
    killed: dict[str, Any] = {}

    async def kill(server: ServerProcess, name: str, started: float) -> None:
        expected = runtimes * turns * RPCS_PER_TURN
        while len(outcome.calls) < kill_at * expected:
            await asyncio.sleep(0.005)
        killed["rpcs_done_before"] = len(outcome.calls)
        try:
            await hold_then_kill(server, name, database_url=database_url, tenant=tenant,
                                 pool_size=pool_size, killed=killed)
        except Exception as exc:  # reported by the phase; the load goes on
            killed["problem"] = str(exc)
            return
        killed["after_seconds"] = round(killed["at"] - started, 2)

    began = time.perf_counter()
    killer = asyncio.create_task(kill(*victim, began)) if victim is not None else None
    try:
        _, wall = await run_runtimes(address, CHANNEL_OPTIONS, tenant=tenant,
                                     runtimes=runtimes, turns=turns, outcome=outcome,
                                     stop=stop, retry=retry)
    finally:
        if killer is not None and not killer.done():
            killer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await killer
    return outcome, wall, killed


def longest_pause(outcome: Outcome) -> float:
    ends = sorted(c.started + c.seconds for c in outcome.calls if c.code == "OK")
    return max((b - a for a, b in itertools.pairwise(ends)), default=0.0)


def answered_within(outcome: Outcome, since: float) -> float:
    """How long after ``since`` the last call that had to be sent again was answered."""
    return max((c.started + c.seconds - since for c in outcome.calls
                if c.attempt > 1 and not c.retried), default=0.0)


async def stored_sessions(database_url: str, tenant: str) -> dict[str, list[int]]:
    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch("SELECT session_id, array_agg(epoch ORDER BY epoch) AS epochs "
                                "FROM plans WHERE tenant_id = $1 GROUP BY session_id", tenant)
    finally:
        await conn.close()
    return {str(r["session_id"]): [int(e) for e in r["epochs"]] for r in rows}


async def stored_usage(database_url: str, tenant: str) -> tuple[set[str], int]:
    """The ReportUsage idempotency keys stored for ``tenant``, and the reports counted over its
    epochs (each key's first report counts once; a retry of it counts nothing)."""
    conn = await asyncpg.connect(database_url)
    try:
        keys = await conn.fetch("SELECT key FROM idempotency_keys WHERE tenant_id = $1 "
                                "AND rpc = 'ReportUsage'", tenant)
        counted = await conn.fetchval("SELECT coalesce(sum(reports), 0) FROM epoch_usage "
                                       "WHERE tenant_id = $1", tenant)
    finally:
        await conn.close()
    return {str(r["key"]) for r in keys}, int(counted)


def check(phase: Phase, outcome: Outcome, database_url: str, turns: int) -> None:
    """Every runtime's turns done, nothing failed for good, one epoch per session, no plan lost,
    every acknowledged usage report counted once, the calls spread over the processes."""
    report, failures = phase.report, phase.report.failures
    short = {s: n for s, n in outcome.turns_by_session.items() if n != turns}
    if short or len(outcome.turns_by_session) != report.runtimes:
        failures.append(f"{len(short)} of {report.runtimes} runtimes did not finish their "
                        f"{turns} turns: " + ", ".join(f"{s} {n}" for s, n in
                                                        sorted(short.items())[:10]))
    final = [c for c in report.calls if c.code != "OK" and not c.retried]
    if final:
        codes = sorted({f"{c.method} {c.code}" for c in final})
        failures.append(f"{len(final)} calls failed for good: {codes}")
    epochs = asyncio.run(stored_sessions(database_url, phase.tenant))
    sessions = sorted(set(outcome.sessions))
    wrong = {s: epochs.get(s, []) for s in sessions if epochs.get(s) != [1]}
    report.epochs_per_session = (round(sum(len(epochs.get(s, [])) for s in sessions)
                                       / len(sessions), 4) if sessions else None)
    if wrong:
        failures.append(f"{len(wrong)} sessions do not have exactly one epoch: " + ", ".join(
            f"{s} epochs {e}" for s, e in sorted(wrong.items())[:10]))
    check_acknowledged(report, outcome.plans, database_url)
    keys, counted = asyncio.run(stored_usage(database_url, phase.tenant))
    acked = set(outcome.usage_keys)
    phase.usage_acknowledged, phase.usage_counted = len(acked), counted
    if keys != acked or counted != len(acked):
        failures.append(f"usage reports: {len(acked)} acknowledged, {len(keys)} keys stored "
                        f"({len(acked - keys)} acknowledged but not stored, {len(keys - acked)} "
                        f"stored but never acknowledged), {counted} counted")
    # round_robin: each process about an equal share (the killed one: until it was killed)
    alive = [n for i, n in enumerate(phase.served) if not (phase.killed and i == KILLED)]
    if phase.replicas > 1 and (min(phase.served) <= 0
                               or min(alive) < sum(alive) / len(alive) / 2):
        failures.append(f"the calls were not spread over the {phase.replicas} processes: "
                        f"{phase.served}")


def run_phase(name: str, servers: list[ServerProcess], database_url: str, pooler: PgBouncer,
              *, runtimes: int, turns: int, kill_at: float) -> Phase:
    used = servers[:1] if name == "1" else servers
    victim = used[KILLED] if name == "kill" else None
    tenant = f"replicas-{name}-{uuid.uuid4().hex[:8]}"
    before = [metric(scrape(s.metrics), SERVED) for s in used]
    outcome, wall, killed = asyncio.run(drive(
        target(used), tenant=tenant, runtimes=runtimes, turns=turns, retry=documented_retry(),
        victim=None if victim is None else (victim, application_name(KILLED)),
        kill_at=kill_at, database_url=database_url, pool_size=pooler.default_pool_size))
    served = []
    for server, was in zip(used, before, strict=True):
        now = (killed.get("served_before_kill", was) if server is victim
               else metric(scrape(server.metrics), SERVED))
        served.append(now - was)
    report = Report(runtimes=runtimes, turns=turns, workers=1, wall_seconds=wall,
                    calls=outcome.calls, turns_done=outcome.turns)
    phase = Phase(name=name, replicas=len(used), tenant=tenant, report=report, served=served,
                  longest_pause=longest_pause(outcome))
    phase.pooler_clients, phase.pooler_servers = pooler_connections(pooler)
    if victim is not None:
        if "at" not in killed:
            report.failures.append(killed.get("problem")
                                   or "the load ended before the kill: nothing was tested")
        else:
            code = victim.proc.wait(30)
            phase.retried_answered_within = answered_within(outcome, killed.pop("at"))
            failed = [c for c in outcome.calls if c.code != "OK"]
            phase.killed = {**killed, "exit_code": code, "failed_attempts": len(failed),
                            "codes": sorted({c.code for c in failed})}
            if code != -signal.SIGKILL:
                report.failures.append(f"the killed process exited {code}")
            if not failed:
                report.failures.append("no call was in flight on the killed process: the kill "
                                       "tested nothing (more runtimes, or a later --kill-at)")
    check(phase, outcome, database_url, turns)
    return phase


# ------------------------------------------------------------------------------ the run


def run(phases: Sequence[str], *, runtimes: int, turns: int, kill_at: float = 0.4,
        pool_size: int = 10, db_pool_size: int = 10,
        database_url: str | None = None) -> list[Phase]:
    """The phases in order on one stack: PostgreSQL (``database_url``, migrated; else an
    embedded one), PgBouncer in transaction mode in front, three ``serve`` processes on it."""
    with contextlib.ExitStack() as stack:
        url = database_url or stack.enter_context(embedded_postgres())
        pooler = PgBouncer(url, pool_mode="transaction", default_pool_size=pool_size).start()
        stack.callback(pooler.stop)
        servers = start_replicas(3, pooler.url, db_pool_size)
        for server in servers:
            stack.callback(server.kill)
        warm_up(servers)
        return [run_phase(name, servers, url, pooler, runtimes=runtimes, turns=turns,
                          kill_at=kill_at) for name in phases]
    raise AssertionError("unreachable")  # ExitStack does not swallow exceptions


# ------------------------------------------------------------------------------ reporting


def table(phases: Sequence[Phase]) -> str:
    head = ("| phase | RPCs answered | wall s | answers/s | errors | retried | epochs/session "
            "| lost plans | usage reports counted | RPCs served per process "
            "| connections to PgBouncer / to PostgreSQL |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for p in phases:
        s = p.summary()
        rows.append(f"| {TITLES[p.name]} | {p.ok:,} | {s['wall_seconds']} | "
                    f"{s['answers_per_second']} | {s['errors']} | {s['retried']} | "
                    f"{s['epochs_per_session']} | {s['lost_plans']} of {s['plans_checked']} | "
                    f"{p.usage_counted:,} of {p.usage_acknowledged:,} | "
                    f"{' / '.join(f'{int(n):,}' for n in p.served)} | "
                    f"{p.pooler_clients} / {p.pooler_servers} |")
    return "\n".join(rows)


def ratio(phases: Sequence[Phase]) -> float | None:
    by = {p.name: p for p in phases}
    if "1" in by and "3" in by and by["1"].answers_per_second:
        return by["3"].answers_per_second / by["1"].answers_per_second
    return None


def describe(phases: Sequence[Phase], *, runtimes: int, turns: int, kill_at: float,
             pool_size: int, db_pool_size: int) -> str:
    lines = [f"{runtimes} runtimes x {turns} turns per phase, loopback; three `serve` "
             f"processes (`--workers 1` each) sharing one PostgreSQL through PgBouncer "
             f"(transaction pooling, {pool_size} server connections; each process's pool "
             f"{db_pool_size}).", "", table(phases), ""]
    r = ratio(phases)
    if r is not None:
        lines.append(f"Throughput, 3 processes against 1: {r:.2f}x on {os.cpu_count()} cores "
                     "shared with the load generator, PgBouncer and PostgreSQL: what these "
                     "cores allow, not scale-out.")
    for p in phases:
        if p.killed:
            k = p.killed
            lines.append(
                f"Kill: process {KILLED + 1} SIGKILLed {k['after_seconds']} s in (after "
                f"{k['rpcs_done_before']:,} RPCs had ended, --kill-at {kill_at}), while "
                f"{k['keyed_writes_in_flight']} of its ReportUsage calls waited in PostgreSQL "
                f"with their idempotency keys claimed (the calibration row held "
                f"{k['held_ms']:.0f} ms, hold {k['hold_attempts']}); "
                f"{k['failed_attempts']} attempts failed ({', '.join(k['codes'])}), "
                f"{p.report.retried()} of them sent again through the other processes, "
                f"{p.report.errors()} failed for good; the last of them was answered "
                f"{p.retried_answered_within * 1000:.0f} ms after the kill; the longest pause "
                "in answers (all runtimes) was "
                f"{p.longest_pause * 1000:.0f} ms.")
    lines += ["", "Latency per RPC (ms, every attempt):", ""]
    for p in phases:
        lines += [f"{TITLES[p.name]}:", "", "```", p.report.table(), "```", ""]
    return "\n".join(lines)


def machine() -> str:
    cpu = platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    pgbouncer = subprocess.run([PGBOUNCER, "--version"], capture_output=True, text=True,
                               check=False).stdout.splitlines()[:1]
    return (f"{os.cpu_count()} cores ({cpu}), Python {platform.python_version()}, "
            f"grpcio {grpc.__version__}, {' '.join(pgbouncer) or 'PgBouncer ?'}, "
            f"load average at start {os.getloadavg()[0]:.2f}")


def shown(argv: Sequence[str]) -> str:
    """The command line, without where the JSON summary went (a file of that run only)."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip or arg.startswith("--json="):
            skip = False
            continue
        if arg == "--json":
            skip = True
            continue
        out.append(arg)
    return " ".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make load-replicas")
    parser.add_argument("--runtimes", type=int, default=100)
    parser.add_argument("--turns", type=int, default=25)
    parser.add_argument("--phases", default=",".join(PHASES),
                        help="which phases, in order: 1, 3 and kill")
    parser.add_argument("--kill-at", type=float, default=0.4,
                        help="SIGKILL one process once this share of the RPCs had ended")
    parser.add_argument("--pool-size", type=int, default=10,
                        help="PgBouncer's server connections (default_pool_size)")
    parser.add_argument("--db-pool-size", type=int, default=10,
                        help="each process's CE_DB_POOL_SIZE (its connections to PgBouncer)")
    parser.add_argument("--time-limit", type=int, default=600)
    parser.add_argument("--results", help="also write the table here (Markdown)")
    parser.add_argument("--json", help="also write the summaries to this file")
    args = parser.parse_args(argv)
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    if not phases or set(phases) - set(PHASES):
        parser.error(f"--phases takes some of {', '.join(PHASES)}")
    if args.runtimes < 1 or args.turns < 1 or not 0 < args.kill_at < 1:
        parser.error("--runtimes and --turns must be at least 1, --kill-at within (0, 1)")
    where, began = machine(), time.monotonic()
    with deadline(args.time_limit, "the replicas load run"):
        done = run(phases, runtimes=args.runtimes, turns=args.turns, kill_at=args.kill_at,
                   pool_size=args.pool_size, db_pool_size=args.db_pool_size)
    text = describe(done, runtimes=args.runtimes, turns=args.turns, kill_at=args.kill_at,
                    pool_size=args.pool_size, db_pool_size=args.db_pool_size)
    print(text)
    failures = [f"{TITLES[p.name]}: {f}" for p in done for f in p.report.failures]
    if args.results:
        Path(args.results).write_text(
            "# `make load-replicas` results\n\n"
            f"Produced by `make load-replicas` (`python -m tests.load.replicas "
            f"{shown(argv if argv is not None else sys.argv[1:])}`); rewritten on every "
            f"run. Machine: {where}. Whole run {time.monotonic() - began:.0f} s.\n\n{text}\n"
            + ("".join(f"\nFAILED: {f}\n" for f in failures)), encoding="utf-8")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump([p.summary() for p in done], fh, indent=2, sort_keys=True)
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    raise SystemExit(main())
