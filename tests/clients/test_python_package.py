"""The Python client as a user takes it home: the committed generated code is what the proto
generates, the sdist and the wheel build from the clean tree with nothing run before them,
carries what it needs and states the bounds its generated code checks, and once installed into a
new virtualenv outside the repository it runs the agent-loop example against the real server."""

from __future__ import annotations

import filecmp
import os
import re
import shutil
import subprocess
import sys
import uuid
import venv
import zipfile
from pathlib import Path

import pytest

from tests.clients.test_python_example import EXAMPLE, check_agent_loop_output
from tests.conftest import REPO

PACKAGE = REPO / "clients" / "python"
COMMITTED = PACKAGE / "src" / "context_engine_client" / "_pb"


def _run(args: list[str], *, cwd: Path, timeout: float, what: str,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout, check=False)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"{what} did not finish within {timeout:.0f} s: {err.stderr!r}")
    if done.returncode != 0:
        pytest.fail(f"{what} failed (exit {done.returncode}):\n{done.stdout[-4000:]}\n"
                    f"{done.stderr[-4000:]}")
    return done


def test_committed_generated_code_is_what_the_proto_generates(tmp_path):
    out = tmp_path / "_pb"
    _run([sys.executable, str(REPO / "scripts" / "gen_python_client.py"), str(out)], cwd=REPO,
         timeout=120, what="scripts/gen_python_client.py")
    fresh = sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    committed = sorted(p.relative_to(COMMITTED) for p in COMMITTED.rglob("*")
                       if p.is_file() and "__pycache__" not in p.parts)
    assert committed == fresh, "regenerate: python scripts/gen_python_client.py"
    differing = [str(p) for p in fresh if not filecmp.cmp(out / p, COMMITTED / p, shallow=False)]
    assert not differing, (f"{differing} differ from what proto/ generates; regenerate with "
                           "`python scripts/gen_python_client.py` and commit")
    stubs = (out / "context_engine" / "v1" / "context_engine_pb2_grpc.py").read_text()
    assert "from context_engine_client._pb.context_engine.v1 import context_engine_pb2" in stubs
    assert "from context_engine.v1 import" not in stubs


def test_generated_code_is_tracked_by_git():
    """A fresh clone has it: nothing ignores it, and it is committed."""
    listed = subprocess.run(["git", "ls-files", str(COMMITTED)], cwd=REPO, capture_output=True,
                            text=True, check=True).stdout.split()
    names = {Path(p).name for p in listed}
    assert {"context_engine_pb2.py", "context_engine_pb2_grpc.py", "context_engine_pb2.pyi",
            "context_engine_pb2_grpc.pyi"} <= names, listed


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """An sdist of clients/python, built from a copy of the package (outside the repository, so
    the build sees only what the package itself holds), and `pip wheel` of that sdist with pip's
    build isolation: the wheel users install is what the sdist alone produces."""
    work = tmp_path_factory.mktemp("client-build")
    source = work / "src"
    shutil.copytree(PACKAGE, source, ignore=shutil.ignore_patterns(
        "__pycache__", "*.egg-info", "build", "dist", ".mypy_cache"))
    sdists = work / "sdist"
    _run([sys.executable, "-c", "import sys; from setuptools import build_meta; "
          "print(build_meta.build_sdist(sys.argv[1]))", str(sdists)], cwd=source, timeout=120,
         what="building the sdist of clients/python")
    [sdist] = sdists.glob("context_engine_client-*.tar.gz")
    out = work / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out),
          str(sdist)], cwd=work, timeout=300, what="pip wheel of the sdist")
    [built] = out.glob("context_engine_client-*.whl")
    return built


def test_wheel_carries_the_generated_code_and_the_bounds_it_needs(wheel):
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        [metadata] = [n for n in names if n.endswith(".dist-info/METADATA")]
        requires = {line.split(":", 1)[1].strip().replace(" ", "")
                    for line in whl.read(metadata).decode().splitlines()
                    if line.startswith("Requires-Dist:")}
    for module in ("context_engine_pb2.py", "context_engine_pb2.pyi",
                   "context_engine_pb2_grpc.py", "context_engine_pb2_grpc.pyi"):
        assert f"context_engine_client/_pb/context_engine/v1/{module}" in names
    assert {"context_engine_client/py.typed",
            "context_engine_client/retry_service_config.json"} <= names
    by_name = {re.split(r"[<>=!~]", r, maxsplit=1)[0].lower(): r for r in requires}
    assert by_name["protobuf"] == "protobuf<8,>=7.35.1", requires
    assert by_name["grpcio"] == "grpcio<2,>=1.85.1", requires
    assert by_name["grpcio-status"].startswith("grpcio-status"), requires
    # the bounds are those the generated code checks at import
    pb2 = (COMMITTED / "context_engine" / "v1" / "context_engine_pb2.py").read_text()
    assert re.search(r"Domain\.PUBLIC,\s*7,\s*35,\s*1,", pb2)
    grpc_stub = (COMMITTED / "context_engine" / "v1" / "context_engine_pb2_grpc.py").read_text()
    assert "GRPC_GENERATED_VERSION = '1.85.1'" in grpc_stub


@pytest.mark.integration
def test_installed_wheel_runs_the_example_against_a_real_server(wheel, server, tmp_path):
    """A new virtualenv outside the repository, the wheel and its dependencies (the versions
    the repository pins), the example copied beside it: no import can reach the checkout."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    _run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
          "-c", str(REPO / "requirements" / "runtime.txt"), str(wheel)], cwd=tmp_path,
         timeout=600, what="pip install the wheel into a new virtualenv")
    example = tmp_path / "agent_loop.py"
    shutil.copy(EXAMPLE, example)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "CE_TOKEN", "VIRTUAL_ENV", "PYTHONHOME")}
    env["CE_GRPC_ADDR"] = server.address
    where = _run([str(python), "-c", "import context_engine_client, sys; "
                  "print(context_engine_client.__file__); print('context_engine' in "
                  "sys.modules)"], cwd=tmp_path, env=env, timeout=60, what="import")
    path, service_loaded = where.stdout.split()
    assert Path(path).is_relative_to(env_dir) and service_loaded == "False"
    out = _run([str(python), str(example), "--tenant", "wheel",
                "--session", f"wheel-{uuid.uuid4().hex[:12]}", "--estimator-factor", "1.0"],
               cwd=tmp_path, env=env, timeout=180, what="the example from the installed wheel")
    check_agent_loop_output(out.stdout)
