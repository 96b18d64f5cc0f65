"""import-linter notices a wrong-way import with the project's own contracts (pyproject.toml).

`make test` and `make lint` run lint-imports on the package itself; this checks that the
contracts would catch a break at all, on the subtlest kind the pyproject promises to count: an
import only under TYPE_CHECKING. It copies the package, adds the import to the copy and runs
lint-imports (a subprocess, hence an integration test); one case, since more would test the tool
rather than the contracts.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def test_a_type_checking_import_the_wrong_way_breaks_a_contract(tmp_path: Path) -> None:
    shutil.copytree(
        ROOT / "dynamo_graph", tmp_path / "dynamo_graph", ignore=shutil.ignore_patterns("__pycache__")
    )
    runtime = tmp_path / "dynamo_graph" / "runtime" / "__init__.py"
    wrong = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dynamo_graph.llm import card\n"
    runtime.write_text(runtime.read_text() + "\n" + wrong)
    result = subprocess.run(
        [str(LINT_IMPORTS), str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0, result.stdout
    assert "Rooms import downwards only" in result.stdout and "BROKEN" in result.stdout
    assert "dynamo_graph.runtime" in result.stdout and "dynamo_graph.llm" in result.stdout
