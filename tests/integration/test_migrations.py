"""Migrations: a fresh migrate reproduces the expected schema; re-running applies nothing;
concurrent migrators serialize on the advisory lock."""

from __future__ import annotations

import asyncio
import uuid

import asyncpg
import pytest
from context_engine.adapters.postgres.migrate import discover, migrate

from tests.conftest import REPO

pytestmark = pytest.mark.integration

EXPECTED = {
    "sessions": {"tenant_id", "session_id", "current_epoch", "created_at", "updated_at"},
    "plans": {"tenant_id", "session_id", "epoch", "reason", "spec_text", "spec", "prefix_sha256",
              "prefix_tokens", "classes", "model_id", "tokenizer", "tool_names",
              "deferred_tool_names", "skipped_tool_names", "authority_scope_hashes",
              "builder_version", "policy_version", "cache_ttl", "created_at"},
    "context_events": {"id", "tenant_id", "session_id", "epoch", "type", "payload",
                       "created_at"},
    "schema_migrations": {"version", "name", "applied_at"},
    "estimator_calibration": {"tenant_id", "model_id", "encoding", "factor", "reports",
                              "updated_at"},
    "idempotency_keys": {"tenant_id", "rpc", "key", "response", "created_at"},
    "compactions": {"tenant_id", "idempotency_key", "session_id", "fingerprint", "depth",
                    "replaced_through_sequence", "compactor_version", "result", "created_at"},
    "api_tokens": {"token_sha256", "tenant_id", "rpcs", "description", "created_at",
                   "revoked_at"},
    "epoch_usage": {"tenant_id", "session_id", "epoch", "reports", "last_input_tokens",
                    "previous_input_tokens", "updated_at"},
}


async def _fresh_database(url: str) -> str:
    name = f"ce_migrate_{uuid.uuid4().hex[:8]}"
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    base, _, query = url.partition("?")
    return f"{base.rsplit('/', 1)[0]}/{name}" + (f"?{query}" if query else "")


async def _columns(url: str) -> dict[str, set[str]]:
    conn = await asyncpg.connect(url)
    try:
        rows = await conn.fetch("SELECT table_name, column_name FROM information_schema.columns "
                                "WHERE table_schema = 'public'")
    finally:
        await conn.close()
    out: dict[str, set[str]] = {}
    for r in rows:
        out.setdefault(r["table_name"], set()).add(r["column_name"])
    return out


def test_fresh_migrate_reproduces_the_schema_and_is_idempotent(database_url):
    async def scenario() -> None:
        url = await _fresh_database(database_url)
        applied = await asyncio.gather(*(migrate(url, REPO / "migrations") for _ in range(3)))
        names = [f"{m.version:04d}_{m.name}" for m in discover(REPO / "migrations")]
        # each migration applied exactly once, by one of the three migrators
        assert sorted(n for batch in applied for n in batch) == names
        assert await _columns(url) == EXPECTED
        assert await migrate(url, REPO / "migrations") == []
    asyncio.run(scenario())


def test_migration_files_are_numbered_without_gaps():
    versions = [m.version for m in discover(REPO / "migrations")]
    assert versions == list(range(1, len(versions) + 1))
