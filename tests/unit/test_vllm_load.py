"""vLLM's scheduler stats -> our LoadMetrics (engines/vllm/load.py), without vLLM: the stats are
vLLM's `SchedulerStats` fields as plain attributes (the real thing runs in test_vllm_engine.py)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from dynamo_graph.engines.vllm import load as vllm_load
from dynamo_graph.engines.vllm.load import LoadReporter, stat_logger
from dynamo_graph.router.kv.protocols import LoadMetrics


class Loads:
    def __init__(self) -> None:
        self.loads: list[LoadMetrics] = []

    def load(self, metrics: LoadMetrics) -> None:
        self.loads.append(metrics)


def stats(usage: float, waiting: int, running: int, skipped: int = 0) -> SimpleNamespace:
    return SimpleNamespace(
        kv_cache_usage=usage,
        num_waiting_reqs=waiting,
        num_running_reqs=running,
        num_skipped_waiting_reqs=skipped,
    )


class Base:
    """Stands for vLLM's abstract StatLoggerBase (the engine passes the real one)."""


def test_stats_become_load_metrics_with_our_queued_prefill() -> None:
    sink = Loads()
    reporter = LoadReporter(sink, worker_id=9)  # type: ignore[arg-type]
    logger = stat_logger(reporter, Base)(SimpleNamespace(cache_config=SimpleNamespace(num_gpu_blocks=200)), 1)
    reporter.accepted(1, 300)
    reporter.accepted(1, 50)
    logger.record(stats(0.25, 1, 1, skipped=1), None, engine_idx=1)
    expected = LoadMetrics(
        worker_id=9, active_blocks=50, total_blocks=200, waiting=2, running=1, dp_rank=1, prefill_tokens=350
    )
    assert sink.loads == [expected]
    logger.record(stats(0.25, 1, 1, skipped=1), None, engine_idx=1)  # unchanged: not sent again
    logger.record(None, None, engine_idx=1)  # a step without scheduler stats
    assert len(sink.loads) == 1
    reporter.computed(1, 300)
    reporter.computed(1, 50)
    reporter.computed(1, 50)  # never below zero
    logger.record(stats(0.0, 0, 0), None, engine_idx=1)  # idle: sent at once, whatever the interval
    assert (sink.loads[-1].running, sink.loads[-1].waiting, sink.loads[-1].prefill_tokens) == (0, 0, 0)


def test_busy_snapshots_are_sent_at_most_every_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_load, "LOAD_INTERVAL_S", 0.05)
    sink = Loads()
    reporter = LoadReporter(sink, worker_id=1)  # type: ignore[arg-type]
    reporter.total_blocks = 100
    for i in range(10):
        reporter.record(0, stats(i / 100, i, 1))
    assert [m.waiting for m in sink.loads] == [0]
    time.sleep(0.06)
    reporter.record(0, stats(0.5, 4, 1))
    assert [m.waiting for m in sink.loads] == [0, 4]
