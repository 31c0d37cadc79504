"""``Config``: one pydantic-settings model read from an injected environment only, with today's
defaults, empty-value rules and strict errors (every bad variable named with its value, in one
error), and secrets that never show: not in repr, str, errors, nor ``effective()``."""

from __future__ import annotations

from pathlib import Path

import pytest
from context_engine.config import (
    MASK,
    SECRETS,
    Config,
    ConfigError,
    effective,
    redact_url,
    variables,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

SECRET = "sk-live-0123456789abcdef-do-not-print"
DSN_PASSWORD = "hunter2-in-the-dsn"

# The defaults as the README's configuration table documents them.
DEFAULTS = {
    "grpc_addr": "127.0.0.1:50051", "metrics_addr": "127.0.0.1:9464", "database_url": None,
    "max_receive_bytes": 67108864, "max_send_bytes": 67108864, "max_concurrent_rpcs": 256,
    "max_items_per_request": 100000,
    "max_item_bytes": 16777216, "workers": 0, "keepalive_time_seconds": 60.0,
    "keepalive_timeout_seconds": 20.0, "max_connection_age_seconds": 1800.0,
    "grace_seconds": 10.0, "drain_seconds": 1.0, "db_pool_size": 10, "db_timeout_seconds": 5.0,
    "plan_cache_size": 4096, "plan_cache_ttl_seconds": 60.0, "log_level": "INFO",
    "safety_margin_ratio": 0.05,
    "policy_cap_tokens": 0, "inline_maximum_bytes": 16384, "recall_floor_tokens": 500,
    "calibration_ttl_seconds": 5.0, "events_retention_days": 30,
    "event_partitions_ahead_days": 7, "idempotency_key_ttl_hours": 24,
    "maintenance_interval_seconds": 3600.0, "summarizer_url": "", "summarizer_model": "",
    "summarizer_api_key": "", "summarizer_timeout_seconds": 20.0, "trace_export": False,
    "dev_mode": False, "auth_tokens_file": None, "auth_db_tokens": False,
    "auth_cache_seconds": 30.0, "tls_cert_file": None, "tls_key_file": None,
    "tls_client_ca_file": None,
}


def test_defaults_are_the_documented_ones():
    config = Config.from_env({})
    assert config == Config()
    assert {name: getattr(config, name) for name in DEFAULTS} == DEFAULTS
    assert config.data_dir.name == ".data" and config.migrations_dir.name == "migrations"
    assert config.model_fields_set == set()


def test_every_setting_has_one_variable():
    names = variables()
    assert set(names) == set(Config.model_fields) - {"trace_export"}
    assert names["database_url"] == "DATABASE_URL"
    assert all(v == f"CE_{n.upper()}" for n, v in names.items() if n != "database_url")


def test_nothing_is_read_behind_from_envs_back(monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path):
    monkeypatch.setenv("CE_WORKERS", "7")
    monkeypatch.setenv("DATABASE_URL", "postgresql://elsewhere/db")
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".env").write_text("CE_WORKERS=9\n")
    assert Config.from_env({}).workers == 0 and Config().workers == 0
    assert Config().database_url is None


def test_values_are_parsed_from_the_environment(tmp_path: Path):
    tokens = tmp_path / "tokens.json"
    tokens.write_text("[]")
    config = Config.from_env({
        "CE_GRPC_ADDR": "[::1]:6000", "CE_METRICS_ADDR": "", "DATABASE_URL": "postgresql://x/y",
        "CE_WORKERS": " 3 ", "CE_GRACE_SECONDS": "2.5", "CE_DRAIN_SECONDS": "0",
        "CE_DEV_MODE": "Yes", "CE_AUTH_DB_TOKENS": "off", "CE_AUTH_TOKENS_FILE": str(tokens),
        "CE_LOG_LEVEL": "debug", "CE_DATA_DIR": str(tmp_path), "CE_SAFETY_MARGIN_RATIO": "0",
        "CE_SUMMARIZER_URL": "https://llm.internal/v1", "CE_SUMMARIZER_MODEL": "m",
        "CE_SUMMARIZER_API_KEY": SECRET, "UNRELATED": "ignored"})
    assert (config.grpc_addr, config.metrics_addr, config.database_url) == (
        "[::1]:6000", "", "postgresql://x/y")
    assert (config.workers, config.grace_seconds, config.drain_seconds) == (3, 2.5, 0.0)
    assert config.dev_mode is True and config.auth_db_tokens is False
    assert config.auth_tokens_file == tokens and config.data_dir == tmp_path
    assert config.log_level == "DEBUG" and config.summarizer_api_key == SECRET
    assert "workers" in config.model_fields_set and "plan_cache_size" not in config.model_fields_set


@pytest.mark.parametrize("variable", sorted(set(variables().values()) - {"CE_METRICS_ADDR"}))
def test_an_empty_variable_means_unset(variable: str):
    assert Config.from_env({variable: ""}) == Config()


def test_an_empty_metrics_address_turns_the_endpoint_off():
    assert Config.from_env({"CE_METRICS_ADDR": ""}).metrics_addr == ""


@pytest.mark.parametrize(("raw", "value"), [
    ("1", True), ("true", True), ("YES", True), (" on ", True),
    ("0", False), ("false", False), ("No", False), ("off", False), ("  ", False),
])
def test_booleans(raw: str, value: bool):
    assert Config.from_env({"CE_AUTH_DB_TOKENS": raw}).auth_db_tokens is value


@pytest.mark.parametrize(("env", "message"), [
    ({"CE_WORKERS": "many"}, "CE_WORKERS='many' is not an integer"),
    ({"CE_WORKERS": "-1"}, "CE_WORKERS='-1' is below 0"),
    ({"CE_MAX_RECEIVE_BYTES": "5.0"}, "CE_MAX_RECEIVE_BYTES='5.0' is not an integer"),
    ({"CE_MAX_RECEIVE_BYTES": "1023"}, "CE_MAX_RECEIVE_BYTES='1023' is below 1024"),
    ({"CE_INLINE_MAXIMUM_BYTES": "255"}, "CE_INLINE_MAXIMUM_BYTES='255' is below 256"),
    ({"CE_DB_POOL_SIZE": "0"}, "CE_DB_POOL_SIZE='0' is below 1"),
    ({"CE_GRACE_SECONDS": "0"}, "CE_GRACE_SECONDS='0' must be positive"),
    ({"CE_GRACE_SECONDS": "soon"}, "CE_GRACE_SECONDS='soon' is not a number"),
    ({"CE_DB_TIMEOUT_SECONDS": "nan"}, "CE_DB_TIMEOUT_SECONDS='nan' is not a finite number"),
    ({"CE_DRAIN_SECONDS": "-0.5"}, "CE_DRAIN_SECONDS='-0.5' is below 0"),
    ({"CE_SAFETY_MARGIN_RATIO": "0.5"}, "CE_SAFETY_MARGIN_RATIO='0.5' must be below 0.5"),
    ({"CE_DEV_MODE": "maybe"}, "CE_DEV_MODE='maybe' is not a boolean (1/0, true/false)"),
    ({"CE_DEV_MODE": "t"}, "CE_DEV_MODE='t' is not a boolean"),
    ({"CE_GRPC_ADDR": "localhost"}, "CE_GRPC_ADDR='localhost' is not host:port"),
    ({"CE_METRICS_ADDR": "9464"}, "CE_METRICS_ADDR='9464' is not host:port"),
    # gRPC refused it after the database had started and migrated, with a traceback
    ({"CE_GRPC_ADDR": ":53204"}, "CE_GRPC_ADDR=':53204' has no host: write 0.0.0.0:53204 or "
                                 "[::]:53204 (every interface) or 127.0.0.1:53204"),
    ({"CE_METRICS_ADDR": ":9464"}, "CE_METRICS_ADDR=':9464' has no host"),
    # read as ::1 (a loopback) port 5005 here, not so by gRPC
    ({"CE_GRPC_ADDR": "::1:5005", "CE_DEV_MODE": "1"},
     "CE_GRPC_ADDR='::1:5005' holds an IPv6 host out of brackets: write [::1]:5005"),
    ({"CE_GRPC_ADDR": "dns:///localhost:1"}, "CE_GRPC_ADDR='dns:///localhost:1' is not host:port"),
    # digits to str.isdigit, not to int() nor gRPC: an anonymous value error, or a traceback
    ({"CE_GRPC_ADDR": "127.0.0.1:5005\u00b2"},
     "CE_GRPC_ADDR='127.0.0.1:5005\u00b2' is not host:port"),
    ({"CE_METRICS_ADDR": "127.0.0.1:\u0665\u0661"},
     "CE_METRICS_ADDR='127.0.0.1:\u0665\u0661' is not host:port"),
    # brackets gRPC cannot parse (it failed to bind after start-up, with a traceback), read
    # here without them
    ({"CE_GRPC_ADDR": "[127.0.0.1]:51555"}, "CE_GRPC_ADDR='[127.0.0.1]:51555' holds brackets "
                                            "around no IPv6 address: write 127.0.0.1:51555"),
    ({"CE_METRICS_ADDR": "[localhost]:9464"}, "CE_METRICS_ADDR='[localhost]:9464' holds brackets"),
    ({"CE_LOG_LEVEL": "chatty"}, "CE_LOG_LEVEL='chatty' is not a log level"),
    ({"CE_SUMMARIZER_URL": "ftp://x", "CE_SUMMARIZER_MODEL": "m"},
     "CE_SUMMARIZER_URL='ftp://x' is not an http(s) URL"),
    ({"CE_SUMMARIZER_URL": "http://x"}, "CE_SUMMARIZER_URL is set without CE_SUMMARIZER_MODEL"),
    # credentials in the summarizer's URL are never shown
    ({"CE_SUMMARIZER_URL": "ftp://u:hunter2@x", "CE_SUMMARIZER_MODEL": "m"},
     "CE_SUMMARIZER_URL='ftp://u:********@x' is not an http(s) URL"),
    ({"CE_EVENTS_RETENTION_DAYS": "0"}, "CE_EVENTS_RETENTION_DAYS='0' is below 1"),
    ({"CE_IDEMPOTENCY_KEY_TTL_HOURS": "0"}, "CE_IDEMPOTENCY_KEY_TTL_HOURS='0' is below 1"),
    ({"CE_MAINTENANCE_INTERVAL_SECONDS": "0"},
     "CE_MAINTENANCE_INTERVAL_SECONDS='0' must be positive"),
    ({"CE_EVENT_PARTITIONS_AHEAD_DAYS": "1", "CE_MAINTENANCE_INTERVAL_SECONDS": "86400"},
     "CE_MAINTENANCE_INTERVAL_SECONDS=86400 must be shorter than "
     "CE_EVENT_PARTITIONS_AHEAD_DAYS=1 days"),
    ({"CE_GRPC_ADDR": "127.0.0.1:70000"},
     "CE_GRPC_ADDR='127.0.0.1:70000': port 70000 is above 65535"),
    ({"CE_METRICS_ADDR": "0.0.0.0:65536"},
     "CE_METRICS_ADDR='0.0.0.0:65536': port 65536 is above 65535"),
    ({"CE_MAX_RECEIVE_BYTES": "2147483648"},
     "CE_MAX_RECEIVE_BYTES='2147483648' is above 2147483647"),
    ({"CE_MAX_SEND_BYTES": "99999999999"},
     "CE_MAX_SEND_BYTES='99999999999' is above 2147483647"),
    ({"CE_MAX_ITEM_BYTES": "4294967296"},
     "CE_MAX_ITEM_BYTES='4294967296' is above 2147483647"),
    ({"CE_KEEPALIVE_TIME_SECONDS": "1e10"}, "CE_KEEPALIVE_TIME_SECONDS='1e10' is above 2000000"),
    ({"CE_MAX_CONNECTION_AGE_SECONDS": "1e300"},
     "CE_MAX_CONNECTION_AGE_SECONDS='1e300' is above 2000000"),
    ({"CE_GRACE_SECONDS": "3000000"}, "CE_GRACE_SECONDS='3000000' is above 2000000"),
    ({"CE_WORKERS": "5000"}, "CE_WORKERS='5000' is above 1024"),
    ({"CE_DB_POOL_SIZE": "1000000000000"}, "CE_DB_POOL_SIZE='1000000000000' is above 10000"),
    # values that validated and then crashed serve (dates out of range) or failed every
    # maintenance cycle (PostgreSQL's lock_timeout is an int32 of ms)
    ({"CE_EVENTS_RETENTION_DAYS": "1000000"},
     "CE_EVENTS_RETENTION_DAYS='1000000' is above 36500"),
    ({"CE_IDEMPOTENCY_KEY_TTL_HOURS": "100000000000"},
     "CE_IDEMPOTENCY_KEY_TTL_HOURS='100000000000' is above 876000"),
    ({"CE_DB_TIMEOUT_SECONDS": "3000000"}, "CE_DB_TIMEOUT_SECONDS='3000000' is above 86400"),
    ({"CE_MODEL_CATALOG": "/no/such/models.json"},
     "CE_MODEL_CATALOG='/no/such/models.json' is not a readable file"),
    ({"CE_ASSETS_DIR": "/no/such/assets"}, "CE_ASSETS_DIR='/no/such/assets' is not a directory"),
    ({"CE_AUTH_TOKENS_FILE": "/no/such/tokens.json"},
     "CE_AUTH_TOKENS_FILE='/no/such/tokens.json' is not a readable file"),
    # values that were taken and then misbehaved: migrate "succeeded" on an empty database,
    # serve died binding its second endpoint, every info line went silent, a stop never ended
    ({"CE_GRPC_ADDR": "127.0.0.1:7000", "CE_METRICS_ADDR": "127.0.0.1:7000"},
     "CE_GRPC_ADDR='127.0.0.1:7000' and CE_METRICS_ADDR='127.0.0.1:7000' name one port"),
    ({"CE_GRPC_ADDR": "0.0.0.0:7000", "CE_METRICS_ADDR": "127.0.0.1:7000"}, "name one port"),
    ({"CE_GRPC_ADDR": "127.0.0.1:7000", "CE_METRICS_ADDR": "[::]:7000"}, "name one port"),
    ({"CE_GRPC_ADDR": "localhost:7000", "CE_METRICS_ADDR": "127.0.0.1:7000"}, "name one port"),
    ({"CE_LOG_LEVEL": "notset"}, "CE_LOG_LEVEL='notset' is not a log level"),
    ({"CE_LOG_LEVEL": "warn"}, "CE_LOG_LEVEL='warn' is not a log level"),
    ({"CE_DRAIN_SECONDS": "1e300"}, "CE_DRAIN_SECONDS='1e300' is above 3600"),
    # the SDK's configurator failed on these after the migrations, with a traceback
    ({"OTEL_TRACES_EXPORTER": "bogus"},
     "OTEL_TRACES_EXPORTER='bogus': no trace exporter 'bogus' is installed"),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "carrier-pigeon"},
     "OTEL_EXPORTER_OTLP_PROTOCOL='carrier-pigeon' is not an OTLP protocol (grpc, "
     "http/protobuf)"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318",
      "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"},
     "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL='http/json' is not an OTLP protocol"),
    # read for every call's context, traced or not: once a traceback from every command
    ({"OTEL_PROPAGATORS": "tracecontext,b3"},
     "OTEL_PROPAGATORS='tracecontext,b3': no propagator 'b3' is installed"),
    # what the SDK's configurator failed on after the migrations, with a traceback
    ({"OTEL_TRACES_EXPORTER": "console", "OTEL_METRICS_EXPORTER": "prometheus"},
     "OTEL_METRICS_EXPORTER='prometheus': no metrics exporter 'prometheus' is installed"),
    ({"OTEL_TRACES_EXPORTER": "console", "OTEL_LOGS_EXPORTER": "bogus"},
     "OTEL_LOGS_EXPORTER='bogus': no logs exporter 'bogus' is installed"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317",
      "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "abc"},
     "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT='abc' is not a number of seconds"),
    ({"OTEL_TRACES_EXPORTER": "console", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "-3"},
     "OTEL_BSP_MAX_EXPORT_BATCH_SIZE=-3 must be positive"),
    ({"OTEL_TRACES_EXPORTER": "console", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "4096"},
     "OTEL_BSP_MAX_EXPORT_BATCH_SIZE=4096 must be at most OTEL_BSP_MAX_QUEUE_SIZE (2048)"),
    ({"OTEL_TRACES_EXPORTER": "console", "OTEL_BSP_SCHEDULE_DELAY": "soon"},
     "OTEL_BSP_SCHEDULE_DELAY='soon' is not an integer"),
    # taken once, and every span was then lost: the exporter's deadline was already past (an
    # OTLP timeout of nan, inf or -5), or no export could finish (the batch export timeout)
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_TIMEOUT": "nan"},
     "OTEL_EXPORTER_OTLP_TIMEOUT='nan' must be a finite number of seconds above 0"),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_TIMEOUT": "inf"},
     "OTEL_EXPORTER_OTLP_TIMEOUT='inf' must be a finite number of seconds above 0"),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_TIMEOUT": "-1"},
     "OTEL_EXPORTER_OTLP_TIMEOUT='-1' must be a finite number of seconds above 0"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317",
      "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "-5"},
     "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT='-5' must be a finite number of seconds above 0"),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "0"},
     "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT='0' must be a finite number of seconds above 0"),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "-inf"},
     "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT='-inf' must be a finite number of seconds above 0"),
    ({"OTEL_TRACES_EXPORTER": "console", "OTEL_BSP_EXPORT_TIMEOUT": "0"},
     "OTEL_BSP_EXPORT_TIMEOUT=0 must be positive"),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_BSP_EXPORT_TIMEOUT": "-1"},
     "OTEL_BSP_EXPORT_TIMEOUT=-1 must be positive"),
    # gRPC takes its timers in whole milliseconds: below 1 ms one was 0 ms, and calls failed
    # DEADLINE_EXCEEDED (once gRPC's core aborted)
    ({"CE_MAX_CONNECTION_AGE_SECONDS": "0.0004"},
     "CE_MAX_CONNECTION_AGE_SECONDS='0.0004' is below 0.001 (seconds): gRPC takes it in whole "
     "milliseconds, and it would be 0 ms"),
    ({"CE_KEEPALIVE_TIME_SECONDS": "0.0009999"},
     "CE_KEEPALIVE_TIME_SECONDS='0.0009999' is below 0.001 (seconds)"),
    ({"CE_KEEPALIVE_TIMEOUT_SECONDS": "1e-9"},
     "CE_KEEPALIVE_TIMEOUT_SECONDS='1e-9' is below 0.001 (seconds)"),
    ({"CE_GRACE_SECONDS": "0.0001"}, "CE_GRACE_SECONDS='0.0001' is below 0.001 (seconds)"),
    # as OpenTelemetry reads them: an empty name is looked up (and fails on every call's
    # context), "none" is the whole list only, and a signal's own protocol comes first
    ({"OTEL_PROPAGATORS": "tracecontext,"},
     "OTEL_PROPAGATORS='tracecontext,': an empty name"),
    ({"OTEL_TRACES_EXPORTER": "console", "OTEL_METRICS_EXPORTER": "otlp,none"},
     "OTEL_METRICS_EXPORTER='otlp,none': no metrics exporter 'none' is installed"),
    ({"OTEL_TRACES_EXPORTER": "console", "OTEL_METRICS_EXPORTER": "otlp",
      "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "http/json"},
     "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL='http/json' is not an OTLP protocol"),
])
def test_a_bad_value_names_the_variable_and_the_value(env: dict[str, str], message: str):
    with pytest.raises(ConfigError) as caught:
        Config.from_env(env)
    assert message in str(caught.value)


@pytest.mark.parametrize("grpc, metrics", [("127.0.0.1:7000", "127.0.0.1:7001"),
                                           ("127.0.0.1:7000", "10.0.0.1:7000"),
                                           ("127.0.0.1:7000", ""),
                                           ("127.0.0.1:0", "127.0.0.1:0")])
def test_metrics_on_another_port_or_host_or_off_is_fine(grpc: str, metrics: str):
    config = Config.from_env({"CE_GRPC_ADDR": grpc, "CE_METRICS_ADDR": metrics})
    assert (config.grpc_addr, config.metrics_addr) == (grpc, metrics)


@pytest.mark.parametrize("env", [
    {"OTEL_TRACES_EXPORTER": "console"},
    {"OTEL_TRACES_EXPORTER": "otlp,console", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"},
    {"OTEL_TRACES_EXPORTER": "otlp_proto_grpc"},
    {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"},
    {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_PROTOCOL": "unused-when-off"},
    {"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "bogus"},
    # the SDK reads the traces protocol before the general one, and only for otlp: a general
    # protocol meant for other signals is not this one's to refuse
    {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317",
     "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"},
    {"OTEL_TRACES_EXPORTER": "console", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"},
    {"OTEL_PROPAGATORS": "tracecontext,baggage"}, {"OTEL_PROPAGATORS": "none"},
    {"OTEL_TRACES_EXPORTER": "console", "OTEL_METRICS_EXPORTER": "none",
     "OTEL_LOGS_EXPORTER": "console", "OTEL_EXPORTER_OTLP_TIMEOUT": "2.5",
     "OTEL_BSP_SCHEDULE_DELAY": "500"},
    # not asked for traces: the exporters' settings are not read
    {"OTEL_METRICS_EXPORTER": "prometheus", "OTEL_EXPORTER_OTLP_TIMEOUT": "abc"},
    # what OpenTelemetry takes: "none" in any case, up to the first "none", numbers int()
    # and float() read
    {"OTEL_PROPAGATORS": "none,b3"}, {"OTEL_PROPAGATORS": " tracecontext , baggage "},
    {"OTEL_TRACES_EXPORTER": "console", "OTEL_METRICS_EXPORTER": "NONE",
     "OTEL_LOGS_EXPORTER": "None", "OTEL_BSP_EXPORT_TIMEOUT": "1",
     "OTEL_BSP_SCHEDULE_DELAY": "+500", "OTEL_EXPORTER_OTLP_TIMEOUT": " 1e-3 ",
     "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "0.5"}])
def test_what_the_sdk_takes_is_taken(env: dict[str, str]):
    Config.from_env(env)


@pytest.mark.parametrize("metrics", ["0.0.0.0:9464", "[::]:9464", "10.0.0.1:9464",
                                     "metrics.example.com:9464", "128.0.0.1:9464"])
def test_dev_mode_refuses_metrics_other_machines_can_reach(metrics: str):
    """``serve --dev`` says "loopback binds only", yet took CE_METRICS_ADDR=0.0.0.0:port and
    served the metrics on every interface."""
    config = Config.from_env({"CE_DEV_MODE": "1", "CE_METRICS_ADDR": metrics})
    with pytest.raises(ConfigError) as caught:
        config.validate_serving()
    assert str(caught.value) == (
        f"dev mode (--dev / CE_DEV_MODE=1) binds only loopback addresses, and the metrics "
        f"address (--metrics-addr / CE_METRICS_ADDR) {metrics!r} is not one: write "
        f"127.0.0.1:<port>, or an empty one for no metrics")
    # with credentials it may be any address
    Config.from_env({"CE_METRICS_ADDR": metrics, "CE_AUTH_DB_TOKENS": "1"}).validate_serving()


@pytest.mark.parametrize("metrics", ["127.0.0.1:9464", "127.8.9.10:0", "[::1]:9464",
                                     "localhost:9464", ""])
def test_dev_mode_takes_metrics_on_loopback_or_off(metrics: str):
    Config.from_env({"CE_DEV_MODE": "1", "CE_METRICS_ADDR": metrics}).validate_serving()


GRPC_TIMERS = ("CE_KEEPALIVE_TIME_SECONDS", "CE_KEEPALIVE_TIMEOUT_SECONDS",
               "CE_MAX_CONNECTION_AGE_SECONDS", "CE_GRACE_SECONDS")


@settings(max_examples=200, deadline=None)
@given(variable=st.sampled_from(GRPC_TIMERS),
       seconds=st.one_of(st.floats(min_value=0, max_value=0.01, exclude_min=True),
                         st.floats(min_value=0.01, max_value=2_000_000),
                         st.sampled_from([0.001, 0.0009999999999999998, 5e-324])))
def test_a_grpc_timer_taken_is_at_least_one_whole_millisecond(variable: str, seconds: float):
    """Oracle: the decimal value of what was written, in exact arithmetic: a value taken is
    one gRPC receives as 1 ms or more; one refused is below 1 ms."""
    from decimal import Decimal

    from context_engine.api.server import server_options

    written = repr(seconds)
    try:
        config = Config.from_env({variable: written})
    except ConfigError as exc:
        assert Decimal(written) * 1000 < 1, exc
        assert "is below 0.001 (seconds)" in str(exc)
        return
    assert Decimal(written) * 1000 >= 1
    option = {"CE_KEEPALIVE_TIME_SECONDS": "grpc.keepalive_time_ms",
              "CE_KEEPALIVE_TIMEOUT_SECONDS": "grpc.keepalive_timeout_ms",
              "CE_MAX_CONNECTION_AGE_SECONDS": "grpc.max_connection_age_ms",
              "CE_GRACE_SECONDS": "grpc.max_connection_age_grace_ms"}[variable]
    assert dict(server_options(config))[option] >= 1


@pytest.mark.parametrize(("directory", "said"), [
    ("/no/such/migrations", "CE_MIGRATIONS_DIR='/no/such/migrations' is not a directory"),
    ("/", "CE_MIGRATIONS_DIR='/' holds no migration (*.sql)")])
def test_serve_and_migrate_need_the_migrations_and_nothing_else_does(directory: str, said: str):
    """A CE_MIGRATIONS_DIR holding no migration let migrate report success on an empty
    database. Only serve and migrate read it: a package installed without the checkout's
    migrations still probes health, inspects and prints its configuration."""
    config = Config.from_env({"CE_MIGRATIONS_DIR": directory, "CE_DEV_MODE": "1"})
    for check in (config.validate_migrations, config.validate_serving):
        with pytest.raises(ConfigError) as caught:
            check()
        assert said in str(caught.value)
    Config.from_env({"CE_MIGRATIONS_DIR": directory}).validate()


@pytest.mark.parametrize(("files", "said"), [
    ({"0001_a.sql": "", "0008_Add-Index.sql": ""},
     "migration file 0008_Add-Index.sql is not named NNNN_description.sql"),
    ({"0001_a.sql": "", "0007_b.sql": "", "0007_c.sql": ""}, "duplicate migration numbers")])
def test_a_misnamed_or_twice_numbered_migration_is_a_configuration_error(
        tmp_path: Path, files: dict[str, str], said: str):
    """Both ended serve, migrate and migrate --status in a traceback."""
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    config = Config.from_env({"CE_MIGRATIONS_DIR": str(tmp_path), "CE_DEV_MODE": "1"})
    with pytest.raises(ConfigError) as caught:
        config.validate_migrations()
    assert f"CE_MIGRATIONS_DIR={str(tmp_path)!r}: " in str(caught.value)
    assert said in str(caught.value)


def test_a_data_dir_that_is_a_file_is_a_configuration_error(tmp_path: Path):
    """The embedded PostgreSQL's mkdir ended serve and migrate in NotADirectoryError."""
    data = tmp_path / "data"
    data.write_text("")
    with pytest.raises(ConfigError, match=r"CE_DATA_DIR=.* is not a directory"):
        Config.from_env({"CE_DATA_DIR": str(data), "CE_DEV_MODE": "1"}).validate()
    # a database URL of its own does not use it
    Config.from_env({"CE_DATA_DIR": str(data), "CE_DEV_MODE": "1",
                     "DATABASE_URL": "postgresql://u@127.0.0.1:5432/db"}).validate()


@pytest.mark.parametrize(("env", "said"), [
    ({"CE_GRPC_ADDR": "127.0.0.1:99999", "CE_WORKERS": "x"},
     ["CE_WORKERS='x' is not an integer", "CE_GRPC_ADDR='127.0.0.1:99999': port 99999 is "
      "above 65535"]),
    ({"CE_MODEL_CATALOG": "/nonexistent", "CE_ASSETS_DIR": "/nonexistent",
      "CE_GRACE_SECONDS": "-1"},
     ["CE_GRACE_SECONDS='-1' must be positive",
      "CE_MODEL_CATALOG='/nonexistent' is not a readable file",
      "CE_ASSETS_DIR='/nonexistent' is not a directory"])])
def test_a_bad_variable_hides_no_other_problem(env: dict[str, str], said: list[str]):
    """pydantic checks the settings together only once each is valid: a bad variable hid a
    port over 65535 and files that do not exist, though the README says every bad variable
    is named in one error."""
    with pytest.raises(ConfigError) as caught:
        Config.from_env(env)
    assert str(caught.value).split("; ") == said


def test_a_problem_naming_a_bad_variable_is_left_to_that_variables_own_error():
    """A bad CE_GRPC_ADDR is one error, not also a port check of its default."""
    with pytest.raises(ConfigError) as caught:
        Config.from_env({"CE_GRPC_ADDR": "nowhere", "CE_METRICS_ADDR": "127.0.0.1:50051"})
    assert str(caught.value) == "CE_GRPC_ADDR='nowhere' is not host:port"


def _tls(tmp_path: Path, **files: str | Path) -> Config:
    env = {"CE_AUTH_TOKENS_FILE": str(tmp_path / "tokens.json")}
    (tmp_path / "tokens.json").write_text("[]")
    names = {"cert": "CE_TLS_CERT_FILE", "key": "CE_TLS_KEY_FILE", "ca": "CE_TLS_CLIENT_CA_FILE"}
    for what, value in files.items():
        path = value if isinstance(value, Path) else tmp_path / f"{what}.pem"
        if not isinstance(value, Path):
            path.write_text(value)
        env[names[what]] = str(path)
    return Config.from_env(env)


def test_tls_files_that_do_not_load_stop_serve_before_it_binds(tmp_path: Path):
    """A certificate and key that do not load were reported as a failure to bind the address
    (after the migrations ran); an unreadable one was a traceback."""
    from tests.support.certs import make_pki

    pki = make_pki(tmp_path, ca_name="config-test-ca", server_alt_names="IP:127.0.0.1")
    _tls(tmp_path, cert=pki.server_cert, key=pki.server_key, ca=pki.ca).validate_serving()
    cases = [
        ({"cert": "junk", "key": pki.server_key}, "are not a PEM certificate and its"),
        ({"cert": "", "key": pki.server_key}, "are not a PEM certificate and its"),
        ({"cert": pki.server_cert, "key": pki.client_key}, "are not a PEM certificate and its"),
        ({"cert": pki.server_cert, "key": pki.server_key, "ca": "junk"},
         "holds no PEM certificate"),
        ({"cert": tmp_path, "key": pki.server_key}, "is not a readable file"),
        # a file that exists and cannot be read (a secret mounted with a mode the service's
        # user lacks; here, a file whose every read fails)
        ({"cert": Path("/proc/self/mem"), "key": pki.server_key}, "cannot be read"),
    ]
    for files, said in cases:
        with pytest.raises(ConfigError) as caught:
            _tls(tmp_path, **files).validate_serving()
        assert said in str(caught.value), (files, str(caught.value))


def test_every_bad_variable_is_reported_at_once():
    with pytest.raises(ConfigError) as caught:
        Config.from_env({"CE_WORKERS": "x", "CE_GRACE_SECONDS": "-1", "CE_DEV_MODE": "2"})
    assert str(caught.value) == ("CE_WORKERS='x' is not an integer; "
                                 "CE_GRACE_SECONDS='-1' must be positive; "
                                 "CE_DEV_MODE='2' is not a boolean (1/0, true/false)")


def test_trace_export_follows_the_standard_otel_variables():
    assert not Config.from_env({}).trace_export
    config = Config.from_env({"OTEL_TRACES_EXPORTER": "otlp"})
    assert config.trace_export and "trace_export" in config.model_fields_set
    assert not Config.from_env({"OTEL_TRACES_EXPORTER": "otlp",
                                "OTEL_SDK_DISABLED": "true"}).trace_export


# ---------------------------------------------------------------------------- secrets


def secret_env(**more: str) -> dict[str, str]:
    return {"CE_SUMMARIZER_API_KEY": SECRET,
            "DATABASE_URL": f"postgresql://ce:{DSN_PASSWORD}@db.internal:5432/ce", **more}


def test_secrets_are_the_api_key_and_the_dsn():
    assert {"summarizer_api_key", "database_url"} <= SECRETS


def test_a_secret_is_never_in_repr_or_str():
    config = Config.from_env(secret_env())
    for text in (repr(config), str(config), f"{config}", repr([config])):
        assert SECRET not in text and DSN_PASSWORD not in text


@pytest.mark.parametrize("other", [
    {"CE_WORKERS": "lots"},  # a field of its own fails
    {"CE_SUMMARIZER_URL": "https://llm.internal/v1"},  # a rule across fields fails
    {"CE_TLS_CERT_FILE": "/missing.pem"},
])
def test_a_secret_is_never_in_the_error_of_another_variable(other: dict[str, str]):
    with pytest.raises(ConfigError) as caught:
        Config.from_env(secret_env(**other))
    shown = [str(caught.value), repr(caught.value), str(caught.value.__context__),
             repr(caught.value.__context__)]
    for text in shown:
        assert SECRET not in text and DSN_PASSWORD not in text


def test_a_secret_is_never_in_a_direct_validation_error():
    with pytest.raises(ValidationError) as caught:
        Config(summarizer_api_key=SECRET, workers=-1)
    assert SECRET not in str(caught.value) and SECRET not in repr(caught.value)
    with pytest.raises(ValidationError) as caught:
        Config(summarizer_api_key=SECRET, summarizer_url="https://x")
    assert SECRET not in str(caught.value)


def test_credentials_in_the_summarizers_url_are_never_shown():
    """The summarizer's URL was printed whole by `context-engine config`, a password in its
    user info included."""
    config = Config.from_env({"CE_SUMMARIZER_URL": "https://svc:hunter2@llm.internal/v1",
                              "CE_SUMMARIZER_MODEL": "m"})
    shown = {s.name: s.value for s in effective(config)}
    assert shown["summarizer_url"] == f"https://svc:{MASK}@llm.internal/v1"
    assert config.summarizer_url == "https://svc:hunter2@llm.internal/v1"  # used as given


def test_the_effective_settings_redact_secrets():
    shown = {s.name: s for s in effective(Config.from_env(secret_env()))}
    assert list(shown) == list(Config.model_fields)
    assert shown["summarizer_api_key"].value == MASK
    assert shown["summarizer_api_key"].source == "environment"
    assert shown["database_url"].value == f"postgresql://ce:{MASK}@db.internal:5432/ce"
    assert shown["grpc_addr"].value == "127.0.0.1:50051"
    assert shown["grpc_addr"].source == "default"
    assert shown["trace_export"].variable == "OTEL_*"
    unset = {s.name: s for s in effective(Config.from_env({}))}
    assert unset["summarizer_api_key"].value == "" and unset["database_url"].value is None


@pytest.mark.parametrize(("url", "shown"), [
    ("postgresql://u:pw@h:5432/db", f"postgresql://u:{MASK}@h:5432/db"),
    ("postgresql://u@h/db", "postgresql://u@h/db"),
    ("postgresql://h/db?user=u&password=pw&sslmode=require",
     f"postgresql://h/db?user=u&password={MASK}&sslmode=require"),
    ("host=h dbname=db password='p w' user=u", f"host=h dbname=db password={MASK} user=u"),
    ("postgresql://u:p%40ss@h/db", f"postgresql://u:{MASK}@h/db"),
    # unescaped, each of these ends urlsplit's netloc early: the password was shown whole
    ("postgresql://u:S3CRET#b@h:5432/db", f"postgresql://u:{MASK}@h:5432/db"),
    ("postgresql://u:S3CRET?c@h/db", f"postgresql://u:{MASK}@h/db"),
    ("postgresql://u:S3/CRET@h/db?sslmode=require", f"postgresql://u:{MASK}@h/db?sslmode=require"),
    ("postgresql://u:pw@[::1]:5432/db", f"postgresql://u:{MASK}@[::1]:5432/db"),
    # an "@" a driver splits the user info at (asyncpg: the first)
    ("postgresql://u:s3cr@t:99x@h:1/db", f"postgresql://u:{MASK}@h:1/db"),
    # an "@" in a parameter is not the user's: the host shown is the URL's
    ("postgresql://u:p@h/db?application_name=a@b",
     f"postgresql://u:{MASK}@h/db?application_name=a@b"),
    ("postgresql://u@h:5432/db?x=1:2@3", "postgresql://u@h:5432/db?x=1:2@3"),
    # no scheme (a summarizer URL written without one), and an API's key as a parameter
    ("user:secret@api.example.com/v1", f"user:{MASK}@api.example.com/v1"),
    ("//user:secret@h/v1", f"//user:{MASK}@h/v1"),
    ("https://h/v1?api_key=secret&x=1", f"https://h/v1?api_key={MASK}&x=1"),
])
def test_a_dsn_password_is_masked(url: str, shown: str):
    assert redact_url(url) == shown


# ---------------------------------------------------------------------------- derived copies


def test_replace_derives_a_validated_copy():
    config = Config.from_env(secret_env())
    copy = config.replace(workers=4, dev_mode=True)
    assert (copy.workers, copy.dev_mode, copy.summarizer_api_key) == (4, True, SECRET)
    assert config.workers == 0  # frozen: the original is untouched
    with pytest.raises(ValidationError):
        config.replace(workers=-1)
    with pytest.raises(TypeError, match="no settings"):
        config.replace(worker=4)
    with pytest.raises(ValidationError):
        config.workers = 3  # type: ignore[misc]


def test_model_copy_then_validate_checks_the_overrides():
    copy = Config().model_copy(update={"grpc_addr": "nowhere"})
    with pytest.raises(ConfigError, match="CE_GRPC_ADDR='nowhere' is not host:port"):
        copy.validate()
