"""Frontend + workers in separate processes, over file+tcp (the embedded default) and etcd+nats."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.processes import DYNGRAPH, ServerProcess, WorkerProcess, free_port, run_cli
from tests.support.routing import instances
from tests.support.scripts import SCRIPTS
from tests.support.waiting import wait_for

MODEL_ENDPOINT = "dyn://dist.backend.generate"
LEASE_TTL = "2"
MODEL_WAIT_S = "1"  # a model whose workers all left stays listed this long (--model-wait-s)


@pytest.fixture(params=["file+tcp", "etcd+nats"])
def planes(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, str]:
    """Environment selecting discovery and request plane for every process of a test."""
    if request.param == "file+tcp":
        return {
            "DYN_DISCOVERY_BACKEND": "file",
            "DYN_FILE_KV": str(tmp_path / "kv"),
            "DYN_REQUEST_PLANE": "tcp",
            "DYN_LEASE_TTL": LEASE_TTL,
        }
    etcd = request.getfixturevalue("etcd_fresh")
    nats = request.getfixturevalue("nats_server")
    return {
        "DYN_DISCOVERY_BACKEND": "etcd",
        "ETCD_ENDPOINTS": etcd.url,
        "DYN_REQUEST_PLANE": "nats",
        "NATS_SERVER": nats.url,
        "DYN_LEASE_TTL": LEASE_TTL,
    }


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
    proc = ServerProcess(
        ["out=auto", "--router-mode", "round-robin", "--model-wait-s", MODEL_WAIT_S],
        env=planes,
        log_dir=tmp_path,
    )
    try:
        proc.wait_ready(path="/live")
        yield proc
    finally:
        proc.stop()


def echo_worker(
    spawn: Callable[..., WorkerProcess], model: Path, env: dict[str, str] | None = None
) -> WorkerProcess:
    return spawn([*DYNGRAPH, "run", f"in={MODEL_ENDPOINT}", "out=echo_core", str(model)], env)


def chat(base_url: str, model: str, text: str, **kw: object) -> httpx.Response:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "nvext": {"ignore_eos": True},
        **kw,
    }
    return httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=30)


async def _load(base_url: str, model: str, n: int, concurrency: int) -> list[int]:
    """n requests with `concurrency` in flight; returns the status codes."""
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=30) as client:

        async def one(i: int) -> int:
            async with sem:
                body = {
                    "model": model,
                    "messages": [{"role": "user", "content": f"request {i}"}],
                    "max_tokens": 8,
                }
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


def test_models_follow_workers(
    tiny_model: Path, spawn: Callable[..., WorkerProcess], frontend: ServerProcess
) -> None:
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
    assert took <= float(LEASE_TTL) + float(MODEL_WAIT_S) + 2.0


@pytest.mark.serial  # times itself: run alone, not beside other test workers
def test_new_worker_is_listed_within_a_second(
    tiny_model: Path, spawn: Callable[..., WorkerProcess], frontend: ServerProcess, tmp_path: Path
) -> None:
    """Time from the worker's registration (its log line) to /v1/models showing the model."""
    worker = echo_worker(spawn, tiny_model)
    wait_for(lambda: "serving model" in worker.log(), 20, "the worker to register")
    registered = time.monotonic()
    wait_for(lambda: bool(httpx.get(f"{frontend.base_url}/v1/models").json()["data"]), 5, "the model")
    assert time.monotonic() - registered < 1.0


def test_client_disconnect_reaches_the_worker_within_100ms(
    tiny_model: Path, spawn: Callable[..., WorkerProcess], frontend: ServerProcess, tmp_path: Path
) -> None:
    log = tmp_path / "cancel.log"
    worker_script = SCRIPTS / "cancel_worker.py"
    spawn([sys.executable, str(worker_script), str(tiny_model)], {"CANCEL_LOG": str(log)})
    wait_for(lambda: len(instances(frontend, "slow")) == 1, 20, "the slow worker")
    body = {"model": "slow", "messages": [{"role": "user", "content": "hello"}], "stream": True}
    with (
        httpx.Client(timeout=10) as http,
        http.stream("POST", f"{frontend.base_url}/v1/chat/completions", json=body) as resp,
    ):
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")
        closed_at = time.time()
    wait_for(lambda: log.exists() and log.read_text().strip() != "", 5, "the worker to see the cancellation")
    seen_at = float(log.read_text().split()[0])
    assert seen_at - closed_at < 0.1, seen_at - closed_at


@pytest.mark.parametrize("kind", ["backend", "chat", "completion"])
def test_seed_example_worker_serves_every_model_type(
    tiny_model: Path, spawn: Callable[..., WorkerProcess], frontend: ServerProcess, kind: str
) -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "hello_worker.py"
    spawn([sys.executable, str(example), str(tiny_model), kind])
    model = f"hello-{kind}"
    wait_for(lambda: len(instances(frontend, model)) == 1, 20, f"the {kind} example worker")
    if kind == "completion":
        resp = httpx.post(
            f"{frontend.base_url}/v1/completions",
            json={"model": model, "prompt": "Tuvalu is far"},
            timeout=10,
        )
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == "Tuvalu is far"
        return
    resp = chat(frontend.base_url, model, "What is the capital of Tuvalu?")
    assert resp.status_code == 200, resp.text
    content = resp.json()["choices"][0]["message"]["content"]
    if kind == "chat":
        assert content == "What is the capital of Tuvalu?"
        assert resp.json()["usage"]["completion_tokens"] == 6
    else:  # Backend: the frontend templated and tokenized; the worker echoed the token ids
        assert "<|start_header_id|>user<|end_header_id|>\n\nWhat is the capital of Tuvalu?" in content


def test_1000_concurrent_streams_through_one_worker_do_not_cross(
    tiny_model: Path, spawn: Callable[..., WorkerProcess], frontend: ServerProcess
) -> None:
    model = tiny_model.name
    echo_worker(spawn, tiny_model)
    wait_for(lambda: len(instances(frontend, model)) == 1, 20, "the worker")

    async def run() -> list[tuple[int, str]]:
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:

            async def one(i: int) -> tuple[int, str]:
                body = {"model": model, "prompt": f"stream number {i} here", "max_tokens": 64, "stream": True}
                text = []
                async with client.stream("POST", f"{frontend.base_url}/v1/completions", json=body) as resp:
                    async for line in resp.aiter_lines():
                        if line.startswith("data: {"):
                            text.append(json.loads(line[6:])["choices"][0]["text"])
                return i, "".join(text)

            return await asyncio.gather(*(one(i) for i in range(1000)))

    results = asyncio.run(asyncio.wait_for(run(), 120))
    for i, text in results:
        assert text == f"<|begin_of_text|>stream number {i} here", (i, text)


@pytest.fixture
def etcd_planes(request: pytest.FixtureRequest) -> tuple[object, dict[str, str]]:
    etcd = request.getfixturevalue("etcd_fresh")
    nats = request.getfixturevalue("nats_server")
    env = {
        "DYN_DISCOVERY_BACKEND": "etcd",
        "ETCD_ENDPOINTS": etcd.url,
        "DYN_REQUEST_PLANE": "nats",
        "NATS_SERVER": nats.url,
        "DYN_LEASE_TTL": LEASE_TTL,
    }
    return etcd, env


def test_etcd_restart_and_outage_longer_than_the_lease(
    tiny_model: Path, tmp_path: Path, etcd_planes: tuple[object, dict[str, str]]
) -> None:
    etcd, env = etcd_planes
    model = tiny_model.name
    workers = [
        WorkerProcess(
            [*DYNGRAPH, "run", f"in={MODEL_ENDPOINT}", "out=echo_core", str(tiny_model)],
            env=env,
            log_dir=tmp_path,
        )
        for _ in range(2)
    ]
    front = ServerProcess(["out=auto"], env=env, log_dir=tmp_path)
    try:
        front.wait_ready(path="/live")
        wait_for(lambda: len(instances(front, model)) == 2, 20, "both workers")

        async def load_during_restart() -> list[int]:
            task = asyncio.create_task(_load(front.base_url, model, 200, 4))
            await asyncio.sleep(0.2)  # the restart lands while the load runs (200 requests take longer)
            await asyncio.to_thread(etcd.restart)  # type: ignore[attr-defined]
            return await task

        codes = asyncio.run(load_during_restart())
        assert codes.count(200) == 200, codes
        wait_for(lambda: len(instances(front, model)) == 2, 10, "both workers after the restart")

        etcd.stop()  # type: ignore[attr-defined]
        time.sleep(float(LEASE_TTL) + 1.5)  # the outage outlasts the lease: the TTL is what is tested
        etcd.restart()  # type: ignore[attr-defined]
        # The leases expired while etcd was down: workers must re-grant and re-register alone.
        wait_for(lambda: len(instances(front, model)) == 2, 20, "both workers to come back by themselves")
        assert chat(front.base_url, model, "after the outage").status_code == 200
    finally:
        front.stop()
        for worker in workers:
            worker.stop()


def test_static_worker_and_frontend_without_discovery(tiny_model: Path, tmp_path: Path) -> None:
    port = free_port()
    env = {"DYN_TCP_PORT": str(port), "DYN_DISCOVERY_BACKEND": "etcd", "ETCD_ENDPOINTS": "http://127.0.0.1:9"}
    # The etcd settings point nowhere: neither side may touch discovery.
    worker = WorkerProcess(
        [
            *DYNGRAPH,
            "run",
            "in=dyn://static.backend.generate",
            "out=echo_core",
            str(tiny_model),
            "--static-worker",
        ],
        env=env,
        log_dir=tmp_path,
    )
    front = ServerProcess(
        ["out=dyn://static.backend.generate", "--model-path", str(tiny_model), "--model-name", "tiny-static"],
        env={"DYN_STATIC_WORKERS": f"127.0.0.1:{port}", "DYN_HEALTH_CHECK_INTERVAL_S": "0.3"},
        log_dir=tmp_path,
    )
    try:
        wait_for(lambda: "serving model" in worker.log(), 20, "the static worker")
        front.wait_ready()
        resp = chat(front.base_url, "tiny-static", "static hello")
        assert resp.status_code == 200, resp.text
        assert "static hello" in resp.json()["choices"][0]["message"]["content"]

        # Discovery cannot vouch for a static worker: health checks keep its state.
        def checked() -> bool:
            (inst,) = instances(front, "tiny-static")
            return inst["state"] == "healthy" and bool((inst.get("last_check") or {}).get("ok"))

        wait_for(checked, 10, "a passing health check of the static worker")
    finally:
        front.stop()
        worker.stop()


def test_static_worker_needs_a_fixed_port(tiny_model: Path) -> None:
    result = run_cli(
        ["run", "in=dyn://static.backend.generate", "out=echo_core", str(tiny_model), "--static-worker"],
        env={"DYN_TCP_PORT": ""},
    )
    assert result.returncode == 2
    assert "DYN_TCP_PORT" in result.stderr


def test_worker_with_a_different_model_card_is_refused(
    tiny_model: Path, spawn: Callable[..., WorkerProcess], frontend: ServerProcess
) -> None:
    """Same model name, different card (context length): the frontend says so and never routes
    to the odd one out."""
    model = tiny_model.name
    echo_worker(spawn, tiny_model)
    wait_for(lambda: len(instances(frontend, model)) == 1, 20, "the first worker")
    odd = spawn(
        [
            *DYNGRAPH,
            "run",
            f"in={MODEL_ENDPOINT}",
            "out=echo_core",
            str(tiny_model),
            "--context-length",
            "256",
        ]
    )
    wait_for(lambda: "serving model" in odd.log(), 20, "the odd worker to register")
    wait_for(lambda: "REFUSING worker" in frontend.log(), 5, "the frontend to refuse it")
    assert len(instances(frontend, model)) == 1
    codes = asyncio.run(_load(frontend.base_url, model, 20, 4))
    assert codes.count(200) == 20
    assert sum(i["requests"] for i in instances(frontend, model)) == 20
