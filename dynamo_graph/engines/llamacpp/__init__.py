"""`out=llamacpp`: a GGUF model run in-process by llama.cpp (docs/engines/llamacpp.md).

args.py the options and model loading, batch.py the decoding thread, guided.py grammars and
logprobs, state.py the KV handoff, embed.py the embedding mode, engine.py the adapter.
llama-cpp-python is imported only when an engine is built.
"""
