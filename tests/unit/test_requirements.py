"""`make run` installs what runs: requirements/runtime.txt holds every distribution the service
imports (found by reading the service's imports, not by trusting a list), and none of the
development set; gen.txt adds only the code generators."""

from __future__ import annotations

import ast
import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

from tests.conftest import REPO

SERVICE = REPO / "service" / "context_engine"
DEV_ONLY = {"mypy", "ruff", "pytest", "hypothesis", "langchain-core", "anthropic", "buf-bin",
            "grpcio-tools", "mypy-protobuf", "types-protobuf", "types-grpcio", "langsmith"}


def pins(name: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for line in (REPO / "requirements" / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("-r "):
            found.update(pins(line[3:].strip()))
        elif line:
            dist, version = line.split("==")
            found[canonical(dist)] = version
    return found


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def imported_top_levels() -> set[str]:
    """Top-level modules the service imports, at module level or inside functions."""
    names: set[str] = set()
    for path in SERVICE.rglob("*.py"):
        if "v1" in path.relative_to(SERVICE).parts[:1]:
            continue  # generated
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"context_engine", "__future__"}


def test_every_distribution_the_service_imports_is_pinned_in_the_runtime_set():
    runtime = pins("runtime.txt")
    owners = packages_distributions()
    missing = {}
    for module in sorted(imported_top_levels()):
        dists = {canonical(d) for d in owners.get(module, [])}
        assert dists, f"{module} is imported by the service but no installed distribution has it"
        if not dists & set(runtime):
            missing[module] = sorted(dists)
    assert not missing, f"imported by the service, not in requirements/runtime.txt: {missing}"


def test_the_runtime_set_holds_none_of_the_development_set():
    runtime = pins("runtime.txt")
    assert not DEV_ONLY & set(runtime), DEV_ONLY & set(runtime)


def test_gen_adds_only_the_code_generators_and_dev_includes_both():
    runtime, gen, dev = pins("runtime.txt"), pins("gen.txt"), pins("dev.txt")
    assert set(gen) - set(runtime) == {"grpcio-tools", "mypy-protobuf", "setuptools",
                                       "types-protobuf"}
    assert set(gen) <= set(dev) and all(dev[d] == gen[d] for d in gen)


def test_the_makefile_installs_the_runtime_set_for_run_and_the_dev_set_for_test():
    makefile = (REPO / "Makefile").read_text()
    runtime_rule = makefile.split("$(RUNTIME_STAMP):", 1)[1].split("\n\n", 1)[0]
    assert "requirements/gen.txt" in runtime_rule and "dev.txt" not in runtime_rule
    run_rule = re.search(r"^run: (.*)$", makefile, re.M)
    assert run_rule and "DEV_STAMP" not in run_rule.group(1)
    assert re.search(r"^lint: .*\$\(DEV_STAMP\)", makefile, re.M)


def test_installed_versions_are_the_pinned_ones():
    """The venv the suite runs in resolved exactly the pins (no drift between machines)."""
    from importlib.metadata import version

    wrong = {d: (v, version(d)) for d, v in pins("dev.txt").items() if version(d) != v}
    assert not wrong, wrong


def test_the_service_package_declares_its_direct_runtime_dependencies():
    import tomllib

    declared = {canonical(re.split(r"[<>=!~ \[]", d, maxsplit=1)[0])
                for d in tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
                    "dependencies"]}
    assert declared <= set(pins("runtime.txt")), declared - set(pins("runtime.txt"))
    assert Path(REPO / "requirements" / "runtime.txt").exists()
