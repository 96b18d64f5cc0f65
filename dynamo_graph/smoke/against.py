"""`dyngraph test GRAPH --against URL [--model NAME]`: a graph's checks against a frontend that
already runs; nothing is brought up or torn down.

For verifying a deployment after `up`, and what a rollout's `checks: true` runs: the rollout
(graph/targets/local/rollout.py) starts it as a subprocess, against a frontend of its own that
routes only to the new revision's workers (graph/ must not import this room above it). With
`--model`, only the checks that talk to that model run (such a frontend serves no other);
`fault` checks signal processes of a graph that `dyngraph test` brought up, so here they are
skipped, and said so.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.markup import escape

from dynamo_graph.graph.build import build
from dynamo_graph.graph.errors import GraphError
from dynamo_graph.graph.schema import Graph, SmokeCheck
from dynamo_graph.smoke.defaults import default_checks, served_models
from dynamo_graph.smoke.report import print_check
from dynamo_graph.smoke.results import CheckResult
from dynamo_graph.smoke.steps import Address, Target, api_key_headers, check_name, run_check, wait_models


def _skipped(graph: Graph, target: Target, check: SmokeCheck, model: str | None) -> str | None:
    """Why a check does not run against an existing frontend, or None when it does."""
    if check.fault is not None:
        return "a fault needs a graph that `dyngraph test` brought up"
    if model is None:
        return None
    if check.chat is not None or check.completion is not None:
        asks = served_models(graph, target.frontend(check))[0]
        return None if asks == model else f"it asks {asks}, not {model}"
    if check.models is not None and check.models != [model]:
        return f"it lists {', '.join(check.models)}, not only {model}"
    return None


async def _run(graph: Graph, url: str, model: str | None, console: Console) -> list[CheckResult]:
    keys = list(graph.frontends())
    headers = api_key_headers(graph, keys[0]) if keys else {}
    address = Address(url.rstrip("/").removesuffix("/v1"), headers)
    frontends = {key: address for key in keys} or {"frontend": address}
    wanted = {key: [model] if model else served_models(graph, key) for key in keys}
    checks = graph.tests if graph.tests is not None else default_checks(graph)
    results: list[CheckResult] = []
    async with httpx.AsyncClient(timeout=None) as client:
        started = time.monotonic()
        if missing := await wait_models(client, graph, frontends, wanted):
            results.append(CheckResult("models", "error", time.monotonic() - started, [missing]))
            print_check(console, results[-1])
            return results
        target = Target(graph, None, frontends, client)
        for index, check in enumerate(checks):
            if (why := _skipped(graph, target, check, model)) is not None:
                console.print(f"  - {escape(check_name(check, index))} [dim](skipped: {escape(why)})[/]")
                continue
            results.append(await run_check(target, check, index))
            print_check(console, results[-1])
    return results


def run_against(file: Path, overrides: list[str], url: str, model: str | None, console: Console) -> int:
    """0 when every check that ran passed, 1 when one failed, 2 for an invalid graph."""
    try:
        graph = build(file, overrides).graph
    except GraphError as e:
        for problem in e.problems:
            console.print(f"[bold red]error:[/] {escape(str(problem))}", highlight=False)
        return 2
    console.print(f"[bold]{escape(str(file))}[/] against {escape(url)}", highlight=False)
    results = asyncio.run(_run(graph, url, model, console))
    failed = [r for r in results if r.outcome != "passed"]
    console.print(f"{len(results) - len(failed)} passed, {len(failed)} failed", highlight=False)
    return 1 if failed else 0
