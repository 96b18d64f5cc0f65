"""TensorRT-LLM's KV cache events (dicts from `get_kv_cache_events_async`) -> our `KvEventSink`."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from dynamo_graph.engines.kv_bridge import U64, KvBlockBridge
from dynamo_graph.router.kv.hashing import local_block_hashes
from dynamo_graph.router.kv.protocols import StoredBlock

log = logging.getLogger(__name__)


def _token_id(token: Any) -> int:
    return int(token["token_id"]) if isinstance(token, Mapping) else int(token)


class TrtllmKvEventBridge(KvBlockBridge):
    """TensorRT-LLM's KV cache event dicts -> our `KvEventSink` (stored / removed per DP rank)."""

    engine = "trtllm"

    def handle(self, event: Mapping[str, Any]) -> None:
        rank = int(event.get("attention_dp_rank") or 0)
        data = event.get("data") or {}
        kind = data.get("type")
        if kind == "stored":
            self._stored(data, rank)
        elif kind == "removed":
            self.remove((int(raw) & U64 for raw in data.get("block_hashes") or ()), rank)
        # "created" / "updated" say nothing the router uses

    def _stored(self, data: Mapping[str, Any], rank: int) -> None:
        # Each block carries its own tokens (not one list for the event, as vLLM and SGLang send).
        size = int(self.block_size or 0)
        blocks: list[StoredBlock] = []
        for block in data.get("blocks") or ():
            raw = block.get("block_hash")
            if raw is None:
                continue
            tokens = [_token_id(t) for t in block.get("tokens") or ()]
            if len(tokens) > size:
                log.error("trtllm: a KV block of %d tokens, more than tokens_per_block %d", len(tokens), size)
                return
            if len(tokens) < size:  # a partial block: unknown to the router, as is its removal
                self.mark_partial(int(raw) & U64, rank)
                break
            blocks.append(StoredBlock(int(raw) & U64, local_block_hashes(tokens, size)[0]))
        parent = data.get("parent_hash")
        self.store_blocks(None if parent is None else int(parent) & U64, blocks, rank)
