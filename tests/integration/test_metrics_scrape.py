"""Every metric of the design (§7) scraped over HTTP from a real server after a scripted session:
exact names, types and label sets, values that follow the script, every labelled series present
at zero before its first use, and no label value that is a tenant, a session or a hash."""

from __future__ import annotations

import math
import re
import time
import urllib.request
import uuid
from collections.abc import Iterator

import grpc
import pytest
from context_engine.adapters.assets import load_model_catalog
from context_engine.api.auth import RPC_NAMES
from context_engine.api.server import ANSWERED_CODES
from context_engine.telemetry.metrics import (
    COMPACTION_DEPTHS,
    EPOCH_REASONS,
    EXCEEDABLE_CLASSES,
    PRESSURE_STEPS,
)
from context_engine.v1 import context_engine_pb2 as pb
from context_engine.v1 import context_engine_pb2_grpc as pb_grpc
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tests.conftest import ServerThread
from tests.conftest import test_config as base_config
from tests.integration.requests import build_request, failure, item, plan_request
from tests.integration.test_budget_rpc import SMALL, long_history
from tests.integration.test_compact_rpc import compact_request

pytestmark = pytest.mark.integration

# name (as exposed, without _total/_bucket suffixes) -> (type, label names)
DESIGN = {
    "context_engine_sessions_opened": ("counter", set()),
    "context_engine_epochs": ("counter", {"reason"}),
    "context_engine_prefix_hash_mismatch": ("counter", set()),
    "context_engine_prefix_tokens": ("histogram", set()),
    "context_engine_budget_pressure": ("counter", {"step", "fits"}),
    "context_engine_budget_exceeded": ("counter", {"class"}),
    "context_engine_build_seconds": ("histogram", set()),
    "context_engine_rpc_seconds": ("histogram", {"method", "code"}),
    "context_engine_estimator_error_ratio": ("histogram", {"model"}),
    "context_engine_estimator_correction_factor": ("gauge", {"model"}),
    "context_engine_cached_prefix_ratio": ("histogram", set()),
    "context_engine_cached_input_ratio": ("histogram", set()),
    "context_engine_compactions": ("counter", {"depth"}),
    "context_engine_elided_spans": ("counter", set()),
}
HEX = re.compile(r"[0-9a-f]{16,}")


@pytest.fixture(scope="module")
def own(database_url: str) -> Iterator[ServerThread]:
    """A server of this module's own: its registry sees only the script below."""
    srv = ServerThread(base_config(), database_url)
    yield srv
    srv.stop()


def scrape(server: ServerThread) -> dict[str, tuple[str, list[Sample]]]:
    port = server.running.metrics_port
    assert port is not None
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    return {f.name: (f.type, list(f.samples)) for f in text_string_to_metric_families(text)}


def value(samples: list[Sample], suffix: str, **labels: str) -> float:
    """The one sample named ``<family><suffix>`` whose labels are exactly ``labels``."""
    found = [s.value for s in samples if s.name.endswith(suffix) and s.labels == labels]
    assert len(found) == 1, (suffix, labels, [(s.name, s.labels) for s in samples])
    return found[0]


def test_a_fresh_server_exposes_every_labelled_series_at_zero(database_url, db):
    """Before its first call: every family the dashboard and the alerts use, each known label
    value at zero (a series that first appears with a non-zero value loses its first increments
    in Prometheus' increase()), and the correction factor as PostgreSQL last reconciled it."""
    tenant = f"tenant-{uuid.uuid4().hex[:12]}"
    # the newest calibration of the claude family, as another replica reconciled it
    db.fetch("INSERT INTO estimator_calibration (tenant_id, model_id, encoding, factor, reports, "
             "updated_at) VALUES ($1, 'claude-sonnet-4-5', 'cl100k_base', 1.2, 3, "
             "now() + interval '1 hour'), ($2, 'claude-opus-4', 'cl100k_base', 1.7, 3, now())",
             tenant, tenant + "-b")
    try:
        fresh = ServerThread(base_config(), database_url)
        try:
            families = scrape(fresh)
        finally:
            fresh.stop()
    finally:
        db.fetch("DELETE FROM estimator_calibration WHERE tenant_id = ANY($1::text[])",
                 [tenant, tenant + "-b"])
    for name, (kind, _) in DESIGN.items():
        assert name in families, name
        assert families[name][0] == kind, name
        assert families[name][1], f"{name}: no series on a fresh server"

    def totals(name: str, suffix: str) -> dict[tuple[str, ...], float]:
        return {tuple(v for k, v in sorted(s.labels.items()) if k != "le"): s.value
                for s in families[name][1] if s.name == name + suffix}

    assert totals("context_engine_epochs", "_total") == {(r,): 0.0 for r in EPOCH_REASONS}
    assert totals("context_engine_budget_pressure", "_total") == \
        {(fits, step): 0.0 for step in PRESSURE_STEPS for fits in ("true", "false")}
    assert totals("context_engine_budget_exceeded", "_total") == \
        {(c,): 0.0 for c in EXCEEDABLE_CLASSES}
    assert totals("context_engine_compactions", "_total") == \
        {(d,): 0.0 for d in COMPACTION_DEPTHS} == {("1",): 0.0, ("2",): 0.0}
    catalog = load_model_catalog()
    assert totals("context_engine_estimator_error_ratio", "_count") == \
        {(f,): 0.0 for f in catalog.families()}
    assert "unknown" in catalog.families() and "claude" in catalog.families()
    assert totals("context_engine_rpc_seconds", "_count") == \
        {(code, method): 0.0 for method in RPC_NAMES for code in ANSWERED_CODES}
    for name in ("context_engine_sessions_opened", "context_engine_prefix_hash_mismatch",
                 "context_engine_elided_spans"):
        assert totals(name, "_total") == {(): 0.0}, name
    for name in ("context_engine_prefix_tokens", "context_engine_build_seconds",
                 "context_engine_cached_prefix_ratio", "context_engine_cached_input_ratio"):
        assert totals(name, "_count") == {(): 0.0}, name
    factors = totals("context_engine_estimator_correction_factor", "")
    assert set(factors) == {(f,) for f in catalog.families()}
    assert factors[("claude",)] == 1.2  # the family's latest reconciliation, not 1.7
    assert all(v > 0 for v in factors.values())  # 1.0 where nothing was reconciled


def test_a_scripted_session_moves_every_metric(own, ids, db):
    tenant, session = ids
    with grpc.insecure_channel(own.address) as channel:
        stub = pb_grpc.ContextEngineStub(channel)
        plan = stub.Plan(plan_request(tenant, session, model=SMALL)).plan
        assert stub.Plan(plan_request(tenant, session, model=SMALL)).created is False

        calm = stub.Build(build_request(tenant, session))
        assert not calm.pressure.steps

        req = build_request(tenant, session, items=long_history(40))
        req.checkpoint.knowledge.extend([
            pb.KnowledgePassage(id=f"k{i}", source="doc", text="passage " * 200, rank=i,
                                trust=pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED) for i in range(3)])
        pressed = stub.Build(req)
        steps = [s.step for s in pressed.pressure.steps]
        assert steps == ["knowledge", "tool_results", "history"] and pressed.pressure.fits

        too_big = [item("u1", 1, user=pb.UserMessage(text="word " * 20_000))]
        with pytest.raises(grpc.RpcError) as err:
            stub.Build(build_request(tenant, session, items=too_big))
        assert failure(err.value).reason == "BUDGET_EXCEEDED"

        rotated = stub.Rotate(pb.RotateRequest(
            tenant_id=tenant, session_id=session, reason=pb.ROTATION_REASON_OPERATOR,
            idempotency_key="rotate-1")).plan
        assert rotated.epoch == 2

        # the epoch's first request writes the prefix to the provider's cache (nothing cached:
        # a necessary miss, left out of the prefix ratio), the second reads half of it back
        first = stub.ReportUsage(pb.ReportUsageRequest(
            tenant_id=tenant, session_id=session, estimated_input_tokens=4_000,
            estimator_factor=1.0, input_tokens=4_800, cached_tokens=0, output_tokens=50,
            idempotency_key="usage-0"))
        assert first.counted
        cached = rotated.prefix_tokens // 2
        usage = stub.ReportUsage(pb.ReportUsageRequest(
            tenant_id=tenant, session_id=session, estimated_input_tokens=4_000,
            estimator_factor=first.correction_factor, input_tokens=4_800,
            cached_tokens=cached, output_tokens=50, idempotency_key="usage-1"))
        assert usage.counted
        # a retried report is counted once: no second observation
        stub.ReportUsage(pb.ReportUsageRequest(
            tenant_id=tenant, session_id=session, estimated_input_tokens=4_000,
            estimator_factor=first.correction_factor, input_tokens=4_800,
            cached_tokens=cached, output_tokens=50, idempotency_key="usage-1"))

        compacted = stub.Compact(compact_request(tenant, session, "compact-1"))
        assert compacted.compacted and compacted.summary.depth == 1
        assert len(compacted.summary.elided) == 1

        # a stored plan that no longer renders to its pinned hash
        db.fetch("UPDATE plans SET spec_text = replace(spec_text, "
                 "'You are a helpful agent.', 'Tampered.') WHERE tenant_id=$1 AND epoch=1",
                 tenant)
        own.running.engine.cache.clear()
        with pytest.raises(grpc.RpcError) as err:
            stub.Build(build_request(tenant, session, epoch=1))
        assert failure(err.value).reason == "PREFIX_HASH_MISMATCH"

    families = scrape(own)
    for name, (kind, labels) in DESIGN.items():
        assert name in families, name
        got_kind, samples = families[name]
        assert got_kind == kind, name
        assert samples, name
        for s in samples:
            assert set(s.labels) - {"le"} == labels, (name, s.labels)

    def fam(name: str) -> list[Sample]:
        return families[name][1]

    assert value(fam("context_engine_sessions_opened"), "_total") == 1
    epochs = fam("context_engine_epochs")
    assert value(epochs, "_total", reason="session_opened") == 1
    assert value(epochs, "_total", reason="operator") == 1
    assert {s.labels["reason"] for s in epochs if s.name.endswith("_total") and s.value} == \
        {"session_opened", "operator"}
    # every other reason is there, at zero, before its first rotation
    assert {s.labels["reason"] for s in epochs if s.name.endswith("_total")} == \
        set(EPOCH_REASONS)
    assert value(fam("context_engine_prefix_hash_mismatch"), "_total") == 1

    prefix = fam("context_engine_prefix_tokens")
    assert value(prefix, "_count") == 2
    assert value(prefix, "_sum") == plan.prefix_tokens + rotated.prefix_tokens

    pressure = fam("context_engine_budget_pressure")
    for step in steps:
        assert value(pressure, "_total", step=step, fits="true") == 1
    assert {(s.labels["step"], s.labels["fits"]) for s in pressure
            if s.name.endswith("_total") and s.value} == {(step, "true") for step in steps}
    assert {(s.labels["step"], s.labels["fits"]) for s in pressure
            if s.name.endswith("_total")} == {(step, fits) for step in PRESSURE_STEPS
                                              for fits in ("true", "false")}
    exceeded = fam("context_engine_budget_exceeded")
    assert value(exceeded, "_total", **{"class": "current_user_message"}) == 1
    assert {s.labels["class"]: s.value for s in exceeded if s.name.endswith("_total")} == \
        {c: float(c == "current_user_message") for c in EXCEEDABLE_CLASSES}

    # two Builds assembled a request; the failed ones did not
    assert value(fam("context_engine_build_seconds"), "_count") == 2

    rpc = fam("context_engine_rpc_seconds")
    for method, code, n in (("Plan", "OK", 2), ("Build", "OK", 2),
                            ("Build", "FAILED_PRECONDITION", 1), ("Build", "INTERNAL", 1),
                            ("Rotate", "OK", 1), ("ReportUsage", "OK", 3),
                            ("Compact", "OK", 1)):
        assert value(rpc, "_count", method=method, code=code) == n, (method, code)
        assert value(rpc, "_bucket", method=method, code=code, le="+Inf") == n

    error = fam("context_engine_estimator_error_ratio")
    # a series for every family of the catalog; only the session's model's moved
    assert {s.labels["model"] for s in error} == set(load_model_catalog().families())
    reported = {s.labels["model"] for s in error if s.name.endswith("_count") and s.value}
    assert len(reported) == 1
    family = reported.pop()
    assert value(error, "_count", model=family) == 2  # the retry counted nothing
    # (a histogram with negative buckets exposes no _sum: the buckets place the two reports)
    buckets = [s for s in error if s.name.endswith("_bucket") and s.labels["model"] == family]
    assert buckets
    for b in buckets:
        le = float(b.labels["le"])
        assert b.value == (first.error_ratio <= le) + (usage.error_ratio <= le), b
    assert value(fam("context_engine_estimator_correction_factor"), "", model=family) == \
        pytest.approx(usage.correction_factor)

    # ReportUsage feeds the cache ratios. The prefix ratio (cached tokens against the plan's
    # prefix tokens) leaves out the epoch's first report; the input ratio measures the cached
    # tokens against the preceding report's full input tokens.
    ratio = fam("context_engine_cached_prefix_ratio")
    assert value(ratio, "_count") == 1
    # the plan's count is Claude's cl100k_base x 1.3, an estimate: taken to the provider's
    # tokens as the report's estimate was (its factor, then input over estimate)
    assert rotated.tokenizer.startswith("cl100k_base x")
    provider_prefix = math.ceil(rotated.prefix_tokens * first.correction_factor) * 4_800 / 4_000
    assert value(ratio, "_sum") == pytest.approx(cached / provider_prefix)
    assert value(ratio, "_bucket", le="0.25") == 0
    assert value(ratio, "_bucket", le="0.5") == 1
    reuse = fam("context_engine_cached_input_ratio")
    assert value(reuse, "_count") == 1
    assert value(reuse, "_sum") == pytest.approx(cached / 4_800)

    assert value(fam("context_engine_compactions"), "_total", depth="1") == 1
    assert value(fam("context_engine_compactions"), "_total", depth="2") == 0
    assert value(fam("context_engine_elided_spans"), "_total") == 1

    # No label value is a tenant, a session, a hash or another unbounded value.
    forbidden = {tenant, session, plan.prefix_sha256, rotated.prefix_sha256, calm.session_key}
    for name, (_, samples) in families.items():
        if not name.startswith("context_engine_"):
            continue
        for s in samples:
            for label, v in s.labels.items():
                assert v not in forbidden and not HEX.search(v), (name, label, v)
                assert not any(f in v for f in forbidden), (name, label, v)


def test_a_stop_does_not_wait_half_a_second_for_the_endpoint(database_url):
    """The endpoint's serve loop looks for a stop every 0.05 s: with socketserver's default
    (0.5 s, which prometheus_client's start_http_server keeps) every stop of a server waited up
    to half a second for it, and all of it just after a scrape, when the loop has begun a new
    poll. Its last scrape served, the endpoint stops within a fraction of that."""
    server = ServerThread(base_config(), database_url)
    try:
        for _ in range(3):
            assert "context_engine_build_info" in scrape(server)
        started = time.monotonic()
        server.running.metrics_http.shutdown()
        took = time.monotonic() - started
        assert took < 0.25, took
    finally:
        server.stop()  # a stopped endpoint's shutdown() returns at once
