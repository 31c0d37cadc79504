"""The domain core is pure: importing it loads no I/O library (STYLE 1)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

DOMAIN = Path(__file__).resolve().parents[2] / "service" / "context_engine" / "domain"
FORBIDDEN = ("grpc", "asyncpg", "prometheus_client", "opentelemetry", "pgserver", "tiktoken")


def test_importing_the_domain_loads_no_io_library():
    modules = sorted(p.stem for p in DOMAIN.glob("*.py") if p.stem != "__init__")
    script = ("import sys\n"
              + "".join(f"import context_engine.domain.{m}\n" for m in modules)
              + f"bad = [m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r}]\n"
              + "print(','.join(sorted(bad)))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == ""
    assert len(modules) >= 10


def test_domain_sources_import_only_stdlib_and_domain():
    allowed_roots = set(sys.stdlib_module_names) | {"context_engine"}
    for path in DOMAIN.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for name in names:
                root = name.split(".")[0]
                assert root in allowed_roots, f"{path.name} imports {name}"
                if root == "context_engine":
                    assert name.startswith("context_engine.domain"), f"{path.name}: {name}"
