"""Which target a command goes to: `up --target NAME` by name, `status`, `logs` and `down` by the
graph's state dir (the target whose record it holds, else the local one), `render -f FORMAT` by
the format (the graph's own formats are graph/render.py's)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from dynamo_graph.graph.plan import Plan
from dynamo_graph.graph.render import render_json, render_mermaid, render_yaml
from dynamo_graph.graph.schema import Graph
from dynamo_graph.graph.targets.base import Renderer, Target, TargetError
from dynamo_graph.graph.targets.k8s.target import KubernetesTarget
from dynamo_graph.graph.targets.local.target import LocalTarget
from dynamo_graph.graph.targets.slurm.target import SlurmTarget

if TYPE_CHECKING:
    from dynamo_graph.graph.validate import Engines

SLURM = SlurmTarget()
LOCAL = LocalTarget(others=[SLURM])
K8S = KubernetesTarget()
TARGETS: dict[str, Target] = {t.name: t for t in (LOCAL, SLURM, K8S)}

RENDERERS: dict[str, Renderer] = {  # in the order `render --format` lists them
    "yaml": render_yaml,
    "json": render_json,
    **LOCAL.renderers,
    "mermaid": render_mermaid,
    **K8S.renderers,
    **SLURM.renderers,
}
FORMATS = tuple(RENDERERS)
ENGINES_OF_FORMAT: dict[str, Engines] = {
    fmt: engines for t in TARGETS.values() for fmt, engines in t.engines_of_format.items()
}


def target_named(name: str) -> Target:
    """`up --target NAME`; raises TargetError for a name no target has."""
    if name not in TARGETS:
        launching = " or ".join(t.name for t in TARGETS.values() if t.launches)
        raise TargetError(f"--target must be {launching}, not {name!r}")
    return TARGETS[name]


def target_of(graph_file: Path) -> Target:
    """The target the graph's last `up` went to, as its state dir records it."""
    return next((t for t in TARGETS.values() if t.has_record(graph_file)), LOCAL)


def render(graph: Graph, plan: Plan, fmt: str) -> str:
    if fmt not in RENDERERS:
        raise ValueError(f"unknown format {fmt!r}; use one of {', '.join(FORMATS)}")
    return RENDERERS[fmt](graph, plan)
