"""A Dynamo deployment from a cluster repo as a smoke graph on a laptop: `dyngraph import` of
each of Dynamo's example deployments, the workers swapped for the mocker (their engine args
dropped, no GPUs) and the model for the tiny one by overrides, then `dyngraph test` with its
default checks (models listed, a chat, a streamed chat, a completion) and a JUnit report."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

from tests.support.processes import run_cli

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "fixtures" / "dynamo" / "examples").glob("*.yaml"))


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_imported_dgd_passes_dyngraph_test(example: Path, tmp_path: Path, tiny_model: Path) -> None:
    graph_file = tmp_path / example.name
    imported = run_cli(["import", str(example), "-o", str(graph_file)])
    assert imported.returncode == 0, imported.stderr
    graph = yaml.safe_load(graph_file.read_text())
    assert graph["components"]["Frontend"]["depends_on"]  # its decode or aggregated workers
    # The name Dynamo would serve the model under.
    assert [m.get("name") for m in graph["models"].values()] == ["Qwen/Qwen3-0.6B"]
    overrides = [f"models.{key}.path={tiny_model}" for key in graph["models"]]
    workers = [k for k, c in graph["components"].items() if c["kind"] == "worker"]
    overrides += [f"components.{k}.engine=mocker" for k in workers]
    overrides += [f"~components.{k}.engine_args" for k in workers if "engine_args" in graph["components"][k]]
    # The mocker needs no GPU, and preflight counts the GPUs a placement asks for.
    overrides += [f"components.{k}.gpus.per_replica=0" for k in workers if graph["components"][k].get("gpus")]
    junit = tmp_path / "junit.xml"
    options = [a for o in overrides for a in ("-o", o)]
    tested = run_cli(["test", str(graph_file), "--junit", str(junit), *options], timeout=240)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    cases = list(ET.parse(junit).getroot().iter("testcase"))
    assert len(cases) >= 4
    assert not [c.get("name") for c in cases if c.find("failure") is not None or c.find("error") is not None]
