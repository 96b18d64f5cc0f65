"""KV-cache-aware routing: block hashing (`hashing.py`, `prefix_hashes.py`), the KV event
contract (`protocols.py`, docs/kv-events.md), indexers of every worker's cached blocks
(`indexer.py`, `approx.py`), the costs that weigh prefix overlap against load (`predict.py`, the
default; `cost.py`, Dynamo's), session affinity, the queue, and the router that combines them
(`router.py`). Its settings are router/config.py's `RouterConfig`."""
