"""The requests an engine adapter is serving, for `abort(context)`, `cleanup()` and `drain()`.

The vLLM, SGLang and TensorRT-LLM adapters hand each request to a library that runs it in its
own processes. They keep one `ActiveRequest` per context so that a stopped context, an
`abort(context)` or `cleanup()` can abort it there, and so that `drain()` waits for the last one.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any

from dynamo_graph.backend.errors import EngineError, EngineShutdown, InvalidArgument
from dynamo_graph.backend.protocol import PreprocessedRequest
from dynamo_graph.llm.openai import AnyRequest
from dynamo_graph.runtime.context import Context


class ActiveRequest:
    """One request in the engine: its id there (`rid`) or handle (`result`), and how it ended."""

    __slots__ = ("aborted", "context", "finished", "result", "rid")

    def __init__(self, context: Context, rid: str = "") -> None:
        self.context = context
        self.rid = rid
        self.result: Any = None
        self.aborted = False
        self.finished = False


class InFlight:
    """The active requests by context, and an event set while there are none."""

    def __init__(self) -> None:
        self._by_context: dict[Context, ActiveRequest] = {}
        self._idle = asyncio.Event()
        self._idle.set()

    def __len__(self) -> int:
        return len(self._by_context)

    def get(self, context: Context) -> ActiveRequest | None:
        return self._by_context.get(context)

    def values(self) -> list[ActiveRequest]:
        return list(self._by_context.values())

    def add(self, active: ActiveRequest) -> None:
        self._by_context[active.context] = active
        self._idle.clear()

    def remove(self, active: ActiveRequest) -> None:
        if self._by_context.get(active.context) is active:
            del self._by_context[active.context]
        if not self._by_context:
            self._idle.set()

    async def wait_idle(self) -> None:
        await self._idle.wait()

    def watch(self, active: ActiveRequest, abort: Callable[[ActiveRequest], Any]) -> asyncio.Future[None]:
        """A task that calls `abort(active)` (awaited when it is a coroutine) once its context stops;
        cancel it when the request ends."""

        async def watcher() -> None:
            await active.context.stopped()
            await _call(abort, active)

        return asyncio.ensure_future(watcher())

    async def abort(self, context: Context, abort: Callable[[ActiveRequest], Any]) -> None:
        """`abort(active)` (awaited when it is a coroutine) for the context's request, if any."""
        active = self.get(context)
        if active is not None:
            await _call(abort, active)


async def _call(abort: Callable[[ActiveRequest], Any], active: ActiveRequest) -> None:
    result = abort(active)
    if inspect.isawaitable(result):
        await result


def checked_prompt(
    request: PreprocessedRequest | AnyRequest, engine: str, *, closed: bool, started: bool
) -> list[int]:
    """The prompt's token ids, after the checks a token-in adapter makes before anything else."""
    if not isinstance(request, PreprocessedRequest):
        raise InvalidArgument(f"out={engine} takes pre-processed requests (token ids)", param="model")
    if closed:
        raise EngineShutdown(f"the {engine} engine shut down")
    if not started:
        raise EngineError(f"the {engine} engine is not started")
    prompt = list(request.token_ids)
    if not prompt:
        raise InvalidArgument("the prompt is empty: at least one token is needed", param="prompt")
    return prompt
