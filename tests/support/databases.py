"""Databases of a test's own on the suite's PostgreSQL, for tests that move time or rewrite the
schema and so must not share the suite's database."""

from __future__ import annotations

import uuid
from urllib.parse import urlsplit, urlunsplit

import asyncpg


def with_database(url: str, name: str) -> str:
    """``url`` naming database ``name`` instead of its own (the query string is kept)."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{name}"))


async def create_database(direct_url: str, prefix: str = "ce_test") -> str:
    """A new empty database on the server of ``direct_url`` (PostgreSQL itself, not a pooler:
    CREATE DATABASE cannot run through one in transaction mode); returns its name."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    conn = await asyncpg.connect(direct_url)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    return name


async def drop_database(direct_url: str, name: str) -> None:
    conn = await asyncpg.connect(direct_url)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()
