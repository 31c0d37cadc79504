"""The image is correct by construction: what it copies exists, its entrypoint is the
package's console script, and its command is a CLI subcommand."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest
from context_engine.cli import main

REPO = Path(__file__).resolve().parents[2]


def _dockerfile() -> str:
    return (REPO / "Dockerfile").read_text()


def test_every_copied_path_exists():
    for line in _dockerfile().splitlines():
        if line.startswith("COPY") and "--from=" not in line:
            sources = line.split()[1:-1]
            for src in sources:
                assert (REPO / src).exists(), src


def test_entrypoint_and_command_exist():
    text = _dockerfile()
    entry = json.loads(re.search(r"^ENTRYPOINT (.*)$", text, re.M).group(1))
    cmd = json.loads(re.search(r"^CMD (.*)$", text, re.M).group(1))
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert entry == ["context-engine"] and "context-engine" in scripts
    assert cmd == ["serve"]
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--help"])
    assert exc.value.code == 0


def test_image_runs_as_non_root_and_exposes_the_default_ports():
    text = _dockerfile()
    assert re.search(r"^USER 10001$", text, re.M)
    assert re.search(r"^EXPOSE 50051 9464$", text, re.M)
    assert "CE_GRPC_ADDR=0.0.0.0:50051" in text and "CE_METRICS_ADDR=0.0.0.0:9464" in text


def test_runtime_stage_installs_only_runtime_requirements():
    runtime = _dockerfile().split("AS runtime", 1)[1]
    assert "requirements/runtime.txt" in runtime and "dev.txt" not in runtime
    pinned = (REPO / "requirements" / "runtime.txt").read_text().splitlines()
    for line in pinned:
        if line and not line.startswith("#"):
            assert re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][A-Za-z0-9_.+-]*", line), line
