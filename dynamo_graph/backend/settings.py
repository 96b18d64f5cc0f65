"""What an engine and a worker are built from (`EngineSettings`, `WorkerSettings`), declared once
as settings (dynamo_graph/options.py), and the error a setting that cannot be used raises.

An engine needs the model, its context length and KV block size, the parallelism flags and the
`--extra-engine-args` file, not the whole `dyngraph run` command line (process/run_config.py):
frontend, routing and plane flags are none of its business. Tests and embedders build it
directly. Field names are dynamo-run's flag names, so an engine file written against the command
line's settings keeps working.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from dynamo_graph.options import SettingError, Spell, setting

FOLLOWING = "following leader"
"""What a worker of node rank > 0 logs as it starts its engine, which joins the leader (it
serves nothing itself: the leader does, for the whole replica)."""


class RunConfigError(SettingError):
    """A setting that cannot be used (a flag, an engine argument, a model): the CLI prints the
    message and exits with code 2, as for a bad flag."""


@dataclass
class EngineSettings:
    """What an engine is built from; field names are dynamo-run's flag names."""

    engine: str | None = None
    """The `out=` word the engine was chosen by (a python engine file's path rides in it)."""
    model_path: str | None = setting(None, flag="--model-path", in_graph=False)
    """HF folder, GGUF file or org/name."""
    model_name: str | None = setting(None, flag="--model-name", in_graph=False)
    """The name the model is served under."""
    model_config: str | None = setting(None, flag="--model-config", in_graph=False)
    """HF folder with tokenizer files (for a GGUF)."""
    context_length: int | None = setting(None, flag="--context-length", ge=1, in_graph=False)
    """Override the model's context length."""
    kv_cache_block_size: int | None = setting(None, flag="--kv-cache-block-size", ge=1, in_graph=False)
    """Tokens per KV cache block (the router hashes prompts in blocks of this size)."""
    tensor_parallel_size: int = setting(1, flag="--tensor-parallel-size", ge=1, in_graph=False)
    """GPUs one replica's engine shards the model over."""
    num_nodes: int = setting(1, flag="--num-nodes", ge=1, in_graph=False)
    """Nodes one replica's engine spans."""
    node_rank: int = setting(0, flag="--node-rank", ge=0, in_graph=False)
    """This process's node among `num_nodes`."""
    leader_addr: str | None = setting(None, flag="--leader-addr", in_graph=False)
    """HOST:PORT of node rank 0."""
    base_gpu_id: int = setting(0, flag="--base-gpu-id", ge=0, in_graph=False)
    """The first GPU this engine uses."""
    extra_engine_args: Path | None = setting(None, flag="--extra-engine-args", in_graph=False)
    """JSON (or YAML) file of engine arguments."""
    disaggregation_mode: Literal["agg", "prefill", "decode"] = setting(
        "agg", flag="--disaggregation-mode", in_graph=False
    )
    """The worker's part: agg (whole requests) | prefill (prompts; hands the KV over) | decode.
    Engines with a native KV connector configure its role from it."""
    disaggregation_bootstrap_port: int | None = setting(
        None, flag="--disaggregation-bootstrap-port", ge=1, le=65535, in_graph=False
    )
    """Where a prefill engine that pairs with decode engines by bootstrap room (SGLang) serves
    its bootstrap server; the graph compiler gives each prefill worker its own."""
    lora_modules: str | None = setting(None, flag="--lora-modules", in_graph=False)
    """LoRA adapters to serve beside the model: NAME=PATH[,NAME=PATH] (engines that must be
    told at start, like vLLM's enable_lora, see them here)."""
    embedding: bool = setting(False, flag="--embedding", in_graph=False)
    """Serve the model's embeddings (/v1/embeddings) instead of generating: the engine's
    embedding mode, published as model type "embedding"."""
    serves_metrics: bool = False
    """The worker serves `/metrics` (its --metrics-port): only then does an engine keep Prometheus
    series of its own (`LLMEngine.metrics_collectors`), which may cost it work every step
    (vLLM's stat logger: benchmarks/bench_vllm_stat_logger.py)."""
    http_port: int = 8080
    """dynamo-run hands python engine files its --http-port among their arguments."""
    engine_argv: list[str] = field(default_factory=list)
    """Arguments after `--` on the command line, for the engine's own parser."""
    explicit: set[str] = field(default_factory=set)
    """Flags given explicitly (so an engine can tell "given" from "left at its default")."""

    def check(self, given: set[str], spell: Spell) -> None:
        if self.node_rank >= self.num_nodes:
            raise SettingError(
                f"{spell('node_rank')} {self.node_rank} must be below {spell('num_nodes')} {self.num_nodes}"
            )
        if self.num_nodes > 1 and not self.leader_addr:
            raise SettingError(f"{spell('num_nodes')} > 1 needs {spell('leader_addr')} HOST:PORT")
        if self.extra_engine_args is not None:
            read_engine_args_file(self.extra_engine_args)  # fail now, with the file named, not after loading

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


@dataclass
class WorkerSettings:
    """How a worker serves its engine (besides the engine itself)."""

    migration_limit: int = setting(0, flag="--migration-limit", ge=0, in_graph=False)
    """Times a request may move to another worker when its worker fails mid-stream (a frontend
    given it overrides what the workers' cards say)."""
    static_worker: bool = setting(False, flag="--static-worker", in_graph=False)
    """Serve without discovery, at DYN_TCP_PORT, for a static frontend."""
    max_inflight: int = setting(1024, flag="--max-inflight", ge=0, in_graph=False)
    """Requests in flight; more are answered overloaded (503, and the frontend tries another
    instance); 0: unlimited."""
    is_prefill_worker: bool = setting(False, flag="--is-prefill-worker", in_graph=False)
    """Deprecated: --disaggregation-mode prefill."""
    is_decode_worker: bool = setting(False, flag="--is-decode-worker", in_graph=False)
    """Deprecated: --disaggregation-mode decode."""
    dyn_tool_call_parser: str | None = setting(None, flag="--dyn-tool-call-parser", in_graph=False)
    """Tool calls in the model's output: hermes | llama3_json | mistral | pythonic | deepseek_v3
    (the card carries it to frontends)."""
    dyn_reasoning_parser: str | None = setting(None, flag="--dyn-reasoning-parser", in_graph=False)
    """The model's thinking -> reasoning_content: deepseek_r1 | qwen3."""
    metrics_port: int | None = setting(None, flag="--metrics-port", ge=0, le=65535, in_graph=False)
    """Serve `GET /metrics` (the worker's requests and its engine's own series) on this port;
    0: a free one; none: not served. Dynamo's workers do the same on DYN_SYSTEM_PORT."""
    metrics_host: str = setting("127.0.0.1", flag="--metrics-host", in_graph=False)
    """The address `/metrics` listens on (a graph gives workers on other hosts their host's)."""

    def check(self, given: set[str], spell: Spell) -> None:
        from dynamo_graph.llm.reasoning import REASONING_PARSERS
        from dynamo_graph.llm.tool_calls import TOOL_CALL_PARSERS

        for name, value, valid in (
            ("dyn_tool_call_parser", self.dyn_tool_call_parser, TOOL_CALL_PARSERS),
            ("dyn_reasoning_parser", self.dyn_reasoning_parser, REASONING_PARSERS),
        ):
            if value is not None and value not in valid:
                raise SettingError(
                    f"{spell(name)}: unknown parser {value!r}; valid names: {', '.join(valid)}"
                )
        if self.is_prefill_worker and self.is_decode_worker:
            raise SettingError(
                f"{spell('is_prefill_worker')} and {spell('is_decode_worker')}: a worker is one or the other"
            )


def resolve_disaggregation_mode(engine: EngineSettings, worker: WorkerSettings, spell: Spell) -> None:
    """--disaggregation-mode, or the deprecated --is-prefill-worker / --is-decode-worker (with a
    warning); given both ways, they must agree."""
    import logging

    for name, mode, given in (
        ("is_prefill_worker", "prefill", worker.is_prefill_worker),
        ("is_decode_worker", "decode", worker.is_decode_worker),
    ):
        if not given:
            continue
        logging.getLogger(__name__).warning(
            "%s is deprecated: use %s %s", spell(name), spell("disaggregation_mode"), mode
        )
        if "disaggregation_mode" in engine.explicit and engine.disaggregation_mode != mode:
            raise SettingError(
                f"{spell(name)} conflicts with {spell('disaggregation_mode')} {engine.disaggregation_mode}"
            )
        engine.disaggregation_mode = mode  # type: ignore[assignment]
