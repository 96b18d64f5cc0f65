"""vLLM's KV event batches (msgpack over ZMQ, decoded with vLLM's msgspec types) -> our
`KvEventSink`; which events count and how hashes become u64: docs/engines/vllm.md."""

from __future__ import annotations

from typing import Any

from dynamo_graph.engines.kv_bridge import U64, KvBlockBridge

# The device tier of vLLM's KV cache (vLLM labels its main cache "GPU" on every platform).
_DEVICE_MEDIA = (None, "GPU")


def block_hash_u64(value: int | bytes) -> int:
    """vLLM's block hash (an int, or sha256 bytes) as a stable u64; see docs/engines/vllm.md."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return int.from_bytes(bytes(value), "big") & U64
    return int(value) & U64


def first_block_salt(event: Any, lora_name: str | None) -> str | None:
    """The cache salt of a prompt's first block, from vLLM's `extra_keys` (newer vLLMs): that
    block's keys are the adapter's name, multimodal keys, then the salt. Only a text prompt's
    keys are read (the adapter's name, then one string); anything else is no salt, which only
    costs the router the blocks' overlap, never a wrong match (docs/security.md)."""
    extra = getattr(event, "extra_keys", None)
    keys = list(extra[0] or ()) if extra else []
    if lora_name is not None and keys[:1] == [lora_name]:
        keys = keys[1:]
    return keys[0] if len(keys) == 1 and isinstance(keys[0], str) else None


class VllmKvEventBridge(KvBlockBridge):
    """vLLM's KV event batches -> our `KvEventSink` (stored / removed / cleared per DP rank)."""

    engine = "vllm"

    def handle_batch(self, batch: Any, dp_rank: int = 0) -> None:
        rank = getattr(batch, "data_parallel_rank", None)
        rank = dp_rank if rank is None else int(rank)
        for event in batch.events:
            if getattr(event, "medium", None) not in _DEVICE_MEDIA or (
                getattr(event, "group_idx", None) or 0
            ):
                continue  # an offloaded tier or another KV cache group: not what the router models
            kind = type(event).__name__
            if kind == "BlockStored":
                self._stored(event, rank)
            elif kind == "BlockRemoved":
                self.remove([block_hash_u64(h) for h in event.block_hashes], rank)
            elif kind == "AllBlocksCleared":
                self.clear(rank)
            else:
                self.warn_once(kind, "ignoring unknown KV event %s", kind)

    def _stored(self, event: Any, rank: int) -> None:
        # A LoRA adapter's blocks (vLLM keys them by adapter) go out under the adapter's name,
        # for the adapter's own kv router. A vLLM that names adapters by id only (before
        # `lora_name`) cannot be followed: those blocks are not reported, nor later their removal.
        lora_name = getattr(event, "lora_name", None) or None
        if lora_name is None and getattr(event, "lora_id", None) is not None:
            self.warn_once(
                "lora_id", "KV events name LoRA adapters by id only: adapter blocks are not reported"
            )
            for h in event.block_hashes:
                self.mark_partial(block_hash_u64(h), rank)
            return
        size = self.event_block_size(event.block_size)
        if size <= 0:
            return
        parent = event.parent_block_hash
        hashes = [block_hash_u64(h) for h in event.block_hashes]
        parent_u64 = None if parent is None else block_hash_u64(parent)
        salt = first_block_salt(event, lora_name) if parent is None else None
        if self.store(parent_u64, hashes, list(event.token_ids), size, rank, lora_name, salt):
            self.warn_once("partial", "a BlockStored event without the tokens of all its blocks")
