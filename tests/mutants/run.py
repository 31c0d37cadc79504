"""``make mutants``: apply each deliberate bug kept beside this file to a copy of the tree, one at
a time, run the test selection that is supposed to kill it, and fail if any mutant survives.

Each mutant is a small patch, ``NAME.patch``, whose first lines (before the diff, which
``git apply`` ignores) say what it breaks and which tests must notice::

    bug: the estimator does not count tool-call names and arguments
    killed-by: -m gate_budget

The copy holds the working tree as it is
(tracked files and the generated code, not ``.git``, ``.venv`` or ``.data``); the copy's
``service/`` and ``clients/python/src`` come first on ``PYTHONPATH``, so the suite imports the
mutated code, which the runner checks before it trusts a result. Every selection is first run
on the unmutated copy: a selection that fails without the bug kills nothing. A mutant is killed
only when a test of its selection fails (pytest's exit 1): an import or collection error stops
the tests before any of them judges the bug, and is reported as an error, as is a TypeScript
patch that does not compile (the client's build fails before its tests run).

    python -m tests.mutants.run                 # every mutant
    python -m tests.mutants.run NAME [NAME...]  # some of them
    python -m tests.mutants.run --list
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SKIP = {".git", ".venv", ".data", ".mypy_cache", ".ruff_cache", ".pytest_cache",
        ".hypothesis", "node_modules", "__pycache__"}


@dataclass(frozen=True)
class Mutant:
    name: str
    patch: Path
    bug: str
    killed_by: tuple[str, ...]  # pytest arguments

    @property
    def selection(self) -> str:
        return shlex.join(self.killed_by)


def header(patch: Path) -> dict[str, str]:
    """The ``key: value`` lines before the diff."""
    fields: dict[str, str] = {}
    for line in patch.read_text(encoding="utf-8").splitlines():
        if line.startswith(("diff ", "--- ", "Index: ")):
            break
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("bug", "killed-by"):
            fields[key.strip()] = value.strip()
    return fields


def catalog() -> list[Mutant]:
    out = []
    for patch in sorted(HERE.glob("*.patch")):
        fields = header(patch)
        missing = {"bug", "killed-by"} - set(fields)
        if missing:
            raise SystemExit(f"{patch.name} names no {' and no '.join(sorted(missing))}")
        out.append(Mutant(name=patch.stem, patch=patch, bug=fields["bug"],
                          killed_by=tuple(shlex.split(fields["killed-by"]))))
    return out


def copy_tree(dest: Path) -> None:
    def ignore(_dir: str, names: list[str]) -> set[str]:
        return {n for n in names if n in SKIP}
    shutil.copytree(REPO, dest, ignore=ignore, symlinks=True)


def env_for(root: Path) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(root / "service"), str(root / "clients" / "python" / "src"), str(root)]
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get(
        "PYTHONPATH") else []))
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def imports_from(root: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", "import context_engine, tests; print(context_engine.__file__);"
         " print(tests.__file__)"], cwd=root, env=env_for(root), capture_output=True,
        text=True, check=True).stdout.split()
    for path in out:
        if not Path(path).resolve().is_relative_to(root.resolve()):
            raise SystemExit(f"the copy imports {path}, not its own code: results would lie")


# One selection's run may take this long; past it the run is stopped with everything it
# started (its process group, and the embedded PostgreSQL servers pg_ctl detached into
# sessions of their own, found by their data directories under the run's temporary
# directory) and the mutant is not counted as killed. A test that hangs under a bug proves
# nothing: it must fail.
TIMEOUT_SECONDS = 900
TIMED_OUT = -1  # pytest's "exit status" of a run stopped at TIMEOUT_SECONDS


def _processes_using(directory: Path) -> list[int]:
    """Processes whose command line names a path under ``directory``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(str(directory).encode() in arg for arg in argv):
            found.append(int(entry.name))
    return found


def pytest(root: Path, args: tuple[str, ...], log: Path,
           timeout: float = TIMEOUT_SECONDS) -> tuple[int, float]:
    started = time.monotonic()
    # the run's own temporary directory (short: PostgreSQL's socket path is limited)
    tmp = Path(tempfile.mkdtemp(prefix="t", dir=log.parent))
    env = {**env_for(root), "TMPDIR": str(tmp)}
    with log.open("w", encoding="utf-8") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
             "-p", "no:randomly", *args], cwd=root, env=env, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            for pid in _processes_using(tmp):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            code = TIMED_OUT
    shutil.rmtree(tmp, ignore_errors=True)
    return code, time.monotonic() - started


def apply(root: Path, patch: Path, *, check: bool = False) -> None:
    cmd = ["git", "apply", "--whitespace=nowarn", *(["--check"] if check else []), str(patch)]
    done = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{patch.name} does not apply to the tree: {done.stderr.strip()}")


# tsc's diagnostics (``src/x.ts(3,1): error TS2339: ...``): the TypeScript did not compile
TS_COMPILE_ERROR = re.compile(r"\berror TS\d+:")


def verdict(code: int, output: str = "") -> str:
    """What pytest's exit status (and its output) says of a mutant: "killed" only where a test
    ran and failed (1); "SURVIVED" where the tests passed (0) or none was collected (5);
    "ERROR" where an import or collection error, an interruption or an internal error (2-4)
    stopped them before any judged the bug, or where the failing test is the TypeScript
    client's build, which a patch that does not compile fails without testing anything;
    "TIMEOUT" where the run was stopped at TIMEOUT_SECONDS (a hang is not a failing test)."""
    if code == TIMED_OUT:
        return "TIMEOUT"
    if code == 1:
        return "ERROR" if TS_COMPILE_ERROR.search(output) else "killed"
    return "SURVIVED" if code in (0, 5) else "ERROR"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make mutants", description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--keep", action="store_true", help="keep the copies and logs")
    args = parser.parse_args(argv)
    mutants = catalog()
    if args.list:
        for m in mutants:
            print(f"{m.name}: {m.bug}\n    killed by: pytest {m.selection}")
        return 0
    unknown = set(args.names) - {m.name for m in mutants}
    if unknown:
        parser.error(f"unknown mutants: {', '.join(sorted(unknown))}")
    chosen = [m for m in mutants if not args.names or m.name in args.names]
    work = Path(tempfile.mkdtemp(prefix="ce-mutants-"))
    print(f"mutants: {len(chosen)}; copies and logs under {work}", flush=True)
    baseline = work / "baseline"
    copy_tree(baseline)
    imports_from(baseline)
    for m in chosen:  # every patch applies before anything runs
        apply(baseline, m.patch, check=True)
    failures: list[str] = []
    clean: dict[tuple[str, ...], bool] = {}
    for m in chosen:
        if m.killed_by not in clean:
            code, secs = pytest(baseline, m.killed_by,
                                work / f"baseline-{len(clean)}.log")
            clean[m.killed_by] = code == 0
            print(f"  baseline  pytest {m.selection}: "
                  f"{'passes' if code == 0 else f'FAILS (exit {code})'} in {secs:.0f} s",
                  flush=True)
        if not clean[m.killed_by]:
            failures.append(f"{m.name}: its selection fails without the mutant")
            continue
        root = work / m.name
        copy_tree(root)
        apply(root, m.patch)
        imports_from(root)
        code, secs = pytest(root, m.killed_by, work / f"{m.name}.log")
        found = verdict(code, (work / f"{m.name}.log").read_text(encoding="utf-8",
                                                               errors="replace"))
        print(f"  {found:8s}  {m.name} by pytest {m.selection} (exit {code}, {secs:.0f} s)",
              flush=True)
        if found != "killed":
            why = ("survived" if found == "SURVIVED"
                   else f"hung its tests past {TIMEOUT_SECONDS} s: none failed"
                   if found == "TIMEOUT"
                   else "its TypeScript did not compile: no test judged it" if code == 1
                   else f"stopped its tests before any judged it (exit {code})")
            failures.append(f"{m.name} {why}: pytest {m.selection}: {m.bug}")
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    if not args.keep:
        shutil.rmtree(baseline, ignore_errors=True)
    if failures:
        print("\n".join(["", "mutants not killed:", *failures]), file=sys.stderr)
        return 1
    print(f"all {len(chosen)} mutants killed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
