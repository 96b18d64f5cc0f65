"""Per-request context shared by every stage a request passes through.

The caller's side (client disconnect, a stop string hit, Ctrl-C) calls `stop_generating()`;
the engine side polls `is_stopped()` or awaits `stopped()`. This is how cancellation travels
from the HTTP layer to an engine, in-process now and across the request plane later.
"""

from __future__ import annotations

import asyncio
import uuid


class Context:
    __slots__ = ("_event", "_killed", "_stopped", "id", "migrations", "trace")

    def __init__(self, request_id: str | None = None) -> None:
        self.id = request_id or uuid.uuid4().hex
        self._stopped = False
        self._killed = False
        self._event: asyncio.Event | None = None
        # Times request migration moved the request to another worker (the decision log says).
        self.migrations = 0
        # The request's place in its trace (runtime/tracing.py; opaque here), None untraced.
        self.trace: object | None = None

    def stop_generating(self) -> None:
        """Ask the producer to end the stream gracefully (it may send a final chunk)."""
        if not self._stopped:
            self._stopped = True
            if self._event is not None:
                self._event.set()

    def kill(self) -> None:
        """Ask the producer to end at once; nothing more will be read."""
        self._killed = True
        self.stop_generating()

    def is_stopped(self) -> bool:
        return self._stopped

    def is_killed(self) -> bool:
        return self._killed

    async def stopped(self) -> None:
        """Wait until the request is stopped (for engines that race work against cancellation)."""
        if self._stopped:
            return
        if self._event is None:
            self._event = asyncio.Event()
        await self._event.wait()
