"""The approximate indexer, for engines that publish no KV events (`--no-kv-events`).

The router records its own decisions instead: after sending a request to a worker key, every full
block of the prompt counts as cached there for `ttl_s` (Dynamo: 120 s), and routing that prefix
to that key again refreshes it. As Dynamo's ApproxKvIndexer, with the
same index as `KvIndexer` (indexer.py: sequence hash -> bitmask of worker keys, and its prefix
walk), so both answer `find_matches` the same way.

What differs is each worker key's `blocks`: an OrderedDict sequence hash -> expiry, kept in
expiry order (a refreshed block moves to the end; the clock is monotonic and the TTL fixed, so
the end is always the latest expiry). Expiring is then popping from the front of each map,
and "is anything due?" is one comparison against the earliest expiry, so expiry runs lazily on
every call (`expire(now)` can also be called from a timer). A request's blocks go in deepest
first, so that among equal expiries a block goes before its prefix (as Dynamo orders its heap).
Past `max_tree_size` (worker key, block) entries, the earliest-expiring entries over all keys
are pruned down to `max_tree_size * prune_target_ratio`.
"""

from __future__ import annotations

import heapq
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import islice, repeat

from dynamo_graph.router.kv.hashing import sequence_hashes
from dynamo_graph.router.kv.indexer import WorkerBlockIndex, WorkerBlocks, WorkerKey

DEFAULT_TTL_S = 120.0
DEFAULT_MAX_TREE_SIZE = 2**20
DEFAULT_PRUNE_TARGET_RATIO = 0.8


@dataclass(slots=True)
class ApproxStats:
    routings: int = 0
    blocks_recorded: int = 0  # blocks new to their worker key
    blocks_refreshed: int = 0
    expired: int = 0
    pruned: int = 0


class ApproxKvIndexer(WorkerBlockIndex):
    """Worker keys' caches as guessed from where the router sent each prompt, for `ttl_s`."""

    __slots__ = (
        "_clock",
        "_last_expiry",
        "_next_expiry",
        "max_tree_size",
        "prune_target_ratio",
        "stats",
        "ttl_s",
    )

    def __init__(
        self,
        *,
        ttl_s: float = DEFAULT_TTL_S,
        max_tree_size: int = DEFAULT_MAX_TREE_SIZE,
        prune_target_ratio: float = DEFAULT_PRUNE_TARGET_RATIO,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, not {ttl_s}")
        if max_tree_size <= 0:
            raise ValueError(f"max_tree_size must be positive, not {max_tree_size}")
        if not 0 <= prune_target_ratio <= 1:
            raise ValueError(f"prune_target_ratio must be within [0, 1], not {prune_target_ratio}")
        super().__init__()
        self.ttl_s = ttl_s
        self.max_tree_size = max_tree_size
        self.prune_target_ratio = prune_target_ratio
        self.stats = ApproxStats()
        self._clock = clock
        self._next_expiry = float("inf")  # no entry expires before this (a lower bound)
        self._last_expiry = float("-inf")  # the latest expiry given: expiries never go backwards

    def record_routing(
        self,
        key: WorkerKey,
        local_hashes: Sequence[int],
        seq_hashes: Sequence[int] | None = None,
        now: float | None = None,
    ) -> None:
        """The router sent a prompt with these full blocks to `key`: they count as cached there
        until `now + ttl_s` (refreshed if they already were)."""
        if seq_hashes is None:
            seq_hashes = sequence_hashes(local_hashes)
        if now is None:
            now = self._clock()
        if now >= self._next_expiry:
            self.expire(now)
        if not seq_hashes:
            return
        expiry = now + self.ttl_s
        if expiry < self._last_expiry:  # an injected clock went backwards: keep the order
            expiry = self._last_expiry
        self._last_expiry = expiry
        worker = self._workers.get(key)
        if worker is None:
            worker = self._add_worker(key, OrderedDict())
        blocks = worker.blocks
        pop = blocks.pop
        index = self._index
        get = index.get
        bit = worker.bit
        added = 0
        for seq in reversed(seq_hashes):  # deepest first: pruned before its prefix
            if pop(seq, None) is None:
                index[seq] = get(seq, 0) | bit
                added += 1
            blocks[seq] = expiry
        self._total += added
        stats = self.stats
        stats.routings += 1
        stats.blocks_recorded += added
        stats.blocks_refreshed += len(seq_hashes) - added
        if expiry < self._next_expiry:
            self._next_expiry = expiry
        if self._total > self.max_tree_size:
            self.prune()

    def find_matches(
        self,
        local_hashes: Sequence[int],
        seq_hashes: Sequence[int] | None = None,
        *,
        early_exit: bool = False,
        now: float | None = None,
    ) -> dict[WorkerKey, int]:
        """As `KvIndexer.find_matches`, over the entries not expired at `now` (default: the clock)."""
        if now is None:
            now = self._clock()
        if now >= self._next_expiry:
            self.expire(now)
        return super().find_matches(local_hashes, seq_hashes, early_exit=early_exit)

    def expire(self, now: float | None = None) -> int:
        """Drop the entries whose expiry is at or before `now`; returns how many."""
        if now is None:
            now = self._clock()
        if now < self._next_expiry:
            return 0
        expired = 0
        earliest = float("inf")
        for worker in self._workers.values():
            blocks = worker.blocks
            while blocks:
                seq = next(iter(blocks))
                expiry = blocks[seq]
                if expiry > now:
                    earliest = min(earliest, expiry)
                    break
                del blocks[seq]
                self._unset(seq, worker.bit)
                expired += 1
        self._total -= expired
        self._next_expiry = earliest
        self.stats.expired += expired
        return expired

    def prune(self) -> int:
        """If over `max_tree_size` entries, drop the earliest-expiring ones (over all worker keys)
        down to `max_tree_size * prune_target_ratio`; returns how many."""
        if self._total <= self.max_tree_size:
            return 0
        excess = self._total - int(self.max_tree_size * self.prune_target_ratio)
        workers = list(self._workers.values())
        # Each key's blocks are in expiry order: merge them, take the first `excess`.
        streams = [zip(w.blocks.values(), repeat(i)) for i, w in enumerate(workers)]
        counts = Counter(i for _, i in islice(heapq.merge(*streams), excess))
        for i, count in counts.items():
            worker = workers[i]
            popitem = worker.blocks.popitem
            for _ in range(count):
                seq, _expiry = popitem(last=False)
                self._unset(seq, worker.bit)
        self._total -= excess
        self.stats.pruned += excess
        return excess

    def _worker_seqs(self, worker: WorkerBlocks) -> Iterable[int]:
        return worker.blocks.keys()
