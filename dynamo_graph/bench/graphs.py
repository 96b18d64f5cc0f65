"""The graph side of `bench`: find the frontend of a running graph, or bring a variant up and
down again, with the same supervisor code that `dyngraph up -d` and `dyngraph down` run."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from itertools import product

from rich.console import Console

from dynamo_graph.graph.build import Built
from dynamo_graph.graph.errors import GraphError, Problem
from dynamo_graph.graph.plan import Plan
from dynamo_graph.graph.targets.local import commands
from dynamo_graph.graph.targets.local.ports import fill_plan
from dynamo_graph.graph.targets.local.state import StateDir
from dynamo_graph.graph.targets.local.ui import frontend_url


class GraphNotReady(RuntimeError):
    """The graph is not running (bench GRAPH) or already runs (a sweep), or did not come up."""


def sweep_variants(sweeps: list[str]) -> list[list[str]]:
    """`KEY=V1,V2` options -> the cartesian product of their overrides, in the order given:
    ["a=1,2", "b=x"] -> [["a=1", "b=x"], ["a=2", "b=x"]]."""
    axes = []
    for sweep in sweeps:
        key, sep, values = sweep.partition("=")
        choices = [v.strip() for v in values.split(",")]
        if not sep or not key.strip() or not all(choices):
            raise ValueError(f"--sweep takes KEY=V1,V2,..., not {sweep!r}")
        axes.append([f"{key.strip()}={v}" for v in choices])
    return [list(combo) for combo in product(*axes)] if axes else [[]]


def preflight_variants(variants: list[tuple[str, Built]]) -> None:
    """Preflight every variant of a sweep (nothing runs yet); raises GraphError with each
    problem prefixed by the variant it belongs to, so a sweep never stops half-way on a
    variant that could not have started."""
    problems: list[Problem] = []
    for label, built in variants:
        try:
            commands.preflight(built, check_ports=True)
        except GraphError as e:
            problems += [Problem(p.path, f"{p.message} (variant {label})", p.location) for p in e.problems]
    if problems:
        raise GraphError(problems)


def frontend_of(plan: Plan) -> str:
    """The base URL of the plan's first frontend (a filled plan: `auto` ports are numbers)."""
    for spec in plan.processes:
        if url := frontend_url(spec):
            return url.split(" on host ")[0].removesuffix("/v1")
    raise GraphNotReady(f"graph {plan.graph} has no frontend (a component of kind frontend) to load")


def running(built: Built) -> tuple[str, bool]:
    """The running graph's frontend URL, and whether what runs is what `built` compiles to."""
    state = StateDir(built.plan.state_dir)
    plan = state.read_plan()
    if state.supervisor() is None or plan is None:
        raise GraphNotReady(
            f"graph {built.plan.graph} is not running: start it with "
            f"`dyngraph up -d {built.plan.graph_file}`, or let --sweep bring it up"
        )
    ports = json.loads(state.ports_file.read_text()) if state.ports_file.exists() else {}
    return frontend_of(plan), fill_plan(built.plan, dict(ports)) == plan


def is_running(built: Built) -> bool:
    return StateDir(built.plan.state_dir).supervisor() is not None


@contextlib.contextmanager
def brought_up(built: Built, console: Console) -> Iterator[str]:
    """Up (detached) for the block, then down whatever happened in it; yields the frontend URL.
    A graph that already runs is refused: a sweep must not replace what someone else runs."""
    state = StateDir(built.plan.state_dir)
    if is_running(built):
        raise GraphNotReady(
            f"graph {built.plan.graph} is already running: a sweep brings each variant up itself "
            f"(stop it first: dyngraph down {built.plan.graph_file})"
        )
    try:
        with commands.DetachedUp(state) as up:
            code = up.run(built, console)
        if code != 0:
            raise GraphNotReady(f"graph {built.plan.graph} did not come up (see the log lines above)")
        plan = state.read_plan()
        assert plan is not None  # written by the supervisor before any process is ready
        yield frontend_of(plan)
    finally:
        if commands.down(state, console) != 0:
            raise GraphNotReady(f"graph {built.plan.graph} did not stop cleanly (see above)")
