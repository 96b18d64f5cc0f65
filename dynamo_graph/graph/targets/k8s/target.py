"""The Kubernetes target renders only: `dyngraph render -f k8s | -f dynamo-k8s` writes what a
cluster runs, and `kubectl apply` (or Dynamo's operator) runs it; dyngraph starts nothing there."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, NoReturn

from rich.console import Console

from dynamo_graph.graph.targets.base import Renderer, Target, TargetError
from dynamo_graph.graph.targets.k8s.dynamo_k8s import render_dynamo_k8s
from dynamo_graph.graph.targets.k8s.manifests import render_k8s

if TYPE_CHECKING:
    from dynamo_graph.graph.build import Built
    from dynamo_graph.graph.validate import Engines


class KubernetesTarget(Target):
    name = "k8s"
    launches = False
    renderers: ClassVar[Mapping[str, Renderer]] = {"k8s": render_k8s, "dynamo-k8s": render_dynamo_k8s}
    engines_of_format: ClassVar[Mapping[str, Engines]] = {"dynamo-k8s": "dynamo"}

    def _renders_only(self, graph_file: Path) -> NoReturn:
        raise TargetError(
            f"the k8s target only renders: `dyngraph render {graph_file} -f k8s` (plain manifests) or "
            "`-f dynamo-k8s` (a Dynamo DynamoGraphDeployment), then `kubectl apply -f` it"
        )

    def up(
        self, graph_file: Path, build: Callable[[], Built], console: Console, *, detach: bool, dry_run: bool
    ) -> int:
        self._renders_only(graph_file)

    def status(self, graph_file: Path, console: Console, *, as_json: bool = False) -> int:
        self._renders_only(graph_file)

    def logs(self, graph_file: Path, console: Console, selector: str | None, follow: bool, lines: int) -> int:
        self._renders_only(graph_file)

    def down(self, graph_file: Path, console: Console) -> int:
        self._renders_only(graph_file)
