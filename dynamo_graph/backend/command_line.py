"""dynamo-run's command line as data: its flags, their defaults, and a parser that needs no typer.

Every worker (`dyngraph run in=dyn://...` and `backend.run(MyEngine)` alike) and every process a
graph compiles to is started with this command line, so its table lives with the worker, below
the CLI. Typer (with pydantic, which it builds a validator per option with) costs ~0.15 s of CPU
per process start: `parse_fast` reads plain `--flag VALUE` command lines itself and returns None
for anything it is not sure of (`--help`, an unknown or malformed option, a value that is not a
plain number where one is expected), which the CLI then hands to typer, so errors and help read
the same. tests/unit/test_cli_fast_run.py checks the table against the typer command.
"""

from __future__ import annotations

import re
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
    "--router-cost": ("router_cost", str),
    "--router-session-affinity-ttl-secs": ("router_session_affinity_ttl_secs", float),
    "--router-session-affinity-mode": ("router_session_affinity_mode", str),
    "--router-queue-threshold": ("router_queue_threshold", float),
    "--router-queue-policy": ("router_queue_policy", str),
    "--router-max-queue-size": ("router_max_queue_size", int),
    "--router-queue-reserve": ("router_queue_reserve", int),
    "--migration-limit": ("migration_limit", int),
    "--health-check-interval-s": ("health_check_interval_s", float),
    "--health-check-timeout-s": ("health_check_timeout_s", float),
    "--max-inflight": ("max_inflight", int),
    "--disaggregation-mode": ("disaggregation_mode", str),
    "--max-local-prefill-length": ("max_local_prefill_length", int),
    "--dyn-tool-call-parser": ("dyn_tool_call_parser", str),
    "--dyn-reasoning-parser": ("dyn_reasoning_parser", str),
    "--lora-modules": ("lora_modules", str),
    "--discovery-backend": ("discovery_backend", str),
    "--request-plane": ("request_plane", str),
    "--event-plane": ("event_plane", str),
}
RUN_FLAGS = {  # boolean flags
    "--static-worker": "static_worker",
    "--is-prefill-worker": "is_prefill_worker",
    "--is-decode-worker": "is_decode_worker",
    "--router-conditional-disagg": "router_conditional_disagg",
    "--enforce-disagg": "enforce_disagg",
    "--embedding": "embedding",
}
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
    "router_cost": "predictive",
    "router_session_affinity_ttl_secs": 0.0,
    "router_session_affinity_mode": "soft",
    "router_queue_threshold": None,
    "router_queue_policy": "priority",
    "router_max_queue_size": 1024,
    "router_queue_reserve": 0,
    "migration_limit": 0,
    "health_check_interval_s": None,
    "health_check_timeout_s": None,
    "max_inflight": 1024,
    "static_worker": False,
    "disaggregation_mode": "agg",
    "is_prefill_worker": False,
    "is_decode_worker": False,
    "router_conditional_disagg": False,
    "max_local_prefill_length": 512,
    "enforce_disagg": False,
    "embedding": False,
    "dyn_tool_call_parser": None,
    "dyn_reasoning_parser": None,
    "lora_modules": None,
    "discovery_backend": None,
    "request_plane": None,
    "event_plane": None,
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
