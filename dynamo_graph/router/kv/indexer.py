"""Which worker ranks hold which prompt blocks: the KV router's index of every worker's cache.

`KvIndexer` is fed by the engines' KV events (docs/kv-events.md); `ApproxKvIndexer`
(approx.py) by the router's own routing decisions. Both answer `find_matches`: for every worker
key (worker_id, dp_rank), how many leading blocks of a request it has cached.

Data structure. Dynamo keeps a radix tree whose children are keyed by local hash, plus a
per-worker lookup `block_hash -> node` for events (docs/kv-events.md). A node of that tree *is*
a prefix, and a prefix is exactly what a sequence hash names (`seq[i]` chains every local hash
before it). So the same index is a flat dict keyed by sequence hash, with the tree's edges implicit
in the hash chain, and no node objects:

    index:   seq_hash -> bitmask of the worker keys that hold that block
    workers: key -> WorkerBlocks(bit, blocks)   (KvIndexer: blocks = {engine block_hash: seq_hash})

* A stored event finds its parent's sequence hash through the worker's `blocks` (the engine's
  block hash is opaque: vLLM's own hash, the mocker's = ours, anything stable), then chains each
  block's `tokens_hash` with `chain_hash`, so the index speaks *our* sequence hashes, the same ones
  the router computes from a prompt's token ids, whatever hashing the engine uses.
* find_matches walks the request's sequence hashes, one dict lookup and one integer AND per
  block: `active &= index[seq[i]]`; workers whose bit drops out stop at depth i. A worker set is
  a Python int (bit i = the i-th worker key), so a set operation is one machine-word operation
  for up to 30 worker ranks (and still fast for hundreds), per-block storage is one dict slot
  holding a small int (cached objects below 257), and nothing is allocated per block.
* A block whose prefix is gone on one worker no longer counts for it (the walk needs every block
  before it), which is what Dynamo's tree gets by clearing a dead node's children.
* The price: a stored block costs one xxh3 of 16 bytes (~0.1 µs) to name it by our sequence
  hash, since engines' block hashes cannot be trusted to be ours. Lookups stay exact (every
  block is probed, no Flash-Indexer jump search that assumes each worker's blocks are
  prefix-closed). The interface (apply_event / find_matches / remove_worker / tree_size) is
  Dynamo's, so a compiled backend can replace this one.

Measured with benchmarks/bench_indexer.py (one core of this project's 2-vCPU Xeon VM, Python
3.11): ~1.7M stored/removed blocks per second from events of ~15 blocks, ~230k find_matches per
second on 64-block prompts (p50 3.4 µs, p99 16 µs), ~1.3M operations per second interleaved.
A lookup costs one dict probe per matched block, so deep hits on a large index are bound by
memory latency (~0.1-0.2 µs per block here).

LoRA adapters: a `KvIndexer` holds one model's blocks, the base model's or one adapter's
(`lora_name`); stored events of any other are skipped and counted (`stats.other_model`), so a
router per adapter, fed by the same channel, holds only its adapter's blocks. Removals and
clears carry no adapter and apply to every indexer (protocols.py says why that is safe).

Robustness: events about unknown parents are skipped and counted, removals of unknown blocks
are counted and ignored, an event repeating the last event id of its worker key is dropped as a
duplicate, older ids are applied (a restarted publisher counts from 1 again) and counted;
malformed hashes are counted, never raised. `max_blocks` bounds the (worker key, block) entries
held: past it, the biggest worker key's least recently stored blocks are evicted (lost remove
events pile up on one worker; its oldest entries are the likeliest to be stale), down to
~98% of the bound, and counted in `stats.evicted`.
"""

from __future__ import annotations

import heapq
import logging
import struct
from collections.abc import Iterable, MutableMapping, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any

from xxhash import xxh3_64_intdigest

from dynamo_graph.router.kv.hashing import HASH_SEED, sequence_hashes
from dynamo_graph.router.kv.protocols import KvCacheEvent, KvCleared, KvRemoved, KvStored, StoredBlock

log = logging.getLogger(__name__)

WorkerKey = tuple[int, int]  # (worker instance id, data-parallel rank)
DEFAULT_MAX_BLOCKS = 2**22
_MASK_CACHE_LIMIT = 4096
_pack = struct.Struct("<QQ").pack


class WorkerBlocks:
    """One worker key's share of an index: its bit in the masks, and its blocks (whose meaning
    is the indexer's: engine block hash -> sequence hash, or sequence hash -> expiry)."""

    __slots__ = ("bit", "blocks", "key", "last_event_id")

    def __init__(self, key: WorkerKey, bit: int, blocks: MutableMapping[int, Any]) -> None:
        self.key = key
        self.bit = bit
        self.blocks = blocks
        self.last_event_id = -1


class WorkerBlockIndex:
    """What both indexers share: sequence hash -> bitmask of worker keys, the worker keys' bits,
    and the prefix walk. Subclasses say what a worker's `blocks` map holds (`_worker_seqs`)."""

    __slots__ = ("_bit_keys", "_free_bits", "_index", "_mask_keys", "_total", "_workers")

    def __init__(self) -> None:
        self._index: dict[int, int] = {}
        self._workers: dict[WorkerKey, WorkerBlocks] = {}
        self._bit_keys: list[WorkerKey | None] = []  # bit number -> worker key
        self._free_bits: list[int] = []  # heap of released bit numbers
        self._mask_keys: dict[int, tuple[WorkerKey, ...]] = {}
        self._total = 0  # (worker key, block) entries

    # -- queries ---------------------------------------------------------------------------

    def find_matches(
        self,
        local_hashes: Sequence[int],
        seq_hashes: Sequence[int] | None = None,
        *,
        early_exit: bool = False,
    ) -> dict[WorkerKey, int]:
        """For every worker key holding the request's first block, how many leading blocks of the
        request it holds (its contiguous prefix depth). `seq_hashes` are the sequence hashes of
        `local_hashes` (computed when None). `early_exit`: stop walking once one worker key is left;
        its depth is then where it became the only one (a lower bound), as Dynamo does."""
        if seq_hashes is None:
            seq_hashes = sequence_hashes(local_hashes)
        if not seq_hashes:
            return {}
        index = self._index
        active = index.get(seq_hashes[0], 0)
        if not active:
            return {}
        keys = self._keys
        if early_exit and not active & (active - 1):
            return dict.fromkeys(keys(active), 1)
        scores: dict[WorkerKey, int] = {}
        depth = 1
        try:
            for h in islice(seq_hashes, 1, None):
                held = index[h] & active  # a plain dict's [] is the fastest lookup; a miss raises
                if held != active:
                    for key in keys(active ^ held):
                        scores[key] = depth
                    if not held:
                        return scores
                    active = held
                    if early_exit and not held & (held - 1):
                        depth += 1
                        break
                depth += 1
        except KeyError:
            pass  # nobody holds block `depth`: every key still active stops there
        for key in keys(active):
            scores[key] = depth
        return scores

    def tree_size(self, key: WorkerKey) -> int:
        """How many blocks the worker key holds (the router breaks ties towards smaller caches)."""
        worker = self._workers.get(key)
        return len(worker.blocks) if worker is not None else 0

    def worker_keys(self) -> list[WorkerKey]:
        return list(self._workers)

    @property
    def entries(self) -> int:
        """(worker key, block) entries: the sum of `tree_size` over worker keys."""
        return self._total

    def __len__(self) -> int:
        """Distinct blocks (prefixes) held by any worker key: the radix tree's node count."""
        return len(self._index)

    def __contains__(self, seq_hash: object) -> bool:
        return seq_hash in self._index

    # -- workers ---------------------------------------------------------------------------

    def remove_worker(self, worker_id: int) -> None:
        """Forget every data-parallel rank of the worker (it left discovery)."""
        for key in [k for k in self._workers if k[0] == worker_id]:
            self.remove_worker_key(key)

    def remove_worker_key(self, key: WorkerKey) -> None:
        worker = self._workers.pop(key, None)
        if worker is None:
            return
        self._clear_worker(worker)
        number = worker.bit.bit_length() - 1
        self._bit_keys[number] = None
        heapq.heappush(self._free_bits, number)
        self._mask_keys.clear()  # the bit may name another key next

    def _add_worker(self, key: WorkerKey, blocks: MutableMapping[int, Any]) -> WorkerBlocks:
        if self._free_bits:
            number = heapq.heappop(self._free_bits)
            self._bit_keys[number] = key
        else:
            number = len(self._bit_keys)
            self._bit_keys.append(key)
        worker = self._workers[key] = WorkerBlocks(key, 1 << number, blocks)
        return worker

    def _worker_seqs(self, worker: WorkerBlocks) -> Iterable[int]:
        """The sequence hashes of the worker's blocks."""
        raise NotImplementedError

    def _clear_worker(self, worker: WorkerBlocks) -> None:
        """Drop all the worker's blocks (it stays known, with its bit)."""
        index = self._index
        keep = ~worker.bit
        # `_unset` inlined on purpose: this loop runs per block on the event hot path.
        for seq in self._worker_seqs(worker):
            held = index.get(seq)
            if held is not None:
                held &= keep
                if held:
                    index[seq] = held
                else:
                    del index[seq]
        self._total -= len(worker.blocks)
        worker.blocks.clear()

    def _unset(self, seq: int, bit: int) -> None:
        """The worker with `bit` no longer holds block `seq`."""
        index = self._index
        held = index.get(seq)
        if held is not None:
            held &= ~bit
            if held:
                index[seq] = held
            else:
                del index[seq]

    def _keys(self, mask: int) -> tuple[WorkerKey, ...]:
        keys = self._mask_keys.get(mask)
        if keys is None:
            found = []
            bit_keys = self._bit_keys
            rest = mask
            while rest:
                low = rest & -rest
                key = bit_keys[low.bit_length() - 1]
                if key is not None:
                    found.append(key)
                rest ^= low
            keys = tuple(found)
            if len(self._mask_keys) >= _MASK_CACHE_LIMIT:
                self._mask_keys.clear()
            self._mask_keys[mask] = keys
        return keys


@dataclass(slots=True)
class IndexerStats:
    events: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    cleared: int = 0
    parent_not_found: int = 0  # stored events skipped: parent block unknown for that worker key
    block_not_found: int = 0  # removed block hashes unknown for that worker key
    duplicate_events: int = 0  # same event id as the key's last one: dropped
    reordered_events: int = 0  # older event id than the key's last one: applied
    malformed_events: int = 0  # hashes that are not u64, or an unknown event kind
    evicted: int = 0  # entries dropped to stay within max_blocks
    other_model: int = 0  # stored events of another LoRA adapter (or the base model): skipped


class KvIndexer(WorkerBlockIndex):
    """The workers' cached blocks as their KV events describe them (see the module docstring)."""

    __slots__ = ("lora_name", "max_blocks", "stats")

    def __init__(self, *, max_blocks: int = DEFAULT_MAX_BLOCKS, lora_name: str | None = None) -> None:
        """`lora_name`: the LoRA adapter whose blocks this index holds (None: the base model's)."""
        if max_blocks <= 0:
            raise ValueError(f"max_blocks must be positive, not {max_blocks}")
        super().__init__()
        self.max_blocks = max_blocks
        self.lora_name = lora_name or None
        self.stats = IndexerStats()

    def apply_event(self, event: KvCacheEvent) -> None:
        """Apply one worker rank's KV event. Never raises on what the event says."""
        stats = self.stats
        stats.events += 1
        key = (event.worker_id, event.dp_rank)
        data = event.data
        kind = type(data)
        if kind is KvStored and (data.lora_name or None) != self.lora_name:  # "": the base model
            stats.other_model += 1
            return
        worker = self._workers.get(key)
        if worker is None:
            if kind is not KvStored:  # nothing to remove or clear
                if kind is KvRemoved:
                    stats.block_not_found += len(data.block_hashes)
                return
            worker = self._add_worker(key, {})
        event_id = event.event_id
        if event_id > worker.last_event_id:
            worker.last_event_id = event_id
        elif event_id == worker.last_event_id:
            stats.duplicate_events += 1
            return
        else:
            stats.reordered_events += 1
        try:
            if kind is KvStored:
                self._store(worker, data.parent_hash, data.blocks)
            elif kind is KvRemoved:
                self._remove(worker, data.block_hashes)
            elif kind is KvCleared:
                stats.cleared += 1
                self._clear_worker(worker)
            else:
                stats.malformed_events += 1
        except (struct.error, OverflowError, TypeError, AttributeError) as err:
            stats.malformed_events += 1
            self._total = sum(len(w.blocks) for w in self._workers.values())
            log.debug("malformed KV event %d from %x rank %d: %s", event_id, *key, err)

    def _store(self, worker: WorkerBlocks, parent_hash: int | None, blocks: Sequence[StoredBlock]) -> None:
        held = worker.blocks
        if parent_hash is None:
            parent = None
        else:
            parent = held.get(parent_hash)
            if parent is None:
                self.stats.parent_not_found += 1
                log.debug(
                    "KV event from %x rank %d: parent block %x not found, %d blocks skipped",
                    *worker.key,
                    parent_hash,
                    len(blocks),
                )
                return
        index = self._index
        get = index.get
        bit = worker.bit
        before = len(held)
        for block in blocks:
            tokens_hash = block.tokens_hash
            seq = tokens_hash if parent is None else xxh3_64_intdigest(_pack(parent, tokens_hash), HASH_SEED)
            block_hash = block.block_hash
            if block_hash in held:  # stored again: now the most recently stored
                old = held.pop(block_hash)
                if old != seq:  # the engine reused a block id for other tokens
                    self._unset(old, bit)
            held[block_hash] = seq
            index[seq] = get(seq, 0) | bit
            parent = seq
        self.stats.blocks_stored += len(blocks)
        self._total += len(held) - before
        if self._total > self.max_blocks:
            self._evict()

    def _remove(self, worker: WorkerBlocks, block_hashes: Sequence[int]) -> None:
        pop = worker.blocks.pop
        index = self._index
        keep = ~worker.bit
        missing = 0
        # `_unset` inlined on purpose: this loop runs per block on the event hot path.
        for block_hash in block_hashes:
            seq = pop(block_hash, None)
            if seq is None:
                missing += 1
                continue
            held = index.get(seq)
            if held is not None:
                held &= keep
                if held:
                    index[seq] = held
                else:
                    del index[seq]
        removed = len(block_hashes) - missing
        self._total -= removed
        self.stats.blocks_removed += removed
        if missing:
            self.stats.block_not_found += missing
            log.debug("KV event from %x rank %d: %d removed blocks not found", *worker.key, missing)

    def _evict(self) -> None:
        target = self.max_blocks - self.max_blocks // 64
        while self._total > target:
            worker = max(self._workers.values(), key=lambda w: len(w.blocks))
            held = worker.blocks
            victims = list(islice(held.items(), self._total - target))
            for block_hash, seq in victims:
                del held[block_hash]
                self._unset(seq, worker.bit)
            self._total -= len(victims)
            self.stats.evicted += len(victims)
        log.debug("KV indexer over %d blocks: evicted down to %d", self.max_blocks, self._total)

    def _worker_seqs(self, worker: WorkerBlocks) -> Iterable[int]:
        return worker.blocks.values()
