"""Frontend + workers in separate processes, over file+tcp (the embedded default) and etcd+nats."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.procs import ServerProcess, WorkerProcess

MODEL_ENDPOINT = "dyn://dist.backend.generate"
LEASE_TTL = "2"


@pytest.fixture(params=["file+tcp", "etcd+nats"])
def planes(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, str]:
    """Environment selecting discovery and request plane for every process of a test."""
    if request.param == "file+tcp":
        return {"DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(tmp_path / "kv"),
                "DYN_REQUEST_PLANE": "tcp", "DYN_LEASE_TTL": LEASE_TTL}
    etcd = request.getfixturevalue("etcd_fresh")
    nats = request.getfixturevalue("nats_server")
    return {"DYN_DISCOVERY_BACKEND": "etcd", "ETCD_ENDPOINTS": etcd.url, "DYN_REQUEST_PLANE": "nats",
            "NATS_SERVER": nats.url, "DYN_LEASE_TTL": LEASE_TTL}


@pytest.fixture
def spawn(tmp_path: Path, planes: dict[str, str]) -> Iterator[Callable[..., WorkerProcess]]:
    """Start processes with the test's planes; every one is stopped at the end."""
    started: list[WorkerProcess] = []

    def start(argv: list[str], env: dict[str, str] | None = None) -> WorkerProcess:
        proc = WorkerProcess(argv, env={**planes, **(env or {})}, log_dir=tmp_path)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()


@pytest.fixture
def frontend(tmp_path: Path, planes: dict[str, str]) -> Iterator[ServerProcess]:
    proc = ServerProcess(["out=auto", "--router-mode", "round-robin"], env=planes, log_dir=tmp_path)
    try:
        proc.wait_ready(path="/live")
        yield proc
    finally:
        proc.stop()


def echo_worker(spawn: Callable[..., WorkerProcess], model: Path, env: dict[str, str] | None = None) -> WorkerProcess:
    from tests.procs import DYNGRAPH

    return spawn([*DYNGRAPH, "run", f"in={MODEL_ENDPOINT}", "out=echo_core", str(model)], env)


def instances(frontend: ServerProcess, model: str) -> list[dict]:
    health = httpx.get(f"{frontend.base_url}/health", timeout=5).json()
    details = health.get("details", {}).get(model)
    return details["instances"] if details else []


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def chat(base_url: str, model: str, text: str, **kw: object) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "nvext": {"ignore_eos": True}, **kw}
    return httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=30)


async def _load(base_url: str, model: str, n: int, concurrency: int) -> list[int]:
    """n requests with `concurrency` in flight; returns the status codes."""
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=30) as client:
        async def one(i: int) -> int:
            async with sem:
                body = {"model": model, "messages": [{"role": "user", "content": f"request {i}"}],
                        "max_tokens": 8}
                try:
                    return (await client.post(f"{base_url}/v1/chat/completions", json=body)).status_code
                except httpx.TransportError:
                    return 0
        return await asyncio.gather(*(one(i) for i in range(n)))


def test_round_robin_spreads_and_a_killed_worker_leaves_routing(
    tiny_model: Path, spawn: Callable[..., WorkerProcess], frontend: ServerProcess
) -> None:
    model = tiny_model.name
    workers = [echo_worker(spawn, tiny_model) for _ in range(3)]
    wait_for(lambda: len(instances(frontend, model)) == 3, 20, "3 worker instances")
    codes = asyncio.run(_load(frontend.base_url, model, 300, 8))
    assert codes.count(200) == 300
    counts = [inst["requests"] for inst in instances(frontend, model)]
    assert sum(counts) == 300
    assert all(80 <= c <= 120 for c in counts), counts

    workers[0].kill9()
    # Requests keep succeeding: the dead instance is dropped on its first connection failure
    # (the request is re-sent elsewhere) or when its lease expires, whichever comes first.
    codes = asyncio.run(_load(frontend.base_url, model, 100, 4))
    assert codes.count(200) == 100, codes
    wait_for(lambda: len(instances(frontend, model)) == 2, 10, "the killed instance to leave")
    before = {i["instance_id"]: i["requests"] for i in instances(frontend, model)}
    codes = asyncio.run(_load(frontend.base_url, model, 60, 4))
    assert codes.count(200) == 60
    after = {i["instance_id"]: i["requests"] for i in instances(frontend, model)}
    assert set(after) == set(before) and sum(after.values()) - sum(before.values()) == 60


def test_models_follow_workers(tiny_model: Path, spawn: Callable[..., WorkerProcess], frontend: ServerProcess) -> None:
    model = tiny_model.name

    def listed() -> list[str]:
        return [m["id"] for m in httpx.get(f"{frontend.base_url}/v1/models", timeout=5).json()["data"]]

    assert listed() == []
    worker = echo_worker(spawn, tiny_model)
    wait_for(lambda: model in listed(), 20, "the model to be listed")  # includes the worker's start-up
    late = echo_worker(spawn, tiny_model)
    wait_for(lambda: len(instances(frontend, model)) == 2, 20, "the late worker")
    assert chat(frontend.base_url, model, "hello").status_code == 200

    worker.kill9()
    late.kill9()
    took = wait_for(lambda: model not in listed(), 10, "the model to leave /v1/models")
    assert took <= float(LEASE_TTL) + 2.0


def test_new_worker_is_listed_within_a_second(
    tiny_model: Path, spawn: Callable[..., WorkerProcess], frontend: ServerProcess, tmp_path: Path
) -> None:
    """Time from the worker's registration (its log line) to /v1/models showing the model."""
    worker = echo_worker(spawn, tiny_model)
    wait_for(lambda: "serving model" in worker.log(), 20, "the worker to register")
    registered = time.monotonic()
    wait_for(lambda: bool(httpx.get(f"{frontend.base_url}/v1/models").json()["data"]), 5, "the model")
    assert time.monotonic() - registered < 1.0
