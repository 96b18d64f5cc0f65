"""What a `dyngraph test` run found: per graph, per check. The summary and JUnit XML read these."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Outcome = Literal["passed", "failed", "error"]


@dataclass
class CheckResult:
    """One step of a graph's `tests` (or the bring-up itself, named `up`)."""

    name: str
    outcome: Outcome
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)  # why it failed, one line each
    detail: str = ""  # what was measured (ttft, latency, tokens), for the summary
    output: str = ""  # longer text for JUnit (log lines of a process that failed)


@dataclass
class GraphResult:
    """One graph file's run. `status` decides the exit code: 0 passed, 1 a check failed, 2 the
    graph is invalid or did not come up, 130 interrupted."""

    file: str
    graph: str = ""
    checks: list[CheckResult] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # graph invalid (file:line: key: message)
    up_failure: str = ""  # why the graph did not come up
    interrupted: bool = False
    seconds: float = 0.0
    state_dir: str = ""  # kept when something failed, for `dyngraph logs`-style inspection

    @property
    def status(self) -> int:
        if self.interrupted:
            return 130
        if self.problems or self.up_failure:
            return 2
        return 1 if any(c.outcome != "passed" for c in self.checks) else 0


def exit_code(results: list[GraphResult]) -> int:
    """The worst of the graphs' statuses (130 for an interrupted run)."""
    return max((r.status for r in results), default=0)
