"""Configuration, built once at start-up from an injectable environment mapping."""

from __future__ import annotations

import ipaddress
import os
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


def _bool(env: Mapping[str, str], name: str) -> bool:
    raw = (env.get(name) or "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ConfigError(f"{name}={raw!r} is not a boolean (1/0, true/false)")


def _path(env: Mapping[str, str], name: str) -> Path | None:
    raw = env.get(name)
    return Path(raw) if raw else None


def is_loopback(host: str) -> bool:
    """True only for addresses no other machine can reach (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # another host name: it may resolve to anything
        return False


def split_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"address {addr!r} is not host:port")
    return host.strip("[]") or "127.0.0.1", int(port)


# Where a container sees its own cgroup (cgroup namespaces; Docker and Kubernetes mount it so).
CGROUP_ROOT = Path("/sys/fs/cgroup")


def _read_ints(path: Path) -> list[int] | None:
    try:
        return [int(word) for word in path.read_text().split()]
    except (OSError, ValueError):  # absent, unreadable, or "max"
        return None


def cgroup_cpu_limit(root: Path = CGROUP_ROOT) -> int | None:
    """CPUs the cgroup CPU quota allows, rounded up (at least 1); None without a quota.

    cgroup v2 ``cpu.max`` ("max 100000" or "<quota> <period>" in microseconds), else cgroup
    v1 ``cpu.cfs_quota_us`` (-1: none) over ``cpu.cfs_period_us``."""
    v2 = root / "cpu.max"
    if v2.exists():
        words = _read_ints(v2)
        quota, period = (words[0], words[1]) if words and len(words) == 2 else (-1, 0)
    else:
        quota, period = -1, 0
        for controller in ("cpu", "cpu,cpuacct"):
            quotas = _read_ints(root / controller / "cpu.cfs_quota_us")
            periods = _read_ints(root / controller / "cpu.cfs_period_us")
            if quotas and periods and len(quotas) == len(periods) == 1:
                quota, period = quotas[0], periods[0]
                break
    if quota <= 0 or period <= 0:
        return None
    return max(1, -(-quota // period))


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
    max_concurrent_rpcs: int = 256  # per process; the next one gets RESOURCE_EXHAUSTED
    max_items_per_request: int = 100_000  # elements of any one repeated field
    max_item_bytes: int = 16 * 1024 * 1024  # serialized size of any one element
    workers: int = 0  # serving processes on one port; 0: the number of CPUs
    keepalive_time_seconds: float = 60.0  # server pings an idle connection this often
    keepalive_timeout_seconds: float = 20.0  # and closes it if the ping is not answered
    max_connection_age_seconds: float = 1800.0  # connections are recycled (rebalancing)
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
    # Who may call: dev mode (no credentials, loopback only) or bearer tokens stored as SHA-256
    # hashes in a JSON file and/or the api_tokens table.
    dev_mode: bool = False
    auth_tokens_file: Path | None = None
    auth_db_tokens: bool = False
    auth_cache_seconds: float = 30.0  # a revoked table token stops working within this
    # TLS: a certificate and key enable it; a client CA makes it mutual (client certs required).
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    tls_client_ca_file: Path | None = None

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
            max_concurrent_rpcs=_int(env, "CE_MAX_CONCURRENT_RPCS",
                                     defaults.max_concurrent_rpcs, 1),
            max_items_per_request=_int(env, "CE_MAX_ITEMS_PER_REQUEST",
                                       defaults.max_items_per_request, 1),
            max_item_bytes=_int(env, "CE_MAX_ITEM_BYTES", defaults.max_item_bytes, 1024),
            workers=_int(env, "CE_WORKERS", defaults.workers, 0),
            keepalive_time_seconds=_float(env, "CE_KEEPALIVE_TIME_SECONDS",
                                          defaults.keepalive_time_seconds),
            keepalive_timeout_seconds=_float(env, "CE_KEEPALIVE_TIMEOUT_SECONDS",
                                             defaults.keepalive_timeout_seconds),
            max_connection_age_seconds=_float(env, "CE_MAX_CONNECTION_AGE_SECONDS",
                                              defaults.max_connection_age_seconds),
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
            dev_mode=_bool(env, "CE_DEV_MODE"),
            auth_tokens_file=_path(env, "CE_AUTH_TOKENS_FILE"),
            auth_db_tokens=_bool(env, "CE_AUTH_DB_TOKENS"),
            auth_cache_seconds=_float(env, "CE_AUTH_CACHE_SECONDS",
                                      defaults.auth_cache_seconds, minimum=0.0),
            tls_cert_file=_path(env, "CE_TLS_CERT_FILE"),
            tls_key_file=_path(env, "CE_TLS_KEY_FILE"),
            tls_client_ca_file=_path(env, "CE_TLS_CLIENT_CA_FILE"),
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
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ConfigError("CE_TLS_CERT_FILE and CE_TLS_KEY_FILE must be set together")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ConfigError("CE_TLS_CLIENT_CA_FILE (mutual TLS) needs CE_TLS_CERT_FILE and "
                              "CE_TLS_KEY_FILE")
        for name, path in (("CE_AUTH_TOKENS_FILE", self.auth_tokens_file),
                           ("CE_TLS_CERT_FILE", self.tls_cert_file),
                           ("CE_TLS_KEY_FILE", self.tls_key_file),
                           ("CE_TLS_CLIENT_CA_FILE", self.tls_client_ca_file)):
            if path is not None and not path.is_file():
                raise ConfigError(f"{name}={str(path)!r} is not a readable file")

    def validate_serving(self) -> None:
        """What ``serve`` needs beyond ``validate``: credentials outside dev mode, and dev mode
        only where no one else can connect."""
        self.validate()
        # The host as written: gRPC binds every interface for an empty one (":50051").
        host = self.grpc_addr.rpartition(":")[0].strip("[]")
        tokens = self.auth_tokens_file is not None or self.auth_db_tokens
        if self.dev_mode:
            if not is_loopback(host):
                raise ConfigError(f"dev mode (--dev / CE_DEV_MODE=1) accepts calls without "
                                  f"credentials and binds only a loopback address, not "
                                  f"{self.grpc_addr!r}")
            if tokens:
                raise ConfigError("dev mode (--dev / CE_DEV_MODE=1) checks no credentials but "
                                  "CE_AUTH_TOKENS_FILE or CE_AUTH_DB_TOKENS is set: choose one")
            return
        if not tokens:
            if is_loopback(host):
                raise ConfigError("no credentials configured: run `context-engine serve --dev` "
                                  "(CE_DEV_MODE=1) for local development, or configure tokens "
                                  "with CE_AUTH_TOKENS_FILE and/or CE_AUTH_DB_TOKENS=1")
            raise ConfigError(f"refusing to serve {self.grpc_addr!r} without credentials: "
                              "configure tokens with CE_AUTH_TOKENS_FILE and/or "
                              "CE_AUTH_DB_TOKENS=1")

    def worker_count(self, *, cgroup_root: Path = CGROUP_ROOT) -> int:
        """Serving processes: ``workers``, or one per CPU this process may use: the CPUs it may
        run on, capped by its cgroup's CPU quota (a container limited to 2 CPUs on a 64-core
        host sees 64 CPUs in its affinity mask but gets the time of 2)."""
        if self.workers > 0:
            return self.workers
        try:
            cpus = max(1, len(os.sched_getaffinity(0)))
        except AttributeError:  # not Linux
            cpus = max(1, os.cpu_count() or 1)
        limit = cgroup_cpu_limit(cgroup_root)
        return cpus if limit is None else min(cpus, limit)

    def budget_policy(self) -> BudgetPolicy:
        return BudgetPolicy(safety_margin_ratio=self.safety_margin_ratio,
                            policy_cap_tokens=self.policy_cap_tokens,
                            inline_maximum_bytes=self.inline_maximum_bytes,
                            recall_floor_tokens=self.recall_floor_tokens)
