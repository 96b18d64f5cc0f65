"""Request migration and graceful shutdown end to end: a real frontend and mocker workers, each
its own process, over the embedded planes (file discovery, tcp). Workers are killed with -9 or
stopped with SIGTERM mid-stream; clients must see one complete stream (or, past the migration
limit, a clean error event)."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.procs import DYNGRAPH, ServerProcess, WorkerProcess, embedded_planes_env
from tests.system.test_distributed import instances, wait_for

ENDPOINT = "dyn://mig.mocker.generate"
# Below the server's keep-alive timeout (uvicorn: 5 s, as httpx's default expiry): a pooled
# connection reused just as the server closes it fails with a ReadError before any byte.
KEEPALIVE_S = 2.0
INSTANCE_RE = re.compile(r"instance ([0-9a-f]+) serving")


def planes_env(tmp_path: Path) -> dict[str, str]:
    return embedded_planes_env(tmp_path, zmq_events=True)


def mocker_args(tmp_path: Path, speedup: float) -> Path:
    """Mocker settings: ~5.7 ms of simulated decode per pass, divided by `speedup`."""
    path = tmp_path / f"mocker-{speedup:g}.json"
    path.write_text(json.dumps({"block_size": 16, "speedup_ratio": speedup, "num_gpu_blocks": 8192}))
    return path


@dataclass
class Cluster:
    """A frontend and mocker workers; workers can be killed and replaced."""

    tmp_path: Path
    model_path: Path
    env: dict[str, str]
    args_file: Path
    frontend: ServerProcess
    workers: list[WorkerProcess] = field(default_factory=list)
    retired: list[WorkerProcess] = field(default_factory=list)

    @property
    def model(self) -> str:
        return self.model_path.name

    def start_worker(
        self, env: dict[str, str] | None = None, extra_args: list[str] | None = None
    ) -> WorkerProcess:
        argv = [
            *DYNGRAPH,
            "run",
            f"in={ENDPOINT}",
            "out=mocker",
            str(self.model_path),
            "--extra-engine-args",
            str(self.args_file),
            *(extra_args or []),
        ]
        worker = WorkerProcess(argv, env={**self.env, **(env or {})}, log_dir=self.tmp_path)
        self.workers.append(worker)
        return worker

    def instance_of(self, worker: WorkerProcess) -> str | None:
        found = INSTANCE_RE.search(worker.log())
        return found.group(1) if found else None

    def routable(self) -> list[str]:
        return [i["instance_id"] for i in instances(self.frontend, self.model)]

    def wait_routable(self, n: int, timeout: float = 60.0) -> None:
        wait_for(lambda: len(self.routable()) >= n, timeout, f"{n} routable mocker workers")

    def sent(self) -> dict[str, int]:
        return {i["instance_id"]: i["requests"] for i in instances(self.frontend, self.model)}

    def worker_by_instance(self, instance: str) -> WorkerProcess:
        for worker in self.workers:
            if self.instance_of(worker) == instance:
                return worker
        raise KeyError(instance)

    def kill9(self, worker: WorkerProcess) -> None:
        worker.kill9()
        self.workers.remove(worker)
        self.retired.append(worker)

    def migrations(self) -> int:
        text = httpx.get(f"{self.frontend.base_url}/metrics", timeout=10).text
        return sum(
            int(float(line.rsplit(" ", 1)[1]))
            for line in text.splitlines()
            if line.startswith("dynamo_frontend_model_migration_total{")
        )

    def stop(self) -> None:
        self.frontend.stop()
        for worker in [*self.workers, *self.retired]:
            worker.stop()


def start_cluster(
    tmp_path: Path,
    model_path: Path,
    *,
    workers: int,
    limit: int | None,
    router: str = "round-robin",
    speedup: float = 0.25,
    frontend_env: dict[str, str] | None = None,
    frontend_args: list[str] | None = None,
) -> Cluster:
    """A frontend (`--migration-limit limit`, none if None; more flags: `frontend_args`) and
    `workers` mocker workers, routable."""
    env = planes_env(tmp_path)
    args = ["out=auto", "--router-mode", router, *(frontend_args or [])]
    if limit is not None:
        args += ["--migration-limit", str(limit)]
    frontend = ServerProcess(args, env={**env, **(frontend_env or {})}, log_dir=tmp_path)
    cluster = Cluster(tmp_path, model_path, env, mocker_args(tmp_path, speedup), frontend)
    try:
        frontend.wait_ready(path="/live", timeout=60)
        for _ in range(workers):
            cluster.start_worker()
        cluster.wait_routable(workers)
    except BaseException:
        cluster.stop()
        raise
    return cluster


# ---- a streaming client that records everything a test checks -------------------------------


@dataclass
class StreamResult:
    status: int = 0
    text: str = ""
    chunks: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    errors: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    body: str = ""  # the body of a non-200 answer
    ttft: float | None = None
    latency: float = 0.0
    exception: str | None = None

    @property
    def token_counts(self) -> tuple[int, int, int] | None:
        """(prompt, completion, total) tokens; cached tokens depend on the workers' caches."""
        u = self.usage
        return None if u is None else (u["prompt_tokens"], u["completion_tokens"], u["total_tokens"])

    @property
    def completion_tokens(self) -> int | None:
        return None if self.usage is None else self.usage.get("completion_tokens")

    def complete(self, max_tokens: int) -> bool:
        return (
            self.status == 200
            and self.done
            and not self.errors
            and self.finish_reasons == ["length"]
            and self.completion_tokens == max_tokens
        )


def completion_body(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def stream_completion(
    http: httpx.AsyncClient,
    base_url: str,
    body: dict[str, Any],
    on_chunk: Callable[[int], Any] | None = None,
) -> StreamResult:
    """One streaming /v1/completions request; `on_chunk(n)` is called after the n-th content chunk."""
    result = StreamResult()
    start = time.perf_counter()
    try:
        async with http.stream("POST", f"{base_url}/v1/completions", json=body) as resp:
            result.status = resp.status_code
            if resp.status_code != 200:
                result.body = (await resp.aread()).decode(errors="replace")
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    result.done = True
                    continue
                event = json.loads(data)
                if "error" in event:
                    result.errors.append(event["error"])
                    continue
                if event.get("usage"):
                    result.usage = event["usage"]
                for choice in event.get("choices") or []:
                    if choice.get("text"):
                        if result.ttft is None:
                            result.ttft = time.perf_counter() - start
                        result.text += choice["text"]
                        result.chunks += 1
                        if on_chunk is not None:
                            on_chunk(result.chunks)
                    if choice.get("finish_reason"):
                        result.finish_reasons.append(choice["finish_reason"])
    except httpx.HTTPError as err:
        result.exception = f"{type(err).__name__}: {err}"
    finally:
        result.latency = time.perf_counter() - start
    return result


def run_one(
    base_url: str, body: dict[str, Any], on_chunk: Callable[[int], Any] | None = None
) -> StreamResult:
    async def main() -> StreamResult:
        async with httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as http:
            return await stream_completion(http, base_url, body, on_chunk)

    return asyncio.run(main())


def kill_serving_worker_after(cluster: Cluster, chunks: int) -> tuple[Callable[[int], None], list[str]]:
    """An on_chunk hook that kills -9 the worker serving the (only) request in flight."""
    before = cluster.sent()
    killed: list[str] = []

    def hook(n: int) -> None:
        if n == chunks and not killed:
            after = cluster.sent()
            serving = [i for i in after if after[i] != before.get(i, 0)]
            assert len(serving) == 1, (before, after)
            killed.append(serving[0])
            cluster.kill9(cluster.worker_by_instance(serving[0]))

    return hook, killed


MAX_TOKENS = 100


@pytest.mark.parametrize("router", ["round-robin", "kv"])
def test_kill9_mid_stream_migrates_and_the_client_sees_one_complete_stream(
    make_cluster: Callable[..., Cluster], router: str
) -> None:
    cluster = make_cluster(workers=3, limit=3, router=router)
    body = completion_body(cluster.model, "tell me a long story about migration", MAX_TOKENS)
    undisturbed = run_one(cluster.frontend.base_url, body)
    assert undisturbed.complete(MAX_TOKENS), undisturbed

    hook, killed = kill_serving_worker_after(cluster, 15)
    started = time.monotonic()
    result = run_one(cluster.frontend.base_url, body, hook)
    assert killed, "the worker was never killed"
    assert result.complete(MAX_TOKENS), result
    assert result.token_counts == undisturbed.token_counts  # original prompt, all generated tokens
    assert time.monotonic() - started < 30
    assert cluster.migrations() == 1
    assert killed[0] not in cluster.routable()


def test_kill9_with_migration_limit_zero_ends_with_an_error_event(
    make_cluster: Callable[..., Cluster],
) -> None:
    cluster = make_cluster(workers=2, limit=0)
    body = completion_body(cluster.model, "a story cut short", MAX_TOKENS)
    hook, killed = kill_serving_worker_after(cluster, 10)
    started = time.monotonic()
    result = run_one(cluster.frontend.base_url, body, hook)
    assert killed
    assert time.monotonic() - started < 20, "the stream hung"
    assert result.status == 200 and result.done and result.exception is None, result
    assert result.finish_reasons == []
    assert len(result.errors) == 1 and result.errors[0]["code"] == "disconnected", result.errors
    assert result.errors[0]["message"]
    assert cluster.migrations() == 0
    # The survivor still serves.
    again = run_one(cluster.frontend.base_url, completion_body(cluster.model, "and again", 10))
    assert again.complete(10), again


def test_without_the_frontend_flag_the_cards_limit_applies(make_cluster: Callable[..., Cluster]) -> None:
    cluster = make_cluster(workers=0, limit=None)  # no --migration-limit on the frontend
    for _ in range(2):
        cluster.start_worker(extra_args=["--migration-limit", "2"])  # in the workers' cards
    cluster.wait_routable(2)
    body = completion_body(cluster.model, "the card decides", MAX_TOKENS)
    hook, killed = kill_serving_worker_after(cluster, 10)
    result = run_one(cluster.frontend.base_url, body, hook)
    assert killed and result.complete(MAX_TOKENS), result
    assert cluster.migrations() == 1


# ---- graceful shutdown ----------------------------------------------------------------------


async def _concurrent(
    base_url: str, bodies: list[dict[str, Any]], during: Callable[[], Any]
) -> list[StreamResult]:
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(60.0), limits=httpx.Limits(max_connections=200)
    ) as http:
        tasks = [asyncio.create_task(stream_completion(http, base_url, b)) for b in bodies]
        await asyncio.sleep(0)
        await during()
        return await asyncio.gather(*tasks)


def test_sigterm_to_a_worker_under_load_loses_no_request(make_cluster: Callable[..., Cluster]) -> None:
    """A short grace (1 s) for requests of ~3 s: those still running when it ends get
    EngineShutdown and migrate; new requests stop going to the worker at once."""
    cluster = make_cluster(workers=1, limit=2, speedup=0.2)
    stopping = cluster.start_worker(env={"DYN_SHUTDOWN_GRACE_S": "1"})
    cluster.wait_routable(2)
    bodies = [completion_body(cluster.model, f"request number {i}", MAX_TOKENS) for i in range(16)]
    stopped_at: list[float] = []

    async def sigterm_soon() -> None:
        await asyncio.sleep(1.0)  # every request has started on one worker or the other
        stopping.proc.send_signal(signal.SIGTERM)
        stopped_at.append(time.monotonic())

    results = asyncio.run(_concurrent(cluster.frontend.base_url, bodies, sigterm_soon))
    bad = [r for r in results if not r.complete(MAX_TOKENS)]
    assert not bad, bad
    code = stopping.proc.wait(timeout=20)
    assert code == 0, stopping.log()
    assert "grace period of 1s over" in stopping.log()
    assert cluster.migrations() >= 1
    cluster.workers.remove(stopping)
    cluster.retired.append(stopping)
    # Nothing is routed to it any more; the survivor serves.
    again = run_one(cluster.frontend.base_url, completion_body(cluster.model, "after", 10))
    assert again.complete(10), again


def test_sigterm_with_a_long_grace_lets_requests_finish_where_they_are(
    make_cluster: Callable[..., Cluster],
) -> None:
    cluster = make_cluster(workers=1, limit=0, speedup=0.5)
    stopping = cluster.start_worker(env={"DYN_SHUTDOWN_GRACE_S": "30"})
    cluster.wait_routable(2)
    bodies = [completion_body(cluster.model, f"short {i}", 40) for i in range(8)]

    async def sigterm_soon() -> None:
        await asyncio.sleep(0.5)
        stopping.proc.send_signal(signal.SIGTERM)

    results = asyncio.run(_concurrent(cluster.frontend.base_url, bodies, sigterm_soon))
    assert all(r.complete(40) for r in results), results
    assert stopping.proc.wait(timeout=30) == 0
    assert "grace period" not in stopping.log()
    cluster.workers.remove(stopping)
    cluster.retired.append(stopping)


def test_sigterm_to_the_frontend_finishes_in_flight_requests_then_exits(
    make_cluster: Callable[..., Cluster],
) -> None:
    cluster = make_cluster(workers=1, limit=0)
    body = completion_body(cluster.model, "finish me", MAX_TOKENS)
    signalled: list[float] = []

    def hook(n: int) -> None:
        if n == 5:
            cluster.frontend.proc.send_signal(signal.SIGTERM)
            signalled.append(time.monotonic())

    result = run_one(cluster.frontend.base_url, body, hook)
    assert signalled and result.complete(MAX_TOKENS), result
    assert cluster.frontend.proc.wait(timeout=20) == 0
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{cluster.frontend.base_url}/live", timeout=2)
