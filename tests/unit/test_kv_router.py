"""KvRouter: indexer, bookkeeping and selection together, without processes."""

from __future__ import annotations

from dynamo_graph.router.config import RouterConfig
from dynamo_graph.router.kv.hashing import local_block_hashes, sequence_hashes
from dynamo_graph.router.kv.protocols import KvCacheEvent, KvStored, StoredBlock
from dynamo_graph.router.kv.router import KvRouter

BS = 16


def stored_event(worker: int, tokens: list[int], event_id: int = 1, dp_rank: int = 0) -> KvCacheEvent:
    local = local_block_hashes(tokens, BS)
    seq = sequence_hashes(local)
    blocks = [StoredBlock(s, h) for s, h in zip(seq, local, strict=True)]
    return KvCacheEvent(event_id, worker, KvStored(blocks), dp_rank)


def test_routes_to_the_worker_whose_cache_holds_the_prefix():
    router = KvRouter(BS, seed=0)
    prompt = list(range(200))
    router.indexer.apply_event(stored_event(2, prompt[:160]))  # 10 blocks on worker 2
    choice = router.route("r1", [*prompt, 5000, 5001], [1, 2, 3])
    assert choice.key == (2, 0) and choice.overlap_blocks == 10
    assert choice.prefill_tokens == 202 - 160
    router.free("r1")


def test_a_burst_sharing_a_new_prefix_meets_on_one_worker():
    """No KV event has arrived yet: the in-flight booking is what shows where the prefix will be."""
    router = KvRouter(BS, seed=0)
    prefix = list(range(1000, 1000 + 64 * BS))  # 64 blocks nobody has cached yet
    choices = [router.route(f"r{i}", [*prefix, i, i + 1], [1, 2, 3, 4]) for i in range(3)]
    assert len({c.key for c in choices}) == 1, choices
    assert [c.prefill_tokens for c in choices] == [1026, 2, 2]
    # An unrelated prompt goes elsewhere: that worker carries the burst's queued prefill.
    assert router.route("x", list(range(5000, 5000 + 64 * BS)), [1, 2, 3, 4]).key != choices[0].key


def test_load_spreads_prompts_without_shared_prefixes():
    router = KvRouter(BS, seed=0)
    keys = [router.route(f"r{i}", [i * 100_000 + t for t in range(320)], [1, 2, 3, 4]).key for i in range(8)]
    assert sorted(keys.count((w, 0)) for w in (1, 2, 3, 4)) == [2, 2, 2, 2]


def test_data_parallel_ranks_are_separate_targets_and_leave_with_their_worker():
    router = KvRouter(BS, seed=0)
    router.dp_sizes[7] = 2
    assert router.targets([7, 8]) == [(7, 0), (7, 1), (8, 0)]
    router.indexer.apply_event(stored_event(7, list(range(64)), dp_rank=1))
    assert router.route("r", list(range(80)), [7, 8]).key == (7, 1)
    router.remove_worker(7)
    assert router.targets([8]) == [(8, 0)]
    assert router.indexer.find_matches(local_block_hashes(list(range(64)), BS)) == {}
    assert router.sequences.active_blocks((7, 1)) == 0


def test_without_events_the_router_remembers_its_own_decisions():
    router = KvRouter(BS, RouterConfig(use_kv_events=False), seed=0)
    conversation = list(range(300))
    first = router.route("t1", conversation, [1, 2, 3]).key
    router.prefill_completed("t1")
    router.free("t1")
    # Other traffic in between, then turn 2 of the conversation.
    for i in range(4):
        router.route(f"o{i}", [50_000 + i * 1000 + t for t in range(100)], [1, 2, 3])
    turn2 = router.route("t2", [*conversation, *range(9000, 9040)], [1, 2, 3])
    assert turn2.key == first and turn2.overlap_blocks == 300 // BS


def test_overlap_weight_zero_ignores_the_cache():
    router = KvRouter(BS, RouterConfig(kv_overlap_score_weight=0.0), seed=0)
    router.indexer.apply_event(stored_event(2, list(range(160))))
    choice = router.route("r", list(range(160)), [1, 2])
    assert choice.overlap_blocks == 0


def test_a_new_prefix_goes_where_the_cache_has_room_not_to_the_smaller_full_one():
    """Worker 1's cache (20 blocks, from its card) is full; worker 2 holds more but has room.
    The smaller cache would win the tie, but storing the new prefix there evicts as much."""
    router = KvRouter(BS, seed=0)
    router.add_worker(1, {"total_kv_blocks": 20})
    router.add_worker(2, {"total_kv_blocks": 400})
    router.add_worker(3, {"total_kv_blocks": 100, "data_parallel_size": 2})
    router.indexer.apply_event(stored_event(1, list(range(20 * BS))))
    router.indexer.apply_event(stored_event(2, list(range(50_000, 50_000 + 40 * BS))))
    assert [router.spare_blocks(k) for k in ((1, 0), (2, 0), (3, 1))] == [0, 360, 50]
    assert router.route("r", list(range(9000, 9000 + 64 * BS)), [1, 2]).key == (2, 0)
    plain = KvRouter(BS, RouterConfig(mode="kv", prefill_penalty=0.0), seed=0)
    plain.indexer.apply_event(stored_event(1, list(range(20 * BS))))
    plain.indexer.apply_event(stored_event(2, list(range(50_000, 50_000 + 40 * BS))))
    assert plain.route("r", list(range(9000, 9000 + 64 * BS)), [1, 2]).key == (1, 0)
    router.remove_worker(2)
    assert router.spare_blocks((2, 0)) is None
