"""Migrations: a fresh migrate reproduces the expected schema; re-running applies nothing;
concurrent migrators serialize on the advisory lock; each applied file's checksum is recorded,
a changed, renamed or missing applied file stops ``migrate`` and ``serve``, ``migrate --status``
reports all of it without writing, and a database from before checksums is backfilled once."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest
from context_engine.adapters.postgres.migrate import MigrationError, discover, migrate

from tests.conftest import REPO

pytestmark = pytest.mark.integration

CLI = Path(sys.executable).parent / "context-engine"

EXPECTED = {
    "sessions": {"tenant_id", "session_id", "current_epoch", "created_at", "updated_at",
                 "incarnation"},
    "plans": {"tenant_id", "session_id", "epoch", "reason", "spec_text", "spec", "prefix_sha256",
              "prefix_tokens", "classes", "model_id", "tokenizer", "tool_names",
              "deferred_tool_names", "skipped_tool_names", "authority_scope_hashes",
              "builder_version", "policy_version", "cache_ttl", "created_at", "counted",
              "count_claim"},
    "context_events": {"id", "event_id", "tenant_id", "session_id", "epoch", "type", "payload",
                       "created_at"},
    "schema_migrations": {"version", "name", "applied_at", "checksum"},
    "estimator_calibration": {"tenant_id", "model_id", "encoding", "factor", "reports",
                              "updated_at"},
    "idempotency_keys": {"tenant_id", "rpc", "key", "response", "created_at", "session_id"},
    "compactions": {"tenant_id", "idempotency_key", "session_id", "fingerprint", "depth",
                    "replaced_through_sequence", "compactor_version", "result", "created_at"},
    "api_tokens": {"token_sha256", "tenant_id", "rpcs", "description", "created_at",
                   "revoked_at"},
    "epoch_usage": {"tenant_id", "session_id", "epoch", "reports", "last_input_tokens",
                    "previous_input_tokens", "updated_at"},
    "erasures": {"id", "tenant_id", "scope", "session_sha256", "sessions", "plans", "events",
                 "compactions", "idempotency_keys", "usage_rows", "calibrations",
                 "requested_by", "erased_at"},
}

# A migration after the last one, which tests add to a copy of the files.
LATER_VERSION = len(discover(REPO / "migrations")) + 1
LATER = f"{LATER_VERSION:04d}_later"

# The migrator's bootstrap table in the releases before checksums were recorded.
PRE_CHECKSUM_TABLE = """
CREATE TABLE schema_migrations (
    version     integer     PRIMARY KEY,
    name        text        NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT now()
)"""


async def _fresh_database(url: str) -> str:
    name = f"ce_migrate_{uuid.uuid4().hex[:8]}"
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    base, _, query = url.partition("?")
    return f"{base.rsplit('/', 1)[0]}/{name}" + (f"?{query}" if query else "")


@pytest.fixture
def fresh(database_url: str) -> Iterator[str]:
    """An empty database of its own on the test server."""
    yield asyncio.run(_fresh_database(database_url))


@pytest.fixture
def files(tmp_path: Path) -> Path:
    """A copy of the repository's migrations that a test may edit."""
    directory = tmp_path / "migrations"
    shutil.copytree(REPO / "migrations", directory)
    return directory


async def _columns(url: str) -> dict[str, set[str]]:
    conn = await asyncpg.connect(url)
    try:
        # a partition (context_events_pYYYYMMDD) has its parent's columns: only the parent
        rows = await conn.fetch("SELECT table_name, column_name FROM information_schema.columns "
                                "WHERE table_schema = 'public' AND table_name NOT IN "
                                "(SELECT relname FROM pg_class WHERE relispartition)")
    finally:
        await conn.close()
    out: dict[str, set[str]] = {}
    for r in rows:
        out.setdefault(r["table_name"], set()).add(r["column_name"])
    return out


def fetch(url: str, sql: str, *args: object) -> list[asyncpg.Record]:
    async def go() -> list[asyncpg.Record]:
        conn = await asyncpg.connect(url)
        try:
            return list(await conn.fetch(sql, *args))
        finally:
            await conn.close()
    return asyncio.run(go())


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def cli(url: str, directory: Path, *args: str, timeout: float = 60
        ) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DATABASE_URL": url, "CE_MIGRATIONS_DIR": str(directory)}
    return subprocess.run([str(CLI), *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def status_rows(stdout: str) -> dict[str, tuple[str, str]]:
    """``migrate --status``'s table: ``{"0001_plans_and_events": (state, checksum)}``."""
    lines = stdout.split("\n\n", 1)[0].splitlines()
    assert lines[0].split() == ["version", "name", "state", "applied_at", "checksum"]
    rows = {}
    for line in lines[1:]:
        version, name, state, _applied_at, check = line.split()
        rows[f"{version}_{name}"] = (state, check)
    return rows


def test_fresh_migrate_reproduces_the_schema_and_is_idempotent(fresh):
    async def scenario() -> None:
        applied = await asyncio.gather(*(migrate(fresh, REPO / "migrations") for _ in range(3)))
        names = [f"{m.version:04d}_{m.name}" for m in discover(REPO / "migrations")]
        # each migration applied exactly once, by one of the three migrators
        assert sorted(n for batch in applied for n in batch) == names
        assert await _columns(fresh) == EXPECTED
        assert await migrate(fresh, REPO / "migrations") == []
    asyncio.run(scenario())


def test_migration_files_are_numbered_without_gaps():
    versions = [m.version for m in discover(REPO / "migrations")]
    assert versions == list(range(1, len(versions) + 1))


def test_each_applied_migration_records_the_sha256_of_its_file(fresh):
    asyncio.run(migrate(fresh, REPO / "migrations"))
    recorded = {f"{r['version']:04d}_{r['name']}.sql": r["checksum"]
                for r in fetch(fresh, "SELECT version, name, checksum FROM schema_migrations")}
    on_disk = {p.name: sha256_of(p) for p in sorted((REPO / "migrations").glob("*.sql"))}
    assert recorded == on_disk


def test_a_changed_applied_migration_stops_migrate_and_serve(fresh, files):
    asyncio.run(migrate(fresh, files))
    edited = files / "0003_compactions.sql"
    recorded = sha256_of(edited)
    edited.write_text(edited.read_text() + "\n-- an innocent-looking comment\n")
    current = sha256_of(edited)
    (files / f"{LATER}.sql").write_text("CREATE TABLE later (id integer);\n")

    with pytest.raises(MigrationError) as caught:
        asyncio.run(migrate(fresh, files))
    message = str(caught.value)
    assert str(edited) in message and recorded in message and current in message
    # Nothing was applied: the pending migration waits for the history to be repaired.
    assert not fetch(fresh, "SELECT 1 FROM schema_migrations WHERE version = $1", LATER_VERSION)
    assert "later" not in asyncio.run(_columns(fresh))

    for command in (["migrate"], ["serve", "--dev", "--grpc-addr", "127.0.0.1:0",
                                  "--metrics-addr", "", "--workers", "1"]):
        done = cli(fresh, files, *command)
        assert done.returncode == 1, (command, done.stdout, done.stderr)
        assert "refusing to start" in done.stderr and str(edited) in done.stderr
        assert recorded in done.stderr and current in done.stderr
        assert "Traceback" not in done.stderr

    # Restoring the file repairs it: the pending migration is applied.
    edited.write_text(edited.read_text().removesuffix("\n-- an innocent-looking comment\n"))
    assert sha256_of(edited) == recorded
    assert asyncio.run(migrate(fresh, files)) == [LATER]


def test_a_missing_or_renamed_applied_migration_is_reported(fresh, files):
    asyncio.run(migrate(fresh, files))
    (files / "0005_epoch_usage.sql").unlink()
    (files / "0004_api_tokens.sql").rename(files / "0004_tokens.sql")
    with pytest.raises(MigrationError) as caught:
        asyncio.run(migrate(fresh, files))
    problems = caught.value.problems
    assert len(problems) == 2
    assert "0004_api_tokens" in problems[0] and str(files / "0004_tokens.sql") in problems[0]
    assert "0005_epoch_usage" in problems[1] and "does not exist" in problems[1]

    done = cli(fresh, files, "migrate", "--status")
    assert done.returncode == 1, done.stderr
    rows = status_rows(done.stdout)
    assert rows["0004_api_tokens"] == ("applied", "renamed")
    assert rows["0005_epoch_usage"] == ("applied", "missing")
    assert "1 renamed, 1 missing" in done.stdout


def test_status_lists_pending_then_applied_and_applies_nothing(fresh, files):
    names = sorted(p.stem for p in files.glob("*.sql"))
    before = cli(fresh, files, "migrate", "--status")
    assert before.returncode == 0, before.stderr
    assert status_rows(before.stdout) == {n: ("pending", "-") for n in names}
    assert f"0 applied, {len(names)} pending" in before.stdout
    # Read-only: not even the migrator's own table was created.
    assert not fetch(fresh, "SELECT 1 FROM pg_tables WHERE tablename = 'schema_migrations'")

    assert cli(fresh, files, "migrate").returncode == 0
    (files / f"{LATER}.sql").write_text("CREATE TABLE later (id integer);\n")
    after = cli(fresh, files, "migrate", "--status")
    assert after.returncode == 0, after.stderr
    assert status_rows(after.stdout) == {**{n: ("applied", "ok") for n in names},
                                         LATER: ("pending", "-")}
    assert f"{len(names)} applied, 1 pending" in after.stdout
    assert not fetch(fresh, "SELECT 1 FROM schema_migrations WHERE version = $1", LATER_VERSION)

    edited = files / "0002_calibration_and_idempotency.sql"
    recorded = sha256_of(edited)
    edited.write_bytes(edited.read_bytes().replace(b"\n", b"\r\n"))  # the bytes count
    changed = cli(fresh, files, "migrate", "--status")
    assert changed.returncode == 1
    assert status_rows(changed.stdout)["0002_calibration_and_idempotency"] == ("applied",
                                                                               "changed")
    assert recorded in changed.stdout and sha256_of(edited) in changed.stdout


def test_a_database_from_before_checksums_is_backfilled_once(fresh, files):
    # As the earlier migrator left it: the first three migrations applied, no checksum column.
    async def old_migrator() -> None:
        conn = await asyncpg.connect(fresh)
        try:
            await conn.execute(PRE_CHECKSUM_TABLE)
            for m in discover(files)[:3]:
                await conn.execute(m.sql)
                await conn.execute("INSERT INTO schema_migrations (version, name) "
                                   "VALUES ($1, $2)", m.version, m.name)
        finally:
            await conn.close()
    asyncio.run(old_migrator())
    old = sorted(p.stem for p in files.glob("*.sql"))[:3]

    status = cli(fresh, files, "migrate", "--status")
    assert status.returncode == 0, status.stderr
    rows = status_rows(status.stdout)
    assert [rows[n] for n in old] == [("applied", "unrecorded")] * 3
    assert "checksum" not in asyncio.run(_columns(fresh))["schema_migrations"]

    done = cli(fresh, files, "migrate")
    assert done.returncode == 0, done.stderr
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    (backfill,) = [e for e in events if e["event"] == "migration_checksums_backfilled"]
    assert backfill["migrations"] == old
    (migrated,) = [e for e in events if e["event"] == "migrated"]
    assert migrated["applied"] == sorted(p.stem for p in files.glob("*.sql"))[3:]
    recorded = {f"{r['version']:04d}_{r['name']}.sql": r["checksum"]
                for r in fetch(fresh, "SELECT version, name, checksum FROM schema_migrations")}
    assert recorded == {p.name: sha256_of(p) for p in files.glob("*.sql")}

    again = cli(fresh, files, "migrate")
    assert again.returncode == 0
    assert "migration_checksums_backfilled" not in again.stdout
    assert set(status_rows(cli(fresh, files, "migrate", "--status").stdout).values()) == {
        ("applied", "ok")}


def test_a_database_that_refuses_the_connection_is_not_called_unreachable(direct_database_url):
    """A database name that does not exist (or a wrong password: the server answers, and says
    no) was reported as "cannot reach the database ... (CE_DB_TIMEOUT_SECONDS=5 s to
    connect)", pointing at the network and a timeout; it is a refusal, said as one."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(direct_database_url)
    wrong = urlunsplit(parts._replace(path="/no_such_database_here"))
    env = {**os.environ, "DATABASE_URL": wrong}
    done = subprocess.run([sys.executable, "-m", "context_engine", "migrate"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    (line,) = [ln for ln in done.stderr.splitlines() if ln.startswith("context-engine:")]
    assert line.startswith("context-engine: the database refused the connection (DATABASE_URL ")
    assert "no_such_database_here" in line and "CE_DB_TIMEOUT_SECONDS" not in line, line


def test_a_migration_that_fails_midway_is_named_in_one_line_and_a_retry_resumes(fresh, files):
    """A migration whose SQL fails after its first statement ended migrate and serve in a
    traceback of some 40 lines ending in "UndefinedColumnError: column ... does not exist", naming
    neither the migration nor what was applied. It is one line naming the migration, the
    error and where in the file; the database shows nothing of it, while those before it
    stay applied, and migrate once the file is fixed applies it once."""
    (files / f"{LATER}.sql").write_text("CREATE TABLE later (id integer);\n"
                                        "INSERT INTO later VALUES (1);\n"
                                        "SELECT no_such_column FROM later;\n")
    for command in (["migrate"], ["serve", "--dev", "--grpc-addr", "127.0.0.1:0",
                                  "--metrics-addr", "", "--workers", "1"]):
        done = cli(fresh, files, *command)
        assert done.returncode == 1, (command, done.stdout, done.stderr)
        assert "Traceback" not in done.stderr, done.stderr
        (line,) = [ln for ln in done.stderr.splitlines() if ln.startswith("context-engine:")]
        assert f"migration {LATER} failed" in line, line
        assert "no_such_column" in line and "SQLSTATE 42703" in line, line
        assert f"at line 3 of {LATER}.sql" in line, line
        # the oracle is the database itself, read on a connection of its own
        assert [r["version"] for r in fetch(fresh, "SELECT version FROM schema_migrations "
                                                   "ORDER BY version")] == list(
            range(1, LATER_VERSION))
        assert not fetch(fresh, "SELECT to_regclass('later') AS t")[0]["t"]
        # the first run applied the others before it; the second, nothing
        before = (", ".join(f"{m.version:04d}_{m.name}" for m in discover(REPO / "migrations"))
                  if command == ["migrate"] else "none")
        assert f"applied before it by this run: {before};" in line, line

    (files / f"{LATER}.sql").write_text("CREATE TABLE later (id integer);\n"
                                        "INSERT INTO later VALUES (1);\n")
    again = cli(fresh, files, "migrate")
    assert again.returncode == 0, again.stderr
    assert fetch(fresh, "SELECT count(*) AS n FROM later")[0]["n"] == 1
    assert fetch(fresh, "SELECT max(version) AS v FROM schema_migrations")[0]["v"] == (
        LATER_VERSION)


def test_a_user_who_may_not_create_tables_is_told_in_one_line(direct_database_url):
    """A DATABASE_URL whose user may connect but not create in the schema (PostgreSQL 15's
    default for a user that does not own the database) ended migrate in an
    InsufficientPrivilegeError traceback, and migrate --status by a user who may not read
    schema_migrations too; each is one line naming the URL and the refusal."""
    from urllib.parse import urlsplit, urlunsplit

    fresh = asyncio.run(_fresh_database(direct_database_url))
    role = f"ce_reader_{uuid.uuid4().hex[:8]}"
    fetch(direct_database_url, f"CREATE ROLE {role} LOGIN PASSWORD 'not-shown-9'")
    try:
        fetch(fresh, "REVOKE CREATE ON SCHEMA public FROM PUBLIC")
        parts = urlsplit(fresh)
        host = parts.netloc.rsplit("@", 1)[-1]
        url = urlunsplit(parts._replace(netloc=f"{role}:not-shown-9@{host}"))
        done = cli(url, REPO / "migrations", "migrate")
        assert done.returncode == 1, done.stdout
        assert "Traceback" not in done.stderr, done.stderr
        (line,) = [ln for ln in done.stderr.splitlines() if ln.startswith("context-engine:")]
        assert line.startswith("context-engine: cannot migrate (DATABASE_URL "), line
        assert "permission denied" in line and "SQLSTATE 42501" in line, line
        assert "nothing was applied" in line and "not-shown-9" not in line, line
        assert not fetch(fresh, "SELECT to_regclass('schema_migrations') AS t")[0]["t"]

        # migrated by its owner, the table is not the user's to read: --status says so
        asyncio.run(migrate(fresh, REPO / "migrations"))
        done = cli(url, REPO / "migrations", "migrate", "--status")
        assert done.returncode == 1 and done.stdout == "", done.stdout
        assert "Traceback" not in done.stderr, done.stderr
        (line,) = [ln for ln in done.stderr.splitlines() if ln.startswith("context-engine:")]
        assert line.startswith("context-engine: cannot read the applied migrations "
                               "(DATABASE_URL "), line
        assert "schema_migrations" in line and "SQLSTATE 42501" in line, line
    finally:
        fetch(direct_database_url, f"DROP OWNED BY {role} CASCADE")
        fetch(direct_database_url, f"DROP ROLE {role}")


def test_a_migration_refused_at_commit_or_cut_off_names_the_first_failure(fresh, files):
    """The failure of a migration's COMMIT (a deferred constraint) and the connection ended
    while it runs are named as such: the latter used to surface as asyncpg's "cannot call
    Transaction.__aexit__(): the underlying connection is closed", the rollback's failure
    hiding the cause."""
    from context_engine.adapters.postgres.migrate import MigrationFailed

    asyncio.run(migrate(fresh, REPO / "migrations"))
    (files / f"{LATER}.sql").write_text(
        "CREATE TABLE later (id integer UNIQUE DEFERRABLE INITIALLY DEFERRED);\n"
        "INSERT INTO later VALUES (1), (1);\n")
    with pytest.raises(MigrationFailed) as caught:
        asyncio.run(migrate(fresh, files))
    assert caught.value.migration == LATER and not caught.value.committing
    assert isinstance(caught.value.cause, asyncpg.UniqueViolationError)
    assert not fetch(fresh, "SELECT to_regclass('later') AS t")[0]["t"]

    marker = f"cut_off_{uuid.uuid4().hex[:8]}"
    (files / f"{LATER}.sql").write_text(f"CREATE TABLE later (id integer);\n"
                                        f"SELECT pg_sleep(30) AS {marker};\n")

    async def cut_off() -> MigrationFailed:
        running = asyncio.ensure_future(migrate(fresh, files))
        admin = await asyncpg.connect(fresh, statement_cache_size=0)  # via the pooler
        try:
            for _ in range(200):
                if await admin.fetchval(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                        "WHERE query LIKE $1 AND pid <> pg_backend_pid()", f"%AS {marker}%"):
                    break
                await asyncio.sleep(0.05)
        finally:
            await admin.close()
        with pytest.raises(MigrationFailed) as failed:
            await asyncio.wait_for(running, 20)
        return failed.value

    failure = asyncio.run(cut_off())
    assert failure.migration == LATER and not failure.committing
    # PostgreSQL says "terminating connection", PgBouncer "server conn crashed?"
    assert isinstance(failure.cause, asyncpg.ConnectionDoesNotExistError), str(failure)
    assert "__aexit__" not in str(failure)
    assert not fetch(fresh, "SELECT to_regclass('later') AS t")[0]["t"]
    assert fetch(fresh, "SELECT max(version) AS v FROM schema_migrations")[0]["v"] == (
        LATER_VERSION - 1)


def test_status_does_not_wait_for_a_running_migration(fresh, files):
    """Every migrate (each serve start, each worker) ran ALTER TABLE schema_migrations ADD
    COLUMN IF NOT EXISTS, which locks the table ACCESS EXCLUSIVE even when the column is
    there: `migrate --status` waited, silent, for the rest of any running migration (all of
    0006 on a large table). It answers at once with what is committed."""
    from context_engine.adapters.postgres.migrate import status

    asyncio.run(migrate(fresh, REPO / "migrations"))
    marker = f"slow_{uuid.uuid4().hex[:8]}"
    (files / f"{LATER}.sql").write_text(f"SELECT pg_sleep(6) AS {marker};\n")

    async def scenario() -> tuple[float, dict[str, str | None], list[str]]:
        running = asyncio.ensure_future(migrate(fresh, files))
        admin = await asyncpg.connect(fresh, statement_cache_size=0)  # via the pooler
        try:
            for _ in range(200):  # the server itself says the migration is running
                if await admin.fetchval("SELECT count(*) FROM pg_stat_activity WHERE query "
                                        "LIKE $1 AND pid <> pg_backend_pid()", f"%AS {marker}%"):
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the slow migration never ran")
        finally:
            await admin.close()
        started = asyncio.get_running_loop().time()
        entries = await asyncio.wait_for(status(fresh, files), 30)
        took = asyncio.get_running_loop().time() - started
        return took, {e.label: e.check for e in entries}, await running

    took, checks, applied = asyncio.run(scenario())
    assert took < 3, f"--status waited {took:.1f} s for the running migration"
    assert checks == {**{p.stem: "ok" for p in (REPO / "migrations").glob("*.sql")},
                      LATER: None}  # committed: all but the running one, which is pending
    assert applied == [LATER]


@pytest.mark.parametrize("through", ["postgresql", "pgbouncer"])
def test_a_url_parameter_the_server_refuses_is_named_as_such(through, direct_database_url,
                                                            database_url):
    """libpq's connect_timeout in DATABASE_URL is no parameter of asyncpg, which sends it to
    the server as a setting: PostgreSQL answers "unrecognized configuration parameter",
    PgBouncer "unsupported startup parameter". The line said to check the user, the password
    and the database name; it names the setting the URL asks for."""
    url = direct_database_url if through == "postgresql" else database_url
    url += ("&" if "?" in url else "?") + "connect_timeout=10"
    done = cli(url, REPO / "migrations", "migrate")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    (line,) = [ln for ln in done.stderr.splitlines() if ln.startswith("context-engine:")]
    assert line.startswith("context-engine: the database refused a setting the URL asks "
                           "for (DATABASE_URL "), line
    assert "connect_timeout" in line and "check the user" not in line, line


def test_the_release_before_runs_on_a_database_a_newer_release_migrated(fresh, files):
    """A rollout's old pod restarted mid-rollout, or a rollback, meets a migration of the newer
    release (numbered past its own), which the deploy notes keep working for the release
    before: it refused to start ("migrated by a newer release"), so the old replica set lost
    its pods and a rollback could not start at all. It now starts, warns, and applies nothing;
    a file removed from among its own migrations still stops it."""
    asyncio.run(migrate(fresh, files))
    (files / f"{LATER}.sql").write_text("CREATE TABLE later (id integer);\n")
    assert asyncio.run(migrate(fresh, files)) == [LATER]
    (files / f"{LATER}.sql").unlink()  # the release before has no such file
    assert asyncio.run(migrate(fresh, files)) == []
    done = cli(fresh, files, "migrate")
    assert done.returncode == 0, done.stderr
    warned = [json.loads(line) for line in (done.stdout + done.stderr).splitlines()
              if "database_migrated_by_a_newer_release" in line]
    assert len(warned) == 1 and warned[0]["migrations"] == [LATER]
    status = cli(fresh, files, "migrate", "--status")
    assert status.returncode == 0, status.stderr
    assert status_rows(status.stdout)[LATER] == ("applied", "newer")
    assert "1 newer" in status.stdout
    # one of its own removed is still refused, newer migrations or not
    (files / "0006_partitioned_events.sql").unlink()
    with pytest.raises(MigrationError) as caught:
        asyncio.run(migrate(fresh, files))
    assert list(caught.value.problems) == [
        f"migration 0006_partitioned_events is recorded as applied but "
        f"{files / '0006_partitioned_events.sql'} does not exist, though later migrations of "
        f"this release do: the file was removed (restore it)"]


def test_what_a_migration_tells_the_operator_is_logged(fresh):
    """Migration 0006 keeps the events of sessions that have no row aside in
    ``context_events_orphaned`` and says how many (RAISE WARNING). The migrator's connection
    had no log listener, so asyncpg dropped what the server said: ``migrate`` set the rows aside
    without a word. It now logs each thing a migration says (``migration_message``, at warning
    for a WARNING), naming the migration, once the migration has committed; a migration that
    says nothing, and a run that applies nothing, log none."""
    asyncio.run(migrate(fresh, REPO / "migrations", target=5))
    fetch(fresh, "INSERT INTO context_events (tenant_id, session_id, epoch, type, payload) "
                 "SELECT 't', 'gone', 1, 'context.plan.created', '{}' FROM generate_series(1, 3)")
    done = cli(fresh, REPO / "migrations", "migrate")
    assert done.returncode == 0, done.stderr
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    told = [e for e in events if e["event"] == "migration_message"]
    assert [(e["migration"], e["level"], e["severity"]) for e in told] == [
        ("0006_partitioned_events", "warning", "WARNING")], told
    assert told[0]["message"].startswith(
        "3 context events of sessions that no longer exist were kept aside in "
        "context_events_orphaned"), told
    assert fetch(fresh, "SELECT count(*) AS n FROM context_events_orphaned")[0]["n"] == 3
    again = cli(fresh, REPO / "migrations", "migrate")
    assert again.returncode == 0 and "migration_message" not in again.stdout, again.stdout
