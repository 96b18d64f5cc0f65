"""Request migration and graceful shutdown end to end: a real frontend and mocker workers, each
its own process, over the embedded planes (file discovery, tcp). Workers are killed with -9 or
stopped with SIGTERM mid-stream; clients must see one complete stream (or, past the migration
limit, a clean error event)."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.support.mocker_cluster import Cluster
from tests.support.streaming import StreamResult, completion_body, run_one, stream_completion
from tests.support.waiting import wait_for_async


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
        await wait_for_async(lambda: sum(cluster.sent().values()) >= len(bodies), 20, "every request routed")
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
        await wait_for_async(lambda: sum(cluster.sent().values()) >= len(bodies), 20, "every request routed")
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
