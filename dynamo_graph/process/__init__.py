"""The composition root of every `dyngraph run` process: its settings (`run_config.py`) and
what it builds from them (`launch.py`: an engine, a worker, a frontend, an input)."""
