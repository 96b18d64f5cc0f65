"""The router's own bookkeeping of what it has sent to each worker and not yet seen finish.

Per worker rank: the prompt tokens still waiting for their first output token (prefill work
queued there) and the KV blocks its in-flight requests hold (reference-counted by sequence hash,
so blocks that requests share count once, as they do in the engine's cache). Updated at once
when a request is routed, gets its first token, and ends — never from polled metrics, so a
burst of concurrent requests sees the load the earlier ones of the burst just added (the
stale-bookkeeping herding Dynamo users report).

Blocks of in-flight requests are also cache the engine *will* hold: a request routed a moment
ago has not produced a KV event yet, but its prompt blocks are already allocated (or queued) on
that worker and cannot be evicted while it runs. `prefix_depth` exposes them so that concurrent
first uses of one prefix meet on the same worker instead of each computing it elsewhere.

A request's leading blocks that form a prefix other requests share (a document, a system
prompt: `shared`, the blocks of the longest prefix the tokenizer named) are booked as one chain,
named by its last sequence hash (which names every block before it): the first request of a
chain on a worker books its blocks, the others only count themselves on the chain, and the last
to leave unbooks them. The held blocks, what every query reads, are the same as booking every
block of every request; a 4k-token prompt of 256 blocks costs its own few blocks, not 256 dict
updates, on the way in and out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from dynamo_graph.router.kv.indexer import WorkerKey


@dataclass(slots=True)
class WorkerLoad:
    prefill_tokens: int = 0
    blocks: dict[int, int] = field(default_factory=dict)  # sequence hash -> bookings holding it
    chains: dict[int, int] = field(default_factory=dict)  # a chain's last hash -> requests on it


@dataclass(slots=True)
class _Booking:
    key: WorkerKey
    blocks: Sequence[int]  # the chain's, then the request's own
    prefill_tokens: int
    shared: int  # leading blocks booked as a chain


def _hold(held: dict[int, int], blocks: Sequence[int]) -> None:
    for block in blocks:
        held[block] = held.get(block, 0) + 1


def _release(held: dict[int, int], blocks: Sequence[int]) -> None:
    for block in blocks:
        count = held.get(block, 0) - 1
        if count > 0:
            held[block] = count
        else:
            held.pop(block, None)


class ActiveSequences:
    def __init__(self) -> None:
        self.loads: dict[WorkerKey, WorkerLoad] = {}
        self._bookings: dict[str, _Booking] = {}

    def __len__(self) -> int:
        return len(self._bookings)

    def add(
        self, request_id: str, key: WorkerKey, blocks: Sequence[int], prefill_tokens: int, shared: int = 0
    ) -> None:
        """Book a routed request: `blocks` are the sequence hashes of all its prompt blocks (a
        trailing partial block under an id of its own), `prefill_tokens` what it must compute,
        `shared` how many leading blocks are a prefix other requests may share (a chain)."""
        self.free(request_id)
        load = self.loads.get(key)
        if load is None:
            load = self.loads[key] = WorkerLoad()
        shared = max(min(shared, len(blocks)), 0)
        held = load.blocks
        if shared:
            chains = load.chains
            last = blocks[shared - 1]
            riders = chains.get(last, 0)
            if not riders:
                _hold(held, blocks[:shared])
            chains[last] = riders + 1
        _hold(held, blocks[shared:] if shared else blocks)
        load.prefill_tokens += prefill_tokens
        self._bookings[request_id] = _Booking(key, blocks, prefill_tokens, shared)

    def prefill_completed(self, request_id: str) -> None:
        """First token out: its prompt is no longer queued work on that worker."""
        booking = self._bookings.get(request_id)
        if booking is None or not booking.prefill_tokens:
            return
        load = self.loads.get(booking.key)
        if load is not None:
            load.prefill_tokens -= booking.prefill_tokens
        booking.prefill_tokens = 0

    def free(self, request_id: str) -> None:
        """The request ended (finished, failed or cancelled): release everything it booked."""
        booking = self._bookings.pop(request_id, None)
        if booking is None:
            return
        load = self.loads.get(booking.key)
        if load is None:
            return
        load.prefill_tokens -= booking.prefill_tokens
        blocks, shared, held = booking.blocks, booking.shared, load.blocks
        _release(held, blocks[shared:] if shared else blocks)
        if shared:
            chains = load.chains
            last = blocks[shared - 1]
            riders = chains.get(last, 0) - 1
            if riders > 0:
                chains[last] = riders
            else:
                chains.pop(last, None)
                _release(held, blocks[:shared])

    def remove_worker(self, worker_id: int) -> None:
        for key in [k for k in self.loads if k[0] == worker_id]:
            del self.loads[key]

    def prefill_tokens(self, key: WorkerKey) -> int:
        load = self.loads.get(key)
        return load.prefill_tokens if load is not None else 0

    def active_blocks(self, key: WorkerKey) -> int:
        load = self.loads.get(key)
        return len(load.blocks) if load is not None else 0

    def prefix_depth(self, key: WorkerKey, seq_hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt the worker's in-flight requests hold.

        The held set is prefix-closed (a sequence hash implies every block before it, and each
        request books a whole chain), so a binary search finds the depth in O(log n)."""
        load = self.loads.get(key)
        if load is None or not load.blocks or not seq_hashes:
            return 0
        held = load.blocks
        lo, hi = 0, len(seq_hashes)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if seq_hashes[mid - 1] in held:
                lo = mid
            else:
                hi = mid - 1
        return lo
