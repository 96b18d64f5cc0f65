"""Block hashes of prompts whose prefix was hashed before: hash only what follows it.

A chat's prompt is mostly what earlier requests sent (a system prompt, a shared document, the
turns so far), and the frontend's segment tokenizer names such leading prefixes: a token count
and a key that is a digest of exactly those token ids (llm/segment_tokenizer.py). This cache
keeps, per key, the local and sequence hashes of the prefix's *full* blocks; a prompt with a
known prefix hashes only the tokens after them, chaining from the last cached sequence hash,
which gives exactly what hashing the whole prompt gives (hashing.py: blocks are aligned at
multiples of the block size from the start, and each sequence hash depends only on its
predecessor). The longest known prefix is used, and the longest named prefix is stored.

One cache belongs to one router, so to one block size and one model: the base model's, or one
LoRA adapter's, whose local hashes are seeded by the adapter (`seed`, hashing.py). Keys name
token ids only, which are the same whichever adapter a prompt is for, so a cache must never
serve routers of two adapters: each adapter's router has its own (router.py). A request's cache
salt changes every hash of its prompt (hashing.py), so a salted prefix is cached under its key
and its salt. Bounded at
`DYN_ROUTER_HASH_CACHE_MB` (16) of hashes, least recently used out first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from dynamo_graph.router.kv.hashing import HASH_SEED, local_block_hashes, sequence_hashes
from dynamo_graph.runtime.env import env_float

_BYTES_PER_BLOCK = 2 * (8 + 36)  # two list slots and two int objects of up to 64 bits
_BYTES_PER_ENTRY = 200  # the key, the tuple, the lists and the map's slot


class PrefixHashCache:
    """`hashes(token_ids, prefixes)` gives exactly `local_block_hashes` and `sequence_hashes`
    of `token_ids`, reusing those of the longest prefix hashed before."""

    def __init__(self, block_size: int, *, seed: int = HASH_SEED, max_bytes: int | None = None) -> None:
        """`seed`: of the local hashes (`lora_hash_seed` of the router's adapter)."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, not {block_size}")
        self.block_size = block_size
        self.seed = seed
        if max_bytes is None:
            max_bytes = int(env_float("DYN_ROUTER_HASH_CACHE_MB", 16.0) * (1 << 20))
        self.max_bytes = max_bytes
        self._entries: OrderedDict[bytes, tuple[list[int], list[int]]] = OrderedDict()
        self.held_bytes = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def hashes(
        self,
        token_ids: Sequence[int],
        prefixes: Sequence[tuple[int, bytes]] | None = None,
        salt: str | None = None,
    ) -> tuple[list[int], list[int]]:
        """Local and sequence hashes of the full blocks of `token_ids`. `prefixes`: (token
        count, key of those leading ids), shortest first, as the segment tokenizer names them;
        `salt`: the request's cache salt."""
        bs = self.block_size
        if not prefixes or self.max_bytes <= 0:
            local = local_block_hashes(token_ids, bs, self.seed, salt)
            return local, sequence_hashes(local)
        entries = self._entries
        suffix = salt.encode() if salt else b""
        found = None
        for _, key in reversed(prefixes):
            key += suffix  # keys are digests of one length: the salt after one is unambiguous
            found = entries.get(key)
            if found is not None and len(found[0]) * bs <= len(token_ids):  # else a foreign key
                entries.move_to_end(key)
                break
            found = None
        if found is None:
            self.misses += 1
            done = 0
            local = local_block_hashes(token_ids, bs, self.seed, salt)
            seq = sequence_hashes(local)
        else:  # new lists: callers may keep them
            self.hits += 1
            done = len(found[0])
            rest = local_block_hashes(token_ids[done * bs :], bs, self.seed)
            local = [*found[0], *rest]
            seq = [*found[1], *sequence_hashes(rest, found[1][-1])]
        tokens, key = prefixes[-1]
        key += suffix
        blocks = min(tokens, len(token_ids)) // bs
        if blocks > done and key not in entries:
            self._remember(key, local[:blocks], seq[:blocks])
        return local, seq

    def _remember(self, key: bytes, local: list[int], seq: list[int]) -> None:
        size = _BYTES_PER_ENTRY + _BYTES_PER_BLOCK * len(local)
        if size > self.max_bytes:
            return
        self._entries[key] = (local, seq)
        self.held_bytes += size
        while self.held_bytes > self.max_bytes:
            _, (old, _) = self._entries.popitem(last=False)
            self.held_bytes -= _BYTES_PER_ENTRY + _BYTES_PER_BLOCK * len(old)
