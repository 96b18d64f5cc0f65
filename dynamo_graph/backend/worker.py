"""Serve one engine as a distributed worker: `dyngraph run in=dyn://ns.comp.ep out=ENGINE MODEL`
and `backend.run(MyEngine)` both end here.

The worker registers its endpoint instance and model card in discovery and serves requests
from the request plane until SIGINT/SIGTERM, then unregisters at once (no new requests), lets
streams in flight finish for a grace period (DYN_SHUTDOWN_GRACE_S, default 10 s), ends those
still running with EngineShutdown (the frontend migrates them to another worker when its
migration limit allows) and releases its lease. What wraps the engine on each request (finish
reasons, cancellation, the in-flight cap) is in backend/handlers.py.

`--max-inflight N` (default 1024; 0: unlimited) caps the requests a worker has in flight: one
more is answered at once with EngineOverloaded (`overloaded`, 503, before any output), and the
frontend's client sends it to another instance (runtime/client.py), so no worker queues without
bound behind the engine.

`--metrics-port N` serves `GET /metrics`: the worker's requests and its engine's own series
(backend/metrics.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rich.console import Console

from dynamo_graph.backend.command_line import WorkerConfig
from dynamo_graph.backend.embedding import EmbeddingEngine
from dynamo_graph.backend.engine import EngineConfig, LLMEngine
from dynamo_graph.backend.handlers import (
    Closing,
    InflightCap,
    TracedEngine,
    embedding_handler,
    health_check_enabled,
    prefill_handler,
    run_health_check,
    text_handler,
    tokens_handler,
)
from dynamo_graph.backend.kv_transfer import KV_FETCH_ENDPOINT, KvFetcher, KvStore, kv_fetch_handler
from dynamo_graph.backend.lora import LORA_ENDPOINT, LoraManager, discovery_publisher, lora_handler
from dynamo_graph.backend.metrics import serve_metrics
from dynamo_graph.backend.rank_network import bind_gloo_to_host_address
from dynamo_graph.backend.settings import FOLLOWING, RunConfigError
from dynamo_graph.llm.card import ModelDeploymentCard
from dynamo_graph.llm.model_source import LocalModel
from dynamo_graph.llm.protocol import PreprocessedEmbeddingRequest, PreprocessedRequest
from dynamo_graph.llm.register import publish_card
from dynamo_graph.runtime import tracing
from dynamo_graph.runtime.metrics_http import MetricsServer
from dynamo_graph.runtime.names import EndpointName
from dynamo_graph.runtime.runtime import DistributedRuntime, Endpoint

if TYPE_CHECKING:
    from dynamo_graph.llm.embeddings import EmbeddingPipeline
    from dynamo_graph.llm.pipeline import ModelPipeline
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


@dataclass
class StartedEngine:
    """An engine started for one model, with the card it serves under."""

    engine: LLMEngine
    config: EngineConfig
    card: ModelDeploymentCard
    model: LocalModel | None

    def pipeline(self) -> ModelPipeline | EmbeddingPipeline:
        from dynamo_graph.llm.embeddings import EmbeddingPipeline  # a worker needs none
        from dynamo_graph.llm.pipeline import TextPipeline, tokens_pipeline

        if isinstance(self.engine, EmbeddingEngine):
            assert self.model is not None
            return EmbeddingPipeline(self.card, self.model.load_tokenizer(), self.engine)
        if self.config.model_input == "tokens":
            assert self.model is not None
            return tokens_pipeline(self.card, self.model, self.backend)
        return TextPipeline(self.card, self.backend)

    @property
    def backend(self) -> LLMEngine | TracedEngine:
        """What this process's pipelines call: the engine, inside a `generate` span while
        tracing is on."""
        return TracedEngine(self.engine) if tracing.ON else self.engine


def make_card(
    cfg: WorkerConfig, engine_name: str, config: EngineConfig, model: LocalModel | None
) -> ModelDeploymentCard:
    context_length = cfg.engine.context_length or config.context_length
    if model is None:
        name = cfg.engine.model_name or config.served_model_name or engine_name
        card = ModelDeploymentCard.without_files(name, context_length=context_length)
        card.migration_limit = cfg.worker.migration_limit
    else:
        card = ModelDeploymentCard.from_local_model(
            model,
            model_input=config.model_input,
            context_length=context_length or model.context_length,
            kv_cache_block_size=cfg.engine.kv_cache_block_size or config.kv_cache_block_size or 16,
            migration_limit=cfg.worker.migration_limit,
        )
        card.runtime_config = runtime_config(config)
    if config.model_type:
        card.model_type = list(config.model_type)  # type: ignore[arg-type]
    card.tool_call_parser = cfg.worker.dyn_tool_call_parser
    card.reasoning_parser = cfg.worker.dyn_reasoning_parser
    card.engine = engine_name
    card.capabilities = list(config.capabilities or ())
    return card


def runtime_config(config: EngineConfig) -> dict[str, int | str] | None:
    """What routers want to know of this worker (may differ between workers): its capacity, and
    a prefill engine's bootstrap address (router/disagg.py `bootstrap_address` reads it)."""
    fields = {
        "total_kv_blocks": config.total_kv_blocks,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "data_parallel_size": config.data_parallel_size,
        "bootstrap_host": config.bootstrap_host,
        "bootstrap_port": config.bootstrap_port,
    }
    return {k: v for k, v in fields.items() if v is not None} or None


async def start_built_engine(
    engine: LLMEngine,
    cfg: WorkerConfig,
    model: LocalModel | None,
    *,
    engine_name: str,
    worker_id: int = 0,
    before_start: Callable[[LLMEngine], Awaitable[None]] | None = None,
) -> StartedEngine:
    """Start an engine that is built already (by `start_engine`, or by `LLMEngine.from_args` for
    `backend.run`) and make its card; the engine is cleaned up if this fails."""
    try:
        if before_start is not None:
            await before_start(engine)
        config = await engine.start(worker_id)
        return StartedEngine(engine, config, make_card(cfg, engine_name, config, model), model)
    except BaseException:
        await engine.cleanup()
        raise


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


async def serve_engine(
    cfg: WorkerConfig, name: EndpointName, start: EngineStarter, *, grace_s: float | None = None
) -> int:
    """Serve one engine as a worker; shared by `dyngraph run in=dyn://` and `backend.run`.

    The runtime first, then the engine under this instance's id (so its KV events name it; the
    event publisher is connected before the engine starts), then the endpoint and the model card.
    Serve until SIGINT/SIGTERM, then shut down in order: unregister (no new requests), let the
    engine drain and streams in flight finish (one grace period for both), close the runtime
    (lease), release the engine, withdraw the event publisher. `grace_s`: DYN_SHUTDOWN_GRACE_S
    or SHUTDOWN_GRACE_S unless given."""
    if cfg.engine.num_nodes > 1:
        bind_gloo_to_host_address()
    if cfg.engine.node_rank > 0:
        return await follow_leader(cfg, name, start)
    if cfg.worker.static_worker:
        check_static_worker_settings()
    grace_s = shutdown_grace_from_env() if grace_s is None else grace_s
    closing = Closing()
    runtime = await DistributedRuntime.create(static=cfg.worker.static_worker)
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
    metrics: MetricsServer | None = None
    endpoint: Endpoint | None = None
    fetcher: KvFetcher | None = None
    try:
        started = await start(runtime.instance_id, connect_kv_events)
        engine, card = started.engine, started.card
        payload = engine.health_check_request(started.config)
        if payload is not None:
            card.user_data = {**(card.user_data or {}), "health_check_payload": payload}
            if health_check_enabled():
                await run_health_check(engine, started.config, payload)
        endpoint = runtime.namespace(name.namespace).component(name.component).endpoint(name.endpoint)
        cap = InflightCap(cfg.worker.max_inflight)
        mode = cfg.engine.disaggregation_mode
        if mode != "agg":
            check_disaggregation(engine, started.config, mode)
        if isinstance(engine, EmbeddingEngine):
            await endpoint.start_serving(
                embedding_handler(engine, closing, cap), request_type=PreprocessedEmbeddingRequest
            )
        elif mode == "prefill" and started.config.bootstrap_port is None:
            store = KvStore()
            kv_endpoint = runtime.namespace(name.namespace).component(name.component)
            kv_endpoint = kv_endpoint.endpoint(KV_FETCH_ENDPOINT)
            await kv_endpoint.start_serving(kv_fetch_handler(store))
            handler = prefill_handler(engine, store, kv_endpoint.name, runtime.instance_id, closing, cap)
            await endpoint.start_serving(handler, request_type=PreprocessedRequest)
            card.model_type = ["prefill"]
        elif started.config.model_input == "tokens":
            if mode == "decode":
                fetcher = KvFetcher(runtime)
            handler = tokens_handler(engine, closing, cap, fetcher)
            await endpoint.start_serving(handler, request_type=PreprocessedRequest)
            if mode == "prefill":  # pairs with decode engines by bootstrap room: streams as any
                card.model_type = ["prefill"]
        else:
            await endpoint.start_serving(text_handler(engine, closing, cap))
        if cfg.worker.metrics_port is not None:
            metrics = await serve_metrics(
                cfg.worker.metrics_host,
                cfg.worker.metrics_port,
                cap,
                card.display_name,
                engine.metrics_collectors(),
            )
            where = f"{metrics.scheme}://{cfg.worker.metrics_host}:{metrics.port}/metrics"
            log.info("worker metrics on %s", where)
        await publish_card(endpoint, card)
        await _serve_lora_adapters(cfg, runtime, name, engine, endpoint, card)
        role = "" if mode == "agg" else f", {mode} worker"
        console.print(
            f"[bold green]dyngraph[/] worker {name} instance {endpoint.instance_id:x} serving "
            f"model [bold]{card.display_name}[/] ({card.model_input} input"
            f"{', KV events' if events is not None else ''}{role})"
        )
        await runtime.wait_for_shutdown()
        log.info("shutting down: unregistering, then up to %.0fs for requests in flight", grace_s)
        return 0
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await _shut_down(runtime, endpoint, started, events, grace_s, closing)
        if metrics is not None:
            await metrics.close()
        if fetcher is not None:
            await fetcher.close()


async def follow_leader(cfg: WorkerConfig, name: EndpointName, start: EngineStarter) -> int:
    """A rank > 0 of a replica over several nodes: its engine joins the leader's rendezvous and
    works on the leader's requests; it registers nothing (the leader serves for the replica) and
    runs until SIGINT/SIGTERM. It logs FOLLOWING as it starts the engine, whose start may only
    return once every rank has joined, or never (the rank's work loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    e = cfg.engine
    console.print(
        f"[bold green]dyngraph[/] worker {name} node rank {e.node_rank} of {e.num_nodes} "
        f"{FOLLOWING} {e.leader_addr}"
    )
    starting = asyncio.ensure_future(start(0, _no_hook))
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if starting.done():
            started = starting.result()  # raises what the engine raised
            try:
                await stopping
            finally:
                await started.engine.cleanup()
        return 0
    finally:
        stopping.cancel()
        starting.cancel()  # a start still running cleans its engine up as it ends
        with contextlib.suppress(BaseException):
            await starting
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


async def _no_hook(engine: LLMEngine) -> None:
    """A follower publishes no KV events (the leader's engine does, for the replica)."""


async def _serve_lora_adapters(
    cfg: WorkerConfig,
    runtime: DistributedRuntime,
    name: EndpointName,
    engine: LLMEngine,
    endpoint: Endpoint,
    card: ModelDeploymentCard,
) -> None:
    """Load the adapters of --lora-modules, and take load/unload requests on the `lora` endpoint
    (a static worker has no discovery to publish adapter cards in: it serves none)."""
    if runtime.discovery is None:
        if cfg.engine.lora_modules:
            raise RunConfigError("--lora-modules needs discovery (adapter cards); not with --static-worker")
        return
    manager = LoraManager(engine, card, discovery_publisher(endpoint))
    await manager.load_declared(cfg.engine.lora_modules)
    control = runtime.namespace(name.namespace).component(name.component).endpoint(LORA_ENDPOINT)
    await control.start_serving(lora_handler(manager))


def check_disaggregation(engine: LLMEngine, config: EngineConfig, mode: str) -> None:
    """A prefill or decode worker needs an engine that hands KV over, and token ids (the frontend
    routes the two halves of a request by its tokens)."""
    if isinstance(engine, EmbeddingEngine):
        raise RunConfigError(f"--disaggregation-mode {mode}: an embedding worker has no prefill/decode split")
    if config.model_input != "tokens":
        raise RunConfigError(
            f"--disaggregation-mode {mode}: {type(engine).__name__} takes text; disaggregation needs a "
            "tokens-input engine"
        )
    if not engine.kv_transfer:
        raise RunConfigError(
            f"--disaggregation-mode {mode}: {type(engine).__name__} cannot hand a prompt's KV cache "
            "over (engines that can: mocker, llamacpp)"
        )


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


async def _kv_event_publisher(runtime: DistributedRuntime, name: EndpointName) -> KvEventPublisher | None:
    """The engine's KV events and load on the event plane, on the endpoint's channel. A static
    worker has no discovery for zmq to announce its socket in: it publishes only over NATS. zmq
    binds and announces the request plane's addresses (DYN_TCP_HOST / DYN_TCP_ADVERTISE_HOST), so
    a kv router on another host reaches a worker whose graph gives it its host's address."""
    from dynamo_graph.router.kv.publisher import KvEventPublisher
    from dynamo_graph.runtime.events import create_event_publisher, event_plane_kind

    kind = event_plane_kind()
    if runtime.discovery is None and kind == "zmq":
        log.warning("a static worker cannot announce zmq KV events (no discovery): kv routers will predict")
        return None
    try:
        publisher = await create_event_publisher(
            kind,
            discovery=runtime.discovery,
            namespace=name.namespace,
            component=name.component,
            publisher_id=runtime.instance_id,
        )
    except ValueError as e:  # an address setting the zmq plane cannot bind
        raise RunConfigError(f"KV events: {e}") from None
    return KvEventPublisher(publisher, runtime.instance_id)
