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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from dynamo_graph.router.kv.indexer import WorkerKey


@dataclass(slots=True)
class WorkerLoad:
    prefill_tokens: int = 0
    blocks: dict[int, int] = field(default_factory=dict)  # sequence hash -> requests holding it


@dataclass(slots=True)
class _Booking:
    key: WorkerKey
    blocks: Sequence[int]
    prefill_tokens: int


class ActiveSequences:
    def __init__(self) -> None:
        self.loads: dict[WorkerKey, WorkerLoad] = {}
        self._bookings: dict[str, _Booking] = {}

    def __len__(self) -> int:
        return len(self._bookings)

    def add(self, request_id: str, key: WorkerKey, blocks: Sequence[int], prefill_tokens: int) -> None:
        """Book a routed request: `blocks` are the sequence hashes of all its prompt blocks (a
        trailing partial block under an id of its own), `prefill_tokens` what it must compute."""
        self.free(request_id)
        load = self.loads.get(key)
        if load is None:
            load = self.loads[key] = WorkerLoad()
        held = load.blocks
        for block in blocks:
            held[block] = held.get(block, 0) + 1
        load.prefill_tokens += prefill_tokens
        self._bookings[request_id] = _Booking(key, blocks, prefill_tokens)

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
        held = load.blocks
        for block in booking.blocks:
            count = held.get(block, 0) - 1
            if count > 0:
                held[block] = count
            else:
                held.pop(block, None)

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
