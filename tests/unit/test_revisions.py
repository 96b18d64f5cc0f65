"""The revision history (graph/targets/local/revisions.py): numbering, outcomes, which revision
serves, what `rollback` picks, and the git origin of a graph file."""

from __future__ import annotations

import subprocess
from pathlib import Path

import msgspec
import pytest

from dynamo_graph.graph.plan import Plan, ProcessSpec, RolloutPolicy
from dynamo_graph.graph.targets.local.revisions import (
    Origin,
    RevisionStore,
    origin_of,
    rollback_target,
    serving,
)
from dynamo_graph.graph.targets.local.rollout import batches, dependency_order
from tests.support.plans import process_spec

ORIGIN = Origin("up", "ci")


def _spec(name: str, *, deps: tuple[str, ...] = (), surge: int = 1, unavailable: int = 0) -> ProcessSpec:
    return process_spec(name, deps=deps, rollout=RolloutPolicy(surge, unavailable), rolls=True)


def _plan(*specs: ProcessSpec, argv: str = "") -> Plan:
    return Plan("g", "g", "/g.yaml", "/state", {"x": argv}, list(specs))


def test_revisions_are_numbered_and_the_serving_one_is_the_last_ready(tmp_path: Path) -> None:
    store = RevisionStore(tmp_path / "revisions")
    first = store.begin(ORIGIN, _plan(argv="1"), ["+ w-0"])
    store.finish(first, "ready")
    second = store.begin(ORIGIN, _plan(argv="2"), ["~ w-0"])
    store.finish(second, "failed", "w-0 failed")
    assert [r.number for r in store.all()] == [1, 2]
    assert serving(store.all()).number == 1  # a failed revision was rolled back
    assert store.read(2).message == "w-0 failed" and store.read(2).finished_at is not None
    assert store.read(3) is None


def test_rollback_goes_to_the_last_ready_revision_that_differs(tmp_path: Path) -> None:
    store = RevisionStore(tmp_path / "revisions")
    for argv, outcome in (("a", "ready"), ("b", "ready"), ("c", "failed"), ("b", "ready")):
        store.finish(store.begin(ORIGIN, _plan(argv=argv), ["~ w-0"]), outcome)
    revisions = store.all()
    # serving: 4 (the same plan as 2), so "the one before" is 1, the last ready that differs
    assert rollback_target(revisions, None).number == 1
    assert rollback_target(revisions, 3).number == 3  # named: taken as asked
    with pytest.raises(LookupError, match="no revision 9"):
        rollback_target(revisions, 9)
    with pytest.raises(LookupError, match="nothing to roll back to"):
        rollback_target(revisions[:1], None)


def test_origin_names_the_commit_and_whether_tracked_files_changed(tmp_path: Path) -> None:
    graph = tmp_path / "graph.yaml"
    graph.write_text("name: g\n")
    assert origin_of(graph, "up").git_commit is None  # not in a repository
    git = ["git", "-C", str(tmp_path), "-c", "user.email=ci@example.invalid", "-c", "user.name=ci"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "graph.yaml"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "g"], check=True)
    clean = origin_of(graph, "up")
    assert clean.git_commit and len(clean.git_commit) == 40 and not clean.git_dirty
    (tmp_path / "untracked.txt").write_text("x")
    assert not origin_of(graph, "up").git_dirty  # untracked files do not count
    graph.write_text("name: h\n")
    assert origin_of(graph, "rollback 1").git_dirty


def test_batches_follow_dependencies_and_the_surge() -> None:
    plan = _plan(
        _spec("f-0", deps=("w-0", "w-1", "w-2")),
        _spec("p-0"),
        _spec("p-1"),
        _spec("w-0", deps=("p-0",), surge=2),
        _spec("w-1", deps=("p-0",), surge=2),
        _spec("w-2", deps=("p-0",), surge=2),
    )
    assert dependency_order(plan, ["f-0", "w-1", "p-1", "p-0"]) == ["p-0", "w-1", "f-0", "p-1"]
    names = ["f-0", "w-0", "w-1", "w-2", "p-0", "p-1"]
    assert batches(plan, names) == [["p-0"], ["p-1"], ["w-0", "w-1"], ["w-2"], ["f-0"]]


def test_the_ranks_of_a_replica_over_nodes_roll_in_one_batch() -> None:
    names = [("w-0", "w-0", 0), ("w-0.rank1", "w-0", 1), ("w-1", "w-1", 0), ("w-1.rank1", "w-1", 1)]
    ranks = [msgspec.structs.replace(_spec(name), group=group, rank=rank) for name, group, rank in names]
    assert batches(_plan(*ranks), [r.name for r in ranks]) == [["w-0", "w-0.rank1"], ["w-1", "w-1.rank1"]]
