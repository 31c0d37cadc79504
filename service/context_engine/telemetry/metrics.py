"""Prometheus metrics (README "Operations": "Metrics"). Names and label sets are fixed:
dashboards and alerts depend on them. No label carries a tenant, session, hash or other
unbounded value (``context_engine_build_info`` names the contract by the first 12 hex digits of
its descriptor's hash: one value per release)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from context_engine.domain.budget import STEPS
from context_engine.domain.items import MAX_DEPTH
from context_engine.domain.plan import ROTATION_REASONS, SESSION_OPENED

_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# RPCs add the summarizer's time: a Compact may call it twice, 20 s each by default
_RPC_SECONDS = (*_SECONDS, 10.0, 30.0, 60.0)
_SIGNED = (-1.0, -0.5, -0.2, -0.1, -0.05, -0.02, 0.0, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
_RATIO = (0.1, 0.25, 0.5, 0.75, 0.8, 0.85, 0.9, 0.95, 0.98, 0.99, 1.0)
_TOKENS = (250, 500, 1000, 2000, 4000, 6000, 8000, 10000, 12000, 16000, 22000)

# The known values of every label, each series created at zero when a process starts
# (``Metrics.initialise``). A series that first appears with a non-zero value loses its first
# increments in Prometheus' increase() and rate(): without these, the first rotations of each
# reason in every process were never counted, and a fresh deployment's panels said "No data".
# Epoch reasons: epoch 1, Plan's rotations (plan.rotation_reason_for, plan.admission_reason),
# the explicit ones (Rotate) and the canonicalization of a legacy plan (Engine._canonicalize).
EPOCH_REASONS = (
    SESSION_OPENED,
    "model_changed", "agent_version_changed", "persona_changed", "policy_changed",
    "builder_changed", "run_authority_changed", "browser_profile_changed",
    *ROTATION_REASONS,
    "prefix_hash_canonicalized",
)
# Yield steps of Build's ladder, history_floor: never-yield items left history below its floor
# (Pressure.history_floor_shortfall past prefix_floor_shortfall), and history_floor_prefix: the
# body budget itself was below it, the prefix costed at a correction factor raised since Plan
# held it to the floor (Pressure.prefix_floor_shortfall).
PRESSURE_STEPS = (*STEPS, "history_floor", "history_floor_prefix")
FITS = ("true", "false")
# The classes a Build can fail on (BudgetExceeded.class_name): the prefix (a policy cap lowered
# under a pinned plan), the rows that never yield, the current user message, the summary and the
# active run (budget.allocate names the largest of them).
EXCEEDABLE_CLASSES = (
    "prefix", "skill_bodies", "working_state", "corrections", "runtime_metadata",
    "current_user_message", "summary", "active_run",
)
COMPACTION_DEPTHS = tuple(str(depth) for depth in range(1, MAX_DEPTH + 1))
# The factor of a model family no report has reconciled yet.
DEFAULT_FACTOR = 1.0


class Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.sessions_opened = Counter(
            "context_engine_sessions_opened", "Sessions opened (epoch 1 written).",
            registry=registry)
        self.epochs = Counter(
            "context_engine_epochs", "Epochs written, by reason (epoch 1: session_opened).",
            ["reason"], registry=registry)
        self.prefix_hash_mismatch = Counter(
            "context_engine_prefix_hash_mismatch",
            "Calls that found a stored plan's re-rendered prefix unlike its pinned hash (each "
            "such call counts: a plan that fails the check is never cached).",
            registry=registry)
        self.prefix_tokens = Histogram(
            "context_engine_prefix_tokens", "Measured prefix tokens of each new epoch.",
            buckets=_TOKENS, registry=registry)
        self.budget_pressure = Counter(
            "context_engine_budget_pressure", "Yield steps run by Build, and whether it fit.",
            ["step", "fits"], registry=registry)
        self.budget_exceeded = Counter(
            "context_engine_budget_exceeded", "Builds that failed because a class did not fit.",
            ["class"], registry=registry)
        self.build_seconds = Histogram(
            "context_engine_build_seconds",
            "Time spent assembling one request, once per Build call (one made again after its "
            "session was planned anew: both assemblies, summed).",
            buckets=_SECONDS, registry=registry)
        self.rpc_seconds = Histogram(
            "context_engine_rpc_seconds", "RPC latency by method and status code.",
            ["method", "code"], buckets=_RPC_SECONDS, registry=registry)
        self.estimator_error_ratio = Histogram(
            "context_engine_estimator_error_ratio",
            "Signed (actual - estimated) / actual input tokens of reported requests.",
            ["model"], buckets=_SIGNED, registry=registry)
        self.estimator_correction_factor = Gauge(
            "context_engine_estimator_correction_factor",
            "Current estimator correction factor per model (last reconciled).",
            ["model"], multiprocess_mode="mostrecent", registry=registry)
        self.cached_prefix_ratio = Histogram(
            "context_engine_cached_prefix_ratio",
            "Cached input tokens against the plan's prefix tokens, per reported request after "
            "the first of its epoch (which writes the prefix to the provider's cache).",
            buckets=_RATIO, registry=registry)
        self.cached_input_ratio = Histogram(
            "context_engine_cached_input_ratio",
            "Cached input tokens against the full input tokens of the preceding report of the "
            "same session and epoch (history reuse), per reported request that has one.",
            buckets=_RATIO, registry=registry)
        self.compactions = Counter(
            "context_engine_compactions", "Compactions stored, by the depth of the summary.",
            ["depth"], registry=registry)
        self.elided_spans = Counter(
            "context_engine_elided_spans",
            "Typed pointers newly written by stored compactions, whatever their label: one "
            "per replaced tool result, user or assistant message and tool call below USER, and "
            "per attachment of a replaced user message.",
            registry=registry)
        # What the process serves: 1, labelled with the versions ``context-engine --version``
        # prints. Every worker sets the same 1: merged by its maximum, never summed.
        self.build_info = Gauge(
            "context_engine_build_info",
            "1, labelled with the service, contract, policy and builder versions.",
            ["version", "contract", "policy", "builder"], multiprocess_mode="max",
            registry=registry)
        # Standard gRPC server metrics, named as grpc-ecosystem/go-grpc-prometheus names them
        # (api/rpc_metrics.py records them for every service the server registers).
        grpc_labels = ["grpc_type", "grpc_service", "grpc_method"]
        self.grpc_server_started = Counter(
            "grpc_server_started", "Total number of RPCs started on the server.",
            grpc_labels, registry=registry)
        self.grpc_server_handled = Counter(
            "grpc_server_handled",
            "Total number of RPCs completed on the server, regardless of success or failure.",
            [*grpc_labels, "grpc_code"], registry=registry)
        self.grpc_server_msg_received = Counter(
            "grpc_server_msg_received", "Total number of RPC stream messages received on the "
            "server.", grpc_labels, registry=registry)
        self.grpc_server_msg_sent = Counter(
            "grpc_server_msg_sent", "Total number of gRPC stream messages sent by the server.",
            grpc_labels, registry=registry)
        self.grpc_server_handling_seconds = Histogram(
            "grpc_server_handling_seconds",
            "Histogram of response latency (seconds) of gRPC that had been application-level "
            "handled by the server.", grpc_labels, buckets=_SECONDS, registry=registry)

    def epoch_counted(self, epoch: int, reason: str, prefix_tokens: int) -> None:
        """One stored epoch counted (by the one call that claimed its count: its writer, a
        call reading it after, or a maintenance cycle): ``context_engine_epochs_total`` by its
        reason, ``context_engine_sessions_opened_total`` for an epoch 1, and its prefix tokens."""
        if epoch == 1:
            self.sessions_opened.inc()
        self.epochs.labels(reason=reason).inc()
        self.prefix_tokens.observe(prefix_tokens)

    def initialise(self, *, families: Iterable[str], methods: Iterable[str],
                   codes: Iterable[str], factors: Mapping[str, float] | None) -> None:
        """Create every labelled series for its known label values, at zero, so a fresh
        process exposes every family the dashboard and the alerts use, and increase() counts
        a series' first increments. ``families``: the model catalog's (and ``unknown``);
        ``methods`` and ``codes``: the RPCs and every code the service answers with.

        The correction factor is a gauge merged across worker processes by its most recent
        write: it is set to ``factors`` (the latest reconciled factor of each family, read
        from PostgreSQL, so a restarted worker repeats the fleet's value instead of hiding it)
        and to 1.0 for a family never reconciled. ``factors`` None (not readable): left unset.
        """
        for reason in EPOCH_REASONS:
            self.epochs.labels(reason=reason)
        for step in PRESSURE_STEPS:
            for fits in FITS:
                self.budget_pressure.labels(step=step, fits=fits)
        for class_name in EXCEEDABLE_CLASSES:
            self.budget_exceeded.labels(**{"class": class_name})
        for depth in COMPACTION_DEPTHS:
            self.compactions.labels(depth=depth)
        codes = tuple(codes)
        for method in methods:
            for code in codes:
                self.rpc_seconds.labels(method=method, code=code)
        for family in families:
            self.estimator_error_ratio.labels(model=family)
            if factors is not None:
                self.estimator_correction_factor.labels(model=family).set(
                    factors.get(family, DEFAULT_FACTOR))

    def initialise_grpc(self, methods: Iterable[tuple[str, str, str]],
                        codes: Iterable[str]) -> None:
        """The gRPC server series of every ``(grpc_type, grpc_service, grpc_method)`` at zero,
        ``grpc_server_handled_total`` for each of ``codes``, as ``initialise`` does for the
        service's own metrics."""
        codes = tuple(codes)
        for labels in methods:
            self.grpc_server_started.labels(*labels)
            self.grpc_server_msg_received.labels(*labels)
            self.grpc_server_msg_sent.labels(*labels)
            self.grpc_server_handling_seconds.labels(*labels)
            for code in codes:
                self.grpc_server_handled.labels(*labels, code)
