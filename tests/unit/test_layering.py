"""The rooms' import order (docs/architecture.md) holds, and import-linter notices when it breaks.

Each case copies the package, adds one wrong-way import to the copy and runs `lint-imports` with
the project's own contracts against it: the contracts must fail, naming the import.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint(tree: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run(
        [str(LINT_IMPORTS), str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def package_copy(tmp_path: Path) -> Path:
    shutil.copytree(
        ROOT / "dynamo_graph", tmp_path / "dynamo_graph", ignore=shutil.ignore_patterns("__pycache__")
    )
    return tmp_path


def test_the_package_keeps_its_layers(package_copy: Path) -> None:
    result = _lint(package_copy)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "BROKEN" not in result.stdout


@pytest.mark.parametrize(
    ("module", "wrong_import", "contract"),
    [
        # The backend reaching up into an input: the knot issue 12 cut.
        ("backend/engine.py", "from dynamo_graph.inputs import launch", "Rooms import downwards only"),
        # The runtime reaching into LLM-level code, even only for typing.
        (
            "runtime/client.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dynamo_graph.llm import card",
            "Rooms import downwards only",
        ),
        # Siblings on one layer: the frontend must not load an engine.
        ("frontend/limits.py", "from dynamo_graph.engines import echo", "Rooms import downwards only"),
        # Allowed by the layers, refused by its own contract: the frontend runs no worker code.
        (
            "frontend/limits.py",
            "def _late():\n    from dynamo_graph.backend import worker",
            "The frontend only routes",
        ),
    ],
)
def test_a_wrong_way_import_breaks_a_contract(
    package_copy: Path, module: str, wrong_import: str, contract: str
) -> None:
    path = package_copy / "dynamo_graph" / module
    path.write_text(path.read_text() + "\n" + wrong_import + "\n")
    result = _lint(package_copy)
    assert result.returncode != 0, result.stdout
    assert f"{contract}" in result.stdout and "BROKEN" in result.stdout
    importer = "dynamo_graph." + module.removesuffix(".py").replace("/", ".")
    assert importer in result.stdout
