"""`dyngraph run`: build the engine and the model pipeline, then drive the chosen input.

This is where model resolution, the engine and pre/post-processing meet for one process.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from contextlib import suppress
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from rich.console import Console

from dynamo_graph.backend.engine import EngineConfig, LLMEngine
from dynamo_graph.backend.settings import RunConfigError
from dynamo_graph.backend.worker import (
    StartedEngine,
    make_card,
    serve_engine,
    shutdown_grace_from_env,
    start_built_engine,
)
from dynamo_graph.engines import create_engine, default_engine, get_engine_spec
from dynamo_graph.llm.model_source import resolve_model
from dynamo_graph.options import flagged, given_fields
from dynamo_graph.process.run_config import RUN_OPTIONS, RunConfig, apply_runtime_settings
from dynamo_graph.router.config import DisaggConfig, RouterConfig
from dynamo_graph.runtime import tracing
from dynamo_graph.runtime.names import EndpointName
from dynamo_graph.runtime.settings import TracingSettings

if TYPE_CHECKING:
    from dynamo_graph.frontend.app import FrontendApp
    from dynamo_graph.frontend.lora import AdapterAdmin
    from dynamo_graph.frontend.models import ModelRegistry
    from dynamo_graph.llm.embeddings import EmbeddingPipeline
    from dynamo_graph.llm.pipeline import ModelPipeline

log = logging.getLogger(__name__)
WAIT_FOR_MODEL_S = 60.0
SETTLE_S = 10.0  # a frontend builds the models discovery lists before it joins its port, this long at most
console = Console(stderr=True, soft_wrap=True)

# Settings of a worker (in=dyn://) that an in-process engine has no use for.
_WORKER_ONLY = ("migration_limit", "static_worker", "disaggregation_mode")
# The engine's parallelism, which the echo engines ignore.
_PARALLELISM = (
    "tensor_parallel_size",
    "num_nodes",
    "node_rank",
    "leader_addr",
    "base_gpu_id",
    "extra_engine_args",
)
# The HTTP frontend's own: nothing to apply them to without in=http.
_HTTP_ONLY = (
    "http_body_limit_mb",
    "max_concurrent_requests",
    "request_timeout_s",
    "api_key",
    "api_keys_file",
    "http_processes",
)


def _warn_unused_flags(cfg: RunConfig, engine_name: str) -> None:
    """Say which given flags have no effect here, instead of dropping them silently."""
    flags = {opt.param: opt.flag for opt in RUN_OPTIONS}
    unused = [opt.param for opt in flagged(RouterConfig, DisaggConfig)]
    if cfg.input != "dyn":
        unused += _WORKER_ONLY
    if engine_name.startswith("echo"):
        unused += _PARALLELISM
    if cfg.input != "http":
        unused += _HTTP_ONLY
    given = [flags[param] for param in flags if param in unused and param in cfg.explicit]
    if given:
        log.warning(
            "%s: no effect with in=%s out=%s (no router in this process)",
            ", ".join(str(flag) for flag in given),
            cfg.input,
            engine_name,
        )


async def start_engine(
    cfg: RunConfig,
    *,
    worker_id: int = 0,
    before_start: Callable[[LLMEngine], Awaitable[None]] | None = None,
) -> StartedEngine:
    """Build the engine for `cfg` and start it. `before_start` connects what the serving process
    provides (e.g. the KV event sink) once the engine exists."""
    engine_name = cfg.output or default_engine()
    spec = get_engine_spec(engine_name)
    if spec.needs_model and not cfg.model_path:
        raise RunConfigError(
            f"out={engine_name} needs a model for its tokenizer and chat template: "
            "pass --model-path DIR|FILE.gguf|org/name or a positional MODEL"
        )
    _warn_unused_flags(cfg, engine_name)
    model = None
    if cfg.model_path:
        model = resolve_model(
            cfg.model_path, model_config=cfg.engine.model_config, model_name=cfg.engine.model_name
        )
    engine = create_engine(engine_name, cfg.engine, model)
    worker = cfg.worker_config(cfg.input_arg or "")
    return await start_built_engine(
        engine, worker, model, engine_name=engine_name, worker_id=worker_id, before_start=before_start
    )


async def serve_worker(cfg: RunConfig, name: EndpointName) -> int:
    """`dyngraph run in=dyn://... out=ENGINE`: build the engine named by `out=` and serve it as
    `backend.run` serves a custom one."""

    async def start(worker_id: int, before_start: Callable[[LLMEngine], Awaitable[None]]) -> StartedEngine:
        return await start_engine(cfg, worker_id=worker_id, before_start=before_start)

    return await serve_engine(cfg.worker_config(str(name)), name, start)


async def _wait_for_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def frontend_app(cfg: RunConfig, registry: ModelRegistry, lora: AdapterAdmin | None = None) -> FrontendApp:
    """The HTTP frontend with `cfg`'s limits and API keys (flag, DYN_API_KEY, DYN_API_KEY_ENV,
    the keys file of tenants), and with `lora`, the LoRA adapter routes."""
    from dynamo_graph.frontend.app import FrontendApp
    from dynamo_graph.frontend.auth import ApiKeys, keys_from_settings
    from dynamo_graph.frontend.limits import FrontendLimits
    from dynamo_graph.frontend.record import Recorder
    from dynamo_graph.frontend.tenants import KeysFileError, Tenants

    limits = FrontendLimits.from_settings(
        body_limit_mb=cfg.limits.body_limit_mb,
        max_concurrent=cfg.limits.max_concurrent_requests,
        request_timeout_s=cfg.limits.request_timeout_s,
        model_wait_s=cfg.limits.model_wait_s,
        unknown_fields=cfg.limits.unknown_fields,
    )
    try:
        keys = ApiKeys(keys_from_settings(cfg.http.api_key))
    except ValueError as err:
        raise RunConfigError(str(err)) from None
    tenants = None
    if cfg.auth.keys_file is not None:
        try:
            tenants = Tenants(cfg.auth.keys_file)
        except KeysFileError as err:
            raise RunConfigError(str(err)) from None
    return FrontendApp(
        registry,
        limits=limits,
        api_keys=keys,
        tenants=tenants,
        lora=lora,
        recorder=Recorder.open(cfg.record),
        stream_interval=cfg.http.stream_interval,
    )


async def _serve_http(cfg: RunConfig, registry: ModelRegistry, lora: AdapterAdmin | None = None) -> None:
    from dynamo_graph.frontend.group import membership
    from dynamo_graph.frontend.server import SHUTDOWN_GRACE_S, listen, make_server
    from dynamo_graph.frontend.settings import GROUP_ENV

    app = frontend_app(cfg, registry, lora)
    try:
        sockets = listen(cfg.http.host, cfg.http.port)
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            raise RunConfigError(
                f"port {cfg.http.port} on {cfg.http.host} is already in use: stop what listens there, "
                "or serve on another port with --http-port PORT"
            ) from None
        raise RunConfigError(f"cannot listen on {cfg.http.host}:{cfg.http.port}: {err}") from None
    # In-flight requests get DYN_SHUTDOWN_GRACE_S, as a worker's do, on SIGTERM.
    server = make_server(app, grace_s=shutdown_grace_from_env(SHUTDOWN_GRACE_S), tls=cfg.http_tls)
    names = ", ".join(registry.names()) or "models as workers appear"
    auth = "API key required" if app.guarded else "no API key"
    scheme = "https" if cfg.http_tls.cert_file else "http"
    console.print(
        f"[bold green]dyngraph[/] serving {names} on {scheme}://{cfg.http.host}:{cfg.http.port}/v1"
        f" ({auth}; Ctrl-C to stop)"
    )
    if not app.guarded and cfg.http.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning(
            "serving on %s without an API key: anyone who can reach it may use it (--api-key, DYN_API_KEY)",
            cfg.http.host,
        )
    try:
        async with membership(os.environ.get(GROUP_ENV) or None, app.metrics.registry) as group:
            app.metrics.group = group
            await _serve_with_keys_file(app, server, sockets)
    finally:
        if app.recorder is not None:
            app.recorder.close()


async def _serve_with_keys_file(app: FrontendApp, server: Any, sockets: Any) -> None:
    """Serve; with a keys file, reload it when it changes and on SIGHUP (requests in flight go on)."""
    if app.tenants is None:
        await server.serve(sockets)
        return
    watcher = asyncio.create_task(app.tenants.watch(), name="keys file")
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGHUP, app.tenants.reload_soon)
    try:
        await server.serve(sockets)
    finally:
        loop.remove_signal_handler(signal.SIGHUP)
        watcher.cancel()


async def _drive_input(cfg: RunConfig, pipeline: ModelPipeline | EmbeddingPipeline, *, echo: bool) -> int:
    """Run a non-HTTP input against one model's pipeline."""
    if "embedding" in pipeline.card.model_type:
        raise RunConfigError(
            f"model {pipeline.name!r} computes embeddings: serve it with in=http (POST /v1/embeddings), "
            f"not in={cfg.input}"
        )
    if cfg.input == "none":
        console.print(f"engine {cfg.output} ready for model {pipeline.name}; waiting for a signal")
        await _wait_for_signal()
        return 0
    if cfg.input == "batch":
        from dynamo_graph.inputs.batch import run_batch

        assert cfg.input_arg is not None
        return await run_batch(pipeline, cfg.input_arg, ignore_eos=echo)
    if cfg.input == "stdin":
        from dynamo_graph.inputs.stdin import run_stdin

        return await run_stdin(pipeline, sys.stdin.read(), ignore_eos=echo)
    from dynamo_graph.inputs.text import run_text

    return await run_text(pipeline, ignore_eos=echo)


async def _first_model(registry: ModelRegistry, timeout_s: float) -> ModelPipeline | EmbeddingPipeline:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not registry.names():
        if asyncio.get_running_loop().time() > deadline:
            raise RunConfigError(f"no model was registered by any worker within {timeout_s:.0f}s")
        await asyncio.sleep(0.05)
    pipeline = registry.get(registry.names()[0])
    assert pipeline is not None
    return pipeline


def _static_addresses() -> list[str]:
    raw = os.environ.get("DYN_STATIC_WORKERS") or ""
    addresses = [a.strip() for a in raw.split(",") if a.strip()]
    if not addresses:
        raise RunConfigError(
            "a static frontend (out=dyn://... with --model-path) needs the workers' "
            "addresses: DYN_STATIC_WORKERS=host:port[,host:port...]"
        )
    return addresses


async def _static_frontend(cfg: RunConfig, name: EndpointName) -> int:
    """No discovery: the model comes from --model-path (a Backend-type model) and the workers
    from DYN_STATIC_WORKERS; requests go round the listed addresses (or, with --router-mode kv,
    where the router predicts their prefix is cached: give --kv-cache-block-size as the workers')."""
    from dynamo_graph.frontend.metrics import count_migration
    from dynamo_graph.frontend.models import ModelRegistry
    from dynamo_graph.frontend.remote import KvRoutedTokensBackend, RemoteTokensBackend
    from dynamo_graph.frontend.router_metrics import ROUTERS
    from dynamo_graph.llm.pipeline import tokens_pipeline
    from dynamo_graph.router.decisions import DecisionLog
    from dynamo_graph.router.kv.router import KvRouter
    from dynamo_graph.router.migration import Migration
    from dynamo_graph.runtime.client import Client
    from dynamo_graph.runtime.health import HealthChecker, HealthSettings, default_payload
    from dynamo_graph.runtime.runtime import DistributedRuntime, InstanceRecord, static_subject

    addresses = _static_addresses()
    assert cfg.model_path is not None
    model = resolve_model(
        cfg.model_path, model_config=cfg.engine.model_config, model_name=cfg.engine.model_name
    )
    card = make_card(cfg.worker_config(str(name)), "static", EngineConfig(model_input="tokens"), model)
    runtime = await DistributedRuntime.create(static=True)
    kv = cfg.router.mode == "kv"
    client = Client(runtime, name, router_mode="round-robin" if kv else cfg.router.mode)
    for index, address in enumerate(addresses, start=1):
        client.add_static(
            InstanceRecord(
                namespace=name.namespace,
                component=name.component,
                endpoint=name.endpoint,
                instance_id=index,
                transport={"tcp": address},
                subject=static_subject(name),
            )
        )
    registry = ModelRegistry()
    decision_log = DecisionLog.open(cfg.router)
    decisions = None if decision_log is None else decision_log.pool(card.display_name, False, kv)
    backend: RemoteTokensBackend | KvRoutedTokensBackend = RemoteTokensBackend(client, decisions)
    if kv:
        # No discovery, so no event plane to hear KV events on: the router predicts caches.
        router = KvRouter(card.kv_cache_block_size, replace(cfg.router, use_kv_events=False))
        ROUTERS.add(card.display_name, "decode", router)
        backend = KvRoutedTokensBackend(client, router, decisions)
    migrating = Migration(
        backend, cfg.worker.migration_limit, model=card.display_name, on_migrate=count_migration
    )
    registry.add(tokens_pipeline(card, model, migrating), instances=client.health_report)
    # Discovery cannot vouch for static workers: health checks are all that notices a wedged one.
    checker = HealthChecker(
        client, HealthSettings.from_env(), default_payload(card.display_name, "tokens", card.bos_token_id)
    )
    checker.start()
    try:
        if cfg.input == "http":
            await _serve_http(cfg, registry)
            return 0
        pipeline = registry.get(card.display_name)
        assert pipeline is not None
        return await _drive_input(cfg, pipeline, echo=False)
    finally:
        await checker.close()
        await runtime.close()
        if decision_log is not None:
            decision_log.close()


async def _run_frontend(cfg: RunConfig) -> int:
    """`out=auto` / `out=dyn://ns.comp.ep`: serve the models that workers register, or with
    --model-path, the static workers of that endpoint."""
    from dynamo_graph.frontend.lora import LoraAdmin
    from dynamo_graph.frontend.model_watcher import ModelWatcher
    from dynamo_graph.frontend.models import ModelRegistry
    from dynamo_graph.runtime.runtime import DistributedRuntime

    only = EndpointName.parse(cfg.output) if cfg.output and cfg.output.startswith("dyn://") else None
    if only is not None and cfg.model_path:
        return await _static_frontend(cfg, only)
    runtime = await DistributedRuntime.create()
    registry = ModelRegistry()
    watcher = ModelWatcher(
        runtime,
        registry,
        router_mode=cfg.router.mode,
        kv_config=cfg.router,
        only_endpoint=only,
        # The frontend's --migration-limit wins when given; else each worker's card says.
        migration_limit=cfg.worker.migration_limit if "migration_limit" in cfg.explicit else None,
        disagg=cfg.disagg,
        model_wait_s=cfg.limits.model_wait_s,
    )
    watch = asyncio.create_task(watcher.run(), name="model watcher")
    lora = LoraAdmin(watcher)
    try:
        if cfg.input == "http":
            await watcher.settled(SETTLE_S)
            await _serve_http(cfg, registry, lora)
            return 0
        return await _drive_input(cfg, await _first_model(registry, WAIT_FOR_MODEL_S), echo=False)
    finally:
        watch.cancel()
        with suppress(asyncio.CancelledError):
            await watch
        await lora.close()
        await watcher.close()
        await runtime.close()


async def run_async(cfg: RunConfig) -> int:
    """Run the process `cfg` describes, traced where the OTEL_* environment (or the tracing
    flags, written there first) asks: a worker, a frontend of workers, or one process with its
    engine inside."""
    cfg.tracing.to_env(given_fields(TracingSettings, cfg.explicit))
    if cfg.input == "dyn" or cfg.discovers_workers:
        apply_runtime_settings(cfg)
    if cfg.input == "dyn":
        assert cfg.input_arg is not None
        name = EndpointName.parse(cfg.input_arg)
        service = f"{name.namespace}.{name.component}"
    else:
        service = "frontend" if cfg.discovers_workers else "dyngraph"
    tracing.setup(service)
    try:
        if cfg.input == "dyn":
            return await serve_worker(cfg, name)
        if cfg.discovers_workers:
            return await _run_frontend(cfg)
        return await _run_local(cfg)
    finally:
        tracing.shutdown()


async def _run_local(cfg: RunConfig) -> int:
    """`out=ENGINE`: the engine in this process, behind the input (`in=http`: the frontend)."""
    started = await start_engine(cfg)
    pipeline = started.pipeline()
    # As dynamo-run does: the echo engines would otherwise stop at the template's own eos token.
    echo = (cfg.output or "").startswith("echo")
    try:
        if cfg.input == "http":
            from dynamo_graph.frontend.models import ModelRegistry
            from dynamo_graph.inputs.lora_local import LocalLoraAdmin

            registry = ModelRegistry()
            registry.add(pipeline)
            lora = LocalLoraAdmin(started, registry)
            await lora.load_declared(cfg.engine.lora_modules)
            await _serve_http(cfg, registry, lora)
            return 0
        return await _drive_input(cfg, pipeline, echo=echo)
    finally:
        with suppress(Exception):
            await started.engine.cleanup()


def run(cfg: RunConfig) -> int:
    from dynamo_graph.frontend.settings import GROUP_ENV

    if cfg.input == "http" and cfg.http.processes > 1 and GROUP_ENV not in os.environ:
        from dynamo_graph.process.http_group import run_group

        return run_group(cfg)
    try:
        import uvloop

        return uvloop.run(run_async(cfg))
    except ImportError:
        return asyncio.run(run_async(cfg))
