"""The end of a `dyngraph test` run: a summary table on the terminal and a JUnit XML file for CI.

JUnit: one `<testsuite>` per graph file, one `<testcase>` per check; a failed expectation is a
`<failure>` (its message names the check and what was unmet), a graph that is invalid or did not
come up is an `<error>` (with the problems, or the failed process's last log lines). CI systems
(GitHub Actions reporters, GitLab, Jenkins) show these without further set-up.
"""

from __future__ import annotations

import platform
import socket
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from dynamo_graph.smoke.results import CheckResult, GraphResult

_VERDICT = {
    0: ("passed", "green"),
    1: ("failed", "bold red"),
    2: ("error", "bold red"),
    130: ("interrupted", "yellow"),
}


_MARKS = {"passed": "[green]✓[/]", "failed": "[bold red]✗[/]", "error": "[bold red]![/]"}


def print_check(console: Console, outcome: CheckResult) -> None:
    """One check's line as it ends: its mark, name and measurements, then why it failed."""
    mark = _MARKS.get(outcome.outcome, "-")
    detail = f" [dim]({escape(outcome.detail)})[/]" if outcome.detail else ""
    console.print(f"  {mark} {escape(outcome.name)}{detail}", highlight=False)
    for failure in outcome.failures:
        console.print(f"      {escape(failure)}", highlight=False)


def _why(result: GraphResult) -> str:
    """What went wrong, in a line: the failed checks by name, or the graph's own problem."""
    if result.problems:
        return f"invalid: {len(result.problems)} problem(s)"
    if result.up_failure:
        return f"did not come up: {result.up_failure}"
    failed = [c.name for c in result.checks if c.outcome != "passed"]
    why = f"failed: {', '.join(failed)}" if failed else ""
    return "; ".join(filter(None, [why, "interrupted" if result.interrupted else ""]))


def summary(results: list[GraphResult]) -> Table:
    """One row per graph file: its verdict, checks passed, time, and what failed."""
    table = Table(title="dyngraph test", title_justify="left")
    for column in ("graph", "result", "checks", "time", "why"):
        table.add_column(column, overflow="fold")
    for result in results:
        verdict, style = _VERDICT[result.status]
        passed = sum(c.outcome == "passed" for c in result.checks)
        table.add_row(
            f"{result.file} ({result.graph})" if result.graph else result.file,
            Text(verdict, style=style),
            f"{passed}/{len(result.checks)}",
            f"{result.seconds:.1f} s",
            _why(result),
        )
    return table


def print_summary(console: Console, results: list[GraphResult]) -> None:
    console.print(summary(results))
    for result in results:
        if result.state_dir:
            console.print(f"{result.file}: state and logs kept in {result.state_dir}", highlight=False)
    counts = [sum(r.status == code for r in results) for code in (0, 1, 2, 130)]
    words = ("passed", "failed", "error", "interrupted")
    console.print(", ".join(f"{n} {w}" for n, w in zip(counts, words, strict=True) if n) or "no graphs")


def _testcase(suite: ET.Element, check: CheckResult, classname: str) -> None:
    case = ET.SubElement(suite, "testcase", name=check.name, classname=classname, time=f"{check.seconds:.3f}")
    if check.outcome in ("failed", "error"):
        tag = "failure" if check.outcome == "failed" else "error"
        message = f"{check.name}: {check.failures[0]}" if check.failures else check.name
        node = ET.SubElement(case, tag, message=message, type=tag)
        node.text = "\n".join(check.failures) + (f"\n\n{check.output}" if check.output else "")
    if check.detail:
        ET.SubElement(case, "system-out").text = check.detail


def _suite(root: ET.Element, result: GraphResult) -> None:
    checks = list(result.checks)
    if result.problems:
        checks.append(CheckResult("validate", "error", 0.0, result.problems))
    if result.interrupted:
        checks.append(CheckResult("interrupted", "error", 0.0, ["the run was stopped by a signal"]))
    suite = ET.SubElement(
        root,
        "testsuite",
        name=result.file,
        tests=str(len(checks)),
        failures=str(sum(c.outcome == "failed" for c in checks)),
        errors=str(sum(c.outcome == "error" for c in checks)),
        time=f"{result.seconds:.3f}",
        timestamp=time.strftime("%Y-%m-%dT%H:%M:%S"),
        hostname=socket.gethostname(),
    )
    props = ET.SubElement(suite, "properties")
    for name, value in (("graph", result.graph), ("python", platform.python_version())):
        ET.SubElement(props, "property", name=name, value=value)
    classname = result.graph or Path(result.file).stem
    for check in checks:
        _testcase(suite, check, classname)


def write_junit(path: Path, results: list[GraphResult], seconds: float) -> None:
    """Write the JUnit XML of the run (the folder is created)."""
    root = ET.Element("testsuites", name="dyngraph test", time=f"{seconds:.3f}")
    for result in results:
        _suite(root, result)
    for key in ("tests", "failures", "errors"):
        root.set(key, str(sum(int(s.get(key, "0")) for s in root)))
    ET.indent(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)
