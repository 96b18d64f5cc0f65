"""`dyngraph test GRAPH... [--junit FILE]`: each graph in turn, then the summary and the report.

Exit status: 0 when every check of every graph passed, 1 when a check failed, 2 when a graph is
invalid (every problem, file:line) or did not come up, 130 when interrupted (SIGINT / SIGTERM):
the worst over the graphs. After an interrupt no further graph is started.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from dynamo_graph.graph.build import build
from dynamo_graph.graph.errors import GraphError
from dynamo_graph.graph.targets.local.preflight import preflight
from dynamo_graph.graph.validate import check_test_faults, locate
from dynamo_graph.smoke.isolate import isolated
from dynamo_graph.smoke.report import print_summary, write_junit
from dynamo_graph.smoke.results import GraphResult, exit_code
from dynamo_graph.smoke.session import run_session


def check_graph(
    file: Path, overrides: Sequence[str], console: Console, *, verbose: bool = False, keep_state: bool = False
) -> GraphResult:
    """Validate, preflight and run one graph file's checks."""
    result = GraphResult(str(file))
    console.print(f"[bold]{escape(str(file))}[/]", highlight=False)
    plan = None
    try:
        built = build(file, overrides)
        result.graph = built.graph.name
        if faults := list(check_test_faults(built.graph)):
            file_name = str(built.loaded.file)
            raise GraphError([locate(p, built.loaded.source, file_name) for p in faults])
        graph, plan = isolated(built.graph, built.loaded.file)
        preflight(graph, plan, built.loaded.source, str(built.loaded.file), check_ports=True)
    except GraphError as e:
        if plan is not None:  # nothing was started in it
            shutil.rmtree(plan.state_dir, ignore_errors=True)
        result.problems = [str(p) for p in e.problems]
        for problem in result.problems:
            console.print(f"  [bold red]error:[/] {escape(problem)}", highlight=False)
        return result
    run_session(built, plan, result, console, verbose=verbose, keep_state=keep_state)
    return result


def run_tests(
    files: Sequence[Path],
    overrides: Sequence[str],
    console: Console,
    *,
    junit: Path | None = None,
    verbose: bool = False,
    keep_state: bool = False,
) -> int:
    """Test each graph; print the summary, write the JUnit file; returns the exit status."""
    started = time.monotonic()
    results: list[GraphResult] = []
    try:
        for file in files:
            results.append(check_graph(file, overrides, console, verbose=verbose, keep_state=keep_state))
            if results[-1].interrupted:
                break
    except KeyboardInterrupt:  # between graphs, or while one loads: nothing of it was started
        results.append(GraphResult(str(file), interrupted=True))
    print_summary(console, results)
    if junit is not None:
        write_junit(junit, results, time.monotonic() - started)
        console.print(f"JUnit report: {junit}", highlight=False)
    return exit_code(results)
