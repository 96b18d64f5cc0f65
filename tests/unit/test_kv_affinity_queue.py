"""Session affinity (hard/soft, TTL), the router queue's order and bound, and the routing hints
from headers and nvext."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from dynamo_graph.frontend.errors import HTTPError, overload_status
from dynamo_graph.frontend.routing_headers import apply_routing_headers
from dynamo_graph.llm.openai import ChatCompletionRequest
from dynamo_graph.llm.preprocessor import routing_hints
from dynamo_graph.llm.protocol import PreprocessedRequest
from dynamo_graph.router.config import RouterConfig
from dynamo_graph.router.kv.affinity import SessionAffinity
from dynamo_graph.router.kv.cost import Choice
from dynamo_graph.router.kv.protocols import LoadMetrics
from dynamo_graph.router.kv.queue import RESERVE_WINDOW_S, QueueFull, RouterQueue
from dynamo_graph.router.kv.reported import ReportedLoad
from dynamo_graph.router.kv.router import KvRouter
from dynamo_graph.runtime.context import Context

BS = 16


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def choices(bound: float, other: float) -> list[Choice]:
    return [Choice((1, 0), 0, 64, bound), Choice((2, 0), 0, 64, other)]


def test_hard_affinity_keeps_the_session_whatever_the_cost():
    affinity = SessionAffinity(10, "hard")
    affinity.bind("s", (1, 0))
    assert affinity.pick("s", choices(bound=9.0, other=0.1)).key == (1, 0)
    assert affinity.pick("other", choices(9.0, 0.1)) is None


def test_soft_affinity_yields_only_when_clearly_worse():
    affinity = SessionAffinity(10, "soft")
    affinity.bind("s", (1, 0))
    assert affinity.pick("s", choices(bound=0.12, other=0.1)).key == (1, 0)  # 1.2x: stays
    assert affinity.pick("s", choices(bound=0.3, other=0.1)) is None  # 3x: yields
    assert (affinity.kept, affinity.yielded) == (1, 1)


def test_bindings_expire_after_the_ttl_since_last_use_and_leave_with_their_worker():
    clock = Clock()
    affinity = SessionAffinity(5, "hard", clock=clock)
    affinity.bind("s", (1, 0))
    affinity.bind("t", (2, 0))
    clock.now = 4
    affinity.bind("s", (1, 0))  # used again: 5 more seconds
    clock.now = 6
    assert affinity.bound("s") == (1, 0) and affinity.bound("t") is None
    affinity.remove_worker(1)
    assert affinity.bound("s") is None and len(affinity) == 0
    with pytest.raises(ValueError, match="hard or soft"):
        SessionAffinity(5, "sticky")  # type: ignore[arg-type]


def test_router_keeps_a_session_on_its_worker_across_unrelated_prompts():
    router = KvRouter(BS, RouterConfig(use_kv_events=False, session_affinity_ttl_secs=60), seed=0)
    homes = set()
    for turn in range(6):
        prompt = list(range(turn * 1000, turn * 1000 + 4 * BS))  # nothing shared between turns
        homes.add(router.route(f"r{turn}", prompt, [1, 2, 3], session_id="agent-7").key)
        router.prefill_completed(f"r{turn}")
        router.free(f"r{turn}")
    assert len(homes) == 1


def test_router_soft_affinity_moves_a_session_off_a_swamped_worker():
    config = RouterConfig(use_kv_events=False, session_affinity_ttl_secs=60, session_affinity_mode="soft")
    router = KvRouter(BS, config, seed=0)
    home = router.route("a", list(range(4 * BS)), [1, 2], session_id="s").key
    router.free("a")
    router.sequences.add("flood", home, [5], prefill_tokens=100_000)
    moved = router.route("b", list(range(100, 100 + 4 * BS)), [1, 2], session_id="s").key
    assert moved != home
    assert router.affinity is not None and router.affinity.bound("s") == moved


async def _queue_order(policy: str) -> list[str]:
    busy = {"value": True}
    queue = RouterQueue(lambda: 0 if busy["value"] else 1, policy=policy, max_size=10)  # type: ignore[arg-type]
    served: list[str] = []

    async def request(name: str, priority: int) -> None:
        assert await queue.admit(priority, Context())
        served.append(name)
        queue.routed()

    tasks = []
    for name, priority in [("low1", 0), ("high", 5), ("low2", 0), ("mid", 1)]:
        tasks.append(asyncio.create_task(request(name, priority)))
        await asyncio.sleep(0)
    await asyncio.sleep(0.01)
    assert served == [] and len(queue) == 4
    busy["value"] = False
    queue.pump()
    await asyncio.gather(*tasks)
    return served


async def test_queue_serves_by_priority_then_arrival():
    assert await _queue_order("priority") == ["high", "mid", "low1", "low2"]


async def test_fcfs_queue_ignores_priorities():
    assert await _queue_order("fcfs") == ["low1", "high", "low2", "mid"]


async def test_queue_refuses_past_its_bound_and_lets_stopped_requests_go():
    queue = RouterQueue(lambda: 0, max_size=2)
    contexts = [Context(), Context()]
    waiting = [asyncio.create_task(queue.admit(0, ctx)) for ctx in contexts]
    await asyncio.sleep(0.01)
    with pytest.raises(QueueFull) as refused:  # no more urgent than those waiting
        await queue.admit(0, Context())
    assert refused.value.retry_after_s >= 1 and queue.rejected == 1
    contexts[0].stop_generating()  # its client went away
    assert await waiting[0] is False
    assert len(queue) == 1
    waiting[1].cancel()  # its deadline passed
    with pytest.raises(asyncio.CancelledError):
        await waiting[1]
    assert len(queue) == 0


async def test_a_free_rank_admits_at_once_and_a_dispatch_waits_for_the_previous_booking():
    busy = {"value": False}
    queue = RouterQueue(lambda: 0 if busy["value"] else 1)
    assert await queue.admit(0, Context())  # in transit until routed
    second = asyncio.create_task(queue.admit(0, Context()))
    await asyncio.sleep(0.01)
    assert not second.done()  # the first has not booked its load yet
    queue.routed()
    assert await second


async def test_router_saturation_follows_the_threshold():
    config = RouterConfig(use_kv_events=False, queue_threshold=0.5)
    router = KvRouter(BS, config, seed=0)
    router.add_worker(1, {"max_num_batched_tokens": 200})  # busy past 0.5 * 200 = 100 tokens
    assert await router.admit(0, Context(), [1])
    router.route("a", list(range(8 * BS)), [1])  # 128 tokens to prefill on the only worker
    router.dispatched()
    assert router.free_ranks() == 0
    held = asyncio.create_task(router.admit(0, Context(), [1]))
    await asyncio.sleep(0.01)
    assert not held.done()
    router.prefill_completed("a")  # backlog gone: the held request goes
    assert await held


async def test_a_reserve_keeps_a_worker_free_of_ordinary_prefill_for_urgent_requests():
    """Threshold 0, reserve 1, two workers. Without urgent traffic nothing is held back; once an
    urgent request came, ordinary ones go only while both workers are free, urgent ones whenever
    one is, and a waiting urgent request goes first to a worker that frees."""
    config = RouterConfig(use_kv_events=False, queue_threshold=0.0, queue_reserve=1)
    router = KvRouter(BS, config, seed=0)
    for worker in (1, 2):
        router.add_worker(worker, {"max_num_batched_tokens": 200})

    async def admitted(priority: int, request_id: str) -> int:
        assert await router.admit(priority, Context(), [1, 2])
        first = 1000 * len(router.sequences)
        choice = router.route(request_id, list(range(first, first + 4 * BS)), [1, 2])
        router.dispatched()
        return choice.key[0]

    workers = {await admitted(0, "a"), await admitted(0, "b")}  # no urgent traffic: both used
    assert workers == {1, 2}
    urgent = asyncio.create_task(admitted(5, "u"))
    await asyncio.sleep(0.01)
    assert not urgent.done()  # no worker free at all
    router.prefill_completed("a")
    await urgent
    ordinary = asyncio.create_task(admitted(0, "c"))
    router.prefill_completed("b")  # one worker free: the reserve, now that urgent requests come
    await asyncio.sleep(0.01)
    assert not ordinary.done()
    await admitted(5, "v")  # urgent: at once, to the free worker
    router.prefill_completed("u")
    await asyncio.sleep(0.01)
    assert not ordinary.done()
    router.prefill_completed("v")  # both free: more than the reserve
    await ordinary


async def test_the_reserve_lapses_when_urgent_requests_stop_coming():
    clock = Clock()
    free = {"ranks": 1}
    queue = RouterQueue(lambda: free["ranks"], reserve=1, clock=clock)
    assert await queue.admit(3, Context())  # urgent: one free rank is enough
    queue.routed()
    ordinary = asyncio.create_task(queue.admit(0, Context()))
    await asyncio.sleep(0.01)
    assert not ordinary.done()  # one free rank is the reserve
    clock.now = RESERVE_WINDOW_S + 1  # no urgent request for a while
    queue.pump()
    assert await ordinary


def test_routing_hints_from_nvext_and_headers_override_them():
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "nvext": {"agent_hints": {"priority": 3}, "agent_context": {"session_id": "body-session"}},
    }
    request = msgspec.json.decode(msgspec.json.encode(body), type=ChatCompletionRequest)
    hints = routing_hints(request.nvext)
    assert hints is not None and (hints.session_id, hints.priority) == ("body-session", 3)
    pre = PreprocessedRequest(model="m", token_ids=[1], routing=hints)
    apply_routing_headers(pre, [(b"x-session-id", b"header-session"), (b"x-dynamo-request-priority", b"-2")])
    assert pre.routing is not None and (pre.routing.session_id, pre.routing.priority) == (
        "header-session",
        -2,
    )
    flat = msgspec.json.decode(b'{"priority": 7}', type=type(request.nvext))
    assert routing_hints(flat).priority == 7  # type: ignore[union-attr]


@pytest.mark.parametrize("value", [b"high", b"1.5", b"99999999999"])
def test_a_bad_priority_header_is_a_400_naming_it(value: bytes):
    with pytest.raises(HTTPError) as err:
        apply_routing_headers(
            PreprocessedRequest(model="m", token_ids=[1]), [(b"x-dynamo-request-priority", value)]
        )
    assert err.value.status == 400 and err.value.param == "x-dynamo-request-priority"


def test_overload_status_is_529_unless_told_503(monkeypatch: pytest.MonkeyPatch):
    assert overload_status() == 529
    monkeypatch.setenv("DYN_HTTP_OVERLOAD_STATUS_CODE", "503")
    assert overload_status() == 503
    err = HTTPError.from_engine_error(QueueFull("full"))
    assert err.status == 503 and err.headers == [(b"retry-after", b"1")]


async def test_a_full_priority_queue_refuses_its_least_urgent_newest_waiter_for_a_more_urgent_one():
    queue = RouterQueue(lambda: 0, max_size=2)
    old_low = asyncio.create_task(queue.admit(0, Context()))
    await asyncio.sleep(0)
    new_low = asyncio.create_task(queue.admit(0, Context()))
    await asyncio.sleep(0)
    high = asyncio.create_task(queue.admit(5, Context()))
    await asyncio.sleep(0.01)
    with pytest.raises(QueueFull):
        await new_low
    assert not old_low.done() and not high.done() and len(queue) == 2
    with pytest.raises(QueueFull):  # no less urgent waiter left to push out
        await queue.admit(0, Context())
    assert queue.rejected == 2
    for task in (old_low, high):
        task.cancel()


def test_each_worker_is_busy_past_the_fraction_of_its_own_batch_and_unknown_ones_never():
    router = KvRouter(BS, RouterConfig(use_kv_events=False, queue_threshold=1.0), seed=0)
    workers = [1, 2]
    router.add_worker(1, {"max_num_batched_tokens": 64})
    router.add_worker(2, {"max_num_batched_tokens": 4096, "data_parallel_size": 2})
    router.route("a", list(range(100)), [1])  # 100 > 1.0 * 64: worker 1 is busy
    assert router.free_ranks(workers) > 0  # worker 2's ranks are not
    router.route("b", list(range(1000, 6000)), [2])
    router.route("c", list(range(9000, 14000)), [2])
    assert {router.sequences.prefill_tokens((2, r)) for r in (0, 1)} == {5000}
    assert router.free_ranks(workers) == 0  # both ranks past 4096, and worker 1 past 64
    router.add_worker(3, None)  # says nothing of its batch: 10,000,000, never busy
    router.route("d", list(range(20000, 40000)), [3])
    assert router.free_ranks([1, 2, 3]) > 0
    router.remove_worker(3)
    assert router.free_ranks(workers) == 0 and 3 not in router.max_batched_tokens


def test_a_workers_reported_backlog_counts_until_it_goes_stale():
    """Work another frontend sent shows only in the worker's load metrics; a report older than
    the bound no longer pins the worker as busy."""
    clock = Clock()
    router = KvRouter(BS, RouterConfig(use_kv_events=False, queue_threshold=0.5), seed=0)
    router.model.reported = ReportedLoad(max_age_s=5.0, clock=clock)
    router.add_worker(1, {"max_num_batched_tokens": 1000})
    router.route("mine", list(range(10)), [1])  # 10 tokens booked here
    assert router.free_ranks() > 0
    router.model.reported.update(LoadMetrics(1, 40, 1024, 3, 1, prefill_tokens=900))
    assert router.prefill_tokens((1, 0)) == 900 and router.free_ranks() == 0
    assert router.model.backlog_seconds((1, 0), router.sequences) == router.model.fit((1, 0)).predict(900, 40)
    clock.now = 5.5  # the worker went quiet
    assert router.prefill_tokens((1, 0)) == 10 and router.free_ranks() > 0


async def test_wspt_serves_the_highest_priority_per_uncached_token_first():
    """Dynamo's weighted shortest processing time: (1 + priority) / uncached tokens, highest
    first, arrival order among equals; negative priorities count as 0."""
    busy = {"value": True}
    queue = RouterQueue(lambda: 0 if busy["value"] else 1, policy="wspt")
    order: list[str] = []

    async def request(name: str, priority: int, tokens: int) -> None:
        assert await queue.admit(priority, Context(), lambda: tokens)
        order.append(name)
        queue.routed()

    arrivals = [
        ("long", 0, 4000),  # 1/4000
        ("short", 0, 100),  # 1/100
        ("cached", 0, 1),  # 1/1: all but one token cached on some worker
        ("long-urgent", 3, 4000),  # 4/4000 = 1/1000
        ("negative", -5, 100),  # as priority 0: 1/100, after "short"
        ("short-urgent", 1, 100),  # 2/100
    ]
    tasks = []
    for name, priority, tokens in arrivals:
        tasks.append(asyncio.create_task(request(name, priority, tokens)))
        await asyncio.sleep(0)
    await asyncio.sleep(0.01)
    assert order == [] and len(queue) == 6
    busy["value"] = False
    queue.pump()
    await asyncio.gather(*tasks)
    assert order == ["cached", "short-urgent", "short", "negative", "long-urgent", "long"]
