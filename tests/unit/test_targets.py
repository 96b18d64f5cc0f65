"""Which launch target a command goes to (graph/targets/dispatch.py), and what a target refuses.

The targets' own work runs for real in the system tests (test_supervisor.py, test_slurm.py,
test_remote_hosts.py); here: the choice between them, without starting anything.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from dynamo_graph.graph.errors import GraphError, Problem
from dynamo_graph.graph.targets.base import Target, TargetError
from dynamo_graph.graph.targets.dispatch import (
    ENGINES_OF_FORMAT,
    FORMATS,
    K8S,
    LOCAL,
    SLURM,
    TARGETS,
    target_named,
    target_of,
)
from dynamo_graph.graph.targets.local.state import StateDir
from dynamo_graph.graph.targets.local.target import LocalTarget
from dynamo_graph.graph.targets.slurm.job import JobRecord, SlurmState


def _never_built() -> Any:
    raise AssertionError("the graph was loaded")


def test_every_format_has_one_renderer_in_the_order_the_cli_lists_them() -> None:
    expected = ("yaml", "json", "shell", "prometheus", "grafana", "mermaid", "k8s", "dynamo-k8s", "slurm")
    assert expected == FORMATS
    owned = [fmt for target in TARGETS.values() for fmt in target.renderers]
    assert sorted(owned) == sorted(set(owned)) == sorted(set(FORMATS) - {"yaml", "json", "mermaid"})
    assert ENGINES_OF_FORMAT == {"dynamo-k8s": "dynamo"}


def test_up_by_name() -> None:
    assert (target_named("local"), target_named("slurm"), target_named("k8s")) == (LOCAL, SLURM, K8S)
    with pytest.raises(TargetError, match=r"^--target must be local or slurm, not 'ssh'$"):
        target_named("ssh")


def test_a_render_only_target_says_so_before_loading_the_graph(tmp_path: Path) -> None:
    graph = tmp_path / "g.yaml"
    console = Console()
    with pytest.raises(TargetError, match=r"the k8s target only renders: `dyngraph render .* -f k8s`"):
        K8S.up(graph, _never_built, console, detach=True, dry_run=False)
    for call in (K8S.status, K8S.down):
        with pytest.raises(TargetError, match="only renders"):
            call(graph, console)


def test_slurm_has_no_dry_run(tmp_path: Path) -> None:
    with pytest.raises(TargetError, match="--dry-run is for the local target"):
        SLURM.up(tmp_path / "g.yaml", _never_built, Console(), detach=False, dry_run=True)


def test_status_logs_down_follow_the_state_dir(tmp_path: Path) -> None:
    graph = tmp_path / "g.yaml"
    assert target_of(graph) is LOCAL  # nothing recorded: the local target, where `up` goes by default
    SlurmState(StateDir.of(graph)).write_job(JobRecord("42", "job.sbatch", 0.0))
    assert target_of(graph) is SLURM


class _Holding(Target):
    """A target that holds every graph: the local one must not start it."""

    name = "holding"

    def up(self, *args: Any, **kwargs: Any) -> int:
        raise NotImplementedError

    status = logs = down = up

    def before_up_elsewhere(self, built: Any) -> None:
        raise GraphError([Problem("", "it runs elsewhere")])


def test_local_up_asks_the_other_targets_first(tmp_path: Path) -> None:
    target = LocalTarget(others=[_Holding()])
    with pytest.raises(GraphError, match="it runs elsewhere"):  # before preflight or any supervisor
        target.up(tmp_path / "g.yaml", lambda: object(), Console(), detach=False, dry_run=False)
    assert not StateDir.of(tmp_path / "g.yaml").root.exists()
