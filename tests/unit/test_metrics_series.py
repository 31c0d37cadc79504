"""The label values the metrics create at start-up are every value the code can produce (read
from the code itself, so a new rotation reason, failing class or status code cannot be left
out), and the state ReportUsage's cache metrics need is the epoch's, counted once per key."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import grpc
from context_engine.adapters.assets import load_model_catalog
from context_engine.api.auth import RPC_NAMES
from context_engine.api.server import ANSWERED_CODES
from context_engine.api.status import CODES
from context_engine.domain.calibration import Calibration, Reconciled
from context_engine.domain.ports import EpochHistory, EpochUsage, InMemoryCalibrationStore
from context_engine.telemetry.metrics import (
    COMPACTION_DEPTHS,
    EPOCH_REASONS,
    EXCEEDABLE_CLASSES,
    FITS,
    PRESSURE_STEPS,
    Metrics,
)
from prometheus_client import CollectorRegistry

SERVICE = Path(__file__).resolve().parents[2] / "service" / "context_engine"


def _tree(relative: str) -> ast.Module:
    return ast.parse((SERVICE / relative).read_text(encoding="utf-8"))


def _function(tree: ast.Module, name: str) -> ast.FunctionDef:
    found = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name]
    assert len(found) == 1, name
    return found[0]


def _returned_strings(fn: ast.FunctionDef) -> set[str]:
    return {n.value.value for n in ast.walk(fn) if isinstance(n, ast.Return)
            and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)}


def _string_kwargs(tree: ast.Module, call: str, keyword: str) -> set[str]:
    return {k.value.value for n in ast.walk(tree) if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Name) and n.func.id == call
            for k in n.keywords if k.arg == keyword
            and isinstance(k.value, ast.Constant) and isinstance(k.value.value, str)}


def test_every_epoch_reason_the_code_writes_is_initialised() -> None:
    plan = _tree("domain/plan.py")
    engine = _tree("engine.py")
    constants = {t.id: n.value for n in plan.body if isinstance(n, ast.Assign)
                 for t in n.targets if isinstance(t, ast.Name)}
    explicit = ast.literal_eval(constants["ROTATION_REASONS"])
    opened = ast.literal_eval(constants["SESSION_OPENED"])
    written = (_returned_strings(_function(plan, "rotation_reason_for"))
               | _returned_strings(_function(plan, "admission_reason"))
               | _string_kwargs(engine, "Rotation", "reason")
               | set(explicit) | {opened})
    assert len(written) >= 12
    assert set(EPOCH_REASONS) == written
    assert len(EPOCH_REASONS) == len(set(EPOCH_REASONS))


def _budget_exceeded_classes(tree: ast.Module) -> set[str]:
    return {n.args[0].value for n in ast.walk(tree) if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Name) and n.func.id == "BudgetExceeded"
            and n.args and isinstance(n.args[0], ast.Constant)}


def _subscript_keys(fn: ast.FunctionDef | ast.Module, *names: str) -> set[str]:
    """String keys assigned in ``name[...] = ...`` (and the keys of dict displays bound to
    those names)."""
    keys = set()
    for n in ast.walk(fn):
        if isinstance(n, ast.Assign):
            for t in n.targets:
                if (isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name)
                        and t.value.id in names and isinstance(t.slice, ast.Constant)):
                    keys.add(t.slice.value)
    return keys


def test_every_class_a_build_can_fail_on_is_initialised() -> None:
    """Build fails on a named class: raised by name in builder.build_steps and
    budget.compute_budget, or the largest of the never-yield shares in budget.allocate (the
    fresh rows, the fixed classes builder.build_steps adds, and the active run)."""
    builder = _tree("domain/builder.py")
    budget = _tree("domain/budget.py")
    raised = _budget_exceeded_classes(builder) | _budget_exceeded_classes(budget)
    shares = {k.value for n in ast.walk(_function(budget, "allocate")) if isinstance(n, ast.Dict)
              for k in n.keys if isinstance(k, ast.Constant)}
    fixed = (_subscript_keys(_function(builder, "fresh_rows"), "rows")
             | _subscript_keys(_function(builder, "build_steps"), "fixed"))
    assert {"working_state", "current_user_message", "active_run", "prefix"} <= \
        raised | shares | fixed
    assert set(EXCEEDABLE_CLASSES) == raised | shares | fixed


def test_every_status_code_the_service_answers_with_is_initialised() -> None:
    used = set()
    for path in (SERVICE / "api").glob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if path.name == "rpc_metrics.py":
            # observes every code (all 17 initialised); its cancelled_code names the code a call
            # cancelled under its handler is counted with (a deadline passed, a caller gone)
            tree = ast.Module(body=[_function(tree, "cancelled_code")], type_ignores=[])
        for n in ast.walk(tree):
            if (isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute)
                    and n.value.attr == "StatusCode"):
                used.add(n.attr)
    assert {"RESOURCE_EXHAUSTED", "UNAUTHENTICATED", "DEADLINE_EXCEEDED", "CANCELLED"} <= used
    assert used <= set(ANSWERED_CODES)
    assert {code.name for _, code in CODES} <= set(ANSWERED_CODES)
    assert set(ANSWERED_CODES) == used | {"OK", "INTERNAL"}


def test_the_catalog_names_every_family_it_resolves_to() -> None:
    catalog = load_model_catalog()
    families = catalog.families()
    assert "unknown" in families and "claude" in families and "gpt-4o" in families
    assert len(families) == len(set(families))
    for model_id in ("claude-sonnet-4-5", "gpt-4o-mini", "gpt-4", "o3-mini", "acme-1"):
        resolved = catalog.resolve(model_id, context_window=100_000, output_reserve=1_000,
                                   breakpoint_budget=None)
        assert resolved.family == catalog.family(model_id) in families


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in registry.collect() for s in family.samples
            if not s.name.endswith("_created")}


def test_initialise_creates_every_series_at_zero_and_the_factor_from_the_store() -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    before = _samples(registry)
    assert not any(name == "context_engine_epochs_total" for name, _ in before)
    metrics.initialise(families=("claude", "unknown"), methods=("Build", "Plan"),
                       codes=("OK", "INTERNAL"), factors={"claude": 1.25})
    got = _samples(registry)

    def values(name: str) -> dict[tuple[tuple[str, str], ...], float]:
        return {labels: v for (n, labels), v in got.items() if n == name}

    assert values("context_engine_epochs_total") == {
        (("reason", r),): 0.0 for r in EPOCH_REASONS}
    assert values("context_engine_budget_pressure_total") == {
        (("fits", f), ("step", s)): 0.0 for s in PRESSURE_STEPS for f in FITS}
    assert "history_floor" in PRESSURE_STEPS
    assert values("context_engine_budget_exceeded_total") == {
        (("class", c),): 0.0 for c in EXCEEDABLE_CLASSES}
    assert values("context_engine_compactions_total") == {
        (("depth", d),): 0.0 for d in COMPACTION_DEPTHS}
    assert values("context_engine_rpc_seconds_count") == {
        (("code", c), ("method", m)): 0.0 for m in ("Build", "Plan") for c in ("OK", "INTERNAL")}
    assert values("context_engine_estimator_error_ratio_count") == {
        (("model", "claude"),): 0.0, (("model", "unknown"),): 0.0}
    # the family's reconciled factor where the store has one, else the factor in effect: 1.0
    assert values("context_engine_estimator_correction_factor") == {
        (("model", "claude"),): 1.25, (("model", "unknown"),): 1.0}
    assert all(v == 0 for (n, _), v in got.items()
               if n != "context_engine_estimator_correction_factor")


def test_an_unreadable_store_leaves_the_factor_unset() -> None:
    """Under `serve --workers N` the most recent write of the gauge wins: a guess would hide
    the factor another worker set."""
    registry = CollectorRegistry()
    Metrics(registry).initialise(families=("claude",), methods=RPC_NAMES, codes=("OK",),
                                 factors=None)
    assert not [k for k in _samples(registry)
                if k[0] == "context_engine_estimator_correction_factor"]


def _outcome(current: Calibration | None) -> Reconciled:
    c = Calibration(model_id="m", encoding="e", factor=1.0,
                    reports=(current.reports if current else 0) + 1)
    return Reconciled(calibration=c, previous_factor=1.0, error_ratio=0.0)


def test_the_in_memory_store_tells_each_report_what_its_epoch_counted_before() -> None:
    store = InMemoryCalibrationStore()

    def report(key: str, session: str, epoch: int, tokens: int) -> EpochHistory | None:
        usage = EpochUsage(session_id=session, epoch=epoch, input_tokens=tokens)
        _, earlier = asyncio.run(store.reconcile("t", "m", key, _outcome, key, usage=usage))
        return earlier

    assert report("k1", "s", 1, 3_000) == EpochHistory(reports_before=0,
                                                       previous_input_tokens=0)
    assert report("k2", "s", 1, 3_400) == EpochHistory(reports_before=1,
                                                       previous_input_tokens=3_000)
    assert report("k2", "s", 1, 3_400) is None  # a retried key: counted once
    assert report("k3", "s", 1, 3_800) == EpochHistory(reports_before=2,
                                                       previous_input_tokens=3_400)
    # a new epoch, and another session, start again
    assert report("k4", "s", 2, 2_000) == EpochHistory(reports_before=0,
                                                       previous_input_tokens=0)
    assert report("k5", "other", 1, 5_000) == EpochHistory(reports_before=0,
                                                           previous_input_tokens=0)
    assert asyncio.run(store.latest_factors()) == [("m", 1.0)]


def test_answered_codes_are_status_code_names() -> None:
    assert all(hasattr(grpc.StatusCode, c) for c in ANSWERED_CODES)
    assert list(ANSWERED_CODES) == sorted(set(ANSWERED_CODES))


def test_rpc_latency_buckets_reach_past_a_compact_that_calls_its_summarizer_twice() -> None:
    """The buckets stopped at 5 s: every Compact waiting on its summarizer (20 s a call by
    default, twice when the first summary measures over its cap) landed in +Inf, and a p99 of
    Compact read 5 s whatever it was."""
    from context_engine.config import Config
    from context_engine.telemetry.metrics import Metrics
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    Metrics(registry).rpc_seconds.labels(method="Compact", code="OK").observe(41.0)
    bounds = [float(s.labels["le"]) for m in registry.collect()
              if m.name == "context_engine_rpc_seconds" for s in m.samples
              if s.name.endswith("_bucket") and s.value and s.labels["le"] != "+Inf"]
    assert bounds and min(bounds) >= 2 * Config().summarizer_timeout_seconds
