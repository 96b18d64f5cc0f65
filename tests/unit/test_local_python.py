"""`hosts.local.venv` / `python`: the interpreter that runs local processes, in the plan, in the
shell script `render -f shell` prints (and, tests/system/test_preflight.py, in what `up` runs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynamo_graph.graph.build import build
from dynamo_graph.graph.targets.dispatch import render

GRAPH = """\
name: lp
models:
  m:
    path: org/model
components:
  backend:
    kind: worker
    model: m
    engine: mocker
"""


@pytest.mark.parametrize(
    ("host", "python"),
    [
        ({}, None),
        ({"hosts.local.venv": "../venvs/vllm"}, "{root}/venvs/vllm/bin/python"),
        ({"hosts.local.python": "python3.12"}, "python3.12"),  # looked up on PATH
        ({"hosts.local.python": "./bin/python"}, "{root}/graphs/bin/python"),
    ],
)
def test_local_python_in_plan_and_shell(tmp_path: Path, host: dict[str, str], python: str | None) -> None:
    file = tmp_path / "graphs" / "lp.yaml"
    file.parent.mkdir()
    file.write_text(GRAPH)
    built = build(file, [f"{k}={v}" for k, v in host.items()], env={})
    expected = python.format(root=tmp_path) if python else None
    assert built.plan.local_python == expected
    shell = render(built.graph, built.plan, "shell")
    command = next(line for line in shell.splitlines() if "in=dyn://" in line)
    if expected:
        assert f"{expected} -m dynamo_graph run in=dyn://lp.backend.generate" in command
    else:
        assert "dyngraph run in=dyn://lp.backend.generate" in command
