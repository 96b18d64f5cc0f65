"""The supervisor's /metrics collector (sup_metrics.py) on a supervisor that runs nothing yet and
an autoscaler with one decision: the planner's series are its last decision's numbers, an
unmeasured latency is left out rather than written as 0, and a change is counted by direction."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.registry import CollectorRegistry

from dynamo_graph.graph.targets.local.planner import Autoscaler, Decision, SupervisorPools
from dynamo_graph.graph.targets.local.state import StateDir
from dynamo_graph.graph.targets.local.sup_metrics import SupervisorCollector
from dynamo_graph.graph.targets.local.supervisor import Supervisor


def test_the_planners_last_decision_and_changes_are_series(tmp_path: Path) -> None:
    state = StateDir(tmp_path / "state")
    state.ensure()
    sup = Supervisor(state, lambda *_: None)
    planner = Autoscaler(SupervisorPools(sup))
    planner.decisions["decode"] = Decision(
        0.0, "decode", 2, 3, 11.5, 250.0, None, 4.0, "why", "capped below 4", output_tokens_s=690.0
    )
    planner.changes[("decode", "up")] += 2
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SupervisorCollector(sup, planner))
    lines = generate_latest(registry).decode().splitlines()
    for line in (
        'dyngraph_autoscale_desired_replicas{pool="decode"} 3.0',
        'dyngraph_autoscale_ready_replicas{pool="decode"} 2.0',
        'dyngraph_autoscale_arrival_rate{pool="decode"} 11.5',
        'dyngraph_autoscale_capacity{pool="decode"} 4.0',
        'dyngraph_autoscale_output_tokens_rate{pool="decode"} 690.0',
        'dyngraph_autoscale_ttft_p90_ms{pool="decode"} 250.0',
        'dyngraph_autoscale_capped{pool="decode"} 1.0',
        'dyngraph_autoscale_changes_total{direction="up",pool="decode"} 2.0',
        "dyngraph_revision 0.0",
    ):
        assert line in lines, "\n".join(lines)
    assert not any(line.startswith("dyngraph_autoscale_itl_p90_ms{") for line in lines)
