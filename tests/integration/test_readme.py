"""The README's Python snippet and five-minute tour run as written against a real server, its
configuration table names every setting the code reads, and ARCHITECTURE.md names only modules
that exist."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO
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


def test_readme_tour_is_the_tours_output(server, db):
    # The tour is deterministic for a new session of tenant "tour"; a database kept between
    # runs (CE_TEST_DATABASE_URL) may hold it from an earlier run.
    tables = [r["table_name"] for r in db.fetch(
        "SELECT table_name FROM information_schema.columns WHERE column_name = 'tenant_id' "
        "AND table_schema = current_schema()")]
    for table in sorted(tables, key=lambda t: t == "sessions"):  # sessions last (foreign keys)
        db.fetch(f'DELETE FROM "{table}" WHERE tenant_id = $1', "tour")
    out = subprocess.run([sys.executable, "-m", "tests.support.tour", server.address],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "== 6. Rotate" in out.stdout and "compaction_needed=True" in out.stdout
    assert readme_tour_block() == out.stdout, (
        "README.md's tour block is not the tour's output; paste this into it:\n" + out.stdout)


def test_the_tour_refuses_a_session_that_exists(server, stub, ids):
    _, session = ids
    stub.Plan(plan_request("tour", session))
    out = subprocess.run([sys.executable, "-m", "tests.support.tour", server.address,
                          "--session", session], capture_output=True, text=True, cwd=REPO,
                         timeout=60)
    assert out.returncode == 1 and "exists already" in out.stderr and not out.stdout


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
