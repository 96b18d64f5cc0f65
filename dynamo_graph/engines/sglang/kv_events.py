"""SGLang's KV events (msgpack `KVEventBatch`es over ZMQ) -> our `KvEventSink`.

msgspec mirrors of sglang.srt.disaggregation.kv_events (array-like, tagged by class name). Fields
added by later SGLang versions trail the ones below and are ignored when decoding.
"""

from __future__ import annotations

import msgspec

from dynamo_graph.engines.kv_bridge import U64, KvBlockBridge


class BlockStored(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None


class BlockRemoved(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag="BlockRemoved"):
    block_hashes: list[int]


class AllBlocksCleared(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag="AllBlocksCleared"):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


_decode_batch = msgspec.msgpack.Decoder(KVEventBatch).decode


class SglangKvEventBridge(KvBlockBridge):
    """SGLang's KV event batches -> our `KvEventSink` (stored / removed / cleared per DP rank)."""

    engine = "sglang"

    def handle_payload(self, payload: bytes, dp_rank: int = 0) -> None:
        self.handle_batch(_decode_batch(payload), dp_rank)

    def handle_batch(self, batch: KVEventBatch, dp_rank: int = 0) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                size = self.event_block_size(event.block_size)
                parent = None if event.parent_block_hash is None else event.parent_block_hash & U64
                hashes = [h & U64 for h in event.block_hashes]
                self.store(parent, hashes, event.token_ids, size, dp_rank)
            elif isinstance(event, BlockRemoved):
                self.remove((h & U64 for h in event.block_hashes), dp_rank)
            else:
                self.clear(dp_rank)
