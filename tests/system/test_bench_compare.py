"""`dyngraph bench GRAPH --profile ... --compare-static N`: the graph's autoscale and a static pool
brought up in turn under one short load profile on a mocker pool, each variant's requests and
replica-seconds counted, and nothing left running."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from dynamo_graph.bench.replicas import arrivals, parse_profile
from dynamo_graph.graph.paths import state_dir
from dynamo_graph.graph.targets.local.state import StateDir
from tests.support.processes import free_port, port_refuses, run_cli

PROFILE = "2:2,4:2-12,2:2"  # 8 s: a ramp between two quiet steps


def test_compare_static_runs_each_variant_counts_requests_and_replica_seconds(
    tmp_path: Path, tiny_model: Path
) -> None:
    port = free_port()
    file = tmp_path / "scaled.yaml"
    backend = {
        "kind": "worker",
        "model": "tiny-model",
        "engine": "mocker",
        "replicas": 1,
        "engine_args": {"max_num_seqs": 2, "speedup_ratio": 8.0},
        "autoscale": {
            "min_replicas": 1,
            "max_replicas": 2,
            "target": {"ttft_p90_ms": 500, "itl_p90_ms": 200},
            "interval_s": 1.0,
            "scale_down_delay_s": 2.0,
        },
    }
    graph = {
        "name": "bench-compare",
        "models": {"tiny-model": {"path": str(tiny_model)}},
        "components": {"frontend": {"kind": "frontend", "http": {"port": port}}, "backend": backend},
    }
    file.write_text(yaml.safe_dump(graph))
    out = tmp_path / "out"
    args = ["bench", str(file), "--profile", PROFILE, "--compare-static", "2", "--output-len", "8"]
    try:
        done = run_cli([*args, "--input-len", "16", "--no-plots", "-o", str(out)], timeout=150)
    finally:
        run_cli(["down", str(file)], timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "autoscale vs static (SLA: TTFT <= 500 ms and ITL <= 200 ms)" in done.stdout
    sweep = json.loads((out / "sweep.json").read_text())
    assert sweep["compare_static"] == {
        "pools": ["backend"],
        "counts": [2],
        "targets": {"ttft_ms": 500.0, "itl_ms": 200.0},
    }
    sent = len(arrivals(parse_profile(PROFILE)))
    figures = {v["label"]: v["comparison"] for v in sweep["variants"]}
    assert set(figures) == {"autoscale", "static-2"}
    for name, f in figures.items():
        assert f["requests"] == sent and f["lost"] == 0, name
        assert 0.0 < f["sla_attainment"] <= 1.0 and f["ttft_p90_ms"] > 0, name
    # two replicas for the whole profile, against one at first (and two at most) for autoscale
    static = figures["static-2"]
    assert static["max_ready"] == {"backend": 2}
    assert 2 * 7 < static["replica_seconds"] <= 2 * 12
    assert 7 < figures["autoscale"]["replica_seconds"] < static["replica_seconds"]
    assert StateDir(state_dir(file)).supervisor() is None and port_refuses(port)
