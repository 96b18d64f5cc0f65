"""The test suite's own shape: shared helpers live in tests/support/, and nothing imports a test
module (a helper kept in a test module is found by nobody, and importing it runs that module's
fixtures and markers a second time)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# The engines refactor rewrites the vLLM tests (LONG and Sink leave test_vllm_engine.py there);
# until then this one import stays.


def _imported(tree: ast.Module) -> Iterator[str]:
    """Every module an import names (`from X import Y`: X and X.Y); a relative import as ".",
    which no check can resolve and none is needed for."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level:
            yield "."
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def test_nothing_imports_a_test_module() -> None:
    found = set()
    for path in [*(REPO / "tests").rglob("*.py"), *(REPO / "benchmarks").rglob("*.py")]:
        for name in _imported(ast.parse(path.read_bytes(), str(path))):
            if name == "." or (name.startswith("tests.") and name.rsplit(".", 1)[-1].startswith("test_")):
                found.add((str(path.relative_to(REPO)), name))
    assert not found, sorted(found)
