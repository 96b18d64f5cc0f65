"""`render -f prometheus` and `render -f grafana`: the graph's monitoring, from the graph itself.

The metrics endpoints of a graph on this machine and its ssh hosts are its frontends' /metrics
(one per frontend component: its replicas share a port and answer /metrics for all of them,
frontend/group.py). Workers have no endpoint of their own; what the frontends know of them is on
the frontends' /metrics: requests and time to first response per worker are on /health, and with
kv routing each worker rank's last load report (KV blocks in use, capacity, requests running and
waiting) is on /metrics (frontend/router_metrics.py).

`prometheus` is a scrape configuration with a job per frontend component, labelled with the
graph, component and host, and one for the supervisor's own /metrics (replicas, restarts,
revisions, autoscaling: sup_metrics.py) when the graph sets `supervisor.metrics_port`. A port
that is `auto` is taken from the running graph's ports.json (render after `up`), else it is a
problem naming the key. `grafana` is one dashboard: per model
request rate, errors, TTFT and ITL percentiles, output tokens/s and requests in flight; with kv
routing, per worker rank KV use, running and waiting requests and routed requests, and the
router's queue when the graph has one; and whether every target is up. Every expression names
only series the graph's frontends export whatever the traffic (an error rate is `or` zero), so
each returns data once Prometheus has scraped (tests/system/test_observability.py checks it).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from dynamo_graph.graph.errors import GraphError, Problem
from dynamo_graph.graph.plan import Plan
from dynamo_graph.graph.schema import Graph

SCRAPE_INTERVAL = "5s"
RATE_WINDOW = "1m"
FRONTEND = "dynamo_frontend"
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


def render_prometheus(graph: Graph, plan: Plan) -> str:
    """A Prometheus scrape configuration for the graph's metrics endpoints."""
    endpoints = frontend_endpoints(plan)
    auto = [e for e in endpoints if e.address is None]
    if auto:
        why = "is `auto`: Prometheus needs the port; render after `dyngraph up`, or fix the port"
        raise GraphError([Problem(f"components.{e.component}.http.port", why) for e in auto])
    jobs = []
    for e in endpoints:
        component, host, target = e.component, e.host, e.address
        jobs.append(
            {
                "job_name": f"{plan.graph}-{component}",
                "metrics_path": "/metrics",
                "static_configs": [
                    {
                        "targets": [target],
                        "labels": {"graph": plan.graph, "component": component, "host": host},
                    }
                ],
            }
        )
    if plan.supervisor_metrics is not None:
        host, port = plan.supervisor_metrics
        labels = {"graph": plan.graph, "component": "supervisor", "host": "local"}
        jobs.append(
            {
                "job_name": f"{plan.graph}-supervisor",
                "metrics_path": "/metrics",
                "static_configs": [{"targets": [f"{host}:{port}"], "labels": labels}],
            }
        )
    config = {"global": {"scrape_interval": SCRAPE_INTERVAL}, "scrape_configs": jobs}
    head = (
        f"# Prometheus scrape configuration of graph {plan.graph!r} ({plan.graph_file}), by `dyngraph render "
        "-f prometheus`.\n# Frontends on an ssh host must listen where Prometheus can reach them "
        "(http.host), not on 127.0.0.1.\n"
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
        ("Frontends up", "short", f"up{{{sel}}}"),
    ]
    routers = [f.router for f in graph.frontends().values()]
    if any(r.mode == "kv" for r in routers):
        router = f"{FRONTEND}_router"
        by = "by (model, worker_id, dp_rank)"
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
            (
                "Routed requests/s per model",
                "reqps",
                f"sum by (model) (rate({router}_routed_requests_total{{{sel}}}[{w}]))",
            ),
        ]
        if any(r.mode == "kv" and r.queue_threshold is not None for r in routers):
            queries.append(("Router queue", "short", f"sum by (model) ({router}_queue_depth{{{sel}}})"))
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
