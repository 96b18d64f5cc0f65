"""`python -m dynamo_graph.manual [--check]`: write the generated pages of the manual, or with
`--check` list those that are stale and exit 1 (tests/unit/test_manual.py runs the same check)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from dynamo_graph.graph import reference
from dynamo_graph.manual import benchmarks, engines, errors, graph_keys, metrics

ROOT = Path(__file__).resolve().parents[2]


def generated() -> dict[Path, Callable[[str], str]]:
    """Each generated file -> its current text, given its text now (the README keeps its prose)."""
    return {
        ROOT / "docs" / "reference" / "settings.md": lambda _: reference.reference(),
        ROOT / "docs" / "reference" / "graph-keys.md": lambda _: graph_keys.page(),
        ROOT / "docs" / "reference" / "metrics.md": lambda _: metrics.page(),
        ROOT / "docs" / "reference" / "errors.md": lambda _: errors.page(),
        ROOT / "docs" / "benchmarks.md": lambda _: benchmarks.page(),
        ROOT / "docs" / "engines" / "index.md": lambda _: engines.page(),
        ROOT / "README.md": engines.readme_with_matrix,
    }


def stale() -> list[Path]:
    out = []
    for path, make in generated().items():
        now = path.read_text() if path.exists() else ""
        if make(now) != now:
            out.append(path)
    return out


def main(argv: list[str]) -> int:
    if argv == ["--check"]:
        paths = stale()
        for path in paths:
            shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
            print(f"stale: {shown} (run python -m dynamo_graph.manual)", file=sys.stderr)
        return 1 if paths else 0
    if argv:
        print("usage: python -m dynamo_graph.manual [--check]", file=sys.stderr)
        return 2
    for path, make in generated().items():
        now = path.read_text() if path.exists() else ""
        path.write_text(make(now))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
