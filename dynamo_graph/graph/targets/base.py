"""The one interface the CLI drives every launch target through.

`dyngraph up --target NAME` picks a target by name, `status`, `logs` and `down` by the graph's
state dir, `render -f FORMAT` by the format (dispatch.py). Each target answers with an exit
code and prints on the console it is given; a graph's problems are a GraphError (the CLI prints
them, exit 2), a command the target cannot do a TargetError (the CLI prints it, exit 2).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from rich.console import Console

    from dynamo_graph.graph.build import Built
    from dynamo_graph.graph.plan import Plan
    from dynamo_graph.graph.schema import Graph
    from dynamo_graph.graph.validate import Engines

Renderer = Callable[["Graph", "Plan"], str]


class TargetError(Exception):
    """What a target cannot do (`up --dry-run` on Slurm, `up` on a render-only target)."""


class Target(ABC):
    """Where a graph's plan runs. `up` gets the graph as a `build` call rather than built, so a
    target can start work before the graph is loaded (the local target boots its supervisor);
    `build` reports the graph's problems itself."""

    name: ClassVar[str]
    launches: ClassVar[bool] = True
    """False for a target that only renders: its `up`, `status`, `logs` and `down` say so."""
    renderers: ClassVar[Mapping[str, Renderer]] = {}
    """The `dyngraph render` formats this target adds, each the graph as this target runs it."""
    engines_of_format: ClassVar[Mapping[str, Engines]] = {}
    """Formats whose workers run another project's engines (the validation they need)."""

    @abstractmethod
    def up(
        self, graph_file: Path, build: Callable[[], Built], console: Console, *, detach: bool, dry_run: bool
    ) -> int:
        """Start the graph (or apply its changes to the running one)."""

    @abstractmethod
    def status(self, graph_file: Path, console: Console, *, as_json: bool = False) -> int:
        """Print the graph's processes: state, where they run, health (JSON for scripts)."""

    @abstractmethod
    def logs(self, graph_file: Path, console: Console, selector: str | None, follow: bool, lines: int) -> int:
        """Print the logs of the graph's processes (those of one component or process)."""

    @abstractmethod
    def down(self, graph_file: Path, console: Console) -> int:
        """Stop the graph, and check that nothing of it is left."""

    def has_record(self, graph_file: Path) -> bool:
        """Whether the graph's state dir says its last `up` ran here (then `status`, `logs` and
        `down` come here). The local target needs no record: it is where the rest go."""
        return False

    def before_up_elsewhere(self, built: Built) -> None:  # noqa: B027 (most targets need nothing)
        """Raise GraphError when the graph cannot go up on another target now: it runs here, or
        it needs this target to run at all."""
