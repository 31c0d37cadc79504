"""Prometheus metrics (DESIGN §7). Names and label sets are fixed: dashboards and alerts depend
on them. No label carries a tenant, session, hash or other unbounded value."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_SIGNED = (-1.0, -0.5, -0.2, -0.1, -0.05, -0.02, 0.0, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
_RATIO = (0.1, 0.25, 0.5, 0.75, 0.8, 0.85, 0.9, 0.95, 0.98, 0.99, 1.0)
_TOKENS = (250, 500, 1000, 2000, 4000, 6000, 8000, 10000, 12000, 16000, 22000)


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
            "Stored plans whose re-rendered prefix did not match their pinned hash.",
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
            "context_engine_build_seconds", "Time spent assembling one request.",
            buckets=_SECONDS, registry=registry)
        self.rpc_seconds = Histogram(
            "context_engine_rpc_seconds", "RPC latency by method and status code.",
            ["method", "code"], buckets=_SECONDS, registry=registry)
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
            "Cached input tokens against the plan's prefix tokens, per reported request.",
            buckets=_RATIO, registry=registry)
        self.compactions = Counter(
            "context_engine_compactions", "Compactions stored, by the depth of the summary.",
            ["depth"], registry=registry)
        self.elided_spans = Counter(
            "context_engine_elided_spans",
            "Untrusted spans newly replaced by typed pointers in stored compactions.",
            registry=registry)
