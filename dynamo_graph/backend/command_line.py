"""A worker's command line: the engine's, the worker's and the planes' settings, as
`backend.run(MyEngine)` takes them (`parse_worker_args`) and as `dyngraph run in=dyn://...`
hands them to the serving loop (`WorkerConfig`).

The flags are derived from the settings classes (dynamo_graph/options.py); `dyngraph run`'s
whole command line (process/run_config.py) adds the frontend's and the router's to these.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dynamo_graph.backend.settings import (
    EngineSettings,
    RunConfigError,
    WorkerSettings,
    resolve_disaggregation_mode,
)
from dynamo_graph.options import SettingError, flag_speller, flagged, from_params, parse_fast, validate
from dynamo_graph.runtime.settings import PlaneSettings

if TYPE_CHECKING:
    from dynamo_graph.llm.model_source import LocalModel

WORKER_SETTINGS = (EngineSettings, WorkerSettings, PlaneSettings)
DEFAULT_WORKER_ENDPOINT = "dyn://dynamo.backend.generate"


@dataclass
class WorkerConfig:
    """What serving an engine as a worker needs besides the engine: where to serve, which model
    to publish, and the worker's settings."""

    endpoint: str
    engine: EngineSettings
    worker: WorkerSettings
    planes: PlaneSettings
    model: LocalModel | None = None
    verbosity: int = 0

    @property
    def engine_args(self) -> Sequence[str]:
        """Arguments after `--` on the command line, for the engine's own parser."""
        return self.engine.engine_argv


def worker_settings(
    params: Mapping[str, Any],
    explicit: set[str],
    *,
    output: str | None = None,
    engine_argv: Sequence[str] = (),
) -> tuple[EngineSettings, WorkerSettings, PlaneSettings]:
    """The worker's three settings from a parsed command line, checked (deprecated spellings
    resolved)."""
    try:
        # A python engine file is handed the frontend's --http-port, where the command line has one.
        port = {"http_port": params["http_port"]} if "http_port" in params else {}
        engine = from_params(
            EngineSettings,
            params,
            **port,
            engine=output,
            serves_metrics=params.get("metrics_port") is not None,
            engine_argv=list(engine_argv),
            explicit=set(explicit),
        )
        worker = from_params(WorkerSettings, params)
        planes = from_params(PlaneSettings, params)
        for settings in (engine, worker, planes):
            validate(settings, flag_speller(type(settings)))
        both = {
            **{o.name: o.flag for o in flagged(EngineSettings)},
            **{o.name: o.flag for o in flagged(WorkerSettings)},
        }
        resolve_disaggregation_mode(engine, worker, lambda name: both.get(name) or name)
    except SettingError as err:
        raise RunConfigError(str(err)) from None
    return engine, worker, planes


def apply_planes(planes: PlaneSettings) -> None:
    """Put the plane flags into the environment, then check the runtime's settings before
    connecting."""
    from dynamo_graph.runtime import discovery, transport
    from dynamo_graph.runtime.events import event_plane_kind
    from dynamo_graph.runtime.health import HealthSettings

    planes.to_env()
    try:
        discovery.check_settings()
        transport.check_settings()
        event_plane_kind()
        HealthSettings.from_env()
    except (ValueError, discovery.DiscoveryError) as err:
        raise RunConfigError(str(err)) from None


def _split_endpoint(args: list[str]) -> tuple[str | None, list[str]]:
    """`--endpoint dyn://...` (a backend.run spelling) out of `args`."""
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
    return endpoint, rest


def parse_worker_args(argv: Sequence[str] | None = None) -> WorkerConfig:
    """A worker's command line, as `dynamo_graph.backend.run` takes it: the worker's flags and
    words (`in=dyn://ns.comp.ep` or `--endpoint dyn://ns.comp.ep`, default
    dyn://dynamo.backend.generate; MODEL or --model-path), then `--` and the engine's own args."""
    from dynamo_graph.runtime.names import EndpointName, NameError_

    args = list(sys.argv[1:] if argv is None else argv)
    engine_argv: list[str] = []
    if "--" in args:
        cut = args.index("--")
        args, engine_argv = args[:cut], args[cut + 1 :]
    endpoint, rest = _split_endpoint(args)
    parsed = parse_fast(rest, flagged(*WORKER_SETTINGS))
    if parsed is None:
        bad = next((a for a in rest if a.startswith("-")), None)
        raise RunConfigError(
            f"cannot parse the worker's command line at {bad!r}: it takes a worker's flags "
            "(see `dyngraph run --help`), --endpoint dyn://ns.comp.ep, and the engine's own "
            "arguments after `--`"
        )
    words, params, explicit = parsed
    given: str | None = None
    for word in words:
        key, sep, value = word.partition("=")
        if sep and key == "in":
            if not value.startswith("dyn://"):
                raise RunConfigError(f"a worker serves a dyn:// endpoint, not in={value}")
            given = value
        elif sep and key == "out":
            raise RunConfigError(f"out={value}: a worker started with backend.run serves its own engine")
        elif not sep and params.get("model_path") is None:
            params["model_path"] = word
        else:
            raise RunConfigError(f"unexpected argument {word!r} (expected in=dyn://..., and one MODEL)")
    if given is not None and endpoint is not None and endpoint != given:
        raise RunConfigError(f"two endpoints given: in={given} and --endpoint {endpoint}")
    try:
        name = EndpointName.parse(given or endpoint or DEFAULT_WORKER_ENDPOINT)
    except NameError_ as err:
        raise RunConfigError(str(err)) from None
    engine, worker, planes = worker_settings(params, explicit, engine_argv=engine_argv)
    return WorkerConfig(str(name), engine, worker, planes, verbosity=params["verbose"])


CONFIG_EXIT = 2
"""`dyngraph run`'s exit code when its settings, model, engine or port cannot be used: the same
command would fail the same way, so a supervisor does not restart it (graph/targets/local/runner.py)."""


def fail(message: str) -> int:
    """Print an error as the CLI does; returns CONFIG_EXIT. The message is plain text:
    `pip install -e '.[vllm]'` must not be read as rich markup."""
    from rich.console import Console
    from rich.markup import escape

    Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {escape(message)}", highlight=False)
    return CONFIG_EXIT
