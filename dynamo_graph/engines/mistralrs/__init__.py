"""`out=mistralrs`: mistral.rs behind a token-id engine contract (docs/engines/mistralrs.md).

args.py the settings, vocab.py the token-bytes -> id bridge, worker.py the thread that owns the
Runner, engine.py the adapter. mistralrs is imported only when an engine is built.
"""
