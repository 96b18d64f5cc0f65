"""One entry point from a graph file to what the commands need: load -> validate -> compile.

`validate`, `render` and (later) `up` all go through `build`, so they agree on every error and
on the plan.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from dynamo_graph.graph.compile import Plan, compile_graph
from dynamo_graph.graph.load import LoadedGraph, load_graph, state_dir
from dynamo_graph.graph.schema import Graph
from dynamo_graph.graph.validate import Engines, schema_keys, schema_knows, validate_graph


@dataclass(frozen=True)
class Built:
    loaded: LoadedGraph
    graph: Graph
    plan: Plan


def build(
    path: str | Path,
    overrides: Sequence[str] = (),
    *,
    env: Mapping[str, str] | None = None,
    engines: Engines = "dyngraph",
) -> Built:
    """Raises GraphError with every problem found at the first stage that has any. `engines`
    says whose engines will run the workers (see validate.Engines)."""
    loaded = load_graph(path, overrides, env=env, known_key=schema_knows, keys_at=schema_keys)
    graph = validate_graph(loaded.data, loaded.source, file=str(loaded.file), engines=engines)
    plan = compile_graph(graph, graph_file=loaded.file, state_dir=state_dir(loaded.file))
    return Built(loaded, graph, plan)
