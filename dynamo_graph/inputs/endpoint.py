"""`dyngraph run in=dyn://ns.comp.ep out=ENGINE MODEL`: serve an engine as a distributed worker.

The worker registers its endpoint instance and model card in discovery and serves requests
from the request plane until SIGINT/SIGTERM, then unregisters at once (no new requests), lets
streams in flight finish for a grace period (DYN_SHUTDOWN_GRACE_S, default 10 s), ends those
still running with EngineShutdown (the frontend migrates them to another worker when its
migration limit allows) and releases its lease. Tokens-input engines receive `PreprocessedRequest`s;
text-input engines receive the OpenAI request and answer with OpenAI chunks, as Dynamo's
Chat/Completion-type workers do.

`--max-inflight N` (default 1024; 0: unlimited) caps the requests a worker has in flight: one
more is answered at once with EngineOverloaded (`overloaded`, 503, before any output), and the
frontend's client sends it to another instance (runtime/client.py), so no worker queues without
bound behind the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec
from rich.console import Console

from dynamo_graph.backend.engine import (
    WIRE_FINISH_REASONS,
    EngineConfig,
    LLMEngine,
    normalize_finish_reason,
)
from dynamo_graph.backend.errors import EngineError, EngineOverloaded, EngineShutdown, InvalidArgument
from dynamo_graph.backend.protocol import LLMEngineOutput, PreprocessedRequest
from dynamo_graph.inputs.config import RunConfig, RunConfigError
from dynamo_graph.inputs.launch import StartedEngine, start_engine
from dynamo_graph.llm.openai import AnyRequest, ChatCompletionRequest, CompletionRequest
from dynamo_graph.llm.register import publish_card
from dynamo_graph.runtime.context import Context
from dynamo_graph.runtime.names import EndpointName
from dynamo_graph.runtime.runtime import DistributedRuntime, Endpoint

if TYPE_CHECKING:
    from dynamo_graph.router.kv.publisher import KvEventPublisher

log = logging.getLogger(__name__)
console = Console(stderr=True, soft_wrap=True)
SHUTDOWN_GRACE_S = 10.0
# After the grace period: how long streams get to send their EngineShutdown error frame.
SHUTDOWN_END_S = 2.0


def shutdown_grace_from_env(default: float = SHUTDOWN_GRACE_S) -> float:
    """DYN_SHUTDOWN_GRACE_S: seconds a stopping worker lets requests in flight finish."""
    raw = (os.environ.get("DYN_SHUTDOWN_GRACE_S") or "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise RunConfigError(f"DYN_SHUTDOWN_GRACE_S must be a number of seconds, not {raw!r}") from None
    if value < 0:
        raise RunConfigError(f"DYN_SHUTDOWN_GRACE_S must be >= 0, not {raw!r}")
    return value


class Closing:
    """Set when a stopping worker's grace period is over: handlers then end their streams with
    EngineShutdown at the next output (one attribute test per output on the hot path)."""

    __slots__ = ("ended",)

    def __init__(self) -> None:
        self.ended = False


_SHUTDOWN_MESSAGE = "the worker is shutting down (its grace period ended)"


class InflightCap:
    """Requests a worker's handler has in flight, and its cap (0: none). `enter` raises
    EngineOverloaded when the cap is reached; every successful `enter` is matched by `leave`."""

    __slots__ = ("inflight", "limit", "refused")

    def __init__(self, limit: int = 0) -> None:
        self.limit = max(int(limit), 0)
        self.inflight = 0
        self.refused = 0

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


def _checked(out: LLMEngineOutput) -> LLMEngineOutput:
    """The wire's finish reasons only; an error chunk becomes the stream's error frame."""
    reason = out.finish_reason
    if reason is not None and reason not in WIRE_FINISH_REASONS:
        out.finish_reason = normalize_finish_reason(reason)  # type: ignore[assignment]
    if out.error is not None or out.finish_reason == "error":
        raise EngineError(out.error or "the engine failed the request")
    return out


def tokens_handler(engine: LLMEngine, closing: Closing | None = None, cap: InflightCap | None = None):
    """The request-plane handler of a Tokens-input engine: finish reasons normalised, exactly
    one final chunk (the stream is closed after it), error chunks as error frames, and
    `engine.abort(context)` called once when the caller cancels. Once `closing.ended`, streams
    end with EngineShutdown (so they migrate) instead of going on. Past `cap`, requests are
    answered EngineOverloaded before anything else."""
    watch = _watches_cancellation(engine)
    closing = closing or Closing()
    cap = cap or InflightCap()

    async def generate(request: PreprocessedRequest, context: Context) -> AsyncIterator[LLMEngineOutput]:
        cap.enter()
        watcher = _watch(engine, context, watch)
        try:
            async for out in engine.generate(request, context):
                if closing.ended:
                    raise EngineShutdown(_SHUTDOWN_MESSAGE)
                out = _checked(out)
                yield out
                if out.finish_reason is not None:
                    return
        finally:
            cap.leave()
            await _unwatch(watcher, context)

    return generate


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
        cap.enter()
        try:
            request = _openai_request(raw)
        except BaseException:
            cap.leave()
            raise
        rid, created = uuid.uuid4().hex, int(time.time())
        watcher = _watch(engine, context, watch)
        try:
            async for out in engine.generate(request, context):
                if closing.ended:
                    raise EngineShutdown(_SHUTDOWN_MESSAGE)
                out = _checked(out)
                yield _chunk(request, rid, created, out)
                if out.finish_reason is not None:
                    return
        finally:
            cap.leave()
            await _unwatch(watcher, context)

    return generate


def check_static_worker_settings() -> None:
    """A static worker is found by address, not discovery: it needs a fixed tcp port."""
    plane = os.environ.get("DYN_REQUEST_PLANE") or "tcp"
    if plane != "tcp":
        raise RunConfigError(f"--static-worker needs the tcp request plane (DYN_REQUEST_PLANE={plane!r})")
    if not (os.environ.get("DYN_TCP_PORT") or "0").strip("0"):
        raise RunConfigError("--static-worker needs a fixed port for frontends to dial: set DYN_TCP_PORT")


# Starts the engine under the given instance id, calling the hook (which connects the KV event
# publisher) after the engine exists and before its start().
EngineStarter = Callable[[int, Callable[[LLMEngine], Awaitable[None]]], Awaitable[StartedEngine]]


async def serve_worker(cfg: RunConfig, name: EndpointName) -> int:
    """`dyngraph run in=dyn://... out=ENGINE`: build the engine named by `out=` and serve it."""

    async def start(worker_id: int, before_start: Callable[[LLMEngine], Awaitable[None]]) -> StartedEngine:
        return await start_engine(cfg, worker_id=worker_id, before_start=before_start)

    return await serve_engine(cfg, name, start)


async def serve_engine(
    cfg: RunConfig, name: EndpointName, start: EngineStarter, *, grace_s: float | None = None
) -> int:
    """Serve one engine as a worker; shared by `dyngraph run in=dyn://` and `backend.run`.

    The runtime first, then the engine under this instance's id (so its KV events name it; the
    event publisher is connected before the engine starts), then the endpoint and the model card.
    Serve until SIGINT/SIGTERM, then shut down in order: unregister (no new requests), let the
    engine drain and streams in flight finish (one grace period for both), close the runtime
    (lease), release the engine, withdraw the event publisher. `grace_s`: DYN_SHUTDOWN_GRACE_S
    or SHUTDOWN_GRACE_S unless given."""
    if cfg.static_worker:
        check_static_worker_settings()
    grace_s = shutdown_grace_from_env() if grace_s is None else grace_s
    closing = Closing()
    runtime = await DistributedRuntime.create(static=cfg.static_worker)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, runtime.shutdown)
    events: KvEventPublisher | None = None

    async def connect_kv_events(engine: LLMEngine) -> None:
        nonlocal events
        if engine.publishes_kv_events:
            events = await _kv_event_publisher(runtime, name)
            engine.kv_event_sink = events

    started: StartedEngine | None = None
    endpoint: Endpoint | None = None
    try:
        started = await start(runtime.instance_id, connect_kv_events)
        engine, card = started.engine, started.card
        payload = engine.health_check_request(started.config)
        if payload is not None:
            card.user_data = {**(card.user_data or {}), "health_check_payload": payload}
            if health_check_enabled():
                await run_health_check(engine, started.config, payload)
        endpoint = runtime.namespace(name.namespace).component(name.component).endpoint(name.endpoint)
        cap = InflightCap(cfg.max_inflight)
        if started.config.model_input == "tokens":
            await endpoint.start_serving(
                tokens_handler(engine, closing, cap), request_type=PreprocessedRequest
            )
        else:
            await endpoint.start_serving(text_handler(engine, closing, cap))
        await publish_card(endpoint, card)
        console.print(
            f"[bold green]dyngraph[/] worker {name} instance {endpoint.instance_id:x} serving "
            f"model [bold]{card.display_name}[/] ({card.model_input} input"
            f"{', KV events' if events is not None else ''})"
        )
        await runtime.wait_for_shutdown()
        log.info("shutting down: unregistering, then up to %.0fs for requests in flight", grace_s)
        return 0
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await _shut_down(runtime, endpoint, started, events, grace_s, closing)


async def _shut_down(
    runtime: DistributedRuntime,
    endpoint: Endpoint | None,
    started: StartedEngine | None,
    events: KvEventPublisher | None,
    grace_s: float,
    closing: Closing | None = None,
) -> None:
    """Unregister at once (discovery and the request plane: callers go elsewhere), give the
    requests in flight `grace_s` to finish, then end the rest with EngineShutdown: handlers stop
    at their next output and the engine is cleaned up (the mocker ends its open streams with
    EngineShutdown). Their error frames get SHUTDOWN_END_S to leave before the runtime closes
    (what is left then is cancelled: its caller sees a broken stream, which migrates too)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    if endpoint is not None:
        try:
            await endpoint.unregister()
        except Exception:
            log.exception("unregistering %s failed", endpoint.name)

    async def end_the_rest() -> None:
        log.warning("grace period of %.0fs over: ending the requests still in flight", grace_s)
        if closing is not None:
            closing.ended = True
        if started is not None:
            with contextlib.suppress(Exception):
                await started.engine.cleanup()

    if started is not None:
        try:
            await asyncio.wait_for(started.engine.drain(), grace_s)
        except TimeoutError:
            pass
        except Exception:
            log.exception("engine.drain failed")
    # The engine is idle or the grace is over; the request plane may still be sending frames.
    ending: list[asyncio.Task[None]] = []
    remaining = max(deadline - loop.time(), 0.0)
    timer = loop.call_later(remaining, lambda: ending.append(asyncio.ensure_future(end_the_rest())))
    await runtime.close(remaining + SHUTDOWN_END_S)
    timer.cancel()
    for task in ending:
        with contextlib.suppress(Exception):
            await task
    if started is not None:
        with contextlib.suppress(Exception):
            await started.engine.cleanup()
    if events is not None:
        with contextlib.suppress(Exception):
            await events.close()


def health_check_enabled() -> bool:
    return (os.environ.get("DYN_HEALTH_CHECK_ENABLED") or "").lower() in ("1", "true", "yes", "on")


async def run_health_check(
    engine: LLMEngine, config: EngineConfig, payload: dict[str, Any], timeout_s: float = 60.0
) -> None:
    """Send the health-check request through the engine; raise EngineError unless it completes."""
    request: PreprocessedRequest | AnyRequest
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


async def _kv_event_publisher(runtime: DistributedRuntime, name: EndpointName) -> KvEventPublisher | None:
    """The engine's KV events and load on the event plane, on the endpoint's channel. A static
    worker has no discovery for zmq to announce its socket in: it publishes only over NATS."""
    from dynamo_graph.router.kv.publisher import KvEventPublisher
    from dynamo_graph.runtime.events import create_event_publisher, event_plane_kind

    kind = event_plane_kind()
    if runtime.discovery is None and kind == "zmq":
        log.warning("a static worker cannot announce zmq KV events (no discovery): kv routers will predict")
        return None
    publisher = await create_event_publisher(
        kind,
        discovery=runtime.discovery,
        namespace=name.namespace,
        component=name.component,
        publisher_id=runtime.instance_id,
    )
    return KvEventPublisher(publisher, runtime.instance_id)
