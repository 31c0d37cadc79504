"""The README's Python snippet runs as written against a real server."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO

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


def test_readme_configuration_table_matches_the_code():
    text = (REPO / "README.md").read_text()
    documented = set(re.findall(r"^\| `([A-Z_]+)` \|", text, re.M))
    source = (REPO / "service" / "context_engine" / "config.py").read_text()
    read = set(re.findall(r'"((?:CE|DATABASE)_[A-Z_]+)"', source))
    assert read <= documented, read - documented
