"""What the vLLM tests share: a long system prompt (several KV blocks) and a KV event sink that
records what an engine publishes."""

from __future__ import annotations

from collections.abc import Sequence

from dynamo_graph.router.kv.protocols import LoadMetrics, StoredBlock

LONG = (
    "You are a careful assistant for a shipping company. Answer in short sentences, quote the relevant "
    "policy section, and never promise delivery dates that the tracking system has not confirmed."
)


class Sink:
    """A KvEventSink recording into plain lists (method names are the protocol's)."""

    def __init__(self) -> None:
        self.stored_events: list[tuple[int | None, list[StoredBlock], int]] = []
        self.lora_names: dict[int, str | None] = {}  # tokens hash -> the adapter of its stored event
        self.removed_events: list[list[int]] = []
        self.cleared_ranks: list[int] = []
        self.loads: list[LoadMetrics] = []

    def stored(
        self,
        parent_hash: int | None,
        blocks: Sequence[StoredBlock],
        dp_rank: int = 0,
        lora_name: str | None = None,
    ) -> None:
        self.stored_events.append((parent_hash, list(blocks), dp_rank))
        self.lora_names.update((b.tokens_hash, lora_name) for b in blocks)

    def removed(self, block_hashes: Sequence[int], dp_rank: int = 0) -> None:
        self.removed_events.append(list(block_hashes))

    def cleared(self, dp_rank: int = 0) -> None:
        self.cleared_ranks.append(dp_rank)

    def load(self, metrics: LoadMetrics) -> None:
        self.loads.append(metrics)

    def blocks(self) -> list[StoredBlock]:
        return [b for _, blocks, _ in self.stored_events for b in blocks]
