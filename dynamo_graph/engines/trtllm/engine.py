"""`out=trtllm`: TensorRT-LLM's LLM API (`tensorrt_llm.LLM`, PyTorch backend) behind the `LLMEngine`
contract, tokens in/out.

This adapter was not run against the real tensorrt-llm package: TensorRT-LLM cannot be installed
on the CPU-only machines this project is built on (shared/notes/ENGINES.md: PyPI holds only a stub
that downloads the real wheel from NVIDIA's index, and the wheel needs a GPU at import). It is
written against TensorRT-LLM's documented LLM API (`LLM(model=..., tensor_parallel_size=...,
**kwargs)`, `generate_async(inputs=token_ids, sampling_params=SamplingParams(...),
streaming=True)`, `RequestOutput.outputs[0]` (`CompletionOutput.token_ids`, `finish_reason`),
`RequestOutput.abort()`, `get_kv_cache_events_async()`, `shutdown()`) and checked as Dynamo's own
TensorRT-LLM worker uses it; tests/unit/test_trtllm_adapter.py exercises all of it with the engine
object replaced at that API boundary (`_create_backend`, `_make_sampling_params`, `_llm_arg_names`).

Install: `pip install 'dyngraph[trtllm]'` on a CUDA machine that can reach NVIDIA's package index
(pypi.nvidia.com). The package is imported only when this engine starts; without it the error says
how to install it (a `RunConfigError`).

Flags -> `LLM(**kwargs)`:

| dyngraph flag | LLM kwarg | note |
|---|---|---|
| --model-path | model | an HF folder (GGUF is refused: TensorRT-LLM does not load it) |
| (always) | backend="pytorch" | as Dynamo's worker |
| --tensor-parallel-size | tensor_parallel_size | |
| --context-length | max_seq_len | |
| --kv-cache-block-size | kv_cache_config.tokens_per_block | default 32 (TensorRT-LLM's) |
| --base-gpu-id | CUDA_VISIBLE_DEVICES | no LLM argument: GPUs base .. base+tp*pp-1 are made visible (1) |
| --num-nodes, --node-rank, --leader-addr | - | refused (2) |
| --extra-engine-args | any LLM kwarg | a YAML file, as Dynamo's `--extra-engine-args`; see below |

(1) Counted among the devices already in CUDA_VISIBLE_DEVICES when it is set; the variable is set
before the engine starts its processes, which inherit it (it has no effect on a process that has
already initialised CUDA). (2) A multi-node TensorRT-LLM is one MPI job: launch every rank with
`mpirun ... trtllm-llmapi-launch dyngraph run ...` and give the whole job's tensor / pipeline
parallel sizes; there is no leader address to pass, so these flags are refused with that advice.

`--extra-engine-args` is a YAML (or JSON) mapping of LLM keyword arguments, deep-merged over the
flags the way Dynamo applies it (`update_llm_args_with_extra_options`): nested mappings such as
`kv_cache_config:` are merged key by key, and TensorRT-LLM's pydantic LlmArgs turns them into its
config objects. A key that contradicts a flag given on the command line is an error naming both.
Once the package is importable, top-level keys are checked against `TorchLlmArgs`' fields (an
unknown key is an error listing the valid ones); TensorRT-LLM validates the values.
(Note: `dyngraph run` reads `--extra-engine-args` as JSON while checking flags, so a YAML file
that is not also JSON needs that check to skip out=trtllm.)

Sampling (SamplingOptions / StopConditions -> `SamplingParams`): max_tokens (unset: the context
length minus the prompt when known; TensorRT-LLM's default is 32), temperature (0: greedy, sent as
top_k=1 since TensorRT-LLM wants a positive temperature), top_p, top_k (<= 0: unset, the whole
vocabulary), min_p, repetition_penalty, presence_penalty, frequency_penalty, seed, min_tokens,
ignore_eos; the request's first eos id is `end_id` (so no tokenizer is needed) and the other eos
ids plus the requested stop ids are `stop_token_ids`; guided_json / guided_regex / guided_grammar
/ guided_choice become `GuidedDecodingParams` (the engine needs a `guided_decoding_backend`);
`detokenize=False`. logit_bias is refused (TensorRT-LLM only takes a dense embedding_bias tensor),
as are n / best_of > 1. Stop strings are left to the postprocessor.

Streaming: `generate_async(..., streaming=True)` yields the same `RequestOutput` again and again;
`outputs[0].token_ids` is cumulative (`token_ids_diff` is the part since the previous response).
This adapter slices the cumulative list past what it already sent (it does not rely on
`token_ids_diff`, whose offset TensorRT-LLM resets per response). TensorRT-LLM drops the end id and
trims a matched stop token from `token_ids`, so a stopped stream ends without its stop token.
`RequestOutput.cached_tokens` (newer releases) is sent as `cached_tokens` on the first chunk.

Finish reasons: "stop" -> stop, "length" -> length, "cancelled" -> cancelled, "timeout" -> error
(with a message); finished without a reason -> stop.

Cancellation: a stopped request is aborted with `RequestOutput.abort()` as soon as the context
stops; the stream ends with "cancelled". `cleanup()` aborts what is running, stops the KV event
task, emits `cleared` and calls `LLM.shutdown()`; idempotent and safe before `start()`.

Disaggregated prefill/decode (`prefill`, `generate_from_kv`; kv_transfer only with
`cache_transceiver_config` in `--extra-engine-args`, e.g. `{backend: DEFAULT}` (UCX, NIXL, MPI,
MOONCAKE), TensorRT-LLM's KV cache transceiver; `--disaggregation-mode prefill|decode` without it
is refused naming it; TensorRT-LLM's own examples also set `disable_overlap_scheduler: true` on
context workers). TensorRT-LLM has no engine-wide mode: each request says its part with
`generate_async(..., disaggregated_params=DisaggregatedParams(request_type=...))`:
- prefill: `request_type="context_only"`, max_tokens=1, not streamed (as Dynamo's worker); the
  result's `disaggregated_params` (first_gen_tokens, ctx_request_id, opaque_state, draft_tokens,
  and what newer releases add) become the handoff (JSON, bytes in base64, format
  "trtllm-connector/1:<backend>", with a digest of the prompt; kv_handoff.py).
- decode: `request_type="generation_only"` with those parameters and the prompt alone; TensorRT-LLM
  pulls the KV through its transceiver and its output starts with first_gen_tokens. Our decode
  request is the prompt followed by that first token (the client has it already), so max_tokens is
  one more than the request's and the first output token is not sent again; a request whose token
  after the prompt is not first_gen_tokens[0] is refused (`KvImportError`).
Like the rest of this adapter, this follows TensorRT-LLM's documented API (and Dynamo's worker)
and was not run against the real package.

KV events (publishes_kv_events = True): when the serving process sets `kv_event_sink`,
`kv_cache_config.event_buffer_max_size` is set (1024 unless given, as dynamo-run did) and a task
drains `llm.get_kv_cache_events_async(timeout)`. Event dicts `{"event_id", "data": {"type":
"stored", "parent_hash", "blocks": [{"block_hash", "tokens": [{"token_id"}, ...]}]},
"attention_dp_rank"?}` become `stored` (one `StoredBlock` of TensorRT-LLM's block hash and our
local hash of the block's tokens per full block; a partial block, and later its removal, are
skipped, as Dynamo does); `removed` becomes `removed`; `created` / `updated` are ignored.
`enable_block_reuse: false` turns events off (TensorRT-LLM only reports reusable blocks).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import dataclasses
import logging
import os
import re
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from dynamo_graph.backend.engine import EngineConfig, KvImportError, LLMEngine
from dynamo_graph.backend.errors import EngineError, EngineShutdown, InvalidArgument
from dynamo_graph.backend.kv_transfer import KvHandoff
from dynamo_graph.backend.protocol import CompletionUsage, FinishReason, LLMEngineOutput, PreprocessedRequest
from dynamo_graph.backend.settings import EngineSettings, RunConfigError
from dynamo_graph.engines.engine_args import import_engine_package, refuse_flag_conflicts, refuse_unknown_keys
from dynamo_graph.engines.inflight import ActiveRequest, InFlight, checked_prompt
from dynamo_graph.engines.kv_bridge import U64, KvBlockBridge
from dynamo_graph.engines.kv_handoff import (
    connector_format,
    connector_handoff,
    connector_params,
    first_token_answer,
    first_token_request,
    prompt_request,
    without_known,
)
from dynamo_graph.llm.openai import GUIDED_DECODING, AnyRequest
from dynamo_graph.router.kv.hashing import local_block_hashes
from dynamo_graph.router.kv.protocols import StoredBlock
from dynamo_graph.runtime.context import Context

if TYPE_CHECKING:
    from dynamo_graph.llm.model_source import LocalModel
    from dynamo_graph.router.kv.publisher import KvEventSink

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "out=trtllm needs TensorRT-LLM: pip install 'dyngraph[trtllm]' "
    "(on a CUDA machine that can reach https://pypi.nvidia.com, where the real wheel lives)"
)
SOURCE = "--extra-engine-args"
DEFAULT_TOKENS_PER_BLOCK = 32  # TensorRT-LLM's KvCacheConfig default
DEFAULT_EVENT_BUFFER = 1024  # dynamo-run's trtllm default when publishing KV events
KV_POLL_TIMEOUT_S = 0.5
KV_IDLE_S = 0.05
_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "cancelled": "cancelled"}


class TrtllmError(RunConfigError):
    """TensorRT-LLM missing, a bad flag or `--extra-engine-args`, or an engine that fails to start."""


def import_tensorrt_llm() -> Any:
    return import_engine_package("tensorrt_llm", INSTALL_HINT, TrtllmError)


# ---- settings ----------------------------------------------------------------------------------


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
            "every rank with `mpirun -n <world size> trtllm-llmapi-launch dyngraph run ...` and set "
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
    """SamplingParams keyword arguments for one request (see the module docstring for the mapping)."""
    sc, so = request.stop_conditions, request.sampling_options
    if (so.n or 1) > 1 or (so.best_of or 1) > 1:
        raise InvalidArgument("n > 1 / best_of > 1 is not supported by out=trtllm", param="n")
    if so.logit_bias:
        raise InvalidArgument("logit_bias is not supported by out=trtllm", param="logit_bias")
    kw: dict[str, Any] = {"detokenize": False}
    max_tokens = sc.max_tokens
    if max_tokens is None and context_length:
        max_tokens = max(context_length - len(request.token_ids), 1)
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
    guided: dict[str, Any] | None = None
    if so.guided_json is not None:
        guided = {"json": so.guided_json}
    elif so.guided_regex is not None:
        guided = {"regex": so.guided_regex}
    elif so.guided_grammar is not None:
        guided = {"grammar": so.guided_grammar}
    elif so.guided_choice:
        guided = {"regex": "(" + "|".join(re.escape(c) for c in so.guided_choice) + ")"}
    if guided is not None:
        kw["guided_decoding"] = guided
    return kw


# ---- KV events -----------------------------------------------------------------------------------


def _token_id(token: Any) -> int:
    return int(token["token_id"]) if isinstance(token, Mapping) else int(token)


class TrtllmKvEventBridge(KvBlockBridge):
    """TensorRT-LLM's KV cache event dicts -> our `KvEventSink` (stored / removed per DP rank)."""

    engine = "trtllm"

    def __init__(self, sink: KvEventSink, block_size: int) -> None:
        super().__init__(sink, block_size)

    def handle(self, event: Mapping[str, Any]) -> None:
        rank = int(event.get("attention_dp_rank") or 0)
        data = event.get("data") or {}
        kind = data.get("type")
        if kind == "stored":
            self._stored(data, rank)
        elif kind == "removed":
            self.remove((int(raw) & U64 for raw in data.get("block_hashes") or ()), rank)
        # "created" / "updated" say nothing the router uses

    def _stored(self, data: Mapping[str, Any], rank: int) -> None:
        # Each block carries its own tokens (not one list for the event, as vLLM and SGLang send).
        size = int(self.block_size or 0)
        blocks: list[StoredBlock] = []
        for block in data.get("blocks") or ():
            raw = block.get("block_hash")
            if raw is None:
                continue
            tokens = [_token_id(t) for t in block.get("tokens") or ()]
            if len(tokens) > size:
                log.error("trtllm: a KV block of %d tokens, more than tokens_per_block %d", len(tokens), size)
                return
            if len(tokens) < size:  # a partial block: unknown to the router, as is its removal
                self.mark_partial(int(raw) & U64, rank)
                break
            blocks.append(StoredBlock(int(raw) & U64, local_block_hashes(tokens, size)[0]))
        parent = data.get("parent_hash")
        self.store_blocks(None if parent is None else int(parent) & U64, blocks, rank)


# ---- the engine ----------------------------------------------------------------------------------


class TrtllmEngine(LLMEngine):
    """TensorRT-LLM behind the engine contract; see the module docstring."""

    publishes_kv_events = True

    def __init__(
        self,
        llm_args: Mapping[str, Any],
        *,
        base_gpu_id: int = 0,
        default_context_length: int | None = None,
    ) -> None:
        self.llm_args = copy.deepcopy(dict(llm_args))
        self.base_gpu_id = base_gpu_id
        # TensorRT-LLM's KV cache transceiver: only with one can it run as a prefill or decode worker.
        self.transceiver = transceiver_backend(self.llm_args.get("cache_transceiver_config"))
        self.kv_transfer = self.transceiver is not None
        self.default_context_length = default_context_length
        self.launched_args: dict[str, Any] | None = None
        self.context_length: int | None = None
        self.cuda_visible_devices: str | None = None
        self._backend: Any = None
        self._config: EngineConfig | None = None
        self._bridge: TrtllmKvEventBridge | None = None
        self._kv_task: asyncio.Task[None] | None = None
        self._active = InFlight()
        self._closed = False

    @classmethod
    def from_config(cls, cfg: EngineSettings, model: LocalModel | None) -> TrtllmEngine:
        return cls(
            llm_args_from_settings(cfg, model),
            base_gpu_id=cfg.base_gpu_id,
            default_context_length=model.context_length if model is not None else None,
        )

    # ---- the API boundary (tests replace these) ----------------------------------------------

    def _llm_arg_names(self) -> set[str] | None:
        """The installed TensorRT-LLM's LLM argument names, or None when they cannot be listed."""
        import_tensorrt_llm()
        try:
            from tensorrt_llm.llmapi.llm_args import TorchLlmArgs
        except Exception as err:  # a layout this adapter does not know: TensorRT-LLM validates
            log.debug("trtllm: cannot list LLM arguments: %s", err)
            return None
        return set(TorchLlmArgs.model_fields)

    def _create_backend(self, llm_args: dict[str, Any]) -> Any:
        """`tensorrt_llm.LLM(**llm_args)`: loads the model and starts the executor workers."""
        return import_tensorrt_llm().LLM(**llm_args)

    def _make_sampling_params(self, kwargs: dict[str, Any]) -> Any:
        from tensorrt_llm import SamplingParams

        kwargs = dict(kwargs)
        guided = kwargs.pop("guided_decoding", None)
        if guided is not None:
            from tensorrt_llm.sampling_params import GuidedDecodingParams

            kwargs["guided_decoding"] = GuidedDecodingParams(**guided)
        return SamplingParams(**kwargs)

    def _make_disaggregated_params(self, kwargs: dict[str, Any]) -> Any:
        from tensorrt_llm.llmapi import DisaggregatedParams

        return DisaggregatedParams(**kwargs)

    # ---- lifecycle -----------------------------------------------------------------------------

    def _gpu_count(self, kwargs: Mapping[str, Any]) -> int:
        return int(kwargs.get("tensor_parallel_size") or 1) * int(kwargs.get("pipeline_parallel_size") or 1)

    async def start(self, worker_id: int = 0) -> EngineConfig:
        if self._closed:
            raise EngineShutdown("the trtllm engine was shut down")
        if self._config is not None:
            return self._config
        kwargs = copy.deepcopy(self.llm_args)
        names = self._llm_arg_names()
        if names is not None:
            check_llm_args(kwargs, names)
        current = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = visible_devices(self.base_gpu_id, self._gpu_count(kwargs), current)
        if devices is not None:
            # Set before the engine's processes start; they inherit it.
            os.environ["CUDA_VISIBLE_DEVICES"] = devices
            self.cuda_visible_devices = devices
        kv_config = kwargs.setdefault("kv_cache_config", {})
        if not isinstance(kv_config, dict):  # a KvCacheConfig object given programmatically
            kv_config = kv_config.model_dump(exclude_none=True)
            kwargs["kv_cache_config"] = kv_config
        block_size = int(kv_config.get("tokens_per_block") or DEFAULT_TOKENS_PER_BLOCK)
        sink = self.kv_event_sink
        if sink is not None:
            if kv_config.get("enable_block_reuse") is False:
                log.warning("trtllm: enable_block_reuse is false, so TensorRT-LLM reports no KV events")
            else:
                if not kv_config.get("event_buffer_max_size"):
                    kv_config["event_buffer_max_size"] = DEFAULT_EVENT_BUFFER
                self._bridge = TrtllmKvEventBridge(sink, block_size)
        try:
            self._backend = self._create_backend(kwargs)
        except Exception as err:
            self._bridge = None
            if isinstance(err, RunConfigError):
                raise
            raise TrtllmError(f"TensorRT-LLM failed to start: {type(err).__name__}: {err}") from err
        self.launched_args = kwargs
        if self._bridge is not None:
            self._kv_task = asyncio.create_task(self._poll_kv_events(), name="trtllm kv events")
        context = kwargs.get("max_seq_len") or self.default_context_length
        self.context_length = int(context) if context else None
        self._config = EngineConfig(
            model_input="tokens",
            context_length=self.context_length,
            kv_cache_block_size=block_size,
            max_num_seqs=kwargs.get("max_batch_size"),
            max_num_batched_tokens=kwargs.get("max_num_tokens"),
            capabilities=list(GUIDED_DECODING),  # GuidedDecodingParams (above)
        )
        return self._config

    async def _poll_kv_events(self) -> None:
        bridge = self._bridge
        assert bridge is not None
        warned = False
        while self._backend is not None:
            got = 0
            try:
                events = self._backend.get_kv_cache_events_async(timeout=KV_POLL_TIMEOUT_S)
                # An IterationResult stays "done" after a quiet timeout until the next request
                # arrives; re-arm it so this poll waits for events instead.
                mark = getattr(events, "mark_undone", None)
                if callable(mark):
                    mark()
                async for event in events:
                    got += 1
                    try:
                        bridge.handle(event)
                    except Exception as err:
                        log.warning("trtllm: dropping a KV event: %s", err)
            except asyncio.CancelledError:
                raise
            except Exception as err:
                if not warned:
                    warned = True
                    log.warning("trtllm: reading KV events failed: %s", err)
                await asyncio.sleep(1.0)
                continue
            if not got:
                await asyncio.sleep(KV_IDLE_S)

    async def drain(self) -> None:
        await self._active.wait_idle()

    async def cleanup(self) -> None:
        if self._closed:
            return
        self._closed = True
        for active in self._active.values():
            self._abort(active)
        if self._kv_task is not None:
            self._kv_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._kv_task
            self._kv_task = None
        backend, self._backend = self._backend, None
        if backend is not None:
            sink = self.kv_event_sink
            if sink is not None and self._bridge is not None:
                with contextlib.suppress(Exception):
                    sink.cleared(0)
            try:
                backend.shutdown()
            except Exception as err:
                log.warning("trtllm: shutdown failed: %s", err)

    async def abort(self, context: Context) -> None:
        await self._active.abort(context, self._abort)

    def _abort(self, active: ActiveRequest) -> None:
        if active.aborted or active.finished or active.result is None:
            return
        active.aborted = True
        try:
            active.result.abort()
        except Exception as err:
            log.warning("trtllm: aborting a request failed: %s", err)

    # ---- requests ------------------------------------------------------------------------------

    def generate(
        self, request: PreprocessedRequest | AnyRequest, context: Context
    ) -> AsyncIterator[LLMEngineOutput]:
        return self._stream(request, context)

    # ---- disaggregated prefill/decode (see the module docstring) -------------------------------

    @property
    def kv_format(self) -> str:
        return connector_format("trtllm", self.transceiver or "none")

    async def prefill(
        self, request: PreprocessedRequest, context: Context
    ) -> tuple[LLMEngineOutput, KvHandoff | None]:
        """The prompt as a context-only request; the handoff carries its DisaggregatedParams."""
        if not self.kv_transfer:
            raise EngineError("trtllm: a prefill worker needs cache_transceiver_config")
        received: dict[str, Any] = {}
        context_only = self._make_disaggregated_params({"request_type": "context_only"})
        stream = self._stream(first_token_request(request), context, context_only, received)
        answer, goes_on = await first_token_answer(stream, request)
        if not goes_on:
            return answer, None
        params = received.get("disaggregated_params")
        if params is None:
            raise EngineError("trtllm: the context-only request came back without disaggregated_params")
        return answer, connector_handoff(self.kv_format, request.token_ids, disaggregated_fields(params))

    async def generate_from_kv(  # type: ignore[override]
        self, request: PreprocessedRequest, handoff: KvHandoff, context: Context
    ) -> AsyncIterator[LLMEngineOutput]:
        """The prompt as a generation-only request with the prefill's DisaggregatedParams; the
        tokens after the prompt that the client has (the first one) are not sent again."""
        if not self.kv_transfer:
            raise KvImportError("trtllm: this engine has no cache_transceiver_config")
        fields = connector_params(handoff, self.kv_format, request.token_ids)
        if not fields:
            raise KvImportError("trtllm: the handoff holds no DisaggregatedParams")
        known = request.token_ids[handoff.num_tokens :]
        first = list(fields.get("first_gen_tokens") or ())
        if known != first[: len(known)] or len(known) > len(first):
            raise KvImportError("the request's tokens after the prompt are not the prefill's first tokens")
        generation_only = self._make_disaggregated_params(
            {**disaggregated_kwargs(fields), "request_type": "generation_only"}
        )
        prompt_only, known = prompt_request(request, handoff.num_tokens)
        async for out in without_known(self._stream(prompt_only, context, generation_only), known):
            yield out

    async def _stream(
        self,
        request: PreprocessedRequest | AnyRequest,
        context: Context,
        disaggregated: Any = None,
        received: dict[str, Any] | None = None,
    ) -> AsyncIterator[LLMEngineOutput]:
        """A request's stream; with `disaggregated` (DisaggregatedParams) the request is a context-
        only one (not streamed, its params put in `received`) or a generation-only one."""
        prompt = checked_prompt(request, "trtllm", closed=self._closed, started=self._backend is not None)
        assert isinstance(request, PreprocessedRequest)
        try:
            params = self._make_sampling_params(sampling_kwargs(request, context_length=self.context_length))
        except EngineError:
            raise
        except (TypeError, ValueError) as err:  # SamplingParams' own checks
            raise InvalidArgument(f"trtllm refused the sampling parameters: {err}") from None
        if context.is_stopped():
            yield LLMEngineOutput(finish_reason="cancelled", completion_usage=CompletionUsage(len(prompt), 0))
            return
        active = ActiveRequest(context)
        self._active.add(active)
        watcher: asyncio.Future[None] | None = None
        sent = 0
        first = True
        extra: dict[str, Any] = {} if disaggregated is None else {"disaggregated_params": disaggregated}
        try:
            try:
                active.result = self._backend.generate_async(
                    inputs=prompt, sampling_params=params, streaming=received is None, **extra
                )
                watcher = self._active.watch(active, self._abort)
                if context.is_stopped():
                    self._abort(active)
                async for res in active.result:
                    outputs = getattr(res, "outputs", None) or []
                    output = outputs[0] if outputs else None
                    ids = list(getattr(output, "token_ids", None) or ())
                    new = ids[sent:] if len(ids) > sent else []
                    sent += len(new)
                    out = LLMEngineOutput(token_ids=new)
                    finish = getattr(output, "finish_reason", None)
                    done = bool(getattr(res, "finished", False)) or finish is not None
                    if first and (new or done):
                        cached = getattr(res, "cached_tokens", None)
                        if cached is not None:
                            out.cached_tokens = min(int(cached), len(prompt))
                        first = False
                    if done or context.is_stopped():
                        if received is not None:
                            got = getattr(output, "disaggregated_params", None)
                            received["disaggregated_params"] = got or getattr(
                                res, "disaggregated_params", None
                            )
                        active.finished = True
                        out.finish_reason = self._finish(active, finish)
                        if finish == "timeout" and out.finish_reason == "error":
                            out.error = "TensorRT-LLM timed the request out"
                        out.completion_usage = CompletionUsage(
                            prompt_tokens=len(prompt), completion_tokens=sent, cached_tokens=out.cached_tokens
                        )
                        yield out
                        return
                    if new:
                        yield out
            except EngineError:
                raise
            except ValueError as err:  # the executor's checks of the request (e.g. too long)
                raise InvalidArgument(f"trtllm refused the request: {err}") from None
            except Exception as err:
                raise EngineError(f"trtllm failed: {type(err).__name__}: {err}") from err
            active.finished = True
            reason: FinishReason = "cancelled" if (context.is_stopped() or active.aborted) else "stop"
            yield LLMEngineOutput(finish_reason=reason, completion_usage=CompletionUsage(len(prompt), sent))
        finally:
            if watcher is not None:
                watcher.cancel()
            if not active.finished:  # our consumer went away: free the engine's slot
                self._abort(active)
            self._active.remove(active)

    def _finish(self, active: ActiveRequest, finish: Any) -> FinishReason:
        if active.context.is_stopped() or active.aborted:
            return "cancelled"
        if finish is None:
            return "stop"
        reason = _FINISH.get(str(finish))
        if reason is not None:
            return reason
        if str(finish) != "timeout":
            log.warning("trtllm: unknown finish reason %r, reporting an error", finish)
        return "error"
