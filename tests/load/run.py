"""``make load``: simulated runtimes against a real multi-process server on loopback.

    python -m tests.load.run [--runtimes 100] [--turns 50] [--workers 2] [--sigterm-after S]
                             [--build-mode incremental|full|both]

Starts ``context-engine serve --workers N`` on 127.0.0.1 (ephemeral ports, an embedded
PostgreSQL in a temporary directory), runs every runtime concurrently, each on its own
connection (as separate runtime processes would), and prints throughput, latency percentiles
per RPC, the error count, and epochs per session (from GetPlan of every session, and from the
server's own counters). With ``--sigterm-after`` the server gets SIGTERM mid-run: the run then
checks that health went NOT_SERVING first, every RPC started before the drain ended completed
OK, and nothing failed other than with UNAVAILABLE after the listener closed.

Both runs record every plan the server acknowledged (each ``Plan`` answered OK: tenant,
session, epoch, prefix hash) and, after the run (after a restart on the same data in the
SIGTERM run), look each one up in PostgreSQL itself (the ``plans`` table, not a server's
cache): one missing, or stored with another prefix hash, is a lost plan and fails the run.
Bounded in count and time: it stops by itself (``--time-limit``, default 900 s per run) and
exits non-zero on any failure of its checks.

The runtimes Build incrementally by default (``--build-mode incremental``: through the Python
client's incremental core, each Build naming the previous one as its base; see
``tests.load.runtime``); ``full`` sends every Build whole, as before; ``both`` runs the same load
twice, incremental then full, each against a server of its own, and prints them side by side.
Every run reports, per Build: the bytes on the wire (request + response, from ``ByteSize``), the
server's CPU time (user + system of the supervisor and its workers, from psutil, between the
start and the end of the load, Plan and ReportUsage included, divided by the Builds answered)
and the ``BUILD_BASE_UNKNOWN`` fallbacks (a Build refused for a base its worker does not hold,
sent again whole: counted, not an error). An incremental run fails if no Build was served from
a base or a delta did not read back.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
import warnings
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import psutil
from context_engine.v1 import context_engine_pb2 as pb
from context_engine.v1 import context_engine_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.bench.common import deadline
from tests.integration.processes import ServerProcess
from tests.load.runtime import AckedPlan, Call, Outcome, run_runtimes

TENANT = "load-tenant"
# What the documented client configuration does besides retrying (retries stay off here, so
# every failure shows): watch the server's health and stop sending to a draining process.
SERVICE_CONFIG = json.dumps({"loadBalancingConfig": [{"round_robin": {}}],
                             "healthCheckConfig": {
                                 "serviceName": "context_engine.v1.ContextEngine"}})
CHANNEL_OPTIONS = [("grpc.use_local_subchannel_pool", 1),  # one connection per runtime
                   ("grpc.service_config", SERVICE_CONFIG),
                   ("grpc.max_send_message_length", 64 * 1024 * 1024),
                   ("grpc.max_receive_message_length", 64 * 1024 * 1024)]


@dataclass
class Report:
    runtimes: int
    turns: int
    workers: int
    wall_seconds: float
    calls: list[Call]
    turns_done: int
    epochs_per_session: float | None = None
    epochs_per_session_metrics: float | None = None
    plans_acknowledged: int = 0  # Plan calls answered OK
    plans_checked: int = 0  # distinct acknowledged plans looked up in PostgreSQL
    lost_plans: int = 0
    shutdown: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    build_mode: str = "full"
    builds: int = 0  # Build calls answered OK
    build_request_bytes: int = 0
    build_response_bytes: int = 0
    incremental_builds: int = 0
    fallbacks: int = 0  # BUILD_BASE_UNKNOWN, sent again whole
    mismatches: int = 0
    server_cpu_seconds: float | None = None  # the server's CPU time during the load

    def errors(self) -> int:
        """Calls that failed for good (an attempt that was sent again is a retry, not one; a
        Build refused BUILD_BASE_UNKNOWN and sent again whole is a fallback, not one)."""
        return sum(1 for c in self.calls if c.code != "OK" and not c.retried
                   and not c.fallback)

    def bytes_per_build(self) -> float | None:
        return ((self.build_request_bytes + self.build_response_bytes) / self.builds
                if self.builds else None)

    def cpu_ms_per_build(self) -> float | None:
        if self.server_cpu_seconds is None or not self.builds:
            return None
        return self.server_cpu_seconds * 1000 / self.builds

    def retried(self) -> int:
        return sum(1 for c in self.calls if c.retried)

    def table(self) -> str:
        lines = [f"{'rpc':<12} {'calls':>7} {'errors':>7} {'p50 ms':>8} {'p95 ms':>8} "
                 f"{'p99 ms':>8}"]
        for method in ("Plan", "Build", "ReportUsage", "GetPlan"):
            ms = sorted(c.seconds * 1000 for c in self.calls if c.method == method)
            if not ms:
                continue
            errors = sum(1 for c in self.calls if c.method == method and c.code != "OK"
                         and not c.retried and not c.fallback)
            lines.append(f"{method:<12} {len(ms):>7} {errors:>7} {pct(ms, 50):>8.1f} "
                         f"{pct(ms, 95):>8.1f} {pct(ms, 99):>8.1f}")
        return "\n".join(lines)

    def summary(self) -> dict[str, Any]:
        return {"runtimes": self.runtimes, "turns": self.turns, "workers": self.workers,
                "turns_done": self.turns_done, "rpcs": len(self.calls),
                "wall_seconds": round(self.wall_seconds, 2),
                "rpcs_per_second": round(len(self.calls) / self.wall_seconds, 1),
                "errors": self.errors(), "epochs_per_session": self.epochs_per_session,
                "epochs_per_session_metrics": self.epochs_per_session_metrics,
                "plans_acknowledged": self.plans_acknowledged,
                "plans_checked": self.plans_checked,
                "lost_plans": self.lost_plans, "shutdown": self.shutdown,
                "failures": self.failures, "build_mode": self.build_mode,
                "builds": self.builds, "build_request_bytes": self.build_request_bytes,
                "build_response_bytes": self.build_response_bytes,
                "bytes_per_build": _round(self.bytes_per_build(), 1),
                "incremental_builds": self.incremental_builds,
                "build_base_unknown_fallbacks": self.fallbacks,
                "delta_mismatches": self.mismatches,
                "server_cpu_seconds": _round(self.server_cpu_seconds, 3),
                "server_cpu_ms_per_build": _round(self.cpu_ms_per_build(), 3)}

    def build_line(self) -> str:
        per = self.bytes_per_build()
        cpu = self.cpu_ms_per_build()
        return (f"Build ({self.build_mode}): {self.builds} answered, "
                f"{self.incremental_builds} from a base; bytes per Build "
                f"{'-' if per is None else f'{per:,.0f}'} (requests "
                f"{self.build_request_bytes:,} + responses {self.build_response_bytes:,} bytes)"
                f"; server CPU per Build {'-' if cpu is None else f'{cpu:.2f} ms'}; "
                f"BUILD_BASE_UNKNOWN fallbacks {self.fallbacks}")


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def pct(sorted_ms: list[float], p: int) -> float:
    if len(sorted_ms) == 1:
        return sorted_ms[0]
    return statistics.quantiles(sorted_ms, n=100, method="inclusive")[p - 1]


async def watch_health(address: str, stop: asyncio.Event, seen: dict[str, float]) -> None:
    # a plain probe (no client-side health checking of its own), as a load balancer's
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while not stop.is_set():
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if (reply.status != health_pb2.HealthCheckResponse.SERVING
                        and "not_serving" not in seen):
                    seen["not_serving"] = time.perf_counter()
            except grpc.aio.AioRpcError:
                seen.setdefault("unreachable", time.perf_counter())
            await asyncio.sleep(0.02)


async def drive(address: str, runtimes: int, turns: int, sigterm: tuple[ServerProcess, float]
                | None, incremental: bool = False) -> tuple[Outcome, float, dict[str, float]]:
    outcome = Outcome()
    stop = asyncio.Event()
    seen: dict[str, float] = {}
    watcher = asyncio.create_task(watch_health(address, stop, seen))

    async def terminate(server: ServerProcess, after: float) -> None:
        await asyncio.sleep(after)
        seen["sigterm"] = time.perf_counter()
        server.proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(server.proc.wait, 120)
        seen["exited"] = time.perf_counter()
        stop.set()

    killer = (asyncio.create_task(terminate(*sigterm)) if sigterm is not None else None)
    try:
        started, wall = await run_runtimes(address, CHANNEL_OPTIONS, tenant=TENANT,
                                           runtimes=runtimes, turns=turns, outcome=outcome,
                                           stop=stop, incremental=incremental)
        if killer is not None:
            await killer
    finally:
        stop.set()
        await watcher
    seen["started"] = started
    return outcome, wall, seen


async def epochs_per_session(address: str, sessions: list[str]) -> float:
    """The mean current epoch of the sessions that exist (GetPlan of each)."""
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stub = pb_grpc.ContextEngineStub(channel)
        epochs: list[int] = []
        for session in sessions:
            try:
                reply = await stub.GetPlan(pb.GetPlanRequest(tenant_id=TENANT,
                                                             session_id=session), timeout=10)
                epochs.append(reply.plan.epoch)
            except grpc.aio.AioRpcError as err:
                if err.code() is not grpc.StatusCode.NOT_FOUND:  # never acknowledged
                    raise
    return sum(epochs) / len(epochs) if epochs else 0.0


PlanKey = tuple[str, str, int]  # tenant, session, epoch


async def stored_plans(database_url: str, tenants: Iterable[str]) -> dict[PlanKey, str]:
    """Every plan PostgreSQL holds for ``tenants``, with its prefix hash."""
    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch("SELECT tenant_id, session_id, epoch, prefix_sha256 FROM plans "
                                "WHERE tenant_id = ANY($1::text[])", sorted(set(tenants)))
    finally:
        await conn.close()
    return {(r["tenant_id"], r["session_id"], int(r["epoch"])): str(r["prefix_sha256"])
            for r in rows}


def lost_plans(acked: Iterable[AckedPlan], stored: Mapping[PlanKey, str]) -> list[AckedPlan]:
    """The acknowledged plans that are not stored, or are stored as another plan."""
    return [p for p in sorted(set(acked))
            if stored.get((p.tenant, p.session, p.epoch)) != p.prefix_sha256]


def check_acknowledged(report: Report, acked: list[AckedPlan], database_url: str) -> None:
    """Look every acknowledged plan up in PostgreSQL; count them, and fail the run on any lost
    one (or when no Plan was acknowledged at all, which would leave nothing checked)."""
    distinct = sorted(set(acked))
    stored = asyncio.run(stored_plans(database_url, {p.tenant for p in distinct}))
    lost = lost_plans(distinct, stored)
    report.plans_acknowledged = len(acked)
    report.plans_checked = len(distinct)
    report.lost_plans = len(lost)
    if not distinct:
        report.failures.append("no Plan was acknowledged: there is nothing to check")
    if lost:
        report.failures.append(
            f"{len(lost)} of {len(distinct)} acknowledged plans are not in PostgreSQL as "
            "acknowledged: " + ", ".join(
                f"{p.tenant}/{p.session} epoch {p.epoch} "
                f"({'missing' if (p.tenant, p.session, p.epoch) not in stored else 'differs'})"
                for p in lost[:10]))


@contextlib.contextmanager
def embedded_database(data: str) -> Iterator[str]:
    """The URL of the server's embedded PostgreSQL under ``data``; this process holds a handle
    while inside (one server started it; the last handle closed stops it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from pgserver import get_server  # type: ignore[attr-defined]
    pg = get_server(Path(data) / "pg", cleanup_mode="stop")
    try:
        yield str(pg.get_uri())
    finally:
        pg.cleanup()


def metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def scrape(metrics_addr: str) -> str:
    with urllib.request.urlopen(f"http://{metrics_addr}/metrics", timeout=10) as response:
        return str(response.read().decode())


def server_processes(server: ServerProcess) -> list[psutil.Process]:
    """The server's processes: the supervisor and the workers it reported serving with (one
    process when it serves alone)."""
    serving = next(r for r in reversed(server.log) if r.get("event") == "serving")
    pids = [server.proc.pid, *(p for p in serving.get("pids") or () if p != server.proc.pid)]
    return [psutil.Process(pid) for pid in pids]


def cpu_seconds(processes: list[psutil.Process]) -> float:
    """User + system CPU time of the processes so far (their own, not their children's)."""
    total = 0.0
    for proc in processes:
        times = proc.cpu_times()
        total += times.user + times.system
    return total


def run(args: argparse.Namespace) -> Report:
    data = tempfile.mkdtemp(prefix="ce-load-")
    env = {"CE_WORKERS": str(args.workers), "CE_DATA_DIR": data, "CE_DEV_MODE": "1",
           "CE_GRACE_SECONDS": str(args.grace), "CE_DRAIN_SECONDS": str(args.drain),
           "CE_MAX_CONCURRENT_RPCS": "1024"}
    server = ServerProcess(env, timeout=180)
    restarted: ServerProcess | None = None
    mode = getattr(args, "build_mode", "incremental")
    try:
        sigterm = (server, args.sigterm_after) if args.sigterm_after else None
        processes = server_processes(server)
        cpu_before = cpu_seconds(processes)
        outcome, wall, seen = asyncio.run(drive(server.address, args.runtimes, args.turns,
                                                sigterm, incremental=mode == "incremental"))
        # after a SIGTERM the processes are gone: no CPU figure for that run
        cpu = cpu_seconds(processes) - cpu_before if sigterm is None else None
        report = Report(runtimes=args.runtimes, turns=args.turns, workers=args.workers,
                        wall_seconds=wall, calls=outcome.calls, turns_done=outcome.turns,
                        build_mode=mode, builds=outcome.builds,
                        build_request_bytes=outcome.build_request_bytes,
                        build_response_bytes=outcome.build_response_bytes,
                        incremental_builds=outcome.incremental_builds,
                        fallbacks=outcome.fallbacks, mismatches=outcome.mismatches,
                        server_cpu_seconds=cpu)
        if outcome.mismatches:
            report.failures.append(f"{outcome.mismatches} incremental Build responses did not "
                                   "read back against their base")
        if mode == "incremental" and sigterm is None and not outcome.incremental_builds:
            report.failures.append("no Build was answered relative to a base: the incremental "
                                   "path was not exercised")
        sessions = sorted(set(outcome.sessions))
        if sigterm is None:
            if report.errors():
                failed = Counter(f"{c.method} {c.code}" + (f" ({c.details})" if c.details else "")
                                 for c in outcome.calls if c.code != "OK")
                report.failures.append(f"{report.errors()} RPCs failed: {dict(failed)}")
            text = scrape(server.metrics)
            opened = metric(text, "context_engine_sessions_opened_total")
            epochs = metric(text, "context_engine_epochs_total")
            report.epochs_per_session_metrics = round(epochs / opened, 4) if opened else None
            per = asyncio.run(epochs_per_session(server.address, sessions))
            with embedded_database(data) as url:
                check_acknowledged(report, outcome.plans, url)
        else:
            sigterm_at, close_at = seen["sigterm"], seen["sigterm"] + args.drain
            broken = [c for c in outcome.calls
                      if c.code not in ("OK", "UNAVAILABLE") and not c.fallback]
            # in flight when SIGTERM came: every one must complete OK
            in_flight = [c for c in outcome.calls if c.started < sigterm_at]
            in_flight_failed = [c for c in in_flight if c.code != "OK" and not c.fallback]
            not_serving = seen.get("not_serving")
            report.shutdown = {
                "sigterm_after_s": args.sigterm_after,
                "exit_code": server.proc.returncode,
                "exit_seconds": round(seen["exited"] - sigterm_at, 2),
                "not_serving_after_ms": (round((not_serving - sigterm_at) * 1000, 1)
                                         if not_serving else None),
                "in_flight_at_sigterm": sum(1 for c in in_flight
                                            if c.started + c.seconds > sigterm_at),
                "in_flight_failed": len(in_flight_failed),
                "ok_after_sigterm": sum(1 for c in outcome.calls
                                        if c.started >= sigterm_at and c.code == "OK"),
                "unavailable_after_sigterm": sum(1 for c in outcome.calls
                                                 if c.started >= sigterm_at
                                                 and c.code == "UNAVAILABLE"),
                "broken": len(broken),
            }
            if server.proc.returncode != 0:  # the supervisor's: 1 when a worker did not exit 0
                report.failures.append(f"server exited {server.proc.returncode}")
            if broken:
                detail = ", ".join(
                    f"{c.method} {c.code} started {c.started - sigterm_at:+.3f} s "
                    f"ended {c.started + c.seconds - sigterm_at:+.3f} s after SIGTERM"
                    for c in broken[:10])
                report.failures.append(f"{len(broken)} calls ended with "
                                       f"{sorted({c.code for c in broken})}: {detail}")
            if in_flight_failed:
                detail = "; ".join(
                    f"{c.method} {c.code} ({c.details}) started {c.started - sigterm_at:+.3f} s "
                    f"ended {c.started + c.seconds - sigterm_at:+.3f} s after SIGTERM"
                    for c in in_flight_failed[:10])
                report.failures.append(f"{len(in_flight_failed)} calls in flight at SIGTERM "
                                       f"did not complete OK: {detail}")
            if not_serving is None or not_serving > close_at:
                report.failures.append("health did not report NOT_SERVING before the "
                                       "listener closed")
            limit = args.drain + args.grace + 5
            if seen["exited"] - seen["sigterm"] > limit:
                report.failures.append(f"shutdown took longer than {limit} s")
            # every plan a runtime was given survives: restart on the same data
            restarted = ServerProcess({"CE_WORKERS": "1", "CE_DATA_DIR": data,
                                       "CE_DEV_MODE": "1"}, timeout=180)
            per = asyncio.run(epochs_per_session(restarted.address, sessions))
            with embedded_database(data) as url:
                check_acknowledged(report, outcome.plans, url)
        report.epochs_per_session = round(per, 4)
        if per != 1.0:
            report.failures.append(f"epochs per session {per} != 1.0")
        if (report.epochs_per_session_metrics is not None
                and report.epochs_per_session_metrics != 1.0):
            report.failures.append("the server's epochs/sessions counters are not 1.0")
        return report
    finally:
        server.kill()
        if restarted is not None:
            restarted.kill()
        shutil.rmtree(data, ignore_errors=True)


MODES = ("incremental", "full")


def print_report(args: argparse.Namespace, report: Report) -> None:
    summary = report.summary()
    print(f"load: {args.runtimes} runtimes x {args.turns} turns, {args.workers} worker "
          f"processes, loopback, {report.build_mode} Builds")
    print(report.table())
    print(f"throughput {summary['rpcs_per_second']} RPC/s over {summary['wall_seconds']} s "
          f"({summary['rpcs']} RPCs, {summary['turns_done']} turns); errors "
          f"{summary['errors']}; epochs per session {summary['epochs_per_session']} "
          f"(server counters: {summary['epochs_per_session_metrics']}); lost plans "
          f"{summary['lost_plans']} of {summary['plans_checked']} acknowledged "
          f"({summary['plans_acknowledged']} Plan calls answered OK, each plan looked up "
          "in PostgreSQL)")
    print(report.build_line())
    if report.shutdown:
        print("shutdown: " + json.dumps(report.shutdown, sort_keys=True))


def side_by_side(reports: list[Report]) -> str:
    """The runs' Build figures in one table, then incremental against full."""
    lines = [f"{'Build mode':<12} {'Builds':>7} {'from a base':>11} {'bytes/Build':>12} "
             f"{'request B':>10} {'response B':>11} {'server CPU ms/Build':>19} "
             f"{'fallbacks':>9} {'Build p50 ms':>12} {'Build p95 ms':>12} {'RPC/s':>7}"]
    for r in reports:
        ms = sorted(c.seconds * 1000 for c in r.calls if c.method == "Build" and c.code == "OK")
        per, cpu = r.bytes_per_build(), r.cpu_ms_per_build()
        lines.append(
            f"{r.build_mode:<12} {r.builds:>7} {r.incremental_builds:>11} "
            f"{'-' if per is None else f'{per:,.0f}':>12} "
            f"{r.build_request_bytes // max(r.builds, 1):>10,} "
            f"{r.build_response_bytes // max(r.builds, 1):>11,} "
            f"{'-' if cpu is None else f'{cpu:.2f}':>19} {r.fallbacks:>9} "
            f"{pct(ms, 50) if ms else 0:>12.1f} {pct(ms, 95) if ms else 0:>12.1f} "
            f"{len(r.calls) / r.wall_seconds:>7.1f}")
    by = {r.build_mode: r for r in reports}
    if set(MODES) <= set(by):
        inc, full = by["incremental"], by["full"]
        parts = []
        inc_bytes, full_bytes = inc.bytes_per_build(), full.bytes_per_build()
        if inc_bytes and full_bytes:
            parts.append(f"bytes per Build {inc_bytes / full_bytes:.3g}x"
                         f" ({full_bytes / inc_bytes:.3g}x fewer)")
        inc_cpu, full_cpu = inc.cpu_ms_per_build(), full.cpu_ms_per_build()
        if inc_cpu and full_cpu:
            parts.append(f"server CPU per Build {inc_cpu / full_cpu:.3g}x")
        if parts:
            lines.append("incremental / full: " + ", ".join(parts))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make load")
    parser.add_argument("--runtimes", type=int, default=100)
    parser.add_argument("--turns", type=int, default=50)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--sigterm-after", type=float, default=0.0,
                        help="send SIGTERM to the server this many seconds into the run")
    parser.add_argument("--drain", type=float, default=1.0)
    parser.add_argument("--grace", type=float, default=10.0)
    parser.add_argument("--time-limit", type=int, default=900,
                        help="seconds each run may take (both: each of the two)")
    parser.add_argument("--build-mode", choices=(*MODES, "both"), default="incremental",
                        help="how the runtimes Build: through the client's incremental core "
                             "(default), whole, or both, one run each, side by side")
    parser.add_argument("--json", help="also write the summary to this file (both: the two "
                                       "summaries by mode)")
    args = parser.parse_args(argv)
    if args.runtimes < 1 or args.turns < 1 or args.workers < 1:
        parser.error("--runtimes, --turns and --workers must be at least 1")
    modes = MODES if args.build_mode == "both" else (args.build_mode,)
    reports: list[Report] = []
    for mode in modes:
        with deadline(args.time_limit, f"the load run ({mode} Builds)"):
            report = run(argparse.Namespace(**{**vars(args), "build_mode": mode}))
        report.build_mode = mode
        reports.append(report)
        if len(modes) > 1:
            print()
        print_report(args, report)
    if len(reports) > 1:
        print("\n" + side_by_side(reports))
    if args.json:
        summaries = [r.summary() for r in reports]
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(summaries[0] if len(summaries) == 1 else
                      {r.build_mode: s for r, s in zip(reports, summaries, strict=True)},
                      fh, indent=2, sort_keys=True)
    failures = [(r.build_mode, f) for r in reports for f in r.failures]
    for mode, failure in failures:
        prefix = f"({mode} Builds) " if len(reports) > 1 else ""
        print(f"FAILED: {prefix}{failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    raise SystemExit(main())
