"""The command line beyond serving: ``--version`` against values read independently of the code
that prints them, ``config`` (every setting, where it came from, secrets redacted), ``migrate
--status`` before any database exists, and one name for the address everywhere."""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

import grpc_tools
import pytest
from context_engine.cli import main, parser
from context_engine.config import MASK, Config, variables
from google.protobuf import descriptor_pb2
from grpc_tools import protoc

REPO = Path(__file__).resolve().parents[2]
PROTO = REPO / "proto" / "context_engine" / "v1" / "context_engine.proto"
SECRET = "sk-live-0123456789abcdef-do-not-print"


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """A process environment without any variable the configuration reads."""
    for name in list(os.environ):
        if name.startswith(("CE_", "OTEL_")) or name == "DATABASE_URL":
            monkeypatch.delenv(name)
    return monkeypatch


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse: --version, --help and usage errors
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


# ---------------------------------------------------------------------------- --version


def compiled_descriptor_sha256() -> str:
    """The contract compiled from the .proto file here, as the generated code embeds it (the
    Python generator leaves out json_name)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.pb"
        include = Path(grpc_tools.__file__).parent / "_proto"
        assert protoc.main(["protoc", f"-I{REPO / 'proto'}", f"-I{include}",
                            f"--descriptor_set_out={out}", str(PROTO)]) == 0
        files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
    (file,) = [f for f in files if f.name == "context_engine/v1/context_engine.proto"]

    def strip(messages: object) -> None:
        for message in messages:  # type: ignore[attr-defined]
            for field in message.field:
                field.ClearField("json_name")
            strip(message.nested_type)
    strip(file.message_type)
    return hashlib.sha256(file.SerializeToString()).hexdigest()


def version_lines(out: str) -> dict[str, str]:
    return dict(line.split(None, 1) for line in out.splitlines())


def test_version_names_the_service_contract_policy_and_builder(env, capsys):
    code, out, err = run(capsys, "--version")
    assert code == 0 and not err
    lines = version_lines(out)
    assert list(lines) == ["context-engine", "contract", "policy", "builder"]
    assert lines["context-engine"] == version("context-engine")
    package = re.search(r"^package ([\w.]+);", PROTO.read_text(), re.M).group(1)
    assert lines["contract"] == f"{package} sha256:{compiled_descriptor_sha256()}"
    manifest = REPO / "service" / "context_engine" / "assets" / "manifest.json"
    assert lines["policy"] == json.loads(manifest.read_text())["version"]
    assert lines["policy"].startswith("platform-policy@")
    plan = (REPO / "service" / "context_engine" / "domain" / "plan.py").read_text()
    assert lines["builder"] == re.search(r'^BUILDER_VERSION = "([^"]+)"', plan, re.M).group(1)


def test_version_reports_the_policy_of_ce_assets_dir(env, capsys, tmp_path: Path):
    (tmp_path / "manifest.json").write_text('{"version": "acme-policy@7"}')
    (tmp_path / "policy.md").write_text("policy")
    (tmp_path / "framing.md").write_text("framing")
    env.setenv("CE_ASSETS_DIR", str(tmp_path))
    code, out, _ = run(capsys, "--version")
    assert code == 0
    assert version_lines(out)["policy"] == f"acme-policy@7 (CE_ASSETS_DIR={tmp_path})"


# ---------------------------------------------------------------------------- config


def test_config_prints_every_setting_and_where_it_came_from(env, capsys, tmp_path: Path):
    env.setenv("CE_WORKERS", "3")
    env.setenv("CE_METRICS_ADDR", "")
    env.setenv("CE_SUMMARIZER_API_KEY", SECRET)
    env.setenv("DATABASE_URL", "postgresql://ce:dsn-password@db:5432/ce")
    code, out, err = run(capsys, "config", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert list(doc) == list(Config.model_fields)
    assert doc["workers"] == {"value": 3, "variable": "CE_WORKERS", "source": "environment"}
    assert doc["metrics_addr"] == {"value": "", "variable": "CE_METRICS_ADDR",
                                   "source": "environment"}
    assert doc["grpc_addr"] == {"value": "127.0.0.1:50051", "variable": "CE_GRPC_ADDR",
                                "source": "default"}
    assert doc["summarizer_api_key"]["value"] == MASK
    assert doc["database_url"]["value"] == f"postgresql://ce:{MASK}@db:5432/ce"
    assert doc["tls_cert_file"]["value"] is None
    assert {name: d["variable"] for name, d in doc.items() if name != "trace_export"} == \
        variables()

    code, text, err = run(capsys, "config")
    assert code == 0, err
    rows = [line.split() for line in text.splitlines()]
    assert rows[0] == ["setting", "variable", "source", "value"]
    by_name = {r[0]: r for r in rows[1:]}
    assert list(by_name) == list(Config.model_fields)
    assert by_name["workers"] == ["workers", "CE_WORKERS", "environment", "3"]
    assert by_name["metrics_addr"] == ["metrics_addr", "CE_METRICS_ADDR", "environment"]
    assert by_name["summarizer_api_key"][3] == MASK
    assert by_name["dev_mode"][2:] == ["default", "false"]
    for shown in (out, text):
        assert SECRET not in shown and "dsn-password" not in shown


def test_config_shows_an_unset_secret_as_empty(env, capsys):
    code, out, _ = run(capsys, "config", "--json")
    assert code == 0
    assert json.loads(out)["summarizer_api_key"] == {
        "value": "", "variable": "CE_SUMMARIZER_API_KEY", "source": "default"}


def test_config_exits_2_on_a_bad_environment_without_showing_secrets(env, capsys):
    env.setenv("CE_SUMMARIZER_API_KEY", SECRET)
    env.setenv("CE_WORKERS", "all of them")
    env.setenv("CE_SUMMARIZER_URL", "https://llm.internal/v1")
    code, out, err = run(capsys, "config")
    assert code == 2 and not out
    # every problem in one error: the variable's own, then what the settings together lack
    assert err == ("context-engine: configuration error: CE_WORKERS='all of them' is not an "
                   "integer; CE_SUMMARIZER_URL is set without CE_SUMMARIZER_MODEL\n")
    assert SECRET not in err
    env.delenv("CE_WORKERS")
    code, out, err = run(capsys, "config", "--json")
    assert code == 2 and not out
    assert "CE_SUMMARIZER_URL is set without CE_SUMMARIZER_MODEL" in err
    assert SECRET not in err


def test_a_misspelt_variable_is_said_not_ignored_without_a_word(env, capsys):
    """CE_DRAIN_SECOND (for CE_DRAIN_SECONDS) was ignored: the default served, silently."""
    env.setenv("CE_DRAIN_SECOND", "30")
    env.setenv("CE_TOKEN", "read by the demo and the examples, not a setting")
    env.setenv("CE_HEALTH_TLS_SERVER_NAME", "read by the health probe")
    env.setenv("CE_WORKER_SUPERVISOR_PID", "1")  # set by a supervisor for its workers
    for tooling in ("CE_TEST_DATABASE_URL", "CE_TEST_PGBOUNCER", "CE_FUZZ_SEED",
                    "CE_RESULT_FILE"):  # the test suite's, which passes them to every server
        env.setenv(tooling, "x")
    code, out, err = run(capsys, "config")
    assert code == 0 and "drain_seconds" in out
    assert err == ("context-engine: warning: CE_DRAIN_SECOND is not a setting and is ignored "
                   "(did you mean CE_DRAIN_SECONDS?)\n")


def test_the_dev_mode_and_misspelt_settings_are_said_whatever_the_log_level(tmp_path):
    """At CE_LOG_LEVEL=ERROR a dev-mode server said nothing: every call taken without
    credentials, and a misspelt setting dropped, both unsaid (the lines were warnings)."""
    import subprocess

    env = {**{k: v for k, v in os.environ.items() if not k.startswith("CE_")},
           "DATABASE_URL": "postgresql://nobody@127.0.0.1:1/none", "CE_LOG_LEVEL": "ERROR",
           "CE_GRACE_SECOND": "30", "CE_WORKERS": "1"}
    done = subprocess.run([sys.executable, "-m", "context_engine", "serve", "--dev",
                           "--grpc-addr", "127.0.0.1:0", "--metrics-addr", ""],
                          capture_output=True, text=True, timeout=60, check=False, env=env)
    assert done.returncode == 1, done.stderr  # the database is not there
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(r["event"], r["level"]) for r in lines[:2]] == [
        ("dev_mode", "warning"), ("unknown_variable", "warning")], done.stdout
    assert "did you mean CE_GRACE_SECONDS?" in lines[1]["problem"]
    assert not [r for r in lines if r["level"] in ("info", "debug")]  # the level still holds


def test_a_tokens_files_warning_is_no_bare_word_on_stderr(tmp_path):
    """The tokens file is checked before logging is set up: its warning (a tenant no request
    can name) reached stderr as the bare event name, beside the JSON lines of stdout."""
    import subprocess

    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps([{"sha256": "a" * 64, "tenant_id": "ac\u200bme",
                                   "rpcs": ["*"]}]), encoding="utf-8")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("CE_")},
           "DATABASE_URL": "postgresql://nobody@127.0.0.1:1/none", "CE_WORKERS": "1",
           "CE_AUTH_TOKENS_FILE": str(tokens)}
    done = subprocess.run([sys.executable, "-m", "context_engine", "serve",
                           "--grpc-addr", "127.0.0.1:0", "--metrics-addr", ""],
                          capture_output=True, text=True, timeout=60, check=False, env=env)
    assert done.returncode == 1, done.stderr  # the database is not there
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("context-engine: cannot reach the database"), line


def test_a_database_url_of_another_scheme_is_a_configuration_error(env, capsys):
    """asyncpg takes postgresql:// and postgres:// only; another scheme failed at connect
    time (exit 1, after the configuration was accepted)."""
    env.setenv("DATABASE_URL", f"mysql://ce:{SECRET}@127.0.0.1:3306/ce")
    code, _, err = run(capsys, "migrate")
    assert code == 2 and SECRET not in err
    assert err == (f"context-engine: configuration error: DATABASE_URL='{MASK}' is not a "
                   "PostgreSQL URL: postgresql://user:password@host:port/database\n")


@pytest.mark.parametrize("command", [["inspect", "--session", "s"], ["demo"],
                                     ["purge-tenant"], ["hash-token"]])
def test_every_command_takes_the_tenant_as_tenant_id_and_as_tenant(command):
    """inspect and demo took --tenant where purge-tenant and hash-token took --tenant-id, and
    each refused the other's spelling."""
    dest = "tenant" if command[0] in ("inspect", "demo") else "tenant_id"
    for flag in ("--tenant", "--tenant-id"):
        args = parser().parse_args([*command, flag, "acme"])
        assert getattr(args, dest) == "acme"


# ---------------------------------------------------------------------------- migrate --status


def test_migrate_status_before_any_database_lists_every_migration_pending(env, capsys,
                                                                          tmp_path: Path):
    env.setenv("CE_DATA_DIR", str(tmp_path))  # no embedded database here, and none is made
    code, out, err = run(capsys, "migrate", "--status")
    assert code == 0, err
    names = sorted(p.stem for p in (REPO / "migrations").glob("*.sql"))
    table = out.split("\n\n")[0].splitlines()
    assert table[0].split() == ["version", "name", "state", "applied_at", "checksum"]
    assert [f"{r.split()[0]}_{r.split()[1]}" for r in table[1:]] == names
    assert all(r.split()[2:] == ["pending", "-", "-"] for r in table[1:])
    assert f"0 applied, {len(names)} pending" in out
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------- addresses


def test_health_takes_the_address_as_grpc_addr(env, capsys):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        code, out, err = run(capsys, "health", "--grpc-addr", f"0.0.0.0:{port}",
                             "--timeout", "1")
    assert code == 1 and not out
    assert err.startswith(f"context-engine health: 127.0.0.1:{port}: "), err
    code, _, err = run(capsys, "health", "--addr", f"127.0.0.1:{port}")
    assert code == 2 and "unrecognized arguments: --addr" in err
    for addr in ("no-port", "127.0.0.1:5005\u00b2", "[127.0.0.1]:5005"):  # no traceback
        code, _, err = run(capsys, "health", "--grpc-addr", addr)
        assert code == 2 and ("is not host:port" in err or "brackets" in err), err


@pytest.mark.parametrize("timeout", ["0", "-1", "nan", "inf", "86401", "soon"])
def test_a_probe_timeout_no_probe_could_meet_is_a_usage_error(env, capsys, timeout):
    """Each of these failed the probe as DEADLINE_EXCEEDED (exit 1: "not serving") without
    waiting at all, marking a healthy server dead; it is the probe that is wrong (exit 2)."""
    code, out, err = run(capsys, "health", "--grpc-addr", "127.0.0.1:1", f"--timeout={timeout}")
    assert code == 2 and not out and "argument --timeout" in err, err


def test_config_into_a_reader_that_stops_early_is_not_an_error():
    """`context-engine config | head -1`: no traceback, exit 0. The reader is gone before the
    command writes (a pipe whose read end is closed), so the write fails every time."""
    import subprocess
    import sys

    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "context_engine", "config"], stdout=write_end,
            stderr=subprocess.PIPE, text=True, timeout=60, check=False,
            env={k: v for k, v in os.environ.items() if not k.startswith("CE_")})
    finally:
        os.close(write_end)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr


def test_a_propagator_no_package_provides_is_one_configuration_error():
    """OTEL_PROPAGATORS=b3 (common cluster-wide) with no b3 package: OpenTelemetry's
    propagation module raised as it loaded, and every command, `--version` included, died
    with a traceback, tracing off or on. Now the commands that read no configuration run, and
    the others refuse it in one line."""
    import subprocess
    import sys

    env = {**{k: v for k, v in os.environ.items()
              if not k.startswith(("CE_", "OTEL_"))}, "OTEL_PROPAGATORS": "tracecontext,b3"}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "context_engine", *args],
                              capture_output=True, text=True, timeout=60, check=False, env=env)

    version = run("--version")
    assert version.returncode == 0 and "Traceback" not in version.stderr, version.stderr
    config = run("config")
    assert config.returncode == 2 and "Traceback" not in config.stderr
    assert config.stderr.strip().endswith(
        "OTEL_PROPAGATORS='tracecontext,b3': no propagator 'b3' is installed "
        "(baggage, tracecontext, none)")


@pytest.mark.parametrize("args", [["hash-token", "--tenant-id", "caf\udce9"],
                                  ["demo", "--session", "caf\udce9"],
                                  ["demo", "--tenant", " padded"],
                                  ["inspect", "--tenant", "caf\udce9", "--session", "s"],
                                  ["inspect", "--tenant", "t", "--session", "a\udcff"]])
def test_an_id_no_request_can_carry_is_refused_before_anything_is_made(args: list[str]):
    """`hash-token` minted an entry for a tenant id holding bytes that are no UTF-8 (a lone
    surrogate once decoded), which no request can ever carry; `demo` died with a traceback
    encoding one. Both refuse it in one line, exit 2, nothing printed to standard output."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "context_engine",
                           *(a.encode("utf-8", "surrogateescape") for a in args)],
                          capture_output=True, timeout=60, check=False,
                          env={k: v for k, v in os.environ.items() if not k.startswith("CE_")})
    assert done.returncode == 2 and done.stdout == b"", done
    assert b"Traceback" not in done.stderr
    assert done.stderr.count(b"\n") == 1 and (b"must be text in UTF-8" in done.stderr
                                              or b"surrounding white space" in done.stderr)


@pytest.mark.parametrize("command", [["migrate", "--status"], ["migrate"],
                                     ["inspect", "--tenant", "t", "--session", "s"],
                                     ["purge-tenant", "--tenant-id", "t", "--yes"]])
def test_an_embedded_database_that_cannot_start_is_one_line(command: list[str],
                                                            tmp_path: Path):
    """A data directory whose cluster cannot start (here a PG_VERSION and nothing else, as
    another PostgreSQL's or a broken one) printed pg_ctl's CalledProcessError traceback from
    every command, after pgserver's log of the command and the server's whole log; one line
    now, naming the directory and its log, exit 1."""
    import subprocess
    import sys

    (tmp_path / "pg").mkdir()
    (tmp_path / "pg" / "PG_VERSION").write_text("junk\n")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("CE_")},
           "DATABASE_URL": "", "CE_DATA_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "context_engine", *command],
                          capture_output=True, text=True, timeout=120, check=False, env=env)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    # one line: pgserver's own log of the command and of the server's log is not printed
    (last,) = done.stderr.strip().splitlines()
    assert last.startswith(f"context-engine: cannot start the embedded PostgreSQL under "
                           f"{tmp_path / 'pg'}: CalledProcessError: pg_ctl start exited 1 "
                           f"(its log is in {tmp_path / 'pg' / 'log'}"), last


@pytest.mark.parametrize(("variable", "content", "said"), [
    ("CE_MODEL_CATALOG", "{bad", "cannot be read: JSONDecodeError"),
    ("CE_MODEL_CATALOG", "[]", "cannot be read: TypeError"),
    ("CE_MODEL_CATALOG", '{"tokens": 5}', "cannot be read: KeyError: 'models'"),
    ("CE_MODEL_CATALOG", "[" * 100_000 + "]" * 100_000, "cannot be read: RecursionError"),
    ("CE_ASSETS_DIR", None, "cannot be read: FileNotFoundError")])
def test_a_catalog_or_assets_serve_cannot_read_is_a_configuration_error(
        variable: str, content: str | None, said: str, tmp_path: Path):
    """A model catalog that is no catalog, or an assets directory without its files, passed
    the checks (a file, a directory) and ended serve in a traceback once the database was
    migrated; it is a configuration error now, exit 2, before anything starts (the database
    named here does not exist: it is never reached)."""
    path = tmp_path / "models.json"
    if content is None:
        path = tmp_path / "assets"
        path.mkdir()
    else:
        path.write_text(content)
    line = _serve_refused(variable, path)
    assert line.startswith(f"context-engine: configuration error: {variable}={str(path)!r} "
                           f"{said}"), line


def _serve_refused(variable: str, path: Path) -> str:
    """``serve --dev`` with ``variable`` naming ``path`` (and a database that is never
    reached): exit 2, no traceback, and the one line it says."""
    import subprocess

    env = {**{k: v for k, v in os.environ.items() if not k.startswith("CE_")},
           "DATABASE_URL": "postgresql://nobody@127.0.0.1:1/none", variable: str(path)}
    done = subprocess.run([sys.executable, "-m", "context_engine", "serve", "--dev"],
                          capture_output=True, text=True, timeout=60, check=False, env=env)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    (line,) = done.stderr.strip().splitlines()
    return line


def _catalog_with(prefix: str, **fields: object) -> str:
    """The packaged model catalog with one entry's fields replaced."""
    data = json.loads((REPO / "service" / "context_engine" / "data" / "models.json")
                      .read_text(encoding="utf-8"))
    for entry in data["models"]:
        if entry["prefix"] == prefix:
            entry.update(fields)
    return json.dumps(data)


@pytest.mark.parametrize(("content", "said"), [
    (_catalog_with("claude-", context_window="200000"),
     "model catalog entry 'claude-': context_window must be an integer from 1 to 2147483647, "
     "not '200000'"),
    (_catalog_with("gpt-4o", base_factor=-1.3),
     "model catalog entry 'gpt-4o': base_factor must be a number from 0.5 to 4.0"),
    (_catalog_with("gpt-4.1", context_window=-5), "model catalog entry 'gpt-4.1': "
     "context_window must be an integer from 1 to 2147483647, not -5"),
    (_catalog_with("gpt-4", output_reserve=8192), "model catalog entry 'gpt-4': output_reserve "
     "8192 leaves nothing of context_window 8192")])
def test_a_catalog_entry_no_plan_could_use_is_a_configuration_error(content: str, said: str,
                                                                     tmp_path: Path):
    """A quoted window or a negative base factor started the server, and every Plan of the
    model then answered INTERNAL; a negative window answered INVALID_ARGUMENT, blaming the
    caller. serve exits 2 before anything starts now, naming the variable, entry and field."""
    path = tmp_path / "models.json"
    path.write_text(content)
    line = _serve_refused("CE_MODEL_CATALOG", path)
    assert line.startswith(f"context-engine: configuration error: CE_MODEL_CATALOG="
                           f"{str(path)!r} cannot be read: ValueError: {said}"), line


def test_serve_dev_refuses_metrics_on_every_interface(env, capsys):
    """`serve --dev` says "loopback binds only", yet served its metrics on 0.0.0.0; the
    refusal comes before the database is reached (nothing listens at the one named)."""
    env.setenv("DATABASE_URL", f"postgresql://ce@127.0.0.1:{_free_port()}/ce")
    env.setenv("CE_GRPC_ADDR", "127.0.0.1:0")
    for argv, metrics in ((("--metrics-addr", "0.0.0.0:0"), "0.0.0.0:0"), ((), "[::]:0")):
        env.setenv("CE_METRICS_ADDR", metrics)
        code, out, err = run(capsys, "serve", "--dev", *argv)
        assert (code, out) == (2, ""), err
        assert err.strip() == (
            f"context-engine: configuration error: dev mode (--dev / CE_DEV_MODE=1) binds only "
            f"loopback addresses, and the metrics address (--metrics-addr / CE_METRICS_ADDR) "
            f"{metrics!r} is not one: write 127.0.0.1:<port>, or an empty one for no metrics")


# ---------------------------------------------------------------- flags and the database


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(("flag", "message"), [
    ("5000", "--workers=5000 is above 1024"),
    ("-1", "--workers=-1 is below 0"),
])
def test_a_flag_is_held_to_its_variables_bounds(env, capsys, flag, message):
    env.setenv("CE_METRICS_ADDR", "")
    # were a bad flag let through, serving would stop at once at a database nobody runs
    env.setenv("DATABASE_URL", f"postgresql://ce@127.0.0.1:{_free_port()}/ce")
    env.setenv("CE_DB_TIMEOUT_SECONDS", "2")
    code, _, err = run(capsys, "serve", "--dev", "--grpc-addr", "127.0.0.1:0", "--workers", flag)
    assert (code, err.strip()) == (2, f"context-engine: configuration error: {message}")
    code, _, err = run(capsys, "serve", "--dev", "--grpc-addr", "nowhere")
    assert code == 2 and "--grpc-addr='nowhere' is not host:port" in err
    # a check of the settings together names the flag too, not the variable it stands for
    code, _, err = run(capsys, "serve", "--dev", "--metrics-addr", "127.0.0.1:70000")
    assert code == 2 and "--metrics-addr='127.0.0.1:70000'" in err, err
    assert "CE_METRICS_ADDR" not in err


@pytest.mark.parametrize("command", [("serve", "--dev", "--workers", "0"), ("migrate",),
                                     ("migrate", "--status")])
def test_an_unreachable_database_is_one_line_not_a_traceback(env, capsys, command):
    """``--workers 0`` is one per CPU, as CE_WORKERS=0 is: it gets as far as the database,
    whose refusal is one line naming it (its password masked), exit 1."""
    port = _free_port()  # nothing listens there
    env.setenv("DATABASE_URL", f"postgresql://ce:{SECRET}@127.0.0.1:{port}/ce")
    env.setenv("CE_GRPC_ADDR", "127.0.0.1:0")
    env.setenv("CE_METRICS_ADDR", "")
    env.setenv("CE_DB_TIMEOUT_SECONDS", "2")
    code, _, err = run(capsys, *command)
    assert code == 1, err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("context-engine:")]
    assert line.startswith(f"context-engine: cannot reach the database (DATABASE_URL "
                           f"postgresql://ce:{MASK}@127.0.0.1:{port}/ce): ConnectionRefusedError")
    assert "Traceback" not in err and SECRET not in err


@pytest.mark.parametrize("query", ["", "?sslmode=bogus"])
def test_an_unusable_database_url_is_one_line_not_a_traceback(env, capsys, query):
    """A URL asyncpg cannot use at all (a port that is no number, an unknown sslmode) is said
    to be so, in one line, not a database that could not be reached."""
    port = "notaport" if not query else str(_free_port())
    env.setenv("DATABASE_URL", f"postgresql://ce:{SECRET}@127.0.0.1:{port}/ce{query}")
    code, _, err = run(capsys, "migrate")
    assert code == 1 and "Traceback" not in err and SECRET not in err, err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("context-engine:")]
    assert line.startswith("context-engine: cannot use the database URL (DATABASE_URL "), line


@pytest.mark.parametrize("delimiter", ["#", "?", "/", "@t:9"])
def test_a_password_a_url_parser_reads_in_pieces_is_never_shown(env, capsys, delimiter):
    """A password holding an unescaped '#', '?' or '/' was printed whole in the URL and again
    in asyncpg's error about the port or query field it misread it as."""
    password = f"S3CRET{delimiter}tail9"
    env.setenv("DATABASE_URL", f"postgresql://ce:{password}@127.0.0.1:{_free_port()}/ce")
    env.setenv("CE_DB_TIMEOUT_SECONDS", "2")
    code, out, err = run(capsys, "migrate")
    assert code == 1 and "Traceback" not in err, err
    for piece in (password, "S3CRET", "tail9"):
        assert piece not in err + out, err
    assert f"postgresql://ce:{MASK}@127.0.0.1:" in err and "percent-encode" in err, err
    code, out, err = run(capsys, "config")
    assert code == 0 and "S3CRET" not in out + err and "tail9" not in out + err


def test_migrate_gives_up_connecting_after_ce_db_timeout_seconds(env, capsys):
    """A database that takes the connection and never answers (a listening socket nobody
    accepts on): migrate gives up after CE_DB_TIMEOUT_SECONDS (1 s here), not asyncpg's 60."""
    import time

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        env.setenv("DATABASE_URL", f"postgresql://ce@127.0.0.1:{port}/ce?sslmode=disable")
        env.setenv("CE_DB_TIMEOUT_SECONDS", "1")
        started = time.monotonic()
        code, _, err = run(capsys, "migrate")
        took = time.monotonic() - started
    assert code == 1 and "cannot reach the database" in err and "TimeoutError" in err, err
    assert took < 15, took


def test_ctrl_c_while_the_program_loads_is_one_line():
    """SIGINT after cli is loaded as the program and before main runs (the window a slow
    import leaves): one line and exit 130, not a traceback. Deterministic: the signal is sent
    from inside, right after the import."""
    import subprocess

    code = ("import os, signal, sys, time\n"
            "sys.argv[0] = 'context-engine'\n"
            "import context_engine.cli\n"
            "os.kill(os.getpid(), signal.SIGINT)\n"
            "time.sleep(10)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert (done.returncode, done.stderr) == (130, "context-engine: interrupted\n"), done
    # imported by anything else (a test, a library), cli leaves SIGINT to Python
    code = code.replace("sys.argv[0] = 'context-engine'\n", "")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode != 130 and "KeyboardInterrupt" in done.stderr, done


def test_a_program_run_with_python_m_that_imports_cli_keeps_its_ctrl_c(tmp_path: Path):
    """`python -m pytest` runs a __main__.py too: cli took its Ctrl-C (exit 130, no teardown)
    when its test files imported it. Only context_engine's own __main__ is the program."""
    import subprocess

    (tmp_path / "probe_program.py").write_text(
        "import os, signal, time\n"
        "import context_engine.cli\n"
        "try:\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(10)\n"
        "finally:\n"
        "    print('teardown ran', flush=True)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "probe_program"], capture_output=True,
                          text=True, timeout=60, env=env)
    assert "teardown ran" in done.stdout and "KeyboardInterrupt" in done.stderr, done


def test_a_database_starting_up_or_out_of_connections_is_not_said_to_refuse_the_url():
    """Both are errors the server answers with, like a wrong password, but nothing in the URL
    is wrong and the next try may pass: reported as not reachable now, not as a refusal."""
    import asyncpg
    from context_engine.adapters.postgres.migrate import DatabaseUnreachable

    assert DatabaseUnreachable(asyncpg.InvalidPasswordError("no")).refused
    assert DatabaseUnreachable(asyncpg.InvalidCatalogNameError("no")).refused
    assert not DatabaseUnreachable(asyncpg.CannotConnectNowError("starting up")).refused
    assert not DatabaseUnreachable(asyncpg.TooManyConnectionsError("full")).refused
    assert not DatabaseUnreachable(ConnectionRefusedError()).refused
