"""The recording rules and alerts, read by a real Prometheus (Debian's package binary) that
scrapes a real two-worker server (``serve --workers 2``) every second, against a scripted set
of sessions whose truth the script knows: sessions opened, epochs by reason (Plan and Rotate),
yield steps and budget failures (Build), usage reports (ReportUsage), compactions (Compact),
calls by method and code.
It checks the rules once after the first half of the script, then kills a worker with SIGKILL
(the supervisor starts another), runs the second half and checks them again: the counters of the
dead worker still add up.

Tolerance (``increase()`` extrapolation). Every series exists, at zero, from the first scrape
(``Metrics.initialise``), so ``increase()`` over a window that holds the whole run does not
extrapolate before the first sample (a first value of 0 extrapolates to 0) and extrapolates
after the last by its distance d to the evaluation time (under 1.1 scrape intervals, else half
an interval). With N samples T = (N - 1) intervals apart, ``increase()`` and ``rate() x range``
read the truth times (T + d) / T: never below it, above it by at most 1.1 / (N - 1) (the test
allows 1.1 / (N - 2): a scrape stamped before the rules' evaluation can be stored after it, so
the rules may have read one sample fewer than the test then counts), and by one
factor for every series read at one evaluation (they share the scrapes and the evaluation time),
which the test checks too. A ratio of two of them (epochs per session, a share of calls, a mean,
a quantile of a histogram) divides that factor out: it must equal the truth (to 1e-9). A series
that first appeared with a non-zero value would lose its first increments outright: the issue's
0.64 for a truth of 1.375, and what ``tests/mutants/series_not_initialised.patch`` brings back.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.parse
import urllib.request
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from context_engine.api.auth import RPC_NAMES
from context_engine.telemetry.metrics import (
    EPOCH_REASONS,
    EXCEEDABLE_CLASSES,
    PRESSURE_STEPS,
)
from context_engine.v1 import context_engine_pb2 as pb
from context_engine.v1 import context_engine_pb2_grpc as pb_grpc

from tests.integration.processes import ServerProcess
from tests.integration.requests import build_request, failure, item, plan_request
from tests.integration.test_budget_rpc import long_history
from tests.integration.test_compact_rpc import compact_request

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "rules.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "context-engine.json"
RATIO_BOUNDS = (0.1, 0.25, 0.5, 0.75, 0.8, 0.85, 0.9, 0.95, 0.98, 0.99, 1.0, math.inf)
MAX_ITEMS = 300  # CE_MAX_ITEMS_PER_REQUEST: a longer Build is refused RESOURCE_EXHAUSTED
# Codes that are not the service's errors (rules.yml's header): the rest count in the alert.
CALLER_CODES = {"OK", "INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION", "ALREADY_EXISTS",
                "OUT_OF_RANGE", "UNAUTHENTICATED", "PERMISSION_DENIED", "CANCELLED"}

CLAUDE = pb.ModelSpec(model_id="claude-sonnet-4-5", capabilities=pb.ModelCapabilities(
    context_window=16_000, output_reserve=2_000))
ACME = pb.ModelSpec(model_id="acme-16k", capabilities=pb.ModelCapabilities(
    context_window=16_000, output_reserve=2_000))
ACME_B = pb.ModelSpec(model_id="acme-16k-b", capabilities=pb.ModelCapabilities(
    context_window=16_000, output_reserve=2_000))
FAMILY = {"claude-sonnet-4-5": "claude", "acme-16k": "unknown", "acme-16k-b": "unknown"}


# ---------------------------------------------------------------------------- Prometheus


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Prometheus:
    """Debian's ``prometheus`` on loopback with a data directory of its own, scraping
    ``target`` every second and evaluating the repository's rules every second."""

    def __init__(self, workdir: Path, target: str) -> None:
        self.target = target
        exe = shutil.which("prometheus")
        if exe is None:
            pytest.fail("prometheus is not on PATH: run scripts/ensure-promtool (as root it "
                        "installs Debian's prometheus package, which holds both prometheus and "
                        "promtool), or install a Prometheus 2.x server")
        config = workdir / "prometheus.yml"
        config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s",
                       "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [{"job_name": "context-engine", "metrics_path": "/metrics",
                                "static_configs": [{"targets": [target]}]}],
        }))
        for attempt in range(3):  # a free port may be taken before Prometheus binds it
            self.url = f"http://127.0.0.1:{free_port()}"
            self.log = (workdir / "prometheus.log").open("w")
            self.proc = subprocess.Popen(
                [exe, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
                 f"--web.listen-address={self.url.removeprefix('http://')}",
                 "--log.level=warn"], stdout=self.log, stderr=subprocess.STDOUT)
            try:
                self.wait(lambda: self._ready(), "Prometheus ready", 30)
                return
            except AssertionError as exc:
                if attempt == 2 or "address already in use" not in str(exc):
                    raise
                self.log.close()

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            self.log.flush()
            raise AssertionError("prometheus exited:\n" +
                                 Path(self.log.name).read_text(encoding="utf-8"))
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    def api(self, path: str, **params: Any) -> Any:
        query = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as resp:
            body = json.loads(resp.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[tuple[dict[str, str], float]]:
        data = self.api("query", query=expr, time=at)
        assert data["resultType"] == "vector", (expr, data)
        return [(r["metric"], float(r["value"][1])) for r in data["result"]]

    def scalar(self, expr: str, at: float | None = None) -> float:
        found = self.query(expr, at)
        assert len(found) == 1, (expr, found)
        return found[0][1]

    def by(self, expr: str, label: str, at: float) -> dict[str, float]:
        return {m.get(label, ""): v for m, v in self.query(expr, at)}

    def groups(self) -> dict[str, dict[str, Any]]:
        return {g["name"]: g for g in self.api("rules")["groups"]}

    @staticmethod
    def wait(check: Callable[[], bool], what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not within {timeout}s")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()


def evaluated_at(group: dict[str, Any]) -> float:
    """A rule group's last evaluation time (RFC 3339, nanoseconds) as Unix seconds."""
    text = group["lastEvaluation"]
    head, _, frac = text.rstrip("Z").partition(".")
    zone = ""
    for sign in ("+", "-"):
        if sign in frac:
            frac, zone = frac.split(sign, 1)[0], sign + frac.split(sign, 1)[1]
    base = datetime.fromisoformat(head + (zone or "+00:00")).timestamp()
    return base + (float("0." + frac) if frac else 0.0)


# ---------------------------------------------------------------------------- the truth


def bucket_quantile(q: float, buckets: dict[float, float]) -> float:
    """histogram_quantile as Prometheus documents it, over cumulative bucket counts by upper
    bound (positive bounds, +Inf last): linear interpolation inside the bucket that holds the
    rank, the +Inf bucket answering the bound below it."""
    bounds = tuple(sorted(buckets))
    counts = [buckets[b] for b in bounds]
    if not counts[-1]:
        return math.nan
    rank = q * counts[-1]
    b = next((i for i, c in enumerate(counts[:-1]) if c >= rank), len(counts) - 1)
    if b == len(counts) - 1:
        return bounds[-2]
    start, count = 0.0, counts[b]
    if b > 0:
        start, count, rank = bounds[b - 1], count - counts[b - 1], rank - counts[b - 1]
    return start + (bounds[b] - start) * rank / count


def quantile(q: float, bounds: tuple[float, ...], values: list[float]) -> float:
    """The quantile Prometheus reads from the buckets these observations fall in."""
    return bucket_quantile(q, {b: float(sum(v <= b for v in values)) for b in bounds})


@dataclass
class Truth:
    sessions: int = 0
    epochs: Counter[str] = field(default_factory=Counter)
    pressure: Counter[tuple[str, str]] = field(default_factory=Counter)
    exceeded: Counter[str] = field(default_factory=Counter)
    compactions: Counter[int] = field(default_factory=Counter)  # by depth
    calls: Counter[tuple[str, str]] = field(default_factory=Counter)
    prefix_ratios: list[float] = field(default_factory=list)
    input_ratios: list[float] = field(default_factory=list)
    errors: dict[str, list[float]] = field(default_factory=dict)  # family -> error ratios
    factors: dict[str, float] = field(default_factory=dict)  # family -> last reconciled


@dataclass
class Session:
    session_id: str
    model: pb.ModelSpec
    channel: grpc.Channel
    epoch: int = 0
    prefix_tokens: int = 0
    approximate: bool = False  # the plan's prefix count is an estimate (another encoding x)
    reports: int = 0  # counted in the current epoch
    last_input: int = 0

    @property
    def stub(self) -> pb_grpc.ContextEngineStub:
        return pb_grpc.ContextEngineStub(self.channel)


def channel(address: str) -> grpc.Channel:
    # a connection of its own, as separate runtimes have: sessions spread over the workers
    return grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


class Script:
    """Drives sessions and records what each call must have done to the metrics."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.tenant = f"tenant-{uuid.uuid4().hex[:12]}"
        self.truth = Truth()
        self.keys = 0

    def call(self, method: str, fn: Callable[[], Any]) -> Any:
        try:
            result = fn()
        except grpc.RpcError as err:
            code = err.code()  # type: ignore[attr-defined]
            self.truth.calls[(method, code.name)] += 1
            raise
        self.truth.calls[(method, "OK")] += 1
        return result

    def key(self) -> str:
        self.keys += 1
        return f"key-{self.keys}"

    def epoch(self, s: Session, plan: pb.ContextPlan, reason: str) -> None:
        assert plan.reason == reason and plan.epoch == s.epoch + 1, (plan.reason, plan.epoch)
        self.truth.epochs[reason] += 1
        s.epoch, s.prefix_tokens, s.reports, s.last_input = plan.epoch, plan.prefix_tokens, 0, 0
        s.approximate = " x" in plan.tokenizer  # "cl100k_base x1.3": Claude's, Gemini's

    def open(self, model: pb.ModelSpec) -> Session:
        s = Session(f"s-{uuid.uuid4().hex[:8]}", model, channel(self.address))
        resp = self.call("Plan", lambda: s.stub.Plan(
            plan_request(self.tenant, s.session_id, model=model), timeout=30))
        assert resp.created
        self.truth.sessions += 1
        self.epoch(s, resp.plan, "session_opened")
        return s

    def replan(self, s: Session, model: pb.ModelSpec) -> None:
        """Plan with another model: the session rotates (model_changed)."""
        resp = self.call("Plan", lambda: s.stub.Plan(
            plan_request(self.tenant, s.session_id, model=model), timeout=30))
        assert resp.created
        s.model = model
        self.epoch(s, resp.plan, "model_changed")

    def rotate(self, s: Session, reason: int, **fields: Any) -> None:
        key = self.key()
        req = pb.RotateRequest(tenant_id=self.tenant, session_id=s.session_id, reason=reason,
                               idempotency_key=key, **fields)
        resp = self.call("Rotate", lambda: s.stub.Rotate(req, timeout=30))
        assert resp.rotated
        if "model" in fields:
            s.model = fields["model"]
        self.epoch(s, resp.plan, pb.RotationReason.Name(reason).removeprefix(
            "ROTATION_REASON_").lower())
        # a retried key rotates once
        again = self.call("Rotate", lambda: s.stub.Rotate(req, timeout=30))
        assert not again.rotated and again.plan.epoch == s.epoch

    def build(self, s: Session, items: list[pb.ConversationItem] | None = None, *,
              knowledge: int = 0, exceeded: str = "", steps_if_exceeded: tuple[str, ...] = (),
              refused: str = "") -> None:
        req = build_request(self.tenant, s.session_id, items=items)
        req.estimator_factor = 1.0  # pinned: the reports' reconciliation moves nothing here
        req.checkpoint.knowledge.extend([
            pb.KnowledgePassage(id=f"k{i}", source="doc", text="passage " * 200, rank=i,
                                trust=pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED)
            for i in range(knowledge)])
        if exceeded or refused:
            with pytest.raises(grpc.RpcError) as info:
                self.call("Build", lambda: s.stub.Build(req, timeout=30))
            f = failure(info.value)
            if refused:  # turned away by the limits before Build ran: nothing else counted
                assert f.code is grpc.StatusCode.RESOURCE_EXHAUSTED and f.reason == refused
                return
            assert f.reason == "BUDGET_EXCEEDED" and f.metadata["class"] == exceeded, f
            self.truth.exceeded[exceeded] += 1
            for step in steps_if_exceeded:
                self.truth.pressure[(step, "false")] += 1
            return
        resp = self.call("Build", lambda: s.stub.Build(req, timeout=30))
        fits = "true" if resp.pressure.fits else "false"
        for step in resp.pressure.steps:
            self.truth.pressure[(step.step, fits)] += 1
        if resp.pressure.history_floor_shortfall:
            self.truth.pressure[("history_floor", fits)] += 1

    def compact(self, s: Session, *, merge: bool = False) -> None:
        """A compaction of the session's history (depth 1), merged once more (depth 2) with
        ``merge``; each key retried, which stores (and counts) nothing."""
        summary = None
        for key in (self.key(), self.key()) if merge else (self.key(),):
            req = compact_request(self.tenant, s.session_id, key, summary=summary,
                                  **({"replace_through_sequence": 3} if merge and summary is None
                                     else {}))
            resp = self.call("Compact", lambda r=req: s.stub.Compact(r, timeout=30))
            assert resp.compacted
            self.truth.compactions[resp.summary.depth] += 1
            again = self.call("Compact", lambda r=req: s.stub.Compact(r, timeout=30))
            assert not again.compacted
            summary = resp.summary

    def report(self, s: Session, *, input_tokens: int, estimated: int, cached: int,
               retry: bool = False) -> None:
        req = pb.ReportUsageRequest(
            tenant_id=self.tenant, session_id=s.session_id, epoch=s.epoch,
            estimated_input_tokens=estimated, estimator_factor=1.0, input_tokens=input_tokens,
            cached_tokens=cached, output_tokens=200, idempotency_key=self.key())
        resp = self.call("ReportUsage", lambda: s.stub.ReportUsage(req, timeout=30))
        assert resp.counted
        family = FAMILY[s.model.model_id]
        self.truth.errors.setdefault(family, []).append(resp.error_ratio)
        assert resp.error_ratio == pytest.approx((input_tokens - estimated) / input_tokens)
        self.truth.factors[family] = resp.correction_factor
        if s.reports:  # the epoch's first report is a necessary miss: not a prefix ratio
            # a request holds no more prefix than its whole input; an estimated prefix count is
            # taken to the provider's tokens as the report's estimate was (factor 1.0 here)
            prefix = (s.prefix_tokens * input_tokens / estimated if s.approximate
                      else s.prefix_tokens)
            self.truth.prefix_ratios.append(min(cached / min(prefix, input_tokens), 1.0))
        if s.last_input:
            self.truth.input_ratios.append(min(cached / s.last_input, 1.0))
        s.reports += 1
        s.last_input = input_tokens
        if retry:  # the same key again: counted once
            again = self.call("ReportUsage", lambda: s.stub.ReportUsage(req, timeout=30))
            assert not again.counted

    def usage(self, s: Session, n: int, *, undercount_every: int = 0) -> None:
        """``n`` reports of one epoch, the history growing by 400 tokens a request: the first
        with nothing cached (the prefix is being written), then alternately the whole preceding
        input cached (history reused) and half the prefix (a body change broke the cache).
        Every ``undercount_every``-th one used 10% more input than estimated."""
        for i in range(n):
            input_tokens = 3_000 + 400 * (s.reports + i)
            if i == 0:
                cached = 0
            elif i % 2:
                cached = s.last_input
            else:
                cached = s.prefix_tokens // 2
            under = undercount_every and (i + 1) % undercount_every == 0
            estimated = round(input_tokens / 1.1) if under else input_tokens
            self.report(s, input_tokens=input_tokens, estimated=estimated, cached=cached,
                        retry=i == 1)


def small_knowledge_overflow() -> list[pb.ConversationItem]:
    """A current user message that fits alone but not beside three knowledge passages."""
    return [item("u1", 1, user=pb.UserMessage(text="word " * 9_500))]


def too_big() -> list[pb.ConversationItem]:
    """A current user message no 16k window holds."""
    return [item("u1", 1, user=pb.UserMessage(text="word " * 20_000))]


def too_many_items() -> list[pb.ConversationItem]:
    return [item(f"u{i}", i + 1, user=pb.UserMessage(text="hi")) for i in range(MAX_ITEMS + 1)]


def below_floor() -> list[pb.ConversationItem]:
    """Never-yield items (the current user message) leave history below its 8,000 floor."""
    items = long_history(20)
    items[-1].user.text = "word " * 4_000
    return items


def first_half(script: Script) -> list[Session]:
    """Six sessions; rotations operator, security_revocation, model_routed, model_changed,
    snapshot_invalidated; Builds that fit, yield, fall below the history floor, fail on their
    budget (with and without a yield step first) and are refused by the limits; 23 counted
    reports (and a retried key in each epoch reported); a compaction (and its retried key)."""
    a = script.open(CLAUDE)
    script.build(a)
    script.usage(a, 3, undercount_every=2)
    script.rotate(a, pb.ROTATION_REASON_OPERATOR)
    script.usage(a, 2)

    b = script.open(CLAUDE)
    script.build(b, long_history(40), knowledge=3)
    script.rotate(b, pb.ROTATION_REASON_SECURITY_REVOCATION, drop_tools=["mail.send"])
    script.usage(b, 4, undercount_every=3)

    c = script.open(ACME)
    script.build(c, small_knowledge_overflow(), knowledge=3, exceeded="current_user_message",
                 steps_if_exceeded=("knowledge",))
    script.rotate(c, pb.ROTATION_REASON_MODEL_ROUTED, model=CLAUDE)
    script.usage(c, 3)

    d = script.open(ACME)
    script.usage(d, 2)
    script.replan(d, ACME_B)
    script.usage(d, 3)
    script.build(d, too_many_items(), refused="TOO_MANY_ITEMS")

    e = script.open(ACME)
    script.build(e, below_floor())
    script.rotate(e, pb.ROTATION_REASON_SNAPSHOT_INVALIDATED)
    script.usage(e, 2)

    f = script.open(CLAUDE)
    script.build(f, too_big(), exceeded="current_user_message")
    script.usage(f, 4, undercount_every=4)
    script.compact(a)
    return [a, b, c, d, e, f]


def second_half(script: Script) -> list[Session]:
    """Six more sessions after the worker restart (operator, model_routed and
    security_revocation again); 21 counted reports; a compaction merged once more (depth 2),
    each key retried."""
    sessions = []
    for i in range(6):
        s = script.open(CLAUDE if i % 2 else ACME)
        sessions.append(s)
        script.build(s, long_history(30), knowledge=2 if i % 3 == 0 else 0)
        if i < 4:
            reason = (pb.ROTATION_REASON_OPERATOR, pb.ROTATION_REASON_MODEL_ROUTED,
                      pb.ROTATION_REASON_SECURITY_REVOCATION, pb.ROTATION_REASON_OPERATOR)[i]
            fields: dict[str, Any] = {}
            if reason == pb.ROTATION_REASON_MODEL_ROUTED:
                fields["model"] = CLAUDE
            if reason == pb.ROTATION_REASON_SECURITY_REVOCATION:
                fields["drop_tools"] = ["mail.send"]
            script.rotate(s, reason, **fields)
        script.usage(s, 3 if i % 2 else 4, undercount_every=3 if i % 2 else 0)
    script.build(sessions[0], too_big(), exceeded="current_user_message")
    script.build(sessions[1], too_many_items(), refused="TOO_MANY_ITEMS")
    script.compact(sessions[2], merge=True)
    return sessions


# ---------------------------------------------------------------------------- the workers


def server_connections(pid: int, port: int) -> int:
    """Established TCP connections to ``port`` that process ``pid`` holds (from /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            local_port = int(cols[1].rsplit(":", 1)[1], 16)
            if local_port == port and cols[3] == "01" and cols[9] in inodes:
                count += 1
    return count


# ---------------------------------------------------------------------------- the checks


@dataclass
class Checks:
    """Every comparison of a measured value with the truth, kept for one report: a failure
    lists them all (and the figures are printed either way)."""

    rows: list[tuple[str, str, str, str, bool]] = field(default_factory=list)
    factors: list[float] = field(default_factory=list)  # measured / truth, this phase

    def exact(self, name: str, measured: float, truth: float) -> None:
        ok = (math.isnan(measured) and math.isnan(truth)) or math.isclose(
            measured, truth, rel_tol=1e-9, abs_tol=1e-12)
        self.rows.append((name, f"{truth:.6g}", f"{measured:.6g}", "exact", ok))

    def extrapolated(self, name: str, measured: float, truth: float, tolerance: float) -> None:
        """``truth <= measured <= truth * (1 + tolerance)``; 0 for a truth of 0."""
        ok = truth * (1 - 1e-9) <= measured <= truth * (1 + tolerance) + 1e-9
        if truth and not math.isnan(measured):
            self.factors.append(measured / truth)
        self.rows.append((name, f"{truth:.6g}", f"{measured:.6g}",
                          f"+{tolerance:.2%}", ok))

    def one_factor(self, phase: str) -> None:
        """Every extrapolated reading of a phase shares the scrapes, the first sample (0) and
        the evaluation time: it is the truth times one common factor. A series that lost an
        increment would stand out even where the tolerance would hide it."""
        if not self.factors:
            self.rows.append((f"{phase}: one extrapolation factor", "", "none", "", False))
            return
        low, high = min(self.factors), max(self.factors)
        spread = high / low - 1 if low > 0 else math.inf
        self.rows.append((f"{phase}: one extrapolation factor for all {len(self.factors)}",
                          "", f"{low:.6f}..{high:.6f}", "exact",
                          spread < 1e-9))
        self.factors.clear()

    def that(self, name: str, ok: bool, detail: str = "") -> None:
        self.rows.append((name, "", detail, "", ok))

    @property
    def failed(self) -> list[tuple[str, str, str, str, bool]]:
        return [r for r in self.rows if not r[4]]

    def table(self) -> str:
        lines = [f"{'check':<70} {'truth':>12} {'measured':>12} {'tolerance':>9}"]
        for name, truth, measured, tolerance, ok in self.rows:
            lines.append(f"{name:<70} {truth:>12} {measured:>12} {tolerance:>9}"
                         f"{'' if ok else '  <-- WRONG'}")
        return "\n".join(lines)


def catch_up(prom: Prometheus, truth: Truth) -> float:
    """Waits until Prometheus has scraped every call of the script, then until both rule
    groups have been evaluated after that (the alerts after the recording rules they read).
    Returns the recording group's evaluation time to read the rules at."""
    calls = sum(truth.calls.values())

    # Both counts of a call: the service's own, and gRPC's handled count, which the outermost
    # interceptor counts after it, so a scrape between the two holds the first one only.
    def scraped() -> bool:
        return all(bool(found) and found[0][1] >= calls for found in (
            prom.query("sum(context_engine_rpc_seconds_count)"),
            prom.query('sum(grpc_server_handled_total{grpc_service='
                       '"context_engine.v1.ContextEngine"})')))
    prom.wait(scraped, f"Prometheus scraping {calls} calls", 20)
    assert prom.scalar("sum(context_engine_rpc_seconds_count)") == calls
    seen = time.time()  # every evaluation from now on reads that scrape
    recorded: list[float] = []

    def recorded_after() -> bool:
        at = evaluated_at(prom.groups()["context-engine.recording"])
        recorded[:] = [at]
        return at > seen
    prom.wait(recorded_after, "the recording rules evaluated after the last scrape", 10)
    prom.wait(lambda: evaluated_at(prom.groups()["context-engine.alerts"]) > recorded[0],
              "the alerts evaluated after the recording rules", 10)
    for group in prom.groups().values():
        for rule in group["rules"]:
            assert rule["health"] == "ok", (rule["name"], rule.get("lastError"))
    return recorded[0]


def check_rules(prom: Prometheus, truth: Truth, checks: Checks, phase: str) -> None:
    at = catch_up(prom, truth)

    def tolerance(window: str) -> float:
        # A scrape stamped before the evaluation may be stored after it (a slow scrape on a
        # busy machine): the rule may have read one sample fewer than this query counts.
        n = prom.scalar(f"count_over_time(context_engine_sessions_opened_total[{window}])", at)
        assert n > 2, f"{n} samples in {window}"
        return 1.1 / (n - 2)

    def rec(name: str, label: str = "") -> defaultdict[str, float]:
        """A recorded rule's series by ``label`` ("" for one without): NaN where missing."""
        found = prom.query(f"context_engine:{name}", at)
        return defaultdict(lambda: math.nan,
                           {(m.get(label, "") if label else ""): v for m, v in found})

    six_h, one_h, five_m = tolerance("6h"), tolerance("1h"), tolerance("5m")
    assert tolerance("5m") == six_h, "the run outlasted 5 minutes: the 5m windows cut it"
    epochs = sum(truth.epochs.values())
    checks.exact(f"{phase}: epochs_per_session:ratio6h ({epochs}/{truth.sessions})",
                 rec("epochs_per_session:ratio6h")[""], epochs / truth.sessions)
    checks.extrapolated(f"{phase}: sessions_opened:increase6h",
                        rec("sessions_opened:increase6h")[""], truth.sessions, six_h)
    rates = rec("epochs:rate5m", "reason")
    checks.that(f"{phase}: epochs:rate5m has every reason", set(rates) == set(EPOCH_REASONS),
                str(sorted(set(EPOCH_REASONS) ^ set(rates))))
    for reason in EPOCH_REASONS:
        checks.extrapolated(f"{phase}: epochs:rate5m{{reason={reason}}} x 300",
                            rates.get(reason, math.nan) * 300, truth.epochs[reason], five_m)

    pressure = {(m["step"], m["fits"]): v for m, v in prom.query(
        "context_engine:budget_pressure:rate5m", at)}
    known = {(step, fits) for step in PRESSURE_STEPS for fits in ("true", "false")}
    checks.that(f"{phase}: budget_pressure:rate5m has every step and fits",
                set(pressure) == known, str(sorted(known ^ set(pressure))))
    for key in sorted(known):
        checks.extrapolated(f"{phase}: budget_pressure:rate5m{{step={key[0]},fits={key[1]}}}"
                            " x 300", pressure.get(key, math.nan) * 300, truth.pressure[key],
                            five_m)
    exceeded = rec("budget_exceeded:rate5m", "class")
    checks.that(f"{phase}: budget_exceeded:rate5m has every class",
                set(exceeded) == set(EXCEEDABLE_CLASSES),
                str(sorted(set(EXCEEDABLE_CLASSES) ^ set(exceeded))))
    for name in EXCEEDABLE_CLASSES:
        checks.extrapolated(f"{phase}: budget_exceeded:rate5m{{class={name}}} x 300",
                            exceeded.get(name, math.nan) * 300, truth.exceeded[name], five_m)
    builds = sum(n for (method, _), n in truth.calls.items() if method == "Build")
    exceeded_share = sum(truth.exceeded.values()) / builds
    checks.exact(f"{phase}: budget_exceeded:ratio15m ({sum(truth.exceeded.values())}/{builds})",
                 rec("budget_exceeded:ratio15m")[""], exceeded_share)

    compacted = sum(truth.compactions.values())
    built = truth.calls[("Build", "OK")]
    checks.exact(f"{phase}: compactions_per_1k_builds:ratio1h ({compacted}/{built} x 1000)",
                 rec("compactions_per_1k_builds:ratio1h")[""], 1000 * compacted / built)
    merged = sum(n for depth, n in truth.compactions.items() if depth >= 2)
    checks.exact(f"{phase}: compactions_depth2_share:ratio1h ({merged}/{compacted})",
                 rec("compactions_depth2_share:ratio1h")[""], merged / compacted)

    errors = rec("rpc_errors:ratio5m", "method")
    share: dict[str, float] = {}
    for method in sorted(RPC_NAMES):
        total = sum(n for (m, _), n in truth.calls.items() if m == method)
        bad = sum(n for (m, code), n in truth.calls.items()
                  if m == method and code not in CALLER_CODES)
        share[method] = bad / total if total else math.nan
        checks.exact(f"{phase}: rpc_errors:ratio5m{{method={method}}} ({bad}/{total})",
                     errors.get(method, math.nan), share[method])

    for name, values in (("cached_prefix_ratio", truth.prefix_ratios),
                         ("cached_input_ratio", truth.input_ratios)):
        checks.extrapolated(f"{phase}: {name}:reports1h", rec(f"{name}:reports1h")[""],
                            len(values), one_h)
        checks.exact(f"{phase}: {name}:mean1h", rec(f"{name}:mean1h")[""],
                     sum(values) / len(values))
        checks.exact(f"{phase}: {name}:p50_1h", rec(f"{name}:p50_1h")[""],
                     quantile(0.5, RATIO_BOUNDS, values))

    reports = rec("estimator_reports:increase1h", "model")
    beyond = rec("estimator_undercount_beyond_margin:ratio1h", "model")
    for family in sorted(truth.errors):
        values = truth.errors[family]
        checks.extrapolated(f"{phase}: estimator_reports:increase1h{{model={family}}}",
                            reports[family], len(values), one_h)
        checks.exact(f"{phase}: estimator_undercount_beyond_margin:ratio1h{{model={family}}}",
                     beyond[family], sum(v > 0.05 for v in values) / len(values))
    silent = set(reports) - set(truth.errors)
    checks.that(f"{phase}: estimator_reports:increase1h is 0 for the other families",
                bool(silent) and all(reports[f] == 0 for f in silent))

    # Latency has no truth outside the service: the rules must agree with the buckets the
    # service exposes (scraped here directly; no call has been made since Prometheus did).
    exposed = scrape_buckets(prom.target)
    for rule, key in (("build_seconds:p99_5m", ("context_engine_build_seconds", "")),
                      ("rpc_seconds:p99_5m", ("context_engine_rpc_seconds", "Build"))):
        measured = rec(rule, "method")["Build"] if key[1] else rec(rule)[""]
        checks.exact(f"{phase}: {rule}{' {method=Build}' if key[1] else ''} (as exposed)",
                     measured, bucket_quantile(0.99, exposed[key]))
    p99 = rec("rpc_seconds:p99_5m", "method")["Build"]

    # The alerts, from the truth: which ones are pending (each has a `for`) or firing. A
    # rule's guard on a count (at least 10 sessions, 20 reports) reads the recorded increase,
    # which Prometheus extrapolates over its window (checked against the truth above, within
    # that tolerance) and which moves with every scrape: the guards here read it as the
    # alerts' last evaluation did, and the alerts are read at that evaluation, or a truth
    # just under a threshold would be decided by when the scrapes fell (16 reports recorded
    # as 20.56 in one run).
    alerts_at = evaluated_at(prom.groups()["context-engine.alerts"])

    def guard(name: str, label: str = "") -> defaultdict[str, float]:
        return defaultdict(lambda: math.nan, {(m.get(label, "") if label else ""): v
                                              for m, v in prom.query(f"context_engine:{name}",
                                                                     alerts_at)})
    expected = set()
    if epochs / truth.sessions > 1.2 and guard("sessions_opened:increase6h")[""] >= 10:
        expected.add(("ContextEngineEpochsPerSessionHigh", ""))
    if exceeded_share > 0.05:
        expected.add(("ContextEngineBudgetExceeded", ""))
    expected |= {("ContextEngineRpcErrors", m) for m, v in share.items() if v > 0.01}
    if quantile(0.5, RATIO_BOUNDS, truth.prefix_ratios) < 0.9 and \
            guard("cached_prefix_ratio:reports1h")[""] >= 20:
        expected.add(("ContextEngineCachedPrefixRatioLow", ""))
    for family, values in truth.errors.items():
        if sum(v > 0.05 for v in values) / len(values) > 0.1 and \
                guard("estimator_reports:increase1h", "model")[family] >= 20:
            expected.add(("ContextEngineEstimatorUndercount", family))
    if p99 > 1:
        expected.add(("ContextEngineBuildLatencyHigh", "Build"))
    # The standard gRPC server counters saw the same calls, every worker's (the dead one's
    # too) added up, each ended with the code its caller got.
    handled = {(m["grpc_method"], m["grpc_code"]): v for m, v in prom.query(
        "sum by (grpc_method, grpc_code) (grpc_server_handled_total"
        '{grpc_service="context_engine.v1.ContextEngine"})', at) if v}
    checks.that(f"{phase}: grpc_server_handled_total by method and code",
                handled == dict(truth.calls), f"{sorted(handled.items())}")
    checks.exact(f"{phase}: grpc_server_started_total",
                 prom.scalar('sum(grpc_server_started_total{grpc_service='
                             '"context_engine.v1.ContextEngine"})', at),
                 sum(truth.calls.values()))
    active = {(m["alertname"], m.get("method", m.get("model", ""))): m["alertstate"]
              for m, _ in prom.query("ALERTS", alerts_at)}
    checks.that(f"{phase}: active alerts {sorted(a for a, _ in expected)}",
                set(active) == expected, f"got {sorted(active.items())}")
    checks.one_factor(phase)


def scrape_buckets(target: str) -> dict[tuple[str, str], dict[float, float]]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{target}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[tuple[str, str], dict[float, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith("_bucket"):
                key = (family.name, s.labels.get("method", ""))
                le = float(s.labels["le"])
                out.setdefault(key, {})
                out[key][le] = out[key].get(le, 0.0) + s.value
    return out


def check_fresh(prom: Prometheus, checks: Checks) -> None:
    """Before the first call, after two scrapes (every series starts at 0, and rate() needs
    two samples) and a rule evaluation: every recording rule and dashboard panel has data."""
    prom.wait(lambda: prom.query(
        "count_over_time(context_engine_sessions_opened_total[1m]) >= 2") != [],
        "two scrapes of the fresh server", 20)
    seen = time.time()
    prom.wait(lambda: evaluated_at(prom.groups()["context-engine.recording"]) > seen,
              "a rule evaluation after them", 10)
    for group in prom.groups().values():
        for rule in group["rules"]:
            if rule["type"] == "recording":
                found = prom.query(rule["name"])
                checks.that(f"fresh: {rule['name']} recorded", bool(found), str(len(found)))
    panels = json.loads(DASHBOARD.read_text(encoding="utf-8"))["panels"]
    for panel in panels:
        found = 0
        for target in panel["targets"]:
            expr = target["expr"].replace("$__rate_interval", "1m").replace("$__range", "1h")
            # the job and namespace variables' "All" (this Prometheus' series have no namespace)
            expr = expr.replace("$job", ".*").replace("$namespace", ".*")
            found += len(prom.query(expr))
        checks.that(f"fresh: panel {panel['title']!r} has data", found > 0, str(found))


# ---------------------------------------------------------------------------- the test


def test_prometheus_reads_the_truth_through_the_rules_across_a_worker_restart(
        database_url: str, tmp_path: Path) -> None:
    started = time.monotonic()
    server = ServerProcess({"DATABASE_URL": database_url, "CE_WORKERS": "2",
                            "CE_MAX_ITEMS_PER_REQUEST": str(MAX_ITEMS)})
    prom = None
    checks = Checks()
    channels: list[grpc.Channel] = []
    try:
        serving = server.log[-1]
        assert serving["event"] == "serving" and serving["workers"] == 2
        pids = list(serving["pids"])
        port = int(server.address.rsplit(":", 1)[1])
        prom = Prometheus(tmp_path, server.metrics)
        check_fresh(prom, checks)

        script = Script(server.address)
        sessions = first_half(script)
        channels += [s.channel for s in sessions]
        check_rules(prom, script.truth, checks, "before the restart")

        # Kill the worker holding the most of the script's connections: it served those
        # sessions, and its counts must survive it.
        held = {pid: server_connections(pid, port) for pid in pids}
        victim = max(pids, key=lambda pid: held[pid])
        checks.that("the killed worker served sessions of the script", held[victim] > 0,
                    str(held))
        factor = script.truth.factors["claude"]
        os.kill(victim, signal.SIGKILL)
        exited = server.wait_for("worker_exited", 30)
        assert exited["pid"] == victim and exited["code"] == -signal.SIGKILL
        server.wait_for("worker_serving", 60)
        for ch in channels:
            ch.close()
        # The new worker's zero series add nothing, and its correction factor (read from
        # PostgreSQL) repeats the fleet's last reconciliation rather than hiding it.
        seen = time.time()
        prom.wait(lambda: prom.scalar("max(timestamp(context_engine_sessions_opened_total))")
                  > seen + 0.1, "a scrape after the restart", 10)
        checks.exact("after the restart: correction factor {model=claude}",
                     prom.scalar('context_engine_estimator_correction_factor{model="claude"}'),
                     factor)

        sessions = second_half(script)
        channels = [s.channel for s in sessions]
        check_rules(prom, script.truth, checks, "after the restart")
        checks.exact("after the restart: correction factor {model=claude} (last report)",
                     prom.scalar('context_engine_estimator_correction_factor{model="claude"}'),
                     script.truth.factors["claude"])
    finally:
        for ch in channels:
            ch.close()
        if prom is not None:
            prom.stop()
        code = server.terminate()
    elapsed = time.monotonic() - started
    truth = script.truth
    print(f"\n{checks.table()}\n\nsessions {truth.sessions}, epochs {dict(truth.epochs)}, "
          f"pressure {dict(truth.pressure)}, exceeded {dict(truth.exceeded)}, calls "
          f"{sum(truth.calls.values())}, prefix ratios {len(truth.prefix_ratios)}, input "
          f"ratios {len(truth.input_ratios)}; {elapsed:.1f} s")
    assert code == 0
    assert not checks.failed, "Prometheus disagrees with the truth:\n" + checks.table()
