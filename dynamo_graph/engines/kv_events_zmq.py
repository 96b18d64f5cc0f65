"""SUB sockets on an engine's ZMQ KV event publisher (vLLM's and SGLang's), read by one task.

Both engines publish `[topic, seq, payload]` messages, one publisher per data-parallel rank, rank r
on the endpoint's tcp port + r (inproc: `_dp{r}`). Which side binds follows the endpoint: the
publisher binds wildcard tcp and ipc:// endpoints (we connect) and connects to a concrete tcp
address (we bind). Each payload goes to a callback with its rank; decoding it is the engine's job.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


def publisher_binds(endpoint: str) -> bool:
    """Whether the engine's publisher binds `endpoint` (so we connect to it) rather than connects."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def offset_endpoint(endpoint: str, rank: int, error: type[Exception] = ValueError) -> str:
    """The endpoint of DP rank `rank`'s publisher: tcp port + rank, inproc `_dp{rank}`."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    if endpoint.startswith("tcp://"):
        head, _, port = endpoint.rpartition(":")
        return f"{head}:{int(port) + rank}"
    raise error(f"KV event endpoint {endpoint!r} cannot serve {rank + 1} data-parallel ranks")


class ZmqKvSubscriber:
    """SUB socket(s), one per DP rank, handing each message's payload to `on_payload(payload, rank)`
    from a task. `engine` names the log lines; `error` is what a failure to bind raises."""

    def __init__(
        self, on_payload: Callable[[bytes, int], None], *, engine: str, error: type[Exception]
    ) -> None:
        import zmq
        import zmq.asyncio

        self._zmq = zmq
        self.on_payload = on_payload
        self.engine = engine
        self.error = error
        self.ctx = zmq.asyncio.Context()
        self.sockets: list[tuple[Any, int]] = []
        self.task: asyncio.Task[None] | None = None

    def _sub(self, topic: str) -> Any:
        sock = self.ctx.socket(self._zmq.SUB)
        sock.setsockopt(self._zmq.LINGER, 0)
        sock.setsockopt(self._zmq.SUBSCRIBE, topic.encode())
        return sock

    def connect(self, endpoint: str, topic: str, rank: int = 0) -> None:
        """The publisher binds `endpoint` (ipc://, or a wildcard tcp one): connect to it."""
        sock = self._sub(topic)
        self.sockets.append((sock, rank))
        sock.connect(endpoint.replace("*", "127.0.0.1"))

    def bind(self, address: str, topic: str, rank: int) -> None:
        """The publisher connects to a concrete tcp address: bind it."""
        sock = self._sub(topic)
        self.sockets.append((sock, rank))
        sock.bind(address)

    def attach(self, endpoint: str, ranks: list[int], topic: str) -> None:
        """Subscribe to the publishers of `ranks` on an endpoint the user configured for the engine."""
        binds = publisher_binds(endpoint)
        for rank in ranks:
            address = offset_endpoint(endpoint, rank, self.error)
            if binds:
                self.connect(address, topic, rank)
            else:
                self.bind(address, topic, rank)

    def bind_loopback(self, ranks: list[int], topic: str, attempts: int = 20) -> str:
        """One SUB per rank on 127.0.0.1, ports base + rank; returns the base endpoint."""
        top = max(ranks)
        for _ in range(attempts):
            base = random.randrange(20_000, 60_000 - top)
            bound: list[tuple[Any, int]] = []
            try:
                for rank in ranks:
                    sock = self._sub(topic)
                    bound.append((sock, rank))
                    sock.bind(f"tcp://127.0.0.1:{base + rank}")
            except self._zmq.ZMQError:
                for sock, _ in bound:
                    sock.close(linger=0)
                continue
            self.sockets.extend(bound)
            return f"tcp://127.0.0.1:{base}"
        raise self.error(f"{self.engine}: could not bind a local port for KV events")

    def start(self) -> None:
        self.task = asyncio.create_task(self._run(), name=f"{self.engine} kv events")

    async def _run(self) -> None:
        poller = self._zmq.asyncio.Poller()
        ranks = {}
        for sock, rank in self.sockets:
            poller.register(sock, self._zmq.POLLIN)
            ranks[sock] = rank
        while True:
            for sock, _ in await poller.poll():
                frames = await sock.recv_multipart()
                try:
                    self.on_payload(frames[-1], ranks[sock])
                except Exception as err:  # a bad batch must not stop the bridge
                    log.warning("%s: dropping a KV event batch: %s", self.engine, err)

    def discard(self) -> None:
        """Close the sockets and the context (of a subscriber that never started, or has stopped)."""
        for sock, _ in self.sockets:
            sock.close(linger=0)
        self.sockets.clear()
        self.ctx.term()

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.task
            self.task = None
        self.discard()
