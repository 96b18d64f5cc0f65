"""`out=sglang`: SGLang's offline engine behind the engine contract (docs/engines/sglang.md).

args.py the ServerArgs and sampling mapping, kv_events.py its KV event bridge, engine.py the
adapter. SGLang itself is imported only when an engine starts.
"""
