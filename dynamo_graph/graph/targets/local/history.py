"""What a graph ran and runs: `dyngraph history` (its revisions, one line each), the revision
lines of `status`, and `status --json` (for scripts and CI)."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from rich.console import Console
from rich.table import Table

from dynamo_graph.graph.plan import Plan
from dynamo_graph.graph.targets.local.revisions import (
    Revision,
    RevisionStore,
    serving,
)
from dynamo_graph.graph.targets.local.state import ProcessRecord, StateDir

_OUTCOME_STYLE = {"ready": "green", "rolling": "yellow", "failed": "bold red"}


def when(stamp: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stamp)) if stamp else "-"


def revision_lines(revisions: list[Revision]) -> list[str]:
    """The serving revision and any rollout in progress, for `status`."""
    lines = []
    if current := serving(revisions):
        lines.append(
            f"revision {current.number} serving (git {current.git_short}, {when(current.finished_at)})"
        )
    latest = revisions[-1] if revisions else None
    if latest is not None and latest.outcome == "rolling":
        since = when(latest.started_at)
        lines.append(f"revision {latest.number} rolling out since {since}: {', '.join(latest.changes)}")
        if latest.progress:
            lines.append(f"  {latest.progress[-1]}")
    elif latest is not None and latest.outcome == "failed":
        what = "failed and was rolled back" if latest.rolled_back else "failed"
        lines.append(f"revision {latest.number} {what}: {latest.message.splitlines()[0]}")
    return lines


def _process(record: ProcessRecord) -> dict[str, Any]:
    return {
        "name": record.name,
        "component": record.component,
        "replica": record.replica,
        "host": record.host,
        "pid": record.pid,
        "state": record.state,
        "revision": record.revision,
        "retiring": record.retiring,
        "restarts": record.restarts,
    }


def _revision(revision: Revision | None) -> dict[str, Any] | None:
    if revision is None:
        return None
    return {
        "number": revision.number,
        "outcome": revision.outcome,
        "git_commit": revision.origin.git_commit,
        "git_dirty": revision.origin.git_dirty,
        "command": revision.origin.command,
        "content_hash": revision.content_hash,
        "changes": revision.changes,
        "message": revision.message,
        "progress": revision.progress,
        "started_at": revision.started_at,
        "finished_at": revision.finished_at,
    }


def autoscale_decisions(state: StateDir) -> dict[str, dict[str, Any]]:
    """The autoscaler's last decision per pool (planner.py writes them), {} when none."""
    try:
        found = json.loads((state.root / "autoscale.json").read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def autoscale_lines(
    plan: Plan, decisions: dict[str, dict[str, Any]], records: Mapping[str, ProcessRecord]
) -> list[str]:
    """Per autoscaled pool, for `status`: its bounds, what it runs and how much of it is ready,
    and the last decision."""
    lines = []
    for pool, policy in plan.autoscale.items():
        names = [p.name for p in plan.processes if p.component == pool]
        ready = sum(n in records and records[n].state == "ready" for n in names)
        bounds = f"{policy.min_replicas}..{policy.max_replicas}"
        line = f"{pool}: autoscaled {bounds}, {len(names)} wanted, {ready} ready"
        if (last := decisions.get(pool)) is not None:
            line += f"; last decision {last.get('desired')} at {when(last.get('time'))}: {last.get('reason')}"
        if policy.capped:
            line += f" (capped below {policy.wanted_max}: {policy.capped})"
        lines.append(line)
    return lines


def status_document(
    plan: Plan,
    records: list[ProcessRecord],
    revisions: list[Revision],
    running: bool,
    decisions: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """`status --json`: the graph, its serving revision and any rollout, each component's
    desired and ready replicas (an autoscaled one's bounds and last decision), and every
    process (old runs being retired included)."""
    current = [r for r in records if not r.retiring]
    components: dict[str, dict[str, Any]] = {}
    for spec in plan.processes:
        entry = components.setdefault(spec.component, {"desired": 0, "ready": 0, "revisions": []})
        entry["desired"] += 1
    for record in current:
        entry = components.get(record.component)
        if entry is None:
            continue
        entry["ready"] += record.state == "ready"
        if record.revision and record.revision not in entry["revisions"]:
            entry["revisions"].append(record.revision)
    for pool, policy in plan.autoscale.items():
        entry = components.setdefault(pool, {"desired": 0, "ready": 0, "revisions": []})
        entry["autoscale"] = {
            "min_replicas": policy.min_replicas,
            "max_replicas": policy.max_replicas,
            "capped": policy.capped or None,
            "last": (decisions or {}).get(pool),
        }
    latest = revisions[-1] if revisions else None
    return {
        "graph": plan.graph,
        "running": running,
        "revision": _revision(serving(revisions)),
        "rolling": _revision(latest) if latest is not None and latest.outcome == "rolling" else None,
        "components": components,
        "processes": [_process(r) for r in records],
    }


def history(state: StateDir, console: Console) -> int:
    """Every revision, oldest first: number, when, git commit, outcome, command, changes."""
    revisions = RevisionStore(state.revisions).all()
    if not revisions:
        console.print(f"graph in {state.root} has no revisions yet (`dyngraph up` records them)")
        return 0
    current = serving(revisions)
    table = Table(title=f"revisions of {revisions[-1].plan.graph}", title_justify="left")
    for column in ("rev", "applied", "git", "outcome", "by", "changes"):
        table.add_column(column)
    for revision in revisions:
        mark = "*" if current is not None and revision.number == current.number else ""
        outcome = revision.outcome + (" (serving)" if mark else "")
        changes = ", ".join(revision.changes)
        table.add_row(
            f"{revision.number}{mark}",
            when(revision.started_at),
            revision.git_short,
            f"[{_OUTCOME_STYLE[revision.outcome]}]{outcome}[/]",
            f"{revision.origin.user}: {revision.origin.command}",
            changes if len(changes) <= 60 else changes[:57] + "...",
        )
    console.print(table)
    return 0
