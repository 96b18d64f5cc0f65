"""SGLang's `ServerArgs` from dyngraph's flags and `--extra-engine-args`, and a request's
sampling_params dict (the mapping tables: docs/engines/sglang.md)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from dynamo_graph.backend.protocol import PreprocessedRequest
from dynamo_graph.backend.settings import EngineSettings, RunConfigError
from dynamo_graph.engines.engine_args import import_engine_package, refuse_flag_conflicts, refuse_unknown_keys
from dynamo_graph.engines.registry import ENGINES
from dynamo_graph.engines.sampling import guided, max_new_tokens, refuse_several_choices, stop_token_ids

if TYPE_CHECKING:
    from dynamo_graph.llm.model_source import LocalModel

INSTALL_HINT = (
    f"out=sglang needs SGLang: {ENGINES['sglang'].install} "
    "(on a CUDA machine; SGLang's wheels need a CUDA build of torch and GPU kernels)"
)
SOURCE = "--extra-engine-args"
DEFAULT_PAGE_SIZE = 16  # dynamo-run's default --kv-block-size for sglang
# ServerArgs fields that make async_generate stream disjoint (incremental) output_ids, newest first.
STREAMING_FIELDS = ("incremental_streaming_output", "stream_output")
# SamplingOptions passed to SGLang under the same name.
_PASSED_THROUGH = (
    "temperature",
    "top_p",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
)


class SglangError(RunConfigError):
    """SGLang missing, a bad flag or `--extra-engine-args` key, or an engine that fails to start."""


def import_sglang() -> Any:
    return import_engine_package("sglang", INSTALL_HINT, SglangError)


# ---- settings ----------------------------------------------------------------------------------


def server_args_from_settings(cfg: EngineSettings, model: LocalModel | None) -> dict[str, Any]:
    """The keyword arguments `sglang.Engine(**kwargs)` receives (ServerArgs fields)."""
    if model is None:
        raise SglangError("out=sglang needs a model: pass --model-path DIR (an HF folder) or org/name")
    model_path = model.root if model.config_json is not None or model.gguf_path is None else model.gguf_path
    kwargs: dict[str, Any] = {
        "model_path": str(model_path),
        "skip_tokenizer_init": True,
        "tp_size": cfg.tensor_parallel_size,
        "base_gpu_id": cfg.base_gpu_id,
        "page_size": cfg.kv_cache_block_size or DEFAULT_PAGE_SIZE,
    }
    # flag attribute -> (flag name, ServerArgs field); flags given explicitly win over nothing,
    # and a contradicting key in --extra-engine-args is an error.
    flags = {
        "tensor_parallel_size": ("--tensor-parallel-size", "tp_size"),
        "base_gpu_id": ("--base-gpu-id", "base_gpu_id"),
        "kv_cache_block_size": ("--kv-cache-block-size", "page_size"),
        "context_length": ("--context-length", "context_length"),
        "num_nodes": ("--num-nodes", "nnodes"),
        "node_rank": ("--node-rank", "node_rank"),
        "leader_addr": ("--leader-addr", "dist_init_addr"),
        "disaggregation_bootstrap_port": ("--disaggregation-bootstrap-port", "disaggregation_bootstrap_port"),
    }
    if cfg.context_length is not None:
        kwargs["context_length"] = cfg.context_length
    if cfg.disaggregation_bootstrap_port is not None:
        kwargs["disaggregation_bootstrap_port"] = cfg.disaggregation_bootstrap_port
    if cfg.num_nodes > 1 or cfg.leader_addr:
        kwargs["nnodes"] = cfg.num_nodes
        kwargs["node_rank"] = cfg.node_rank
        if cfg.leader_addr:
            kwargs["dist_init_addr"] = cfg.leader_addr
    extra = cfg.engine_args()
    refuse_flag_conflicts(cfg, flags, kwargs, extra, SglangError)
    mode, theirs = cfg.disaggregation_mode, extra.get("disaggregation_mode")
    if theirs not in (None, "null", mode):
        raise SglangError(
            f"--disaggregation-mode {mode} conflicts with disaggregation_mode={theirs!r} in {SOURCE}; "
            "give one"
        )
    if mode != "agg":
        if not extra.get("disaggregation_transfer_backend"):
            raise SglangError(
                f"--disaggregation-mode {mode}: SGLang moves the KV cache with its transfer backend; add "
                f"disaggregation_transfer_backend to {SOURCE} (a graph's engine_args), e.g. nixl or mooncake"
            )
        kwargs["disaggregation_mode"] = mode
    if mode == "prefill" and os.environ.get("SGLANG_HOST_IP") and "host" not in extra:
        kwargs["host"] = os.environ["SGLANG_HOST_IP"]  # its bootstrap server listens where it is advertised
    kv_config = extra.get("kv_events_config")
    if isinstance(kv_config, Mapping):  # ServerArgs takes it as a JSON string
        extra = {**extra, "kv_events_config": json.dumps(dict(kv_config))}
    elif kv_config is not None and not isinstance(kv_config, str):
        raise SglangError(f"{SOURCE}: kv_events_config must be a JSON object or string, not {kv_config!r}")
    kwargs.update(extra)
    return kwargs


def check_server_args(kwargs: Mapping[str, Any], fields: Iterable[str]) -> None:
    """Refuse keys that are not ServerArgs fields, naming the closest and all valid ones."""
    refuse_unknown_keys(kwargs, fields, what="SGLang ServerArgs", noun="field", error=SglangError)


def enable_incremental_output(kwargs: dict[str, Any], fields: Iterable[str] | None) -> bool:
    """Ask for disjoint output_ids where the installed SGLang can (unless the user chose), and say
    whether the stream will be incremental."""
    for name in STREAMING_FIELDS:
        if name in kwargs:
            return bool(kwargs[name])
    names = set(fields or ())
    for name in STREAMING_FIELDS:
        if name in names:
            kwargs[name] = True
            return True
    return False  # an SGLang without either setting streams cumulative ids


# guided kinds -> SGLang's sampling_params keys
_GUIDED_KEYS = {"json": "json_schema", "regex": "regex", "grammar": "ebnf"}


def sampling_params(request: PreprocessedRequest, *, context_length: int | None = None) -> dict[str, Any]:
    """SGLang's sampling_params dict for one request (docs/engines/sglang.md has the mapping)."""
    refuse_several_choices(request, "sglang")
    sc, so = request.stop_conditions, request.sampling_options
    params: dict[str, Any] = {}
    max_new = max_new_tokens(request, context_length)
    if max_new is not None:
        params["max_new_tokens"] = max_new
    if sc.min_tokens:
        params["min_new_tokens"] = sc.min_tokens
    for key in _PASSED_THROUGH:
        value = getattr(so, key)
        if value is not None:
            params[key] = value
    if so.top_k is not None:
        params["top_k"] = so.top_k if so.top_k > 0 else -1
    if so.seed is not None:
        params["sampling_seed"] = so.seed
    if so.logit_bias:
        params["logit_bias"] = dict(so.logit_bias)
    if sc.ignore_eos:
        params["ignore_eos"] = True
    stop_ids = stop_token_ids(request)
    if stop_ids:
        params["stop_token_ids"] = sorted(stop_ids)
    spec = guided(so)
    if spec is not None:
        value = spec.value
        params[_GUIDED_KEYS[spec.kind]] = (
            value if spec.kind != "json" or isinstance(value, str) else json.dumps(value)
        )
    return params
