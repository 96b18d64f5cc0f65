"""Graph validation as the tests drive it: a YAML text in, its problems (or the valid graph)
out, each problem located at the line of its key. MINIMAL is the smallest valid graph, which
tests extend with the keys they check."""

from __future__ import annotations

import textwrap

import pytest
import yaml
from yaml.nodes import MappingNode, Node, SequenceNode

from dynamo_graph.graph.errors import GraphError, Location, Problem
from dynamo_graph.graph.schema import Graph
from dynamo_graph.graph.validate import validate_graph

FILE = "graph.yaml"


class YamlLines:
    """A line-aware locator built from `yaml.compose`: key path -> line of the key."""

    def __init__(self, text: str) -> None:
        self.lines: dict[str, int] = {}
        self._walk(yaml.compose(text), "")

    def _walk(self, node: Node, path: str) -> None:
        children: list[tuple[str, Node, Node]] = []
        if isinstance(node, MappingNode):
            children = [(str(k.value), k, v) for k, v in node.value]
        elif isinstance(node, SequenceNode):
            children = [(str(i), v, v) for i, v in enumerate(node.value)]
        for name, mark_node, child in children:
            child_path = f"{path}.{name}" if path else name
            self.lines[child_path] = mark_node.start_mark.line + 1
            self._walk(child, child_path)

    def locate(self, path: str) -> Location | None:
        line = self.lines.get(path)
        return Location(FILE, line) if line is not None else None


def problems(text: str) -> list[Problem]:
    text = textwrap.dedent(text)
    with pytest.raises(GraphError) as info:
        validate_graph(yaml.safe_load(text), YamlLines(text), file=FILE)
    return info.value.problems


def valid(text: str) -> Graph:
    text = textwrap.dedent(text)
    return validate_graph(yaml.safe_load(text), YamlLines(text), file=FILE)


HEAD = """\
name: demo
models:
  tiny: {path: ./tiny}
"""

MINIMAL = (
    HEAD
    + """\
components:
  frontend:
    kind: frontend
  backend:
    kind: worker
    model: tiny
    engine: echo_core
"""
)

# (id, graph, key path, message fragment)
