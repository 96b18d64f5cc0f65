"""The mocker's scheduler and KV block manager, driven step by step (no event loop, no clock)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from dynamo_graph.engines.mocker.kv_manager import KvManager
from dynamo_graph.engines.mocker.scheduler import (
    MockSequence,
    TokenSampler,
    mock_token_ids,
    sampling_seed,
)
from dynamo_graph.router.kv.hashing import local_block_hashes, sequence_hashes
from dynamo_graph.router.kv.protocols import StoredBlock
from dynamo_graph.runtime.context import Context
from tests.support.mocker_steps import VOCAB, run, scheduler, tokens_out


def seq(
    prompt: Sequence[int],
    max_tokens: int,
    *,
    min_tokens: int = 0,
    stop_ids: frozenset[int] = frozenset(),
) -> MockSequence:
    sampler = TokenSampler(sampling_seed(prompt), VOCAB, frozenset())
    return MockSequence(
        Context(), prompt, max_tokens=max_tokens, sampler=sampler, min_tokens=min_tokens, stop_ids=stop_ids
    )


def blocks_of(tokens: Sequence[int], block_size: int) -> list[StoredBlock]:
    local = local_block_hashes(tokens, block_size)
    return [StoredBlock(s, h) for s, h in zip(sequence_hashes(local), local, strict=True)]


# ---- admission -------------------------------------------------------------------------------


def test_admission_fills_up_to_the_watermark() -> None:
    sched = scheduler(block_size=4, num_gpu_blocks=100, watermark=0.1, max_num_batched_tokens=1000)
    a, b, c = seq(range(1, 201), 5), seq(range(300, 460), 5), seq(range(500, 508), 5)  # 50, 40, 2 blocks
    for s in (a, b, c):
        sched.add(s)
    sched.step()
    assert sched.running == [a, b]  # 90 blocks == (1 - 0.1) * 100
    assert list(sched.waiting) == [c]
    assert sched.kv.used == 90 and sched.kv.free == 10  # c would fit in memory, not under the watermark


def test_admission_is_head_of_line_blocking() -> None:
    sched = scheduler(block_size=4, num_gpu_blocks=100, watermark=0.1, max_num_batched_tokens=1000)
    a, b, c = seq(range(1, 201), 3), seq(range(300, 464), 3), seq(range(500, 508), 3)  # 50, 41, 2 blocks
    for s in (a, b, c):
        sched.add(s)
    sched.step()
    assert sched.running == [a]
    assert list(sched.waiting) == [b, c]  # c fits, but does not overtake b
    steps = run(sched)
    assert all(s.finished and s.generated == 3 for s in (a, b, c))
    admitted_b = next(i for i, st in enumerate(steps) if any(q is b for q, _ in st.outputs))
    admitted_c = next(i for i, st in enumerate(steps) if any(q is c for q, _ in st.outputs))
    assert admitted_b <= admitted_c


def test_without_watermark_the_same_request_is_admitted() -> None:
    sched = scheduler(block_size=4, num_gpu_blocks=100, watermark=0.0, max_num_batched_tokens=1000)
    a, b = seq(range(1, 201), 3), seq(range(300, 464), 3)
    sched.add(a)
    sched.add(b)
    sched.step()
    assert sched.running == [a, b]


def test_max_num_seqs_limits_the_batch() -> None:
    sched = scheduler(block_size=4, max_num_seqs=2)
    seqs = [seq([i + 1] * 5, 4) for i in range(3)]
    for s in seqs:
        sched.add(s)
    sched.step()
    assert sched.running == seqs[:2]
    run(sched)
    assert all(s.generated == 4 for s in seqs)


# ---- chunked prefill -------------------------------------------------------------------------


def test_a_long_prompt_is_prefilled_in_chunks_within_the_token_budget() -> None:
    sched = scheduler(block_size=4, max_num_batched_tokens=64)
    s = seq(range(1, 201), 2)
    sched.add(s)
    steps = run(sched)
    assert [st.prefill_tokens for st in steps] == [64, 64, 64, 8, 0]
    assert [len(st.outputs) for st in steps] == [0, 0, 0, 1, 1]  # first token when prefill completes
    assert [st.decoding for st in steps] == [0, 0, 0, 0, 1]
    # blocks are reported as the chunks complete them
    stored = [ev for st in steps for ev in st.events]
    expected = blocks_of(list(range(1, 201)), 4)
    assert [len(ev[2]) for ev in stored] == [16, 16, 16, 2]
    assert [b for ev in stored for b in ev[2]] == expected
    assert stored[1][1] == expected[15].block_hash  # parent = the previous chunk's last block


def test_decodes_share_the_token_budget_with_a_prefill_chunk() -> None:
    sched = scheduler(block_size=4, max_num_batched_tokens=64)
    a = seq(range(1, 9), 10)
    sched.add(a)
    sched.step()  # a prefilled, now decoding
    b = seq(range(100, 300), 2)
    sched.add(b)
    st = sched.step()
    assert st.decoding == 1 and st.prefill_tokens == 63
    assert b.num_computed == 63


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget() -> None:
    sched = scheduler(block_size=4, max_num_batched_tokens=64, enable_chunked_prefill=False)
    a = seq(range(1, 9), 3)
    sched.add(a)
    sched.step()
    b = seq(range(100, 164), 2)  # 64 new tokens; the running decode takes 1 of the budget
    sched.add(b)
    st = sched.step()
    assert st.prefill_tokens == 0 and list(sched.waiting) == [b]
    steps = run(sched)
    assert 64 in [s.prefill_tokens for s in steps] and b.generated == 2


# ---- preemption ------------------------------------------------------------------------------


def test_block_pressure_preempts_the_newest_request_which_completes_later() -> None:
    sched = scheduler(block_size=4, num_gpu_blocks=10, watermark=0.0, enable_prefix_caching=False)
    a, b = seq(range(1, 13), 20), seq(range(50, 62), 20)  # 3 blocks each, growing to 8
    sched.add(a)
    sched.add(b)
    steps = []
    while not sched.num_preemptions and len(steps) < 100:
        steps.append(sched.step())
    assert b.preemptions == 1 and a.preemptions == 0  # the newest is the victim
    assert list(sched.waiting) == [b] and sched.running == [a]
    assert sched.kv.used == a.held_blocks  # the victim's blocks are free
    steps += run(sched)
    assert a.finished and b.finished
    for s, prompt in ((a, range(1, 13)), (b, range(50, 62))):
        assert s.generated == 20
        # recomputation keeps what was generated: the stream is the one it would have been
        assert tokens_out(steps, s) == mock_token_ids(list(prompt), 20, vocab_size=VOCAB)
    assert sched.kv.used == 0


def test_a_preempted_request_is_readmitted_before_newer_ones() -> None:
    sched = scheduler(block_size=4, num_gpu_blocks=10, watermark=0.0, enable_prefix_caching=False)
    a, b = seq(range(1, 13), 20), seq(range(50, 62), 20)
    sched.add(a)
    sched.add(b)
    for _ in range(100):
        if sched.num_preemptions:
            break
        sched.step()
    c = seq(range(80, 84), 2)
    sched.add(c)
    assert list(sched.waiting) == [b, c]


# ---- prefix cache ----------------------------------------------------------------------------


def test_an_identical_prompt_reuses_cached_blocks() -> None:
    sched = scheduler(block_size=4)
    prompt = list(range(1, 11))
    a = seq(prompt, 3)
    sched.add(a)
    steps_a = run(sched)
    assert steps_a[0].outputs[0][1].cached_tokens == 0
    b = seq(prompt, 3)
    sched.add(b)
    steps_b = run(sched)
    first = steps_b[0].outputs[0][1]
    assert first.cached_tokens == 8 and steps_b[0].prefill_tokens == 2
    final = steps_b[-1].outputs[0][1]
    assert final.completion_usage is not None and final.completion_usage.cached_tokens == 8
    assert final.completion_usage.prompt_tokens == 10


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    sched = scheduler(block_size=4)
    prompt = list(range(1, 9))  # two full blocks
    for expected in (0, 4):
        s = seq(prompt, 1)
        sched.add(s)
        st = sched.step()
        assert st.outputs[0][1].cached_tokens == expected
    assert st.prefill_tokens == 4


def test_freed_blocks_are_evicted_lru_first_tail_blocks_first_with_removed_events() -> None:
    sched = scheduler(block_size=4, num_gpu_blocks=6, watermark=0.0)
    pa, pb, pc = list(range(1, 9)), list(range(11, 19)), list(range(21, 37))
    ha, hb, hc = blocks_of(pa, 4), blocks_of(pb, 4), blocks_of(pc, 4)
    events = []
    for prompt in (pa, pb):
        sched.add(seq(prompt, 1))
        events += [ev for st in run(sched) for ev in st.events]
    assert events == [("stored", None, ha, None), ("stored", None, hb, None)]
    # freed in reverse order: the tail block of a sequence goes before its head
    assert sched.kv.lru_order() == [ha[1].block_hash, ha[0].block_hash, hb[1].block_hash, hb[0].block_hash]
    assert sched.kv.used == 0 and sched.kv.cached == 4 and sched.kv.free == 2

    c = seq(pc, 1)  # 4 blocks: 2 free + the 2 least recently freed
    sched.add(c)
    events = [ev for st in run(sched) for ev in st.events]
    assert events == [("removed", [ha[1].block_hash, ha[0].block_hash]), ("stored", None, hc, None)]

    b2 = seq(pb, 1)  # hits pb's first block (its last token is recomputed), evicts the LRU (pb's tail)
    sched.add(b2)
    events = [ev for st in run(sched) for ev in st.events]
    assert b2.cached_tokens == 4
    assert events == [("removed", [hb[1].block_hash]), ("stored", hb[0].block_hash, [hb[1]], None)]

    a2 = seq(pa, 1)  # evicted: no hit
    sched.add(a2)
    run(sched)
    assert a2.cached_tokens == 0


def test_exact_kv_events_of_prefill_and_decode_blocks_match_the_router_hashes() -> None:
    sched = scheduler(block_size=4)
    prompt = list(range(1, 11))
    s = seq(prompt, 3)
    sched.add(s)
    steps = run(sched)
    generated = mock_token_ids(prompt, 3, vocab_size=VOCAB)
    router = blocks_of(prompt, 4)  # what a kv router computes from the prompt
    full = blocks_of(prompt + generated[:2], 4)  # 12 computed tokens = 3 full blocks
    assert [st.events for st in steps] == [
        [("stored", None, router, None)],  # prefill completes 2 full blocks
        [],
        [("stored", router[1].block_hash, [full[2]], None)],  # decode filled the third block
    ]
    assert tokens_out(steps, s) == generated
    assert steps[-1].outputs[0][1].finish_reason == "length"
    assert sched.kv.used == 0 and sched.kv.cached == 3


def test_two_sequences_computing_the_same_block_share_it() -> None:
    sched = scheduler(block_size=4)
    a, b = seq(range(1, 10), 2), seq(range(1, 10), 2)
    sched.add(a)
    sched.add(b)
    st = sched.step()  # both miss the cache in the same pass
    assert [ev[0] for ev in st.events] == ["stored", "stored"]  # both computed them (as vLLM reports)
    assert sched.kv.refcount(a.seq_hashes[0]) == 2
    assert sched.kv.used == 2 + 2  # the 2 shared full blocks + each one's private partial block
    run(sched)
    assert sched.kv.used == 0 and sched.kv.cached == 2


def test_without_prefix_caching_nothing_is_reused_or_reported() -> None:
    sched = scheduler(block_size=4, enable_prefix_caching=False)
    for _ in range(2):
        s = seq(range(1, 11), 3)
        sched.add(s)
        steps = run(sched)
        assert s.cached_tokens == 0
        assert all(not st.events for st in steps)
    assert sched.kv.used == 0 and sched.kv.cached == 0


# ---- stop conditions, cancellation -----------------------------------------------------------


def test_stop_token_after_min_tokens() -> None:
    prompt = list(range(1, 6))
    stream = mock_token_ids(prompt, 50, vocab_size=VOCAB)
    stop = stream[4]
    first = stream.index(stop)
    sched = scheduler(block_size=4)
    s = seq(prompt, 50, stop_ids=frozenset({stop}))
    sched.add(s)
    steps = run(sched)
    assert tokens_out(steps, s) == stream[: first + 1]
    assert steps[-1].outputs[-1][1].finish_reason == "stop"

    s2 = seq(prompt, 50, stop_ids=frozenset({stop}), min_tokens=first + 1)
    sched.add(s2)
    out = tokens_out(run(sched), s2)
    later = [i for i, t in enumerate(stream) if t == stop and i > first]
    assert len(out) == (later[0] + 1 if later else 50)


def test_cancelled_sequences_leave_and_free_their_blocks() -> None:
    sched = scheduler(block_size=4, max_num_seqs=1)
    a, b = seq(range(1, 20), 100), seq(range(30, 40), 100)
    sched.add(a)
    sched.add(b)
    sched.step()
    sched.step()
    assert sched.kv.used > 0 and list(sched.waiting) == [b]
    a.context.stop_generating()
    sched.cancel(b)
    st = sched.step()
    ended = {id(q): out for q, out in st.outputs if out.finish_reason == "cancelled"}
    assert set(ended) == {id(a), id(b)}
    assert ended[id(a)].completion_usage is not None and ended[id(a)].completion_usage.completion_tokens == 2
    assert sched.kv.used == 0 and not sched.has_work()


# ---- kv manager ------------------------------------------------------------------------------


def test_kv_manager_allocation_fails_without_side_effects_when_full() -> None:
    kv = KvManager(4, 4)
    assert kv.allocate(3)
    kv.promote(111)
    kv.release([111], 2)
    assert kv.used == 0 and kv.cached == 1 and kv.free == 3
    assert not kv.allocate(5)
    assert kv.events == [] and kv.cached == 1
    assert kv.allocate(4)
    assert kv.events == [("removed", [111])]
    assert kv.match_prefix([111], 1) == (0, 0)


@pytest.mark.parametrize("limit", [0, 1, 2])
def test_match_prefix_stops_at_the_first_miss_and_the_limit(limit: int) -> None:
    kv = KvManager(8, 4)
    kv.allocate(3)
    for h in (1, 2, 3):
        kv.promote(h)
    kv.release([3], 0)  # 1, 2 active, 3 cached
    assert kv.match_prefix([1, 2, 3], limit) == (limit, limit)
    assert kv.match_prefix([1, 2, 3, 9, 4], 5) == (3, 2)
    assert kv.match_prefix([9, 1], 2) == (0, 0)
