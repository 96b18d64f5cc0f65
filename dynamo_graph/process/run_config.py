"""One `dyngraph run`: which input, which output engine, and dynamo-run's flags, as the
composition of the settings classes of the rooms below (each declares its own; see
dynamo_graph/options.py). The command line is derived from them (`RUN_OPTIONS`): the fast
parser's table here, the typer options in cli/run_options.py, a graph's argv in graph/compile.py.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from dynamo_graph.backend.command_line import WorkerConfig, apply_planes, worker_settings
from dynamo_graph.backend.settings import EngineSettings, RunConfigError, WorkerSettings
from dynamo_graph.frontend.settings import (
    AuthSettings,
    HttpSettings,
    HttpTlsSettings,
    LimitSettings,
    RecordSettings,
)
from dynamo_graph.options import (
    SettingError,
    check_values,
    flag_speller,
    flagged,
    from_params,
    given_fields,
    parse_fast,
    validate,
)
from dynamo_graph.router.config import DisaggConfig, RouterConfig
from dynamo_graph.runtime.settings import PlaneSettings, TracingSettings

InputKind = Literal["text", "stdin", "http", "batch", "none", "dyn"]
# The order of `dyngraph run --help`.
RUN_SETTINGS = (
    EngineSettings,
    HttpSettings,
    HttpTlsSettings,
    AuthSettings,
    LimitSettings,
    RecordSettings,
    RouterConfig,
    DisaggConfig,
    WorkerSettings,
    PlaneSettings,
    TracingSettings,
)
RUN_OPTIONS = flagged(*RUN_SETTINGS)
assert len({opt.param for opt in RUN_OPTIONS}) == len(RUN_OPTIONS), "two settings share a flag"


@dataclass
class RunConfig:
    engine: EngineSettings
    worker: WorkerSettings
    planes: PlaneSettings
    http: HttpSettings = field(default_factory=HttpSettings)
    http_tls: HttpTlsSettings = field(default_factory=HttpTlsSettings)
    auth: AuthSettings = field(default_factory=AuthSettings)
    limits: LimitSettings = field(default_factory=LimitSettings)
    record: RecordSettings = field(default_factory=RecordSettings)
    router: RouterConfig = field(default_factory=RouterConfig)
    disagg: DisaggConfig = field(default_factory=DisaggConfig)
    tracing: TracingSettings = field(default_factory=TracingSettings)
    input: InputKind = "text"
    input_arg: str | None = None  # the batch file, or the dyn:// endpoint
    output: str | None = None  # None: the default engine
    verbosity: int = 0
    # Parameters (`Option.param`) given explicitly on the command line.
    explicit: set[str] = field(default_factory=set)

    @property
    def model_path(self) -> str | None:
        return self.engine.model_path

    @property
    def discovers_workers(self) -> bool:
        """A frontend of workers it discovers (`out=auto`) or is told of (`out=dyn://...`)."""
        return self.output == "auto" or (self.output or "").startswith("dyn://")

    def worker_config(self, endpoint: str) -> WorkerConfig:
        """This process's part as a worker serving `endpoint`."""
        return WorkerConfig(endpoint, self.engine, self.worker, self.planes, verbosity=self.verbosity)


def parse_run_args(args: list[str]) -> tuple[list[str], dict[str, Any], set[str]] | None:
    """`dyngraph run`'s arguments without typer (options.parse_fast); None: typer must parse."""
    return parse_fast(args, RUN_OPTIONS)


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


def run_config_from_args(
    words: Sequence[str] | None,
    params: dict[str, Any],
    explicit: set[str],
    *,
    engine_argv: Sequence[str] = (),
) -> tuple[RunConfig, bool]:
    """`dyngraph run`'s parsed command line (`parse_run_args` or typer) as a checked RunConfig:
    `in=...`, `out=...` and one MODEL among the words. Returns (config, whether in= was given)."""
    params = dict(params)
    input_kind: InputKind = "text"
    input_arg: str | None = None
    output: str | None = None
    input_given = False
    for word in words or []:
        key, sep, value = word.partition("=")
        if sep and key == "in":
            input_kind, input_arg = parse_input(value)
            input_given = True
        elif sep and key == "out":
            output = value
        elif params.get("model_path") is None and not sep:
            params["model_path"] = word
        else:
            raise RunConfigError(f"unexpected argument {word!r} (expected in=..., out=... and one MODEL)")
    engine, worker, planes = worker_settings(params, explicit, output=output, engine_argv=engine_argv)
    try:
        cfg = RunConfig(
            engine=engine,
            worker=worker,
            planes=planes,
            http=from_params(HttpSettings, params),
            http_tls=from_params(HttpTlsSettings, params),
            auth=from_params(AuthSettings, params),
            limits=from_params(LimitSettings, params),
            record=from_params(RecordSettings, params),
            router=from_params(RouterConfig, params),
            disagg=from_params(DisaggConfig, params),
            tracing=from_params(TracingSettings, params),
            input=input_kind,
            input_arg=input_arg,
            output=output,
            verbosity=params.get("verbose", 0),
            explicit=set(explicit),
        )
        for settings in (cfg.http, cfg.http_tls, cfg.auth, cfg.limits, cfg.disagg):
            validate(settings, flag_speller(type(settings)))
        validate(cfg.record, flag_speller(RecordSettings), given=given_fields(RecordSettings, explicit))
        validate(cfg.tracing, flag_speller(TracingSettings))
        if input_kind == "dyn":  # a worker has no router: its router flags are reported unused
            check_values(cfg.router, flag_speller(RouterConfig))
        else:
            validate(cfg.router, flag_speller(RouterConfig), given=given_fields(RouterConfig, explicit))
        from dynamo_graph.backend.lora import parse_lora_modules

        parse_lora_modules(engine.lora_modules)
    except SettingError as err:
        raise RunConfigError(str(err)) from None
    _check_parts(cfg)
    return cfg, input_given


def _check_parts(cfg: RunConfig) -> None:
    """The rules between the words (in=, out=) and the flags."""
    if cfg.http.processes > 1 and cfg.input == "http" and not cfg.discovers_workers:
        raise RunConfigError(
            f"--http-processes {cfg.http.processes} runs that many frontends of the same workers: "
            f"give out=auto or out=dyn://...; out={cfg.output or 'the default engine'} would run an "
            "engine in each"
        )
    if cfg.input == "dyn" and cfg.discovers_workers:
        raise RunConfigError(f"in={cfg.input_arg} serves an engine: give out=ENGINE, not out={cfg.output}")
    if cfg.engine.lora_modules and cfg.input != "dyn":
        if cfg.discovers_workers:
            raise RunConfigError(
                "--lora-modules is a worker's flag: the frontend lists the adapters workers load"
            )
        if cfg.input != "http":
            raise RunConfigError(
                f"--lora-modules serves adapters as models over HTTP: not with in={cfg.input}"
            )


def apply_runtime_settings(cfg: RunConfig) -> None:
    """Put the plane and health-check flags into the environment (so every part of the runtime,
    and any child process, sees one configuration), then check them before connecting."""
    from dynamo_graph.runtime.health import INTERVAL_ENV, TIMEOUT_ENV

    for env, value in (
        (INTERVAL_ENV, cfg.limits.health_check_interval_s),
        (TIMEOUT_ENV, cfg.limits.health_check_timeout_s),
    ):
        if value is not None:
            os.environ[env] = f"{value:g}"
    apply_planes(cfg.planes)


def parse_run_config(args: list[str]) -> RunConfig:
    """A `dyngraph run` command line (plain `--flag VALUE` form) as a checked RunConfig: for
    embedders and tests; the CLI goes through typer where this form does not parse."""
    parsed = parse_run_args(args)
    if parsed is None:
        raise RunConfigError(f"not a plain dyngraph run command line: {' '.join(args)}")
    words, params, explicit = parsed
    return run_config_from_args(words, params, explicit, engine_argv=params.pop("engine_argv", ()))[0]
