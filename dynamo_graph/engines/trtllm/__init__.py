"""`out=trtllm`: TensorRT-LLM's LLM API behind the engine contract (docs/engines/trtllm.md).

args.py the LLM arguments and sampling mapping, kv_events.py its KV event bridge, engine.py the
adapter. TensorRT-LLM itself is imported only when an engine starts.
"""
