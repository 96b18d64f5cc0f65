"""A worker's own `/metrics` (--metrics-port): what its request-plane handler counts and what
its engine reports, for Prometheus (`render -f prometheus` scrapes every worker replica).

The worker's series, labelled with the model it serves (the scrape adds graph, component, host
and process):

- `dyngraph_worker_inflight_requests`: requests in its handler now;
- `dyngraph_worker_requests_total{status}`: requests ended, `served`, `error` (the stream
  ended with an error), `cancelled` (the caller stopped it) or `refused` (over --max-inflight);
- `dyngraph_worker_max_inflight`: its cap (0: none).

The engine's come from `LLMEngine.metrics_collectors()`: the mocker's scheduler, vLLM's own
`vllm:` series, llama.cpp's counters (docs/observability.md lists them).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from dynamo_graph.backend.handlers import InflightCap
from dynamo_graph.runtime.metrics_http import MetricsServer
from dynamo_graph.runtime.tls import TlsFiles


class WorkerCollector(Collector):
    """The worker's series above, from its handler's `InflightCap`."""

    def __init__(self, cap: InflightCap, model: str) -> None:
        self.cap = cap
        self.model = model

    def collect(self) -> Iterator[Metric]:
        cap, labels = self.cap, [self.model]
        inflight = GaugeMetricFamily(
            "dyngraph_worker_inflight_requests", "Requests in the worker's handler", labels=["model"]
        )
        inflight.add_metric(labels, cap.inflight)
        limit = GaugeMetricFamily(
            "dyngraph_worker_max_inflight",
            "The worker's cap on requests in flight (0: none)",
            labels=["model"],
        )
        limit.add_metric(labels, cap.limit)
        ended = CounterMetricFamily(
            "dyngraph_worker_requests", "Requests the worker ended, by how", labels=["model", "status"]
        )
        for status, count in (
            ("served", cap.served),
            ("error", cap.failed),
            ("cancelled", cap.cancelled),
            ("refused", cap.refused),
        ):
            ended.add_metric([*labels, status], count)
        yield from (inflight, limit, ended)


async def serve_metrics(
    host: str, port: int, cap: InflightCap, model: str, engine_collectors: Sequence[Collector]
) -> MetricsServer:
    """Start the worker's /metrics on host:port with its series and the engine's: HTTPS with a
    client certificate (the graph's scraper's) required where the process has TLS files."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(WorkerCollector(cap, model))
    for collector in engine_collectors:
        registry.register(collector)
    server = MetricsServer(registry, "worker metrics")
    await server.follow((host, port), TlsFiles.for_metrics())
    return server
