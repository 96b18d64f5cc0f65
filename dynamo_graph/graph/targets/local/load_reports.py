"""What the workers of an autoscaled pool say of their own load, for the planner's load targets
(`kv_usage`, `waiting_requests`, `queued_prefill_tokens`: Dynamo's load mode).

A worker whose engine publishes KV events also publishes a `LoadMetrics` report on the event
plane after scheduling passes that changed its load (router/kv/protocols.py): KV blocks in use
and in all, requests waiting and running, prompt tokens accepted and not yet computed. A kv
router reads them to route; the supervisor subscribes to the pool's channel the same way, with
the discovery and event plane its workers use (their environment), and averages each rank's
reports over the planner's interval. A rank that sent nothing in the interval keeps its last
report: engines report when their load changes, so silence means unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass

import msgspec

from dynamo_graph.router.kv.protocols import LOAD_METRICS_TOPIC, LoadMetrics, decode_load_metrics
from dynamo_graph.runtime.discovery import Discovery, create_discovery
from dynamo_graph.runtime.events import EventSubscriber, create_event_subscriber
from dynamo_graph.runtime.names import EndpointName

log = logging.getLogger(__name__)


def discovery_of(env: Mapping[str, str]) -> Discovery:
    """A client of the discovery a graph process with environment `env` uses (backend, folder
    or endpoints, and with TLS the credentials of that process)."""
    return create_discovery(
        env.get("DYN_DISCOVERY_BACKEND") or "file",
        file_root=env.get("DYN_FILE_KV"),
        etcd_endpoints=env.get("ETCD_ENDPOINTS"),
        ttl_s=float(env["DYN_LEASE_TTL"]) if env.get("DYN_LEASE_TTL") else None,
        env=env if "ETCD_AUTH_CA" in env else None,
    )


@dataclass
class PoolLoad:
    """A pool's load over one interval, per replica (mean over its instances' ranks)."""

    kv_usage: float  # KV blocks in use / blocks
    waiting_requests: float
    queued_prefill_tokens: float


class LoadWatch:
    """The load reports of one pool's channel, read from the supervisor."""

    def __init__(self, endpoint: EndpointName, env: Mapping[str, str]) -> None:
        self.endpoint = endpoint
        self.env = dict(env)
        self.last: dict[tuple[int, int], LoadMetrics] = {}  # (instance, rank) -> last report
        self.window: dict[tuple[int, int], list[LoadMetrics]] = {}  # reports since the last take
        self._discovery: Discovery | None = None
        self._subscriber: EventSubscriber | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Subscribe (a failure is logged and the pool is planned without load reports)."""
        try:
            kind = self.env.get("DYN_EVENT_PLANE")
            if kind in (None, "", "zmq"):
                self._discovery = discovery_of(self.env)
                await self._discovery.start()
            self._subscriber = await create_event_subscriber(
                kind or None,
                discovery=self._discovery,
                namespace=self.endpoint.namespace,
                component=self.endpoint.component,
                topics=[LOAD_METRICS_TOPIC],
                nats_url=self.env.get("NATS_SERVER"),
                env=self.env,  # with TLS on: the graph's CURVE key, its NATS client certificate
            )
        except (OSError, ValueError, RuntimeError) as err:
            log.warning("autoscale: cannot hear %s's load reports: %s", self.endpoint.component, err)
            return
        self._task = asyncio.create_task(self._consume(self._subscriber), name="load reports")

    async def _consume(self, subscriber: EventSubscriber) -> None:
        async for event in subscriber.events():
            try:
                self.hear(decode_load_metrics(event.payload))
            except msgspec.DecodeError as err:
                log.warning("autoscale: a malformed load report from %x: %s", event.publisher_id, err)

    def hear(self, report: LoadMetrics) -> None:
        key = (report.worker_id, report.dp_rank)
        self.last[key] = report
        self.window.setdefault(key, []).append(report)

    def take(self, instances: set[int]) -> PoolLoad | None:
        """The mean load per replica of `instances` since the last take (a rank that sent no
        report meanwhile: its last; an instance that never reported: idle), or None when none
        of them has reported yet."""
        ranks: dict[int, list[tuple[float, float, float]]] = {}
        for key, last in self.last.items():
            if key[0] not in instances:
                continue
            heard = self.window.get(key) or [last]
            ranks.setdefault(key[0], []).append(
                (
                    sum(r.active_blocks / r.total_blocks if r.total_blocks else 0.0 for r in heard)
                    / len(heard),
                    sum(r.waiting for r in heard) / len(heard),
                    sum(r.prefill_tokens for r in heard) / len(heard),
                )
            )
        self.window.clear()
        for gone in [k for k in self.last if k[0] not in instances]:
            del self.last[gone]
        if not ranks:
            return None
        # A replica's KV usage is its ranks' mean; its queue is its ranks' sum.
        usage = sum(sum(r[0] for r in rs) / len(rs) for rs in ranks.values())
        waiting = sum(r[1] for rs in ranks.values() for r in rs)
        queued = sum(r[2] for rs in ranks.values() for r in rs)
        n = len(instances)
        return PoolLoad(usage / n, waiting / n, queued / n)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        for closing in (self._subscriber, self._discovery):
            if closing is not None:
                with contextlib.suppress(Exception):
                    await closing.close()
