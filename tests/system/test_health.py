"""Instance health end to end: a frontend health-checks its workers (runtime/health.py), so one that
wedges (alive and registered, but answering nothing) leaves routing and comes back when it
recovers; a worker at its `--max-inflight` answers `overloaded` and the frontend sends the
request elsewhere. Real processes over file discovery and the tcp request plane."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.processes import DYNGRAPH, ServerProcess, WorkerProcess, embedded_planes_env
from tests.support.scripts import SCRIPTS
from tests.support.waiting import wait_for

ENDPOINT = "dyn://health.pytok.generate"
ENGINE = SCRIPTS / "wedge_engine.py"
INTERVAL_S, TIMEOUT_S = 1.0, 1.0


def _env(tmp_path: Path) -> dict[str, str]:
    return embedded_planes_env(tmp_path)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[list[Any]]:
    started: list[Any] = []
    yield started
    for proc in started:
        proc.stop()


def _frontend(tmp_path: Path, procs: list[Any], *args: str) -> ServerProcess:
    front = ServerProcess(
        [
            "out=auto",
            "--router-mode",
            "round-robin",
            "--health-check-interval-s",
            str(INTERVAL_S),
            "--health-check-timeout-s",
            str(TIMEOUT_S),
            *args,
        ],
        env=_env(tmp_path),
        log_dir=tmp_path,
    )
    procs.append(front)
    front.wait_ready(path="/live", timeout=60)
    return front


def _worker(tmp_path: Path, procs: list[Any], model: Path, env: dict[str, str], *args: str) -> WorkerProcess:
    argv = [*DYNGRAPH, "run", f"in={ENDPOINT}", f"out=pytok:{ENGINE}", str(model), *args]
    worker = WorkerProcess(argv, env={**_env(tmp_path), **env}, log_dir=tmp_path)
    procs.append(worker)
    return worker


def _instance(worker: WorkerProcess) -> str:
    wait_for(worker.instance, 60, "the worker to serve")
    return worker.instance() or ""


def _health(front: ServerProcess, model: str) -> tuple[int, dict[str, Any]]:
    resp = httpx.get(f"{front.base_url}/health", timeout=5)
    return resp.status_code, resp.json()["details"].get(model, {})


def _states(front: ServerProcess, model: str) -> dict[str, str]:
    _, details = _health(front, model)
    return {
        i["instance_id"]: i["state"] for i in details.get("instances", []) + details.get("unavailable", [])
    }


def _sent(front: ServerProcess, model: str) -> dict[str, int]:
    _, details = _health(front, model)
    return {
        i["instance_id"]: i["requests"] for i in details.get("instances", []) + details.get("unavailable", [])
    }


async def _requests(base_url: str, model: str, n: int, max_tokens: int = 4) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=20) as client:

        async def one(i: int) -> httpx.Response:
            body = {"model": model, "prompt": f"request {i}", "max_tokens": max_tokens}
            return await client.post(f"{base_url}/v1/completions", json=body)

        return await asyncio.gather(*(one(i) for i in range(n)))


def _ok(responses: list[httpx.Response]) -> bool:
    return all(r.status_code == 200 for r in responses)


def test_a_wedged_worker_leaves_routing_and_comes_back(
    tiny_model: Path, tmp_path: Path, procs: list[Any]
) -> None:
    model = tiny_model.name
    front = _frontend(tmp_path, procs)
    wedge = tmp_path / "wedge-a"
    a = _instance(_worker(tmp_path, procs, tiny_model, {"WEDGE_FILE": str(wedge)}))
    b = _instance(_worker(tmp_path, procs, tiny_model, {"WEDGE_FILE": str(tmp_path / "wedge-b")}))
    wait_for(lambda: _states(front, model) == {a: "healthy", b: "healthy"}, 30, "both workers healthy")
    assert _ok(asyncio.run(_requests(front.base_url, model, 6)))
    assert all(n > 0 for n in _sent(front, model).values())

    wedge.touch()
    started = time.monotonic()
    wait_for(lambda: _states(front, model).get(a) == "unhealthy", 15, "the wedged worker to turn unhealthy")
    took = time.monotonic() - started
    assert took < INTERVAL_S + TIMEOUT_S + 3.0, took
    status, details = _health(front, model)
    assert status == 200 and details["status"] == "healthy"
    (entry,) = [i for i in details["unavailable"] if i["instance_id"] == a]
    assert entry["reason"] == f"no answer within {TIMEOUT_S:g}s" and entry["since"] > 0
    assert entry["last_check"]["ok"] is False
    assert [i["instance_id"] for i in details["instances"]] == [b]
    before = _sent(front, model)
    responses = asyncio.run(_requests(front.base_url, model, 12))
    assert _ok(responses), [r.text for r in responses if r.status_code != 200]
    after = _sent(front, model)
    assert after[a] == before[a] and after[b] == before[b] + 12

    wedge.unlink()
    started = time.monotonic()
    wait_for(lambda: _states(front, model).get(a) == "healthy", 15, "the recovered worker to turn healthy")
    assert time.monotonic() - started < 2 * INTERVAL_S + TIMEOUT_S + 3.0
    before = _sent(front, model)
    assert _ok(asyncio.run(_requests(front.base_url, model, 8)))
    assert _sent(front, model)[a] > before[a]


def test_a_worker_at_its_inflight_cap_sends_requests_elsewhere(
    tiny_model: Path, tmp_path: Path, procs: list[Any]
) -> None:
    model = tiny_model.name
    front = _frontend(tmp_path, procs, "--migration-limit", "3")
    slow = {"TOKEN_DELAY_S": "0.1"}
    peaks = {name: tmp_path / f"peak-{name}" for name in ("a", "b")}
    a = _instance(
        _worker(tmp_path, procs, tiny_model, {**slow, "PEAK_FILE": str(peaks["a"])}, "--max-inflight", "1")
    )
    b = _instance(
        _worker(tmp_path, procs, tiny_model, {**slow, "PEAK_FILE": str(peaks["b"])}, "--max-inflight", "3")
    )
    wait_for(lambda: _states(front, model) == {a: "healthy", b: "healthy"}, 30, "both workers")

    # 4 at once, each ~2 s: round-robin alone would give each worker 2; a takes 1, b the rest.
    responses = asyncio.run(_requests(front.base_url, model, 4, max_tokens=20))
    assert _ok(responses), [r.text for r in responses if r.status_code != 200]
    assert peaks["a"].read_text() == "1" and peaks["b"].read_text() == "3"
    sent = _sent(front, model)
    assert sent[a] + sent[b] >= 5  # a refused try was re-sent (health checks are not counted)
    # Both full: the excess is answered 503 `overloaded` at once, not queued.
    started = time.monotonic()
    responses = asyncio.run(_requests(front.base_url, model, 6, max_tokens=20))
    codes = sorted(r.status_code for r in responses)
    assert codes == [200] * 4 + [503] * 2, codes
    refused = [r for r in responses if r.status_code == 503]
    assert all("requests in flight" in r.json()["error"]["message"] for r in refused)
    assert time.monotonic() - started < 15
    metrics = httpx.get(f"{front.base_url}/metrics", timeout=5).text
    migrations = [
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("dynamo_frontend_model_migration_total{")
    ]
    assert sum(migrations) == 0  # going elsewhere before the first token is not a migration
    assert all(state == "healthy" for state in _states(front, model).values())
