"""A vLLM worker's load on the event plane: vLLM's scheduler stats as our `LoadMetrics`.

Why: the kv router predicts each worker's time to first token from what it routed there itself;
a worker shared by several frontends (or restarted) carries load no single router booked. The
mocker publishes its load after its passes; this does the same for vLLM, so that every router
sees what the engine really holds.

How: `AsyncLLM(stat_loggers=[...])` with a per-engine `StatLoggerBase` of ours (a custom logger
turns vLLM's stats on without its default logging loggers). vLLM adds its Prometheus logger to
any custom ones unless one of them is a `PrometheusStatLogger`: where the worker serves
`/metrics` the adapter gives it the real one, elsewhere `quiet_prometheus`, which records nothing.
vLLM calls `record()` on the event loop after each engine step with that
DP rank's `SchedulerStats`, which become `LoadMetrics`:

| LoadMetrics | from |
|---|---|
| active_blocks | `kv_cache_usage` x total blocks (vLLM reports the used fraction) |
| total_blocks | `cache_config.num_gpu_blocks` |
| waiting | `num_waiting_reqs + num_skipped_waiting_reqs` |
| running | `num_running_reqs` |
| prefill_tokens | ours: prompt tokens handed to that rank that have no first token yet |

vLLM does not report its queued prefill tokens, hence the last row: it counts a prompt whole until
its first token (prefix-cache hits included; vLLM tells them only with the first output). A
snapshot is published when it changed, at most every `LOAD_INTERVAL_S` per rank, and always when
the rank goes idle, so the last word on an idle worker is "idle".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dynamo_graph.router.kv.protocols import LoadMetrics

if TYPE_CHECKING:
    from dynamo_graph.router.kv.publisher import KvEventSink

log = logging.getLogger(__name__)

LOAD_INTERVAL_S = 0.005


class LoadReporter:
    """Per DP rank: the prompt tokens awaiting a first token, and the last snapshot published."""

    def __init__(self, sink: KvEventSink, worker_id: int) -> None:
        self.sink = sink
        self.worker_id = worker_id
        self.total_blocks = 0
        self._prefill: dict[int, int] = {}
        self._last: dict[int, tuple[int, int, int, int]] = {}
        self._last_time: dict[int, float] = {}

    def accepted(self, rank: int, tokens: int) -> None:
        """A prompt of `tokens` was handed to vLLM for `rank`."""
        self._prefill[rank] = self._prefill.get(rank, 0) + tokens

    def computed(self, rank: int, tokens: int) -> None:
        """That prompt has its first token (or ended without one)."""
        self._prefill[rank] = max(0, self._prefill.get(rank, 0) - tokens)

    def record(self, rank: int, stats: Any) -> None:
        """One engine step's `SchedulerStats` of `rank`."""
        total = self.total_blocks
        snapshot = (
            round(float(stats.kv_cache_usage) * total),
            int(stats.num_waiting_reqs) + int(getattr(stats, "num_skipped_waiting_reqs", 0) or 0),
            int(stats.num_running_reqs),
            self._prefill.get(rank, 0),
        )
        if snapshot == self._last.get(rank):
            return
        now = time.monotonic()
        idle = snapshot[1] == snapshot[2] == 0
        if not idle and now - self._last_time.get(rank, float("-inf")) < LOAD_INTERVAL_S:
            return
        self._last[rank], self._last_time[rank] = snapshot, now
        metrics = LoadMetrics(
            worker_id=self.worker_id,
            active_blocks=snapshot[0],
            total_blocks=total,
            waiting=snapshot[1],
            running=snapshot[2],
            dp_rank=rank,
            prefill_tokens=snapshot[3],
        )
        try:
            self.sink.load(metrics)
        except Exception as err:  # the event plane's trouble is not the requests' trouble
            log.warning("vllm: publishing load metrics failed: %s", err)


def stat_logger(reporter: LoadReporter, base: type) -> Callable[[Any, int], Any]:
    """A per-engine stat logger class (vLLM's `StatLoggerBase` is `base`, imported lazily by
    the engine) that hands each step's scheduler stats to `reporter`."""

    class LoadStatLogger(base):  # type: ignore[misc, valid-type]
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            reporter.total_blocks = int(getattr(vllm_config.cache_config, "num_gpu_blocks", 0) or 0)

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            if scheduler_stats is not None:
                reporter.record(engine_idx, scheduler_stats)

        def log_engine_initialized(self) -> None:
            pass

    return LoadStatLogger


def quiet_prometheus(base: type) -> type:
    """A stand-in for vLLM's `PrometheusStatLogger` (`base`) that records nothing: vLLM's
    StatLoggerManager adds the real one to custom loggers unless one of them is a
    `PrometheusStatLogger` (vLLM 0.32), so a worker that publishes its load but serves no
    /metrics would otherwise pay for series nobody reads, every step
    (benchmarks/bench_vllm_stat_logger.py)."""

    class QuietPrometheus(base):  # type: ignore[misc, valid-type]
        def __init__(self, vllm_config: Any, engine_indexes: Any = None) -> None:
            pass  # none of the real one's series: they would register in the process's registry

        def record(self, *args: Any, **kwargs: Any) -> None:
            pass

        def record_sleep_state(self, *args: Any, **kwargs: Any) -> None:
            pass

        def record_admission_rejection(self, *args: Any, **kwargs: Any) -> None:
            pass

        def log(self) -> None:
            pass

        def log_engine_initialized(self) -> None:
            pass

    return QuietPrometheus
