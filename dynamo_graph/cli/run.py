"""`dyngraph run` itself, and a fast path to it that does not load typer.

Every process of a graph is a `dyngraph run ...` whose command line the compiler wrote: plain
`--flag VALUE` options, which `python -m dynamo_graph run ...` parses without typer
(process/run_config.py `parse_run_args`): typer, with pydantic, which it builds a validator per
option with, costs ~0.15 s of CPU per process start. Anything that parser is not sure of goes to
typer, whose options are derived from the same settings (cli/run_options.py), so errors and help
read the same.
"""

from __future__ import annotations

import sys
from typing import Any

from dynamo_graph.backend.command_line import fail


def execute(words: list[str] | None, params: dict[str, Any], explicit: set[str]) -> int:
    """Run `dyngraph run` with parsed arguments; returns the exit code."""
    from dynamo_graph.backend.settings import RunConfigError
    from dynamo_graph.llm.model_source import ModelResolutionError
    from dynamo_graph.log import LogSpecError, setup_logging
    from dynamo_graph.process.launch import run
    from dynamo_graph.process.run_config import run_config_from_args

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
        return run(cfg)
    except (RunConfigError, ModelResolutionError) as e:
        return fail(str(e))
    except KeyboardInterrupt:
        return 130


def main_fast(args: list[str]) -> int | None:
    """`dyngraph run ARGS` without typer; None when typer must parse ARGS."""
    from dynamo_graph.process.run_config import parse_run_args

    parsed = parse_run_args(args)
    if parsed is None:
        return None
    words, params, explicit = parsed
    return execute(words, params, explicit)
