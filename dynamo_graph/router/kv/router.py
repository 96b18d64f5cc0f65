"""One model's KV-aware router in a frontend: where each request should go, and why.

Ties together the indexer of the workers' caches (fed by KV events from the event plane, or,
with `use_kv_events=False`, the approximate indexer fed by the router's own decisions), the
bookkeeping of in-flight requests, and the selection (scheduler.py). The caller routes, then
reports the first token and the end of every request it routed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import msgspec

from dynamo_graph.router.kv.approx import ApproxKvIndexer
from dynamo_graph.router.kv.hashing import local_block_hashes, sequence_hashes
from dynamo_graph.router.kv.indexer import KvIndexer
from dynamo_graph.router.kv.protocols import KV_EVENTS_TOPIC, decode_kv_event
from dynamo_graph.router.kv.scheduler import Choice, KvRouterConfig, score_workers, select
from dynamo_graph.router.kv.sequences import ActiveSequences, WorkerKey

if TYPE_CHECKING:
    from dynamo_graph.runtime.events.base import EventSubscriber
    from dynamo_graph.runtime.runtime import DistributedRuntime

log = logging.getLogger(__name__)


class NoWorkers(LookupError):
    pass


class KvRouter:
    def __init__(
        self, block_size: int, config: KvRouterConfig | None = None, *, seed: int | None = None
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"kv routing needs a positive kv cache block size, not {block_size}")
        self.block_size = block_size
        self.config = config or KvRouterConfig()
        self.indexer: KvIndexer | ApproxKvIndexer
        if self.config.use_kv_events:
            self.indexer = KvIndexer()
        else:
            self.indexer = ApproxKvIndexer(
                ttl_s=self.config.ttl_s,
                max_tree_size=self.config.max_tree_size,
                prune_target_ratio=self.config.prune_target_ratio,
            )
        self.sequences = ActiveSequences()
        # Data-parallel ranks per worker instance (from its model card); 1 when not told.
        self.dp_sizes: dict[int, int] = {}
        self.routed = 0
        self.overlap_blocks_routed = 0
        self.events_applied = 0
        self._rng = random.Random(seed)
        self._subscriber: EventSubscriber | None = None
        self._consumer: asyncio.Task[None] | None = None

    async def subscribe(self, runtime: DistributedRuntime, namespace: str, component: str) -> None:
        """Feed the indexer from the KV events of the workers on channel namespace/component.
        Nothing to do without KV events, or when overlap does not count (weight 0)."""
        if not self.config.use_kv_events or self.config.overlap_score_weight == 0:
            return
        from dynamo_graph.runtime.events import create_event_subscriber

        self._subscriber = await create_event_subscriber(
            discovery=runtime.discovery, namespace=namespace, component=component, topics=[KV_EVENTS_TOPIC]
        )
        self._consumer = asyncio.create_task(self._consume(self._subscriber), name=f"kv events {component}")

    async def _consume(self, subscriber: EventSubscriber) -> None:
        assert isinstance(self.indexer, KvIndexer)
        apply = self.indexer.apply_event
        async for event in subscriber.events():
            try:
                apply(decode_kv_event(event.payload))
            except msgspec.DecodeError as err:
                log.warning("ignoring a malformed KV event from %x: %s", event.publisher_id, err)
                continue
            self.events_applied += 1

    def targets(self, instance_ids: Iterable[int]) -> list[WorkerKey]:
        dp_sizes = self.dp_sizes
        return [(i, rank) for i in instance_ids for rank in range(dp_sizes.get(i, 1))]

    def route(self, request_id: str, token_ids: Sequence[int], instance_ids: Iterable[int]) -> Choice:
        """Pick a worker rank for the request and book it there."""
        candidates = self.targets(instance_ids)
        if not candidates:
            raise NoWorkers("no worker instances to route to")
        block_size = self.block_size
        weight = self.config.overlap_score_weight
        local = local_block_hashes(token_ids, block_size)
        seq = sequence_hashes(local)
        overlaps = self.indexer.find_matches(local, seq) if weight and local else {}
        choices = score_workers(candidates, seq, len(token_ids), block_size, overlaps, self.sequences, weight)
        choice = select(choices, self.config.temperature, self._rng, self.indexer.tree_size)
        blocks: list[int] = seq
        if len(token_ids) % block_size:
            blocks = [*seq, self._rng.getrandbits(64)]  # the partial last block is the request's own
        self.sequences.add(request_id, choice.key, blocks, choice.prefill_tokens)
        if isinstance(self.indexer, ApproxKvIndexer) and local:
            self.indexer.record_routing(choice.key, local, seq)
        self.routed += 1
        self.overlap_blocks_routed += choice.overlap_blocks
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "request %s -> %x rank %d (overlap %d of %d blocks, cost %.1f; %s)",
                request_id,
                *choice.key,
                choice.overlap_blocks,
                len(local),
                choice.logit,
                ", ".join(f"{c.key[0]:x}.{c.key[1]}={c.logit:.1f}" for c in choices),
            )
        return choice

    def uncached_tokens(self, token_ids: Sequence[int], instance_ids: Iterable[int]) -> int:
        """Prompt tokens the best-placed of these workers would still have to compute."""
        local = local_block_hashes(token_ids, self.block_size)
        if not local:
            return len(token_ids)
        overlaps = self.indexer.find_matches(local, sequence_hashes(local))
        best = max((overlaps.get(key, 0) for key in self.targets(instance_ids)), default=0)
        return len(token_ids) - best * self.block_size

    def prefill_completed(self, request_id: str) -> None:
        self.sequences.prefill_completed(request_id)

    def free(self, request_id: str) -> None:
        self.sequences.free(request_id)

    def remove_worker(self, worker_id: int) -> None:
        """The worker left discovery: forget its cache and its bookings."""
        self.indexer.remove_worker(worker_id)
        self.sequences.remove_worker(worker_id)
        self.dp_sizes.pop(worker_id, None)

    async def close(self) -> None:
        if self._consumer is not None:
            self._consumer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._consumer
        if self._subscriber is not None:
            await self._subscriber.close()
