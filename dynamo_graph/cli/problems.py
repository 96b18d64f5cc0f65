"""How every graph command reports a graph's problems: one line each, a count, exit 2."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.markup import escape

if TYPE_CHECKING:
    from dynamo_graph.graph.errors import GraphError

err = Console(stderr=True, soft_wrap=True)


def problems(graph_file: Path, error: GraphError) -> typer.Exit:
    for problem in error.problems:
        err.print(f"[bold red]error:[/] {escape(str(problem))}", highlight=False)
    count = len(error.problems)
    err.print(f"{graph_file}: {count} problem{'s' if count != 1 else ''}", highlight=False)
    return typer.Exit(2)


@contextlib.contextmanager
def graph_problems(graph_file: Path) -> Iterator[None]:
    """Print a GraphError's problems (a bad graph, or preflight on its hosts) and exit 2."""
    from dynamo_graph.graph.errors import GraphError

    try:
        yield
    except GraphError as e:
        raise problems(graph_file, e) from None
