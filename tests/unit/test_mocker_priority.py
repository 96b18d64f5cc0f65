"""The mocker's scheduling policies (vLLM's `scheduling_policy`): the waiting queue's order, the
preemption victim, equal priorities behaving as fcfs, and the queued prefill in load metrics."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence

import pytest

from dynamo_graph.backend.protocol import PreprocessedRequest, StopConditions
from dynamo_graph.engines.mocker.args import MockerArgs, MockerArgsError
from dynamo_graph.engines.mocker.engine import MockerEngine
from dynamo_graph.engines.mocker.scheduler import (
    MockSequence,
    StepResult,
    TokenSampler,
    mock_token_ids,
    sampling_seed,
)
from dynamo_graph.llm.protocol import RoutingHints
from dynamo_graph.router.kv.protocols import LoadMetrics
from dynamo_graph.runtime.context import Context
from tests.support.mocker_steps import VOCAB, run, scheduler, tokens_out


def seq(prompt: Sequence[int], max_tokens: int, priority: int = 0) -> MockSequence:
    sampler = TokenSampler(sampling_seed(prompt), VOCAB, frozenset())
    return MockSequence(Context(), prompt, max_tokens=max_tokens, sampler=sampler, priority=priority)


def first_output_order(steps: list[StepResult], seqs: dict[str, MockSequence]) -> list[str]:
    names = {id(s): name for name, s in seqs.items()}
    order: list[str] = []
    for step in steps:
        for s, _ in step.outputs:
            name = names.get(id(s))
            if name is not None and name not in order:
                order.append(name)
    return order


def test_the_default_policy_is_priority_and_a_bad_one_is_named() -> None:
    assert MockerArgs().scheduling_policy == "priority"
    with pytest.raises(MockerArgsError, match="scheduling_policy must be one of fcfs, priority, not 'lifo'"):
        MockerArgs.from_dict({"scheduling_policy": "lifo"})


# ---- the waiting queue -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("priority", ["running", "high", "urgent-too", "low0", "low1", "low2"]),
        ("fcfs", ["running", "low0", "high", "low1", "urgent-too", "low2"]),
    ],
)
def test_waiting_requests_are_admitted_most_urgent_first_then_by_arrival(
    policy: str, expected: list[str]
) -> None:
    sched = scheduler(block_size=4, max_num_seqs=1, scheduling_policy=policy)
    seqs = {"running": seq(range(1, 9), 3)}
    sched.add(seqs["running"])
    sched.step()  # it runs; the others queue behind the one sequence slot
    arrivals = [("low0", -1), ("high", 10), ("low1", -1), ("urgent-too", 10), ("low2", -1)]
    for i, (name, priority) in enumerate(arrivals):
        seqs[name] = seq(range(100 + 10 * i, 108 + 10 * i), 2, priority)
        sched.add(seqs[name])
    queued = [name for s in sched.waiting for name, q in seqs.items() if q is s]
    assert queued == expected[1:]  # iteration shows the admission order
    steps = run(sched)
    waiters = {name: s for name, s in seqs.items() if name != "running"}
    assert first_output_order(steps, waiters) == expected[1:]
    assert all(s.generated == s.max_tokens for s in seqs.values())


# ---- preemption ------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_preemption_takes_the_least_urgent_latest_arrived_and_gives_back_its_chunk(policy: str) -> None:
    sched = scheduler(
        block_size=4, num_gpu_blocks=6, watermark=0.0, enable_prefix_caching=False, scheduling_policy=policy
    )
    low, high = seq(range(1, 9), 12), seq(range(50, 61), 12, priority=5)  # 2 and 3 blocks
    sched.add(low)
    sched.add(high)
    steps = [sched.step()]  # both prefilled: low has 9 tokens, high 12
    steps.append(sched.step())  # low takes the last free block for its 10th token
    assert sched.kv.free == 0
    st = sched.step()  # high's 14th token needs a block: someone is preempted
    assert st.preempted == 1 and st.decoding == 1
    if policy == "priority":
        # low is less urgent; it was already planned this pass, so its token is given back
        assert low.preemptions == 1 and high.preemptions == 0
        assert sched.running == [high] and list(sched.waiting) == [low]
        assert [q for q, _ in st.outputs] == [high] and low.num_computed == 0
    else:  # vLLM's fcfs: the newest running sequence, here high itself, which then waits
        assert high.preemptions == 1 and low.preemptions == 0
        assert sched.running == [low] and list(sched.waiting) == [high]
    steps += [st, *run(sched)]
    for s, prompt in ((low, range(1, 9)), (high, range(50, 61))):
        # recomputation keeps what was generated: the stream is the one it would have been
        assert s.finished and tokens_out(steps, s) == mock_token_ids(list(prompt), 12, vocab_size=VOCAB)
    assert sched.kv.used == 0


def test_a_preempted_sequence_is_recomputed_into_the_same_stream_under_priority() -> None:
    sched = scheduler(block_size=4, num_gpu_blocks=10, watermark=0.0, enable_prefix_caching=False)
    a, b, c = seq(range(1, 13), 16, priority=1), seq(range(50, 62), 16), seq(range(70, 82), 16, priority=1)
    for s in (a, b, c):
        sched.add(s)
    steps = run(sched)
    # b, the least urgent, goes first; then c, the latest of the urgent two; a never
    assert b.preemptions >= 1 and a.preemptions == 0
    for s, prompt in ((a, range(1, 13)), (b, range(50, 62)), (c, range(70, 82))):
        assert tokens_out(steps, s) == mock_token_ids(list(prompt), 16, vocab_size=VOCAB)


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_with_equal_priorities_priority_scheduling_is_exactly_fcfs(seed: int) -> None:
    """Same arrivals into an fcfs and a priority scheduler under memory pressure: the same
    batches, queues, preemptions and tokens, step by step."""
    rng = random.Random(seed)
    kw = {"block_size": 4, "num_gpu_blocks": 40, "watermark": 0.0, "max_num_batched_tokens": 48}
    fcfs, prio = scheduler(scheduling_policy="fcfs", **kw), scheduler(scheduling_policy="priority", **kw)
    twins: list[tuple[MockSequence, MockSequence]] = []
    plan = [(step, rng.randrange(3, 60), rng.randrange(1, 40)) for step in sorted(rng.sample(range(120), 40))]
    step = 0
    while plan or fcfs.has_work():
        while plan and plan[0][0] <= step:
            _, length, out = plan.pop(0)
            prompt = [rng.randrange(1, VOCAB) for _ in range(length)]
            pair = (seq(prompt, out, priority=7), seq(prompt, out, priority=7))
            twins.append(pair)
            fcfs.add(pair[0])
            prio.add(pair[1])
        index = {id(s): i for pair in twins for i, s in enumerate(pair)}
        number = {id(s): n for n, pair in enumerate(twins) for s in pair}
        a, b = fcfs.step(), prio.step()
        assert (a.prefill_tokens, a.decoding, a.preempted) == (b.prefill_tokens, b.decoding, b.preempted)
        assert [number[id(s)] for s in fcfs.running] == [number[id(s)] for s in prio.running]
        assert [number[id(s)] for s in fcfs.waiting] == [number[id(s)] for s in prio.waiting]
        outs_a = [(number[id(s)], o.token_ids, o.finish_reason) for s, o in a.outputs]
        outs_b = [(number[id(s)], o.token_ids, o.finish_reason) for s, o in b.outputs]
        assert outs_a == outs_b and all(index[id(s)] == 0 for s, _ in a.outputs)
        step += 1
        assert step < 20_000
    assert fcfs.num_preemptions == prio.num_preemptions > 0  # the pressure did preempt


# ---- load: the queued prefill ----------------------------------------------------------------


def test_prefill_backlog_counts_waiting_tokens_and_the_rest_of_partial_prefills() -> None:
    sched = scheduler(block_size=4, max_num_batched_tokens=64)
    a, b = seq(range(1, 201), 2), seq(range(300, 330), 2)
    sched.add(a)
    sched.add(b)
    assert sched.prefill_backlog() == 230
    sched.step()  # 64 of a's tokens; the budget is spent, b waits
    assert sched.prefill_backlog() == 136 + 30
    run(sched)
    assert sched.prefill_backlog() == 0


# ---- the engine: priority from the request's routing hints -----------------------------------


def request(tokens: Sequence[int], max_tokens: int, priority: int | None) -> PreprocessedRequest:
    return PreprocessedRequest(
        model="mock",
        token_ids=list(tokens),
        stop_conditions=StopConditions(max_tokens=max_tokens),
        routing=None if priority is None else RoutingHints(priority=priority),
    )


class Loads:
    """A KV event sink that keeps only load metrics."""

    def __init__(self) -> None:
        self.loads: list[LoadMetrics] = []

    def stored(self, *args: object) -> None: ...

    def removed(self, *args: object) -> None: ...

    def cleared(self, *args: object) -> None: ...

    def load(self, metrics: LoadMetrics) -> None:
        self.loads.append(metrics)


@pytest.mark.parametrize(("policy", "expected"), [("priority", ["high", "low0", "low1"]), ("fcfs", None)])
async def test_the_engine_admits_by_the_requests_priority(policy: str, expected: list[str] | None) -> None:
    sink = Loads()
    engine = MockerEngine(MockerArgs(max_num_seqs=1, scheduling_policy=policy), vocab_size=VOCAB)
    engine.kv_event_sink = sink
    await engine.start()
    order: list[str] = []

    async def send(name: str, prompt: Sequence[int], max_tokens: int, priority: int | None) -> None:
        async for _ in engine.generate(request(prompt, max_tokens, priority), Context()):
            order.append(name)
            return  # the first token is what matters; leaving frees the sequence

    try:
        tasks = [asyncio.create_task(send("blocker", [3 + i % 900 for i in range(2000)], 1, None))]
        await asyncio.sleep(0)  # the blocker is queued first and starts its ~50 ms prefill
        for name, priority in (("low0", -1), ("low1", -1), ("high", 5)):
            tasks.append(asyncio.create_task(send(name, [7, 8, 9, len(tasks)], 2, priority)))
            await asyncio.sleep(0)
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
    finally:
        await engine.cleanup()
    assert order == ["blocker", *(expected or ["low0", "low1", "high"])]
    # After the blocker's pass, the rank's load carried the prompts waiting behind it.
    assert any(m.waiting == 3 and m.prefill_tokens == 3 * 4 for m in sink.loads), sink.loads
    assert sink.loads[-1].prefill_tokens == 0
