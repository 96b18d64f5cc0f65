"""The event plane: publish/subscribe for KV events and load metrics (used by KV routing).

Backends behind this interface: in-process (one process, tests), zmq (the single-host default:
each publisher binds a loopback socket announced in discovery, subscribers connect to all of
them), and NATS (subjects). Payloads are opaque bytes (msgspec-encoded by the caller); delivery
is at-most-once, in order per publisher; subscribers tolerate gaps (docs/kv-events.md).
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Event:
    topic: str
    payload: bytes
    publisher_id: int


class EventPublisher(abc.ABC):
    publisher_id: int

    @abc.abstractmethod
    async def publish(self, topic: str, payload: bytes) -> None:
        """Send without waiting for subscribers; never blocks on a slow one (bounded buffers,
        oldest dropped)."""

    @abc.abstractmethod
    async def close(self) -> None: ...


class EventSubscriber(abc.ABC):
    # Events known lost (buffer overflow or sequence gaps) since the subscriber started.
    dropped: int

    @abc.abstractmethod
    def events(self) -> AsyncIterator[Event]:
        """Every event on the subscribed topics, from every publisher, as they arrive."""

    @abc.abstractmethod
    async def close(self) -> None: ...
