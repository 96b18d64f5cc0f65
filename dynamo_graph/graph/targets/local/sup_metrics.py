"""The supervisor's own `/metrics` (`supervisor: {metrics_port: N}` in the graph): what it runs
and what it decided, for Prometheus — the frontends' /metrics know requests, not replicas.

Every series is read from the supervisor's state at scrape time, inside its event loop (the
server is asyncio's, so nothing is shared with another thread):

- `dyngraph_replicas{component, state}`: processes by state (`starting`, `ready`, ...;
  `retiring` for old runs a rollout or scale-down is draining);
- `dyngraph_desired_replicas{component}`: what the graph (or its planner) wants;
- `dyngraph_process_restarts_total{component, process}`;
- `dyngraph_revision` and `dyngraph_revision_rolling` (1 while a revision rolls out);
- per autoscaled pool, the planner's last decision: `dyngraph_autoscale_desired_replicas`,
  `_ready_replicas`, `_arrival_rate` (requests/s), `_prompt_tokens_rate` and
  `_output_tokens_rate` (tokens/s), `_capacity` (a replica's, in the measure the decision was
  sized by; absent until learned), `_ttft_p90_ms`, `_itl_p90_ms` (absent when unmeasured), `_capped` (1 when
  the pool wants more than fits) and `dyngraph_autoscale_changes_total{pool, direction}`.

`render -f prometheus` scrapes it as the job `<graph>-supervisor`, which adds the `graph` label.
With TLS on it is HTTPS with the supervisor's certificate, and wants the scraper's (graph/tls.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from dynamo_graph.graph.plan import Plan
from dynamo_graph.graph.targets.local.planner import Autoscaler
from dynamo_graph.graph.targets.local.supervisor import Supervisor
from dynamo_graph.graph.tls import SCRAPE_CA, SUPERVISOR, ca_file, cert_files
from dynamo_graph.runtime.metrics_http import MetricsServer
from dynamo_graph.runtime.tls import TlsFiles


class SupervisorCollector(Collector):
    """The series above, from one supervisor and its autoscaler."""

    def __init__(self, sup: Supervisor, autoscaler: Autoscaler) -> None:
        self.sup = sup
        self.autoscaler = autoscaler

    def collect(self) -> Iterator[Metric]:
        sup = self.sup
        replicas = GaugeMetricFamily(
            "dyngraph_replicas", "Processes of a component by state", labels=["component", "state"]
        )
        desired = GaugeMetricFamily(
            "dyngraph_desired_replicas", "Replicas a component should run", labels=["component"]
        )
        restarts = CounterMetricFamily(
            "dyngraph_process_restarts", "Restarts of a process", labels=["component", "process"]
        )
        states: Counter[tuple[str, str]] = Counter()
        wanted: Counter[str] = Counter()
        for runner in sup.runners.values():
            record = runner.record
            states[(record.component, record.state)] += 1
            wanted[record.component] += 1
            restarts.add_metric([record.component, record.name], record.restarts)
        for runner in sup.retiring:
            states[(runner.record.component, "retiring")] += 1
        for (component, state), count in sorted(states.items()):
            replicas.add_metric([component, state], count)
        for component, count in {**wanted, **sup.desired}.items():
            desired.add_metric([component], count)
        revision = GaugeMetricFamily(
            "dyngraph_revision", "The graph revision serving or rolling out", labels=[]
        )
        rolling = GaugeMetricFamily("dyngraph_revision_rolling", "1 while a revision rolls out", labels=[])
        revision.add_metric([], sup.revision.number if sup.revision is not None else 0)
        rolling.add_metric([], 1 if sup.rolling is not None else 0)
        yield from (replicas, desired, restarts, revision, rolling)
        yield from self._planner()

    def _planner(self) -> Iterator[Metric]:
        labels = ["pool"]
        gauges = {
            "desired": GaugeMetricFamily(
                "dyngraph_autoscale_desired_replicas", "Planner: replicas decided", labels=labels
            ),
            "ready": GaugeMetricFamily(
                "dyngraph_autoscale_ready_replicas", "Planner: replicas ready", labels=labels
            ),
            "rate": GaugeMetricFamily(
                "dyngraph_autoscale_arrival_rate", "Planner: requests/s to the pool", labels=labels
            ),
            "prompt_tokens_s": GaugeMetricFamily(
                "dyngraph_autoscale_prompt_tokens_rate", "Planner: prompt tokens/s to the pool", labels=labels
            ),
            "output_tokens_s": GaugeMetricFamily(
                "dyngraph_autoscale_output_tokens_rate", "Planner: tokens/s the pool answered", labels=labels
            ),
            "capacity": GaugeMetricFamily(
                "dyngraph_autoscale_capacity",
                "Planner: what one replica serves within target, in the measure the pool is sized by",
                labels=labels,
            ),
            "ttft_p90_ms": GaugeMetricFamily(
                "dyngraph_autoscale_ttft_p90_ms", "Planner: TTFT p90 measured", labels=labels
            ),
            "itl_p90_ms": GaugeMetricFamily(
                "dyngraph_autoscale_itl_p90_ms", "Planner: ITL p90 measured", labels=labels
            ),
        }
        capped = GaugeMetricFamily(
            "dyngraph_autoscale_capped", "Planner: 1 when the pool wants more than fits", labels=labels
        )
        changes = CounterMetricFamily(
            "dyngraph_autoscale_changes", "Planner: pool size changes", labels=["pool", "direction"]
        )
        for pool, decision in sorted(self.autoscaler.decisions.items()):
            for key, family in gauges.items():
                value = getattr(decision, key)
                if value is not None:
                    family.add_metric([pool], value)
            capped.add_metric([pool], 1 if decision.capped else 0)
        for (pool, direction), count in sorted(self.autoscaler.changes.items()):
            changes.add_metric([pool, direction], count)
        yield from (*gauges.values(), capped, changes)


def metrics_server(sup: Supervisor, autoscaler: Autoscaler) -> MetricsServer:
    """The supervisor's /metrics server; `follow` binds it where the plan says."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SupervisorCollector(sup, autoscaler))
    return MetricsServer(registry, "supervisor metrics")


async def follow(server: MetricsServer, plan: Plan) -> None:
    """Serve where `plan` says, over TLS for the scraper's certificate when the graph has TLS on."""
    tls = None
    if plan.tls is not None and SUPERVISOR in plan.tls.names:
        tls = TlsFiles(ca_file(plan.tls.dir, SCRAPE_CA), *cert_files(plan.tls.dir, SUPERVISOR))
    await server.follow(plan.supervisor_metrics, tls)
