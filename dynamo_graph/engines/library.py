"""The core of the adapters for engine libraries that run requests in their own processes
(vLLM, SGLang, TensorRT-LLM): lifecycle over `InFlight` and the request stream, with one policy
per edge case. An engine supplies only how to build a request's parameters (`_params`), submit
it (`_submit`), read one library output (`_parse`), abort a request and shut down, and which
exceptions are the client's fault (`client_errors`).

The policies, the same for every library:
- A library failing a request is `InvalidArgument` (400) for a client error, else `EngineError`;
  once the request was aborted (or the engine is closing) the failure is its cancellation.
- A context stopped before the request reaches the library: one "cancelled" chunk, nothing sent.
  Stopped later (or `abort(context)`): aborted in the library at once, the stream ends "cancelled".
- A consumer that leaves mid-stream aborts the request in the library, so it frees its slot.
- `cached_tokens` (the library's prefix-cache hit) rides on the first chunk with tokens and on the
  usage, capped at the prompt length: a library counting more cannot have reused more.
- A library stream that ends without a finish reason ends with finish "error" and a message: the
  client must not take a truncated answer for a complete one. A library output marked finished
  without a reason is "stop" (the library vouches for the sequence).
- A finish reason outside the engine's table is mapped by `normalize_finish_reason` (unknown
  spellings are "stop", warned once per spelling): one policy for every engine and custom engines.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from abc import abstractmethod
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from dynamo_graph.backend.engine import EngineConfig, LLMEngine, normalize_finish_reason
from dynamo_graph.backend.errors import EngineError, EngineShutdown, InvalidArgument
from dynamo_graph.backend.protocol import (
    CompletionUsage,
    FinishReason,
    LLMEngineOutput,
    PreprocessedRequest,
    TopLogprob,
)
from dynamo_graph.engines.inflight import ActiveRequest, InFlight, checked_prompt
from dynamo_graph.llm.openai import AnyRequest
from dynamo_graph.runtime.context import Context

log = logging.getLogger(__name__)

# How long cleanup() waits for the library to take aborts, then for aborted streams to end.
ABORT_WAIT_S = 5.0
DRAIN_AFTER_ABORT_S = 1.0


@dataclass(slots=True)
class Parsed:
    """One library output, read: the new token ids, whether the library finished the request and
    its finish reason (as the library spells it), its prefix-cache hit, logprobs, and what a
    finished prefill hands to the decode side (`handoff`: the library's transfer parameters)."""

    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    reason: Any = None
    cached_tokens: int | None = None
    log_probs: list[float] | None = None
    top_logprobs: list[list[TopLogprob]] | None = None
    handoff: Any = None


@dataclass(slots=True)
class Submission:
    """A request on its way to the library: its entry in `InFlight` (`active.rid` its id there),
    the prompt, the library's parameters (`_params`), its disaggregation parameters, and whether
    one final output will do (`gather`: a prefill that only wants the handoff)."""

    active: ActiveRequest
    request: PreprocessedRequest
    prompt: list[int]
    params: Any
    transfer: Any
    gather: bool


class LibraryEngine(LLMEngine):
    """See the module docstring. Subclasses set `engine_name` and implement the hooks below."""

    engine_name: ClassVar[str]
    # Exceptions of the library that mean the request itself is wrong (the client's 400).
    client_errors: tuple[type[BaseException], ...] = (ValueError,)

    def __init__(self) -> None:
        self.context_length: int | None = None
        self._config: EngineConfig | None = None
        self._active = InFlight()
        self._rids: set[str] = set()
        self._closed = False

    # ---- what each engine supplies -------------------------------------------------------------

    @property
    @abstractmethod
    def _started(self) -> bool:
        """Whether the library is up."""

    @abstractmethod
    async def _start(self, worker_id: int) -> EngineConfig:
        """Start the library; the config is kept, so this runs once."""

    @abstractmethod
    def _params(self, request: PreprocessedRequest, transfer: Any) -> Any:
        """The library's parameters for the request (its checks raise `client_errors`)."""

    @abstractmethod
    async def _submit(self, job: Submission) -> AsyncIterator[Any]:
        """Hand the request to the library; its stream of outputs."""

    @abstractmethod
    def _parse(self, output: Any, sent: int, request: PreprocessedRequest) -> Parsed:
        """One library output; `sent`: the tokens of this request already passed on."""

    @abstractmethod
    async def _abort_request(self, active: ActiveRequest) -> None:
        """Abort one request inside the library."""

    @abstractmethod
    async def _shutdown(self) -> None:
        """Stop the library (requests are aborted already); called once, by cleanup()."""

    def _finish_reason(self, reason: Any) -> tuple[FinishReason, str | None]:
        """A library finish reason as ours, with an error text for "error". Engines override it
        only for what the common reading gets wrong for them, and may raise (a refusal)."""
        if reason is None:  # finished without a reason: the library vouches for the sequence
            return "stop", None
        return normalize_finish_reason(str(reason)), None  # type: ignore[return-value]

    # ---- lifecycle -----------------------------------------------------------------------------

    async def start(self, worker_id: int = 0) -> EngineConfig:
        if self._closed:
            raise EngineShutdown(f"the {self.engine_name} engine was shut down")
        if self._config is None:
            self._config = await self._start(worker_id)
        return self._config

    async def drain(self) -> None:
        await self._active.wait_idle()

    async def abort(self, context: Context) -> None:
        await self._active.abort(context, self._abort)

    async def _abort(self, active: ActiveRequest) -> None:
        if active.aborted or active.finished or not self._started:
            return
        active.aborted = True
        try:
            await self._abort_request(active)
        except Exception as err:
            log.warning("%s: aborting request %s failed: %s", self.engine_name, active.rid, err)

    async def cleanup(self) -> None:
        """Abort what runs (their streams end "cancelled"), then shut the library down;
        idempotent and safe before start(); `generate` afterwards raises `EngineShutdown`."""
        if self._closed:
            return
        self._closed = True
        running = [a for a in self._active.values() if not a.finished]
        if running and self._started:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(*(self._abort(a) for a in running)), ABORT_WAIT_S)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._active.wait_idle(), DRAIN_AFTER_ABORT_S)
        await self._shutdown()

    def _emit_cleared(self, ranks: Iterable[int]) -> None:
        """Tell the KV event sink the library's cache is gone (the router forgets its blocks)."""
        sink = self.kv_event_sink
        if sink is None:
            return
        for rank in ranks:
            with contextlib.suppress(Exception):
                sink.cleared(rank)

    # ---- requests ------------------------------------------------------------------------------

    def generate(
        self, request: PreprocessedRequest | AnyRequest, context: Context
    ) -> AsyncIterator[LLMEngineOutput]:
        return self._stream(request, context)

    def _request_id(self, context: Context) -> str:
        """The library's id of the request: the context's, made unique among running requests
        (one context may be served twice, by a retry)."""
        rid, n = context.id, 1
        while rid in self._rids:
            n += 1
            rid = f"{context.id}-{n}"
        return rid

    def _checked_params(self, request: PreprocessedRequest, transfer: Any) -> Any:
        try:
            return self._params(request, transfer)
        except EngineError:
            raise
        except self.client_errors as err:
            raise InvalidArgument(f"{self.engine_name} refused the sampling parameters: {err}") from None

    async def _stream(
        self,
        request: PreprocessedRequest | AnyRequest,
        context: Context,
        transfer: Any = None,
        received: dict[str, Any] | None = None,
    ) -> AsyncIterator[LLMEngineOutput]:
        """A request's stream. `transfer`: the library's disaggregation parameters for it;
        `received`: where a finished request's handoff goes (`received["handoff"]`)."""
        name = self.engine_name
        prompt = checked_prompt(request, name, closed=self._closed, started=self._started)
        assert isinstance(request, PreprocessedRequest)
        if self.context_length is not None and len(prompt) >= self.context_length:
            raise InvalidArgument(
                f"This model's maximum context length is {self.context_length} tokens. However, the prompt "
                f"has {len(prompt)} tokens, leaving no room for the completion. Please reduce the length "
                "of the prompt.",
                param="prompt",
            )
        params = self._checked_params(request, transfer)
        if context.is_stopped():
            yield LLMEngineOutput(finish_reason="cancelled", completion_usage=CompletionUsage(len(prompt), 0))
            return
        active = ActiveRequest(context, self._request_id(context))
        self._active.add(active)
        self._rids.add(active.rid)
        watcher: asyncio.Future[None] | None = None
        stream: Any = None
        sent, cached, first = 0, None, True

        def usage() -> CompletionUsage:
            return CompletionUsage(len(prompt), sent, cached)

        try:
            try:
                stream = await self._submit(
                    Submission(active, request, prompt, params, transfer, received is not None)
                )
                watcher = self._active.watch(active, self._abort)
                async for output in stream:
                    parsed = self._parse(output, sent, request)
                    sent += len(parsed.token_ids)
                    if cached is None and parsed.cached_tokens is not None:
                        cached = min(int(parsed.cached_tokens), len(prompt))
                    out = LLMEngineOutput(
                        token_ids=parsed.token_ids,
                        log_probs=parsed.log_probs,
                        top_logprobs=parsed.top_logprobs,
                    )
                    if first and (parsed.token_ids or parsed.finished):
                        out.cached_tokens = cached
                        first = False
                    if parsed.finished or context.is_stopped():
                        if not parsed.finished:
                            await self._abort(active)
                        elif received is not None:
                            received["handoff"] = parsed.handoff
                        out.finish_reason, out.error = self._finish(active, parsed)
                        active.finished = True
                        out.completion_usage = usage()
                        # Close the library's stream before the last yield: a consumer may never
                        # resume this generator after its final output, and the stream's own
                        # bookkeeping (vLLM's queued-prefill count) must not wait for the GC.
                        await _close(stream)
                        yield out
                        return
                    if parsed.token_ids:
                        yield out
            except EngineError:
                raise
            except self.client_errors as err:  # the library's checks of the request
                raise InvalidArgument(f"{name} refused the request: {err}") from None
            except Exception as err:
                if not (self._closed or active.aborted):
                    raise EngineError(f"{name} failed: {type(err).__name__}: {err}") from err
            active.finished = True
            if self._closed or active.aborted or context.is_stopped():
                yield LLMEngineOutput(finish_reason="cancelled", completion_usage=usage())
            else:
                yield LLMEngineOutput(
                    finish_reason="error",
                    completion_usage=usage(),
                    error=f"{name} ended the stream without a finish reason",
                )
        finally:
            if watcher is not None:
                watcher.cancel()
            if not active.finished:  # our consumer went away: free the library's slot
                await self._abort(active)
            await _close(stream)
            self._rids.discard(active.rid)
            self._active.remove(active)

    def _finish(self, active: ActiveRequest, parsed: Parsed) -> tuple[FinishReason, str | None]:
        """The finish reason (and error text) of the request's last output; see the module docstring."""
        if active.aborted or active.context.is_stopped() or not parsed.finished:
            return "cancelled", None
        return self._finish_reason(parsed.reason)


async def _close(stream: Any) -> None:
    """End a library stream (an async generator: its `finally` runs now); twice is harmless."""
    if stream is not None and hasattr(stream, "aclose"):
        with contextlib.suppress(Exception):
            await stream.aclose()
