"""What the engine adapters' KV event bridges share: an engine's stored blocks become ours.

vLLM, SGLang and TensorRT-LLM report a stored block as the engine's own block hash plus the
block's token ids. The router matches prefixes by *our* local hash of a block's tokens
(router/kv/hashing.py), so each full block is sent on as `StoredBlock(engine hash as u64, local
hash)`. The router knows no partial blocks: a partial block's hash is remembered per DP rank and
its later removal is not passed on. A LoRA adapter's blocks are hashed with the adapter's seed
and their stored event names it (router/kv/protocols.py). Each adapter keeps the parsing of its
engine's event format.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from dynamo_graph.router.kv.hashing import local_block_hashes, lora_hash_seed
from dynamo_graph.router.kv.protocols import StoredBlock

if TYPE_CHECKING:
    from dynamo_graph.router.kv.publisher import KvEventSink

log = logging.getLogger(__name__)

U64 = (1 << 64) - 1


class KvBlockBridge:
    """An engine's stored / removed / cleared blocks -> our `KvEventSink`; subclasses parse events."""

    engine = "engine"  # the name log lines start with

    def __init__(self, sink: KvEventSink, block_size: int | None = None) -> None:
        self.sink = sink
        self.block_size = block_size
        self._partial: dict[int, set[int]] = {}  # per rank: hashes of partial blocks we did not report
        self._warned: set[str] = set()

    def warn_once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(f"{self.engine}: {message}", *args)

    def event_block_size(self, size: int | None) -> int:
        """The event's block size (else the card's), with a warning (once) when the two differ."""
        size = int(size or self.block_size or 0)
        if self.block_size and size != self.block_size:
            self.warn_once(
                "size",
                "KV events use block size %d, the card says %d; routing will not match",
                size,
                self.block_size,
            )
        return size

    def store(
        self,
        parent: int | None,
        hashes: Sequence[int],
        tokens: Sequence[int],
        size: int,
        rank: int,
        lora_name: str | None = None,
        salt: str | None = None,
    ) -> int:
        """Blocks `hashes` (u64s) holding `tokens` in order, `size` tokens each, of the LoRA
        adapter `lora_name` (None: the base model): the full ones go to the sink, the rest are
        remembered as partial. Returns how many were partial. `salt`: the cache salt of a
        prompt's first block (`parent` None), which seeds its hash as the router seeds it."""
        locals_ = local_block_hashes(
            tokens, size, lora_hash_seed(lora_name), salt if parent is None else None
        )
        blocks = [StoredBlock(h, local) for h, local in zip(hashes, locals_, strict=False)]
        partial = hashes[len(blocks) :]
        for h in partial:
            self.mark_partial(h, rank)
        self.store_blocks(parent, blocks, rank, lora_name)
        return len(partial)

    def store_blocks(
        self, parent: int | None, blocks: list[StoredBlock], rank: int, lora_name: str | None = None
    ) -> None:
        if blocks:
            self.sink.stored(parent, blocks, rank, lora_name)

    def mark_partial(self, block_hash: int, rank: int) -> None:
        self._partial.setdefault(rank, set()).add(block_hash)

    def remove(self, hashes: Iterable[int], rank: int) -> None:
        """Removed blocks (u64s), less the partial ones the router never saw."""
        hashes = list(hashes)
        partial = self._partial.get(rank)
        if partial:
            kept = [h for h in hashes if h not in partial]
            partial.difference_update(hashes)
            hashes = kept
        if hashes:
            self.sink.removed(hashes, rank)

    def clear(self, rank: int) -> None:
        self._partial.pop(rank, None)
        self.sink.cleared(rank)
