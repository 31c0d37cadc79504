"""Configuration, built once at start-up from an injectable environment mapping."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from context_engine.adapters.assets import DEFAULT_ASSETS_DIR, DEFAULT_CATALOG
from context_engine.domain.budget import BudgetPolicy
from context_engine.telemetry.tracing import otlp_requested

REPO_DIR = Path(__file__).resolve().parents[2]


class ConfigError(ValueError):
    pass


def _int(env: Mapping[str, str], name: str, default: int, minimum: int = 0) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError as exc:
        raise ConfigError(f"{name}={raw!r} is not an integer") from exc
    if value < minimum:
        raise ConfigError(f"{name}={value} is below {minimum}")
    return value


def _float(env: Mapping[str, str], name: str, default: float,
           minimum: float | None = None) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError as exc:
        raise ConfigError(f"{name}={raw!r} is not a number") from exc
    if minimum is None and value <= 0:
        raise ConfigError(f"{name}={value} must be positive")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{name}={value} is below {minimum}")
    return value


def split_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"address {addr!r} is not host:port")
    return host.strip("[]") or "127.0.0.1", int(port)


@dataclass(frozen=True, kw_only=True)
class Config:
    grpc_addr: str = "127.0.0.1:50051"
    metrics_addr: str = "127.0.0.1:9464"  # empty: no metrics endpoint
    database_url: str | None = None  # None: embedded PostgreSQL under data_dir
    data_dir: Path = REPO_DIR / ".data"
    migrations_dir: Path = REPO_DIR / "migrations"
    assets_dir: Path = DEFAULT_ASSETS_DIR
    model_catalog: Path = DEFAULT_CATALOG
    max_receive_bytes: int = 64 * 1024 * 1024
    grace_seconds: float = 10.0
    drain_seconds: float = 1.0
    db_pool_size: int = 10
    db_timeout_seconds: float = 5.0
    plan_cache_size: int = 4096
    log_level: str = "INFO"
    safety_margin_ratio: float = 0.05
    policy_cap_tokens: int = 0  # 0: the model window is the only limit
    inline_maximum_bytes: int = 16_384
    recall_floor_tokens: int = 500
    calibration_ttl_seconds: float = 5.0
    # Compaction's summarizer: unset URL means the deterministic structured summarizer.
    summarizer_url: str = ""
    summarizer_model: str = ""
    summarizer_api_key: str = field(default="", repr=False)  # never printed
    summarizer_timeout_seconds: float = 20.0
    # Traces go over OTLP only when the standard OTEL_* variables ask for it (off by default).
    trace_export: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Config:
        defaults = cls()
        cfg = cls(
            grpc_addr=env.get("CE_GRPC_ADDR") or defaults.grpc_addr,
            metrics_addr=env.get("CE_METRICS_ADDR", defaults.metrics_addr),
            database_url=env.get("DATABASE_URL") or None,
            data_dir=Path(env.get("CE_DATA_DIR") or defaults.data_dir),
            migrations_dir=Path(env.get("CE_MIGRATIONS_DIR") or defaults.migrations_dir),
            assets_dir=Path(env.get("CE_ASSETS_DIR") or defaults.assets_dir),
            model_catalog=Path(env.get("CE_MODEL_CATALOG") or defaults.model_catalog),
            max_receive_bytes=_int(env, "CE_MAX_RECEIVE_BYTES", defaults.max_receive_bytes, 1024),
            grace_seconds=_float(env, "CE_GRACE_SECONDS", defaults.grace_seconds),
            drain_seconds=_float(env, "CE_DRAIN_SECONDS", defaults.drain_seconds, minimum=0.0),
            db_pool_size=_int(env, "CE_DB_POOL_SIZE", defaults.db_pool_size, 1),
            db_timeout_seconds=_float(env, "CE_DB_TIMEOUT_SECONDS", defaults.db_timeout_seconds),
            plan_cache_size=_int(env, "CE_PLAN_CACHE_SIZE", defaults.plan_cache_size, 1),
            log_level=env.get("CE_LOG_LEVEL") or defaults.log_level,
            safety_margin_ratio=_float(env, "CE_SAFETY_MARGIN_RATIO",
                                       defaults.safety_margin_ratio, minimum=0.0),
            policy_cap_tokens=_int(env, "CE_POLICY_CAP_TOKENS", defaults.policy_cap_tokens),
            inline_maximum_bytes=_int(env, "CE_INLINE_MAXIMUM_BYTES",
                                      defaults.inline_maximum_bytes, 256),
            recall_floor_tokens=_int(env, "CE_RECALL_FLOOR_TOKENS",
                                     defaults.recall_floor_tokens),
            calibration_ttl_seconds=_float(env, "CE_CALIBRATION_TTL_SECONDS",
                                           defaults.calibration_ttl_seconds, minimum=0.0),
            summarizer_url=env.get("CE_SUMMARIZER_URL") or "",
            summarizer_model=env.get("CE_SUMMARIZER_MODEL") or "",
            summarizer_api_key=env.get("CE_SUMMARIZER_API_KEY") or "",
            summarizer_timeout_seconds=_float(env, "CE_SUMMARIZER_TIMEOUT_SECONDS",
                                              defaults.summarizer_timeout_seconds),
            trace_export=otlp_requested(env),
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if not 0.0 <= self.safety_margin_ratio < 0.5:
            raise ConfigError(f"CE_SAFETY_MARGIN_RATIO={self.safety_margin_ratio} is not in "
                              "[0, 0.5)")
        split_addr(self.grpc_addr)
        if self.summarizer_url and not self.summarizer_model:
            raise ConfigError("CE_SUMMARIZER_URL is set without CE_SUMMARIZER_MODEL")
        if self.summarizer_url and not self.summarizer_url.startswith(("http://", "https://")):
            raise ConfigError(f"CE_SUMMARIZER_URL={self.summarizer_url!r} is not an http(s) URL")
        if self.metrics_addr:
            split_addr(self.metrics_addr)

    def budget_policy(self) -> BudgetPolicy:
        return BudgetPolicy(safety_margin_ratio=self.safety_margin_ratio,
                            policy_cap_tokens=self.policy_cap_tokens,
                            inline_maximum_bytes=self.inline_maximum_bytes,
                            recall_floor_tokens=self.recall_floor_tokens)
