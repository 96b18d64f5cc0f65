"""KV-cache-aware routing: block hashing, the KV event contract, indexers of every worker's
cached blocks, and the scheduler that weighs prefix overlap against load (DESIGN.md, KV events)."""
