"""Frontend metrics in Prometheus format, named as Dynamo names them (`dynamo_frontend_*`).

The frontend observes inter-token latency once per streamed token, so the histogram here is a
plain bucket array updated without locks (the event loop is single-threaded) and exported
through a custom collector; prometheus_client's own Histogram costs several microseconds per
observation, a visible share of the per-request CPU budget (docs/benchmarks.md).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from typing import Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from dynamo_graph.frontend.router_metrics import ROUTERS
from dynamo_graph.llm.protocol import KvImportReport

PREFIX = "dynamo_frontend"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
BYTE_BUCKETS = tuple(float(1 << n) for n in range(10, 34, 2))  # 1 KiB .. 8 GiB
TOKEN_BUCKETS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)

# Request migrations, (model, "new_request" | "ongoing_request") -> count. Process-wide: the
# migration operator sits in the model's pipeline, which is built before (and apart from) the
# HTTP app whose FrontendMetrics exports them; one frontend per process.
MIGRATIONS: dict[tuple[str, str], int] = {}


def count_migration(model: str, kind: str) -> None:
    """The migration operator's hook (router/migration.py): one request moved to another worker."""
    key = (model, kind)
    MIGRATIONS[key] = MIGRATIONS.get(key, 0) + 1


class DisaggMetrics:
    """Disaggregated serving's counts (router/disagg.py `DisaggHooks`), process-wide as
    MIGRATIONS: where each request was prefilled and why, and what its KV transfer cost."""

    def __init__(self) -> None:
        self.prefills: dict[tuple[str, str, str], int] = {}  # (model, where, reason) -> n
        self.import_failures: dict[tuple[str, str], int] = {}  # (model, kind) -> n
        self.transfer_bytes: dict[str, Histogram] = {}
        self.transfer_seconds: dict[str, Histogram] = {}

    def prefill(self, model: str, where: str, reason: str) -> None:
        key = (model, where, reason)
        self.prefills[key] = self.prefills.get(key, 0) + 1

    def kv_import(self, model: str, report: KvImportReport) -> None:
        if report.error is not None:
            key = (model, report.error)
            self.import_failures[key] = self.import_failures.get(key, 0) + 1
            return
        if model not in self.transfer_bytes:
            self.transfer_bytes[model] = Histogram(BYTE_BUCKETS)
            self.transfer_seconds[model] = Histogram(LATENCY_BUCKETS)
        self.transfer_bytes[model].observe(report.nbytes)
        self.transfer_seconds[model].observe(report.seconds)

    def collect(self) -> Iterator[Metric]:
        prefills = CounterMetricFamily(
            f"{PREFIX}_disagg_prefill",
            "Requests of disaggregated models by where their prompt was computed (remote: a prefill "
            "worker; local: the decode worker) and why",
            labels=["model", "where", "reason"],
        )
        for (model, where, reason), n in sorted(self.prefills.items()):
            prefills.add_metric([model, where, reason], n)
        failures = CounterMetricFamily(
            f"{PREFIX}_kv_transfer_failures",
            "KV transfers a decode worker could not use (it prefilled locally), by kind",
            labels=["model", "kind"],
        )
        for (model, kind), n in sorted(self.import_failures.items()):
            failures.add_metric([model, kind], n)
        sizes = HistogramMetricFamily(
            f"{PREFIX}_kv_transfer_bytes", "KV bytes per transfer", labels=["model"]
        )
        times = HistogramMetricFamily(
            f"{PREFIX}_kv_transfer_seconds",
            "Time a decode worker spent fetching a transfer's KV",
            labels=["model"],
        )
        for model, hist in self.transfer_bytes.items():
            sizes.add_metric([model], hist.buckets(), hist.sum)
            seconds = self.transfer_seconds[model]
            times.add_metric([model], seconds.buckets(), seconds.sum)
        yield from (prefills, failures, sizes, times)


class Histogram:
    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def buckets(self) -> list[tuple[str, float]]:
        out, running = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += n
            out.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
        return out


class ModelMetrics:
    """Everything counted for one served model."""

    __slots__ = ("cached_tokens", "duration", "inflight", "isl", "itl", "osl", "requests", "ttft")

    def __init__(self) -> None:
        # (endpoint, request_type, status) -> count
        self.requests: dict[tuple[str, str, str], int] = {}
        self.inflight = 0
        self.ttft = Histogram(LATENCY_BUCKETS)
        self.itl = Histogram(LATENCY_BUCKETS)
        self.duration = Histogram(LATENCY_BUCKETS)
        self.isl = Histogram(TOKEN_BUCKETS)
        self.osl = Histogram(TOKEN_BUCKETS)
        self.cached_tokens = Histogram(TOKEN_BUCKETS)

    def count_request(self, endpoint: str, request_type: str, status: str) -> None:
        key = (endpoint, request_type, status)
        self.requests[key] = self.requests.get(key, 0) + 1


class Scraper(Protocol):
    async def scrape(self) -> bytes: ...


class FrontendMetrics(Collector):
    def __init__(self) -> None:
        self.models: dict[str, ModelMetrics] = {}
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        # The frontend processes sharing this one's port (group.py), which /metrics answers for.
        self.group: Scraper | None = None

    def model(self, name: str) -> ModelMetrics:
        metrics = self.models.get(name)
        if metrics is None:
            metrics = self.models[name] = ModelMetrics()
        return metrics

    def render(self) -> bytes:
        return generate_latest(self.registry)

    async def scrape(self) -> bytes:
        """What /metrics answers: this process's metrics, or its group's (every process's)."""
        return self.render() if self.group is None else await self.group.scrape()

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            f"{PREFIX}_requests", "Requests handled", labels=["model", "endpoint", "request_type", "status"]
        )
        inflight = GaugeMetricFamily(f"{PREFIX}_inflight_requests", "Requests in flight", labels=["model"])
        migrations = CounterMetricFamily(
            f"{PREFIX}_model_migration",
            "Requests moved to another worker after theirs failed (new: before any token, or ongoing)",
            labels=["model", "migration_type"],
        )
        for (model, kind), n in sorted(MIGRATIONS.items()):
            migrations.add_metric([model, kind], n)
        histograms = {
            "ttft": (f"{PREFIX}_time_to_first_token_seconds", "Time to first token"),
            "itl": (f"{PREFIX}_inter_token_latency_seconds", "Time between streamed tokens"),
            "duration": (f"{PREFIX}_request_duration_seconds", "Request duration"),
            "isl": (f"{PREFIX}_input_sequence_tokens", "Prompt length in tokens"),
            "osl": (f"{PREFIX}_output_sequence_tokens", "Completion length in tokens"),
            "cached_tokens": (f"{PREFIX}_cached_tokens", "Prompt tokens served from a prefix cache"),
        }
        families = {
            key: HistogramMetricFamily(name, doc, labels=["model"]) for key, (name, doc) in histograms.items()
        }
        for model, m in self.models.items():
            for (endpoint, request_type, status), n in m.requests.items():
                requests.add_metric([model, endpoint, request_type, status], n)
            inflight.add_metric([model], m.inflight)
            for key, family in families.items():
                hist: Histogram = getattr(m, key)
                family.add_metric([model], hist.buckets(), hist.sum)
        yield requests
        yield inflight
        yield migrations
        yield from families.values()
        yield from DISAGG.collect()
        yield from ROUTERS.collect()


DISAGG = DisaggMetrics()
