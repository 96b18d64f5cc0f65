"""A graph's model names its tool-call and reasoning parsers; its workers get the flags."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynamo_graph.graph.build import build
from dynamo_graph.graph.errors import GraphError

GRAPH = """
name: agents
models:
  qwen:
    path: ./model
    {extra}
components:
  frontend:
    kind: frontend
  backend:
    kind: worker
    model: qwen
    engine: echo_core
"""


def plan_argvs(tmp_path: Path, extra: str) -> list[list[str]]:
    path = tmp_path / "graph.yaml"
    path.write_text(GRAPH.format(extra=extra))
    return [p.argv for p in build(path).plan.processes]


def test_parsers_become_worker_flags(tmp_path: Path) -> None:
    argvs = plan_argvs(tmp_path, "tool_call_parser: hermes\n    reasoning_parser: qwen3")
    (worker,) = [a for a in argvs if any(w.startswith("in=dyn://") for w in a)]
    assert worker[worker.index("--dyn-tool-call-parser") + 1] == "hermes"
    assert worker[worker.index("--dyn-reasoning-parser") + 1] == "qwen3"
    frontend = next(a for a in argvs if a is not worker)
    assert "--dyn-tool-call-parser" not in frontend  # frontends read it from the card
    plain = plan_argvs(tmp_path, "")
    assert not any("--dyn-tool-call-parser" in a or "--dyn-reasoning-parser" in a for a in plain)


def test_an_unknown_parser_is_a_graph_error(tmp_path: Path) -> None:
    with pytest.raises(GraphError) as exc:
        plan_argvs(tmp_path, "tool_call_parser: nope")
    text = "\n".join(str(p) for p in exc.value.problems)
    assert "tool_call_parser" in text and "hermes" in text
