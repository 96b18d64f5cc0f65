"""`render -f prometheus` and `-f grafana` of small graphs: a job per frontend and per worker
component (a target per replica), the workers' --metrics-port, `auto` ports taken
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


def _built(tmp_path: Path, port: str = "18555", router: str = "{mode: round-robin}", engine: str = "mocker"):  # type: ignore[no-untyped-def]
    (tmp_path / "model").mkdir(exist_ok=True)
    path = tmp_path / "graph.yaml"
    path.write_text(GRAPH.format(port=port, router=router).replace("engine: mocker", f"engine: {engine}"))
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


def _exprs(tmp_path: Path, router: str, engine: str = "mocker") -> dict[str, str]:
    built = _built(tmp_path, router=router, engine=engine)
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


def test_the_ranks_load_is_charted_only_for_engines_that_report_it(tmp_path: Path):
    reported = ("KV cache use per worker", "Running requests per worker", "Waiting requests per worker")
    llamacpp = _exprs(tmp_path, "{mode: kv, use_kv_events: false}", "llamacpp")
    assert "Routed requests/s per model" in llamacpp and not set(reported) & set(llamacpp)
    assert "dyngraph_llamacpp_requests" in llamacpp["llama.cpp requests"]
    vllm = _exprs(tmp_path, "{mode: kv}", "vllm")
    assert set(reported) <= set(vllm)


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


WORKERS = """
name: demo
models: {tiny: {path: ./model}}
components:
  frontend: {kind: frontend, http: {port: 18555}}
  backend: {kind: worker, model: tiny, engine: ENGINE, replicas: 2, metrics_port: PORT}
"""


def _workers(tmp_path: Path, port: str, engine: str = "mocker"):  # type: ignore[no-untyped-def]
    (tmp_path / "model").mkdir(exist_ok=True)
    path = tmp_path / "graph.yaml"
    path.write_text(WORKERS.replace("PORT", port).replace("ENGINE", engine))
    return build(path)


def test_each_worker_replica_gets_its_metrics_port_on_its_command_line(tmp_path: Path):
    fixed = _workers(tmp_path, "19600").plan.processes
    workers = [p for p in fixed if p.component == "backend"]
    for i, spec in enumerate(workers):
        at = spec.argv.index("--metrics-port")
        assert spec.argv[at : at + 4] == ["--metrics-port", str(19600 + i), "--metrics-host", "127.0.0.1"]
        assert spec.ports == {f"backend-{i}.metrics": 19600 + i}
    auto = [p for p in _workers(tmp_path, "auto").plan.processes if p.component == "backend"]
    assert [p.argv[p.argv.index("--metrics-port") + 1] for p in auto] == [
        "{port:backend-0.metrics}",
        "{port:backend-1.metrics}",
    ]
    off = [p for p in _workers(tmp_path, "null").plan.processes if p.component == "backend"]
    assert all("--metrics-port" not in p.argv and not p.ports for p in off)


def test_a_fixed_metrics_port_that_clashes_is_a_problem(tmp_path: Path):
    with pytest.raises(GraphError, match=r"components\.backend\.metrics_port: port 18555"):
        _workers(tmp_path, "18554")  # replica 1 would take the frontend's port


def test_a_scrape_job_per_worker_component_with_a_target_per_replica(tmp_path: Path):
    built = _workers(tmp_path, "19600")
    jobs = {
        j["job_name"]: j
        for j in yaml.safe_load(render(built.graph, built.plan, "prometheus"))["scrape_configs"]
    }
    assert [(s["targets"], s["labels"]) for s in jobs["demo-backend"]["static_configs"]] == [
        (
            ["127.0.0.1:19600"],
            {"graph": "demo", "component": "backend", "host": "local", "process": "backend-0"},
        ),
        (
            ["127.0.0.1:19601"],
            {"graph": "demo", "component": "backend", "host": "local", "process": "backend-1"},
        ),
    ]
    auto = _workers(tmp_path, "auto")
    text = render(auto.graph, auto.plan, "prometheus")
    assert "demo-backend" not in text and "Not scraped: the workers of backend" in text
    state = Path(auto.plan.state_dir)
    state.mkdir(parents=True, exist_ok=True)
    (state / "ports.json").write_text(json.dumps({"backend-0.metrics": 40001, "backend-1.metrics": 40002}))
    jobs = {
        j["job_name"]: j
        for j in yaml.safe_load(render(auto.graph, auto.plan, "prometheus"))["scrape_configs"]
    }
    assert [s["targets"] for s in jobs["demo-backend"]["static_configs"]] == [
        ["127.0.0.1:40001"],
        ["127.0.0.1:40002"],
    ]


def test_a_worker_on_an_ssh_host_listens_and_is_scraped_at_its_address(tmp_path: Path):
    path = tmp_path / "graph.yaml"
    graph = REMOTE.replace("BIND", "0.0.0.0").replace(
        "backend: {kind: worker, model: m, engine: mocker}",
        "backend: {kind: worker, model: m, engine: mocker, placement: [local, gpu1], replicas: 2,"
        " metrics_port: 19700}",
    )
    path.write_text(graph)
    built = build(path)
    jobs = {
        j["job_name"]: j
        for j in yaml.safe_load(render(built.graph, built.plan, "prometheus"))["scrape_configs"]
    }
    assert [(s["targets"], s["labels"]["host"]) for s in jobs["edge-backend"]["static_configs"]] == [
        (["10.0.0.1:19700"], "local"),
        (["10.0.0.5:19701"], "gpu1"),
    ]


def test_worker_panels_follow_the_engines_the_graph_runs(tmp_path: Path):
    def titles(port: str, engine: str) -> dict[str, str]:
        built = _workers(tmp_path, port, engine)
        panels = json.loads(render(built.graph, built.plan, "grafana"))["panels"]
        return {p["title"]: p["targets"][0]["expr"] for p in panels}

    mocker = titles("auto", "mocker")
    assert "dyngraph_worker_inflight_requests" in mocker["Worker requests in flight"]
    assert "dyngraph_mocker_kv_cache_usage_ratio" in mocker["Mocker KV cache use per worker"]
    echo = titles("auto", "echo_core")
    assert "Worker requests in flight" in echo and not any(t.startswith("Mocker") for t in echo)
    vllm = titles("auto", "vllm")
    assert "vllm:kv_cache_usage_perc" in vllm["vLLM KV cache use"]
    off = titles("null", "mocker")
    assert not any(t.startswith(("Worker", "Mocker")) for t in off)


def test_a_frontend_over_https_is_scraped_over_https_verified_with_the_graphs_ca(tmp_path: Path):
    files = "cert_file: certs/api.crt, key_file: certs/api.key"
    anchored = _built(tmp_path, port=f"18555, tls: {{{files}, ca_file: certs/ca.crt}}")
    text = render(anchored.graph, anchored.plan, "prometheus")
    (job,) = yaml.safe_load(text)["scrape_configs"]
    assert job["scheme"] == "https"
    assert job["tls_config"] == {"ca_file": str(tmp_path / "certs" / "ca.crt")}
    assert "no ca_file" not in text
    assert "ca.crt" not in " ".join(anchored.plan.processes[0].argv)  # the scraper's, not the server's
    system = _built(tmp_path, port=f"18555, tls: {{{files}}}")
    text = render(system.graph, system.plan, "prometheus")
    (job,) = yaml.safe_load(text)["scrape_configs"]
    assert job["scheme"] == "https" and "tls_config" not in job
    assert "# frontend: HTTPS (http.tls) with no ca_file" in text
    with pytest.raises(
        GraphError, match=r"components\.frontend\.http\.tls\.ca_file: is the CA of `cert_file`"
    ):
        _built(tmp_path, port="18555, tls: {ca_file: certs/ca.crt}")
