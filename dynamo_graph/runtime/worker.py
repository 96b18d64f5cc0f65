"""`@dynamo_worker()`: turn `async def worker(runtime)` into a process entry point.

The decorated coroutine gets a runtime configured from the environment; SIGINT/SIGTERM ask it
to shut down (every `serve_endpoint` returns), and the runtime is closed gracefully at the end
(unregister, let streams in flight finish, release the discovery lease).
"""

from __future__ import annotations

import asyncio
import functools
import signal
from collections.abc import Awaitable, Callable
from typing import Any

from dynamo_graph.runtime.runtime import DistributedRuntime

WorkerFn = Callable[..., Awaitable[Any]]


def dynamo_worker(
    static: bool = False, *, grace_s: float = 5.0
) -> Callable[[WorkerFn], Callable[..., Awaitable[Any]]]:
    def decorate(fn: WorkerFn) -> Callable[..., Awaitable[Any]]:
        @functools.wraps(fn)
        async def run(*args: Any, **kwargs: Any) -> Any:
            runtime = await DistributedRuntime.create(static=static)
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, runtime.shutdown)
            try:
                return await fn(runtime, *args, **kwargs)
            finally:
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(sig)
                await runtime.close(grace_s)

        return run

    return decorate
