"""The KV routers' state on /metrics: per worker rank, the fitted TTFT model, the predicted
backlog, the load the router counts there (its own bookkeeping, the rank's last load report and
the larger of the two, which cost and queue use) and, with the queue on, the tokens past which
the rank is busy; per router, its queue and session bindings (router/kv/predict.py, reported.py,
queue.py, affinity.py), and what its index of the workers' caches holds and found: a LoRA
adapter's router is labelled with the adapter's name, so its hits are told apart from the base
model's.

Process-wide, like the migration counts: routers belong to the model watcher's pools, which are
built apart from the HTTP app whose FrontendMetrics exports them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from dynamo_graph.router.kv.router import KvRouter

PREFIX = "dynamo_frontend_router"


class RouterMetrics:
    def __init__(self) -> None:
        self.routers: dict[tuple[str, str], KvRouter] = {}  # (model, pool) -> router

    def add(self, model: str, pool: str, router: KvRouter) -> None:
        self.routers[(model, pool)] = router

    def remove(self, router: KvRouter) -> None:
        for key in [k for k, r in self.routers.items() if r is router]:
            del self.routers[key]

    def collect(self) -> Iterator[Metric]:
        worker_labels = ["model", "pool", "worker_id", "dp_rank"]

        def gauge(name: str, doc: str, labels: list[str] = worker_labels) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=labels)

        fixed = gauge("ttft_fixed_seconds", "Fitted TTFT model: fixed seconds (a)")
        per_token = gauge("ttft_seconds_per_prefill_token", "Fitted TTFT model: s per prefill token (b)")
        per_block = gauge("ttft_seconds_per_decode_block", "Fitted TTFT model: seconds per held KV block (c)")
        observed = CounterMetricFamily(
            f"{PREFIX}_ttft_observations", "TTFTs the worker's fit has seen", labels=worker_labels
        )
        backlog = gauge("predicted_backlog_seconds", "Predicted time to finish the prefill work routed there")
        tokens = gauge("queued_prefill_tokens", "Prompt tokens routed there and waiting for a first token")
        blocks = gauge("active_blocks", "KV blocks its in-flight requests hold (router's bookkeeping)")
        counted = gauge(
            "counted_prefill_tokens", "Prefill tokens the router counts there: its own or the rank's report"
        )
        busy = gauge("busy_prefill_tokens", "Prefill tokens past which the queue counts the rank busy")
        reported_tokens = gauge(
            "reported_prefill_tokens", "Prompt tokens the rank reported accepted and not yet computed"
        )
        reported_blocks = gauge("reported_active_blocks", "KV blocks in use, as the rank reported")
        reported_waiting = gauge("reported_waiting_requests", "Requests waiting, as the rank reported")
        reported_running = gauge("reported_running_requests", "Requests running, as the rank reported")
        report_age = gauge("load_report_age_seconds", "Age of the rank's last load report (stale past 5 s)")
        capacity = gauge("kv_capacity_blocks", "KV cache blocks of the rank (its card's total_kv_blocks)")
        router_labels = ["model", "pool"]
        queued = gauge("queue_depth", "Requests held while every worker is saturated", router_labels)
        queued_total = CounterMetricFamily(
            f"{PREFIX}_queued_requests", "Requests that waited in the router's queue", labels=router_labels
        )
        rejected = CounterMetricFamily(
            f"{PREFIX}_queue_rejected_requests",
            "Refused with 529/503: queue full",
            labels=router_labels,
        )
        sessions = gauge("session_bindings", "Sessions bound to a worker", router_labels)
        routed = CounterMetricFamily(
            f"{PREFIX}_routed_requests", "Requests the router placed on a worker", labels=router_labels
        )
        overlap = CounterMetricFamily(
            f"{PREFIX}_routed_overlap_blocks",
            "Prompt KV blocks cached on the worker each request was placed on",
            labels=router_labels,
        )
        indexed = gauge(
            "indexed_blocks", "(worker rank, block) entries in the router's cache index", router_labels
        )
        for (model, pool), router in list(self.routers.items()):
            seqs = router.sequences
            predictor = router.model
            reported = predictor.reported
            keys = set(predictor.fits) | set(seqs.loads) | set(reported.keys())
            for key in sorted(keys):
                labels = [model, pool, f"{key[0]:x}", str(key[1])]
                fit = predictor.fit(key)
                a, b, c = fit.coeffs
                fixed.add_metric(labels, a)
                per_token.add_metric(labels, b)
                per_block.add_metric(labels, c)
                observed.add_metric(labels, fit.observations)
                backlog.add_metric(labels, predictor.backlog_seconds(key, seqs))
                tokens.add_metric(labels, seqs.prefill_tokens(key))
                blocks.add_metric(labels, seqs.active_blocks(key))
                counted.add_metric(labels, router.prefill_tokens(key))
                if router.queue is not None:
                    busy.add_metric(labels, router.busy_limit(key))
                total = router.kv_blocks.get(key[0])
                if total is not None:
                    capacity.add_metric(labels, total)
                age = reported.age_s(key)
                if age is not None:
                    report_age.add_metric(labels, age)
                report = reported.get(key)
                if report is not None:
                    reported_tokens.add_metric(labels, report.prefill_tokens)
                    reported_blocks.add_metric(labels, report.active_blocks)
                    reported_waiting.add_metric(labels, report.waiting)
                    reported_running.add_metric(labels, report.running)
            if router.queue is not None:
                queued.add_metric([model, pool], len(router.queue))
                queued_total.add_metric([model, pool], router.queue.queued_total)
                rejected.add_metric([model, pool], router.queue.rejected)
            if router.affinity is not None:
                sessions.add_metric([model, pool], len(router.affinity))
            routed.add_metric([model, pool], router.routed)
            overlap.add_metric([model, pool], router.overlap_blocks_routed)
            indexed.add_metric([model, pool], router.indexer.entries)
        yield from (fixed, per_token, per_block, observed, backlog, tokens, blocks, counted, busy)
        yield from (reported_tokens, reported_blocks, reported_waiting, reported_running, report_age)
        yield capacity
        yield from (queued, queued_total, rejected, sessions, routed, overlap, indexed)


ROUTERS = RouterMetrics()
