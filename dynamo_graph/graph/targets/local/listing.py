"""`dyngraph ls`: the graphs running on this machine (registry.py) with their state: how many
processes are ready, starting or failed, where their frontends listen, and graphs whose
supervisor died and left processes behind (`dyngraph down` stops those)."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from dynamo_graph.graph.targets.local import registry
from dynamo_graph.graph.targets.local.state import StateDir, record_alive
from dynamo_graph.graph.targets.local.ui import frontend_url

_STYLE = {"running": "green", "starting": "yellow", "degraded": "bold red", "supervisor gone": "bold red"}


@dataclass(frozen=True)
class GraphRow:
    graph: str
    file: str
    state: str  # running | starting | degraded | supervisor gone
    processes: dict[str, int]  # process state -> count
    urls: list[str]
    supervisor_pid: int | None


def _row(root: Path) -> GraphRow | None:
    """The graph in `root`, or None once nothing of it runs (its entry is then dropped)."""
    state = StateDir(root)
    sup = state.supervisor()
    records = state.read_processes()
    if sup is None and not any(record_alive(r) for r in records):
        registry.leave(root)
        return None
    plan = state.read_plan()
    counts = Counter(r.state for r in records)
    if sup is None:
        status = "supervisor gone"
        counts = Counter("left running" for r in records if record_alive(r))
    elif counts["failed"]:
        status = "degraded"
    elif plan is not None and counts["ready"] == len(plan.processes):
        status = "running"
    else:
        status = "starting"
    # A frontend's replicas share one URL: listed once.
    urls = list(
        dict.fromkeys(url for spec in (plan.processes if plan else []) if (url := frontend_url(spec)))
    )
    return GraphRow(
        graph=plan.graph if plan else root.name,
        file=plan.graph_file if plan else str(root),
        state=status,
        processes=dict(sorted(counts.items())),
        urls=urls,
        supervisor_pid=sup.pid if sup else None,
    )


def ls(console: Console, as_json: bool) -> int:
    rows = [row for root in registry.entered() if (row := _row(root)) is not None]
    if as_json:
        print(json.dumps([asdict(r) for r in rows], indent=2))
        return 0
    if not rows:
        console.print("no graph is running on this machine")
        return 0
    table = Table(title_justify="left")
    for column in ("graph", "state", "processes", "frontend", "file"):
        table.add_column(column, overflow="fold")  # whole URLs and paths, wrapped, never cut
    for row in rows:
        table.add_row(
            row.graph,
            Text(row.state, style=_STYLE.get(row.state, "")),
            ", ".join(f"{n} {s}" for s, n in row.processes.items()) or "-",
            "\n".join(row.urls) or "-",
            row.file,
        )
    console.print(table)
    return 0
