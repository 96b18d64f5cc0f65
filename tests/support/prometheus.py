"""A real Prometheus (Debian's `prometheus`) scraping what `render -f prometheus` wrote, the
dashboard's expressions asked of it, and a scrape of one target the way its job says (HTTPS
with the job's client certificate where the graph has TLS on): tests/system/test_observability*.py
and test_tls.py."""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.support.local_graph import Graph
from tests.support.processes import free_port, run_cli
from tests.support.waiting import wait_for

needs_prometheus = pytest.mark.skipif(
    shutil.which("prometheus") is None, reason="needs Prometheus (Debian's prometheus)"
)


def scrape(job: dict[str, Any], target: str) -> str:
    """`GET /metrics` of `target` as its job scrapes it."""
    tls = job.get("tls_config")
    verify: ssl.SSLContext | bool = True
    if tls is not None:
        verify = ssl.create_default_context(cafile=tls["ca_file"])
        verify.load_cert_chain(tls["cert_file"], tls["key_file"])
    url = f"{job.get('scheme', 'http')}://{target}{job['metrics_path']}"
    answer = httpx.get(url, verify=verify, timeout=5)
    answer.raise_for_status()
    return answer.text


@contextmanager
def prometheus(rendered: str, folder: Path) -> Iterator[httpx.Client]:
    """Run Prometheus on the rendered configuration (scraping every second rather than the
    rendered 5 s), after `promtool check config` passes it; yields a client of its HTTP API."""
    folder.mkdir()
    config = yaml.safe_load(rendered)
    config["global"]["scrape_interval"] = "1s"
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
    check = subprocess.run(
        ["promtool", "check", "config", str(folder / "prometheus.yml")], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    port = free_port()
    process = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={folder / 'prometheus.yml'}",
            f"--storage.tsdb.path={folder / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=(folder / "prometheus.log").open("wb"),
    )
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}/api/v1", timeout=5) as api:
            yield api
    finally:
        process.terminate()
        process.wait(30)


def active_targets(api: httpx.Client) -> list[dict[str, Any]]:
    try:
        return api.get("/targets").json()["data"]["activeTargets"]
    except (httpx.HTTPError, ValueError, KeyError):
        return []


def all_up(api: httpx.Client) -> bool:
    active = active_targets(api)
    return bool(active) and all(t["health"] == "up" for t in active)


def _render(graph: Graph, fmt: str) -> str:
    rendered = run_cli(["render", str(graph.file), "-f", fmt, *graph.overrides])
    assert rendered.returncode == 0, rendered.stderr
    return rendered.stdout


@contextmanager
def scraping(graph: Graph) -> Iterator[httpx.Client]:
    """Prometheus on the running graph's `render -f prometheus`, once every target is up."""
    with prometheus(_render(graph, "prometheus"), graph.file.parent / "prometheus") as api:
        wait_for(lambda: all_up(api), 30, "every scrape target up")
        yield api


def dashboard_expressions(graph: Graph) -> list[str]:
    """The PromQL of every panel of the graph's `render -f grafana`."""
    return [t["expr"] for p in json.loads(_render(graph, "grafana"))["panels"] for t in p["targets"]]


def wait_for_data(api: httpx.Client, exprs: list[str], timeout: float) -> None:
    """Until every expression returns a series; AssertionError naming those that never did."""
    deadline = time.monotonic() + timeout
    while empty := [e for e in exprs if not api.get("/query", params={"query": e}).json()["data"]["result"]]:
        assert time.monotonic() < deadline, f"no data after {timeout} s for {empty}"
        time.sleep(0.5)
