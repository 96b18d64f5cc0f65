"""The local target: the graph's processes on this machine and its ssh hosts, under a supervisor."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from rich.console import Console

from dynamo_graph.graph.targets.base import Renderer, Target
from dynamo_graph.graph.targets.local import commands
from dynamo_graph.graph.targets.local.diff import print_diff
from dynamo_graph.graph.targets.local.monitoring import render_grafana, render_prometheus
from dynamo_graph.graph.targets.local.shell import render_shell
from dynamo_graph.graph.targets.local.state import StateDir

if TYPE_CHECKING:
    from dynamo_graph.graph.build import Built


class LocalTarget(Target):
    """`others` are the targets that may hold the graph instead (a Slurm job of it): each is
    asked before the graph starts here."""

    name = "local"
    renderers: ClassVar[Mapping[str, Renderer]] = {
        "shell": render_shell,
        "prometheus": render_prometheus,
        "grafana": render_grafana,
    }

    def __init__(self, others: Sequence[Target] = ()) -> None:
        self.others = others

    def up(
        self, graph_file: Path, build: Callable[[], Built], console: Console, *, detach: bool, dry_run: bool
    ) -> int:
        if dry_run:
            built = build()
            commands.preflight(built, check_ports=StateDir.of(graph_file).supervisor() is None)
            return print_diff(built, console)
        if not detach:
            built = build()
            self._before_up(built)  # then preflight on the graph's hosts
            return commands.up_foreground(built, console)
        with commands.DetachedUp(StateDir.of(graph_file)) as up:  # the supervisor boots while we load
            built = build()
            self._before_up(built)
            return up.run(built, console)

    def _before_up(self, built: Built) -> None:
        for other in self.others:
            other.before_up_elsewhere(built)

    def status(self, graph_file: Path, console: Console, *, as_json: bool = False) -> int:
        return commands.status(StateDir.of(graph_file), console, as_json)

    def logs(self, graph_file: Path, console: Console, selector: str | None, follow: bool, lines: int) -> int:
        return commands.logs(StateDir.of(graph_file), console, selector, follow, lines)

    def down(self, graph_file: Path, console: Console) -> int:
        return commands.down(StateDir.of(graph_file), console)
