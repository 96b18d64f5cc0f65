"""TensorRT-LLM's `LLM(**kwargs)` from dyngraph's flags and `--extra-engine-args`, its
DisaggregatedParams as JSON, and a request's SamplingParams (the tables: docs/engines/trtllm.md)."""

from __future__ import annotations

import base64
import copy
import dataclasses
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from dynamo_graph.backend.errors import InvalidArgument
from dynamo_graph.backend.protocol import PreprocessedRequest
from dynamo_graph.backend.settings import EngineSettings, RunConfigError
from dynamo_graph.engines.engine_args import import_engine_package, refuse_flag_conflicts, refuse_unknown_keys
from dynamo_graph.engines.registry import ENGINES
from dynamo_graph.engines.sampling import guided, max_new_tokens, refuse_several_choices

if TYPE_CHECKING:
    from dynamo_graph.llm.model_source import LocalModel

INSTALL_HINT = (
    f"out=trtllm needs TensorRT-LLM: {ENGINES['trtllm'].install} "
    "(on a CUDA machine that can reach https://pypi.nvidia.com, where the real wheel lives)"
)
SOURCE = "--extra-engine-args"
DEFAULT_TOKENS_PER_BLOCK = 32  # TensorRT-LLM's KvCacheConfig default


class TrtllmError(RunConfigError):
    """TensorRT-LLM missing, a bad flag or `--extra-engine-args`, or an engine that fails to start."""


def import_tensorrt_llm() -> Any:
    return import_engine_package("tensorrt_llm", INSTALL_HINT, TrtllmError)


def deep_merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """`extra` over `base`; nested mappings merge key by key (as Dynamo's deep_update)."""
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            deep_merge(base[key], value)
        else:
            base[key] = copy.deepcopy(value)
    return base


def visible_devices(base_gpu_id: int, count: int, current: str | None) -> str | None:
    """CUDA_VISIBLE_DEVICES for `count` GPUs from `base_gpu_id` (None: leave it as it is)."""
    if base_gpu_id == 0:
        return None
    if current is not None and current.strip():
        ids = [d.strip() for d in current.split(",") if d.strip()]
        chosen = ids[base_gpu_id : base_gpu_id + count]
        if len(chosen) < count:
            raise TrtllmError(
                f"--base-gpu-id {base_gpu_id} with {count} GPU(s) needs more devices than "
                f"CUDA_VISIBLE_DEVICES={current} lists"
            )
        return ",".join(chosen)
    return ",".join(str(i) for i in range(base_gpu_id, base_gpu_id + count))


def llm_args_from_settings(cfg: EngineSettings, model: LocalModel | None) -> dict[str, Any]:
    """The keyword arguments `tensorrt_llm.LLM(**kwargs)` receives."""
    if model is None:
        raise TrtllmError("out=trtllm needs a model: pass --model-path DIR (an HF folder) or org/name")
    if model.config_json is None and model.gguf_path is not None:
        raise TrtllmError(
            f"out=trtllm cannot load a GGUF model ({model.gguf_path}); pass the HF folder (config.json + "
            "safetensors)"
        )
    if cfg.num_nodes > 1 or cfg.leader_addr:
        raise TrtllmError(
            "out=trtllm: TensorRT-LLM spans nodes as one MPI job, not through a leader address; launch "
            "every rank with `mpirun -n <world size> trtllm-llmapi-launch dyngraph run ...` (what a "
            "graph's `nodes` compiles to: one `srun --mpi=pmix` step with `up --target slurm`) and set "
            "tensor_parallel_size / pipeline_parallel_size (in --extra-engine-args) to the whole job's "
            "size instead of --num-nodes / --node-rank / --leader-addr"
        )
    kwargs: dict[str, Any] = {
        "model": str(model.root),
        "backend": "pytorch",
        "tensor_parallel_size": cfg.tensor_parallel_size,
        "kv_cache_config": {"tokens_per_block": cfg.kv_cache_block_size or DEFAULT_TOKENS_PER_BLOCK},
    }
    if cfg.context_length is not None:
        kwargs["max_seq_len"] = cfg.context_length
    extra = cfg.engine_args()  # YAML for a .yaml/.yml file, as Dynamo's trtllm users write
    kv_extra = extra.get("kv_cache_config")
    if kv_extra is not None and not isinstance(kv_extra, Mapping):
        raise TrtllmError(f"{SOURCE}: kv_cache_config must be a mapping, not {kv_extra!r}")
    # The flags' values as LLM kwargs (a nested key by its dotted path), against the extra ones.
    flags = {
        "tensor_parallel_size": ("--tensor-parallel-size", "tensor_parallel_size"),
        "context_length": ("--context-length", "max_seq_len"),
        "kv_cache_block_size": ("--kv-cache-block-size", "kv_cache_config.tokens_per_block"),
    }
    ours = {key: getattr(cfg, attr) for attr, (_, key) in flags.items()}
    theirs = {
        "tensor_parallel_size": extra.get("tensor_parallel_size"),
        "max_seq_len": extra.get("max_seq_len"),
        "kv_cache_config.tokens_per_block": (kv_extra or {}).get("tokens_per_block"),
    }
    theirs = {key: value for key, value in theirs.items() if value is not None}
    refuse_flag_conflicts(cfg, flags, ours, theirs, TrtllmError)
    merged = deep_merge(kwargs, extra)
    if cfg.disaggregation_mode != "agg" and not merged.get("cache_transceiver_config"):
        raise TrtllmError(
            f"--disaggregation-mode {cfg.disaggregation_mode}: TensorRT-LLM hands KV over with its cache "
            f"transceiver; add cache_transceiver_config to {SOURCE} (a graph's engine_args), e.g. "
            "{backend: DEFAULT}"
        )
    return merged


def transceiver_backend(config: Any) -> str | None:
    """The backend of a cache_transceiver_config (a mapping or TensorRT-LLM's object); None: none."""
    if not config:
        return None
    backend = config.get("backend") if isinstance(config, Mapping) else getattr(config, "backend", None)
    return str(getattr(backend, "value", backend) or "DEFAULT")


def disaggregated_fields(params: Any) -> dict[str, Any]:
    """TensorRT-LLM's DisaggregatedParams as JSON-able fields (bytes in {"base64": ...}), without
    request_type and unset ones, whatever fields the installed release has."""
    if dataclasses.is_dataclass(params) and not isinstance(params, type):
        fields = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    elif isinstance(params, Mapping):
        fields = dict(params)
    else:
        fields = dict(vars(params))
    out: dict[str, Any] = {}
    for key, value in fields.items():
        if value is None or key == "request_type":
            continue
        if isinstance(value, (bytes, bytearray)):
            value = {"base64": base64.b64encode(bytes(value)).decode()}
        out[key] = value
    return out


def disaggregated_kwargs(fields: Mapping[str, Any]) -> dict[str, Any]:
    """`disaggregated_fields` back into DisaggregatedParams keyword arguments."""
    return {
        key: base64.b64decode(value["base64"])
        if isinstance(value, Mapping) and set(value) == {"base64"}
        else value
        for key, value in fields.items()
    }


def check_llm_args(kwargs: Mapping[str, Any], names: Iterable[str]) -> None:
    """Refuse keys that are not LLM arguments, naming the closest and all valid ones."""
    refuse_unknown_keys(kwargs, names, what="TensorRT-LLM LLM", noun="argument", error=TrtllmError)


def sampling_kwargs(request: PreprocessedRequest, *, context_length: int | None = None) -> dict[str, Any]:
    """SamplingParams keyword arguments for one request (docs/engines/trtllm.md has the mapping)."""
    refuse_several_choices(request, "trtllm")
    sc, so = request.stop_conditions, request.sampling_options
    if so.logit_bias:
        raise InvalidArgument("logit_bias is not supported by out=trtllm", param="logit_bias")
    kw: dict[str, Any] = {"detokenize": False}
    max_tokens = max_new_tokens(request, context_length)
    if max_tokens is not None:
        kw["max_tokens"] = max_tokens
    if sc.min_tokens:
        kw["min_tokens"] = sc.min_tokens
    if so.temperature is not None and so.temperature <= 0.0:
        kw["top_k"] = 1  # greedy; TensorRT-LLM wants temperature > 0
    else:
        if so.temperature is not None:
            kw["temperature"] = so.temperature
        if so.top_k is not None and so.top_k > 0:
            kw["top_k"] = so.top_k
        if so.top_p is not None:
            kw["top_p"] = so.top_p
        if so.min_p is not None:
            kw["min_p"] = so.min_p
    for key in ("repetition_penalty", "presence_penalty", "frequency_penalty", "seed"):
        value = getattr(so, key)
        if value is not None:
            kw[key] = value
    eos = list(dict.fromkeys([*request.eos_token_ids, *(sc.stop_token_ids_hidden or ())]))
    if eos:
        kw["end_id"] = eos[0]
    stop_ids = list(dict.fromkeys(sc.stop_token_ids or ()))
    if sc.ignore_eos:
        kw["ignore_eos"] = True
    else:
        stop_ids += [t for t in eos[1:] if t not in stop_ids]
    if stop_ids:
        kw["stop_token_ids"] = stop_ids
    spec = guided(so)
    if spec is not None:  # GuidedDecodingParams(json= / regex= / grammar=)
        kw["guided_decoding"] = {spec.kind: spec.value}
    return kw
