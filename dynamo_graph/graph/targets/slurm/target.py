"""The Slurm target: the graph as one Slurm job, which Slurm supervises (so `up` always detaches).
`logs` is the local target's: the job's steps write to the same state dir."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from rich.console import Console

from dynamo_graph.graph.targets.base import Renderer, Target, TargetError
from dynamo_graph.graph.targets.local import commands as local
from dynamo_graph.graph.targets.local.state import StateDir
from dynamo_graph.graph.targets.slurm import commands
from dynamo_graph.graph.targets.slurm.job import SlurmState
from dynamo_graph.graph.targets.slurm.script import render_slurm

if TYPE_CHECKING:
    from dynamo_graph.graph.build import Built


class SlurmTarget(Target):
    name = "slurm"
    renderers: ClassVar[Mapping[str, Renderer]] = {"slurm": render_slurm}

    def up(
        self, graph_file: Path, build: Callable[[], Built], console: Console, *, detach: bool, dry_run: bool
    ) -> int:
        if dry_run:
            raise TargetError(
                "--dry-run is for the local target; `dyngraph render -f slurm` shows the job unsubmitted"
            )
        return commands.up(build(), console)

    def status(self, graph_file: Path, console: Console, *, as_json: bool = False) -> int:
        if as_json:
            raise TargetError(
                "`status --json` reads the local supervisor's records; a Slurm job has none yet"
            )
        return commands.status(StateDir.of(graph_file), console)

    def logs(self, graph_file: Path, console: Console, selector: str | None, follow: bool, lines: int) -> int:
        return local.logs(StateDir.of(graph_file), console, selector, follow, lines)

    def down(self, graph_file: Path, console: Console) -> int:
        return commands.down(StateDir.of(graph_file), console)

    def rollback(self, graph_file: Path, console: Console, revision: int | None) -> int:
        """`dyngraph rollback` of a graph that runs as a job (the local target's is its supervisor's)."""
        return commands.rollback(StateDir.of(graph_file), console, revision)

    def has_record(self, graph_file: Path) -> bool:
        """Whether the graph's last `up` was `--target slurm` (so status / down ask Slurm)."""
        return SlurmState(StateDir.of(graph_file)).job() is not None

    def before_up_elsewhere(self, built: Built) -> None:
        commands.before_local_up(built)
