"""`render -f prometheus` and `-f grafana` of small graphs: a job per frontend, `auto` ports taken
from the running graph or refused by key, and dashboard panels only for what the graph exports
(tests/system/test_observability.py scrapes a running graph with a real Prometheus)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from dynamo_graph.graph.build import build
from dynamo_graph.graph.errors import GraphError
from dynamo_graph.graph.targets.dispatch import render
from dynamo_graph.graph.targets.local.monitoring import frontend_endpoints

GRAPH = """
name: demo
models:
  tiny:
    path: ./model
    kv_cache_block_size: 16
components:
  frontend:
    kind: frontend
    http: {{port: {port}}}
    router: {router}
  backend:
    kind: worker
    model: tiny
    engine: mocker
"""


def _built(tmp_path: Path, port: str = "18555", router: str = "{mode: round-robin}"):  # type: ignore[no-untyped-def]
    (tmp_path / "model").mkdir(exist_ok=True)
    path = tmp_path / "graph.yaml"
    path.write_text(GRAPH.format(port=port, router=router))
    return build(path)


def test_a_scrape_job_per_frontend_labelled_with_the_graph(tmp_path: Path):
    built = _built(tmp_path)
    config = yaml.safe_load(render(built.graph, built.plan, "prometheus"))
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "demo-frontend" and job["metrics_path"] == "/metrics"
    (static,) = job["static_configs"]
    assert static["targets"] == ["127.0.0.1:18555"]
    assert static["labels"] == {"graph": "demo", "component": "frontend", "host": "local"}


def test_an_auto_port_comes_from_the_running_graph_or_is_a_problem(tmp_path: Path):
    built = _built(tmp_path, port="auto")
    with pytest.raises(GraphError, match=r"components\.frontend\.http\.port: is `auto`"):
        render(built.graph, built.plan, "prometheus")
    state = Path(built.plan.state_dir)
    state.mkdir(parents=True)
    (state / "ports.json").write_text(json.dumps({"frontend-0.http": 40123}))
    config = yaml.safe_load(render(built.graph, built.plan, "prometheus"))
    assert config["scrape_configs"][0]["static_configs"][0]["targets"] == ["127.0.0.1:40123"]


def _exprs(tmp_path: Path, router: str) -> dict[str, str]:
    built = _built(tmp_path, router=router)
    panels = json.loads(render(built.graph, built.plan, "grafana"))["panels"]
    return {p["title"]: p["targets"][0]["expr"] for p in panels}


def test_dashboard_panels_follow_the_router(tmp_path: Path):
    plain = _exprs(tmp_path, "{mode: round-robin}")
    assert "TTFT p90" in plain and "KV cache use per worker" not in plain
    assert all('graph="demo"' in e for e in plain.values())
    kv = _exprs(tmp_path, "{mode: kv}")
    assert "dynamo_frontend_router_kv_capacity_blocks" in kv["KV cache use per worker"]
    assert "Router queue" not in kv
    queued = _exprs(tmp_path, "{mode: kv, queue_threshold: 0.5}")
    assert "dynamo_frontend_router_queue_depth" in queued["Router queue"]


KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKey"
REMOTE = f"""
name: edge
hosts:
  local: {{advertise_host: 10.0.0.1}}
  gpu1: {{ssh: {{address: 10.0.0.5, host_key: "{KEY}"}}}}
runtime: {{discovery: etcd, request_plane: tcp, event_plane: nats}}
infra: {{etcd: {{managed: true}}, nats: {{managed: true}}}}
models: {{m: {{path: /models/llama}}}}
components:
  frontend: {{kind: frontend, host: gpu1, http: {{port: 18555, host: BIND}}}}
  backend: {{kind: worker, model: m, engine: mocker}}
"""


def test_a_frontend_on_an_ssh_host_is_scraped_at_the_host_unless_it_listens_on_loopback(tmp_path: Path):
    path = tmp_path / "graph.yaml"
    for bind, expected in (("0.0.0.0", ("10.0.0.5:18555", False)), ("127.0.0.1", ("127.0.0.1:18555", True))):
        path.write_text(REMOTE.replace("BIND", bind))
        (endpoint,) = frontend_endpoints(build(path).plan)
        assert (endpoint.host, endpoint.address, endpoint.loopback_remote) == ("gpu1", *expected)


def test_the_supervisors_metrics_are_scraped_and_charted_when_the_graph_serves_them(tmp_path: Path):
    (tmp_path / "model").mkdir()
    path = tmp_path / "graph.yaml"
    path.write_text(
        GRAPH.format(port="18555", router="{mode: round-robin}") + "supervisor: {metrics_port: 19555}\n"
    )
    built = build(path)
    config = yaml.safe_load(render(built.graph, built.plan, "prometheus"))
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs["demo-supervisor"]["static_configs"][0]["targets"] == ["127.0.0.1:19555"]
    panels = json.loads(render(built.graph, built.plan, "grafana"))["panels"]
    exprs = [panel["targets"][0]["expr"] for panel in panels]
    assert any(expr.startswith("sum by (component, state) (dyngraph_replicas") for expr in exprs)
