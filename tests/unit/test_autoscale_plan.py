"""What the compiler makes of `autoscale` (the most replicas that fit, compiled ahead as
standby) and what the supervisor runs of it (supervisor.scaled)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from dynamo_graph.graph.build import build
from dynamo_graph.graph.errors import GraphError
from dynamo_graph.graph.targets.local.supervisor import scaled


def _graph(tmp_path: Path, tiny_model: Path, **top: Any) -> Path:
    graph = {
        "name": "as",
        "hosts": {"local": {"gpus": 2}},
        "models": {"m": {"path": str(tiny_model)}},
        "components": {
            "frontend": {"kind": "frontend"},
            "backend": {
                "kind": "worker",
                "model": "m",
                "engine": "mocker",
                "replicas": 1,
                "gpus": {"per_replica": 1},
                "autoscale": {"min_replicas": 1, "max_replicas": 4, "target": {"ttft_p90_ms": 500}},
            },
        },
        **top,
    }
    file = tmp_path / "g.yaml"
    file.write_text(yaml.safe_dump(graph))
    return file


def test_a_pool_stops_at_the_gpus_its_host_declares_and_says_why(tmp_path: Path, tiny_model: Path) -> None:
    plan = build(_graph(tmp_path, tiny_model), []).plan
    policy = plan.autoscale["backend"]
    assert (policy.max_replicas, policy.wanted_max) == (2, 4)
    assert policy.capped == "host 'local' has 2 GPU(s) and 1 per replica"
    assert [p.name for p in plan.processes if p.component == "backend"] == ["backend-0"]
    assert [(p.name, p.env["CUDA_VISIBLE_DEVICES"]) for p in plan.standby] == [("backend-1", "1")]


def test_max_gpus_caps_the_pool_too(tmp_path: Path, tiny_model: Path) -> None:
    plan = build(_graph(tmp_path, tiny_model, max_gpus=1), []).plan
    assert plan.autoscale["backend"].max_replicas == 1 and plan.autoscale["backend"].capped == "max_gpus is 1"
    with pytest.raises(GraphError, match="max_gpus"):
        build(_graph(tmp_path, tiny_model, max_gpus=0), [])


def test_the_supervisor_runs_the_desired_replicas_in_plan_order(tmp_path: Path, tiny_model: Path) -> None:
    plan = build(_graph(tmp_path, tiny_model), []).plan
    assert [p.name for p in scaled(plan, {"backend": 2}).processes] == [
        "backend-0",
        "backend-1",
        "frontend-0",
    ]
    assert [p.name for p in scaled(plan, {"backend": 0}).processes] == ["frontend-0"]
