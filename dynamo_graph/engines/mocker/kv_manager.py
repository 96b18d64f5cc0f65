"""The mocker's KV block manager: a vLLM-style block pool with prefix caching.

Capacity is `num_blocks` blocks of `block_size` tokens. A block is in one of three states:

- *private*: allocated to one sequence and not (yet) a full, computed block — the prompt blocks
  a prefill has not reached, and a sequence's partial trailing block. Only counted, never shared.
- *active*: a full computed block, named by its sequence hash (router/kv/hashing.py over the
  sequence's token ids, so the router computes the same name from a prompt), reference-counted
  by the running sequences that use it.
- *inactive*: a cached full block nobody uses any more (refcount 0). It stays reusable by its
  hash until its slot is needed; then the least recently freed goes first (an LRU, as vLLM's
  free-block queue) and a `removed` event reports it.

`used` (private + active) is what running sequences hold; inactive blocks are free capacity
that still serves cache hits. Sequences free their blocks in reverse order, so a sequence's tail
blocks are evicted before its head blocks (vLLM does the same: the head is more likely shared).

Events are appended to `events` (the scheduler hands them to the engine's sink after the
forward pass): `("stored", parent_hash, [StoredBlock], lora_name)` (the adapter whose blocks
they are, None for the base model) and `("removed", [block_hash])`.
`stored` events are made by the scheduler (it knows the parents); this class makes `removed`.

Without prefix caching nothing is ever registered or reused: every block is private and freed
blocks go straight back to the free pool, so no KV events are produced (as vLLM, which publishes
KV events only from its prefix-caching block pool).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any


class KvManager:
    __slots__ = ("_active", "_inactive", "block_size", "events", "num_blocks", "prefix_caching", "private")

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        prefix_caching: bool = True,
        events: list[Any] | None = None,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.events: list[Any] = [] if events is None else events
        self._active: dict[int, int] = {}  # sequence hash -> refcount
        self._inactive: OrderedDict[int, None] = OrderedDict()  # LRU first
        self.private = 0

    # ---- state ---------------------------------------------------------------------------

    @property
    def used(self) -> int:
        """Blocks held by running sequences (active + private)."""
        return len(self._active) + self.private

    @property
    def cached(self) -> int:
        """Inactive blocks kept for prefix reuse."""
        return len(self._inactive)

    @property
    def free(self) -> int:
        """Blocks neither used nor cached."""
        return self.num_blocks - self.used - len(self._inactive)

    def usage(self) -> float:
        return self.used / self.num_blocks

    def refcount(self, block_hash: int) -> int:
        return self._active.get(block_hash, 0)

    def is_cached(self, block_hash: int) -> bool:
        return block_hash in self._active or block_hash in self._inactive

    def lru_order(self) -> list[int]:
        """Inactive blocks, the next to be evicted first."""
        return list(self._inactive)

    # ---- operations ----------------------------------------------------------------------

    def match_prefix(self, seq_hashes: Sequence[int], limit: int) -> tuple[int, int]:
        """(cached leading blocks, how many of those are active) among the first `limit`."""
        if not self.prefix_caching:
            return 0, 0
        active, inactive = self._active, self._inactive
        hit = active_hit = 0
        for h in seq_hashes[: max(limit, 0)]:
            if h in active:
                active_hit += 1
            elif h not in inactive:
                break
            hit += 1
        return hit, active_hit

    def acquire(self, seq_hashes: Sequence[int]) -> None:
        """Take a reference on cached blocks (matched by `match_prefix` just before)."""
        active, inactive = self._active, self._inactive
        for h in reversed(seq_hashes):
            rc = active.get(h)
            if rc is None:
                del inactive[h]
                active[h] = 1
            else:
                active[h] = rc + 1

    def allocate(self, n: int) -> bool:
        """Allocate `n` private blocks, evicting LRU cached blocks as needed; False (and nothing
        changed) when even eviction cannot make room."""
        if n <= 0:
            return True
        if n > self.num_blocks - self.used:
            return False
        shortfall = n - self.free
        if shortfall > 0:
            inactive = self._inactive
            evicted = [inactive.popitem(last=False)[0] for _ in range(shortfall)]
            self.events.append(("removed", evicted))
        self.private += n
        return True

    def promote(self, block_hash: int) -> None:
        """A private block of a sequence became full and computed: register it by its hash. When
        the hash is cached already (another sequence computed the same block), the sequence
        shares that block and its private one is freed."""
        self.private -= 1
        active = self._active
        rc = active.get(block_hash)
        if rc is not None:
            active[block_hash] = rc + 1
            return
        self._inactive.pop(block_hash, None)
        active[block_hash] = 1

    def release(self, seq_hashes: Sequence[int], private: int) -> None:
        """A sequence gives back its registered blocks (in sequence order) and private ones."""
        self.private -= private
        active, inactive = self._active, self._inactive
        for h in reversed(seq_hashes):
            rc = active[h]
            if rc > 1:
                active[h] = rc - 1
            else:
                del active[h]
                inactive[h] = None

    def clear(self) -> None:
        """Forget every cached block (used when the engine shuts down)."""
        self._inactive.clear()
        self._active.clear()
        self.private = 0
