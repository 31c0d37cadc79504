"""Forward-only migrations: numbered SQL files applied in order under an advisory lock."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import asyncpg

from context_engine.adapters.postgres import queries

# Arbitrary but fixed key of the advisory lock that serializes migrators.
MIGRATION_LOCK_KEY = 0x636F6E74  # "cont"
_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


@dataclass(frozen=True, kw_only=True, slots=True)
class Migration:
    version: int
    name: str
    sql: str


def discover(directory: Path) -> list[Migration]:
    found: list[Migration] = []
    for path in sorted(directory.glob("*.sql")):
        match = _NAME.match(path.name)
        if not match:
            raise ValueError(f"migration file {path.name} is not named NNNN_description.sql")
        found.append(Migration(version=int(match.group(1)), name=match.group(2),
                               sql=path.read_text(encoding="utf-8")))
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise ValueError(f"duplicate migration numbers in {directory}")
    return found


async def migrate(dsn: str, directory: Path) -> list[str]:
    """Apply every migration not yet applied; returns the names applied by this call."""
    conn = await asyncpg.connect(dsn)
    applied_now: list[str] = []
    try:
        await conn.execute(queries.LOCK_MIGRATIONS, MIGRATION_LOCK_KEY)
        try:
            await conn.execute(queries.CREATE_MIGRATIONS_TABLE)
            done = {r["version"] for r in await conn.fetch(queries.APPLIED_MIGRATIONS)}
            for m in discover(directory):
                if m.version in done:
                    continue
                async with conn.transaction():
                    await conn.execute(m.sql)
                    await conn.execute(queries.RECORD_MIGRATION, m.version, m.name)
                applied_now.append(f"{m.version:04d}_{m.name}")
        finally:
            await conn.execute(queries.UNLOCK_MIGRATIONS, MIGRATION_LOCK_KEY)
    finally:
        await conn.close()
    return applied_now
