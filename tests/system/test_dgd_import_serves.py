"""A Dynamo deployment from a cluster repo as a smoke graph on a laptop: `dyngraph import` of
each of Dynamo's example deployments (tests/support/dgd.py lists them), the workers swapped for
the mocker (their engine args dropped, no GPUs) and the model for the tiny one by overrides, then
`dyngraph test` with its default checks (models listed, a chat, a streamed chat, a completion)
and a JUnit report. Two run in the default set (one disaggregated, one aggregated with kv
routing); the others are marked slow."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

from dynamo_graph.graph.targets.k8s.dgd_import import mocker_overrides
from tests.support.dgd import DGD_FILES, dgd_id
from tests.support.processes import run_cli

DEFAULT = {"examples/sglang-disagg.yaml", "upstream/examples/backends/trtllm/deploy/agg_router.yaml"}


@pytest.mark.parametrize(
    "dgd",
    [
        pytest.param(p, id=dgd_id(p), marks=() if dgd_id(p) in DEFAULT else pytest.mark.slow)
        for p in DGD_FILES
    ],
)
def test_imported_dgd_passes_dyngraph_test(dgd: Path, tmp_path: Path, tiny_model: Path) -> None:
    graph_file = tmp_path / dgd.name
    imported = run_cli(["import", str(dgd), "-o", str(graph_file)])
    assert imported.returncode == 0, imported.stderr
    graph = yaml.safe_load(graph_file.read_text())
    frontend = next(c for c in graph["components"].values() if c["kind"] == "frontend")
    assert frontend["depends_on"]  # its decode or aggregated workers
    # The name Dynamo would serve the model under.
    assert len({m.get("name") for m in graph["models"].values()}) == 1
    junit = tmp_path / "junit.xml"
    options = [a for o in mocker_overrides(graph, str(tiny_model)) for a in ("-o", o)]
    tested = run_cli(["test", str(graph_file), "--junit", str(junit), *options], timeout=240)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    cases = list(ET.parse(junit).getroot().iter("testcase"))
    assert len(cases) >= 4
    assert not [c.get("name") for c in cases if c.find("failure") is not None or c.find("error") is not None]
