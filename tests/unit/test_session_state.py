"""Nothing the service runs keeps state on a database session past its transaction, so a pooler
in transaction mode may hand each transaction to another server connection: no session-level
advisory lock, SET (only SET LOCAL), LISTEN, temporary table, WITH HOLD cursor or PREPARE, in
the service's code or its migrations (``tests/integration/test_pooler.py`` runs it behind one)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCES = sorted([*(REPO / "service" / "context_engine").rglob("*.py"),
                  *(REPO / "migrations").glob("*.sql")])
SOURCES = [p for p in SOURCES if "/v1/" not in p.as_posix()]  # generated code

# A statement's start: the file's, or after ";", a quote or "(" (SQL in a Python string),
# across white space and comment lines (so "DO UPDATE\nSET" is not one).
START = r"""(?:\A|[;"'(])(?:\s|--[^\n]*\n)*"""
SESSION_STATE = {
    "a session-level advisory lock": re.compile(
        r"pg_(?:try_)?advisory_(?:lock|lock_shared|unlock|unlock_shared|unlock_all)\s*\(", re.I),
    "a session setting (SET without LOCAL)": re.compile(
        START + r"SET\s+(?!LOCAL\b|TRANSACTION\b|CONSTRAINTS\b)(?:SESSION\s+)?"
        r"[a-z_][a-z_.]*\s*(?:=|\bTO\b)", re.I),
    "set_config(..., false)": re.compile(r"set_config\s*\([^)]*,\s*false\s*\)", re.I),
    "LISTEN": re.compile(START + r"(?:UN)?LISTEN\s", re.I),
    "a temporary table": re.compile(r"CREATE\s+(?:GLOBAL\s+|LOCAL\s+)?TEMP(?:ORARY)?\s", re.I),
    "a WITH HOLD cursor": re.compile(r"CURSOR\s+WITH\s+HOLD", re.I),
    "a prepared statement by name": re.compile(START + r"PREPARE\s+\w+", re.I),
}


def test_there_are_sources() -> None:
    assert any(p.suffix == ".sql" for p in SOURCES) and any(p.suffix == ".py" for p in SOURCES)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_no_session_state(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    found = [f"{what}: {m.group(0).strip()!r}" for what, pattern in SESSION_STATE.items()
             for m in pattern.finditer(text)]
    assert not found, found


@pytest.mark.parametrize("sql, what", [
    ("SELECT pg_advisory_lock($1)", "a session-level advisory lock"),
    ("SELECT pg_try_advisory_lock(1)", "a session-level advisory lock"),
    ('X = "SET statement_timeout = 5"', "a session setting (SET without LOCAL)"),
    ("SET search_path TO app", "a session setting (SET without LOCAL)"),
    ("SELECT 1;\n-- then\nSET work_mem = '1GB';", "a session setting (SET without LOCAL)"),
    ("SELECT set_config('a.b', 'c', false)", "set_config(..., false)"),
    ("LISTEN events", "LISTEN"),
    ("CREATE TEMP TABLE t (a int)", "a temporary table"),
    ("DECLARE c CURSOR WITH HOLD FOR SELECT 1", "a WITH HOLD cursor"),
    ("PREPARE q AS SELECT 1", "a prepared statement by name"),
])
def test_each_kind_is_found(sql: str, what: str) -> None:
    assert SESSION_STATE[what].search(sql)


@pytest.mark.parametrize("sql", [
    "SELECT pg_advisory_xact_lock($1)", "SELECT pg_try_advisory_xact_lock($1)",
    "SET LOCAL lock_timeout = '5s'", "UPDATE sessions SET current_epoch = $3",
    "INSERT INTO t VALUES (1) ON CONFLICT (k) DO UPDATE\nSET factor = EXCLUDED.factor",
    "SET TRANSACTION READ ONLY", "SELECT set_config('a.b', 'c', true)",
])
def test_transaction_scoped_forms_pass(sql: str) -> None:
    assert not any(p.search(sql) for p in SESSION_STATE.values()), sql
