"""The README's Python snippet and five-minute tour (``context-engine demo``) run as written
against a real server, the demo's failures are clear, its configuration table names every setting
the code reads, and ARCHITECTURE.md names only modules that exist."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import replace

import pytest
from context_engine.api.auth import token_sha256
from context_engine.cli import main

from tests.conftest import REPO, ServerThread
from tests.conftest import test_config as base_config
from tests.integration.requests import plan_request

pytestmark = pytest.mark.integration


def test_readme_snippet_calls_plan_then_build(server):
    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 1
    out = subprocess.run([sys.executable, "-c", blocks[0]], capture_output=True, text=True,
                         env={**os.environ, "CONTEXT_ENGINE_ADDR": server.address}, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("epoch 1 prefix ")
    assert lines[1].startswith("10 ROLE_USER <user source=\"user\" id=\"u1\"")
    assert any(line.startswith("10 ROLE_TOOL <untrusted") for line in lines)
    assert lines[-1].endswith("tokens")


def readme_tour_block() -> str:
    text = (REPO / "README.md").read_text()
    section = re.search(r"^## A five-minute tour\n(.*?)^## ", text, re.S | re.M)
    assert section, "README.md has no '## A five-minute tour' section"
    blocks = re.findall(r"```text\n(.*?)```", section.group(1), re.S)
    assert len(blocks) == 1, "the tour section holds exactly one text block: the tour's output"
    return blocks[0]


def demo(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``context-engine demo`` run in-process: its exit status, stdout and stderr."""
    capsys.readouterr()
    code = main(["demo", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_readme_tour_is_the_demos_output(server, db, capsys):
    # The tour is deterministic for a new session of tenant "tour"; a database kept between
    # runs (CE_TEST_DATABASE_URL) may hold it from an earlier run.
    tables = [r["table_name"] for r in db.fetch(
        "SELECT table_name FROM information_schema.columns WHERE column_name = 'tenant_id' "
        "AND table_schema = current_schema()")]
    for table in sorted(tables, key=lambda t: t == "sessions"):  # sessions last (foreign keys)
        db.fetch(f'DELETE FROM "{table}" WHERE tenant_id = $1', "tour")
    code, out, err = demo(capsys, "--addr", server.address)
    assert code == 0, err
    assert "== 6. Rotate" in out and "compaction_needed=True" in out
    assert readme_tour_block() == out, (
        "README.md's tour block is not the demo's output; paste this into it:\n" + out)


def test_the_demo_refuses_a_session_that_exists(server, stub, ids, capsys):
    _, session = ids
    stub.Plan(plan_request("tour", session))
    code, out, err = demo(capsys, "--addr", server.address, "--session", session)
    assert code == 1 and not out
    assert f"session {session!r} of tenant 'tour' exists already" in err


def test_the_demo_command_reports_an_unreachable_server():
    # A bound socket that never listens: connecting to it is refused at once.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
        out = subprocess.run([str(REPO / ".venv" / "bin" / "context-engine"), "demo",
                              "--addr", address], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and not out.stdout
    assert out.stderr.startswith(f"context-engine demo: cannot reach a context-engine server "
                                 f"at {address} (UNAVAILABLE"), out.stderr
    assert "Traceback" not in out.stderr


@pytest.fixture(scope="module")
def secured(database_url: str, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[ServerThread, str, str]]:
    """A server that requires credentials; its one token may call every RPC of one tenant."""
    tenant, token = f"tenant-{uuid.uuid4().hex[:10]}", f"token-{uuid.uuid4().hex}"
    path = tmp_path_factory.mktemp("demo") / "tokens.json"
    path.write_text(json.dumps([{"sha256": token_sha256(token), "tenant_id": tenant,
                                 "rpcs": ["*"]}]))
    server = ServerThread(replace(base_config(), dev_mode=False, auth_tokens_file=path),
                          database_url)
    yield server, tenant, token
    server.stop()


def test_the_demo_sends_its_token_as_bearer_metadata(secured, capsys):
    server, tenant, token = secured
    code, out, err = demo(capsys, "--addr", server.address, "--tenant", tenant)
    assert code == 1 and not out
    assert "GetPlan failed: UNAUTHENTICATED" in err and "pass --token" in err, err
    code, out, err = demo(capsys, "--addr", server.address, "--tenant", tenant,
                          "--token", f"not-{token}")
    assert code == 1 and "GetPlan failed: UNAUTHENTICATED" in err, err
    code, out, err = demo(capsys, "--addr", server.address, "--token", token)  # tenant "tour"
    assert code == 1 and "GetPlan failed: PERMISSION_DENIED" in err, err
    assert token not in err
    code, out, err = demo(capsys, "--addr", server.address, "--tenant", tenant,
                          "--token", token)
    assert code == 0, err
    assert out.startswith("== 1. Plan") and "== 6. Rotate" in out, out


def test_readme_configuration_table_matches_the_code():
    text = (REPO / "README.md").read_text()
    documented = set(re.findall(r"^\| `([A-Z_]+)` \|", text, re.M))
    source = (REPO / "service" / "context_engine" / "config.py").read_text()
    read = set(re.findall(r'"((?:CE|DATABASE)_[A-Z_]+)"', source))
    assert read <= documented, read - documented


def test_architecture_names_only_paths_that_exist():
    text = (REPO / "ARCHITECTURE.md").read_text()
    named = set(re.findall(r"`((?:service|tests|migrations|deploy|proto|clients)/[^`\s]*)`",
                           text))
    named |= {"service/context_engine/" + p for p in re.findall(
        r"`((?:domain|adapters|api|telemetry)/[^`\s]*|engine\.py|config\.py|cli\.py)`", text)}
    assert len(named) >= 30, sorted(named)
    missing = sorted(p for p in named if not (REPO / p.rstrip("/")).exists())
    assert not missing, missing
