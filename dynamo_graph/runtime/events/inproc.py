"""In-process event plane: publishers and subscribers of one process and one event loop.

Used when a whole graph runs in one process (and in tests). Each subscriber owns a bounded queue
that drops its oldest event when full, so a slow subscriber loses events (counted in `dropped`)
instead of slowing publishers down — the same at-most-once contract as the zmq and NATS planes.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Sequence

from dynamo_graph.runtime.events.base import Event, EventPublisher, EventSubscriber
from dynamo_graph.runtime.events.common import DEFAULT_MAX_PENDING, check_topics


class InProcEventBus:
    """One channel (a namespace/component) inside a process: every publisher reaches every
    subscriber whose topic prefixes match."""

    def __init__(self, max_pending: int = DEFAULT_MAX_PENDING) -> None:
        self.max_pending = max_pending
        self._subscribers: set[InProcEventSubscriber] = set()

    def publisher(self, publisher_id: int) -> InProcEventPublisher:
        return InProcEventPublisher(self, publisher_id)

    def subscriber(
        self, topic_prefixes: Sequence[str], *, max_pending: int | None = None
    ) -> InProcEventSubscriber:
        sub = InProcEventSubscriber(self, check_topics(topic_prefixes), max_pending or self.max_pending)
        self._subscribers.add(sub)
        return sub

    def _deliver(self, event: Event) -> None:
        for sub in self._subscribers:
            if event.topic.startswith(sub.topics):
                sub._push(event)

    def _remove(self, sub: InProcEventSubscriber) -> None:
        self._subscribers.discard(sub)


class InProcEventPublisher(EventPublisher):
    def __init__(self, bus: InProcEventBus, publisher_id: int) -> None:
        self.publisher_id = publisher_id
        self._bus: InProcEventBus | None = bus

    async def publish(self, topic: str, payload: bytes) -> None:
        if self._bus is None:
            raise RuntimeError("publish on a closed event publisher")
        self._bus._deliver(Event(topic, payload, self.publisher_id))

    async def close(self) -> None:
        self._bus = None


class InProcEventSubscriber(EventSubscriber):
    def __init__(self, bus: InProcEventBus, topics: tuple[str, ...], max_pending: int) -> None:
        self.topics = topics
        self.dropped = 0
        """Events discarded because this subscriber's queue was full (the oldest go first)."""
        self._bus = bus
        self._queue: deque[Event] = deque(maxlen=max_pending)
        self._wakeup = asyncio.Event()
        self._closed = False

    def _push(self, event: Event) -> None:
        if len(self._queue) == self._queue.maxlen:
            self.dropped += 1
        self._queue.append(event)
        self._wakeup.set()

    async def events(self) -> AsyncIterator[Event]:
        while not self._closed:
            while self._queue:
                yield self._queue.popleft()
            self._wakeup.clear()
            await self._wakeup.wait()

    async def close(self) -> None:
        self._closed = True
        self._bus._remove(self)
        self._queue.clear()
        self._wakeup.set()
