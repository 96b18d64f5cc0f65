"""`dyngraph run`: build the engine and the model pipeline, then drive the chosen input.

This is where model resolution, the engine and pre/post-processing meet for one process.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from contextlib import suppress

from rich.console import Console

from dynamo_graph.backend.engine import EngineConfig, LLMEngine
from dynamo_graph.engines import create_engine, default_engine, get_engine_spec
from dynamo_graph.inputs.config import RunConfig, RunConfigError
from dynamo_graph.llm.card import ModelDeploymentCard
from dynamo_graph.llm.model_source import LocalModel, resolve_model
from dynamo_graph.llm.pipeline import ModelPipeline, TextPipeline, tokens_pipeline

log = logging.getLogger(__name__)
console = Console(stderr=True)

# Flags that configure parts this process does not have with one in-process engine.
_DISTRIBUTED_FLAGS = {
    "router_mode": "--router-mode",
    "kv_overlap_score_weight": "--kv-overlap-score-weight",
    "router_temperature": "--router-temperature",
    "use_kv_events": "--use-kv-events",
    "migration_limit": "--migration-limit",
    "static_worker": "--static-worker",
}
_ENGINE_FLAGS = {
    "tensor_parallel_size": "--tensor-parallel-size",
    "num_nodes": "--num-nodes",
    "node_rank": "--node-rank",
    "leader_addr": "--leader-addr",
    "base_gpu_id": "--base-gpu-id",
    "extra_engine_args": "--extra-engine-args",
}


def _warn_unused_flags(cfg: RunConfig, engine_name: str) -> None:
    """Say which given flags have no effect here, instead of dropping them silently."""
    unused = [flag for key, flag in _DISTRIBUTED_FLAGS.items() if key in cfg.explicit]
    if engine_name.startswith("echo"):
        unused += [flag for key, flag in _ENGINE_FLAGS.items() if key in cfg.explicit]
    if unused:
        log.warning(
            "%s: no effect with in=%s out=%s (one in-process engine, no router)",
            ", ".join(unused),
            cfg.input,
            engine_name,
        )


def _tokens_card(cfg: RunConfig, engine_config: EngineConfig, model: LocalModel) -> ModelDeploymentCard:
    return ModelDeploymentCard.from_local_model(
        model,
        model_input="tokens",
        context_length=cfg.context_length or engine_config.context_length or model.context_length,
        kv_cache_block_size=cfg.kv_cache_block_size or engine_config.kv_cache_block_size or 16,
        migration_limit=cfg.migration_limit,
    )


async def build_pipeline(cfg: RunConfig) -> tuple[ModelPipeline, LLMEngine]:
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
        model = resolve_model(cfg.model_path, model_config=cfg.model_config, model_name=cfg.model_name)
    engine = create_engine(engine_name)
    try:
        engine_config = await engine.start()
        if engine_config.model_input == "tokens":
            assert model is not None
            pipeline: ModelPipeline = tokens_pipeline(_tokens_card(cfg, engine_config, model), model, engine)
        else:
            context_length = cfg.context_length or engine_config.context_length
            if model is not None:
                card = ModelDeploymentCard.from_local_model(
                    model, model_input="text", context_length=context_length
                )
            else:
                card = ModelDeploymentCard.without_files(
                    cfg.model_name or engine_name, context_length=context_length
                )
            pipeline = TextPipeline(card, engine)
    except BaseException:
        await engine.cleanup()
        raise
    return pipeline, engine


async def _wait_for_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def _serve_http(cfg: RunConfig, pipeline: ModelPipeline) -> None:
    from dynamo_graph.frontend.app import FrontendApp, make_server
    from dynamo_graph.frontend.models import ModelRegistry

    registry = ModelRegistry()
    registry.add(pipeline)
    server = make_server(FrontendApp(registry), cfg.http_host, cfg.http_port)
    console.print(
        f"[bold green]dyngraph[/] serving model [bold]{pipeline.name}[/] on "
        f"http://{cfg.http_host}:{cfg.http_port}/v1 (Ctrl-C to stop)"
    )
    await server.serve()


async def run_async(cfg: RunConfig) -> int:
    if cfg.input == "dyn":
        raise RunConfigError(
            f"in={cfg.input_arg}: serving as a distributed worker needs the distributed "
            "runtime, which this version of dyngraph does not have yet"
        )
    pipeline, engine = await build_pipeline(cfg)
    # As dynamo-run does: the echo engines would otherwise stop at the template's own eos token.
    echo = (cfg.output or "").startswith("echo")
    try:
        if cfg.input == "http":
            await _serve_http(cfg, pipeline)
            return 0
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
    finally:
        with suppress(Exception):
            await engine.cleanup()


def run(cfg: RunConfig) -> int:
    try:
        import uvloop

        return uvloop.run(run_async(cfg))
    except ImportError:
        return asyncio.run(run_async(cfg))
