"""``context-engine inspect`` against a session made through the real gRPC server."""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import pytest
from context_engine.adapters.postgres.inspect import connect_read_only
from context_engine.cli import main
from context_engine.config import Pooler
from context_engine.inspect import inspect_session
from context_engine.v1 import context_engine_pb2 as pb

from tests.integration.requests import build_request, item, plan_request

pytestmark = pytest.mark.integration

SMALL = pb.ModelSpec(model_id="acme-16k", capabilities=pb.ModelCapabilities(
    context_window=16_000, output_reserve=4_000))
# Texts the session's requests carry; none may ever reach inspect's output.
CONTENT = ("You are a helpful agent", "Fetch a web page", "lorem ipsum", "question 3",
           "answer 3", "passage passage", "and now?")


def history(n: int) -> list[pb.ConversationItem]:
    """An earlier run's fetches, too long for a 16k window, then a new user message."""
    items: list[pb.ConversationItem] = []
    seq = 0
    for i in range(n):
        items += [
            item(f"u{i}", seq + 1, run="run-0", user=pb.UserMessage(text=f"question {i}")),
            item(f"c{i}", seq + 2, run="run-0", tool_calls=pb.ToolCalls(calls=[pb.ToolCall(
                call_id=f"k{i}", name="web.fetch", arguments_json='{"url":"https://e.x"}')])),
            item(f"r{i}", seq + 3, pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED, run="run-0",
                 tool_result=pb.ToolResult(call_id=f"k{i}", tool_name="web.fetch",
                                           content=f"page {i} " + "lorem ipsum " * 1_500,
                                           event_id=1000 + i)),
            item(f"a{i}", seq + 4, run="run-0",
                 assistant=pb.AssistantMessage(text=f"answer {i} " + "word " * 300))]
        seq += 4
    return [*items, item("now", seq + 1, run="run-1", user=pb.UserMessage(text="and now?"))]


@dataclass
class Made:
    tenant: str
    session: str
    first: pb.ContextPlan
    second: pb.ContextPlan


def make_session(stub, ids) -> Made:
    """Epoch 1 (session_opened) with one Build under pressure, then epoch 2
    (security_revocation of the only deferred tool)."""
    tenant, session = ids
    first = stub.Plan(plan_request(tenant, session, model=SMALL)).plan
    req = build_request(tenant, session, items=history(40))
    req.checkpoint.knowledge.extend([
        pb.KnowledgePassage(id=f"k{i}", source="doc", text="passage " * 200, rank=i,
                            trust=pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED) for i in range(3)])
    assert stub.Build(req).pressure.steps
    second = stub.Rotate(pb.RotateRequest(
        tenant_id=tenant, session_id=session, reason=pb.ROTATION_REASON_SECURITY_REVOCATION,
        drop_tools=["mail.send"], idempotency_key="revoke-mail")).plan
    assert second.epoch == 2
    return Made(tenant=tenant, session=session, first=first, second=second)


def inspect(url: str, made: Made, **kw) -> tuple[int, str, str]:
    """``url`` is the suite's pooler (transaction mode), as the CLI's CE_DB_POOLER says."""
    out, err = io.StringIO(), io.StringIO()
    code = asyncio.run(inspect_session(url, made.tenant, made.session, out=out, err=err,
                                       pooler=Pooler.TRANSACTION, **kw))
    return code, out.getvalue(), err.getvalue()


def cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DATABASE_URL": url}
    return subprocess.run([str(Path(sys.executable).parent / "context-engine"), "inspect", *args],
                          capture_output=True, text=True, env=env, timeout=60)


def assert_no_content(text: str) -> None:
    for canary in CONTENT:
        assert canary not in text


def test_table_shows_epochs_tools_classes_and_events(stub, ids, database_url, db):
    made = make_session(stub, ids)
    code, out, err = inspect(database_url, made)
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert f"session {made.session}  tenant {made.tenant}" in lines[0]
    assert "current epoch 2" in lines[1]
    epochs = lines[lines.index("EPOCHS (2)") + 1:lines.index("PREFIX TOKENS BY CLASS") - 1]
    assert epochs[0].split()[:6] == ["EPOCH", "REASON", "CREATED", "(UTC)", "PREFIX_SHA256",
                                     "TOKENS"]
    row1, row2 = (r.split() for r in epochs[1:])
    assert (row1[0], row1[1], row1[4], row1[5]) == (
        "1", "session_opened", made.first.prefix_sha256, str(made.first.prefix_tokens))
    assert (row2[0], row2[1], row2[4], row2[5]) == (
        "2", "security_revocation", made.second.prefix_sha256, str(made.second.prefix_tokens))
    # every table is aligned: each column starts at the same offset in every row
    assert epochs[1].index(made.first.prefix_sha256) == epochs[2].index(
        made.second.prefix_sha256) == epochs[0].index("PREFIX_SHA256")

    classes = lines[lines.index("PREFIX TOKENS BY CLASS") + 1:lines.index("TOOLS") - 1]
    header = classes[0].split()
    tokens = dict(zip(header, classes[1].split(), strict=True))
    assert tokens["EPOCH"] == "1"
    assert sum(int(v) for k, v in tokens.items() if k != "EPOCH") == made.first.prefix_tokens

    tools = lines[lines.index("TOOLS") + 1:lines.index("TOOLS") + 4]
    assert "mail.send" in tools[1] and "tool.call" in tools[1] and "web.fetch" in tools[1]
    assert "mail.send" not in tools[2] and "tool.call" not in tools[2]

    events = [line for line in lines if line.startswith("EVENTS")]
    assert events == ["EVENTS (last 3 of 3)"]
    ids_in_db = [r["id"] for r in db.fetch(
        "SELECT id FROM context_events WHERE tenant_id=$1 ORDER BY id", made.tenant)]
    rows = lines[lines.index(events[0]) + 2:]
    assert [int(r.split()[0]) for r in rows] == ids_in_db
    assert [r.split()[4] for r in rows] == [
        "context.plan.created", "context.budget.pressure", "context.epoch.rotated"]
    assert "steps=knowledge(" in rows[1] and "fits=true" in rows[1]
    assert "reason=security_revocation" in rows[2]
    assert made.second.prefix_sha256[:12] + "..." in rows[2]
    assert_no_content(out)


def test_json_is_one_document_with_the_stored_rows(stub, ids, database_url, db):
    made = make_session(stub, ids)
    code, out, _ = inspect(database_url, made, as_json=True)
    assert code == 0
    doc = json.loads(out)
    assert (doc["tenant_id"], doc["session_id"], doc["current_epoch"]) == (
        made.tenant, made.session, 2)
    e1, e2 = doc["epochs"]
    for got, plan in ((e1, made.first), (e2, made.second)):
        assert (got["epoch"], got["reason"], got["prefix_sha256"], got["prefix_tokens"]) == (
            plan.epoch, plan.reason, plan.prefix_sha256, plan.prefix_tokens)
        assert got["tool_names"] == list(plan.tool_names)
        assert got["deferred_tool_names"] == list(plan.deferred_tool_names)
        assert got["skipped_tool_names"] == list(plan.skipped_tool_names)
        assert sum(c["tokens"] for c in got["classes"]) == plan.prefix_tokens
    assert e1["deferred_tool_names"] == ["mail.send"] and e2["deferred_tool_names"] == []
    stored = db.fetch("SELECT id, type, payload::text AS payload FROM context_events "
                      "WHERE tenant_id=$1 ORDER BY id", made.tenant)
    assert doc["events_total"] == 3
    assert [(e["id"], e["type"], e["payload"]) for e in doc["events"]] == [
        (r["id"], r["type"], json.loads(r["payload"])) for r in stored]
    assert doc["events"][2]["payload"]["prefix_sha256"] == made.second.prefix_sha256
    assert_no_content(out)


def test_events_limit_and_one_epoch_in_detail(stub, ids, database_url):
    made = make_session(stub, ids)
    code, out, _ = inspect(database_url, made, events=1, as_json=True)
    doc = json.loads(out)
    assert code == 0 and doc["events_total"] == 3
    assert [e["type"] for e in doc["events"]] == ["context.epoch.rotated"]  # the latest

    code, out, _ = inspect(database_url, made, epoch=1)
    assert code == 0
    assert "EPOCH 1" in out.splitlines() and "(current)" not in out
    assert made.first.prefix_sha256 in out and made.second.prefix_sha256 not in out
    assert "reason           session_opened" in out
    assert "EVENTS OF EPOCH 1 (last 2 of 2)" in out
    assert "context.plan.created" in out and "context.budget.pressure" in out
    assert "context.epoch.rotated" not in out
    assert "tool_definitions" in out and "ITEM_CAP" in out
    assert_no_content(out)

    code, out, _ = inspect(database_url, made, epoch=2, events=0, as_json=True)
    doc = json.loads(out)
    assert code == 0 and [e["epoch"] for e in doc["epochs"]] == [2]
    assert doc["events"] == [] and doc["events_total"] == 1 and doc["epoch_filter"] == 2


def test_the_command_line_prints_both_forms(stub, ids, database_url):
    made = make_session(stub, ids)
    table = cli(database_url, "--tenant", made.tenant, "--session", made.session)
    assert table.returncode == 0, table.stderr
    for text in (made.first.prefix_sha256, made.second.prefix_sha256, "session_opened",
                 "security_revocation", "context.budget.pressure", "EVENTS (last 3 of 3)"):
        assert text in table.stdout
    as_json = cli(database_url, "--tenant", made.tenant, "--session", made.session, "--json",
                  "--events", "2")
    assert as_json.returncode == 0, as_json.stderr
    doc = json.loads(as_json.stdout)  # nothing but the document on stdout
    assert [e["prefix_sha256"] for e in doc["epochs"]] == [made.first.prefix_sha256,
                                                           made.second.prefix_sha256]
    assert [e["type"] for e in doc["events"]] == ["context.budget.pressure",
                                                  "context.epoch.rotated"]
    assert_no_content(table.stdout + as_json.stdout)


def test_it_reads_only(stub, ids, database_url, direct_database_url, db):
    made = make_session(stub, ids)
    before = db.counts(made.tenant)
    keys = db.val("SELECT count(*) FROM idempotency_keys WHERE tenant_id=$1", made.tenant)
    updated = db.val("SELECT updated_at FROM sessions WHERE tenant_id=$1", made.tenant)
    for kw in ({}, {"as_json": True}, {"epoch": 1}):
        assert inspect(database_url, made, **kw)[0] == 0
    assert db.counts(made.tenant) == before
    assert db.val("SELECT count(*) FROM idempotency_keys WHERE tenant_id=$1", made.tenant) == keys
    assert db.val("SELECT updated_at FROM sessions WHERE tenant_id=$1", made.tenant) == updated

    async def write_through_inspects_connection() -> None:
        # connected directly, the connection's transactions default to READ ONLY
        conn = await connect_read_only(direct_database_url)
        try:
            assert await conn.fetchval("SHOW default_transaction_read_only") == "on"
            with pytest.raises(asyncpg.ReadOnlySQLTransactionError):
                await conn.execute("INSERT INTO sessions (tenant_id, session_id) "
                                   "VALUES ($1, 'written')", made.tenant)
        finally:
            await conn.close()
        # behind the pooler no session default holds: read_session's transaction refuses
        conn = await connect_read_only(database_url, pooler=Pooler.TRANSACTION)
        try:
            async with conn.transaction(isolation="repeatable_read", readonly=True):
                with pytest.raises(asyncpg.ReadOnlySQLTransactionError):
                    await conn.execute("INSERT INTO sessions (tenant_id, session_id) "
                                       "VALUES ($1, 'written')", made.tenant)
        finally:
            await conn.close()

    asyncio.run(write_through_inspects_connection())
    assert db.counts(made.tenant) == before


def test_unknown_session_or_epoch_exits_1(stub, ids, database_url):
    made = make_session(stub, ids)
    code, out, err = inspect(database_url, Made(tenant=made.tenant, session="no-such-session",
                                                first=made.first, second=made.second))
    assert (code, out) == (1, "") and "no session 'no-such-session'" in err
    code, out, err = inspect(database_url, Made(tenant="other-tenant", session=made.session,
                                                first=made.first, second=made.second))
    assert (code, out) == (1, "") and "no session" in err  # another tenant's session is unknown
    code, out, err = inspect(database_url, made, epoch=3)
    assert (code, out) == (1, "") and "has no epoch 3 (current epoch 2)" in err
    proc = cli(database_url, "--tenant", made.tenant, "--session", "no-such-session")
    assert (proc.returncode, proc.stdout) == (1, "") and "no session" in proc.stderr


@pytest.mark.parametrize("args", [
    ["--tenant", "t"],  # no session
    ["--tenant", "t", "--session", "s", "--events", "-1"],
    ["--tenant", "t", "--session", "s", "--events", "many"],
    ["--tenant", "t", "--session", "s", "--epoch", "0"],
    ["--tenant", "", "--session", "s"],
    # past PostgreSQL's integer: the query failed (DataError) and exited 1
    ["--tenant", "t", "--session", "s", "--epoch", "99999999999"],
    ["--tenant", "t", "--session", "s", "--events", "99999999999999999999"],
])
def test_bad_arguments_exit_2(args, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["inspect", *args])
    assert exited.value.code == 2
    assert "inspect" in capsys.readouterr().err


def test_without_database_url_it_needs_an_existing_embedded_database(tmp_path, monkeypatch,
                                                                     capsys):
    monkeypatch.delenv("DATABASE_URL", raising=False)
    monkeypatch.setenv("CE_DATA_DIR", str(tmp_path / "data"))
    assert main(["inspect", "--tenant", "t", "--session", "s"]) == 1
    assert "DATABASE_URL is not set" in capsys.readouterr().err
    assert not (tmp_path / "data").exists()  # nothing was created
    # a pg/ a first start left without a cluster (or an empty volume mounted there): once
    # taken for a database, and a cluster was made there to inspect nothing in
    (tmp_path / "data" / "pg").mkdir(parents=True)
    assert main(["inspect", "--tenant", "t", "--session", "s"]) == 1
    assert "DATABASE_URL is not set" in capsys.readouterr().err
    assert list((tmp_path / "data" / "pg").iterdir()) == []


def test_a_database_it_cannot_use_or_reach_is_one_line_in_its_time(tmp_path):
    """A port that is no number printed ValueError's traceback (one beyond 65535,
    OverflowError's); a server that never answers
    held inspect 10 s whatever CE_DB_TIMEOUT_SECONDS said (its connection's timeout was
    fixed). Both are one line naming the URL now, the second within the configured time."""
    import socket
    import time

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)  # accepts, never answers
    try:
        cases = [("postgresql://u@localhost:abc/ce", "cannot use the database URL"),
                 ("postgresql://u@127.0.0.1:99999/ce", "cannot use the database URL"),
                 (f"postgresql://u@127.0.0.1:{silent.getsockname()[1]}/ce",
                  "cannot reach the database")]
        for url, said in cases:
            began = time.monotonic()
            done = subprocess.run(
                [str(Path(sys.executable).parent / "context-engine"), "inspect", "--tenant",
                 "t", "--session", "s"], capture_output=True, text=True, timeout=60,
                env={**os.environ, "DATABASE_URL": url, "CE_DB_TIMEOUT_SECONDS": "1"})
            took = time.monotonic() - began
            assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
            (line,) = done.stderr.strip().splitlines()
            assert line.startswith(f"context-engine inspect: {said} (DATABASE_URL "), line
            assert took < 6, took  # 10 s before, whatever CE_DB_TIMEOUT_SECONDS said
    finally:
        silent.close()
