"""Per-stream machinery that the tcp and nats transports share, so each keeps only its wire.

Worker side: `ServerStream` (a request's Context, its handler task and the grace timer that
cancels it), `run_handler` (data frames, then the one terminal frame, whatever the handler
does) and `HandlerTasks` (what `stop(grace_s)` waits for, then ends). Caller side:
`ClientStream`, the frame queue a consumer waits on until a frame or a failure arrives.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any

from dynamo_graph.runtime.context import Context
from dynamo_graph.runtime.errors import RequestError
from dynamo_graph.runtime.transport.base import Handler
from dynamo_graph.runtime.transport.frames import Data, End, Frame, Request, error_frame

log = logging.getLogger(__name__)

Send = Callable[[Frame], Awaitable[None] | None]
"""Sends one frame; returns something to await only when the frame has not left yet (tcp writes
at once unless paused, so most frames cost no coroutine; a nats publish is always awaited)."""


# --------------------------------------------------------------------------- worker side


class ServerStream:
    """One request being served; transports subclass it to add how they address the caller."""

    __slots__ = ("context", "stopped", "task", "timer")

    def __init__(self, context: Context) -> None:
        self.context = context
        self.stopped = False  # caller gone or cancelled: frames are no longer wanted
        self.task: asyncio.Task[None] | None = None
        self.timer: asyncio.TimerHandle | None = None

    def stop(self, grace_s: float, *, killed: bool) -> None:
        """Tell the handler to stop; cancel its task if it is still running after grace_s."""
        if self.stopped:
            return
        self.stopped = True
        if killed:
            self.context.kill()
        else:
            self.context.stop_generating()
        task = self.task
        if task is not None and not task.done():
            self.timer = asyncio.get_running_loop().call_later(grace_s, task.cancel)


async def run_handler(stream: ServerStream, handler: Handler, request: Request, send: Send) -> Frame:
    """Run one handler, sending its `Data` frames while the caller wants them, and return the
    terminal frame (`End`, or `Error` if it raised) for the transport to send where it can still
    be read. Cancellation (grace expired, server stopping) propagates: then there is none."""
    sid = request.id
    terminal: Frame = End(sid)
    try:
        responses = handler(request.body, request.headers, stream.context)
        try:
            async for body in responses:
                if stream.stopped:
                    continue  # let the handler run its abort; nobody reads these frames
                sending = send(Data(sid, body))
                if sending is not None:
                    await sending
        finally:
            aclose = getattr(responses, "aclose", None)
            if aclose is not None:
                await aclose()
    except RequestError as exc:
        terminal = error_frame(sid, exc)
    except Exception as exc:
        log.exception("handler for %r failed", request.subject)
        terminal = error_frame(sid, exc)
    finally:
        if stream.timer is not None:
            stream.timer.cancel()
    return terminal


class HandlerTasks:
    """The handler tasks of one server, kept so that `stop(grace_s)` can wait for them."""

    __slots__ = ("_tasks",)

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, stream: ServerStream, serve: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(serve)
        stream.task = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def wait(self, grace_s: float) -> None:
        """Give the handlers in flight up to grace_s to finish on their own."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=grace_s)

    async def end(self, streams: Iterable[ServerStream]) -> None:
        """Kill the Contexts of `streams` (those still open) and cancel every task left,
        waiting up to 1 s for them to unwind."""
        pending = [task for task in self._tasks if not task.done()]
        for stream in streams:
            stream.context.kill()
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=1.0)


# --------------------------------------------------------------------------- caller side


class ClientStream:
    """Frames received for one request, and the failure (if any) that ends it after them."""

    __slots__ = ("failure", "frames", "waiter")

    def __init__(self) -> None:
        self.frames: collections.deque[Frame] = collections.deque()
        self.waiter: asyncio.Future[None] | None = None
        self.failure: RequestError | None = None

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def fail(self, error: RequestError) -> None:
        """Record the first failure; the consumer raises it once the frames before it are read."""
        if self.failure is None:
            self.failure = error
        self.wake()
