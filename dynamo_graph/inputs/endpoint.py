"""`dyngraph run in=dyn://ns.comp.ep out=ENGINE MODEL`: serve an engine as a distributed worker.

The worker registers its endpoint instance and model card in discovery and serves requests
from the request plane until SIGINT/SIGTERM, then unregisters, lets streams in flight finish
(a grace period) and releases its lease. Tokens-input engines receive `PreprocessedRequest`s;
text-input engines receive the OpenAI request and answer with OpenAI chunks, as Dynamo's
Chat/Completion-type workers do.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import msgspec
from rich.console import Console

from dynamo_graph.backend.engine import LLMEngine
from dynamo_graph.backend.errors import InvalidArgument
from dynamo_graph.backend.protocol import LLMEngineOutput, PreprocessedRequest
from dynamo_graph.inputs.config import RunConfig, RunConfigError
from dynamo_graph.inputs.launch import StartedEngine, start_engine
from dynamo_graph.llm.openai import AnyRequest, ChatCompletionRequest, CompletionRequest
from dynamo_graph.llm.register import publish_card
from dynamo_graph.runtime.context import Context
from dynamo_graph.runtime.names import EndpointName
from dynamo_graph.runtime.runtime import DistributedRuntime

if TYPE_CHECKING:
    from dynamo_graph.router.kv.publisher import KvEventPublisher

log = logging.getLogger(__name__)
console = Console(stderr=True, soft_wrap=True)
SHUTDOWN_GRACE_S = 10.0


def tokens_handler(engine: LLMEngine):
    async def generate(request: PreprocessedRequest, context: Context) -> AsyncIterator[LLMEngineOutput]:
        try:
            async for out in engine.generate(request, context):
                yield out
        finally:
            if context.is_stopped():
                await engine.abort(context)

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


def text_handler(engine: LLMEngine):
    async def generate(raw: Any, context: Context) -> AsyncIterator[dict[str, Any]]:
        request = _openai_request(raw)
        rid, created = uuid.uuid4().hex, int(time.time())
        try:
            async for out in engine.generate(request, context):
                yield _chunk(request, rid, created, out)
        finally:
            if context.is_stopped():
                await engine.abort(context)

    return generate


def check_static_worker_settings() -> None:
    """A static worker is found by address, not discovery: it needs a fixed tcp port."""
    plane = os.environ.get("DYN_REQUEST_PLANE") or "tcp"
    if plane != "tcp":
        raise RunConfigError(f"--static-worker needs the tcp request plane (DYN_REQUEST_PLANE={plane!r})")
    if not (os.environ.get("DYN_TCP_PORT") or "0").strip("0"):
        raise RunConfigError("--static-worker needs a fixed port for frontends to dial: set DYN_TCP_PORT")


async def serve_worker(cfg: RunConfig, name: EndpointName) -> int:
    """Start the runtime, then the engine under this instance's id (so its KV events name it),
    serve until told to stop, and shut down in order: unregister, let requests in flight finish
    (grace period), release the engine, withdraw the event publisher."""
    if cfg.static_worker:
        check_static_worker_settings()
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
    try:
        started = await start_engine(cfg, worker_id=runtime.instance_id, before_start=connect_kv_events)
        engine, card = started.engine, started.card
        endpoint = runtime.namespace(name.namespace).component(name.component).endpoint(name.endpoint)
        if started.config.model_input == "tokens":
            await endpoint.start_serving(tokens_handler(engine), request_type=PreprocessedRequest)
        else:
            await endpoint.start_serving(text_handler(engine))
        await publish_card(endpoint, card)
        console.print(
            f"[bold green]dyngraph[/] worker {name} instance {endpoint.instance_id:x} serving "
            f"model [bold]{card.display_name}[/] ({card.model_input} input"
            f"{', KV events' if events is not None else ''})"
        )
        await runtime.wait_for_shutdown()
        log.info("shutting down: unregistering, then up to %.0fs for requests in flight", SHUTDOWN_GRACE_S)
        return 0
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await runtime.close(SHUTDOWN_GRACE_S)
        if started is not None:
            with contextlib.suppress(Exception):
                await started.engine.cleanup()
        if events is not None:
            with contextlib.suppress(Exception):
                await events.close()


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
