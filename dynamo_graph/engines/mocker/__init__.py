"""`out=mocker`: a vLLM worker simulated in Python (scheduling, prefix cache, KV events, timing).

- args.py: `MockerArgs`, loaded from `--extra-engine-args`.
- perf_model.py: how long a forward pass takes.
- kv_manager.py: the block pool with prefix caching.
- scheduler.py: one rank's vLLM-style scheduler (`Scheduler.step()` = one forward pass).
- engine.py: `MockerEngine`, the `LLMEngine` that runs the schedulers on asyncio.

Only `args` is imported here; import `engine` for the engine (the engine registry does it lazily).
"""

from dynamo_graph.engines.mocker.args import MockerArgs, MockerArgsError

__all__ = ["MockerArgs", "MockerArgsError"]
