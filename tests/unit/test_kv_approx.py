"""ApproxKvIndexer: the router's own routing decisions as a guess of the workers' caches."""

from __future__ import annotations

import random

import pytest

from dynamo_graph.router.kv.approx import ApproxKvIndexer
from dynamo_graph.router.kv.hashing import local_block_hashes, sequence_hashes


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def chain(n: int, seed: int = 0) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    local = [rng.getrandbits(64) for _ in range(n)]
    return local, sequence_hashes(local)


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_recorded_routing_matches_until_it_expires(clock: Clock) -> None:
    idx = ApproxKvIndexer(ttl_s=10, clock=clock)
    local, seq = chain(6)
    idx.record_routing((1, 0), local, seq)
    assert idx.find_matches(local, seq) == {(1, 0): 6}
    assert idx.find_matches(local[:4] + chain(2, 1)[0]) == {(1, 0): 4}
    assert idx.tree_size((1, 0)) == 6 and len(idx) == 6
    clock.now += 9.9
    assert idx.find_matches(local, seq) == {(1, 0): 6}
    clock.now += 0.1
    assert idx.find_matches(local, seq) == {}  # expired at now + ttl
    assert idx.tree_size((1, 0)) == 0 and len(idx) == 0 and idx.entries == 0
    assert idx.stats.expired == 6


def test_reuse_refreshes_the_expiry(clock: Clock) -> None:
    idx = ApproxKvIndexer(ttl_s=10, clock=clock)
    local, seq = chain(6)
    idx.record_routing((1, 0), local, seq)
    clock.now += 8
    idx.record_routing((1, 0), local[:3], seq[:3])  # a shorter prompt with the same prefix
    assert idx.stats.blocks_refreshed == 3
    clock.now += 5  # the first routing's blocks 3..5 expired, the refreshed 0..2 did not
    assert idx.find_matches(local, seq) == {(1, 0): 3}
    assert idx.tree_size((1, 0)) == 3
    clock.now += 5
    assert idx.find_matches(local, seq) == {}


def test_expiry_is_per_worker_key_and_explicit(clock: Clock) -> None:
    idx = ApproxKvIndexer(ttl_s=10, clock=clock)
    local, seq = chain(4)
    idx.record_routing((1, 0), local, seq)
    clock.now += 5
    idx.record_routing((1, 1), local, seq)
    idx.record_routing((2, 0), local[:2], seq[:2], now=clock.now + 1)
    assert idx.find_matches(local, seq) == {(1, 0): 4, (1, 1): 4, (2, 0): 2}
    assert idx.expire(clock.now + 6) == 4  # only (1, 0)'s blocks
    assert idx.find_matches(local, seq, now=clock.now + 6) == {(1, 1): 4, (2, 0): 2}
    assert idx.expire(clock.now + 6) == 0
    assert idx.find_matches(local, seq, now=clock.now + 100) == {}
    assert idx.entries == 0


def test_a_clock_going_backwards_keeps_expiry_order(clock: Clock) -> None:
    idx = ApproxKvIndexer(ttl_s=10, clock=clock)
    a_local, a_seq = chain(2, 1)
    b_local, b_seq = chain(2, 2)
    idx.record_routing((1, 0), a_local, a_seq, now=100)
    idx.record_routing((1, 0), b_local, b_seq, now=50)  # expires no earlier than a
    assert idx.find_matches(b_local, b_seq, now=105) == {(1, 0): 2}
    assert idx.find_matches(a_local, a_seq, now=110) == {}
    assert idx.find_matches(b_local, b_seq, now=110) == {}


def test_prune_by_size_drops_the_earliest_expiring(clock: Clock) -> None:
    idx = ApproxKvIndexer(ttl_s=100, max_tree_size=10, prune_target_ratio=0.5, clock=clock)
    chains = [chain(4, seed) for seed in range(3)]
    for i, (local, seq) in enumerate(chains):
        idx.record_routing((i % 2, 0), local, seq)
        clock.now += 1
    assert idx.entries == 5 and idx.stats.pruned == 7  # 12 > 10: pruned to 5
    # chain 0 (oldest) is gone; chain 1's deeper blocks went before its first one
    assert idx.find_matches(*chains[0]) == {}
    assert idx.find_matches(*chains[1]) == {(1, 0): 1}
    assert idx.find_matches(*chains[2]) == {(0, 0): 4}
    assert idx.tree_size((0, 0)) == 4 and idx.tree_size((1, 0)) == 1


def test_prune_keeps_what_was_refreshed(clock: Clock) -> None:
    idx = ApproxKvIndexer(ttl_s=100, max_tree_size=6, prune_target_ratio=0.67, clock=clock)
    a, b, c = chain(3, 1), chain(3, 2), chain(1, 3)
    idx.record_routing((1, 0), *a)
    clock.now += 1
    idx.record_routing((2, 0), *b)
    clock.now += 1
    idx.record_routing((1, 0), *a)  # a is now the most recent
    idx.record_routing((2, 0), *c)  # 7 > 6: down to 4
    assert idx.entries == 4
    assert idx.find_matches(*a) == {(1, 0): 3}
    assert idx.find_matches(*b) == {}


def test_remove_worker_and_keys(clock: Clock) -> None:
    idx = ApproxKvIndexer(clock=clock)
    local, seq = chain(3)
    for key in [(1, 0), (1, 1), (2, 0)]:
        idx.record_routing(key, local, seq)
    idx.remove_worker(1)
    assert idx.find_matches(local, seq) == {(2, 0): 3}
    assert idx.tree_size((1, 0)) == 0 and idx.entries == 3
    idx.remove_worker_key((2, 0))
    assert idx.find_matches(local, seq) == {} and len(idx) == 0
    clock.now += 1000  # nothing left to expire, nothing breaks
    assert idx.expire() == 0
    idx.record_routing((3, 0), local, seq)
    assert idx.find_matches(local, seq) == {(3, 0): 3}


def test_real_prompts_shared_prefix_and_settings(clock: Clock) -> None:
    rng = random.Random(7)
    system = [rng.randrange(32_000) for _ in range(64 * 8)]
    first = system + [rng.randrange(32_000) for _ in range(64 * 4 + 10)]
    second = system + [rng.randrange(32_000) for _ in range(64 * 20)]
    idx = ApproxKvIndexer(clock=clock)
    local = local_block_hashes(first, 64)
    idx.record_routing((5, 0), local, sequence_hashes(local))
    idx.record_routing((6, 0), local[:8], None)  # sequence hashes computed when not given
    local2 = local_block_hashes(second, 64)
    assert idx.find_matches(local2, sequence_hashes(local2)) == {(5, 0): 8, (6, 0): 8}
    assert idx.find_matches(local) == {(5, 0): 12, (6, 0): 8}
    idx.record_routing((7, 0), [], [])  # a prompt shorter than a block: nothing to record
    assert idx.tree_size((7, 0)) == 0
    with pytest.raises(ValueError):
        ApproxKvIndexer(ttl_s=0)
    with pytest.raises(ValueError):
        ApproxKvIndexer(prune_target_ratio=1.5)
