"""KvIndexer: the workers' cached blocks as their KV events say, and prefix matches."""

from __future__ import annotations

import random

from xxhash import xxh3_64_intdigest

from dynamo_graph.router.kv.hashing import local_block_hashes, sequence_hashes
from dynamo_graph.router.kv.indexer import KvIndexer
from dynamo_graph.router.kv.protocols import (
    KvCacheEvent,
    KvCleared,
    KvRemoved,
    KvStored,
    StoredBlock,
    decode_kv_event,
    encode_event,
)

BLOCK = 4


def chain(n: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """Local and sequence hashes of a random chain of n blocks."""
    rng = random.Random(seed)
    local = [rng.getrandbits(64) for _ in range(n)]
    return local, sequence_hashes(local)


def opaque(seq: int) -> int:
    """An engine's own block id for a block (not our sequence hash), as vLLM's would be."""
    return xxh3_64_intdigest(seq.to_bytes(8, "little"), 7)


class Worker:
    """Emits a worker rank's KV events with monotonic ids."""

    def __init__(self, worker_id: int, dp_rank: int = 0, *, ids=lambda seq: seq) -> None:
        self.worker_id, self.dp_rank, self.ids = worker_id, dp_rank, ids
        self.next_id = 0

    def event(self, data) -> KvCacheEvent:
        self.next_id += 1
        return KvCacheEvent(self.next_id, self.worker_id, data, self.dp_rank)

    def stored(self, local: list[int], seq: list[int], start: int = 0, stop: int | None = None):
        stop = len(seq) if stop is None else stop
        blocks = [
            StoredBlock(self.ids(s), h) for s, h in zip(seq[start:stop], local[start:stop], strict=True)
        ]
        return self.event(KvStored(blocks, self.ids(seq[start - 1]) if start else None))

    def removed(self, seqs: list[int]) -> KvCacheEvent:
        return self.event(KvRemoved([self.ids(s) for s in seqs]))

    def cleared(self) -> KvCacheEvent:
        return self.event(KvCleared())


def test_stored_in_several_events_then_matches() -> None:
    local, seq = chain(8)
    idx = KvIndexer()
    w = Worker(1)
    idx.apply_event(w.stored(local, seq, 0, 3))
    idx.apply_event(w.stored(local, seq, 3, 8))  # continues from block 2
    assert idx.find_matches(local, seq) == {(1, 0): 8}
    assert idx.find_matches(local[:5], seq[:5]) == {(1, 0): 5}
    assert idx.find_matches(local) == {(1, 0): 8}  # sequence hashes computed when not given
    assert idx.tree_size((1, 0)) == 8
    assert len(idx) == 8 and idx.entries == 8
    assert idx.stats.blocks_stored == 8


def test_unknown_prompt_and_empty_prompt_match_nothing() -> None:
    local, seq = chain(4)
    idx = KvIndexer()
    idx.apply_event(Worker(1).stored(local, seq))
    other_local, other_seq = chain(4, seed=1)
    assert idx.find_matches(other_local, other_seq) == {}
    assert idx.find_matches([], []) == {}
    # The same chunk of tokens at another position is another block.
    assert idx.find_matches(local[1:]) == {}


def test_removed_block_ends_the_prefix_there() -> None:
    local, seq = chain(6)
    idx = KvIndexer()
    w = Worker(1)
    idx.apply_event(w.stored(local, seq))
    idx.apply_event(w.removed([seq[5]]))
    assert idx.find_matches(local, seq) == {(1, 0): 5}
    idx.apply_event(w.removed([seq[2]]))  # a gap: blocks 3 and 4 no longer count
    assert idx.find_matches(local, seq) == {(1, 0): 2}
    assert idx.tree_size((1, 0)) == 4
    idx.apply_event(w.removed(seq[:2]))
    assert idx.find_matches(local, seq) == {}
    assert idx.stats.blocks_removed == 4


def test_cleared_drops_only_that_rank() -> None:
    local, seq = chain(4)
    idx = KvIndexer()
    r0, r1 = Worker(1, 0), Worker(1, 1)
    idx.apply_event(r0.stored(local, seq))
    idx.apply_event(r1.stored(local, seq))
    idx.apply_event(r0.cleared())
    assert idx.find_matches(local, seq) == {(1, 1): 4}
    assert idx.tree_size((1, 0)) == 0
    idx.apply_event(r0.stored(local, seq, 0, 2))  # a cleared rank stores again
    assert idx.find_matches(local, seq) == {(1, 1): 4, (1, 0): 2}


def test_parent_not_found_is_counted_and_skipped() -> None:
    local, seq = chain(6)
    idx = KvIndexer()
    w = Worker(1)
    idx.apply_event(w.stored(local, seq, 3, 6))  # its parent (block 2) was never stored
    assert idx.stats.parent_not_found == 1
    assert idx.entries == 0 and idx.find_matches(local, seq) == {}
    idx.apply_event(w.stored(local, seq, 0, 3))
    assert idx.find_matches(local, seq) == {(1, 0): 3}


def test_unknown_removals_are_counted_and_tolerated() -> None:
    local, seq = chain(3)
    idx = KvIndexer()
    w = Worker(1)
    idx.apply_event(w.removed([123, 456]))  # unknown worker
    idx.apply_event(w.stored(local, seq))
    idx.apply_event(w.removed([789, seq[2]]))  # one unknown block, one known
    idx.apply_event(w.cleared())
    idx.apply_event(Worker(9).cleared())
    assert idx.stats.block_not_found == 3
    assert idx.stats.blocks_removed == 1
    assert idx.entries == 0 and len(idx) == 0


def test_out_of_order_lost_and_duplicated_events() -> None:
    local, seq = chain(4)
    idx = KvIndexer()
    w = Worker(1)
    first = w.stored(local, seq, 0, 3)
    store = w.stored(local, seq, 3, 4)
    remove = w.removed([seq[3]])
    # remove before store: the remove is about a block not stored yet (counted), the late store
    # applies (counted as reordered): a stale block, never a broken index
    for event in (first, remove, store):
        idx.apply_event(event)
    assert idx.stats.block_not_found == 1
    assert idx.stats.reordered_events == 1
    assert idx.find_matches(local, seq) == {(1, 0): 4}
    # the same event twice in a row: the repeat is dropped
    again = w.removed([seq[3]])
    idx.apply_event(again)
    idx.apply_event(again)
    assert idx.stats.duplicate_events == 1 and idx.stats.block_not_found == 1
    assert idx.find_matches(local, seq) == {(1, 0): 3}
    # an event lost: ids jump; a restarted publisher counts from 1 again: both still apply
    w.next_id += 10
    idx.apply_event(w.stored(local, seq, 3, 4))
    w.next_id = 0
    idx.apply_event(w.removed([seq[0]]))
    assert idx.find_matches(local, seq) == {}
    assert idx.entries == 3 == idx.tree_size((1, 0))


def test_malformed_hashes_are_counted_not_raised() -> None:
    local, seq = chain(2)
    idx = KvIndexer()
    w = Worker(1)
    idx.apply_event(w.stored(local, seq, 0, 1))
    idx.apply_event(w.event(KvStored([StoredBlock(5, -1)], seq[0])))
    idx.apply_event(w.event(KvStored([StoredBlock(6, 2**70)], seq[0])))
    assert idx.stats.malformed_events == 2
    assert idx.entries == idx.tree_size((1, 0))
    idx.apply_event(w.stored(local, seq, 1, 2))
    assert idx.find_matches(local, seq) == {(1, 0): 2}


def test_remove_worker_drops_all_its_ranks() -> None:
    local, seq = chain(4)
    idx = KvIndexer()
    for worker_id, rank in [(1, 0), (1, 1), (2, 0)]:
        idx.apply_event(Worker(worker_id, rank).stored(local, seq))
    assert idx.find_matches(local, seq) == {(1, 0): 4, (1, 1): 4, (2, 0): 4}
    idx.remove_worker(1)
    assert idx.find_matches(local, seq) == {(2, 0): 4}
    assert idx.worker_keys() == [(2, 0)] and idx.entries == 4
    idx.remove_worker_key((2, 0))
    idx.remove_worker_key((2, 0))  # twice: fine
    idx.remove_worker(77)
    assert idx.find_matches(local, seq) == {} and len(idx) == 0 and idx.entries == 0
    # a new worker reuses a freed bit and is not mistaken for the old one
    idx.apply_event(Worker(3).stored(local, seq, 0, 2))
    assert idx.find_matches(local, seq) == {(3, 0): 2}


def test_dp_ranks_are_separate_keys() -> None:
    local, seq = chain(5)
    idx = KvIndexer()
    idx.apply_event(Worker(1, 0).stored(local, seq, 0, 2))
    idx.apply_event(Worker(1, 1).stored(local, seq))
    assert idx.find_matches(local, seq) == {(1, 0): 2, (1, 1): 5}
    assert idx.tree_size((1, 0)) == 2 and idx.tree_size((1, 1)) == 5
    assert len(idx) == 5 and idx.entries == 7


def test_two_workers_share_a_prefix_then_diverge() -> None:
    shared_local, _ = chain(3, seed=1)
    a_local = shared_local + chain(3, seed=2)[0]
    b_local = shared_local + chain(2, seed=3)[0]
    a_seq, b_seq = sequence_hashes(a_local), sequence_hashes(b_local)
    idx = KvIndexer()
    wb = Worker(2)
    idx.apply_event(Worker(1).stored(a_local, a_seq))
    idx.apply_event(wb.stored(b_local, b_seq))
    assert len(idx) == 3 + 3 + 2
    assert idx.find_matches(a_local, a_seq) == {(1, 0): 6, (2, 0): 3}
    assert idx.find_matches(b_local, b_seq) == {(1, 0): 3, (2, 0): 5}
    # early exit: stop once one worker is left (its depth is then a lower bound)
    assert idx.find_matches(a_local, a_seq, early_exit=True) == {(2, 0): 3, (1, 0): 4}
    assert idx.find_matches(a_local[:2], a_seq[:2], early_exit=True) == {(1, 0): 2, (2, 0): 2}
    # worker 2 drops the shared first block: it matches nothing any more
    idx.apply_event(wb.removed([b_seq[0]]))
    assert idx.find_matches(b_local, b_seq) == {(1, 0): 3}


def test_opaque_engine_block_hashes() -> None:
    """Events name blocks by the engine's own ids; matches are by our sequence hashes."""
    local, seq = chain(6)
    idx = KvIndexer()
    w = Worker(1, ids=opaque)
    idx.apply_event(w.stored(local, seq, 0, 2))
    idx.apply_event(w.stored(local, seq, 2, 6))  # parent named by its opaque id
    assert all(opaque(s) != s for s in seq)
    assert idx.find_matches(local, seq) == {(1, 0): 6}
    assert seq[5] in idx and opaque(seq[5]) not in idx
    idx.apply_event(w.event(KvRemoved([seq[4]])))  # ours is not the engine's id: unknown
    assert idx.stats.block_not_found == 1
    idx.apply_event(w.removed(seq[4:]))
    assert idx.find_matches(local, seq) == {(1, 0): 4}


def test_engine_reusing_a_block_id_for_other_tokens() -> None:
    local, seq = chain(2)
    other_local, _ = chain(1, seed=5)
    idx = KvIndexer()
    w = Worker(1)
    idx.apply_event(w.stored(local, seq))
    # block id seq[1] now holds other tokens (a physical block id, reused)
    idx.apply_event(w.event(KvStored([StoredBlock(seq[1], other_local[0])], seq[0])))
    assert idx.find_matches(local, seq) == {(1, 0): 1}
    rechained = sequence_hashes(local[:1] + other_local)
    assert idx.find_matches(local[:1] + other_local, rechained) == {(1, 0): 2}
    assert idx.tree_size((1, 0)) == 2 and len(idx) == 2


def test_bounded_size_evicts_least_recently_stored_of_biggest_worker() -> None:
    idx = KvIndexer(max_blocks=10)
    a_local, a_seq = chain(8, seed=1)
    b_local, b_seq = chain(4, seed=2)
    wa, wb = Worker(1), Worker(2)
    idx.apply_event(wa.stored(a_local, a_seq, 0, 4))
    idx.apply_event(wb.stored(b_local, b_seq))
    idx.apply_event(wa.stored(a_local, a_seq, 4, 8))  # 12 entries > 10: worker 1's oldest go
    assert idx.entries == 10 == idx.tree_size((1, 0)) + idx.tree_size((2, 0))
    assert idx.stats.evicted == 2
    assert idx.tree_size((2, 0)) == 4 and idx.find_matches(b_local, b_seq) == {(2, 0): 4}
    assert a_seq[0] not in idx and a_seq[1] not in idx and a_seq[2] in idx
    # a later remove of an evicted block is just unknown
    idx.apply_event(wa.removed([a_seq[0]]))
    assert idx.stats.block_not_found == 1 and idx.entries == 10


def test_restored_block_becomes_most_recent() -> None:
    idx = KvIndexer(max_blocks=3)
    local, seq = chain(3)
    w = Worker(1)
    idx.apply_event(w.stored(local, seq))
    idx.apply_event(w.stored(local, seq, 0, 1))  # block 0 stored again
    other_local, other_seq = chain(1, seed=9)
    idx.apply_event(w.stored(other_local, other_seq))
    assert seq[0] in idx and seq[1] not in idx and seq[2] in idx and other_seq[0] in idx


def test_real_tokens_and_wire_round_trip() -> None:
    """Events built from token ids as an engine would publish them, through msgpack, and a
    longer prompt that shares their prefix."""
    rng = random.Random(42)
    system = [rng.randrange(50_000) for _ in range(10 * BLOCK)]
    doc_a = system + [rng.randrange(50_000) for _ in range(6 * BLOCK + 1)]
    doc_b = system + [rng.randrange(50_000) for _ in range(3 * BLOCK)]
    idx = KvIndexer()
    for worker_id, tokens in [(10, doc_a), (20, doc_b)]:
        local = local_block_hashes(tokens, BLOCK)
        seq = sequence_hashes(local)
        w = Worker(worker_id, ids=opaque if worker_id == 20 else (lambda s: s))
        for start in range(0, len(local), 5):  # the engine stores a few blocks per step
            event = w.stored(local, seq, start, min(start + 5, len(local)))
            idx.apply_event(decode_kv_event(encode_event(event)))
    prompt = doc_a[: 12 * BLOCK] + [rng.randrange(50_000) for _ in range(20 * BLOCK + 3)]
    local = local_block_hashes(prompt, BLOCK)
    assert len(local) == 32
    assert idx.find_matches(local, sequence_hashes(local)) == {(10, 0): 12, (20, 0): 10}
    assert idx.find_matches(local_block_hashes(doc_b, BLOCK)) == {(10, 0): 10, (20, 0): 13}
    assert idx.find_matches(local_block_hashes(doc_a[1:], BLOCK)) == {}


def test_shuffled_events_agree_with_a_model() -> None:
    """A shuffled mix of stores and removes over several ranks: the index agrees with a plain
    model of each key's blocks (stores whose parent the key lacks are skipped)."""
    rng = random.Random(3)
    chains = [chain(8, seed=s) for s in range(20)]
    workers = [Worker(w, rank) for w in range(3) for rank in range(2)]
    events = []
    for _ in range(600):
        w = rng.choice(workers)
        local, seq = rng.choice(chains)
        start = rng.randrange(8)
        if rng.random() < 0.6:
            events.append(w.stored(local, seq, start, rng.randrange(start + 1, 9)))
        else:
            events.append(w.removed(rng.sample(seq, rng.randrange(1, 4))))
    rng.shuffle(events)
    idx = KvIndexer()
    model: dict[tuple[int, int], set[int]] = {}
    for event in events:
        idx.apply_event(event)
        held = model.setdefault((event.worker_id, event.dp_rank), set())
        if isinstance(event.data, KvStored):
            if event.data.parent_hash is None or event.data.parent_hash in held:
                held.update(b.block_hash for b in event.data.blocks)
        else:
            held.difference_update(event.data.block_hashes)
    assert idx.stats.parent_not_found > 0 and idx.stats.block_not_found > 0
    assert idx.entries == sum(len(h) for h in model.values())
    assert len(idx) == len(set().union(*model.values()))
    for key, held in model.items():
        assert idx.tree_size(key) == len(held)
    for local, seq in chains:
        expected = {}
        for key, held in model.items():
            depth = next((i for i, s in enumerate(seq) if s not in held), len(seq))
            if depth:
                expected[key] = depth
        assert idx.find_matches(local, seq) == expected
