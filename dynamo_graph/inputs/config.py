"""The settings of one `dyngraph run`: which input, which output engine, and dynamo-run's flags.

Parsed by the CLI, consumed by inputs/launch.py. Flags that only matter to later parts of the
system (routing, multi-node, migration) are kept here and passed on, never dropped.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

InputKind = Literal["text", "stdin", "http", "batch", "none", "dyn"]
ROUTER_MODES = ("random", "round-robin", "kv")


class RunConfigError(ValueError):
    pass


@dataclass
class RunConfig:
    input: InputKind = "text"
    input_arg: str | None = None  # the batch file, or the dyn:// endpoint
    output: str | None = None  # None: the default engine
    model_path: str | None = None
    model_name: str | None = None
    model_config: str | None = None
    http_host: str = "127.0.0.1"
    http_port: int = 8080
    context_length: int | None = None
    kv_cache_block_size: int | None = None
    tensor_parallel_size: int = 1
    num_nodes: int = 1
    node_rank: int = 0
    leader_addr: str | None = None
    base_gpu_id: int = 0
    extra_engine_args: Path | None = None
    router_mode: str = "round-robin"
    kv_overlap_score_weight: float = 1.0
    router_temperature: float = 0.0
    use_kv_events: bool = True
    migration_limit: int = 0
    static_worker: bool = False
    # Runtime planes; None leaves the environment (DYN_DISCOVERY_BACKEND, ...) in charge.
    discovery_backend: str | None = None
    request_plane: str | None = None
    event_plane: str | None = None
    verbosity: int = 0
    # Flags given explicitly on the command line (so we can say which ones an engine ignores).
    explicit: set[str] = field(default_factory=set)

    def engine_args(self) -> dict[str, Any]:
        """The JSON object of --extra-engine-args, read and checked once."""
        if self.extra_engine_args is None:
            return {}
        try:
            data = json.loads(self.extra_engine_args.read_text())
        except OSError as err:
            raise RunConfigError(
                f"--extra-engine-args: cannot read {self.extra_engine_args}: {err}"
            ) from None
        except json.JSONDecodeError as err:
            raise RunConfigError(
                f"--extra-engine-args: {self.extra_engine_args} is not valid JSON: {err}"
            ) from None
        if not isinstance(data, dict):
            raise RunConfigError(f"--extra-engine-args: {self.extra_engine_args} must hold a JSON object")
        return data


def parse_input(word: str) -> tuple[InputKind, str | None]:
    """`text`, `stdin`, `http`, `none`, `batch:FILE`, `dyn://ns.comp.ep`."""
    if word.startswith("batch:"):
        path = word[len("batch:") :]
        if not path:
            raise RunConfigError("in=batch:FILE needs a file, e.g. in=batch:prompts.jsonl")
        if not os.path.isfile(path):
            raise RunConfigError(f"in=batch: no such file {path!r}")
        return "batch", path
    if word.startswith("dyn://"):
        return "dyn", word
    if word in ("text", "stdin", "http", "none"):
        return word, None  # type: ignore[return-value]
    raise RunConfigError(
        f"unknown input {word!r}; use text, stdin, http, batch:FILE, none or dyn://ns.comp.ep"
    )


def validate(cfg: RunConfig) -> None:
    if cfg.router_mode not in ROUTER_MODES:
        raise RunConfigError(
            f"--router-mode must be one of {', '.join(ROUTER_MODES)}, not {cfg.router_mode!r}"
        )
    if not 0 <= cfg.http_port <= 65535:
        raise RunConfigError(f"--http-port must be within 0-65535, not {cfg.http_port}")
    checks = [
        ("--context-length", cfg.context_length, 1),
        ("--kv-cache-block-size", cfg.kv_cache_block_size, 1),
        ("--tensor-parallel-size", cfg.tensor_parallel_size, 1),
        ("--num-nodes", cfg.num_nodes, 1),
        ("--node-rank", cfg.node_rank, 0),
        ("--base-gpu-id", cfg.base_gpu_id, 0),
        ("--migration-limit", cfg.migration_limit, 0),
    ]
    for flag, value, minimum in checks:
        if value is not None and value < minimum:
            raise RunConfigError(f"{flag} must be at least {minimum}, not {value}")
    if cfg.node_rank >= cfg.num_nodes:
        raise RunConfigError(f"--node-rank {cfg.node_rank} must be below --num-nodes {cfg.num_nodes}")
    if cfg.num_nodes > 1 and not cfg.leader_addr:
        raise RunConfigError("--num-nodes > 1 needs --leader-addr HOST:PORT")
    if cfg.router_temperature < 0:
        raise RunConfigError(f"--router-temperature must be >= 0, not {cfg.router_temperature}")
    if cfg.extra_engine_args is not None:
        cfg.engine_args()  # fail now, with the file named, rather than after the model loads


_PLANE_ENV = {
    "discovery_backend": "DYN_DISCOVERY_BACKEND",
    "request_plane": "DYN_REQUEST_PLANE",
    "event_plane": "DYN_EVENT_PLANE",
}


def apply_runtime_settings(cfg: RunConfig) -> None:
    """Put the plane flags into the environment (so every part of the runtime, and any child
    process, sees one configuration), then check all runtime settings before connecting."""
    from dynamo_graph.runtime import discovery, transport
    from dynamo_graph.runtime.events import event_plane_kind

    for attr, env in _PLANE_ENV.items():
        value = getattr(cfg, attr)
        if value is not None:
            os.environ[env] = value
    try:
        discovery.check_settings()
        transport.check_settings()
        event_plane_kind()
    except (ValueError, discovery.DiscoveryError) as err:
        raise RunConfigError(str(err)) from None
