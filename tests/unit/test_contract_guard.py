"""`make lint` holds the proto to the released contract (scripts/check-contract, buf breaking
against contract/context_engine.v1.binpb): an incompatible change fails, a compatible one passes,
and a new contract version (a new package) is the way out. Each case runs the script itself on a
copy of the tree."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

PROTO = Path("proto/context_engine/v1/context_engine.proto")
BUF = Path(sys.executable).parent / "buf"


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    for name in ("buf.yaml", "proto", "contract", "scripts"):
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, tmp_path / name)
        else:
            shutil.copy(source, tmp_path / name)
    return tmp_path


def check(tree: Path) -> subprocess.CompletedProcess[str]:
    assert BUF.exists(), f"buf is not installed in the venv ({BUF})"
    return subprocess.run([str(tree / "scripts" / "check-contract"), str(BUF)], cwd=tree,
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ), check=False)


def edit(tree: Path, old: str, new: str) -> None:
    path = tree / PROTO
    text = path.read_text()
    assert text.count(old) == 1, old
    path.write_text(text.replace(old, new))


def test_the_proto_as_it_is_matches_the_released_contract(tree):
    done = check(tree)
    assert done.returncode == 0, done.stderr
    assert "compatible with context_engine.v1 as released" in done.stdout


@pytest.mark.parametrize(("old", "new", "complaint"), [
    ("  string policy_version = 17;", "  int64 policy_version = 17;", "changed type"),
    ("  string policy_version = 17;", "  string policy_version = 99;", "17"),
    ("  string policy_version = 17;", "  reserved 17;", "deleted"),
], ids=["type", "number", "deleted"])
def test_an_incompatible_change_fails(tree, old, new, complaint):
    edit(tree, old, new)
    done = check(tree)
    assert done.returncode != 0
    assert complaint in done.stdout + done.stderr
    assert "release a new contract version" in done.stderr


def test_a_renamed_rpc_fails(tree):
    text = (tree / PROTO).read_text()
    assert re.search(r"rpc GetPlan\(", text)
    (tree / PROTO).write_text(text.replace("rpc GetPlan(", "rpc FetchPlan("))
    done = check(tree)
    assert done.returncode != 0 and "GetPlan" in done.stdout


def test_a_compatible_change_passes(tree):
    edit(tree, "  string policy_version = 17;",
         "  string policy_version = 17;\n  string added_later = 9001;")
    done = check(tree)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_new_contract_version_is_the_way_to_break(tree):
    """Moving the contract to context_engine.v2 (a new package) is a version change: the v1
    release no longer binds it."""
    old_dir = tree / "proto" / "context_engine" / "v1"
    new_dir = tree / "proto" / "context_engine" / "v2"
    old_dir.rename(new_dir)
    proto = new_dir / "context_engine.proto"
    text = proto.read_text().replace("package context_engine.v1;", "package context_engine.v2;")
    proto.write_text(text.replace("  string policy_version = 17;", "  int64 policy_version = 17;"))
    done = check(tree)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "contract's version changed" in done.stdout


def test_no_released_contract_is_an_error(tree):
    shutil.rmtree(tree / "contract")
    (tree / "contract").mkdir()
    done = check(tree)
    assert done.returncode != 0 and "no released contract" in done.stderr
