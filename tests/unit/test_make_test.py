"""``make test``'s own recipe, on a copy of the Makefile with every tool a stub: ruff first,
lint's slower half (``lint-types``: mypy, buf) beside the suite, its output printed after the
suite's, either failing fails the target, and Ctrl-C stops the half running beside it (run in
the background by a non-interactive shell, it ignored SIGINT and ran on after make)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

STUB = "#!/bin/sh\necho \"{name} $*\"\n{body}\n"


def _tree(root: Path) -> dict[str, str]:
    shutil.copy(REPO / "Makefile", root / "Makefile")
    for path in ("requirements/runtime.txt", "requirements/gen.txt", "requirements/dev.txt",
                 "pyproject.toml", "clients/python/pyproject.toml"):
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text("")
    stubs = {
        ".venv/bin/python": 'sleep "${SUITE_SLEEP:-0}"; exit "${SUITE_RC:-0}"',
        ".venv/bin/ruff": "exit 0",
        ".venv/bin/mypy": 'sleep "${TYPES_SLEEP:-0}"; touch "$TYPES_DONE"; '
                          'exit "${TYPES_RC:-0}"',
        ".venv/bin/buf": "exit 0",
        "scripts/check-prereqs": "exit 0",
        "scripts/ensure-promtool": "exit 0",
        "scripts/ensure-pgbouncer": "exit 0",
        "scripts/check-contract": "exit 0",
    }
    for path, body in stubs.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(STUB.format(name=Path(path).name, body=body))
        (root / path).chmod(0o755)
    time.sleep(0.01)  # the stamps newer than what they are made from: nothing to bootstrap
    for stamp in (".venv/.runtime", ".venv/.dev", "service/context_engine/v1/.generated"):
        (root / stamp).parent.mkdir(parents=True, exist_ok=True)
        (root / stamp).touch()
    return {**os.environ, "TYPES_DONE": str(root / "types-done"), "TMPDIR": str(root)}


def _make(root: Path, env: dict[str, str], **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["make", "--no-print-directory", "test"], cwd=root,
                          env={**env, **extra}, capture_output=True, text=True, timeout=60)


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    if shutil.which("make") is None:
        pytest.fail("make is not on PATH")
    return tmp_path, _tree(tmp_path)


def test_lint_types_runs_beside_the_suite_and_either_failing_fails_it(tree) -> None:
    root, env = tree
    done = _make(root, env)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    # ruff before the suite, mypy's output printed after it
    assert out.index("ruff check") < out.index("python -m pytest") < out.index("mypy service")
    assert "buf lint" in out
    done = _make(root, env, SUITE_RC="3")
    assert done.returncode != 0 and "mypy service" in done.stdout
    done = _make(root, env, TYPES_RC="1")
    assert done.returncode != 0
    assert "lint-types failed" in done.stderr and "mypy service" in done.stdout
    assert not [p for p in root.glob("tmp.*")], "a log left behind"


def test_ctrl_c_stops_the_half_running_beside_the_suite(tree) -> None:
    root, env = tree
    proc = subprocess.Popen(["make", "--no-print-directory", "test"], cwd=root,
                            env={**env, "SUITE_SLEEP": "30", "TYPES_SLEEP": "6"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # a terminal's process group of its own
    time.sleep(2)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C sends
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode != 0
    time.sleep(6)  # long enough for mypy's stand-in to have finished, had it run on
    assert not (root / "types-done").exists(), out
    assert not [p for p in root.glob("tmp.*")], "a log left behind"
