"""What a bench result records about its graph: the plan's hash is the same for the same graph in
another checkout and changes with what runs; the graph file's git commit and dirtiness."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from dynamo_graph.bench.provenance import git_of, plan_hash
from dynamo_graph.graph.build import build

GRAPH = Path(__file__).resolve().parents[2] / "graphs" / "ci" / "mocker-kv.yaml"


def checkout(root: Path) -> Path:
    """A git work tree holding the CI graph where the repository keeps it."""
    (root / "graphs" / "ci").mkdir(parents=True)
    graph = root / "graphs" / "ci" / GRAPH.name
    shutil.copy(GRAPH, graph)
    for args in (
        ["init", "-q"],
        ["add", "."],
        ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "g"],
    ):
        subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, timeout=30)
    return graph


def test_plan_hash_ignores_where_the_checkout_is_not_what_runs(tmp_path: Path) -> None:
    one, two = checkout(tmp_path / "a"), checkout(tmp_path / "b")
    assert plan_hash(build(one).plan) == plan_hash(build(two).plan)
    assert plan_hash(build(one).plan) != plan_hash(build(one, ["components.backend.replicas=3"]).plan)
    assert plan_hash(build(one).plan) != plan_hash(
        build(one, ["components.frontend.router.mode=random"]).plan
    )


def test_git_of_the_graph_file(tmp_path: Path) -> None:
    graph = checkout(tmp_path)
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True
    ).stdout.strip()
    assert git_of(graph) == {"commit": head, "head": head, "dirty": False}
    graph.write_text(graph.read_text() + "\n# changed\n")
    assert git_of(graph) == {"commit": head, "head": head, "dirty": True}
    outside = tmp_path.parent / f"{tmp_path.name}-plain.yaml"
    outside.write_text("name: x\n")
    try:
        assert git_of(outside) is None  # not in a git work tree
    finally:
        outside.unlink()
