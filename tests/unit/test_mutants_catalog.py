"""The deliberate bugs of ``make mutants`` stay applicable: each patch names its bug and the tests
that kill it, applies cleanly to the tree as it is (a patch that no longer applies would
quietly stop testing anything), and leaves the Python it touches compiling (a patch applied
out of place can break the syntax, and a module that does not import "kills" every mutant
without testing one)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import WHOLE_SUITE
from tests.mutants.run import HERE, REPO, TIMED_OUT, Mutant, catalog, verdict
from tests.mutants.run import pytest as run_pytest
from tests.mutants.selections import Collected

MUTANTS = catalog()


def touched_by(mutant: Mutant) -> list[str]:
    """The paths a mutant's patch changes (without a timestamp after them)."""
    return [line[6:].split("\t")[0] for line in mutant.patch.read_text().splitlines()
            if line.startswith("+++ b/")]


def test_there_are_mutants() -> None:
    assert len(MUTANTS) >= 1
    assert len({m.name for m in MUTANTS}) == len(MUTANTS)


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_mutant_applies_and_leaves_the_python_it_touches_compiling(mutant: object,
                                                                  tmp_path: Path) -> None:
    """Applied to a copy of the files it touches (the tree's as they are: a patch that applies
    there applies to the tree), it changes each, and each Python file compiles."""
    assert isinstance(mutant, Mutant)
    assert mutant.patch.parent == HERE
    assert mutant.bug and mutant.killed_by
    touched = touched_by(mutant)
    product = ("service/", "clients/", "scripts/", "deploy/", "Makefile")
    assert touched and all(p.startswith(product) for p in touched), touched
    for path in touched:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / path, tmp_path / path)
    done = subprocess.run(["git", "apply", "--whitespace=nowarn", str(mutant.patch)],
                          cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    for path in touched:
        patched = (tmp_path / path).read_text(encoding="utf-8")
        assert patched != (REPO / path).read_text(encoding="utf-8"), f"{path} unchanged"
        if path.endswith(".py"):
            compile(patched, path, "exec")  # a SyntaxError fails the mutant here


def test_the_readme_lists_every_mutant() -> None:
    """The mutants table lists each mutant once, and nothing else (a row elsewhere, in another
    table, once passed for a listed one)."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    start = readme.index("The mutants and what kills each:")
    table = readme[start:readme.index("\n\n", readme.index("|---|", start))]
    rows = re.findall(r"^\| `(\w+)` \|", table, re.M)
    assert sorted(rows) == sorted(m.name for m in MUTANTS), (
        f"README's mutants table: missing {sorted({m.name for m in MUTANTS} - set(rows))}, "
        f"not a mutant {sorted(set(rows) - {m.name for m in MUTANTS})}, "
        f"listed twice {sorted({r for r in rows if rows.count(r) > 1})}")


def test_the_readme_counts_the_mutants() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    stated = re.findall(r"There are (\d+) mutants\.", readme)
    assert stated == [str(len(MUTANTS))], stated


def test_only_a_failing_test_kills_a_mutant() -> None:
    # pytest's exit statuses: 1 tests failed, 0 passed, 5 none collected, 2 interrupted (a
    # collection error), 3 internal error, 4 usage error
    assert [verdict(code) for code in (1, 0, 5, 2, 3, 4)] == [
        "killed", "SURVIVED", "SURVIVED", "ERROR", "ERROR", "ERROR"]
    # a TypeScript patch that does not compile fails the client's build, testing nothing
    tsc = "src/incremental.ts(544,14): error TS2339: Property 'x' does not exist on type 'Y'."
    assert verdict(1, f"npm run build failed (exit 2):\n{tsc}") == "ERROR"
    assert verdict(1, "AssertionError: a Build naming a base is kept anyway") == "killed"
    assert verdict(TIMED_OUT) == "TIMEOUT"  # a hang is not a failing test


def _gone(pid: int) -> bool:
    """The process has ended (or is a zombie its killed parent left to init to reap)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
                return True
        except OSError:
            return True
        time.sleep(0.1)
    return False


def test_a_hanging_run_is_stopped_with_everything_it_started(tmp_path: Path) -> None:
    """A selection that hangs is stopped at the timeout with what it started: a child in its
    process group (as a server fixture starts one), and one detached into a session of its
    own whose command line names a path under the run's temporary directory (as pg_ctl
    starts an embedded PostgreSQL, its data directory under TMPDIR)."""
    (tmp_path / "test_hang.py").write_text(
        "import os, subprocess, sys, tempfile, time\n"
        "SLEEP = 'import time; time.sleep(600)'\n"
        "def test_hangs():\n"
        "    child = subprocess.Popen([sys.executable, '-c', SLEEP])\n"
        "    data = os.path.join(tempfile.mkdtemp(), 'pg')\n"
        "    detached = subprocess.Popen([sys.executable, '-c', SLEEP, '-D', data],\n"
        "                                start_new_session=True)\n"
        "    open('pids', 'w').write(f'{child.pid} {detached.pid}')\n"
        "    time.sleep(600)\n")
    # long enough for the inner pytest to reach its test on a loaded machine (5 s once stopped
    # it before the test had started anything)
    code, secs = run_pytest(tmp_path, ("test_hang.py",), tmp_path / "log", timeout=15)
    assert code == TIMED_OUT and secs < 60
    child, detached = map(int, (tmp_path / "pids").read_text().split())
    assert _gone(child), "the child outlived the run"
    assert _gone(detached), "the detached server outlived the run"


def test_every_mutants_selection_runs_a_test(request: pytest.FixtureRequest,
                                            tmp_path: Path) -> None:
    """A selection that selects no test kills nothing: ``make mutants`` finds it only when it
    runs (pytest's exit 5 on the unmutated tree). Each selection's paths, ``-k`` and ``-m``
    are matched by pytest's own matchers (``tests/mutants/selections.py``) against the suite
    as this run collected it where it collected all of it (``make test``, in each of xdist's
    processes alike), else as collected once in a process of its own, with
    ``--assert=plain``: nothing runs there, so rewriting every test module's asserts (most of
    that collection's time where no bytecode is kept, as under ``PYTHONDONTWRITEBYTECODE``)
    would buy nothing."""
    selections = {m.name: list(m.killed_by) for m in MUTANTS}
    whole = request.config.stash.get(WHOLE_SUITE, None)
    if whole is not None:
        collected = Collected.of(whole)
        counts = {name: collected.selected(args, REPO) for name, args in selections.items()}
    else:
        source, target = tmp_path / "selections.json", tmp_path / "counts.json"
        source.write_text(json.dumps(selections))
        env = {**os.environ, "CE_MUTANT_SELECTIONS": str(source),
               "CE_MUTANT_SELECTIONS_OUT": str(target)}
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", "--assert=plain",
             "-p", "no:cacheprovider", "-p", "no:xdist", "-p", "no:randomly",
             "-p", "tests.mutants.selections", "tests"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert target.exists(), done.stdout[-2000:] + done.stderr[-2000:]
        counts = json.loads(target.read_text())
    assert set(counts) == {m.name for m in MUTANTS}
    empty = sorted(name for name, count in counts.items() if count == 0)
    assert not empty, f"selections that run no test: {empty}"



def test_the_run_is_taken_for_the_whole_suite_only_when_it_collected_every_test_file() -> None:
    """What the selection check counts against: the run's collection only when it holds every
    test file under ``tests/`` (``--ignore`` and ``--lf`` leave out files, not paths: taken
    for the whole suite, every selection into them counted 0); else a collection apart."""
    from types import SimpleNamespace

    from tests.conftest import pytest_collection_modifyitems

    files = sorted((REPO / "tests").rglob("test_*.py"))
    for collected, whole in ((files, True), (files[1:], False), ([*files, *files], True)):
        config = SimpleNamespace(stash=pytest.Stash())
        items = [SimpleNamespace(path=p) for p in collected]
        pytest_collection_modifyitems(None, config, items)  # type: ignore[arg-type]
        assert (WHOLE_SUITE in config.stash) is whole
        if whole:
            assert config.stash[WHOLE_SUITE] == items
