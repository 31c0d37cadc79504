"""Migration 0007 on a database whose operator erased sessions by hand (their plans, then their
row) before DeleteSession existed, leaving their compaction records: 0007 gives compactions a
foreign key to sessions, and failed outright on them (``MigrationFailed 0007_erasure:
ForeignKeyViolationError ... compactions_tenant_id_session_id_fkey``), every later migration
waiting behind it. ``migrations/before/0007_erasure.sql``, run in 0007's transaction right
before it, keeps those records aside unchanged in ``compactions_orphaned`` and says how many;
0007's own bytes stay as released, so a database that applied it still starts, and a changed
0007 is still refused."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest
from context_engine.adapters.postgres.migrate import (
    MigrationError,
    MigrationFailed,
    discover,
    migrate,
)

from tests.conftest import REPO, ServerThread
from tests.conftest import test_config as base_config
from tests.support.databases import create_database, drop_database, with_database

pytestmark = pytest.mark.integration

CLI = Path(sys.executable).parent / "context-engine"
MIGRATIONS = REPO / "migrations"
ALL = len(list(MIGRATIONS.glob("[0-9]*.sql")))  # every migration, later ones included
# SHA-256 of migrations/0007_erasure.sql as released (commit d60f767): recorded by every database
# that applied it, and the file of the release before this one.
RELEASED_0007 = "26999b4da575b3f895595ee3767a08b6d7656c14cbea29f52e6cd79f6f9d177d"
COMPACTION = ("SELECT tenant_id, idempotency_key, session_id, fingerprint, depth, "
              "replaced_through_sequence, compactor_version, result::text AS result, created_at "
              "FROM {} ORDER BY tenant_id, idempotency_key")


@pytest.fixture
def fresh(direct_database_url: str) -> Iterator[str]:
    """A database of its own (PostgreSQL itself: the test rewrites the schema)."""
    name = asyncio.run(create_database(direct_database_url, "ce_upgrade"))
    yield with_database(direct_database_url, name)
    asyncio.run(drop_database(direct_database_url, name))


def fetch(url: str, sql: str, *args: object) -> list[tuple[object, ...]]:
    async def go() -> list[tuple[object, ...]]:
        conn = await asyncpg.connect(url)
        try:
            return [tuple(r) for r in await conn.fetch(sql, *args)]
        finally:
            await conn.close()
    return asyncio.run(go())


def cli(url: str, directory: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DATABASE_URL": url, "CE_MIGRATIONS_DIR": str(directory)}
    return subprocess.run([str(CLI), *args], capture_output=True, text=True, env=env,
                          timeout=120)


def said(stdout: str) -> dict[str, str]:
    """What each migration said, as ``migrate`` logged it: ``{migration: message}``."""
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    told = [e for e in lines if e["event"] == "migration_message"]
    assert all(e["level"] == "warning" for e in told), told
    return {e["migration"]: e["message"] for e in told}


def _populate(url: str, *, events: bool) -> None:
    """Sessions t/live and u/gone have rows; t/gone and t/other were erased by hand."""
    fetch(url, "INSERT INTO sessions (tenant_id, session_id) "
               "VALUES ('t', 'live'), ('u', 'gone')")
    rows = [("t", "c-live-0", "live"), ("t", "c-live-1", "live"), ("t", "c-gone-0", "gone"),
            ("t", "c-gone-1", "gone"), ("t", "c-gone-2", "gone"), ("t", "c-other", "other"),
            ("u", "c-gone", "gone")]
    for n, (tenant, key, session) in enumerate(rows):
        fetch(url, "INSERT INTO compactions (tenant_id, idempotency_key, session_id, "
                   "fingerprint, depth, replaced_through_sequence, compactor_version, result, "
                   "created_at) VALUES ($1, $2, $3, 'fp', 1, $4::bigint, 'v1', $5::jsonb, "
                   "now() - $4 * interval '1 hour')",
              tenant, key, session, n, json.dumps({"summary": f"{tenant}/{session}/{key}"}))
    fetch(url, "INSERT INTO idempotency_keys (tenant_id, rpc, key, response) VALUES "
               "('t', 'Rotate', 'r-gone', '{\"session_id\": \"gone\"}'), "
               "('t', 'Rotate', 'r-live', '{\"session_id\": \"live\"}'), "
               "('t', 'context.snapshot.used', 'gone:1:run', '{}')")
    if events:  # before 0006 an event needed no session
        fetch(url, "INSERT INTO context_events (tenant_id, session_id, epoch, type, payload) "
                   "VALUES ('t', 'gone', 1, 'context.plan.created', '{}'), "
                   "('t', 'gone', 1, 'context.plan.created', '{}')")


@pytest.mark.parametrize("since", [5, 6])
def test_0007_keeps_aside_the_compactions_of_sessions_erased_by_hand(fresh, since):
    asyncio.run(migrate(fresh, MIGRATIONS, target=since))
    _populate(fresh, events=since < 6)
    before = fetch(fresh, COMPACTION.format("compactions"))
    assert len(before) == 7

    done = cli(fresh, MIGRATIONS, "migrate")
    assert done.returncode == 0, done.stderr
    told = said(done.stdout)
    assert told.pop("0007_erasure").startswith(
        "4 compaction records of sessions that no longer exist were kept aside in "
        "compactions_orphaned"), told
    if since < 6:
        assert told.pop("0006_partitioned_events").startswith("2 context events"), told
    assert told == {}

    # every record kept, unchanged: those of a session with a row where they were, the
    # others aside (the same session id with a row in another tenant stays)
    gone = {("t", "gone"), ("t", "other")}
    assert fetch(fresh, COMPACTION.format("compactions")) == [
        r for r in before if (r[0], r[2]) not in gone]
    assert fetch(fresh, COMPACTION.format("compactions_orphaned")) == [
        r for r in before if (r[0], r[2]) in gone]
    # idempotency keys: all kept, a session given only where it has a row
    assert fetch(fresh, "SELECT key, session_id FROM idempotency_keys ORDER BY key") == [
        ("gone:1:run", None), ("r-gone", None), ("r-live", "live")]
    # 0007 applied, as released: its foreign key holds
    assert fetch(fresh, "SELECT checksum FROM schema_migrations WHERE version = 7") == [
        (RELEASED_0007,)]
    with pytest.raises(asyncpg.ForeignKeyViolationError):
        fetch(fresh, "INSERT INTO compactions (tenant_id, idempotency_key, session_id, "
                     "fingerprint, depth, replaced_through_sequence, compactor_version, result) "
                     "VALUES ('t', 'c-new', 'gone', 'fp', 1, 0, 'v1', '{}')")
    status = cli(fresh, MIGRATIONS, "migrate", "--status")
    assert status.returncode == 0 and f"{ALL} applied, 0 pending" in status.stdout, status.stdout


def test_0007_without_such_compactions_leaves_no_side_table(fresh):
    asyncio.run(migrate(fresh, MIGRATIONS, target=6))
    fetch(fresh, "INSERT INTO sessions (tenant_id, session_id) VALUES ('t', 'live')")
    fetch(fresh, "INSERT INTO compactions (tenant_id, idempotency_key, session_id, fingerprint, "
                 "depth, replaced_through_sequence, compactor_version, result) "
                 "VALUES ('t', 'c', 'live', 'fp', 1, 0, 'v1', '{}')")
    done = cli(fresh, MIGRATIONS, "migrate")
    assert done.returncode == 0, done.stderr
    assert said(done.stdout) == {}
    assert fetch(fresh, "SELECT to_regclass('compactions_orphaned')") == [(None,)]
    assert fetch(fresh, "SELECT idempotency_key FROM compactions") == [("c",)]


def test_the_release_0007_file_is_unchanged():
    """Every database that applied 0007 recorded this checksum: an edit of the file would make
    each of them refuse to start, and the release before refuse a database this one migrated."""
    assert hashlib.sha256((MIGRATIONS / "0007_erasure.sql").read_bytes()).hexdigest() == (
        RELEASED_0007)


def test_a_database_that_applied_0007_as_released_starts_and_a_changed_0007_is_refused(
        fresh, tmp_path):
    released = tmp_path / "released"  # the release before: no before/
    shutil.copytree(MIGRATIONS, released, ignore=shutil.ignore_patterns("before"))
    asyncio.run(migrate(fresh, released))
    assert asyncio.run(migrate(fresh, MIGRATIONS)) == []
    status = cli(fresh, MIGRATIONS, "migrate", "--status")
    assert status.returncode == 0, status.stdout + status.stderr
    assert f"{ALL} applied, 0 pending" in status.stdout and "changed" not in status.stdout
    server = ServerThread(base_config(), fresh)  # serve starts on it
    server.stop()

    # what runs before a migration never runs once it is applied
    unused = tmp_path / "unused"
    shutil.copytree(MIGRATIONS, unused)
    (unused / "before" / "0007_erasure.sql").write_text("SELECT 1 / 0;\n")
    assert asyncio.run(migrate(fresh, unused)) == []

    # a 0007 changed in any way is still refused, by migrate and serve
    tampered = tmp_path / "tampered"
    shutil.copytree(MIGRATIONS, tampered)
    edited = tampered / "0007_erasure.sql"
    edited.write_bytes(edited.read_bytes() + b"\n-- reworded\n")
    with pytest.raises(MigrationError) as caught:
        asyncio.run(migrate(fresh, tampered))
    assert RELEASED_0007 in str(caught.value) and str(edited) in str(caught.value)
    refused = cli(fresh, tampered, "migrate")
    assert refused.returncode == 1 and "refusing to start" in refused.stderr, refused.stderr


def test_a_failure_before_a_migration_names_its_file_and_line(fresh, tmp_path):
    asyncio.run(migrate(fresh, MIGRATIONS, target=6))
    files = tmp_path / "migrations"
    shutil.copytree(MIGRATIONS, files)
    (files / "before" / "0007_erasure.sql").write_text("SELECT 1;\n\nSELECT no_such_column;\n")
    with pytest.raises(MigrationFailed) as caught:
        asyncio.run(migrate(fresh, files))
    assert caught.value.migration == "0007_erasure"
    assert "(at line 3 of before/0007_erasure.sql)" in caught.value.detail, caught.value.detail
    assert fetch(fresh, "SELECT max(version) FROM schema_migrations") == [(6,)]


def test_a_file_before_no_migration_is_refused(tmp_path):
    files = tmp_path / "migrations"
    shutil.copytree(MIGRATIONS, files)
    (files / "before" / "0009_later.sql").write_text("SELECT 1;\n")
    with pytest.raises(ValueError, match=r"before/0009_later\.sql names no migration"):
        discover(files)
