"""The Python runtime API end to end in one process: two runtimes (a worker, a caller) sharing a
file discovery directory, talking over the tcp request plane."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dynamo_graph.runtime import Context, DistributedRuntime
from dynamo_graph.runtime.client import NoInstances
from dynamo_graph.runtime.discovery.file import FileDiscovery
from tests.support.waiting import wait_for_async


async def _runtime(kv: Path) -> DistributedRuntime:
    discovery = FileDiscovery(kv, ttl_s=2.0, poll_s=0.05)
    await discovery.start()
    return DistributedRuntime(discovery=discovery, request_plane="tcp")


@pytest.fixture
async def runtimes(tmp_path: Path) -> AsyncIterator[list[DistributedRuntime]]:
    made = [await _runtime(tmp_path / "kv") for _ in range(3)]
    yield made
    for runtime in made:
        await runtime.close(0.5)


async def _serve(runtime: DistributedRuntime, tag: str) -> None:
    async def generate(request: dict, context: Context) -> AsyncIterator[dict]:
        for i in range(request["n"]):
            yield {"from": tag, "i": i}

    endpoint = runtime.namespace("api").component("worker").endpoint("generate")
    await endpoint.start_serving(generate)


async def test_round_robin_random_and_direct(runtimes: list[DistributedRuntime]) -> None:
    worker_a, worker_b, caller = runtimes
    await _serve(worker_a, "a")
    await _serve(worker_b, "b")
    client = await caller.namespace("api").component("worker").endpoint("generate").client()
    async with asyncio.timeout(10):
        assert await client.wait_for_instances()  # returns once at least one is there
        await wait_for_async(lambda: len(client.instance_ids()) == 2, 10, "both workers")
        assert sorted(client.instance_ids()) == sorted([worker_a.instance_id, worker_b.instance_id])

        seen = []
        for _ in range(4):
            stream = await client.round_robin({"n": 3})
            items = [item async for item in stream]
            assert [item["i"] for item in items] == [0, 1, 2]
            seen.append(items[0]["from"])
        assert sorted(seen) == ["a", "a", "b", "b"] and seen[0] != seen[1]

        stream = await client.direct({"n": 1}, worker_b.instance_id)
        assert [item["from"] async for item in stream] == ["b"]
        stream = await client.random({"n": 2})
        assert len([item async for item in stream]) == 2
    await client.close()


async def test_closed_worker_leaves_the_client(runtimes: list[DistributedRuntime]) -> None:
    worker, _, caller = runtimes
    await _serve(worker, "only")
    client = await caller.namespace("api").component("worker").endpoint("generate").client()
    async with asyncio.timeout(10):
        await client.wait_for_instances()
        await worker.close(0.1)
        await wait_for_async(lambda: not client.instance_ids(), 10, "the closed worker to leave")
        with pytest.raises(NoInstances):
            await client.round_robin({"n": 1})
    await client.close()


async def test_a_request_an_instance_drops_unanswered_goes_to_another(
    runtimes: list[DistributedRuntime],
) -> None:
    """An instance that closes its connection as a request reaches it (it was leaving) answered
    nothing: the request goes to another instance instead of failing."""
    leaving, worker, caller = runtimes
    await _serve(worker, "stays")

    async def drop(request: dict, context: Context) -> AsyncIterator[dict]:
        for conn in list((await leaving.server())._connections):  # type: ignore[attr-defined]
            conn.transport.abort()
        return
        yield {}

    await leaving.namespace("api").component("worker").endpoint("generate").start_serving(drop)
    client = await caller.namespace("api").component("worker").endpoint("generate").client()
    async with asyncio.timeout(10):
        await wait_for_async(lambda: len(client.instance_ids()) == 2, 10, "both workers")
        for _ in range(4):  # the client's picker (round robin) meets the leaving one once
            stream = client.generate({"n": 2})
            assert [item["from"] async for item in stream] == ["stays", "stays"]
    await client.close()
