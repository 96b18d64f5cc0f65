"""Block hashes, as Dynamo computes them, so that our events and real engines' events agree.

A block's *local* hash is xxh3_64 (seed 1337) of its token ids as u32 little-endian; only full
blocks are hashed. The *sequence* hash chains them: `seq[0] = local[0]`,
`seq[i] = xxh3_64(le64(seq[i-1]) ++ le64(local[i]))`, so it names a block together with
everything before it. Local hashes key the radix tree's children; sequence hashes name blocks in
events and in the router's bookkeeping.

A LoRA adapter's blocks hold other keys and values than the base model's for the same tokens,
so their local hashes are seeded by the adapter, as Dynamo seeds them:
`seed = 1337 + xxh3_64(adapter name)` (mod 2^64; no name, or an empty one, is the base model).
Their sequence hashes chain as usual, so no block of an adapter ever names the same prefix as a
base-model block or another adapter's.

A request's *cache salt* (vLLM's `cache_salt`; the frontend sets it per tenant, docs/security.md)
goes into its first block only, as in vLLM: that block's local hash is seeded by
`salted_seed(seed, salt)`. Every later sequence hash chains from it, so two requests with other
salts share no block, while the local hashes of later blocks stay the plain ones.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence

from xxhash import xxh3_64_intdigest

HASH_SEED = 1337
_U64 = (1 << 64) - 1
_U32 = 4
_SWAP = sys.byteorder != "little"  # the hash is over little-endian u32s on every machine
assert array("I").itemsize == _U32, "array('I') must hold 32-bit unsigned ints here"
_pair = struct.Struct("<QQ").pack


def lora_hash_seed(lora_name: str | None) -> int:
    """The seed of the local hashes of `lora_name`'s blocks (None or "": the base model's)."""
    if not lora_name:
        return HASH_SEED
    return (HASH_SEED + xxh3_64_intdigest(lora_name.encode())) & _U64


def salted_seed(seed: int, salt: str | None) -> int:
    """The seed of a request's first block: `seed` itself without a salt."""
    if not salt:
        return seed
    return xxh3_64_intdigest(salt.encode(), seed)


def local_block_hashes(
    token_ids: Sequence[int], block_size: int, seed: int = HASH_SEED, salt: str | None = None
) -> list[int]:
    """The local hash of every full block of `token_ids` (a trailing partial block is skipped);
    `seed`: `lora_hash_seed` of the adapter whose blocks these are; `salt`: the request's cache
    salt, which seeds the first block (so `token_ids` must start at the prompt's start)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, not {block_size}")
    full = len(token_ids) // block_size
    if not full:
        return []
    words = array("I", token_ids)  # the trailing partial block is simply not read
    if _SWAP:
        words.byteswap()
    data = memoryview(words).cast("B")
    step = block_size * _U32
    hashes = [xxh3_64_intdigest(data[i : i + step], seed) for i in range(0, full * step, step)]
    if salt:
        hashes[0] = xxh3_64_intdigest(data[:step], salted_seed(seed, salt))
    return hashes


def chain_hash(parent: int | None, local: int) -> int:
    """The sequence hash of a block whose parent block has sequence hash `parent` (None: first)."""
    if parent is None:
        return local
    return xxh3_64_intdigest(_pair(parent, local), HASH_SEED)


def sequence_hashes(local_hashes: Sequence[int], parent: int | None = None) -> list[int]:
    """Sequence hashes of consecutive blocks, continuing from `parent` (None: from the start)."""
    out: list[int] = []
    append = out.append
    for local in local_hashes:
        parent = local if parent is None else xxh3_64_intdigest(_pair(parent, local), HASH_SEED)
        append(parent)
    return out
