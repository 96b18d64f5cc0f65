"""A graph compiled to run beside itself: a fresh state dir and free ports.

Two `dyngraph test` runs of one graph, or a test run next to the graph started by `dyngraph up`,
must not share a state dir (file discovery lives there, as do logs and the supervisor's pid) or
a port. So the validated graph is compiled again with every port it pins that can move made
`auto` (frontends' HTTP ports, managed etcd and nats-server, workers' request-plane ports) and a
state dir of its own under the temp dir. Static workers keep their ports: their frontend finds
them by those.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from dynamo_graph.graph.compile import compile_graph
from dynamo_graph.graph.plan import Plan
from dynamo_graph.graph.schema import Frontend, Graph, Worker


def movable_ports_auto(graph: Graph) -> Graph:
    """A copy of the graph with every port that can be picked at launch left to `auto`."""
    graph = graph.model_copy(deep=True)
    for comp in graph.components.values():
        if isinstance(comp, Frontend):
            comp.http.port = "auto"
        elif isinstance(comp, Worker) and not comp.static:
            comp.tcp_port = None
    etcd, nats = graph.infra.etcd, graph.infra.nats
    if etcd is not None and etcd.managed:
        etcd.client_port = etcd.peer_port = "auto"
    if nats is not None and nats.managed:
        nats.port = "auto"
    return graph


def isolated(graph: Graph, graph_file: Path, parent: Path | None = None) -> tuple[Graph, Plan]:
    """The graph with its movable ports `auto`, and its plan in a new state dir
    (`dyngraph-test-<stem>-*` under `parent`, default the temp dir)."""
    graph = movable_ports_auto(graph)
    state = tempfile.mkdtemp(prefix=f"dyngraph-test-{graph_file.stem}-", dir=parent)
    return graph, compile_graph(graph, graph_file=graph_file, state_dir=Path(state))
