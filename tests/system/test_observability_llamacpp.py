"""The dashboard of a llama.cpp graph against a real Prometheus (issue 30's acceptance, which
tests/system/test_observability.py checks for the mocker): two llama.cpp workers on the tiny
model's GGUF behind a kv-routing frontend (llama.cpp publishes no KV events nor load reports,
so the router predicts from what it routed) under `dyngraph up`; every target is up and every
expression of `render -f grafana` returns data after a few requests."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

if os.environ.get("CI"):
    import llama_cpp  # noqa: F401 - CI installs the llamacpp extra: a missing package must fail
else:
    pytest.importorskip("llama_cpp")

from tests.support.local_graph import Graph, Traffic, running
from tests.support.prometheus import (
    active_targets,
    dashboard_expressions,
    needs_prometheus,
    scraping,
    wait_for_data,
)

GRAPH = """
name: llamacpp-kv
models:
  tiny-model: {path: ./model}
components:
  frontend:
    kind: frontend
    router: {mode: kv, use_kv_events: false}
    depends_on: [backend]
  backend:
    kind: worker
    model: tiny-model
    engine: llamacpp
    replicas: 2
    engine_args: {n_threads: 1, n_parallel: 2}
"""


@pytest.fixture(scope="module")
def graph(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Graph]:
    with running(GRAPH, tmp_path_factory.mktemp("observe-llamacpp"), tiny_model) as graph:
        yield graph


@needs_prometheus
def test_prometheus_scrapes_every_llamacpp_worker_and_every_dashboard_expression_has_data(
    graph: Graph,
) -> None:
    exprs = dashboard_expressions(graph)
    assert any("dyngraph_llamacpp_" in e for e in exprs)
    assert not any("_reported_" in e for e in exprs)  # the panels of load reports it never sends
    with scraping(graph) as api:
        scraped = {t["labels"].get("process") for t in active_targets(api)}
        assert scraped == {None, "backend-0", "backend-1"}  # the frontend, each worker replica's own
        with Traffic(graph):
            wait_for_data(api, exprs, 30)
