"""`dyngraph run` itself, and a fast path to it that does not load typer.

Every process of a graph is a `dyngraph run ...` whose command line the compiler wrote: plain
`--flag VALUE` options, which `python -m dynamo_graph run ...` parses without typer
(backend/command_line.py `parse_fast`); anything that parser is not sure of goes to typer as
before. The flag table is re-exported here for the typer command and its test.
"""

from __future__ import annotations

import sys
from typing import Any

from dynamo_graph.backend.command_line import (
    BOOL_WORDS,
    RUN_DEFAULTS,
    RUN_FLAGS,
    RUN_OPTIONS,
    fail,
    parse_fast,
)

__all__ = [
    "BOOL_WORDS",
    "RUN_DEFAULTS",
    "RUN_FLAGS",
    "RUN_OPTIONS",
    "execute",
    "fail",
    "main_fast",
    "parse_fast",
]


def execute(words: list[str] | None, params: dict[str, Any], explicit: set[str]) -> int:
    """Run `dyngraph run` with parsed arguments; returns the exit code."""
    from dynamo_graph.backend.run_config import RunConfigError, run_config_from_args, validate
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
    except (RunConfigError, ModelResolutionError) as e:
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
