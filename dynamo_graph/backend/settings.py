"""What an engine is built from: `EngineSettings`, and the error a setting that cannot be used raises.

An engine needs the model, its context length and KV block size, the parallelism flags and the
`--extra-engine-args` file, not the whole `dyngraph run` command line (backend/run_config.py):
frontend, routing and plane flags are none of its business. `RunConfig.engine_settings()` cuts
this out of a command line; tests and embedders build it directly. Field names are dynamo-run's
flag names, so an engine file written against the command line's settings keeps working.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class RunConfigError(ValueError):
    """A setting that cannot be used (a flag, an engine argument, a model): the CLI prints the
    message and exits with code 2, as for a bad flag."""


@dataclass
class EngineSettings:
    # The `out=` word the engine was chosen by (a python engine file's path rides in it).
    engine: str | None = None
    model_path: str | None = None
    model_name: str | None = None
    model_config: str | None = None
    context_length: int | None = None
    kv_cache_block_size: int | None = None
    tensor_parallel_size: int = 1
    num_nodes: int = 1
    node_rank: int = 0
    leader_addr: str | None = None
    base_gpu_id: int = 0
    extra_engine_args: Path | None = None
    # The worker's part in disaggregated serving (agg, prefill or decode): engines with a native KV
    # connector configure its role from it (vLLM's kv_role, SGLang's disaggregation_mode, ...).
    disaggregation_mode: str = "agg"
    # LoRA adapters declared on the command line (`--lora-modules NAME=PATH,...`; backend/lora.py):
    # engines that must be told at start (vLLM's enable_lora) see them here.
    lora_modules: str | None = None
    # Serve the model's embeddings (`/v1/embeddings`) instead of generating: the engine's
    # embedding mode (EngineSpec.embedding_target), published as model type "embedding".
    embedding: bool = False
    # dynamo-run hands python engine files its --http-port among their arguments.
    http_port: int = 8080
    # Arguments after `--` on the command line, for the engine's own parser.
    engine_argv: list[str] = field(default_factory=list)
    # Flags given explicitly (so an engine can tell "given" from "left at its default").
    explicit: set[str] = field(default_factory=set)

    def engine_args(self) -> dict[str, Any]:
        """The object in the --extra-engine-args file: JSON, or YAML for a .yaml/.yml file (the
        form TensorRT-LLM users write); {} without one."""
        if self.extra_engine_args is None:
            return {}
        return read_engine_args_file(self.extra_engine_args)

    def flag_given(self, name: str) -> bool:
        """Whether the setting `name` was given on the command line (or differs from its default)."""
        return name in self.explicit or getattr(self, name) != _DEFAULTS[name]


_DEFAULTS = {
    f.name: f.default for f in dataclasses.fields(EngineSettings) if f.default is not dataclasses.MISSING
}


def read_engine_args_file(path: Path) -> dict[str, Any]:
    """An --extra-engine-args file's mapping; a RunConfigError naming the file when it is unreadable,
    not valid JSON/YAML, or not a mapping."""
    is_yaml = path.suffix.lower() in (".yaml", ".yml")
    if is_yaml:
        import yaml

        parse, bad_syntax = yaml.safe_load, yaml.YAMLError
    else:
        parse, bad_syntax = json.loads, json.JSONDecodeError
    try:
        data = parse(path.read_text())
    except OSError as err:
        raise RunConfigError(f"--extra-engine-args: cannot read {path}: {err}") from None
    except bad_syntax as err:
        raise RunConfigError(
            f"--extra-engine-args: {path} is not valid {'YAML' if is_yaml else 'JSON'}: {err}"
        ) from None
    if data is None:  # an empty file
        return {}
    if not isinstance(data, dict):
        raise RunConfigError(f"--extra-engine-args: {path} must hold a mapping of engine options")
    return data
