"""`render -f prometheus` and `render -f grafana`: the graph's monitoring, from the graph itself.

The metrics endpoints of a graph on this machine and its ssh hosts are its frontends' /metrics
(one per frontend component: its replicas share a port and answer /metrics for all of them,
frontend/group.py), every worker replica's own /metrics (`metrics_port`, on by default: its
requests and its engine's series, backend/metrics.py), and the supervisor's. With kv routing
the frontends' /metrics also carry each worker rank's last load report (frontend/router_metrics.py).

`prometheus` is a scrape configuration with a job per frontend component and per worker
component (a target per replica, labelled with its process), labelled with the graph,
component and host, and one for the supervisor's own /metrics (replicas, restarts,
revisions, autoscaling: sup_metrics.py) when the graph sets `supervisor.metrics_port`. A port
that is `auto` is taken from the running graph's ports.json (render after `up`), else it is a
problem naming the key (a worker's is left out, with a comment saying so). Replicas an
autoscaled pool keeps in standby are not scraped (they are not running until the planner
starts them). With TLS on, the workers' and the supervisor's jobs scrape over HTTPS with the
graph's scraper certificate (graph/tls.py): the configuration names the files, never their
contents. A frontend with `http.tls` is scraped over HTTPS, verified with its `ca_file` where
the graph gives one (else against the trusted CAs of Prometheus's machine, which a comment says).

`grafana` is one dashboard: per model request rate, errors, TTFT and ITL percentiles, output
tokens/s and requests in flight; with kv routing, per worker rank KV use, running and waiting
requests (those only where a worker's engine reports its load: registry.py `load_reports`)
and routed requests, and the router's queue when the graph has one; per worker requests in
flight and ended, and its engine's own series (mocker, vLLM, llama.cpp) for the engines the
graph's workers run; and whether every target is up. Every expression names only series the
graph's processes export whatever the traffic (a ratio or an error rate is `or` zero), so each
returns data once Prometheus has scraped (tests/system/test_observability.py checks it for the
mocker, test_observability_llamacpp.py for llama.cpp, test_vllm_observability.py for vLLM).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from dynamo_graph.engines.registry import ENGINES
from dynamo_graph.graph.compile import file_path
from dynamo_graph.graph.errors import GraphError, Problem
from dynamo_graph.graph.plan import Plan
from dynamo_graph.graph.schema import Graph
from dynamo_graph.graph.tls import METRICS_NAME, SCRAPER, ca_file, cert_files

SCRAPE_INTERVAL = "5s"
RATE_WINDOW = "1m"
FRONTEND = "dynamo_frontend"
# Engines whose ranks report their load to the kv router (the `reported_*` gauges).
LOAD_REPORTING = {name for name, spec in ENGINES.items() if spec.load_reports}
_PLACEHOLDER = re.compile(r"\{port:([^}]+)\}")


LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class Endpoint:
    """Where a frontend component's /health and /metrics answer."""

    component: str
    host: str  # the host key (`local` or one of `hosts`)
    address: str | None  # HOST:PORT; None: its port is `auto` and not allocated yet
    loopback_remote: bool  # on an ssh host, listening on loopback only: not reachable from here


def frontend_endpoints(plan: Plan) -> list[Endpoint]:
    """Each frontend component's endpoint (its replicas share it), from the plan's readiness
    probes; `auto` ports from the running graph's ports.json."""
    ports_file = Path(plan.state_dir) / "ports.json"
    auto = json.loads(ports_file.read_text()) if ports_file.exists() else {}
    out: dict[str, Endpoint] = {}
    for spec in plan.processes:
        target = spec.readiness.target
        if not (spec.shares_ports and spec.readiness.kind == "http" and target.endswith("/health")):
            continue
        if spec.component in out:
            continue
        url = _PLACEHOLDER.sub(lambda m: str(auto.get(m.group(1), m.group(0))), target)
        parts = urlsplit(url)
        host = parts.hostname or "127.0.0.1"
        loopback_remote = False
        if spec.host in plan.hosts and host in LOOPBACK:
            bind = spec.argv[spec.argv.index("--http-host") + 1] if "--http-host" in spec.argv else host
            loopback_remote = bind in LOOPBACK
            host = host if loopback_remote else plan.hosts[spec.host].address
        address = None if _PLACEHOLDER.search(url) else f"{host}:{parts.port}"
        out[spec.component] = Endpoint(spec.component, spec.host, address, loopback_remote)
    return list(out.values())


@dataclass(frozen=True)
class WorkerEndpoint:
    """Where one worker replica's /metrics answers."""

    component: str
    process: str
    host: str  # the host key
    address: str | None  # HOST:PORT; None: its port is `auto` and not allocated yet


def worker_endpoints(plan: Plan) -> list[WorkerEndpoint]:
    """Every running worker replica's /metrics (--metrics-host/--metrics-port in its argv, as the
    compiler wrote them); `auto` ports from the running graph's ports.json."""
    ports_file = Path(plan.state_dir) / "ports.json"
    auto = json.loads(ports_file.read_text()) if ports_file.exists() else {}
    out = []
    for spec in plan.processes:
        if "--metrics-port" not in spec.argv:
            continue
        port = spec.argv[spec.argv.index("--metrics-port") + 1]
        host = spec.argv[spec.argv.index("--metrics-host") + 1]
        port = _PLACEHOLDER.sub(lambda m: str(auto.get(m.group(1), m.group(0))), port)
        address = None if _PLACEHOLDER.search(port) else f"{host}:{port}"
        out.append(WorkerEndpoint(spec.component, spec.name, spec.host, address))
    return out


def render_prometheus(graph: Graph, plan: Plan) -> str:
    """A Prometheus scrape configuration for the graph's metrics endpoints."""
    endpoints = frontend_endpoints(plan)
    workers = worker_endpoints(plan)
    why = "is `auto`: Prometheus needs the port; render after `dyngraph up`, or fix the port"
    problems = [Problem(f"components.{e.component}.http.port", why) for e in endpoints if e.address is None]
    if problems:
        raise GraphError(problems)
    unallocated = list(dict.fromkeys(w.component for w in workers if w.address is None))
    jobs = []
    tls: dict[str, Any] = {}  # how the graph's own listeners (not the frontends') are scraped
    if plan.tls is not None:
        cert, key = cert_files(plan.tls.dir, SCRAPER)
        tls = {
            "scheme": "https",
            "tls_config": {
                "ca_file": ca_file(plan.tls.dir),
                "cert_file": cert,
                "key_file": key,
                "server_name": METRICS_NAME,
            },
        }

    def job(component: str, targets: list[tuple[str | None, dict[str, str]]], **more: Any) -> None:
        labels = {"graph": plan.graph, "component": component}
        configs = [{"targets": [target], "labels": {**labels, **extra}} for target, extra in targets]
        jobs.append(
            {
                "job_name": f"{plan.graph}-{component}",
                "metrics_path": "/metrics",
                **more,
                "static_configs": configs,
            }
        )

    https = {name: f.http.tls for name, f in graph.frontends().items() if f.http.tls is not None}
    graph_dir = Path(plan.graph_file).parent
    for e in endpoints:
        frontend: dict[str, Any] = {}
        if (served := https.get(e.component)) is not None:
            frontend["scheme"] = "https"
            if served.ca_file is not None:
                frontend["tls_config"] = {"ca_file": file_path(served.ca_file, graph_dir)}
        job(e.component, [(e.address, {"host": e.host})], **frontend)
    by_component: dict[str, list[WorkerEndpoint]] = {}
    for w in workers:
        if w.address is not None:
            by_component.setdefault(w.component, []).append(w)
    for component, replicas in by_component.items():
        job(component, [(w.address, {"host": w.host, "process": w.process}) for w in replicas], **tls)
    if plan.supervisor_metrics is not None:
        host, port = plan.supervisor_metrics
        job("supervisor", [(f"{host}:{port}", {"host": "local"})], **tls)
    config = {"global": {"scrape_interval": SCRAPE_INTERVAL}, "scrape_configs": jobs}
    head = (
        f"# Prometheus scrape configuration of graph {plan.graph!r} ({plan.graph_file}), by `dyngraph render "
        "-f prometheus`.\n# Frontends on an ssh host must listen where Prometheus can reach them "
        "(http.host), not on 127.0.0.1; workers listen on their host's address.\n"
    )
    if plan.tls is not None:
        head += (
            "# TLS is on: workers and the supervisor are scraped over HTTPS with the graph's scraper "
            "certificate,\n# files on the machine that ran `up` (copy them where Prometheus runs).\n"
        )
    unanchored = [name for name, served in https.items() if served.ca_file is None]
    if unanchored:
        head += (
            f"# {', '.join(unanchored)}: HTTPS (http.tls) with no ca_file, so Prometheus checks the "
            "certificate against its machine's\n# trusted CAs and the address scraped; give "
            "http.tls.ca_file for one of a CA of your own.\n"
        )
    if unallocated:
        head += (
            f"# Not scraped: the workers of {', '.join(unallocated)}, whose metrics_port is `auto`: "
            "render after `dyngraph up` to scrape them.\n"
        )
    return head + yaml.safe_dump(config, sort_keys=False)


def dashboard_queries(graph: Graph, plan: Plan) -> list[tuple[str, str, str]]:
    """(panel title, unit, PromQL) of every panel, for this graph's frontends' settings."""
    sel = f'graph="{plan.graph}"'
    w = RATE_WINDOW
    requests = f"{FRONTEND}_requests_total{{{sel}}}"

    def quantile(q: float, name: str) -> str:
        return f"histogram_quantile({q}, sum by (le, model) (rate({FRONTEND}_{name}_bucket{{{sel}}}[{w}])))"

    queries = [
        ("Requests/s per model", "reqps", f"sum by (model) (rate({requests}[{w}]))"),
        (
            "Errors/s per model",
            "reqps",
            f'sum by (model) (rate({FRONTEND}_requests_total{{{sel},status="error"}}[{w}])) '
            f"or (0 * sum by (model) (rate({requests}[{w}])))",
        ),
        ("TTFT p50", "s", quantile(0.5, "time_to_first_token_seconds")),
        ("TTFT p90", "s", quantile(0.9, "time_to_first_token_seconds")),
        ("ITL p50", "s", quantile(0.5, "inter_token_latency_seconds")),
        ("ITL p90", "s", quantile(0.9, "inter_token_latency_seconds")),
        (
            "Output tokens/s per model",
            "short",
            f"sum by (model) (rate({FRONTEND}_output_sequence_tokens_sum{{{sel}}}[{w}]))",
        ),
        ("Requests in flight", "short", f"sum by (model) ({FRONTEND}_inflight_requests{{{sel}}})"),
        ("Targets up", "short", f"up{{{sel}}}"),
    ]
    routers = [f.router for f in graph.frontends().values()]
    if any(r.mode == "kv" for r in routers):
        router = f"{FRONTEND}_router"
        by = "by (model, worker_id, dp_rank)"
        queries.append(
            (
                "Routed requests/s per model",
                "reqps",
                f"sum by (model) (rate({router}_routed_requests_total{{{sel}}}[{w}]))",
            )
        )
        if any(w.engine in LOAD_REPORTING for w in graph.workers().values()):  # their reports
            queries += [
                (
                    "KV cache use per worker",
                    "percentunit",
                    f"max {by} ({router}_reported_active_blocks{{{sel}}}) "
                    f"/ max {by} ({router}_kv_capacity_blocks{{{sel}}})",
                ),
                (
                    "Running requests per worker",
                    "short",
                    f"max {by} ({router}_reported_running_requests{{{sel}}})",
                ),
                (
                    "Waiting requests per worker",
                    "short",
                    f"max {by} ({router}_reported_waiting_requests{{{sel}}})",
                ),
            ]
        if any(r.mode == "kv" and r.queue_threshold is not None for r in routers):
            queries.append(("Router queue", "short", f"sum by (model) ({router}_queue_depth{{{sel}}})"))
    queries += _worker_queries(graph, sel)
    if plan.supervisor_metrics is not None:  # the supervisor's own endpoint (sup_metrics.py)
        queries += [
            ("Replicas by state", "short", f"sum by (component, state) (dyngraph_replicas{{{sel}}})"),
            (
                "Restarts per component",
                "short",
                f"sum by (component) (dyngraph_process_restarts_total{{{sel}}})",
            ),
            ("Revision", "short", f"dyngraph_revision{{{sel}}}"),
            ("Revision rolling out", "short", f"dyngraph_revision_rolling{{{sel}}}"),
        ]
        if plan.autoscale:
            queries.append(
                (
                    "Autoscaled pools: desired replicas",
                    "short",
                    f"dyngraph_autoscale_desired_replicas{{{sel}}}",
                )
            )
    return queries


def _worker_queries(graph: Graph, sel: str) -> list[tuple[str, str, str]]:
    """Panels of the workers' own /metrics (backend/metrics.py), and of the engines they run."""
    workers = [w for w in graph.workers().values() if w.metrics_port is not None]
    if not workers:
        return []
    w = RATE_WINDOW
    by = "by (component, process)"
    queries = [
        (
            "Worker requests in flight",
            "short",
            f"sum {by} (dyngraph_worker_inflight_requests{{{sel}}})",
        ),
        (
            "Worker requests ended/s by status",
            "reqps",
            f"sum by (component, status) (rate(dyngraph_worker_requests_total{{{sel}}}[{w}]))",
        ),
    ]
    engines = {worker.engine for worker in workers}
    if "mocker" in engines:
        m = "dyngraph_mocker"
        hits = f"sum by (component) (rate({m}_prefix_cache_hit_tokens_total{{{sel}}}[{w}]))"
        prompts = f"sum by (component) (rate({m}_prompt_tokens_total{{{sel}}}[{w}]))"
        queries += [
            (
                "Mocker KV cache use per worker",
                "percentunit",
                f"max by (process, dp_rank) ({m}_kv_cache_usage_ratio{{{sel}}})",
            ),
            ("Mocker running requests", "short", f"sum {by} ({m}_num_requests_running{{{sel}}})"),
            ("Mocker waiting requests", "short", f"sum {by} ({m}_num_requests_waiting{{{sel}}})"),
            (
                "Mocker prefix cache hit rate",
                "percentunit",
                f"{hits} / ({prompts} > 0) or (0 * {prompts})",
            ),
        ]
    if "vllm" in engines:
        queries += [
            ("vLLM KV cache use", "percentunit", f"max {by} (vllm:kv_cache_usage_perc{{{sel}}})"),
            ("vLLM running requests", "short", f"sum {by} (vllm:num_requests_running{{{sel}}})"),
            ("vLLM waiting requests", "short", f"sum {by} (vllm:num_requests_waiting{{{sel}}})"),
        ]
    if "llamacpp" in engines:
        queries += [
            ("llama.cpp requests", "short", f"sum {by} (dyngraph_llamacpp_requests{{{sel}}})"),
            (
                "llama.cpp sequence slots in use",
                "percentunit",
                f"sum {by} (dyngraph_llamacpp_requests{{{sel}}}) "
                f"/ sum {by} (dyngraph_llamacpp_max_sequences{{{sel}}})",
            ),
            (
                "llama.cpp prompt tokens evaluated/s",
                "short",
                f"sum {by} (rate(dyngraph_llamacpp_prompt_tokens_evaluated_total{{{sel}}}[{w}]))",
            ),
            (
                "llama.cpp decode steps/s",
                "short",
                f"sum {by} (rate(dyngraph_llamacpp_decode_steps_total{{{sel}}}[{w}]))",
            ),
        ]
    return queries


def render_grafana(graph: Graph, plan: Plan) -> str:
    """A Grafana dashboard (JSON, Prometheus datasource `${datasource}`) of the graph."""
    panels: list[dict[str, Any]] = []
    for i, (title, unit, expr) in enumerate(dashboard_queries(graph, plan)):
        panels.append(
            {
                "id": i + 1,
                "type": "timeseries",
                "title": title,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "targets": [{"refId": "A", "expr": expr, "legendFormat": "__auto"}],
            }
        )
    dashboard = {
        "title": f"dyngraph {plan.graph}",
        "uid": f"dyngraph-{re.sub(r'[^a-zA-Z0-9_-]', '-', plan.graph)}"[:40],
        "tags": ["dyngraph"],
        "timezone": "browser",
        "refresh": "10s",
        "schemaVersion": 39,
        "time": {"from": "now-30m", "to": "now"},
        "templating": {
            "list": [
                {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"}
            ]
        },
        "panels": panels,
    }
    return json.dumps(dashboard, indent=2) + "\n"
