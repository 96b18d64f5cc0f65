"""KV routing of LoRA adapters without processes: adapter-seeded block hashes, the `lora_name` of
stored events (and events from before it), and one router per model, each keeping only its own
model's blocks from a channel that carries every model's events."""

from __future__ import annotations

import msgspec
from xxhash import xxh3_64_intdigest

from dynamo_graph.router.config import RouterConfig
from dynamo_graph.router.kv.hashing import HASH_SEED, local_block_hashes, lora_hash_seed, sequence_hashes
from dynamo_graph.router.kv.prefix_hashes import PrefixHashCache
from dynamo_graph.router.kv.protocols import (
    KvCacheEvent,
    KvCleared,
    KvRemoved,
    KvStored,
    StoredBlock,
    decode_kv_event,
    encode_event,
)
from dynamo_graph.router.kv.router import KvRouter

BS = 16
PROMPT = list(range(100, 100 + 10 * BS))


def stored(
    worker: int, tokens: list[int], lora_name: str | None, event_id: int
) -> tuple[KvCacheEvent, list[int]]:
    """A worker's stored event for `tokens`' full blocks of model `lora_name`, as engines send it
    (the engine's block ids opaque), and those block ids."""
    local = local_block_hashes(tokens, BS, lora_hash_seed(lora_name))
    ids = [h ^ 0x5A5A for h in sequence_hashes(local)]  # the engine's own ids
    blocks = [StoredBlock(i, h) for i, h in zip(ids, local, strict=True)]
    return KvCacheEvent(event_id, worker, KvStored(blocks, None, lora_name)), ids


def test_adapter_seeds_are_dynamos_and_keep_every_model_apart() -> None:
    assert lora_hash_seed(None) == lora_hash_seed("") == HASH_SEED
    assert lora_hash_seed("sql") == (HASH_SEED + xxh3_64_intdigest(b"sql")) % 2**64
    base, sql, chat = (local_block_hashes(PROMPT, BS, lora_hash_seed(n)) for n in (None, "sql", "chat"))
    assert base == local_block_hashes(PROMPT, BS)
    assert not set(base) & set(sql) and not set(sql) & set(chat) and not set(base) & set(chat)


class OldKvStored(msgspec.Struct, tag="stored", frozen=True):
    """KvStored before `lora_name`."""

    blocks: list[StoredBlock]
    parent_hash: int | None = None


class OldEvent(msgspec.Struct, frozen=True):
    event_id: int
    worker_id: int
    data: OldKvStored
    dp_rank: int = 0


def test_lora_name_is_optional_on_the_wire_both_ways() -> None:
    old = msgspec.msgpack.encode(OldEvent(1, 7, OldKvStored([StoredBlock(1, 2)], 9)))
    assert decode_kv_event(old).data == KvStored([StoredBlock(1, 2)], 9, None)
    read_by_old = msgspec.msgpack.Decoder(OldEvent).decode
    base = KvCacheEvent(2, 7, KvStored([StoredBlock(3, 4)], 1))
    assert b"lora_name" not in encode_event(base)
    assert read_by_old(encode_event(base)).data == OldKvStored([StoredBlock(3, 4)], 1)
    adapter = KvCacheEvent(3, 7, KvStored([StoredBlock(5, 6)], None, "sql"))
    assert decode_kv_event(encode_event(adapter)) == adapter
    # A router from before the field reads an adapter's blocks as the base model's; their
    # adapter-seeded hashes never match a base-model prompt, so they cost it memory, not hits.
    assert read_by_old(encode_event(adapter)).data == OldKvStored([StoredBlock(5, 6)])


def test_each_router_keeps_only_its_models_blocks_and_every_router_applies_removals() -> None:
    base, sql = KvRouter(BS, seed=0), KvRouter(BS, seed=0, lora_name="sql")
    channel: list[KvCacheEvent] = []  # what every router of the channel hears
    event, sql_on_1 = stored(1, PROMPT, "sql", 1)
    channel.append(event)
    event, base_on_2 = stored(2, PROMPT, None, 1)
    channel.append(event)
    channel.append(stored(2, PROMPT, "chat", 2)[0])  # a third model on the same channel
    for router in (base, sql):
        for event in channel:
            router.indexer.apply_event(event)

    # Each router finds its own model's blocks, on the worker that holds them.
    assert base.route("b", [*PROMPT, 1], [1, 2]).key == (2, 0)
    choice = sql.route("s", [*PROMPT, 1], [1, 2])
    assert (choice.key, choice.overlap_blocks) == ((1, 0), 10)
    assert sql.uncached_tokens([*PROMPT, 1], [1, 2]) == 1 and sql.uncached_tokens([*PROMPT, 1], [2]) == 161
    assert sql.indexer.entries == 10 and base.indexer.entries == 10  # nobody holds the others' blocks
    assert sql.indexer.stats.other_model == 2 and base.indexer.stats.other_model == 2
    base.free("b")
    sql.free("s")  # in-flight bookings count as overlap too

    # Removals carry no adapter: every router applies them, and only the holder drops blocks.
    for router in (base, sql):
        router.indexer.apply_event(KvCacheEvent(3, 1, KvRemoved(sql_on_1[5:])))
        router.indexer.apply_event(KvCacheEvent(4, 2, KvRemoved(base_on_2[8:])))
    assert sql.route("s2", [*PROMPT, 1], [1, 2]).overlap_blocks == 5
    assert base.indexer.entries == 8
    # A cleared worker rank lost every model's blocks.
    for router in (base, sql):
        router.indexer.apply_event(KvCacheEvent(5, 1, KvCleared()))
    assert sql.indexer.entries == 0 and base.indexer.entries == 8


def test_an_adapters_prefix_hash_cache_gives_its_seeded_hashes() -> None:
    """The frontend names prompt prefixes by their token ids alone; an adapter's router reuses a
    prefix's hashes from its own cache, seeded by the adapter, never the base model's."""
    seed = lora_hash_seed("sql")
    want_local = local_block_hashes(PROMPT, BS, seed)
    want = (want_local, sequence_hashes(want_local))
    prefixes = [(6 * BS, b"six blocks")]
    cache = PrefixHashCache(BS, seed=seed)
    assert cache.hashes(PROMPT, prefixes) == want and cache.misses == 1
    assert cache.hashes(PROMPT, prefixes) == want and cache.hits == 1
    base = PrefixHashCache(BS)
    assert base.hashes(PROMPT, prefixes)[0] == local_block_hashes(PROMPT, BS) != want_local


def test_without_kv_events_an_adapters_router_remembers_its_own_decisions() -> None:
    router = KvRouter(BS, RouterConfig(use_kv_events=False), seed=0, lora_name="sql")
    first = router.route("t1", PROMPT, [1, 2, 3])
    router.free("t1")
    again = router.route("t2", [*PROMPT, 7, 8], [1, 2, 3])
    assert again.key == first.key and again.overlap_blocks == len(PROMPT) // BS
