"""One socket write per connection per event-loop turn, however many SSE events the turn made.

A streamed answer is one event per token, and uvicorn writes each event to the socket as it is
sent: a write system call and, with TCP_NODELAY, a segment each. Tokens reach the frontend in
bursts (one read of the request plane holds several frames), so many events of one stream are
ready in the same turn of the loop; writing them together takes the same bytes to the client in
one call. The first profile of a streamed request at c=32 put ~40% of the frontend's CPU in
those writes (docs/frontend-scaling.md).

Nothing waits for more: what a turn wrote goes out at the start of the next turn (`call_soon`),
before the loop polls for I/O again, so an event is delayed by microseconds, never by another
token's arrival; each event is still its own SSE event (no chunk coalescing).
"""

from __future__ import annotations

import asyncio
from typing import Any


class CoalescingTransport:
    """Wraps a connection's transport for the HTTP protocol: `write` gathers until the turn
    ends; `close` writes what is gathered first; the rest is the transport's own."""

    __slots__ = ("_loop", "_pending", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self._pending:
            self._loop.call_soon(self.flush)
        self._pending.append(data)

    def flush(self) -> None:
        pending = self._pending
        if not pending:
            return
        self._pending = []
        if not self._transport.is_closing():
            self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)
