"""The kv router's cost, selection and in-flight bookkeeping."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamo_graph.router.config import RouterConfig
from dynamo_graph.router.kv.cost import Choice, score_workers, select
from dynamo_graph.router.kv.hashing import local_block_hashes, sequence_hashes
from dynamo_graph.router.kv.router import KvRouter
from dynamo_graph.router.kv.sequences import ActiveSequences

BS = 4


def seq_of(tokens: list[int]) -> list[int]:
    return sequence_hashes(local_block_hashes(tokens, BS))


def test_bookkeeping_follows_route_first_token_and_end():
    seqs = ActiveSequences()
    blocks = seq_of(list(range(12)))  # 3 blocks
    seqs.add("a", (1, 0), blocks, prefill_tokens=12)
    seqs.add("b", (1, 0), [*blocks[:2], 999], prefill_tokens=4)  # shares two blocks, own partial
    assert seqs.prefill_tokens((1, 0)) == 16
    assert seqs.active_blocks((1, 0)) == 4  # shared blocks count once
    seqs.prefill_completed("a")
    seqs.prefill_completed("a")  # twice is harmless
    assert seqs.prefill_tokens((1, 0)) == 4
    seqs.free("b")
    assert seqs.active_blocks((1, 0)) == 3 and seqs.prefill_tokens((1, 0)) == 0
    seqs.free("a")
    seqs.free("unknown")
    assert seqs.active_blocks((1, 0)) == 0 and len(seqs) == 0


def test_prefix_depth_of_in_flight_blocks():
    seqs = ActiveSequences()
    prompt = list(range(40))  # 10 blocks
    seqs.add("a", (7, 0), seq_of(prompt[:24]), prefill_tokens=24)  # holds the first 6 blocks
    assert seqs.prefix_depth((7, 0), seq_of(prompt)) == 6
    assert seqs.prefix_depth((7, 0), seq_of([99, *prompt[1:]])) == 0  # differs in block 0
    assert seqs.prefix_depth((8, 0), seq_of(prompt)) == 0
    seqs.remove_worker(7)
    assert seqs.prefix_depth((7, 0), seq_of(prompt)) == 0


@settings(max_examples=150, deadline=None)
@given(
    steps=st.lists(
        # (request, document, blocks of it, leading blocks booked as a chain, whether it leaves)
        st.tuples(
            st.integers(0, 5), st.integers(0, 3), st.integers(0, 12), st.integers(-2, 14), st.booleans()
        ),
        max_size=40,
    )
)
def test_booking_shared_chains_holds_exactly_the_blocks_of_every_request(steps) -> None:
    """Whatever leading blocks requests book as a shared chain, and in whatever order they come
    and go, the held blocks (what the cost and the prefix depth read) are the union of the
    in-flight requests' blocks on each worker, as booking every block one by one gives."""
    documents = [seq_of(list(range(d * 1000, d * 1000 + 12 * BS))) for d in range(4)]
    seqs = ActiveSequences()
    in_flight: dict[str, tuple[tuple[int, int], list[int]]] = {}
    for request, document, length, shared, leave in steps:
        name = f"r{request}"
        if leave:
            seqs.free(name)
            in_flight.pop(name, None)
        else:
            key = (request % 2, 0)
            blocks = [*documents[document][:length], 10_000 + request]  # and a block of its own
            seqs.add(name, key, blocks, prefill_tokens=length, shared=shared)
            in_flight[name] = (key, blocks)
        for key in ((0, 0), (1, 0)):
            want = {b for k, blocks in in_flight.values() if k == key for b in blocks}
            load = seqs.loads.get(key)
            assert set(load.blocks if load else ()) == want
            assert seqs.active_blocks(key) == len(want)
            for doc in documents:
                depth = next((i for i, b in enumerate(doc) if b not in want), len(doc))
                assert seqs.prefix_depth(key, doc) == depth


def test_cost_matches_dynamos_worked_example():
    """Dynamo's cost: (prefill 8, decode 10) = 18, (5, 5) = 10, (2, 9) = 11 -> the second wins."""
    seqs = ActiveSequences()
    # An empty request (isl 0) leaves only the workers' own load in the cost.
    for worker, (prefill_blocks, decode_blocks) in enumerate([(8, 10), (5, 5), (2, 9)]):
        blocks = [worker * 1000 + i for i in range(decode_blocks)]
        seqs.add(f"r{worker}", (worker, 0), blocks, prefill_blocks * BS)
    choices = score_workers([(0, 0), (1, 0), (2, 0)], [], 0, BS, {}, seqs, 1.0)
    assert [c.logit for c in choices] == [18, 10, 11]
    assert select(choices, 0.0, random.Random(0)).key == (1, 0)


def test_overlap_lowers_prefill_and_decode_cost():
    seqs = ActiveSequences()
    prompt = list(range(32))  # 8 blocks
    choices = score_workers([(0, 0), (1, 0)], seq_of(prompt), 32, BS, {(1, 0): 6}, seqs, 1.0)
    by_key = {c.key: c for c in choices}
    # Tokens to compute count twice (own wait + delay to others), blocks to hold once.
    assert by_key[(0, 0)].logit == 2 * 8 + 8  # everything to compute, 8 new blocks
    assert by_key[(1, 0)].prefill_tokens == 8 and by_key[(1, 0)].logit == 2 * 2 + 8
    heavier = score_workers([(0, 0), (1, 0)], seq_of(prompt), 32, BS, {(1, 0): 6}, seqs, 3.0)
    assert {c.key: c.logit for c in heavier} == {(0, 0): 56.0, (1, 0): 20.0}


def test_in_flight_prefix_counts_as_overlap():
    """The second request of a burst meets the first one's prefix before any KV event."""
    seqs = ActiveSequences()
    prompt = list(range(32))
    seqs.add("first", (0, 0), seq_of(prompt), prefill_tokens=32)
    choices = {c.key: c for c in score_workers([(0, 0), (1, 0)], seq_of(prompt), 32, BS, {}, seqs, 1.0)}
    assert choices[(0, 0)].overlap_blocks == 8 and choices[(0, 0)].prefill_tokens == 0
    # worker 0: 32 queued tokens (8 blocks) + 8 held blocks + 0 new; worker 1: 2 * 8 + 8 new
    assert choices[(0, 0)].logit == 16 and choices[(1, 0)].logit == 24


def test_ties_go_to_the_smallest_cache_then_at_random():
    choices = [Choice((i, 0), 0, 0, 5.0) for i in range(3)]
    sizes = {(0, 0): 10, (1, 0): 3, (2, 0): 3}
    picked = Counter(select(choices, 0.0, random.Random(s), sizes.__getitem__).key for s in range(200))
    assert set(picked) == {(1, 0), (2, 0)} and min(picked.values()) > 50


def test_softmax_follows_normalised_logits():
    choices = [Choice((0, 0), 0, 0, 10.0), Choice((1, 0), 0, 0, 20.0), Choice((2, 0), 0, 0, 15.0)]
    rng = random.Random(1)
    n = 20_000
    counts = Counter(select(choices, 1.0, rng).key for _ in range(n))
    weights = [math.exp(-x) for x in (0.0, 1.0, 0.5)]
    for key, w in zip([(0, 0), (1, 0), (2, 0)], weights, strict=True):
        assert counts[key] / n == pytest.approx(w / sum(weights), abs=0.02)
    equal = [Choice((i, 0), 0, 0, 3.0) for i in range(2)]
    assert len({select(equal, 0.5, random.Random(s)).key for s in range(50)}) == 2


def test_config_rejects_negative_knobs():
    with pytest.raises(ValueError, match="kv_overlap_score_weight must be at least 0"):
        KvRouter(16, RouterConfig(kv_overlap_score_weight=-1))
    with pytest.raises(ValueError, match="temperature must be at least 0"):
        KvRouter(16, RouterConfig(temperature=-0.1))
