"""vLLM's scheduler stats -> our LoadMetrics (engines/vllm/load.py), and which Prometheus logger the
adapter gives vLLM, without vLLM: the stats are vLLM's `SchedulerStats` fields as plain attributes
(the real thing runs in test_vllm_engine.py)."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from dynamo_graph.engines.vllm import load as vllm_load
from dynamo_graph.engines.vllm.engine import VllmEngine
from dynamo_graph.engines.vllm.load import LoadReporter, stat_logger
from dynamo_graph.llm.model_source import resolve_model
from dynamo_graph.process.run_config import parse_run_config
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


def test_the_workers_metrics_port_decides_the_engines_prometheus_logger(tiny_model: Path) -> None:
    """Only a worker serving /metrics gives vLLM its Prometheus logger (EngineSettings
    .serves_metrics, from --metrics-port); elsewhere the stand-in records nothing."""
    served = parse_run_config(["in=dyn://ns.backend.generate", "out=vllm", "--metrics-port", "0"])
    assert served.engine.serves_metrics
    for words in (["in=dyn://ns.backend.generate", "out=vllm"], ["in=http", "out=vllm"]):
        assert not parse_run_config(words).engine.serves_metrics
    assert VllmEngine.from_config(served.engine, resolve_model(str(tiny_model))).serves_metrics

    class Prometheus:
        def __init__(self, vllm_config: object, engine_indexes: object = None) -> None:
            raise AssertionError("the real logger is not made")

    quiet = vllm_load.quiet_prometheus(Prometheus)(SimpleNamespace(), [0])
    assert isinstance(quiet, Prometheus)  # what keeps vLLM from adding its own
    quiet.record(None, None, engine_idx=0)
    quiet.log()
