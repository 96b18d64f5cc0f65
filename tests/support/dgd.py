"""Dynamo's example deployments (DGD files) the import is tested on."""

from __future__ import annotations

from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "dynamo"
EXAMPLES = sorted((FIXTURES / "examples").glob("*.yaml"))
UPSTREAM = FIXTURES / "upstream"
DGD_FILES = EXAMPLES + sorted(p for p in UPSTREAM.rglob("*.yaml") if "engine_configs" not in p.parts)
"""tests/fixtures/dynamo/README.md and upstream/README.md say where each comes from."""


def dgd_id(path: Path) -> str:
    return str(path.relative_to(FIXTURES))
