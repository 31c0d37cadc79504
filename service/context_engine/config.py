"""Configuration, built once at start-up from an injectable environment mapping.

``Config`` is a pydantic-settings model whose only source is its keyword arguments:
``Config.from_env(env)`` reads the ``CE_*`` variables (and ``DATABASE_URL``) from the mapping it
is given, never from ``os.environ`` behind the caller's back, and reports every bad variable in
one ``ConfigError`` naming the variable and its value (a secret's value never).
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import ipaddress
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Self
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BeforeValidator,
    Field,
    ValidationError,
    model_validator,
)
from pydantic_core import PydanticCustomError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from context_engine.adapters.assets import DEFAULT_ASSETS_DIR, DEFAULT_CATALOG
from context_engine.domain.budget import BudgetPolicy
from context_engine.telemetry.tracing import otel_problems, otlp_requested

REPO_DIR = Path(__file__).resolve().parents[2]
# What a set secret is shown as (`context-engine config`, error messages).
MASK = "********"


class ConfigError(ValueError):
    pass


def is_loopback(host: str) -> bool:
    """True only for addresses no other machine can reach (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # another host name: it may resolve to anything
        return False


def written_host(addr: str) -> str:
    """The host of ``addr`` as written, without an IPv6 address's brackets ("" for none)."""
    return addr.rpartition(":")[0].strip("[]")


def addr_problem(addr: str) -> str | None:
    """Why ``addr`` is no host:port to bind, or None."""
    host, sep, port = addr.rpartition(":")
    # ASCII digits only: "5005²" and Arabic-Indic digits are digits to str.isdigit, not to
    # int() nor to gRPC
    if not sep or not (port.isascii() and port.isdigit()):
        return "is not host:port"
    if not host:  # gRPC refuses an empty host (after start-up, with a traceback)
        return (f"has no host: write 0.0.0.0:{port} or [::]:{port} (every interface) or "
                f"127.0.0.1:{port} (this machine)")
    if ("[" in host or "]" in host) and not (
            host.startswith("[") and host.endswith("]") and _is_ipv6(host[1:-1])):
        # gRPC cannot parse brackets around anything but an IPv6 address (it fails to bind,
        # after start-up), while the host checked here would be read without them
        return (f"holds brackets around no IPv6 address: write {host.strip('[]')}:{port}, or "
                f"an IPv6 address in brackets ([::1]:{port})")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        # "::1:5005" is read here as ::1 port 5005, while gRPC does not read it so (it fails
        # to bind it as a name): what is checked (loopback, free) must be what is bound
        if _is_ip(host):
            return f"holds an IPv6 host out of brackets: write [{host}]:{port}"
        return "is not host:port"
    return None


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _is_ipv6(host: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address)
    except ValueError:
        return False


def split_addr(addr: str) -> tuple[str, int]:
    problem = addr_problem(addr)
    if problem is not None:
        raise ConfigError(f"address {addr!r} {problem}")
    return written_host(addr), int(addr.rpartition(":")[2])


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


# ---------------------------------------------------------------------- value parsing
# Each parser raises a PydanticCustomError whose message is the predicate ("is not an
# integer"); ``_message`` prefixes it with the variable and the value as written.


def _problem(kind: str, text: str) -> PydanticCustomError:
    return PydanticCustomError(kind, "{problem}", {"problem": text})


def _parse_int(value: object) -> object:
    if isinstance(value, str):  # Python's int(): "5.0" is not an integer
        try:
            return int(value)
        except ValueError:
            raise _problem("int_parsing", "is not an integer") from None
    return value


def _parse_float(value: object) -> object:
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            raise _problem("float_parsing", "is not a number") from None
    return value


_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})


def _parse_bool(value: object) -> object:
    if isinstance(value, str):
        word = value.strip().lower()
        if word in _TRUE or word in _FALSE:
            return word in _TRUE
        raise _problem("bool_parsing", "is not a boolean (1/0, true/false)")
    return value


def _address(value: str) -> str:
    problem = addr_problem(value)
    if problem is not None:
        raise _problem("address", problem)
    return value


def _optional_address(value: str) -> str:
    return value and _address(value)  # empty: that endpoint is off


def _http_url(value: str) -> str:
    if value and not value.startswith(("http://", "https://")):
        raise _problem("url", "is not an http(s) URL")
    return value


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _database_url(value: str) -> str:
    # asyncpg takes these two schemes and reports any other only when it connects, after the
    # configuration has been accepted
    if urlsplit(value).scheme not in ("postgresql", "postgres"):
        raise _problem("database_url", "is not a PostgreSQL URL: "
                       "postgresql://user:password@host:port/database")
    return value


def _log_level(value: str) -> str:
    """One of the five levels the error names (NOTSET would inherit the root logger's WARNING
    and silence every info line; WARN and FATAL are aliases logging keeps for old code)."""
    level = value.strip().upper()
    if level not in LOG_LEVELS:
        raise _problem("log_level", f"is not a log level ({', '.join(LOG_LEVELS)})")
    return level


class Pooler(enum.StrEnum):
    """What stands between the service and PostgreSQL (``CE_DB_POOLER``). It cannot be told
    reliably from the connection (PgBouncer answers like PostgreSQL), so it is configured."""

    NONE = "none"  # PostgreSQL itself, or a pooler in session mode
    TRANSACTION = "transaction"  # a pooler in transaction mode (PgBouncer pool_mode=transaction)


Int = Annotated[int, BeforeValidator(_parse_int)]
Float = Annotated[float, BeforeValidator(_parse_float)]
Bool = Annotated[bool, BeforeValidator(_parse_bool)]
Positive = Annotated[Float, Field(gt=0)]
NonNegative = Annotated[Float, Field(ge=0)]
# gRPC takes message sizes and its timers (in milliseconds) as 32-bit integers.
MessageBytes = Annotated[Int, Field(ge=1024, le=2**31 - 1)]


def _whole_milliseconds(value: float) -> float:
    """A timer gRPC takes in whole milliseconds (``server_options``): one below 1 ms was 0 ms
    there, and calls failed DEADLINE_EXCEEDED (once gRPC's core aborted)."""
    if value < 0.001:
        raise _problem("whole_milliseconds", "is below 0.001 (seconds): gRPC takes it in whole "
                                             "milliseconds, and it would be 0 ms")
    return value


# 23 days in ms fits an int32; 1 ms the least
GrpcSeconds = Annotated[Float, Field(gt=0, le=2_000_000), AfterValidator(_whole_milliseconds)]


def _raise(problems: list[str]) -> None:
    """``ConfigError`` naming every problem, when there is any."""
    if problems:
        raise ConfigError("; ".join(problems))


class Config(BaseSettings):
    """Every setting of the service; the variable of each is ``CE_<NAME>`` (``variables()``)."""

    model_config = SettingsConfigDict(frozen=True, extra="forbid", allow_inf_nan=False,
                                      hide_input_in_errors=True)  # inputs may hold secrets

    grpc_addr: Annotated[str, AfterValidator(_address)] = "127.0.0.1:50051"
    # empty: no metrics endpoint
    metrics_addr: Annotated[str, AfterValidator(_optional_address)] = "127.0.0.1:9464"
    # None: embedded PostgreSQL under data_dir. A DSN may hold a password: never in repr.
    database_url: Annotated[str, AfterValidator(_database_url)] | None = Field(default=None,
                                                                             repr=False)
    data_dir: Path = REPO_DIR / ".data"
    migrations_dir: Path = REPO_DIR / "migrations"
    assets_dir: Path = DEFAULT_ASSETS_DIR
    model_catalog: Path = DEFAULT_CATALOG
    max_receive_bytes: MessageBytes = 64 * 1024 * 1024
    # largest response sent; the clients' default receive limit is the same 64 MiB
    max_send_bytes: MessageBytes = 64 * 1024 * 1024
    # per process; the next one gets RESOURCE_EXHAUSTED
    max_concurrent_rpcs: Annotated[Int, Field(ge=1)] = 256
    max_items_per_request: Annotated[Int, Field(ge=1)] = 100_000  # elements of a repeated field
    max_item_bytes: MessageBytes = 16 * 1024 * 1024  # of any one element
    # serving processes on one port; 0: one per CPU
    workers: Annotated[Int, Field(ge=0, le=1024)] = 0
    keepalive_time_seconds: GrpcSeconds = 60.0  # server pings an idle connection this often
    keepalive_timeout_seconds: GrpcSeconds = 20.0  # and closes it if the ping is not answered
    max_connection_age_seconds: GrpcSeconds = 1800.0  # connections are recycled (rebalancing)
    grace_seconds: GrpcSeconds = 10.0
    # at most an hour: a stop waits for it, and only SIGKILL ends a longer one
    drain_seconds: Annotated[Float, Field(ge=0, le=3_600)] = 1.0
    # asyncpg makes a holder per slot when the pool is made: a typo's trillion ran the
    # process out of memory after the migrations
    db_pool_size: Annotated[Int, Field(ge=1, le=10_000)] = 10
    # transaction: no statement cache, nothing kept on a server connection between transactions
    db_pooler: Pooler = Pooler.NONE
    # at most a day: it is also PostgreSQL's lock_timeout of maintenance (an int32 of ms)
    db_timeout_seconds: Annotated[Float, Field(gt=0, le=86_400)] = 5.0
    plan_cache_size: Annotated[Int, Field(ge=1)] = 4096
    # how long a cached plan serves a Build naming its epoch before the database confirms the
    # session again: the bound on serving an erased session (DeleteSession's plan_cache_seconds)
    plan_cache_ttl_seconds: Annotated[Float, Field(ge=0, le=86_400)] = 60.0
    # the bases of incremental Builds this process keeps (estimated MiB); 0 keeps none, and
    # every Build naming a base answers BUILD_BASE_UNKNOWN
    build_cache_mb: Annotated[Int, Field(ge=0, le=1_048_576)] = 256
    # what Build's render memo keeps of sessions' mapped items, renderings and wire forms
    # (estimated MiB; least recently built session out first); 0 keeps nothing
    render_memo_mb: Annotated[Int, Field(ge=0, le=1_048_576)] = 256
    log_level: Annotated[str, AfterValidator(_log_level)] = "INFO"
    safety_margin_ratio: Annotated[Float, Field(ge=0, lt=0.5)] = 0.05
    policy_cap_tokens: Annotated[Int, Field(ge=0)] = 0  # 0: the model window is the only limit
    inline_maximum_bytes: Annotated[Int, Field(ge=256)] = 16_384
    recall_floor_tokens: Annotated[Int, Field(ge=0)] = 500
    calibration_ttl_seconds: NonNegative = 5.0
    # The data lifecycle (adapters/postgres/maintenance.py): context events are kept this many
    # days (whole UTC days: a partition is a day), partitions are made this many days ahead,
    # retry keys and compaction records are kept this many hours, and a cycle runs this often.
    events_retention_days: Annotated[Int, Field(ge=1, le=36_500)] = 30  # dates stay in range
    event_partitions_ahead_days: Annotated[Int, Field(ge=1, le=366)] = 7
    idempotency_key_ttl_hours: Annotated[Int, Field(ge=1, le=876_000)] = 24  # 100 years
    maintenance_interval_seconds: Positive = 3600.0
    # Compaction's summarizer: unset URL means the deterministic structured summarizer.
    summarizer_url: Annotated[str, AfterValidator(_http_url)] = ""
    summarizer_model: str = ""
    summarizer_api_key: str = Field(default="", repr=False)  # never printed
    summarizer_timeout_seconds: Positive = 20.0
    # the openai SDK's retries within that deadline (connection errors, 408/409/429/5xx)
    summarizer_max_retries: Annotated[Int, Field(ge=0, le=10)] = 2
    # Traces go over OTLP only when the standard OTEL_* variables ask for it (off by default).
    trace_export: Bool = False
    # Who may call: dev mode (no credentials, loopback only) or bearer tokens stored as SHA-256
    # hashes in a JSON file and/or the api_tokens table.
    dev_mode: Bool = False
    auth_tokens_file: Path | None = None
    auth_db_tokens: Bool = False
    auth_cache_seconds: NonNegative = 30.0  # a revoked table token stops working within this
    # TLS: a certificate and key enable it; a client CA makes it mutual (client certs required).
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    tls_client_ca_file: Path | None = None

    @classmethod
    def settings_customise_sources(
            cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)  # nothing is read behind from_env's back (os.environ, .env)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Config:
        """The configuration the variables of ``env`` ask for; ``ConfigError`` naming every
        bad variable (and its value, unless it is a secret) otherwise."""
        values: dict[str, Any] = {}
        for name, variable in variables().items():
            if variable in env:
                raw = env[variable]
                if raw or name in _EMPTY_IS_A_VALUE:  # otherwise empty means unset
                    values[name] = raw
        if otlp_requested(env):
            values["trace_export"] = True
        otel = otel_problems(env)
        try:
            config = cls(**values)
        except ValidationError as exc:
            raise ConfigError("; ".join([_message(exc, values), *_also(cls, exc, values),
                                         *otel])) from None
        if otel:
            raise ConfigError("; ".join(otel))
        return config

    def with_flags(self, flags: Mapping[str, tuple[str, Any]]) -> Config:
        """A copy with settings given by command-line flags (``{setting: (flag, value)}``),
        validated like the variables: ``ConfigError`` naming each bad flag."""
        values = {name: value for name, (_, value) in flags.items()}
        try:
            return self.replace(**values)
        except ValidationError as exc:
            message = _message(exc, values)
            # every problem names the variable it reads: a flag's value is the flag's
            names = variables()
            for name, (flag, _) in flags.items():
                message = message.replace(f"{names.get(name, name)}=", f"{flag}=")
            raise ConfigError(message) from None

    def replace(self, **changes: Any) -> Config:
        """A copy with ``changes``, validated like any other ``Config`` (pydantic's
        ``model_copy(update=...)`` validates nothing)."""
        unknown = set(changes) - set(type(self).model_fields)
        if unknown:
            raise TypeError(f"Config has no settings {sorted(unknown)}")
        return type(self)(**{**{name: getattr(self, name) for name in type(self).model_fields},
                             **changes})

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        problems = self.problems()
        if problems:
            raise PydanticCustomError("config", "{problem}", {"problem": "; ".join(problems)})
        return self

    def problems(self) -> list[str]:
        """What makes the settings inconsistent with each other or the files they name."""
        found: list[str] = []
        for variable, addr in (("CE_GRPC_ADDR", self.grpc_addr),
                               ("CE_METRICS_ADDR", self.metrics_addr)):
            if addr or variable == "CE_GRPC_ADDR":
                try:
                    _, port = split_addr(addr)
                except ConfigError:
                    found.append(f"{variable}={addr!r} is not host:port")
                    continue
                if port > 65535:
                    found.append(f"{variable}={addr!r}: port {port} is above 65535")
        if self.metrics_addr and self._same_port(self.grpc_addr, self.metrics_addr):
            found.append(f"CE_GRPC_ADDR={self.grpc_addr!r} and CE_METRICS_ADDR="
                         f"{self.metrics_addr!r} name one port: give metrics another one")
        if self.maintenance_interval_seconds >= self.event_partitions_ahead_days * 86_400:
            found.append(f"CE_MAINTENANCE_INTERVAL_SECONDS={self.maintenance_interval_seconds:g} "
                         f"must be shorter than CE_EVENT_PARTITIONS_AHEAD_DAYS="
                         f"{self.event_partitions_ahead_days} days, or the partitions made "
                         "ahead run out between two cycles")
        if self.summarizer_url and not self.summarizer_model:
            found.append("CE_SUMMARIZER_URL is set without CE_SUMMARIZER_MODEL")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            found.append("CE_TLS_CERT_FILE and CE_TLS_KEY_FILE must be set together")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            found.append("CE_TLS_CLIENT_CA_FILE (mutual TLS) needs CE_TLS_CERT_FILE and "
                         "CE_TLS_KEY_FILE")
        for variable, path in (("CE_AUTH_TOKENS_FILE", self.auth_tokens_file),
                               ("CE_TLS_CERT_FILE", self.tls_cert_file),
                               ("CE_TLS_KEY_FILE", self.tls_key_file),
                               ("CE_TLS_CLIENT_CA_FILE", self.tls_client_ca_file)):
            if path is not None and not path.is_file():
                found.append(f"{variable}={str(path)!r} is not a readable file")
        if not self.model_catalog.is_file():
            found.append(f"CE_MODEL_CATALOG={str(self.model_catalog)!r} is not a readable file")
        if not self.assets_dir.is_dir():
            found.append(f"CE_ASSETS_DIR={str(self.assets_dir)!r} is not a directory")
        if self.database_url is None and self.data_dir.exists() and not self.data_dir.is_dir():
            found.append(f"CE_DATA_DIR={str(self.data_dir)!r} is not a directory (the embedded "
                         "PostgreSQL keeps its data under it)")
        return found

    def migration_problems(self) -> list[str]:
        """What ``serve`` and ``migrate`` need of ``CE_MIGRATIONS_DIR`` (only they read it: a
        package installed without the checkout's migrations still probes and inspects)."""
        if not self.migrations_dir.is_dir():
            return [f"CE_MIGRATIONS_DIR={str(self.migrations_dir)!r} is not a directory"]
        if not any(self.migrations_dir.glob("*.sql")):
            return [f"CE_MIGRATIONS_DIR={str(self.migrations_dir)!r} holds no migration "
                    "(*.sql): a database migrated from it would hold no tables"]
        from context_engine.adapters.postgres.migrate import discover

        try:
            discover(self.migrations_dir)
        except (ValueError, OSError) as exc:  # a misnamed, unreadable or twice-numbered file
            return [f"CE_MIGRATIONS_DIR={str(self.migrations_dir)!r}: {exc}"]
        return []

    def validate_migrations(self) -> None:
        _raise(self.migration_problems())

    @staticmethod
    def _same_port(a: str, b: str) -> bool:
        """Whether two addresses would bind one port: the same port on the same host, or on
        any host where one of them binds every interface."""
        try:
            (host_a, port_a), (host_b, port_b) = split_addr(a), split_addr(b)
        except ConfigError:
            return False  # reported as not host:port
        every = ("0.0.0.0", "::")
        same = {"localhost": "127.0.0.1"}  # what a bind of "localhost" takes first
        host_a, host_b = same.get(host_a, host_a), same.get(host_b, host_b)
        return (port_a == port_b != 0  # port 0: each gets a port of its own
                and (host_a == host_b or host_a in every or host_b in every))

    def validate(self) -> None:  # type: ignore[override]  # pydantic v1's validate is gone
        """``ConfigError`` when ``problems()`` finds any (after ``model_copy(update=...)``,
        which validates nothing)."""
        _raise(self.problems())

    def tls_problems(self) -> list[str]:
        """What ``serve`` would fail on in its TLS files, said before it binds anything (a
        certificate and key that do not load were reported as a failure to bind the address):
        each file unreadable, the certificate and key no PEM pair, the client CA no PEM."""
        if self.tls_cert_file is None or self.tls_key_file is None:
            return []
        import ssl

        found = []
        for variable, path in (("CE_TLS_CERT_FILE", self.tls_cert_file),
                               ("CE_TLS_KEY_FILE", self.tls_key_file),
                               ("CE_TLS_CLIENT_CA_FILE", self.tls_client_ca_file)):
            if path is None:
                continue
            try:
                path.read_bytes()
            except OSError as exc:
                found.append(f"{variable}={str(path)!r} cannot be read: {exc.strerror}")
        if found:
            return found
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:  # an encrypted key is refused, never prompted for
            context.load_cert_chain(self.tls_cert_file, self.tls_key_file, password="")
        except ssl.SSLError as exc:
            found.append(f"CE_TLS_CERT_FILE={str(self.tls_cert_file)!r} and CE_TLS_KEY_FILE="
                         f"{str(self.tls_key_file)!r} are not a PEM certificate and its "
                         f"unencrypted key ({exc.reason or exc})")
        if self.tls_client_ca_file is not None:
            try:
                context.load_verify_locations(cafile=self.tls_client_ca_file)
            except ssl.SSLError as exc:
                found.append(f"CE_TLS_CLIENT_CA_FILE={str(self.tls_client_ca_file)!r} holds no "
                             f"PEM certificate ({exc.reason or exc})")
        return found

    def validate_serving(self) -> None:
        """What ``serve`` needs beyond ``validate``: credentials outside dev mode, dev mode
        only where no one else can connect, and TLS files that load."""
        self.validate()
        _raise(self.migration_problems() + self.tls_problems())
        # The host as written (an empty one, ":50051", is refused as no host at all).
        host = written_host(self.grpc_addr)
        tokens = self.auth_tokens_file is not None or self.auth_db_tokens
        if self.dev_mode:
            if not is_loopback(host):
                raise ConfigError(f"dev mode (--dev / CE_DEV_MODE=1) accepts calls without "
                                  f"credentials and binds only a loopback address, not "
                                  f"{self.grpc_addr!r}")
            # its first line says loopback binds only: the metrics endpoint's too (empty: off)
            if self.metrics_addr and not is_loopback(written_host(self.metrics_addr)):
                raise ConfigError(f"dev mode (--dev / CE_DEV_MODE=1) binds only loopback "
                                  f"addresses, and the metrics address (--metrics-addr / "
                                  f"CE_METRICS_ADDR) {self.metrics_addr!r} is not one: write "
                                  f"127.0.0.1:<port>, or an empty one for no metrics")
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


# Set but empty means "unset" (the default) for every variable but this one: empty turns the
# metrics endpoint off.
_EMPTY_IS_A_VALUE = frozenset({"metrics_addr"})
# Not read from a variable of its own: the standard OTEL_* variables decide it.
_DERIVED = {"trace_export": "OTEL_*"}
# Settings shown only redacted, and never in repr: the fields declared with repr=False.
SECRETS = frozenset(name for name, info in Config.model_fields.items() if not info.repr)


def variables() -> dict[str, str]:
    """The environment variable of each setting read from one: ``CE_<NAME>``, and the
    conventional ``DATABASE_URL``."""
    return {name: "DATABASE_URL" if name == "database_url" else f"CE_{name.upper()}"
            for name in Config.model_fields if name not in _DERIVED}


# CE_* variables that are not settings of the server but are read by the tools beside it
# (the demo's and the examples' bearer token and ids, the health probe's TLS, a worker's
# supervisor, the test suite's database, pooler, fuzz seed and result file): not reported as
# unknown.
OTHER_VARIABLES = frozenset({"CE_TOKEN", "CE_TENANT_ID", "CE_SESSION_ID", "CE_FUZZ_SEED",
                             "CE_RESULT_FILE"})
OTHER_PREFIXES = ("CE_HEALTH_TLS_", "CE_WORKER_", "CE_TEST_")


def unknown_variables(env: Mapping[str, str]) -> list[str]:
    """One line for each ``CE_*`` variable of ``env`` that nothing reads (a misspelt setting
    would otherwise be ignored without a word), naming the setting it most resembles."""
    known = set(variables().values())
    lines = []
    for variable in sorted(env):
        if (not variable.startswith("CE_") or variable in known or variable in OTHER_VARIABLES
                or variable.startswith(OTHER_PREFIXES)):
            continue
        close = difflib.get_close_matches(variable, sorted(known), n=1, cutoff=0.75)
        hint = f" (did you mean {close[0]}?)" if close else ""
        lines.append(f"{variable} is not a setting and is ignored{hint}")
    return lines


def _shown(name: str, raw: object) -> str:
    return repr(MASK) if name in SECRETS else repr(redacted(name, raw))


def _also(cls: type[Config], exc: ValidationError, values: Mapping[str, Any]) -> list[str]:
    """The settings-together and file problems a variable's own error hid (pydantic checks the
    settings together only once every one is valid): those of the other variables as given,
    the bad ones at their defaults; one naming a bad variable is left to that one's error."""
    bad = {str(e["loc"][0]) for e in exc.errors() if e["loc"]}
    if not bad:
        return []
    try:
        cls(**{name: value for name, value in values.items() if name not in bad})
    except ValidationError as rest:
        names = variables()
        hidden = {names.get(name, name) for name in bad}
        return [problem for error in rest.errors(include_input=False, include_url=False)
                if not error["loc"]
                for problem in str((error.get("ctx") or {}).get("problem", "")).split("; ")
                if problem and not any(variable in problem for variable in hidden)]
    return []


def _message(exc: ValidationError, values: Mapping[str, Any]) -> str:
    """One line per bad variable, ``VAR='value' <problem>``; a secret's value is masked."""
    names = variables()
    lines: list[str] = []
    for error in exc.errors(include_input=False, include_url=False):
        ctx = error.get("ctx") or {}
        kind = error["type"]
        if "problem" in ctx:
            problem = str(ctx["problem"])
        elif kind == "greater_than_equal":
            problem = f"is below {ctx['ge']}"
        elif kind == "greater_than":
            problem = "must be positive" if ctx["gt"] == 0 else f"must be above {ctx['gt']}"
        elif kind == "less_than":
            problem = f"must be below {ctx['lt']}"
        elif kind == "less_than_equal":
            problem = f"is above {ctx['le']}"
        elif kind == "finite_number":
            problem = "is not a finite number"
        elif kind == "enum":
            problem = f"is not {ctx['expected']}"
        else:
            problem = error["msg"][:1].lower() + error["msg"][1:]
        if not error["loc"]:  # the settings together (model_validator)
            lines.append(problem)
            continue
        name = str(error["loc"][0])
        variable = names.get(name) or _DERIVED.get(name, name)
        lines.append(f"{variable}={_shown(name, values.get(name))} {problem}")
    return "; ".join(lines)


# ---------------------------------------------------------------------- the effective settings


# a parameter holding a secret: libpq's password and sslpassword, an API's key or token
_PASSWORD_PARAM = re.compile(
    r"((?:[\w-]*password|[\w-]*key|[\w-]*token|[\w-]*secret)\s*=\s*)"
    r"('(?:[^'\\]|\\.)*'|[^\s&]*)", re.I)
# what a driver splits a URL's user info at when a password holds it unescaped (drivers
# differ on "@": asyncpg takes the first)
URL_DELIMITERS = re.compile(r"[#?/@]")


def _userinfo(url: str) -> tuple[str, str, str | None, str] | None:
    """``(head, user, password, rest)`` of a URL with user info (``head`` is what precedes
    the user: ``scheme://``, ``//`` or nothing), read up to its last "@" that no parameter
    precedes (not urlsplit's: a password holding an unescaped "#", "?" or "/" ends its netloc
    early, and the password was shown whole; an "@" in a parameter is not the user's)."""
    start = url.find("://") + 3 if "://" in url else 2 if url.startswith("//") else 0
    head, after = url[:start], url[start:]
    ats = [i for i, c in enumerate(after) if c == "@"]
    if not ats:
        return None
    own = [i for i in ats if "=" not in after[:i]]
    at = (own or ats)[-1]
    user, colon, password = after[:at].partition(":")
    return head, user, password if colon else None, after[at + 1:]


def redact_url(url: str) -> str:
    """``url`` with any password replaced by the mask: ``postgresql://user:********@host/db``,
    ``...?password=********`` and libpq's ``password=********`` keyword form. A "@" after the
    host (in a parameter) may mask more than the password, never less."""
    masked = _PASSWORD_PARAM.sub(rf"\g<1>{MASK}", url)
    found = _userinfo(masked)
    if found is not None and found[2] is not None:
        head, user, _, rest = found
        masked = f"{head}{user}:{MASK}@{rest}"
    return masked


def redact_message(text: str, url: str) -> str:
    """``text`` (a driver's error about ``url``) fit to be shown: each password of the URL in
    it masked. A password holding a character that ends a URL's authority unescaped is read
    by a driver in pieces (a port, a path, a query field), which an error may name: such a
    message is not shown, only what it is, and how to write the password."""
    found = _userinfo(url)
    password = found[2] if found is not None else None
    if password and URL_DELIMITERS.search(password):
        kind = text.split(":", 1)[0]
        return (f"{kind} (its message would show part of the password: percent-encode "
                f"'#', '?', '/', '@' and ':' in a URL's password, as %23, %3F, %2F, %40, %3A)")
    secrets = [password or "", *(m.group(2).strip("'") for m in _PASSWORD_PARAM.finditer(url))]
    for secret in sorted(filter(None, secrets), key=len, reverse=True):
        text = text.replace(secret, MASK)
    return text


def redacted(name: str, value: object) -> object:
    """What may be shown of a setting: secrets masked (empty when unset), the DSN's password."""
    if name == "summarizer_url":  # credentials in its user info are the API's too
        return redact_url(str(value)) if value else value
    if name not in SECRETS:
        return value
    if name == "database_url":
        return None if value is None else redact_url(str(value))
    return MASK if value else ""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Setting:
    name: str
    variable: str  # where it is read from
    value: object  # JSON-ready (str for a path), secrets redacted
    source: str  # "environment" or "default"


def effective(config: Config) -> list[Setting]:
    """Every setting of a configuration made by ``from_env``, its value as it may be shown and
    where it came from."""
    names = variables()
    out: list[Setting] = []
    for name in Config.model_fields:
        value = getattr(config, name)
        if isinstance(value, Path):
            value = str(value)
        out.append(Setting(name=name, variable=names.get(name) or _DERIVED[name],
                           value=redacted(name, value),
                           source="environment" if name in config.model_fields_set
                           else "default"))
    return out
