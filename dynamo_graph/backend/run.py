"""`backend.run(MyEngine)`: serve a custom `LLMEngine` as a worker, the way dynamo-run serves its own.

A custom engine file ends with

    if __name__ == "__main__":
        run(MyEngine)

and is started like any worker:

    python my_engine.py in=dyn://ns.comp.ep --model-path MODEL [dynamo-run flags] [-- engine args]
    python my_engine.py --endpoint dyn://ns.comp.ep MODEL       # Dynamo's worker spelling

`run` parses the command line with `MyEngine.from_args(argv)` (the default reads dynamo-run's
flags with the same parser as `dyngraph run` and calls `from_config`), then hands the engine
to the very code that serves `dyngraph run in=dyn://... out=ENGINE` (backend/worker.py,
`serve_engine`): the runtime and its lease, signals, the KV event publisher (connected before
`start()` for engines with `publishes_kv_events`), `start(worker_id=instance id)`, the model
card (with the engine's health-check payload in `user_data.health_check_payload`; with
DYN_HEALTH_CHECK_ENABLED=1 the request is run once before registering), serving with
finish-reason normalisation and cancellation monitoring (a stopped context reaches
`engine.abort(context)` at once), and graceful shutdown on SIGINT/SIGTERM: unregister, drain
within the grace period, close the runtime, `cleanup()`.

Errors: an engine raises `backend.errors` types (`InvalidArgument` -> HTTP 400, `ModelNotFound`
-> 404, `EngineOverloaded` / `EngineShutdown` -> 503, any other `EngineError` or exception ->
500); the code travels on the request plane's error frame and the frontend answers with that
status and an OpenAI error body. A command line or model that cannot be used exits with code 2
and one line on stderr, as `dyngraph run` does.
"""

from __future__ import annotations

import asyncio
import sys
import types
from collections.abc import Sequence
from typing import NoReturn

from dynamo_graph.backend.command_line import WorkerConfig
from dynamo_graph.backend.engine import LLMEngine


async def serve(engine: LLMEngine, worker: WorkerConfig) -> int:
    """Serve an engine that is built but not started; returns the exit code once shut down."""
    from dynamo_graph.backend.command_line import apply_planes
    from dynamo_graph.backend.worker import StartedEngine, serve_engine, start_built_engine
    from dynamo_graph.runtime.names import EndpointName

    apply_planes(worker.planes)
    name = EndpointName.parse(worker.endpoint)

    async def start(worker_id: int, before_start) -> StartedEngine:  # type: ignore[no-untyped-def]
        return await start_built_engine(
            engine,
            worker,
            worker.model,
            engine_name=type(engine).__name__,
            worker_id=worker_id,
            before_start=before_start,
        )

    return await serve_engine(worker, name, start)


async def run_async(engine_class: type[LLMEngine], argv: Sequence[str] | None = None) -> int:
    """`run` without leaving the process: parse, serve, return the exit code."""
    from dynamo_graph.backend.command_line import fail
    from dynamo_graph.backend.settings import RunConfigError
    from dynamo_graph.llm.model_source import ModelResolutionError
    from dynamo_graph.log import LogSpecError, setup_logging

    try:
        engine, worker = engine_class.from_args(argv)
    except (RunConfigError, ModelResolutionError) as err:
        return fail(str(err))
    try:
        setup_logging(worker.verbosity)
    except LogSpecError as err:
        return fail(str(err))
    try:
        return await serve(engine, worker)
    except (RunConfigError, ModelResolutionError) as err:
        return fail(str(err))


def run(engine_class: type[LLMEngine], argv: Sequence[str] | None = None) -> NoReturn:
    """The entry point of a custom engine file: serve `engine_class` as a worker until
    SIGINT/SIGTERM, then exit (code 0; 2 for a bad command line; 130 on a second Ctrl-C)."""
    try:
        import uvloop
    except ImportError:
        uvloop = None  # type: ignore[assignment]
    try:
        if uvloop is not None:
            code = uvloop.run(run_async(engine_class, argv))
        else:
            code = asyncio.run(run_async(engine_class, argv))
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)


class _CallableModule(types.ModuleType):
    """`dynamo_graph.backend.run(MyEngine)` works whether `run` is reached as this module (as
    `from dynamo_graph.backend import run` gives it) or as the function in it."""

    def __call__(self, engine_class: type[LLMEngine], argv: Sequence[str] | None = None) -> NoReturn:
        run(engine_class, argv)


sys.modules[__name__].__class__ = _CallableModule
