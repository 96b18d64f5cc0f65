"""Dynamo's example deployments (DGD files) the import is tested on, and the overrides that turn
an imported graph into a laptop's: the mocker for every worker, the tiny model, no GPUs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "dynamo"
EXAMPLES = sorted((FIXTURES / "examples").glob("*.yaml"))
UPSTREAM = FIXTURES / "upstream"
DGD_FILES = EXAMPLES + sorted(p for p in UPSTREAM.rglob("*.yaml") if "engine_configs" not in p.parts)
"""tests/fixtures/dynamo/README.md and upstream/README.md say where each comes from."""


def dgd_id(path: Path) -> str:
    return str(path.relative_to(FIXTURES))


def mocker_overrides(graph: dict[str, Any], tiny_model: Path) -> list[str]:
    """Every worker on the mocker (its engine args, for the real engine, dropped; no GPUs, which
    preflight would count) serving the tiny model."""
    overrides = [f"models.{key}.path={tiny_model}" for key in graph["models"]]
    for key, comp in graph["components"].items():
        if comp["kind"] != "worker":
            continue
        overrides.append(f"components.{key}.engine=mocker")
        overrides += [f"~components.{key}.{field}" for field in ("engine_args", "gpus") if field in comp]
    return overrides
