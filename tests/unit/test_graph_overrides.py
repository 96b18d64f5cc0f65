"""Overrides of keys the schema knows need no Hydra `+`, even where the graph file leaves them out;
anything else keeps Hydra's grammar."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynamo_graph.graph.build import build
from dynamo_graph.graph.errors import GraphError

GRAPH = """\
name: ov
models:
  m:
    path: org/model
components:
  frontend:
    kind: frontend
  backend:
    kind: worker
    model: m
    engine: mocker
"""


@pytest.fixture
def graph(tmp_path: Path) -> Path:
    file = tmp_path / "ov.yaml"
    file.write_text(GRAPH)
    return file


def test_known_keys_set_without_plus(graph: Path) -> None:
    built = build(
        graph,
        [
            "components.backend.max_inflight=8",  # a field the file leaves out
            "components.backend.gpus.per_replica=0",  # inside a section the file leaves out
            "components.backend.env.DYN_EXAMPLE=1",  # a new entry of a free mapping
            "components.frontend.http.port=18123",
            "hosts.local.gpus=0",
            "++components.backend.migration_limit=2",  # Hydra's own forms still work
        ],
        env={},
    )
    backend = next(p for p in built.plan.processes if p.name == "backend-0")
    assert backend.argv[backend.argv.index("--max-inflight") + 1] == "8"
    assert backend.argv[backend.argv.index("--migration-limit") + 1] == "2"
    assert backend.env["DYN_EXAMPLE"] == "1"
    frontend = next(p for p in built.plan.processes if p.name == "frontend-0")
    assert "18123" in frontend.argv


def test_unknown_key_still_refused_with_its_name(graph: Path) -> None:
    with pytest.raises(GraphError) as e:
        build(graph, ["components.backend.replica=2"], env={})
    (problem,) = e.value.problems
    assert problem.path == "components.backend.replica"
    assert str(problem.location) == "<override>"
