"""Forward-only migrations: numbered SQL files applied in order, each in a transaction that holds
an advisory lock.

Each applied migration's checksum (SHA-256 of the file's bytes) is recorded with it. Before
applying anything, the migrator compares the record with the files: a migration changed after
it was applied, one recorded under another name, or one whose file is gone stops it with a
``MigrationError`` naming each (``serve`` and ``migrate`` then refuse to start). Rows applied
before checksums were kept are backfilled once from the files on disk, and the log says so.

A file of the same name in ``before/`` (``before/0007_erasure.sql``) is run in the migration's
transaction right before it, while it is pending: what a released migration needs first on a
database it fails on, added without changing the migration's bytes (so its checksum, recorded
by every database that applied it, and the release before it, which has the same file, still
agree). It is not recorded; a database that applied the migration never runs it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import re
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from pathlib import Path
from typing import Any

import asyncpg

from context_engine.adapters.postgres import queries
from context_engine.adapters.postgres.errors import RefusedConnection
from context_engine.telemetry.logs import log

# Arbitrary but fixed key of the advisory lock that serializes migrators.
MIGRATION_LOCK_KEY = 0x636F6E74  # "cont"
_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
BEFORE = "before"  # the directory, within the migrations', of what runs before a migration


@dataclass(frozen=True, kw_only=True, slots=True)
class Migration:
    version: int
    name: str
    sql: str
    checksum: str  # SHA-256 of the file's bytes, hex
    before: str | None = None  # before/<file>: run in its transaction before it; not recorded

    @property
    def file(self) -> str:
        return f"{self.version:04d}_{self.name}.sql"


def checksum(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def discover(directory: Path) -> list[Migration]:
    found: list[Migration] = []
    for path in sorted(directory.glob("*.sql")):
        match = _NAME.match(path.name)
        if not match:
            raise ValueError(f"migration file {path.name} is not named NNNN_description.sql")
        data = path.read_bytes()
        found.append(Migration(version=int(match.group(1)), name=match.group(2),
                               sql=data.decode("utf-8"), checksum=checksum(data)))
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise ValueError(f"duplicate migration numbers in {directory}")
    by_file = {m.file: i for i, m in enumerate(found)}
    for path in sorted((directory / BEFORE).glob("*.sql")):
        if path.name not in by_file:
            raise ValueError(f"{BEFORE}/{path.name} names no migration of {directory}")
        i = by_file[path.name]
        found[i] = dataclasses.replace(found[i], before=path.read_bytes().decode("utf-8"))
    return found


@dataclass(frozen=True, kw_only=True, slots=True)
class Applied:
    """A row of ``schema_migrations``."""

    version: int
    name: str
    applied_at: datetime
    checksum: str | None  # None: applied before checksums were recorded


class Check(StrEnum):
    """How an applied migration compares with its file."""

    OK = "ok"
    CHANGED = "changed"  # the file's checksum is not the recorded one
    RENAMED = "renamed"  # the file of that number has another name
    MISSING = "missing"  # no file of that number, below this release's newest: removed
    # numbered above every file of this release: a newer release's, which this one runs on
    # (deploy/README.md: a migration keeps working for the release before it), as an old pod
    # restarted during a rollout, or a rollback, does
    NEWER = "newer"
    UNRECORDED = "unrecorded"  # applied before checksums were kept: the next migrate records it


BROKEN = frozenset({Check.CHANGED, Check.RENAMED, Check.MISSING})


@dataclass(frozen=True, kw_only=True, slots=True)
class Entry:
    """One migration as ``migrate --status`` lists it: applied (with its check) or pending."""

    version: int
    name: str
    applied_at: datetime | None  # None: pending
    check: Check | None  # None: pending
    recorded: str | None  # the checksum in schema_migrations
    current: str | None  # the file's checksum; None: no file
    file_name: str | None = None  # the file of that number, when renamed

    @property
    def label(self) -> str:
        return f"{self.version:04d}_{self.name}"

    @property
    def pending(self) -> bool:
        return self.applied_at is None


def reconcile(applied: Sequence[Applied], files: Sequence[Migration]) -> list[Entry]:
    """Every recorded and every discovered migration, by version, each applied one checked
    against its file."""
    by_version = {m.version: m for m in files}
    newest = max(by_version, default=0)
    entries: list[Entry] = []
    for row in applied:
        m = by_version.pop(row.version, None)
        if m is None:
            check = Check.NEWER if row.version > newest else Check.MISSING
        elif m.name != row.name:
            check = Check.RENAMED
        elif row.checksum is None:
            check = Check.UNRECORDED
        else:
            check = Check.OK if m.checksum == row.checksum else Check.CHANGED
        entries.append(Entry(version=row.version, name=row.name, applied_at=row.applied_at,
                             check=check, recorded=row.checksum,
                             current=m.checksum if m else None,
                             file_name=m.file if m and check is Check.RENAMED else None))
    entries.extend(Entry(version=m.version, name=m.name, applied_at=None, check=None,
                         recorded=None, current=m.checksum) for m in by_version.values())
    return sorted(entries, key=lambda e: e.version)


def problems(entries: Sequence[Entry], directory: Path) -> list[str]:
    """One sentence per applied migration that no longer matches ``directory``."""
    found: list[str] = []
    for e in entries:
        if e.check is Check.CHANGED:
            found.append(f"migration {directory / (e.label + '.sql')} changed after it was "
                         f"applied: recorded sha256 {e.recorded}, file now {e.current}; an "
                         f"applied migration must not change (restore the file and put the "
                         f"change in a new migration)")
        elif e.check is Check.RENAMED:
            found.append(f"migration {e.version:04d} was applied as {e.label} but its file is "
                         f"{directory / (e.file_name or '?')}; restore the file's name")
        elif e.check is Check.MISSING:
            found.append(f"migration {e.label} is recorded as applied but "
                         f"{directory / (e.label + '.sql')} does not exist, though later "
                         f"migrations of this release do: the file was removed (restore it)")
    return found


class DatabaseUnreachable(Exception):
    """The migrator could not connect (refused, timed out, authentication, no such database),
    or its URL cannot be used at all (``misconfigured``: a port that is no number, an unknown
    sslmode): nothing was read or applied."""

    def __init__(self, cause: BaseException, *, misconfigured: bool = False) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}" if str(cause)
                         else type(cause).__name__)
        self.cause = cause
        self.misconfigured = misconfigured
        # the server answered and said no (a password, a role, a database that does not
        # exist): reached, so no timeout is to blame. Starting up or out of connections is
        # not a refusal of what the URL says: it may answer in a moment.
        self.refused = (isinstance(cause, asyncpg.PostgresError) and not isinstance(
            cause, (asyncpg.CannotConnectNowError, asyncpg.TooManyConnectionsError)))
        # refused for a setting the URL asks for, not for who connects: asyncpg sends each
        # query parameter it does not take itself (libpq's connect_timeout, say) to the server
        # as a run-time setting, which PostgreSQL refuses when it knows no such setting
        # (42704) or not that value (22023) or cannot set it now (55P02), and PgBouncer
        # refuses unless it tracks it
        self.setting = self.refused and (
            getattr(cause, "sqlstate", None) in {"42704", "22023", "55P02"}
            or (isinstance(cause, asyncpg.ProtocolViolationError)
                and "startup parameter" in str(cause)))


# What connecting can fail with before anything is read: the network, the connect timeout,
# the server's refusal (authentication, a database that does not exist), the protocol.
_CONNECT_FAILURES = (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError)


@contextlib.asynccontextmanager
async def connecting() -> AsyncIterator[None]:
    """Connecting (a connection, or a pool's first ones): what fails before anything is read
    raised as ``DatabaseUnreachable``."""
    try:
        yield
    # the URL itself (a port beyond 65535 is OverflowError, from the socket's connect)
    except (ValueError, OverflowError, asyncpg.ClientConfigurationError) as exc:
        raise DatabaseUnreachable(exc, misconfigured=True) from exc
    except RefusedConnection as exc:  # a pool's connection refused: the server's own answer
        raise DatabaseUnreachable(exc.cause) from exc.cause
    except _CONNECT_FAILURES as exc:
        raise DatabaseUnreachable(exc) from exc


async def _connect(dsn: str, timeout: float, **options: Any) -> asyncpg.Connection:
    async with connecting():
        return await asyncpg.connect(dsn, statement_cache_size=0, timeout=timeout, **options)


class MigrationError(Exception):
    """The applied migrations do not match the files: nothing was applied."""

    def __init__(self, problems: Sequence[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = tuple(problems)


# What the server, or the connection to it, can fail with once connected: an error in a
# migration's SQL, a privilege the user lacks, a statement or lock timeout, the connection lost.
_SERVER_FAILURES = (asyncpg.PostgresError, asyncpg.InterfaceError, OSError, TimeoutError)


class MigrationFailed(Exception):
    """A migration (``migration``: its file's name without ``.sql``), or the migrator's own
    bookkeeping before it (``migration`` None), failed on the server. Its transaction did not
    commit: nothing of it is applied, while ``applied`` (applied by this call before it) stay
    applied; a migration and its record commit together, so a later run resumes at it. Only
    when the connection was lost during its COMMIT (``committing``) is whether it committed
    unknown; a later run applies it if it did not."""

    def __init__(self, cause: BaseException, *, migration: Migration | None,
                 applied: Sequence[str], committing: bool = False,
                 before: bool = False) -> None:
        self.cause = cause
        self.committing = committing
        self.migration = migration.file.removesuffix(".sql") if migration else None
        self.applied = tuple(applied)
        detail = f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__
        sqlstate = getattr(cause, "sqlstate", None)
        if isinstance(cause, asyncpg.PostgresError) and sqlstate:
            position = getattr(cause, "position", None)
            if migration is not None and position and str(position).isdigit():
                sql, file = ((migration.before or "", f"{BEFORE}/{migration.file}") if before
                             else (migration.sql, migration.file))
                line = sql[:int(position) - 1].count("\n") + 1
                detail += f" (at line {line} of {file})"
            if getattr(cause, "detail", None):
                detail += f"; {cause.detail}"
            detail += f" (SQLSTATE {sqlstate})"
        self.detail = detail
        super().__init__(f"{self.migration or 'the migrator'}: {detail}")


def _first_failure(exc: BaseException) -> BaseException:
    """What ended a transaction: a rollback on a lost connection fails too, and its error
    ("cannot call Transaction.__aexit__()") is not the cause."""
    if isinstance(exc, asyncpg.InterfaceError) and isinstance(exc.__context__,
                                                              _SERVER_FAILURES):
        return exc.__context__
    return exc


def _applied(rows: Sequence[asyncpg.Record]) -> list[Applied]:
    return [Applied(version=int(r["version"]), name=str(r["name"]), applied_at=r["applied_at"],
                    checksum=r["checksum"]) for r in rows]


async def migrate(dsn: str, directory: Path, *, target: int | None = None,
                  connect_timeout: float = 60.0) -> list[str]:
    """Apply every migration not yet applied (only those numbered up to ``target`` when given);
    returns the names applied by this call. ``MigrationError`` (and nothing applied) when an
    applied migration no longer matches its file.

    Each migration is applied in a transaction of its own that first takes the migration lock
    (``pg_advisory_xact_lock``, released when the transaction ends) and then reads what is
    applied: concurrent migrators serialize and each migration is applied once, and nothing
    outlives a transaction on the server connection, so a pooler in transaction mode may stand
    in between. The statement cache is off for the same reason. What a migration's SQL raises
    short of an error (RAISE WARNING or NOTICE) is logged as ``migration_message`` once the
    migration has committed. ``DatabaseUnreachable`` when
    it cannot connect within ``connect_timeout`` seconds; ``MigrationFailed`` when a migration
    (or the bookkeeping before it) fails on the server or the connection is lost: that
    migration is not applied, those before it are."""
    files = discover(directory)
    if target is not None and target not in {m.version for m in files}:
        raise ValueError(f"no migration numbered {target:04d} in {directory}")
    conn = await _connect(dsn, connect_timeout)
    applied_now: list[str] = []
    # What the server says while a migration runs (a count of rows it set aside, say: RAISE
    # WARNING or NOTICE), logged once the migration has committed; asyncpg drops it otherwise.
    heard: list[asyncpg.PostgresLogMessage] = []
    conn.add_log_listener(lambda _conn, message: heard.append(message))
    try:
        while True:
            todo: Migration | None = None
            said: list[asyncpg.PostgresLogMessage] = []
            committing = before = False
            try:
                async with conn.transaction():
                    await conn.execute(queries.LOCK_MIGRATIONS, MIGRATION_LOCK_KEY)
                    await conn.execute(queries.CREATE_MIGRATIONS_TABLE)
                    if not await conn.fetchval(queries.MIGRATION_CHECKSUM_EXISTS):
                        await conn.execute(queries.ADD_MIGRATION_CHECKSUM)
                    entries = reconcile(_applied(await conn.fetch(queries.APPLIED_MIGRATIONS)),
                                        files)
                    found = problems(entries, directory)
                    if found:
                        raise MigrationError(found)
                    unrecorded = [e for e in entries if e.check is Check.UNRECORDED]
                    for e in unrecorded:
                        await conn.execute(queries.BACKFILL_MIGRATION_CHECKSUM, e.version,
                                           e.current)
                    pending = {e.version for e in entries if e.pending}
                    todo = next((m for m in files if m.version in pending
                                 and (target is None or m.version <= target)), None)
                    if todo is not None:
                        heard.clear()
                        if todo.before is not None:
                            before = True
                            await conn.execute(todo.before)
                            before = False
                        await conn.execute(todo.sql)
                        said = list(heard)
                        await conn.execute(queries.RECORD_MIGRATION, todo.version, todo.name,
                                           todo.checksum)
                    committing = True
            except _SERVER_FAILURES as exc:
                # a COMMIT the server answered with an error rolled back; one whose
                # connection was lost may have committed
                raise MigrationFailed(_first_failure(exc), migration=todo, applied=applied_now,
                                      committing=committing and conn.is_closed(),
                                      before=before) from exc
            newer = [e.label for e in entries if e.check is Check.NEWER]
            if newer and todo is None:
                log("database_migrated_by_a_newer_release", logging.WARNING,
                    migrations=newer, directory=str(directory),
                    note="this release runs on the newer schema (each migration keeps working "
                         "for the release before it); roll forward again, or keep to the "
                         "release before")
            if unrecorded:
                log("migration_checksums_backfilled", logging.WARNING,
                    migrations=[e.label for e in unrecorded], directory=str(directory),
                    note="applied before checksums were recorded: recorded now from the files "
                         "on disk, which are trusted to be the ones applied")
            if todo is None:
                return applied_now
            applied_now.append(todo.file.removesuffix(".sql"))
            for message in said:
                severity = str(getattr(message, "severity", "") or "NOTICE")
                log("migration_message",
                    logging.WARNING if severity == "WARNING" else logging.INFO,
                    migration=applied_now[-1], severity=severity, message=message.message)
    finally:
        await conn.close()


async def status(dsn: str, directory: Path, *, connect_timeout: float = 60.0) -> list[Entry]:
    """The applied and pending migrations, read-only: creates, records and applies nothing
    (a database from before checksums shows its rows ``unrecorded``). ``MigrationFailed``
    (no migration named) when the server refuses the reading or the connection is lost."""
    files = discover(directory)
    conn = await _connect(dsn, connect_timeout,
                          server_settings={"application_name": "context-engine migrate"})
    try:
        async with conn.transaction(readonly=True):  # PostgreSQL refuses any write in it
            rows = (await conn.fetch(queries.APPLIED_MIGRATIONS_READ_ONLY)
                    if await conn.fetchval(queries.MIGRATIONS_TABLE_EXISTS) else [])
    except _SERVER_FAILURES as exc:  # a privilege the user lacks, the connection lost
        raise MigrationFailed(_first_failure(exc), migration=None, applied=()) from exc
    finally:
        await conn.close()
    return reconcile(_applied(rows), files)
