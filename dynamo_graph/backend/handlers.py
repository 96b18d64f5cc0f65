"""The request-plane handlers that wrap an engine: what every worker does around `generate`.

Whatever the engine, a worker's stream has the same shape (docs/contracts.md): the wire's
finish reasons only (`normalize_finish_reason`), exactly one final chunk, an engine's error chunk
turned into the stream's error frame, `engine.abort(context)` called once when the caller
cancels, streams ended with EngineShutdown once a stopping worker's grace is over (so they
migrate), and a cap on requests in flight answered with EngineOverloaded before any output (the
caller's client sends it to another instance, so no worker queues without bound behind its
engine). Tokens-input engines take `PreprocessedRequest`s; text-input engines take the OpenAI
request and answer with OpenAI chunks, as Dynamo's Chat/Completion-type workers do.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from dynamo_graph.backend.embedding import EmbeddingEngine
from dynamo_graph.backend.engine import (
    WIRE_FINISH_REASONS,
    EngineConfig,
    KvImportError,
    LLMEngine,
    normalize_finish_reason,
)
from dynamo_graph.backend.errors import EngineError, EngineOverloaded, EngineShutdown, InvalidArgument
from dynamo_graph.backend.kv_transfer import KvFetcher, KvFetchError, KvStore
from dynamo_graph.llm.openai import AnyRequest, ChatCompletionRequest, CompletionRequest
from dynamo_graph.llm.protocol import (
    EmbeddingOutput,
    KvImportReport,
    KvTransferParams,
    LLMEngineOutput,
    PreprocessedEmbeddingRequest,
    PreprocessedRequest,
)
from dynamo_graph.runtime import tracing
from dynamo_graph.runtime.context import Context
from dynamo_graph.runtime.names import EndpointName

log = logging.getLogger(__name__)


class Closing:
    """Set when a stopping worker's grace period is over: handlers then end their streams with
    EngineShutdown at the next output (one attribute test per output on the hot path)."""

    __slots__ = ("ended",)

    def __init__(self) -> None:
        self.ended = False


_SHUTDOWN_MESSAGE = "the worker is shutting down (its grace period ended)"


class InflightCap:
    """Requests a worker's handler has in flight, and its cap (0: none). `enter` raises
    EngineOverloaded when the cap is reached; every successful `enter` is matched by `leave`.
    It also counts how requests ended, for the worker's /metrics (backend/metrics.py)."""

    __slots__ = ("cancelled", "failed", "inflight", "limit", "refused", "served")

    def __init__(self, limit: int = 0) -> None:
        self.limit = max(int(limit), 0)
        self.inflight = 0
        self.refused = 0
        self.served = 0  # streams that ended normally
        self.failed = 0  # streams that ended with an error
        self.cancelled = 0  # streams the caller stopped

    def enter(self) -> None:
        if self.limit and self.inflight >= self.limit:
            self.refused += 1
            raise EngineOverloaded(f"the worker is at its limit of {self.limit} requests in flight")
        self.inflight += 1

    def leave(self) -> None:
        self.inflight -= 1


def _watches_cancellation(engine: LLMEngine) -> bool:
    """Engines that implement `abort` hear of a cancelled request as soon as it is cancelled;
    for the others (the no-op default) no watcher task is spent per request."""
    return type(engine).abort is not LLMEngine.abort


async def _abort_when_stopped(engine: LLMEngine, context: Context) -> None:
    await context.stopped()
    try:
        await engine.abort(context)
    except Exception:
        log.exception("engine.abort failed for request %s", context.id)


def _watch(engine: LLMEngine, context: Context, enabled: bool) -> asyncio.Task[None] | None:
    if not enabled:
        return None
    return asyncio.get_running_loop().create_task(_abort_when_stopped(engine, context))


async def _unwatch(watcher: asyncio.Task[None] | None, context: Context) -> None:
    """The stream is over: a cancelled request's abort runs to its end (exactly once), else the
    watcher goes."""
    if watcher is None:
        return
    if context.is_stopped():
        with contextlib.suppress(Exception):
            await watcher
    else:
        watcher.cancel()


@contextlib.asynccontextmanager
async def _in_flight(
    engine: LLMEngine, context: Context, cap: InflightCap, watch: bool
) -> AsyncIterator[None]:
    """One request inside a handler: counted against the cap, and watched for cancellation
    (engines with `abort`) until its stream is over."""
    cap.enter()
    watcher = _watch(engine, context, watch)
    try:
        yield
    except (GeneratorExit, asyncio.CancelledError):
        cap.cancelled += 1
        raise
    except BaseException:
        cap.failed += 1
        raise
    else:
        if context.is_stopped():
            cap.cancelled += 1
        else:
            cap.served += 1
    finally:
        cap.leave()
        await _unwatch(watcher, context)


def _checked(out: LLMEngineOutput) -> LLMEngineOutput:
    """The wire's finish reasons only; an error chunk becomes the stream's error frame."""
    reason = out.finish_reason
    if reason is not None and reason not in WIRE_FINISH_REASONS:
        out.finish_reason = normalize_finish_reason(reason)  # type: ignore[assignment]
    if out.error is not None or out.finish_reason == "error":
        raise EngineError(out.error or "the engine failed the request")
    return out


def tokens_handler(
    engine: LLMEngine,
    closing: Closing | None = None,
    cap: InflightCap | None = None,
    fetcher: KvFetcher | None = None,
):
    """The request-plane handler of a Tokens-input engine: finish reasons normalised, exactly
    one final chunk (the stream is closed after it), error chunks as error frames, and
    `engine.abort(context)` called once when the caller cancels. Once `closing.ended`, streams
    end with EngineShutdown (so they migrate) instead of going on. Past `cap`, requests are
    answered EngineOverloaded before anything else. With a `fetcher` (a decode worker), a request
    that brings `kv_transfer_params` continues from the KV a prefill worker computed."""
    watch = _watches_cancellation(engine)
    closing = closing or Closing()
    cap = cap or InflightCap()

    async def generate(request: PreprocessedRequest, context: Context) -> AsyncIterator[LLMEngineOutput]:
        async with _in_flight(engine, context, cap, watch):
            with tracing.span("generate", context) as span:
                _describe(span, request, cap)
                report: KvImportReport | None = None
                if fetcher is not None and request.kv_transfer_params is not None:
                    stream, report = await _from_transfer(engine, fetcher, request, context)
                else:
                    stream = engine.generate(request, context)
                tokens, first = 0, True
                async for out in stream:
                    if closing.ended:
                        raise EngineShutdown(_SHUTDOWN_MESSAGE)
                    out = _checked(out)
                    if first:
                        span.event("first_token")
                        first = False
                    tokens += len(out.token_ids)
                    if report is not None:
                        out.kv_import, report = report, None
                    yield out
                    if out.finish_reason is not None:
                        span.set("llm.completion_tokens", tokens)
                        span.set("llm.finish_reason", out.finish_reason)
                        return

    return generate


def _describe(
    span: tracing.Span | tracing.NoSpan, request: PreprocessedRequest, cap: InflightCap | None
) -> None:
    """A worker span's request: its size, and the requests in flight beside it (its queue)."""
    if span is tracing.NO_SPAN:
        return
    span.set("llm.prompt_tokens", len(request.token_ids))
    if cap is not None:
        span.set("worker.inflight", cap.inflight)
    max_tokens = request.stop_conditions.max_tokens
    if max_tokens is not None:
        span.set("llm.max_tokens", max_tokens)


async def _from_transfer(
    engine: LLMEngine, fetcher: KvFetcher, request: PreprocessedRequest, context: Context
) -> tuple[AsyncIterator[LLMEngineOutput], KvImportReport]:
    """The engine's stream continuing from the transferred KV, or, when the KV cannot be had or
    loaded, its ordinary stream (local prefill); with the report of which it was."""
    params = request.kv_transfer_params
    assert params is not None
    attributes = {"kv.instance_id": f"{params.instance_id:x}", "kv.bytes": params.nbytes}
    with tracing.span("kv_transfer", context, attributes) as span:
        try:
            handoff, report = await fetcher.fetch(params, context)
        except KvFetchError as err:
            log.warning(
                "request %s: KV transfer failed (%s: %s); prefilling locally", context.id, err.kind, err
            )
            span.set("kv.error", err.kind)
            return engine.generate(request, context), KvImportReport(error=err.kind)
    stream = engine.generate_from_kv(request, handoff, context)
    try:
        first = await anext(stream)
    except KvImportError as err:
        log.warning("request %s: KV import failed (%s); prefilling locally", context.id, err)
        return engine.generate(request, context), KvImportReport(error="import_failed")
    except StopAsyncIteration:
        first = None

    async def resumed() -> AsyncIterator[LLMEngineOutput]:
        if first is not None:
            yield first
            async for out in stream:
                yield out

    return resumed(), report


def prefill_handler(
    engine: LLMEngine,
    store: KvStore,
    kv_endpoint: EndpointName,
    instance_id: int,
    closing: Closing | None = None,
    cap: InflightCap | None = None,
):
    """A prefill worker's handler: the prompt is evaluated and its first token returned, with
    `kv_transfer_params` naming where its KV waits (`store`, served on `kv_endpoint`); a request
    that ends at its first token comes back finished, with nothing held."""
    watch = _watches_cancellation(engine)
    closing = closing or Closing()
    cap = cap or InflightCap()

    async def generate(request: PreprocessedRequest, context: Context) -> AsyncIterator[LLMEngineOutput]:
        async with _in_flight(engine, context, cap, watch):
            with tracing.span("prefill", context) as span:
                _describe(span, request, cap)
                out, handoff = await engine.prefill(request, context)
            if closing.ended:
                raise EngineShutdown(_SHUTDOWN_MESSAGE)
            out = _checked(out)
            if out.finish_reason is None:
                if handoff is None:
                    raise EngineError("the engine's prefill returned no KV for an unfinished request")
                out.kv_transfer_params = KvTransferParams(
                    namespace=kv_endpoint.namespace,
                    component=kv_endpoint.component,
                    instance_id=instance_id,
                    transfer_id=store.put(handoff),
                    num_tokens=handoff.num_tokens,
                    format=handoff.format,
                    nbytes=handoff.size,
                )
                out.finish_reason = "length"  # this worker's part is done; the stream ends here
            yield out

    return generate


def embedding_handler(
    engine: EmbeddingEngine, closing: Closing | None = None, cap: InflightCap | None = None
):
    """An embedding worker's handler: one `EmbeddingOutput` frame per request, under the same
    in-flight cap, cancellation and shutdown rules as generation."""
    watch = _watches_cancellation(engine)
    closing = closing or Closing()
    cap = cap or InflightCap()

    async def embed(
        request: PreprocessedEmbeddingRequest, context: Context
    ) -> AsyncIterator[EmbeddingOutput]:
        async with _in_flight(engine, context, cap, watch):
            out = await engine.embed(request, context)
            if closing.ended:
                raise EngineShutdown(_SHUTDOWN_MESSAGE)
            if out.error is not None:
                raise EngineError(out.error)
            yield out

    return embed


def _openai_request(raw: Any) -> AnyRequest:
    try:
        if isinstance(raw, dict) and "messages" in raw:
            return msgspec.convert(raw, ChatCompletionRequest)
        return msgspec.convert(raw, CompletionRequest)
    except msgspec.ValidationError as err:
        raise InvalidArgument(f"invalid request: {err}") from None


def _chunk(request: AnyRequest, rid: str, created: int, out: LLMEngineOutput) -> dict[str, Any]:
    if isinstance(request, ChatCompletionRequest):
        delta = {"content": out.text} if out.text else {}
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": out.finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": out.text or "", "finish_reason": out.finish_reason}
        obj = "text_completion"
    chunk: dict[str, Any] = {
        "id": rid,
        "object": obj,
        "created": created,
        "model": request.model,
        "choices": [choice],
    }
    usage = out.completion_usage
    if usage is not None:
        chunk["usage"] = {
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        }
    return chunk


def text_handler(engine: LLMEngine, closing: Closing | None = None, cap: InflightCap | None = None):
    """As `tokens_handler`, for a Text-input engine: OpenAI request in, OpenAI chunks out."""
    watch = _watches_cancellation(engine)
    closing = closing or Closing()
    cap = cap or InflightCap()

    async def generate(raw: Any, context: Context) -> AsyncIterator[dict[str, Any]]:
        async with _in_flight(engine, context, cap, watch):
            request = _openai_request(raw)
            rid, created = uuid.uuid4().hex, int(time.time())
            with tracing.span("generate", context, {"worker.inflight": cap.inflight}):
                async for out in engine.generate(request, context):
                    if closing.ended:
                        raise EngineShutdown(_SHUTDOWN_MESSAGE)
                    out = _checked(out)
                    yield _chunk(request, rid, created, out)
                    if out.finish_reason is not None:
                        return

    return generate


class TracedEngine:
    """An engine in the serving process itself (`dyngraph run in=http out=ENGINE`) with the
    worker's `generate` span around each call, so one process's trace reads `POST` →
    `preprocess` → `generate` as a graph's does across processes. Used only while tracing is on."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    async def generate(self, request: Any, context: Context) -> AsyncIterator[LLMEngineOutput]:
        with tracing.span("generate", context) as span:
            if isinstance(request, PreprocessedRequest):
                _describe(span, request, None)
            tokens, first = 0, True
            try:
                async with contextlib.aclosing(self.engine.generate(request, context)) as stream:
                    async for out in stream:
                        if first:
                            span.event("first_token")
                            first = False
                        tokens += len(out.token_ids)
                        if out.finish_reason is not None:
                            span.set("llm.finish_reason", out.finish_reason)
                        yield out
            finally:  # also when the pipeline stops reading (its own stop conditions met)
                span.set("llm.completion_tokens", tokens)


def health_check_enabled() -> bool:
    return (os.environ.get("DYN_HEALTH_CHECK_ENABLED") or "").lower() in ("1", "true", "yes", "on")


async def run_health_check(
    engine: LLMEngine, config: EngineConfig, payload: dict[str, Any], timeout_s: float = 60.0
) -> None:
    """Send the health-check request through the engine; raise EngineError unless it completes."""
    request: PreprocessedRequest | AnyRequest
    if isinstance(engine, EmbeddingEngine):
        try:
            async with asyncio.timeout(timeout_s):
                await engine.embed(
                    msgspec.convert(payload, PreprocessedEmbeddingRequest), Context("health-check")
                )
        except TimeoutError:
            raise EngineError(f"health check did not complete within {timeout_s:.0f}s") from None
        return
    if config.model_input == "tokens":
        request = msgspec.convert(payload, PreprocessedRequest)
    else:
        request = _openai_request(payload)
    context = Context("health-check")
    try:
        async with asyncio.timeout(timeout_s):
            async for out in engine.generate(request, context):
                if out.error is not None or out.finish_reason == "error":
                    raise EngineError(f"health check failed: {out.error or 'error'}")
                if out.finish_reason is not None:
                    return
    except TimeoutError:
        raise EngineError(f"health check did not complete within {timeout_s:.0f}s") from None
    raise EngineError("health check failed: the engine ended the stream without a finish reason")
