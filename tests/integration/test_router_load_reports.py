"""The KV router hears the workers' load reports over the event plane: a worker busy with work
that another frontend sent holds this router's queue, and frees it when it reports the work done
or stops reporting (a stale report pins nobody). Real parts: the worker-side `KvEventPublisher`,
the in-process event plane, the router's own subscription."""

from __future__ import annotations

import asyncio

import pytest

from dynamo_graph.router.config import RouterConfig
from dynamo_graph.router.kv.protocols import LoadMetrics
from dynamo_graph.router.kv.publisher import KvEventPublisher
from dynamo_graph.router.kv.router import KvRouter
from dynamo_graph.runtime.context import Context
from dynamo_graph.runtime.events import create_event_publisher
from dynamo_graph.runtime.runtime import DistributedRuntime
from tests.support.waiting import wait_for_async

NS, COMP, WORKER = "loadrep", "backend", 0x51
BATCH = 2048


@pytest.fixture
async def plane(monkeypatch: pytest.MonkeyPatch):
    """A router subscribed to channel NS/COMP and the worker's publisher on it."""
    monkeypatch.setenv("DYN_EVENT_PLANE", "inproc")
    router = KvRouter(16, RouterConfig(use_kv_events=False, queue_threshold=0.5), seed=0)
    router.add_worker(WORKER, {"max_num_batched_tokens": BATCH})
    await router.subscribe(DistributedRuntime(discovery=None, static=True), NS, COMP)
    publisher = KvEventPublisher(
        await create_event_publisher(namespace=NS, component=COMP, publisher_id=WORKER), WORKER
    )
    yield router, publisher
    await publisher.close()
    await router.close()


def report(prefill_tokens: int, waiting: int) -> LoadMetrics:
    return LoadMetrics(WORKER, 64, 1024, waiting, 1, prefill_tokens=prefill_tokens)


async def test_another_frontends_work_holds_the_queue_until_the_worker_reports_it_done(
    plane, monkeypatch: pytest.MonkeyPatch
) -> None:
    router, publisher = plane
    rechecks: list[float] = []  # the queue's periodic rechecks, counted to wait for them, not for a time
    recheck = router.queue._rechecked

    def counted() -> None:
        rechecks.append(asyncio.get_running_loop().time())
        recheck()

    monkeypatch.setattr(router.queue, "_rechecked", counted)
    publisher.load(report(1500, 2))  # 1500 > 0.5 * 2048: busy, though this router sent nothing
    await wait_for_async(lambda: router.prefill_tokens((WORKER, 0)) == 1500, 5, "the load report")
    assert router.free_ranks([WORKER]) == 0 and router.sequences.prefill_tokens((WORKER, 0)) == 0
    held = asyncio.create_task(router.admit(0, Context(), [WORKER]))
    await wait_for_async(lambda: len(rechecks) >= 2, 5, "two rechecks of the queue")
    assert not held.done() and len(router.queue or ()) == 1  # still busy
    publisher.load(report(200, 0))  # the other frontend's prompts are computed
    assert await asyncio.wait_for(held, 5)
    router.dispatched()
    # The predictive cost sees the reported backlog too.
    assert router.model.backlog_seconds((WORKER, 0), router.sequences) > 0


async def test_a_worker_that_stops_reporting_does_not_hold_the_queue(plane) -> None:
    router, publisher = plane
    router.model.reported.max_age_s = 0.5
    publisher.load(report(5000, 9))  # its last words, then silence
    await wait_for_async(lambda: router.free_ranks([WORKER]) == 0, 5, "the load report")
    held = asyncio.create_task(router.admit(0, Context(), [WORKER]))
    await wait_for_async(lambda: len(router.queue or ()) == 1, 5, "the request to queue")
    assert not held.done()
    assert await asyncio.wait_for(held, 5)  # released once the report is older than 0.5 s
    router.dispatched()
    assert router.prefill_tokens((WORKER, 0)) == 0
