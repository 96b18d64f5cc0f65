"""The mocker's series on the worker's /metrics (`LLMEngine.metrics_collectors`), per data-parallel
rank, named after vLLM's where they mean the same (`vllm:num_requests_running` ...) but under
`dyngraph_mocker_`, since they are simulated: what the scheduler knows at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dynamo_graph.engines.mocker.scheduler import Scheduler

PREFIX = "dyngraph_mocker_"
# (name, help, counter?, value of a rank's scheduler)
SERIES: tuple[tuple[str, str, bool, Callable[[Scheduler], float]], ...] = (
    ("num_requests_running", "Sequences in the running batch", False, lambda s: len(s.running)),
    ("num_requests_waiting", "Sequences waiting for admission", False, lambda s: len(s.waiting)),
    ("kv_blocks_used", "KV blocks held by running sequences", False, lambda s: s.kv.used),
    ("kv_blocks_cached", "KV blocks kept for prefix reuse", False, lambda s: s.kv.cached),
    ("kv_blocks_total", "KV blocks of the rank", False, lambda s: s.kv.num_blocks),
    ("kv_cache_usage_ratio", "Share of KV blocks in use", False, lambda s: s.kv.usage()),
    ("prompt_tokens", "Prompt tokens of admitted sequences", True, lambda s: s.prompt_tokens),
    (
        "prefix_cache_hit_tokens",
        "Prompt tokens found in the prefix cache",
        True,
        lambda s: s.prefix_hit_tokens,
    ),
    ("num_preemptions", "Sequences preempted for KV space", True, lambda s: s.num_preemptions),
)


class MockerCollector(Collector):
    """The series above for each rank the engine runs (none before `start`)."""

    def __init__(self, schedulers: Callable[[], Sequence[Scheduler]]) -> None:
        self.schedulers = schedulers

    def collect(self) -> Iterator[Metric]:
        ranks = self.schedulers()
        for name, doc, counter, value in SERIES:
            family = (CounterMetricFamily if counter else GaugeMetricFamily)(
                PREFIX + name, doc, labels=["dp_rank"]
            )
            for scheduler in ranks:
                family.add_metric([str(scheduler.dp_rank)], value(scheduler))
            yield family
