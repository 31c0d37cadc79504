"""scripts/check-prereqs, which `make run` and `make test` call first: each missing tool is named
with what to do, on a PATH built for the case (a fake `node` stands for an old one)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

SCRIPT = REPO / "scripts" / "check-prereqs"


def path_with(tmp_path: Path, *, node_major: int | None, npm: bool, promtool: bool,
              kubectl: bool = True, pgbouncer: bool = True) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "id", "git", "env"):
        found = shutil.which(tool)
        assert found, tool
        (bin_dir / tool).symlink_to(found)
    (bin_dir / "python3").symlink_to(sys.executable)
    fakes = {}
    if node_major is not None:
        fakes["node"] = (f'[ "$1" = --version ] && echo v{node_major}.0.0 && exit 0\n'
                         f'exit {0 if node_major >= 20 else 1}\n')
    if npm:
        fakes["npm"] = "exit 0\n"
    if promtool:
        fakes["promtool"] = fakes["prometheus"] = "exit 0\n"
    if kubectl:
        fakes["kubectl"] = "exit 0\n"
    if pgbouncer:
        fakes["pgbouncer"] = "exit 0\n"
    for name, body in fakes.items():
        (bin_dir / name).write_text("#!/bin/sh\n" + body)
        (bin_dir / name).chmod(0o755)
    return str(bin_dir)


def run(what: str, path: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k != "CE_TEST_PGBOUNCER"}
    return subprocess.run(["/bin/bash", str(SCRIPT), what, "python3"], capture_output=True,
                          text=True, timeout=30, env={**base, "PATH": path, **env}, check=False)


def test_everything_present(tmp_path):
    done = run("test", path_with(tmp_path, node_major=20, npm=True, promtool=True))
    assert done.returncode == 0, done.stderr


def test_run_needs_no_node(tmp_path):
    done = run("run", path_with(tmp_path, node_major=None, npm=False, promtool=False))
    assert done.returncode == 0, done.stderr


def test_test_names_an_old_node_and_a_missing_npm(tmp_path):
    done = run("test", path_with(tmp_path, node_major=18, npm=False, promtool=True))
    assert done.returncode == 1
    assert "make test needs, and this machine lacks:" in done.stderr
    assert "Node.js 20+ (found v18.0.0)" in done.stderr and "npm (ships with" in done.stderr


def test_test_names_missing_promtool_when_it_cannot_be_installed(tmp_path):
    done = run("test", path_with(tmp_path, node_major=22, npm=True, promtool=False))
    assert done.returncode == 1 and "promtool and prometheus (the alerting" in done.stderr
    assert "brew install prometheus" in done.stderr


def test_test_names_a_missing_kubectl(tmp_path):
    done = run("test", path_with(tmp_path, node_major=22, npm=True, promtool=True,
                                 kubectl=False))
    assert done.returncode == 1 and "kubectl (its built-in kustomize" in done.stderr
    assert done.stderr.count("  - ") == 1


def test_test_names_a_pgbouncer_that_is_not_there(tmp_path):
    """Where the binary is named (CE_TEST_PGBOUNCER), nothing is installed: it must exist."""
    path = path_with(tmp_path, node_major=22, npm=True, promtool=True, pgbouncer=False)
    done = run("test", path, CE_TEST_PGBOUNCER=str(tmp_path / "no-pgbouncer"))
    assert done.returncode == 1 and "pgbouncer: CE_TEST_PGBOUNCER=" in done.stderr
    assert done.stderr.count("  - ") == 1
    assert run("test", path, CE_TEST_PGBOUNCER=str(Path(path) / "bash")).returncode == 0


def test_ensure_pgbouncer_finds_the_named_binary_or_fails_with_what_to_do(tmp_path):
    script = REPO / "scripts" / "ensure-pgbouncer"
    env = {**os.environ, "CE_TEST_PGBOUNCER": str(tmp_path / "no-pgbouncer")}
    done = subprocess.run(["/bin/bash", str(script)], capture_output=True, text=True,
                          timeout=30, env=env, check=False)
    assert done.returncode == 1 and "apt-get install --no-install-recommends pgbouncer" in (
        done.stderr)
    env["CE_TEST_PGBOUNCER"] = shutil.which("bash") or "/bin/bash"
    assert subprocess.run(["/bin/bash", str(script)], env=env, timeout=30,
                          check=False).returncode == 0


def test_root_with_apt_get_may_lack_promtool(tmp_path):
    """scripts/ensure-promtool installs it then; as another user it stays missing."""
    path = path_with(tmp_path, node_major=22, npm=True, promtool=False)
    (Path(path) / "apt-get").write_text("#!/bin/sh\nexit 0\n")
    (Path(path) / "apt-get").chmod(0o755)
    done = run("test", path)
    assert done.returncode == (0 if os.geteuid() == 0 else 1), done.stderr


def test_an_old_python_is_named(tmp_path):
    old = tmp_path / "python3.9"
    old.write_text("#!/bin/sh\n[ \"$1\" = -V ] && echo 'Python 3.9.2' && exit 0\nexit 1\n")
    old.chmod(0o755)
    done = subprocess.run(["/bin/bash", str(SCRIPT), "run", str(old)], capture_output=True,
                          text=True, timeout=30, check=False)
    assert done.returncode == 1 and "is Python 3.9.2" in done.stderr
