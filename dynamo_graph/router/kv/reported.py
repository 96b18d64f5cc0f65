"""The workers' own load reports (`LoadMetrics` on the event plane), as the router last heard them.

The router's bookkeeping (sequences.py) knows only what this router sent. Work that another
frontend sent to the same workers shows only in the workers' reports: per rank, the prompt tokens
accepted and not yet computed, and the KV blocks in use. The predictive cost and the queue's busy
test take the larger of the two (the bookkeeping also counts requests still on their way, which no
report has seen yet).

A report older than `max_age_s` counts as no report: a worker that stopped publishing (hung,
cut off, or an engine that reports only when its load changes and then went quiet) must not stay
pinned as busy by its last words. An engine that publishes keeps its reports fresh whenever its
load moves (the mocker reports after every pass that changed it, and once more when it goes idle).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from dynamo_graph.router.kv.protocols import LoadMetrics
from dynamo_graph.router.kv.sequences import WorkerKey

MAX_AGE_S = 5.0


class ReportedLoad:
    def __init__(self, max_age_s: float = MAX_AGE_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_age_s = max_age_s
        self.received = 0
        self._reports: dict[WorkerKey, tuple[LoadMetrics, float]] = {}
        self._clock = clock

    def update(self, metrics: LoadMetrics) -> None:
        self._reports[(metrics.worker_id, metrics.dp_rank)] = (metrics, self._clock())
        self.received += 1

    def get(self, key: WorkerKey) -> LoadMetrics | None:
        """The rank's last report, or None when it has none younger than `max_age_s`."""
        entry = self._reports.get(key)
        if entry is None or self._clock() - entry[1] > self.max_age_s:
            return None
        return entry[0]

    def age_s(self, key: WorkerKey) -> float | None:
        entry = self._reports.get(key)
        return None if entry is None else self._clock() - entry[1]

    def prefill_tokens(self, key: WorkerKey) -> int:
        report = self.get(key)
        return report.prefill_tokens if report is not None else 0

    def blocks(self, key: WorkerKey) -> int:
        report = self.get(key)
        return report.active_blocks if report is not None else 0

    def keys(self) -> list[WorkerKey]:
        return list(self._reports)

    def remove_worker(self, worker_id: int) -> None:
        for key in [k for k in self._reports if k[0] == worker_id]:
            del self._reports[key]
