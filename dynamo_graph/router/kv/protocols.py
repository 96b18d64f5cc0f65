"""The KV event contract on the event plane (docs/kv-events.md), and worker load metrics.

Engines publish on their endpoint's channel (namespace/component): `kv_events` carry
`KvCacheEvent`s, `load_metrics` carry `LoadMetrics`. Event ids are monotonic per worker; the
router tolerates gaps, duplicates and events about blocks it never saw. `block_hash` is whatever
stable id the engine gives a block (for the mocker, our sequence hash; for vLLM, its own hash);
`tokens_hash` is the local hash of the block's tokens (see hashing.py).

LoRA adapters: a `stored` event names the adapter its blocks belong to (`lora_name`, None for
the base model, and then left out of the encoded event: readers from before the field decode
base-model events as ever, and events from before it decode as the base model's), and their
`tokens_hash`es are seeded by the adapter (`lora_hash_seed`). A frontend's KV router per model
keeps only the stored blocks of its own model or adapter. `removed` and `cleared` carry no
adapter, as vLLM's do not: engines name an adapter's blocks apart from the base model's (vLLM
mixes the adapter into its block hash, the mocker into its local hashes), so every router of the
channel applies a removal and drops the blocks it holds (to the others those hashes are unknown:
counted, ignored), and a `cleared` empties the worker rank's blocks in every router (the
engine's whole cache is gone, every adapter's with it). docs/kv-events.md has the whole contract.
"""

from __future__ import annotations

import msgspec

KV_EVENTS_TOPIC = "kv_events"
LOAD_METRICS_TOPIC = "load_metrics"


class StoredBlock(msgspec.Struct, array_like=True, frozen=True):
    block_hash: int
    tokens_hash: int


class KvStored(msgspec.Struct, tag="stored", frozen=True, omit_defaults=True):
    """Blocks now cached, in order; the first one's parent is `parent_hash` (None: a first block).
    `lora_name`: the LoRA adapter whose blocks they are (None: the base model's)."""

    blocks: list[StoredBlock]
    parent_hash: int | None = None
    lora_name: str | None = None


class KvRemoved(msgspec.Struct, tag="removed", frozen=True):
    block_hashes: list[int]


class KvCleared(msgspec.Struct, tag="cleared", frozen=True):
    """Everything this worker (rank) had cached is gone."""


KvEventData = KvStored | KvRemoved | KvCleared


class KvCacheEvent(msgspec.Struct, frozen=True):
    event_id: int
    worker_id: int
    data: KvEventData
    dp_rank: int = 0


class LoadMetrics(msgspec.Struct, frozen=True):
    """A worker rank's load after a scheduling step, as the engine sees it."""

    worker_id: int
    active_blocks: int
    total_blocks: int
    waiting: int
    running: int
    dp_rank: int = 0
    # Prompt tokens this rank has accepted and not yet computed (waiting and partially
    # prefilled requests).
    prefill_tokens: int = 0


encode_event = msgspec.msgpack.Encoder().encode
decode_kv_event = msgspec.msgpack.Decoder(KvCacheEvent).decode
decode_load_metrics = msgspec.msgpack.Decoder(LoadMetrics).decode
