"""`dyngraph run` itself, and a fast path to it that does not load typer.

Every process of a graph is a `dyngraph run ...` whose command line the compiler wrote: plain
`--flag VALUE` options. Typer (with pydantic, which it builds a validator per option with) costs
~0.15 s of CPU per process start, so `python -m dynamo_graph run ...` parses such a command line
here (`parse_fast`); anything it is not sure of (`--help`, an unknown or malformed option, a
value that is not a plain number where one is expected) goes to typer as before, so errors and
help read the same. tests/unit/test_cli_fast_run.py checks RUN_OPTIONS against the typer command.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

# flag -> (parameter name, type); the typer signature of `run_command` in cli/main.py.
RUN_OPTIONS: dict[str, tuple[str, type]] = {
    "--model-path": ("model_path", str),
    "--model-name": ("model_name", str),
    "--model-config": ("model_config", str),
    "--http-host": ("http_host", str),
    "--http-port": ("http_port", int),
    "--http-body-limit-mb": ("http_body_limit_mb", float),
    "--max-concurrent-requests": ("max_concurrent_requests", int),
    "--request-timeout-s": ("request_timeout_s", float),
    "--api-key": ("api_key", str),
    "--context-length": ("context_length", int),
    "--kv-cache-block-size": ("kv_cache_block_size", int),
    "--tensor-parallel-size": ("tensor_parallel_size", int),
    "--num-nodes": ("num_nodes", int),
    "--node-rank": ("node_rank", int),
    "--leader-addr": ("leader_addr", str),
    "--base-gpu-id": ("base_gpu_id", int),
    "--extra-engine-args": ("extra_engine_args", Path),
    "--router-mode": ("router_mode", str),
    "--kv-overlap-score-weight": ("kv_overlap_score_weight", float),
    "--router-temperature": ("router_temperature", float),
    "--use-kv-events": ("use_kv_events", str),
    "--migration-limit": ("migration_limit", int),
    "--health-check-interval-s": ("health_check_interval_s", float),
    "--health-check-timeout-s": ("health_check_timeout_s", float),
    "--max-inflight": ("max_inflight", int),
    "--discovery-backend": ("discovery_backend", str),
    "--request-plane": ("request_plane", str),
    "--event-plane": ("event_plane", str),
    "--dyn-tool-call-parser": ("dyn_tool_call_parser", str),
    "--dyn-reasoning-parser": ("dyn_reasoning_parser", str),
}
RUN_FLAGS = {"--static-worker": "static_worker"}  # boolean flags
RUN_DEFAULTS: dict[str, Any] = {
    "model_path": None,
    "model_name": None,
    "model_config": None,
    "http_host": "127.0.0.1",
    "http_port": 8080,
    "http_body_limit_mb": None,
    "max_concurrent_requests": 1024,
    "request_timeout_s": None,
    "api_key": None,
    "context_length": None,
    "kv_cache_block_size": None,
    "tensor_parallel_size": 1,
    "num_nodes": 1,
    "node_rank": 0,
    "leader_addr": None,
    "base_gpu_id": 0,
    "extra_engine_args": None,
    "router_mode": "round-robin",
    "kv_overlap_score_weight": 1.0,
    "router_temperature": 0.0,
    "use_kv_events": "true",
    "migration_limit": 0,
    "health_check_interval_s": None,
    "health_check_timeout_s": None,
    "max_inflight": 1024,
    "static_worker": False,
    "discovery_backend": None,
    "request_plane": None,
    "event_plane": None,
    "dyn_tool_call_parser": None,
    "dyn_reasoning_parser": None,
    "verbose": 0,
}
_INT = re.compile(r"-?[0-9]+")
_FLOAT = re.compile(r"-?[0-9]+(\.[0-9]+)?")
_VERBOSE = re.compile(r"-v+")

BOOL_WORDS = {
    "true": True,
    "1": True,
    "yes": True,
    "on": True,
    "false": False,
    "0": False,
    "no": False,
    "off": False,
}


def _convert(kind: type, value: str) -> Any:
    """The value as typer would give it, or None where typer's answer is not this simple."""
    if value.startswith("-") and kind is not int and kind is not float:
        return None
    if kind is int:
        return int(value) if _INT.fullmatch(value) else None
    if kind is float:
        return float(value) if _FLOAT.fullmatch(value) else None
    return Path(value) if kind is Path else value


def parse_fast(args: list[str]) -> tuple[list[str], dict[str, Any], set[str]] | None:
    """`run`'s arguments as (words, parameters, names given explicitly), or None for typer.
    Arguments after `--` go to the engine, as `engine_argv` in the parameters."""
    words: list[str] = []
    params = dict(RUN_DEFAULTS)
    explicit: set[str] = set()
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg == "--":  # the rest is the engine's own (a python engine file's sys.argv)
            params["engine_argv"] = args[i:]
            break
        if not arg.startswith("-"):
            words.append(arg)
            explicit.add("words")
        elif arg in RUN_FLAGS:
            params[RUN_FLAGS[arg]] = True
            explicit.add(RUN_FLAGS[arg])
        elif arg == "--verbose" or _VERBOSE.fullmatch(arg):
            params["verbose"] += 1 if arg == "--verbose" else len(arg) - 1
            explicit.add("verbose")
        else:
            flag, sep, value = arg.partition("=")
            if flag not in RUN_OPTIONS:
                return None  # --help, an unknown option, `--`, ...
            if not sep:
                if i >= len(args):
                    return None
                value = args[i]
                i += 1
            name, kind = RUN_OPTIONS[flag]
            converted = _convert(kind, value)
            if converted is None:
                return None
            params[name] = converted
            explicit.add(name)
    return words, params, explicit


def fail(message: str) -> int:
    """Print an error as the CLI does; returns the usage-error exit code. The message is plain
    text: `pip install 'dyngraph[vllm]'` must not be read as rich markup."""
    from rich.console import Console
    from rich.markup import escape

    Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {escape(message)}", highlight=False)
    return 2


def execute(words: list[str] | None, params: dict[str, Any], explicit: set[str]) -> int:
    """Run `dyngraph run` with parsed arguments; returns the exit code."""
    from dynamo_graph.engines import UnknownEngineError
    from dynamo_graph.inputs.config import RunConfigError, run_config_from_args, validate
    from dynamo_graph.inputs.launch import run
    from dynamo_graph.llm.model_source import ModelResolutionError
    from dynamo_graph.log import LogSpecError, setup_logging

    params = dict(params)
    engine_argv = params.pop("engine_argv", ())
    try:
        setup_logging(params["verbose"])
    except LogSpecError as e:
        return fail(str(e))
    try:
        cfg, input_given = run_config_from_args(words, params, explicit, engine_argv=engine_argv)
        if cfg.input == "text" and not sys.stdin.isatty():
            # dynamo-run: a piped prompt is answered once, then the process exits.
            cfg.input = "stdin"
        if not input_given and not cfg.output and not cfg.model_path:
            raise RunConfigError("nothing to run: give a MODEL, out=ENGINE, or both (see --help)")
        validate(cfg)
        return run(cfg)
    except (RunConfigError, UnknownEngineError, ModelResolutionError) as e:
        return fail(str(e))
    except KeyboardInterrupt:
        return 130


def main_fast(args: list[str]) -> int | None:
    """`dyngraph run ARGS` without typer; None when typer must parse ARGS."""
    parsed = parse_fast(args)
    if parsed is None:
        return None
    words, params, explicit = parsed
    return execute(words, params, explicit)
