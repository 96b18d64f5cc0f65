"""The settings of one `dyngraph run`: which input, which output engine, and dynamo-run's flags.

Parsed from the command line (backend/command_line.py) by the CLI and by `backend.run`'s
workers, consumed by the worker (backend/worker.py) and by inputs/launch.py. Flags that only
matter to other parts of the system (routing, multi-node, migration) are kept here and passed
on, never dropped. An engine gets only its part of them (`engine_settings()`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from dynamo_graph.backend.lora import parse_lora_modules
from dynamo_graph.backend.settings import EngineSettings, RunConfigError, read_engine_args_file
from dynamo_graph.llm.reasoning import REASONING_PARSERS
from dynamo_graph.llm.tool_calls import TOOL_CALL_PARSERS

if TYPE_CHECKING:
    from dynamo_graph.llm.model_source import LocalModel

InputKind = Literal["text", "stdin", "http", "batch", "none", "dyn"]
ROUTER_MODES = ("random", "round-robin", "kv")
_ROUTER_CHOICES = {
    "--router-cost": ("router_cost", ("predictive", "dynamo")),
    "--router-session-affinity-mode": ("router_session_affinity_mode", ("hard", "soft")),
    "--router-queue-policy": ("router_queue_policy", ("priority", "fcfs", "wspt")),
}
# The kv router's flags that mean nothing to another router mode (given with one: an error).
KV_ONLY_FLAGS = {
    "router_session_affinity_ttl_secs": "--router-session-affinity-ttl-secs",
    "router_session_affinity_mode": "--router-session-affinity-mode",
    "router_queue_threshold": "--router-queue-threshold",
    "router_queue_policy": "--router-queue-policy",
    "router_max_queue_size": "--router-max-queue-size",
    "router_queue_reserve": "--router-queue-reserve",
}
DISAGGREGATION_MODES = ("agg", "prefill", "decode")
log = logging.getLogger(__name__)


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
    # Frontend limits and auth (frontend/limits.py, frontend/auth.py).
    http_body_limit_mb: float | None = None  # None: DYN_HTTP_BODY_LIMIT_MB, else 32
    max_concurrent_requests: int = 1024  # 0: unlimited
    request_timeout_s: float | None = None  # None: no limit
    api_key: str | None = None  # KEY[,KEY...]; also DYN_API_KEY and DYN_API_KEY_ENV
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
    # The kv router's cost, session affinity and queue (router/kv/: predict.py, affinity.py, queue.py).
    router_cost: str = "predictive"
    router_session_affinity_ttl_secs: float = 0.0  # 0: no session affinity
    router_session_affinity_mode: str = "soft"
    # Busy: prefill tokens waiting > this fraction of a worker's max_num_batched_tokens; None: no queue.
    router_queue_threshold: float | None = None
    router_queue_policy: str = "priority"
    router_max_queue_size: int = 1024
    router_queue_reserve: int = 0  # ranks kept free of ordinary prefill work for urgent requests
    migration_limit: int = 0
    static_worker: bool = False
    # Frontend health checks of worker instances (runtime/health.py); None: the environment's
    # DYN_HEALTH_CHECK_INTERVAL_S / DYN_HEALTH_CHECK_TIMEOUT_S, else 5 s / 3 s. Interval 0: off.
    health_check_interval_s: float | None = None
    health_check_timeout_s: float | None = None
    # A worker's cap on requests in flight; beyond it, requests are answered `overloaded` (503,
    # and the frontend tries another instance). 0: unlimited.
    max_inflight: int = 1024
    # Disaggregated serving. A worker's part: whole requests (agg), or only prompts (prefill:
    # it hands the KV over), or requests whose prompt a prefill worker computed (decode; it
    # prefills locally when none did). --is-prefill-worker / --is-decode-worker: old spellings.
    disaggregation_mode: str = "agg"
    is_prefill_worker: bool = False
    # The engine's embedding mode: a worker of model type "embedding" (EngineSettings.embedding).
    embedding: bool = False
    is_decode_worker: bool = False
    # A frontend's part: prompts with fewer uncached tokens than max_local_prefill_length are
    # prefilled on the decode worker (with router_conditional_disagg); enforce_disagg forbids
    # local prefill altogether (no prefill worker: 503).
    router_conditional_disagg: bool = False
    max_local_prefill_length: int = 512
    enforce_disagg: bool = False
    # Runtime planes; None leaves the environment (DYN_DISCOVERY_BACKEND, ...) in charge.
    discovery_backend: str | None = None
    request_plane: str | None = None
    event_plane: str | None = None
    # How frontends read this model's output (llm/tool_calls, llm/reasoning.py); the card carries them.
    dyn_tool_call_parser: str | None = None
    dyn_reasoning_parser: str | None = None
    # LoRA adapters the worker loads at start, NAME=PATH[,NAME=PATH] (backend/lora.py).
    lora_modules: str | None = None
    verbosity: int = 0
    # Flags given explicitly on the command line (so we can say which ones an engine ignores).
    explicit: set[str] = field(default_factory=set)
    # Arguments after `--`: passed on to the engine (a python engine file's sys.argv).
    engine_argv: list[str] = field(default_factory=list)

    def engine_settings(self) -> EngineSettings:
        """The part of these settings an engine is built from."""
        values = {name: getattr(self, name) for name in _ENGINE_FIELDS if name != "engine"}
        return EngineSettings(engine=self.output, **values)


_ENGINE_FIELDS = tuple(f.name for f in dataclasses.fields(EngineSettings))


DEFAULT_WORKER_ENDPOINT = "dyn://dynamo.backend.generate"


@dataclass
class WorkerConfig:
    """What serving an engine as a worker needs besides the engine: where to serve, which model
    to publish, and the rest of the dynamo-run flags (`settings`, a RunConfig)."""

    endpoint: str
    settings: RunConfig
    model: LocalModel | None = None
    # Arguments after `--` on the command line, for the engine's own parser.
    engine_args: Sequence[str] = ()

    @property
    def model_path(self) -> str | None:
        return self.settings.model_path

    @property
    def model_name(self) -> str | None:
        return self.settings.model_name

    @property
    def migration_limit(self) -> int:
        return self.settings.migration_limit

    @property
    def static(self) -> bool:
        return self.settings.static_worker


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


def _validate_router(cfg: RunConfig) -> None:
    for flag, (name, valid) in _ROUTER_CHOICES.items():
        if getattr(cfg, name) not in valid:
            raise RunConfigError(f"{flag} must be one of {', '.join(valid)}, not {getattr(cfg, name)!r}")
    ttl = cfg.router_session_affinity_ttl_secs
    if ttl < 0:
        raise RunConfigError(f"--router-session-affinity-ttl-secs must be >= 0 (0: off), not {ttl:g}")
    threshold = cfg.router_queue_threshold
    if threshold is not None and not (math.isfinite(threshold) and threshold >= 0):
        raise RunConfigError(
            f"--router-queue-threshold is a fraction of each worker's max_num_batched_tokens, "
            f">= 0 (e.g. 0.5), not {threshold:g}"
        )
    if cfg.router_max_queue_size < 0:
        raise RunConfigError(f"--router-max-queue-size must be >= 0, not {cfg.router_max_queue_size}")
    reserve = cfg.router_queue_reserve
    if reserve < 0:
        raise RunConfigError(f"--router-queue-reserve must be >= 0 workers, not {reserve}")
    if reserve and (threshold is None or cfg.router_queue_policy != "priority"):
        raise RunConfigError(
            "--router-queue-reserve keeps workers free for urgent requests: it needs the queue "
            "(--router-queue-threshold) in priority order (--router-queue-policy priority)"
        )
    given = set(cfg.explicit)
    if cfg.router_session_affinity_ttl_secs > 0:
        given.add("router_session_affinity_ttl_secs")
    if threshold is not None:
        given.add("router_queue_threshold")
    kv_only = [flag for name, flag in KV_ONLY_FLAGS.items() if name in given]
    if kv_only and cfg.router_mode != "kv" and cfg.input != "dyn":
        raise RunConfigError(
            f"{', '.join(kv_only)}: session affinity and the router queue are the kv router's, "
            f"not --router-mode {cfg.router_mode}'s: add --router-mode kv"
        )


def validate(cfg: RunConfig) -> None:
    _resolve_disaggregation_mode(cfg)
    if cfg.router_mode not in ROUTER_MODES:
        raise RunConfigError(
            f"--router-mode must be one of {', '.join(ROUTER_MODES)}, not {cfg.router_mode!r}"
        )
    _validate_router(cfg)
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
        ("--max-concurrent-requests", cfg.max_concurrent_requests, 0),
        ("--max-inflight", cfg.max_inflight, 0),
        ("--max-local-prefill-length", cfg.max_local_prefill_length, 0),
    ]
    for flag, value, minimum in checks:
        if value is not None and value < minimum:
            raise RunConfigError(f"{flag} must be at least {minimum}, not {value}")
    if cfg.node_rank >= cfg.num_nodes:
        raise RunConfigError(f"--node-rank {cfg.node_rank} must be below --num-nodes {cfg.num_nodes}")
    if cfg.num_nodes > 1 and not cfg.leader_addr:
        raise RunConfigError("--num-nodes > 1 needs --leader-addr HOST:PORT")
    for flag, fvalue in (
        ("--request-timeout-s", cfg.request_timeout_s),
        ("--http-body-limit-mb", cfg.http_body_limit_mb),
        ("--health-check-timeout-s", cfg.health_check_timeout_s),
    ):
        if fvalue is not None and not fvalue > 0:
            raise RunConfigError(f"{flag} must be above 0, not {fvalue:g}")
    interval = cfg.health_check_interval_s
    if interval is not None and not interval >= 0:
        raise RunConfigError(f"--health-check-interval-s must be >= 0 (0: no checks), not {interval:g}")
    if cfg.api_key is not None and not [k for k in cfg.api_key.split(",") if k.strip()]:
        raise RunConfigError("--api-key needs a key (or a comma list of keys)")  # never echo a key
    if cfg.router_temperature < 0:
        raise RunConfigError(f"--router-temperature must be >= 0, not {cfg.router_temperature}")
    for flag, name, valid in (
        ("--dyn-tool-call-parser", cfg.dyn_tool_call_parser, TOOL_CALL_PARSERS),
        ("--dyn-reasoning-parser", cfg.dyn_reasoning_parser, REASONING_PARSERS),
    ):
        if name is not None and name not in valid:
            raise RunConfigError(f"{flag}: unknown parser {name!r}; valid names: {', '.join(valid)}")
    parse_lora_modules(cfg.lora_modules)
    if cfg.extra_engine_args is not None:
        read_engine_args_file(cfg.extra_engine_args)  # fail now, with the file named, not after loading


def _resolve_disaggregation_mode(cfg: RunConfig) -> None:
    """--disaggregation-mode, or the deprecated --is-prefill-worker / --is-decode-worker (with a
    warning); given both ways, they must agree."""
    if cfg.disaggregation_mode not in DISAGGREGATION_MODES:
        raise RunConfigError(
            f"--disaggregation-mode must be one of {', '.join(DISAGGREGATION_MODES)}, "
            f"not {cfg.disaggregation_mode!r}"
        )
    if cfg.is_prefill_worker and cfg.is_decode_worker:
        raise RunConfigError("--is-prefill-worker and --is-decode-worker: a worker is one or the other")
    for flag, mode, given in (
        ("--is-prefill-worker", "prefill", cfg.is_prefill_worker),
        ("--is-decode-worker", "decode", cfg.is_decode_worker),
    ):
        if not given:
            continue
        log.warning("%s is deprecated: use --disaggregation-mode %s", flag, mode)
        if "disaggregation_mode" in cfg.explicit and cfg.disaggregation_mode != mode:
            raise RunConfigError(f"{flag} conflicts with --disaggregation-mode {cfg.disaggregation_mode}")
        cfg.disaggregation_mode = mode


_PLANE_ENV = {
    "discovery_backend": "DYN_DISCOVERY_BACKEND",
    "request_plane": "DYN_REQUEST_PLANE",
    "event_plane": "DYN_EVENT_PLANE",
}
# The frontend's health-check settings, read by the model watcher (runtime/health.py).
_HEALTH_ENV = {
    "health_check_interval_s": "DYN_HEALTH_CHECK_INTERVAL_S",
    "health_check_timeout_s": "DYN_HEALTH_CHECK_TIMEOUT_S",
}


def apply_runtime_settings(cfg: RunConfig) -> None:
    """Put the plane flags into the environment (so every part of the runtime, and any child
    process, sees one configuration), then check all runtime settings before connecting."""
    from dynamo_graph.runtime import discovery, transport
    from dynamo_graph.runtime.events import event_plane_kind
    from dynamo_graph.runtime.health import HealthSettings

    for attr, env in _PLANE_ENV.items():
        value = getattr(cfg, attr)
        if value is not None:
            os.environ[env] = value
    for attr, env in _HEALTH_ENV.items():
        value = getattr(cfg, attr)
        if value is not None:
            os.environ[env] = f"{value:g}"
    try:
        discovery.check_settings()
        transport.check_settings()
        event_plane_kind()
        HealthSettings.from_env()
    except (ValueError, discovery.DiscoveryError) as err:
        raise RunConfigError(str(err)) from None


def run_config_from_args(
    words: Sequence[str] | None,
    params: dict[str, Any],
    explicit: set[str],
    *,
    engine_argv: Sequence[str] = (),
) -> tuple[RunConfig, bool]:
    """`dyngraph run`'s parsed command line (command_line.py `parse_fast` or typer) as a RunConfig:
    `in=...`, `out=...` and one MODEL among the words. Returns (config, whether in= was given).
    Not validated yet (`validate`)."""
    from dynamo_graph.backend.command_line import BOOL_WORDS

    params = dict(params)
    verbose = params.pop("verbose", 0)
    use_kv_events = str(params.pop("use_kv_events", "true"))
    if use_kv_events.lower() not in BOOL_WORDS:
        raise RunConfigError(f"--use-kv-events takes true or false, not {use_kv_events!r}")
    cfg = RunConfig(
        **params,
        use_kv_events=BOOL_WORDS[use_kv_events.lower()],
        verbosity=verbose,
        explicit=set(explicit),
        engine_argv=list(engine_argv),
    )
    input_given = False
    for word in words or []:
        key, sep, value = word.partition("=")
        if sep and key == "in":
            cfg.input, cfg.input_arg = parse_input(value)
            input_given = True
        elif sep and key == "out":
            cfg.output = value
        elif cfg.model_path is None and not sep:
            cfg.model_path = word
        else:
            raise RunConfigError(f"unexpected argument {word!r} (expected in=..., out=... and one MODEL)")
    return cfg, input_given


def parse_worker_args(argv: Sequence[str] | None = None) -> WorkerConfig:
    """A worker's command line, as `dynamo_graph.backend.run` takes it: dynamo-run's flags and
    words (`in=dyn://ns.comp.ep` or `--endpoint dyn://ns.comp.ep`, default
    dyn://dynamo.backend.generate; MODEL or --model-path), then `--` and the engine's own args."""
    import sys

    from dynamo_graph.backend.command_line import parse_fast
    from dynamo_graph.runtime.names import EndpointName, NameError_

    args = list(sys.argv[1:] if argv is None else argv)
    engine_argv: list[str] = []
    if "--" in args:
        cut = args.index("--")
        args, engine_argv = args[:cut], args[cut + 1 :]
    endpoint: str | None = None
    rest: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--endpoint" and i + 1 < len(args):
            endpoint, i = args[i + 1], i + 2
            continue
        if arg.startswith("--endpoint="):
            endpoint = arg.partition("=")[2]
        else:
            rest.append(arg)
        i += 1
    parsed = parse_fast(rest)
    if parsed is None:
        bad = next((a for a in rest if a.startswith("-")), None)
        raise RunConfigError(
            f"cannot parse the worker's command line at {bad!r}: it takes dynamo-run's flags "
            "(see `dyngraph run --help`), --endpoint dyn://ns.comp.ep, and the engine's own "
            "arguments after `--`"
        )
    words, params, explicit = parsed
    cfg, input_given = run_config_from_args(words, params, explicit, engine_argv=engine_argv)
    if input_given and cfg.input != "dyn":
        raise RunConfigError(f"a worker serves a dyn:// endpoint, not in={cfg.input}")
    if cfg.output is not None:
        raise RunConfigError(f"out={cfg.output}: a worker started with backend.run serves its own engine")
    if input_given and endpoint is not None and endpoint != cfg.input_arg:
        raise RunConfigError(f"two endpoints given: in={cfg.input_arg} and --endpoint {endpoint}")
    endpoint = cfg.input_arg if input_given else endpoint or DEFAULT_WORKER_ENDPOINT
    try:
        name = EndpointName.parse(endpoint)
    except NameError_ as err:
        raise RunConfigError(str(err)) from None
    cfg.input, cfg.input_arg = "dyn", str(name)
    validate(cfg)
    return WorkerConfig(endpoint=str(name), settings=cfg, engine_args=engine_argv)
