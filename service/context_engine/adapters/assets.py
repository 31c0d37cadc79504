"""File-backed assets: platform policy and framing texts, control tools, the model catalog."""

from __future__ import annotations

import json
from pathlib import Path

from context_engine.domain.estimator import ModelCatalog
from context_engine.domain.model import PlatformAssets, ToolSpec

PACKAGE_DIR = Path(__file__).resolve().parent.parent
DEFAULT_ASSETS_DIR = PACKAGE_DIR / "assets"
DEFAULT_CATALOG = PACKAGE_DIR / "data" / "models.json"


def load_platform_assets(directory: Path = DEFAULT_ASSETS_DIR) -> PlatformAssets:
    """Row 1 and row 2 texts and their version. A deployment may point to its own directory
    (same three files); changing them takes effect at the next Plan as one rotation."""
    manifest = json.loads((directory / "manifest.json").read_text(encoding="utf-8"))
    return PlatformAssets(
        version=str(manifest["version"]),
        policy=(directory / "policy.md").read_text(encoding="utf-8").strip(),
        framing=(directory / "framing.md").read_text(encoding="utf-8").strip(),
    )


def load_control_tools(directory: Path = DEFAULT_ASSETS_DIR) -> dict[str, ToolSpec]:
    path = directory / "control_tools.json"
    if not path.exists():
        path = DEFAULT_ASSETS_DIR / "control_tools.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    tools = [ToolSpec.from_canonical(t) for t in data["tools"]]
    return {t.name: t for t in tools}


def load_model_catalog(path: Path = DEFAULT_CATALOG) -> ModelCatalog:
    return ModelCatalog.from_data(json.loads(path.read_text(encoding="utf-8")))
