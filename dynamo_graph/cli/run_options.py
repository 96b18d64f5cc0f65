"""`dyngraph run`'s typer signature, derived from the settings classes (dynamo_graph/options.py):
the same flags, types, defaults and help as the fast parser's table, so the two cannot drift."""

from __future__ import annotations

import inspect
from typing import Annotated

import typer

from dynamo_graph.options import help_text
from dynamo_graph.process.run_config import RUN_OPTIONS


def run_signature() -> inspect.Signature:
    """(ctx, words, one keyword parameter per flag, verbose) for `run_command`."""
    params = [
        inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context),
        inspect.Parameter(
            "words",
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            default=None,
            annotation=Annotated[
                list[str] | None, typer.Argument(help="in=INPUT, out=ENGINE and/or MODEL", show_default=False)
            ],
        ),
    ]
    for opt in RUN_OPTIONS:
        option = typer.Option(opt.flag, help=help_text(opt))
        params.append(
            inspect.Parameter(
                opt.param,
                inspect.Parameter.KEYWORD_ONLY,
                default=opt.cli_default,
                annotation=Annotated[opt.annotation, option],
            )
        )
    verbose = typer.Option("-v", "--verbose", count=True, help="-v debug, -vv trace")
    params.append(
        inspect.Parameter(
            "verbose", inspect.Parameter.KEYWORD_ONLY, default=0, annotation=Annotated[int, verbose]
        )
    )
    return inspect.Signature(params)
