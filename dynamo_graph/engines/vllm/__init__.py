"""`out=vllm`: vLLM's AsyncLLM behind the engine contract (docs/engines/vllm.md).

engine.py the adapter, disagg.py its KV connectors for prefill/decode, embed.py the embedding mode,
load.py the load metrics it publishes. vLLM itself is imported only when an engine starts.
"""
