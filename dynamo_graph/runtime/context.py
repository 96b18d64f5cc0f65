"""Per-request context shared by every stage a request passes through.

The caller's side (client disconnect, a stop string hit, Ctrl-C) calls `stop_generating()`;
the engine side polls `is_stopped()` or awaits `stopped()`. This is how cancellation travels
from the HTTP layer to an engine, in-process now and across the request plane later.
"""

from __future__ import annotations

import asyncio
import itertools
import os

_id_prefix = os.urandom(8).hex()
_id_counter = itertools.count()


def _reseed() -> None:
    """A forked child draws its own half, so parent and child never hand out the same id."""
    global _id_prefix, _id_counter
    _id_prefix = os.urandom(8).hex()
    _id_counter = itertools.count()


os.register_at_fork(after_in_child=_reseed)


def unique_hex() -> str:
    """32 hex digits (as `uuid4().hex`) unique across processes: a random per-process half and a
    counter. Every streamed request takes a few ids; uuid4 costs a system call and an object each."""
    return f"{_id_prefix}{next(_id_counter):016x}"


class Context:
    __slots__ = ("_event", "_killed", "_stopped", "id", "migrations", "trace")

    def __init__(self, request_id: str | None = None) -> None:
        self.id = request_id or unique_hex()
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
