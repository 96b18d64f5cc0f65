"""What the local target's commands print: the status table, frontend URLs, prefixed log lines."""

from __future__ import annotations

import time
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text

from dynamo_graph.graph.plan import LOCAL, Plan, ProcessSpec
from dynamo_graph.graph.targets.local.state import ProcessRecord

_STATE_STYLE = {
    "ready": "green",
    "starting": "yellow",
    "reconnecting": "yellow",
    "restarting": "yellow",
    "exited": "dim",
    "stopped": "dim",
    "failed": "bold red",
}
_PREFIX_COLORS = ("cyan", "magenta", "green", "yellow", "blue", "bright_cyan", "bright_magenta")


_RUNNING = ("starting", "ready", "reconnecting")  # states with a live process (and pid)


def _uptime(record: ProcessRecord) -> str:
    if record.state not in _RUNNING or record.started_at is None:
        return "-"
    seconds = int(time.time() - record.started_at)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


def status_table(
    plan: Plan,
    records: dict[str, ProcessRecord],
    health: dict[str, str] | None,
    retiring: Sequence[ProcessRecord] = (),
) -> Table:
    """One row per process of the plan, then one per old run a rollout is retiring; the health
    column only when probes were run. Narrow enough for an 80-column terminal."""
    table = Table(title=f"graph {plan.graph} (namespace {plan.namespace})", title_justify="left")
    columns = ["process", "host", "pid", "state", "restarts", "uptime", "rev"]
    for column in [*columns, "health"] if health is not None else columns:
        table.add_column(column)
    rows = [(spec.name, spec.host, records.get(spec.name)) for spec in plan.processes]
    rows += [(r.name, r.host, r) for r in retiring]
    for name, host, record in rows:
        state = record.state if record else "-"
        running = record is not None and record.state in _RUNNING
        lost = record is not None and record.state == "reconnecting"
        shown = Text(state, style=_STATE_STYLE.get(state, ""))
        if record is not None and record.retiring and running:
            shown = Text("retiring", style="dim")
        cells: list[str | Text] = [
            name,
            Text(f"{host} (disconnected)", style="yellow") if lost else host,
            str(record.pid) if running and record and record.pid else "-",
            shown,
            str(record.restarts) if record else "-",
            _uptime(record) if record else "-",
            str(record.revision) if record and record.revision else "-",
        ]
        if health is not None:
            checked = record is not None and not record.retiring
            cells.append(health.get(name, "-") if checked else "-")
        table.add_row(*cells)
    return table


def frontend_url(spec: ProcessSpec) -> str | None:
    """`http(s)://host:port/v1` of a frontend process (one run with `in=http`), and its host when
    that is not this one (the address is as that host sees it)."""
    if "in=http" not in spec.argv:
        return None
    argv = spec.argv
    host = argv[argv.index("--http-host") + 1] if "--http-host" in argv else "127.0.0.1"
    port = argv[argv.index("--http-port") + 1] if "--http-port" in argv else "8080"
    scheme = "https" if "--http-tls-cert-file" in argv else "http"
    url = f"{scheme}://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}/v1"
    return url if spec.host == LOCAL else f"{url} on host {spec.host}"


class Prefixer:
    """`name | line` with one stable color per name, like docker compose."""

    def __init__(self, console: Console, names: list[str]) -> None:
        self.console = console
        self.width = max([len(n) for n in names] + [len("dyngraph")])
        self.colors: dict[str, str] = {}

    def _prefix(self, name: str) -> Text:
        color = self.colors.setdefault(name, _PREFIX_COLORS[len(self.colors) % len(_PREFIX_COLORS)])
        return Text(f"{name:<{self.width}} | ", style="bold white" if name == "dyngraph" else color)

    def line(self, name: str, text: str) -> None:
        """A line the process wrote."""
        self.console.print(self._prefix(name) + Text(text), highlight=False)

    def event(self, name: str, text: str) -> None:
        """Something the supervisor says about the process (ready, restarting, crash loop)."""
        tag = "" if name == "dyngraph" else "[dyngraph] "
        self.console.print(self._prefix(name) + Text(tag + text, style="bold"), highlight=False)
