"""How engines report KV cache changes and load: a `KvEventSink` they call synchronously from
their scheduling loop, and `KvEventPublisher`, the sink that puts them on the event plane.

Calls never block an engine: events are encoded at once and queued (bounded; the oldest are
dropped and counted if the plane falls behind), and one task publishes them in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Sequence
from typing import Protocol

from dynamo_graph.router.kv.protocols import (
    KV_EVENTS_TOPIC,
    LOAD_METRICS_TOPIC,
    KvCacheEvent,
    KvCleared,
    KvEventData,
    KvRemoved,
    KvStored,
    LoadMetrics,
    StoredBlock,
    encode_event,
)
from dynamo_graph.runtime.events.base import EventPublisher

log = logging.getLogger(__name__)
MAX_QUEUED_EVENTS = 65_536


class KvEventSink(Protocol):
    def stored(
        self,
        parent_hash: int | None,
        blocks: Sequence[StoredBlock],
        dp_rank: int = 0,
        lora_name: str | None = None,
    ) -> None:
        """`lora_name`: the LoRA adapter whose blocks these are (None: the base model's)."""

    def removed(self, block_hashes: Sequence[int], dp_rank: int = 0) -> None: ...

    def cleared(self, dp_rank: int = 0) -> None: ...

    def load(self, metrics: LoadMetrics) -> None: ...


class KvEventPublisher:
    """A worker's KV events and load metrics onto its channel; event ids count up per worker."""

    def __init__(
        self, publisher: EventPublisher, worker_id: int, *, max_queued: int = MAX_QUEUED_EVENTS
    ) -> None:
        self.worker_id = worker_id
        self.dropped = 0
        self._publisher = publisher
        self._next_event_id = 0
        self._queue: deque[tuple[str, bytes]] = deque()
        self._max_queued = max_queued
        self._ready = asyncio.Event()
        self._task = asyncio.create_task(self._flush(), name=f"kv events {worker_id:x}")

    def _event(self, data: KvEventData, dp_rank: int) -> None:
        self._next_event_id += 1
        event = KvCacheEvent(self._next_event_id, self.worker_id, data, dp_rank)
        self._put(KV_EVENTS_TOPIC, encode_event(event))

    def _put(self, topic: str, payload: bytes) -> None:
        if len(self._queue) >= self._max_queued:
            self._queue.popleft()
            self.dropped += 1
        self._queue.append((topic, payload))
        self._ready.set()

    def stored(
        self,
        parent_hash: int | None,
        blocks: Sequence[StoredBlock],
        dp_rank: int = 0,
        lora_name: str | None = None,
    ) -> None:
        if blocks:
            self._event(KvStored(list(blocks), parent_hash, lora_name), dp_rank)

    def removed(self, block_hashes: Sequence[int], dp_rank: int = 0) -> None:
        if block_hashes:
            self._event(KvRemoved(list(block_hashes)), dp_rank)

    def cleared(self, dp_rank: int = 0) -> None:
        self._event(KvCleared(), dp_rank)

    def load(self, metrics: LoadMetrics) -> None:
        self._put(LOAD_METRICS_TOPIC, encode_event(metrics))

    async def _flush(self) -> None:
        while True:
            await self._ready.wait()
            self._ready.clear()
            await self._publish_queued()

    async def _publish_queued(self) -> None:
        while self._queue:
            topic, payload = self._queue.popleft()
            try:
                await self._publisher.publish(topic, payload)
            except Exception as err:  # the plane is gone; routing degrades, serving goes on
                self.dropped += 1
                log.warning("kv event publish failed: %s", err)

    async def close(self) -> None:
        """Publish what is still queued, then stop."""
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._publish_queued(), 1.0)
        await self._publisher.close()
